//! The coherence loss ([`Objective::Coherence`]) over the frequencies of `coherence_terms`, and
//! the quadratic form of Γ that it and the corrected spectra use where they can.
//!
//! Any χ: `Γ_b(ν)` from the probe at `k_b ∓ ν` (two sin/cos and two χ polynomials per term).
//! Where χ is quadratic, `χ(v) = vᵀMv` (only C10, C12, φ12: the default fit), the terms need
//! neither: `χ(k ∓ ν) = χ(k) ∓ 2kᵀMν + χ(ν)` gives
//! `Γ(k, ν) = A(k) E [A(k − ν) U − A(k + ν) U*]` with `U = exp(−iχ(ν))` (one per frequency
//! and evaluation) and `E = exp(2i kᵀMν) = exp(i a_r ν_r) · exp(i a_c ν_c)`, `a = 2Mk`, which
//! separates over the scan's rows and columns (`N_r + N_c` sin/cos per pixel, then one complex
//! product per term). The CUDA kernels use the same algebra (`kernels/ssb.cu`, `quad_terms`);
//! here E is exact per term (no carried product), so the two forms differ by rounding only.

use super::*;

/// One evaluation's tables of the quadratic form: `M` and `U(ν)` over the full plane.
pub(super) struct Quadratic {
    m_rr: f64,
    m_rc: f64,
    m_cc: f64,
    /// `U = exp(−iχ(ν))`, row-major over the scan's frequencies.
    pub(super) u: Vec<Complex64>,
}

impl Quadratic {
    /// `W = A(k − ν) U − A(k + ν) U*`, or `None` where both apertures are 0 (Γ = 0).
    pub(super) fn w(
        &self,
        p: &Probe<'_>,
        k: (f64, f64),
        nu: (f64, f64),
        u: Complex64,
    ) -> Option<Complex64> {
        let am = p.amplitude(k.0 - nu.0, k.1 - nu.1);
        let ap = p.amplitude(k.0 + nu.0, k.1 + nu.1);
        if am == 0.0 && ap == 0.0 {
            return None;
        }
        Some(u * am - u.conj() * ap)
    }
}

impl Prepared {
    /// The quadratic form's tables when `p`'s χ is quadratic.
    pub(super) fn quadratic(&self, p: &Probe<'_>) -> Option<Quadratic> {
        if !p.is_quadratic() {
            return None;
        }
        let c = &p.c;
        // χ(v) = vᵀMv: M = [[c0 + c1, c2], [c2, c0 − c1]] (chi_polynomial, x = v_r, y = v_c).
        let u = (0..self.scan.len())
            .map(|i| {
                let (vr, vc) = self.nu(i);
                Complex64::from_polar(1.0, -chi_from_polynomial(c, vr, vc))
            })
            .collect();
        Some(Quadratic {
            m_rr: c[0] + c[1],
            m_rc: c[2],
            m_cc: c[0] - c[1],
            u,
        })
    }

    /// `A(k) exp(i a_r ν_r)` over the scan's rows and `exp(i a_c ν_c)` over its columns
    /// (`a = 2Mk`): their product is `A(k) E`.
    pub(super) fn pixel_phases(
        &self,
        q: &Quadratic,
        k: (f64, f64),
        ak: f64,
    ) -> (Vec<Complex64>, Vec<Complex64>) {
        let a_r = 2.0 * (q.m_rr * k.0 + q.m_rc * k.1);
        let a_c = 2.0 * (q.m_rc * k.0 + q.m_cc * k.1);
        (
            self.nu_r
                .iter()
                .map(|&v| Complex64::from_polar(ak, a_r * v))
                .collect(),
            self.nu_c
                .iter()
                .map(|&v| Complex64::from_polar(1.0, a_c * v))
                .collect(),
        )
    }

    /// [`Objective::Coherence`] over pixels `0..b`.
    pub(super) fn coherence(&self, ab: &Aberrations, b: usize) -> f64 {
        let p = Probe::new(&self.optics, ab);
        self.coherence_with(&p, b, self.quadratic(&p).as_ref())
    }

    /// The coherence with the quadratic terms (`quad`) or the general ones.
    pub(super) fn coherence_with(&self, p: &Probe<'_>, b: usize, quad: Option<&Quadratic>) -> f64 {
        let h = self.terms.len();
        // acc[q] = Σ_b G_b Γ_b*(ν_q), acc[h + q].re = Σ_b |Γ_b(ν_q)|² over the frequencies of
        // `terms`; acc[2h].re = Σ_b Σ_{ν≠0} |G_b|² (pixels with A(k_b) > 0, every frequency).
        let acc = match quad {
            Some(q) => self.coherence_sums_quadratic(p, q, b),
            None => self.coherence_sums(p, b),
        };
        let power = acc[2 * h].re;
        if power <= 0.0 {
            return 0.0;
        }
        let explained: f64 = self
            .terms
            .iter()
            .enumerate()
            .filter(|&(q, _)| acc[h + q].re > GAMMA_SUM_FLOOR)
            .map(|(q, &(_, w))| w * acc[q].norm_sqr() / acc[h + q].re)
            .sum();
        -explained / power
    }

    /// The sums of [`Prepared::coherence_with`] for any χ.
    fn coherence_sums(&self, p: &Probe<'_>, b: usize) -> Vec<Complex64> {
        let h = self.terms.len();
        ordered_sum(b, 2 * h + 1, Complex64::new(0.0, 0.0), |j, acc| {
            let k = self.k[j];
            let pk = p.at(k.0, k.1);
            if pk.norm_sqr() == 0.0 {
                return; // zero-aperture pixel: Γ ≡ 0
            }
            let gj = &self.g[j];
            for (q, &(i, _)) in self.terms.iter().enumerate() {
                let gam = p.gamma_at(k, pk, self.nu(i));
                acc[q] += gj[i] * gam.conj();
                acc[h + q].re += gam.norm_sqr();
            }
            acc[2 * h].re += self.power[j];
        })
    }

    /// The sums of [`Prepared::coherence_with`] for quadratic χ (module docs).
    fn coherence_sums_quadratic(&self, p: &Probe<'_>, q: &Quadratic, b: usize) -> Vec<Complex64> {
        let h = self.terms.len();
        ordered_sum(b, 2 * h + 1, Complex64::new(0.0, 0.0), |j, acc| {
            let k = self.k[j];
            let ak = p.amplitude(k.0, k.1);
            if ak == 0.0 {
                return; // zero-aperture pixel: Γ ≡ 0
            }
            let (e_r, e_c) = self.pixel_phases(q, k, ak);
            let gj = &self.g[j];
            for (t, (&(i, _), &(r, c))) in self.terms.iter().zip(&self.term_rc).enumerate() {
                let (r, c) = (r as usize, c as usize);
                let Some(w) = q.w(p, k, (self.nu_r[r], self.nu_c[c]), q.u[i]) else {
                    continue; // Γ = 0
                };
                let gam = e_r[r] * e_c[c] * w;
                acc[t] += gj[i] * gam.conj();
                acc[h + t].re += gam.norm_sqr();
            }
            acc[2 * h].re += self.power[j];
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The quadratic terms equal the general ones (to rounding) where χ is quadratic, in the
    /// coherence over every pixel and over a coarse prefix and in every pixel's corrected
    /// spectrum, with pixels outside and on the aperture's edge.
    #[test]
    fn quadratic_terms_equal_the_general_ones() {
        // Oblong detector pixels: a soft edge of direction-dependent width.
        let o = Optics {
            dtheta_rad: (1.0e-3, 1.2e-3),
            ..Optics::new(200.0, 21.0, 1.0)
        };
        let kmax = o.alpha_rad / o.lambda_a;
        let scan = Shape2::new(9, 12);
        let n = scan.len();
        let k: Vec<(f64, f64)> = (0..40)
            .map(|j| {
                let t = j as f64 * 0.61;
                let r = 1.05 * kmax * ((j % 7) as f64 / 6.0);
                (r * t.cos(), r * t.sin())
            })
            .collect();
        let images: Vec<u32> = (0..k.len() * n)
            .map(|i| ((i * 6007 + 11) % 307) as u32)
            .collect();
        let prep = Prepared::new(&images, scan, (0.31, 0.27), o, k).unwrap();
        for (c10, c12, phi12) in [(0.0, 0.0, 0.0), (85.0, 20.0, 0.4), (-140.0, 55.0, -1.2)] {
            let ab = Aberrations {
                c10,
                c12,
                phi12,
                ..Aberrations::default()
            };
            let p = Probe::new(&prep.optics, &ab);
            let q = prep.quadratic(&p).expect("quadratic χ");
            for b in [40, 13] {
                let (quad, general) = (
                    prep.coherence_with(&p, b, Some(&q)),
                    prep.coherence_with(&p, b, None),
                );
                assert!(general < -1e-6, "{c10} {b}: a loss to compare ({general})");
                assert!(
                    (quad - general).abs() <= 1e-12 * general.abs(),
                    "{c10} {c12} {phi12} over {b}: {quad} vs {general}"
                );
            }
        }
        // The corrected spectra (object, phase variance) by both forms, pixel by pixel.
        let ab = Aberrations {
            c10: 85.0,
            c12: 20.0,
            phi12: 0.4,
            ..Aberrations::default()
        };
        let p = Probe::new(&prep.optics, &ab);
        let q = prep.quadratic(&p).expect("quadratic χ");
        let mut compared = 0;
        for j in 0..prep.n_pixels() {
            let (quad, general) = (
                prep.corrected_with(j, &p, Some(&q)),
                prep.corrected_with(j, &p, None),
            );
            let norm: f64 = general.iter().map(|v| v.norm_sqr()).sum::<f64>().sqrt();
            let diff: f64 = quad
                .iter()
                .zip(&general)
                .map(|(a, b)| (a - b).norm_sqr())
                .sum::<f64>()
                .sqrt();
            assert!(diff <= 1e-12 * norm, "pixel {j}: {diff} vs {norm}");
            compared += usize::from(general[1..].iter().any(|v| v.norm_sqr() > 0.0));
        }
        assert!(compared > 20, "{compared} pixels with a non-zero spectrum");
        let odd = Aberrations {
            c21: 300.0,
            ..Aberrations::default()
        };
        assert!(prep.quadratic(&Probe::new(&prep.optics, &odd)).is_none());
    }
}
