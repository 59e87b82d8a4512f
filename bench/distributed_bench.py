"""Scan-block products on a dask.distributed LocalCluster: 1 vs N workers, exact vs one process.

Writes a Dectris-style acquisition (tests/tools/make_dectris.py: h5py + hdf5plugin, bslz4
chunks of one frame, uint16 counts with a moving BF disk), then times

* the single-process engine: ``io.load`` + ``detector.products`` (one pass), and
* ``distributed.products`` on a LocalCluster of 1, 2, ... worker processes (the cluster is
  started and warmed before timing; each run loads every block on the workers),

checks that every integer product equals the single-process one bit for bit, and writes a JSON
record. On a GPU (``--backend cuda``) every worker is given the same ``CUDA_VISIBLE_DEVICES``
(several workers sharing one card) unless ``--gpus`` lists several.

    python bench/distributed_bench.py --scan 64 64 --det 128 128 --workers 1 2 \\
        --out bench/results/cpu_distributed_workers.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "tools"))

PRODUCTS = ["sum_dp", "max_dp", "moments", "bf", "adf"]


def write_data(folder: Path, scan, det, seed=0) -> tuple[str, int]:
    import make_dectris

    rng = np.random.default_rng(seed)
    rr, cc = np.mgrid[: det[0], : det[1]]
    r_disk = det[0] / 8
    data = np.empty(tuple(scan) + tuple(det), np.uint16)
    for r in range(scan[0]):
        cr = det[0] / 2 + 1.5 * np.sin(r / 5)
        for c in range(scan[1]):
            cc0 = det[1] / 2 + 1.5 * np.cos(c / 7)
            lam = np.where((rr - cr) ** 2 + (cc - cc0) ** 2 <= r_disk**2, 40.0, 0.5)
            data[r, c] = rng.poisson(lam)
    res = make_dectris.write_dectris(
        str(folder / "bench"), data, frames_per_file=1000, dtype=np.uint16
    )
    size = sum(os.path.getsize(p) for p in res["data_files"])
    return res["master"], size


def git_revision() -> str:
    """``QEM_GIT_REVISION`` when set (bench/device.sh sets it from the carry: the device's copy
    of the tree may carry another HEAD), else ``git rev-parse HEAD``."""
    if os.environ.get("QEM_GIT_REVISION"):
        return os.environ["QEM_GIT_REVISION"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def single(master, scan, backend, repeats):
    from quantem.gpu import detector, io

    times, res = [], None
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        with io.load(master, backend=backend, scan_shape=scan) as ds:
            res = detector.products(ds, PRODUCTS)
            dev = ds.device
        times.append(time.perf_counter() - t0)
    return times[1:], res, dev


def cluster(n_workers, backend, gpus):
    from distributed import Client, LocalCluster

    from quantem.gpu import distributed as qd

    if backend == "cuda":
        c = qd.local_gpu_cluster(
            gpus=gpus, workers_per_gpu=max(1, n_workers // len(gpus)), silence_logs=40
        )
    else:
        c = LocalCluster(
            n_workers=n_workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=40,
        )
    return c, Client(c)


def distributed_runs(master, scan, backend, n_workers, gpus, repeats, rows_per_block):
    from quantem.gpu import distributed as qd

    c, client = cluster(n_workers, backend, gpus)
    try:
        client.wait_for_workers(n_workers, timeout=120)
        load = {"scan_shape": scan, "backend": backend}
        times, out = [], None
        for _ in range(repeats + 1):  # the first run warms workers (imports, kernels)
            t0 = time.perf_counter()
            out = qd.products(master, client, PRODUCTS, load=load, rows_per_block=rows_per_block)
            times.append(time.perf_counter() - t0)
        return times[1:], out
    finally:
        client.close()
        c.close()


def exact(out, one) -> dict[str, bool]:
    verdict = {
        "sum_dp": bool(np.array_equal(out["sum_dp"], one["sum_dp"])),
        "max_dp": bool(np.array_equal(out["max_dp"], one["max_dp"])),
        "mean_dp": bool(np.array_equal(out["mean_dp"], one["mean_dp"]))
        if "mean_dp" in out and "mean_dp" in one
        else None,
    }
    for k in ("sum", "m_row", "m_col"):
        verdict[f"moments.{k}"] = bool(np.array_equal(out["moments"][k], one["moments"][k]))
    for d in ("bf", "adf"):
        verdict[d] = bool(np.array_equal(out[d]["image"], one[d].image))
    return {k: v for k, v in verdict.items() if v is not None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scan", type=int, nargs=2, default=(64, 64))
    ap.add_argument("--det", type=int, nargs=2, default=(128, 128))
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--gpus", type=int, nargs="+", default=[0])
    ap.add_argument("--rows-per-block", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--data", default=None, help="an existing master file (else one is written)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    scan = tuple(a.scan)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        if a.data:
            master, size = a.data, None
        else:
            master, size = write_data(Path(tmp), scan, tuple(a.det))
        rows = a.rows_per_block or max(1, scan[0] // 8)
        t_one, one, device = single(master, scan, a.backend, a.repeats)
        runs = []
        for n in a.workers:
            t, out = distributed_runs(master, scan, a.backend, n, a.gpus, a.repeats, rows)
            runs.append(
                {
                    "workers": n,
                    "p50_s": statistics.median(t),
                    "runs_s": t,
                    "blocks": sum(1 for b in out["blocks"] if b["stage"] == "pass 1"),
                    "worker_pids": sorted({b["pid"] for b in out["blocks"]}),
                    "block_seconds_p50": statistics.median(b["seconds"] for b in out["blocks"]),
                    "exact_vs_single_process": exact(out, one),
                }
            )
            print(
                f"{n} worker(s): p50 {runs[-1]['p50_s']:.3f} s  exact "
                f"{all(runs[-1]['exact_vs_single_process'].values())}"
            )
    rec = {
        "what": "distributed.products (scan blocks) vs the single-process engine",
        "command": "python bench/distributed_bench.py " + " ".join(argv or sys.argv[1:]),
        "git_revision": git_revision(),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "device": device,
            "load_average_before_after": [load_before, os.getloadavg()],
        },
        "backend": a.backend,
        "source": {
            "scan": scan,
            "detector": tuple(a.det),
            "dtype": "uint16",
            "compressed_bytes": size,
            "dense_bytes": int(np.prod(scan + tuple(a.det))) * 2,
            "chunking": "bslz4, one frame per chunk, 1000 frames per data file",
        },
        "products": PRODUCTS,
        "rows_per_block": rows,
        "single_process": {"p50_s": statistics.median(t_one), "runs_s": t_one},
        "distributed": runs,
        "notes": "p50 over --repeats runs after one warm-up run; a distributed run includes "
        "two passes (sum DP for the disk fit, then the detector images), scheduling "
        "and the merge on the client; the files sit in the page cache after the "
        "first read.",
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1, default=str) + "\n")
    print(f"single process: p50 {rec['single_process']['p50_s']:.3f} s; wrote {a.out}")
    return rec


if __name__ == "__main__":
    main()
