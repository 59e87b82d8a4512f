//! The router: the page and its static files, `/api/v1` (capabilities, catalog, data views,
//! virtual images, SSB and jobs), all behind the token middleware; unknown routes are a JSON 404.

mod data;
mod ssb;
mod virt;

use crate::auth;
use crate::catalog::{cached, Acq};
use crate::error::{ApiError, ApiResult};
use crate::params::{Params, DET_BINS, GEOMETRY_FACTOR, MAX_BODY_BYTES, SCAN_BINS};
use crate::state::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequestParts, Path, RawQuery, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use qem::{BackendRequest, LoadParams, Representation, SourceArg};
use serde_json::{json, Value};
use std::sync::Arc;

const INDEX_HTML: &str = include_str!("../../web/index.html");
const APP_JS: &str = include_str!("../../web/app.js");
const STYLE_CSS: &str = include_str!("../../web/style.css");

/// Every route of the service.
pub(crate) fn router(st: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/capabilities", get(capabilities))
        .route("/acquisitions", get(acquisitions))
        .route("/acquisitions/{id}", get(acquisition_detail))
        .route("/acquisitions/{id}/dp", get(data::dp))
        .route("/acquisitions/{id}/frame", get(data::frame))
        .route("/acquisitions/{id}/roi-dp", get(data::roi_dp))
        .route("/acquisitions/{id}/virtual", get(virt::virtual_image))
        .route("/acquisitions/{id}/virtual-mask", post(virt::virtual_mask))
        .route("/acquisitions/{id}/ssb/prepare", post(ssb::prepare))
        .route("/acquisitions/{id}/ssb/reconstruct", get(ssb::reconstruct))
        .route("/acquisitions/{id}/ssb/fit", post(ssb::fit))
        .route("/jobs/{job}", get(ssb::job));
    Router::new()
        .route("/", get(page))
        .route("/static/{name}", get(static_file))
        .nest("/api/v1", api)
        .fallback(|| async { ApiError::not_found("no such route") })
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&st),
            auth::require_token,
        ))
        .layer(axum::middleware::map_response(crate::error::json_errors))
        .with_state(st)
}

/// The page; with the right `?token=` it also sets the `qem_token` cookie and carries the
/// token in its asset URLs, because a browser sends no `SameSite=Strict` cookie to a page framed
/// by another site (a notebook's IFrame) and the assets would then be refused.
async fn page(State(st): State<Arc<AppState>>, RawQuery(q): RawQuery) -> Response {
    let right = |t: &String| auth::query_token(q.as_deref()).is_some_and(|q| auth::token_eq(&q, t));
    let token = st.token.as_ref().filter(|t| right(t));
    let html = match token {
        Some(t) => with_asset_token(INDEX_HTML, t),
        None => INDEX_HTML.to_string(),
    };
    let mut resp = axum::response::Html(html).into_response();
    if let Some(t) = token {
        if let Ok(v) = HeaderValue::from_str(&auth::set_cookie(t)) {
            resp.headers_mut().insert(header::SET_COOKIE, v);
        }
    }
    no_store(resp)
}

/// `html` with `?token=…` (percent-encoded, so also safe inside an attribute) appended to the
/// quoted URLs of the two static files.
fn with_asset_token(html: &str, token: &str) -> String {
    let q = serde_urlencoded::to_string([("token", token)]).unwrap_or_default();
    let mut out = html.to_string();
    for name in ["app.js", "style.css"] {
        for prefix in ["static/", "./static/", "/static/"] {
            out = out.replace(
                &format!("\"{prefix}{name}\""),
                &format!("\"{prefix}{name}?{q}\""),
            );
        }
    }
    out
}

fn no_store(mut resp: Response) -> Response {
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// The page's two static files, from a fixed table (no path is ever opened).
async fn static_file(Path(name): Path<String>) -> Response {
    let (body, ctype) = match name.as_str() {
        "app.js" => (APP_JS, "text/javascript; charset=utf-8"),
        "style.css" => (STYLE_CSS, "text/css; charset=utf-8"),
        _ => return ApiError::not_found("no such static file").into_response(),
    };
    no_store(([(header::CONTENT_TYPE, ctype)], body).into_response())
}

async fn capabilities(State(st): State<Arc<AppState>>) -> Json<Value> {
    let revision = match qem::GIT_REVISION {
        "" | "unknown" => env!("CARGO_PKG_VERSION"),
        r => r,
    };
    Json(json!({
        "protocol": "quantem-gpu-browse",
        "version": 1,
        "backend": st.backend.name(),
        "devices": qem::available_backends(),
        "memory": {"budget_bytes": st.budget, "resident_bytes": st.catalog.resident()},
        "revision": revision,
        "package_version": env!("CARGO_PKG_VERSION"),
        "limits": {
            "det_bin": DET_BINS, "scan_bin": SCAN_BINS, "max_body_bytes": MAX_BODY_BYTES,
            "geometry_factor": GEOMETRY_FACTOR, "engine_calls_per_device": 1,
        },
    }))
}

async fn acquisitions(State(st): State<Arc<AppState>>) -> ApiResult<Json<Value>> {
    let st2 = Arc::clone(&st);
    // Rescanning and inspecting read files: off the async threads.
    let list = blocking(move || {
        st2.catalog.rescan()?;
        st2.catalog.listing(None)
    })
    .await?;
    Ok(Json(Value::Array(list)))
}

/// `f` on a blocking thread (file-system work that is not engine work: no device permit).
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> ApiResult<T> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("a catalog task failed: {e}")))?
}

/// The acquisition `id`, loaded on first use (LRU release within the budget).
pub(crate) async fn acquisition(st: &Arc<AppState>, id: &str) -> ApiResult<Acq> {
    let found = match st.catalog.lookup(id)? {
        Some(f) => Some(f),
        None => {
            // An id from a listing made since the last scan: rescan once (reads the folder).
            let st2 = Arc::clone(st);
            let id2 = id.to_string();
            blocking(move || {
                st2.catalog.rescan()?;
                st2.catalog.lookup(&id2)
            })
            .await?
        }
    };
    let path = match found {
        Some(Ok(a)) => return Ok(a),
        Some(Err(p)) => p,
        None => {
            return Err(ApiError::not_found(format!(
                "no acquisition with id \"{id}\""
            )))
        }
    };
    let permit = st.device_permit().await?;
    if let Some(Ok(a)) = st.catalog.lookup(id)? {
        return Ok(a); // loaded while this request waited
    }
    let st2 = Arc::clone(st);
    let id = id.to_string();
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        load(&st2, &id, path)
    })
    .await
    .map_err(|e| ApiError::internal(format!("a load task failed: {e}")))?
}

fn load(st: &AppState, id: &str, path: std::path::PathBuf) -> ApiResult<Acq> {
    let representation = st
        .representation
        .unwrap_or_else(|| qem::default_representation(st.backend));
    // Room for a dense load first (its size is known from the header); an ENCODED load's
    // size is known once encoded.
    let estimate = match (representation, qem::inspect(&path, None)) {
        (Representation::Dense, Ok(ins)) => match (ins.scan_shape, ins.detector_shape, ins.dtype) {
            (Some(s), Some(d), Some(t)) => (s.len() as u64)
                .saturating_mul(d.len() as u64)
                .saturating_mul(t.size() as u64),
            _ => 0,
        },
        _ => 0,
    };
    if estimate > st.budget {
        return Err(qem::Error::memory_budget("serve load", estimate, st.budget).into());
    }
    st.catalog.make_room(estimate, st.budget, None)?;
    let params = LoadParams {
        backend: match st.backend {
            qem::Backend::Cpu => BackendRequest::Cpu,
            qem::Backend::Cuda => BackendRequest::Cuda,
        },
        representation: Some(representation),
        memory_budget: Some(st.budget),
        ..Default::default()
    };
    let ds = qem::load(SourceArg::Path(path), &params)?;
    let n = ds.nbytes_resident();
    if n > st.budget {
        return Err(qem::Error::memory_budget("serve load", n, st.budget).into());
    }
    st.catalog.make_room(n, st.budget, None)?;
    st.catalog.insert_loaded(id, ds)
}

/// The BF disk of the mean DP, cached per acquisition.
pub(crate) fn disk(ds: &qem::Dataset, acq: &Acq) -> ApiResult<qem::detector::DiskFit> {
    cached(&acq.cache.disk, || Ok(qem::detector::fit_disk(ds)?)).copied()
}

async fn acquisition_detail(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let acq = acquisition(&st, &id).await?;
    let (mut v, _) = st
        .engine(&acq, |ds, acq| {
            let d = disk(ds, acq)?;
            let m = ds.metadata();
            let src = |x: bool, s: &str| if x { json!(s) } else { Value::Null };
            let det_mrad = m.angular_sampling_mrad.map(|a| a.0);
            Ok(json!({
                "shape": ds.shape(),
                "dtype": ds.dtype().numpy_name(),
                "representation": ds.representation().name(),
                "backend": ds.backend().name(),
                "device": ds.device(),
                "nbytes_resident": ds.nbytes_resident(),
                "metadata": m,
                "provenance": ds.provenance(),
                "calibration": {
                    "det_mrad_per_px": det_mrad,
                    "det_mrad_per_px_source": src(det_mrad.is_some(), "metadata"),
                    "scan_step_a": m.scan_step_a,
                    "scan_step_a_source": src(m.scan_step_a.is_some(), "metadata"),
                    "voltage_kv": m.energy_ev.map(|e| e / 1e3),
                    "voltage_kv_source": src(m.energy_ev.is_some(), "metadata"),
                    "semiangle_mrad": m.semiangle_mrad,
                },
                "disk": {"row": d.center_px.0, "col": d.center_px.1, "radius": d.radius_px},
            }))
        })
        .await?;
    // The catalog's fields (id, name, path, ready, loaded) come first.
    let st2 = Arc::clone(&st);
    let id2 = id.clone();
    let listing = blocking(move || st2.catalog.listing(Some(&id2))).await?;
    if let Some(entry) = listing.into_iter().find(|e| e["id"] == json!(id)) {
        if let (Some(o), Value::Object(e)) = (v.as_object_mut(), entry) {
            for (k, x) in e {
                o.entry(k).or_insert(x);
            }
        }
    }
    Ok(Json(v))
}

/// A request body, or `too_large` past the body limit / `bad_request` when unreadable.
pub(crate) fn body_bytes(body: Result<Bytes, BytesRejection>) -> ApiResult<Bytes> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(format!("the body passes the limit: {e}"))
        } else {
            ApiError::bad_request(format!("unreadable body: {e}"))
        }
    })
}

/// What a route on one acquisition starts from: the state, the `{id}` of the path and the
/// parsed query (a bad query is `bad_request` before the acquisition is loaded or a body read).
pub(crate) struct AcqRequest {
    pub st: Arc<AppState>,
    pub id: String,
    pub p: Params,
}

impl FromRequestParts<Arc<AppState>> for AcqRequest {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut Parts,
        st: &Arc<AppState>,
    ) -> Result<Self, Self::Rejection> {
        let Path(id) = Path::<String>::from_request_parts(parts, st)
            .await
            .map_err(IntoResponse::into_response)?;
        let p = Params::parse(parts.uri.query()).map_err(IntoResponse::into_response)?;
        Ok(Self {
            st: Arc::clone(st),
            id,
            p,
        })
    }
}
