"""CPU engine against LiberTEM's inline executor (issue 23 item 6), same machine, same data.

A synthetic 128² scan × 128² u16 acquisition (Poisson counts with a bright disk of radius 20 px,
512 MiB) is made once as a .npy file. Both sides start from that array in memory:

* ours: ``io.load(array, backend="cpu")`` (a copy into the engine), then
  ``detector.virtual_image`` with the BF disk and the ADF annulus masks, ``detector.sum_dp``,
  and the three in one pass (``detector.products(["bf", "adf", "sum_dp"])`` with the same
  centre and radius);
* LiberTEM: ``Context.make_with("inline")`` on a ``memory`` dataset of the same array,
  ``ApplyMasksUDF`` with the same boolean masks and ``SumUDF``, each alone and all in one
  ``run_udf``.

Times are p50 of ``--repeats`` calls after one warm-up; results must agree (ours are exact
uint64; LiberTEM's float sums are compared after rounding). LiberTEM runs in its own
interpreter (``--libertem-python``, a venv with ``pip install libertem``) because its numpy pins
may differ from ours. Usage:

    python bench/libertem_compare.py --libertem-python /tmp/lt-venv/bin/python \\
        --out bench/results/cpu_libertem_compare.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SCAN, DET, RADIUS = 128, 128, 20.0
CENTER = (63.5, 64.0)


def masks() -> tuple[np.ndarray, np.ndarray]:
    """The BF disk ``d ≤ r`` and the ADF annulus ``r < d ≤ 2r`` (boolean, detector shape)."""
    yy, xx = np.mgrid[0:DET, 0:DET]
    d = np.hypot(yy - CENTER[0], xx - CENTER[1])
    return d <= RADIUS, (d > RADIUS) & (d <= 2 * RADIUS)


def make_data(path: Path) -> None:
    rng = np.random.default_rng(23)
    bf, _ = masks()
    lam = np.where(bf, 40.0, 0.6).astype(np.float32)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(SCAN, SCAN, DET, DET))
    for r in range(SCAN):
        out[r] = rng.poisson(lam, size=(SCAN, DET, DET)).astype(np.uint16)
    out.flush()


def p50_time(fn, repeats: int) -> tuple[float, list[float], object]:
    res = fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        res = fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), ts, res


def p50_time_fresh(make, fn, repeats: int) -> tuple[float, list[float], object]:
    """``p50_time`` of ``fn(make())`` timing only ``fn``, on a new object each run."""
    ts, res = [], None
    for _ in range(repeats + 1):
        obj = make()
        t = time.perf_counter()
        res = fn(obj)
        ts.append(time.perf_counter() - t)
        del obj
    return float(np.median(ts[1:])), ts[1:], res


def run_ours(data: Path, repeats: int, out: Path) -> dict:
    import quantem.gpu as qg
    from quantem.gpu import detector, io

    arr = np.load(data)
    t = time.perf_counter()
    ds = io.load(arr, backend="cpu")
    load_s = time.perf_counter() - t
    bf, adf = masks()
    rec: dict = {"load_from_array_s": load_s, "version": getattr(qg, "__version__", None)}
    times = {}
    times["bf"], _, img_bf = p50_time(lambda: detector.virtual_image(ds, bf), repeats)
    times["adf"], _, img_adf = p50_time(lambda: detector.virtual_image(ds, adf), repeats)
    # A dataset caches its sum DP (the disk fit reuses it): the passes that produce it are
    # timed on a fresh dataset each time, so no call is answered from that cache.
    times["sum_dp"], _, sdp = p50_time_fresh(
        lambda: io.load(arr, backend="cpu"), detector.sum_dp, repeats
    )
    times["bf_adf_sum_one_pass"], _, prod = p50_time_fresh(
        lambda: io.load(arr, backend="cpu"),
        lambda d: detector.products(d, ["bf", "adf", "sum_dp"], center=CENTER, radius=RADIUS),
        repeats,
    )
    rec["p50_s"] = times
    pb = np.asarray(prod["bf"])
    pa = np.asarray(prod["adf"])
    rec["products_equal_masks"] = bool(
        np.array_equal(pb, img_bf)
        and np.array_equal(pa, img_adf)
        and np.array_equal(prod["sum_dp"], sdp)
    )
    np.savez(out, bf=img_bf, adf=img_adf, sum_dp=sdp)
    return rec


def run_libertem(data: Path, repeats: int, out: Path) -> dict:
    import libertem
    from libertem.api import Context
    from libertem.udf.masks import ApplyMasksUDF
    from libertem.udf.sum import SumUDF

    arr = np.load(data)
    ctx = Context.make_with("inline")
    t = time.perf_counter()
    ds = ctx.load("memory", data=arr, sig_dims=2)
    load_s = time.perf_counter() - t
    bf, adf = masks()

    def masks_udf(ms):
        return ApplyMasksUDF(mask_factories=[(lambda m=m: m) for m in ms], mask_dtype=np.float64)

    def run(udfs):
        return ctx.run_udf(dataset=ds, udf=udfs)

    times = {}
    times["bf"], _, r_bf = p50_time(lambda: run([masks_udf([bf])]), repeats)
    times["adf"], _, r_adf = p50_time(lambda: run([masks_udf([adf])]), repeats)
    times["sum_dp"], _, r_sum = p50_time(lambda: run([SumUDF()]), repeats)
    times["bf_adf_sum_one_pass"], _, r_all = p50_time(
        lambda: run([masks_udf([bf, adf]), SumUDF()]), repeats
    )
    img_bf = np.asarray(r_bf[0]["intensity"].data)[..., 0]
    img_adf = np.asarray(r_adf[0]["intensity"].data)[..., 0]
    sdp = np.asarray(r_sum[0]["intensity"].data)
    both = np.asarray(r_all[0]["intensity"].data)
    np.savez(
        out,
        bf=img_bf,
        adf=img_adf,
        sum_dp=sdp,
        all_bf=both[..., 0],
        all_adf=both[..., 1],
        all_sum=np.asarray(r_all[1]["intensity"].data),
    )
    return {"load_memory_dataset_s": load_s, "p50_s": times, "version": libertem.__version__}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--libertem-python", default=None, help="interpreter with libertem installed")
    ap.add_argument("--data", default="/tmp/libertem_compare_128x128x128x128_u16.npy")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results/cpu_libertem_compare.json")
    ap.add_argument("--part", choices=["ours", "libertem"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--part-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    data = Path(a.data)
    if a.part:  # one side, in this interpreter
        f = run_ours if a.part == "ours" else run_libertem
        rec = f(data, a.repeats, Path(a.part_out + ".npz"))
        Path(a.part_out + ".json").write_text(json.dumps(rec))
        return 0
    if not data.exists():
        t = time.perf_counter()
        make_data(data)
        print(f"made {data} in {time.perf_counter() - t:.1f} s")
    lt_py = a.libertem_python or sys.executable
    parts = {}
    for part, py in (("ours", sys.executable), ("libertem", lt_py)):
        po = f"/tmp/libertem_compare_{part}"
        cmd = [
            py,
            __file__,
            "--part",
            part,
            "--data",
            str(data),
            "--repeats",
            str(a.repeats),
            "--part-out",
            po,
        ]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        parts[part] = (json.loads(Path(po + ".json").read_text()), np.load(po + ".npz"))
    ours, o = parts["ours"]
    lt, lr = parts["libertem"]
    agree = {}
    for k in ("bf", "adf", "sum_dp"):
        agree[k] = bool(np.array_equal(o[k].astype(np.float64), np.rint(lr[k]).astype(np.float64)))
    agree["libertem_one_pass_equal"] = bool(
        np.array_equal(lr["all_bf"], lr["bf"])
        and np.array_equal(lr["all_adf"], lr["adf"])
        and np.array_equal(lr["all_sum"], lr["sum_dp"])
    )
    agree["ours_products_equal_masks"] = ours["products_equal_masks"]
    speedup = {k: lt["p50_s"][k] / ours["p50_s"][k] for k in ours["p50_s"]}
    rec = {
        "what": "CPU engine vs LiberTEM inline executor: virtual BF/ADF (boolean masks) and sum DP "
        "on a 128x128 scan x 128x128 u16 acquisition held in memory; p50 of repeats after a "
        "warm-up; speedup = LiberTEM / ours",
        "command": "python bench/libertem_compare.py --libertem-python /tmp/lt-venv/bin/python "
        f"--repeats {a.repeats} --out {a.out}",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "data": {
            "scan": [SCAN, SCAN],
            "detector": [DET, DET],
            "dtype": "uint16",
            "bytes": SCAN * SCAN * DET * DET * 2,
            "bf_radius_px": RADIUS,
            "center": list(CENTER),
            "bf_pixels": int(masks()[0].sum()),
            "adf_pixels": int(masks()[1].sum()),
        },
        "ours": ours,
        "libertem": lt,
        "results_agree": agree,
        "speedup": speedup,
        "revision": subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        or None,
    }
    Path(a.out).write_text(json.dumps(rec, indent=1))
    print(
        json.dumps(
            {
                "p50_ours_s": ours["p50_s"],
                "p50_libertem_s": lt["p50_s"],
                "speedup": speedup,
                "agree": agree,
            },
            indent=1,
        )
    )
    return 0 if all(agree.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
