//! Detector calibration from the bright-field disk edge (docs/calibration.md).
//!
//! The detector angular sampling of a STEM acquisition is `α / r_BF`: the BF disk's edge is the
//! image of the probe-forming aperture's edge. [`fit_disk_edge`] measures `r_BF` to a small
//! fraction of a pixel from the mean diffraction pattern, for hard (coherent, pixel-integrated)
//! edges, soft ones (finite source, partially coherent, detector blur) and abTEM's
//! amplitude-tapered aperture, and for an elliptical disk (projector distortion):
//!
//! * geometry: the elliptical radius `ρ(k) = |D⁻¹ (k − c)|`, `D = exp(η_c σ_z + η_s σ_x)`
//!   symmetric with `det D = 1` (so `R` is the geometric-mean radius `√(ab)` and `D⁻¹` maps
//!   the ellipse to a circle of radius `R`); `I(k) = B + (P − B) f(ρ(k) − R)` between the
//!   plateau `P` and the background `B` just outside;
//! * three edge profiles `f` ([`EdgeModel`]), because an aperture edge is not one shape: a
//!   **logistic** `1/(1 + exp(x/w))` (an intensity blur: finite source, partial coherence,
//!   detector PSF; `R` at 50 % intensity); a **pixel step**, a hard edge integrated over the
//!   square pixel and blurred by a Gaussian (a pixel-integrating or binned detector; `R` at
//!   the edge); an **amplitude taper**, `A = clip(½ − x/τ, 0, 1)`, intensity `A²`, blurred
//!   by a Gaussian (abTEM's default soft aperture, sampled at pixel centres; `R` where
//!   `A = ½`, which is 0.21 τ *outside* the 50 %-intensity point);
//! * the band around the edge and the bad pixels come from the logistic fit
//!   (Levenberg–Marquardt on the pixels near the edge, from the threshold disk of a
//!   3×3-median-filtered pattern, refitted with pixels whose residual exceeds 8 robust
//!   standard deviations dropped); the other two profiles are fitted to the same pixels
//!   from its geometry (a few starts of their shape parameters);
//! * the taper is fitted three times: sampled at the pixel centre, and as the mean of 2×2 and
//!   3×3 points per pixel (a point-sampled simulation binned 2× or 3×: its one-pixel taper is
//!   then ½ or ⅓ pixel wide and each pixel sums b² samples); a taper with `τ → 0` on the
//!   right sub-grid is the exact model of a binned point-sampled *hard* edge;
//! * model average: Akaike weights `exp(−ΔAIC/2)` over all fits, with the residual variance of
//!   the best one as the noise scale; a taper fit counts as a taper only when it is one
//!   (`τ ≥ 0.15` px) and *resolved* (its blur at most `τ/5`); otherwise its weight goes to
//!   the better intensity edge (logistic or pixel step): an unresolved taper is an intensity
//!   edge shifted by `τ/6` that no profile can tell from a smaller hard disk, and `τ → 0` is a
//!   hard edge;
//! * each profile's radius adds back the curvature shift `s²/(2R)` of its blur's 50 %
//!   contour (the logistic of width `w` matches a Gaussian of `s = 1.70 w`; the pixel box
//!   adds `1/12` px² per axis);
//! * uncertainty: per profile the larger of the least-squares standard error (scaled by the
//!   residual variance, so misfit counts) and a delete-one-sector jackknife over 8 azimuthal
//!   sectors (structure that is not azimuthally uniform, e.g. Bragg disks, counts); then
//!   `σ² = Σ w_i (σ_i² + (R_i − R̄)²)`, so profiles that disagree and fit alike widen it.

use crate::error::{Error, Result};
use crate::geometry::Shape2;
use rayon::prelude::*;

mod lm;
mod profile;

use lm::{inverse, levenberg_marquardt, sum_sq, Px};
use profile::{inv_distortion, model};

const OP: &str = "calibration disk edge";

/// The edge profile a fit assumes; `R` is where each puts the aperture edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EdgeModel {
    /// `1 / (1 + exp((ρ − R)/w))`: an intensity blur (finite source, detector PSF); `R` is
    /// the 50 % point.
    Logistic,
    /// A hard edge integrated over each square pixel and blurred by a Gaussian of σ `s`: a
    /// pixel-integrating detector, or a binned one; `R` is the edge.
    PixelStep,
    /// A point-sampled amplitude taper (amplitude falling linearly from 1 to 0 over `τ`,
    /// ½ at `R`) squared, blurred by a Gaussian of σ `s`: abTEM's default soft aperture.
    AmplitudeTaper,
}

/// One number per [`EdgeModel`].
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct PerModel {
    /// [`EdgeModel::Logistic`].
    pub logistic: f64,
    /// [`EdgeModel::PixelStep`].
    pub pixel_step: f64,
    /// [`EdgeModel::AmplitudeTaper`].
    pub amplitude_taper: f64,
}

impl PerModel {
    fn get(&self, m: EdgeModel) -> f64 {
        match m {
            EdgeModel::Logistic => self.logistic,
            EdgeModel::PixelStep => self.pixel_step,
            EdgeModel::AmplitudeTaper => self.amplitude_taper,
        }
    }

    fn set(&mut self, m: EdgeModel, v: f64) {
        match m {
            EdgeModel::Logistic => self.logistic = v,
            EdgeModel::PixelStep => self.pixel_step = v,
            EdgeModel::AmplitudeTaper => self.amplitude_taper = v,
        }
    }
}

/// The BF disk edge of a mean diffraction pattern ([`fit_disk_edge`]).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DiskEdge {
    /// Centre `(row, col)`, detector pixels.
    pub center_px: (f64, f64),
    /// Standard uncertainty of the centre, pixels.
    pub center_sigma_px: (f64, f64),
    /// Radius of the aperture edge, pixels: the geometric mean `√(ab)` of the semi-axes of an
    /// elliptical disk, corrected for the curvature shift of a blurred edge, averaged over the
    /// edge models with their weights ([`DiskEdge::model_weights`]).
    pub radius_px: f64,
    /// Standard uncertainty of `radius_px`, pixels: each model's, and the spread between the
    /// models, by their weights.
    pub radius_sigma_px: f64,
    /// Radius of the logistic fit's 50 % intensity contour, pixels (before the curvature term
    /// and the model average).
    pub radius_50_px: f64,
    /// Major over minor semi-axis (≥ 1; 1 = circular).
    pub axis_ratio: f64,
    /// Standard uncertainty of `axis_ratio`.
    pub axis_ratio_sigma: f64,
    /// Direction of the major axis, radians from the detector row axis toward the column axis,
    /// in `(−π/2, π/2]`.
    pub major_axis_rad: f64,
    /// `D⁻¹` (row-major 2×2): `D⁻¹ (k − c)` is the offset of pixel `k` in the frame where the
    /// disk is a circle of radius `radius_px` (the identity for a circular disk).
    pub to_circular: [[f64; 2]; 2],
    /// Logistic edge width `w`, pixels (10–90 % rise = 4.39 w).
    pub edge_width_px: f64,
    /// The edge model with the largest weight (the centre and ellipse are its).
    pub edge_model: EdgeModel,
    /// Akaike weights of the edge models (sum 1; the taper's is 0 when its taper is not
    /// resolved, see the module docs).
    pub model_weights: PerModel,
    /// Each model's curvature-corrected radius, pixels.
    pub model_radii_px: PerModel,
    /// The amplitude-taper model's fitted taper width `τ`, pixels (0 when not resolved).
    pub taper_width_px: f64,
    /// The sub-grid that taper was sampled on (`n × n` points per pixel: a point-sampled grid
    /// binned `n×`; 0 when no taper is resolved).
    pub taper_subsamples: usize,
    /// Fitted plateau inside the edge (units of the input pattern).
    pub plateau: f64,
    /// Fitted level just outside the edge.
    pub background: f64,
    /// Pixels the final fit used.
    pub n_pixels_fit: usize,
    /// Pixels dropped as outliers (bad pixels).
    pub n_pixels_rejected: usize,
    /// Pixels inside the fitted edge (`ρ ≤ R`) on the detector.
    pub n_pixels_inside: usize,
    /// Residual RMS over the plateau-to-background step (0 = perfect model), of the chosen
    /// model.
    pub relative_rms: f64,
    /// Whether the whole edge lies on the detector (some pixel beyond `R + 2w` in every
    /// direction); a disk cut by the detector border is measured from the part that is there.
    pub edge_complete: bool,
}

impl DiskEdge {
    /// The offset of detector position `k` from the centre in the frame where the disk is a
    /// circle ([`DiskEdge::to_circular`] applied to `k − c`).
    pub fn circular_offset(&self, k: (f64, f64)) -> (f64, f64) {
        let (dr, dc) = (k.0 - self.center_px.0, k.1 - self.center_px.1);
        let m = &self.to_circular;
        (m[0][0] * dr + m[0][1] * dc, m[1][0] * dr + m[1][1] * dc)
    }

    /// The rule, for provenance.
    pub const RULE: &'static str = "edge fit to the mean DP (elliptical, bad pixels rejected \
        at 8 robust sigma) with three profiles: logistic intensity edge, pixel-integrated \
        blurred step, amplitude taper point-sampled on 1x1, 2x2 or 3x3 points per pixel (a \
        taper only when >= 0.15 px and resolved: blur <= taper / 5; else its weight goes to \
        the intensity edge); radius = Akaike-weighted mean of their edges plus the curvature \
        term s^2/(2R), sigma includes the spread between the models";
}

/// The Gaussian σ whose edge profile the logistic of width `w` matches best is `1.70 w` (the
/// classic logit–probit scale).
const LOGISTIC_TO_GAUSS: f64 = 1.70;

/// The amplitude taper counts only when its blur is at most this fraction of its width: a
/// taper under a wider blur is an intensity edge shifted by `τ/6`, which no profile can tell
/// from a smaller hard disk (docs/calibration.md §2).
const TAPER_RESOLVED: f64 = 0.2;

/// A fitted taper narrower than this (pixels) is a hard edge, not a taper.
const TAPER_MIN_PX: f64 = 0.15;

/// The taper is also fitted sampled on sub-grids up to this size (binning of a point-sampled
/// grid).
const MAX_SUB: usize = 3;

/// Parameter vector: centre row, centre col, R, η_c, η_s, ln width (`w` of the logistic, `s`
/// of the others), P, B, ln τ (the taper only).
const NP: usize = 9;

impl EdgeModel {
    /// Parameters fitted (the first `n` of the vector).
    fn n_params(self) -> usize {
        match self {
            EdgeModel::AmplitudeTaper => 9,
            _ => 8,
        }
    }
}

/// An edge model and how each pixel samples it: the mean of `sub × sub` points on the pixel's
/// sub-grid (1 = the pixel centre). A detector binned `b×` from a point-sampled grid (a
/// simulation) samples `b × b` points per pixel; only the taper is evaluated that way.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Profile {
    model: EdgeModel,
    sub: usize,
}

impl Profile {
    const fn of(model: EdgeModel) -> Profile {
        Profile { model, sub: 1 }
    }
}

/// 3×3 median of `v` (edge pixels use the neighbours that exist).
fn median3(v: &[f64], s: Shape2) -> Vec<f64> {
    let mut out = vec![0.0; v.len()];
    let mut nb = Vec::with_capacity(9);
    for i in 0..s.rows {
        for j in 0..s.cols {
            nb.clear();
            for di in i.saturating_sub(1)..(i + 2).min(s.rows) {
                for dj in j.saturating_sub(1)..(j + 2).min(s.cols) {
                    nb.push(v[di * s.cols + dj]);
                }
            }
            nb.sort_by(f64::total_cmp);
            out[i * s.cols + j] = nb[nb.len() / 2];
        }
    }
    out
}

/// The start: the half-maximum disk of the median-filtered pattern (centroid, equal area).
fn start(values: &[f64], s: Shape2) -> Result<[f64; NP]> {
    let med = median3(values, s);
    let mut sorted = med.clone();
    sorted.sort_by(f64::total_cmp);
    let lo = crate::stats::percentile_sorted(&sorted, 2.0);
    let hi = sorted[sorted.len() - 1];
    if hi.partial_cmp(&lo) != Some(std::cmp::Ordering::Greater) {
        return Err(
            Error::invalid(OP, "the mean diffraction pattern is flat: no BF disk")
                .with_expected("a bright disk on a darker background")
                .with_found(format!("values from {lo} to {hi}")),
        );
    }
    let t = 0.5 * (lo + hi);
    let (mut n, mut sr, mut sc) = (0usize, 0.0, 0.0);
    for (k, &m) in med.iter().enumerate() {
        if m > t {
            n += 1;
            sr += (k / s.cols) as f64;
            sc += (k % s.cols) as f64;
        }
    }
    if n < 12 {
        return Err(
            Error::invalid(OP, "the BF disk is too small to measure its edge")
                .with_expected("a disk of at least 12 pixels (radius >= 2 px)")
                .with_found(format!("{n} pixels above half maximum")),
        );
    }
    let r0 = (n as f64 / std::f64::consts::PI).sqrt();
    // Plateau: median inside 0.7 R0; background: median of the ring 1.2–1.5 R0.
    let (c0r, c0c) = (sr / n as f64, sc / n as f64);
    let (mut inside, mut outside) = (Vec::new(), Vec::new());
    for (k, &m) in med.iter().enumerate() {
        let d = ((k / s.cols) as f64 - c0r).hypot((k % s.cols) as f64 - c0c);
        if d < 0.7 * r0 {
            inside.push(m);
        } else if d > 1.2 * r0 && d < 1.5 * r0 + 2.0 {
            outside.push(m);
        }
    }
    let p0 = crate::stats::percentile(&inside, 50.0);
    let b0 = if outside.is_empty() {
        lo
    } else {
        crate::stats::percentile(&outside, 50.0)
    };
    Ok([c0r, c0c, r0, 0.0, 0.0, (0.7f64).ln(), p0, b0, 0.0])
}

/// Pixels within `half` of the ellipse `p` (by elliptical radius), minus `rejected`.
fn band(values: &[f64], s: Shape2, p: &[f64; NP], half: f64, rejected: &[bool]) -> Vec<Px> {
    let m = inv_distortion(p[3], p[4]);
    let mut out = Vec::new();
    for i in 0..s.rows {
        for j in 0..s.cols {
            let k = i * s.cols + j;
            if rejected[k] {
                continue;
            }
            let (dr, dc) = (i as f64 - p[0], j as f64 - p[1]);
            let rho = (m[0][0] * dr + m[0][1] * dc).hypot(m[1][0] * dr + m[1][1] * dc);
            if (rho - p[2]).abs() <= half {
                out.push(Px {
                    r: i as f64,
                    c: j as f64,
                    v: values[k],
                });
            }
        }
    }
    out
}

/// The BF disk edge of the mean diffraction pattern `values` (row-major, `shape`; any
/// non-negative scale: counts, counts per frame, normalised intensity). See the module docs.
///
/// Errors: a size mismatch, a non-finite value, a flat pattern, a disk under 12 pixels, or a
/// fit that does not converge to a disk on the detector.
pub fn fit_disk_edge(values: &[f64], shape: Shape2) -> Result<DiskEdge> {
    if values.len() != shape.len() || shape.rows < 5 || shape.cols < 5 {
        return Err(
            Error::invalid(OP, "the pattern does not match its shape (at least 5 x 5)")
                .with_expected(format!("{} values", shape.len()))
                .with_found(format!("{} values", values.len())),
        );
    }
    if let Some(k) = values.iter().position(|v| !v.is_finite()) {
        return Err(Error::invalid(OP, "the pattern holds a non-finite value")
            .with_expected("finite values")
            .with_found(format!(
                "{} at pixel ({}, {})",
                values[k],
                k / shape.cols,
                k % shape.cols
            )));
    }
    let mut p = start(values, shape)?;
    let mut rejected = vec![false; values.len()];
    let mut n_rejected = 0usize;
    let mut px = Vec::new();
    let mut jtj = [[0.0; NP]; NP];
    // The band and the bad pixels from the logistic fit (robust, one shape parameter).
    for round in 0..4 {
        let w = p[5].exp();
        let half = (0.3 * p[2]).clamp(4.0, 10.0).max(5.0 * w);
        px = band(values, shape, &p, half, &rejected);
        if px.len() < 2 * NP {
            return Err(Error::invalid(OP, "too few pixels around the disk edge")
                .with_expected("a disk edge on the detector")
                .with_found(format!("{} pixels", px.len())));
        }
        (p, jtj) = levenberg_marquardt(Profile::of(EdgeModel::Logistic), p, &px);
        // Outliers (bad pixels) against a robust scale of the residuals.
        let mut res: Vec<f64> = px
            .iter()
            .map(|q| (q.v - model(Profile::of(EdgeModel::Logistic), &p, q.r, q.c)).abs())
            .collect();
        res.sort_by(f64::total_cmp);
        let scale = 1.4826 * crate::stats::percentile_sorted(&res, 50.0);
        let step = (p[6] - p[7]).abs();
        // At least 10 % of the step: a noise-free pattern's tiny residuals are model misfit
        // (a pixel-integrated hard edge is not exactly logistic), not bad pixels.
        let limit = (8.0 * scale).max(0.1 * step);
        let mut new = 0;
        for q in &px {
            if (q.v - model(Profile::of(EdgeModel::Logistic), &p, q.r, q.c)).abs() > limit {
                rejected[q.r as usize * shape.cols + q.c as usize] = true;
                new += 1;
            }
        }
        n_rejected += new;
        if new == 0 && round > 0 {
            break;
        }
    }
    check_disk(shape, &p)?;
    let logistic = Fit::new(Profile::of(EdgeModel::Logistic), p, jtj, &px);
    // The other profiles on the same pixels, from the logistic's geometry; the lowest cost of
    // a few starts of the shape parameters (the taper's cost has local minima). Every start is
    // an independent fit: they run in parallel and are collected in this order, so the result
    // is the serial one.
    let w = p[5].exp();
    let mut starts: Vec<(Profile, f64, f64)> =
        [(0.05, 1.0), ((LOGISTIC_TO_GAUSS * w).max(0.05), 1.0)]
            .iter()
            .map(|&(s, tau)| (Profile::of(EdgeModel::PixelStep), s, tau))
            .collect();
    // The taper point-sampled at the pixel centre, and on 2×2 and 3×3 sub-grids (a
    // simulation's grid binned 2× or 3×: its one-pixel taper is then 1/b pixel wide).
    for sub in 1..=MAX_SUB {
        let tau = 1.0 / sub as f64;
        let taper = Profile {
            model: EdgeModel::AmplitudeTaper,
            sub,
        };
        // Fewer starts on the sub-grids (each costs sub² evaluations per pixel).
        let taper_starts: &[(f64, f64)] = if sub == 1 {
            &[
                (0.02, tau),
                (0.02, 0.05),
                (0.3, 0.3),
                (0.05, (4.0 * w).max(0.1)),
            ]
        } else {
            &[(0.02, tau), (0.02, 0.05)]
        };
        starts.extend(taper_starts.iter().map(|&(s, tau)| (taper, s, tau)));
    }
    let tried: Vec<Fit> = starts
        .par_iter()
        .map(|&(prof, s, tau)| {
            let mut q = p;
            q[5] = s.ln();
            q[8] = tau.ln();
            let (q, jtj) = levenberg_marquardt(prof, q, &px);
            Fit::new(prof, q, jtj, &px)
        })
        .collect();
    let mut fits: Vec<Fit> = vec![logistic];
    // The best start of each profile, in the order the profiles were listed.
    for (i, f) in tried.iter().enumerate() {
        if i > 0 && tried[i - 1].shape == f.shape {
            continue;
        }
        let best = tried[i..]
            .iter()
            .take_while(|g| g.shape == f.shape)
            .min_by(|a, b| a.ss.total_cmp(&b.ss));
        fits.extend(best.copied());
    }
    fits.retain(|f| check_disk(shape, &f.p).is_ok() && f.ss.is_finite());
    finish(shape, &fits, &logistic, &px, n_rejected)
}

/// One edge model fitted to the band.
#[derive(Clone, Copy)]
struct Fit {
    shape: Profile,
    p: [f64; NP],
    jtj: [[f64; NP]; NP],
    ss: f64,
}

impl Fit {
    fn new(shape: Profile, p: [f64; NP], jtj: [[f64; NP]; NP], px: &[Px]) -> Fit {
        Fit {
            shape,
            p,
            jtj,
            ss: sum_sq(shape, &p, px),
        }
    }

    /// The blur σ of the profile (the logistic's Gaussian equivalent; the pixel box's
    /// variance 1/12 per axis added for the pixel step).
    fn blur_var(&self) -> f64 {
        let w = self.p[5].exp();
        match self.shape.model {
            EdgeModel::Logistic => (LOGISTIC_TO_GAUSS * w).powi(2),
            EdgeModel::PixelStep => w * w + 1.0 / 12.0,
            EdgeModel::AmplitudeTaper => w * w,
        }
    }

    /// The edge radius with the curvature term `s²/(2R)` added back.
    fn radius(&self) -> f64 {
        self.p[2] + self.blur_var() / (2.0 * self.p[2])
    }

    /// Whether the profile's own edge counts: the taper only when it is a taper (at least
    /// [`TAPER_MIN_PX`]) and resolved; otherwise it is an intensity edge (a taper under a wider
    /// blur) or a hard one (τ → 0), and its weight goes to the intensity-edge answer.
    fn admissible(&self) -> bool {
        match self.shape.model {
            EdgeModel::AmplitudeTaper => {
                let tau = self.p[8].exp();
                tau >= TAPER_MIN_PX && self.p[5].exp() <= TAPER_RESOLVED * tau
            }
            _ => true,
        }
    }
}

/// A converged fit must be a bright disk whose centre is within a radius of the detector.
fn check_disk(shape: Shape2, p: &[f64; NP]) -> Result<()> {
    let step = p[6] - p[7];
    let inside_detector = p[0] > -p[2]
        && p[0] < shape.rows as f64 + p[2]
        && p[1] > -p[2]
        && p[1] < shape.cols as f64 + p[2];
    if step > 0.0 && p[2] > 1.0 && inside_detector && p.iter().all(|v| v.is_finite()) {
        return Ok(());
    }
    Err(
        Error::invalid(OP, "the edge fit did not converge to a bright disk")
            .with_expected("a bright disk on a darker background")
            .with_found(format!(
                "radius {:.3} px, centre ({:.2}, {:.2}), plateau - background {:.4}",
                p[2], p[0], p[1], step
            )),
    )
}

fn finish(
    shape: Shape2,
    fits: &[Fit],
    logistic: &Fit,
    px: &[Px],
    n_rejected: usize,
) -> Result<DiskEdge> {
    let n = px.len();
    // Akaike weights with the residual variance of the best-fitting profile as the noise
    // scale (misfit that no profile explains, e.g. Bragg disks, counts as noise and flattens
    // them).
    let min_ss = fits.iter().map(|f| f.ss).fold(f64::INFINITY, f64::min);
    let s2_all = (min_ss / n.saturating_sub(NP).max(1) as f64).max(1e-300);
    let aic: Vec<f64> = fits
        .iter()
        .map(|f| f.ss / s2_all + 2.0 * f.shape.model.n_params() as f64)
        .collect();
    let amin = aic.iter().copied().fold(f64::INFINITY, f64::min);
    let raw: Vec<f64> = aic.iter().map(|a| (-(a - amin) / 2.0).exp()).collect();
    let total: f64 = raw.iter().sum();
    // A taper that is not admissible votes for the better intensity edge.
    let intensity = fits
        .iter()
        .filter(|f| f.shape.model != EdgeModel::AmplitudeTaper)
        .min_by(|a, b| a.ss.total_cmp(&b.ss))
        .copied()
        .unwrap_or(*logistic);
    let mut answers: Vec<(Fit, f64)> = Vec::new();
    for (f, r) in fits.iter().zip(&raw) {
        let f = if f.admissible() { *f } else { intensity };
        match answers.iter_mut().find(|(g, _)| g.shape == f.shape) {
            Some((_, w)) => *w += r / total,
            None => answers.push((f, r / total)),
        }
    }
    let best = answers
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(f, _)| *f)
        .unwrap_or(*logistic);
    let mut model_weights = PerModel::default();
    let mut model_radii = PerModel::default();
    let mut radius = 0.0;
    let mut answers_sigma = Vec::with_capacity(answers.len());
    for (f, wt) in &answers {
        model_weights.set(f.shape.model, model_weights.get(f.shape.model) + wt);
        let sigma = if *wt > 1e-3 {
            let k = f.shape.model.n_params();
            let s2 = f.ss / n.saturating_sub(k).max(1) as f64;
            let cov = inverse(&f.jtj, k).unwrap_or([[f64::NAN; NP]; NP]);
            let se = (cov[2][2] * s2).max(0.0).sqrt();
            let jack = jackknife_radius(f.shape, &f.p, px);
            if jack.is_finite() {
                se.max(jack)
            } else {
                se
            }
        } else {
            0.0
        };
        answers_sigma.push(sigma);
        radius += wt * f.radius();
    }
    for f in fits {
        if f.shape.model != EdgeModel::AmplitudeTaper || f.admissible() {
            let m = f.shape.model;
            let better = answers
                .iter()
                .filter(|(g, _)| g.shape.model == m)
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .is_some_and(|(g, _)| g.shape == f.shape);
            if better || model_radii.get(m) == 0.0 {
                model_radii.set(m, f.radius());
            }
        }
    }
    let var: f64 = answers
        .iter()
        .zip(&answers_sigma)
        .map(|((f, w), s)| w * (s * s + (f.radius() - radius).powi(2)))
        .sum();
    let taper_fit = answers
        .iter()
        .filter(|(f, _)| f.shape.model == EdgeModel::AmplitudeTaper)
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(f, _)| *f);
    let p = best.p;
    let k = best.shape.model.n_params();
    let s2 = best.ss / n.saturating_sub(k).max(1) as f64;
    let cov = inverse(&best.jtj, k).unwrap_or([[f64::NAN; NP]; NP]);
    let se = |k: usize| (cov[k][k] * s2).max(0.0).sqrt();
    let step = p[6] - p[7];
    let edge_w = logistic.p[5].exp();
    let eta = p[3].hypot(p[4]);
    // Axis ratio exp(2η): its uncertainty from those of η_c, η_s along the η direction.
    let se_eta = if eta > 1e-12 {
        let (uc, us) = (p[3] / eta, p[4] / eta);
        (uc * uc * cov[3][3] + us * us * cov[4][4] + 2.0 * uc * us * cov[3][4])
            .max(0.0)
            .sqrt()
            * s2.sqrt()
    } else {
        (0.5 * (cov[3][3] + cov[4][4]) * s2).max(0.0).sqrt()
    };
    // D = exp(H) stretches along the eigenvector of H with eigenvalue +η: angle atan2(η_s, η_c)/2.
    let major = 0.5 * p[4].atan2(p[3]);
    let to_circular = inv_distortion(p[3], p[4]);
    let mut n_inside = 0;
    let mut reach = [false; 4];
    for i in 0..shape.rows {
        for j in 0..shape.cols {
            let (dr, dc) = (i as f64 - p[0], j as f64 - p[1]);
            let (u, v) = (
                to_circular[0][0] * dr + to_circular[0][1] * dc,
                to_circular[1][0] * dr + to_circular[1][1] * dc,
            );
            let rho = u.hypot(v);
            if rho <= p[2] {
                n_inside += 1;
            } else if rho > p[2] + 2.0 * edge_w {
                let q = if u.abs() >= v.abs() {
                    usize::from(u > 0.0)
                } else {
                    2 + usize::from(v > 0.0)
                };
                reach[q] = true;
            }
        }
    }
    let taper_width_px = taper_fit.map_or(0.0, |f| f.p[8].exp());
    let taper_subsamples = taper_fit.map_or(0, |f| f.shape.sub);
    Ok(DiskEdge {
        center_px: (p[0], p[1]),
        center_sigma_px: (se(0), se(1)),
        radius_px: radius,
        radius_sigma_px: var.max(0.0).sqrt(),
        radius_50_px: logistic.p[2],
        axis_ratio: (2.0 * eta).exp(),
        axis_ratio_sigma: 2.0 * (2.0 * eta).exp() * se_eta,
        major_axis_rad: if major <= -std::f64::consts::FRAC_PI_2 + 1e-15 {
            major + std::f64::consts::PI
        } else {
            major
        },
        to_circular,
        edge_width_px: edge_w,
        edge_model: best.shape.model,
        model_weights,
        model_radii_px: model_radii,
        taper_width_px,
        taper_subsamples,
        plateau: p[6],
        background: p[7],
        n_pixels_fit: n,
        n_pixels_rejected: n_rejected,
        n_pixels_inside: n_inside,
        relative_rms: (best.ss / n.max(1) as f64).sqrt() / step,
        edge_complete: reach.iter().all(|&b| b),
    })
}

/// Delete-one-sector jackknife standard error of the corrected radius over 8 azimuthal
/// sectors.
fn jackknife_radius(shape: Profile, p: &[f64; NP], px: &[Px]) -> f64 {
    const K: usize = 8;
    let sector = |q: &Px| {
        let a = (q.c - p[1]).atan2(q.r - p[0]) + std::f64::consts::PI;
        ((a / (2.0 * std::f64::consts::PI) * K as f64) as usize).min(K - 1)
    };
    // The K refits are independent: in parallel, collected in sector order.
    let rs: Option<Vec<f64>> = (0..K)
        .into_par_iter()
        .map(|s| {
            let sub: Vec<Px> = px.iter().copied().filter(|q| sector(q) != s).collect();
            if sub.len() < 2 * NP {
                return None;
            }
            let (q, jtj) = levenberg_marquardt(shape, *p, &sub);
            Some(Fit::new(shape, q, jtj, &sub).radius())
        })
        .collect();
    let Some(rs) = rs else {
        return f64::NAN;
    };
    let mean = rs.iter().sum::<f64>() / K as f64;
    ((K - 1) as f64 / K as f64 * rs.iter().map(|r| (r - mean).powi(2)).sum::<f64>()).sqrt()
}
