//! Several products in one engine pass: [`Product`], [`Products`] and [`products`] (detector
//! images, sum/mean/max DP, moments, centre of mass), with their provenance. Called by
//! `qem-cli`'s `products` command, `dpc` and the Python bindings.

use super::geometry::{bounds, disk_json, geometry, sampling_json, Geometry};
use super::target::{Host, Reduced, Target};
use super::{
    annulus_mask, DetectorImage, DetectorKind, DetectorMask, DetectorParams, DiskFit, Moments,
    ReduceRequest,
};
use crate::dataset::Dataset;
use crate::result::ResultProvenance;
use qem_core::{parse_choice, Error, Result};
use serde_json::json;
use std::time::Instant;

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

display_by_name!(Product);

impl std::str::FromStr for Product {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let all: Vec<Product> = (DetectorKind::ALL.into_iter().map(Product::Det))
            .chain([
                Product::SumDp,
                Product::MeanDp,
                Product::MaxDp,
                Product::Moments,
                Product::Com,
            ])
            .collect();
        parse_choice("detector products", "product", s, &all, Product::name)
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
    let wants = |x: Product| which.contains(&x);
    let cached_sum = ds.detector_cache.sum_dp.get();
    let mut pass = products_pass::<Host>(ds, which, p, OP, cached_sum)?;
    let want_sum = wants(Product::SumDp) || wants(Product::MeanDp);
    let sum = match (pass.reduced.sum_dp.take(), cached_sum) {
        (Some(s), _) => {
            let _ = ds.detector_cache.sum_dp.set(s.clone());
            Some(s)
        }
        (None, Some(s)) if want_sum => Some(s.clone()),
        _ => None,
    };
    let f = finish(ds, which, p, &mut pass, sum.as_ref(), OP)?;
    Ok(Products {
        images: pass.images,
        sum_dp: sum.filter(|_| wants(Product::SumDp)),
        mean_dp: f.mean_dp,
        max_dp: pass.reduced.max_dp,
        moments: f.moments,
        com: f.com,
        disk: pass.g.map(|g| g.disk),
        provenance: f.provenance,
    })
}

/// What [`products`] and [`super::products_on_device`] make alike after their pass, on target
/// `T`: the mean DP (of `sum`) and the moments and centred CoM, each when asked, and the
/// provenance of the whole call.
pub(super) struct Finished<T: Target> {
    pub(super) mean_dp: Option<T::MeanDp>,
    pub(super) moments: Option<T::Moments>,
    pub(super) com: Option<crate::dpc::CenterOfMass<T::Field>>,
    pub(super) provenance: ResultProvenance,
}

/// The [`Finished`] part of a products call whose pass is `pass` and whose sum DP (from the
/// pass or the cache) is `sum`; errors carry `op`.
pub(super) fn finish<T: Target>(
    ds: &Dataset,
    which: &[Product],
    p: &DetectorParams,
    pass: &mut ProductsPass<T>,
    sum: Option<&T::SumDp>,
    op: &str,
) -> Result<Finished<T>> {
    let wants = |x: Product| which.contains(&x);
    let mean_dp = match (sum, wants(Product::MeanDp)) {
        (Some(s), true) => Some(T::mean_dp(s, ds.scan_shape.len() as u64, op)?),
        _ => None,
    };
    let moments = pass.reduced.moments.take();
    let com = match (&moments, wants(Product::Com)) {
        (Some(m), true) => Some(com_of::<T>(ds, m, pass.t0, pass.reduce_secs)?),
        _ => None,
    };
    let mut provenance = pass.provenance(ds, which, p);
    if let Some(params) = provenance.params.as_object_mut() {
        params.insert(
            "com_centered".into(),
            json!(wants(Product::Com).then_some(true)),
        );
    }
    Ok(Finished {
        mean_dp,
        moments: moments.filter(|_| wants(Product::Moments)),
        com,
        provenance,
    })
}

/// The part of a products call that [`products`] and [`super::products_on_device`] share, on
/// either [`Target`]: the plan, the request (without the sum DP when `cached_sum` serves it),
/// the one pass (none when nothing needs the frames), the detector images with their
/// provenance, and the numbers the provenance of the whole call needs.
pub(super) struct ProductsPass<T: Target> {
    /// When the call began.
    pub(super) t0: Instant,
    /// The disk and calibration, when a detector image was asked.
    pub(super) g: Option<Geometry>,
    /// One image per detector kind asked.
    pub(super) images: Vec<DetectorImage<T::U64Image>>,
    /// The pass's other arrays (its images are in `images`).
    pub(super) reduced: Reduced<T>,
    /// Seconds of the pass.
    pub(super) reduce_secs: f64,
    /// Whether the sum DP came from the dataset's cache.
    sum_dp_from_cache: bool,
    /// Passes over the frames: 0 or 1.
    passes: u32,
}

/// Check `ds` on target `T`, plan, run the one pass of a products call and make its detector
/// images; errors carry `op`.
pub(super) fn products_pass<T: Target>(
    ds: &Dataset,
    which: &[Product],
    p: &DetectorParams,
    op: &str,
    cached_sum: Option<&Vec<u64>>,
) -> Result<ProductsPass<T>> {
    T::check(ds, op)?;
    let t0 = Instant::now();
    let Plan {
        kinds,
        g,
        masks,
        geom,
    } = plan(ds, which, p, op)?;
    let wants = |x: Product| which.contains(&x);
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
    let mut reduced = if nothing_to_read {
        Reduced::default()
    } else {
        T::pass(ds, &req).map_err(|e| e.with_op(op))?
    };
    let reduce_secs = t1.elapsed().as_secs_f64();

    let mut images = Vec::with_capacity(kinds.len());
    let pass_images = std::mem::take(&mut reduced.images);
    for ((&kind, (lo, hi, mask_pixels)), im) in kinds.iter().zip(geom).zip(pass_images) {
        let Some(image) = T::u64_image(im) else {
            return Err(Error::internal(
                op,
                "the reduction returned a float image for an integer mask",
            ));
        };
        let Some(g) = &g else {
            return Err(Error::internal(op, "a detector image without a disk"));
        };
        let mut im = DetectorImage::new(
            ds,
            kind,
            image,
            (lo, hi, mask_pixels),
            g,
            p,
            (T::PRODUCTS_STAGE, reduce_secs),
        );
        if let Some(params) = im.provenance.params.as_object_mut() {
            params.insert("computed_by".into(), json!("detector.products (one pass)"));
        }
        T::mark(&mut im.provenance, ds);
        images.push(im);
    }
    Ok(ProductsPass {
        t0,
        g,
        images,
        reduced,
        reduce_secs,
        sum_dp_from_cache: want_sum && cached_sum.is_some(),
        passes: u32::from(!nothing_to_read),
    })
}

impl<T: Target> ProductsPass<T> {
    /// The provenance of the whole call: the products asked, every detector, the disk and
    /// calibration, the stage times (the engine's own included) and the wall time up to now.
    pub(super) fn provenance(
        &mut self,
        ds: &Dataset,
        which: &[Product],
        p: &DetectorParams,
    ) -> ResultProvenance {
        let asked: Vec<&str> = which.iter().map(|w| w.name()).collect();
        let images_json: Vec<_> = (self.images.iter())
            .map(|im| im.provenance.params["detector"].clone())
            .collect();
        let g = &self.g;
        let mut provenance = ResultProvenance::new(
            ds,
            "detector.products",
            json!({
                "products": asked,
                "detectors": images_json,
                "disk": g.as_ref().map(|g| disk_json(&g.disk, p, g)),
                "calibration": g.as_ref().map(|g| sampling_json(p, g)),
                "sum_dp_from_cache": self.sum_dp_from_cache,
                "passes": self.passes,
            }),
        );
        T::mark(&mut provenance, ds);
        if let Some(g) = g {
            provenance.stage("disk_fit", g.disk_secs);
        }
        provenance.stage("reduce", self.reduce_secs);
        for st in std::mem::take(&mut self.reduced.stages) {
            provenance.stage(&format!("reduce: {}", st.stage), st.seconds);
        }
        provenance.stage("total (wall)", self.t0.elapsed().as_secs_f64());
        provenance
    }
}

/// What one [`products`] pass needs before it reads a frame: the detector kinds asked (each
/// once, in the order first asked), their geometry (the disk: from the cache, or one sum-DP
/// pass), masks and `(lo, hi, mask_pixels)`.
struct Plan {
    kinds: Vec<DetectorKind>,
    g: Option<Geometry>,
    masks: Vec<DetectorMask>,
    geom: Vec<(f64, f64, usize)>,
}

/// Check `which` and `p` and build the [`Plan`] of a products pass; errors carry `op`.
fn plan(ds: &Dataset, which: &[Product], p: &DetectorParams, op: &str) -> Result<Plan> {
    const OP_NAMES: &str =
        "at least one of bf, abf, adf, haadf, df, annular, sum_dp, mean_dp, max_dp, moments, com";
    p.validate().map_err(|e| e.with_op(op))?;
    if which.is_empty() {
        return Err(Error::invalid(op, "no product asked").with_expected(OP_NAMES));
    }
    let mut kinds: Vec<DetectorKind> = Vec::new();
    for w in which {
        if let Product::Det(k) = w {
            if !kinds.contains(k) {
                kinds.push(*k);
            }
        }
    }
    if kinds.len() > 1 && (p.inner.is_some() || p.outer.is_some()) {
        return Err(
            Error::invalid(op, "inner/outer given with several detectors")
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
    let g = if kinds.is_empty() {
        None
    } else {
        Some(geometry(ds, p).map_err(|e| e.with_op(op))?)
    };
    let mut masks = Vec::with_capacity(kinds.len());
    let mut geom = Vec::with_capacity(kinds.len());
    if let Some(g) = &g {
        for &k in &kinds {
            let (lo, hi) = bounds(k, p, g).map_err(|e| e.with_op(op))?;
            let m = annulus_mask(ds.detector_shape, g.disk.center_px, lo, hi);
            geom.push((lo, hi, m.iter().filter(|&&w| w != 0).count()));
            masks.push(DetectorMask::Int(m));
        }
    }
    Ok(Plan {
        kinds,
        g,
        masks,
        geom,
    })
}

/// The centred CoM of `m` on target `T`, in detector pixels or, when the metadata gives the
/// detector angular sampling (per source pixel, times `det_bin`), in mrad — the rule of
/// [`crate::dpc::center_of_mass`], which the tests hold this to.
fn com_of<T: Target>(
    ds: &Dataset,
    m: &T::Moments,
    t0: Instant,
    reduce_secs: f64,
) -> Result<crate::dpc::CenterOfMass<T::Field>> {
    let det_mrad = ds
        .metadata()
        .angular_sampling_mrad
        .filter(|&(r, c)| r.is_finite() && c.is_finite() && r > 0.0 && c > 0.0);
    let (com_row, com_col, zero_frames) = T::com(m, true, det_mrad)?;
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
    T::mark(&mut provenance, ds);
    provenance.stage("reduce (moments, shared pass)", reduce_secs);
    provenance.stage("total (wall)", t0.elapsed().as_secs_f64());
    Ok(crate::dpc::CenterOfMass {
        com_row,
        com_col,
        scan_shape: ds.scan_shape,
        centered: true,
        zero_frames,
        unit: unit.to_string(),
        provenance,
    })
}
