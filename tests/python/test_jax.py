"""JAX takes a CPU dataset and host results through DLPack (``jax.dlpack.from_dlpack``,
``jax.numpy.from_dlpack``): the values are the counts, and JAX's copy is documented, not
silent. XLA's CPU client views only 64-byte-aligned buffers; a dataset's host array is
aligned to 16 bytes (to 64 only by chance), so JAX mostly copies it (``copy=False`` then
raises ``ValueError``). JAX is optional
(scripts/setup.sh installs it where it can); the module skips without it, and the GPU machine
has none (docs/interop.md).
"""

from __future__ import annotations

import numpy as np
import pytest
from disk_data import disk_data

from quantem.gpu import detector, io

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def _counts(shape=(6, 7, 8, 9), dtype=np.uint16, seed=12):
    return np.random.default_rng(seed).integers(0, 60000, shape).astype(dtype)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
@pytest.mark.parametrize("take", ["jax.dlpack", "jax.numpy"])
def test_jax_takes_a_cpu_dataset(dtype, take):
    a = _counts(dtype=dtype)
    ds = io.load(a, backend="cpu", representation="dense")
    f = jax.dlpack.from_dlpack if take == "jax.dlpack" else jnp.from_dlpack
    j = f(ds)
    assert j.shape == a.shape and j.dtype == a.dtype
    assert np.array_equal(np.asarray(j), a)
    # JAX either views the buffer or (unaligned) copies it; after close() the values are
    # still the counts either way (a view holds the dataset's lease).
    ds.close()
    assert np.array_equal(np.asarray(j), a)


def test_jax_copy_semantics_are_explicit():
    a = _counts(shape=(16, 16, 16, 16), seed=13)
    ds = io.load(a, backend="cpu", representation="dense")
    data = np.from_dlpack(ds).ctypes.data
    try:
        j = jax.dlpack.from_dlpack(ds, copy=False)
    except ValueError as e:  # the buffer is not 64-byte aligned: JAX refuses to copy
        assert data % 64 != 0
        assert "aligned" in str(e)
    else:
        assert data % 64 == 0
        assert j.unsafe_buffer_pointer() == data, "copy=False gave a copy"
    assert np.array_equal(np.asarray(jax.dlpack.from_dlpack(ds, copy=True)), a)


def test_jax_takes_host_results():
    data = disk_data()
    ds = io.load(data, backend="cpu")
    bf = detector.bf(ds)
    x64 = getattr(jax, "enable_x64", None)
    if x64 is None:  # older JAX
        x64 = jax.experimental.enable_x64
    with x64(True):  # uint64 images stay uint64
        j = jax.dlpack.from_dlpack(bf)
        assert j.dtype == np.uint64
        assert np.array_equal(np.asarray(j), bf.image)
    m = detector.mean_dp(ds)
    assert np.array_equal(np.asarray(jnp.from_dlpack(m)), m)
