//! `quantem-gpu ssb PATH --voltage-kv KV --semiangle-mrad A --scan-step-a S [--fit] --out DIR`:
//! single-sideband ptychography, with or without an aberration fit.
//!
//! Prepares [`qem::ssb::Ssb`] (BF pixels from the mean DP, their scan spectra), then either
//! reconstructs at the aberrations given (`--c10 --c12 --phi12 ...`, Å / rad, default 0) or,
//! with `--fit`, fits the chosen coefficients from those values (seeded global search, then
//! Nelder–Mead) and reconstructs at the result. Writes `phase` (arg O), `weak_phase` (the
//! first-order phase Im O / Re O) and `amplitude` (PNG with a grey-level bar and `.npy`, `f64`), `object_re.npy`, `object_im.npy` and `ssb.json`: the
//! calibration used (detector sampling and where it came from), the BF disk, the aberrations
//! with units, the fit (loss, evaluations, loss curve, ranges, seed) and the provenance.

use crate::args::SsbArgs;
use crate::print_out;
use crate::products_cmd::{dataset_line, load_source, write_record, write_scan_arrays};
use anyhow::Context;
use qem::ssb::{Aberrations, FitParams, Objective, Ssb, SsbParams, SsbResult};
use qem::Dataset;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Instant;

/// What to do once the data is prepared.
#[derive(Debug, Clone)]
pub enum SsbJob {
    /// Reconstruct at these aberrations.
    Reconstruct(Aberrations),
    /// Fit, then reconstruct at the fitted aberrations.
    Fit(FitParams),
}

/// Aberrations as JSON with their units: `{"C10": {"value": .., "unit": "Å"}, ...}`.
pub fn aberrations_json(ab: &Aberrations) -> Value {
    ab.to_map()
        .into_iter()
        .map(|(k, v)| {
            let unit = Aberrations::unit(&k).unwrap_or("");
            (k, json!({ "value": v, "unit": unit }))
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// Prepare SSB on `ds`, run `job`, and write its files into `out` (created after the
/// computation); returns the result, the `ssb.json` record (without the command and source)
/// and the files written.
pub fn write_ssb(
    ds: &Dataset,
    params: &SsbParams,
    job: &SsbJob,
    out: &Path,
) -> anyhow::Result<(SsbResult, Value, Vec<String>)> {
    let t = Instant::now();
    let s = Ssb::new(ds, params).context("preparing SSB")?;
    let t_prepare = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let (res, fit_record, provenance) = match job {
        SsbJob::Reconstruct(ab) => {
            let r = s.reconstruct(ab).context("reconstructing")?;
            let p = r.provenance.clone();
            (r, Value::Null, p)
        }
        SsbJob::Fit(f) => {
            let fit = s.fit(f).context("fitting the aberrations")?;
            let record = json!({
                "fitted": f.fit,
                "seed": f.seed,
                "objective": f.objective.name(),
                "loss": fit.loss,
                "evaluations": fit.evaluations,
                "loss_curve": fit.loss_curve,
                "aberrations": aberrations_json(&fit.aberrations),
                "start": aberrations_json(&f.start),
                "provenance": fit.provenance.params.get("fit").cloned().unwrap_or(Value::Null),
            });
            // The fit's record (ranges, seed, budgets) is the provenance of what it made.
            (fit.result, record, fit.provenance)
        }
    };
    let t_compute = t.elapsed().as_secs_f64();
    let (files, arrays, t_write) = write_scan_arrays(
        out,
        res.scan_shape,
        Some(params.scan_step_a),
        &[
            ("phase", &res.phase),
            ("weak_phase", &res.weak_phase),
            ("amplitude", &res.amplitude),
        ],
        &[("object_re", &res.object_re), ("object_im", &res.object_im)],
    )?;
    let objective = match job {
        SsbJob::Fit(f) => f.objective,
        SsbJob::Reconstruct(_) => Objective::default(),
    };
    let record = json!({
        "dataset": crate::products_cmd::dataset_json(ds),
        "params": {
            "voltage_kv": params.voltage_kv,
            "semiangle_mrad": params.semiangle_mrad,
            "scan_step_a": [params.scan_step_a.0, params.scan_step_a.1],
            "det_sampling_mrad": params.det_sampling_mrad,
            "rotation_deg": params.rotation_deg,
            "transpose": params.transpose,
            "compat_2alpha": params.compat_2alpha,
            "bf_threshold": params.bf_threshold,
            "memory_budget": params.memory_budget,
            "engine": params.engine.name(),
        },
        "engine": s.engine_name(),
        "wavelength_a": s.wavelength_a,
        "det_sampling_mrad": s.det_sampling_mrad,
        "bf_disk": crate::products_cmd::disk_json(&s.disk),
        "n_bf_pixels": s.n_bf_pixels(),
        "aberrations": aberrations_json(&res.aberrations),
        // A fit already knows its loss; a plain reconstruction pays one evaluation.
        "loss": { "objective": objective.name(),
                  "value": match &fit_record {
                      Value::Null => s.objective(&res.aberrations, objective)?,
                      f => f["loss"].as_f64().unwrap_or(f64::NAN),
                  } },
        "fit": fit_record,
        "arrays": arrays,
        "timings_s": { "prepare": t_prepare, "compute": t_compute, "write": t_write },
        "provenance": provenance,
    });
    Ok((res, record, files))
}

/// The objective named `name` (`coherence` or `phase_variance`).
pub fn parse_objective(name: &str) -> Result<Objective, String> {
    [Objective::Coherence, Objective::PhaseVariance]
        .into_iter()
        .find(|o| o.name() == name)
        .ok_or_else(|| format!("unknown objective {name:?} (expected coherence or phase_variance)"))
}

pub fn run(a: &SsbArgs, command_line: &str) -> anyhow::Result<()> {
    let step = match a.scan_step_a.as_slice() {
        [s] => (*s, *s),
        [r, c] => (*r, *c),
        other => anyhow::bail!("--scan-step-a takes 1 or 2 values, got {}", other.len()),
    };
    let params = SsbParams {
        voltage_kv: a.voltage_kv,
        semiangle_mrad: a.semiangle_mrad,
        scan_step_a: step,
        det_sampling_mrad: a.det_sampling_mrad,
        rotation_deg: a.rotation_deg,
        transpose: a.transpose,
        compat_2alpha: a.compat_2alpha,
        bf_threshold: a.bf_threshold,
        memory_budget: a.memory_budget,
        engine: a.engine,
        ..SsbParams::default()
    };
    // Bad calibration fails before the (possibly long) load, exit 3.
    params.validate()?;
    let mut start = Aberrations::default();
    for (name, v) in a.aberrations.given() {
        start.set(name, v)?;
    }
    let job = if a.fit {
        let d = FitParams::default();
        SsbJob::Fit(FitParams {
            seed: a.seed,
            fit: a.fit_params.clone(),
            objective: a.objective,
            global_evals: a.global_evals.unwrap_or(d.global_evals),
            local_max_iter: a.local_max_iter.unwrap_or(d.local_max_iter),
            coarse: !a.no_coarse,
            start,
            ..d
        })
    } else {
        SsbJob::Reconstruct(start)
    };
    let (ds, t_load) = load_source(&a.io)?;
    let (res, mut record, files) = write_ssb(&ds, &params, &job, &a.io.out)?;
    let text = write_record(&mut record, command_line, &a.io, t_load, "ssb.json")?;
    if a.json {
        return print_out(&text);
    }
    let ab = &res.aberrations;
    let fit_line = match &record["fit"] {
        Value::Null => "no fit (aberrations as given)".to_string(),
        f => format!(
            "{} evaluations, {} = {:.6e}",
            f["evaluations"],
            f["objective"].as_str().unwrap_or(""),
            f["loss"].as_f64().unwrap_or(f64::NAN)
        ),
    };
    let s = format!(
        "{} -> {}\n  dataset   {}\n  BF        {} pixels, Δθ = {:.4} mrad/px, λ = {:.5} Å\n  probe     C10 = {:.2} Å, C12 = {:.2} Å at φ12 = {:.4} rad\n  fit       {}\n  phase     phase.png, in rad\n  {} files + ssb.json; load {:.2} s, prepare {:.3} s, compute {:.3} s\n",
        a.io.path.display(),
        a.io.out.display(),
        dataset_line(&ds),
        record["n_bf_pixels"],
        record["det_sampling_mrad"].as_f64().unwrap_or(f64::NAN),
        record["wavelength_a"].as_f64().unwrap_or(f64::NAN),
        ab.c10,
        ab.c12,
        ab.phi12,
        fit_line,
        files.len(),
        t_load,
        record["timings_s"]["prepare"].as_f64().unwrap_or(f64::NAN),
        record["timings_s"]["compute"].as_f64().unwrap_or(f64::NAN),
    );
    print_out(&s)
}
