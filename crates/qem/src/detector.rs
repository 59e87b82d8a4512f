//! `qem::detector`: detector products of a [`Dataset`] — diffraction sums, virtual detector
//! images, scan-ROI patterns and moments (docs/science.md §2–4).
//!
//! Every product is one engine pass: the operation builds a [`ReduceRequest`] and [`reduce`]
//! hands it to the engine that holds the data (`qem_cpu::reduce_dense`/`reduce_encoded` on the
//! CPU, `qem_cuda::reduce_dense`/`reduce_encoded` on the GPU). [`products`] puts several products
//! into that one request, so asking for BF, ADF, the sum DP and the CoM costs one pass.
//!
//! Definitions, followed exactly:
//! * integer sums are exact `u64`; the mean DP is the `u64` sum divided by the frame count in
//!   `f64`, returned as `f32`; the max DP is exact;
//! * the BF disk ([`fit_disk`]) comes from the `f32` mean DP: threshold `t = mean + std`
//!   (population std, in `f64`), pixels `> t` (strict), unweighted centroid, equal-area radius
//!   `√(n/π)`; no pixel above `t` gives the centre `(k_r/2, k_c/2)` (real division) and the
//!   radius `min(k_r, k_c)/4`;
//! * a pixel `k` belongs to the annulus `[lo, hi]` around `c` when `lo² ≤ |k − c|² ≤ hi²` in
//!   `f64`, both bounds inclusive ([`annulus_mask`]); BF `[0, r]`, ABF `[r/2, r]`, ADF `[r, 2r]`,
//!   HAADF `[2r, 4r]`, DF `[r, ∞)`, annular `[inner, outer]` (both required).
//!
//! The sum DP over all frames is cached on the dataset the first time it is computed, so the
//! disk fit costs one pass per dataset and is free afterwards.

use crate::dataset::{Dataset, Storage};
use crate::result::ResultProvenance;
use qem_core::{DType, DenseArray, Error, Region, Result, Shape2};
use serde_json::json;
use std::sync::OnceLock;
use std::time::Instant;

pub use qem_core::{DetectorMask, Moments, ReduceRequest, ReduceResult, VirtualImage};

/// Results a dataset keeps for later detector operations: the exact sum DP over all frames
/// (the disk fit, [`sum_dp`] and [`mean_dp`] are then free). Data does not change after a
/// load, so the cache never goes stale.
#[derive(Default)]
pub(crate) struct DetectorCache {
    sum_dp: OnceLock<Vec<u64>>,
}

impl std::fmt::Debug for DetectorCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the pattern itself: a dataset's Debug output stays short.
        f.debug_struct("DetectorCache")
            .field("sum_dp_cached", &self.sum_dp.get().is_some())
            .finish()
    }
}

fn closed(op: &str) -> Error {
    Error::invalid(op, "the dataset has been closed")
}

fn live(ds: &Dataset, op: &str) -> Result<()> {
    if ds.is_closed() {
        Err(closed(op))
    } else {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The engine pass.

/// Run one reduction pass over the frames of `ds` on the engine that holds it (CPU dense or
/// ENCODED, CUDA dense or ENCODED). The engine's result is checked against the request (one
/// value per visited frame, every requested field present) before it is returned.
pub fn reduce(ds: &Dataset, req: &ReduceRequest) -> Result<ReduceResult> {
    let n_frames = ds.scan_shape.len();
    let det = ds.detector_shape;
    let result = match &ds.storage {
        Storage::CpuDense(a) => qem_cpu::reduce_dense(a, n_frames, det, req)?,
        Storage::CpuEncoded(e) => qem_cpu::reduce_encoded(e, req)?,
        Storage::CudaDense(a) => qem_cuda::reduce_dense(a, req)?,
        Storage::CudaEncoded(e) => qem_cuda::reduce_encoded(e, req)?,
        Storage::Closed => return Err(closed("detector reduction")),
    };
    check_result(&result, req, n_frames as u64, det.len())?;
    Ok(result)
}

/// An engine result that does not fit its request is an internal error, never an answer.
fn check_result(
    r: &ReduceResult,
    req: &ReduceRequest,
    n_frames: u64,
    frame_len: usize,
) -> Result<()> {
    let n_sel = req.n_selected(n_frames);
    let bad = |what: &str, expected: String, found: String| {
        Err(Error::internal(
            "detector reduction",
            format!("the engine returned a malformed result: {what}"),
        )
        .with_expected(expected)
        .with_found(found))
    };
    if r.n_frames != n_sel {
        return bad("frames visited", n_sel.to_string(), r.n_frames.to_string());
    }
    if r.images.len() != req.masks.len() {
        return bad(
            "number of images",
            req.masks.len().to_string(),
            r.images.len().to_string(),
        );
    }
    for (i, (im, m)) in r.images.iter().zip(&req.masks).enumerate() {
        let kind_ok = matches!(
            (im, m),
            (VirtualImage::U64(_), DetectorMask::Int(_))
                | (VirtualImage::F64(_), DetectorMask::Float(_))
        );
        if !kind_ok || im.len() as u64 != n_sel {
            return bad(
                &format!("image {i}"),
                format!("{n_sel} values of the mask's kind"),
                format!("{} values", im.len()),
            );
        }
    }
    let len_ok = |v: Option<usize>, wanted: bool| match v {
        Some(n) => wanted && n == frame_len,
        None => !wanted,
    };
    if !len_ok(r.sum_dp.as_ref().map(Vec::len), req.sum_dp) {
        return bad(
            "sum_dp",
            format!("requested={}", req.sum_dp),
            "other".into(),
        );
    }
    if !len_ok(r.max_dp.as_ref().map(Vec::len), req.max_dp) {
        return bad(
            "max_dp",
            format!("requested={}", req.max_dp),
            "other".into(),
        );
    }
    match (&r.moments, req.moments) {
        (None, false) => {}
        (Some(m), true)
            if [m.sum.len(), m.m_row.len(), m.m_col.len()]
                .iter()
                .all(|&n| n as u64 == n_sel) => {}
        _ => {
            return bad(
                "moments",
                format!("requested={}", req.moments),
                "other".into(),
            )
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Diffraction patterns and frames.

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

fn mean_from_sum(sum: &[u64], n_frames: u64, op: &str) -> Result<Vec<f32>> {
    if n_frames == 0 {
        return Err(Error::invalid(op, "the mean over no frames is undefined")
            .with_expected("at least one frame")
            .with_found("0 frames"));
    }
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

// ---------------------------------------------------------------------------------------------
// Virtual images and moments.

/// The virtual image `V[R] = Σ_k w[k] · I[R, k]` of one mask over every frame: exact `u64` for
/// an integer (or bool) mask, `f64` for a float mask. A mask of the wrong size is an error
/// naming both sizes.
pub fn virtual_image(ds: &Dataset, mask: &DetectorMask) -> Result<VirtualImage> {
    const OP: &str = "detector virtual_image";
    live(ds, OP)?;
    let r = reduce(
        ds,
        &ReduceRequest {
            masks: vec![mask.clone()],
            ..Default::default()
        },
    )
    .map_err(|e| e.with_op(OP))?;
    r.images
        .into_iter()
        .next()
        .ok_or_else(|| Error::internal(OP, "the reduction returned no image"))
}

/// Exact per-frame moments over the whole detector: `S = Σ I`, `m_row = Σ k_r I`,
/// `m_col = Σ k_c I` (`u64`, one value per scan position).
pub fn moments(ds: &Dataset) -> Result<Moments> {
    const OP: &str = "detector moments";
    live(ds, OP)?;
    let r = reduce(
        ds,
        &ReduceRequest {
            moments: true,
            ..Default::default()
        },
    )
    .map_err(|e| e.with_op(OP))?;
    r.moments
        .ok_or_else(|| Error::internal(OP, "the reduction returned no moments"))
}

// ---------------------------------------------------------------------------------------------
// The BF disk.

/// The BF disk used by the virtual detectors.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DiskFit {
    /// Centre `(row, col)`, detector pixels.
    pub center_px: (f64, f64),
    /// Radius, detector pixels.
    pub radius_px: f64,
    /// The fit's threshold `mean + std` of the mean DP (NaN when no fit ran because both
    /// centre and radius were given).
    pub threshold: f64,
    /// Pixels of the mean DP above the threshold (0 when no fit ran).
    pub n_pixels: usize,
    /// True when centre and radius are both the fit's; false when either was given.
    pub fitted: bool,
}

/// The BF disk of a mean diffraction pattern (docs/science.md §3, anchor §3.1): threshold
/// `t = mean + std` over all pixels (population std, computed in `f64` from the `f32` values),
/// pixels with value `> t`, their unweighted centroid and equal-area radius `√(n/π)`. With no
/// pixel above `t` (a flat pattern): centre `(k_r/2, k_c/2)`, radius `min(k_r, k_c)/4`.
pub fn fit_disk_from_mean(mean: &[f32], detector: Shape2) -> DiskFit {
    let n = mean.len().max(1) as f64;
    let mu = mean.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = mean
        .iter()
        .map(|&v| (f64::from(v) - mu).powi(2))
        .sum::<f64>()
        / n;
    let t = mu + var.sqrt();
    let (mut count, mut sr, mut sc) = (0usize, 0.0f64, 0.0f64);
    for (k, &v) in mean.iter().enumerate() {
        if f64::from(v) > t {
            count += 1;
            sr += (k / detector.cols.max(1)) as f64;
            sc += (k % detector.cols.max(1)) as f64;
        }
    }
    if count == 0 {
        return DiskFit {
            center_px: (detector.rows as f64 / 2.0, detector.cols as f64 / 2.0),
            radius_px: detector.rows.min(detector.cols) as f64 / 4.0,
            threshold: t,
            n_pixels: 0,
            fitted: true,
        };
    }
    DiskFit {
        center_px: (sr / count as f64, sc / count as f64),
        radius_px: (count as f64 / std::f64::consts::PI).sqrt(),
        threshold: t,
        n_pixels: count,
        fitted: true,
    }
}

/// The BF disk of `ds`, fitted from its mean DP ([`fit_disk_from_mean`]). The sum DP behind it
/// is computed once per dataset and cached, so repeated fits cost no pass.
pub fn fit_disk(ds: &Dataset) -> Result<DiskFit> {
    let mean = mean_dp(ds).map_err(|e| e.with_op("detector fit_disk"))?;
    Ok(fit_disk_from_mean(&mean, ds.detector_shape))
}

/// The annulus mask `lo² ≤ |k − c|² ≤ hi²` (f64, both bounds inclusive) over a detector, as
/// 0/1 integer weights. `outer_px = ∞` keeps every pixel beyond `inner_px`.
pub fn annulus_mask(
    detector: Shape2,
    center: (f64, f64),
    inner_px: f64,
    outer_px: f64,
) -> Vec<u32> {
    let (lo2, hi2) = (inner_px * inner_px, outer_px * outer_px);
    let mut m = Vec::with_capacity(detector.len());
    for i in 0..detector.rows {
        for j in 0..detector.cols {
            let (dr, dc) = (i as f64 - center.0, j as f64 - center.1);
            let d2 = dr * dr + dc * dc;
            m.push(u32::from(lo2 <= d2 && d2 <= hi2));
        }
    }
    m
}

// ---------------------------------------------------------------------------------------------
// Named virtual detectors.

/// Unit of [`DetectorParams::inner`] and [`DetectorParams::outer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Unit {
    /// Detector pixels of the loaded (possibly binned) grid.
    #[default]
    Px,
    /// Milliradians of scattering angle.
    Mrad,
}

impl Unit {
    /// `"px"` or `"mrad"`.
    pub fn name(self) -> &'static str {
        match self {
            Unit::Px => "px",
            Unit::Mrad => "mrad",
        }
    }
}

impl std::str::FromStr for Unit {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "px" => Ok(Unit::Px),
            "mrad" => Ok(Unit::Mrad),
            other => Err(
                Error::invalid("detector", format!("unknown unit \"{other}\""))
                    .with_expected("px or mrad")
                    .with_found(other.to_string()),
            ),
        }
    }
}

/// A named virtual detector (docs/science.md §4 bounds, `r` the BF disk radius).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DetectorKind {
    /// Bright field `[0, r]`.
    Bf,
    /// Annular bright field `[r/2, r]`.
    Abf,
    /// Annular dark field, default `[r, 2r]`.
    Adf,
    /// High-angle annular dark field `[2r, 4r]`.
    Haadf,
    /// Dark field `[r, ∞)`.
    Df,
    /// Any annulus: `inner` and `outer` are required.
    Annular,
}

impl DetectorKind {
    /// Every kind, in the order of their names.
    pub const ALL: [DetectorKind; 6] = [
        DetectorKind::Bf,
        DetectorKind::Abf,
        DetectorKind::Adf,
        DetectorKind::Haadf,
        DetectorKind::Df,
        DetectorKind::Annular,
    ];

    /// Lower-case name (`"bf"`, `"abf"`, `"adf"`, `"haadf"`, `"df"`, `"annular"`).
    pub fn name(self) -> &'static str {
        match self {
            DetectorKind::Bf => "bf",
            DetectorKind::Abf => "abf",
            DetectorKind::Adf => "adf",
            DetectorKind::Haadf => "haadf",
            DetectorKind::Df => "df",
            DetectorKind::Annular => "annular",
        }
    }

    /// Default `(lo, hi)` in pixels for a disk of radius `r`; `None` for `annular`, which has
    /// no default.
    pub fn default_bounds(self, r: f64) -> Option<(f64, f64)> {
        match self {
            DetectorKind::Bf => Some((0.0, r)),
            DetectorKind::Abf => Some((0.5 * r, r)),
            DetectorKind::Adf => Some((r, 2.0 * r)),
            DetectorKind::Haadf => Some((2.0 * r, 4.0 * r)),
            DetectorKind::Df => Some((r, f64::INFINITY)),
            DetectorKind::Annular => None,
        }
    }
}

impl std::fmt::Display for DetectorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DetectorKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let low = s.to_ascii_lowercase();
        DetectorKind::ALL
            .into_iter()
            .find(|k| k.name() == low)
            .ok_or_else(|| {
                Error::invalid("detector", format!("unknown detector \"{s}\""))
                    .with_expected("bf, abf, adf, haadf, df or annular")
                    .with_found(s.to_string())
            })
    }
}

/// Geometry of a named virtual detector. `Default`: the fitted disk, the kind's own bounds,
/// pixels, no calibration beyond the dataset's metadata.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct DetectorParams {
    /// Inner bound in [`DetectorParams::unit`] (overrides the kind's default).
    pub inner: Option<f64>,
    /// Outer bound in [`DetectorParams::unit`] (overrides the kind's default; may be `∞`).
    pub outer: Option<f64>,
    /// Disk centre `(row, col)` in detector pixels (overrides the fitted one).
    pub center: Option<(f64, f64)>,
    /// Disk radius in detector pixels (overrides the fitted one).
    pub radius: Option<f64>,
    /// Unit of `inner` and `outer`.
    pub unit: Unit,
    /// Convergence semi-angle in mrad, for `Unit::Mrad` when the angular sampling is not
    /// known: the disk edge is then taken as the aperture edge (`semiangle_mrad / r` mrad per
    /// pixel). Falls back to the metadata's semi-angle.
    pub semiangle_mrad: Option<f64>,
    /// Detector angular sampling, mrad per loaded pixel (overrides the metadata's).
    pub det_sampling_mrad: Option<f64>,
}

impl DetectorParams {
    /// Check the numbers: finite centre, positive finite radius and calibrations, bounds
    /// `>= 0` (outer may be `∞`), not NaN.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "detector";
        let bad = |what: &str, expected: &str, found: String| {
            Err(Error::invalid(OP, format!("invalid {what}"))
                .with_expected(expected.to_string())
                .with_found(found))
        };
        if let Some((r, c)) = self.center {
            if !(r.is_finite() && c.is_finite()) {
                return bad("center", "finite (row, col) pixels", format!("({r}, {c})"));
            }
        }
        for (name, v) in [
            ("radius", self.radius),
            ("semiangle_mrad", self.semiangle_mrad),
            ("det_sampling_mrad", self.det_sampling_mrad),
        ] {
            if let Some(x) = v {
                if !(x.is_finite() && x > 0.0) {
                    return bad(name, "a finite value > 0", x.to_string());
                }
            }
        }
        if let Some(x) = self.inner {
            if !(x.is_finite() && x >= 0.0) {
                return bad("inner", "a finite value >= 0", x.to_string());
            }
        }
        if let Some(x) = self.outer {
            if x.is_nan() || x < 0.0 {
                return bad("outer", "a value >= 0 (or infinity)", x.to_string());
            }
        }
        if let (Some(i), Some(o)) = (self.inner, self.outer) {
            if i > o {
                return bad("bounds", "inner <= outer", format!("inner {i} > outer {o}"));
            }
        }
        Ok(())
    }
}

/// A named virtual detector image.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DetectorImage {
    /// Which detector.
    pub kind: DetectorKind,
    /// Exact `u64` sums, one per scan position, row-major `[R_r, R_c]`.
    pub image: Vec<u64>,
    /// Scan grid.
    pub scan_shape: Shape2,
    /// Inner bound, detector pixels.
    pub inner_px: f64,
    /// Outer bound, detector pixels (`f64::INFINITY` for DF; serialised as `null`).
    pub outer_px: f64,
    /// The disk the bounds were made from.
    pub disk: DiskFit,
    /// Detector pixels in the mask.
    pub mask_pixels: usize,
    /// How it was computed (centre, radius, bounds in px and mrad, calibration source).
    pub provenance: ResultProvenance,
}

/// Detector angular sampling (mrad per loaded pixel) and where it came from.
#[derive(Debug, Clone)]
struct Sampling {
    mrad_per_px: f64,
    source: String,
}

/// The sampling `unit = mrad` converts with: the argument, else the metadata's (per loaded
/// pixel: [`qem_core::Metadata::for_loaded_grid`] has applied `det_bin`; must be the same along
/// rows and columns, since a mask is a circle in pixels), else the semi-angle (argument, else
/// metadata) over the disk radius.
fn sampling(ds: &Dataset, p: &DetectorParams, radius_px: f64) -> Result<Sampling> {
    const OP: &str = "detector (unit mrad)";
    if let Some(s) = p.det_sampling_mrad {
        return Ok(Sampling {
            mrad_per_px: s,
            source: "det_sampling_mrad argument".into(),
        });
    }
    let md = ds.metadata();
    if let Some((r, c)) = md.angular_sampling_mrad {
        if !(r.is_finite() && c.is_finite() && r > 0.0 && c > 0.0) {
            return Err(Error::invalid(
                OP,
                "the metadata's detector angular sampling is not usable",
            )
            .with_expected("finite values > 0 mrad/px")
            .with_found(format!("({r}, {c})")));
        }
        if (r - c).abs() > 1e-9 * r.max(c) {
            return Err(Error::invalid(
                OP,
                "the detector angular sampling differs along rows and columns; a circular mask in mrad is an ellipse in pixels",
            )
            .with_expected("equal row and column sampling, or det_sampling_mrad, or unit px")
            .with_found(format!("({r}, {c}) mrad/px")));
        }
        return Ok(Sampling {
            mrad_per_px: r,
            source: format!(
                "metadata angular_sampling_mrad {r} (loaded grid, det_bin {})",
                ds.provenance().det_bin.max(1)
            ),
        });
    }
    let semi = p
        .semiangle_mrad
        .map(|s| (s, "argument"))
        .or(md.semiangle_mrad.map(|s| (s, "metadata")));
    match semi {
        Some((s, from)) if s.is_finite() && s > 0.0 => Ok(Sampling {
            mrad_per_px: s / radius_px,
            source: format!("semiangle_mrad ({from}) {s} / disk radius {radius_px} px"),
        }),
        _ => Err(Error::invalid(
            OP,
            "cannot convert mrad to pixels: no detector angular sampling and no convergence semi-angle",
        )
        .with_expected("det_sampling_mrad, metadata angular_sampling_mrad, or semiangle_mrad")
        .with_found("none of them")),
    }
}

/// Everything a named detector needs beyond its kind: the disk and the unit conversion.
#[derive(Debug, Clone)]
struct Geometry {
    disk: DiskFit,
    /// Known angular sampling (required for `Unit::Mrad`, recorded when known otherwise).
    sampling: Option<Sampling>,
    /// Whether the sum DP behind the fit was served from the cache.
    disk_cached: bool,
    disk_secs: f64,
}

fn geometry(ds: &Dataset, p: &DetectorParams) -> Result<Geometry> {
    let t = Instant::now();
    let disk_cached = ds.detector_cache.sum_dp.get().is_some();
    let disk = match (p.center, p.radius) {
        (Some(center_px), Some(radius_px)) => DiskFit {
            center_px,
            radius_px,
            threshold: f64::NAN,
            n_pixels: 0,
            fitted: false,
        },
        (center, radius) => {
            let mut d = fit_disk(ds)?;
            if let Some(c) = center {
                d.center_px = c;
                d.fitted = false;
            }
            if let Some(r) = radius {
                d.radius_px = r;
                d.fitted = false;
            }
            d
        }
    };
    let disk_secs = t.elapsed().as_secs_f64();
    let sampling = match p.unit {
        Unit::Mrad => Some(sampling(ds, p, disk.radius_px)?),
        Unit::Px => sampling(ds, p, disk.radius_px).ok(),
    };
    Ok(Geometry {
        disk,
        sampling,
        disk_cached: disk_cached || (p.center.is_some() && p.radius.is_some()),
        disk_secs,
    })
}

/// `(inner_px, outer_px)` of `kind`: the kind's default, with `inner`/`outer` (in `p.unit`)
/// overriding it.
fn bounds(kind: DetectorKind, p: &DetectorParams, g: &Geometry) -> Result<(f64, f64)> {
    let op = format!("detector {kind}");
    let to_px = |v: f64| match (p.unit, &g.sampling) {
        (Unit::Px, _) => Ok(v),
        (Unit::Mrad, Some(s)) => Ok(v / s.mrad_per_px),
        (Unit::Mrad, None) => Err(Error::internal(&op, "mrad without a sampling")),
    };
    let default = kind.default_bounds(g.disk.radius_px);
    let (lo, hi) = match (p.inner, p.outer, default) {
        (Some(i), Some(o), _) => (to_px(i)?, to_px(o)?),
        (i, o, Some((dlo, dhi))) => (
            i.map(to_px).transpose()?.unwrap_or(dlo),
            o.map(to_px).transpose()?.unwrap_or(dhi),
        ),
        (i, o, None) => {
            return Err(
                Error::invalid(&op, "the annular detector needs both bounds")
                    .with_expected("inner and outer")
                    .with_found(format!("inner {i:?}, outer {o:?}")),
            )
        }
    };
    if lo > hi {
        return Err(Error::invalid(&op, "inner bound beyond outer bound")
            .with_expected("inner <= outer")
            .with_found(format!("inner {lo} px, outer {hi} px")));
    }
    Ok((lo, hi))
}

fn disk_json(d: &DiskFit, p: &DetectorParams, g: &Geometry) -> serde_json::Value {
    json!({
        "center_px": [d.center_px.0, d.center_px.1],
        "radius_px": d.radius_px,
        "center_source": if p.center.is_some() { "argument" } else { "fitted from the mean DP" },
        "radius_source": if p.radius.is_some() { "argument" } else { "fitted from the mean DP" },
        "fitted": d.fitted,
        "threshold": d.threshold,
        "n_pixels": d.n_pixels,
        "fit_rule": "mean DP > mean + std (population), unweighted centroid, equal-area radius",
        "sum_dp_cached": g.disk_cached,
    })
}

fn bounds_json(
    kind: DetectorKind,
    lo: f64,
    hi: f64,
    mask_pixels: usize,
    g: &Geometry,
) -> serde_json::Value {
    let mrad = |v: f64| g.sampling.as_ref().map(|s| v * s.mrad_per_px);
    json!({
        "kind": kind.name(),
        "inner_px": lo,
        "outer_px": if hi.is_finite() { json!(hi) } else { json!("inf") },
        "inner_mrad": mrad(lo),
        "outer_mrad": if hi.is_finite() { json!(mrad(hi)) } else { json!("inf") },
        "mask_pixels": mask_pixels,
        "mask_rule": "lo^2 <= |k - c|^2 <= hi^2 (f64, both bounds inclusive)",
    })
}

fn sampling_json(p: &DetectorParams, g: &Geometry) -> serde_json::Value {
    json!({
        "unit": p.unit.name(),
        "mrad_per_px": g.sampling.as_ref().map(|s| s.mrad_per_px),
        "sampling_source": g.sampling.as_ref().map(|s| s.source.clone()),
    })
}

/// One named virtual detector image: the BF disk (fitted from the cached mean DP unless
/// `center` and `radius` are given), the kind's bounds (or `inner`/`outer` in `unit`), the mask
/// `lo² ≤ |k − c|² ≤ hi²`, and one pass for the exact `u64` image.
pub fn detector_image(
    ds: &Dataset,
    kind: DetectorKind,
    p: &DetectorParams,
) -> Result<DetectorImage> {
    let op = format!("detector {kind}");
    live(ds, &op)?;
    p.validate().map_err(|e| e.with_op(&op))?;
    let g = geometry(ds, p).map_err(|e| e.with_op(&op))?;
    let (lo, hi) = bounds(kind, p, &g)?;
    let mask = annulus_mask(ds.detector_shape, g.disk.center_px, lo, hi);
    let mask_pixels = mask.iter().filter(|&&w| w != 0).count();
    let t = Instant::now();
    let r = reduce(
        ds,
        &ReduceRequest {
            masks: vec![DetectorMask::Int(mask)],
            ..Default::default()
        },
    )
    .map_err(|e| e.with_op(&op))?;
    let secs = t.elapsed().as_secs_f64();
    let image = match r.images.into_iter().next() {
        Some(VirtualImage::U64(v)) => v,
        _ => {
            return Err(Error::internal(
                &op,
                "the reduction returned no integer image",
            ))
        }
    };
    let mut provenance = ResultProvenance::new(
        ds,
        &format!("detector.{kind}"),
        json!({
            "detector": bounds_json(kind, lo, hi, mask_pixels, &g),
            "disk": disk_json(&g.disk, p, &g),
            "calibration": sampling_json(p, &g),
        }),
    );
    provenance.stage("disk_fit", g.disk_secs);
    provenance.stage("reduce", secs);
    Ok(DetectorImage {
        kind,
        image,
        scan_shape: ds.scan_shape,
        inner_px: lo,
        outer_px: hi,
        disk: g.disk,
        mask_pixels,
        provenance,
    })
}

// ---------------------------------------------------------------------------------------------
// Several products in one pass.

/// One product [`products`] can compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Product {
    /// A named virtual detector image.
    Det(DetectorKind),
    /// Exact sum DP.
    SumDp,
    /// Mean DP (`f32`).
    MeanDp,
    /// Max DP.
    MaxDp,
    /// Exact per-frame moments.
    Moments,
    /// Centre of mass, centred, as `dpc::center_of_mass(ds, true)` gives it.
    Com,
}

impl Product {
    /// The name [`Product::from_str`](std::str::FromStr) accepts.
    pub fn name(self) -> &'static str {
        match self {
            Product::Det(k) => k.name(),
            Product::SumDp => "sum_dp",
            Product::MeanDp => "mean_dp",
            Product::MaxDp => "max_dp",
            Product::Moments => "moments",
            Product::Com => "com",
        }
    }
}

impl std::fmt::Display for Product {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Product {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "sum_dp" => Ok(Product::SumDp),
            "mean_dp" => Ok(Product::MeanDp),
            "max_dp" => Ok(Product::MaxDp),
            "moments" => Ok(Product::Moments),
            "com" => Ok(Product::Com),
            _ => s.parse::<DetectorKind>().map(Product::Det).map_err(|_| {
                Error::invalid("detector products", format!("unknown product \"{s}\""))
                    .with_expected(
                        "bf, abf, adf, haadf, df, annular, sum_dp, mean_dp, max_dp, moments or com",
                    )
                    .with_found(s.to_string())
            }),
        }
    }
}

fn ser_moments<S: serde::Serializer>(
    m: &Option<Moments>,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    use serde::Serialize;
    m.as_ref()
        .map(|m| json!({ "sum": m.sum, "m_row": m.m_row, "m_col": m.m_col }))
        .serialize(s)
}

/// What [`products`] returns: a field is `Some` (or `images` non-empty) exactly when asked.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Products {
    /// One image per requested detector kind, in the order first requested.
    pub images: Vec<DetectorImage>,
    /// Exact sum DP.
    pub sum_dp: Option<Vec<u64>>,
    /// Mean DP.
    pub mean_dp: Option<Vec<f32>>,
    /// Max DP.
    pub max_dp: Option<Vec<u32>>,
    /// Exact per-frame moments.
    #[serde(serialize_with = "ser_moments")]
    pub moments: Option<Moments>,
    /// Centred centre of mass.
    pub com: Option<crate::dpc::CenterOfMass>,
    /// The BF disk, when a detector image was asked.
    pub disk: Option<DiskFit>,
    /// How it was computed: the request, the disk and calibration, stage times.
    pub provenance: ResultProvenance,
}

/// Several products in ONE reduction pass (plus, the first time a dataset needs its BF disk,
/// one sum-DP pass that is then cached; a cached sum DP also serves `sum_dp`/`mean_dp` without
/// reading the frames again).
///
/// Every detector kind gets [`detector_image`]'s geometry from the same `p`: the same disk and
/// calibration. `inner`/`outer` override a kind's bounds, so they are accepted only when one
/// detector kind is asked (with several, which one they meant is ambiguous: it is an error).
/// Repeated products are computed once. `moments` and `com` share one set of moments; `com` is
/// centred and in mrad when the metadata gives the angular sampling, like
/// [`crate::dpc::center_of_mass`].
pub fn products(ds: &Dataset, which: &[Product], p: &DetectorParams) -> Result<Products> {
    const OP: &str = "detector products";
    live(ds, OP)?;
    p.validate().map_err(|e| e.with_op(OP))?;
    if which.is_empty() {
        return Err(Error::invalid(OP, "no product asked")
            .with_expected("at least one of bf, abf, adf, haadf, df, annular, sum_dp, mean_dp, max_dp, moments, com"));
    }
    let t0 = Instant::now();
    let mut kinds: Vec<DetectorKind> = Vec::new();
    for w in which {
        if let Product::Det(k) = w {
            if !kinds.contains(k) {
                kinds.push(*k);
            }
        }
    }
    let wants = |x: Product| which.contains(&x);
    if kinds.len() > 1 && (p.inner.is_some() || p.outer.is_some()) {
        return Err(
            Error::invalid(OP, "inner/outer given with several detectors")
                .with_expected(
                    "inner/outer with exactly one detector kind (call detector_image per detector)",
                )
                .with_found(format!(
                    "{} detectors: {}",
                    kinds.len(),
                    kinds
                        .iter()
                        .map(|k| k.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                )),
        );
    }

    // The disk (from the cache, or one sum-DP pass) and the masks.
    let g = if kinds.is_empty() {
        None
    } else {
        Some(geometry(ds, p).map_err(|e| e.with_op(OP))?)
    };
    let mut masks = Vec::with_capacity(kinds.len());
    let mut geom = Vec::with_capacity(kinds.len());
    if let Some(g) = &g {
        for &k in &kinds {
            let (lo, hi) = bounds(k, p, g).map_err(|e| e.with_op(OP))?;
            let m = annulus_mask(ds.detector_shape, g.disk.center_px, lo, hi);
            geom.push((lo, hi, m.iter().filter(|&&w| w != 0).count()));
            masks.push(DetectorMask::Int(m));
        }
    }
    let cached_sum = ds.detector_cache.sum_dp.get();
    let want_sum = wants(Product::SumDp) || wants(Product::MeanDp);
    let req = ReduceRequest {
        masks,
        sum_dp: want_sum && cached_sum.is_none(),
        max_dp: wants(Product::MaxDp),
        moments: wants(Product::Moments) || wants(Product::Com),
        frames: None,
    };
    let t1 = Instant::now();
    let nothing_to_read = req.masks.is_empty() && !req.sum_dp && !req.max_dp && !req.moments;
    let mut r = if nothing_to_read {
        ReduceResult::default()
    } else {
        reduce(ds, &req).map_err(|e| e.with_op(OP))?
    };
    let reduce_secs = t1.elapsed().as_secs_f64();
    let engine_stages = std::mem::take(&mut r.stages);

    let sum = match (r.sum_dp, cached_sum) {
        (Some(s), _) => {
            let _ = ds.detector_cache.sum_dp.set(s.clone());
            Some(s)
        }
        (None, Some(s)) if want_sum => Some(s.clone()),
        _ => None,
    };
    let n_frames = ds.scan_shape.len() as u64;
    let mean_dp = match (&sum, wants(Product::MeanDp)) {
        (Some(s), true) => Some(mean_from_sum(s, n_frames, OP)?),
        _ => None,
    };
    let moments = r.moments;
    let com = match (&moments, wants(Product::Com)) {
        (Some(m), true) => Some(com_of(ds, m, t0, reduce_secs)),
        _ => None,
    };

    let mut images = Vec::with_capacity(kinds.len());
    let mut images_json = Vec::with_capacity(kinds.len());
    for ((&kind, (lo, hi, mask_pixels)), im) in kinds.iter().zip(geom).zip(r.images) {
        let VirtualImage::U64(image) = im else {
            return Err(Error::internal(
                OP,
                "the reduction returned a float image for an integer mask",
            ));
        };
        let Some(g) = &g else {
            return Err(Error::internal(OP, "a detector image without a disk"));
        };
        let dj = bounds_json(kind, lo, hi, mask_pixels, g);
        let mut prov = ResultProvenance::new(
            ds,
            &format!("detector.{kind}"),
            json!({
                "detector": dj,
                "disk": disk_json(&g.disk, p, g),
                "calibration": sampling_json(p, g),
                "computed_by": "detector.products (one pass)",
            }),
        );
        prov.stage("disk_fit", g.disk_secs);
        prov.stage("reduce (shared pass)", reduce_secs);
        images_json.push(dj);
        images.push(DetectorImage {
            kind,
            image,
            scan_shape: ds.scan_shape,
            inner_px: lo,
            outer_px: hi,
            disk: g.disk,
            mask_pixels,
            provenance: prov,
        });
    }

    let asked: Vec<&str> = which.iter().map(|w| w.name()).collect();
    let mut provenance = ResultProvenance::new(
        ds,
        "detector.products",
        json!({
            "products": asked,
            "detectors": images_json,
            "disk": g.as_ref().map(|g| disk_json(&g.disk, p, g)),
            "calibration": g.as_ref().map(|g| sampling_json(p, g)),
            "sum_dp_from_cache": want_sum && cached_sum.is_some(),
            "passes": u32::from(!nothing_to_read),
            "com_centered": wants(Product::Com).then_some(true),
        }),
    );
    if let Some(g) = &g {
        provenance.stage("disk_fit", g.disk_secs);
    }
    provenance.stage("reduce", reduce_secs);
    for st in &engine_stages {
        provenance.stage(&format!("reduce: {}", st.stage), st.seconds);
    }
    provenance.stage("total (wall)", t0.elapsed().as_secs_f64());
    Ok(Products {
        images,
        sum_dp: if wants(Product::SumDp) { sum } else { None },
        mean_dp,
        max_dp: r.max_dp,
        moments: if wants(Product::Moments) {
            moments
        } else {
            None
        },
        com,
        disk: g.map(|g| g.disk),
        provenance,
    })
}

/// The centred CoM of `m`, in detector pixels or, when the metadata gives the detector angular
/// sampling (per source pixel, times `det_bin`), in mrad — the rule of
/// [`crate::dpc::center_of_mass`], which the tests hold this to.
fn com_of(ds: &Dataset, m: &Moments, t0: Instant, reduce_secs: f64) -> crate::dpc::CenterOfMass {
    let shape = ds.scan_shape;
    let (mut com_row, mut com_col, zero_frames) = crate::dpc::com_from_moments(m, shape, true);
    let det_mrad = ds
        .metadata()
        .angular_sampling_mrad
        .filter(|&(r, c)| r.is_finite() && c.is_finite() && r > 0.0 && c > 0.0);
    if let Some((sr, sc)) = det_mrad {
        com_row.iter_mut().for_each(|v| *v *= sr);
        com_col.iter_mut().for_each(|v| *v *= sc);
    }
    let unit = if det_mrad.is_some() { "mrad" } else { "px" };
    let mut provenance = ResultProvenance::new(
        ds,
        "dpc.center_of_mass",
        json!({
            "centered": true,
            "unit": unit,
            "origin": "detector pixel (0, 0)",
            "zero_frames": zero_frames,
            "det_bin": ds.provenance().det_bin,
            "detector_angular_sampling_mrad": det_mrad.map(|(r, c)| [r, c]),
            "computed_by": "detector.products (one pass)",
        }),
    );
    provenance.stage("reduce (moments, shared pass)", reduce_secs);
    provenance.stage("total (wall)", t0.elapsed().as_secs_f64());
    crate::dpc::CenterOfMass {
        com_row,
        com_col,
        scan_shape: shape,
        centered: true,
        zero_frames,
        unit: unit.to_string(),
        provenance,
    }
}
