//! Detector calibration from the bright-field disk edge (docs/calibration.md).
//!
//! The detector angular sampling of a STEM acquisition is `α / r_BF`: the BF disk's edge is the
//! image of the probe-forming aperture's edge. [`fit_disk_edge`] measures `r_BF` to a small
//! fraction of a pixel from the mean diffraction pattern, for hard (coherent, pixel-integrated)
//! and soft (finite source, partially coherent, detector blur) edges alike, and for an
//! elliptical disk (projector distortion):
//!
//! * model: `I(k) = B + (P − B) / (1 + exp((ρ(k) − R) / w))` with the elliptical radius
//!   `ρ(k) = |D⁻¹ (k − c)|`, `D = exp(η_c σ_z + η_s σ_x)` symmetric with `det D = 1` (so `R` is
//!   the geometric-mean radius `√(ab)` and `D⁻¹` maps the ellipse to a circle of radius `R`);
//!   `R` is the radius where the pattern is halfway between its plateau `P` and the background
//!   `B` just outside — the 50 % point of a symmetric edge, which is where a hard edge crosses a
//!   pixel centre;
//! * fitted by Levenberg–Marquardt to the pixels in a band around the edge (the plateau far
//!   inside and the diffuse scattering far outside do not pull it), starting from the anchor's
//!   threshold disk of a 3×3-median-filtered pattern (isolated bad pixels cannot move the
//!   start), then refitted with pixels whose residual exceeds 8 robust standard deviations
//!   dropped (dead, hot or masked pixels);
//! * a disk blurred by an isotropic spread of variance `s²` per axis has its 50 % contour
//!   `≈ s²/(2R)` inside the true edge (curvature); the logistic of width `w` matches a Gaussian
//!   blur of `s = 1.70 w`, and the reported radius adds that term back (0.002 px for a pixel-integrated hard edge, 1 % for a
//!   2-px blur of a 15-px disk);
//! * uncertainty: the larger of the least-squares standard error (scaled by the residual
//!   variance, so model misfit counts) and a delete-one-sector jackknife over 8 azimuthal
//!   sectors (structure in the pattern that is not azimuthally uniform, e.g. overlapping Bragg
//!   disks of a crystal, counts).

use crate::error::{Error, Result};
use crate::geometry::Shape2;

const OP: &str = "calibration disk edge";

/// The BF disk edge of a mean diffraction pattern ([`fit_disk_edge`]).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DiskEdge {
    /// Centre `(row, col)`, detector pixels.
    pub center_px: (f64, f64),
    /// Standard uncertainty of the centre, pixels.
    pub center_sigma_px: (f64, f64),
    /// Radius of the aperture edge, pixels: the geometric mean `√(ab)` of the semi-axes of an
    /// elliptical disk, corrected for the curvature shift of a blurred edge.
    pub radius_px: f64,
    /// Standard uncertainty of `radius_px`, pixels.
    pub radius_sigma_px: f64,
    /// Radius of the 50 % contour itself, pixels (before the curvature term).
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
    /// Residual RMS over the plateau-to-background step (0 = perfect model).
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
    pub const RULE: &'static str = "logistic edge fit to the mean DP (50 % point between plateau \
        and background, elliptical, bad pixels rejected at 8 robust sigma), plus the curvature \
        term s^2/(2R) of a blurred edge";
}

/// The Gaussian σ whose edge profile the logistic of width `w` matches best is `1.70 w` (the
/// classic logit–probit scale).
const LOGISTIC_TO_GAUSS: f64 = 1.70;

/// Parameter vector: centre row, centre col, R, η_c, η_s, ln w, P, B.
const NP: usize = 8;

/// `D⁻¹ = exp(−H)`, `H = [[η_c, η_s], [η_s, −η_c]]`: `cosh η · 1 − sinh η / η · H`.
fn inv_distortion(ec: f64, es: f64) -> [[f64; 2]; 2] {
    let eta = ec.hypot(es);
    let (ch, shc) = if eta < 1e-12 {
        (1.0, 1.0)
    } else {
        (eta.cosh(), eta.sinh() / eta)
    };
    [[ch - shc * ec, -shc * es], [-shc * es, ch + shc * ec]]
}

fn model(p: &[f64; NP], r: f64, c: f64) -> f64 {
    let m = inv_distortion(p[3], p[4]);
    let (dr, dc) = (r - p[0], c - p[1]);
    let (u, v) = (m[0][0] * dr + m[0][1] * dc, m[1][0] * dr + m[1][1] * dc);
    let rho = u.hypot(v);
    let w = p[5].exp();
    let x = ((rho - p[2]) / w).clamp(-60.0, 60.0);
    p[7] + (p[6] - p[7]) / (1.0 + x.exp())
}

/// One pixel of the fit: position and value.
#[derive(Clone, Copy)]
struct Px {
    r: f64,
    c: f64,
    v: f64,
}

/// Solve `A x = b` (symmetric positive definite, small) by Gaussian elimination with partial
/// pivoting; `None` when singular.
// Index loops read as the textbook elimination; iterator forms would hide the pivoting.
#[allow(clippy::needless_range_loop)]
fn solve(mut a: [[f64; NP]; NP], mut b: [f64; NP], n: usize) -> Option<[f64; NP]> {
    for col in 0..n {
        let piv = (col..n).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[piv][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, piv);
        b.swap(col, piv);
        for row in col + 1..n {
            let f = a[row][col] / a[col][col];
            for k in col..n {
                a[row][k] -= f * a[col][k];
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; NP];
    for i in (0..n).rev() {
        let s: f64 = (i + 1..n).map(|k| a[i][k] * x[k]).sum();
        x[i] = (b[i] - s) / a[i][i];
    }
    Some(x)
}

/// Jacobian row of `model` at `p` by central differences (steps scaled to each parameter).
fn jac_row(p: &[f64; NP], q: &Px, active: usize) -> [f64; NP] {
    let mut j = [0.0; NP];
    let steps = [1e-4, 1e-4, 1e-4, 1e-6, 1e-6, 1e-5, 0.0, 0.0];
    for (k, jk) in j.iter_mut().enumerate().take(active) {
        let h = if k >= 6 {
            1e-6 * (p[6] - p[7]).abs().max(1e-12)
        } else {
            steps[k]
        };
        let (mut a, mut b) = (*p, *p);
        a[k] += h;
        b[k] -= h;
        *jk = (model(&a, q.r, q.c) - model(&b, q.r, q.c)) / (2.0 * h);
    }
    j
}

fn sum_sq(p: &[f64; NP], px: &[Px]) -> f64 {
    px.iter().map(|q| (q.v - model(p, q.r, q.c)).powi(2)).sum()
}

/// Levenberg–Marquardt on `px` from `p`; the normal matrix at the end (for the covariance).
fn levenberg_marquardt(mut p: [f64; NP], px: &[Px]) -> ([f64; NP], [[f64; NP]; NP]) {
    let mut lambda = 1e-3;
    let mut cost = sum_sq(&p, px);
    let mut jtj = [[0.0; NP]; NP];
    for _ in 0..200 {
        jtj = [[0.0; NP]; NP];
        let mut jtr = [0.0; NP];
        for q in px {
            let j = jac_row(&p, q, NP);
            let res = q.v - model(&p, q.r, q.c);
            for a in 0..NP {
                jtr[a] += j[a] * res;
                for b in a..NP {
                    jtj[a][b] += j[a] * j[b];
                }
            }
        }
        for a in 1..NP {
            let (upper, lower) = jtj.split_at_mut(a);
            for (b, row) in upper.iter().enumerate() {
                lower[0][b] = row[a];
            }
        }
        let mut improved = false;
        for _ in 0..20 {
            let mut a = jtj;
            for (k, row) in a.iter_mut().enumerate() {
                row[k] += lambda * jtj[k][k].max(1e-30);
            }
            let Some(dx) = solve(a, jtr, NP) else {
                lambda *= 10.0;
                continue;
            };
            let mut trial = p;
            for k in 0..NP {
                trial[k] += dx[k];
            }
            trial[5] = trial[5].clamp(-4.0, 3.5);
            let c = sum_sq(&trial, px);
            if c.is_finite() && c <= cost {
                let rel = (cost - c) / cost.max(1e-300);
                p = trial;
                cost = c;
                lambda = (lambda / 10.0).max(1e-12);
                improved = true;
                if rel < 1e-13 {
                    return (p, jtj);
                }
                break;
            }
            lambda *= 10.0;
        }
        if !improved {
            break;
        }
    }
    (p, jtj)
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
    Ok([c0r, c0c, r0, 0.0, 0.0, (0.7f64).ln(), p0, b0])
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

/// Inverse of the normal matrix (covariance up to the residual variance).
fn inverse(a: &[[f64; NP]; NP]) -> Option<[[f64; NP]; NP]> {
    let mut inv = [[0.0; NP]; NP];
    for k in 0..NP {
        let mut e = [0.0; NP];
        e[k] = 1.0;
        let x = solve(*a, e, NP)?;
        for i in 0..NP {
            inv[i][k] = x[i];
        }
    }
    Some(inv)
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
    for round in 0..4 {
        let w = p[5].exp();
        let half = (0.3 * p[2]).clamp(4.0, 10.0).max(5.0 * w);
        px = band(values, shape, &p, half, &rejected);
        if px.len() < 2 * NP {
            return Err(Error::invalid(OP, "too few pixels around the disk edge")
                .with_expected("a disk edge on the detector")
                .with_found(format!("{} pixels", px.len())));
        }
        (p, jtj) = levenberg_marquardt(p, &px);
        // Outliers (bad pixels) against a robust scale of the residuals.
        let mut res: Vec<f64> = px
            .iter()
            .map(|q| (q.v - model(&p, q.r, q.c)).abs())
            .collect();
        res.sort_by(f64::total_cmp);
        let scale = 1.4826 * crate::stats::percentile_sorted(&res, 50.0);
        let step = (p[6] - p[7]).abs();
        // At least 10 % of the step: a noise-free pattern's tiny residuals are model misfit
        // (a pixel-integrated hard edge is not exactly logistic), not bad pixels.
        let limit = (8.0 * scale).max(0.1 * step);
        let mut new = 0;
        for q in &px {
            if (q.v - model(&p, q.r, q.c)).abs() > limit {
                rejected[q.r as usize * shape.cols + q.c as usize] = true;
                new += 1;
            }
        }
        n_rejected += new;
        if new == 0 && round > 0 {
            break;
        }
    }
    finish(values, shape, p, &px, &jtj, n_rejected, &rejected)
}

fn finish(
    values: &[f64],
    shape: Shape2,
    p: [f64; NP],
    px: &[Px],
    jtj: &[[f64; NP]; NP],
    n_rejected: usize,
    rejected: &[bool],
) -> Result<DiskEdge> {
    let step = p[6] - p[7];
    let inside_detector = p[0] > -p[2]
        && p[0] < shape.rows as f64 + p[2]
        && p[1] > -p[2]
        && p[1] < shape.cols as f64 + p[2];
    if !(step > 0.0 && p[2] > 1.0 && inside_detector && p.iter().all(|v| v.is_finite())) {
        return Err(
            Error::invalid(OP, "the edge fit did not converge to a bright disk")
                .with_expected("a bright disk on a darker background")
                .with_found(format!(
                    "radius {:.3} px, centre ({:.2}, {:.2}), plateau - background {:.4}",
                    p[2], p[0], p[1], step
                )),
        );
    }
    let n = px.len();
    let ss = sum_sq(&p, px);
    let s2 = ss / (n.saturating_sub(NP).max(1)) as f64;
    let cov = inverse(jtj).unwrap_or([[f64::NAN; NP]; NP]);
    let se = |k: usize| (cov[k][k] * s2).max(0.0).sqrt();
    let w = p[5].exp();
    let spread = LOGISTIC_TO_GAUSS * w;
    let curvature = spread * spread / (2.0 * p[2]);
    let jack = jackknife_radius(&p, px);
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
            } else if rho > p[2] + 2.0 * w {
                let q = if u.abs() >= v.abs() {
                    usize::from(u > 0.0)
                } else {
                    2 + usize::from(v > 0.0)
                };
                reach[q] = true;
            }
        }
    }
    let _ = (values, rejected);
    Ok(DiskEdge {
        center_px: (p[0], p[1]),
        center_sigma_px: (se(0), se(1)),
        radius_px: p[2] + curvature,
        radius_sigma_px: se(2).max(jack),
        radius_50_px: p[2],
        axis_ratio: (2.0 * eta).exp(),
        axis_ratio_sigma: 2.0 * (2.0 * eta).exp() * se_eta,
        major_axis_rad: if major <= -std::f64::consts::FRAC_PI_2 + 1e-15 {
            major + std::f64::consts::PI
        } else {
            major
        },
        to_circular,
        edge_width_px: w,
        plateau: p[6],
        background: p[7],
        n_pixels_fit: n,
        n_pixels_rejected: n_rejected,
        n_pixels_inside: n_inside,
        relative_rms: (ss / n.max(1) as f64).sqrt() / step,
        edge_complete: reach.iter().all(|&b| b),
    })
}

/// Delete-one-sector jackknife standard error of R over 8 azimuthal sectors.
fn jackknife_radius(p: &[f64; NP], px: &[Px]) -> f64 {
    const K: usize = 8;
    let sector = |q: &Px| {
        let a = (q.c - p[1]).atan2(q.r - p[0]) + std::f64::consts::PI;
        ((a / (2.0 * std::f64::consts::PI) * K as f64) as usize).min(K - 1)
    };
    let mut rs = Vec::with_capacity(K);
    for s in 0..K {
        let sub: Vec<Px> = px.iter().copied().filter(|q| sector(q) != s).collect();
        if sub.len() < 2 * NP {
            return f64::NAN;
        }
        rs.push(levenberg_marquardt(*p, &sub).0[2]);
    }
    let mean = rs.iter().sum::<f64>() / K as f64;
    ((K - 1) as f64 / K as f64 * rs.iter().map(|r| (r - mean).powi(2)).sum::<f64>()).sqrt()
}
