//! Physical validation of SSB against abTEM multislice data (issue 6, "Validation that must pass").
//!
//! ```text
//! cargo run --release -p qem-bench --example ssb_validation -- MASTER.h5 SIM.json OUT.json \
//!     [--truth TRUTH.f64] [--seed S] [--global N] [--local-iter N] [--starts N] \
//!     [--c10-range LO,HI] [--c12-range LO,HI] [--phi12-range LO,HI] \
//!     [--samplings default,true] [--objectives phase_variance,coherence]
//! ```
//!
//! * `MASTER.h5`: the Dectris acquisition written by `tests/tools/make_dectris.py` from a
//!   `tests/tools/simulate_abtem.py` simulation; loaded with `qem::load` on the CPU backend.
//! * `SIM.json`: the simulation's sidecar (energy, semiangle, scan step, angular sampling, the true
//!   aberrations; abTEM `defocus` = −C10).
//! * `TRUTH.f64`: optional raw little-endian f64 `(scan_rows, scan_cols)` of the simulation's
//!   `phase_scan_2alpha` (the ground-truth phase band-limited to 2α/λ, what SSB can see):
//!   `python -c "import numpy as n; n.load('sim.npz')['phase_scan_2alpha'].astype('<f8').tofile('t.f64')"`.
//!   With it every reconstruction reports its Pearson correlation with the truth (at zero shift,
//!   and the best over circular shifts of ±3 scan pixels, with the shift).
//!
//! For each detector sampling (`default` = α/r_BF, `true` = the sidecar's angular sampling) it
//! reconstructs with the true aberrations, with C10 of the wrong sign (sign check) and with none,
//! and fits C10, C12, φ12 from 0 with each objective; everything goes into `OUT.json`.
use qem::ssb::{Aberrations, FitParams, Objective, Ssb, SsbParams, SsbResult};
use qem::{load, BackendRequest, LoadParams, SourceArg};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Instant;

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn pearson(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len() as f64;
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let (mut sab, mut saa, mut sbb) = (0.0, 0.0, 0.0);
    for (x, y) in a.iter().zip(b) {
        sab += (x - ma) * (y - mb);
        saa += (x - ma) * (x - ma);
        sbb += (y - mb) * (y - mb);
    }
    sab / (saa * sbb).sqrt()
}

/// Correlation at zero shift, and the best over circular shifts |s| ≤ 3 of the phase.
fn correlation(r: &SsbResult, truth: &[f64]) -> Value {
    let (nr, nc) = (r.scan_shape.rows, r.scan_shape.cols);
    let zero = pearson(&r.phase, truth);
    let mut best = (f64::NEG_INFINITY, 0i64, 0i64);
    for dr in -3i64..=3 {
        for dc in -3i64..=3 {
            let shifted: Vec<f64> = (0..nr * nc)
                .map(|i| {
                    let rr = ((i / nc) as i64 + dr).rem_euclid(nr as i64) as usize;
                    let cc = ((i % nc) as i64 + dc).rem_euclid(nc as i64) as usize;
                    r.phase[rr * nc + cc]
                })
                .collect();
            let c = pearson(&shifted, truth);
            if c > best.0 {
                best = (c, dr, dc);
            }
        }
    }
    json!({"pearson": zero, "best_shifted_pearson": best.0, "best_shift_px": [best.1, best.2]})
}

fn parse_range(s: &str) -> Res<(f64, f64)> {
    let (a, b) = s.split_once(',').ok_or("range is LO,HI")?;
    Ok((a.trim().parse()?, b.trim().parse()?))
}

fn f(v: &Value, k: &str) -> Res<f64> {
    v[k].as_f64()
        .ok_or_else(|| format!("sidecar lacks {k}").into())
}

fn rel(fitted: f64, truth: f64) -> f64 {
    (fitted - truth).abs() / truth.abs()
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 {
        return Err(
            "usage: ssb_validation MASTER.h5 SIM.json OUT.json [options] (see docs)".into(),
        );
    }
    let (master, sidecar, out_path) = (&args[0], &args[1], &args[2]);
    let mut truth_path = None;
    let mut fp = FitParams::default();
    let mut ranges: BTreeMap<String, (f64, f64)> = [
        ("C10", (-400.0, 400.0)),
        ("C12", (0.0, 100.0)),
        (
            "phi12",
            (-std::f64::consts::FRAC_PI_2, std::f64::consts::FRAC_PI_2),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let mut samplings = vec!["default".to_string(), "true".to_string()];
    let mut objectives = vec![Objective::PhaseVariance, Objective::Coherence];
    let mut i = 3;
    while i < args.len() {
        let v = args.get(i + 1).ok_or("option needs a value")?.clone();
        match args[i].as_str() {
            "--truth" => truth_path = Some(v),
            "--seed" => fp.seed = v.parse()?,
            "--global" => fp.global_evals = v.parse()?,
            "--local-iter" => fp.local_max_iter = v.parse()?,
            "--starts" => fp.local_starts = v.parse()?,
            "--c10-range" => _ = ranges.insert("C10".into(), parse_range(&v)?),
            "--c12-range" => _ = ranges.insert("C12".into(), parse_range(&v)?),
            "--phi12-range" => _ = ranges.insert("phi12".into(), parse_range(&v)?),
            "--samplings" => samplings = v.split(',').map(str::to_string).collect(),
            "--objectives" => {
                objectives = v
                    .split(',')
                    .map(|s| match s {
                        "phase_variance" => Ok(Objective::PhaseVariance),
                        "coherence" => Ok(Objective::Coherence),
                        _ => Err(format!("unknown objective {s}")),
                    })
                    .collect::<std::result::Result<_, _>>()?
            }
            o => return Err(format!("unknown option {o}").into()),
        }
        i += 2;
    }
    fp.ranges = ranges.clone();

    let sim: Value = serde_json::from_str(&std::fs::read_to_string(sidecar)?)?;
    let energy_ev = f(&sim, "energy_eV")?;
    let alpha = f(&sim, "semiangle_mrad")?;
    let step = (
        sim["scan_step_A"][0].as_f64().ok_or("scan_step_A")?,
        sim["scan_step_A"][1].as_f64().ok_or("scan_step_A")?,
    );
    let true_ang = (
        sim["angular_sampling_mrad"][0]
            .as_f64()
            .ok_or("angular_sampling_mrad")?,
        sim["angular_sampling_mrad"][1]
            .as_f64()
            .ok_or("angular_sampling_mrad")?,
    );
    let truth_ab = Aberrations {
        c10: f(&sim, "C10_A")?,
        c12: f(&sim, "C12_A")?,
        phi12: f(&sim, "phi12_rad")?,
        c30: f(&sim, "C30_A")?,
        ..Aberrations::default()
    };

    let t = Instant::now();
    let ds = load(
        SourceArg::Path(master.into()),
        &LoadParams {
            backend: BackendRequest::Cpu,
            ..LoadParams::default()
        },
    )?;
    let t_load = t.elapsed().as_secs_f64();
    let scan = ds.scan_shape();
    let truth: Option<Vec<f64>> = match &truth_path {
        Some(p) => {
            let bytes = std::fs::read(p)?;
            let v: Vec<f64> = bytes
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect();
            if v.len() != scan.len() {
                return Err(format!("truth has {} values, scan {}", v.len(), scan.len()).into());
            }
            Some(v)
        }
        None => None,
    };
    let corr = |r: &SsbResult| {
        truth
            .as_ref()
            .map(|t| correlation(r, t))
            .unwrap_or(Value::Null)
    };

    let mut runs = Vec::new();
    for s in &samplings {
        let det_sampling = match s.as_str() {
            "default" => None,
            "true" => Some(0.5 * (true_ang.0 + true_ang.1)),
            x => Some(x.parse::<f64>()?),
        };
        let params = SsbParams {
            voltage_kv: energy_ev / 1e3,
            semiangle_mrad: alpha,
            scan_step_a: step,
            det_sampling_mrad: det_sampling,
            rotation_deg: 0.0,
            ..SsbParams::default()
        };
        let t = Instant::now();
        let ssb = Ssb::new(&ds, &params)?;
        let t_prep = t.elapsed().as_secs_f64();
        eprintln!(
            "[{s}] {} BF px, r_BF {:.3} px, centre {:?}, dθ {:.4} mrad (true {:.4}), prepare {t_prep:.2} s",
            ssb.n_bf_pixels(),
            ssb.disk.radius_px,
            ssb.disk.center_px,
            ssb.det_sampling_mrad,
            true_ang.0
        );
        let mut recon = serde_json::Map::new();
        let wrong_sign = Aberrations {
            c10: -truth_ab.c10,
            ..truth_ab
        };
        let only_c10 = Aberrations {
            c10: truth_ab.c10,
            ..Aberrations::default()
        };
        for (name, ab) in [
            ("true", truth_ab),
            ("c10_wrong_sign", wrong_sign),
            ("c10_only", only_c10),
            ("none", Aberrations::default()),
        ] {
            let t = Instant::now();
            let r = ssb.reconstruct(&ab)?;
            let t_obj = t.elapsed().as_secs_f64();
            let losses: serde_json::Map<String, Value> = objectives
                .iter()
                .map(|&o| Ok((o.name().to_string(), json!(ssb.objective(&ab, o)?))))
                .collect::<qem::Result<_>>()?;
            eprintln!("[{s}] recon {name}: {} losses {:?}", corr(&r), losses);
            recon.insert(
                name.into(),
                json!({"aberrations": ab.to_map(), "correlation": corr(&r),
                       "losses": losses, "object_s": t_obj}),
            );
        }
        let mut fits = Vec::new();
        // Each objective with the default coarse stages and with every loss over all pixels.
        for (o, coarse) in objectives.iter().flat_map(|&o| [(o, true), (o, false)]) {
            let fpo = FitParams {
                objective: o,
                coarse,
                ..fp.clone()
            };
            let t = Instant::now();
            let fit = ssb.fit(&fpo)?;
            let t_fit = t.elapsed().as_secs_f64();
            let a = fit.aberrations;
            // C12 with (C12, φ12) ≡ (−C12, φ12 ± π/2) and φ12 mod π: compare φ12 modulo π.
            let dphi = {
                let d = (a.phi12 - truth_ab.phi12).rem_euclid(std::f64::consts::PI);
                d.min(std::f64::consts::PI - d)
            };
            let c10_err = rel(a.c10, truth_ab.c10);
            let c12_err = rel(a.c12, truth_ab.c12);
            let v = json!({
                "objective": o.name(),
                "coarse": coarse,
                "coarse_pixels": fit.provenance.params["fit"]["coarse_pixels"],
                "coarse_evaluations": fit.provenance.params["fit"]["coarse_evaluations"],
                "fitted": a.to_map(),
                "true": truth_ab.to_map(),
                "C10_rel_err": c10_err,
                "C12_rel_err": c12_err,
                "phi12_abs_err_rad_mod_pi": dphi,
                "loss": fit.loss,
                "loss_at_true": ssb.objective(&truth_ab, o)?,
                "evaluations": fit.evaluations,
                "fit_s": t_fit,
                "correlation_at_fit": corr(&fit.result),
                "targets": {
                    "high_dose": c10_err <= 0.02 && c12_err <= 0.10,
                    "realistic_dose": c10_err <= 0.02 && c12_err <= 0.20,
                },
            });
            eprintln!("[{s}] fit {}: {v}", o.name());
            fits.push(v);
        }
        runs.push(json!({
            "det_sampling": s,
            "det_sampling_mrad_used": ssb.det_sampling_mrad,
            "bf_radius_px": ssb.disk.radius_px,
            "bf_center_px": [ssb.disk.center_px.0, ssb.disk.center_px.1],
            "n_bf_pixels": ssb.n_bf_pixels(),
            "prepare_s": t_prep,
            "reconstructions": recon,
            "fits": fits,
        }));
    }
    let out = json!({
        "master": master,
        "sidecar": sidecar,
        "truth": truth_path,
        "load_s": t_load,
        "scan_shape": [scan.rows, scan.cols],
        "detector_shape": [ds.detector_shape().rows, ds.detector_shape().cols],
        "voltage_kv": energy_ev / 1e3,
        "semiangle_mrad": alpha,
        "scan_step_a": [step.0, step.1],
        "true_angular_sampling_mrad": [true_ang.0, true_ang.1],
        "electrons_per_frame": sim["electrons_per_frame"],
        "dose_e_per_A2": sim["dose_e_per_A2"],
        "true_aberrations": truth_ab.to_map(),
        "fit_settings": {
            "seed": fp.seed, "global_evals": fp.global_evals, "local_max_iter": fp.local_max_iter,
            "local_starts": fp.local_starts, "start": "all 0",
            "ranges": ranges.iter().map(|(k, v)| (k.clone(), json!([v.0, v.1])))
                .collect::<serde_json::Map<_, _>>(),
        },
        "threads": rayon_threads(),
        "runs": runs,
    });
    std::fs::write(out_path, serde_json::to_string_pretty(&out)?)?;
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}
