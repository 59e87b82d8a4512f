//! SSB: `prepare` (kept per acquisition), `reconstruct` at given aberrations, and `fit` as a
//! background job with progress (`GET /api/v1/jobs/{job}`). On CUDA the fit holds the device
//! permit while it runs, like every engine call; on the CPU it runs beside the views.

use super::{acquisition, body_bytes, AcqRequest};
use crate::error::{ApiError, ApiResult};
use crate::payload::{ArrayData, ArrayOut};
use crate::state::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::Response;
use axum::Json;
use qem::ssb::{Aberrations, FitParams, Objective, Ssb, SsbParams};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Largest fit budget a request may ask for (each number).
const MAX_FIT_EVALS: usize = 10_000;

/// A JSON body, or `bad_request`/`too_large`.
fn json_body<T: for<'de> Deserialize<'de>>(body: Result<Bytes, BytesRejection>) -> ApiResult<T> {
    let b = body_bytes(body)?;
    let b: &[u8] = if b.is_empty() { b"{}" } else { &b };
    serde_json::from_slice(b).map_err(|e| ApiError::bad_request(format!("bad JSON body: {e}")))
}

/// A scan step: one number for both axes or `[row, col]`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Step {
    One(f64),
    Two([f64; 2]),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PrepareBody {
    voltage_kv: Option<f64>,
    semiangle_mrad: Option<f64>,
    scan_step_a: Option<Step>,
    det_sampling_mrad: Option<f64>,
    rotation_deg: Option<f64>,
}

fn missing(what: &str) -> ApiError {
    ApiError::bad_request(format!("{what} is neither given nor in the calibration"))
}

/// `POST …/{id}/ssb/prepare`.
pub(crate) async fn prepare(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<Value>> {
    let b: PrepareBody = json_body(body)?;
    let acq = acquisition(&st, &id).await?;
    let (v, ms) = st
        .engine(&acq, move |ds, acq| {
            let m = ds.metadata();
            let p = SsbParams {
                voltage_kv: b
                    .voltage_kv
                    .or(m.energy_ev.map(|e| e / 1e3))
                    .ok_or_else(|| missing("voltage_kv"))?,
                semiangle_mrad: b
                    .semiangle_mrad
                    .or(m.semiangle_mrad)
                    .ok_or_else(|| missing("semiangle_mrad"))?,
                scan_step_a: match b.scan_step_a {
                    Some(Step::One(s)) => (s, s),
                    Some(Step::Two([r, c])) => (r, c),
                    None => m.scan_step_a.ok_or_else(|| missing("scan_step_a"))?,
                },
                det_sampling_mrad: b.det_sampling_mrad,
                rotation_deg: b.rotation_deg.unwrap_or(0.0),
                ..SsbParams::default()
            };
            p.validate()?;
            let ssb = Ssb::new(ds, &p)?;
            let out = json!({
                "n_bf_pixels": ssb.n_bf_pixels(),
                "params": {"voltage_kv": p.voltage_kv, "semiangle_mrad": p.semiangle_mrad,
                    "scan_step_a": [p.scan_step_a.0, p.scan_step_a.1],
                    "det_sampling_mrad": ssb.det_sampling_mrad, "rotation_deg": p.rotation_deg,
                    "wavelength_a": ssb.wavelength_a},
                "disk": {"row": ssb.disk.center_px.0, "col": ssb.disk.center_px.1,
                    "radius": ssb.disk.radius_px},
            });
            let mut slot = acq
                .cache
                .ssb
                .lock()
                .map_err(|_| ApiError::internal("the SSB slot lock was poisoned"))?;
            *slot = Some(Arc::new(ssb));
            Ok(out)
        })
        .await?;
    let mut v = v;
    v["elapsed_ms"] = json!(ms);
    Ok(Json(v))
}

fn prepared(acq: &crate::catalog::Acq) -> ApiResult<Arc<Ssb>> {
    acq.cache
        .ssb
        .lock()
        .map_err(|_| ApiError::internal("the SSB slot lock was poisoned"))?
        .clone()
        .ok_or_else(|| ApiError::bad_request("no prepared SSB: POST ssb/prepare first"))
}

/// `GET …/{id}/ssb/reconstruct?C10=&C12=&phi12=&part=phase|amplitude`.
pub(crate) async fn reconstruct(AcqRequest { st, id, p }: AcqRequest) -> ApiResult<Response> {
    let mut ab = Aberrations::default();
    for name in qem::ssb::ABERRATION_NAMES {
        if let Some(v) = p.f64_opt(name)? {
            ab.set(name, v)?;
        }
    }
    let amplitude = match p.str("part").unwrap_or("phase") {
        "phase" => false,
        "amplitude" => true,
        o => {
            return Err(ApiError::bad_request(format!(
                "part={o}: expected phase or amplitude"
            )))
        }
    };
    let npy = p.npy()?;
    let acq = acquisition(&st, &id).await?;
    let ssb = prepared(&acq)?;
    let (mut out, ms) = st
        .engine(&acq, move |_, _| {
            let r = ssb.reconstruct(&ab)?;
            let v = if amplitude { &r.amplitude } else { &r.phase };
            let data = ArrayData::F32(v.iter().map(|&x| x as f32).collect());
            Ok(ArrayOut::new(
                data,
                vec![r.scan_shape.rows, r.scan_shape.cols],
            ))
        })
        .await?;
    out.elapsed_ms = ms;
    out.respond(
        npy,
        if amplitude {
            "ssb_amplitude"
        } else {
            "ssb_phase"
        },
    )
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FitBody {
    seed: Option<u64>,
    fit: Option<Vec<String>>,
    ranges: Option<BTreeMap<String, [f64; 2]>>,
    objective: Option<String>,
    global_evals: Option<usize>,
    local_max_iter: Option<usize>,
    local_starts: Option<usize>,
    start: Option<BTreeMap<String, f64>>,
}

fn fit_params(b: FitBody) -> ApiResult<FitParams> {
    let mut f = FitParams::default();
    if let Some(s) = b.seed {
        f.seed = s;
    }
    if let Some(names) = b.fit {
        f.fit = names;
    }
    if let Some(r) = b.ranges {
        f.ranges = r.into_iter().map(|(k, [lo, hi])| (k, (lo, hi))).collect();
    }
    if let Some(o) = b.objective {
        f.objective = match o.as_str() {
            "coherence" => Objective::Coherence,
            "phase_variance" => Objective::PhaseVariance,
            _ => {
                return Err(ApiError::bad_request(format!(
                    "objective \"{o}\": expected coherence or phase_variance"
                )))
            }
        };
    }
    for (slot, v) in [
        (&mut f.global_evals, b.global_evals),
        (&mut f.local_max_iter, b.local_max_iter),
        (&mut f.local_starts, b.local_starts),
    ] {
        if let Some(v) = v {
            if v > MAX_FIT_EVALS {
                return Err(ApiError::bad_request(format!(
                    "a fit budget of {v}: at most {MAX_FIT_EVALS}"
                )));
            }
            *slot = v;
        }
    }
    if let Some(s) = b.start {
        f.start = Aberrations::from_map(&s)?;
    }
    Ok(f)
}

/// `POST …/{id}/ssb/fit` → `{job}`.
pub(crate) async fn fit(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<Value>> {
    let fp = fit_params(json_body(body)?)?;
    let acq = acquisition(&st, &id).await?;
    let ssb = prepared(&acq)?;
    let (job_id, job) = st.jobs.create()?;
    job.progress(0, fp.evaluation_estimate());
    let st2 = Arc::clone(&st);
    tokio::spawn(async move {
        let j = Arc::clone(&job);
        let r = st2
            .job(&acq, move |_, _| {
                let out = ssb.fit_with_progress(&fp, &|d, t| j.progress(d, t))?;
                Ok(
                    json!({"aberrations": out.aberrations.to_map(), "loss": out.loss,
                    "evaluations": out.evaluations}),
                )
            })
            .await;
        job.finish(r.map(|(mut v, ms)| {
            v["elapsed_ms"] = json!(ms);
            v
        }));
    });
    Ok(Json(json!({"job": job_id})))
}

/// `GET /api/v1/jobs/{job}`.
pub(crate) async fn job(
    State(st): State<Arc<AppState>>,
    Path(job): Path<String>,
) -> ApiResult<Json<Value>> {
    Ok(Json(st.jobs.get(&job)?.status()))
}
