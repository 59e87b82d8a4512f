//! `qem::calibration`: one rule for the calibration every module uses (docs/calibration.md).
//!
//! * [`Calibration::of`]: the dataset's calibration as typed fields — voltage (kV), probe
//!   semi-angle (mrad), scan step (Å), detector angular sampling (mrad per loaded pixel, after
//!   binning) — each with the source it came from (the file's metadata), `None` where the file
//!   does not say. Arguments given to a module override it; the module records which.
//! * [`disk_edge`]: the BF disk edge of the dataset's mean DP
//!   ([`qem_core::calibration::fit_disk_edge`]: sub-pixel, unbiased for hard and soft edges,
//!   bad pixels rejected, ellipse measured, with its uncertainty).
//! * [`detector_sampling`]: the detector angular sampling a module converts with — the
//!   argument, else the metadata's, else `α / r_edge` with the edge radius of [`disk_edge`].

use crate::dataset::Dataset;
use crate::detector;
use qem_core::calibration::{fit_disk_edge, DiskEdge};
use qem_core::{Error, Result};
use serde_json::json;

/// A calibration value and where it came from.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Sourced<T> {
    /// The value.
    pub value: T,
    /// Where it came from (`"argument"`, `"metadata …"`, `"α / r_edge …"`).
    pub source: String,
}

impl<T> Sourced<T> {
    /// `value`, from `source`.
    pub fn new(value: T, source: impl Into<String>) -> Sourced<T> {
        Sourced {
            value,
            source: source.into(),
        }
    }
}

/// The dataset's calibration, from its metadata.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Calibration {
    /// Accelerating voltage, kV (metadata energy in eV / 1000, else from the wavelength).
    pub voltage_kv: Option<Sourced<f64>>,
    /// Probe-forming semi-angle, mrad.
    pub semiangle_mrad: Option<Sourced<f64>>,
    /// Scan step `(row, col)`, Å.
    pub scan_step_a: Option<Sourced<(f64, f64)>>,
    /// Detector angular sampling `(row, col)`, mrad per loaded pixel (after binning).
    pub det_sampling_mrad: Option<Sourced<(f64, f64)>>,
}

fn positive(v: f64) -> bool {
    v.is_finite() && v > 0.0
}

fn positive_pair((r, c): (f64, f64)) -> bool {
    positive(r) && positive(c)
}

/// The one value of a detector sampling `(r, c)` (mrad/px) that is the same along rows and
/// columns (to 1e-9 relative), which a circular mask in mrad needs; otherwise an
/// `InvalidArgument` error for `op`, `detail`, expecting `expected`.
pub(crate) fn isotropic_sampling(
    op: &str,
    (r, c): (f64, f64),
    detail: &str,
    expected: &str,
) -> Result<f64> {
    if (r - c).abs() > 1e-9 * r.max(c) {
        return Err(Error::invalid(op, detail)
            .with_expected(expected)
            .with_found(format!("({r}, {c}) mrad/px")));
    }
    Ok(r)
}

/// Relativistic voltage (V) of electrons of wavelength `lambda_a` (Å): the inverse of
/// `λ = h / √(2 m e V (1 + e V / (2 m c²)))`.
fn voltage_from_wavelength(lambda_a: f64) -> f64 {
    const H: f64 = 6.626_070_15e-34;
    const M: f64 = 9.109_383_701_5e-31;
    const E: f64 = 1.602_176_634e-19;
    const C: f64 = 299_792_458.0;
    let p = H / (lambda_a * 1e-10); // momentum
                                    // (pc)² = (eV)² + 2 eV mc²  ->  eV = √((pc)² + (mc²)²) − mc².
    let mc2 = M * C * C;
    (((p * C).powi(2) + mc2 * mc2).sqrt() - mc2) / E
}

impl Calibration {
    /// The calibration the metadata of `ds` gives (on the loaded grid: the detector sampling
    /// already includes `det_bin`).
    pub fn of(ds: &Dataset) -> Calibration {
        let md = ds.metadata();
        let voltage_kv = match (md.energy_ev, md.wavelength_a) {
            (Some(e), _) if positive(e) => {
                Some(Sourced::new(e / 1e3, format!("metadata energy_ev {e}")))
            }
            (_, Some(l)) if positive(l) => Some(Sourced::new(
                voltage_from_wavelength(l) / 1e3,
                format!("metadata wavelength_a {l}"),
            )),
            _ => None,
        };
        let semiangle_mrad = md
            .semiangle_mrad
            .filter(|&v| positive(v))
            .map(|v| Sourced::new(v, "metadata semiangle_mrad"));
        let scan_step_a = md
            .scan_step_a
            .filter(|&v| positive_pair(v))
            .map(|v| Sourced::new(v, "metadata scan_step_a"));
        let det_bin = ds.provenance().det_bin.max(1);
        let det_sampling_mrad = md
            .angular_sampling_mrad
            .filter(|&v| positive_pair(v))
            .map(|v| {
                Sourced::new(
                    v,
                    format!("metadata angular_sampling_mrad (loaded grid, det_bin {det_bin})"),
                )
            });
        Calibration {
            voltage_kv,
            semiangle_mrad,
            scan_step_a,
            det_sampling_mrad,
        }
    }
}

/// The BF disk edge of `ds`'s mean DP, fitted once per dataset and cached with its sum DP (a
/// failed fit is not cached: it is tried again, and fails again, on the next call).
pub fn disk_edge(ds: &Dataset) -> Result<DiskEdge> {
    if let Some(e) = ds.detector_cache.disk_edge.get() {
        return Ok(*e);
    }
    let mean = detector::mean_dp(ds).map_err(|e| e.with_op("calibration disk edge"))?;
    let v: Vec<f64> = mean.iter().map(|&x| f64::from(x)).collect();
    let e = fit_disk_edge(&v, ds.detector_shape())?;
    // Another thread may have fitted it meanwhile: the same pattern gives the same edge.
    Ok(*ds.detector_cache.disk_edge.get_or_init(|| e))
}

/// Relative systematic uncertainty of `α / r_edge`, added in quadrature to the edge fit's
/// statistical one: the abTEM validation (docs/calibration.md §3) found errors up to ±0.5 %
/// from how the edge falls on the pixel grid, which the statistical σ does not see (median
/// |error|/σ_stat 3.4); 0.3 % is the spread it supports on sampled disks.
pub const EDGE_SYSTEMATIC_REL: f64 = 0.003;

/// The detector angular sampling (mrad per loaded pixel) a module converts with.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DetectorSampling {
    /// mrad per pixel.
    pub mrad_per_px: f64,
    /// Its standard uncertainty (0 when given or from metadata): from the disk edge, the
    /// statistical part and [`EDGE_SYSTEMATIC_REL`] added in quadrature.
    pub sigma_mrad_per_px: f64,
    /// The statistical part alone (the edge fit's standard error; 0 when given or from
    /// metadata).
    pub sigma_stat_mrad_per_px: f64,
    /// Where it came from.
    pub source: String,
    /// The disk edge it was computed from (when it was).
    pub edge: Option<DiskEdge>,
}

/// The rule every module follows: `given` (an argument) > the metadata's (equal along rows and
/// columns) > `semiangle_mrad / r_edge` with the BF disk edge of [`disk_edge`].
pub fn detector_sampling(
    ds: &Dataset,
    given: Option<f64>,
    semiangle_mrad: Option<f64>,
) -> Result<DetectorSampling> {
    const OP: &str = "calibration detector sampling";
    if let Some(s) = given {
        return Ok(DetectorSampling {
            mrad_per_px: s,
            sigma_mrad_per_px: 0.0,
            sigma_stat_mrad_per_px: 0.0,
            source: "argument det_sampling_mrad".into(),
            edge: None,
        });
    }
    if let Some(s) = Calibration::of(ds).det_sampling_mrad {
        let r = isotropic_sampling(
            OP,
            s.value,
            "the metadata's detector sampling differs along rows and columns",
            "equal row and column sampling, or det_sampling_mrad",
        )?;
        return Ok(DetectorSampling {
            mrad_per_px: r,
            sigma_mrad_per_px: 0.0,
            sigma_stat_mrad_per_px: 0.0,
            source: s.source,
            edge: None,
        });
    }
    let Some(alpha) = semiangle_mrad.filter(|&a| positive(a)) else {
        return Err(Error::invalid(
            OP,
            "no detector sampling: neither given, nor in the metadata, nor a semi-angle to divide by the disk radius",
        )
        .with_expected("det_sampling_mrad, metadata angular_sampling_mrad, or semiangle_mrad")
        .with_found("none of them"));
    };
    let e = disk_edge(ds).map_err(|err| err.with_op(OP))?;
    Ok(edge_sampling(alpha, e))
}

/// `α / r_edge` with its uncertainty (the edge fit's and [`EDGE_SYSTEMATIC_REL`]) and source:
/// rule 3 of [`detector_sampling`], also the detector functions' for `unit="mrad"`.
pub fn edge_sampling(alpha: f64, e: DiskEdge) -> DetectorSampling {
    let s = alpha / e.radius_px;
    let stat = e.radius_sigma_px / e.radius_px;
    DetectorSampling {
        mrad_per_px: s,
        sigma_mrad_per_px: s * stat.hypot(EDGE_SYSTEMATIC_REL),
        sigma_stat_mrad_per_px: s * stat,
        source: format!(
            "semiangle_mrad {alpha} / BF disk edge radius {:.4} ± {:.4} px",
            e.radius_px, e.radius_sigma_px
        ),
        edge: Some(e),
    }
}

/// The disk edge as provenance JSON.
pub fn edge_json(e: &DiskEdge) -> serde_json::Value {
    json!({
        "rule": DiskEdge::RULE,
        "center_px": [e.center_px.0, e.center_px.1],
        "center_sigma_px": [e.center_sigma_px.0, e.center_sigma_px.1],
        "radius_px": e.radius_px,
        "radius_sigma_px": e.radius_sigma_px,
        "radius_50_px": e.radius_50_px,
        "axis_ratio": e.axis_ratio,
        "axis_ratio_sigma": e.axis_ratio_sigma,
        "major_axis_rad": e.major_axis_rad,
        "edge_width_px": e.edge_width_px,
        "edge_model": e.edge_model,
        "model_weights": e.model_weights,
        "model_radii_px": e.model_radii_px,
        "taper_width_px": e.taper_width_px,
        "taper_subsamples": e.taper_subsamples,
        "n_pixels_fit": e.n_pixels_fit,
        "n_pixels_rejected": e.n_pixels_rejected,
        "n_pixels_inside": e.n_pixels_inside,
        "relative_rms": e.relative_rms,
        "edge_complete": e.edge_complete,
    })
}

#[cfg(test)]
mod tests {
    use super::voltage_from_wavelength;

    #[test]
    fn voltage_inverts_the_relativistic_wavelength() {
        for kv in [60.0, 80.0, 200.0, 300.0] {
            let l = qem_cpu::dpc::electron_wavelength_a(kv);
            let v = voltage_from_wavelength(l) / 1e3;
            assert!((v - kv).abs() < 1e-6 * kv, "{kv} kV -> {l} A -> {v}");
        }
        // 300 kV: 0.019687 Å (a textbook value, not ours).
        assert!((qem_cpu::dpc::electron_wavelength_a(300.0) - 0.019687).abs() < 1e-6);
    }
}
