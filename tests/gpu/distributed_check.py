"""GPU check of issue 22 (run on the machine with the GPU):

1. device index: ``io.load(..., device=0)`` runs on CUDA; ``device=<count>`` raises
   InvalidArgumentError naming the range; ``backend="cpu", device=0`` raises
   InvalidArgumentError; a second device in the same process is refused (only with 2+ GPUs).
2. several Dask workers sharing one GPU (``local_gpu_cluster(gpus=[0], workers_per_gpu=k)``):
   ``distributed.products`` and ``distributed.dpc`` equal the single-process CUDA engine
   (integers bit for bit, DPC floats to 1e-9 of the phase scale), 1 vs 2 workers timed
   (bench/distributed_bench.py's runs).

    python tests/gpu/distributed_check.py OUT.json [--scan 128 128 --det 192 192]

Writes a JSON record to OUT.json; exits 1 when a check fails.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import distributed_bench as bench  # noqa: E402


def device_checks() -> dict:
    from quantem.gpu import BackendUnavailableError, InvalidArgumentError, io

    out = {}
    a = np.ones((2, 2, 8, 8), np.uint16)
    with io.load(a, device=0) as ds:
        out["device0_backend"] = ds.backend
        out["device0_device"] = ds.device
    try:
        io.load(a, device=64)
        out["out_of_range"] = "no error (FAIL)"
    except InvalidArgumentError as e:
        out["out_of_range"] = f"InvalidArgumentError: {e}"
    except BackendUnavailableError as e:
        out["out_of_range"] = f"BackendUnavailableError (FAIL): {e}"
    try:
        io.load(a, backend="cpu", device=0)
        out["cpu_with_device"] = "no error (FAIL)"
    except InvalidArgumentError as e:
        out["cpu_with_device"] = f"InvalidArgumentError: {e}"
    out["ok"] = (
        out["device0_backend"] == "cuda"
        and out["out_of_range"].startswith("InvalidArgumentError")
        and out["cpu_with_device"].startswith("InvalidArgumentError")
    )
    return out


def dpc_check(master, scan) -> dict:
    from quantem.gpu import distributed as qd
    from quantem.gpu import dpc, io

    c, client = bench.cluster(2, "cuda", [0])
    try:
        client.wait_for_workers(2, timeout=120)
        got = qd.dpc(
            master,
            client,
            load={"scan_shape": scan, "backend": "cuda"},
            rows_per_block=max(1, scan[0] // 8),
        )
    finally:
        client.close()
        c.close()
    with io.load(master, backend="cuda", scan_shape=scan) as ds:
        one = dpc.run(ds)
    scale = float(np.abs(one.phase).max()) or 1.0
    err = float(np.abs(got.phase - one.phase).max()) / scale
    return {
        "rotation_deg": [got.rotation_deg, one.rotation_deg],
        "transpose": [got.transpose, one.transpose],
        "phase_max_abs_diff_over_scale": err,
        "ok": bool(
            abs(got.rotation_deg - one.rotation_deg) < 1e-6
            and err < 1e-9
            and got.transpose == one.transpose
        ),
    }


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    out_path = sys.argv[1]
    extra = sys.argv[2:]
    rec = {"device": device_checks()}
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "--backend",
            "cuda",
            "--gpus",
            "0",
            "--workers",
            "1",
            "2",
            "--out",
            str(Path(tmp) / "bench.json"),
        ] + extra
        scan = (64, 64)
        if "--scan" in extra:
            i = extra.index("--scan")
            scan = (int(extra[i + 1]), int(extra[i + 2]))
        det = (128, 128)
        if "--det" in extra:
            i = extra.index("--det")
            det = (int(extra[i + 1]), int(extra[i + 2]))
        master, _ = bench.write_data(Path(tmp), scan, det)
        rec["scaling"] = bench.main(args + ["--data", master])
        rec["dpc"] = dpc_check(master, scan)
    rec["ok"] = bool(
        rec["device"]["ok"]
        and rec["dpc"]["ok"]
        and all(all(r["exact_vs_single_process"].values()) for r in rec["scaling"]["distributed"])
    )
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(rec, indent=1, default=str) + "\n")
    print(json.dumps({"ok": rec["ok"], "device": rec["device"]["ok"], "dpc": rec["dpc"]["ok"]}))
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
