//! Query parameters of the routes, checked against the limits of docs/browse.md: bins from
//! their allowed sets, integers that parse, finite geometry within ±4× the detector.

use crate::error::{ApiError, ApiResult};
use qem::Region;
use std::collections::HashMap;

/// Allowed detector bins.
pub(crate) const DET_BINS: [usize; 4] = [1, 2, 4, 8];
/// Allowed scan bins.
pub(crate) const SCAN_BINS: [usize; 5] = [1, 2, 4, 8, 16];
/// Largest request body, bytes.
pub(crate) const MAX_BODY_BYTES: usize = 16 << 20;
/// Geometry may reach this many detector sizes from the origin.
pub(crate) const GEOMETRY_FACTOR: f64 = 4.0;

/// The query of one request.
#[derive(Debug, Default)]
pub(crate) struct Params(HashMap<String, String>);

impl Params {
    /// Parse a raw query string (a malformed one is `bad_request`).
    pub fn parse(q: Option<&str>) -> ApiResult<Params> {
        let Some(q) = q else {
            return Ok(Params::default());
        };
        let pairs: Vec<(String, String)> = serde_urlencoded::from_str(q)
            .map_err(|e| ApiError::bad_request(format!("malformed query: {e}")))?;
        Ok(Params(pairs.into_iter().collect()))
    }
    /// The raw value of `k`.
    pub fn str(&self, k: &str) -> Option<&str> {
        self.0.get(k).map(String::as_str)
    }
    /// `format=npy`?
    pub fn npy(&self) -> ApiResult<bool> {
        match self.str("format") {
            None | Some("raw") => Ok(false),
            Some("npy") => Ok(true),
            Some(o) => Err(ApiError::bad_request(format!(
                "format \"{o}\": expected raw or npy"
            ))),
        }
    }
    /// A required non-negative integer.
    pub fn usize(&self, k: &str) -> ApiResult<usize> {
        let v = self
            .str(k)
            .ok_or_else(|| ApiError::bad_request(format!("missing parameter {k}")))?;
        v.parse::<usize>()
            .map_err(|_| ApiError::bad_request(format!("{k}={v}: expected a non-negative integer")))
    }
    /// An optional finite number.
    pub fn f64_opt(&self, k: &str) -> ApiResult<Option<f64>> {
        match self.str(k) {
            None => Ok(None),
            Some(v) => match v.parse::<f64>() {
                Ok(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(ApiError::bad_request(format!(
                    "{k}={v}: expected a finite number"
                ))),
            },
        }
    }
    /// A bin from `allowed` (default 1).
    pub fn bin(&self, k: &str, allowed: &[usize]) -> ApiResult<usize> {
        let Some(v) = self.str(k) else { return Ok(1) };
        match v.parse::<usize>() {
            Ok(b) if allowed.contains(&b) => Ok(b),
            _ => Err(ApiError::bad_request(format!(
                "{k}={v}: expected one of {allowed:?}"
            ))),
        }
    }
    /// `reduce=sum|mean|max` (default sum).
    pub fn reduce(&self) -> ApiResult<Reduce> {
        match self.str("reduce").unwrap_or("sum") {
            "sum" => Ok(Reduce::Sum),
            "mean" => Ok(Reduce::Mean),
            "max" => Ok(Reduce::Max),
            o => Err(ApiError::bad_request(format!(
                "reduce={o}: expected sum, mean or max"
            ))),
        }
    }
    /// `region=r0,r1,c0,c1` checked against a `rows × cols` scan (`None` when absent).
    pub fn region(&self, rows: usize, cols: usize) -> ApiResult<Option<Region>> {
        let Some(v) = self.str("region") else {
            return Ok(None);
        };
        let parts: Vec<usize> = v
            .split(',')
            .map(|p| p.trim().parse::<usize>())
            .collect::<Result<_, _>>()
            .map_err(|_| ApiError::bad_request(format!("region={v}: expected r0,r1,c0,c1")))?;
        let [r0, r1, c0, c1] = parts[..] else {
            return Err(ApiError::bad_request(format!(
                "region={v}: expected four integers r0,r1,c0,c1"
            )));
        };
        rect(r0, r1, c0, c1, rows, cols, "region").map(Some)
    }
}

/// The half-open rectangle `[r0, r1) × [c0, c1)` inside `rows × cols`, non-empty.
pub(crate) fn rect(
    r0: usize,
    r1: usize,
    c0: usize,
    c1: usize,
    rows: usize,
    cols: usize,
    what: &str,
) -> ApiResult<Region> {
    if r0 < r1 && c0 < c1 && r1 <= rows && c1 <= cols {
        Ok(Region {
            row_start: r0,
            row_stop: r1,
            col_start: c0,
            col_stop: c1,
        })
    } else {
        Err(ApiError::bad_request(format!(
            "{what} [{r0}, {r1}) x [{c0}, {c1}) is empty or outside the {rows} x {cols} scan"
        )))
    }
}

/// Which reduction of a pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reduce {
    Sum,
    Mean,
    Max,
}

/// A geometry value (detector pixels as viewed) within ±4× the viewed detector's larger side.
pub(crate) fn check_geometry(k: &str, v: f64, det_rows: usize, det_cols: usize) -> ApiResult<f64> {
    let lim = GEOMETRY_FACTOR * det_rows.max(det_cols) as f64;
    if v.is_finite() && v.abs() <= lim {
        Ok(v)
    } else {
        Err(ApiError::bad_request(format!(
            "{k}={v}: expected a finite value within ±{lim} pixels"
        )))
    }
}
