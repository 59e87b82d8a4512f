//! Single-sideband (SSB) ptychography on plain arrays: the CPU reference of docs/science.md
//! §9 "SSB ptychography" (the anchor's §7–8, with the deviations of docs/science.md §10).
//!
//! Units: aberrations in Å (coefficients) and rad (angles), wavelengths in Å, spatial
//! frequencies in Å⁻¹, angles of the optics in rad. Everything is `f64` (the anchor's `f32`
//! loss is not copied: the objective's differences near the optimum are below `f32` noise).
//!
//! The steps, for BF pixel `b` with reciprocal vector `k_b` and scan frequency `ν`:
//!
//! 1. [`chi`]: the Krivanek aberration function
//!    `χ = (2π/λ) Σ C_nm α^(n+1)/(n+1) cos(m(φ − φ_nm))`, so defocus enters as `π C10 α²/λ`.
//! 2. [`probe`]: `P(v) = A(v) exp(−iχ(v))` with the anchor's soft aperture `A`
//!    ([`Optics::aperture`]).
//! 3. [`Prepared::new`]: `G_b(ν)` = unnormalised forward 2-D DFT over the scan of pixel b's
//!    image (the full plane, any scan shape: no crop, no pad).
//! 4. [`gamma`]: the double-overlap ("trotter") transfer
//!    `Γ_b(ν) = P(k_b − ν) P*(k_b) − P(k_b) P*(k_b + ν)`. For a weak phase object
//!    `t = 1 + iφ`, a probe `p(r − R)` with `p = IFT[P]` and frames `|FT[p(r − R) t(r)]|²`,
//!    `G_b(ν) = iΦ(ν) Γ_b(ν)` exactly at first order (Φ = DFT of φ over the scan). The anchor
//!    writes the first factor as `P(ν − k_b)`; that is the same for the centrosymmetric terms
//!    (C10, C12, C30) but breaks the Hermitian symmetry `Γ(−ν) = −Γ(ν)*` that `G` has for
//!    odd terms (C21, C23), so we use the derived form (a test checks the symmetry).
//! 5. [`Prepared::corrected`]: phase-only correction `C_b = G_b Γ_b* / |Γ_b|` (or
//!    `G_b Γ_b* 10⁸` where `|Γ|² ≤ 10⁻¹⁶`), DC replaced by `d = mean_b G_b(0)`.
//! 6. [`Prepared::object`]: `O = IFFT(mean_b C_b)` (normalised by 1/N), phase `arg O`.
//! 7. Objectives ([`Objective`]): the anchor's mean per-position variance of the per-pixel
//!    phases, and the coherence of the data with the SSB model (see [`Objective::Coherence`]).
//! 8. [`fit_with`]: seeded scrambled-Halton global search, then Nelder–Mead from the best few
//!    candidates (on the coarse loss by default), then quadratic-model Newton steps on the
//!    full loss.
//!
//! [`Aberrations`], [`Optics`], [`chi`] and [`chi_polynomial`] live in `qem_core::optics`
//! (shared with the CUDA engine) and are re-exported here.

use qem_core::{DenseArray, Error, Result, Shape2};
use rayon::prelude::*;
use rustfft::num_complex::Complex64;
use rustfft::{Fft, FftDirection, FftPlanner};
use std::f64::consts::PI;
use std::sync::Arc;

use crate::EncodedFrames;

mod coherence;
use coherence::Quadratic;
mod fit;
mod refine;
pub use fit::{fit_with, BatchObjective, Fidelity, FitOutcome, FitSpec};

/// Below this `|Γ|²` the phase-only correction is not defined; the anchor then multiplies by
/// `10⁸` instead of dividing by `|Γ|` (which keeps such terms negligible, not exploded).
pub const GAMMA_FLOOR_SQ: f64 = 1e-16;

/// A frequency whose `Σ_b |Γ_b(ν)|²` is at most this adds nothing to the coherence loss (no
/// pixel transfers it; the f32 kernel's rounding stays far below).
pub const GAMMA_SUM_FLOOR: f64 = 1e-12;

pub use qem_core::optics::{
    chi, chi_from_polynomial, chi_polynomial, Aberrations, Optics, ABERRATION_NAMES,
};

/// Probe in reciprocal space `P(v) = A(v) exp(−iχ(v))` ([`Optics::aperture`], [`chi`] in its
/// polynomial form): the losses' [`Probe`] at one point.
pub fn probe(o: &Optics, ab: &Aberrations, v_r: f64, v_c: f64) -> Complex64 {
    Probe::new(o, ab).at(v_r, v_c)
}

/// Double-overlap transfer `Γ(k, ν) = P(k − ν) P*(k) − P(k) P*(k + ν)` (module docs, step 4).
pub fn gamma(o: &Optics, ab: &Aberrations, k: (f64, f64), nu: (f64, f64)) -> Complex64 {
    let p = Probe::new(o, ab);
    p.gamma_at(k, p.at(k.0, k.1), nu)
}

/// The probe for one set of aberrations, evaluated many times: χ from its [`chi_polynomial`]
/// coefficients (no `atan2` and no cosines per point, as the CUDA kernels do; equal to [`chi`]
/// to rounding, `qem_core::optics`' test). The losses evaluate it twice per BF pixel and
/// frequency, so this is most of their time.
#[derive(Debug, Clone, Copy)]
struct Probe<'a> {
    o: &'a Optics,
    c: [f64; 8],
    /// `|v|²` at or below which [`Optics::aperture`] is surely 1, at or above which surely 0
    /// (the soft edge `λ|v| ∈ α ± δ/2` widened by 1e-9 relative, so rounding cannot cross it);
    /// between them the aperture is computed.
    q2_in: f64,
    q2_out: f64,
}

impl<'a> Probe<'a> {
    fn new(o: &'a Optics, ab: &Aberrations) -> Probe<'a> {
        // The edge's half width is δ/2 with δ between the row and column sampling.
        let half = 0.5 * o.dtheta_rad.0.max(o.dtheta_rad.1);
        let q_in = (o.alpha_rad - half) / o.lambda_a * (1.0 - 1e-9);
        let q_out = (o.alpha_rad + half) / o.lambda_a * (1.0 + 1e-9);
        Probe {
            o,
            c: chi_polynomial(ab, o.lambda_a),
            q2_in: if q_in > 0.0 { q_in * q_in } else { -1.0 },
            q2_out: q_out * q_out,
        }
    }

    /// [`Optics::aperture`] at `v`, its square roots and divisions only on the soft edge.
    fn amplitude(&self, v_r: f64, v_c: f64) -> f64 {
        let q2 = v_r * v_r + v_c * v_c;
        if q2 <= self.q2_in {
            1.0
        } else if q2 >= self.q2_out {
            0.0
        } else {
            self.o.aperture(v_r, v_c)
        }
    }

    /// `P(v) = A(v) exp(−iχ(v))`.
    fn at(&self, v_r: f64, v_c: f64) -> Complex64 {
        let amp = self.amplitude(v_r, v_c);
        if amp == 0.0 {
            return Complex64::new(0.0, 0.0);
        }
        Complex64::from_polar(amp, -chi_from_polynomial(&self.c, v_r, v_c))
    }

    /// True when χ is quadratic, `χ(v) = vᵀMv` (only C10, C12, φ12 act): the coherence loss
    /// and the corrected spectra then take their terms without χ or sin/cos (`coherence.rs`).
    fn is_quadratic(&self) -> bool {
        self.c[3..].iter().all(|&v| v == 0.0)
    }

    /// [`gamma`] with `P(k)` already known.
    fn gamma_at(&self, k: (f64, f64), pk: Complex64, nu: (f64, f64)) -> Complex64 {
        self.at(k.0 - nu.0, k.1 - nu.1) * pk.conj() - pk * self.at(k.0 + nu.0, k.1 + nu.1).conj()
    }
}

/// `fftfreq(n, d)`: frequencies of an `n`-point DFT with sample spacing `d` (cycles per unit).
pub fn fftfreq(n: usize, d: f64) -> Vec<f64> {
    (0..n)
        .map(|i| {
            let s = if i < n.div_ceil(2) {
                i as f64
            } else {
                i as f64 - n as f64
            };
            s / (n as f64 * d)
        })
        .collect()
}

/// BF pixels (anchor §8.2): pixels of the mean DP with `mean > threshold·max(mean)` (all
/// positive pixels at threshold 0) inside the disk `(k_r − c_r)² + (k_c − c_c)² ≤ r²`, as
/// flat detector indices in row-major order.
pub fn select_bf(
    mean_dp: &[f32],
    det: Shape2,
    center: (f64, f64),
    radius: f64,
    threshold: f64,
) -> Vec<usize> {
    let max = mean_dp.iter().fold(0.0f64, |m, &v| m.max(f64::from(v)));
    let t = threshold * max;
    (0..det.len().min(mean_dp.len()))
        .filter(|&i| {
            let (r, c) = ((i / det.cols) as f64, (i % det.cols) as f64);
            let v = f64::from(mean_dp[i]);
            v > t && v > 0.0 && (r - center.0).powi(2) + (c - center.1).powi(2) <= radius * radius
        })
        .collect()
}

/// Detector-row stride of the fit's coarse sample of BF pixels ([`coarse_first`]).
pub const COARSE_ROW_STRIDE: usize = 4;
/// Fewest BF pixels a coarse sample holds by default; with fewer the fit has no coarse stage
/// (its loss would be rough, and a loss over so few pixels is cheap anyway).
pub const MIN_COARSE_PIXELS: usize = 256;

/// `pixels` (flat detector indices, row-major, as [`select_bf`] gives them) reordered with the
/// fit's coarse sample first, and the sample's size: the whole detector rows `r ≡ r₀ (mod
/// COARSE_ROW_STRIDE)`, `r₀` the row nearest the disk centre, then the other rows, each part in
/// row-major order. Size 0 (no coarse stage, order unchanged) when the sample would hold fewer
/// than `min_pixels` (by default [`MIN_COARSE_PIXELS`]) or every pixel. Why whole rows: the sample covers the disk evenly in both
/// directions within a row spacing, and each part stays runs of adjacent pixels, along which
/// the CUDA quadratic kernel carries its phase factor instead of recomputing it.
pub fn coarse_first(
    pixels: &[usize],
    det_cols: usize,
    center_row: f64,
    min_pixels: usize,
) -> (Vec<usize>, usize) {
    let cols = det_cols.max(1);
    let r0 = center_row.round().max(0.0) as usize % COARSE_ROW_STRIDE;
    let in_sample = |p: usize| (p / cols) % COARSE_ROW_STRIDE == r0;
    let (mut order, rest): (Vec<usize>, Vec<usize>) = pixels.iter().partition(|&&p| in_sample(p));
    let n = order.len();
    if n < min_pixels.max(1) || n == pixels.len() {
        return (pixels.to_vec(), 0);
    }
    order.extend(rest);
    (order, n)
}

/// Reciprocal vectors (Å⁻¹) of detector pixels: `k⁰ = ((i − c_r)Δk_r, (j − c_c)Δk_c)`, its
/// components exchanged when `transpose`, then the passive rotation `k = R(θ)k⁰`,
/// `R = [[cos, −sin], [sin, cos]]` on (row, col): the order and sense of `dpc` (so the rotation
/// and transpose `dpc.run` reports can be passed on).
pub fn pixel_k_vectors(
    pixels: &[usize],
    det: Shape2,
    center: (f64, f64),
    dk: (f64, f64),
    rotation_deg: f64,
    transpose: bool,
) -> Vec<(f64, f64)> {
    let (s, c) = rotation_deg.to_radians().sin_cos();
    pixels
        .iter()
        .map(|&p| {
            let kr = ((p / det.cols) as f64 - center.0) * dk.0;
            let kc = ((p % det.cols) as f64 - center.1) * dk.1;
            let (kr, kc) = if transpose { (kc, kr) } else { (kr, kc) };
            (c * kr - s * kc, s * kr + c * kc)
        })
        .collect()
}

/// Per-pixel images of the BF pixels of a dense `[N][frame_len]` array: `[B][N]` counts.
pub fn gather_dense(data: &DenseArray, frame_len: usize, pixels: &[usize]) -> Result<Vec<u32>> {
    let n = data.len().checked_div(frame_len).unwrap_or(0);
    let mut out = vec![0u32; pixels.len() * n];
    gather_dense_into(data, frame_len, pixels, &mut out)?;
    Ok(out)
}

/// Frames per task of [`gather_dense_into`].
const GATHER_FRAMES: usize = 1024;

/// [`gather_dense`] into `out` (`pixels.len()·N` values, `out[j·N + R]`), in parallel over
/// blocks of frames: a task reads the BF rows of each of its frames once (the pixels are a few
/// neighbouring detector rows) and writes one run per pixel. The host route of the CUDA SSB
/// fills its pinned upload buffers with this, a chunk of pixels at a time.
pub fn gather_dense_into(
    data: &DenseArray,
    frame_len: usize,
    pixels: &[usize],
    out: &mut [u32],
) -> Result<()> {
    const OP: &str = "ssb gather_pixels";
    if frame_len == 0 || data.len() % frame_len != 0 {
        return Err(
            Error::invalid(OP, "data length is not a whole number of frames")
                .with_found(format!("{} elements, frame {frame_len}", data.len())),
        );
    }
    if let Some(&p) = pixels.iter().find(|&&p| p >= frame_len) {
        return Err(Error::invalid(OP, "pixel index outside the frame")
            .with_expected(format!("< {frame_len}"))
            .with_found(p.to_string()));
    }
    let n = data.len() / frame_len;
    if out.len() != pixels.len() * n {
        return Err(Error::internal(OP, "output buffer size")
            .with_expected(format!("{} values", pixels.len() * n))
            .with_found(out.len().to_string()));
    }
    if n == 0 || pixels.is_empty() {
        return Ok(());
    }
    // runs[t][j] = pixel j's values over frame block t.
    let mut runs: Vec<Vec<&mut [u32]>> = (0..n.div_ceil(GATHER_FRAMES))
        .map(|_| Vec::with_capacity(pixels.len()))
        .collect();
    for row in out.chunks_mut(n) {
        for (t, run) in row.chunks_mut(GATHER_FRAMES).enumerate() {
            runs[t].push(run);
        }
    }
    fn block<T: Copy + Into<u32> + Sync>(
        a: &[T],
        frame_len: usize,
        pixels: &[usize],
        f0: usize,
        runs: &mut [&mut [u32]],
    ) {
        let frames = runs.first().map_or(0, |r| r.len());
        for i in 0..frames {
            let base = (f0 + i) * frame_len;
            for (run, &p) in runs.iter_mut().zip(pixels) {
                run[i] = a[base + p].into();
            }
        }
    }
    runs.into_par_iter().enumerate().for_each(|(t, mut r)| {
        let f0 = t * GATHER_FRAMES;
        match data {
            DenseArray::U8(a) => block(a, frame_len, pixels, f0, &mut r),
            DenseArray::U16(a) => block(a, frame_len, pixels, f0, &mut r),
            DenseArray::U32(a) => block(a, frame_len, pixels, f0, &mut r),
        }
    });
    Ok(())
}

/// Per-pixel images of the BF pixels of ENCODED frames: every frame decoded once (in
/// parallel), `[B][N]` counts.
pub fn gather_encoded(enc: &EncodedFrames, pixels: &[usize]) -> Result<Vec<u32>> {
    let frame_len = enc.frame_shape().len();
    if let Some(&p) = pixels.iter().find(|&&p| p >= frame_len) {
        return Err(
            Error::invalid("ssb gather_pixels", "pixel index outside the frame")
                .with_expected(format!("< {frame_len}"))
                .with_found(p.to_string()),
        );
    }
    let n = enc.n_frames();
    let b = pixels.len();
    // Frame-major first (each worker decodes its frames into a scratch frame), then transposed.
    let per_frame: Vec<Vec<u32>> = (0..n)
        .into_par_iter()
        .map_init(
            || vec![0u16; frame_len],
            |buf, f| {
                enc.decode_frame(f, buf)?;
                Ok(pixels.iter().map(|&p| u32::from(buf[p])).collect())
            },
        )
        .collect::<Result<_>>()?;
    let mut out = vec![0u32; b * n];
    for (f, vals) in per_frame.iter().enumerate() {
        for (j, &v) in vals.iter().enumerate() {
            out[j * n + f] = v;
        }
    }
    Ok(out)
}

/// 2-D FFT plans for one scan shape.
#[derive(Clone)]
struct Fft2 {
    shape: Shape2,
    fwd: (Arc<dyn Fft<f64>>, Arc<dyn Fft<f64>>),
    inv: (Arc<dyn Fft<f64>>, Arc<dyn Fft<f64>>),
}

impl std::fmt::Debug for Fft2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fft2({})", self.shape)
    }
}

impl Fft2 {
    fn new(shape: Shape2) -> Fft2 {
        let mut pl = FftPlanner::new();
        Fft2 {
            shape,
            fwd: (
                pl.plan_fft(shape.rows, FftDirection::Forward),
                pl.plan_fft(shape.cols, FftDirection::Forward),
            ),
            inv: (
                pl.plan_fft(shape.rows, FftDirection::Inverse),
                pl.plan_fft(shape.cols, FftDirection::Inverse),
            ),
        }
    }

    /// Unnormalised 2-D DFT in place (row-major), forward or inverse.
    fn run(&self, data: &mut [Complex64], forward: bool) {
        let (fr, fc) = if forward { &self.fwd } else { &self.inv };
        let (nr, nc) = (self.shape.rows, self.shape.cols);
        for row in data.chunks_exact_mut(nc) {
            fc.process(row);
        }
        let mut col = vec![Complex64::new(0.0, 0.0); nr];
        for c in 0..nc {
            for r in 0..nr {
                col[r] = data[r * nc + c];
            }
            fr.process(&mut col);
            for r in 0..nr {
                data[r * nc + c] = col[r];
            }
        }
    }
}

/// SSB loss functions. The default is [`Objective::Coherence`]: on abTEM multislice data at a
/// realistic dose (6k e⁻/frame) only it recovers C10 within 2.5 % and C12 within 1 % on one unit
/// cell (bench/results/cpu_ssb_abtem_validation.json), and on the GPU it costs a fraction of the
/// phase variance (no per-pixel inverse FFT).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Objective {
    /// The anchor's loss: `mean_R var_b φ_b(R)`, the per-position variance over BF pixels of
    /// the per-pixel phases `φ_b = arg O_b` (no unwrapping), B counting every BF pixel.
    PhaseVariance,
    /// Coherence of the data with the SSB model, negated so that lower is better:
    /// `L = −Σ_{ν≠0} |Σ_b G_b(ν) Γ_b*(ν)|² / Σ_b |Γ_b(ν)|²  /  Σ_{ν≠0} Σ_b |G_b(ν)|²` ∈ [−1, 0]
    /// (b over the pixels with `A(k_b) > 0`; a frequency where every `Γ_b` is 0 adds nothing).
    /// It is the share of the data's power that the weak-phase model `G_b(ν) = iΦ(ν) Γ_b(ν)`
    /// explains with the best `Φ(ν)` per frequency (least squares over the pixels), so by
    /// Cauchy–Schwarz each frequency's term is largest exactly where `Γ_b(ν) ∝ G_b(ν)`: at the
    /// true aberrations for noise-free data from a weak phase object. Why this form
    /// and not the phase-only corrected spectra `G Γ*/|Γ|`: those flip sign where the transfer
    /// of a pixel inside both discs passes through 0, so that loss jumps on the surfaces
    /// `χ(ν) = nπ` (the fit ended on such cliffs); here `Γ` enters smoothly, so the loss is
    /// smooth in the aberrations and the fit's last stage can model it (docs/science.md §9).
    /// It never takes `arg` (phases wrapping past ±π in thick samples do not scramble it), each
    /// frequency weighs by its own signal, and shot noise only adds an aberration-independent
    /// floor to the denominator. It needs no per-pixel inverse FFT.
    #[default]
    Coherence,
}

impl Objective {
    /// Name used in provenance and by the Python/CLI surfaces.
    pub fn name(self) -> &'static str {
        match self {
            Objective::PhaseVariance => "phase_variance",
            Objective::Coherence => "coherence",
        }
    }
}

/// Prepared SSB data: BF k vectors and `G_b(ν)` for every BF pixel.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// Scan grid.
    pub scan: Shape2,
    /// Scan step `(row, col)`, Å.
    pub scan_step_a: (f64, f64),
    /// Optics.
    pub optics: Optics,
    /// BF pixel reciprocal vectors (after rotation), Å⁻¹.
    pub k: Vec<(f64, f64)>,
    /// `G_b(ν)`, `[B][N_r·N_c]` row-major, unnormalised forward DFT of each pixel's image.
    pub g: Vec<Vec<Complex64>>,
    /// `d = mean_b G_b(0)`: the DC every corrected spectrum gets.
    pub dc: f64,
    nu_r: Vec<f64>,
    nu_c: Vec<f64>,
    /// The frequencies the coherence loss evaluates, with their weights (see
    /// [`coherence_terms`]).
    terms: Vec<(usize, f64)>,
    /// Each term's (scan row, scan column).
    term_rc: Vec<(u32, u32)>,
    /// Per pixel `Σ_{ν≠0} |G_b(ν)|²` (the coherence loss's constant denominator), summed in
    /// frequency order.
    power: Vec<f64>,
    fft: Fft2,
}

/// The frequencies `ν ≠ 0` of the coherence loss, each with the number of frequencies it
/// stands for. Where the mirror index `((N_r − r) mod N_r, (N_c − c) mod N_c)` holds exactly
/// `−ν` (everywhere but on the Nyquist lines of even sizes), its term equals `ν`'s:
/// `G(−ν) = G(ν)*` for a real image and `Γ(k, −ν) = −Γ(k, ν)*` for any χ, so
/// `|Σ_b G_b Γ_b*|²` and `Σ_b |Γ_b|²` are the same at both. The lower index of such a pair is
/// kept with weight 2 and its mirror dropped; every other frequency is kept with weight 1. The
/// CUDA kernels pair the same frequencies (`ssb.cu`, `pair_of`).
fn coherence_terms(scan: Shape2, nu_r: &[f64], nu_c: &[f64]) -> Vec<(usize, f64)> {
    let (rows, cols) = (scan.rows, scan.cols);
    (1..scan.len())
        .filter_map(|i| {
            let (r, c) = (i / cols, i % cols);
            let (rm, cm) = ((rows - r) % rows, (cols - c) % cols);
            let exact = nu_r[rm] == -nu_r[r] && nu_c[cm] == -nu_c[c];
            let m = rm * cols + cm;
            match (exact, i.cmp(&m)) {
                (false, _) => Some((i, 1.0)),
                (true, std::cmp::Ordering::Less) => Some((i, 2.0)),
                (true, _) => None,
            }
        })
        .collect()
}

impl Prepared {
    /// Bytes [`Prepared::new`] holds for `b` pixels over `scan` (G as complex f64).
    pub fn bytes_for(b: usize, scan: Shape2) -> u64 {
        b as u64 * scan.len() as u64 * 16
    }

    /// FFT every BF pixel's image (`images` = `[B][N]` counts from [`gather_dense`] /
    /// [`gather_encoded`]).
    pub fn new(
        images: &[u32],
        scan: Shape2,
        scan_step_a: (f64, f64),
        optics: Optics,
        k: Vec<(f64, f64)>,
    ) -> Result<Prepared> {
        const OP: &str = "ssb prepare";
        let n = scan.len();
        if n == 0 || k.is_empty() || images.len() != k.len() * n {
            return Err(
                Error::invalid(OP, "images do not match the BF pixels and the scan")
                    .with_expected(format!("{} × {n} values (B × scan), B > 0", k.len()))
                    .with_found(images.len().to_string()),
            );
        }
        let fft = Fft2::new(scan);
        let g: Vec<Vec<Complex64>> = images
            .par_chunks(n)
            .map(|img| {
                let mut buf: Vec<Complex64> = img
                    .iter()
                    .map(|&v| Complex64::new(f64::from(v), 0.0))
                    .collect();
                fft.run(&mut buf, true);
                buf
            })
            .collect();
        let dc = g.iter().map(|gb| gb[0].re).sum::<f64>() / g.len() as f64;
        let nu_r = fftfreq(scan.rows, scan_step_a.0);
        let nu_c = fftfreq(scan.cols, scan_step_a.1);
        let terms = coherence_terms(scan, &nu_r, &nu_c);
        let term_rc = terms
            .iter()
            .map(|&(i, _)| ((i / scan.cols) as u32, (i % scan.cols) as u32))
            .collect();
        let power = g
            .iter()
            .map(|gb| gb[1..].iter().map(|v| v.norm_sqr()).sum())
            .collect();
        Ok(Prepared {
            scan,
            scan_step_a,
            optics,
            k,
            g,
            dc,
            nu_r,
            nu_c,
            terms,
            term_rc,
            power,
            fft,
        })
    }

    /// Number of BF pixels.
    pub fn n_pixels(&self) -> usize {
        self.k.len()
    }

    /// Scan frequency `ν` (Å⁻¹) of flat index `i`.
    fn nu(&self, i: usize) -> (f64, f64) {
        (self.nu_r[i / self.scan.cols], self.nu_c[i % self.scan.cols])
    }

    /// Corrected spectrum `C_b(ν)` of pixel `b` (module docs, step 5).
    pub fn corrected(&self, b: usize, ab: &Aberrations) -> Vec<Complex64> {
        let p = Probe::new(&self.optics, ab);
        self.corrected_with(b, &p, self.quadratic(&p).as_ref())
    }

    /// [`Prepared::corrected`] with the probe made, by the quadratic terms when `quad` is
    /// given (`coherence.rs`), else by the general ones.
    fn corrected_with(&self, b: usize, p: &Probe<'_>, quad: Option<&Quadratic>) -> Vec<Complex64> {
        let k = self.k[b];
        let gb = &self.g[b];
        let mut out = vec![Complex64::new(0.0, 0.0); gb.len()];
        out[0] = Complex64::new(self.dc, 0.0);
        let correct = |gv: Complex64, gam: Complex64| {
            let n2 = gam.norm_sqr();
            if n2 > GAMMA_FLOOR_SQ {
                gv * gam.conj() / n2.sqrt()
            } else {
                gv * gam.conj() * 1e8
            }
        };
        match quad {
            Some(q) => {
                let ak = p.amplitude(k.0, k.1);
                if ak == 0.0 {
                    return out; // zero-aperture pixel: Γ ≡ 0, its spectrum is DC only
                }
                let (e_r, e_c) = self.pixel_phases(q, k, ak);
                for (i, (o, &gv)) in out.iter_mut().zip(gb).enumerate().skip(1) {
                    let (r, c) = (i / self.scan.cols, i % self.scan.cols);
                    if let Some(w) = q.w(p, k, (self.nu_r[r], self.nu_c[c]), q.u[i]) {
                        *o = correct(gv, e_r[r] * e_c[c] * w);
                    }
                }
            }
            None => {
                let pk = p.at(k.0, k.1);
                if pk.norm_sqr() == 0.0 {
                    return out; // zero-aperture pixel: Γ ≡ 0, its spectrum is DC only
                }
                for (i, (o, &gv)) in out.iter_mut().zip(gb).enumerate().skip(1) {
                    *o = correct(gv, p.gamma_at(k, pk, self.nu(i)));
                }
            }
        }
        out
    }

    /// The object `O(R) = (1/B) Σ_b O_b(R)` = IFFT of the mean corrected spectrum, 1/N
    /// normalised, row-major over the scan.
    pub fn object(&self, ab: &Aberrations) -> Vec<Complex64> {
        let n = self.scan.len();
        let b = self.n_pixels();
        let p = Probe::new(&self.optics, ab);
        let quad = self.quadratic(&p);
        let sum = ordered_sum(b, n, Complex64::new(0.0, 0.0), |j, acc| {
            let c = self.corrected_with(j, &p, quad.as_ref());
            acc.iter_mut().zip(&c).for_each(|(x, y)| *x += y);
        });
        let mut spec: Vec<Complex64> = sum.into_iter().map(|v| v / b as f64).collect();
        self.fft.run(&mut spec, false);
        spec.iter().map(|v| v / n as f64).collect()
    }

    /// The loss `kind` at `ab` (lower is better).
    pub fn objective(&self, ab: &Aberrations, kind: Objective) -> f64 {
        self.objective_over(ab, kind, self.n_pixels())
    }

    /// The loss `kind` at `ab` over the first `used` BF pixels only (all of them when `used`
    /// is more than there are): the fit's coarse loss, [`coarse_first`] puts a sample of the
    /// disk first.
    pub fn objective_over(&self, ab: &Aberrations, kind: Objective, used: usize) -> f64 {
        let used = used.min(self.n_pixels());
        match kind {
            Objective::PhaseVariance => self.phase_variance(ab, used),
            Objective::Coherence => self.coherence(ab, used),
        }
    }

    /// `mean_R [(1/B) Σ_b φ_b² − ((1/B) Σ_b φ_b)²]`, `φ_b = arg IFFT(C_b)`, over pixels
    /// `0..b`.
    fn phase_variance(&self, ab: &Aberrations, b: usize) -> f64 {
        let n = self.scan.len();
        // s[R] = Σ_b φ_b, s[N + R] = Σ_b φ_b².
        let p = Probe::new(&self.optics, ab);
        let quad = self.quadratic(&p);
        let s = ordered_sum(b, 2 * n, 0.0, |j, acc| {
            let mut c = self.corrected_with(j, &p, quad.as_ref());
            self.fft.run(&mut c, false);
            // The 1/N normalisation does not change arg, so it is skipped.
            for (r, v) in c.iter().enumerate() {
                let ph = v.im.atan2(v.re);
                acc[r] += ph;
                acc[n + r] += ph * ph;
            }
        });
        let (s1, s2) = s.split_at(n);
        let bf = b as f64;
        s1.iter()
            .zip(s2)
            .map(|(m1, m2)| m2 / bf - (m1 / bf).powi(2))
            .sum::<f64>()
            / n as f64
    }
}

/// BF pixels per summation block of [`ordered_sum`].
const SUM_BLOCK: usize = 32;

/// `Σ_j term(j)` over `0..b` into a vector of `len`, in parallel but in a fixed order: blocks
/// of [`SUM_BLOCK`] pixels are summed sequentially, then the blocks in order. The result so
/// does not depend on the thread count or scheduling (rayon's `reduce` does, in the last
/// bits), which the fit's determinism needs; memory stays at one vector per block.
fn ordered_sum<T, F>(b: usize, len: usize, zero: T, term: F) -> Vec<T>
where
    T: Copy + Send + Sync + std::ops::AddAssign,
    F: Fn(usize, &mut [T]) + Sync,
{
    let blocks: Vec<Vec<T>> = (0..b.div_ceil(SUM_BLOCK))
        .into_par_iter()
        .map(|blk| {
            let mut acc = vec![zero; len];
            for j in blk * SUM_BLOCK..((blk + 1) * SUM_BLOCK).min(b) {
                term(j, &mut acc);
            }
            acc
        })
        .collect();
    let mut out = vec![zero; len];
    for blk in &blocks {
        out.iter_mut().zip(blk).for_each(|(x, &y)| *x += y);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The fit.

/// Default search range of a parameter (name → `(lo, hi)`): C10 ±400 Å (the anchor's box; an
/// uncorrected-focus error of ±40 nm), C12 0…100 Å, φ12 ±π/2 (C12's period is π), C21 and C23
/// 0…1000 Å, φ21 ±π, φ23 ±π/3, C30 ±5·10⁴ Å (±5 µm, a corrected instrument).
pub fn default_range(name: &str) -> Option<(f64, f64)> {
    Some(match name {
        "C10" => (-400.0, 400.0),
        "C12" => (0.0, 100.0),
        "phi12" => (-PI / 2.0, PI / 2.0),
        "C21" => (0.0, 1000.0),
        "phi21" => (-PI, PI),
        "C23" => (0.0, 1000.0),
        "phi23" => (-PI / 3.0, PI / 3.0),
        "C30" => (-5e4, 5e4),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// More frames than one gather block, pixels in an irregular order, u8/u16/u32 data, and
    /// the chunked form the CUDA host route uses: every (pixel, frame) value in its place.
    #[test]
    fn gather_dense_into_places_every_value_chunk_by_chunk() {
        let (frames, frame_len) = (2 * GATHER_FRAMES + 37, 50usize);
        let pixels: Vec<usize> = (0..23).map(|j| (j * 7 + j / 3) % frame_len).collect();
        let v = |f: usize, p: usize| ((f * 31 + p * 7) % 251) as u32;
        let raw: Vec<u32> = (0..frames * frame_len)
            .map(|i| v(i / frame_len, i % frame_len))
            .collect();
        for data in [
            DenseArray::U8(raw.iter().map(|&x| x as u8).collect()),
            DenseArray::U16(raw.iter().map(|&x| x as u16).collect()),
            DenseArray::U32(raw.clone()),
        ] {
            for chunk in [1usize, 5, 23] {
                for p0 in (0..pixels.len()).step_by(chunk) {
                    let np = chunk.min(pixels.len() - p0);
                    let mut out = vec![u32::MAX; np * frames];
                    gather_dense_into(&data, frame_len, &pixels[p0..p0 + np], &mut out).unwrap();
                    for j in 0..np {
                        for f in 0..frames {
                            assert_eq!(
                                out[j * frames + f],
                                v(f, pixels[p0 + j]),
                                "pixel {j} frame {f}"
                            );
                        }
                    }
                }
            }
        }
        let mut short = vec![0u32; 3];
        let e =
            gather_dense_into(&DenseArray::U32(raw), frame_len, &pixels, &mut short).unwrap_err();
        assert_eq!(e.kind, qem_core::ErrorKind::Internal);
    }

    /// More pixels than one gather group, in an irregular order: every (pixel, frame) value.
    #[test]
    fn gather_dense_places_every_value() {
        let (frames, frame_len) = (37usize, 300usize);
        let data: Vec<u32> = (0..frames * frame_len)
            .map(|i| (i / frame_len * 1000 + i % frame_len) as u32)
            .collect();
        let pixels: Vec<usize> = (0..150).map(|j| (j * 7 + j / 3) % frame_len).collect();
        let out = gather_dense(&DenseArray::U32(data), frame_len, &pixels).unwrap();
        assert_eq!(out.len(), pixels.len() * frames);
        for (j, &p) in pixels.iter().enumerate() {
            for f in 0..frames {
                assert_eq!(
                    out[j * frames + f],
                    (f * 1000 + p) as u32,
                    "pixel {p} frame {f}"
                );
            }
        }
    }

    /// 300 kV, 20 mrad, 2.5 mrad per pixel.
    fn optics() -> Optics {
        Optics::new(300.0, 20.0, 2.5)
    }

    /// Defocus C10 and two-fold astigmatism C12 at φ12 (Å, Å, rad), nothing else.
    fn focus_astigmatism(c10: f64, c12: f64, phi12: f64) -> Aberrations {
        Aberrations {
            c10,
            c12,
            phi12,
            ..Default::default()
        }
    }

    #[test]
    fn probe_inside_outside_and_edge() {
        let o = optics();
        let kmax = o.alpha_rad / o.lambda_a;
        let ab = Aberrations {
            c10: 80.0,
            ..Default::default()
        };
        let p = probe(&o, &ab, 0.5 * kmax, 0.0);
        assert!((p.norm() - 1.0).abs() < 1e-12);
        let want = -chi(&ab, o.lambda_a, 0.5 * kmax, 0.0);
        assert!((p.arg() - want.sin().atan2(want.cos())).abs() < 1e-9);
        assert_eq!(probe(&o, &ab, 1.2 * kmax, 0.0).norm(), 0.0);
        // Exactly at the edge the soft aperture is ½.
        assert!((o.aperture(kmax, 0.0) - 0.5).abs() < 1e-9);
    }

    /// The coherence loss over the paired half of the frequencies equals its definition summed
    /// over every `ν ≠ 0` with [`gamma`] (`−Σ_ν |Σ_b G_b Γ_b*|² / Σ_b |Γ_b|²`, over
    /// `Σ_b Σ_ν |G_b|²`), on even and odd scans (Nyquist lines kept once) and with pixels
    /// outside the aperture.
    #[test]
    fn coherence_over_mirror_pairs_equals_the_full_sum() {
        let o = optics();
        let kmax = o.alpha_rad / o.lambda_a;
        // Quadratic χ (the loss's quadratic terms) and with coma and three-fold (its general
        // terms).
        let quadratic = focus_astigmatism(70.0, 15.0, 0.3);
        let odd = Aberrations {
            c21: 250.0,
            phi21: 0.7,
            c23: 120.0,
            ..quadratic
        };
        for (scan, ab) in [
            (Shape2::new(8, 6), quadratic),
            (Shape2::new(7, 5), quadratic),
            (Shape2::new(6, 9), quadratic),
            (Shape2::new(8, 6), odd),
            (Shape2::new(7, 5), odd),
        ] {
            let n = scan.len();
            // Pixels inside, near the edge and outside the aperture; pseudo-random images.
            let k: Vec<(f64, f64)> = [
                (0.1, 0.2),
                (-0.5, 0.3),
                (0.7, -0.69),
                (0.0, 1.3),
                (0.4, 0.0),
            ]
            .iter()
            .map(|&(a, b)| (a * kmax, b * kmax))
            .collect();
            let images: Vec<u32> = (0..k.len() * n)
                .map(|i| ((i * 7919 + 13) % 251) as u32)
                .collect();
            let step = (0.3, 0.37);
            let prep = Prepared::new(&images, scan, step, o, k.clone()).unwrap();
            let (fr, fc) = (fftfreq(scan.rows, step.0), fftfreq(scan.cols, step.1));
            let (mut explained, mut power) = (0.0, 0.0);
            for i in 1..n {
                let nu = (fr[i / scan.cols], fc[i % scan.cols]);
                let (mut s, mut d) = (Complex64::new(0.0, 0.0), 0.0);
                for (j, &kj) in k.iter().enumerate() {
                    if probe(&o, &ab, kj.0, kj.1).norm_sqr() == 0.0 {
                        continue;
                    }
                    let gam = gamma(&o, &ab, kj, nu);
                    s += prep.g[j][i] * gam.conj();
                    d += gam.norm_sqr();
                    power += prep.g[j][i].norm_sqr();
                }
                if d > GAMMA_SUM_FLOOR {
                    explained += s.norm_sqr() / d;
                }
            }
            let want = -explained / power;
            let got = prep.objective(&ab, Objective::Coherence);
            assert!(want < -1e-6, "{scan}: a loss to compare ({want})");
            assert!(
                (got - want).abs() <= 1e-12 * want.abs(),
                "{scan}: {got} vs {want}"
            );
        }
    }

    /// The losses' `Probe` against its definition: its amplitude is `Optics::aperture`'s to the
    /// bit (the fast inside/outside tests never decide a point the formula would not give 1 or
    /// 0 exactly), the probe `A exp(−iχ)` with the polar [`chi`] to rounding, on a dense band
    /// across the soft edge, for square, oblong and zero detector sampling.
    #[test]
    fn probe_fast_path_equals_the_aperture_and_chi() {
        let ab = Aberrations {
            c10: -60.0,
            c12: 25.0,
            phi12: 0.4,
            c30: 1e4,
            ..Default::default()
        };
        let mut o_oblong = optics();
        o_oblong.dtheta_rad = (0.9e-3, 2.9e-3);
        let mut o_hard = optics();
        o_hard.dtheta_rad = (0.0, 0.0);
        for o in [optics(), o_oblong, o_hard] {
            let p = Probe::new(&o, &ab);
            let kmax = o.alpha_rad / o.lambda_a;
            let (mut inside, mut edge, mut outside) = (0, 0, 0);
            for i in 0..4000 {
                let r = kmax * (0.8 + 0.4 * i as f64 / 4000.0);
                let phi = 0.37 * i as f64;
                let (x, y) = (r * phi.cos(), r * phi.sin());
                let amp = o.aperture(x, y);
                assert_eq!(p.amplitude(x, y).to_bits(), amp.to_bits(), "{x} {y}");
                let got = p.at(x, y);
                if amp == 1.0 {
                    inside += 1;
                } else if amp == 0.0 {
                    outside += 1;
                } else {
                    edge += 1;
                }
                let want = Complex64::from_polar(amp, -chi(&ab, o.lambda_a, x, y));
                assert!((got - want).norm() < 1e-9, "{x} {y}: {got} vs {want}");
            }
            assert!(inside > 100 && outside > 100, "{inside} {edge} {outside}");
        }
    }

    #[test]
    fn gamma_hermitian_symmetry_and_zero_without_aberrations() {
        let o = optics();
        let ab = Aberrations {
            c10: 120.0,
            c12: 40.0,
            phi12: 0.6,
            c21: 500.0,
            phi21: 0.2,
            c23: 300.0,
            phi23: -0.4,
            c30: 2e4,
        };
        for &(k, nu) in &[
            ((0.3, -0.2), (0.4, 0.1)),
            ((-0.1, 0.5), (0.2, -0.7)),
            ((0.0, 0.2), (0.9, 0.3)),
        ] {
            let g = gamma(&o, &ab, k, nu);
            let gm = gamma(&o, &ab, k, (-nu.0, -nu.1));
            assert!((gm + g.conj()).norm() < 1e-12, "{k:?} {nu:?}");
        }
        // No aberrations, both trotters inside: Γ = 1 − 1 = 0.
        let g = gamma(&o, &Aberrations::default(), (0.1, 0.0), (0.05, 0.0));
        assert!(g.norm() < 1e-12);
        // Outside both discs: 0.
        let g = gamma(&o, &ab, (0.3, 0.0), (5.0, 0.0));
        assert_eq!(g.norm(), 0.0);
    }

    #[test]
    fn fftfreq_matches_numpy() {
        let f = fftfreq(5, 0.5);
        let want = [0.0, 0.4, 0.8, -0.8, -0.4];
        f.iter()
            .zip(want)
            .for_each(|(a, b)| assert!((a - b).abs() < 1e-12));
        let f = fftfreq(4, 1.0);
        let want = [0.0, 0.25, -0.5, -0.25];
        f.iter()
            .zip(want)
            .for_each(|(a, b)| assert!((a - b).abs() < 1e-12));
    }

    #[test]
    fn rotation_is_the_dpc_sense() {
        let det = Shape2::new(3, 3);
        // Pixel (2, 1): k⁰ = (1, 0); R(90°) (1, 0) = (0, 1).
        let k = pixel_k_vectors(&[7], det, (1.0, 1.0), (1.0, 1.0), 90.0, false);
        assert!((k[0].0).abs() < 1e-12 && (k[0].1 - 1.0).abs() < 1e-12);
        // Transposed first: k⁰ = (0, 1), then R(90°) (0, 1) = (−1, 0).
        let k = pixel_k_vectors(&[7], det, (1.0, 1.0), (1.0, 1.0), 90.0, true);
        assert!((k[0].0 + 1.0).abs() < 1e-12 && (k[0].1).abs() < 1e-12);
    }

    /// The coarse sample: whole detector rows r ≡ round(centre) (mod 4) first, each part in
    /// row-major order; too small a sample gives no coarse stage and the order unchanged.
    #[test]
    fn coarse_first_puts_every_fourth_row_first() {
        let cols = 100;
        // Rows 0..12, columns 5..95 of a 100-column detector: 90 pixels a row.
        let pixels: Vec<usize> = (0..12)
            .flat_map(|r| (5..95).map(move |c| r * cols + c))
            .collect();
        let (order, n) = coarse_first(&pixels, cols, 5.4, MIN_COARSE_PIXELS);
        // round(5.4) = 5 → rows 1, 5, 9.
        assert_eq!(n, 3 * 90);
        let rows: Vec<usize> = order.iter().map(|p| p / cols).collect();
        assert!(
            rows[..n].iter().all(|r| [1, 5, 9].contains(r)),
            "{:?}",
            &rows[..n]
        );
        assert!(rows[n..].iter().all(|r| ![1, 5, 9].contains(r)));
        assert!(order[..n].windows(2).all(|w| w[0] < w[1]));
        assert!(order[n..].windows(2).all(|w| w[0] < w[1]));
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, pixels, "a permutation of the pixels");
        // 40 pixels a row: a sample of 120 < MIN_COARSE_PIXELS.
        let small: Vec<usize> = (0..12)
            .flat_map(|r| (10..50).map(move |c| r * cols + c))
            .collect();
        assert_eq!(
            coarse_first(&small, cols, 5.4, MIN_COARSE_PIXELS),
            (small.clone(), 0)
        );
        assert_eq!(coarse_first(&small, cols, 5.4, 100).1, 3 * 40);
    }
}
