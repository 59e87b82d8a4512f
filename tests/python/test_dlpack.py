"""DLPack: results export their host arrays without a copy (``np.from_dlpack`` shares the
memory and gives the same values). Datasets: tests/python/test_dlpack_dataset.py."""

from __future__ import annotations

import numpy as np
import pytest
from disk_data import disk_data

import quantem.gpu as qg
from quantem.gpu import detector, dpc, io, ssb


@pytest.fixture(scope="module")
def results():
    ds = io.load(disk_data(), backend="cpu")
    s = ssb.SSB(ds, voltage_kv=300.0, semiangle_mrad=20.0, scan_step_a=0.5)
    return {
        "bf": (detector.bf(ds), lambda r: r.image),
        "dpc": (dpc.run(ds), lambda r: r.phase),
        "ssb": (s.reconstruct({"C10": 10.0}), lambda r: r.phase),
        "fit": (
            s.fit(seed=0, global_evals=2, local_max_iter=2, local_starts=1),
            lambda r: r.result.phase,
        ),
    }


@pytest.mark.parametrize("key", ["bf", "dpc", "ssb", "fit"])
def test_results_export_without_a_copy(results, key):
    r, main = results[key]
    want = main(r)
    assert r.__dlpack_device__() == (1, 0)
    got = np.from_dlpack(r)
    assert np.shares_memory(got, want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)
    copied = np.from_dlpack(r, copy=True)
    assert not np.shares_memory(copied, want) and np.array_equal(copied, want)


def test_bf_values_are_the_exact_counts(results):
    r, _ = results["bf"]
    got = np.from_dlpack(r)
    assert got.dtype == np.uint64 and got.shape == (8, 9)
    assert int(got.sum()) == int(r.image.sum()) > 0


def test_com_exports_neither_component(results):
    ds = io.load(disk_data(), backend="cpu")
    com = dpc.center_of_mass(ds)
    with pytest.raises(qg.DLPackUnavailableError, match="two arrays") as e:
        np.from_dlpack(com)
    assert "com_row" in e.value.expected
    assert np.shares_memory(np.from_dlpack(com.com_row), com.com_row)
