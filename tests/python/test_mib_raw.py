"""Merlin raw (``R64``) frames through ``io.load`` (issue 21 item 1): 1-, 6-, 12- and 24-bit
counters, one chip and a 2×2 quad.

The files are written here from the documented layout (docs/formats.md §7.8): rows of
big-endian 64-bit words whose lanes, from the least significant end, are consecutive pixels; a
quad's raw row is four chip rows ``[4 | 3 | 2 | 1]`` with chips 3 and 4 turned by 180°; 24-bit
is two 12-bit frames, high bits first. LiberTEM's Merlin reader (0.16) read every layout written
by ``write_raw_mib`` as the array written (24-bit one frame at a time: LiberTEM reads no more);
``python tests/python/test_mib_raw.py --libertem`` in a LiberTEM environment re-runs that check.
The word rule is also pinned by hand-made bytes below.
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
    """The stored rows: for a quad, each raw row is [4 | 3 | 2 | 1] of the assembled frame."""
    if not quad:
        return frame
    h, w = frame.shape[0] // 2, frame.shape[1] // 2
    turned = [q[::-1, ::-1] for q in (frame[h:, w:], frame[h:, :w])]  # chips 4, 3
    return np.concatenate([*turned, frame[:h, w:], frame[:h, :w]], axis=1)


def write_raw_mib(path, frames: np.ndarray, bits: int, quad: bool = False) -> None:
    """``frames`` (N, rows, cols) of assembled counts as an R64 file."""
    n, rows, cols = frames.shape
    header_bytes = 768 if quad else 384
    raw_rows = rows // 2 if quad else rows
    raw_cols = cols * 2 if quad else cols
    if bits == 24:
        raw_cols *= 2  # the header's width counts both 12-bit halves
    layout = "2x2" if quad else "1x1"
    with open(path, "wb") as f:
        for i, frame in enumerate(frames):
            h = (
                f"MQ1,{i + 1:06d},{header_bytes:05d},{4 if quad else 1:02d},{raw_cols:04d},"
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


CASES = [(1, False), (6, False), (12, False), (24, False), (1, True), (6, True), (12, True)]
IDS = [f"{b}bit-{'quad' if q else 'single'}" for b, q in CASES]


def _backend():  # pragma: no cover
    from libertem.io.dataset.base import BufferedBackend

    return BufferedBackend()


def _libertem_check(tmp: str) -> None:  # pragma: no cover - run by hand in a LiberTEM env
    import pathlib

    import libertem.api as lt

    ctx = lt.Context.make_with("inline")
    for bits, quad in CASES:
        det = 128 if quad else 64
        # LiberTEM 0.16 reads 24-bit raw one frame at a time only (more frames: IndexError).
        nav = (1, 1) if bits == 24 else (2, 3)
        data = _counts((*nav, det, det), bits)
        p = pathlib.Path(tmp) / f"r{bits}{'q' if quad else 's'}.mib"
        write_raw_mib(p, data.reshape(-1, det, det), bits, quad)
        try:
            ds = ctx.load("mib", path=str(p), nav_shape=nav, io_backend=_backend())
            got = ctx.run_udf(dataset=ds, udf=_PickAll())["frames"].data
            ok = np.array_equal(got.reshape(data.shape), data)
        except Exception as e:  # report and go on to the next layout
            print(f"{bits:2d}-bit {'quad' if quad else 'single'}: LiberTEM failed: {e!r}")
            continue
        print(f"{bits:2d}-bit {'quad  ' if quad else 'single'}: {'same' if ok else 'DIFFERENT'}")


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
@pytest.mark.parametrize("bits,quad", CASES, ids=IDS)
def test_raw_mib_loads_byte_exact(tmp_path, backend, bits, quad):
    det = 128 if quad else 64
    data = _counts((2, 3, det, det), bits, seed=bits)
    p = tmp_path / "raw.mib"
    write_raw_mib(p, data.reshape(6, det, det), bits, quad)
    with io.load(p, backend=backend, scan_shape=(2, 3), representation="dense") as ds:
        got = ds.to_numpy()
        assert ds.metadata["bit_depth_image"] == bits
    assert got.dtype == data.dtype
    np.testing.assert_array_equal(got, data)


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
    data = _counts((4, 64, 64), 12)
    p = tmp_path / "cut.mib"
    write_raw_mib(p, data, 12)
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(qg.SourceError, match="whole number of frames") as e:
        io.load(p, backend="cpu", scan_shape=(2, 2))
    assert "3 whole frames" in str(e.value)
    q = tmp_path / "quad24.mib"
    write_raw_mib(q, _counts((1, 128, 128), 24), 24, quad=True)
    with pytest.raises(qg.SourceError, match="chip arrangement is not read"):
        io.load(q, backend="cpu", scan_shape=(1, 1))
    odd = tmp_path / "odd.mib"
    write_raw_mib(odd, np.zeros((1, 4, 64), np.uint8), 1)
    raw = bytearray(odd.read_bytes())
    raw[:384] = raw[:384].replace(b"0064,0004", b"0032,0008")
    odd.write_bytes(bytes(raw))
    with pytest.raises(qg.SourceError, match="whole 64-bit words"):
        io.load(odd, backend="cpu", scan_shape=(1, 1))
