"""Formats besides Dectris master files (issue 21 items 1 and 7), each through ``io.load``.

Files are written by the format's own library where it writes the format (h5py for gzip,
hdf5plugin for Zstd/Blosc, rosettasciio for hyperspy ``.hspy``, emdfile for py4DSTEM's EMD,
numpy for ``.npy`` and raw binaries), then loaded on every backend this machine has and compared
byte for byte with the array written. Malformed files must raise the typed error named.
"""

from __future__ import annotations

import numpy as np
import pytest

import quantem.gpu as qg
from quantem.gpu import device, io

BACKENDS = ["cpu"] + (["cuda"] if "cuda" in device.available() else [])
REPS = ["dense", "encoded"]


def _frames(shape, dtype=np.uint16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.poisson(3.0, size=shape).astype(dtype)


def _check(path, expected, backend, representation, **kw):
    exp4 = expected if expected.ndim == 4 else expected.reshape((-1,) + expected.shape[-2:])
    if representation == "encoded" and exp4.dtype == np.uint32:
        # ENCODED holds counts up to 65535 (u8 counts are coded widened, on both engines).
        with pytest.raises(qg.InvalidArgumentError, match="u16|65535"):
            io.load(path, backend=backend, representation=representation, **kw)
        return
    with io.load(path, backend=backend, representation=representation, **kw) as ds:
        got = ds.to_numpy()
        assert ds.representation is io.DataRepresentation(representation)
    assert got.dtype == exp4.dtype
    np.testing.assert_array_equal(got.reshape(exp4.shape), exp4)


def _h5_write(path, data, name="data", **create):
    """``data`` as dataset ``name`` of a new HDF5 file written by h5py; ``create`` are
    ``create_dataset``'s keywords (chunks, filters)."""
    h5py = pytest.importorskip("h5py")
    with h5py.File(path, "w") as f:
        f.create_dataset(name, data=data, **create)


def _chunk_info(path, index, name="data"):
    """Where chunk ``index`` of dataset ``name`` lies in the file (h5py's ``StoreInfo``:
    ``byte_offset``, ``size``)."""
    h5py = pytest.importorskip("h5py")
    with h5py.File(path, "r") as f:
        return f[name].id.get_chunk_info(index)


# --- HDF5: gzip/deflate (+ shuffle), Zstd, hyperspy, emdfile --------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("representation", REPS)
@pytest.mark.parametrize("shuffle", [False, True], ids=["gzip", "gzip+shuffle"])
def test_h5py_gzip_loads_byte_exact(tmp_path, backend, representation, shuffle):
    data = _frames((5, 6, 12, 10))
    p = tmp_path / "gzip.h5"
    _h5_write(p, data, chunks=(1, 3, 12, 10), compression="gzip", shuffle=shuffle)
    _check(p, data, backend, representation)


@pytest.mark.parametrize("backend", BACKENDS)
def test_h5py_gzip_3d_several_frames_per_chunk(tmp_path, backend):
    data = _frames((30, 9, 7), np.uint32)
    p = tmp_path / "gzip3.h5"
    _h5_write(p, data, "frames", chunks=(4, 9, 7), compression="gzip", fletcher32=True)
    _check(p, data.reshape(5, 6, 9, 7), backend, "dense", scan_shape=(5, 6))


def test_gzip_corrupt_chunk_is_a_decode_error(tmp_path):
    data = _frames((4, 4, 16, 16))
    p = tmp_path / "bad.h5"
    _h5_write(p, data, chunks=(1, 4, 16, 16), compression="gzip")
    info = _chunk_info(p, 1)
    raw = bytearray(p.read_bytes())
    raw[info.byte_offset + 2 : info.byte_offset + info.size] = b"\xff" * (info.size - 2)
    p.write_bytes(bytes(raw))
    with pytest.raises(qg.DecodeError, match="deflate"):
        io.load(p, backend="cpu").to_numpy()


@pytest.mark.parametrize("backend", BACKENDS)
def test_hdf5plugin_zstd_loads_byte_exact(tmp_path, backend):
    hdf5plugin = pytest.importorskip("hdf5plugin")
    data = _frames((3, 4, 16, 12))
    p = tmp_path / "zstd.h5"
    _h5_write(p, data, chunks=(1, 4, 16, 12), **hdf5plugin.Zstd())
    _check(p, data, backend, "dense")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cname", ["blosclz", "lz4", "lz4hc", "zlib", "zstd"])
@pytest.mark.parametrize("shuffle", ["none", "byte", "bit"])
def test_hdf5plugin_blosc_loads_byte_exact(tmp_path, backend, cname, shuffle):
    hdf5plugin = pytest.importorskip("hdf5plugin")
    data = _frames((4, 5, 16, 12))
    p = tmp_path / "blosc.h5"
    mode = {
        "none": hdf5plugin.Blosc.NOSHUFFLE,
        "byte": hdf5plugin.Blosc.SHUFFLE,
        "bit": hdf5plugin.Blosc.BITSHUFFLE,
    }[shuffle]
    _h5_write(p, data, chunks=(1, 5, 16, 12), **hdf5plugin.Blosc(cname=cname, shuffle=mode))
    _check(p, data, backend, "dense")


def test_corrupt_blosc_chunk_is_a_decode_error_naming_the_frame(tmp_path):
    hdf5plugin = pytest.importorskip("hdf5plugin")
    data = _frames((3, 4, 16, 12))
    p = tmp_path / "blosc_bad.h5"
    _h5_write(p, data, chunks=(1, 4, 16, 12), **hdf5plugin.Blosc())
    off = _chunk_info(p, 1).byte_offset
    raw = bytearray(p.read_bytes())
    raw[off + 12 : off + 16] = (10**9).to_bytes(4, "little")  # compressed size past the chunk
    p.write_bytes(bytes(raw))
    with pytest.raises(qg.QuantemError, match="Blosc") as e:
        io.load(p, backend="cpu")
    assert "frame 4" in str(e.value), str(e.value)


def _hspy_write(path, data, **kw):
    hspy = pytest.importorskip("rsciio.hspy")
    names = ["y", "x", "ky", "kx"]
    axes = [
        dict(name=n, size=s, navigate=i < 2, scale=1.0, offset=0.0, units="")
        for i, (n, s) in enumerate(zip(names, data.shape))
    ]
    signal = dict(
        data=data,
        axes=axes,
        metadata={"General": {"title": "scan"}, "Signal": {"signal_type": ""}},
        original_metadata={},
        tmp_parameters={},
        attributes={"_lazy": False},
        learning_results={},
        models={},
        package_info={"name": "hyperspy", "version": "2.0"},
    )
    hspy.file_writer(str(path), signal, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("representation", REPS)
def test_hyperspy_hspy_written_by_rosettasciio(tmp_path, backend, representation):
    data = _frames((5, 6, 12, 10))
    p = tmp_path / "scan.hspy"
    _hspy_write(p, data)
    _check(p, data, backend, representation)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hspy_chunks_of_partial_scan_rows(tmp_path, backend):
    # Chunks of 2 x 4 scan positions of a 5 x 6 scan: edges, and several partial rows per chunk.
    data = _frames((5, 6, 8, 8))
    p = tmp_path / "blocks.hspy"
    _hspy_write(p, data, chunks=(2, 4, 8, 8))
    h5py = pytest.importorskip("h5py")
    with h5py.File(p, "r") as f:
        assert f["Experiments/scan/data"].chunks == (2, 4, 8, 8)
    _check(p, data, backend, "dense")
    with io.load(p, backend=backend, scan_region=(1, 4, 3, 6)) as ds:
        np.testing.assert_array_equal(ds.to_numpy(), data[1:4, 3:6])


@pytest.mark.parametrize("backend", BACKENDS)
def test_py4dstem_emdfile_array(tmp_path, backend):
    emdfile = pytest.importorskip("emdfile")
    data = _frames((4, 5, 10, 9))
    p = tmp_path / "datacube.h5"
    root = emdfile.Root(name="root")
    root.add_to_tree(emdfile.Array(data=data, name="datacube"))
    emdfile.save(str(p), root)
    _check(p, data, backend, "dense")


# --- NumPy, float32, raw ------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("representation", REPS)
@pytest.mark.parametrize("descr", ["<u2", ">u2", "|u1", "<u4"])
def test_npy_paths_load_byte_exact(tmp_path, backend, representation, descr):
    data = _frames((4, 3, 10, 8)).astype(descr)
    if representation == "encoded" and data.dtype.itemsize == 4:
        pytest.skip("ENCODED holds u16 counts; u32 is refused by design")
    p = tmp_path / "scan.npy"
    np.save(p, data)
    _check(p, data.astype(data.dtype.newbyteorder("=")), backend, representation)


def test_inspect_reports_a_npy_file(tmp_path):
    data = _frames((3, 4, 10, 8))
    p = tmp_path / "scan.npy"
    np.save(p, data)
    ins = io.inspect(p)
    assert ins["ready"] is True and ins["source_kind"].lower().startswith("npy"), ins
    assert ins["scan_shape"] == {"rows": 3, "cols": 4}, ins["scan_shape"]
    assert ins["detector_shape"] == {"rows": 10, "cols": 8}, ins["detector_shape"]
    p.write_bytes(p.read_bytes()[:-7])
    ins = io.inspect(p)
    assert ins["ready"] is False and "HDF5" not in ins["reason"], ins


def test_npy_3d_needs_a_scan_shape_or_a_square(tmp_path):
    data = _frames((12, 6, 6))
    p = tmp_path / "frames.npy"
    np.save(p, data)
    with io.load(p, backend="cpu", scan_shape=(3, 4)) as ds:
        np.testing.assert_array_equal(ds.to_numpy(), data.reshape(3, 4, 6, 6))
    with pytest.raises(qg.QuantemError, match="scan shape"):
        io.load(p, backend="cpu")


def test_truncated_npy_is_a_source_error(tmp_path):
    data = _frames((4, 4, 8, 8))
    p = tmp_path / "cut.npy"
    np.save(p, data)
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(qg.SourceError, match="truncated") as e:
        io.load(p, backend="cpu")
    assert "cut.npy" in str(e.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_counts_need_consent_and_round(tmp_path, backend):
    rng = np.random.default_rng(3)
    counts = rng.poisson(2.0, size=(3, 3, 8, 8)).astype(np.uint32)
    noisy = counts.astype(np.float32) * 7.5 + rng.uniform(-3.0, 3.0, counts.shape).astype(
        np.float32
    )
    noisy[0, 0, 0, 0] = -9.0  # rounds below zero: read as 0 and counted
    p = tmp_path / "gain.npy"
    np.save(p, noisy)
    with pytest.raises(qg.InvalidArgumentError, match="float_scale"):
        io.load(p, backend=backend)
    expected = np.maximum(np.round(noisy.astype(np.float64) / 7.5), 0).astype(np.uint32)
    with io.load(p, backend=backend, float_scale=7.5, representation="dense") as ds:
        np.testing.assert_array_equal(ds.to_numpy(), expected)
        assert ds.metadata["extra"]["float_values_read_as_0"] >= 1
    with io.load(p, backend=backend, float_scale=7.5, dtype="u16") as ds:
        np.testing.assert_array_equal(ds.to_numpy(), expected.astype(np.uint16))


def test_float32_nan_is_a_decode_error(tmp_path):
    data = np.ones((2, 2, 4, 4), np.float32)
    data[1, 0, 2, 3] = np.nan
    p = tmp_path / "nan.npy"
    np.save(p, data)
    with pytest.raises(qg.DecodeError, match="not a count"):
        io.load(p, backend="cpu", float_scale=1.0).to_numpy()


def test_float32_hdf5_dataset(tmp_path):
    data = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5) * 2.0
    p = tmp_path / "f32.h5"
    _h5_write(p, data, chunks=(1, 3, 4, 5), compression="gzip")
    with io.load(p, backend="cpu", float_scale=2.0) as ds:
        np.testing.assert_array_equal(ds.to_numpy(), (data / 2).astype(np.uint32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("representation", REPS)
def test_raw_binary_with_headers_and_footers(tmp_path, backend, representation):
    data = _frames((3, 4, 9, 7))
    p = tmp_path / "scan.bin"
    rng = np.random.default_rng(1)
    with open(p, "wb") as f:
        f.write(rng.bytes(64))
        for frame in data.reshape(-1, 9, 7):
            f.write(rng.bytes(16))
            f.write(frame.astype("<u2").tobytes())
            f.write(rng.bytes(8))
    _check(
        p,
        data,
        backend,
        representation,
        format="raw",
        shape=data.shape,
        raw_dtype="uint16",
        file_header_bytes=64,
        frame_header_bytes=16,
        frame_footer_bytes=8,
    )


def test_raw_binary_size_mismatch_is_a_source_error(tmp_path):
    data = _frames((2, 2, 8, 8))
    p = tmp_path / "scan.bin"
    p.write_bytes(data.tobytes()[:-3])
    with pytest.raises(qg.SourceError, match="shorter") as e:
        io.load(p, format="raw", shape=data.shape, raw_dtype="<u2", backend="cpu")
    assert "(3 whole frames)" in str(e.value)
    with pytest.raises(qg.InvalidArgumentError, match="shape"):
        io.load(p, format="raw", backend="cpu")


# --- detection, shards, .qem ------------------------------------------------------------


def test_unknown_file_lists_the_supported_formats(tmp_path):
    p = tmp_path / "notes.dat"
    p.write_bytes(b"hello, this is not an acquisition")
    with pytest.raises(qg.SourceError, match="unrecognised file format") as e:
        io.load(p, backend="cpu")
    for name in ("hdf5", "npy", "raw", "mib", "empad", "dm4", "qem"):
        assert name in str(e.value)


def test_unknown_format_name_is_refused(tmp_path):
    p = tmp_path / "x.npy"
    np.save(p, _frames((1, 1, 4, 4)))
    with pytest.raises(qg.InvalidArgumentError, match="unknown format"):
        io.load(p, format="tiff", backend="cpu")


def test_dectris_shard_points_at_its_master(acquisition):
    shard = sorted(acquisition["master"].parent.glob("*_data_*.h5"))[0]
    with pytest.raises(qg.SourceError, match=r"open the \*_master.h5"):
        io.load(shard, backend="cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_qem_stays_encoded_by_default(acquisition, tmp_path, backend):
    with io.load(acquisition["master"], backend="cpu", dtype="u16") as ds:
        dense = ds.to_numpy()
    enc = io.load(acquisition["master"], backend="cpu", dtype="u16", representation="encoded")
    io.save(enc, tmp_path / "scan.qem")
    enc.close()
    with io.load(tmp_path / "scan.qem", backend=backend) as q:
        assert q.representation is io.DataRepresentation.ENCODED
        np.testing.assert_array_equal(q.to_numpy(), dense)
    with io.load(tmp_path / "scan.qem", backend=backend, representation="dense") as q:
        assert q.representation is io.DataRepresentation.DENSE


# --- Merlin .mib (processed U08/U16/U32 modes) ---------------------------------------------


def _write_mib(path, data, pixel="U16", header_bytes=384, chips=1, layout=None):
    """Frames in the documented Merlin layout: an ASCII header padded to ``header_bytes``, then
    the frame as big-endian unsigned integers (processed modes: the frame already assembled,
    whatever the chip layout)."""
    rows, cols = data.shape[-2:]
    dt = {"U08": ">u1", "U16": ">u2", "U32": ">u4"}[pixel]
    layout = layout or ("2x2" if chips == 4 else "1x1")
    with open(path, "wb") as f:
        for i, frame in enumerate(data.reshape(-1, rows, cols)):
            h = (
                f"MQ1,{i + 1:06d},{header_bytes:05d},{chips:02d},{cols:04d},{rows:04d},{pixel},"
                f"   {layout},0F,2020-05-18 11:45:59.289618,0.000500,0,0,0,1.200000E+2,"
                "5.110000E+2,0.000000E+0,0.000000E+0,0.000000E+0,0.000000E+0,0.000000E+0,"
                "0.000000E+0,3RX,175,511,000,000,000,000,000,000,125,255,125,125,100,100,082,100,"
                "087,030,128,004,255,129,128,176,168,511,511,MQ1A,2020-05-18T09:45:59.289618178Z,"
                "500000ns,12,"
            )
            f.write(h.encode().ljust(header_bytes, b" "))
            f.write(frame.astype(dt).tobytes())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("representation", REPS)
@pytest.mark.parametrize(
    "pixel,chips,det,layout",
    [
        ("U16", 1, (256, 256), "1x1"),
        ("U08", 1, (256, 256), "1x1"),
        ("U32", 4, (512, 512), "2x2"),
        ("U16", 4, (256, 1024), "Nx1"),
    ],
    ids=["u16", "u8", "quad-u32", "row4-u16"],
)
def test_merlin_mib_processed_modes(tmp_path, backend, representation, pixel, chips, det, layout):
    dtype = {"U08": np.uint8, "U16": np.uint16, "U32": np.uint32}[pixel]
    if representation == "encoded" and dtype == np.uint32:
        pytest.skip("ENCODED holds u16 counts; u32 is refused by design")
    data = _frames((2, 3, *det), dtype)
    p = tmp_path / "scan.mib"
    _write_mib(p, data, pixel, 256 + 128 * chips, chips, layout)
    _check(p, data, backend, representation, scan_shape=(2, 3))


@pytest.mark.parametrize(
    "chips,det,layout", [(1, (256, 256), "1x1"), (4, (256, 1024), "Nx1")], ids=["1x1", "Nx1"]
)
def test_merlin_layout_matches_rosettasciio(tmp_path, chips, det, layout):
    """rosettasciio's reader reads the file we write as the same frames (it flips rows: its
    orientation convention; we keep the stored row order); chips in a row included."""
    qd = pytest.importorskip("rsciio.quantumdetector")
    data = _frames((2, 3, *det))
    p = tmp_path / "scan.mib"
    _write_mib(p, data, "U16", 256 + 128 * chips, chips, layout)
    theirs = np.asarray(qd.file_reader(str(p), navigation_shape=(3, 2))[0]["data"]).reshape(
        data.shape
    )
    np.testing.assert_array_equal(theirs[..., ::-1, :], data)
    with io.load(p, backend="cpu", scan_shape=(2, 3)) as ds:
        np.testing.assert_array_equal(ds.to_numpy(), data)


def test_truncated_mib_is_a_source_error(tmp_path):
    data = _frames((2, 2, 256, 256))
    p = tmp_path / "cut.mib"
    _write_mib(p, data)
    p.write_bytes(p.read_bytes()[:-1000])
    with pytest.raises(qg.SourceError, match="whole number of frames") as e:
        io.load(p, backend="cpu", scan_shape=(2, 2))
    assert "3 whole frames" in str(e.value)


def test_mib_with_a_different_last_frame_is_a_source_error(tmp_path):
    p = tmp_path / "mixed.mib"
    _write_mib(p, _frames((1, 2, 256, 256)))
    b = bytearray(p.read_bytes())
    second = 384 + 256 * 256 * 2
    b[second : second + 40] = b"MQ1,000002,00384,01,0256,0256,U08,   1x1"[:40]
    p.write_bytes(bytes(b))
    with pytest.raises(qg.SourceError, match="differs from the first"):
        io.load(p, backend="cpu", scan_shape=(1, 2))


# --- EMPAD (.xml + .raw of float32 128 x 130 frames) ----------------------------------------


def _write_empad(folder, values, name="scan_x3_y2.raw", pix=True):
    """The documented EMPAD layout: little-endian float32 frames of 130 rows x 128 columns, the
    last 2 rows a footer; an .xml naming the raw file and the scan (pix_x columns, pix_y rows)."""
    rows, cols = values.shape[:2]
    frames = np.zeros((rows * cols, 130, 128), "<f4")
    frames[:, :128, :] = values.reshape(-1, 128, 128)
    frames[:, 128:, :] = 12345.0  # footer, must be skipped
    (folder / name).write_bytes(frames.tobytes())
    scan = f"<pix_x>{cols}</pix_x><pix_y>{rows}</pix_y>" if pix else ""
    xml = folder / "acquisition.xml"
    xml.write_text(f'<root><raw_file filename="{name}"/>{scan}</root>')
    return xml


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("via", ["xml", "raw"])
def test_empad_float32_frames(tmp_path, backend, via):
    rng = np.random.default_rng(5)
    counts = rng.poisson(1.5, size=(2, 3, 128, 128)).astype(np.uint32)
    values = (counts * 10.0 + rng.uniform(-4, 4, counts.shape)).astype(np.float32)
    xml = _write_empad(tmp_path, values)
    path = xml if via == "xml" else tmp_path / "scan_x3_y2.raw"
    expected = np.maximum(np.round(values.astype(np.float64) / 10.0), 0).astype(np.uint32)
    with pytest.raises(qg.InvalidArgumentError, match="float_scale"):
        io.load(path, backend=backend)
    with io.load(path, backend=backend, float_scale=10.0, representation="dense") as ds:
        assert ds.shape == (2, 3, 128, 128)
        np.testing.assert_array_equal(ds.to_numpy(), expected)


def test_empad_layout_matches_rosettasciio(tmp_path):
    empad = pytest.importorskip("rsciio.empad")
    values = np.arange(2 * 3 * 128 * 128, dtype=np.float32).reshape(2, 3, 128, 128) % 977
    xml = _write_empad(tmp_path, values, pix=False)  # scan from the raw file's name
    theirs = np.asarray(empad.file_reader(str(xml))[0]["data"])
    np.testing.assert_array_equal(theirs, values)
    with io.load(xml, backend="cpu", float_scale=1.0) as ds:
        np.testing.assert_array_equal(ds.to_numpy(), values.astype(np.uint32))


def test_truncated_empad_is_a_source_error(tmp_path):
    xml = _write_empad(tmp_path, np.zeros((2, 3, 128, 128), np.float32))
    raw = tmp_path / "scan_x3_y2.raw"
    raw.write_bytes(raw.read_bytes()[:-4000])
    with pytest.raises(qg.SourceError, match="truncated") as e:
        io.load(xml, backend="cpu", float_scale=1.0)
    assert "5 whole frames" in str(e.value)


# --- ENCODED u8 on CUDA: the CPU engine's streams (issue 21 item 1) ---------------------------


def _qem_sections(path):
    """``{kind: bytes}`` of a ``.qem`` file's sections (docs/formats.md §6.1-6.2)."""
    import struct

    b = path.read_bytes()
    count, table = struct.unpack_from("<I", b, 16)[0], struct.unpack_from("<Q", b, 24)[0]
    out = {}
    for i in range(count):
        kind, _, at, n = struct.unpack_from("<IIQQ", b, table + 32 * i)
        out[kind] = b[at : at + n]
    return out


def _u8_sources(tmp_path):
    """u8 counts reaching the card by each route: read from the file by the GPU pipeline
    (``.npy``, Merlin U08), decoded on the host and uploaded (raw 6-bit Merlin), a NumPy array,
    and u16 counts narrowed by a saturating ``dtype="u8"``."""
    from test_mib_raw import write_raw_mib

    u8 = _frames((3, 4, 64, 64), np.uint8, seed=11)
    npy = tmp_path / "u8.npy"
    np.save(npy, u8)
    mib = tmp_path / "u8.mib"
    _write_mib(mib, u8, "U08")
    raw6 = tmp_path / "raw6.mib"
    six = np.minimum(u8, 63)
    write_raw_mib(raw6, six.reshape(-1, 64, 64), 6)
    wide = _frames((3, 4, 64, 64), np.uint16, seed=12) * 90  # some values above 255
    wnpy = tmp_path / "wide.npy"
    np.save(wnpy, wide)
    return {
        "npy": (npy, u8, {}),
        "mib-u08": (mib, u8, {"scan_shape": (3, 4)}),
        "raw6-host-decoded": (raw6, six, {"scan_shape": (3, 4)}),
        "array": (u8, u8, {}),
        "saturating": (wnpy, np.minimum(wide, 255).astype(np.uint8), {"dtype": "u8"}),
    }


@pytest.mark.skipif("cuda" not in device.available(), reason="needs the CUDA backend")
@pytest.mark.parametrize("route", ["npy", "mib-u08", "raw6-host-decoded", "array", "saturating"])
def test_cuda_encoded_u8_equals_the_cpu_encoding(tmp_path, route):
    """ENCODED u8 on the card: the same frames, sums and .qem codec bytes (model, index,
    streams) as the CPU engine's ENCODED u8 load of the same source."""
    import json

    from quantem.gpu import detector

    src, want, kw = _u8_sources(tmp_path)[route]
    loaded = {}
    for backend in ("cpu", "cuda"):
        ds = io.load(src, backend=backend, representation="encoded", **kw)
        assert ds.representation is io.DataRepresentation.ENCODED
        got = ds.to_numpy()
        assert got.dtype == np.uint8, backend
        np.testing.assert_array_equal(got, want.reshape(got.shape))
        np.testing.assert_array_equal(ds[2, 3], want.reshape(got.shape)[2, 3])
        np.testing.assert_array_equal(
            detector.sum_dp(ds), want.reshape(got.shape).sum(axis=(0, 1), dtype=np.uint64)
        )
        out = tmp_path / f"{route}-{backend}.qem"
        io.save(ds, str(out))
        loaded[backend] = (_qem_sections(out), ds.provenance)
        ds.close()
    (cpu, cpu_prov), (gpu, gpu_prov) = loaded["cpu"], loaded["cuda"]
    for kind, name in [(2, "CodecTables"), (3, "StreamIndex"), (4, "Streams")]:
        assert cpu[kind] == gpu[kind], f"{name} differs"
    meta = [json.loads(m[1]) for m in (cpu, gpu)]
    assert meta[0]["dtype"] == meta[1]["dtype"] == "u8"
    assert meta[0]["shape"] == meta[1]["shape"]
    if route == "saturating":
        n_over = int((np.load(src) > 255).sum())
        assert cpu_prov["saturated_values"] == gpu_prov["saturated_values"] == n_over
    with io.load(tmp_path / f"{route}-cuda.qem", backend="cuda") as back:
        assert back.representation is io.DataRepresentation.ENCODED
        np.testing.assert_array_equal(back.to_numpy(), want.reshape(back.shape))
