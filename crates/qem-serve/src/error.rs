//! Errors as HTTP answers: `{"error": {"kind": K, "message": M}}` with the status of `K`
//! (docs/browse.md, "HTTP API").

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use qem::{Error, ErrorKind};

/// An error answer: a kind of docs/browse.md's list, its status and a message.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
}

/// What a route returns.
pub(crate) type ApiResult<T> = std::result::Result<T, ApiError>;

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
        }
    }
    /// 400: the request is malformed or out of the limits.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }
    /// 401: no token or a wrong one.
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid token is required (?token=, Authorization: Bearer or the qem_token cookie)",
        )
    }
    /// 404: no such route, acquisition, job or file.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }
    /// 410: the shared dataset was closed by its owner.
    pub fn closed(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GONE, "closed", message)
    }
    /// 413: the request body passes the limit.
    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", message)
    }
    /// 500: a bug.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
}

/// Whether `e` says the dataset was closed (the façade's and the Python binding's wording).
pub(crate) fn is_closed(e: &Error) -> bool {
    e.kind == ErrorKind::InvalidArgument
        && (e.detail.contains("has been closed")
            || e.detail == "closed"
            || e.found.as_deref() == Some("closed"))
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let msg = e.to_string();
        if is_closed(&e) {
            return ApiError::closed(msg);
        }
        let (status, kind) = match e.kind {
            ErrorKind::InvalidArgument | ErrorKind::Overflow => {
                (StatusCode::BAD_REQUEST, "bad_request")
            }
            ErrorKind::Source | ErrorKind::Decode | ErrorKind::Io => {
                (StatusCode::UNPROCESSABLE_ENTITY, "source")
            }
            ErrorKind::MemoryBudget => (StatusCode::INSUFFICIENT_STORAGE, "memory_budget"),
            ErrorKind::BackendUnavailable => {
                (StatusCode::SERVICE_UNAVAILABLE, "backend_unavailable")
            }
            ErrorKind::DeviceLost => (StatusCode::SERVICE_UNAVAILABLE, "device_lost"),
            ErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        ApiError::new(status, kind, msg)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({"error": {"kind": self.kind, "message": self.message}});
        (self.status, axum::Json(body)).into_response()
    }
}

/// Every error answer as JSON: axum's own rejections (a path that does not decode, a method a
/// route does not take) are plain text; they become `{"error": …}` with their status kept.
pub(crate) async fn json_errors(resp: Response) -> Response {
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let is_json = resp
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if is_json {
        return resp;
    }
    let text = axum::body::to_bytes(resp.into_body(), 64 << 10)
        .await
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let kind = match status.as_u16() {
        401 => "unauthorized",
        404 => "not_found",
        410 => "closed",
        413 => "too_large",
        400..=499 => "bad_request",
        _ => "internal",
    };
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        text
    };
    ApiError::new(status, kind, message).into_response()
}
