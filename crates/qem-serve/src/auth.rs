//! The token: made at start, checked in constant time on every route (docs/browse.md,
//! "Security model"). Accepted from `?token=`, `Authorization: Bearer` or the `qem_token`
//! cookie, which the page route sets when it is loaded with the right `?token=`.

use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use qem::{Error, Result};
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// Name of the cookie the page sets.
pub(crate) const COOKIE: &str = "qem_token";

/// 32 random bytes as 64 lower-case hex digits.
pub(crate) fn random_token() -> Result<String> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b)
        .map_err(|e| Error::internal("serve", format!("no random token: {e}")))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Constant-time equality of two tokens (lengths are not secret).
pub(crate) fn token_eq(a: &str, b: &str) -> bool {
    a.len() == b.len() && bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

/// The `token` value of a query string, percent-decoded.
pub(crate) fn query_token(query: Option<&str>) -> Option<String> {
    let q = query?;
    form_pairs(q)
        .into_iter()
        .find(|(k, _)| k == "token")
        .map(|(_, v)| v)
}

/// `application/x-www-form-urlencoded` pairs of a query string.
pub(crate) fn form_pairs(q: &str) -> Vec<(String, String)> {
    serde_urlencoded::from_str::<Vec<(String, String)>>(q).unwrap_or_default()
}

fn bearer(h: &HeaderMap) -> Option<&str> {
    h.get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

fn cookie(h: &HeaderMap) -> Option<String> {
    h.get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.to_string())
}

/// Whether the request carries `token` by one of the three ways.
pub(crate) fn authorised(token: &str, query: Option<&str>, h: &HeaderMap) -> bool {
    // Every candidate is compared (no early exit on the first present one being wrong).
    let mut ok = false;
    if let Some(t) = query_token(query) {
        ok |= token_eq(&t, token);
    }
    if let Some(t) = bearer(h) {
        ok |= token_eq(t, token);
    }
    if let Some(t) = cookie(h) {
        ok |= token_eq(&t, token);
    }
    ok
}

/// Middleware on every route: 401 without the token.
pub(crate) async fn require_token(
    State(st): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    if let Some(token) = &st.token {
        if !authorised(token, req.uri().query(), req.headers()) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// The `Set-Cookie` value of the page route.
pub(crate) fn set_cookie(token: &str) -> String {
    format!("{COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/")
}
