//! Centre of mass, DPC alignment and iDPC integration on plain arrays: the CPU reference of
//! docs/science.md §5–7 "Centre of mass", "DPC", "iDPC" (the anchor's §4–6).
//!
//! Everything here works on scan-grid arrays in row-major order (`n = R_r·N_Rc + R_c`), in
//! `f64`; the façade (`qem::dpc`) gets the exact moments from a detector reduction and calls
//! these functions. The steps:
//!
//! 1. [`com_from_moments`]: `μ = m / S` from exact `u64` moments; `S = 0` gives 0 and is counted.
//! 2. [`fit_rotation`]: the rotation θ (and whether to exchange the two components first) that
//!    minimises the mean squared interior curl. Rotation mixes curl and divergence linearly, so
//!    `⟨curl²⟩(θ) = A cos²θ + B sin²θ + 2C sinθ cosθ` with three moments `A, B, C` of the
//!    unrotated field ([`CurlMoments`]); its minimum over `[0, π)` has a closed form, which a
//!    0.05° grid over the same function checks.
//! 3. [`align`]: the field rotated into the scan frame.
//! 4. [`integrate`]: the least-squares inverse gradient in Fourier space,
//!    `φ̂ = −i (ν·ĝ) / (2π |ν|²)`, `φ̂(0) = 0`, ν in cycles per scan step, with periodic or
//!    mirrored edges ([`EdgeMode`]).
//! 5. [`resolve_sign`]: θ and θ + π have the same curl, but opposite phase. The physical
//!    criterion: a positive projected potential gives a positive phase on the atom columns,
//!    where the ADF signal is high, so the phase must correlate positively with the ADF image.
//!    When no ADF image is given or the correlation is weak, the skewness of the phase decides
//!    (atom columns are sparse positive peaks on a lower background, so the true phase is
//!    positively skewed). The decision says which criterion decided and whether it was
//!    confident.

use qem_core::{Error, Moments, Result, Shape2};
use rayon::prelude::*;
use rustfft::num_complex::Complex64;
use rustfft::{Fft, FftDirection, FftPlanner};
use std::f64::consts::PI;
use std::sync::Arc;

/// The smallest |Pearson r| between the phase and the ADF image that decides the sign with
/// confidence. For `n` uncorrelated scan positions r has a spread of about `1/√n` (0.03 for a
/// 32 × 32 scan), so 0.1 is well clear of chance for any scan worth integrating; on the
/// simulated SrTiO3 scans of the tests the correlation is above 0.5.
pub const SIGN_MIN_ADF_CORRELATION: f64 = 0.1;

/// The smallest |skewness| of the phase that decides the sign with confidence when the ADF
/// criterion cannot. The skewness of `n` Gaussian-noise values spreads by about `√(6/n)`
/// (0.08 for 32 × 32), so 0.5 is far from chance; a lattice of atom columns is typically
/// skewed by more than 1.
pub const SIGN_MIN_SKEWNESS: f64 = 0.5;

/// Grid step of the check of the closed-form rotation minimum, degrees.
pub const ROTATION_GRID_STEP_DEG: f64 = 0.05;

/// How the scan edges are treated by [`integrate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum EdgeMode {
    /// The field is taken as periodic over the scan (what a plain FFT assumes). Exact for a
    /// periodic field; a non-periodic one gets artefacts along the edges.
    #[default]
    Periodic,
    /// The field is mirrored to `2N_r × 2N_c` before integration and the result cropped back:
    /// the mirrored phase is continuous across the edges, so a non-periodic field integrates
    /// without wrap-around artefacts. Mirroring a gradient flips the sign of the component
    /// along the mirrored axis, which this does.
    Mirror,
}

qem_core::named_choice! {
    /// Lower-case name (`"periodic"`, `"mirror"`).
    EdgeMode, "dpc integrate", "edge mode", { Periodic => "periodic", Mirror => "mirror" }
}

/// Centre of mass per scan position, detector pixels.
#[derive(Debug, Clone, PartialEq)]
pub struct ComField {
    /// `μ_r`, one value per frame.
    pub com_row: Vec<f64>,
    /// `μ_c`, one value per frame.
    pub com_col: Vec<f64>,
    /// Frames with `S = 0` (all zero, or fully masked): their CoM is 0 before centring.
    pub zero_frames: u64,
}

/// Centre of mass `μ = m / S` (f64) from exact moments; origin = detector pixel (0, 0).
///
/// A frame with `S = 0` gives `μ = 0` and is counted in [`ComField::zero_frames`]. With
/// `centered`, the scan mean of each component is subtracted, the zero frames included in the
/// mean (as the anchor does), so that a constant descan offset or the beam centre position
/// disappears. The three moment vectors hold one value per frame, as every reduction gives
/// them; should they differ in length, only the frames present in all three are used.
pub fn com_from_moments(m: &Moments, centered: bool) -> ComField {
    debug_assert!(m.sum.len() == m.m_row.len() && m.sum.len() == m.m_col.len());
    let n = m.sum.len();
    let mut com_row = vec![0.0; n];
    let mut com_col = vec![0.0; n];
    // One pass computes every frame's CoM and, per chunk of ORDERED_CHUNK frames, the sums the
    // centring needs — the chunks and order of `ordered_sums`, so the mean has the same bits as
    // `subtract_mean`'s; a second pass centres. (Two parallel regions, not six: each region is
    // as slow as its slowest worker, and the device host's workers are sometimes late.)
    let parts: Vec<(f64, f64, u64)> = com_row
        .par_chunks_mut(ORDERED_CHUNK)
        .zip(com_col.par_chunks_mut(ORDERED_CHUNK))
        .enumerate()
        .map(|(j, (r, c))| {
            let base = j * ORDERED_CHUNK;
            let (mut sr, mut sc, mut zeros) = (0.0f64, 0.0f64, 0u64);
            for (k, (a, b)) in r.iter_mut().zip(c.iter_mut()).enumerate() {
                let i = base + k;
                let s = m.sum[i];
                if s == 0 {
                    zeros += 1;
                } else {
                    *a = m.m_row[i] as f64 / s as f64;
                    *b = m.m_col[i] as f64 / s as f64;
                }
                sr += *a;
                sc += *b;
            }
            (sr, sc, zeros)
        })
        .collect();
    let zero_frames = parts.iter().map(|p| p.2).sum();
    if centered && n > 0 {
        let (mut tr, mut tc) = (0.0f64, 0.0f64);
        for p in &parts {
            tr += p.0;
            tc += p.1;
        }
        let (mr, mc) = (tr / n as f64, tc / n as f64);
        com_row
            .par_chunks_mut(ORDERED_CHUNK)
            .zip(com_col.par_chunks_mut(ORDERED_CHUNK))
            .for_each(|(r, c)| {
                r.iter_mut().for_each(|x| *x -= mr);
                c.iter_mut().for_each(|x| *x -= mc);
            });
    }
    ComField {
        com_row,
        com_col,
        zero_frames,
    }
}

/// Subtract the mean (nothing for an empty slice).
fn subtract_mean(v: &mut [f64]) {
    if v.is_empty() {
        return;
    }
    let mean = ordered_sums(v.len(), |i| [v[i]])[0] / v.len() as f64;
    v.par_iter_mut().for_each(|x| *x -= mean);
}

/// Check that a pair of scan fields matches `shape`.
fn check_field(op: &str, a: &[f64], b: &[f64], shape: Shape2) -> Result<()> {
    for (name, v) in [("row component", a), ("column component", b)] {
        if v.len() != shape.len() {
            return Err(
                Error::invalid(op, format!("{name} does not match the scan"))
                    .with_expected(format!("{} values ({shape})", shape.len()))
                    .with_found(format!("{} values", v.len())),
            );
        }
        if let Some((i, x)) = v.iter().enumerate().find(|(_, x)| !x.is_finite()) {
            return Err(Error::invalid(
                op,
                format!(
                    "{name} at scan position ({}, {}) is not finite",
                    i / shape.cols.max(1),
                    i % shape.cols.max(1)
                ),
            )
            .with_expected("finite values")
            .with_found(x.to_string()));
        }
    }
    Ok(())
}

/// The three scalar moments of a field's interior curl and divergence that determine the mean
/// squared curl of the field rotated by any θ (anchor §5):
/// `⟨curl_θ²⟩ = A cos²θ + B sin²θ + 2C sinθ cosθ`.
///
/// Central differences on the scan grid, interior positions `1..N−2` along both axes:
/// `curl = ½[g_c(r+1,c) − g_c(r−1,c)] − ½[g_r(r,c+1) − g_r(r,c−1)]`,
/// `div  = ½[g_r(r+1,c) − g_r(r−1,c)] + ½[g_c(r,c+1) − g_c(r,c−1)]`; rotating the field by θ
/// gives `curl_θ = cosθ·curl + sinθ·div`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CurlMoments {
    /// `A = ⟨curl²⟩` of the unrotated field.
    pub curl2: f64,
    /// `B = ⟨div²⟩` of the unrotated field.
    pub div2: f64,
    /// `C = ⟨curl·div⟩` of the unrotated field.
    pub curl_div: f64,
    /// Interior positions averaged over, `(N_r − 2)(N_c − 2)`.
    pub n_interior: usize,
}

impl CurlMoments {
    /// The moments of `(g_row, g_col)` on `shape`, which must be at least 3 × 3.
    pub fn of(g_row: &[f64], g_col: &[f64], shape: Shape2) -> Result<CurlMoments> {
        Ok(Self::pair_of(g_row, g_col, shape)?.0)
    }

    /// The moments of `(g_row, g_col)` and of the transposed field `(g_col, g_row)` from one
    /// pass (the same four central differences serve both: the transposed field's curl is
    /// `∂_r g_r − ∂_c g_c` and its divergence `∂_r g_c + ∂_c g_r`). Rows are summed in parallel
    /// and their partial sums added in row order, so the result does not depend on the thread
    /// count; `pair_of(a, b).1 == of(b, a)` exactly.
    pub fn pair_of(
        g_row: &[f64],
        g_col: &[f64],
        shape: Shape2,
    ) -> Result<(CurlMoments, CurlMoments)> {
        const OP: &str = "dpc rotation";
        check_field(OP, g_row, g_col, shape)?;
        if shape.rows < 3 || shape.cols < 3 {
            return Err(Error::invalid(OP, "the scan has no interior for the curl")
                .with_expected("at least 3 x 3 scan positions")
                .with_found(shape.to_string()));
        }
        let c = shape.cols;
        let rows: Vec<[f64; 6]> = (1..shape.rows - 1)
            .into_par_iter()
            .map(|r| {
                // The rows above, at and below r, as slices (no index checks in the loop).
                let (up_r, mid_r, dn_r) = (
                    &g_row[(r - 1) * c..r * c],
                    &g_row[r * c..(r + 1) * c],
                    &g_row[(r + 1) * c..(r + 2) * c],
                );
                let (up_c, mid_c, dn_c) = (
                    &g_col[(r - 1) * c..r * c],
                    &g_col[r * c..(r + 1) * c],
                    &g_col[(r + 1) * c..(r + 2) * c],
                );
                let (mut a, mut b, mut cd, mut at, mut bt, mut cdt) =
                    (0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
                for k in 1..c - 1 {
                    let d_r_gc = 0.5 * (dn_c[k] - up_c[k]);
                    let d_c_gr = 0.5 * (mid_r[k + 1] - mid_r[k - 1]);
                    let d_r_gr = 0.5 * (dn_r[k] - up_r[k]);
                    let d_c_gc = 0.5 * (mid_c[k + 1] - mid_c[k - 1]);
                    let (curl, div) = (d_r_gc - d_c_gr, d_r_gr + d_c_gc);
                    let (curl_t, div_t) = (d_r_gr - d_c_gc, d_r_gc + d_c_gr);
                    a += curl * curl;
                    b += div * div;
                    cd += curl * div;
                    at += curl_t * curl_t;
                    bt += div_t * div_t;
                    cdt += curl_t * div_t;
                }
                [a, b, cd, at, bt, cdt]
            })
            .collect();
        Ok(Self::pair_from_rows(&rows, shape))
    }

    /// The pair of [`CurlMoments::pair_of`] from its per-row sums: `rows[r − 1]` holds interior
    /// row r's `Σ curl², Σ div², Σ curl·div` of the field and then of the transposed field,
    /// each summed over `k = 1 .. N_c − 2` in order from 0.0 (wherever they were summed: the
    /// CUDA engine sums the rows on the card). The rows are added in row order.
    pub fn pair_from_rows(rows: &[[f64; 6]], shape: Shape2) -> (CurlMoments, CurlMoments) {
        let mut t = [0.0f64; 6];
        for row in rows {
            for (a, b) in t.iter_mut().zip(row) {
                *a += b;
            }
        }
        let n = shape.rows.saturating_sub(2) * shape.cols.saturating_sub(2);
        let m = |a: f64, b: f64, cd: f64| CurlMoments {
            curl2: a / n as f64,
            div2: b / n as f64,
            curl_div: cd / n as f64,
            n_interior: n,
        };
        (m(t[0], t[1], t[2]), m(t[3], t[4], t[5]))
    }

    /// Mean squared interior curl of the field rotated by `theta` (rad).
    pub fn score(&self, theta: f64) -> f64 {
        let (s, c) = theta.sin_cos();
        self.curl2 * c * c + self.div2 * s * s + 2.0 * self.curl_div * s * c
    }

    /// The θ in `[0, π)` that minimises [`CurlMoments::score`], in closed form: with
    /// `M = (A+B)/2`, `P = (A−B)/2`, `score = M + P cos 2θ + C sin 2θ = M + R cos(2θ − ψ)`,
    /// `R = √(P² + C²)`, `ψ = atan2(C, P)`, so the minimum `M − R` lies at `θ = (ψ + π)/2`.
    pub fn argmin(&self) -> f64 {
        let p = 0.5 * (self.curl2 - self.div2);
        let theta = 0.5 * (self.curl_div.atan2(p) + PI);
        if theta >= PI {
            theta - PI
        } else {
            theta
        }
    }

    /// `A + B = ⟨curl² + div²⟩`, which rotation does not change: the scale against which a curl
    /// is small or large.
    pub fn total(&self) -> f64 {
        self.curl2 + self.div2
    }

    /// `R / M`: how strongly the score depends on θ (0 = not at all, e.g. a zero field or a
    /// field with as much curl as divergence in every direction; 1 = fully determined).
    pub fn contrast(&self) -> f64 {
        let m = 0.5 * self.total();
        if m > 0.0 {
            (0.25 * (self.curl2 - self.div2).powi(2) + self.curl_div.powi(2)).sqrt() / m
        } else {
            0.0
        }
    }
}

/// Below this [`CurlMoments::contrast`] the rotation is reported as not determined: the
/// score then changes by less than 1e-9 of its size over all angles.
pub const ROTATION_MIN_CONTRAST: f64 = 1e-9;

/// Minimum of `score` over `[0, π)` for one candidate (normal or transposed).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RotationCandidate {
    /// Whether the components were exchanged before the rotation.
    pub transpose: bool,
    /// The minimising angle, rad, in `[0, π)`.
    pub rotation_rad: f64,
    /// The minimum mean squared curl.
    pub score: f64,
    /// The moments it came from.
    pub moments: CurlMoments,
    /// How the minimum was found: `"closed form"` (checked on the grid) or
    /// `"grid + golden section"` (when the grid found a lower value, which only rounding can
    /// cause).
    pub method: &'static str,
}

/// The rotation (and transpose) that makes a CoM field curl-free.
#[derive(Debug, Clone, PartialEq)]
pub struct RotationFit {
    /// θ in `[0, π)`, rad; θ + π has the same curl ([`resolve_sign`] picks between them).
    pub rotation_rad: f64,
    /// Whether `(μ_r, μ_c)` are exchanged before the rotation (a mirrored detector).
    pub transpose: bool,
    /// Minimum mean squared interior curl (field units² per scan step²).
    pub score: f64,
    /// `score / ⟨curl² + div²⟩` ∈ `[0, ½]`: the fraction of the field's derivative energy that
    /// stays rotational after alignment (0 for a pure gradient field).
    pub curl_score: f64,
    /// False when the scan is smaller than 3 × 3 or the score does not depend on θ (then θ = 0,
    /// no transpose).
    pub determined: bool,
    /// The candidates compared (one when the transpose was given).
    pub candidates: Vec<RotationCandidate>,
    /// How the result was reached, in words.
    pub method: String,
}

/// Minimise one candidate's score: the closed form, checked against a grid of
/// [`ROTATION_GRID_STEP_DEG`] over `[0, π)`, refined by golden section around the grid's best
/// point if the grid ever beats the closed form (rounding only).
fn minimise(m: CurlMoments, transpose: bool) -> RotationCandidate {
    let theta = m.argmin();
    let best = m.score(theta);
    let steps = (180.0 / ROTATION_GRID_STEP_DEG).round() as usize;
    let step = PI / steps as f64;
    let (mut g_theta, mut g_best) = (0.0, f64::INFINITY);
    for j in 0..steps {
        let t = j as f64 * step;
        let s = m.score(t);
        if s < g_best {
            (g_theta, g_best) = (t, s);
        }
    }
    let tol = 1e-12 * m.total().max(f64::MIN_POSITIVE);
    if best <= g_best + tol {
        return RotationCandidate {
            transpose,
            rotation_rad: theta,
            score: best,
            moments: m,
            method: "closed form",
        };
    }
    // Golden section on [g − step, g + step] (the score is smooth with one minimum per π).
    let inv_phi = (5f64.sqrt() - 1.0) / 2.0;
    let (mut lo, mut hi) = (g_theta - step, g_theta + step);
    while hi - lo > 1e-9 {
        let a = hi - inv_phi * (hi - lo);
        let b = lo + inv_phi * (hi - lo);
        if m.score(a) < m.score(b) {
            hi = b;
        } else {
            lo = a;
        }
    }
    let t = (0.5 * (lo + hi)).rem_euclid(PI);
    RotationCandidate {
        transpose,
        rotation_rad: t,
        score: m.score(t),
        moments: m,
        method: "grid + golden section",
    }
}

/// The rotation θ ∈ `[0, π)` and transpose that minimise the mean squared interior curl of
/// the aligned field [`align`]`(com_row, com_col, θ, transpose)`.
///
/// `transpose: None` compares both candidates (the lower minimum wins; a tie within 1e-12 of
/// the scale keeps the normal one); `Some(t)` fixes it. A scan smaller than 3 × 3 has no
/// interior: θ = 0, no transpose (unless given), `determined = false`.
pub fn fit_rotation(
    com_row: &[f64],
    com_col: &[f64],
    shape: Shape2,
    transpose: Option<bool>,
) -> Result<RotationFit> {
    check_field("dpc rotation", com_row, com_col, shape)?;
    let pair = if shape.rows < 3 || shape.cols < 3 {
        None
    } else {
        Some(CurlMoments::pair_of(com_row, com_col, shape)?)
    };
    Ok(fit_rotation_from(pair, shape, transpose))
}

/// [`fit_rotation`] from the field's curl moments `(normal, transposed)`
/// ([`CurlMoments::pair_of`], computed wherever the field lives: the CUDA engine sums them on
/// the card); `None` for a scan `shape` smaller than 3 × 3.
pub fn fit_rotation_from(
    pair: Option<(CurlMoments, CurlMoments)>,
    shape: Shape2,
    transpose: Option<bool>,
) -> RotationFit {
    let Some((normal, transposed)) = pair else {
        return RotationFit {
            rotation_rad: 0.0,
            transpose: transpose.unwrap_or(false),
            score: 0.0,
            curl_score: 0.0,
            determined: false,
            candidates: Vec::new(),
            method: format!("scan {shape} is smaller than 3 x 3: no interior curl, θ = 0"),
        };
    };
    let options: &[bool] = match transpose {
        None => &[false, true],
        Some(false) => &[false],
        Some(true) => &[true],
    };
    let candidates: Vec<RotationCandidate> = options
        .iter()
        .map(|&t| minimise(if t { transposed } else { normal }, t))
        .collect();
    let mut best = candidates[0];
    for c in &candidates[1..] {
        if c.score < best.score - 1e-12 * best.moments.total() {
            best = *c;
        }
    }
    let total = best.moments.total();
    let curl_score = if total > 0.0 { best.score / total } else { 0.0 };
    if best.moments.contrast() < ROTATION_MIN_CONTRAST {
        return RotationFit {
            rotation_rad: 0.0,
            transpose: transpose.unwrap_or(false),
            score: best.score,
            curl_score,
            determined: false,
            candidates,
            method: "the curl does not depend on the rotation (zero or isotropic field): θ = 0"
                .to_string(),
        };
    }
    RotationFit {
        rotation_rad: best.rotation_rad,
        transpose: best.transpose,
        score: best.score,
        curl_score,
        determined: true,
        candidates,
        method: format!(
            "minimum mean squared interior curl, {} (checked on a {ROTATION_GRID_STEP_DEG}° grid)",
            best.method
        ),
    }
}

/// The CoM field in the scan frame: exchange the components if `transpose`, then rotate by
/// `theta` (rad): `g_r = cosθ·a − sinθ·b`, `g_c = sinθ·a + cosθ·b` with `(a, b) = (μ_r, μ_c)`
/// or `(μ_c, μ_r)`.
///
/// Unlike the anchor, the transposed field is not exchanged back after the rotation: the
/// rotated field is the one the curl search made curl-free, i.e. the gradient to integrate.
pub fn align(
    com_row: &[f64],
    com_col: &[f64],
    theta: f64,
    transpose: bool,
) -> (Vec<f64>, Vec<f64>) {
    let (a, b) = if transpose {
        (com_col, com_row)
    } else {
        (com_row, com_col)
    };
    let (s, c) = theta.sin_cos();
    a.par_iter()
        .zip(b)
        .map(|(&x, &y)| (c * x - s * y, s * x + c * y))
        .unzip()
}

/// The chunk of [`ordered_sums`] (and of [`com_from_moments`]' centring sums): the vocabulary's,
/// shared with the CUDA engine's centre of mass.
use qem_core::reduce::ORDERED_CHUNK;

/// `Σ_i f(i)` for `i < n`, K sums at once, in parallel but in a fixed order (chunks of 8192
/// indices summed serially, then the chunk sums in chunk order): the same bits whatever the
/// thread count.
fn ordered_sums<const K: usize>(n: usize, f: impl Fn(usize) -> [f64; K] + Sync) -> [f64; K] {
    let parts: Vec<[f64; K]> = (0..n.div_ceil(ORDERED_CHUNK))
        .into_par_iter()
        .map(|j| {
            let mut t = [0.0f64; K];
            for i in j * ORDERED_CHUNK..((j + 1) * ORDERED_CHUNK).min(n) {
                for (a, b) in t.iter_mut().zip(f(i)) {
                    *a += b;
                }
            }
            t
        })
        .collect();
    let mut t = [0.0f64; K];
    for p in &parts {
        for (a, b) in t.iter_mut().zip(p) {
            *a += b;
        }
    }
    t
}

/// `numpy.fft.fftfreq(n)[i]`: cycles per sample.
fn fftfreq(i: usize, n: usize) -> f64 {
    if i < n.div_ceil(2) {
        i as f64 / n as f64
    } else {
        (i as f64 - n as f64) / n as f64
    }
}

/// An unnormalised 2-D DFT in place, rows then columns (any sizes).
struct Fft2 {
    cols: usize,
    row_fft: Arc<dyn Fft<f64>>,
    col_fft: Arc<dyn Fft<f64>>,
    scratch: Vec<Complex64>,
    column: Vec<Complex64>,
}

impl Fft2 {
    fn new(planner: &mut FftPlanner<f64>, rows: usize, cols: usize, dir: FftDirection) -> Fft2 {
        let row_fft = planner.plan_fft(cols, dir);
        let col_fft = planner.plan_fft(rows, dir);
        let n = row_fft
            .get_inplace_scratch_len()
            .max(col_fft.get_inplace_scratch_len());
        Fft2 {
            cols,
            row_fft,
            col_fft,
            scratch: vec![Complex64::new(0.0, 0.0); n],
            column: vec![Complex64::new(0.0, 0.0); rows],
        }
    }

    fn process(&mut self, buf: &mut [Complex64]) {
        for row in buf.chunks_exact_mut(self.cols) {
            self.row_fft.process_with_scratch(row, &mut self.scratch);
        }
        for j in 0..self.cols {
            for (i, v) in self.column.iter_mut().enumerate() {
                *v = buf[i * self.cols + j];
            }
            self.col_fft
                .process_with_scratch(&mut self.column, &mut self.scratch);
            for (i, v) in self.column.iter().enumerate() {
                buf[i * self.cols + j] = *v;
            }
        }
    }
}

/// Periodic least-squares integration on a `rows × cols` grid (inputs already checked).
fn integrate_periodic(g_row: &[f64], g_col: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    let mut planner = FftPlanner::<f64>::new();
    let mut fwd = Fft2::new(&mut planner, rows, cols, FftDirection::Forward);
    let mut inv = Fft2::new(&mut planner, rows, cols, FftDirection::Inverse);
    let mut a: Vec<Complex64> = g_row.iter().map(|&x| Complex64::new(x, 0.0)).collect();
    let mut b: Vec<Complex64> = g_col.iter().map(|&x| Complex64::new(x, 0.0)).collect();
    fwd.process(&mut a);
    fwd.process(&mut b);
    for i in 0..rows {
        let nu_r = fftfreq(i, rows);
        for j in 0..cols {
            let nu_c = fftfreq(j, cols);
            let d = nu_r * nu_r + nu_c * nu_c;
            let k = i * cols + j;
            a[k] = if d == 0.0 {
                Complex64::new(0.0, 0.0)
            } else {
                // −i (ν·ĝ) / (2π|ν|²)
                let dot = a[k] * nu_r + b[k] * nu_c;
                Complex64::new(dot.im, -dot.re) / (2.0 * PI * d)
            };
        }
    }
    inv.process(&mut a);
    let norm = 1.0 / (rows * cols) as f64;
    a.iter().map(|z| z.re * norm).collect()
}

/// The phase φ whose gradient best matches `(g_row, g_col)` in the least-squares sense:
/// `φ̂(ν) = −i (ν_r ĝ_r + ν_c ĝ_c) / (2π |ν|²)`, `φ̂(0) = 0`, with `ν = fftfreq` in cycles per
/// scan step (any sizes, including odd and non-power-of-two), so that `∂φ/∂(scan step) ≈ g`.
/// The phase has zero mean and the unit of the field times one scan step.
///
/// [`EdgeMode::Mirror`] integrates the even extension to `2N_r × 2N_c` (row component negated
/// in the row-mirrored half, column component in the column-mirrored half, as the gradient of
/// the mirrored phase is) and returns its top-left quarter with the mean removed.
pub fn integrate(g_row: &[f64], g_col: &[f64], shape: Shape2, edge: EdgeMode) -> Result<Vec<f64>> {
    integrate_with(g_row, g_col, shape, edge, |a, b, r, c| {
        Ok(integrate_periodic(a, b, r, c))
    })
}

/// [`integrate`] with another periodic solver `periodic(g_row, g_col, rows, cols)` (e.g. the
/// GPU's cuFFT one, `qem_cuda::fft::integrate_periodic`), which must compute what this module's
/// periodic solver computes; the checks and the mirror extension stay here.
pub fn integrate_with<F>(
    g_row: &[f64],
    g_col: &[f64],
    shape: Shape2,
    edge: EdgeMode,
    periodic: F,
) -> Result<Vec<f64>>
where
    F: FnOnce(&[f64], &[f64], usize, usize) -> Result<Vec<f64>>,
{
    const OP: &str = "dpc integrate";
    check_field(OP, g_row, g_col, shape)?;
    if shape.is_empty() {
        return Err(Error::invalid(OP, "empty scan")
            .with_expected("at least 1 x 1 scan positions")
            .with_found(shape.to_string()));
    }
    let (rows, cols) = (shape.rows, shape.cols);
    match edge {
        EdgeMode::Periodic => periodic(g_row, g_col, rows, cols),
        EdgeMode::Mirror => {
            let (er, ec) = (2 * rows, 2 * cols);
            let mut xr = vec![0.0; er * ec];
            let mut xc = vec![0.0; er * ec];
            for i in 0..er {
                let (si, sr) = if i < rows {
                    (i, 1.0)
                } else {
                    (er - 1 - i, -1.0)
                };
                for j in 0..ec {
                    let (sj, sc) = if j < cols {
                        (j, 1.0)
                    } else {
                        (ec - 1 - j, -1.0)
                    };
                    xr[i * ec + j] = sr * g_row[si * cols + sj];
                    xc[i * ec + j] = sc * g_col[si * cols + sj];
                }
            }
            let ext = periodic(&xr, &xc, er, ec)?;
            let mut phi: Vec<f64> = (0..rows)
                .flat_map(|i| ext[i * ec..i * ec + cols].iter().copied())
                .collect();
            subtract_mean(&mut phi);
            Ok(phi)
        }
    }
}

/// Pearson correlation of two equally long series; `None` when either is constant, they
/// differ in length, or they hold fewer than 2 values.
pub fn pearson(a: &[f64], b: &[f64]) -> Option<f64> {
    if a.len() != b.len() || a.len() < 2 {
        return None;
    }
    let n = a.len() as f64;
    let [sa, sb] = ordered_sums(a.len(), |i| [a[i], b[i]]);
    let (ma, mb) = (sa / n, sb / n);
    let [sab, saa, sbb] = ordered_sums(a.len(), |i| {
        let (dx, dy) = (a[i] - ma, b[i] - mb);
        [dx * dy, dx * dx, dy * dy]
    });
    pearson_of(sab, saa, sbb)
}

/// Pearson's r from the centred sums `Σ dx·dy, Σ dx², Σ dy²`; `None` when not finite.
fn pearson_of(sab: f64, saa: f64, sbb: f64) -> Option<f64> {
    let r = sab / (saa * sbb).sqrt();
    r.is_finite().then_some(r)
}

/// Population skewness from the centred sums `Σ d², Σ d³` of `n` values.
fn skewness_of(s2: f64, s3: f64, n: f64) -> Option<f64> {
    let (m2, m3) = (s2 / n, s3 / n);
    let s = m3 / m2.powf(1.5);
    (m2 > 0.0 && s.is_finite()).then_some(s)
}

/// Population skewness `m₃ / m₂^{3/2}`; `None` for a constant series or fewer than 3 values.
pub fn skewness(a: &[f64]) -> Option<f64> {
    if a.len() < 3 {
        return None;
    }
    let n = a.len() as f64;
    let m = ordered_sums(a.len(), |i| [a[i]])[0] / n;
    let [m2, m3] = ordered_sums(a.len(), |i| {
        let d = a[i] - m;
        [d * d, d * d * d]
    });
    skewness_of(m2, m3, n)
}

/// `(pearson(phase, adf), skewness(phase))` with the same bits, in two parallel regions instead
/// of four when both are computed: the phase sum and `Σ d²` are shared (each region is as slow as
/// its slowest worker).
fn sign_statistics(phase: &[f64], adf: Option<&[f64]>) -> (Option<f64>, Option<f64>) {
    let Some(b) = adf.filter(|b| b.len() == phase.len() && phase.len() >= 3) else {
        return (adf.and_then(|b| pearson(phase, b)), skewness(phase));
    };
    let a = phase;
    let n = a.len() as f64;
    let [sa, sb] = ordered_sums(a.len(), |i| [a[i], b[i]]);
    let (ma, mb) = (sa / n, sb / n);
    let sums = ordered_sums(a.len(), |i| {
        let (dx, dy) = (a[i] - ma, b[i] - mb);
        [dx * dy, dx * dx, dy * dy, dx * dx * dx]
    });
    sign_statistics_from(a.len(), true, sums)
}

/// `(pearson(phase, adf), skewness(phase))` from the centred sums of `n` values,
/// `[Σ dx·dy, Σ dx², Σ dy², Σ dx²·dx]` (`dy = 0` without the image): Pearson's r needs the
/// image and 2 values, the skewness 3. The sums may come from either engine (the CUDA engine
/// forms them on the card in this module's chunk order).
pub fn sign_statistics_from(
    n: usize,
    has_adf: bool,
    [sab, saa, sbb, sa3]: [f64; 4],
) -> (Option<f64>, Option<f64>) {
    let r = (has_adf && n >= 2)
        .then(|| pearson_of(sab, saa, sbb))
        .flatten();
    let s = (n >= 3).then(|| skewness_of(saa, sa3, n as f64)).flatten();
    (r, s)
}

/// Which criterion fixed the sign of the phase (θ vs θ + π).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SignCriterion {
    /// Pearson correlation of the phase with the ADF image, made positive.
    AdfCorrelation,
    /// Skewness of the phase, made positive.
    PhaseSkewness,
    /// No statistic was available (e.g. a constant phase): the sign was left as it was.
    None,
}

impl SignCriterion {
    /// Name used in results (`"adf_correlation"`, `"phase_skewness"`, `"none"`).
    pub fn name(self) -> &'static str {
        match self {
            SignCriterion::AdfCorrelation => "adf_correlation",
            SignCriterion::PhaseSkewness => "phase_skewness",
            SignCriterion::None => "none",
        }
    }
}

/// The outcome of [`resolve_sign`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SignDecision {
    /// Negate the phase (and the aligned field; θ → θ + π).
    pub flip: bool,
    /// The criterion that decided.
    pub criterion: SignCriterion,
    /// |statistic| of the deciding criterion: |Pearson r| (0..1) for the ADF correlation,
    /// |skewness| for the skewness; 0 with [`SignCriterion::None`].
    pub confidence: f64,
    /// Whether that statistic reached its threshold ([`SIGN_MIN_ADF_CORRELATION`],
    /// [`SIGN_MIN_SKEWNESS`]).
    pub confident: bool,
    /// Pearson r of the phase before any flip with the ADF image, when available.
    pub adf_correlation: Option<f64>,
    /// Skewness of the phase before any flip.
    pub skewness: Option<f64>,
}

/// Choose the sign of `phase` (θ or θ + π): positive correlation with `adf` when that is
/// confident (|r| ≥ [`SIGN_MIN_ADF_CORRELATION`]); otherwise positive skewness when that is
/// confident (|skew| ≥ [`SIGN_MIN_SKEWNESS`]); otherwise the first available of the two decides
/// without confidence.
pub fn resolve_sign(phase: &[f64], adf: Option<&[f64]>) -> SignDecision {
    let (r, s) = sign_statistics(phase, adf);
    decide_sign(r, s)
}

/// [`resolve_sign`]'s rule on the statistics `r = pearson(phase, adf)` and
/// `s = skewness(phase)`, computed wherever the phase lives (the CUDA engine sums them on the
/// card in this module's chunk order, from [`pearson_of`] and [`skewness_of`]).
pub fn decide_sign(r: Option<f64>, s: Option<f64>) -> SignDecision {
    let decide = |criterion, stat: f64, confident| SignDecision {
        flip: stat < 0.0,
        criterion,
        confidence: stat.abs(),
        confident,
        adf_correlation: r,
        skewness: s,
    };
    match (r, s) {
        (Some(r), _) if r.abs() >= SIGN_MIN_ADF_CORRELATION => {
            decide(SignCriterion::AdfCorrelation, r, true)
        }
        (_, Some(s)) if s.abs() >= SIGN_MIN_SKEWNESS => {
            decide(SignCriterion::PhaseSkewness, s, true)
        }
        (Some(r), _) => decide(SignCriterion::AdfCorrelation, r, false),
        (None, Some(s)) => decide(SignCriterion::PhaseSkewness, s, false),
        (None, None) => SignDecision {
            flip: false,
            criterion: SignCriterion::None,
            confidence: 0.0,
            confident: false,
            adf_correlation: None,
            skewness: None,
        },
    }
}

/// Relativistic electron wavelength in Å for `voltage_kv` kV (shared physics, in
/// `qem_core::optics`).
pub use qem_core::optics::electron_wavelength_a;

#[cfg(test)]
mod tests {
    #[test]
    fn sign_statistics_equal_pearson_and_skewness_bit_for_bit() {
        use super::*;
        let mix = |i: u64| ((i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 33) % 100_003) as f64 / 1e4;
        for n in [3usize, 10, ORDERED_CHUNK + 7, 3 * ORDERED_CHUNK] {
            let phase: Vec<f64> = (0..n as u64)
                .map(|i| mix(i) - 5.0 + (i % 7) as f64)
                .collect();
            let adf: Vec<f64> = (0..n as u64)
                .map(|i| mix(i ^ 0x1234) + 0.3 * phase[i as usize])
                .collect();
            let (r, s) = sign_statistics(&phase, Some(&adf));
            assert_eq!(
                r.map(f64::to_bits),
                pearson(&phase, &adf).map(f64::to_bits),
                "n {n}"
            );
            assert_eq!(
                s.map(f64::to_bits),
                skewness(&phase).map(f64::to_bits),
                "n {n}"
            );
            assert!(r.is_some() && s.is_some());
        }
        // Constant phase: no statistic; no ADF or a short series: the plain functions.
        let flat = vec![1.5; 50];
        assert_eq!(sign_statistics(&flat, Some(&flat)), (None, None));
        let p = [0.0, 1.0, 5.0, 2.0];
        assert_eq!(sign_statistics(&p, None), (None, skewness(&p)));
        assert_eq!(
            sign_statistics(&p[..2], Some(&p[2..])),
            (pearson(&p[..2], &p[2..]), None)
        );
    }

    #[test]
    fn com_from_moments_centres_with_the_ordered_mean() {
        use super::*;
        // 3 chunks and a tail, zero frames included; the reference is the plain per-frame
        // division and `subtract_mean` (the ordered sums), compared bit for bit.
        let n = 2 * ORDERED_CHUNK + 1234;
        let mix = |i: u64| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) % 1_000_003;
        let m = Moments {
            sum: (0..n as u64)
                .map(|i| if i % 97 == 5 { 0 } else { 1 + mix(i) })
                .collect(),
            m_row: (0..n as u64).map(|i| mix(i ^ 0x55) * 37).collect(),
            m_col: (0..n as u64).map(|i| mix(i ^ 0xaa) * 91).collect(),
        };
        let plain = |centered: bool| {
            let f = |w: &[u64]| -> Vec<f64> {
                (0..n)
                    .map(|i| {
                        if m.sum[i] == 0 {
                            0.0
                        } else {
                            w[i] as f64 / m.sum[i] as f64
                        }
                    })
                    .collect()
            };
            let (mut r, mut c) = (f(&m.m_row), f(&m.m_col));
            if centered {
                subtract_mean(&mut r);
                subtract_mean(&mut c);
            }
            (r, c)
        };
        for centered in [false, true] {
            let got = com_from_moments(&m, centered);
            let (r, c) = plain(centered);
            assert_eq!(
                got.zero_frames,
                (0..n).filter(|i| i % 97 == 5).count() as u64
            );
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got.com_row), bits(&r), "centered {centered}");
            assert_eq!(bits(&got.com_col), bits(&c), "centered {centered}");
        }
        let empty = Moments {
            sum: vec![],
            m_row: vec![],
            m_col: vec![],
        };
        assert!(com_from_moments(&empty, true).com_row.is_empty());
    }

    use super::*;

    /// One pass gives both fields' moments: the transposed one bit-equal to `of` on the
    /// exchanged components, and both equal (to rounding) to a plain serial sum written here.
    #[test]
    fn curl_moment_pair_matches_separate_passes() {
        let shape = Shape2::new(37, 53);
        let n = shape.len();
        let a: Vec<f64> = (0..n)
            .map(|i| (i as f64 * 0.37).sin() + 0.01 * i as f64)
            .collect();
        let b: Vec<f64> = (0..n).map(|i| (i as f64 * 0.11).cos() * 2.0).collect();
        let (m, t) = CurlMoments::pair_of(&a, &b, shape).unwrap();
        assert_eq!(m, CurlMoments::of(&a, &b, shape).unwrap());
        assert_eq!(t, CurlMoments::of(&b, &a, shape).unwrap());
        let naive = |gr: &[f64], gc: &[f64]| {
            let (c, mut s) = (shape.cols, [0.0f64; 3]);
            for r in 1..shape.rows - 1 {
                for k in 1..c - 1 {
                    let i = r * c + k;
                    let curl = 0.5 * (gc[i + c] - gc[i - c]) - 0.5 * (gr[i + 1] - gr[i - 1]);
                    let div = 0.5 * (gr[i + c] - gr[i - c]) + 0.5 * (gc[i + 1] - gc[i - 1]);
                    s[0] += curl * curl;
                    s[1] += div * div;
                    s[2] += curl * div;
                }
            }
            let n = ((shape.rows - 2) * (c - 2)) as f64;
            [s[0] / n, s[1] / n, s[2] / n]
        };
        for (got, want) in [(m, naive(&a, &b)), (t, naive(&b, &a))] {
            for (g, w) in [got.curl2, got.div2, got.curl_div].iter().zip(want) {
                assert!((g - w).abs() <= 1e-12 * w.abs().max(1e-3), "{g} vs {w}");
            }
        }
    }

    /// φ = Σ a·cos(2π(k r/N_r + l c/N_c) + p): periodic and band-limited, with an exact
    /// analytic gradient per scan step.
    #[allow(clippy::type_complexity)]
    fn trig_field(shape: Shape2) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let terms = [
            (1.0, 1i32, 0i32, 0.3),
            (0.5, 2, 3, 1.1),
            (0.25, -3, 1, 2.0),
            (0.7, 0, 2, -0.4),
        ];
        let (nr, nc) = (shape.rows as f64, shape.cols as f64);
        field(shape, |r, c| {
            let (mut phi, mut gr, mut gc) = (0.0, 0.0, 0.0);
            for &(a, k, l, p) in &terms {
                let (wr, wc) = (2.0 * PI * k as f64 / nr, 2.0 * PI * l as f64 / nc);
                let arg = wr * r + wc * c + p;
                phi += a * arg.cos();
                gr -= a * wr * arg.sin();
                gc -= a * wc * arg.sin();
            }
            (phi, gr, gc)
        })
    }

    /// φ and its gradient (∂φ/∂row, ∂φ/∂col) on `shape`, row-major, from `at(row, col)`.
    fn field(
        shape: Shape2,
        at: impl Fn(f64, f64) -> (f64, f64, f64),
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let mut phi = vec![0.0; shape.len()];
        let mut gr = vec![0.0; shape.len()];
        let mut gc = vec![0.0; shape.len()];
        for r in 0..shape.rows {
            for c in 0..shape.cols {
                let i = r * shape.cols + c;
                (phi[i], gr[i], gc[i]) = at(r as f64, c as f64);
            }
        }
        (phi, gr, gc)
    }

    fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
        let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
        let den: f64 = b.iter().map(|y| y * y).sum();
        (num / den).sqrt()
    }

    fn demean(v: &[f64]) -> Vec<f64> {
        let m = v.iter().sum::<f64>() / v.len() as f64;
        v.iter().map(|x| x - m).collect()
    }

    #[test]
    fn integrate_recovers_a_periodic_phase_on_odd_and_even_grids() {
        for shape in [Shape2::new(23, 37), Shape2::new(32, 18), Shape2::new(1, 9)] {
            let (phi, gr, gc) = trig_field(shape);
            let got = integrate(&gr, &gc, shape, EdgeMode::Periodic).unwrap();
            let want = demean(&phi);
            let e = rel_l2(&got, &want);
            assert!(e < 1e-12, "{shape}: rel L2 {e}");
        }
    }

    #[test]
    fn mirror_is_exact_for_an_even_periodic_phase_and_validates_input() {
        // A cosine series with whole half-periods is its own mirror image: mirror integration
        // must reproduce it exactly (tests the sign flips of the mirrored components).
        let shape = Shape2::new(14, 9);
        // cos(π k (r + ½)/N_r) is even about r = −½ and r = N_r − ½.
        let (phi, gr, gc) = field(shape, |r, c| {
            let (wr, wc) = (PI * 2.0 / 14.0, PI * 3.0 / 9.0);
            let (ar, ac) = (wr * (r + 0.5), wc * (c + 0.5));
            (
                ar.cos() * ac.cos() + 0.5 * ac.cos(),
                -wr * ar.sin() * ac.cos(),
                -wc * ar.cos() * ac.sin() - 0.5 * wc * ac.sin(),
            )
        });
        let got = integrate(&gr, &gc, shape, EdgeMode::Mirror).unwrap();
        let e = rel_l2(&got, &demean(&phi));
        assert!(e < 1e-12, "mirror rel L2 {e}");
        assert!(integrate(&gr[1..], &gc, shape, EdgeMode::Mirror).is_err());
        let mut bad = gr.clone();
        bad[5] = f64::NAN;
        let err = integrate(&bad, &gc, shape, EdgeMode::Periodic).unwrap_err();
        assert!(err.to_string().contains("(0, 5)"), "{err}");
        assert!("MIRROR".parse::<EdgeMode>().unwrap() == EdgeMode::Mirror);
        assert!("wrap".parse::<EdgeMode>().is_err());
    }

    #[test]
    fn com_from_moments_divides_counts_zero_frames_and_centres() {
        let m = Moments {
            sum: vec![4, 0, 2, 10],
            m_row: vec![8, 0, 1, 35],
            m_col: vec![2, 0, 6, 0],
        };
        let raw = com_from_moments(&m, false);
        assert_eq!(raw.zero_frames, 1);
        assert_eq!(raw.com_row, vec![2.0, 0.0, 0.5, 3.5]);
        assert_eq!(raw.com_col, vec![0.5, 0.0, 3.0, 0.0]);
        let c = com_from_moments(&m, true);
        // Mean of the rows includes the zero frame: (2 + 0 + 0.5 + 3.5)/4 = 1.5.
        assert_eq!(c.com_row, vec![0.5, -1.5, -1.0, 2.0]);
        assert_eq!(c.com_col, vec![-0.375, -0.875, 2.125, -0.875]);
    }

    /// Sum of Gaussians and its analytic gradient; measured field = R(−θ)·G (or that
    /// exchanged when `transpose`), so aligning by θ (and transpose) recovers G.
    #[allow(clippy::type_complexity)]
    fn gaussian_field(
        shape: Shape2,
        theta: f64,
        transpose: bool,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let blobs = [
            (7.3, 5.1, 2.5, 1.0),
            (15.2, 20.7, 3.0, 0.8),
            (3.0, 28.0, 2.2, 1.3),
            (20.0, 9.0, 4.0, -0.6),
        ];
        let n = shape.len();
        let (mut phi, mut gr, mut gc) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        for r in 0..shape.rows {
            for c in 0..shape.cols {
                let i = r * shape.cols + c;
                for &(r0, c0, s, a) in &blobs {
                    let (dr, dc) = (r as f64 - r0, c as f64 - c0);
                    let v = a * (-(dr * dr + dc * dc) / (2.0 * s * s)).exp();
                    phi[i] += v;
                    gr[i] += -dr / (s * s) * v;
                    gc[i] += -dc / (s * s) * v;
                }
            }
        }
        let (s, c) = theta.sin_cos();
        let (mr, mc): (Vec<f64>, Vec<f64>) = gr
            .iter()
            .zip(&gc)
            .map(|(&x, &y)| (c * x + s * y, -s * x + c * y))
            .unzip();
        if transpose {
            (phi, mc, mr)
        } else {
            (phi, mr, mc)
        }
    }

    #[test]
    fn rotation_and_transpose_are_recovered() {
        let shape = Shape2::new(29, 35);
        for transpose in [false, true] {
            for deg in [23.0, 0.0, 97.5, 170.0] {
                let theta = f64::to_radians(deg);
                let (_, mr, mc) = gaussian_field(shape, theta, transpose);
                let fit = fit_rotation(&mr, &mc, shape, None).unwrap();
                assert!(fit.determined);
                assert_eq!(fit.transpose, transpose, "{deg}°");
                let got = fit.rotation_rad.to_degrees();
                let err = (got - deg + 90.0).rem_euclid(180.0) - 90.0;
                eprintln!(
                    "{deg}° transpose {transpose}: error {err:.2e}°, curl {:.1e}",
                    fit.curl_score
                );
                assert!(err.abs() < 0.1, "{deg}° transpose {transpose}: got {got}");
                assert!(fit.curl_score < 1e-3, "{}", fit.curl_score);
            }
        }
    }

    #[test]
    fn closed_form_matches_a_naive_angle_scan_of_the_rotated_curl() {
        // Independent check: rotate the field explicitly at each angle and compute the interior
        // curl with a naive loop; the closed-form minimum must be no worse than any of them.
        let shape = Shape2::new(11, 13);
        let mr: Vec<f64> = (0..shape.len())
            .map(|i| ((i * 37 % 17) as f64).sin())
            .collect();
        let mc: Vec<f64> = (0..shape.len())
            .map(|i| ((i * 11 % 23) as f64).cos())
            .collect();
        let naive = |theta: f64| {
            let (g_r, g_c) = align(&mr, &mc, theta, false);
            let mut acc = 0.0;
            for r in 1..shape.rows - 1 {
                for c in 1..shape.cols - 1 {
                    let i = r * shape.cols + c;
                    let curl = 0.5 * (g_c[i + shape.cols] - g_c[i - shape.cols])
                        - 0.5 * (g_r[i + 1] - g_r[i - 1]);
                    acc += curl * curl;
                }
            }
            acc / ((shape.rows - 2) * (shape.cols - 2)) as f64
        };
        let fit = fit_rotation(&mr, &mc, shape, Some(false)).unwrap();
        let best = naive(fit.rotation_rad);
        assert!((best - fit.score).abs() < 1e-12 * best.max(1.0));
        for j in 0..720 {
            let t = j as f64 * PI / 720.0;
            assert!(naive(t) >= best - 1e-12, "{t}: {} < {best}", naive(t));
        }
    }

    #[test]
    fn small_or_empty_fields_are_not_determined() {
        let shape = Shape2::new(2, 5);
        let f = fit_rotation(&[1.0; 10], &[0.5; 10], shape, None).unwrap();
        assert!(!f.determined && f.rotation_rad == 0.0 && !f.transpose);
        let shape = Shape2::new(4, 4);
        let f = fit_rotation(&[0.0; 16], &[0.0; 16], shape, None).unwrap();
        assert!(!f.determined && f.rotation_rad == 0.0);
        assert!(fit_rotation(&[0.0; 15], &[0.0; 16], shape, None).is_err());
    }

    #[test]
    fn sign_follows_adf_then_skewness() {
        let phase = vec![0.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.5, 0.0];
        let adf: Vec<f64> = phase.iter().map(|p| 10.0 + 2.0 * p).collect();
        let d = resolve_sign(&phase, Some(&adf));
        assert!(!d.flip && d.confident && d.criterion == SignCriterion::AdfCorrelation);
        let neg: Vec<f64> = phase.iter().map(|p| -p).collect();
        let d = resolve_sign(&neg, Some(&adf));
        assert!(d.flip && d.confident && (d.confidence - 1.0).abs() < 1e-12);
        // Constant ADF: the skewness decides (the positive peaks say "not flipped").
        let d = resolve_sign(&neg, Some(&[1.0; 8]));
        assert!(d.flip && d.confident && d.criterion == SignCriterion::PhaseSkewness);
        let d = resolve_sign(&[1.0; 8], None);
        assert!(!d.flip && !d.confident && d.criterion == SignCriterion::None);
    }

    #[test]
    fn pearson_and_skewness_match_hand_values() {
        assert!(
            (pearson(&[1.0, 2.0, 3.0], &[2.0, 4.0, 7.0]).unwrap() - 0.9933992677987828).abs()
                < 1e-12
        );
        assert!(pearson(&[1.0, 1.0], &[0.0, 1.0]).is_none());
        // [0, 0, 3]: mean 1, m2 = 2, m3 = 2 → 2 / 2^1.5.
        assert!((skewness(&[0.0, 0.0, 3.0]).unwrap() - 2f64 / 2f64.powf(1.5)).abs() < 1e-12);
    }
}
