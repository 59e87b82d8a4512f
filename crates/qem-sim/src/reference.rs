//! The reference benchmark acquisition (the anchor figures' data), frame by frame.
//!
//! [`ReferencePattern`] follows the recipe of `tests/tools/make_reference_acquisition.py`
//! (which makes the same kind of data with CuPy + h5py): for scan position `(i, j)` a
//! lattice-like sample `ph = cos(2πi/9.3)·cos(2πj/9.3)` modulates the bright-field disk
//! (`0.85 + 0.15·ph`) and deflects its centre by up to 1.2 px
//! (`(K_r/2 + 1.2·sin(2πi/9.3)·cos(2πj/9.3), K_c/2 + 1.2·cos(2πi/9.3)·sin(2πj/9.3))`); the disk
//! of radius `radius_px` has a logistic edge of 0.7 px, and a diffuse halo
//! `0.15·exp(−r/22)·(1 + 0.5·ph)` surrounds it. The expectation is normalised to
//! `dose_e_per_frame` over the detector and sampled as Poisson counts; two pixels, (17, 101)
//! and (150, 3), then read the dtype's maximum (65535 for u16) and are flagged in the
//! [`ReferencePattern::pixel_mask`] with values 1 and 8, like dead/hot pixels of a real
//! detector. It is not bit-identical to the CuPy recipe (another random generator); its
//! statistics and compression ratio (≈6.0× bitshuffle-LZ4 at 200 000 e⁻/frame) are the same.
//!
//! Frame `n` is deterministic for `(seed, n)` whatever the thread or order it is drawn in.
//!
//! # Speed
//! A frame is 36 864 Poisson draws with per-pixel λ (≈0.1–2.5 outside the disk, ≈60 inside),
//! so the sampler dominates: [`poisson`] uses sequential-search inversion for λ < 12 (expected
//! λ + 1 steps, one `exp`) and Hörmann's PTRS transformed rejection above (≈1.1 uniform pairs
//! per draw, a log-factorial table instead of `lgamma`); λ itself is computed in f32.

use qem_core::{Error, Result, Shape2};
use rand::{Rng, SeedableRng};
use std::f64::consts::PI;
use std::sync::OnceLock;

/// Bad pixels of the reference acquisition: `((row, col), pixel_mask value)`.
pub const REFERENCE_BAD_PIXELS: [((usize, usize), u32); 2] = [((17, 101), 1), ((150, 3), 8)];

/// Period of the lattice-like sample, in scan positions.
const LATTICE_PERIOD: f64 = 9.3;
/// Largest deflection of the disk centre, px.
const DEFLECTION_PX: f64 = 1.2;
/// Width of the disk's logistic edge, px.
const EDGE_PX: f32 = 0.7;
/// Decay length of the halo, px.
const HALO_DECAY_PX: f32 = 22.0;

/// Parameters of [`ReferencePattern`]; `Default` is the reference acquisition
/// (512 × 512 scan, 192 × 192 detector, radius 30 px, 200 000 e⁻/frame, seed 1234).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ReferenceParams {
    /// Scan grid `(R_r, R_c)`; frame `n = i·R_c + j`.
    pub scan_shape: Shape2,
    /// Detector frame `(k_r, k_c)`.
    pub detector_shape: Shape2,
    /// Radius of the bright-field disk, px.
    pub radius_px: f64,
    /// Expected counts per frame (before the bad pixels are set).
    pub dose_e_per_frame: f64,
    /// Seed of the per-frame random streams.
    pub seed: u64,
}

impl Default for ReferenceParams {
    fn default() -> Self {
        ReferenceParams {
            scan_shape: Shape2::new(512, 512),
            detector_shape: Shape2::new(192, 192),
            radius_px: 30.0,
            dose_e_per_frame: 200_000.0,
            seed: 1234,
        }
    }
}

/// Frame generator of the reference benchmark acquisition (see the module docs).
#[derive(Debug, Clone)]
pub struct ReferencePattern {
    params: ReferenceParams,
    /// Flat indices of the bad pixels that lie on the detector.
    bad: Vec<usize>,
}

impl ReferencePattern {
    /// Validate `params`.
    pub fn new(params: ReferenceParams) -> Result<ReferencePattern> {
        let ok = !params.scan_shape.is_empty()
            && !params.detector_shape.is_empty()
            && params.radius_px.is_finite()
            && params.radius_px > 0.0
            && params.dose_e_per_frame.is_finite()
            && params.dose_e_per_frame >= 0.0;
        if !ok {
            return Err(Error::invalid(
                "reference pattern",
                "invalid scan or detector shape, radius or dose",
            )
            .with_expected("non-empty shapes, radius > 0, finite dose >= 0")
            .with_found(format!(
                "scan {}, detector {}, radius {}, dose {}",
                params.scan_shape, params.detector_shape, params.radius_px, params.dose_e_per_frame
            )));
        }
        let det = params.detector_shape;
        let bad = REFERENCE_BAD_PIXELS
            .iter()
            .filter(|((r, c), _)| *r < det.rows && *c < det.cols)
            .map(|((r, c), _)| r * det.cols + c)
            .collect();
        Ok(ReferencePattern { params, bad })
    }

    /// The parameters.
    pub fn params(&self) -> &ReferenceParams {
        &self.params
    }

    /// Number of frames (`R_r·R_c`).
    pub fn frames(&self) -> u64 {
        self.params.scan_shape.len() as u64
    }

    /// `pixel_mask` of the detector (`k_r·k_c` values; 1 and 8 at the bad pixels that lie on it).
    pub fn pixel_mask(&self) -> Vec<u32> {
        let det = self.params.detector_shape;
        let mut m = vec![0u32; det.len()];
        for ((r, c), v) in REFERENCE_BAD_PIXELS {
            if r < det.rows && c < det.cols {
                m[r * det.cols + c] = v;
            }
        }
        m
    }

    /// The expected counts λ of frame `n` (`k_r·k_c` values summing to the dose).
    pub fn expectation(&self, n: u64, lam: &mut [f32]) {
        let p = &self.params;
        let det = p.detector_shape;
        debug_assert_eq!(lam.len(), det.len());
        let cols = p.scan_shape.cols as u64;
        let (i, j) = ((n / cols) as f64, (n % cols) as f64);
        let (ai, aj) = (2.0 * PI * i / LATTICE_PERIOD, 2.0 * PI * j / LATTICE_PERIOD);
        let ph = ai.cos() * aj.cos();
        let cy = (det.rows as f64) / 2.0 + DEFLECTION_PX * ai.sin() * aj.cos();
        let cx = (det.cols as f64) / 2.0 + DEFLECTION_PX * ai.cos() * aj.sin();
        let (cy, cx, ph) = (cy as f32, cx as f32, ph as f32);
        let radius = p.radius_px as f32;
        let bf_scale = 0.85 + 0.15 * ph;
        let halo_scale = 0.15 * (1.0 + 0.5 * ph);
        let mut total = 0.0f64;
        for (r, row) in lam.chunks_exact_mut(det.cols).enumerate() {
            let dr2 = (r as f32 - cy) * (r as f32 - cy);
            let mut row_total = 0.0f32;
            for (c, l) in row.iter_mut().enumerate() {
                let dc = c as f32 - cx;
                let d = (dr2 + dc * dc).sqrt();
                // Beyond 40 edge widths the disk term is below 5e-18 of its peak: skip the exp.
                let x = (d - radius) / EDGE_PX;
                let bf = if x > 40.0 { 0.0 } else { 1.0 / (1.0 + x.exp()) };
                let halo = halo_scale * (-d / HALO_DECAY_PX).exp();
                let v = bf * bf_scale + halo;
                *l = v;
                row_total += v;
            }
            total += row_total as f64;
        }
        let scale = if total > 0.0 {
            (p.dose_e_per_frame / total) as f32
        } else {
            0.0
        };
        for l in lam.iter_mut() {
            *l *= scale;
        }
    }

    /// Frame `n` as counts clipped to `max_value`, the bad pixels set to `max_value`
    /// (`out.len() == k_r·k_c`). `lam` is scratch of the same length.
    pub fn frame(&self, n: u64, max_value: u32, lam: &mut [f32], out: &mut [u32]) {
        self.expectation(n, lam);
        let mut rng = rand::rngs::Xoshiro256PlusPlus::seed_from_u64(crate::mix(
            self.params.seed ^ crate::mix(n),
        ));
        for (o, &l) in out.iter_mut().zip(lam.iter()) {
            *o = poisson(&mut rng, l).min(max_value);
        }
        for &k in &self.bad {
            out[k] = max_value;
        }
    }

    /// Frame `n` as a loader holds it: counts clipped to 65535, as u16, with the bad pixels
    /// of [`ReferencePattern::pixel_mask`] zeroed. `lam` and `out` are scratch of `k_r·k_c`.
    pub fn loaded_frame(&self, n: u64, lam: &mut [f32], out: &mut [u32]) -> Vec<u16> {
        self.frame(n, 65535, lam, out);
        let mut f: Vec<u16> = out.iter().map(|&v| v as u16).collect();
        for &k in &self.bad {
            f[k] = 0;
        }
        f
    }
}

/// A uniform draw in `[0, 1)` with 53 random bits.
#[inline]
fn uniform<R: Rng>(rng: &mut R) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Size of the `ln k!` table.
const LOG_FACTORIALS: usize = 1024;

fn log_factorials() -> &'static [f64; LOG_FACTORIALS] {
    static TABLE: OnceLock<Box<[f64; LOG_FACTORIALS]>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = Box::new([0.0f64; LOG_FACTORIALS]);
        for k in 1..LOG_FACTORIALS {
            t[k] = t[k - 1] + (k as f64).ln();
        }
        t
    })
}

/// `ln k!` (table below 1024, Stirling's series above).
fn ln_factorial(k: u64) -> f64 {
    if (k as usize) < LOG_FACTORIALS {
        return log_factorials()[k as usize];
    }
    let x = k as f64 + 1.0;
    (x - 0.5) * x.ln() - x + 0.5 * (2.0 * PI).ln() + 1.0 / (12.0 * x) - 1.0 / (360.0 * x * x * x)
}

/// Below this λ, inversion by sequential search; above, PTRS.
const INVERSION_MAX_LAMBDA: f32 = 12.0;

/// One Poisson draw of mean `lambda` (0 for λ ≤ 0 or NaN).
///
/// λ < 12: inversion — walk the CDF `Σ e^−λ λ^k/k!` from k = 0 until it passes a uniform draw.
/// λ ≥ 12: W. Hörmann, "The transformed rejection method for generating Poisson random
/// variables", Insurance: Mathematics and Economics 12 (1993) 39–45 (PTRS).
pub fn poisson<R: Rng>(rng: &mut R, lambda: f32) -> u32 {
    if lambda.is_nan() || lambda <= 0.0 {
        return 0;
    }
    if lambda < INVERSION_MAX_LAMBDA {
        let lam = lambda as f64;
        let u = uniform(rng);
        let mut p = (-lam).exp();
        let mut cdf = p;
        let mut k = 0u32;
        // The CDF reaches 1 − 1e-16 long before k = 200 for λ < 12; the bound only guards
        // against rounding leaving u above the summed CDF.
        while u > cdf && k < 200 {
            k += 1;
            p *= lam / k as f64;
            cdf += p;
        }
        return k;
    }
    let lam = lambda as f64;
    let slam = lam.sqrt();
    let loglam = lam.ln();
    let b = 0.931 + 2.53 * slam;
    let a = -0.059 + 0.02483 * b;
    let inv_alpha = 1.1239 + 1.1328 / (b - 3.4);
    let vr = 0.9277 - 3.6224 / (b - 2.0);
    loop {
        let u = uniform(rng) - 0.5;
        let v = uniform(rng);
        let us = 0.5 - u.abs();
        let k = ((2.0 * a / us + b) * u + lam + 0.43).floor();
        if us >= 0.07 && v <= vr {
            return k.min(u32::MAX as f64) as u32;
        }
        if k < 0.0 || (us < 0.013 && v > us) {
            continue;
        }
        let ki = k as u64;
        if v.ln() + inv_alpha.ln() - (a / (us * us) + b).ln()
            <= -lam + k * loglam - ln_factorial(ki)
        {
            return k.min(u32::MAX as f64) as u32;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn mean_var(lambda: f32, n: usize, seed: u64) -> (f64, f64) {
        let mut rng = rand::rngs::Xoshiro256PlusPlus::seed_from_u64(seed);
        let draws: Vec<f64> = (0..n).map(|_| poisson(&mut rng, lambda) as f64).collect();
        let m = draws.iter().sum::<f64>() / n as f64;
        let v = draws.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1) as f64;
        (m, v)
    }

    #[test]
    fn poisson_mean_and_variance_match_lambda() {
        // Both branches and the switch between them; 5-sigma bounds on mean and variance.
        for (i, &lam) in [0.05f32, 0.7, 2.5, 11.9, 12.0, 61.0, 900.0, 5000.0]
            .iter()
            .enumerate()
        {
            let n = 200_000;
            let (m, v) = mean_var(lam, n, 17 + i as u64);
            let lam = lam as f64;
            let sd_mean = (lam / n as f64).sqrt();
            // Var of the sample variance of a Poisson: (λ + 2λ²)/n (fourth cumulant λ).
            let sd_var = ((lam + 2.0 * lam * lam) / n as f64).sqrt();
            assert!((m - lam).abs() < 5.0 * sd_mean, "λ={lam}: mean {m}");
            assert!((v - lam).abs() < 5.0 * sd_var, "λ={lam}: variance {v}");
        }
        let mut rng = rand::rngs::Xoshiro256PlusPlus::seed_from_u64(0);
        assert_eq!(poisson(&mut rng, 0.0), 0);
        assert_eq!(poisson(&mut rng, -3.0), 0);
        assert_eq!(poisson(&mut rng, f32::NAN), 0);
    }

    #[test]
    fn poisson_small_lambda_probabilities() {
        // P(0) = e^-λ and P(1) = λe^-λ for λ = 1.3 (inversion branch), within 5 sigma.
        let mut rng = rand::rngs::Xoshiro256PlusPlus::seed_from_u64(5);
        let n = 400_000;
        let mut hist = [0u32; 4];
        for _ in 0..n {
            let k = poisson(&mut rng, 1.3) as usize;
            if k < 4 {
                hist[k] += 1;
            }
        }
        for (k, &h) in hist.iter().enumerate().take(2) {
            let p = (-1.3f64).exp() * 1.3f64.powi(k as i32); // k! = 1 for k = 0, 1
            let f = h as f64 / n as f64;
            let sd = (p * (1.0 - p) / n as f64).sqrt();
            assert!((f - p).abs() < 5.0 * sd, "P({k}) = {f}, expected {p}");
        }
    }

    #[test]
    fn ln_factorial_table_and_series_agree() {
        let exact: f64 = (1..=1500u64).map(|k| (k as f64).ln()).sum();
        assert!((ln_factorial(1500) - exact).abs() < 1e-6);
        let exact: f64 = (1..=1023u64).map(|k| (k as f64).ln()).sum();
        assert!((ln_factorial(1023) - exact).abs() < 1e-6);
        assert_eq!(ln_factorial(0), 0.0);
    }

    #[test]
    fn reference_frames_are_deterministic_and_carry_the_dose() {
        let params = ReferenceParams {
            scan_shape: Shape2::new(4, 5),
            ..ReferenceParams::default()
        };
        let p = ReferencePattern::new(params).unwrap();
        let det = p.params().detector_shape;
        let mut lam = vec![0f32; det.len()];
        let (mut a, mut b) = (vec![0u32; det.len()], vec![0u32; det.len()]);
        p.frame(7, 65535, &mut lam, &mut a);
        p.frame(7, 65535, &mut lam, &mut b);
        assert_eq!(a, b);
        p.frame(8, 65535, &mut lam, &mut b);
        assert_ne!(a, b);
        // The loaded form: the same counts, the bad pixels zeroed.
        let loaded = p.loaded_frame(7, &mut lam, &mut b);
        let mask0 = p.pixel_mask();
        for (k, (&l, &v)) in loaded.iter().zip(&a).enumerate() {
            assert_eq!(u32::from(l), if mask0[k] != 0 { 0 } else { v }, "pixel {k}");
        }
        // Bad pixels read the maximum and are flagged.
        assert_eq!(a[17 * 192 + 101], 65535);
        assert_eq!(a[150 * 192 + 3], 65535);
        let mask = p.pixel_mask();
        assert_eq!(mask[17 * 192 + 101], 1);
        assert_eq!(mask[150 * 192 + 3], 8);
        assert_eq!(mask.iter().filter(|&&v| v != 0).count(), 2);
        // The dose, less the bad pixels' expectation, within a few sigma.
        let good: u64 = a
            .iter()
            .enumerate()
            .filter(|(k, _)| mask[*k] == 0)
            .map(|(_, &v)| v as u64)
            .sum();
        assert!((good as f64 - 200_000.0).abs() < 3_000.0, "{good}");
        // Bright disk around the (deflected) centre, dark corner.
        p.expectation(7, &mut lam);
        let total: f64 = lam.iter().map(|&l| l as f64).sum();
        assert!((total - 200_000.0).abs() < 1.0, "{total}");
        assert!(
            lam[96 * 192 + 96] > 50.0 && lam[0] < 0.5,
            "{}",
            lam[96 * 192 + 96]
        );
        // The sample modulates the bright field: frame 0 (ph = 1) vs a frame with ph < 0.
        let mut lam2 = vec![0f32; det.len()];
        p.expectation(3, &mut lam2); // j = 3: cos(2π·3/9.3) < 0
        assert!(lam[96 * 192 + 96] != lam2[96 * 192 + 96]);
    }

    #[test]
    fn reference_rejects_bad_parameters_and_small_detectors_skip_bad_pixels() {
        let bad = ReferenceParams {
            radius_px: 0.0,
            ..ReferenceParams::default()
        };
        assert!(ReferencePattern::new(bad).is_err());
        let small = ReferenceParams {
            scan_shape: Shape2::new(2, 2),
            detector_shape: Shape2::new(64, 64),
            radius_px: 10.0,
            ..ReferenceParams::default()
        };
        let p = ReferencePattern::new(small).unwrap();
        assert!(p.pixel_mask().iter().all(|&v| v == 0));
    }
}
