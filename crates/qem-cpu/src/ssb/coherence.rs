//! The coherence loss ([`Objective::Coherence`]) over the frequencies of `coherence_terms`.
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

impl Prepared {
    /// [`Objective::Coherence`] over pixels `0..b`.
    pub(super) fn coherence(&self, ab: &Aberrations, b: usize) -> f64 {
        let p = Probe::new(&self.optics, ab);
        self.coherence_with(&p, b, p.is_quadratic())
    }

    /// The coherence with the quadratic terms (`quadratic`, which χ must allow) or the general
    /// ones.
    pub(super) fn coherence_with(&self, p: &Probe<'_>, b: usize, quadratic: bool) -> f64 {
        let h = self.terms.len();
        // acc[q] = Σ_b G_b Γ_b*(ν_q), acc[h + q].re = Σ_b |Γ_b(ν_q)|² over the frequencies of
        // `terms`; acc[2h].re = Σ_b Σ_{ν≠0} |G_b|² (pixels with A(k_b) > 0, every frequency).
        let acc = if quadratic {
            self.coherence_sums_quadratic(p, b)
        } else {
            self.coherence_sums(p, b)
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
    fn coherence_sums_quadratic(&self, p: &Probe<'_>, b: usize) -> Vec<Complex64> {
        let h = self.terms.len();
        let c = &p.c;
        // χ(v) = vᵀMv: M = [[c0 + c1, c2], [c2, c0 − c1]] (chi_polynomial, x = v_r, y = v_c).
        let (m_rr, m_rc, m_cc) = (c[0] + c[1], c[2], c[0] - c[1]);
        let u: Vec<Complex64> = self
            .terms
            .iter()
            .map(|&(i, _)| {
                let (vr, vc) = self.nu(i);
                Complex64::from_polar(1.0, -chi_from_polynomial(c, vr, vc))
            })
            .collect();
        ordered_sum(b, 2 * h + 1, Complex64::new(0.0, 0.0), |j, acc| {
            let k = self.k[j];
            let ak = p.amplitude(k.0, k.1);
            if ak == 0.0 {
                return; // zero-aperture pixel: Γ ≡ 0
            }
            let (a_r, a_c) = (
                2.0 * (m_rr * k.0 + m_rc * k.1),
                2.0 * (m_rc * k.0 + m_cc * k.1),
            );
            let e_r: Vec<Complex64> = self
                .nu_r
                .iter()
                .map(|&v| Complex64::from_polar(ak, a_r * v))
                .collect();
            let e_c: Vec<Complex64> = self
                .nu_c
                .iter()
                .map(|&v| Complex64::from_polar(1.0, a_c * v))
                .collect();
            let gj = &self.g[j];
            for (q, (&(i, _), &(r, cc))) in self.terms.iter().zip(&self.term_rc).enumerate() {
                let (vr, vc) = (self.nu_r[r as usize], self.nu_c[cc as usize]);
                let am = p.amplitude(k.0 - vr, k.1 - vc);
                let ap = p.amplitude(k.0 + vr, k.1 + vc);
                if am == 0.0 && ap == 0.0 {
                    continue; // Γ = 0
                }
                let w = u[q] * am - u[q].conj() * ap;
                let gam = e_r[r as usize] * e_c[cc as usize] * w;
                acc[q] += gj[i] * gam.conj();
                acc[h + q].re += gam.norm_sqr();
            }
            acc[2 * h].re += self.power[j];
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The quadratic terms equal the general ones (to rounding) where χ is quadratic, over
    /// every pixel and over a coarse prefix, with pixels outside and on the aperture's edge.
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
            assert!(p.is_quadratic());
            for b in [40, 13] {
                let (quad, general) = (
                    prep.coherence_with(&p, b, true),
                    prep.coherence_with(&p, b, false),
                );
                assert!(general < -1e-6, "{c10} {b}: a loss to compare ({general})");
                assert!(
                    (quad - general).abs() <= 1e-12 * general.abs(),
                    "{c10} {c12} {phi12} over {b}: {quad} vs {general}"
                );
            }
        }
        let odd = Aberrations {
            c21: 300.0,
            ..Aberrations::default()
        };
        assert!(!Probe::new(&prep.optics, &odd).is_quadratic());
    }
}
