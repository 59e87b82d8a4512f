"""What a CuPy user writes today for the first detector products, timed on the same H200 and
the same resident dense array as qem-cuda-products-check, for the comparison in issue 5.

  python3 bench/cupy_products.py MASTER OUT.json [repeats]

The dense array comes from quantem.gpu (io.load(..., backend="cuda", representation="dense"))
and is handed to CuPy without a copy (cupy.asarray through __cuda_array_interface__). Masks
follow docs/science.md §3–4 (BF disk from the mean DP: threshold mean+std, unweighted centroid,
equal-area radius; annulus lo^2 <= d^2 <= hi^2). Times are CUDA-event p50 after one warm-up."""

import json
import sys
import time

import cupy as cp
import numpy as np

from quantem.gpu import io

master, out = sys.argv[1], sys.argv[2]
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 10
t = time.perf_counter()
ds = io.load(master, backend="cuda", representation="dense")
load_s = time.perf_counter() - t
a = cp.asarray(ds)
R, C, KR, KC = a.shape


def timed(f):
    f()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(repeats):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        r = f()
        e.record()
        e.synchronize()
        ts.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
    return float(np.median(ts)), ts, r


sum_dp = a.sum(axis=(0, 1), dtype=cp.uint64)
mean = (sum_dp.astype(cp.float64) / (R * C)).astype(cp.float32).get().astype(np.float64)
thr = mean.mean() + mean.std()
rr, cc = np.nonzero(mean > thr)
c0, c1, r = rr.mean(), cc.mean(), np.sqrt(len(rr) / np.pi)
kr, kc = np.meshgrid(np.arange(KR), np.arange(KC), indexing="ij")
d2 = (kr - c0) ** 2 + (kc - c1) ** 2
bf = cp.asarray((d2 <= r * r).astype(np.uint16))
adf = cp.asarray(((r * r <= d2) & (d2 <= 4 * r * r)).astype(np.uint16))
rows = cp.arange(KR, dtype=cp.uint64)
cols = cp.arange(KC, dtype=cp.uint64)

cases = {
    "mean_dp": lambda: a.sum(axis=(0, 1), dtype=cp.uint64).astype(cp.float32) / (R * C),
    "bf": lambda: (a * bf).sum(axis=(2, 3), dtype=cp.uint64),
    "adf": lambda: (a * adf).sum(axis=(2, 3), dtype=cp.uint64),
    "sum_dp": lambda: a.sum(axis=(0, 1), dtype=cp.uint64),
    "com_moments": lambda: (
        a.sum(axis=(2, 3), dtype=cp.uint64),
        (a.sum(axis=3, dtype=cp.uint64) * rows).sum(axis=2),
        (a.sum(axis=2, dtype=cp.uint64) * cols).sum(axis=2),
    ),
}
res = {}
for name, f in cases.items():
    mid, ts, r_ = timed(f)
    res[name] = {"p50_s": mid, "runs_s": ts}
    print(f"cupy {name:<12} p50 {mid * 1e3:8.2f} ms")
bf_img = cases["bf"]()
rec = {
    "tool": "bench/cupy_products.py",
    "cupy": cp.__version__,
    "source": master,
    "shape": [R, C, KR, KC],
    "dtype": str(a.dtype),
    "repeats": repeats,
    "load_s": load_s,
    "disk": {
        "center_px": [float(c0), float(c1)],
        "radius_px": float(r),
        "bf_pixels": int((d2 <= r * r).sum()),
    },
    "bf_total": int(bf_img.sum()),
    "sum_dp_total": int(sum_dp.sum()),
    "cases": res,
    "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
}
json.dump(rec, open(out, "w"), indent=1)
print(json.dumps({k: round(v["p50_s"] * 1e3, 2) for k, v in res.items()}))
