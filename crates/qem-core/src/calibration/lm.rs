//! The least squares of the edge fit: Levenberg–Marquardt on the band's pixels with the
//! chain-rule Jacobian, the normal equations in fixed chunks (the same sums on any number of
//! threads); the small dense solves are nalgebra's.

use super::profile::{inv_distortion, model, taper};
use super::{EdgeModel, Profile, NP, TAPER_MIN_PX, TAPER_RESOLVED};
use nalgebra::{DMatrix, DVector};
use rayon::prelude::*;

/// One pixel of the fit: position and value.
#[derive(Clone, Copy)]
pub(super) struct Px {
    pub(super) r: f64,
    pub(super) c: f64,
    pub(super) v: f64,
}

/// The leading `n × n` block of `a` as a matrix.
fn leading(a: &[[f64; NP]; NP], n: usize) -> DMatrix<f64> {
    DMatrix::from_fn(n, n, |i, j| a[i][j])
}

/// Solve `A x = b` for the first `n` unknowns (LU with partial pivoting, nalgebra); `None`
/// when singular or the solution is not finite.
pub(super) fn solve(a: [[f64; NP]; NP], b: [f64; NP], n: usize) -> Option<[f64; NP]> {
    let x = leading(&a, n)
        .lu()
        .solve(&DVector::from_column_slice(&b[..n]))?;
    let mut out = [0.0; NP];
    out[..n].copy_from_slice(x.as_slice());
    out.iter().all(|v| v.is_finite()).then_some(out)
}

/// Steps of the central differences, per parameter (P and B, 6 and 7, are linear: exact).
pub(super) const STEPS: [f64; NP] = [1e-4, 1e-4, 1e-4, 1e-6, 1e-6, 1e-5, 0.0, 0.0, 1e-5];

/// What a Jacobian row needs of `p` that does not depend on the pixel: `D⁻¹` and its
/// derivatives along η_c and η_s (central differences of 2×2 matrices, once per iteration).
pub(super) struct Geometry {
    m: [[f64; 2]; 2],
    dm: [[[f64; 2]; 2]; 2],
}

impl Geometry {
    fn of(p: &[f64; NP]) -> Geometry {
        let diff = |a: [[f64; 2]; 2], b: [[f64; 2]; 2], h: f64| {
            [
                [
                    (a[0][0] - b[0][0]) / (2.0 * h),
                    (a[0][1] - b[0][1]) / (2.0 * h),
                ],
                [
                    (a[1][0] - b[1][0]) / (2.0 * h),
                    (a[1][1] - b[1][1]) / (2.0 * h),
                ],
            ]
        };
        let (h3, h4) = (STEPS[3], STEPS[4]);
        Geometry {
            m: inv_distortion(p[3], p[4]),
            dm: [
                diff(
                    inv_distortion(p[3] + h3, p[4]),
                    inv_distortion(p[3] - h3, p[4]),
                    h3,
                ),
                diff(
                    inv_distortion(p[3], p[4] + h4),
                    inv_distortion(p[3], p[4] - h4),
                    h4,
                ),
            ],
        }
    }
}

/// Jacobian row of `model` at `p`. The logistic and the taper depend on the geometry (centre,
/// R, η) only through `x = ρ − R`, so their row is the chain rule: `∂f/∂x` and the shape
/// derivatives by central differences of the 1-D profile, `∂x/∂θ` in closed form, P and B
/// exact — 6 profile evaluations per sample point instead of the 16–18 of differencing the
/// whole model (the fit's cost; a 3×3 sub-grid taper evaluates 9 points per pixel). The pixel
/// step also depends on the edge direction: central differences of the whole model.
pub(super) fn jac_row(
    shape: Profile,
    p: &[f64; NP],
    g: &Geometry,
    q: &Px,
    active: usize,
) -> [f64; NP] {
    let mut j = [0.0; NP];
    if shape.model == EdgeModel::PixelStep {
        for (k, jk) in j.iter_mut().enumerate().take(active) {
            let h = if k == 6 || k == 7 {
                1e-6 * (p[6] - p[7]).abs().max(1e-12)
            } else {
                STEPS[k]
            };
            let (mut a, mut b) = (*p, *p);
            a[k] += h;
            b[k] -= h;
            *jk = (model(shape, &a, q.r, q.c) - model(shape, &b, q.r, q.c)) / (2.0 * h);
        }
        return j;
    }
    let profile = |x: f64, ln_w: f64, ln_tau: f64| match shape.model {
        EdgeModel::AmplitudeTaper => taper(x, ln_w.exp(), ln_tau.exp()),
        _ => 1.0 / (1.0 + (x / ln_w.exp()).clamp(-60.0, 60.0).exp()),
    };
    let n = shape.sub.max(1);
    let off = |k: usize| (k as f64 - 0.5 * (n - 1) as f64) / n as f64;
    let (hx, hw, ht) = (STEPS[2], STEPS[5], STEPS[8]);
    let mut sum = [0.0; NP]; // Σ over the sample points: f, then ∂f/∂θ for θ ≠ P, B
    for i in 0..n {
        for k in 0..n {
            let (dr, dc) = (q.r + off(i) - p[0], q.c + off(k) - p[1]);
            let m = &g.m;
            let (u, v) = (m[0][0] * dr + m[0][1] * dc, m[1][0] * dr + m[1][1] * dc);
            let rho = u.hypot(v);
            let x = rho - p[2];
            let f = profile(x, p[5], p[8]);
            let fx = (profile(x + hx, p[5], p[8]) - profile(x - hx, p[5], p[8])) / (2.0 * hx);
            // ∂ρ/∂θ = (u ∂u/∂θ + v ∂v/∂θ) / ρ; ρ ≈ R in the band, never 0 there.
            let along = |du: f64, dv: f64| {
                if rho > 0.0 {
                    (u * du + v * dv) / rho
                } else {
                    0.0
                }
            };
            let eta =
                |d: &[[f64; 2]; 2]| along(d[0][0] * dr + d[0][1] * dc, d[1][0] * dr + d[1][1] * dc);
            sum[0] += fx * along(-m[0][0], -m[1][0]);
            sum[1] += fx * along(-m[0][1], -m[1][1]);
            sum[2] -= fx;
            sum[3] += fx * eta(&g.dm[0]);
            sum[4] += fx * eta(&g.dm[1]);
            sum[5] += (profile(x, p[5] + hw, p[8]) - profile(x, p[5] - hw, p[8])) / (2.0 * hw);
            sum[6] += f;
            if active > 8 {
                sum[8] += (profile(x, p[5], p[8] + ht) - profile(x, p[5], p[8] - ht)) / (2.0 * ht);
            }
        }
    }
    let inv = 1.0 / (n * n) as f64;
    let step = p[6] - p[7];
    for k in [0, 1, 2, 3, 4, 5, 8] {
        j[k] = step * sum[k] * inv;
    }
    j[6] = sum[6] * inv;
    j[7] = 1.0 - sum[6] * inv;
    if active <= 8 {
        j[8] = 0.0;
    }
    j
}

/// Pixels per unit of the fit's parallel sums: fixed, so a sum is the same on any number of
/// threads (the chunks' partial sums are added in order).
pub(super) const CHUNK: usize = 256;

pub(super) fn sum_sq(shape: Profile, p: &[f64; NP], px: &[Px]) -> f64 {
    let parts: Vec<f64> = px
        .par_chunks(CHUNK)
        .map(|c| {
            c.iter()
                .map(|q| (q.v - model(shape, p, q.r, q.c)).powi(2))
                .sum()
        })
        .collect();
    parts.iter().sum()
}

/// `JᵀJ` (upper triangle) and `Jᵀr` over `px` at `p`, in fixed chunks added in order.
pub(super) fn normal_equations(
    shape: Profile,
    p: &[f64; NP],
    px: &[Px],
    n: usize,
) -> ([[f64; NP]; NP], [f64; NP]) {
    let g = Geometry::of(p);
    let parts: Vec<([[f64; NP]; NP], [f64; NP])> = px
        .par_chunks(CHUNK)
        .map(|c| {
            let mut jtj = [[0.0; NP]; NP];
            let mut jtr = [0.0; NP];
            for q in c {
                let j = jac_row(shape, p, &g, q, n);
                let res = q.v - model(shape, p, q.r, q.c);
                for a in 0..n {
                    jtr[a] += j[a] * res;
                    for b in a..n {
                        jtj[a][b] += j[a] * j[b];
                    }
                }
            }
            (jtj, jtr)
        })
        .collect();
    let mut jtj = [[0.0; NP]; NP];
    let mut jtr = [0.0; NP];
    for (a, b) in &parts {
        for i in 0..n {
            jtr[i] += b[i];
            for k in i..n {
                jtj[i][k] += a[i][k];
            }
        }
    }
    (jtj, jtr)
}

/// Levenberg–Marquardt on `px` from `p` (the model's parameters only); the normal matrix at
/// the end (for the covariance).
pub(super) fn levenberg_marquardt(
    shape: Profile,
    mut p: [f64; NP],
    px: &[Px],
) -> ([f64; NP], [[f64; NP]; NP]) {
    let n = shape.model.n_params();
    let mut lambda = 1e-3;
    let mut cost = sum_sq(shape, &p, px);
    let mut jtj = [[0.0; NP]; NP];
    for _ in 0..200 {
        let jtr;
        (jtj, jtr) = normal_equations(shape, &p, px, n);
        for a in 1..n {
            let (upper, lower) = jtj.split_at_mut(a);
            for (b, row) in upper.iter().enumerate() {
                lower[0][b] = row[a];
            }
        }
        let mut improved = false;
        for _ in 0..20 {
            let mut a = jtj;
            for (k, row) in a.iter_mut().enumerate().take(n) {
                row[k] += lambda * jtj[k][k].max(1e-30);
            }
            let Some(dx) = solve(a, jtr, n) else {
                lambda *= 10.0;
                continue;
            };
            let mut trial = p;
            for k in 0..n {
                trial[k] += dx[k];
            }
            trial[5] = trial[5].clamp(-4.0, 3.5);
            trial[8] = trial[8].clamp(-4.0, 3.0);
            let c = sum_sq(shape, &trial, px);
            if c.is_finite() && c <= cost {
                let rel = (cost - c) / cost.max(1e-300);
                p = trial;
                cost = c;
                lambda = (lambda / 10.0).max(1e-12);
                improved = true;
                if rel < 1e-13 || (rel < STALL_REL && swallowed_taper(shape, &p)) {
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

/// A taper fit stops once a step gains less than this fraction of its cost while the taper is
/// [swallowed](swallowed_taper).
pub(super) const STALL_REL: f64 = 1e-6;

/// Whether a taper fit's taper is hidden by its blur with a margin: the blur wider than twice
/// the resolved limit (`s > 2 · TAPER_RESOLVED · τ`) or the taper narrower than half the
/// narrowest one that counts. Such a fit is not admissible and its weight goes to the
/// intensity edge, so its radius is never used; left to converge it crawls along the valley
/// `τ → 0` (each step ~1e-7 of the cost, 200 iterations: 19 s of a 192² disk on the 3×3
/// sub-grid), which moves the only thing of it that counts, its cost, by ~1e-5.
pub(super) fn swallowed_taper(shape: Profile, p: &[f64; NP]) -> bool {
    let (s, tau) = (p[5].exp(), p[8].exp());
    shape.model == EdgeModel::AmplitudeTaper
        && (s > 2.0 * TAPER_RESOLVED * tau || tau < 0.5 * TAPER_MIN_PX)
}

/// Inverse of the normal matrix (covariance up to the residual variance); `None` when
/// singular.
pub(super) fn inverse(a: &[[f64; NP]; NP], n: usize) -> Option<[[f64; NP]; NP]> {
    let m = leading(a, n).lu().try_inverse()?;
    let mut inv = [[0.0; NP]; NP];
    for (i, row) in inv.iter_mut().enumerate().take(n) {
        for (k, v) in row.iter_mut().enumerate().take(n) {
            *v = m[(i, k)];
        }
    }
    inv.iter().flatten().all(|v| v.is_finite()).then_some(inv)
}
