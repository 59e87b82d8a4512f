"""The GPU hand-off: ``__cuda_array_interface__`` on CUDA datasets only, ``to_numpy`` on both.

Without a usable CUDA backend only the CPU-side contract runs; the CuPy comparison is skipped
with the reason. On a GPU machine (CuPy installed) it checks that ``cupy.asarray(ds)`` views
the very counts the CPU engine loads, with and without a region, binning and a dtype change.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from quantem.gpu import device, io

CUDA_AVAILABLE = "cuda" in device.available()


def _cuda_reason() -> str:
    info = {b["name"]: b for b in device.info()}
    return str(info.get("cuda", {}).get("detail", "no cuda backend in this build"))


def test_cpu_dataset_has_no_cuda_array_interface(acquisition):
    with io.load(acquisition["master"], backend="cpu") as ds:
        assert ds.backend == "cpu"
        assert not hasattr(ds, "__cuda_array_interface__")
        with pytest.raises(AttributeError, match="not on the GPU"):
            ds.__cuda_array_interface__  # noqa: B018
        assert np.array_equal(ds.to_numpy(), acquisition["masked"])


def test_array_source_on_cpu_has_no_cuda_array_interface():
    a = np.arange(2 * 3 * 4 * 5, dtype=np.uint16).reshape(2, 3, 4, 5)
    ds = io.load(a, backend="cpu")
    assert not hasattr(ds, "__cuda_array_interface__")
    assert np.array_equal(np.asarray(ds), a)


def test_dataset4dstemgpu_is_the_dataset_class(acquisition):
    assert io.Dataset4dstemGPU is io.Dataset
    with io.load(acquisition["master"], backend="cpu") as ds:
        assert isinstance(ds, io.Dataset4dstemGPU)


def test_available_lists_cuda_first_when_usable():
    names = device.available()
    assert "cpu" in names
    if "cuda" in names:
        assert names[0] == "cuda"
        assert device.resolve("auto") == "cuda"
    else:
        assert device.resolve("auto") == "cpu"


@pytest.mark.skipif(not CUDA_AVAILABLE, reason=f"CUDA backend unavailable: {_cuda_reason()}")
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"scan_region": (1, 4, 2, 7), "det_bin": 2},
        {"dtype": "u8"},
    ],
    ids=["full", "region+bin", "u8"],
)
def test_cupy_asarray_equals_the_cpu_load(acquisition, options):
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    expected = io.load(acquisition["master"], backend="cpu", **options).to_numpy()
    with io.load(acquisition["master"], backend="cuda", representation="dense", **options) as ds:
        assert ds.backend == "cuda"
        assert ds.representation is io.DataRepresentation.DENSE
        assert isinstance(ds, io.Dataset4dstemGPU)
        cai = ds.__cuda_array_interface__
        assert cai["version"] == 3
        assert tuple(cai["shape"]) == ds.shape == expected.shape
        assert cai["typestr"] == expected.dtype.str
        assert cai["strides"] is None and cai["stream"] is None
        assert isinstance(cai["data"][0], int) and cai["data"][1] is False
        on_gpu = cupy.asarray(ds)
        assert on_gpu.shape == expected.shape and on_gpu.dtype == expected.dtype
        assert np.array_equal(cupy.asnumpy(on_gpu), expected)
        assert np.array_equal(ds.to_numpy(), expected)
        assert np.array_equal(ds[ds.shape[0] - 1, 0], expected[-1, 0])
        del on_gpu
    assert not hasattr(ds, "__cuda_array_interface__")  # closed: the device memory is gone


@pytest.mark.skipif(not CUDA_AVAILABLE, reason=f"CUDA backend unavailable: {_cuda_reason()}")
@pytest.mark.parametrize(
    "options",
    # The acquisition is u32; ENCODED (the CUDA default) holds u16 results, so ask for them.
    [
        {"dtype": "u16"},
        {"scan_region": (1, 4, 2, 7), "dtype": "u16"},
        {"scan_region": (0, 5, 1, 6), "det_bin": 2, "dtype": "u16"},
    ],
    ids=["full", "region", "region+bin"],
)
def test_cuda_default_is_encoded_and_decodes_the_cpu_load(acquisition, options, tmp_path):
    expected = io.load(acquisition["master"], backend="cpu", **options).to_numpy()
    with io.load(acquisition["master"], backend="cuda", **options) as ds:
        assert ds.backend == "cuda"
        assert ds.representation is io.DataRepresentation.ENCODED
        # Resident = streams + index + model tables; on these few tiny frames the tables
        # (~80 KB) outweigh the dense array, so no size comparison here: the size claim is
        # checked on the reference acquisition (bench/results/h200_load_encoded.json).
        assert ds.nbytes_resident > 0
        assert not hasattr(ds, "__cuda_array_interface__")
        assert np.array_equal(ds.to_numpy(), expected)
        for r, c in [(0, 0), (ds.shape[0] - 1, ds.shape[1] - 1), (ds.shape[0] // 2, 1)]:
            assert np.array_equal(ds[r, c], expected[r, c])
        # .qem written from the GPU reopens on both engines, straight to the device on CUDA.
        path = tmp_path / "x.qem"
        io.save(ds, str(path))
    cpu = io.load(acquisition["master"], backend="cpu", representation="encoded", **options)
    for backend in ("cuda", "cpu"):
        with io.load(str(path), backend=backend, representation="encoded") as back:
            assert back.representation is io.DataRepresentation.ENCODED
            assert np.array_equal(back.to_numpy(), expected)
            if backend == "cpu":
                # The CPU engine encodes the same streams from the same data: the GPU's streams
                # reopened on the CPU take exactly the bytes of the CPU's own encoding. (Resident
                # bytes on the device differ: its model tables are unpacked for the kernels.)
                assert back.nbytes_resident == cpu.nbytes_resident


@pytest.mark.skipif(not CUDA_AVAILABLE, reason=f"CUDA backend unavailable: {_cuda_reason()}")
def test_cuda_u32_result_stays_dense_by_default(acquisition):
    with io.load(acquisition["master"], backend="cuda", dtype="u32") as ds:
        assert ds.representation is io.DataRepresentation.DENSE
    with pytest.raises(ValueError, match="u16|uint16|65535"):
        io.load(acquisition["master"], backend="cuda", dtype="u32", representation="encoded")


@pytest.mark.skipif(not CUDA_AVAILABLE, reason=f"CUDA backend unavailable: {_cuda_reason()}")
def test_encoded_products_after_dense_loads_equal_the_cpu(acquisition):
    """Issue 17: an ENCODED dataset, then DENSE loads (closed, dropped), then a BF image on the
    ENCODED one. At 1cde066 the mask upload raced its kernel (a pageable copy on the legacy
    stream, the kernel on a non-blocking one) and read a freed DENSE load's memory: a lost
    context or a corrupt-stream error. Now every result equals the CPU engine's. (u16 counts:
    ENCODED holds u16; the fixture's u32 counts are clipped for this test.)"""
    from quantem.gpu import detector

    data = np.minimum(acquisition["masked"], 65535).astype(np.uint16)
    with io.load(data, backend="cpu") as cpu:
        disk = detector.fit_disk(cpu)
        center, radius = list(disk.center_px), float(disk.radius_px)
        want = detector.bf(cpu, center=center, radius=radius).image
        want_adf = detector.adf(cpu, center=center, radius=radius).image
    enc = io.load(data, backend="cuda", representation="encoded")
    for i in range(4):
        dense = io.load(data, backend="cuda", representation="dense")
        if i % 2:
            dense.close()
        else:
            del dense
        got = detector.bf(enc, center=center, radius=radius).image
        assert np.array_equal(got, want), f"round {i}"
        assert np.array_equal(detector.adf(enc, center=center, radius=radius).image, want_adf)
    enc.close()


WARM_CHILD = r"""
import json, sys
import numpy as np
import quantem.gpu as qg
from quantem.gpu import _native, device, io
ds = io.load(sys.argv[1])
same = bool(np.array_equal(ds.to_numpy(), np.load(sys.argv[2])))
print(json.dumps({"warm": _native._warm_start, "available": device.available(),
                  "backend": ds.backend, "same": same}))
"""


@pytest.mark.parametrize("value", ["1", "TRUE", "0", ""])
def test_warm_start_env_starts_the_engine_early_and_changes_no_result(acquisition, tmp_path, value):
    """QEM_WARM_START=1 starts the CUDA engine on a thread as the extension loads; the child
    process then resolves the same backends and loads the same counts as this one (on a
    machine without CUDA the thread's failure is the usual one and `auto` runs on the CPU)."""
    expected = tmp_path / "expected.npy"
    np.save(expected, acquisition["masked"])
    env = {**os.environ, "QEM_WARM_START": value}
    p = subprocess.run(
        [sys.executable, "-c", WARM_CHILD, str(acquisition["master"]), str(expected)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    assert rec["warm"] is (value in ("1", "TRUE"))
    assert rec["available"] == device.available()
    assert rec["backend"] == ("cuda" if CUDA_AVAILABLE else "cpu")
    assert rec["same"] is True
