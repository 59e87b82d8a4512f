//! SSB on the GPU (issue 6 evidence): prepare G, object, objectives and a 3-parameter fit on an
//! ENCODED GPU-resident acquisition, without a budget and under a whole-card budget (e.g.
//! 6 GiB: the dataset, the context and SSB together), with card memory read from the driver;
//! and a CPU-engine check of the object and losses on a scan region of the same file.
//!
//! ```text
//! cargo run --release -p qem-bench --example ssb_cuda_bench -- MASTER OUT.json LABEL \
//!     [--card-budget BYTES] [--cpu-check ROWS] [--fit-pv] [--repeats R] [--det-bin N]
//!     [--host-data] [--storages]
//! ```
//! `--storages` adds runs with G stored as complex f32, f16 and f12 (`GStorage::C32`, `C16`,
//! `C12`): the loss evaluation and the default fit timed on each, and the f16 and f12 fitted
//! values, their fitted points' f32 loss and their objects set against f32's (is a narrower G
//! accurate enough to fit on?).
//! `--host-data` loads the acquisition with the CPU engine (dense in host memory) and runs
//! SSB with `engine = Cuda`: the card holds G and the work buffers, not the dataset.
//! Optics: 300 kV, 25 mrad, 0.4 Å steps (the reference acquisition is synthetic; the timings
//! depend on the scan, the BF pixel count and the scan step only through the support of Γ).

use qem::ssb::{Aberrations, Fidelity, FitParams, GStorage, Objective, Ssb, SsbFit, SsbParams};
use qem::{BackendRequest, Dataset, Region, Representation};
use qem_bench::timing::time_p50;
use serde_json::{json, Value};
use std::time::Instant;

#[path = "shared/facade.rs"]
mod facade;
use facade::{load, rel_l2};

/// One warm-up, then `r` timed calls: (p50, all).
fn time<T>(r: usize, f: impl FnMut() -> qem::Result<T>) -> qem::Result<(f64, Vec<f64>)> {
    time_p50(r, f).map(|(p, all, _)| (p, all))
}

/// Bytes in use on the card (all processes' view: total − free).
fn card_used() -> qem::Result<u64> {
    let (free, total) = qem_cuda::engine()?.gpu.mem_info()?;
    Ok(total - free)
}

fn params(budget: Option<u64>) -> SsbParams {
    SsbParams {
        engine: BackendRequest::Cuda,
        voltage_kv: 300.0,
        semiangle_mrad: 25.0,
        scan_step_a: (0.4, 0.4),
        memory_budget: budget,
        ..SsbParams::default()
    }
}

fn probe_ab() -> Aberrations {
    Aberrations {
        c10: 120.0,
        c12: 25.0,
        phi12: 0.4,
        ..Default::default()
    }
}

fn bench_one(
    ds: &Dataset,
    ssb_budget: Option<u64>,
    r: usize,
    fit_pv: bool,
    used_before: u64,
) -> qem::Result<Value> {
    let t = Instant::now();
    let s = Ssb::new(ds, &params(ssb_budget))?;
    let prepare_s = t.elapsed().as_secs_f64();
    let card_after_prepare = card_used()?;
    let st = s
        .cuda_stats()
        .cloned()
        .ok_or_else(|| qem::Error::internal("ssb bench", "the SSB was not prepared on CUDA"))?;
    eprintln!(
        "prepared {} BF px in {prepare_s:.3} s ({:?}, {} batches of {}, {} staged per pass)",
        s.n_bf_pixels(),
        st.storage,
        st.batches,
        st.batch_pixels,
        st.staged_pixels
    );
    let ab = probe_ab();
    let (obj, obj_all) = time(r, || s.reconstruct(&ab))?;
    let (coh, coh_all) = time(r, || s.objective(&ab, Objective::Coherence))?;
    let (pv, pv_all) = time(r.min(5), || s.objective(&ab, Objective::PhaseVariance))?;
    let card_after_pv = card_used()?;
    eprintln!(
        "object {:.2} ms, coherence {:.2} ms, phase variance {:.2} ms",
        obj * 1e3,
        coh * 1e3,
        pv * 1e3
    );
    // The same evaluations with the general accumulate kernel (χ is quadratic at probe_ab, so
    // the timings above took the quadratic one).
    let quad_obj = s.reconstruct(&ab)?;
    s.set_cuda_quadratic_kernel(false);
    let general_obj = s.reconstruct(&ab)?;
    let (gobj, gobj_all) = time(r, || s.reconstruct(&ab))?;
    let (gcoh, gcoh_all) = time(r, || s.objective(&ab, Objective::Coherence))?;
    let gloss = s.objective(&ab, Objective::Coherence)?;
    s.set_cuda_quadratic_kernel(true);
    let qloss = s.objective(&ab, Objective::Coherence)?;
    eprintln!(
        "general kernel: object {:.2} ms, coherence {:.2} ms",
        gobj * 1e3,
        gcoh * 1e3
    );
    let general = json!({
        "object_p50_s": gobj,
        "object_all_s": gobj_all,
        "coherence_p50_s": gcoh,
        "coherence_all_s": gcoh_all,
        "object_rel_l2_re_quad_vs_general": rel_l2(&quad_obj.object_re, &general_obj.object_re),
        "object_rel_l2_im_quad_vs_general": rel_l2(&quad_obj.object_im, &general_obj.object_im),
        "coherence_quad": qloss,
        "coherence_general": gloss,
    });
    // The coherence loss over the fit's coarse sample (the first pixels of G).
    let (coarse_coh, coarse_coh_all) = time(r, || {
        s.objective_at(&ab, Objective::Coherence, Fidelity::Coarse)
    })?;
    eprintln!(
        "coarse coherence ({} of {} pixels) {:.2} ms",
        s.coarse_pixels(),
        s.n_bf_pixels(),
        coarse_coh * 1e3
    );
    let mut fits = Vec::new();
    // The default fit (coarse stages) and the all-pixel one, same seed: the time and the
    // fitted values side by side.
    let mut runs = vec![(Objective::Coherence, true), (Objective::Coherence, false)];
    if fit_pv {
        runs.push((Objective::PhaseVariance, true));
    }
    for (kind, coarse) in runs {
        let t = Instant::now();
        let f = s.fit(&FitParams {
            objective: kind,
            coarse,
            ..FitParams::default()
        })?;
        let secs = t.elapsed().as_secs_f64();
        let pf = &f.provenance.params["fit"];
        eprintln!(
            "fit ({}, coarse {coarse}) {secs:.3} s, {} evaluations ({} coarse): {:?}",
            kind.name(),
            f.evaluations,
            pf["coarse_evaluations"],
            f.aberrations
        );
        fits.push(json!({
            "objective": kind.name(),
            "coarse": pf["coarse"],
            "coarse_pixels": pf["coarse_pixels"],
            "coarse_evaluations": pf["coarse_evaluations"],
            "seconds": secs,
            "evaluations": f.evaluations,
            "ms_per_evaluation": secs * 1e3 / f.evaluations as f64,
            "fitted": f.aberrations.to_map(),
            "loss": f.loss,
            "params": ["C10", "C12", "phi12"],
            "search": pf["search"],
        }));
    }
    let card_peak_seen = card_after_prepare.max(card_after_pv).max(card_used()?);
    Ok(json!({
        "n_bf_pixels": s.n_bf_pixels(),
        "bf_radius_px": s.disk.radius_px,
        "det_sampling_mrad": s.det_sampling_mrad,
        "ssb_budget_bytes": ssb_budget,
        "g_storage": st.storage.name(),
        "g_bytes": st.g_bytes,
        "prepare_batches": st.batches,
        "prepare_batch_pixels": st.batch_pixels,
        "prepare_staged_pixels": st.staged_pixels,
        "prepare_s": prepare_s,
        "prepare_gather_fft_s": st.seconds,
        "object_p50_s": obj,
        "object_all_s": obj_all,
        "coherence_p50_s": coh,
        "coherence_all_s": coh_all,
        "coarse_pixels": s.coarse_pixels(),
        "coherence_coarse_p50_s": coarse_coh,
        "coherence_coarse_all_s": coarse_coh_all,
        "phase_variance_p50_s": pv,
        "phase_variance_all_s": pv_all,
        "fits": fits,
        "general_kernel": general,
        "ssb_peak_bytes_counted": s.cuda_peak_bytes(),
        "card_used_before_ssb": used_before,
        "card_used_after_prepare": card_after_prepare,
        "card_used_after_phase_variance": card_after_pv,
        "card_used_max_seen": card_peak_seen,
        "card_peak_bound": used_before + s.cuda_peak_bytes().unwrap_or(0),
    }))
}

/// The default coherence fit with G as f32, f16 and f12, side by side (same seed and search).
fn storage_compare(ds: &Dataset, r: usize) -> qem::Result<Value> {
    let storages = [
        ("f32", GStorage::C32),
        ("f16", GStorage::C16),
        ("f12", GStorage::C12),
    ];
    let ab = probe_ab();
    let mut side = serde_json::Map::new();
    let mut reference: Option<(Ssb, SsbFit)> = None;
    for (name, st) in storages {
        let s = Ssb::new(
            ds,
            &SsbParams {
                g_storage: Some(st),
                ..params(None)
            },
        )?;
        let (coh, _) = time(r, || s.objective(&ab, Objective::Coherence))?;
        let (coarse, _) = time(r, || {
            s.objective_at(&ab, Objective::Coherence, Fidelity::Coarse)
        })?;
        let (obj, _) = time(r, || s.reconstruct(&ab))?;
        let t = Instant::now();
        let f = s.fit(&FitParams::default())?;
        let secs = t.elapsed().as_secs_f64();
        eprintln!(
            "storage compare {name}: coherence {:.2} ms, coarse {:.2} ms, fit {secs:.3} s ({} evaluations): {:?}",
            coh * 1e3,
            coarse * 1e3,
            f.evaluations,
            f.aberrations
        );
        let mut run = json!({
            "g_storage": s.cuda_stats().map(|st| st.storage.name()),
            "g_bytes": s.cuda_stats().map(|st| st.g_bytes),
            "coherence_p50_s": coh,
            "coherence_coarse_p50_s": coarse,
            "object_p50_s": obj,
            "fit_seconds": secs,
            "fit_evaluations": f.evaluations,
            "fitted": f.aberrations.to_map(),
            "loss": f.loss,
        });
        // Against f32: the fitted values, the f32 loss at this fit, the loss at the probe
        // point and the object there.
        if let Some((s32, f32fit)) = &reference {
            let (a, b) = (&f32fit.aberrations, &f.aberrations);
            let l32_at_32 = s32.objective(a, Objective::Coherence)?;
            let l32_at_this = s32.objective(b, Objective::Coherence)?;
            let l32_at_probe = s32.objective(&ab, Objective::Coherence)?;
            let l_at_probe = s.objective(&ab, Objective::Coherence)?;
            let (o, o32) = (s.reconstruct(&ab)?, s32.reconstruct(&ab)?);
            run["vs_f32"] = json!({
                "fitted_minus_f32": {"C10_a": b.c10 - a.c10, "C12_a": b.c12 - a.c12,
                                     "phi12_rad": b.phi12 - a.phi12},
                "f32_loss_relative_excess_at_this_fit": (l32_at_this - l32_at_32) / l32_at_32.abs(),
                "coherence_at_probe_relative_difference": (l_at_probe - l32_at_probe) / l32_at_probe.abs(),
                "object_rel_l2": {"re": rel_l2(&o.object_re, &o32.object_re),
                                  "im": rel_l2(&o.object_im, &o32.object_im)},
            });
        } else {
            reference = Some((s, f));
        }
        side.insert(name.into(), run);
    }
    Ok(json!({
        "what": "default coherence fit (C10, C12, phi12) with G as complex f32, f16 and f12 (f16 rounded to 7 significant bits), same seed; each against f32",
        "runs": side,
    }))
}

fn cpu_check(master: &str, rows: usize) -> qem::Result<Value> {
    let region = Region::new(0, rows, 0, rows);
    let c = load(
        master,
        BackendRequest::Cpu,
        Some(region),
        1,
        Representation::Encoded,
    )?;
    let g = load(
        master,
        BackendRequest::Cuda,
        Some(region),
        1,
        Representation::Encoded,
    )?;
    let sc = Ssb::new(
        &c,
        &SsbParams {
            engine: BackendRequest::Cpu,
            ..params(None)
        },
    )?;
    let sg = Ssb::new(&g, &params(None))?;
    // The same on the card with the BF pixels in raster order (no coarse sample first): the
    // object must not depend on the order beyond f32 rounding.
    let sr = Ssb::new(
        &g,
        &SsbParams {
            coarse_min_pixels: usize::MAX,
            ..params(None)
        },
    )?;
    // The host-data route: the CPU-held region, SSB on the card.
    let sh = Ssb::new(&c, &params(None))?;
    let host_route = {
        let (a, b) = (sc.reconstruct(&probe_ab())?, sh.reconstruct(&probe_ab())?);
        json!({
            "engine": sh.engine_name(),
            "object_rel_l2_re": rel_l2(&b.object_re, &a.object_re),
            "object_rel_l2_im": rel_l2(&b.object_im, &a.object_im),
        })
    };
    let mut out = serde_json::Map::new();
    for (name, ab) in [("probe", probe_ab()), ("zero", Aberrations::default())] {
        let (a, b) = (sc.reconstruct(&ab)?, sg.reconstruct(&ab)?);
        let raster = sr.reconstruct(&ab)?;
        let mut losses = serde_json::Map::new();
        for kind in [Objective::Coherence, Objective::PhaseVariance] {
            let (lc, lg) = (sc.objective(&ab, kind)?, sg.objective(&ab, kind)?);
            losses.insert(
                kind.name().into(),
                json!({"cpu": lc, "cuda": lg, "rel": (lg - lc).abs() / lc.abs()}),
            );
        }
        out.insert(
            name.into(),
            json!({
                "aberrations": ab.to_map(),
                "object_rel_l2_re": rel_l2(&b.object_re, &a.object_re),
                "object_rel_l2_im": rel_l2(&b.object_im, &a.object_im),
                "phase_rel_l2": rel_l2(&b.phase, &a.phase),
                "raster_order_object_rel_l2_re": rel_l2(&raster.object_re, &a.object_re),
                "raster_order_object_rel_l2_im": rel_l2(&raster.object_im, &a.object_im),
                "losses": losses,
            }),
        );
    }
    Ok(json!({
        "scan_region": [rows, rows],
        "n_bf_pixels": [sc.n_bf_pixels(), sg.n_bf_pixels()],
        "coarse_pixels": [sc.coarse_pixels(), sg.coarse_pixels(), sr.coarse_pixels()],
        "cases": out,
        "host_data_cuda_vs_cpu": host_route,
    }))
}

fn main() -> qem::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 {
        eprintln!(
            "usage: ssb_cuda_bench MASTER OUT.json LABEL [--card-budget B] [--cpu-check ROWS] [--fit-pv] [--repeats R] [--det-bin N] [--host-data] [--storages]"
        );
        std::process::exit(2);
    }
    let (master, out, label) = (&args[0], &args[1], &args[2]);
    let flag = |name: &str| args.iter().position(|a| a == name);
    let value = |name: &str| flag(name).and_then(|i| args.get(i + 1)).cloned();
    let card_budget: Option<u64> = value("--card-budget").and_then(|v| v.parse().ok());
    let cpu_rows: Option<usize> = value("--cpu-check").and_then(|v| v.parse().ok());
    let repeats: usize = value("--repeats")
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let fit_pv = flag("--fit-pv").is_some();
    let det_bin: usize = value("--det-bin").and_then(|v| v.parse().ok()).unwrap_or(1);
    let host_data = flag("--host-data").is_some();
    let storages = flag("--storages").is_some();
    let used0 = card_used()?;
    let t = Instant::now();
    let backend = if host_data {
        BackendRequest::Cpu
    } else {
        BackendRequest::Cuda
    };
    // Host data is held dense (the CPU engine's fastest load; 18 GiB for the reference).
    let repr = if host_data {
        Representation::Dense
    } else {
        Representation::Encoded
    };
    let ds = load(master, backend, None, det_bin, repr)?;
    let load_s = t.elapsed().as_secs_f64();
    // The disk fit reads the cached sum DP; fill it before timing prepare.
    let t = Instant::now();
    qem::detector::sum_dp(&ds)?;
    let sum_dp_s = t.elapsed().as_secs_f64();
    let used_data = card_used()?;
    eprintln!(
        "{label}: loaded {:?} {repr:?} ({}) in {load_s:.2} s, card {:.2} GB used",
        ds.shape(),
        if host_data { "host" } else { "card" },
        used_data as f64 / 1e9
    );
    let mut runs = vec![json!({"budget": "none (free device memory)",
                               "result": bench_one(&ds, None, repeats, fit_pv, used_data)?})];
    if let Some(cb) = card_budget {
        let ssb_budget = cb.saturating_sub(used_data);
        let r = match bench_one(&ds, Some(ssb_budget), repeats, false, used_data) {
            Ok(v) => v,
            Err(e) => json!({"error": e.to_string(), "kind": format!("{:?}", e.kind)}),
        };
        runs.push(json!({"budget": format!("card {cb} bytes = dataset + context {used_data} + SSB {ssb_budget}"),
                         "card_budget_bytes": cb, "result": r}));
    }
    let storage_record = if storages {
        storage_compare(&ds, repeats)?
    } else {
        Value::Null
    };
    let check = match cpu_rows {
        Some(rows) => cpu_check(master, rows)?,
        None => Value::Null,
    };
    let info = qem_cuda::engine_info()?;
    let rec = json!({
        "what": if host_data {
            "SSB on CUDA from host-held data (dense in host memory, engine=cuda): prepare G, object, objectives, 3-parameter fit"
        } else {
            "SSB on CUDA: prepare G, object, objectives, 3-parameter fit (ENCODED resident)"
        },
        "host_data": host_data,
        "label": label,
        "git_revision": std::env::var("QEM_GIT_REVISION").unwrap_or_else(|_| "unknown".into()),
        "master": master,
        "device": format!("{info:?}"),
        "dataset_shape": ds.shape(),
        "det_bin": det_bin,
        "dataset_resident_bytes": ds.nbytes_resident(),
        "load_s": load_s,
        "sum_dp_s": sum_dp_s,
        "card_used_before_load": used0,
        "card_used_with_dataset": used_data,
        "optics": {"voltage_kv": 300.0, "semiangle_mrad": 25.0, "scan_step_a": 0.4,
                   "det_sampling": "alpha / r_BF (default)"},
        "aberrations_timed": probe_ab().to_map(),
        "timing": "wall of the whole call, p50 after one warm-up",
        "runs": runs,
        "cpu_check": check,
        "storage_compare": storage_record,
    });
    std::fs::write(out, serde_json::to_string_pretty(&rec).unwrap_or_default())
        .map_err(|e| qem::Error::io("write", std::path::Path::new(out), &e))?;
    Ok(())
}
