"""Gatan ``.dm4``/``.dm3`` 3-D and 4-D stacks through ``io.load`` (issue 21 item 1).

No library writes DM files, so the files are written here from the documented layout
(docs/formats.md §7.10), and rosettasciio's reader (what hyperspy uses) must read each one as
the same array before our loader is compared with it; then every backend and representation
must give the frames byte for byte, with the calibration the file carries.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

import quantem.gpu as qg
from quantem.gpu import device, io

BACKENDS = ["cpu"] + (["cuda"] if "cuda" in device.available() else [])

# DM value type codes and the numpy type of each; ImageData/DataType codes (docs/formats.md
# §7.10; the DataType codes as rosettasciio lists them: it has none for 64-bit integers).
SIMPLE = {
    "<i2": 2,
    "<i4": 3,
    "<u2": 4,
    "<u4": 5,
    "<f4": 6,
    "<f8": 7,
    "i1": 9,
    "u1": 10,
    "<i8": 11,
    "<u8": 12,
}
DATA_TYPE = {
    "uint16": 10,
    "uint32": 11,
    "float32": 2,
    "uint8": 6,
    "int16": 1,
    "int8": 9,
    "int32": 7,
    "float64": 12,
    "complex64": 3,
    "complex128": 13,
}


class _Writer:
    """Tags as nested lists: ``(name, value)`` where a value is a list (a group), an int (u32),
    a float (f32), a str (u16 text) or a numpy array (an array of its simple type)."""

    def __init__(self, v4: bool, little: bool):
        self.v4, self.little, self.out = v4, little, bytearray()

    def _len(self, v: int) -> None:
        self.out += struct.pack(">Q" if self.v4 else ">I", v)

    def _head(self, info: list[int]) -> None:
        self.out += b"%%%%"
        self._len(len(info))
        for i in info:
            self._len(i)

    def group(self, entries) -> None:
        self.out += b"\x00\x01"
        self._len(len(entries))
        for name, value in entries:
            self.tag(name, value)

    def tag(self, name: str, value) -> None:
        self.out += struct.pack(">BH", 20 if isinstance(value, list) else 21, len(name))
        self.out += name.encode()
        at = len(self.out)
        if self.v4:
            self.out += bytes(8)
        start = len(self.out)
        e = "<" if self.little else ">"
        if isinstance(value, list):
            self.group(value)
        elif isinstance(value, int):
            self._head([5])
            self.out += struct.pack(e + "I", value)
        elif isinstance(value, float):
            self._head([6])
            self.out += struct.pack(e + "f", value)
        elif isinstance(value, str):
            self._head([20, 4, len(value)])
            self.out += value.encode("utf-16-le" if self.little else "utf-16-be")
        elif np.iscomplexobj(value):
            # An array of structs of two floats (real, imaginary): how complex data is held.
            arr = np.ascontiguousarray(value)
            part = SIMPLE[np.dtype(arr.real.dtype).newbyteorder("<").str]
            self._head([20, 15, 0, 2, 0, part, 0, part, arr.size])
            self.out += arr.astype(arr.dtype.newbyteorder(e)).tobytes()
        else:
            arr = np.ascontiguousarray(value)
            one = arr.itemsize == 1
            code = SIMPLE[arr.dtype.str[1:] if one else arr.dtype.newbyteorder("<").str]
            self._head([20, code, arr.size])
            self.out += arr.astype(arr.dtype.newbyteorder("|" if one else e)).tobytes()
        if self.v4:
            self.out[at : at + 8] = struct.pack(">Q", len(self.out) - start)


def _image(data: np.ndarray, calibrations=(), data_type=None, tags=None):
    """An ImageList entry for a C-order array: DM lists dimensions fastest first."""
    dims = [("", int(d)) for d in data.shape[::-1]]
    cal = [("", [("Origin", 0.0), ("Scale", float(s)), ("Units", u)]) for s, u in calibrations]
    entry = [
        (
            "ImageData",
            [
                ("Calibrations", [("Dimension", cal)]),
                ("Data", data.reshape(-1)),
                ("DataType", data_type if data_type is not None else DATA_TYPE[data.dtype.name]),
                ("Dimensions", dims),
            ],
        )
    ]
    if tags:
        entry.append(("ImageTags", tags))
    return entry


def write_dm(path, images, v4=True, little=True, thumbnail=True):
    """A GMS-like file: a 2-D thumbnail first (listed under Thumbnails), then the images."""
    entries = ([("", _image(np.full((4, 4), 7, np.uint8)))] if thumbnail else []) + [
        ("", im) for im in images
    ]
    root = [("ImageList", entries)]
    if thumbnail:
        root.append(("Thumbnails", [("", [("ImageIndex", 0)])]))
    w = _Writer(v4, little)
    w.group(root)
    head = struct.pack(">I", 4 if v4 else 3)
    head += struct.pack(">Q" if v4 else ">I", len(w.out))
    head += struct.pack(">I", 1 if little else 0)
    path.write_bytes(head + bytes(w.out))
    return path


def _frames(shape, dtype=np.uint16, seed=0):
    return np.random.default_rng(seed).poisson(3.0, size=shape).astype(dtype)


def _gms_4d(tmp_path, data, name="scan.dm4", v4=True):
    cal = [(0.5, "mrad"), (0.5, "mrad"), (0.04, "nm"), (0.04, "nm")]
    tags = [("Microscope Info", [("Voltage", 300000.0)])]
    return write_dm(tmp_path / name, [_image(data, cal, tags=tags)], v4=v4)


@pytest.mark.parametrize("v4", [True, False], ids=["dm4", "dm3"])
def test_dm_layout_matches_rosettasciio(tmp_path, v4):
    dm = pytest.importorskip("rsciio.digitalmicrograph")
    data = _frames((3, 4, 5, 6))
    p = _gms_4d(tmp_path, data, name="scan.dm4" if v4 else "scan.dm3", v4=v4)
    theirs = dm.file_reader(str(p))
    assert len(theirs) == 1, "the thumbnail is not an image"
    np.testing.assert_array_equal(np.asarray(theirs[0]["data"]), data)
    with io.load(p, backend="cpu", representation="dense") as ds:
        assert ds.shape == (3, 4, 5, 6)
        np.testing.assert_array_equal(ds.to_numpy(), data)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("representation", ["dense", "encoded"])
def test_dm4_u16_4d_loads_byte_exact_with_calibration(tmp_path, backend, representation):
    data = _frames((6, 5, 16, 12), seed=1)
    p = _gms_4d(tmp_path, data)
    with io.load(p, backend=backend, representation=representation) as ds:
        assert ds.representation is io.DataRepresentation(representation)
        np.testing.assert_array_equal(ds.to_numpy(), data)
        cal = ds.calibration
        assert cal.det_sampling_mrad == (0.5, 0.5)
        assert cal.scan_step_a == pytest.approx((0.4, 0.4))
        assert cal.voltage_kv == 300.0
        assert cal.source("scan_step_a") == "metadata"


@pytest.mark.parametrize("backend", BACKENDS)
def test_dm3_big_endian_u32_frames(tmp_path, backend):
    data = _frames((12, 9, 7), np.uint32, seed=2) * 70001
    p = write_dm(tmp_path / "frames.dm3", [_image(data)], v4=False, little=False)
    with io.load(p, backend=backend, scan_shape=(3, 4), representation="dense") as ds:
        assert ds.shape == (3, 4, 9, 7)
        np.testing.assert_array_equal(ds.to_numpy(), data.reshape(3, 4, 9, 7))


def test_dm4_float32_needs_float_scale(tmp_path):
    counts = _frames((2, 3, 8, 8), np.uint32, seed=3)
    values = (counts * 4.0 + 0.4).astype(np.float32)
    p = write_dm(tmp_path / "gain.dm4", [_image(values)])
    with pytest.raises(qg.InvalidArgumentError, match="float_scale"):
        io.load(p, backend="cpu")
    with io.load(p, backend="cpu", float_scale=4.0, representation="dense") as ds:
        np.testing.assert_array_equal(ds.to_numpy(), counts)


def test_malformed_dm_files_are_source_errors(tmp_path):
    data = _frames((3, 4, 5, 6))
    whole = _gms_4d(tmp_path, data).read_bytes()
    cut = tmp_path / "cut.dm4"
    cut.write_bytes(whole[:-200])
    with pytest.raises(qg.SourceError, match="truncated") as e:
        io.load(cut, backend="cpu")
    assert "cut.dm4" in str(e.value)
    flat = write_dm(tmp_path / "flat.dm4", [_image(data[0, 0])])
    with pytest.raises(qg.SourceError, match="no 3-D or 4-D image"):
        io.load(flat, backend="cpu")


def test_dm_is_recognised_and_inspected(tmp_path):
    p = _gms_4d(tmp_path, _frames((3, 4, 5, 6)))
    info = io.inspect(p)
    assert info["ready"] is True, info
    assert info["source_kind"].lower().startswith("gatan"), info
    assert info["scan_shape"] == {"rows": 3, "cols": 4}, info["scan_shape"]
    assert info["detector_shape"] == {"rows": 5, "cols": 6}, info["detector_shape"]


# --- Signed, 64-bit and complex images (issue 21 item 1) -----------------------------------


def _tagged(data, **kw):
    """An image with the ImageTags group rosettasciio's reader expects."""
    return _image(data, tags=[("Microscope Info", [("Voltage", 300000.0)])], **kw)


def _theirs(p):
    """The array rosettasciio reads from ``p``."""
    dm = pytest.importorskip("rsciio.digitalmicrograph")
    return np.asarray(dm.file_reader(str(p))[0]["data"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["int8", "int16", "int32"])
@pytest.mark.parametrize("little", [True, False], ids=["le", "be"])
def test_signed_images_load_as_unsigned_counts(tmp_path, backend, dtype, little):
    """int8/int16/int32 with no negative value load losslessly as uint8/16/32 (counts are
    unsigned); rosettasciio reads the little-endian file as the same signed array (it reads
    image data little-endian whatever the header says, so big-endian values are checked as in
    ``test_dm3_big_endian_u32_frames``)."""
    data = (_frames((2, 3, 5, 6), np.int64, seed=4) * 9).astype(dtype)
    data.flat[0] = np.iinfo(dtype).max  # the largest value below the sign bit
    p = write_dm(tmp_path / "s.dm4", [_tagged(data)], little=little)
    if little:
        np.testing.assert_array_equal(_theirs(p), data)
    unsigned = data.astype(dtype.replace("int", "uint"))
    with io.load(p, backend=backend, representation="dense") as ds:
        got = ds.to_numpy()
    assert got.dtype == unsigned.dtype
    np.testing.assert_array_equal(got, unsigned)


@pytest.mark.parametrize("backend", BACKENDS)
def test_signed_negative_value_is_a_decode_error_naming_frame_and_value(tmp_path, backend):
    data = _frames((2, 3, 5, 6), np.int16, seed=5)
    data[1, 0, 2, 3] = -7  # frame 3, pixel 2·6 + 3 = 15
    p = write_dm(tmp_path / "neg.dm4", [_tagged(data)])
    np.testing.assert_array_equal(_theirs(p), data)
    with pytest.raises(qg.DecodeError, match="pixel 15") as e:
        io.load(p, backend=backend, representation="dense").to_numpy()
    text = str(e.value)
    assert "frame 3 of neg.dm4" in text and "found -7" in text, text


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("representation", ["dense", "encoded"])
def test_float64_images_go_through_float_scale(tmp_path, backend, representation):
    counts = _frames((2, 3, 8, 8), np.uint16, seed=6)
    values = counts * 2.0 - 0.4  # round(value / 2) = counts
    p = write_dm(tmp_path / "f64.dm4", [_tagged(values)])
    np.testing.assert_array_equal(_theirs(p), values)
    with pytest.raises(qg.InvalidArgumentError, match="float_scale"):
        io.load(p, backend="cpu")
    kw = {"float_scale": 2.0, "dtype": "u16"}
    with io.load(p, backend=backend, representation=representation, **kw) as ds:
        got = ds.to_numpy()
    np.testing.assert_array_equal(got, counts)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["uint64", "int64"])
def test_64_bit_integer_images_load_when_every_value_fits_u32(tmp_path, backend, dtype):
    """No DataType code for 64-bit integers is known to the readers checked (rosettasciio,
    ncempy, nionswift-io list none), so the loader recognises them by the array's value type
    under any DataType code it does not list (39 here, an unlisted code): values that fit u32
    load as uint32; one that does not is a decode error naming the frame and the value."""
    data = (_frames((2, 3, 4, 4), np.int64, seed=7) * 100_000_007).astype(dtype)
    p = write_dm(tmp_path / "w.dm4", [_tagged(data, data_type=39)])
    with io.load(p, backend=backend, representation="dense") as ds:
        got = ds.to_numpy()
    assert got.dtype == np.uint32
    np.testing.assert_array_equal(got, data.astype(np.uint32))
    bad = data.copy()
    bad[0, 2, 1, 1] = 2**32 if dtype == "uint64" else -2
    q = write_dm(tmp_path / "bad.dm4", [_tagged(bad, data_type=39)])
    with pytest.raises(qg.DecodeError, match="pixel 5") as e:
        io.load(q, backend=backend, representation="dense").to_numpy()
    found = 2**32 if dtype == "uint64" else -2
    assert "frame 2 of bad.dm4" in str(e.value) and f"found {found}" in str(e.value)


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_complex_images_are_refused_by_name(tmp_path, dtype):
    data = (_frames((2, 3, 4, 4), np.float64, seed=8) + 1j).astype(dtype)
    p = write_dm(tmp_path / "c.dm4", [_tagged(data)])
    np.testing.assert_array_equal(_theirs(p), data)
    with pytest.raises(qg.SourceError, match="complex") as e:
        io.load(p, backend="cpu")
    assert f"DataType {DATA_TYPE[dtype]}" in str(e.value)
