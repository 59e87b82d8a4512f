"""quantem.gpu.distributed on a LocalCluster of 2 worker processes (CPU backend).

Expected integers come from numpy on the data as written (and must also equal the
single-process engine bit for bit); floats (CoM, DPC) are compared with the single-process
engine, which runs the same Rust arithmetic on the same exact integers (atol 1e-12 relative to
the field's scale; in practice they are identical).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from helpers import write_acquisition

distributed = pytest.importorskip("distributed")  # scripts/setup.sh installs it
pd = pytest.importorskip("pandas")

from quantem.gpu import (  # noqa: E402  # noqa: E402
    BackendUnavailableError,
    InvalidArgumentError,
    SourceError,
    detector,
    dpc,
    io,
    lazy,
    ssb,
)
from quantem.gpu import distributed as qd  # noqa: E402

SCAN = (9, 6)  # 9 rows: blocks of 2 rows leave a partial last block
DET = (16, 15)


def _disk_data(seed: int) -> np.ndarray:
    """uint16 frames with a bright disk whose centre moves with the scan position."""
    rng = np.random.default_rng(seed)
    rr, cc = np.mgrid[: DET[0], : DET[1]]
    out = np.empty(SCAN + DET, np.uint16)
    for r in range(SCAN[0]):
        for c in range(SCAN[1]):
            cr = 7.5 + 0.6 * np.sin(r / 2.0 + seed)
            ccol = 7.0 + 0.5 * np.cos(c / 1.7)
            lam = np.where((rr - cr) ** 2 + (cc - ccol) ** 2 <= 16.0, 60.0, 2.0)
            out[r, c] = rng.poisson(lam)
    return out


@pytest.fixture(scope="module")
def acquisitions(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    out = []
    for i in range(3):
        data = _disk_data(i)
        master, _, written = write_acquisition(
            root / f"a{i}", name="scan", data=data, dtype=np.uint16, fpf=8
        )
        out.append((str(master), written))
    return root, out


@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    cluster = LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, silence_logs=40
    )
    c = Client(cluster)
    yield c
    c.close()
    cluster.close()


def _scan(master):
    return {"scan_shape": SCAN}


def test_products_exact_against_numpy_and_single_process(acquisitions, client):
    _, acq = acquisitions
    master, data = acq[0]
    want_sum = data.reshape(-1, *DET).sum(axis=0, dtype=np.uint64)
    which = ["sum_dp", "mean_dp", "max_dp", "moments", "bf", "adf", "com"]
    got = qd.products(master, client, which, load=_scan(master), rows_per_block=2)
    # 5 blocks of whole rows, computed by both workers.
    assert [b["region"] for b in got["blocks"] if b["stage"] == "pass 1"] == [
        (0, 2, 0, 6),
        (2, 4, 0, 6),
        (4, 6, 0, 6),
        (6, 8, 0, 6),
        (8, 9, 0, 6),
    ]
    assert len({b["pid"] for b in got["blocks"]}) == 2
    assert got["sum_dp"].dtype == np.uint64 and np.array_equal(got["sum_dp"], want_sum)
    assert np.array_equal(got["max_dp"], data.reshape(-1, *DET).max(axis=0))
    kr = np.arange(DET[0], dtype=np.uint64)[:, None]
    assert np.array_equal(got["moments"]["sum"], data.sum(axis=(2, 3), dtype=np.uint64))
    assert np.array_equal(
        got["moments"]["m_row"], (data.astype(np.uint64) * kr).sum(axis=(2, 3), dtype=np.uint64)
    )
    with io.load(master, backend="cpu", scan_shape=SCAN) as ds:
        one = detector.products(ds, which)
    assert np.array_equal(got["mean_dp"], one["mean_dp"])
    for name in ("bf", "adf"):
        assert got[name]["image"].dtype == np.uint64
        assert np.array_equal(got[name]["image"], one[name].image), name
        assert got[name]["mask_pixels"] == one[name].mask_pixels
    assert got["disk"]["center_px"] == pytest.approx(one.disk.center_px, abs=0)
    assert got["disk"]["radius_px"] == one.disk.radius_px
    np.testing.assert_allclose(got["com"].com_row, one["com"].com_row, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got["com"].com_col, one["com"].com_col, rtol=0, atol=1e-12)


def test_scan_region_and_binning_blocks(acquisitions, client):
    _, acq = acquisitions
    master, data = acq[1]
    load = {"scan_shape": SCAN, "scan_region": (1, 8, 2, 6), "det_bin": 2}
    got = qd.products(master, client, ["sum_dp", "bf"], load=load, n_blocks=3)
    with io.load(master, backend="cpu", **load) as ds:
        one = detector.products(ds, ["sum_dp", "bf"])
    assert np.array_equal(got["sum_dp"], one["sum_dp"])
    assert np.array_equal(got["bf"]["image"], one["bf"].image)


def test_dpc_on_merged_moments(acquisitions, client):
    _, acq = acquisitions
    master, _ = acq[0]
    got = qd.dpc(master, client, load=_scan(master), rows_per_block=3)
    with io.load(master, backend="cpu", scan_shape=SCAN) as ds:
        one = dpc.run(ds)
    assert got.rotation_deg == pytest.approx(one.rotation_deg, abs=1e-9)
    assert got.transpose == one.transpose and got.sign_criterion == one.sign_criterion
    scale = float(np.abs(one.phase).max())
    for f in ("com_row", "com_col", "dpc_row", "dpc_col"):
        np.testing.assert_allclose(getattr(got, f), getattr(one, f), rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.phase, one.phase, rtol=0, atol=1e-12 * scale)
    assert got.provenance["operation"] == "distributed.dpc" and got.provenance["blocks"]


def test_bf_pixels_match_the_data(acquisitions, client):
    _, acq = acquisitions
    master, data = acq[2]
    got = qd.bf_pixels(master, client, load=_scan(master), rows_per_block=4)
    flat = data.reshape(SCAN + (-1,))
    assert got["images"].shape == SCAN + (got["pixels"].size,)
    assert np.array_equal(got["images"], flat[:, :, got["pixels"]])
    assert got["pixels"].size > 20  # the disk of radius 4


@pytest.mark.parametrize("bf_threshold", [0.0, 0.5])
def test_bf_pixels_are_the_pixels_ssb_selects(acquisitions, client, bf_threshold):
    # The distributed selection is written in numpy over the merged mean DP; it must pick
    # exactly the pixels the engine's SSB preparation picks from the same data.
    _, acq = acquisitions
    master, _ = acq[2]
    got = qd.bf_pixels(
        master, client, load=_scan(master), rows_per_block=4, bf_threshold=bf_threshold
    )
    with io.load(master, backend="cpu", scan_shape=SCAN) as ds:
        info = ssb.SSB(
            ds, voltage_kv=300, semiangle_mrad=20, scan_step_a=0.5, bf_threshold=bf_threshold
        ).info
    rows_cols = np.asarray(info["bf_pixels"], dtype=np.int64)
    want = np.sort(rows_cols[:, 0] * DET[1] + rows_cols[:, 1])
    assert np.array_equal(np.sort(got["pixels"]), want)
    assert got["disk"]["radius_px"] == pytest.approx(info["bf_radius_px"], abs=1e-12)


def test_batch_of_three_with_one_failure(acquisitions, client, tmp_path):
    root, acq = acquisitions
    broken = tmp_path / "broken_master.h5"
    broken.write_bytes(b"not an HDF5 file")
    sources = [a[0] for a in acq] + [str(broken)]
    table = qd.batch(
        sources,
        client,
        products=["sum_dp", "adf"],
        dpc=True,
        load={"scan_shape": SCAN},
        out_dir=tmp_path / "out",
    )
    assert isinstance(table, pd.DataFrame) and len(table) == 4
    assert table["ok"].tolist() == [True, True, True, False]
    assert table.loc[3, "error_type"] == "SourceError"
    for i, (master, data) in enumerate(acq):
        saved = Path(table.loc[i, "out_dir"])
        want = data.reshape(-1, *DET).sum(axis=0, dtype=np.uint64)
        assert np.array_equal(np.load(saved / "sum_dp.npy"), want)
        with io.load(master, backend="cpu", scan_shape=SCAN) as ds:
            assert np.array_equal(np.load(saved / "adf.npy"), detector.adf(ds).image)
            assert table.loc[i, "dpc_rotation_deg"] == pytest.approx(dpc.run(ds).rotation_deg)


def test_dataset_pickles_as_a_handle(acquisitions, tmp_path):
    _, acq = acquisitions
    master, data = acq[0]
    with io.load(master, backend="cpu", scan_shape=SCAN, scan_region=(1, 5, 0, 6)) as ds:
        blob = pickle.dumps(ds)
        assert len(blob) < 4096 < ds.nbytes_resident  # the bytes do not travel
        back = pickle.loads(blob)
        assert back.shape == ds.shape
        assert np.array_equal(back.to_numpy(), data[1:5])
        back.close()
    arr = io.load(data, backend="cpu")
    with pytest.raises(InvalidArgumentError, match="in-memory array"):
        pickle.dumps(arr)
    # A source changed since pickling is refused, not silently reread.
    copy = Path(master)
    with io.load(master, backend="cpu", scan_shape=SCAN) as ds:
        blob = pickle.dumps(ds)
    st = os.stat(copy)
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        with pytest.raises(SourceError, match="changed"):
            pickle.loads(blob)
    finally:
        os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_to_dask_against_the_engine(acquisitions, client):
    _, acq = acquisitions
    master, data = acq[1]
    with io.load(master, backend="cpu", scan_shape=SCAN) as ds:
        arr = lazy.to_dask(ds, rows_per_block=2)
        assert arr.chunks[0] == (2, 2, 2, 2, 1) and arr.shape == SCAN + DET
        got = client.compute(arr).result()
        assert np.array_equal(got, ds.to_numpy())
    lz = io.load_lazy(master, scan_shape=SCAN, scan_region=(2, 9, 1, 5), backend="cpu")
    assert np.array_equal(
        lz.sum(axis=(0, 1)).compute(scheduler=client.get), data[2:9, 1:5].sum(axis=(0, 1))
    )


def test_worker_killed_mid_task_is_retried_exactly(acquisitions, client, tmp_path, monkeypatch):
    _, acq = acquisitions
    master, data = acq[0]
    marker = str(tmp_path / "killed-once")
    real = qd._block_task

    def dies_once(*args):
        # The first block task to run kills its worker process (as an OOM kill would).
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return real(*args)
        os.close(fd)
        os._exit(1)

    monkeypatch.setattr(qd, "_block_task", dies_once)
    got = qd.products(master, client, ["sum_dp", "moments"], load=_scan(master), rows_per_block=2)
    assert os.path.exists(marker)
    assert np.array_equal(got["sum_dp"], data.reshape(-1, *DET).sum(axis=0, dtype=np.uint64))
    assert np.array_equal(got["moments"]["sum"], data.sum(axis=(2, 3), dtype=np.uint64))


def test_device_index_is_validated():
    with pytest.raises(InvalidArgumentError):
        io.load(np.zeros((2, 2, 4, 4), np.uint16), backend="cpu", device=0)
    with pytest.raises(InvalidArgumentError):
        io.load(np.zeros((2, 2, 4, 4), np.uint16), device=-1)
    from quantem.gpu import device

    if "cuda" in device.available():
        with pytest.raises(InvalidArgumentError, match="out of range"):
            io.load(np.zeros((2, 2, 4, 4), np.uint16), device=64)
    else:
        # No GPU: a device index asks for CUDA; it is an error, never a CPU run.
        with pytest.raises(BackendUnavailableError):
            io.load(np.zeros((2, 2, 4, 4), np.uint16), device=0)
