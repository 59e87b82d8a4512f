//! Electron optics: relativistic wavelength, interaction constant, aberration function, aperture.
//!
//! Units: lengths in Å, angles in rad, accelerating voltage in kV. Constants are CODATA 2018
//! (exact SI values for `h`, `e`, `c`); they and the wavelength are `qem_core::optics`'s.

pub use qem_core::optics::{ELECTRON_MASS_KG, ELEMENTARY_CHARGE_C, PLANCK_J_S, SPEED_OF_LIGHT_M_S};

/// Relativistic de Broglie wavelength in Å of an electron accelerated through `voltage_kv` kV
/// (`qem_core::optics::electron_wavelength_a`, the one wavelength both engines use).
///
/// ```
/// let lam = qem_sim::wavelength_a(300.0);
/// assert!((lam - 0.019687489006849).abs() < 1e-14);
/// ```
pub use qem_core::optics::electron_wavelength_a as wavelength_a;

/// Interaction constant `σ = 2π γ m₀ e λ / h²` in rad/(V·Å): the phase shift per unit of
/// projected potential (V·Å), with the relativistic mass `γ m₀`. About 6.526e-4 at 300 kV.
pub fn interaction_constant_rad_per_v_a(voltage_kv: f64) -> f64 {
    let ev = ELEMENTARY_CHARGE_C * voltage_kv * 1e3;
    let mc2 = ELECTRON_MASS_KG * SPEED_OF_LIGHT_M_S * SPEED_OF_LIGHT_M_S;
    let gamma = 1.0 + ev / mc2;
    let lambda_m = wavelength_a(voltage_kv) * 1e-10;
    let sigma_per_v_m =
        2.0 * std::f64::consts::PI * gamma * ELECTRON_MASS_KG * ELEMENTARY_CHARGE_C * lambda_m
            / (PLANCK_J_S * PLANCK_J_S);
    sigma_per_v_m * 1e-10
}

/// Probe aberrations in Krivanek notation: coefficients `C_nm` in Å, azimuths `φ_nm` in rad.
///
/// The aberration function is
/// `χ(α, φ) = (2π/λ) Σ C_nm α^(n+1)/(n+1) cos(m(φ − φ_nm))`, with `α` the scattering angle (rad)
/// and `φ` the azimuth measured **from the detector/scan row axis towards the column axis**
/// (`φ = atan2(k_col, k_row)`). The probe's Fourier coefficients are `A(α) exp(−iχ)`.
///
/// Defocus: `χ ⊃ π C10 α² / λ`. With `exp(−iχ)` and free propagation `exp(−iπλΔz k²)`,
/// **positive `C10` is overfocus** (the crossover lies `C10` above the specimen). abTEM's
/// `defocus` is `−C10` (positive defocus = underfocus).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct Aberrations {
    /// Defocus `C10`, Å (positive = overfocus).
    pub c10_a: f64,
    /// Two-fold astigmatism `C12`, Å.
    pub c12_a: f64,
    /// Azimuth of `C12`, rad.
    pub phi12_rad: f64,
    /// Axial coma `C21`, Å.
    pub c21_a: f64,
    /// Azimuth of `C21`, rad.
    pub phi21_rad: f64,
    /// Three-fold astigmatism `C23`, Å.
    pub c23_a: f64,
    /// Azimuth of `C23`, rad.
    pub phi23_rad: f64,
    /// Spherical aberration `C30` (Cs), Å.
    pub c30_a: f64,
}

impl Aberrations {
    /// `χ(α, φ)` in rad for scattering angle `alpha_rad`, azimuth `phi_rad` and wavelength `λ`.
    pub fn chi(&self, alpha_rad: f64, phi_rad: f64, wavelength_a: f64) -> f64 {
        let ab = qem_core::optics::Aberrations {
            c10: self.c10_a,
            c12: self.c12_a,
            phi12: self.phi12_rad,
            c21: self.c21_a,
            phi21: self.phi21_rad,
            c23: self.c23_a,
            phi23: self.phi23_rad,
            c30: self.c30_a,
        };
        qem_core::optics::chi_polar(&ab, wavelength_a, alpha_rad, phi_rad)
    }

    /// A rough upper bound on the probe's real-space radius caused by the aberrations, Å:
    /// the geometric blur `|∂χ/∂k|/2π` at the aperture edge.
    pub fn blur_radius_a(&self, semiangle_rad: f64) -> f64 {
        let a = semiangle_rad;
        (self.c10_a.abs() + self.c12_a.abs()) * a
            + (self.c21_a.abs() + self.c23_a.abs()) * a * a
            + self.c30_a.abs() * a * a * a
    }
}

/// Soft-edged aperture transmission at angle `alpha_rad` for semi-angle `semiangle_rad`: a linear
/// ramp from 1 to 0 over one angular sample `edge_rad` centred on the edge. The ramp keeps the
/// disk's area equal to that of a hard disk of radius `semiangle_rad` and avoids ringing.
pub fn aperture(alpha_rad: f64, semiangle_rad: f64, edge_rad: f64) -> f64 {
    ((semiangle_rad - alpha_rad) / edge_rad + 0.5).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(a: f64, b: f64) -> f64 {
        ((a - b) / b).abs()
    }

    #[test]
    fn interaction_constant_at_300_kv() {
        // Kirkland's σ = 2π/(λV)·(m₀c² + eV)/(2m₀c² + eV), an independent form of the same value.
        let kv = 300.0;
        let v = kv * 1e3;
        let mc2_ev = ELECTRON_MASS_KG * SPEED_OF_LIGHT_M_S.powi(2) / ELEMENTARY_CHARGE_C;
        let kirkland =
            2.0 * std::f64::consts::PI / (wavelength_a(kv) * v) * (mc2_ev + v) / (2.0 * mc2_ev + v);
        let got = interaction_constant_rad_per_v_a(kv);
        assert!(rel(got, kirkland) < 1e-12, "{got} vs {kirkland}");
        assert!((got - 6.526e-4).abs() < 1e-6, "{got}");
    }

    #[test]
    fn defocus_term_is_pi_c10_alpha2_over_lambda() {
        let ab = Aberrations {
            c10_a: 50.0,
            ..Default::default()
        };
        let lam = wavelength_a(300.0);
        let a = 0.02;
        let want = std::f64::consts::PI * 50.0 * a * a / lam;
        assert!(rel(ab.chi(a, 0.7, lam), want) < 1e-14);
    }

    #[test]
    fn astigmatism_azimuth_is_measured_from_the_row_axis() {
        let ab = Aberrations {
            c12_a: 10.0,
            phi12_rad: 0.0,
            ..Default::default()
        };
        let lam = wavelength_a(300.0);
        // Along the row axis (φ = 0) the two-fold term is +max, along the column axis −max.
        let row = ab.chi(0.01, 0.0, lam);
        let col = ab.chi(0.01, std::f64::consts::FRAC_PI_2, lam);
        assert!(row > 0.0 && (row + col).abs() < 1e-12);
    }

    #[test]
    fn aperture_is_a_centred_ramp() {
        assert_eq!(aperture(0.0, 0.02, 0.001), 1.0);
        assert_eq!(aperture(0.02, 0.02, 0.001), 0.5);
        assert_eq!(aperture(0.03, 0.02, 0.001), 0.0);
    }
}
