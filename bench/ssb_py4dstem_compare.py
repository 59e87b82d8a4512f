#!/usr/bin/env python3
"""
py4DSTEM 0.14.18 SSB vs our SSB, both at the TRUE aberrations, on the abTEM SrTiO3 validation data
(issue 6: "The reconstructed phase correlates with the simulated phase at least as well as
py4DSTEM's SSB given the true aberrations on the same data").

Runs in the reference environment (numpy < 2):
    python3 -m venv /tmp/refs-venv
    /tmp/refs-venv/bin/pip install -c "${ANCHOR_TOOLS:-tests/tools}"/requirements-refs.lock.txt numpy py4DSTEM
    /tmp/refs-venv/bin/python bench/ssb_py4dstem_compare.py \
        --sim-dir /tmp/ssbval --cases sto_t1_d1e6,sto_t1_d1e5,sto_d1e6,sto_d1e5 \
        --ours-python python3 --out bench/results/cpu_ssb_py4dstem_compare.json

Inputs per case NAME (all in --sim-dir):
  NAME.npz        simulate_abtem.py output: 'counts' (scan_r, scan_c, det_r, det_c) uint16 Poisson
                  counts (the same counts that make_dectris.py wrote for our engine), the truth
                  'phase_scan_2alpha' (scan_r, scan_c), and every calibration.
  val_NAME.json   crates/qem-bench/examples/ssb_validation.rs output: our engine's
                  reconstruction at the true aberrations
                  (runs[det_sampling='true'|'default'].reconstructions.true).
Our engine is also re-run here (optional, --ours-python: an interpreter with the quantem.gpu wheel,
numpy >= 2 is fine) on the npz counts as a cross-check of the JSON numbers.

Correlation measure = exactly ssb_validation.rs `correlation()`: Pearson r of the phase image with
the truth at zero shift ("pearson"), and the best Pearson r over circular shifts |dr|,|dc| <= 3 of
the phase, shifted[r, c] = phase[(r+dr) % nr, (c+dc) % nc] ("best_shifted_pearson").
Arrays are compared in the same (scan axis 0, scan axis 1) orientation as the data; no flips.

Conventions (from py4DSTEM/process/phase/utils.py ComplexProbe.evaluate_chi / polar_coordinates
and direct_ptychography.py _set_polar_parameters):
  chi = 2 pi / lambda * (1/2 alpha^2 (C10 + C12 cos(2 (phi - phi12))) + ...), probe = A exp(-i chi),
  'defocus' alias = -C10  -> identical to ours (chi has +pi C10 alpha^2 / lambda) and to abTEM, so
  C10 = +100 A is passed as C10 = +100.
  phi = arctan2(ky, kx) with kx along array axis 0 (scan/detector rows), ky along axis 1 ->
  identical to ours (atan2(k_col, k_row)); with rotation 0 and no transpose, phi12_relative = phi12.
  The candidate alternatives (C10 sign flipped, phi12 -> -phi12, phi12 -> pi/2 - phi12) are also
  reconstructed and reported as a check.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np


def pearson(a, b):
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    a = a - a.mean()
    b = b - b.mean()
    return float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum()))


def correlation(phase, truth):
    """Same as ssb_validation.rs: zero-shift Pearson and best over circular shifts |s| <= 3."""
    phase = np.asarray(phase, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    zero = pearson(phase, truth)
    best = (-np.inf, 0, 0)
    for dr in range(-3, 4):
        for dc in range(-3, 4):
            # shifted[r, c] = phase[(r + dr) % nr, (c + dc) % nc]
            shifted = np.roll(phase, shift=(-dr, -dc), axis=(0, 1))
            c = pearson(shifted, truth)
            if c > best[0]:
                best = (c, dr, dc)
    return {"pearson": zero, "best_shifted_pearson": best[0], "best_shift_px": [best[1], best[2]]}


def run_provenance(py4dstem):
    """How and where a record was made: command, date, host, interpreter and library versions
    (also used by ssb_py4dstem_fit_compare.py)."""
    return {
        "command": " ".join([sys.executable] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "host_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "py4dstem_version": py4dstem.__version__,
        "numpy_version": np.__version__,
    }


def write_record(path, rec):
    """``rec`` as indented JSON at ``path`` (``--out``; nothing when it is not given)."""
    if path:
        with open(path, "w") as f:
            json.dump(rec, f, indent=1)
        print("wrote", path)


# --------------------------------------------------------------------------- our engine (worker)
def ours_worker(npz_path, det_sampling):
    """Runs in an interpreter with the quantem.gpu wheel; prints one JSON line."""
    from quantem.gpu import io, ssb

    z = np.load(npz_path)
    ds = io.load(np.ascontiguousarray(z["counts"]), backend="cpu")
    step = [float(v) for v in z["scan_step_A"]]
    kw = dict(
        voltage_kv=float(z["energy_eV"]) / 1e3,
        semiangle_mrad=float(z["semiangle_mrad"]),
        scan_step_a=step,
        rotation_deg=0.0,
    )
    if det_sampling == "true":
        kw["det_sampling_mrad"] = float(np.mean(z["angular_sampling_mrad"]))
    t0 = time.perf_counter()
    s = ssb.SSB(ds, **kw)
    t1 = time.perf_counter()
    ab = {
        "C10": float(z["C10_A"]),
        "C12": float(z["C12_A"]),
        "phi12": float(z["phi12_rad"]),
        "C30": float(z["C30_A"]),
    }
    r = s.reconstruct(ab)
    t2 = time.perf_counter()
    shape = z["phase_scan_2alpha"].shape
    obj = np.asarray(r.object).reshape(shape)
    out = {
        "det_sampling": det_sampling,
        "params": kw,
        "aberrations": ab,
        "correlation": correlation(np.asarray(r.phase).reshape(shape), z["phase_scan_2alpha"]),
        # The first-order phase Im O / Re O (SSBResult.weak_phase): Re O is the constant DC.
        "correlation_weak_phase": correlation(
            np.asarray(r.weak_phase).reshape(shape), z["phase_scan_2alpha"]
        ),
        "re_object_relative_spread": float(obj.real.std() / obj.real.mean()),
        # Diagnostic: arg O with the DC 10 % larger (py4DSTEM's DC sums |G(k, 0)| over every
        # pixel of its crop, dark field included): how much of a gap a DC scale makes.
        "correlation_arg_with_dc_x1.1": correlation(
            np.angle(1.1 * obj.real + 1j * obj.imag), z["phase_scan_2alpha"]
        ),
        "prepare_s": t1 - t0,
        "reconstruct_s": t2 - t1,
    }
    print(json.dumps(out))


def run_ours(python, npz_path, det_sampling):
    p = subprocess.run(
        [python, os.path.abspath(__file__), "--ours-worker", npz_path, det_sampling],
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        return {"error": p.stderr[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- py4DSTEM
def make_datacube(py4DSTEM, counts, step_a, q_mrad):
    dc = py4DSTEM.DataCube(data=counts.astype(np.float32))
    dc.calibration.set_R_pixel_size(step_a)
    dc.calibration.set_R_pixel_units("A")
    dc.calibration.set_Q_pixel_size(q_mrad)
    dc.calibration.set_Q_pixel_units("mrad")
    return dc


def p4_ssb(py4DSTEM, counts, z, q_mrad, polar, crop=True, num_jobs=1, rolloff=2.0):
    from py4DSTEM.process.phase import SSB

    step = float(z["scan_step_A"][0])
    dc = make_datacube(py4DSTEM, counts, step, q_mrad)
    t0 = time.perf_counter()
    s = SSB(
        energy=float(z["energy_eV"]),
        datacube=dc,
        semiangle_cutoff=float(z["semiangle_mrad"]),
        polar_parameters=dict(polar),
        rolloff=rolloff,
        verbose=False,
    )
    s.preprocess(
        crop_around_bf_disk=crop,
        plot_center_of_mass=None,
        plot_rotation=False,
        plot_overlap_trotters=False,
        force_com_rotation=0.0,
        force_com_transpose=False,
    )
    t1 = time.perf_counter()
    s.reconstruct(num_jobs=num_jobs, progress_bar=False)
    t2 = time.perf_counter()
    return s, np.angle(s.object), t1 - t0, t2 - t1


def case_notes(case):
    """Plain-language notes computed from the numbers (nothing hard-coded)."""
    n = []
    d = case["ours_minus_py4dstem"]
    if d is not None:
        who = "ours is better" if d > 0 else ("py4DSTEM is better" if d < 0 else "tie")
        n.append(
            f"same calibrations (true detector sampling): ours {case['ours_corr']:.4f} vs py4DSTEM "
            f"{case['py4dstem_corr']:.4f}, diff {d:+.4f} ({who}; requirement 'at least as well' "
            f"{'met' if d >= 0 else 'NOT met'} at this calibration)"
        )
    var = case.get("py4dstem_variants", {})
    for k, vv in var.items():
        if k.startswith("ours_default_sampling") and "ours_default_sampling_corr" in case:
            p4d = vv["correlation"]["pearson"]
            od = case["ours_default_sampling_corr"]
            n.append(
                f"both at our default detector sampling alpha/r_BF = {vv['Q_pixel_size_mrad']:.4f} mrad: "
                f"ours {od:.4f} vs py4DSTEM {p4d:.4f}, diff {od - p4d:+.4f}"
            )
    best_var = max(
        ((k, vv["correlation"]["pearson"]) for k, vv in var.items() if "correlation" in vv),
        key=lambda t: t[1],
        default=None,
    )
    if best_var:
        n.append(f"best py4DSTEM variant: {best_var[0]} r={best_var[1]:.4f}")
    conv = case.get("py4dstem_convention_check", {})
    if conv:
        best = max(conv, key=lambda k: conv[k]["correlation"]["pearson"])
        n.append(
            f"convention check: highest r with '{best}' "
            + ", ".join(
                f"{k.split(' ')[0]} {v['correlation']['pearson']:.4f}" for k, v in conv.items()
            )
        )
    rr = case.get("ours_rerun_wheel", {}).get("true")
    if rr and "error" not in rr and case["ours_corr"] is not None:
        n.append(
            f"ours re-run from the npz counts with the wheel: r={rr['correlation']['pearson']:.6f} "
            f"(|diff| vs val JSON {abs(rr['correlation']['pearson'] - case['ours_corr']):.1e}); "
            f"reconstruct {rr['reconstruct_s']:.3f} s vs py4DSTEM reconstruct "
            f"{case['py4dstem']['reconstruct_s']:.2f} s"
        )
    return n


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sim-dir", default="/tmp/ssbval")
    ap.add_argument("--cases", default="sto_t1_d1e6,sto_t1_d1e5,sto_d1e6,sto_d1e5")
    ap.add_argument(
        "--num-jobs", type=int, default=1, help="py4DSTEM SSB.reconstruct num_jobs (timed run)"
    )
    ap.add_argument(
        "--ours-python",
        default=None,
        help="interpreter with the quantem.gpu wheel for a re-run of our engine (optional)",
    )
    ap.add_argument("--out", default=None, help="write the result JSON here")
    ap.add_argument("--ours-worker", nargs=2, metavar=("NPZ", "SAMPLING"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.ours_worker:
        ours_worker(*a.ours_worker)
        return

    import warnings

    warnings.filterwarnings("ignore")
    import py4DSTEM

    rec = {
        "what": "issue 6: py4DSTEM SSB vs ours (qem::ssb CPU), both at the TRUE aberrations, on the abTEM "
        "multislice SrTiO3 [001] validation data; phase vs truth 'phase_scan_2alpha' "
        "(band-limited to 2 alpha/lambda), Pearson r as in crates/qem-bench/examples/ssb_validation.rs",
        **run_provenance(py4DSTEM),
        "correlation_measure": "pearson = Pearson r(phase, truth) at zero shift; best_shifted_pearson = max "
        "over circular shifts |dr|,|dc|<=3 of phase[(r+dr)%n,(c+dc)%n] (as ssb_validation.rs)",
        "cases": [],
    }
    for name in [c for c in a.cases.split(",") if c]:
        npz = os.path.join(a.sim_dir, f"{name}.npz")
        z = np.load(npz)
        truth = z["phase_scan_2alpha"].astype(np.float64)
        counts = z["counts"]
        q_true = float(np.mean(z["angular_sampling_mrad"]))
        polar_true = {
            "C10": float(z["C10_A"]),
            "C12": float(z["C12_A"]),
            "phi12": float(z["phi12_rad"]),
            "C30": float(z["C30_A"]),
        }
        case = {
            "name": name,
            "dose_e_per_frame": float(z["electrons_per_frame"]),
            "dose_e_per_A2": float(z["dose_e_per_A2"]),
            "thickness_cells": int(z["thickness_cells"]),
            "scan_shape": list(map(int, z["scan_shape"])),
            "det_shape": list(map(int, z["det_shape"])),
        }

        # ---- ours from the validation JSON
        vpath = os.path.join(a.sim_dir, f"val_{name}.json")
        ours = {}
        if os.path.exists(vpath):
            v = json.load(open(vpath))
            tpath = v.get("truth")
            if tpath and os.path.exists(tpath):
                t = np.fromfile(tpath, dtype="<f8").reshape(truth.shape)
                case["truth_file_matches_npz"] = bool(np.array_equal(t, truth))
            for run in v["runs"]:
                rt = run["reconstructions"]["true"]
                ours[run["det_sampling"]] = {
                    "det_sampling_mrad_used": run["det_sampling_mrad_used"],
                    "aberrations": {
                        k: rt["aberrations"][k] for k in ("C10", "C12", "phi12", "C30")
                    },
                    "correlation": rt["correlation"],
                    "object_s": rt["object_s"],
                    "n_bf_pixels": run["n_bf_pixels"],
                    "source": vpath,
                }
        case["ours_from_val_json"] = ours

        # ---- py4DSTEM, primary: true calibrations, true aberrations, defaults otherwise
        print(
            f"== {name}: {case['dose_e_per_frame']:.0f} e/frame, {case['thickness_cells']} cell(s)",
            flush=True,
        )
        s, ph, t_pre, t_rec = p4_ssb(
            py4DSTEM, counts, z, q_true, polar_true, crop=True, num_jobs=a.num_jobs
        )
        c_main = correlation(ph, truth)
        case["py4dstem_parameters"] = {
            "DataCube": {
                "data": "npz['counts'] as float32",
                "R_pixel_size": float(z["scan_step_A"][0]),
                "R_pixel_units": "A",
                "Q_pixel_size": q_true,
                "Q_pixel_units": "mrad",
            },
            "SSB": {
                "energy": float(z["energy_eV"]),
                "semiangle_cutoff": float(z["semiangle_mrad"]),
                "polar_parameters": polar_true,
                "rolloff": 2.0,
                "vacuum_probe_intensity": None,
            },
            "preprocess": {
                "crop_around_bf_disk": True,
                "force_com_rotation": 0.0,
                "force_com_transpose": False,
                "fit_function": "default ('plane')",
                "shifting_interpolation_order": "default (3)",
            },
            "reconstruct": {"phase_compensation": True, "num_jobs": a.num_jobs},
        }
        case["py4dstem"] = {
            "correlation": c_main,
            "preprocess_s": t_pre,
            "reconstruct_s": t_rec,
            "total_s": t_pre + t_rec,
            "num_jobs": a.num_jobs,
            "intensities_shape_after_crop": list(map(int, s._intensities_shape)),
            "angular_sampling_mrad": list(s._angular_sampling),
            "scan_sampling_A": list(s._scan_sampling),
            "rotation_best_rad": float(s._rotation_best_rad),
            "transpose": bool(s._rotation_best_transpose),
            "polar_parameters_relative_used": {
                k: float(s._polar_parameters_relative[k]) for k in ("C10", "C12", "phi12", "C30")
            },
        }
        print(
            f"  py4DSTEM SSB (true ab, true sampling {q_true:.4f} mrad): r={c_main['pearson']:.4f} "
            f"best_shifted={c_main['best_shifted_pearson']:.4f} @ {c_main['best_shift_px']}  "
            f"preprocess {t_pre:.2f} s + reconstruct {t_rec:.2f} s (num_jobs={a.num_jobs})",
            flush=True,
        )

        # ---- convention check: alternative sign / angle conventions on the same preprocessed object
        conv = {}
        alts = {
            "as_given (source says right)": polar_true,
            "C10_sign_flipped": dict(polar_true, C10=-polar_true["C10"]),
            "phi12_negated": dict(polar_true, phi12=-polar_true["phi12"]),
            "phi12_axes_swapped (pi/2-phi12)": dict(
                polar_true, phi12=np.pi / 2 - polar_true["phi12"]
            ),
        }
        for k, pp in alts.items():
            s.reconstruct(num_jobs=1, progress_bar=False, polar_parameters=dict(pp))
            conv[k] = {
                "polar_parameters": pp,
                "correlation": correlation(np.angle(s.object), truth),
            }
            print(f"    convention {k:32s} r={conv[k]['correlation']['pearson']:.4f}")
        case["py4dstem_convention_check"] = conv

        # ---- variants: no BF crop; detector sampling = our 'default' (alpha / r_BF)
        var = {}
        _, ph2, tp2, tr2 = p4_ssb(py4DSTEM, counts, z, q_true, polar_true, crop=False, num_jobs=1)
        var["true_sampling_crop_around_bf_disk_False"] = {
            "correlation": correlation(ph2, truth),
            "total_s": tp2 + tr2,
        }
        _, ph5, tp5, tr5 = p4_ssb(
            py4DSTEM, counts, z, q_true, polar_true, crop=True, num_jobs=1, rolloff=0.0
        )
        var["true_sampling_rolloff_0 (hard aperture edge)"] = {
            "correlation": correlation(ph5, truth),
            "total_s": tp5 + tr5,
        }
        if "default" in ours:
            qd = ours["default"]["det_sampling_mrad_used"]
            _, ph3, tp3, tr3 = p4_ssb(py4DSTEM, counts, z, qd, polar_true, crop=True, num_jobs=1)
            var[f"ours_default_sampling_{qd:.4f}_mrad"] = {
                "Q_pixel_size_mrad": qd,
                "correlation": correlation(ph3, truth),
                "total_s": tp3 + tr3,
            }
        if a.num_jobs != 2:
            _, ph4, tp4, tr4 = p4_ssb(
                py4DSTEM, counts, z, q_true, polar_true, crop=True, num_jobs=2
            )
            var["num_jobs_2_timing"] = {
                "preprocess_s": tp4,
                "reconstruct_s": tr4,
                "total_s": tp4 + tr4,
                "max_abs_phase_diff_vs_num_jobs_1": float(np.abs(ph4 - ph).max()),
            }
        for k, vv in var.items():
            extra = f" r={vv['correlation']['pearson']:.4f}" if "correlation" in vv else ""
            print(f"    variant {k:40s}{extra} total {vv['total_s']:.2f} s")
        case["py4dstem_variants"] = var

        # ---- our engine re-run (cross-check of the JSON)
        if a.ours_python:
            rr = {smp: run_ours(a.ours_python, npz, smp) for smp in ("true", "default")}
            case["ours_rerun_wheel"] = rr
            for smp, o in rr.items():
                if "error" in o:
                    print(f"  ours re-run [{smp}] failed: {o['error'][-300:]}")
                else:
                    print(
                        f"  ours re-run [{smp}] r={o['correlation']['pearson']:.4f} "
                        f"weak_phase r={o['correlation_weak_phase']['pearson']:.4f} "
                        f"reconstruct {o['reconstruct_s']:.3f} s"
                    )
            wt = rr["true"]
            if "error" not in wt:
                case["ours_weak_phase_corr"] = wt["correlation_weak_phase"]["pearson"]
                case["ours_weak_phase_minus_py4dstem"] = (
                    wt["correlation_weak_phase"]["pearson"] - c_main["pearson"]
                )

        # ---- headline: same calibration given to both (true detector sampling)
        if "true" in ours:
            oc = ours["true"]["correlation"]["pearson"]
            src = "val_json runs[det_sampling=true].reconstructions.true.correlation.pearson"
        elif a.ours_python and "error" not in case["ours_rerun_wheel"]["true"]:
            oc = case["ours_rerun_wheel"]["true"]["correlation"]["pearson"]
            src = "wheel re-run, det_sampling=true"
        else:
            oc, src = None, "missing"
        case["py4dstem_corr"] = c_main["pearson"]
        case["ours_corr"] = oc
        case["ours_corr_source"] = src
        case["ours_minus_py4dstem"] = None if oc is None else oc - c_main["pearson"]
        case["py4dstem_seconds"] = t_pre + t_rec
        if "default" in ours:
            od = ours["default"]["correlation"]["pearson"]
            case["ours_default_sampling_corr"] = od
            case["ours_default_sampling_minus_py4dstem"] = od - c_main["pearson"]
        case["notes"] = case_notes(case)
        print(
            f"  ours (true sampling) r={oc:.4f}  ours - py4DSTEM = {case['ours_minus_py4dstem']:+.4f}",
            flush=True,
        )
        rec["cases"].append(case)

    rec["py4dstem_call"] = (
        "dc = py4DSTEM.DataCube(data=counts.astype(float32)); dc.calibration.set_R_pixel_size(scan_step_A[0]); "
        "set_R_pixel_units('A'); set_Q_pixel_size(angular_sampling_mrad); set_Q_pixel_units('mrad'); "
        "s = SSB(energy=energy_eV, datacube=dc, semiangle_cutoff=semiangle_mrad, "
        "polar_parameters={'C10': C10_A, 'C12': C12_A, 'phi12': phi12_rad, 'C30': C30_A}, verbose=False); "
        "s.preprocess(crop_around_bf_disk=True, plot_center_of_mass=None, plot_rotation=False, "
        "plot_overlap_trotters=False, force_com_rotation=0.0, force_com_transpose=False); "
        f"s.reconstruct(num_jobs={a.num_jobs}, progress_bar=False); phase = np.angle(s.object)"
    )
    rec["conventions"] = (
        "Decided from py4DSTEM 0.14.18 source, not guessed: utils.py ComplexProbe.evaluate_chi has "
        "chi = 2pi/lambda*(alpha^2/2*(C10 + C12 cos(2(phi-phi12))) + ...), probe = A*exp(-i chi), and "
        "_set_polar_parameters maps 'defocus' to -C10 -> same sign as ours, C10 = +100 A passed as C10=+100. "
        "polar_coordinates: phi = arctan2(ky, kx), kx along array axis 0 -> same as ours (atan2(k_col, k_row)); "
        "rotation forced 0, no transpose, so phi12_relative = phi12 = 0.5 rad. The data agree: the as-given "
        "parameters give the highest r of the four candidates in every case (py4dstem_convention_check)."
    )
    diffs = [c["ours_minus_py4dstem"] for c in rec["cases"] if c["ours_minus_py4dstem"] is not None]
    if diffs:
        rec["summary"] = {
            "ours_minus_py4dstem_same_calibration": {
                c["name"]: c["ours_minus_py4dstem"] for c in rec["cases"]
            },
            "ours_default_minus_py4dstem_default_sampling": {
                c["name"]: c["notes"][1] for c in rec["cases"] if len(c["notes"]) > 1
            },
            "requirement_met_all_cases_same_calibration": bool(min(diffs) >= 0),
            "min_diff": min(diffs),
            "max_diff": max(diffs),
        }
        wdiffs = [
            c["ours_weak_phase_minus_py4dstem"]
            for c in rec["cases"]
            if c.get("ours_weak_phase_minus_py4dstem") is not None
        ]
        if wdiffs:
            rec["summary"]["weak_phase"] = {
                "what": "ours SSBResult.weak_phase = Im O / Re O (first-order phase) vs py4DSTEM's "
                "angle(object), same calibrations (true detector sampling)",
                "ours_minus_py4dstem": {
                    c["name"]: c.get("ours_weak_phase_minus_py4dstem") for c in rec["cases"]
                },
                "requirement_met_all_cases": bool(min(wdiffs) >= 0),
                "min_diff": min(wdiffs),
                "max_diff": max(wdiffs),
            }
    write_record(a.out, rec)


if __name__ == "__main__":
    main()
