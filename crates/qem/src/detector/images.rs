//! Virtual images and moments from detector masks, the BF disk fit from the mean DP and the
//! annulus mask every named detector is built from. Called by `named`, `products`, `ssb`,
//! `dpc` and the Python bindings.

use super::target::{one_product, Host, Reduced, Target};
use super::{mean_dp, DetectorMask, Moments, ReduceRequest, VirtualImage};
use crate::dataset::Dataset;
use qem_core::{Result, Shape2};

/// The virtual image `V[R] = Σ_k w[k] · I[R, k]` of one mask over every frame: exact `u64` for
/// an integer (or bool) mask, `f64` for a float mask. A mask of the wrong size is an error
/// naming both sizes.
pub fn virtual_image(ds: &Dataset, mask: &DetectorMask) -> Result<VirtualImage> {
    virtual_image_in::<Host>(ds, mask)
}

/// [`virtual_image`] with its image on target `T` (host or device).
pub(super) fn virtual_image_in<T: Target>(ds: &Dataset, mask: &DetectorMask) -> Result<T::Image> {
    let req = ReduceRequest {
        masks: vec![mask.clone()],
        ..Default::default()
    };
    let first = |r: Reduced<T>| r.images.into_iter().next();
    one_product(ds, "detector virtual_image", &req, first, "image")
}

/// Exact per-frame moments over the whole detector: `S = Σ I`, `m_row = Σ k_r I`,
/// `m_col = Σ k_c I` (`u64`, one value per scan position).
pub fn moments(ds: &Dataset) -> Result<Moments> {
    moments_in::<Host>(ds)
}

/// [`moments`] with its arrays on target `T` (host or device).
pub(crate) fn moments_in<T: Target>(ds: &Dataset) -> Result<T::Moments> {
    let req = ReduceRequest {
        moments: true,
        ..Default::default()
    };
    one_product(
        ds,
        "detector moments",
        &req,
        |r: Reduced<T>| r.moments,
        "moments",
    )
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
