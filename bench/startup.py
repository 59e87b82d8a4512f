"""First-use costs through the public Python API, each in a fresh process (issue 23 item 1).

Five child processes in order, each timing from before ``import quantem.gpu``:

* ``nvrtc_cold``: ``QEM_KERNELS=nvrtc`` and an empty kernel disk cache — a fresh machine
  without shipped kernels (every module compiled by NVRTC);
* ``nvrtc_warm``: the same cache again — a later process (modules read from the disk cache);
* ``shipped_cold``: shipped kernels on, another empty disk cache — a fresh machine with this
  build;
* ``shipped_warm``: the same again, a later process;
* ``shipped_warm_start``: that later process with ``QEM_WARM_START=1`` (the CUDA engine
  starts on a thread as the extension loads, beside numpy's import).

Each child times: ``import quantem.gpu``; the first ``io.load(SOURCE)`` (CUDA, the default
ENCODED) and the time from the import's start to its end; a second load; the first
``detector.products(["bf", "abf", "adf", "sum_dp", "com"])`` and a second one; the first
``dpc.run``; and, through ``QEM_KERNEL_LOG``, every kernel module loaded with where it came from
(shipped / disk / compiled) and its milliseconds. A sixth process imports the package under
``python -X importtime`` and records the modules whose import took longest (cumulative). Usage
(on the device, see bench/device.sh ``startup``):

    python3 bench/startup.py /tmp/ref/scan_master.h5 --out startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import quantem.gpu as qg
from quantem.gpu import detector, dpc, io
t_import = time.perf_counter()
src = sys.argv[1]
rec = {"import_s": t_import - t0}
t = time.perf_counter(); ds = io.load(src, backend="cuda"); t1 = time.perf_counter()
rec["first_load_s"] = t1 - t
rec["first_load_stages"] = ds.provenance.get("timings")
rec["import_to_first_load_end_s"] = t1 - t0
rec["representation"] = str(getattr(ds, "representation", None))
t = time.perf_counter()
ds = io.load(src, backend="cuda")
rec["second_load_s"] = time.perf_counter() - t
rec["second_load_stages"] = ds.provenance.get("timings")
which = ["bf", "abf", "adf", "sum_dp", "com"]
t = time.perf_counter()
detector.products(ds, which)
rec["first_products_s"] = time.perf_counter() - t
t = time.perf_counter()
detector.products(ds, which)
rec["second_products_s"] = time.perf_counter() - t
t = time.perf_counter()
dpc.run(ds)
rec["first_dpc_run_s"] = time.perf_counter() - t
t = time.perf_counter()
dpc.run(ds)
rec["second_dpc_run_s"] = time.perf_counter() - t
rec["total_s"] = time.perf_counter() - t0
print("RESULT " + json.dumps(rec))
"""


def child(source: str, env: dict, log: Path) -> dict:
    env = {**os.environ, **env, "QEM_KERNEL_LOG": str(log)}
    log.unlink(missing_ok=True)
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", CHILD, source], env=env, capture_output=True, text=True, timeout=300
    )
    wall = time.perf_counter() - t
    rec: dict = {"process_wall_s": wall, "rc": p.returncode}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            rec.update(json.loads(line[7:]))
    if p.returncode != 0:
        rec["stderr_tail"] = p.stderr[-3000:]
    mods = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    by_source: dict = {}
    for m in mods:
        s = by_source.setdefault(m["source"], {"modules": 0, "ms": 0.0, "compile_ms": 0.0})
        s["modules"] += 1
        s["ms"] += m["total_ms"]
        s["compile_ms"] += m["compile_ms"]
    rec["kernel_modules"] = by_source
    rec["kernel_log"] = mods
    return rec


def import_profile(top: int = 15) -> dict:
    """`python -X importtime -c "import quantem.gpu"`: the wall time and the `top` modules by
    cumulative microseconds (self, cumulative), the package's own and its dependencies'."""
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import quantem.gpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    wall = time.perf_counter() - t
    rows = []
    for line in p.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[0].startswith("import time:") and parts[1].strip().isdigit():
            rows.append((parts[2].strip(), int(parts[0].split(":")[1]), int(parts[1])))
    rows.sort(key=lambda r: -r[2])
    return {
        "process_wall_s": wall,
        "rc": p.returncode,
        "top_cumulative_us": [
            {"module": m, "self_us": s_, "cumulative_us": c} for m, s_, c in rows[:top]
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qem-startup-"))
    runs = {}
    plan = [
        ("nvrtc_cold", {"QEM_KERNELS": "nvrtc"}, "cache_nvrtc"),
        ("nvrtc_warm", {"QEM_KERNELS": "nvrtc"}, "cache_nvrtc"),
        ("shipped_cold", {}, "cache_shipped"),
        ("shipped_warm", {}, "cache_shipped"),
        ("shipped_warm_start", {"QEM_WARM_START": "1"}, "cache_shipped"),
    ]
    for name, env, cache in plan:
        env = {**env, "QUANTEM_GPU_KERNEL_CACHE": str(work / cache)}
        for k in ("QEM_KERNELS", "QEM_WARM_START"):
            if k not in env:
                os.environ.pop(k, None)
        r = child(a.source, env, work / f"{name}.jsonl")
        runs[name] = r
        keys = (
            "import_s",
            "first_load_s",
            "import_to_first_load_end_s",
            "second_load_s",
            "first_products_s",
            "second_products_s",
            "first_dpc_run_s",
        )
        print(
            name,
            {k: round(r[k], 4) for k in keys if k in r},
            {k: v["modules"] for k, v in r["kernel_modules"].items()},
            "rc",
            r["rc"],
            flush=True,
        )
    runs["import_profile"] = import_profile()
    print("import_profile", runs["import_profile"]["top_cumulative_us"][:5], flush=True)
    rec = {
        "what": "first-use costs in fresh processes through the Python API (issue 23 item 1)",
        "command": f"python3 bench/startup.py {a.source} --out {a.out}",
        "source": a.source,
        "runs": runs,
        "revision": os.environ.get("QEM_GIT_REVISION"),
    }
    Path(a.out).write_text(json.dumps(rec, indent=1))
    return 0 if all(r["rc"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
