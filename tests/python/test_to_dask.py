"""``ds.to_dask()``: a lazy dask array of the dataset's own source and load options, equal to
the dataset's dense frames and to the data as written (threaded scheduler, no cluster)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import bin_reference, counts, write_acquisition

da = pytest.importorskip("dask.array")

import quantem.gpu as qg  # noqa: E402
from quantem.gpu import io  # noqa: E402

SCAN = (7, 5)
DET = (12, 10)


@pytest.fixture(scope="module")
def acquisition(tmp_path_factory):
    data = counts(SCAN + DET, dtype=np.uint16, seed=3)
    master, _, written = write_acquisition(
        tmp_path_factory.mktemp("todask"), data=data, dtype=np.uint16, fpf=5
    )
    return str(master), written


@pytest.mark.parametrize("representation", ["dense", "encoded"])
def test_to_dask_equals_the_dense_frames(acquisition, representation):
    master, written = acquisition
    with io.load(master, backend="cpu", representation=representation) as ds:
        arr = ds.to_dask(rows_per_block=3)
        assert isinstance(arr, da.Array)
        assert arr.shape == SCAN + DET and arr.dtype == ds.dtype
        assert arr.chunks[0] == (3, 3, 1)
        got = arr.compute(scheduler="threads")
        assert np.array_equal(got, ds.to_numpy())
        assert np.array_equal(got, written)
        # Slices compute only their own blocks' values.
        assert np.array_equal(arr[4:6, :, 2, 3].compute(), written[4:6, :, 2, 3])


def test_to_dask_keeps_the_load_options(acquisition):
    master, written = acquisition
    ds = io.load(master, backend="cpu", scan_region=(1, 6, 1, 4), det_bin=2)
    arr = ds.to_dask()
    want = bin_reference(written[1:6, 1:4], 2)
    assert arr.shape == want.shape
    assert np.array_equal(arr.compute(scheduler="threads"), want)
    assert np.array_equal(arr.compute(scheduler="threads"), ds.to_numpy())


def test_to_dask_refuses_an_in_memory_dataset_and_bad_blocks(acquisition):
    ds = io.load(np.zeros((2, 2, 4, 4), np.uint16), backend="cpu")
    with pytest.raises(qg.InvalidArgumentError, match="no source to reopen"):
        ds.to_dask()
    with io.load(acquisition[0], backend="cpu") as ds:
        with pytest.raises(qg.InvalidArgumentError, match="rows_per_block"):
            ds.to_dask(rows_per_block=0)
        with pytest.raises(qg.ArgumentTypeError, match="rows_per_block"):
            ds.to_dask(rows_per_block=2.0)
