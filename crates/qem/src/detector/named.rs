//! Named virtual detectors (BF, ABF, ADF, HAADF, DF, annular): [`Unit`], [`DetectorKind`],
//! [`DetectorParams`], and [`detector_image`], one image with its provenance. The geometry
//! (disk, calibration, bounds) comes from `geometry`; `products` shares it.

use super::geometry::{bounds, bounds_json, disk_json, geometry, sampling_json, Geometry};
use super::target::{Host, Target};
use super::{annulus_mask, DetectorMask, DiskFit, ReduceRequest};
use crate::dataset::Dataset;
use crate::result::ResultProvenance;
use qem_core::{parse_choice, Error, Result, Shape2};
use serde_json::json;
use std::time::Instant;

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

qem_core::named_choice! {
    /// `"px"` or `"mrad"`.
    Unit, "detector", "unit", { Px => "px", Mrad => "mrad" }
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

display_by_name!(DetectorKind);

impl std::str::FromStr for DetectorKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        parse_choice(
            "detector",
            "detector",
            s,
            &DetectorKind::ALL,
            DetectorKind::name,
        )
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

/// A named virtual detector image. `I` is where the image lives: host memory (`Vec<u64>`, the
/// default) or device memory ([`super::DeviceVec`], from [`super::detector_image_on_device`]);
/// everything else (bounds, disk, provenance) is the same either way.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DetectorImage<I = Vec<u64>> {
    /// Which detector.
    pub kind: DetectorKind,
    /// Exact `u64` sums, one per scan position, row-major `[R_r, R_c]`.
    pub image: I,
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

/// One named virtual detector image: the BF disk (fitted from the cached mean DP unless
/// `center` and `radius` are given), the kind's bounds (or `inner`/`outer` in `unit`), the mask
/// `lo² ≤ |k − c|² ≤ hi²`, and one pass for the exact `u64` image.
pub fn detector_image(
    ds: &Dataset,
    kind: DetectorKind,
    p: &DetectorParams,
) -> Result<DetectorImage> {
    detector_image_in::<Host>(ds, kind, p)
}

/// [`detector_image`] with its image on target `T` (host or device): the same disk, bounds,
/// mask and provenance (a device result's says where its image is).
pub(super) fn detector_image_in<T: Target>(
    ds: &Dataset,
    kind: DetectorKind,
    p: &DetectorParams,
) -> Result<DetectorImage<T::U64Image>> {
    let op = format!("detector {kind}");
    T::check(ds, &op)?;
    p.validate().map_err(|e| e.with_op(&op))?;
    let g = geometry(ds, p).map_err(|e| e.with_op(&op))?;
    let (lo, hi) = bounds(kind, p, &g)?;
    let mask = annulus_mask(ds.detector_shape, g.disk.center_px, lo, hi);
    let mask_pixels = mask.iter().filter(|&&w| w != 0).count();
    let t = Instant::now();
    let req = ReduceRequest {
        masks: vec![DetectorMask::Int(mask)],
        ..Default::default()
    };
    let r = T::pass(ds, &req).map_err(|e| e.with_op(&op))?;
    let secs = t.elapsed().as_secs_f64();
    let image = (r.images.into_iter().next())
        .and_then(T::u64_image)
        .ok_or_else(|| Error::internal(&op, "the reduction returned no integer image"))?;
    let mut im = DetectorImage::new(
        ds,
        kind,
        image,
        (lo, hi, mask_pixels),
        &g,
        p,
        (T::IMAGE_STAGE, secs),
    );
    T::mark(&mut im.provenance, ds);
    Ok(im)
}

impl<I> DetectorImage<I> {
    /// The `image` of detector `kind`, whose bounds `(lo, hi)` px (`mask_pixels` in the mask)
    /// were made from the disk of `g`, with its provenance: the detector, disk and calibration
    /// records as `params` (an object, to which a caller may add), the disk fit's time and the
    /// reduction's (`reduce`: stage name, seconds).
    pub(super) fn new(
        ds: &Dataset,
        kind: DetectorKind,
        image: I,
        (lo, hi, mask_pixels): (f64, f64, usize),
        g: &Geometry,
        p: &DetectorParams,
        reduce: (&str, f64),
    ) -> DetectorImage<I> {
        let mut provenance = ResultProvenance::new(
            ds,
            &format!("detector.{kind}"),
            json!({
                "detector": bounds_json(kind, lo, hi, mask_pixels, g),
                "disk": disk_json(&g.disk, p, g),
                "calibration": sampling_json(p, g),
            }),
        );
        provenance.stage("disk_fit", g.disk_secs);
        provenance.stage(reduce.0, reduce.1);
        DetectorImage {
            kind,
            image,
            scan_shape: ds.scan_shape,
            inner_px: lo,
            outer_px: hi,
            disk: g.disk,
            mask_pixels,
            provenance,
        }
    }
}
