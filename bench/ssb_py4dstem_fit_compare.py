#!/usr/bin/env python3
"""
Aberration fit side by side: our SSB fit vs py4DSTEM 0.14.18's direct-ptychography (SSB) fit, on
the same abTEM SrTiO3 [001] simulations with known C10, C12, phi12 (issue 20, item 4).

One command (reference venv with py4DSTEM, numpy < 2; our engine in the system python3):
    python3 -m venv /tmp/refs-venv
    /tmp/refs-venv/bin/pip install -c tests/tools/requirements-refs.lock.txt numpy py4DSTEM
    /tmp/refs-venv/bin/python bench/ssb_py4dstem_fit_compare.py --ours-python python3 \
        --out bench/results/cpu_ssb_py4dstem_fit_compare.json

Simulations: noise-free 'intensity' npz from tests/tools/simulate_abtem.py (SIMS below: 32x32
scans over 2x2 cells, 64x64 detector, 6x6 tiles, 256 gpts, --dose 0). A case is read from
--foc-dir (the foc_* cases of bench/calibration_validation.py, same arguments) or --sim-dir;
one found in neither is simulated into --sim-dir with --abtem-python (~25 s each on 2 cores).
The counts both codes get are Poisson(intensity * dose) with numpy default_rng(--seed), clipped
to uint16; py4DSTEM gets the same counts as float32. A case that cannot be loaded or fitted by
either code makes the script exit nonzero before anything is written.

Methods:
  ours      ssb.SSB(ds, voltage_kv, semiangle_mrad, scan_step_a, det_sampling_mrad=true mrad/px,
            rotation_deg=0).fit(seed=0, fit=("C10", "C12", "phi12"), thickness_a=t); phase =
            fit.result.phase (the reconstruction at the fitted aberrations). Run in --ours-python.
  py4DSTEM  py4DSTEM.process.phase.SSB (DirectPtychography) with the true energy, semiangle, scan
            step and mrad/px, all aberrations 0 at the start; preprocess(force_com_rotation=0,
            force_com_transpose=False); aberration_fit(max_radial_order=2) fits exactly
            C1 (m=1, n=0) and C12 (m=1, n=2, cos and sin) by least squares on the unwrapped
            phase of the single-overlap trotter regions (trotters with normalised intensity
            > 0.1, its default; the 1e3 e/frame case passes num_trotters=12, the number the
            default picks at 1e5 on the same simulation: at <= 1e4 e/frame the default picks all
            1023 non-DC trotters, ~15 GB of design arrays, beyond this 23 GB machine).
            "single" = one call from zero, as the method is documented;
            "iterated" = the call repeated with relative_polar_parameters = its previous fit
            (what that argument is for) until C10, C12 move < 0.01 A and phi12 < 1e-4 rad, at
            most 20 calls. Phase = angle(object) of SSB.reconstruct(polar_parameters=the
            iterated fit). The time of each includes preprocess.

Conventions (py4DSTEM source, utils.py ComplexProbe.evaluate_chi, polar_coordinates,
DirectPtychography.aberration_fit): chi = 2 pi / lambda (alpha^2 / 2 (C10 + C12 cos 2(phi -
phi12)) + ...), probe = A exp(-i chi); fitted C12, phi12 = hypot(a, b), arctan2(b, a) / 2 of the
cos/sin coefficients; phi = arctan2(ky, kx) with kx along array axis 0; rotation 0, no
transpose -> fitted phi12 = phi12_relative. Same as ours and abTEM (C10 = -defocus), so no
mapping: both fits are compared with the npz C10_A, C12_A, phi12_rad as they are. The check:
py4DSTEM's SSB at the truth is also reconstructed with C10 sign-flipped and phi12 negated
('convention_check'); the as-given parameters must correlate best.

C10 reference plane: abTEM's defocus refers to the entrance surface; SSB measures the probe near
the exit plane (docs/calibration.md, section 4), so both fits are expected near C10_truth + t on
the 3-cell cases. Errors are reported against the npz truth (entrance) and against truth + t.

Correlation = bench/ssb_py4dstem_compare.py's measure (Pearson r with 'phase_scan_2alpha' at zero
shift, and the best over circular shifts |dr|, |dc| <= 3).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from typing import Any

import numpy as np

# The correlation measure and the record's provenance are the first comparison's (same folder).
from ssb_py4dstem_compare import correlation, run_provenance, write_record

# name : dose (electrons per frame) [: py4DSTEM num_trotters]
DEFAULT_CASES = (
    "ast_200kv_1c:1e5,ast_300kv_3c:1e5,ast_200kv_3c:1e5,foc_200kv_1c:1e5,"
    "foc_300kv_3c:1e5,ast_200kv_1c:1e3:12"
)
NAMES = ("C10", "C12", "phi12")
# simulate_abtem.py arguments besides the common ones (COMMON); defocus is abTEM's (= -C10)
COMMON = [
    "--structure",
    "sto",
    "--reps",
    "6",
    "--gpts",
    "256",
    "--det",
    "64",
    "--scan",
    "32",
    "--scan-cells",
    "2",
    "--dose",
    "0",
    "--seed",
    "0",
    "--workers",
    "2",
]
SIMS = {
    "ast_200kv_1c": "--energy 200e3 --semiangle 25 --thickness 1 --defocus -100 "
    "--C12 40 --phi12 0.5",
    "ast_300kv_3c": "--energy 300e3 --semiangle 20 --thickness 3 --defocus 80 "
    "--C12 25 --phi12 -0.7",
    "ast_200kv_3c": "--energy 200e3 --semiangle 25 --thickness 3 --defocus 60 --C12 50 --phi12 1.2",
    "foc_200kv_1c": "--energy 200e3 --semiangle 25 --thickness 1 --defocus -100",
    "foc_300kv_3c": "--energy 300e3 --semiangle 20 --thickness 3 --defocus 80",
}


def errors(fit: dict[str, float], truth: dict[str, float], thickness_a: float) -> dict[str, float]:
    """Fit minus truth: C10 (vs entrance and vs exit plane), C12, phi12 wrapped to (-pi/2, pi/2]."""
    d = (fit["phi12"] - truth["phi12"] + np.pi / 2) % np.pi - np.pi / 2
    c10 = fit["C10"] - truth["C10"]
    return {
        "C10": c10,
        "C10_vs_exit": c10 - thickness_a,
        "C12": fit["C12"] - truth["C12"],
        "phi12_mod_pi": float(d),
    }


# --------------------------------------------------------------------------- our engine (worker)
def ours_worker(npz_path: str, counts_path: str, thickness_a: str) -> None:
    """Runs in an interpreter with the quantem.gpu wheel; prints one JSON line."""
    from quantem.gpu import io, ssb

    z = np.load(npz_path)
    counts = np.load(counts_path)
    shape = z["phase_scan_2alpha"].shape
    ds = io.load(np.ascontiguousarray(counts), backend="cpu")
    kw = {
        "voltage_kv": float(z["energy_eV"]) / 1e3,
        "semiangle_mrad": float(z["semiangle_mrad"]),
        "scan_step_a": [float(v) for v in z["scan_step_A"]],
        "det_sampling_mrad": float(np.mean(z["angular_sampling_mrad"])),
        "rotation_deg": 0.0,
    }
    t0 = time.perf_counter()
    s = ssb.SSB(ds, **kw)
    f = s.fit(seed=0, fit=NAMES, thickness_a=float(thickness_a))
    phase = np.asarray(f.result.phase).reshape(shape)
    t1 = time.perf_counter()
    out = {
        "params": kw,
        "fit_call": "fit(seed=0, fit=('C10', 'C12', 'phi12'), thickness_a=t)",
        "fitted": {k: float(f.aberrations[k]) for k in NAMES},
        "focal_reference": f.provenance.get("focal_reference"),
        "evaluations": int(f.evaluations) if np.isscalar(f.evaluations) else None,
        "correlation": correlation(phase, z["phase_scan_2alpha"]),
        "wall_s": t1 - t0,
    }
    print(json.dumps(out))


def run_ours(python: str, npz: str, counts_path: str, thickness_a: float) -> dict[str, Any]:
    """Our fit in a subprocess (numpy >= 2 interpreter); raises on failure."""
    p = subprocess.run(
        [python, os.path.abspath(__file__), "--ours-worker", npz, counts_path, repr(thickness_a)],
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        raise RuntimeError(f"our fit failed on {npz}:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- py4DSTEM
def p4_prepare(py4dstem: Any, counts: np.ndarray, z: Any) -> Any:
    """py4DSTEM SSB object on the counts with the true calibrations, aberrations 0, preprocessed."""
    from py4DSTEM.process.phase import SSB

    dc = py4dstem.DataCube(data=counts.astype(np.float32))
    dc.calibration.set_R_pixel_size(float(z["scan_step_A"][0]))
    dc.calibration.set_R_pixel_units("A")
    dc.calibration.set_Q_pixel_size(float(np.mean(z["angular_sampling_mrad"])))
    dc.calibration.set_Q_pixel_units("mrad")
    s = SSB(
        energy=float(z["energy_eV"]),
        datacube=dc,
        semiangle_cutoff=float(z["semiangle_mrad"]),
        verbose=False,
    )
    s.preprocess(
        plot_center_of_mass=None,
        plot_rotation=False,
        plot_overlap_trotters=False,
        force_com_rotation=0.0,
        force_com_transpose=False,
    )
    return s


def p4_fitted(s: Any) -> dict[str, float]:
    """The fitted C10, C12, phi12 (absolute frame) of the last aberration_fit call."""
    return {k: float(s._fitted_polar_parameters[k]) for k in NAMES}


def p4_fit(
    py4dstem: Any,
    counts: np.ndarray,
    z: Any,
    num_trotters: int | None,
    mem_limit_gb: float,
    max_calls: int = 20,
) -> dict[str, Any]:
    """py4DSTEM's aberration fit, single call and iterated; reconstruction at the iterated fit.

    ``num_trotters`` None is py4DSTEM's default selection (normalised intensity > 0.1). Its
    least-squares design arrays hold 2 x num_trotters x trotter size x (3 + num_trotters) float32;
    above ``mem_limit_gb`` this raises instead of running the machine out of memory.
    """
    t0 = time.perf_counter()
    s = p4_prepare(py4dstem, counts, z)
    t_pre = time.perf_counter() - t0
    n_default = int((s._normalized_trotter_intensities > 0.1).sum())
    n = n_default if num_trotters is None else num_trotters
    size = round(float((np.abs(s._fourier_probe_initial) > 0).sum()) * 1.05)
    need_gb = 2 * n * size * (3 + n) * 4 / 1e9
    if need_gb > mem_limit_gb:
        raise RuntimeError(
            f"py4DSTEM aberration_fit would use {n} trotters (its default selects "
            f"{n_default}): ~{need_gb:.0f} GB of design arrays > {mem_limit_gb} GB; "
            "give this case a num_trotters (name:dose:num_trotters)"
        )
    t1 = time.perf_counter()
    s.aberration_fit(max_radial_order=2, plot_fitted_fourier_probe=False, num_trotters=num_trotters)
    single = p4_fitted(s)
    t_single = time.perf_counter() - t1
    path = [single]
    converged = False
    for _ in range(max_calls - 1):
        s.aberration_fit(
            max_radial_order=2,
            plot_fitted_fourier_probe=False,
            num_trotters=num_trotters,
            relative_polar_parameters=dict(s._fitted_polar_parameters_relative),
        )
        cur = p4_fitted(s)
        prev = path[-1]
        path.append(cur)
        if (
            abs(cur["C10"] - prev["C10"]) < 0.01
            and abs(cur["C12"] - prev["C12"]) < 0.01
            and abs(cur["phi12"] - prev["phi12"]) < 1e-4
        ):
            converged = True
            break
    t_iter = time.perf_counter() - t1
    fitted = path[-1]
    t2 = time.perf_counter()
    s.reconstruct(polar_parameters=dict(fitted), num_jobs=1, progress_bar=False)
    phase = np.angle(s.object)
    t_rec = time.perf_counter() - t2
    for k in NAMES:
        if not np.isfinite(fitted[k]):
            raise RuntimeError(f"py4DSTEM fit gave a non-finite {k}")
    return {
        "single": single,
        "iterated": fitted,
        "calls": len(path),
        "converged": converged,
        "path": path,
        "num_trotters": int(s._num_trotters),
        "num_trotters_default_selection": n_default,
        "num_trotters_source": "default (> 0.1)" if num_trotters is None else "case spec",
        "phase": phase,
        "preprocess_s": t_pre,
        "single_fit_s": t_single,
        "iterated_fit_s": t_iter,
        "reconstruct_s": t_rec,
        "wall_single_s": t_pre + t_single,
        "wall_iterated_s": t_pre + t_iter + t_rec,
    }


def p4_convention_check(
    py4dstem: Any, counts: np.ndarray, z: Any, truth: dict[str, float], ref: np.ndarray
) -> dict[str, float]:
    """Correlation of py4DSTEM's SSB at the truth under the candidate conventions."""
    s = p4_prepare(py4dstem, counts, z)
    alts = {
        "as_given": truth,
        "C10_sign_flipped": dict(truth, C10=-truth["C10"]),
        "phi12_negated": dict(truth, phi12=-truth["phi12"]),
    }
    out = {}
    for k, pp in alts.items():
        s.reconstruct(polar_parameters=dict(pp), num_jobs=1, progress_bar=False)
        out[k] = correlation(np.angle(s.object), ref)["pearson"]
    return out


# --------------------------------------------------------------------------- driver
def find_or_simulate(name: str, a: argparse.Namespace) -> str:
    """The npz of case ``name``: --foc-dir or --sim-dir, else simulated into --sim-dir."""
    for d in (a.foc_dir, a.sim_dir):
        path = os.path.join(d, f"{name}.npz")
        if os.path.exists(path):
            return path
    if name not in SIMS:
        raise RuntimeError(f"{name}.npz not found and no simulation arguments for it")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(a.sim_dir, exist_ok=True)
    out = os.path.join(a.sim_dir, name)
    cmd = [
        a.abtem_python,
        os.path.join(root, "tests", "tools", "simulate_abtem.py"),
        *COMMON,
        *SIMS[name].split(),
        "--out",
        out,
    ]
    print("simulating:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return out + ".npz"


def run_case(py4dstem: Any, spec: str, a: argparse.Namespace, tmp: str) -> dict[str, Any]:
    """One case: counts, both fits, errors, correlations; raises if anything fails."""
    name, dose, *rest = spec.split(":")
    num_trotters = int(rest[0]) if rest else None
    npz = find_or_simulate(name, a)
    z = np.load(npz)
    truth = {"C10": float(z["C10_A"]), "C12": float(z["C12_A"]), "phi12": float(z["phi12_rad"])}
    if float(z["C30_A"]) != 0.0:
        raise RuntimeError(f"{name}: C30 != 0 is not fitted by either side here")
    thickness = float(z["slice_thickness_A"]) * int(z["num_slices"])
    rng = np.random.default_rng(a.seed)
    lam = z["intensity"].astype(np.float64) * float(dose)
    counts = np.minimum(rng.poisson(lam), 65535).astype(np.uint16)
    counts_path = os.path.join(tmp, f"{name}_{dose}.npy")
    np.save(counts_path, counts)
    ref = z["phase_scan_2alpha"].astype(np.float64)
    label = f"{name}@{float(dose):.0e}"
    print(f"== {label}: truth {truth}, t = {thickness:.2f} A", flush=True)

    ours = run_ours(a.ours_python, npz, counts_path, thickness)
    p4 = p4_fit(py4dstem, counts, z, num_trotters, a.p4_mem_limit_gb)
    c_p4 = correlation(p4.pop("phase"), ref)
    conv = p4_convention_check(py4dstem, counts, z, truth, ref)
    if max(conv, key=conv.get) != "as_given":
        raise RuntimeError(f"{label}: convention check failed: {conv}")
    case = {
        "case": label,
        "npz": npz,
        "dose_e_per_frame": float(dose),
        "seed": a.seed,
        "energy_kv": float(z["energy_eV"]) / 1e3,
        "semiangle_mrad": float(z["semiangle_mrad"]),
        "thickness_cells": int(z["thickness_cells"]),
        "thickness_a": thickness,
        "scan_shape": list(map(int, z["scan_shape"])),
        "det_shape": list(map(int, z["det_shape"])),
        "truth": truth,
        "ours": {**ours, "errors": errors(ours["fitted"], truth, thickness)},
        "py4dstem": {
            **p4,
            "correlation": c_p4,
            "errors_single": errors(p4["single"], truth, thickness),
            "errors_iterated": errors(p4["iterated"], truth, thickness),
        },
        "py4dstem_convention_check_pearson_at_truth": conv,
    }
    for who, fit, err, c, t in (
        ("ours", ours["fitted"], case["ours"]["errors"], ours["correlation"], ours["wall_s"]),
        ("p4 single", p4["single"], case["py4dstem"]["errors_single"], None, p4["wall_single_s"]),
        (
            "p4 iter",
            p4["iterated"],
            case["py4dstem"]["errors_iterated"],
            c_p4,
            p4["wall_iterated_s"],
        ),
    ):
        cs = f" r={c['pearson']:.4f}" if c else ""
        print(
            f"  {who:9s} C10 {fit['C10']:8.2f} C12 {fit['C12']:6.2f} phi12 {fit['phi12']:+.3f}"
            f" | dC10 {err['C10']:+7.2f} (exit {err['C10_vs_exit']:+7.2f}) dC12 "
            f"{err['C12']:+6.2f} dphi12 {err['phi12_mod_pi']:+.3f}{cs} {t:.2f} s",
            flush=True,
        )
    return case


def main() -> None:
    """Parse arguments, run every case, write the record."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sim-dir", default="/tmp/p4fit")
    ap.add_argument("--foc-dir", default="/tmp/calval")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="name:dose[:py4DSTEM num_trotters],...")
    ap.add_argument(
        "--abtem-python",
        default="/tmp/abtem-venv-E/bin/python",
        help="abTEM venv interpreter, for cases not simulated yet",
    )
    ap.add_argument(
        "--p4-mem-limit-gb",
        type=float,
        default=4.0,
        help="refuse a py4DSTEM fit whose design arrays would exceed this",
    )
    ap.add_argument("--seed", type=int, default=0, help="Poisson seed")
    ap.add_argument(
        "--ours-python",
        default="python3",
        help="interpreter with the quantem.gpu wheel (our fit runs there)",
    )
    ap.add_argument("--out", default=None, help="write the result JSON here")
    ap.add_argument("--ours-worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.ours_worker:
        ours_worker(*a.ours_worker)
        return

    import warnings

    warnings.filterwarnings("ignore")
    import py4DSTEM

    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in [c for c in a.cases.split(",") if c]:
            cases.append(run_case(py4DSTEM, spec, a, tmp))
    ours_v = subprocess.run(
        [a.ours_python, "-c", "import quantem.gpu as q; print(q.__version__)"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    rec = {
        "what": "issue 20 item 4: C10/C12/phi12 fit, ours (ssb.SSB.fit) vs py4DSTEM 0.14.18 "
        "DirectPtychography SSB aberration_fit, same Poisson counts of abTEM SrTiO3 [001]",
        **run_provenance(py4DSTEM),
        "quantem_gpu_version": ours_v,
        "method_doc": __doc__,
        "errors_note": "C10 = fit - truth (abTEM entrance plane); C10_vs_exit = fit - (truth + t); "
        "phi12_mod_pi wrapped to (-pi/2, pi/2]",
        "cases": cases,
    }
    write_record(a.out, rec)


if __name__ == "__main__":
    main()
