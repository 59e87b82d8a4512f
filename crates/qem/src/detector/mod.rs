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
//!
//! Results can also stay in GPU memory (`*_on_device`, [`reduce_on_device`]: arrays are
//! [`DeviceVec`]s for DLPack / CUDA Array Interface consumers); only a CUDA dataset has them,
//! a CPU dataset answers with an error naming its backend.
//!
//! Files: this module holds the engine pass ([`reduce`]) and the dataset's cache; `patterns`
//! the sum/mean/max DP, frames and scan-ROI patterns; `images` virtual images, moments, the BF
//! disk fit and the annulus mask; `named` the named detectors ([`detector_image`]); `geometry`
//! their disk, calibration, bounds and provenance JSON; `products` several products in one pass;
//! `device` the results left on the GPU; `target` what the host and device forms of an
//! operation differ in (the engine call), so that each operation is written once.

mod device;
mod geometry;
mod images;
mod named;
mod patterns;
mod products;
pub(crate) mod target;

pub use device::{
    detector_image_on_device, download_image, max_dp_on_device, mean_dp_on_device,
    moments_on_device, products_on_device, reduce_on_device, scale_on_device, sum_dp_on_device,
    virtual_image_on_device, DeviceMoments, DeviceProducts, DeviceReduceResult, DeviceVec, HostVec,
    ResultDType,
};
pub(crate) use images::moments_in;
pub use images::{annulus_mask, fit_disk, fit_disk_from_mean, moments, virtual_image, DiskFit};
pub use named::{detector_image, DetectorImage, DetectorKind, DetectorParams, Unit};
pub use patterns::{frames, max_dp, mean_dp, roi_dp, sum_dp, RoiDp, ScanRoi};
pub use products::{products, Product, Products};

use crate::dataset::{Dataset, Storage};
use qem_core::{Error, Result};
use std::sync::OnceLock;

pub use qem_core::{DetectorMask, Moments, ReduceRequest, ReduceResult, VirtualImage};

/// Results a dataset keeps for later detector operations: the exact sum DP over all frames
/// (the disk fit, [`sum_dp`] and [`mean_dp`] are then free) and the BF disk edge fitted to it
/// (`crate::calibration::disk_edge`: every module that converts with the detector sampling
/// asks for it). Data does not change after a load, so the cache never goes stale.
#[derive(Default)]
pub(crate) struct DetectorCache {
    sum_dp: OnceLock<Vec<u64>>,
    pub(crate) disk_edge: OnceLock<qem_core::DiskEdge>,
}

impl DetectorCache {
    /// A cache holding `sum_dp` where the load took it on the way (CUDA ENCODED loads).
    pub(crate) fn with_sum_dp(sum_dp: Option<Vec<u64>>) -> DetectorCache {
        let c = DetectorCache::default();
        if let Some(s) = sum_dp {
            let _ = c.sum_dp.set(s);
        }
        c
    }
}

impl std::fmt::Debug for DetectorCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the pattern itself: a dataset's Debug output stays short.
        f.debug_struct("DetectorCache")
            .field("sum_dp_cached", &self.sum_dp.get().is_some())
            .field("disk_edge_cached", &self.disk_edge.get().is_some())
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
///
/// With a progress observer installed ([`crate::progress::with_progress`]) the pass runs in
/// blocks of frames (see [`reduce_in_blocks`]), reporting and honouring cancellation between
/// blocks; the result is the same, value for value.
pub fn reduce(ds: &Dataset, req: &ReduceRequest) -> Result<ReduceResult> {
    let n_frames = ds.scan_shape.len();
    let det = ds.detector_shape;
    if let Some((progress, label)) = crate::progress::current() {
        let result = reduce_in_blocks(ds, req, progress.as_ref(), &label)?;
        check_result(&result, req, n_frames as u64, det.len())?;
        return Ok(result);
    }
    let result = engine_pass(ds, req)?;
    check_result(&result, req, n_frames as u64, det.len())?;
    Ok(result)
}

/// Frames per reported block: about 64 blocks, none smaller than this (an engine call has a
/// fixed cost: on CUDA the mask upload and launch set-up).
const MIN_BLOCK_FRAMES: usize = 1024;

/// [`reduce`] as a sequence of engine passes over consecutive blocks of the selected frames,
/// merged: per-frame outputs (images, moments) concatenated in order, the sum DP added (exact
/// `u64`), the max DP by element-wise maximum. Each block is reported to `progress` as frames
/// done; a cancellation between blocks stops the pass with an error.
fn reduce_in_blocks(
    ds: &Dataset,
    req: &ReduceRequest,
    progress: &dyn qem_core::Progress,
    label: &str,
) -> Result<ReduceResult> {
    let selected: Vec<u64> = match &req.frames {
        Some(f) => f.clone(),
        None => (0..ds.scan_shape.len() as u64).collect(),
    };
    let n = selected.len();
    let block = n.div_ceil(64).max(MIN_BLOCK_FRAMES);
    progress.begin(label, n as u64);
    let out = (|| {
        let mut merged: Option<ReduceResult> = None;
        for part in selected.chunks(block.max(1)) {
            if progress.cancelled() {
                return Err(Error::invalid(label, "cancelled by the caller"));
            }
            let sub = ReduceRequest {
                frames: Some(part.to_vec()),
                ..req.clone()
            };
            let r = engine_pass(ds, &sub)?;
            merged = Some(match merged {
                None => r,
                Some(m) => merge(m, r)?,
            });
            progress.advance(part.len() as u64);
        }
        match merged {
            Some(m) => Ok(m),
            // No frame selected: the engine's own answer to an empty selection.
            None => engine_pass(ds, req),
        }
    })();
    progress.end();
    out
}

/// `a` followed by `b` (consecutive blocks of one pass).
fn merge(mut a: ReduceResult, b: ReduceResult) -> Result<ReduceResult> {
    let mismatch = || Error::internal("detector reduction", "blocks of one pass differ in kind");
    if a.images.len() != b.images.len() {
        return Err(mismatch());
    }
    for (x, y) in a.images.iter_mut().zip(b.images) {
        match (x, y) {
            (VirtualImage::U64(x), VirtualImage::U64(y)) => x.extend(y),
            (VirtualImage::F64(x), VirtualImage::F64(y)) => x.extend(y),
            _ => return Err(mismatch()),
        }
    }
    a.sum_dp = match (a.sum_dp, b.sum_dp) {
        (Some(x), Some(y)) => Some(x.iter().zip(&y).map(|(p, q)| p + q).collect()),
        (None, None) => None,
        _ => return Err(mismatch()),
    };
    a.max_dp = match (a.max_dp, b.max_dp) {
        (Some(x), Some(y)) => Some(x.iter().zip(&y).map(|(p, q)| *p.max(q)).collect()),
        (None, None) => None,
        _ => return Err(mismatch()),
    };
    a.moments = match (a.moments, b.moments) {
        (Some(mut x), Some(y)) => {
            x.sum.extend(y.sum);
            x.m_row.extend(y.m_row);
            x.m_col.extend(y.m_col);
            Some(x)
        }
        (None, None) => None,
        _ => return Err(mismatch()),
    };
    a.n_frames += b.n_frames;
    a.stages.extend(b.stages);
    Ok(a)
}

/// One engine call on the storage of `ds`.
fn engine_pass(ds: &Dataset, req: &ReduceRequest) -> Result<ReduceResult> {
    let n_frames = ds.scan_shape.len();
    let det = ds.detector_shape;
    let result = match &ds.storage {
        Storage::CpuDense(a) => qem_cpu::reduce_dense(a, n_frames, det, req)?,
        Storage::CpuEncoded(e) => qem_cpu::reduce_encoded(e, req)?,
        Storage::CudaDense(a) => qem_cuda::reduce_dense(a, req)?,
        Storage::CudaEncoded(e) => qem_cuda::reduce_encoded(e, req)?,
        Storage::Closed => return Err(closed("detector reduction")),
    };
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
