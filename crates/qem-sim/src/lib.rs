//! `qem-sim`: a small, physically meaningful 4D-STEM simulator.
//!
//! It makes acquisitions `I[R_r, R_c, k_r, k_c]` (u16 Poisson counts) with a known ground truth
//! for the `demo` command, tests and benchmarks, and later for validating DPC and SSB. It depends
//! only on `qem-core`; nothing here reads or writes files, except the `demo` module (feature
//! `files`, which adds `qem-io`): the demo acquisition written as Dectris-style files. Any crate
//! may depend on it (normally as a dev-dependency or from the CLI). [`DiskPattern`] is a much cheaper generator (Poisson
//! counts of a fixed disk, no specimen) for benchmark files too large to simulate quickly;
//! [`ReferencePattern`] makes the frames of the reference benchmark acquisition.
//!
//! # Physics (single-slice projection approximation)
//! * Specimen: the projected potential `V_proj` (V·Å) of a [`Crystal`] ([`potential`] states the
//!   model), transmission `t(r) = exp(iσV_proj(r))` with the interaction constant
//!   [`interaction_constant_rad_per_v_a`]. No propagation inside the specimen (thin specimens).
//! * Probe: Fourier coefficients `ψ̂(k) = A(λ|k|) exp(−iχ(k))` with a soft-edged aperture
//!   ([`optics::aperture`]) of semi-angle α and the aberration function of [`Aberrations`]
//!   (positive `C10` = overfocus). The probe carries unit total intensity.
//! * Frame at scan position `p`: `Ψ(k) = F[ψ(r − p) · t(r)]`, intensity `|Ψ|²` normalised so that
//!   the whole (simulated) diffraction plane sums to 1, then `counts ~ Poisson(dose · |Ψ|²)`
//!   clipped to `u16::MAX`. The dose counts incident electrons; the few scattered beyond the
//!   detector edge are lost, as on a real detector.
//!
//! # Sampling and conventions
//! * Scan position `(i, j)` (row-major, frame `n = i·C + j`) sits at `(i·step, j·step)` Å in the
//!   crystal frame; scan position (0, 0) is on a column at the cell origin (a Sr column for
//!   SrTiO3).
//! * The detector row/column axes are parallel to the scan row/column axes: no scan rotation, no
//!   transpose, no flip. Forward transforms use `exp(−2πi k·r)`, so a phase increasing towards
//!   `+row` moves intensity towards larger detector row indices (the beam is deflected towards
//!   positive potential, i.e. towards the atoms).
//! * Detector pixel `(i, j)` sees scattering angle `((i − K_r/2)·Δθ, (j − K_c/2)·Δθ)` with integer
//!   division `K/2` (the FFT-shift convention, as abTEM): **the beam centre is pixel
//!   `(K_r/2, K_c/2)` rounded down**, e.g. (32, 32) for 64×64 and (31, 32) for 63×65.
//! * Each frame is computed on a square window of `M = 2·max(K_r, K_c)` pixels of size
//!   `dx = λ/(M·Δθ)` Å (window side `λ/Δθ`), so the FFT's reciprocal sampling is exactly the
//!   detector's `Δθ`; the central `K_r × K_c` of the diffraction plane is the detector (the 2×
//!   oversampling keeps high-angle scattering from aliasing onto it). The probe is moved by an
//!   integer-pixel crop of the transmission function plus an exact sub-pixel Fourier phase ramp.
//! * Each frame's Poisson noise comes from its own RNG seeded by `(seed, frame index)`, so the
//!   result does not depend on the number of threads.

#[cfg(feature = "files")]
pub mod demo;
pub mod disk;
pub mod optics;
pub mod potential;
pub mod reference;

pub use disk::DiskPattern;
pub use optics::{interaction_constant_rad_per_v_a, wavelength_a, Aberrations};
pub use potential::{atom_strength_v_a3, Crystal, SRTIO3_A};
pub use reference::{ReferenceParams, ReferencePattern, REFERENCE_BAD_PIXELS};

use potential::ProjectedPotential;
use qem_core::{Error, Result, Shape2};
use rand::SeedableRng;
use rand_distr::{Distribution, Poisson};
use rayon::prelude::*;
use rustfft::num_complex::Complex32;
use rustfft::{Fft, FftPlanner};
use std::f64::consts::PI;
use std::sync::Arc;

/// Parameters of a simulation. `Default` is the demo acquisition: SrTiO3 [001] (5 cells thick),
/// scan 48 × 40 (rectangular on purpose) at 0.4 Å, detector 64 × 64, 300 kV, 20 mrad,
/// `C10 = 50 Å` (overfocus), `C12 = 20 Å` at 30°, 20 000 e⁻/frame, seed 0.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SimParams {
    /// Scan grid `(R_r, R_c)`.
    pub scan_shape: Shape2,
    /// Detector frame `(k_r, k_c)`.
    pub detector_shape: Shape2,
    /// Distance between neighbouring probe positions along rows and columns, Å.
    pub scan_step_a: f64,
    /// Accelerating voltage, kV.
    pub voltage_kv: f64,
    /// Probe-forming aperture semi-angle α, mrad.
    pub semiangle_mrad: f64,
    /// Detector angular sampling Δθ, mrad/pixel; `None` = α / (min(k_r, k_c)/4), i.e. a BF disk
    /// radius of a quarter of the detector's short side.
    pub angular_sampling_mrad: Option<f64>,
    /// Probe aberrations.
    pub aberrations: Aberrations,
    /// Incident electrons per frame (the expectation of the total counts, less what scatters
    /// beyond the detector).
    pub dose_e_per_frame: f64,
    /// The specimen.
    pub crystal: Crystal,
    /// Seed of the Poisson noise.
    pub seed: u64,
    /// Also return the noise-free intensities (f32, as large as the counts × 2).
    pub keep_intensities: bool,
}

impl Default for SimParams {
    fn default() -> Self {
        SimParams {
            scan_shape: Shape2::new(48, 40),
            detector_shape: Shape2::new(64, 64),
            scan_step_a: 0.4,
            voltage_kv: 300.0,
            semiangle_mrad: 20.0,
            angular_sampling_mrad: None,
            aberrations: Aberrations {
                c10_a: 50.0,
                c12_a: 20.0,
                phi12_rad: 30f64.to_radians(),
                ..Default::default()
            },
            dose_e_per_frame: 20_000.0,
            crystal: Crystal::default(),
            seed: 0,
            keep_intensities: false,
        }
    }
}

impl SimParams {
    /// Detector angular sampling actually used, mrad/pixel.
    pub fn angular_sampling_mrad(&self) -> f64 {
        self.angular_sampling_mrad.unwrap_or_else(|| {
            let short = self
                .detector_shape
                .rows
                .min(self.detector_shape.cols)
                .max(1);
            self.semiangle_mrad / (short as f64 / 4.0)
        })
    }

    /// Side of the square simulation window in pixels, `2·max(k_r, k_c)`.
    pub fn window_px(&self) -> usize {
        2 * self.detector_shape.rows.max(self.detector_shape.cols)
    }

    /// Real-space pixel size of the simulation, `λ / (M·Δθ)`, Å.
    pub fn potential_pixel_a(&self) -> f64 {
        wavelength_a(self.voltage_kv)
            / (self.window_px() as f64 * self.angular_sampling_mrad() * 1e-3)
    }

    /// Check every parameter; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, expected: &str, found: String| {
            Err(Error::invalid("simulate", format!("invalid {what}"))
                .with_expected(expected.to_string())
                .with_found(found))
        };
        if self.scan_shape.is_empty() {
            return bad("scan_shape", "at least 1 x 1", self.scan_shape.to_string());
        }
        if self.detector_shape.rows < 2 || self.detector_shape.cols < 2 {
            return bad(
                "detector_shape",
                "at least 2 x 2",
                self.detector_shape.to_string(),
            );
        }
        let positive = [
            ("scan_step_a", self.scan_step_a),
            ("voltage_kv", self.voltage_kv),
            ("semiangle_mrad", self.semiangle_mrad),
            ("angular_sampling_mrad", self.angular_sampling_mrad()),
        ];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return bad(name, "a finite number > 0", v.to_string());
            }
        }
        if !(self.dose_e_per_frame.is_finite() && self.dose_e_per_frame >= 0.0) {
            return bad(
                "dose_e_per_frame",
                "a finite number >= 0",
                self.dose_e_per_frame.to_string(),
            );
        }
        let ab = &self.aberrations;
        for (name, v) in [
            ("c10_a", ab.c10_a),
            ("c12_a", ab.c12_a),
            ("phi12_rad", ab.phi12_rad),
            ("c21_a", ab.c21_a),
            ("phi21_rad", ab.phi21_rad),
            ("c23_a", ab.c23_a),
            ("phi23_rad", ab.phi23_rad),
            ("c30_a", ab.c30_a),
        ] {
            if !v.is_finite() {
                return bad(name, "a finite number", v.to_string());
            }
        }
        match self.crystal {
            Crystal::RectangularLattice {
                a_row_a, a_col_a, ..
            } if !(a_row_a.is_finite()
                && a_row_a > 0.0
                && a_col_a.is_finite()
                && a_col_a > 0.0) =>
            {
                return bad(
                    "crystal lattice periods",
                    "finite numbers > 0",
                    format!("{a_row_a} x {a_col_a} Å"),
                );
            }
            _ => {}
        }
        // The probe must fit in the window λ/Δθ that the detector sampling implies, or it wraps.
        let alpha = self.semiangle_mrad * 1e-3;
        let lam = wavelength_a(self.voltage_kv);
        let window_a = lam / (self.angular_sampling_mrad() * 1e-3);
        let probe_diameter_a = 2.0 * (ab.blur_radius_a(alpha) + 2.0 * lam / alpha);
        if probe_diameter_a > window_a {
            return Err(Error::invalid(
                "simulate",
                "the probe does not fit in the real-space window λ/Δθ set by the detector sampling; \
                 reduce the aberrations or the angular sampling",
            )
            .with_expected(format!("probe diameter <= {window_a:.2} Å"))
            .with_found(format!("about {probe_diameter_a:.2} Å")));
        }
        let frames = self.scan_shape.len() as u128;
        let bytes = frames * self.detector_shape.len() as u128 * 2;
        if bytes > isize::MAX as u128 {
            return bad(
                "scan/detector size",
                "fits in memory",
                format!("{bytes} bytes"),
            );
        }
        Ok(())
    }
}

/// Calibration of a simulated acquisition (what a user would supply for real data).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Calibration {
    /// Accelerating voltage, kV.
    pub voltage_kv: f64,
    /// Relativistic electron wavelength, Å.
    pub wavelength_a: f64,
    /// Interaction constant σ, rad/(V·Å): phase = σ·V_proj.
    pub sigma_rad_per_v_a: f64,
    /// Probe semi-angle α, mrad.
    pub semiangle_mrad: f64,
    /// Scan step (rows and columns), Å.
    pub scan_step_a: f64,
    /// Detector angular sampling Δθ, mrad/pixel (rows and columns).
    pub angular_sampling_mrad: f64,
    /// Expected BF disk radius `α/Δθ`, detector pixels.
    pub bf_radius_px: f64,
    /// Beam centre (zero scattering angle), detector pixels `(k_r/2, k_c/2)` rounded down.
    pub beam_center_px: (f64, f64),
    /// Real-space pixel of the simulation grid, Å.
    pub potential_pixel_a: f64,
    /// Side of the square simulation window, pixels.
    pub window_px: usize,
}

/// The result of [`simulate`].
#[derive(Debug, Clone)]
pub struct SimOutput {
    /// Counts `[R_r, R_c, k_r, k_c]`, row-major.
    pub counts: Vec<u16>,
    /// Noise-free intensities (fraction of the incident beam per pixel), same layout; only when
    /// [`SimParams::keep_intensities`].
    pub intensities: Option<Vec<f32>>,
    /// Ground truth: projected potential (V·Å) at every scan position `[R_r, R_c]`; multiply by
    /// [`Calibration::sigma_rad_per_v_a`] for the phase.
    pub projected_potential: Vec<f32>,
    /// Calibration of the acquisition.
    pub calibration: Calibration,
    /// The parameters it was made with.
    pub params: SimParams,
}

/// Everything a frame needs that does not change between frames.
struct Setup {
    m: usize,
    det: Shape2,
    /// Probe Fourier coefficients on the window, unshifted FFT order, `Σ|ψ̂|² = 1`.
    probe_hat: Vec<Complex32>,
    /// Transmission function on the potential grid.
    transmission: Vec<Complex32>,
    grid_cols: usize,
    pixel_a: f64,
    /// Signed frequency index of FFT bin `i`.
    freq: Vec<f64>,
    fwd: Arc<dyn Fft<f32>>,
    inv: Arc<dyn Fft<f32>>,
    scratch_len: usize,
}

/// Per-thread buffers.
struct Work {
    buf: Vec<Complex32>,
    scratch: Vec<Complex32>,
    ramp_r: Vec<Complex32>,
    ramp_c: Vec<Complex32>,
}

fn transpose_square(buf: &mut [Complex32], m: usize) {
    for i in 0..m {
        for j in i + 1..m {
            buf.swap(i * m + j, j * m + i);
        }
    }
}

/// Fill `ramp` with `exp(−2πi q·shift/M)` for the signed frequency `q` of each bin.
fn fill_ramp(ramp: &mut [Complex32], freq: &[f64], shift_px: f64) {
    let m = freq.len() as f64;
    for (r, &q) in ramp.iter_mut().zip(freq) {
        let ph = -2.0 * PI * q * shift_px / m;
        *r = Complex32::new(ph.cos() as f32, ph.sin() as f32);
    }
}

/// SplitMix64 finaliser: decorrelates `(seed, frame)` into an RNG seed.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Setup {
    fn new(p: &SimParams) -> Setup {
        let m = p.window_px();
        let lam = wavelength_a(p.voltage_kv);
        let dtheta = p.angular_sampling_mrad() * 1e-3;
        let alpha = p.semiangle_mrad * 1e-3;
        let freq: Vec<f64> = (0..m)
            .map(|i| {
                if i < m.div_ceil(2) {
                    i as f64
                } else {
                    i as f64 - m as f64
                }
            })
            .collect();

        // Probe: angle of bin (qr, qc) is (qr·Δθ, qc·Δθ).
        let mut probe = vec![(0.0f64, 0.0f64); m * m];
        let mut norm = 0.0;
        for (i, &qr) in freq.iter().enumerate() {
            for (j, &qc) in freq.iter().enumerate() {
                let (ar, ac) = (qr * dtheta, qc * dtheta);
                let a = (ar * ar + ac * ac).sqrt();
                let amp = optics::aperture(a, alpha, dtheta);
                if amp > 0.0 {
                    let chi = p.aberrations.chi(a, ac.atan2(ar), lam);
                    probe[i * m + j] = (amp * chi.cos(), -amp * chi.sin());
                    norm += amp * amp;
                }
            }
        }
        let scale = if norm > 0.0 { 1.0 / norm.sqrt() } else { 0.0 };
        let probe_hat = probe
            .iter()
            .map(|&(re, im)| Complex32::new((re * scale) as f32, (im * scale) as f32))
            .collect();

        // Transmission on a grid covering every window: pixel n (row) sits at (n − M/2)·dx Å, so
        // the window of scan position p starts at pixel round(p/dx) and never leaves the grid.
        let dx = p.potential_pixel_a();
        let half = (m / 2) as f64;
        let extent =
            |n: usize| ((n.saturating_sub(1)) as f64 * p.scan_step_a / dx).round() as usize + m + 1;
        let (grid_rows, grid_cols) = (extent(p.scan_shape.rows), extent(p.scan_shape.cols));
        let sigma = interaction_constant_rad_per_v_a(p.voltage_kv);
        let pot = ProjectedPotential::new(&p.crystal);
        let mut transmission = vec![Complex32::new(1.0, 0.0); grid_rows * grid_cols];
        if !matches!(p.crystal, Crystal::Vacuum) {
            transmission
                .par_chunks_mut(grid_cols)
                .enumerate()
                .for_each(|(n, row)| {
                    let r_a = (n as f64 - half) * dx;
                    for (k, t) in row.iter_mut().enumerate() {
                        let phase = sigma * pot.at(r_a, (k as f64 - half) * dx);
                        *t = Complex32::new(phase.cos() as f32, phase.sin() as f32);
                    }
                });
        }

        let mut planner = FftPlanner::<f32>::new();
        let fwd = planner.plan_fft_forward(m);
        let inv = planner.plan_fft_inverse(m);
        let scratch_len = fwd
            .get_inplace_scratch_len()
            .max(inv.get_inplace_scratch_len());
        Setup {
            m,
            det: p.detector_shape,
            probe_hat,
            transmission,
            grid_cols,
            pixel_a: dx,
            freq,
            fwd,
            inv,
            scratch_len,
        }
    }

    fn work(&self) -> Work {
        Work {
            buf: vec![Complex32::new(0.0, 0.0); self.m * self.m],
            scratch: vec![Complex32::new(0.0, 0.0); self.scratch_len],
            ramp_r: vec![Complex32::new(0.0, 0.0); self.m],
            ramp_c: vec![Complex32::new(0.0, 0.0); self.m],
        }
    }

    /// Noise-free intensity of the frame at `(row_a, col_a)` Å into `out` (`k_r·k_c`), as a
    /// fraction of the incident beam.
    fn frame(&self, w: &mut Work, pos_a: (f64, f64), out: &mut [f32]) {
        let m = self.m;
        // Window origin (integer pixel) and the probe's sub-pixel position inside the window.
        let start_r = (pos_a.0 / self.pixel_a).round();
        let start_c = (pos_a.1 / self.pixel_a).round();
        let shift_r = (m / 2) as f64 + pos_a.0 / self.pixel_a - start_r;
        let shift_c = (m / 2) as f64 + pos_a.1 / self.pixel_a - start_c;
        fill_ramp(&mut w.ramp_r, &self.freq, shift_r);
        fill_ramp(&mut w.ramp_c, &self.freq, shift_c);
        for (i, (row, p_row)) in w
            .buf
            .chunks_exact_mut(m)
            .zip(self.probe_hat.chunks_exact(m))
            .enumerate()
        {
            let rr = w.ramp_r[i];
            for ((b, &p), &rc) in row.iter_mut().zip(p_row).zip(&w.ramp_c) {
                *b = p * rr * rc;
            }
        }
        // Inverse 2-D FFT (unnormalised): rows, transpose, rows -> ψ transposed ([col][row]).
        self.inv.process_with_scratch(&mut w.buf, &mut w.scratch);
        transpose_square(&mut w.buf, m);
        self.inv.process_with_scratch(&mut w.buf, &mut w.scratch);
        // Multiply by the transmission window (buf is transposed).
        let (r0, c0) = (start_r as usize, start_c as usize);
        for (c, col) in w.buf.chunks_exact_mut(m).enumerate() {
            let base = r0 * self.grid_cols + c0 + c;
            for (r, v) in col.iter_mut().enumerate() {
                *v *= self.transmission[base + r * self.grid_cols];
            }
        }
        // Forward 2-D FFT back to normal orientation: rows, transpose, rows.
        self.fwd.process_with_scratch(&mut w.buf, &mut w.scratch);
        transpose_square(&mut w.buf, m);
        self.fwd.process_with_scratch(&mut w.buf, &mut w.scratch);
        // |Ψ|² / M⁴ sums to 1 over the window; the detector is the centred K_r × K_c of it.
        let norm = 1.0 / (m as f32 * m as f32).powi(2);
        let (kr, kc) = (self.det.rows, self.det.cols);
        for (i, out_row) in out.chunks_exact_mut(kc).enumerate() {
            let qi = (i as isize - (kr / 2) as isize).rem_euclid(m as isize) as usize;
            for (j, o) in out_row.iter_mut().enumerate() {
                let qj = (j as isize - (kc / 2) as isize).rem_euclid(m as isize) as usize;
                *o = w.buf[qi * m + qj].norm_sqr() * norm;
            }
        }
    }
}

/// Poisson counts of `dose · intensity`, clipped to `u16::MAX`.
fn poisson_counts<R: rand::Rng>(rng: &mut R, intensity: &[f32], dose: f64, out: &mut [u16]) {
    for (o, &i) in out.iter_mut().zip(intensity) {
        let lam = dose * i as f64;
        *o = if lam > 0.0 {
            match Poisson::new(lam) {
                Ok(d) => d.sample(rng).min(u16::MAX as f64) as u16,
                Err(_) => lam.round().min(u16::MAX as f64) as u16,
            }
        } else {
            0
        };
    }
}

/// Simulate the acquisition described by `params` (validated first).
///
/// Runs in parallel over frames (rayon); the result is identical for any number of threads.
pub fn simulate(params: &SimParams) -> Result<SimOutput> {
    params.validate()?;
    let setup = Setup::new(params);
    let frame_len = params.detector_shape.len();
    let n_frames = params.scan_shape.len();
    let cols = params.scan_shape.cols;
    let step = params.scan_step_a;
    let dose = params.dose_e_per_frame;
    let pos = |n: usize| ((n / cols) as f64 * step, (n % cols) as f64 * step);

    let mut counts = vec![0u16; n_frames * frame_len];
    let mut intensities = params
        .keep_intensities
        .then(|| vec![0f32; n_frames * frame_len]);
    let run_frame =
        |w: &mut (Work, Vec<f32>), n: usize, c: &mut [u16], i_out: Option<&mut [f32]>| {
            let (work, tmp) = w;
            let dst: &mut [f32] = match i_out {
                Some(o) => o,
                None => tmp,
            };
            setup.frame(work, pos(n), dst);
            let mut rng =
                rand::rngs::Xoshiro256PlusPlus::seed_from_u64(mix(params.seed ^ mix(n as u64)));
            poisson_counts(&mut rng, dst, dose, c);
        };
    let init = || (setup.work(), vec![0f32; frame_len]);
    match intensities.as_mut() {
        Some(ints) => counts
            .par_chunks_mut(frame_len)
            .zip(ints.par_chunks_mut(frame_len))
            .enumerate()
            .for_each_init(init, |w, (n, (c, i))| run_frame(w, n, c, Some(i))),
        None => counts
            .par_chunks_mut(frame_len)
            .enumerate()
            .for_each_init(init, |w, (n, c)| run_frame(w, n, c, None)),
    }

    let pot = ProjectedPotential::new(&params.crystal);
    let projected_potential = (0..n_frames)
        .map(|n| {
            let (r, c) = pos(n);
            pot.at(r, c) as f32
        })
        .collect();
    let dtheta = params.angular_sampling_mrad();
    let calibration = Calibration {
        voltage_kv: params.voltage_kv,
        wavelength_a: wavelength_a(params.voltage_kv),
        sigma_rad_per_v_a: interaction_constant_rad_per_v_a(params.voltage_kv),
        semiangle_mrad: params.semiangle_mrad,
        scan_step_a: step,
        angular_sampling_mrad: dtheta,
        bf_radius_px: params.semiangle_mrad / dtheta,
        beam_center_px: (
            (params.detector_shape.rows / 2) as f64,
            (params.detector_shape.cols / 2) as f64,
        ),
        potential_pixel_a: setup.pixel_a,
        window_px: setup.m,
    };
    Ok(SimOutput {
        counts,
        intensities,
        projected_potential,
        calibration,
        params: params.clone(),
    })
}

#[cfg(test)]
mod tests;
