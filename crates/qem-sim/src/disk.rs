//! A cheap generator for large benchmark acquisitions.
//!
//! Simulating a 128×128 scan on a 192×192 detector with [`crate::simulate`] costs two large FFTs
//! per frame; benchmarks of loading and decoding only need data with realistic counting
//! statistics (and hence realistic compression). [`DiskPattern`] draws every frame as Poisson
//! counts of one fixed pattern: a uniformly bright disk with a one-pixel soft edge (the BF disk)
//! centred on `(k_r/2, k_c/2)` (rounded down, as in [`crate::simulate`]), plus a weak halo outside
//! it falling off as `(r/d)⁴` (the dark-field scattering of a real specimen). There is no
//! specimen and no contrast between frames beyond the noise.

use qem_core::{Error, Result, Shape2};
use rand::SeedableRng;
use rand_distr::{Distribution, Poisson};

/// Fixed expected pattern, sampled with Poisson noise per frame.
#[derive(Debug, Clone)]
pub struct DiskPattern {
    detector_shape: Shape2,
    /// Per pixel: the Poisson distribution of its counts, `None` where the expectation is 0.
    pixels: Vec<Option<Poisson<f64>>>,
    seed: u64,
}

impl DiskPattern {
    /// The pattern of a disk of `radius_px` pixels holding `1 − halo_fraction` of
    /// `dose_e_per_frame` electrons, the rest in the halo outside it.
    pub fn new(
        detector_shape: Shape2,
        radius_px: f64,
        halo_fraction: f64,
        dose_e_per_frame: f64,
        seed: u64,
    ) -> Result<DiskPattern> {
        let ok = !detector_shape.is_empty()
            && radius_px.is_finite()
            && radius_px > 0.0
            && (0.0..=1.0).contains(&halo_fraction)
            && dose_e_per_frame.is_finite()
            && dose_e_per_frame >= 0.0;
        if !ok {
            return Err(Error::invalid(
                "disk pattern",
                "invalid detector shape, radius, halo fraction or dose",
            )
            .with_expected("non-empty detector, radius > 0, 0 <= halo <= 1, dose >= 0")
            .with_found(format!(
                "detector {detector_shape}, radius {radius_px}, halo {halo_fraction}, dose {dose_e_per_frame}"
            )));
        }
        let (cr, cc) = (
            (detector_shape.rows / 2) as f64,
            (detector_shape.cols / 2) as f64,
        );
        let mut disk = vec![0.0f64; detector_shape.len()];
        let mut halo = vec![0.0f64; detector_shape.len()];
        for i in 0..detector_shape.rows {
            for j in 0..detector_shape.cols {
                let d = ((i as f64 - cr).powi(2) + (j as f64 - cc).powi(2)).sqrt();
                let k = i * detector_shape.cols + j;
                disk[k] = (radius_px - d + 0.5).clamp(0.0, 1.0);
                halo[k] = (1.0 - disk[k]) * (radius_px / d.max(radius_px)).powi(4);
            }
        }
        let (sd, sh): (f64, f64) = (disk.iter().sum(), halo.iter().sum());
        let pixels = disk
            .iter()
            .zip(&halo)
            .map(|(&d, &h)| {
                let mut lam = 0.0;
                if sd > 0.0 {
                    lam += dose_e_per_frame * (1.0 - halo_fraction) * d / sd;
                }
                if sh > 0.0 {
                    lam += dose_e_per_frame * halo_fraction * h / sh;
                }
                Poisson::new(lam).ok()
            })
            .collect();
        Ok(DiskPattern {
            detector_shape,
            pixels,
            seed,
        })
    }

    /// Detector shape of the frames.
    pub fn detector_shape(&self) -> Shape2 {
        self.detector_shape
    }

    /// Frame `n` (`k_r·k_c` counts, clipped to `u16::MAX`) into `out`; deterministic for
    /// `(seed, n)` whatever the order or thread frames are drawn in.
    pub fn frame(&self, n: u64, out: &mut [u16]) {
        let mut rng =
            rand::rngs::Xoshiro256PlusPlus::seed_from_u64(crate::mix(self.seed ^ crate::mix(n)));
        for (o, p) in out.iter_mut().zip(&self.pixels) {
            *o = match p {
                Some(d) => d.sample(&mut rng).min(u16::MAX as f64) as u16,
                None => 0,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn disk_pattern_dose_and_determinism() {
        let det = Shape2::new(48, 40);
        let p = DiskPattern::new(det, 10.0, 0.05, 10_000.0, 3).unwrap();
        let mut a = vec![0u16; det.len()];
        let mut b = vec![0u16; det.len()];
        p.frame(7, &mut a);
        p.frame(7, &mut b);
        assert_eq!(a, b);
        p.frame(8, &mut b);
        assert_ne!(a, b);
        let total: f64 = a.iter().map(|&v| v as f64).sum();
        assert!((total - 10_000.0).abs() < 500.0, "{total}");
        // Brightest around the centre (24, 20), dim in the corner.
        assert!(a[24 * 40 + 20] > 10 && a[0] < 5);
        assert!(DiskPattern::new(det, -1.0, 0.0, 1.0, 0).is_err());
    }
}
