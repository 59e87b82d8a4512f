//! Shared electron optics: the relativistic wavelength, the Krivanek aberration function χ, the
//! probe-forming aperture and the parameters that describe them ([`Aberrations`], [`Optics`]).
//!
//! Both engines need the same physics: the CPU engine (`qem-cpu`'s SSB) evaluates χ directly,
//! the CUDA engine passes [`chi_polynomial`] coefficients and the [`Optics`] to its kernels,
//! and the façade derives the wavelength from the acquisition's voltage. Keeping it here, in
//! the vocabulary crate, means neither engine has to depend on the other for it.
//!
//! Units: lengths in Å, angles in rad, accelerating voltage in kV, spatial frequencies in Å⁻¹.
//! Constants are CODATA 2018 (exact SI values for `h`, `e`, `c`). Nothing here needs complex
//! numbers; the complex probe `A exp(−iχ)` is built by the engines.

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::f64::consts::PI;

/// Planck constant, J·s (exact, CODATA 2018).
pub const PLANCK_J_S: f64 = 6.626_070_15e-34;
/// Electron rest mass, kg (CODATA 2018).
pub const ELECTRON_MASS_KG: f64 = 9.109_383_701_5e-31;
/// Elementary charge, C (exact, CODATA 2018).
pub const ELEMENTARY_CHARGE_C: f64 = 1.602_176_634e-19;
/// Speed of light in vacuum, m/s (exact).
pub const SPEED_OF_LIGHT_M_S: f64 = 299_792_458.0;

/// Relativistic de Broglie wavelength in Å of an electron accelerated through `voltage_kv` kV:
/// `λ = h / √(2 m₀ e V (1 + eV / (2 m₀ c²)))`.
///
/// ```
/// let lam = qem_core::optics::electron_wavelength_a(300.0);
/// assert!((lam - 0.019687489006849).abs() < 1e-14);
/// ```
pub fn electron_wavelength_a(voltage_kv: f64) -> f64 {
    let ev = ELEMENTARY_CHARGE_C * voltage_kv * 1e3;
    let p = (2.0
        * ELECTRON_MASS_KG
        * ev
        * (1.0 + ev / (2.0 * ELECTRON_MASS_KG * SPEED_OF_LIGHT_M_S * SPEED_OF_LIGHT_M_S)))
        .sqrt();
    PLANCK_J_S / p * 1e10
}

/// Aberration coefficients (Krivanek notation). Coefficients in Å, angles in rad; `Default`
/// is the aberration-free probe.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Aberrations {
    /// Defocus C10, Å (χ ⊃ π C10 α²/λ; abTEM's `defocus` is −C10).
    pub c10: f64,
    /// Two-fold astigmatism C12, Å.
    pub c12: f64,
    /// Angle φ12 of C12, rad.
    pub phi12: f64,
    /// Axial coma C21, Å.
    pub c21: f64,
    /// Angle φ21 of C21, rad.
    pub phi21: f64,
    /// Three-fold astigmatism C23, Å.
    pub c23: f64,
    /// Angle φ23 of C23, rad.
    pub phi23: f64,
    /// Spherical aberration C30, Å.
    pub c30: f64,
}

/// Names of the [`Aberrations`] fields, in the order of [`Aberrations::to_map`].
pub const ABERRATION_NAMES: [&str; 8] =
    ["C10", "C12", "phi12", "C21", "phi21", "C23", "phi23", "C30"];

impl Aberrations {
    /// Unit of a named parameter (`"Å"` or `"rad"`), `None` for an unknown name.
    pub fn unit(name: &str) -> Option<&'static str> {
        match name {
            "C10" | "C12" | "C21" | "C23" | "C30" => Some("Å"),
            "phi12" | "phi21" | "phi23" => Some("rad"),
            _ => None,
        }
    }

    /// Value of a named parameter.
    pub fn get(&self, name: &str) -> Option<f64> {
        Some(match name {
            "C10" => self.c10,
            "C12" => self.c12,
            "phi12" => self.phi12,
            "C21" => self.c21,
            "phi21" => self.phi21,
            "C23" => self.c23,
            "phi23" => self.phi23,
            "C30" => self.c30,
            _ => return None,
        })
    }

    /// Set a named parameter; an unknown name or a non-finite value is an error.
    pub fn set(&mut self, name: &str, value: f64) -> Result<()> {
        if !value.is_finite() {
            return Err(
                Error::invalid("ssb aberrations", format!("{name} is not finite"))
                    .with_expected("a finite value")
                    .with_found(value.to_string()),
            );
        }
        let slot = match name {
            "C10" => &mut self.c10,
            "C12" => &mut self.c12,
            "phi12" => &mut self.phi12,
            "C21" => &mut self.c21,
            "phi21" => &mut self.phi21,
            "C23" => &mut self.c23,
            "phi23" => &mut self.phi23,
            "C30" => &mut self.c30,
            _ => {
                return Err(Error::invalid("ssb aberrations", "unknown aberration name")
                    .with_expected(ABERRATION_NAMES.join(", "))
                    .with_found(name.to_string()))
            }
        };
        *slot = value;
        Ok(())
    }

    /// From a name → value map (missing names are 0).
    pub fn from_map(map: &BTreeMap<String, f64>) -> Result<Aberrations> {
        let mut ab = Aberrations::default();
        for (k, &v) in map {
            ab.set(k, v)?;
        }
        Ok(ab)
    }

    /// All parameters as a name → value map.
    pub fn to_map(&self) -> BTreeMap<String, f64> {
        ABERRATION_NAMES
            .iter()
            .filter_map(|&n| self.get(n).map(|v| (n.to_string(), v)))
            .collect()
    }
}

/// Krivanek aberration function χ (rad) at the reciprocal vector `(v_r, v_c)` (Å⁻¹):
/// `α = λ|v|`, `φ = atan2(v_c, v_r)` (from the row axis towards the column axis).
pub fn chi(ab: &Aberrations, lambda_a: f64, v_r: f64, v_c: f64) -> f64 {
    let a = lambda_a * (v_r * v_r + v_c * v_c).sqrt();
    if a == 0.0 {
        return 0.0;
    }
    chi_polar(ab, lambda_a, a, v_c.atan2(v_r))
}

/// [`chi`] at scattering angle `alpha_rad` = λ|v| and azimuth `phi_rad` (from the row axis
/// towards the column axis).
pub fn chi_polar(ab: &Aberrations, lambda_a: f64, alpha_rad: f64, phi_rad: f64) -> f64 {
    let (a, phi) = (alpha_rad, phi_rad);
    let a2 = a * a;
    let sum = ab.c10 * a2 / 2.0
        + ab.c12 * a2 / 2.0 * (2.0 * (phi - ab.phi12)).cos()
        + ab.c21 * a2 * a / 3.0 * (phi - ab.phi21).cos()
        + ab.c23 * a2 * a / 3.0 * (3.0 * (phi - ab.phi23)).cos()
        + ab.c30 * a2 * a2 / 4.0;
    2.0 * PI / lambda_a * sum
}

/// [`chi`] as a polynomial in the reciprocal vector's components `(x, y) = (v_r, v_c)`, for
/// kernels that should not take `atan2`: with `q² = x² + y²`,
/// `χ = c[0] q² + c[1] (x² − y²) + c[2] 2xy + q² (c[3] x + c[4] y) + c[5] x(x² − 3y²)
/// + c[6] y(3x² − y²) + c[7] q⁴`, since `α = λq`, `cos φ = x/q`, `sin φ = y/q` and
/// `cos m(φ − φ_m)` expands into `cos mφ`, `sin mφ`. [`chi_from_polynomial`] evaluates it.
pub fn chi_polynomial(ab: &Aberrations, lambda_a: f64) -> [f64; 8] {
    let l = lambda_a;
    let (s2, c2) = (2.0 * ab.phi12).sin_cos();
    let (s1, c1) = ab.phi21.sin_cos();
    let (s3, c3) = (3.0 * ab.phi23).sin_cos();
    let k3 = 2.0 * PI / 3.0 * l * l;
    [
        PI * l * ab.c10,
        PI * l * ab.c12 * c2,
        PI * l * ab.c12 * s2,
        k3 * ab.c21 * c1,
        k3 * ab.c21 * s1,
        k3 * ab.c23 * c3,
        k3 * ab.c23 * s3,
        PI / 2.0 * l * l * l * ab.c30,
    ]
}

/// χ from the [`chi_polynomial`] coefficients `c` at `(x, y)` (Å⁻¹).
pub fn chi_from_polynomial(c: &[f64; 8], x: f64, y: f64) -> f64 {
    let q2 = x * x + y * y;
    c[0] * q2
        + c[1] * (x * x - y * y)
        + c[2] * 2.0 * x * y
        + q2 * (c[3] * x + c[4] * y)
        + c[5] * x * (x * x - 3.0 * y * y)
        + c[6] * y * (3.0 * x * x - y * y)
        + c[7] * q2 * q2
}

/// Probe optics: wavelength, aperture semi-angle and detector angular sampling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Optics {
    /// Electron wavelength, Å.
    pub lambda_a: f64,
    /// Aperture semi-angle, rad.
    pub alpha_rad: f64,
    /// Detector angular sampling per pixel `(row, col)`, rad (sets the soft edge width).
    pub dtheta_rad: (f64, f64),
}

impl Optics {
    /// The optics of a `voltage_kv` beam through an aperture of `semiangle_mrad`, recorded on
    /// square detector pixels of `det_sampling_mrad` each.
    pub fn new(voltage_kv: f64, semiangle_mrad: f64, det_sampling_mrad: f64) -> Optics {
        let dtheta_rad = det_sampling_mrad * 1e-3;
        Optics {
            lambda_a: electron_wavelength_a(voltage_kv),
            alpha_rad: semiangle_mrad * 1e-3,
            dtheta_rad: (dtheta_rad, dtheta_rad),
        }
    }

    /// Soft aperture `A(v) = clip((α − λ|v|)/δ + ½, 0, 1)`, `δ = √((cosφ Δθ_r)² + (sinφ Δθ_c)²)`
    /// (one detector pixel wide, so the BF disk edge is anti-aliased); δ ≈ 0 → hard edge.
    pub fn aperture(&self, v_r: f64, v_c: f64) -> f64 {
        let norm = (v_r * v_r + v_c * v_c).sqrt();
        let a = self.lambda_a * norm;
        let delta = if norm > 0.0 {
            let (c, s) = (v_r / norm, v_c / norm);
            ((c * self.dtheta_rad.0).powi(2) + (s * self.dtheta_rad.1).powi(2)).sqrt()
        } else {
            0.0
        };
        if delta <= 1e-300 {
            return if a <= self.alpha_rad { 1.0 } else { 0.0 };
        }
        ((self.alpha_rad - a) / delta + 0.5).clamp(0.0, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 300 kV, 20 mrad, 2.5 mrad per pixel.
    fn optics() -> Optics {
        Optics::new(300.0, 20.0, 2.5)
    }

    #[test]
    fn wavelength_matches_the_codata_2018_table() {
        for (kv, want) in [
            (80.0, 0.041757160772834),
            (120.0, 0.033492152726724),
            (200.0, 0.025079340450548),
            (300.0, 0.019687489006849),
            (400.0, 0.016439434169908),
        ] {
            let got = electron_wavelength_a(kv);
            assert!((got - want).abs() < 1e-14, "{kv} kV: {got} vs {want}");
        }
    }

    #[test]
    fn chi_polynomial_equals_chi() {
        let lam = 0.025_079;
        let ab = Aberrations {
            c10: -123.0,
            c12: 45.0,
            phi12: 0.7,
            c21: 800.0,
            phi21: -2.1,
            c23: 300.0,
            phi23: 0.4,
            c30: 2.5e4,
        };
        let c = chi_polynomial(&ab, lam);
        for &(x, y) in &[
            (0.5, 0.0),
            (0.0, -0.3),
            (0.31, -0.72),
            (-0.9, 0.05),
            (0.0, 0.0),
        ] {
            let want = chi(&ab, lam, x, y);
            let got = chi_from_polynomial(&c, x, y);
            assert!(
                (got - want).abs() <= 1e-10 * want.abs().max(1.0),
                "{x} {y}: {got} vs {want}"
            );
        }
        // Each term alone too (a sign slip in one could hide behind another).
        for name in ["C10", "C12", "C21", "C23", "C30"] {
            let mut one = Aberrations::default();
            one.set(name, 100.0).unwrap();
            one.phi12 = 0.3;
            one.phi21 = 1.1;
            one.phi23 = -0.5;
            let c = chi_polynomial(&one, lam);
            let (x, y) = (0.4, 0.6);
            assert!(
                (chi_from_polynomial(&c, x, y) - chi(&one, lam, x, y)).abs() < 1e-10,
                "{name}"
            );
        }
    }

    #[test]
    fn chi_defocus_and_astigmatism_by_hand() {
        let lam = 0.019_687_489_006_849;
        // v = 0.5 Å⁻¹ along the row axis: α = λ/2, φ = 0.
        let ab = Aberrations {
            c10: 100.0,
            ..Default::default()
        };
        let a = lam * 0.5;
        let want = PI * 100.0 * a * a / lam; // π C10 α² / λ
        assert!((chi(&ab, lam, 0.5, 0.0) - want).abs() < 1e-12);
        // Positive C10 → positive χ.
        assert!(chi(&ab, lam, 0.0, 0.3) > 0.0);
        // C12 along φ12 = 0: +π C12 α²/λ along rows, − along columns.
        let ab = Aberrations {
            c12: 50.0,
            ..Default::default()
        };
        let w = PI * 50.0 * a * a / lam;
        assert!((chi(&ab, lam, 0.5, 0.0) - w).abs() < 1e-12);
        assert!((chi(&ab, lam, 0.0, 0.5) + w).abs() < 1e-12);
        // C30: (2π/λ) C30 α⁴/4.
        let ab = Aberrations {
            c30: 1e4,
            ..Default::default()
        };
        let w = 2.0 * PI / lam * 1e4 * a.powi(4) / 4.0;
        assert!((chi(&ab, lam, 0.5, 0.0) - w).abs() < 1e-12);
        // C21 is odd: χ(−v) = −χ(v).
        let ab = Aberrations {
            c21: 300.0,
            phi21: 0.3,
            ..Default::default()
        };
        assert!((chi(&ab, lam, 0.2, 0.4) + chi(&ab, lam, -0.2, -0.4)).abs() < 1e-12);
        assert_eq!(chi(&ab, lam, 0.0, 0.0), 0.0);
    }

    #[test]
    fn aberration_map_round_trip_and_errors() {
        let mut m = BTreeMap::new();
        m.insert("C10".to_string(), 12.0);
        m.insert("phi12".to_string(), 0.5);
        let ab = Aberrations::from_map(&m).unwrap_or_default();
        assert_eq!(ab.c10, 12.0);
        assert_eq!(ab.phi12, 0.5);
        assert_eq!(ab.to_map().len(), 8);
        m.insert("C99".to_string(), 1.0);
        assert!(Aberrations::from_map(&m).is_err());
        assert_eq!(Aberrations::unit("phi23"), Some("rad"));
    }

    #[test]
    fn aperture_is_a_half_at_the_edge_and_hard_without_sampling() {
        let o = optics();
        let kmax = o.alpha_rad / o.lambda_a;
        assert_eq!(o.aperture(0.5 * kmax, 0.0), 1.0);
        assert!((o.aperture(kmax, 0.0) - 0.5).abs() < 1e-9);
        assert_eq!(o.aperture(1.2 * kmax, 0.0), 0.0);
        let hard = Optics {
            dtheta_rad: (0.0, 0.0),
            ..o
        };
        assert_eq!(hard.aperture(0.99 * kmax, 0.0), 1.0);
        assert_eq!(hard.aperture(1.01 * kmax, 0.0), 0.0);
    }
}
