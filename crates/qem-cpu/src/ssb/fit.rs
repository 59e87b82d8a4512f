//! The aberration fit (module docs of `ssb`, step 8): a seeded global search, Nelder–Mead
//! from the best distinct starts, optionally on a coarse loss first, and Newton steps on a
//! quadratic model of the full loss at the end. The search sees only a batch objective
//! ([`BatchObjective`]), so the CPU and the GPU engines fit the same way.

use super::{Aberrations, Objective};
use qem_core::{Error, Result};

/// Resolved fit settings (the façade validates and fills defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct FitSpec {
    /// Seed of the global search.
    pub seed: u64,
    /// Fitted parameter names with their search ranges.
    pub params: Vec<(String, (f64, f64))>,
    /// Loss.
    pub objective: Objective,
    /// Global search points (besides the start point).
    pub global_evals: usize,
    /// Nelder–Mead iterations per start, at most.
    pub local_max_iter: usize,
    /// Nelder–Mead starts (best distinct global candidates).
    pub local_starts: usize,
    /// Values of the parameters that are not fitted, and the first global point.
    pub start: Aberrations,
    /// Whether the global points and every Nelder–Mead start's first stage use the coarse
    /// loss ([`Fidelity::Coarse`]); the last stage always uses the full one.
    pub coarse: bool,
}

/// Which loss a batch of the fit asks for: over every BF pixel, or over the coarse sample
/// that [`coarse_first`] puts first (about a quarter of the pixels, so about a quarter of the
/// cost). The coarse loss has its minimum where the full one has it, to within the rough
/// simplex the coarse stage stops at; the last stage refines on the full loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fidelity {
    /// The loss over the coarse sample.
    Coarse,
    /// The loss over every BF pixel.
    Full,
}

/// What [`fit_with`] found.
#[derive(Debug, Clone, PartialEq)]
pub struct FitOutcome {
    /// Best parameters.
    pub aberrations: Aberrations,
    /// Loss at them.
    pub loss: f64,
    /// Objective evaluations in all.
    pub evaluations: usize,
    /// Loss of every evaluation, in evaluation order.
    pub loss_curve: Vec<f64>,
    /// Loss of the best global candidate (before refinement; the coarse loss when the global
    /// stage was coarse).
    pub global_best_loss: f64,
    /// How many of the evaluations used the coarse loss (they come first in `loss_curve`
    /// together with the full-loss ones that picked the winning start).
    pub coarse_evaluations: usize,
    /// How the last stage ended: `"nelder-mead"` (no coarse stage), `"model steps (N)"` (the
    /// Newton steps on a quadratic model converged after N steps) or `"model steps (N), then
    /// nelder-mead"` (the model gave up after N steps: not convex, no descent, or the box edge).
    pub final_stage: String,
}

/// SplitMix64: a small, fully specified generator so the seed → points map is reproducible.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Radical inverse of `i` in `base` (the Halton coordinate).
fn radical_inverse(mut i: u64, base: u64) -> f64 {
    let (mut f, mut r) = (1.0, 0.0);
    while i > 0 {
        f /= base as f64;
        r += f * (i % base) as f64;
        i /= base;
    }
    r
}

const PRIMES: [u64; 8] = [2, 3, 5, 7, 11, 13, 17, 19];

/// The losses of a batch of aberration sets at one fidelity, in order (the global search asks
/// for all its points at once, Nelder–Mead for one at a time).
pub type BatchObjective<'a> = dyn Fn(&[Aberrations], Fidelity) -> Result<Vec<f64>> + Sync + 'a;

/// Seeded global search then Nelder–Mead (module docs, step 8) over the losses `objective`
/// computes (on the CPU or the GPU: equal losses give an equal fit). Why this scheme: Halton points
/// cover the box evenly (better than random for a few hundred points in ≤ 8 dimensions), a
/// seeded Cranley–Patterson shift makes the points depend on the seed only, and because the
/// points do not depend on earlier losses they are evaluated in parallel without changing the
/// result (TPE's trajectory changes with batching). Nelder–Mead then runs in coordinates
/// scaled to the box, clamped to it, from the best `local_starts` candidates.
pub fn fit_with(spec: &FitSpec, objective: &BatchObjective<'_>) -> Result<FitOutcome> {
    const OP: &str = "ssb fit";
    let d = spec.params.len();
    if d == 0 || d > PRIMES.len() {
        return Err(Error::invalid(OP, "number of fitted parameters")
            .with_expected("1 to 8")
            .with_found(d.to_string()));
    }
    let to_ab = |u: &[f64]| -> Result<Aberrations> {
        let mut ab = spec.start;
        for ((name, (lo, hi)), &ui) in spec.params.iter().zip(u) {
            ab.set(name, lo + ui.clamp(0.0, 1.0) * (hi - lo))?;
        }
        Ok(ab)
    };
    let finite = |l: f64| if l.is_finite() { l } else { f64::INFINITY };
    let batch = |abs: &[Aberrations], fid: Fidelity| -> Result<Vec<f64>> {
        let l = objective(abs, fid)?;
        if l.len() != abs.len() {
            return Err(Error::internal(
                OP,
                "the objective returned a wrong number of losses",
            ));
        }
        Ok(l.into_iter().map(finite).collect())
    };
    let first = if spec.coarse {
        Fidelity::Coarse
    } else {
        Fidelity::Full
    };
    let eval_first = |u: &[f64]| -> Result<f64> { Ok(batch(&[to_ab(u)?], first)?[0]) };
    let eval_full = |u: &[f64]| -> Result<f64> { Ok(batch(&[to_ab(u)?], Fidelity::Full)?[0]) };
    // The start point in box coordinates (clamped into the box).
    let u0: Vec<f64> = spec
        .params
        .iter()
        .map(|(name, (lo, hi))| {
            let v = spec.start.get(name).unwrap_or(0.0);
            ((v - lo) / (hi - lo)).clamp(0.0, 1.0)
        })
        .collect();
    let mut state = spec.seed;
    let shift: Vec<f64> = (0..d)
        .map(|_| (splitmix64(&mut state) >> 11) as f64 / (1u64 << 53) as f64)
        .collect();
    let mut points = vec![u0];
    for i in 1..=spec.global_evals as u64 {
        points.push(
            (0..d)
                .map(|j| (radical_inverse(i, PRIMES[j]) + shift[j]).fract())
                .collect(),
        );
    }
    let abs: Vec<Aberrations> = points.iter().map(|u| to_ab(u)).collect::<Result<_>>()?;
    let losses = batch(&abs, first)?;
    let mut curve = losses.clone();
    let mut order: Vec<usize> = (0..points.len()).collect();
    order.sort_by(|&a, &b| losses[a].total_cmp(&losses[b]).then(a.cmp(&b)));
    let global_best_loss = losses[order[0]];
    // Distinct starts: skip candidates closer than 5 % of the box to a chosen one, so the
    // starts explore different basins.
    let mut starts: Vec<usize> = Vec::new();
    for &i in &order {
        if starts.len() >= spec.local_starts.max(1) {
            break;
        }
        let far = starts.iter().all(|&s| {
            points[s]
                .iter()
                .zip(&points[i])
                .map(|(a, b)| (a - b).powi(2))
                .sum::<f64>()
                .sqrt()
                > 0.05
        });
        if far {
            starts.push(i);
        }
    }
    // Every start is refined to a rough simplex, then only the best of them on to the final
    // one (its simplex continued, not restarted). The starts that lose at the rough stage
    // stop there: on the reference acquisition each start took ~130 evaluations to reach
    // 1e-4 of the box and most of them after it had fallen behind for good. With one start
    // and no coarse loss this is exactly one Nelder–Mead run.
    let mut runs: Vec<NelderMead> = Vec::with_capacity(starts.len());
    for &s in &starts {
        let mut nm = NelderMead::new(&eval_first, &points[s], losses[s], 0.05, &mut curve)?;
        nm.run(&eval_first, COARSE_SPREAD, spec.local_max_iter, &mut curve)?;
        runs.push(nm);
    }
    let coarse_evaluations = if spec.coarse { curve.len() } else { 0 };
    let mut best = (points[order[0]].clone(), global_best_loss);
    let mut final_stage = "nelder-mead".to_string();
    if spec.coarse {
        // The starts' best vertices compared on the full loss (one batch), so a start that the
        // coarse loss ranks a little low is not lost; from the winner's best vertex a fresh
        // simplex (RESTART_STEP along each axis) runs on the full loss to the end. Not the
        // coarse simplex carried over: it is shaped by the other function and may have
        // collapsed along a flat direction, and continued on the full loss it stopped short
        // (abTEM 1-cell cases: C12 off by 1 % with a worse full loss than the all-pixel fit).
        // The coarse global losses are not comparable with full ones, so the result is the
        // winner's.
        let tips: Vec<Aberrations> = runs
            .iter()
            .map(|nm| to_ab(nm.best().0))
            .collect::<Result<_>>()?;
        let full = batch(&tips, Fidelity::Full)?;
        curve.extend(&full);
        let w = (0..runs.len()).reduce(|a, b| if full[b] < full[a] { b } else { a });
        if let Some(w) = w {
            // Newton steps on a quadratic model of the full loss (about 10 evaluations a step
            // for 3 parameters, ~3 steps, where the fresh simplex took ~170); where the model
            // does not hold (not convex, no descent, the box edge) a fresh simplex from the
            // best point seen runs to the end instead.
            let eval_points = |us: &[Vec<f64>]| -> Result<Vec<f64>> {
                let abs: Vec<Aberrations> = us.iter().map(|u| to_ab(u)).collect::<Result<_>>()?;
                batch(&abs, Fidelity::Full)
            };
            let u0 = runs[w].best().0.to_vec();
            best = match newton_refine(&eval_points, &u0, full[w], &mut curve)? {
                Refined::Converged(u, l, steps) => {
                    final_stage = format!("model steps ({steps})");
                    (u, l)
                }
                Refined::Gave(u, l, steps) => {
                    final_stage = format!("model steps ({steps}), then nelder-mead");
                    let mut nm = NelderMead::new(&eval_full, &u, l, RESTART_STEP, &mut curve)?;
                    nm.run(&eval_full, FINAL_SPREAD, spec.local_max_iter, &mut curve)?;
                    let (u, l) = nm.best();
                    (u.to_vec(), l)
                }
            };
        }
    } else {
        // The best at the rough stage (the earlier start on a tie).
        let winner = runs
            .iter_mut()
            .reduce(|a, b| if b.best().1 < a.best().1 { b } else { a });
        if let Some(nm) = winner {
            nm.run(&eval_full, FINAL_SPREAD, spec.local_max_iter, &mut curve)?;
            let (u, l) = nm.best();
            if l < best.1 {
                best = (u.to_vec(), l);
            }
        }
    }
    Ok(FitOutcome {
        aberrations: to_ab(&best.0)?,
        loss: best.1,
        evaluations: curve.len(),
        loss_curve: curve,
        global_best_loss,
        coarse_evaluations,
        final_stage,
    })
}

/// Spread (largest vertex distance from the best vertex, per box coordinate) at which every
/// Nelder–Mead start stops its first stage; 1 % of the box (8 Å of the default C10 box).
const COARSE_SPREAD: f64 = 1e-2;
/// Step of the fresh simplex the full-loss stage starts from after the coarse stages: 2 % of
/// the box, twice the rough simplex the coarse stage stopped at, so the full loss's minimum
/// lies within reach even where the coarse loss's lies a little apart.
const RESTART_STEP: f64 = 2e-2;
/// Spread at which the best start stops: 1e-4 of every box side (0.08 Å of the default C10
/// box). No test on the losses: a loss evaluated in f32 (the GPU) is rough at the 1e-7 level,
/// so a relative loss tolerance below that is never met and every start ran to `max_iter`
/// (1,592 evaluations instead of ~600 on the reference acquisition).
const FINAL_SPREAD: f64 = 1e-4;

/// Smallest step of the quadratic model's difference quotients (box units): the losses at
/// ±1e-3 of the box differ by ~1e-7 of the loss near the minimum on the reference data, well
/// above the f32 loss's rounding, while the model's own error stays below [`FINAL_SPREAD`].
const MODEL_MIN_STEP: f64 = 1e-3;
/// Newton steps at most before [`newton_refine`] hands over to Nelder–Mead.
const MODEL_MAX_STEPS: usize = 8;

/// What [`newton_refine`] ended with.
enum Refined {
    /// The last Newton step was below [`FINAL_SPREAD`] of every box side: the point, its loss
    /// and the steps taken.
    Converged(Vec<f64>, f64, usize),
    /// The model failed (not positive definite, no descent, the design left the box, or
    /// [`MODEL_MAX_STEPS`] were used): the best point seen, its loss, to go on from, and the
    /// steps taken.
    Gave(Vec<f64>, f64, usize),
}

/// Newton's method on a quadratic model of the loss around `x0` (box coordinates; `f0` its
/// loss): the gradient and Hessian from central differences on the design `x ± h·e_i`,
/// `x + h·(e_i + e_j)` (`2d + d(d−1)/2` points, one batch), the step `−H⁻¹g` limited to 4h and
/// to the box; then the model is rebuilt at the new point with `h` shrunk towards the step's
/// size (not below [`MODEL_MIN_STEP`]). Every loss goes to `curve`. Why: near the minimum the
/// loss is smooth and close to quadratic, so a few model steps place the minimum as closely
/// as Nelder–Mead's ~170 evaluations did (the fit's last stage was most of its time).
fn newton_refine(
    eval: &PointsLoss<'_>,
    x0: &[f64],
    f0: f64,
    curve: &mut Vec<f64>,
) -> Result<Refined> {
    let d = x0.len();
    let (mut x, mut fx) = (x0.to_vec(), f0);
    let mut h = RESTART_STEP;
    let mut best = (x.clone(), fx);
    for steps in 0..MODEL_MAX_STEPS {
        if x.iter().any(|&v| v - h < 0.0 || v + h > 1.0) {
            return Ok(Refined::Gave(best.0, best.1, steps));
        }
        let shifted = |steps: &[(usize, f64)]| {
            let mut y = x.clone();
            for &(i, t) in steps {
                y[i] += t;
            }
            y
        };
        let mut design = Vec::with_capacity(2 * d + d * (d - 1) / 2);
        for i in 0..d {
            design.push(shifted(&[(i, h)]));
            design.push(shifted(&[(i, -h)]));
        }
        for i in 0..d {
            for j in i + 1..d {
                design.push(shifted(&[(i, h), (j, h)]));
            }
        }
        let f = eval(&design)?;
        curve.extend(&f);
        for (y, &fy) in design.iter().zip(&f) {
            if fy < best.1 {
                best = (y.clone(), fy);
            }
        }
        let (fp, fm) = (|i: usize| f[2 * i], |i: usize| f[2 * i + 1]);
        let g: Vec<f64> = (0..d).map(|i| (fp(i) - fm(i)) / (2.0 * h)).collect();
        // The mixed points follow the axis pairs in (i, j > i) order.
        let mut mixed = f[2 * d..].iter();
        let mut hess = vec![vec![0.0; d]; d];
        for (i, j) in (0..d).flat_map(|i| (i..d).map(move |j| (i, j))) {
            let v = if i == j {
                (fp(i) - 2.0 * fx + fm(i)) / (h * h)
            } else {
                let fij = mixed.next().copied().unwrap_or(f64::NAN);
                (fij - fp(i) - fp(j) + fx) / (h * h)
            };
            hess[i][j] = v;
            hess[j][i] = v;
        }
        let Some(mut step) = cholesky_solve(&hess, &g) else {
            return Ok(Refined::Gave(best.0, best.1, steps));
        };
        step.iter_mut().for_each(|v| *v = -*v);
        let len = step.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        if len > 4.0 * h {
            step.iter_mut().for_each(|v| *v *= 4.0 * h / len);
        }
        let x1: Vec<f64> = x
            .iter()
            .zip(&step)
            .map(|(a, s)| (a + s).clamp(0.0, 1.0))
            .collect();
        let f1 = eval(std::slice::from_ref(&x1))?[0];
        curve.push(f1);
        if f1 < best.1 {
            best = (x1.clone(), f1);
        }
        let small = len < FINAL_SPREAD;
        if small && h <= 2.0 * MODEL_MIN_STEP {
            // The model's minimum and the centre lie within the final spread, on a model
            // whose differences are fine enough not to bias it: the better of the two.
            return Ok(if f1 <= fx {
                Refined::Converged(x1, f1, steps + 1)
            } else {
                Refined::Converged(x, fx, steps + 1)
            });
        }
        if f1 < fx && !small {
            // Descent: the model again at the new point, its differences as fine as the step.
            (x, fx) = (x1, f1);
            h = (2.0 * len).clamp(MODEL_MIN_STEP, h);
            continue;
        }
        if f1 < fx {
            (x, fx) = (x1, f1);
        }
        // A small step, or no descent (the loss is not quadratic over the design: higher
        // terms bias the differences): the same place, a design at least four times finer,
        // as fine as the step.
        if h <= MODEL_MIN_STEP {
            return Ok(Refined::Gave(best.0, best.1, steps + 1));
        }
        h = (2.0 * len).min(0.25 * h).max(MODEL_MIN_STEP);
    }
    Ok(Refined::Gave(best.0, best.1, MODEL_MAX_STEPS))
}

/// `x` with `a x = b` for a symmetric positive definite `a` (Cholesky); `None` when `a` is not
/// positive definite (or not finite).
fn cholesky_solve(a: &[Vec<f64>], b: &[f64]) -> Option<Vec<f64>> {
    let n = b.len();
    let mut l = vec![vec![0.0; n]; n];
    for i in 0..n {
        for j in 0..=i {
            let s: f64 = a[i][j] - (0..j).map(|k| l[i][k] * l[j][k]).sum::<f64>();
            if i == j {
                if !(s > 0.0 && s.is_finite()) {
                    return None;
                }
                l[i][i] = s.sqrt();
            } else {
                l[i][j] = s / l[j][j];
            }
        }
    }
    let mut y = vec![0.0; n];
    for i in 0..n {
        y[i] = (b[i] - (0..i).map(|k| l[i][k] * y[k]).sum::<f64>()) / l[i][i];
    }
    let mut x = vec![0.0; n];
    for i in (0..n).rev() {
        x[i] = (y[i] - (i + 1..n).map(|k| l[k][i] * x[k]).sum::<f64>()) / l[i][i];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// Nelder–Mead (reflection 1, expansion 2, contraction ½, shrink ½) in box coordinates,
/// vertices clamped to [0, 1], run in stages by [`NelderMead::run`]. Every evaluation's loss
/// is appended to the loss curve.
struct NelderMead {
    /// d + 1 vertices with their losses, best first after each iteration's sort.
    simplex: Vec<(Vec<f64>, f64)>,
    /// Iterations done so far (all stages).
    iterations: usize,
}

type BoxLoss<'a> = dyn Fn(&[f64]) -> Result<f64> + 'a;
/// The losses of a batch of points in box coordinates, in order.
type PointsLoss<'a> = dyn Fn(&[Vec<f64>]) -> Result<Vec<f64>> + 'a;

impl NelderMead {
    /// The start simplex: `x0` and one vertex `step` along each axis (inwards when `x0` lies
    /// near the upper edge, so the vertex stays distinct).
    fn new(
        f: &BoxLoss<'_>,
        x0: &[f64],
        f0: f64,
        step: f64,
        curve: &mut Vec<f64>,
    ) -> Result<NelderMead> {
        let mut simplex: Vec<(Vec<f64>, f64)> = vec![(x0.to_vec(), f0)];
        for i in 0..x0.len() {
            let mut x = x0.to_vec();
            x[i] = if x[i] + step <= 1.0 {
                x[i] + step
            } else {
                x[i] - step
            };
            let fx = f(&x)?;
            curve.push(fx);
            simplex.push((x, fx));
        }
        simplex.sort_by(|a, b| a.1.total_cmp(&b.1));
        Ok(NelderMead {
            simplex,
            iterations: 0,
        })
    }

    /// The best vertex and its loss.
    fn best(&self) -> (&[f64], f64) {
        let (x, fx) = &self.simplex[0];
        (x, *fx)
    }

    /// Iterates until the simplex spans < `spread` of every box side or `max_iter` iterations
    /// have been done in all stages.
    fn run(
        &mut self,
        f: &BoxLoss<'_>,
        spread: f64,
        max_iter: usize,
        curve: &mut Vec<f64>,
    ) -> Result<()> {
        let simplex = &mut self.simplex;
        let d = simplex.len() - 1;
        let mut ev = |x: &[f64]| -> Result<f64> {
            let v = f(x)?;
            curve.push(v);
            Ok(v)
        };
        let clamp = |mut x: Vec<f64>| {
            x.iter_mut().for_each(|v| *v = v.clamp(0.0, 1.0));
            x
        };
        while self.iterations < max_iter {
            simplex.sort_by(|a, b| a.1.total_cmp(&b.1));
            let span = simplex
                .iter()
                .skip(1)
                .flat_map(|(x, _)| x.iter().zip(&simplex[0].0).map(|(a, b)| (a - b).abs()))
                .fold(0.0f64, f64::max);
            if span < spread {
                break;
            }
            self.iterations += 1;
            let centroid: Vec<f64> = (0..d)
                .map(|j| simplex[..d].iter().map(|(x, _)| x[j]).sum::<f64>() / d as f64)
                .collect();
            let along = |t: f64| -> Vec<f64> {
                clamp(
                    centroid
                        .iter()
                        .zip(&simplex[d].0)
                        .map(|(c, w)| c + t * (c - w))
                        .collect(),
                )
            };
            let xr = along(1.0);
            let fr = ev(&xr)?;
            if fr < simplex[0].1 {
                let xe = along(2.0);
                let fe = ev(&xe)?;
                simplex[d] = if fe < fr { (xe, fe) } else { (xr, fr) };
            } else if fr < simplex[d - 1].1 {
                simplex[d] = (xr, fr);
            } else {
                let xc = if fr < simplex[d].1 {
                    along(0.5)
                } else {
                    along(-0.5)
                };
                let fc = ev(&xc)?;
                if fc < simplex[d].1.min(fr) {
                    simplex[d] = (xc, fc);
                } else {
                    let x_best = simplex[0].0.clone();
                    for v in simplex.iter_mut().skip(1) {
                        let x: Vec<f64> =
                            v.0.iter()
                                .zip(&x_best)
                                .map(|(a, b)| b + 0.5 * (a - b))
                                .collect();
                        let fx = ev(&x)?;
                        *v = (x, fx);
                    }
                }
            }
        }
        simplex.sort_by(|a, b| a.1.total_cmp(&b.1));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::f64::consts::PI;

    #[test]
    fn halton_points_depend_on_seed_only() {
        let (mut a, mut b) = (7u64, 7u64);
        assert_eq!(splitmix64(&mut a), splitmix64(&mut b));
        assert!((radical_inverse(3, 2) - 0.75).abs() < 1e-15);
    }

    /// C10, C12 and φ12 over their default boxes, 50 global points, seed 3.
    fn three_parameter_spec(starts: usize, coarse: bool) -> FitSpec {
        FitSpec {
            seed: 3,
            params: vec![
                ("C10".into(), (-400.0, 400.0)),
                ("C12".into(), (0.0, 100.0)),
                ("phi12".into(), (-PI / 2.0, PI / 2.0)),
            ],
            objective: Objective::Coherence,
            global_evals: 50,
            local_max_iter: 200,
            local_starts: starts,
            start: Aberrations::default(),
            coarse,
        }
    }

    /// The fitted C10 and C12 within their tolerances of the expected values.
    fn assert_fits(a: &Aberrations, (c10, tol10): (f64, f64), (c12, tol12): (f64, f64)) {
        assert!(
            (a.c10 - c10).abs() < tol10 && (a.c12 - c12).abs() < tol12,
            "{a:?}"
        );
    }

    /// A quadratic bowl with its minimum at C10 = `c10`, C12 = 21 Å, φ12 = 0.3 rad.
    fn bowl_at(a: &Aberrations, c10: f64) -> f64 {
        ((a.c10 - c10) / 400.0).powi(2)
            + ((a.c12 - 21.0) / 100.0).powi(2)
            + ((a.phi12 - 0.3) / 1.5).powi(2)
    }

    /// The staged Nelder–Mead: with three starts on a bowl, the best start's run is exactly
    /// the single-start run (same minimum, bit for bit), and the two other starts stop at the
    /// coarse simplex — together well under the two full runs they would cost otherwise.
    #[test]
    fn only_the_best_start_is_refined_to_the_end() {
        let spec = |starts: usize| three_parameter_spec(starts, false);
        let bowl = |abs: &[Aberrations], _: Fidelity| -> Result<Vec<f64>> {
            Ok(abs.iter().map(|a| bowl_at(a, 57.0)).collect())
        };
        let one = fit_with(&spec(1), &bowl).unwrap();
        let three = fit_with(&spec(3), &bowl).unwrap();
        assert_eq!(one.aberrations, three.aberrations);
        assert_eq!(one.loss, three.loss);
        let full = one.evaluations - 51;
        let extra = three.evaluations - one.evaluations;
        assert!(extra > 0, "the other starts were not run");
        // Run to the end, the two others would cost about two full runs.
        assert!(
            4 * extra < 3 * full * 2,
            "the other starts ran {extra} evaluations, a full run {full}"
        );
        assert!(
            (one.aberrations.c10 - 57.0).abs() < 0.5,
            "{:?}",
            one.aberrations
        );
    }

    /// The coarse stages: the global points and the starts' first stage ask for the coarse
    /// loss, everything after for the full one; the fit ends at the full loss's minimum even
    /// where the coarse loss's lies a little apart, and most evaluations are coarse.
    #[test]
    fn coarse_fit_ends_on_the_full_loss() {
        let spec = three_parameter_spec(3, true);
        let asked = std::sync::Mutex::new(Vec::new());
        let bowl = |abs: &[Aberrations], fid: Fidelity| -> Result<Vec<f64>> {
            if let Ok(mut a) = asked.lock() {
                a.extend(std::iter::repeat_n(fid, abs.len()));
            }
            // The coarse loss's minimum lies 4 Å (0.5 % of the box) from the full one's.
            let c10 = if fid == Fidelity::Coarse { 61.0 } else { 57.0 };
            Ok(abs.iter().map(|a| bowl_at(a, c10)).collect())
        };
        let out = fit_with(&spec, &bowl).unwrap();
        assert_fits(&out.aberrations, (57.0, 0.5), (21.0, 0.2));
        let asked = asked.into_inner().unwrap_or_default();
        assert_eq!(asked.len(), out.evaluations);
        let n_coarse = asked.iter().take_while(|&&f| f == Fidelity::Coarse).count();
        assert_eq!(n_coarse, out.coarse_evaluations);
        assert!(asked[n_coarse..].iter().all(|&f| f == Fidelity::Full));
        let n_full = out.evaluations - n_coarse;
        assert!(
            n_full > 3 && 2 * n_full < n_coarse,
            "{n_coarse} coarse, {n_full} full evaluations"
        );
    }

    /// A coupled quadratic bowl (not axis-aligned) in 3 box coordinates, minimum inside.
    fn bowl3(u: &[f64]) -> f64 {
        let (a, b, c) = (u[0] - 0.43, u[1] - 0.61, u[2] - 0.37);
        2.0 * a * a + b * b + 0.5 * c * c + 0.8 * a * b - 0.3 * b * c - 1.25
    }

    #[test]
    fn newton_refine_lands_on_a_quadratic_minimum_in_a_few_steps() {
        let eval =
            |us: &[Vec<f64>]| -> Result<Vec<f64>> { Ok(us.iter().map(|u| bowl3(u)).collect()) };
        let x0 = [0.45, 0.58, 0.40];
        let mut curve = Vec::new();
        let Refined::Converged(x, f, _) =
            newton_refine(&eval, &x0, bowl3(&x0), &mut curve).unwrap()
        else {
            panic!("a quadratic bowl must converge");
        };
        for (got, want) in x.iter().zip([0.43, 0.61, 0.37]) {
            assert!((got - want).abs() < 1e-9, "{x:?}");
        }
        assert!((f + 1.25).abs() < 1e-15, "{f}");
        // 2d + d(d-1)/2 = 9 design points and one model point a step.
        assert_eq!(curve.len() % 10, 0, "{}", curve.len());
        assert!(curve.len() <= 30, "{} evaluations", curve.len());
    }

    #[test]
    fn newton_refine_gives_up_on_a_saddle_and_at_the_box_edge() {
        let saddle = |us: &[Vec<f64>]| -> Result<Vec<f64>> {
            Ok(us
                .iter()
                .map(|u| (u[0] - 0.5).powi(2) - (u[1] - 0.5).powi(2))
                .collect())
        };
        let x0 = [0.52, 0.47];
        let mut curve = Vec::new();
        let r = newton_refine(&saddle, &x0, 0.0, &mut curve).unwrap();
        assert!(matches!(r, Refined::Gave(..)));
        assert_eq!(curve.len(), 5, "one design (4 + 1 points), no model step");
        let bowl = |us: &[Vec<f64>]| -> Result<Vec<f64>> {
            Ok(us.iter().map(|u| (u[0] - 0.005).powi(2)).collect())
        };
        let mut curve = Vec::new();
        let r = newton_refine(&bowl, &[0.01], 2.5e-5, &mut curve).unwrap();
        assert!(matches!(r, Refined::Gave(..)));
        assert!(
            curve.is_empty(),
            "the design would leave the box: nothing evaluated"
        );
    }

    #[test]
    fn cholesky_solve_solves_and_refuses_indefinite_matrices() {
        let a = vec![
            vec![4.0, 2.0, 0.4],
            vec![2.0, 2.0, -0.3],
            vec![0.4, -0.3, 1.0],
        ];
        let x_true = [1.5, -2.0, 0.25];
        let b: Vec<f64> = a
            .iter()
            .map(|row| row.iter().zip(&x_true).map(|(p, q)| p * q).sum())
            .collect();
        let x = cholesky_solve(&a, &b).unwrap();
        for (got, want) in x.iter().zip(x_true) {
            assert!((got - want).abs() < 1e-12, "{x:?}");
        }
        assert!(cholesky_solve(&[vec![1.0, 2.0], vec![2.0, 1.0]], &[1.0, 1.0]).is_none());
        assert!(cholesky_solve(&[vec![f64::NAN]], &[1.0]).is_none());
    }

    /// The coarse path ends with model steps on the full loss: the full loss's minimum (which
    /// the coarse loss misplaces a little), in far fewer evaluations than the all-pixel path.
    #[test]
    fn fit_with_coarse_refines_on_the_full_loss_with_model_steps() {
        let spec = |coarse| FitSpec {
            seed: 11,
            global_evals: 100,
            ..three_parameter_spec(2, coarse)
        };
        let loss = |a: &Aberrations, off: f64| {
            let (x, y, z) = (
                (a.c10 - 123.0 - off) / 400.0,
                (a.c12 - 37.0) / 100.0,
                (a.phi12 - 0.4) / 1.5,
            );
            x * x + 2.0 * y * y + z * z + 0.5 * x * y + 0.1 * (3.0 * x).sin().powi(4)
        };
        let obj = |abs: &[Aberrations], fid: Fidelity| -> Result<Vec<f64>> {
            let off = if fid == Fidelity::Coarse { 3.0 } else { 0.0 };
            Ok(abs.iter().map(|a| loss(a, off)).collect())
        };
        let fast = fit_with(&spec(true), &obj).unwrap();
        let slow = fit_with(&spec(false), &obj).unwrap();
        for out in [&fast, &slow] {
            let a = out.aberrations;
            assert!((a.c10 - 123.0).abs() < 0.1, "{a:?}");
            assert!((a.c12 - 37.0).abs() < 0.02, "{a:?}");
            assert!((a.phi12 - 0.4).abs() < 1e-3, "{a:?}");
        }
        assert!(
            fast.final_stage.starts_with("model steps ("),
            "{}",
            fast.final_stage
        );
        assert!(
            !fast.final_stage.ends_with("nelder-mead"),
            "{}",
            fast.final_stage
        );
        assert_eq!(slow.final_stage, "nelder-mead");
        let full_evals = fast.evaluations - fast.coarse_evaluations;
        assert!(
            full_evals <= 60,
            "{full_evals} full-loss evaluations after the coarse stage"
        );
        assert!(
            fast.loss <= slow.loss + 1e-9,
            "{} vs {}",
            fast.loss,
            slow.loss
        );
    }

    /// `fit_with` on an analytic loss (a bowl around a known point): the search finds it, the
    /// global points come in one batch, and an objective that answers with the wrong number of
    /// losses is an error, not a silent mis-assignment.
    #[test]
    fn fit_with_finds_a_known_minimum_and_checks_the_batch() {
        let spec = FitSpec {
            seed: 5,
            params: vec![
                ("C10".into(), (-400.0, 400.0)),
                ("C12".into(), (0.0, 100.0)),
            ],
            objective: Objective::Coherence,
            global_evals: 64,
            local_max_iter: 200,
            local_starts: 2,
            start: Aberrations::default(),
            coarse: false,
        };
        let batches = std::sync::Mutex::new(Vec::new());
        let bowl = |abs: &[Aberrations], _: Fidelity| -> Result<Vec<f64>> {
            if let Ok(mut b) = batches.lock() {
                b.push(abs.len());
            }
            Ok(abs
                .iter()
                .map(|a| ((a.c10 - 123.0) / 400.0).powi(2) + ((a.c12 - 37.0) / 100.0).powi(2))
                .collect())
        };
        let out = fit_with(&spec, &bowl).unwrap();
        assert_fits(&out.aberrations, (123.0, 0.2), (37.0, 0.05));
        assert_eq!(out.evaluations, out.loss_curve.len());
        let b = batches.into_inner().unwrap_or_default();
        assert_eq!(
            b[0], 65,
            "the start point and the 64 global points in one batch"
        );
        assert!(b[1..].iter().all(|&n| n == 1));
        let short =
            |abs: &[Aberrations], _: Fidelity| -> Result<Vec<f64>> { Ok(vec![0.0; abs.len() / 2]) };
        let e = fit_with(&spec, &short).unwrap_err();
        assert_eq!(e.kind, qem_core::ErrorKind::Internal);
    }
}
