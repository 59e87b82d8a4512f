"""Device results (``device_result=True``, issue 21 item 2): on a CUDA dataset the detector
products stay in GPU memory as a ``results.DeviceArray`` that CuPy and PyTorch view without a
copy (DLPack, CUDA Array Interface), holding exactly the host path's values; on a CPU dataset
the keyword is a typed error. Host results export through DLPack as before.

The CPU cases run everywhere (CI). The CUDA cases skip without a usable CUDA backend, and each
consumer case skips without its library; on the GPU machine:

    cd tests/python && python3 -m pytest -q -rs test_device_result.py
"""

from __future__ import annotations

import gc
import importlib

import numpy as np
import pytest
from disk_data import disk_data

import quantem.gpu as qg
from quantem.gpu import _native, detector, device, dpc, io, results

CPU_REFUSAL = "device_result=True needs a CUDA dataset; this dataset is on the CPU"

#: Every call that takes ``device_result``, as ``(name, call(ds))``.
DEVICE_CALLS = [
    ("bf", lambda ds: detector.bf(ds, device_result=True)),
    ("abf", lambda ds: detector.abf(ds, device_result=True)),
    ("adf", lambda ds: detector.adf(ds, device_result=True)),
    ("haadf", lambda ds: detector.haadf(ds, device_result=True)),
    ("df", lambda ds: detector.df(ds, device_result=True)),
    ("annular", lambda ds: detector.annular(ds, inner=2.0, outer=5.0, device_result=True)),
    (
        "virtual_image",
        lambda ds: detector.virtual_image(
            ds, np.ones(ds.shape[2:], dtype=bool), device_result=True
        ),
    ),
    ("sum_dp", lambda ds: detector.sum_dp(ds, device_result=True)),
    ("mean_dp", lambda ds: detector.mean_dp(ds, device_result=True)),
    ("max_dp", lambda ds: detector.max_dp(ds, device_result=True)),
    ("moments", lambda ds: detector.moments(ds, device_result=True)),
    ("products", lambda ds: detector.products(ds, ["bf", "sum_dp"], device_result=True)),
    ("center_of_mass", lambda ds: dpc.center_of_mass(ds, device_result=True)),
]


def _bf_mask(det: tuple[int, int], center=(11.5, 12.2), radius=6.0) -> np.ndarray:
    yy, xx = np.mgrid[: det[0], : det[1]]
    return (yy - center[0]) ** 2 + (xx - center[1]) ** 2 <= radius**2


def _virtual_reference(data: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``Σ_k mask[k] · I[R, k]`` in NumPy (uint64, independent of the engine)."""
    return np.einsum("abij,ij->ab", data.astype(np.uint64), mask.astype(np.uint64))


# --- CPU: run in CI ----------------------------------------------------------------------


@pytest.mark.parametrize("representation", ["dense", "encoded"])
@pytest.mark.parametrize("name, call", DEVICE_CALLS, ids=[n for n, _ in DEVICE_CALLS])
def test_cpu_dataset_refuses_device_results(representation, name, call):
    ds = io.load(disk_data(), backend="cpu", representation=representation)
    with pytest.raises(qg.InvalidArgumentError, match=CPU_REFUSAL) as e:
        call(ds)
    assert e.value.found == 'backend "cpu"', name
    assert "cuda" in e.value.expected, name


def test_device_result_must_be_a_bool():
    ds = io.load(disk_data(), backend="cpu")
    with pytest.raises(qg.ArgumentTypeError, match="device_result must be a bool"):
        detector.bf(ds, device_result="yes")
    with pytest.raises(qg.ArgumentTypeError, match="device_result must be a bool"):
        detector.sum_dp(ds, device_result=1)


def test_device_result_false_is_the_host_path():
    data = disk_data()
    ds = io.load(data, backend="cpu")
    got = detector.sum_dp(ds, device_result=False)
    assert isinstance(got, np.ndarray)
    assert np.array_equal(got, data.astype(np.uint64).sum(axis=(0, 1)))
    img = detector.bf(ds, device_result=False)
    assert not img.on_device and img.to_host() is img
    assert not hasattr(img, "__cuda_array_interface__")


def test_device_array_is_the_native_class_and_not_constructible():
    assert results.DeviceArray is _native.DeviceArray
    assert "DeviceArray" in results.__all__
    with pytest.raises(TypeError):
        results.DeviceArray()


def test_host_results_export_through_dlpack():
    data = disk_data()
    ds = io.load(data, backend="cpu")
    mask = _bf_mask(ds.shape[2:])
    want = _virtual_reference(data, mask)
    bf = detector.bf(ds, center=(11.5, 12.2), radius=6.0)
    assert bf.__dlpack_device__() == (1, 0)
    got = np.from_dlpack(bf)
    assert got.dtype == np.uint64 and np.array_equal(got, want)
    assert np.shares_memory(got, bf.image)
    vi = detector.virtual_image(ds, mask)
    assert np.array_equal(np.from_dlpack(vi), want)
    s = detector.sum_dp(ds)
    assert np.array_equal(np.from_dlpack(s), data.astype(np.uint64).sum(axis=(0, 1)))
    p = detector.products(ds, ["adf", "moments"])
    assert np.array_equal(np.from_dlpack(p["adf"]), p["adf"].image)
    assert np.array_equal(
        np.from_dlpack(p["moments"]["sum"]), data.astype(np.uint64).sum(axis=(2, 3))
    )


# --- CUDA: run on the GPU machine ----------------------------------------------------------

cuda = pytest.mark.skipif("cuda" not in device.available(), reason="needs a CUDA GPU")

#: A rectangular scan (R_r ≠ R_c).
SCAN = (13, 17)


@pytest.fixture(scope="module")
def data():
    return disk_data(scan=SCAN)


@pytest.fixture(scope="module", params=["dense", "encoded"])
def gpu_ds(request, data):
    ds = io.load(data, backend="cuda", representation=request.param)
    assert ds.backend == "cuda"
    yield ds
    ds.close()


def _ordinal(ds) -> int:
    kind, ordinal = ds.__dlpack_device__()
    assert kind == 2
    return ordinal


def _ptr(a) -> int:
    return a.__cuda_array_interface__["data"][0]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bits (float64 compared as uint64: -0.0 and NaNs included)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return np.array_equal(a.view(view), b.view(view))


def _torch_numpy(t) -> np.ndarray:
    """A host NumPy copy of a torch tensor (uint64 through an int64 view where the torch
    release cannot convert uint64 itself)."""
    import torch

    host = t.cpu()
    try:
        return host.numpy()
    except (TypeError, RuntimeError):
        return host.view(torch.int64).numpy().view(np.uint64)


@cuda
def test_device_images_equal_the_host_images(gpu_ds, data):
    ordinal = _ordinal(gpu_ds)
    for kind in ("bf", "adf", "haadf", "df"):
        host = getattr(detector, kind)(gpu_ds)
        dev = getattr(detector, kind)(gpu_ds, device_result=True)
        assert dev.on_device and isinstance(dev.image, results.DeviceArray), kind
        assert dev.image.shape == SCAN and dev.image.dtype == np.uint64, kind
        assert dev.image.device == ordinal and dev.__dlpack_device__() == (2, ordinal), kind
        got = dev.image.to_numpy()
        assert got.dtype == np.uint64 and np.array_equal(got, host.image), kind
        assert host.image.sum() > 0, kind
        # Calibration and provenance come along.
        assert (dev.inner_px, dev.outer_px, dev.mask_pixels) == (
            host.inner_px,
            host.outer_px,
            host.mask_pixels,
        ), kind
        assert dev.disk == host.disk and dev.axes == host.axes and dev.units == host.units
        params = dev.provenance["params"]
        assert params["result_device"] == f"cuda:{ordinal}", kind
        assert params["detector"] == host.provenance["params"]["detector"], kind
        assert np.array_equal(dev.to_host().image, host.image), kind
    # The BF disk given: the image against NumPy, independent of the engine.
    mask = _bf_mask(data.shape[2:])
    dev = detector.bf(gpu_ds, center=(11.5, 12.2), radius=6.0, device_result=True)
    assert np.array_equal(dev.image.to_numpy(), _virtual_reference(data, mask))


@cuda
def test_device_patterns_and_virtual_images_are_exact(gpu_ds, data):
    wide = data.astype(np.uint64)
    s = detector.sum_dp(gpu_ds, device_result=True)
    assert isinstance(s, results.DeviceArray) and s.shape == data.shape[2:]
    assert s.dtype == np.uint64 and np.array_equal(s.to_numpy(), wide.sum(axis=(0, 1)))
    m = detector.max_dp(gpu_ds, device_result=True)
    assert m.dtype == np.uint32 and np.array_equal(m.to_numpy(), data.max(axis=(0, 1)))
    mask = _bf_mask(data.shape[2:])
    v = detector.virtual_image(gpu_ds, mask, device_result=True)
    assert v.shape == SCAN and np.array_equal(v.to_numpy(), _virtual_reference(data, mask))
    weights = np.arange(data.shape[2] * data.shape[3], dtype=np.uint64).reshape(data.shape[2:])
    v = detector.virtual_image(gpu_ds, weights % 7, device_result=True)
    assert np.array_equal(v.to_numpy(), _virtual_reference(data, weights % 7))
    # Float masks: the host path's values exactly (the same kernels ran).
    fmask = np.sin(weights.astype(np.float64) * 0.1)
    vf = detector.virtual_image(gpu_ds, fmask, device_result=True)
    assert vf.dtype == np.float64
    assert np.array_equal(vf.to_numpy(), detector.virtual_image(gpu_ds, fmask))
    mom = detector.moments(gpu_ds, device_result=True)
    host = detector.moments(gpu_ds)
    assert set(mom) == {"sum", "m_row", "m_col"}
    for k in mom:
        assert isinstance(mom[k], results.DeviceArray), k
        assert np.array_equal(mom[k].to_numpy(), host[k]), k
    assert np.array_equal(mom["sum"].to_numpy(), wide.sum(axis=(2, 3)))


@cuda
def test_device_products_equal_the_host_products(gpu_ds, data):
    names = ["bf", "adf", "sum_dp", "mean_dp", "max_dp", "moments", "com"]
    host = detector.products(gpu_ds, names)
    dev = detector.products(gpu_ds, names, device_result=True)
    assert list(dev) == names
    for k in ("bf", "adf"):
        assert dev[k].on_device, k
        assert np.array_equal(dev[k].image.to_numpy(), host[k].image), k
    assert np.array_equal(dev["sum_dp"].to_numpy(), data.astype(np.uint64).sum(axis=(0, 1)))
    assert np.array_equal(dev["max_dp"].to_numpy(), host["max_dp"])
    for k in ("sum", "m_row", "m_col"):
        assert np.array_equal(dev["moments"][k].to_numpy(), host["moments"][k]), k
    # The mean and the CoM are finished on the card: the host values bit for bit.
    mean = dev["mean_dp"]
    assert isinstance(mean, results.DeviceArray) and mean.dtype == np.float32
    assert np.array_equal(mean.to_numpy().view(np.uint32), host["mean_dp"].view(np.uint32))
    com, hcom = dev["com"], host["com"]
    assert isinstance(com, dpc.CoM) and isinstance(com.com_row, results.DeviceArray)
    for k in ("com_row", "com_col"):
        assert _same_bits(getattr(com, k).to_numpy(), getattr(hcom, k)), k
    assert (com.zero_frames, com.unit, com.centered) == (hcom.zero_frames, hcom.unit, True)
    assert com.provenance["params"]["result_device"] == f"cuda:{_ordinal(gpu_ds)}"
    assert dev.disk == host.disk and dev.axes == host.axes and dev.units == host.units
    assert dev.provenance["params"]["result_device"] == f"cuda:{_ordinal(gpu_ds)}"


@cuda
@pytest.mark.parametrize("consumer", ["cupy", "torch"])
def test_consumers_view_device_results_without_a_copy(gpu_ds, consumer):
    lib = pytest.importorskip(consumer)
    host = detector.bf(gpu_ds)
    dev = detector.bf(gpu_ds, device_result=True)
    ptr = _ptr(dev.image)
    assert _ptr(dev) == ptr  # the DetectorImage hands on its image's interface
    for source in (dev.image, dev):  # the array itself, and the result delegating to it
        t = lib.from_dlpack(source)
        got_ptr = t.data_ptr() if consumer == "torch" else t.data.ptr
        assert got_ptr == ptr, "the consumer's array is not the result's device buffer"
        assert tuple(t.shape) == SCAN
        got = _torch_numpy(t) if consumer == "torch" else lib.asnumpy(t)
        assert np.array_equal(got.astype(np.uint64), host.image)
    if consumer == "cupy":
        c = lib.asarray(dev.image)  # the CUDA Array Interface
        assert c.data.ptr == ptr and c.dtype == np.uint64
        f = detector.virtual_image(gpu_ds, np.ones(gpu_ds.shape[2:]), device_result=True)
        cf = lib.from_dlpack(f)
        assert cf.dtype == np.float64 and cf.data.ptr == _ptr(f)


@cuda
@pytest.mark.parametrize("consumer", ["cupy", "torch"])
def test_a_view_keeps_the_memory_after_the_dataset_and_the_result_are_gone(data, consumer):
    lib = pytest.importorskip(consumer)
    ds = io.load(data, backend="cuda", representation="dense")
    want = detector.adf(ds).image
    dev = detector.adf(ds, device_result=True)
    t = lib.from_dlpack(dev)
    ptr = _ptr(dev.image)
    ds.close()
    assert ds._released, "a device result must not hold the dataset's memory"
    del dev
    gc.collect()
    # Churn the device allocator: new results must not land on the viewed buffer.
    other = io.load(data + 1, backend="cuda", representation="dense")
    churn = [detector.adf(other, device_result=True) for _ in range(8)]
    assert all(_ptr(c.image) != ptr for c in churn)
    got = _torch_numpy(t) if consumer == "torch" else lib.asnumpy(t)
    assert np.array_equal(got.astype(np.uint64), want)
    other.close()


@cuda
def test_device_memory_is_released_when_the_last_view_goes():
    cupy = pytest.importorskip("cupy")
    # A 1024 x 1024 scan: the image is 8 MiB of uint64.
    a = np.random.default_rng(4).integers(0, 100, (1024, 1024, 4, 4)).astype(np.uint16)
    ds = io.load(a, backend="cuda", representation="dense")
    mask = np.ones((4, 4), dtype=bool)
    detector.virtual_image(ds, mask, device_result=True)  # compile and warm up first
    gc.collect()
    free0, _ = cupy.cuda.runtime.memGetInfo()
    dev = detector.virtual_image(ds, mask, device_result=True)
    view = cupy.from_dlpack(dev)
    del dev
    gc.collect()
    free_held, _ = cupy.cuda.runtime.memGetInfo()
    assert free0 - free_held >= 8 << 20, "the viewed image was freed"
    assert int(view.sum()) == int(a.astype(np.uint64).sum())
    del view
    gc.collect()
    free_after, _ = cupy.cuda.runtime.memGetInfo()
    assert free_after - free_held >= (8 << 20) * 0.9, (free0, free_held, free_after)
    ds.close()


@cuda
def test_two_device_results_in_flight_are_independent(gpu_ds):
    cupy = pytest.importorskip("cupy")
    bf_host, adf_host = detector.bf(gpu_ds).image, detector.adf(gpu_ds).image
    assert not np.array_equal(bf_host, adf_host)
    bf = detector.bf(gpu_ds, device_result=True)
    adf = detector.adf(gpu_ds, device_result=True)
    assert _ptr(bf) != _ptr(adf)
    vb, va = cupy.from_dlpack(bf), cupy.from_dlpack(adf)
    vb[0, 0] = 12345  # a view writes the result's own memory, not the other's
    assert int(bf.image.to_numpy()[0, 0]) == 12345
    assert np.array_equal(adf.image.to_numpy(), adf_host)
    del bf, vb
    gc.collect()
    assert np.array_equal(cupy.asnumpy(va), adf_host)
    assert np.array_equal(adf.to_host().image, adf_host)


@cuda
def test_device_array_arguments_and_display(gpu_ds):
    ordinal = _ordinal(gpu_ds)
    dev = detector.bf(gpu_ds, device_result=True)
    a = dev.image
    for stream in (None, -1, 1, 2):
        capsule = a.__dlpack__(stream=stream)
        assert type(capsule).__name__ == "PyCapsule"
    del capsule
    assert a.__dlpack__(dl_device=(2, ordinal)) is not None
    with pytest.raises(BufferError, match=rf"expected dl_device=\(2, {ordinal}\)"):
        a.__dlpack__(dl_device=(1, 0))
    with pytest.raises(BufferError, match="found copy=True"):
        a.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="stream"):
        a.__dlpack__(stream="default")
    with pytest.raises(TypeError, match="to_numpy"):
        np.asarray(a)
    with pytest.raises(TypeError, match="to_host"):
        np.asarray(dev)
    cai = a.__cuda_array_interface__
    assert cai["version"] == 3 and cai["typestr"] == "<u8" and cai["shape"] == SCAN
    assert cai["stream"] is None and cai["strides"] is None
    assert (a.ndim, a.size, a.nbytes, len(a)) == (2, SCAN[0] * SCAN[1], SCAN[0] * SCAN[1] * 8, 13)
    assert f"cuda:{ordinal}" in repr(a) and f"cuda:{ordinal}" in repr(dev)
    assert f"cuda:{ordinal}" in a._repr_html_() and f"cuda:{ordinal}" in dev._repr_html_()


@cuda
def test_device_mean_dp_is_the_host_mean_bit_for_bit(gpu_ds, data):
    dev = detector.mean_dp(gpu_ds, device_result=True)
    assert isinstance(dev, results.DeviceArray)
    assert dev.dtype == np.float32 and dev.shape == data.shape[2:]
    assert dev.__cuda_array_interface__["typestr"] == "<f4"
    got = dev.to_numpy()
    assert _same_bits(got, detector.mean_dp(gpu_ds))
    # NumPy, independent of the engine: the exact sum over the frame count in float64.
    n = data.shape[0] * data.shape[1]
    want = (data.astype(np.uint64).sum(axis=(0, 1)).astype(np.float64) / n).astype(np.float32)
    assert _same_bits(got, want)


def _numpy_com(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``μ = m / S`` per frame in float64 from NumPy's exact moments (0 where S = 0)."""
    wide = data.astype(np.uint64)
    kr = np.arange(data.shape[2], dtype=np.uint64)[:, None]
    kc = np.arange(data.shape[3], dtype=np.uint64)[None, :]
    s = wide.sum(axis=(2, 3))
    mr, mc = (wide * kr).sum(axis=(2, 3)), (wide * kc).sum(axis=(2, 3))
    safe = np.where(s == 0, 1, s).astype(np.float64)
    row = np.where(s == 0, 0.0, mr.astype(np.float64) / safe)
    col = np.where(s == 0, 0.0, mc.astype(np.float64) / safe)
    return row, col, int((s == 0).sum())


@cuda
def test_device_com_is_the_host_com_bit_for_bit(gpu_ds, data):
    ordinal = _ordinal(gpu_ds)
    row, col, zeros = _numpy_com(data)
    for centered in (True, False):
        host = dpc.center_of_mass(gpu_ds, centered=centered)
        dev = dpc.center_of_mass(gpu_ds, centered=centered, device_result=True)
        assert isinstance(dev.com_row, results.DeviceArray) and dev.com_row.dtype == np.float64
        assert dev.com_row.shape == SCAN and dev.com_col.device == ordinal
        for k in ("com_row", "com_col"):
            assert _same_bits(getattr(dev, k).to_numpy(), getattr(host, k)), (k, centered)
        assert (dev.zero_frames, dev.unit, dev.centered) == (zeros, host.unit, centered)
        assert dev.provenance["params"]["result_device"] == f"cuda:{ordinal}"
        assert dev.axes == host.axes and dev.units == host.units
        if not centered:  # one IEEE division per value: NumPy's bits exactly
            assert _same_bits(dev.com_row.to_numpy(), row)
            assert _same_bits(dev.com_col.to_numpy(), col)
        else:
            np.testing.assert_allclose(dev.com_row.to_numpy(), row - row.mean(), atol=1e-12)
    page = dev._repr_html_()  # the arrays are listed where they live (no thumbnail)
    assert f"cuda:{ordinal} (device_result=True)" in page and "<img" not in page
    for k in ("com_row", "com_col"):
        assert f">{k}</th><td style='text-align:left'>{SCAN} float64<" in page
    with pytest.raises(qg.DLPackUnavailableError, match="two arrays"):
        dev.__dlpack__()


@cuda
def test_device_com_takes_a_user_calibration_on_the_card(data):
    ds = io.load(data, backend="cuda", representation="dense")
    ds.calibration = ds.calibration.replace(det_sampling_mrad=(0.37, 0.37))
    host = dpc.center_of_mass(ds)
    dev = dpc.center_of_mass(ds, device_result=True)
    assert host.unit == dev.unit == "mrad"
    for k in ("com_row", "com_col"):
        assert _same_bits(getattr(dev, k).to_numpy(), getattr(host, k)), k
    applied = dev.provenance["calibration_applied"]
    assert applied == host.provenance["calibration_applied"]
    ds.close()


def _consumer_views(source):
    """``(consumer, view, capsule name)`` for CuPy and PyTorch where installed: each
    consumer's ``from_dlpack`` of ``source``, with the capsule it chose by its own
    ``max_version`` (recent releases ask for the versioned one, older ones the legacy) and took
    (renamed ``used_...``)."""
    from test_dlpack_versioned import _Handing, _name

    for consumer in ("cupy", "torch"):
        try:
            lib = importlib.import_module(consumer)
        except ImportError:
            continue
        producer = _Handing(source)
        v = lib.from_dlpack(producer)
        name = _name(producer.capsule)
        print(f"{consumer} {lib.__version__} took {name}")
        yield consumer, v, name


def _view_ptr(v) -> int:
    """The device address of a CuPy array or a torch tensor."""
    return v.data_ptr() if hasattr(v, "data_ptr") else v.data.ptr


@cuda
def test_device_arrays_export_versioned_dlpack(gpu_ds):
    from test_dlpack_versioned import _name, _shape, _versioned

    ordinal = _ordinal(gpu_ds)
    a = detector.mean_dp(gpu_ds, device_result=True)
    capsule = a.__dlpack__(max_version=(1, 0))
    assert _name(capsule) == "dltensor_versioned"
    m = _versioned(capsule)
    assert (m.version.major, m.version.minor) == (1, 0)
    assert m.flags == 0, "a device result is the caller's memory: writable, not a copy"
    t = m.dl_tensor
    assert t.data == _ptr(a) and _shape(t) == a.shape
    assert (t.device.device_type, t.device.device_id) == (2, ordinal)
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (2, 32, 1)
    del m, capsule
    assert _name(a.__dlpack__()) == "dltensor"
    # NumPy: an explicit host copy only (copy=True, device="cpu"), marked as a copy.
    host = np.from_dlpack(a, device="cpu", copy=True)
    assert host.flags.writeable and _same_bits(host, a.to_numpy())
    assert _versioned(a.__dlpack__(max_version=(1, 0), dl_device=(1, 0), copy=True)).flags == 2
    with pytest.raises(BufferError, match="copy=True with dl_device=\\(1, 0\\) makes a host"):
        a.__dlpack__(max_version=(1, 0), dl_device=(1, 0))
    with pytest.raises(BufferError, match="makes a host copy only"):
        a.__dlpack__(max_version=(1, 0), copy=True)
    with pytest.raises((BufferError, RuntimeError)):  # NumPy: "Unsupported device"
        np.from_dlpack(a)
    for consumer, v, name in _consumer_views(a):
        assert name in ("used_dltensor", "used_dltensor_versioned"), (consumer, name)
        assert _view_ptr(v) == _ptr(a), consumer
        v[0, 0] = 2.5  # writable: the result's own memory
        assert a.to_numpy()[0, 0] == np.float32(2.5), consumer


@cuda
def test_consumers_take_a_cuda_dataset_through_either_capsule(data):
    ds = io.load(data, backend="cuda", representation="dense")
    from test_dlpack_versioned import _versioned

    assert _versioned(ds.__dlpack__(max_version=(1, 0))).flags == 1  # read-only
    for consumer, v, name in _consumer_views(ds):
        assert name in ("used_dltensor", "used_dltensor_versioned"), (consumer, name)
        assert _view_ptr(v) == ds.__cuda_array_interface__["data"][0], consumer
        host = v.cpu().numpy() if consumer == "torch" else v.get()
        assert np.array_equal(host.astype(data.dtype), data), consumer
    with pytest.raises(BufferError, match="copy=True of a CUDA dataset"):
        ds.__dlpack__(max_version=(1, 0), copy=True)
    ds.close()
