"""Plain HDF5 layouts, numpy sources, regions, binning and dtype policy.

Expected values come from h5py (decode) and numpy (slicing, uint64 block sums).
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from helpers import DET, SCAN, bin_reference, bslz4, counts, write_acquisition

import quantem.gpu as qg
from quantem.gpu import io


def write_plain(path, data, chunks, name="/data", nelems=0, extra=None):
    with h5py.File(path, "w") as f:
        f.create_dataset(name, data=data, chunks=chunks, **bslz4(nelems))
        for k, v in (extra or {}).items():
            f.create_dataset(k, data=v)
    with h5py.File(path, "r") as f:
        back = f[name][...]
    np.testing.assert_array_equal(back, data)
    return back


# ----------------------------------------------------------------------------- plain HDF5


def test_bitshuffle_block_size_256(tmp_path):
    # 23 x 21 = 483 u16 pixels: LZ4 blocks of 256 and 224 elements, 3 left raw.
    data = counts((12, 23, 21), np.uint16, seed=1, high=60000)
    p = tmp_path / "nelems256.h5"
    expected = write_plain(p, data, chunks=(1, 23, 21), nelems=256)
    with io.load(p, scan_shape=(3, 4), dataset_path="/data") as ds:
        assert ds.shape == (3, 4, 23, 21) and ds.dtype == np.uint16
        np.testing.assert_array_equal(ds.to_numpy(), expected.reshape(3, 4, 23, 21))
        np.testing.assert_array_equal(ds[2, 1], expected[9])


def test_single_dataset_found_without_dataset_path(tmp_path):
    data = counts((6, 9, 8), np.uint16, seed=2)
    p = tmp_path / "single.h5"
    expected = write_plain(p, data, chunks=(1, 9, 8), name="/some/where/frames")
    with io.load(p, scan_shape=(2, 3)) as ds:
        np.testing.assert_array_equal(ds.to_numpy(), expected.reshape(2, 3, 9, 8))


def test_chunks_of_three_frames_with_partial_last_chunk(tmp_path):
    # N = 10 is not divisible by 3: the last chunk holds one valid frame.
    data = counts((10, 9, 8), np.uint16, seed=3, high=3000)
    p = tmp_path / "chunk3.h5"
    expected = write_plain(p, data, chunks=(3, 9, 8))
    with io.load(p, scan_shape=(2, 5), dataset_path="/data") as ds:
        a = ds.to_numpy()
        np.testing.assert_array_equal(a, expected.reshape(2, 5, 9, 8))
        for n in range(10):
            np.testing.assert_array_equal(ds[n // 5, n % 5], expected[n], err_msg=f"frame {n}")


def test_inline_4d_dataset_with_dataset_path(tmp_path):
    data = counts((3, 4, 9, 8), np.uint16, seed=4, high=9000)
    p = tmp_path / "inline4d.h5"
    decoy = counts((5, 9, 8), np.uint16, seed=5)
    expected = write_plain(
        p, data, chunks=(1, 2, 9, 8), name="/entry/data4d", extra={"/entry/decoy": decoy}
    )
    with io.load(p, dataset_path="/entry/data4d") as ds:
        assert ds.shape == (3, 4, 9, 8)
        np.testing.assert_array_equal(ds.to_numpy(), expected)
        np.testing.assert_array_equal(ds[-1, 1], expected[2, 1])
        assert ds.provenance["dataset_path"].strip("/") == "entry/data4d"


def test_wrong_dataset_path(tmp_path):
    p = tmp_path / "x.h5"
    write_plain(p, counts((4, 8, 8), np.uint16), chunks=(1, 8, 8))
    with pytest.raises((qg.SourceError, qg.InvalidArgumentError)) as e:
        io.load(p, scan_shape=(2, 2), dataset_path="/nope")
    assert "/nope" in str(e.value) or "nope" in str(e.value)


# ----------------------------------------------------------------------------- numpy sources


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_numpy_4d(dtype):
    a = counts((3, 4, 5, 6), dtype, seed=6)
    with io.load(a) as ds:
        assert ds.shape == a.shape and ds.dtype == dtype
        np.testing.assert_array_equal(ds.to_numpy(), a)
        np.testing.assert_array_equal(ds[2, 3], a[2, 3])
        assert ds.provenance["source_kind"] in ("numpy", "array")


def test_numpy_3d_with_scan_shape():
    a = counts((12, 5, 6), np.uint16, seed=7)
    with io.load(a, scan_shape=(3, 4)) as ds:
        np.testing.assert_array_equal(ds.to_numpy(), a.reshape(3, 4, 5, 6))
    with pytest.raises((qg.SourceError, qg.InvalidArgumentError)):
        io.load(a, scan_shape=(5, 5))


def test_numpy_non_contiguous_is_copied_in_logical_order():
    base = counts((4, 6, 5, 8), np.uint16, seed=8)
    views = [base[:, ::2], base[..., ::2], base.transpose(1, 0, 2, 3), np.asfortranarray(base)]
    for v in views:
        with io.load(v) as ds:
            np.testing.assert_array_equal(ds.to_numpy(), v)
    # the source is not modified and later changes do not leak in
    a = base.copy()
    ds = io.load(a)
    a[...] = 0
    np.testing.assert_array_equal(ds.to_numpy(), base)
    ds.close()


# ----------------------------------------------------------------------------- regions and bins


def region_dict(r):
    return dict(zip(("row_start", "row_stop", "col_start", "col_stop"), r))


def test_scan_region(acquisition):
    sr = (1, 4, 2, 6)
    with io.load(acquisition["master"], scan_shape=SCAN, scan_region=sr) as ds:
        expected = acquisition["masked"][1:4, 2:6]
        assert ds.shape == expected.shape
        np.testing.assert_array_equal(ds.to_numpy(), expected)
        np.testing.assert_array_equal(ds[0, 0], acquisition["masked"][1, 2])
        assert ds.provenance["scan_region"] == region_dict(sr)


def test_detector_region(acquisition):
    dr = (2, 9, 3, 12)
    with io.load(acquisition["master"], scan_shape=SCAN, detector_region=dr) as ds:
        expected = acquisition["masked"][:, :, 2:9, 3:12]
        assert ds.shape == expected.shape
        np.testing.assert_array_equal(ds.to_numpy(), expected)
        assert ds.provenance["detector_region"] == region_dict(dr)


@pytest.mark.parametrize("b", [2, 3, 4, 12, 13])
def test_det_bin_with_partial_edge_blocks(acquisition, b):
    expected = bin_reference(acquisition["masked"], b)
    with io.load(acquisition["master"], scan_shape=SCAN, det_bin=b) as ds:
        assert ds.shape == SCAN + (-(-DET[0] // b), -(-DET[1] // b))
        a = ds.to_numpy()
        assert a.dtype == np.uint32
        np.testing.assert_array_equal(a.astype(np.uint64), expected)
        assert ds.provenance["det_bin"] == b


def test_regions_then_bin(acquisition):
    sr, dr, b = (0, 5, 1, 7), (1, 11, 0, 12), 3
    raw = acquisition["raw"]
    expected = bin_reference(raw[0:5, 1:7, 1:11, 0:12], b)
    with io.load(
        acquisition["master"],
        scan_shape=SCAN,
        scan_region=sr,
        detector_region=dr,
        det_bin=b,
        apply_mask=False,
    ) as ds:
        np.testing.assert_array_equal(ds.to_numpy().astype(np.uint64), expected)


def test_u16_bin_widens_to_u32():
    a = np.full((2, 3, 5, 5), 65535, np.uint16)
    a[0, 0, 0, 0] = 7
    with io.load(a, det_bin=2) as ds:
        assert ds.dtype == np.uint32  # 4 x 65535 does not fit uint16
        np.testing.assert_array_equal(ds.to_numpy().astype(np.uint64), bin_reference(a, 2))
    with io.load(a, det_bin=1) as ds:
        assert ds.dtype == np.uint16


def test_bad_regions_and_bins(acquisition):
    m = acquisition["master"]
    for kwargs in [
        dict(scan_region=(0, 6, 0, 7)),
        dict(scan_region=(2, 2, 0, 7)),
        dict(detector_region=(0, 11, 0, 14)),
        dict(det_bin=0),
        dict(det_bin=20),  # larger than both detector extents
    ]:
        with pytest.raises(qg.InvalidArgumentError):
            io.load(m, scan_shape=SCAN, **kwargs)


# ----------------------------------------------------------------------------- dtype policy


def test_u16_from_u32_that_fits(acquisition):
    assert acquisition["masked"].max() <= 65535
    with io.load(acquisition["master"], scan_shape=SCAN, dtype="u16") as ds:
        assert ds.dtype == np.uint16
        np.testing.assert_array_equal(ds.to_numpy(), acquisition["masked"].astype(np.uint16))
        assert ds.provenance["source_dtype"] == "u32" and ds.provenance["result_dtype"] == "u16"
    with io.load(acquisition["master"], scan_shape=SCAN, dtype=np.uint16) as ds:
        assert ds.dtype == np.uint16


def test_u16_from_u32_that_does_not_fit(tmp_path):
    data = counts(SCAN + DET, np.uint32, seed=9)
    data[3, 2, 5, 5] = 70000
    master, _, _ = write_acquisition(tmp_path, data=data)
    with pytest.raises(qg.DtypeOverflowError) as e:
        io.load(master, scan_shape=SCAN, dtype="u16")
    assert isinstance(e.value, ValueError)
    assert "70000" in str(e.value) or "u16" in str(e.value).lower()
    # native keeps u32 and the exact value
    with io.load(master, scan_shape=SCAN) as ds:
        assert ds[3, 2][5, 5] == 70000


def test_u8_saturates_and_counts(tmp_path):
    a = counts((3, 4, 6, 7), np.uint16, seed=10, high=1000)
    n_over = int((a > 255).sum())
    assert n_over > 0
    with io.load(a, dtype="u8") as ds:
        assert ds.dtype == np.uint8
        np.testing.assert_array_equal(ds.to_numpy(), np.minimum(a, 255).astype(np.uint8))
        assert ds.provenance["saturated_values"] == n_over


def test_u32_widens(acquisition):
    a = counts((2, 3, 4, 5), np.uint16, seed=11, high=60000)
    with io.load(a, dtype="u32") as ds:
        assert ds.dtype == np.uint32
        np.testing.assert_array_equal(ds.to_numpy(), a.astype(np.uint32))


def test_memory_budget(acquisition):
    nbytes = int(np.prod(SCAN + DET)) * 4
    with pytest.raises(qg.MemoryBudgetError) as e:
        io.load(acquisition["master"], scan_shape=SCAN, memory_budget=nbytes // 2)
    assert str(nbytes // 2) in str(e.value) or e.value.expected
    # On the CPU engine the result is the only buffer, so a budget of exactly its size suffices.
    # (The CUDA engine also admits its batch buffers, tables and allocator reserve.)
    with io.load(acquisition["master"], scan_shape=SCAN, memory_budget=nbytes, backend="cpu") as ds:
        assert ds.nbytes_resident <= nbytes
