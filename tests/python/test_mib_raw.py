"""Merlin raw (``R64``) frames through ``io.load`` (issue 21 item 1): 1-, 6-, 12- and 24-bit
counters, one chip and a 2×2 quad.

The files are written here from the documented layout (docs/formats.md §7.8): rows of
big-endian 64-bit words whose lanes, from the least significant end, are consecutive pixels; a
quad's raw row is four chip rows ``[4 | 3 | 2 | 1]`` with chips 3 and 4 turned by 180°; 24-bit
is two 12-bit frames, high bits first (a 24-bit quad: two whole 12-bit quad frames, the header's
width counting both). LiberTEM's Merlin reader (0.16) reads every single-chip and 1/6/12-bit quad
file written by ``write_raw_mib`` as the array written (24-bit one frame at a time: LiberTEM
reads no more); it parses the 24-bit quad header as written here but does not decode 24-bit
quads ("not implemented"), so that layout rests on the two rules composed. Chips in a row
(``Nx1``) are refused in raw mode: LiberTEM 0.16 refuses every layout but 1x1 and 2x2, and no
source we could read gives their raw chip order. ``python tests/python/test_mib_raw.py
--libertem`` in a LiberTEM environment re-runs the comparison for every layout here. The word
rule is also pinned by hand-made bytes below.
"""

from __future__ import annotations

import sys

import numpy as np

WIDTH = {1: 1, 6: 8, 12: 16}


def _words(rows: np.ndarray, bits: int) -> bytes:
    """Rows of counts (≤ 12-bit) as big-endian 64-bit words, lane j = pixel w·lanes + j."""
    width = WIDTH[bits]
    lanes = 64 // width
    r = rows.astype(np.uint64).reshape(rows.shape[0], -1, lanes)
    shifts = (np.arange(lanes, dtype=np.uint64) * np.uint64(width)).reshape(1, 1, -1)
    return (r << shifts).sum(axis=2, dtype=np.uint64).astype(">u8").tobytes()


def _raw_rows(frame: np.ndarray, quad: bool) -> np.ndarray:
    """The stored rows: for a quad, each raw row is [4 | 3 | 2 | 1] of the assembled frame;
    one chip or chips in a row are stored as assembled."""
    if not quad:
        return frame
    h, w = frame.shape[0] // 2, frame.shape[1] // 2
    turned = [q[::-1, ::-1] for q in (frame[h:, w:], frame[h:, :w])]  # chips 4, 3
    return np.concatenate([*turned, frame[:h, w:], frame[:h, :w]], axis=1)


def write_raw_mib(path, frames: np.ndarray, bits: int, layout: str = "1x1", chips: int = 1):
    """``frames`` (N, rows, cols) of assembled counts as an R64 file; ``layout`` is the header's
    field 7 (``1x1``, ``2x2``, ``Nx1`` or ``<N>x1``) and ``chips`` its chip count (4 for
    ``2x2``)."""
    n, rows, cols = frames.shape
    quad = layout == "2x2"
    if quad:
        chips = 4
    header_bytes = 256 + 128 * chips  # 384 for one chip, 768 for four
    raw_rows = rows // 2 if quad else rows
    raw_cols = cols * 2 if quad else cols
    if bits == 24:
        raw_cols *= 2  # the header's width counts both 12-bit halves
    with open(path, "wb") as f:
        for i, frame in enumerate(frames):
            h = (
                f"MQ1,{i + 1:06d},{header_bytes:05d},{chips:02d},{raw_cols:04d},"
                f"{raw_rows:04d},R64,   {layout},0F,2020-05-18 11:45:59.289618,0.000500,0,0,0,"
                "1.200000E+2,5.110000E+2,0.000000E+0,0.000000E+0,0.000000E+0,0.000000E+0,"
                "0.000000E+0,0.000000E+0,3RX,175,511,000,000,000,000,000,000,125,255,125,125,"
                f"100,100,082,100,087,030,128,004,255,129,128,176,168,511,511,MQ1A,"
                f"2020-05-18T09:45:59.289618178Z,500000ns,{bits},"
            )
            f.write(h.encode().ljust(header_bytes, b"\0"))
            if bits == 24:
                f.write(_words(_raw_rows(frame >> 12, quad), 12))
                f.write(_words(_raw_rows(frame & 0xFFF, quad), 12))
            else:
                f.write(_words(_raw_rows(frame, quad), bits))


def _counts(shape, bits, seed=0):
    hi = {1: 2, 6: 64, 12: 4096, 24: 1 << 24}[bits]
    dtype = {1: np.uint8, 6: np.uint8, 12: np.uint16, 24: np.uint32}[bits]
    return np.random.default_rng(seed).integers(0, hi, size=shape).astype(dtype)


# (bits, layout field, chips); frames are 64 × 64 per chip.
CASES = [(b, "1x1", 1) for b in (1, 6, 12, 24)] + [(b, "2x2", 4) for b in (1, 6, 12, 24)]
IDS = [f"{b}bit-{'quad' if lay == '2x2' else 'single'}" for b, lay, _ in CASES]


def _det(layout, chips):
    """The assembled frame shape of 64 × 64 chips."""
    return {"1x1": (64, 64), "2x2": (128, 128)}.get(layout, (64, 64 * chips))


def _backend():  # pragma: no cover
    from libertem.io.dataset.base import BufferedBackend

    return BufferedBackend()


def _libertem_check(tmp: str) -> None:  # pragma: no cover - run by hand in a LiberTEM env
    import pathlib

    import libertem.api as lt

    ctx = lt.Context.make_with("inline")
    # Chips in a row last: refused by LiberTEM 0.16 as by us (the report says so).
    for bits, layout, chips in CASES + [(12, "Nx1", 4)]:
        det = _det(layout, chips)
        # LiberTEM 0.16 reads 24-bit raw one frame at a time only (more frames: IndexError).
        nav = (1, 1) if bits == 24 else (2, 3)
        data = _counts((*nav, *det), bits)
        # LiberTEM parses the layout's N as a number only ("Nx1": ValueError).
        field = f"{chips}x1" if layout == "Nx1" else layout
        name = f"{bits}-bit {field} {chips} chips"
        p = pathlib.Path(tmp) / f"r{bits}{layout}{chips}.mib"
        write_raw_mib(p, data.reshape(-1, *det), bits, field, chips)
        try:
            ds = ctx.load("mib", path=str(p), nav_shape=nav, io_backend=_backend())
            got = ctx.run_udf(dataset=ds, udf=_PickAll())["frames"].data
            ok = np.array_equal(got.reshape(data.shape), data)
        except Exception as e:  # report and go on to the next layout
            print(f"{name}: LiberTEM failed: {e!r}")
            continue
        print(f"{name}: {'same' if ok else 'DIFFERENT'}")


if __name__ == "__main__" and "--libertem" in sys.argv:  # pragma: no cover
    import tempfile

    from libertem.udf import UDF

    class _PickAll(UDF):
        def get_result_buffers(self):
            sig = self.meta.dataset_shape.sig
            return {"frames": self.buffer(kind="nav", extra_shape=sig, dtype=np.float64)}

        def process_frame(self, frame):
            self.results.frames[:] = frame

    with tempfile.TemporaryDirectory() as t:
        _libertem_check(t)
    sys.exit(0)

import pytest  # noqa: E402

import quantem.gpu as qg  # noqa: E402
from quantem.gpu import device, io  # noqa: E402

BACKENDS = ["cpu"] + (["cuda"] if "cuda" in device.available() else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits,layout,chips", CASES, ids=IDS)
def test_raw_mib_loads_byte_exact(tmp_path, backend, bits, layout, chips):
    det = _det(layout, chips)
    data = _counts((2, 3, *det), bits, seed=bits + chips)
    p = tmp_path / "raw.mib"
    write_raw_mib(p, data.reshape(6, *det), bits, layout, chips)
    with io.load(p, backend=backend, scan_shape=(2, 3), representation="dense") as ds:
        got = ds.to_numpy()
        assert ds.metadata["bit_depth_image"] == bits
    assert got.dtype == data.dtype
    np.testing.assert_array_equal(got, data)


@pytest.mark.parametrize("field", ["Nx1", "Nx1G", "4x1"])
def test_raw_chips_in_a_row_are_refused_by_name(tmp_path, field):
    """Raw ``Nx1`` frames: refused, saying why and that processed modes are read."""
    p = tmp_path / "row.mib"
    write_raw_mib(p, _counts((2, 64, 256), 12), 12, field, 4)
    with pytest.raises(qg.SourceError, match=r"chips in a row \(Nx1\)") as e:
        io.load(p, backend="cpu", scan_shape=(1, 2))
    assert "processed" in str(e.value) and "row.mib" in str(e.value)


def test_raw_words_by_hand(tmp_path):
    """One 64-pixel 1-bit row: bytes 80 00 00 00 00 00 00 03 set pixels 0, 1 and 63."""
    p = tmp_path / "hand.mib"
    write_raw_mib(p, np.zeros((1, 1, 64), np.uint8), 1)
    b = bytearray(p.read_bytes())
    b[384:392] = bytes([0x80, 0, 0, 0, 0, 0, 0, 0x03])
    p.write_bytes(bytes(b))
    with io.load(p, backend="cpu", scan_shape=(1, 1), representation="dense") as ds:
        row = ds.to_numpy().reshape(-1)
    assert np.flatnonzero(row).tolist() == [0, 1, 63]


def test_raw_mib_errors(tmp_path):
    # Truncated files: a 12-bit single chip and a 24-bit quad, cut inside their last frame.
    for name, frames, bits, layout in [
        ("cut.mib", _counts((4, 64, 64), 12), 12, "1x1"),
        ("quad24.mib", _counts((4, 128, 128), 24), 24, "2x2"),
    ]:
        p = tmp_path / name
        write_raw_mib(p, frames, bits, layout)
        p.write_bytes(p.read_bytes()[:-100])
        with pytest.raises(qg.SourceError, match="whole number of frames") as e:
            io.load(p, backend="cpu", scan_shape=(2, 2))
        assert "3 whole frames" in str(e.value) and name in str(e.value)
    # A partial quad: three chips in a 2x2 layout.
    part = tmp_path / "partial.mib"
    write_raw_mib(part, _counts((1, 128, 128), 12), 12, "2x2")
    raw = bytearray(part.read_bytes())
    raw[:40] = raw[:40].replace(b",04,", b",03,", 1)
    part.write_bytes(bytes(raw))
    with pytest.raises(qg.SourceError, match="chip arrangement is not read"):
        io.load(part, backend="cpu", scan_shape=(1, 1))
    odd = tmp_path / "odd.mib"
    write_raw_mib(odd, np.zeros((1, 4, 64), np.uint8), 1)
    raw = bytearray(odd.read_bytes())
    raw[:384] = raw[:384].replace(b"0064,0004", b"0032,0008")
    odd.write_bytes(bytes(raw))
    with pytest.raises(qg.SourceError, match="whole 64-bit words"):
        io.load(odd, backend="cpu", scan_shape=(1, 1))
