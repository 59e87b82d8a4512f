"""GPU reliability checks (issue 17), run on a machine with an NVIDIA GPU.

Modes (``python3 tests/gpu/soak.py MODE ...``; JSON records go to ``--out``):

* ``repro``: the sequence that lost the context at ``1cde066`` — an ENCODED load, a DENSE load of
  the same source (closed), then ``detector.bf`` on the ENCODED dataset — compared with the BF
  image of a DENSE dataset. Exits 1 on any error or difference.
* ``lost``: inject a device fault, then check that every later call raises ``DeviceLostError``
  naming the first fault (no hang, no CPU fallback for ``backend="auto"``) and that the CPU
  backend keeps working.
* ``soak``: a seeded random sequence of operations over several datasets held at once (ENCODED and
  DENSE on CUDA, one on the CPU; full scans and regions; u16 and u32 sources): load, close, drop,
  frames, every detector product, CoM, ``dpc.run``, SSB reconstruct/fit, ``.qem`` save and reopen.
  Every integer result is compared with the CPU engine's (byte-exact), floats to their parity
  bound, and after every close the card's used memory must come back to the baseline plus what the
  held datasets occupy, within 1 % of the card.
* ``cycles``: 200 load/close cycles; host RSS and card memory back to baseline within 1 %.
* ``threads``: 4 threads loading and reducing concurrently give identical results.

The CPU engine is the reference for every comparison; nothing here compares the GPU with itself.
``--device-backend cpu`` runs the same logic on the CPU alone (a dry run of the script).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from quantem.gpu import DeviceLostError, QuantemError, detector, dpc, io, ssb

# The threads mode runs its work as tests/python/test_cycles.py does (tests/python/concurrency.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from concurrency import on_threads  # noqa: E402

# ---- card memory (through CuPy, which shares the primary context) ---------------------------


def card_used() -> int | None:
    try:
        import cupy

        free, total = cupy.cuda.runtime.memGetInfo()
        return int(total - free)
    except Exception:  # no CuPy or no GPU: the dry run
        return None


def card_total() -> int | None:
    try:
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[1])
    except Exception:
        return None


def host_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rel_l2(a, b) -> float:
    kind = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
    a = np.asarray(a, dtype=kind)
    b = np.asarray(b, dtype=kind)
    d = float(np.linalg.norm(a - b))
    n = float(np.linalg.norm(b))
    return d / n if n > 0 else d


# ---- sources ---------------------------------------------------------------------------------


def write_u32_source(path: Path, scan=(24, 20), det=(40, 36), seed=7) -> Path:
    """A plain HDF5 4-D uint32 dataset (values above 65535 present: it stays DENSE on CUDA)."""
    import h5py

    rng = np.random.default_rng(seed)
    data = rng.poisson(40.0, size=scan + det).astype(np.uint32)
    data[:, :, det[0] // 2, det[1] // 2] += 70000
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=data, chunks=(1, 1) + det)
    return path


class Ref:
    """CPU reference datasets and memoised results per (source, region, det_bin)."""

    def __init__(self):
        self.ds: dict = {}
        self.memo: dict = {}

    def dataset(self, key):
        if key not in self.ds:
            src, region, det_bin = key
            self.ds[key] = io.load(src, backend="cpu", scan_region=region, det_bin=det_bin)
        return self.ds[key]

    def get(self, key, name, fn):
        k = (key, name)
        if k not in self.memo:
            self.memo[k] = fn(self.dataset(key))
        return self.memo[k]


# ---- the soak ---------------------------------------------------------------------------------


class Soak:
    def __init__(self, sources, seed, device_backend, tmp: Path):
        self.sources = sources  # list of (name, path, scan_shape, u16: bool)
        self.rng = random.Random(seed)
        self.nrng = np.random.default_rng(seed)
        self.dev = device_backend
        self.tmp = tmp
        self.ref = Ref()
        self.held: list[dict] = []
        self.failures: list[dict] = []
        # The largest relative L2 error seen per compared float operation.
        self.worst: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        # Compared operations per backend of the dataset they ran on.
        self.backends: dict[str, int] = {}
        self.op_backend = ""
        self.mem_excess_max = 0
        self.mem_checks = 0
        self.base = None
        self.total = card_total()

    # -- bookkeeping
    def fail(self, op, h, msg):
        self.failures.append({"op": op, "dataset": h and h["label"], "message": msg[:2000]})

    def cuda_resident(self) -> int:
        return sum(
            h["ds"].nbytes_resident
            for h in self.held
            if h["backend"] == "cuda" and not h["ds"].closed
        )

    def check_memory(self, op):
        used = card_used()
        if used is None or self.base is None:
            return
        gc.collect()
        used = card_used()
        excess = used - self.base - self.cuda_resident()
        self.mem_checks += 1
        self.mem_excess_max = max(self.mem_excess_max, excess)
        if excess > 0.01 * self.total:
            self.fail(
                op,
                None,
                f"card memory {used} B = baseline {self.base} + held "
                f"{self.cuda_resident()} + {excess} B (> 1 % of {self.total})",
            )

    # -- loading
    def load(self):
        name, path, scan, u16 = self.rng.choice(self.sources)
        full = self.rng.random() < 0.5
        if full:
            region = None
        else:
            r0 = self.rng.randrange(0, scan[0] // 2)
            c0 = self.rng.randrange(0, scan[1] // 2)
            region = (
                r0,
                self.rng.randrange(r0 + 4, scan[0] + 1),
                c0,
                self.rng.randrange(c0 + 4, scan[1] + 1),
            )
        det_bin = self.rng.choice([1, 1, 2])
        has_cpu = any(h["backend"] == "cpu" for h in self.held)
        backend = "cpu" if (not has_cpu or self.dev == "cpu") else self.dev
        # Binned u16 sums widen to u32, which only DENSE holds.
        rep = self.rng.choice(["encoded", "dense"]) if u16 and det_bin == 1 else "dense"
        ds = io.load(path, backend=backend, scan_region=region, det_bin=det_bin, representation=rep)
        label = f"{name}/{backend}/{rep}/region={region}/bin={det_bin}"
        self.held.append(
            {
                "ds": ds,
                "key": (path, region, det_bin),
                "backend": backend,
                "label": label,
                "u16": u16,
            }
        )

    def close(self, drop=False):
        if not self.held:
            return
        h = self.held.pop(self.rng.randrange(len(self.held)))
        if drop:
            del h["ds"]
        else:
            h["ds"].close()
        del h
        self.check_memory("drop" if drop else "close")

    # -- comparisons
    def exact(self, op, h, got, want):
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
            self.fail(
                op,
                h,
                f"differs from the CPU engine: shape {got.shape}/{want.shape}, dtype "
                f"{got.dtype}/{want.dtype}, "
                f"{int(np.sum(got != want)) if got.shape == want.shape else 'n/a'} elements",
            )

    def close_to(self, op, h, got, want, tol):
        e = rel_l2(got, want)
        self.worst[op] = max(self.worst.get(op, 0.0), e) if np.isfinite(e) else float("nan")
        if not np.isfinite(e) or e > tol:
            self.fail(op, h, f"relative L2 {e:.3e} against the CPU engine (bound {tol:.0e})")

    def op(self, name):
        h = self.rng.choice(self.held)
        ds, key = h["ds"], h["key"]
        self.op_backend = h["backend"]
        ref = self.ref
        R, C, KR, KC = ds.shape
        disk = ref.get(key, "disk", detector.fit_disk)
        center, radius = list(disk.center_px), float(disk.radius_px)
        if name == "frames":
            pos = [(self.rng.randrange(R), self.rng.randrange(C)) for _ in range(5)]
            want = ref.dataset(key)
            self.exact(name, h, detector.frames(ds, pos), detector.frames(want, pos))
        elif name in ("sum_dp", "max_dp", "mean_dp", "moments"):
            fn = getattr(detector, name)
            got, want = fn(ds), ref.get(key, name, fn)
            if name == "moments":
                for k in ("sum", "m_row", "m_col"):
                    self.exact(f"{name}.{k}", h, got[k], want[k])
            else:
                self.exact(name, h, got, want)
        elif name in ("bf", "abf", "adf", "haadf", "df"):
            fn = getattr(detector, name)
            got = fn(ds, center=center, radius=radius)
            want = ref.get(key, name, lambda d: fn(d, center=center, radius=radius))
            self.exact(name, h, got.image, want.image)
        elif name == "annular":
            inner = round(self.rng.uniform(0, radius), 2)
            outer = round(inner + self.rng.uniform(1, radius), 2)
            got = detector.annular(ds, inner=inner, outer=outer, center=center)
            want = detector.annular(ref.dataset(key), inner=inner, outer=outer, center=center)
            self.exact(name, h, got.image, want.image)
        elif name == "virtual_image":
            mask = self.nrng.integers(0, 4, size=(KR, KC)).astype(np.int32)
            self.exact(
                name,
                h,
                detector.virtual_image(ds, mask),
                detector.virtual_image(ref.dataset(key), mask),
            )
        elif name == "products":
            which = ["bf", "adf", "sum_dp", "moments", "com"]
            got = detector.products(ds, which, center=center, radius=radius)
            want = ref.get(
                key, name, lambda d: detector.products(d, which, center=center, radius=radius)
            )
            for k in ("bf", "adf"):
                self.exact(f"products.{k}", h, got[k].image, want[k].image)
            self.exact("products.sum_dp", h, got["sum_dp"], want["sum_dp"])
            for k in ("sum", "m_row", "m_col"):
                self.exact(f"products.moments.{k}", h, got["moments"][k], want["moments"][k])
            self.close_to("products.com", h, got["com"].com_row, want["com"].com_row, 1e-12)
        elif name == "com":
            got = dpc.center_of_mass(ds)
            want = ref.get(key, name, dpc.center_of_mass)
            self.close_to(name, h, got.com_row, want.com_row, 1e-12)
            self.close_to(name, h, got.com_col, want.com_col, 1e-12)
        elif name == "dpc":
            got = dpc.run(ds, rotation_deg=12.0)
            want = ref.get(key, name, lambda d: dpc.run(d, rotation_deg=12.0))
            self.close_to(name, h, got.phase, want.phase, 1e-9)
        elif name == "ssb":
            if not h["u16"] or R < 8 or C < 8:
                return "skipped"
            kw = dict(voltage_kv=300, semiangle_mrad=20, scan_step_a=0.25)
            ab = {"C10": -40.0, "C12": 5.0, "phi12": 0.3}
            got = ssb.SSB(ds, **kw).reconstruct(ab)
            want = ref.get(key, name, lambda d: ssb.SSB(d, **kw).reconstruct(ab))
            # The complex object: the CUDA engine keeps G and its sums in f32, the CPU in f64.
            # Not the phase: for these weak-phase scans the phase is small next to |object|, so
            # its relative error is the object's f32 error times |object| / |phase| (on the H100
            # at d321546: phase up to 1.8e-4 on the 256² scan, the object within 9.9e-7).
            self.close_to(name, h, got.object, want.object, 1e-5)
            e_phase = rel_l2(got.phase, want.phase)
            self.worst["ssb.phase (reported, not bounded)"] = max(
                self.worst.get("ssb.phase (reported, not bounded)", 0.0), e_phase
            )
        elif name == "ssb_fit":
            if not h["u16"] or R < 8 or C < 8:
                return "skipped"
            s = ssb.SSB(ds, voltage_kv=300, semiangle_mrad=20, scan_step_a=0.25)
            f = s.fit(seed=1, global_evals=16, local_max_iter=16)
            if not np.isfinite(f.loss) or not all(np.isfinite(v) for v in f.aberrations.values()):
                self.fail(name, h, f"non-finite fit {f.aberrations} loss {f.loss}")
        elif name == "save":
            if ds.dtype != np.uint16:
                return "skipped"  # .qem holds u16 counts
            path = self.tmp / f"soak_{self.rng.randrange(1 << 30)}.qem"
            io.save(ds, path)
            with io.load(path, backend=h["backend"]) as back:
                self.exact(
                    "save.sum_dp", h, detector.sum_dp(back), ref.get(key, "sum_dp", detector.sum_dp)
                )
            path.unlink()
        return "ok"

    def run(self, n_ops):
        weights = {
            "load": 6,
            "close": 3,
            "drop": 2,
            "frames": 8,
            "sum_dp": 5,
            "max_dp": 4,
            "mean_dp": 3,
            "moments": 4,
            "bf": 5,
            "abf": 3,
            "adf": 5,
            "haadf": 3,
            "df": 3,
            "annular": 4,
            "virtual_image": 5,
            "products": 6,
            "com": 4,
            "dpc": 4,
            "ssb": 3,
            "ssb_fit": 1,
            "save": 2,
        }
        names, w = list(weights), list(weights.values())
        # Warm up (context, kernels) before the memory baseline.
        self.load()
        self.load()
        self.op("products")
        self.held[0]["ds"].close()
        self.held.pop(0)
        gc.collect()
        if card_used() is not None:
            self.base = card_used() - self.cuda_resident()
        done = 0
        t0 = time.time()
        while done < n_ops:
            name = self.rng.choices(names, w)[0]
            if name == "load" and len(self.held) >= 4:
                name = "close"
            if name in ("close", "drop") and len(self.held) <= 2:
                name = "load"
            try:
                if name == "load":
                    self.load()
                    r = "ok"
                elif name in ("close", "drop"):
                    self.close(drop=name == "drop")
                    r = "ok"
                else:
                    r = self.op(name)
            except DeviceLostError as e:
                self.fail(name, None, f"device lost: {e}")
                break
            except Exception as e:  # every error is a failure of the soak
                self.fail(name, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
                r = "error"
            self.counts[f"{name}:{r}"] = self.counts.get(f"{name}:{r}", 0) + 1
            if r == "ok" and name not in ("load", "close", "drop"):
                self.backends[self.op_backend] = self.backends.get(self.op_backend, 0) + 1
            done += 1
        for h in self.held:
            h["ds"].close()
        self.held.clear()
        self.check_memory("final close")
        return {
            "operations": done,
            "seconds": round(time.time() - t0, 2),
            "failures": self.failures,
            "worst_rel_l2": dict(sorted(self.worst.items())),
            "counts": dict(sorted(self.counts.items())),
            "compared_ops_by_backend": self.backends,
            "memory_checks": self.mem_checks,
            "memory_excess_max_bytes": self.mem_excess_max,
            "card_total_bytes": self.total,
            "baseline_bytes": self.base,
        }


# ---- the other modes -------------------------------------------------------------------------


def mode_repro(args) -> dict:
    """The issue-17 sequence; `rounds` times, each with a fresh DENSE load closed before bf."""
    out = {"rounds": []}
    e = io.load(args.source, representation="encoded")
    for i in range(args.rounds):
        d = io.load(args.source, representation="dense")
        if i % 2 == 0:
            d.close()
        else:
            del d
            gc.collect()
        t = time.time()
        got = detector.bf(e)
        t_bf = time.time() - t
        with io.load(args.source, representation="dense") as d2:
            want = detector.bf(d2, center=list(got.center), radius=float(got.radius))
        same = bool(np.array_equal(got.image, want.image))
        out["rounds"].append({"bf_s": round(t_bf, 4), "equal_to_dense": same})
        if not same:
            raise AssertionError(f"round {i}: ENCODED bf differs from DENSE bf")
    e.close()
    return out


def mode_lost(args) -> dict:
    from quantem.gpu import _native

    res = {}
    ds = io.load(args.source, representation="encoded")
    t = time.time()
    try:
        _native._inject_cuda_fault()
        raise AssertionError("the injected fault did not fault")
    except DeviceLostError as err:
        res["inject"] = str(err)
    res["inject_s"] = round(time.time() - t, 3)
    checks = {
        "detector.bf": lambda: detector.bf(ds),
        "ds[0, 0]": lambda: ds[0, 0],
        "io.load auto": lambda: io.load(args.source),
        "io.load cuda": lambda: io.load(args.source, backend="cuda"),
        "dpc.run": lambda: dpc.run(ds),
    }
    for name, fn in checks.items():
        t = time.time()
        try:
            fn()
            raise AssertionError(f"{name} succeeded after the context was lost")
        except DeviceLostError as err:
            msg = str(err)
            if "CUDA_ERROR_ILLEGAL_ADDRESS" not in msg or "inject" not in msg:
                raise AssertionError(
                    f"{name}: the message does not name the first fault: {msg}"
                ) from err
            res[name] = {"seconds": round(time.time() - t, 3), "message": msg}
    with io.load(args.source, backend="cpu", scan_region=(0, 8, 0, 8)) as c:
        res["cpu_after_loss_sum"] = int(detector.sum_dp(c).sum())
    return res


def mode_cycles(args) -> dict:
    """`--warmup` cycles (caches, pools and allocator arenas reach their size: on the CPU RSS
    grows for ~300 cycles, then stays put), then the baseline, then `--cycles` measured ones."""
    rows = []

    def cycle():
        ds = io.load(args.source, representation=args.representation)
        ds.close()
        del ds

    for _ in range(args.warmup):
        cycle()
    gc.collect()
    base_used, base_rss = card_used(), host_rss()
    for i in range(args.cycles):
        cycle()
        if i % 20 == 0:
            rows.append({"cycle": i, "card_used": card_used(), "rss": host_rss()})
    gc.collect()
    end_used, end_rss = card_used(), host_rss()
    res = {
        "warmup": args.warmup,
        "cycles": args.cycles,
        "baseline_card": base_used,
        "end_card": end_used,
        "baseline_rss": base_rss,
        "end_rss": end_rss,
        "samples": rows,
    }
    total = card_total()
    if base_used is not None and abs(end_used - base_used) > 0.01 * total:
        raise AssertionError(f"card memory {base_used} -> {end_used}")
    if end_rss > base_rss * 1.01:
        raise AssertionError(f"host RSS {base_rss} -> {end_rss} (more than 1 %)")
    return res


def mode_threads(args) -> dict:
    results = [None] * 4

    def work(i):
        with io.load(
            args.source,
            scan_region=(0, 64, 0, 64),
            representation="encoded" if i % 2 else "dense",
        ) as ds:
            p = detector.products(
                ds, ["bf", "adf", "sum_dp", "moments"], center=[96, 96], radius=30.0
            )
            results[i] = (p["bf"].image, p["adf"].image, p["sum_dp"], p["moments"]["m_row"])

    errors = on_threads(work, 4)
    if errors:
        raise AssertionError("; ".join(errors))
    with io.load(args.source, backend="cpu", scan_region=(0, 64, 0, 64)) as c:
        p = detector.products(c, ["bf", "adf", "sum_dp", "moments"], center=[96, 96], radius=30.0)
        want = (p["bf"].image, p["adf"].image, p["sum_dp"], p["moments"]["m_row"])
    for i, r in enumerate(results):
        for a, b in zip(r, want):
            if not np.array_equal(a, b):
                raise AssertionError(f"thread {i} differs from the CPU engine")
    return {"threads": 4, "identical_to_cpu": True}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=["repro", "lost", "soak", "cycles", "threads"])
    p.add_argument("--source", help="an acquisition (repro, lost, cycles, threads)")
    p.add_argument(
        "--sources", nargs="*", default=[], help="soak: NAME=PATH:ROWSxCOLS:u16|u32 entries"
    )
    p.add_argument("--ops", type=int, default=500)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--cycles", type=int, default=200)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--representation", default="encoded")
    p.add_argument("--device-backend", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", help="JSON record path")
    args = p.parse_args()
    t0 = time.time()
    rec = {"mode": args.mode, "argv": sys.argv}
    ok = True
    try:
        if args.mode == "soak":
            srcs = []
            for s in args.sources:
                name, rest = s.split("=", 1)
                path, shape, kind = rest.rsplit(":", 2)
                r, c = (int(x) for x in shape.split("x"))
                srcs.append((name, path, (r, c), kind == "u16"))
            with tempfile.TemporaryDirectory() as tmp:
                res = Soak(srcs, args.seed, args.device_backend, Path(tmp)).run(args.ops)
            ok = not res["failures"]
        else:
            res = {
                "repro": mode_repro,
                "lost": mode_lost,
                "cycles": mode_cycles,
                "threads": mode_threads,
            }[args.mode](args)
    except (AssertionError, QuantemError) as e:
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        ok = False
    rec.update(res)
    rec["ok"] = ok
    rec["wall_s"] = round(time.time() - t0, 2)
    text = json.dumps(rec, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
    summary = {k: v for k, v in rec.items() if k in ("mode", "ok", "wall_s", "operations", "error")}
    if "failures" in rec:
        summary["failures"] = len(rec["failures"])
        summary["first_failures"] = rec["failures"][:3]
    print(json.dumps(summary, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
