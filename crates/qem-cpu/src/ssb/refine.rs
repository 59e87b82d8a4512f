//! The fit's last stage on the full loss: Newton steps on a quadratic model of the loss, fitted
//! to a small design of points around the current best (module docs of `fit`).
//!
//! Why not Nelder–Mead to the end, as before: from a 2 % simplex to a 1e-4 one it took ~176
//! full-loss evaluations on the reference acquisition (3.8 ms each on an H100: two thirds of
//! the fit). Near its minimum the loss is smooth and close to quadratic, so a quadratic model
//! from 1 + 2d + d(d−1)/2 points (10 for C10, C12, φ12) and one Newton step lands within a
//! small fraction of the design's size; four designs, each a quarter of the one before, reach
//! the final spread in ~40 evaluations. Every design is one batch.

use nalgebra::{DMatrix, DVector};
use qem_core::Result;

/// Design size the refinement starts with (box coordinates): the fresh simplex step the
/// previous scheme used, twice the spread at which the coarse stages stop.
pub(super) const START_STEP: f64 = 2e-2;
/// The design shrinks by this factor once the best point moves less than the design's size.
const SHRINK: f64 = 4.0;
/// The refinement ends once a design of at most this size (box coordinates) has moved the best
/// point by less than its size: 0.02 / 4³ = 3.1e-4, whose Newton step resolves the minimum far
/// below the 1e-4 spread Nelder–Mead stopped at (the model's error on a smooth loss falls with
/// the square of the design's size).
const STOP_STEP: f64 = 5e-4;
/// Designs at most (a loss far from quadratic at every scale falls back to Nelder–Mead); a
/// smaller budget can be asked for (`refine_quadratic`'s `max_designs`).
pub(super) const MAX_DESIGNS: usize = 12;

/// What [`refine_quadratic`] ended with: the best point and its loss.
pub(super) enum Refined {
    /// The design reached [`STOP_STEP`] with the best point settled.
    Converged(Vec<f64>, f64),
    /// [`MAX_DESIGNS`] designs without settling; the last design's size comes with it.
    Unsettled(Vec<f64>, f64, f64),
}

/// Full losses of a batch of points in box coordinates, in order.
pub(super) type BoxBatch<'a> = dyn Fn(&[Vec<f64>]) -> Result<Vec<f64>> + 'a;

/// Offsets along axis `i` of the design at `c` with size `h`: ±h, or one-sided (h, 2h) and
/// (−h, −2h) where the box edge is closer than h (the box is [0, 1] on every axis).
fn axis_offsets(ci: f64, h: f64) -> (f64, f64) {
    if ci - h >= 0.0 && ci + h <= 1.0 {
        (-h, h)
    } else if ci + 2.0 * h <= 1.0 {
        (h, 2.0 * h)
    } else {
        (-h, -2.0 * h)
    }
}

/// The quadratic model m(s) = f0 + gᵀs + ½ sᵀHs through the design's values: along axis i the
/// parabola through (0, f0), (a_i, fa_i), (b_i, fb_i) gives g_i and H_ii; the point
/// (b_i, b_j) gives H_ij. Exact for a quadratic loss.
fn model(f0: f64, off: &[(f64, f64)], axis: &[(f64, f64)], cross: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let d = off.len();
    let mut g = vec![0.0; d];
    let mut hm = vec![0.0; d * d];
    for i in 0..d {
        let ((a, b), (fa, fb)) = (off[i], axis[i]);
        // g a + ½H a² = fa − f0 and g b + ½H b² = fb − f0.
        let (ra, rb) = (fa - f0, fb - f0);
        let det = a * b * (b - a) / 2.0;
        g[i] = (ra * b * b / 2.0 - rb * a * a / 2.0) / det;
        hm[i * d + i] = (a * rb - b * ra) / det;
    }
    let mut k = 0;
    for i in 0..d {
        for j in i + 1..d {
            let (bi, bj) = (off[i].1, off[j].1);
            let rest = cross[k]
                - f0
                - g[i] * bi
                - g[j] * bj
                - 0.5 * hm[i * d + i] * bi * bi
                - 0.5 * hm[j * d + j] * bj * bj;
            hm[i * d + j] = rest / (bi * bj);
            hm[j * d + i] = hm[i * d + j];
            k += 1;
        }
    }
    (g, hm)
}

/// Solves (H + μI) s = −g by Cholesky for the smallest μ in 0, 1e-12·scale, ×10 … that makes
/// the matrix positive definite (a flat or curved-down direction then gets a bounded step
/// instead of a wild or uphill one). `None` only for non-finite input.
fn damped_newton(g: &[f64], hm: &[f64]) -> Option<Vec<f64>> {
    let d = g.len();
    let scale = (0..d)
        .map(|i| hm[i * d + i].abs())
        .fold(0.0f64, f64::max)
        .max(1e-300);
    let mut mu = 0.0;
    for _ in 0..40 {
        if let Some(s) = cholesky_solve(hm, mu, g) {
            return Some(s);
        }
        mu = if mu == 0.0 { 1e-12 * scale } else { mu * 10.0 };
    }
    None
}

/// −(H + μI)⁻¹ g through the Cholesky factor (nalgebra), or `None` where H + μI is not
/// positive definite or the step is not finite.
fn cholesky_solve(hm: &[f64], mu: f64, g: &[f64]) -> Option<Vec<f64>> {
    let d = g.len();
    let h = DMatrix::from_row_slice(d, d, hm) + DMatrix::identity(d, d) * mu;
    let s = h.cholesky()?.solve(&-DVector::from_column_slice(g));
    s.iter()
        .all(|v| v.is_finite())
        .then(|| s.as_slice().to_vec())
}

/// The model's minimum over the box [0, 1]ᵈ from `c`, each coordinate's step at most `trust`:
/// the damped Newton step over the free coordinates, with every coordinate that it would take
/// out of the box pinned to that edge and the others solved again for the pinned ones' steps
/// (so a minimum beyond an edge ends at the edge's own minimum, not at a clamped point of the
/// free solution). `None` only for non-finite input.
fn box_newton(c: &[f64], g: &[f64], hm: &[f64], trust: f64) -> Option<Vec<f64>> {
    let d = c.len();
    let mut pinned: Vec<Option<f64>> = vec![None; d];
    loop {
        let free: Vec<usize> = (0..d).filter(|&i| pinned[i].is_none()).collect();
        let n = free.len();
        let gr: Vec<f64> = free
            .iter()
            .map(|&i| {
                g[i] + (0..d)
                    .filter_map(|j| pinned[j].map(|sj| hm[i * d + j] * sj))
                    .sum::<f64>()
            })
            .collect();
        let hr: Vec<f64> = free
            .iter()
            .flat_map(|&i| free.iter().map(move |&j| hm[i * d + j]))
            .collect();
        let sr = if n > 0 {
            damped_newton(&gr, &hr)?
        } else {
            Vec::new()
        };
        let mut again = false;
        let mut s: Vec<f64> = pinned.iter().map(|p| p.unwrap_or(0.0)).collect();
        for (k, &i) in free.iter().enumerate() {
            let t = c[i] + sr[k];
            if !(0.0..=1.0).contains(&t) {
                pinned[i] = Some(t.clamp(0.0, 1.0) - c[i]);
                again = true;
            }
            s[i] = sr[k];
        }
        if !again {
            return Some(
                c.iter()
                    .zip(&s)
                    .map(|(ci, si)| (ci + si.clamp(-trust, trust)).clamp(0.0, 1.0))
                    .collect(),
            );
        }
    }
}

/// Largest coordinate difference.
fn dist_inf(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Quadratic-model refinement from `start` = (point, its loss) in box coordinates. Each design: the
/// 2d axis points and d(d−1)/2 cross points around the best point so far (one batch), the
/// model's damped Newton step within the box (`box_newton`), at most 2h per coordinate (one more
/// evaluation), and the best of all these points becomes the next centre. When the centre
/// moved less than h, or gained a negligible loss (a flat direction), the design shrinks by
/// [`SHRINK`]; it ends once a design of at most [`STOP_STEP`] settles, or unsettled after
/// `max_designs` designs (at most [`MAX_DESIGNS`]). Every loss is appended to `curve`.
pub(super) fn refine_quadratic(
    f: &BoxBatch<'_>,
    (u0, f0): (&[f64], f64),
    max_designs: usize,
    curve: &mut Vec<f64>,
) -> Result<Refined> {
    let d = u0.len();
    let (mut c, mut fc) = (u0.to_vec(), f0);
    let mut h = START_STEP;
    // The spread of the first design's losses: the loss's scale at this stage.
    let mut scale: Option<f64> = None;
    for _ in 0..max_designs.min(MAX_DESIGNS) {
        let off: Vec<(f64, f64)> = c.iter().map(|&ci| axis_offsets(ci, h)).collect();
        let mut pts: Vec<Vec<f64>> = Vec::with_capacity(2 * d + d * (d - 1) / 2);
        for (i, &(a, b)) in off.iter().enumerate() {
            for t in [a, b] {
                let mut p = c.clone();
                p[i] += t;
                pts.push(p);
            }
        }
        for i in 0..d {
            for j in i + 1..d {
                let mut p = c.clone();
                p[i] += off[i].1;
                p[j] += off[j].1;
                pts.push(p);
            }
        }
        let vals = f(&pts)?;
        curve.extend(&vals);
        let axis: Vec<(f64, f64)> = (0..d).map(|i| (vals[2 * i], vals[2 * i + 1])).collect();
        let (g, hm) = model(fc, &off, &axis, &vals[2 * d..]);
        let mut cands: Vec<(Vec<f64>, f64)> = pts.into_iter().zip(vals).collect();
        if let Some(p) = box_newton(&c, &g, &hm, 2.0 * h) {
            if dist_inf(&p, &c) > 0.0 {
                let v = f(std::slice::from_ref(&p))?[0];
                curve.push(v);
                cands.push((p, v));
            }
        }
        if scale.is_none() {
            let (lo, hi) = cands
                .iter()
                .map(|x| x.1)
                .filter(|v| v.is_finite())
                .fold((fc, fc), |(lo, hi), v| (lo.min(v), hi.max(v)));
            scale = Some(hi - lo);
        }
        let (moved, gained) = match cands.into_iter().min_by(|a, b| a.1.total_cmp(&b.1)) {
            Some((p, v)) if v < fc => {
                let m = (dist_inf(&p, &c), fc - v);
                (c, fc) = (p, v);
                m
            }
            _ => (0.0, 0.0),
        };
        // Settled at this size: the centre stayed within the design, or it moved only along
        // directions that gain nothing (a flat loss: φ12 where C12 = 0), by less than the
        // loss's rounding (f32 on the GPU) or 1e-6 of the first design's spread.
        let negligible = 1e-6 * fc.abs().max(scale.unwrap_or(0.0));
        if moved < h || gained <= negligible {
            if h <= STOP_STEP {
                return Ok(Refined::Converged(c, fc));
            }
            h /= SHRINK;
        }
    }
    Ok(Refined::Unsettled(c, fc, h))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Points asked for, and a loss over them.
    fn run(loss: impl Fn(&[f64]) -> f64, u0: &[f64]) -> (Refined, usize) {
        let mut curve = Vec::new();
        let f = |us: &[Vec<f64>]| -> Result<Vec<f64>> { Ok(us.iter().map(|u| loss(u)).collect()) };
        let r = refine_quadratic(&f, (u0, loss(u0)), MAX_DESIGNS, &mut curve).unwrap();
        (r, curve.len())
    }

    fn converged(r: Refined) -> (Vec<f64>, f64) {
        match r {
            Refined::Converged(u, l) => (u, l),
            Refined::Unsettled(u, l, h) => panic!("unsettled at {u:?} ({l}), h {h}"),
        }
    }

    /// A quadratic with correlated axes: the model is exact, so the first Newton step lands on
    /// the minimum (to rounding) and the shrinking designs only confirm it.
    #[test]
    fn a_correlated_quadratic_is_solved_exactly() {
        let m = [0.31, 0.62, 0.47];
        let loss = |u: &[f64]| {
            let x = [u[0] - m[0], u[1] - m[1], u[2] - m[2]];
            3.0 * x[0] * x[0] + 2.0 * x[1] * x[1] + x[2] * x[2] + 2.0 * x[0] * x[1]
                - 1.2 * x[1] * x[2]
                + 0.5
        };
        let (r, n) = run(loss, &[0.30, 0.63, 0.48]);
        let (u, l) = converged(r);
        assert!(dist_inf(&u, &m) < 1e-9, "{u:?}");
        assert!((l - 0.5).abs() < 1e-15);
        // Four designs of 9 points and a Newton point each.
        assert!(n <= 40, "{n} evaluations");
    }

    /// The minimum on the box edge (C12 = 0 when the data has no astigmatism): one-sided
    /// designs there, and the clamped Newton step ends on the edge.
    #[test]
    fn a_minimum_beyond_the_box_edge_ends_on_the_edge() {
        let loss = |u: &[f64]| (u[0] - 0.4).powi(2) + (u[1] + 0.05).powi(2) + 0.3 * u[0] * u[1];
        let (r, _) = run(loss, &[0.42, 0.01]);
        let (u, _) = converged(r);
        assert_eq!(u[1], 0.0, "{u:?}");
        // ∂/∂u0 = 2(u0 − 0.4) + 0.3 u1 = 0 at u1 = 0.
        assert!((u[0] - 0.4).abs() < 1e-6, "{u:?}");
    }

    /// A loss flat along one axis (φ12 when C12 = 0): no wild step along it, and the other
    /// axes still end at their minimum.
    #[test]
    fn a_flat_direction_gets_no_wild_step() {
        let loss = |u: &[f64]| (u[0] - 0.55).powi(2) + 4.0 * (u[1] - 0.25).powi(2);
        let (r, _) = run(loss, &[0.56, 0.26, 0.7]);
        let (u, _) = converged(r);
        assert!(
            (u[0] - 0.55).abs() < 1e-6 && (u[1] - 0.25).abs() < 1e-6,
            "{u:?}"
        );
        assert!((u[2] - 0.7).abs() <= 2.0 * START_STEP, "{u:?}");
    }

    /// A direction that is flat but for a slope far below the loss's scale (φ12 where C12 = 0,
    /// with rounding): the Newton step runs the full 2h along it at every design, which must
    /// not keep the designs from shrinking (it did: the case ended `Unsettled` after 12
    /// designs and a Nelder–Mead fallback, 550–600 evaluations on abTEM's C12 = 0 cases).
    #[test]
    fn a_nearly_flat_direction_settles() {
        let loss = |u: &[f64]| (u[0] - 0.55).powi(2) + 4.0 * (u[1] - 0.25).powi(2) + 1e-9 * u[2];
        let (r, n) = run(loss, &[0.56, 0.26, 0.7]);
        let (u, _) = converged(r);
        assert!(
            (u[0] - 0.55).abs() < 1e-6 && (u[1] - 0.25).abs() < 1e-6,
            "{u:?}"
        );
        assert!(n <= 60, "{n} evaluations");
    }

    /// A smooth loss that is not quadratic (quartic and periodic terms), its minimum 1.5 %
    /// of the box from the start: the designs walk there and resolve it to 1e-5.
    #[test]
    fn a_non_quadratic_loss_is_resolved_below_the_old_spread() {
        let m = [0.52, 0.33, 0.61];
        let loss = |u: &[f64]| {
            let x = [u[0] - m[0], u[1] - m[1], u[2] - m[2]];
            x[0] * x[0]
                + 2.0 * x[1] * x[1]
                + x[2] * x[2]
                + 0.5 * x[0] * x[1]
                + 30.0 * x[0].powi(4)
                + 0.1 * (3.0 * x[2]).sin().powi(4)
                + 5.0 * x[1].powi(3)
        };
        let (r, n) = run(loss, &[0.535, 0.32, 0.6]);
        let (u, _) = converged(r);
        assert!(dist_inf(&u, &m) < 1e-5, "{u:?}, {n} evaluations");
    }
}
