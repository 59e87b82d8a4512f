//! The geometry of a named detector: the angular sampling (argument, metadata or semi-angle
//! over the disk radius), the BF disk (fitted or given), the bounds in pixels, and the
//! provenance JSON of each. Used by [`detector_image`](super::detector_image) and
//! [`products`](super::products).

use super::{fit_disk, DetectorKind, DetectorParams, DiskFit, Unit};
use crate::dataset::Dataset;
use qem_core::{Error, ErrorKind, Result};
use serde_json::json;
use std::time::Instant;

/// The operation named in the unit conversion's errors.
const OP: &str = "detector (unit mrad)";

/// Detector angular sampling (mrad per loaded pixel) and where it came from.
#[derive(Debug, Clone)]
pub(super) struct Sampling {
    pub(super) mrad_per_px: f64,
    pub(super) source: String,
}

/// The sampling `unit = mrad` converts with: the argument, else the metadata's (per loaded
/// pixel: [`qem_core::Metadata::for_loaded_grid`] has applied `det_bin`; must be the same along
/// rows and columns, since a mask is a circle in pixels), else the semi-angle (argument, else
/// metadata) over the BF disk radius — the radius the user gave, else the disk *edge*
/// ([`crate::calibration::disk_edge`], the rule SSB follows, fitted once per dataset) when
/// `fit_edge`; a pattern whose edge the fit refuses (an `InvalidArgument`: too small, flat, no
/// convergence) falls back to the threshold fit's equal-area radius `threshold_radius_px`, and
/// the source says so. Without `fit_edge` (a
/// detector in pixels only records the sampling) the edge is not fitted for it: the semi-angle
/// rule then applies only to a given radius or an edge already fitted.
pub(super) fn sampling(
    ds: &Dataset,
    p: &DetectorParams,
    threshold_radius_px: f64,
    fit_edge: bool,
) -> Result<Sampling> {
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
        let r = crate::calibration::isotropic_sampling(
            OP,
            (r, c),
            "the detector angular sampling differs along rows and columns; a circular mask in mrad is an ellipse in pixels",
            "equal row and column sampling, or det_sampling_mrad, or unit px",
        )?;
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
        Some((s, from)) if s.is_finite() && s > 0.0 => {
            Ok(match semi_angle_radius(ds, p.radius, threshold_radius_px, fit_edge)? {
                DiskRadius::Edge(e) => {
                    let d = crate::calibration::edge_sampling(s, *e);
                    Sampling {
                        mrad_per_px: d.mrad_per_px,
                        source: format!("{} (semi-angle: {from})", d.source),
                    }
                }
                DiskRadius::Px(r, what) => Sampling {
                    mrad_per_px: s / r,
                    source: format!("semiangle_mrad ({from}) {s} / {what}"),
                },
            })
        }
        _ => Err(Error::invalid(
            OP,
            "cannot convert mrad to pixels: no detector angular sampling and no convergence semi-angle",
        )
        .with_expected("det_sampling_mrad, metadata angular_sampling_mrad, or semiangle_mrad")
        .with_found("none of them")),
    }
}

/// The BF disk radius the semi-angle rule divides by: the fitted edge (its sampling comes from
/// [`crate::calibration::edge_sampling`]), or a radius in pixels with its description.
enum DiskRadius {
    Edge(Box<qem_core::calibration::DiskEdge>),
    Px(f64, String),
}

/// [`sampling`]'s radius: the given one, else the disk edge (cached on the dataset, fitted here
/// only when `fit_edge`), else — where the edge fit refuses the pattern — the threshold radius.
fn semi_angle_radius(
    ds: &Dataset,
    given: Option<f64>,
    threshold_radius_px: f64,
    fit_edge: bool,
) -> Result<DiskRadius> {
    if let Some(r) = given {
        return Ok(DiskRadius::Px(r, format!("the given disk radius {r} px")));
    }
    let edge =
        if fit_edge {
            crate::calibration::disk_edge(ds)
        } else {
            match ds.detector_cache.disk_edge.get() {
                Some(e) => Ok(*e),
                None => return Err(Error::invalid(
                    OP,
                    "the semi-angle rule needs the disk edge, not fitted for a detector in pixels",
                )),
            }
        };
    match edge {
        Ok(e) => Ok(DiskRadius::Edge(Box::new(e))),
        // The fit's refusals (too small, flat, no convergence) fall back; anything else (a
        // closed dataset, a lost device) is the caller's error.
        Err(err) if err.kind != ErrorKind::InvalidArgument => Err(err.with_op(OP)),
        Err(err) => Ok(DiskRadius::Px(
            threshold_radius_px,
            format!("threshold disk radius {threshold_radius_px} px (no disk edge: {err})"),
        )),
    }
}

/// Everything a named detector needs beyond its kind: the disk and the unit conversion.
#[derive(Debug, Clone)]
pub(super) struct Geometry {
    pub(super) disk: DiskFit,
    /// Known angular sampling (required for `Unit::Mrad`, recorded when known otherwise).
    pub(super) sampling: Option<Sampling>,
    /// Whether the sum DP behind the fit was served from the cache.
    pub(super) disk_cached: bool,
    pub(super) disk_secs: f64,
}

pub(super) fn geometry(ds: &Dataset, p: &DetectorParams) -> Result<Geometry> {
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
        Unit::Mrad => Some(sampling(ds, p, disk.radius_px, true)?),
        Unit::Px => sampling(ds, p, disk.radius_px, false).ok(),
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
pub(super) fn bounds(kind: DetectorKind, p: &DetectorParams, g: &Geometry) -> Result<(f64, f64)> {
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

pub(super) fn disk_json(d: &DiskFit, p: &DetectorParams, g: &Geometry) -> serde_json::Value {
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

pub(super) fn bounds_json(
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

pub(super) fn sampling_json(p: &DetectorParams, g: &Geometry) -> serde_json::Value {
    json!({
        "unit": p.unit.name(),
        "mrad_per_px": g.sampling.as_ref().map(|s| s.mrad_per_px),
        "sampling_source": g.sampling.as_ref().map(|s| s.source.clone()),
    })
}
