"""Versioned DLPack (DLPack 1.0, Python array API 2023.12) on a Dataset: ``max_version``
selects the capsule (``"dltensor_versioned"`` from 1.0 on, the legacy ``"dltensor"`` before),
the versioned tensor says read-only (a view of the dataset) or is-copied (``copy=True``), NumPy
honours the flag, both kinds are zero-copy views with the same lifetime rule, and bad keywords
are refused. The layouts read through ctypes below are DLPack's (dlpack.h), written here from
the specification, not from the exporter.

The DeviceArray cases (CuPy, PyTorch, NumPy host copies of a device result) are in
tests/python/test_device_result.py and run on the GPU machine.
"""

from __future__ import annotations

import ctypes
import gc
import inspect
import sys

import numpy as np
import pytest

from quantem.gpu import InvalidArgumentError, io

READ_ONLY = 1 << 0
IS_COPIED = 1 << 1

_api = ctypes.pythonapi
_api.PyCapsule_GetName.restype = ctypes.c_char_p
_api.PyCapsule_GetName.argtypes = [ctypes.py_object]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


def _name(capsule) -> str:
    return _api.PyCapsule_GetName(capsule).decode()


def _legacy(capsule) -> _DLManagedTensor:
    return _DLManagedTensor.from_address(_api.PyCapsule_GetPointer(capsule, b"dltensor"))


def _versioned(capsule) -> _DLManagedTensorVersioned:
    ptr = _api.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
    return _DLManagedTensorVersioned.from_address(ptr)


def _shape(t: _DLTensor) -> tuple[int, ...]:
    return tuple(t.shape[i] for i in range(t.ndim))


def _counts(shape=(5, 6, 7, 8), dtype=np.uint16, seed=3):
    return np.random.default_rng(seed).integers(0, 60000, shape).astype(dtype)


class _Handing:
    """A producer that hands on ``source``'s capsule with the keywords it is given, keeping
    the capsule, so that a test sees what the consumer did with it (renamed it on use)."""

    def __init__(self, source, **force):
        self.source, self.force, self.capsule = source, force, None

    def __dlpack__(self, **kwargs):
        self.capsule = self.source.__dlpack__(**{**kwargs, **self.force})
        return self.capsule

    def __dlpack_device__(self):
        return self.source.__dlpack_device__()


numpy_2_1 = pytest.mark.skipif(
    tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 1),
    reason="np.from_dlpack passes max_version from NumPy 2.1",
)


@pytest.mark.parametrize(
    "dtype, bits", [(np.uint8, 8), (np.uint16, 16), (np.uint32, 32)], ids=["u8", "u16", "u32"]
)
def test_max_version_selects_the_capsule(dtype, bits):
    a = _counts(dtype=dtype)
    ds = io.load(a, backend="cpu", representation="dense")
    data = np.from_dlpack(ds).__array_interface__["data"][0]
    for max_version in (None, (0, 8)):
        kw = {} if max_version is None else {"max_version": max_version}
        capsule = ds.__dlpack__(**kw)
        assert _name(capsule) == "dltensor", max_version
        t = _legacy(capsule).dl_tensor
        assert t.data == data and _shape(t) == a.shape and not t.strides
        assert (t.device.device_type, t.device.device_id) == (1, 0)
        assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (1, bits, 1)
    for max_version in ((1, 0), (1, 3), (2, 0)):
        capsule = ds.__dlpack__(max_version=max_version)
        assert _name(capsule) == "dltensor_versioned", max_version
        m = _versioned(capsule)
        assert (m.version.major, m.version.minor) == (1, 0)
        assert m.flags == READ_ONLY, "a view of a dataset must say read-only"
        t = m.dl_tensor
        assert t.data == data and _shape(t) == a.shape and t.byte_offset == 0
        assert (t.dtype.code, t.dtype.bits) == (1, bits)
    ds.close()


@numpy_2_1
def test_numpy_takes_the_versioned_view_read_only():
    a = _counts()
    ds = io.load(a, backend="cpu", representation="dense")
    producer = _Handing(ds)
    v = np.from_dlpack(producer)
    assert _name(producer.capsule) == "used_dltensor_versioned", "NumPy did not ask for 1.0"
    assert np.array_equal(v, a) and v.dtype == np.uint16
    assert not v.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        v[0, 0, 0, 0] = 1
    legacy = _Handing(ds, max_version=None)
    w = np.from_dlpack(legacy)
    assert _name(legacy.capsule) == "used_dltensor"
    # Both capsules view the dataset's one buffer.
    assert v.__array_interface__["data"][0] == w.__array_interface__["data"][0]
    assert np.shares_memory(v, w) and np.array_equal(w, a)


@numpy_2_1
@pytest.mark.parametrize("representation", ["dense", "encoded"])
def test_copy_true_exports_a_writable_copy(representation):
    a = _counts(seed=8)
    ds = io.load(a, backend="cpu", representation=representation)
    m = _versioned(capsule := ds.__dlpack__(max_version=(1, 0), copy=True))
    assert m.flags == IS_COPIED
    del m, capsule
    c = np.from_dlpack(ds, copy=True)
    assert c.flags.writeable and np.array_equal(c, a)
    if representation == "dense":
        assert not np.shares_memory(c, np.from_dlpack(ds))
    c[0, 0, 0, 0] = 7  # the copy is the consumer's: the dataset keeps its counts
    assert int(ds[0, 0][0, 0]) == int(a[0, 0, 0, 0])
    # A copy holds nothing of the dataset: close() releases it at once.
    ds.close()
    assert ds._released, "a copy kept the dataset's memory"
    assert np.array_equal(c[1:], a[1:])


@numpy_2_1
def test_a_versioned_view_keeps_the_data_until_it_goes():
    a = _counts(shape=(32, 32, 16, 16), seed=5)
    ds = io.load(a, backend="cpu", representation="dense")
    before = sys.getrefcount(ds)
    view = np.from_dlpack(ds)
    assert sys.getrefcount(ds) == before, "the view holds the data, not the Python object"
    ds.close()
    assert ds.closed and not ds._released
    junk = [np.full(a.size, 7, dtype=np.uint16) for _ in range(4)]
    assert np.array_equal(view, a)
    del junk, view
    gc.collect()
    assert ds._released, "the data outlived its last versioned view"


@numpy_2_1
def test_a_versioned_view_outlives_its_dataset_object():
    a = _counts(shape=(32, 32, 16, 16), seed=6)
    ds = io.load(a, backend="cpu", representation="dense")
    view = np.from_dlpack(ds)
    del ds  # the source object goes: the view's lease keeps the counts
    gc.collect()
    junk = [np.full(a.size, 9, dtype=np.uint16) for _ in range(4)]
    assert np.array_equal(view, a)
    del junk


def test_an_unconsumed_versioned_capsule_releases_its_lease():
    ds = io.load(_counts(), backend="cpu", representation="dense")
    capsule = ds.__dlpack__(max_version=(1, 0))
    ds.close()
    assert not ds._released
    del capsule
    gc.collect()
    assert ds._released, "a versioned capsule nobody consumed kept the data alive"


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"max_version": "1.0"}, TypeError, "max_version must be None or a"),
        ({"max_version": (1,)}, TypeError, "max_version"),
        ({"dl_device": "cpu"}, TypeError, "dl_device must be None or a"),
        ({"copy": "yes"}, TypeError, "copy must be None or a bool"),
        ({"strem": None}, TypeError, "unexpected keyword argument 'strem'"),
        ({"max_version": (1, 0), "dl_device": (2, 0)}, BufferError, "found dl_device=\\(2, 0\\)"),
        ({"max_version": (1, 0), "stream": 1}, BufferError, "expected stream=None"),
    ],
)
def test_bad_keywords_are_refused(kwargs, error, message):
    ds = io.load(_counts(), backend="cpu", representation="dense")
    with pytest.raises(error, match=message):
        ds.__dlpack__(**kwargs)


def test_the_keywords_are_keyword_only_and_documented():
    ds = io.load(_counts(), backend="cpu", representation="dense")
    with pytest.raises(TypeError):
        ds.__dlpack__(None)
    sig = inspect.signature(io.Dataset.__dlpack__)
    params = sig.parameters
    assert list(params)[-4:] == ["stream", "max_version", "dl_device", "copy"]
    assert all(params[p].kind is inspect.Parameter.KEYWORD_ONLY for p in list(params)[-4:])
    assert all(params[p].default is None for p in list(params)[-4:])
    # copy=False and the dataset's own device are what a view is anyway.
    assert ds.__dlpack__(max_version=(1, 0), copy=False, dl_device=(1, 0)) is not None


@numpy_2_1
def test_encoded_and_closed_datasets_refuse_a_view():
    ds = io.load(_counts(), backend="cpu", representation="encoded")
    with pytest.raises(BufferError, match="ENCODED.*copy=True on the CPU"):
        ds.__dlpack__(max_version=(1, 0))
    with pytest.raises(BufferError, match="ENCODED"):
        np.from_dlpack(ds, copy=False)
    ds.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        ds.__dlpack__(max_version=(1, 0), copy=True)
