//! The aberration fit (module docs of `ssb`, step 8): a seeded global search, Nelder–Mead
//! from the best distinct starts, optionally on a coarse loss first, and then (after a coarse
//! stage) Newton steps on quadratic models of the full loss (`refine`). The search sees only a
//! batch objective ([`BatchObjective`]), so the CPU and the GPU engines fit the same way.

use super::refine::{refine_quadratic, Refined, MAX_DESIGNS, START_STEP};
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
    /// Iterations of each local stage, at most: Nelder–Mead iterations per start, and designs
    /// of the coherence fit's quadratic-model last stage (which never takes more than 12).
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
    let points = global_points(u0, spec.seed, spec.global_evals);
    let abs: Vec<Aberrations> = points.iter().map(|u| to_ab(u)).collect::<Result<_>>()?;
    let losses = batch(&abs, first)?;
    let mut curve = losses.clone();
    let mut order: Vec<usize> = (0..points.len()).collect();
    order.sort_by(|&a, &b| losses[a].total_cmp(&losses[b]).then(a.cmp(&b)));
    let global_best_loss = losses[order[0]];
    let starts = distinct_starts(&points, &order, spec.local_starts.max(1));
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
    let eval_full_batch = |us: &[Vec<f64>]| -> Result<Vec<f64>> {
        let abs: Vec<Aberrations> = us.iter().map(|u| to_ab(u)).collect::<Result<_>>()?;
        batch(&abs, Fidelity::Full)
    };
    // The last stage on the full loss from `u0` (loss `l0`): Newton steps on quadratic models
    // (`refine`), at most `local_max_iter` designs, which need a smooth loss: the coherence is
    // one (Γ enters it smoothly, `Objective::Coherence`); the phase variance jumps where a
    // phase wraps or a transfer passes through 0, so it takes a fresh simplex of `START_STEP`,
    // and so does a loss whose models never settled in the full 12 designs (far from quadratic
    // at every scale), from the best point seen. A smaller budget ends at the best point.
    let simplex = |u: &[f64], l: f64, h: f64, curve: &mut Vec<f64>| -> Result<(Vec<f64>, f64)> {
        let mut nm = NelderMead::new(&eval_full, u, l, h, curve)?;
        nm.run(&eval_full, FINAL_SPREAD, spec.local_max_iter, curve)?;
        let (u, l) = nm.best();
        Ok((u.to_vec(), l))
    };
    let finish = |u0: Vec<f64>, l0: f64, curve: &mut Vec<f64>| -> Result<(Vec<f64>, f64)> {
        if spec.objective != Objective::Coherence {
            return simplex(&u0, l0, START_STEP, curve);
        }
        match refine_quadratic(&eval_full_batch, (&u0, l0), spec.local_max_iter, curve)? {
            Refined::Converged(u, l) => Ok((u, l)),
            Refined::Unsettled(u, l, _) if spec.local_max_iter < MAX_DESIGNS => Ok((u, l)),
            Refined::Unsettled(u, l, h) => simplex(&u, l, h, curve),
        }
    };
    let mut best = (points[order[0]].clone(), global_best_loss);
    if spec.coarse {
        // The starts' best vertices compared on the full loss (one batch), so a start that the
        // coarse loss ranks a little low is not lost; from the winner's best vertex the last
        // stage (`finish`) runs on the full loss to the end, its first design (or simplex) 2 %
        // of the box, twice the rough simplex the coarse stage stopped at, so the full loss's
        // minimum lies within reach even where the coarse loss's lies a little apart. Not the
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
            best = finish(runs[w].best().0.to_vec(), full[w], &mut curve)?;
        }
    } else {
        // The best at the rough stage (the earlier start on a tie): the coherence goes on with
        // the last stage from its best vertex; the phase variance continues its simplex (with
        // one start this is exactly one Nelder–Mead run).
        let winner = runs
            .iter_mut()
            .reduce(|a, b| if b.best().1 < a.best().1 { b } else { a });
        if let Some(nm) = winner {
            let (u, l) = if spec.objective == Objective::Coherence {
                let (u0, l0) = nm.best();
                finish(u0.to_vec(), l0, &mut curve)?
            } else {
                nm.run(&eval_full, FINAL_SPREAD, spec.local_max_iter, &mut curve)?;
                let (u, l) = nm.best();
                (u.to_vec(), l)
            };
            if l < best.1 {
                best = (u, l);
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
    })
}

/// The global search's points in box coordinates: the start `u0`, then `count` points of the
/// Halton sequence (one prime per coordinate) shifted by a seeded random vector modulo 1
/// (Cranley–Patterson rotation), so a seed gives the same points on every engine.
fn global_points(u0: Vec<f64>, seed: u64, count: usize) -> Vec<Vec<f64>> {
    let d = u0.len();
    let mut state = seed;
    let shift: Vec<f64> = (0..d)
        .map(|_| (splitmix64(&mut state) >> 11) as f64 / (1u64 << 53) as f64)
        .collect();
    let mut points = vec![u0];
    for i in 1..=count as u64 {
        points.push(
            (0..d)
                .map(|j| (radical_inverse(i, PRIMES[j]) + shift[j]).fract())
                .collect(),
        );
    }
    points
}

/// Up to `n` Nelder–Mead starts from the points in `order` (best first), skipping a candidate
/// closer than 5 % of the box to a chosen one, so the starts explore different basins.
fn distinct_starts(points: &[Vec<f64>], order: &[usize], n: usize) -> Vec<usize> {
    let mut starts: Vec<usize> = Vec::new();
    for &i in order {
        if starts.len() >= n {
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
    starts
}

/// Spread (largest vertex distance from the best vertex, per box coordinate) at which every
/// Nelder–Mead start stops its first stage; 1 % of the box (8 Å of the default C10 box).
const COARSE_SPREAD: f64 = 1e-2;
/// Spread at which the best start stops: 1e-4 of every box side (0.08 Å of the default C10
/// box). No test on the losses: a loss evaluated in f32 (the GPU) is rough at the 1e-7 level,
/// so a relative loss tolerance below that is never met and every start ran to `max_iter`
/// (1,592 evaluations instead of ~600 on the reference acquisition).
const FINAL_SPREAD: f64 = 1e-4;

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

    /// On a loss that is not quadratic, whose coarse form has its minimum a little apart, the
    /// coarse path ends at the full loss's minimum as the all-pixel path does.
    #[test]
    fn fit_with_coarse_ends_at_the_full_minimum_of_a_non_quadratic_loss() {
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
            fast.loss <= slow.loss + 1e-9,
            "{} vs {}",
            fast.loss,
            slow.loss
        );
    }

    /// `fit_with` on an analytic loss (a bowl around a known point): the search finds it, the
    /// global points and each quadratic design come in one batch, and an objective that answers
    /// with the wrong number of losses is an error, not a silent mis-assignment.
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
        // Then Nelder–Mead's single points, and the last stage's designs: the 2d axis points
        // and d(d−1)/2 cross points (5 for d = 2) in one batch each, the Newton point alone.
        assert!(b[1..].iter().all(|&n| n == 1 || n == 5), "{b:?}");
        assert!(b[1..].contains(&5), "the quadratic last stage ran: {b:?}");
        let short =
            |abs: &[Aberrations], _: Fidelity| -> Result<Vec<f64>> { Ok(vec![0.0; abs.len() / 2]) };
        let e = fit_with(&spec, &short).unwrap_err();
        assert_eq!(e.kind, qem_core::ErrorKind::Internal);
    }
}
