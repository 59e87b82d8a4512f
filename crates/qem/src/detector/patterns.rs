//! Diffraction patterns and frames: the exact sum DP (cached on the dataset), mean and max DP,
//! raw frames at scan positions, and the summed pattern of a scan ROI. Each is one engine pass
//! through [`reduce`](super::reduce); called by `qem-py`, `qem-cli`, `ssb` and `products`.

use super::{live, reduce, ReduceRequest};
use crate::dataset::Dataset;
use crate::result::ResultProvenance;
use qem_core::{DType, DenseArray, Error, Region, Result, Shape2};
use serde_json::json;
use std::time::Instant;

/// The exact sum over all frames, cached on the dataset.
fn cached_sum_dp(ds: &Dataset) -> Result<&[u64]> {
    live(ds, "detector sum_dp")?;
    if let Some(s) = ds.detector_cache.sum_dp.get() {
        return Ok(s);
    }
    let r = reduce(
        ds,
        &ReduceRequest {
            sum_dp: true,
            ..Default::default()
        },
    )?;
    let s = r
        .sum_dp
        .ok_or_else(|| Error::internal("detector sum_dp", "the reduction returned no sum"))?;
    // Another thread may have filled the cache meanwhile: both values are the same exact sum.
    let _ = ds.detector_cache.sum_dp.set(s);
    ds.detector_cache
        .sum_dp
        .get()
        .map(Vec::as_slice)
        .ok_or_else(|| Error::internal("detector sum_dp", "the cache is empty after filling it"))
}

/// Exact `u64` sum of all frames, per detector pixel (`k_r · k_c` values, row-major). Computed
/// once per dataset, then served from its cache.
pub fn sum_dp(ds: &Dataset) -> Result<Vec<u64>> {
    Ok(cached_sum_dp(ds)?.to_vec())
}

/// Refuse the mean over no frames (both forms of the mean DP).
pub(super) fn check_frames(n_frames: u64, op: &str) -> Result<()> {
    if n_frames == 0 {
        return Err(Error::invalid(op, "the mean over no frames is undefined")
            .with_expected("at least one frame")
            .with_found("0 frames"));
    }
    Ok(())
}

pub(super) fn mean_from_sum(sum: &[u64], n_frames: u64, op: &str) -> Result<Vec<f32>> {
    check_frames(n_frames, op)?;
    let n = n_frames as f64;
    Ok(sum.iter().map(|&s| (s as f64 / n) as f32).collect())
}

/// Mean diffraction pattern: the exact `u64` sum divided by the number of frames in `f64`,
/// returned as `f32` (docs/science.md §2).
pub fn mean_dp(ds: &Dataset) -> Result<Vec<f32>> {
    let sum = cached_sum_dp(ds)?;
    mean_from_sum(sum, ds.scan_shape.len() as u64, "detector mean_dp")
}

/// Element-wise maximum over all frames, per detector pixel (exact).
pub fn max_dp(ds: &Dataset) -> Result<Vec<u32>> {
    live(ds, "detector max_dp")?;
    let r = reduce(
        ds,
        &ReduceRequest {
            max_dp: true,
            ..Default::default()
        },
    )?;
    r.max_dp
        .ok_or_else(|| Error::internal("detector max_dp", "the reduction returned no max"))
}

/// The frames at scan `positions` (`(row, col)`, in the order given, repeats allowed) as one
/// `[n, k_r, k_c]` array in the dataset's dtype. A position outside the scan is an error naming
/// it; an empty list is an error.
pub fn frames(ds: &Dataset, positions: &[(usize, usize)]) -> Result<DenseArray> {
    const OP: &str = "detector frames";
    live(ds, OP)?;
    if positions.is_empty() {
        return Err(Error::invalid(OP, "no scan positions given")
            .with_expected("at least one (row, col) position"));
    }
    check_positions(ds.scan_shape, positions, OP)?;
    let len = positions.len() * ds.detector_shape.len();
    let mut out = match ds.dtype {
        DType::U8 => DenseArray::U8(Vec::with_capacity(len)),
        DType::U16 => DenseArray::U16(Vec::with_capacity(len)),
        DType::U32 => DenseArray::U32(Vec::with_capacity(len)),
    };
    for &(r, c) in positions {
        let f = ds.frame(r, c).map_err(|e| e.with_op(OP))?;
        match (&mut out, f) {
            (DenseArray::U8(o), DenseArray::U8(f)) => o.extend_from_slice(&f),
            (DenseArray::U16(o), DenseArray::U16(f)) => o.extend_from_slice(&f),
            (DenseArray::U32(o), DenseArray::U32(f)) => o.extend_from_slice(&f),
            (o, f) => {
                return Err(Error::internal(OP, "a frame came back in another dtype")
                    .with_expected(o.dtype().numpy_name().to_string())
                    .with_found(f.dtype().numpy_name().to_string()))
            }
        }
    }
    Ok(out)
}

fn check_positions(scan: Shape2, positions: &[(usize, usize)], op: &str) -> Result<()> {
    if let Some(&(r, c)) = positions
        .iter()
        .find(|&&(r, c)| r >= scan.rows || c >= scan.cols)
    {
        return Err(
            Error::invalid(op, format!("scan position ({r}, {c}) is outside the scan"))
                .with_expected(format!("row < {}, col < {}", scan.rows, scan.cols))
                .with_found(format!("({r}, {c})")),
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Scan ROI.

/// A set of scan positions.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScanRoi {
    /// A half-open rectangle of scan positions `(row_start, row_stop, col_start, col_stop)`.
    Rect(Region),
    /// The integer scan positions `(r, c)` with `(r − r0)² + (c − c0)² ≤ R²` (inside the scan).
    Circle {
        /// `(r0, c0)`, scan positions (may be fractional).
        center: (f64, f64),
        /// `R`, scan positions.
        radius: f64,
    },
    /// Explicit positions `(row, col)`; duplicates count once.
    Positions(Vec<(usize, usize)>),
}

impl ScanRoi {
    /// The flat frame indices `n = r · N_Rc + c` the ROI covers, ascending, without repeats.
    /// An empty ROI, a rectangle outside the scan or a position outside it is an error.
    pub fn frame_indices(&self, scan: Shape2) -> Result<Vec<u64>> {
        const OP: &str = "detector roi_dp";
        let flat = |r: usize, c: usize| (r * scan.cols + c) as u64;
        let mut out: Vec<u64> = match self {
            ScanRoi::Rect(region) => {
                region
                    .validate(scan, "scan ROI")
                    .map_err(|e| e.with_op(OP))?;
                (region.row_start..region.row_stop)
                    .flat_map(|r| (region.col_start..region.col_stop).map(move |c| flat(r, c)))
                    .collect()
            }
            ScanRoi::Circle { center, radius } => {
                let (r0, c0) = *center;
                let rad = *radius;
                if !(r0.is_finite() && c0.is_finite() && rad.is_finite() && rad >= 0.0) {
                    return Err(Error::invalid(OP, "the circle ROI is not a valid circle")
                        .with_expected("finite centre and a finite radius >= 0")
                        .with_found(format!("centre ({r0}, {c0}), radius {rad}")));
                }
                let mut v = Vec::new();
                // Integer positions in [⌈r0 − R⌉, ⌊r0 + R⌋] (clipped to the scan) are the only
                // candidates; each is tested exactly.
                let rows = clip_range(r0, rad, scan.rows);
                let cols = clip_range(c0, rad, scan.cols);
                for r in rows {
                    for c in cols.clone() {
                        let (dr, dc) = (r as f64 - r0, c as f64 - c0);
                        if dr * dr + dc * dc <= rad * rad {
                            v.push(flat(r, c));
                        }
                    }
                }
                v
            }
            ScanRoi::Positions(p) => {
                check_positions(scan, p, OP)?;
                p.iter().map(|&(r, c)| flat(r, c)).collect()
            }
        };
        out.sort_unstable();
        out.dedup();
        if out.is_empty() {
            return Err(Error::invalid(OP, "the scan ROI holds no scan position")
                .with_expected("at least one scan position inside the scan")
                .with_found(format!("{self:?} on a {scan} scan")));
        }
        Ok(out)
    }
}

/// `[⌈x − r⌉, ⌊x + r⌋] ∩ [0, n)` as a range.
fn clip_range(x: f64, r: f64, n: usize) -> std::ops::Range<usize> {
    let lo = (x - r).ceil().max(0.0);
    let hi = (x + r).floor() + 1.0;
    if hi <= lo || hi <= 0.0 {
        return 0..0;
    }
    let lo = (lo as usize).min(n);
    let hi = if hi >= n as f64 { n } else { hi as usize };
    lo..hi.max(lo)
}

/// Sum and max diffraction pattern over a scan ROI.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RoiDp {
    /// Exact `u64` sum over the ROI's frames, per detector pixel.
    pub sum: Vec<u64>,
    /// Element-wise maximum over the ROI's frames.
    pub max: Vec<u32>,
    /// Frames in the ROI (distinct positions): the mean is `sum / n_frames`.
    pub n_frames: u64,
    /// How it was computed (the ROI and its frame count in `params`).
    pub provenance: ResultProvenance,
}

impl RoiDp {
    /// The mean pattern `sum / n_frames`, divided in `f64`, as `f32`.
    pub fn mean(&self) -> Vec<f32> {
        let n = self.n_frames.max(1) as f64;
        self.sum.iter().map(|&s| (s as f64 / n) as f32).collect()
    }
}

/// Sum and max DP over the frames of a scan ROI, in one pass over those frames only.
pub fn roi_dp(ds: &Dataset, roi: &ScanRoi) -> Result<RoiDp> {
    const OP: &str = "detector roi_dp";
    live(ds, OP)?;
    let t0 = Instant::now();
    let frames = roi.frame_indices(ds.scan_shape)?;
    let n = frames.len() as u64;
    let r = reduce(
        ds,
        &ReduceRequest {
            sum_dp: true,
            max_dp: true,
            frames: Some(frames),
            ..Default::default()
        },
    )
    .map_err(|e| e.with_op(OP))?;
    let secs = t0.elapsed().as_secs_f64();
    let missing = || Error::internal(OP, "the reduction returned no sum or max");
    let mut provenance = ResultProvenance::new(
        ds,
        "detector.roi_dp",
        json!({ "roi": roi, "n_frames": n, "mean": "sum / n_frames" }),
    );
    provenance.stage("reduce", secs);
    Ok(RoiDp {
        sum: r.sum_dp.ok_or_else(missing)?,
        max: r.max_dp.ok_or_else(missing)?,
        n_frames: r.n_frames,
        provenance,
    })
}
