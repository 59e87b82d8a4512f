"""DLPack export of a Dataset's dense array (``__dlpack__`` / ``__dlpack_device__``): zero copy,
the data kept alive past ``close()`` while a view exists, typed refusals. CPU here; the CUDA
cases (torch / CuPy consumers, device memory released when the last view goes) run where a GPU
is (they skip without one, and bench/device.sh runs them on the card)."""

import gc

import numpy as np
import pytest

from quantem.gpu import InvalidArgumentError, device, io


def _counts(shape=(5, 6, 7, 8), dtype=np.uint16, seed=3):
    return np.random.default_rng(seed).integers(0, 60000, shape).astype(dtype)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_cpu_dense_dataset_exports_a_zero_copy_view(dtype):
    a = _counts(dtype=dtype)
    ds = io.load(a, backend="cpu", representation="dense")
    assert ds.__dlpack_device__() == (1, 0)
    v1 = np.from_dlpack(ds)
    v2 = np.from_dlpack(ds)
    assert v1.shape == a.shape and v1.dtype == a.dtype
    assert np.array_equal(v1, a)
    # Both views point at the dataset's one buffer (no copy was made for either).
    assert np.shares_memory(v1, v2)
    assert v1.__array_interface__["data"][0] == v2.__array_interface__["data"][0]
    ds.close()


def test_close_waits_for_the_last_view():
    a = _counts(shape=(32, 32, 16, 16), seed=5)
    ds = io.load(a, backend="cpu", representation="dense")
    view = np.from_dlpack(ds)
    ds.close()
    assert ds.closed and ds.nbytes_resident == 0
    assert not ds._released, "the data was released while a view of it existed"
    with pytest.raises(InvalidArgumentError, match="closed"):
        ds.__dlpack__()
    # The memory is still the dataset's and still holds the counts: churn the allocator first.
    junk = [np.full(a.size, 7, dtype=np.uint16) for _ in range(4)]
    assert np.array_equal(view, a)
    del junk, view
    gc.collect()
    assert ds._released, "the data outlived its last view after close()"


def test_an_unconsumed_capsule_releases_its_lease():
    ds = io.load(_counts(), backend="cpu", representation="dense")
    capsule = ds.__dlpack__()
    assert type(capsule).__name__ == "PyCapsule"
    ds.close()
    assert not ds._released
    del capsule
    gc.collect()
    assert ds._released, "a capsule nobody consumed kept the data alive"


def test_encoded_dataset_refuses_with_the_reason():
    ds = io.load(_counts(), backend="cpu", representation="encoded")
    assert ds.__dlpack_device__() == (1, 0)
    with pytest.raises(
        BufferError, match="ENCODED.*expected representation dense, found representation encoded"
    ):
        np.from_dlpack(ds)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dl_device": (2, 0)}, r"expected dl_device=\(1, 0\), found dl_device=\(2, 0\)"),
        ({"dl_device": (2, 0), "copy": True}, r"found dl_device=\(2, 0\)"),
        ({"stream": 1}, "expected stream=None"),
    ],
)
def test_export_arguments_are_checked(kwargs, message):
    ds = io.load(_counts(), backend="cpu", representation="dense")
    with pytest.raises(BufferError, match=message):
        ds.__dlpack__(**kwargs)


cuda = pytest.mark.skipif("cuda" not in device.available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("consumer", ["torch", "cupy"])
def test_cuda_dense_dataset_exports_a_device_view(consumer):
    lib = pytest.importorskip(consumer)
    a = _counts(shape=(16, 16, 32, 32), dtype=np.uint16, seed=9)
    ds = io.load(a, backend="cuda", representation="dense")
    kind, ordinal = ds.__dlpack_device__()
    assert kind == 2
    t = lib.from_dlpack(ds)
    ptr = ds.__cuda_array_interface__["data"][0]
    got_ptr = t.data_ptr() if consumer == "torch" else t.data.ptr
    assert got_ptr == ptr, "the consumer's array is not the dataset's buffer"
    host = t.cpu().numpy() if consumer == "torch" else lib.asnumpy(t)
    assert np.array_equal(host.astype(np.uint16), a)
    ds.close()
    assert not ds._released
    host = t.cpu().numpy() if consumer == "torch" else lib.asnumpy(t)
    assert np.array_equal(host.astype(np.uint16), a)
    del t
    gc.collect()
    assert ds._released


@cuda
def test_cuda_memory_is_released_when_the_last_view_goes():
    cupy = pytest.importorskip("cupy")
    a = _counts(shape=(64, 64, 64, 64), dtype=np.uint16, seed=11)  # 32 MiB
    ds = io.load(a, backend="cuda", representation="dense")
    view = cupy.from_dlpack(ds)
    free_open, _ = cupy.cuda.runtime.memGetInfo()
    ds.close()
    free_closed, _ = cupy.cuda.runtime.memGetInfo()
    assert abs(free_closed - free_open) < a.nbytes // 2, "freed while a view still existed"
    assert int(view[63, 63].sum()) == int(a[63, 63].astype(np.uint64).sum())
    del view
    gc.collect()
    free_after, _ = cupy.cuda.runtime.memGetInfo()
    assert free_after - free_closed >= a.nbytes * 0.9, (free_closed, free_after)


@cuda
def test_cuda_encoded_dataset_refuses():
    ds = io.load(_counts(), backend="cuda", representation="encoded")
    assert ds.__dlpack_device__()[0] == 2
    with pytest.raises(BufferError, match="ENCODED"):
        ds.__dlpack__()
