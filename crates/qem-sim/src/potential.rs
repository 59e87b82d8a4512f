//! Projected potential of a crystal viewed down a zone axis, in V·Å.
//!
//! Model (stated, phenomenological — not a tabulated scattering-factor parametrisation): every
//! atom contributes to its column's projected potential a normalised 2-D Gaussian
//!
//! `V_atom(r) = W(Z) / (2π s²) · exp(−|r|² / (2 s²))`   [V·Å]
//!
//! with integrated strength `W(Z) = W₀ · Z^0.85` (V·Å³), `W₀ =` [`ATOM_STRENGTH_V_A3`] `= 15`,
//! and width `s =` [`ATOM_WIDTH_A`] `= 0.25 Å` (the atomic core smeared by thermal motion). The
//! scale follows the order of magnitude of `h²/(2π m₀ e) · f_e(0)` (47.9 V·Å² times the electron
//! scattering factor at zero angle, a few Å); the exponent makes heavier columns stronger but
//! less than linearly in Z. A Sr atom peaks at ≈840 V·Å (≈0.55 rad at 300 kV); a column of `n`
//! atoms along the beam is `n` times one atom (projection approximation, no channelling).
//! The potential is periodic: it is summed over all lattice images within [`CUTOFF_WIDTHS`]·s.

use serde::{Deserialize, Serialize};

/// Width `s` (standard deviation, Å) of every atom's Gaussian projected potential.
pub const ATOM_WIDTH_A: f64 = 0.25;
/// `W₀` in `W(Z) = W₀·Z^0.85`, V·Å³.
pub const ATOM_STRENGTH_V_A3: f64 = 15.0;
/// Exponent of Z in the atom strength.
pub const ATOM_STRENGTH_Z_EXPONENT: f64 = 0.85;
/// Gaussians are cut off beyond this many widths (exp(−18) ≈ 1.5e-8 of the peak).
pub const CUTOFF_WIDTHS: f64 = 6.0;

/// The specimen.
#[allow(non_camel_case_types)] // `SrTiO3_001` reads as the crystal and zone axis it is.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Crystal {
    /// SrTiO3 (cubic perovskite, a = 3.905 Å) down [001]: Sr columns at (0, 0), mixed Ti–O
    /// columns at (½, ½) and pure O columns at (½, 0) and (0, ½) (fractions of `a`, (row, col)).
    /// Each unit cell of thickness adds one atom of each kind to each column.
    SrTiO3_001 {
        /// Thickness in unit cells along the beam (3.905 Å each).
        thickness_cells: u32,
    },
    /// A rectangular lattice of identical single-element columns at the cell corners (a simple,
    /// anisotropic test object: its row and column periods differ).
    RectangularLattice {
        /// Period along the scan/detector row axis, Å.
        a_row_a: f64,
        /// Period along the column axis, Å.
        a_col_a: f64,
        /// Atomic number of every atom.
        z: u32,
        /// Atoms per column (thickness along the beam).
        atoms_per_column: u32,
    },
    /// No specimen: the transmission function is 1 everywhere.
    Vacuum,
}

/// SrTiO3 lattice constant, Å.
pub const SRTIO3_A: f64 = 3.905;

impl Default for Crystal {
    fn default() -> Self {
        Crystal::SrTiO3_001 { thickness_cells: 5 }
    }
}

impl Crystal {
    /// A short human description (`"SrTiO3 [001], 2 unit cells (7.81 Å)"`).
    pub fn describe(&self) -> String {
        match *self {
            Crystal::SrTiO3_001 { thickness_cells } => format!(
                "SrTiO3 [001], a = {SRTIO3_A} Å, {thickness_cells} unit cell(s) thick ({:.2} Å)",
                thickness_cells as f64 * SRTIO3_A
            ),
            Crystal::RectangularLattice {
                a_row_a,
                a_col_a,
                z,
                atoms_per_column,
            } => format!(
                "rectangular lattice {a_row_a} x {a_col_a} Å (row x col) of Z = {z}, {atoms_per_column} atom(s) per column"
            ),
            Crystal::Vacuum => "vacuum (no specimen)".to_string(),
        }
    }
}

/// Integrated projected-potential strength `W(Z)` of one atom, V·Å³.
pub fn atom_strength_v_a3(z: u32) -> f64 {
    ATOM_STRENGTH_V_A3 * (z as f64).powf(ATOM_STRENGTH_Z_EXPONENT)
}

/// One atomic column of the unit cell.
#[derive(Debug, Clone, Copy)]
struct Column {
    /// Position in the cell, Å, (row, col).
    pos_a: (f64, f64),
    /// Summed `W` of the column's atoms, V·Å³.
    strength_v_a3: f64,
}

/// A periodic projected potential that can be evaluated anywhere.
#[derive(Debug, Clone)]
pub(crate) struct ProjectedPotential {
    cell_a: (f64, f64),
    columns: Vec<Column>,
}

impl ProjectedPotential {
    pub(crate) fn new(crystal: &Crystal) -> Self {
        match *crystal {
            Crystal::SrTiO3_001 { thickness_cells } => {
                let n = thickness_cells as f64;
                let a = SRTIO3_A;
                let (sr, ti, o) = (
                    atom_strength_v_a3(38),
                    atom_strength_v_a3(22),
                    atom_strength_v_a3(8),
                );
                let col = |fr: f64, fc: f64, w: f64| Column {
                    pos_a: (fr * a, fc * a),
                    strength_v_a3: n * w,
                };
                ProjectedPotential {
                    cell_a: (a, a),
                    columns: vec![
                        col(0.0, 0.0, sr),
                        col(0.5, 0.5, ti + o),
                        col(0.5, 0.0, o),
                        col(0.0, 0.5, o),
                    ],
                }
            }
            Crystal::RectangularLattice {
                a_row_a,
                a_col_a,
                z,
                atoms_per_column,
            } => ProjectedPotential {
                cell_a: (a_row_a, a_col_a),
                columns: vec![Column {
                    pos_a: (0.0, 0.0),
                    strength_v_a3: atoms_per_column as f64 * atom_strength_v_a3(z),
                }],
            },
            Crystal::Vacuum => ProjectedPotential {
                cell_a: (1.0, 1.0),
                columns: Vec::new(),
            },
        }
    }

    /// `V_proj` at `(row, col)` Å, V·Å.
    pub(crate) fn at(&self, r: f64, c: f64) -> f64 {
        let s = ATOM_WIDTH_A;
        let cut = CUTOFF_WIDTHS * s;
        let inv2s2 = 1.0 / (2.0 * s * s);
        let norm = 1.0 / (2.0 * std::f64::consts::PI * s * s);
        let (ar, ac) = self.cell_a;
        let mut v = 0.0;
        for col in &self.columns {
            // Lattice images n with |r − (pos + n·a)| < cut along each axis.
            let dr0 = r - col.pos_a.0;
            let dc0 = c - col.pos_a.1;
            let nr_lo = ((dr0 - cut) / ar).ceil() as i64;
            let nr_hi = ((dr0 + cut) / ar).floor() as i64;
            let nc_lo = ((dc0 - cut) / ac).ceil() as i64;
            let nc_hi = ((dc0 + cut) / ac).floor() as i64;
            for nr in nr_lo..=nr_hi {
                let dr = dr0 - nr as f64 * ar;
                for nc in nc_lo..=nc_hi {
                    let dc = dc0 - nc as f64 * ac;
                    let d2 = dr * dr + dc * dc;
                    if d2 < cut * cut {
                        v += col.strength_v_a3 * norm * (-d2 * inv2s2).exp();
                    }
                }
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn potential_is_periodic_and_peaks_on_columns() {
        let p = ProjectedPotential::new(&Crystal::SrTiO3_001 { thickness_cells: 1 });
        let a = SRTIO3_A;
        let sr = p.at(0.0, 0.0);
        assert!((p.at(2.0 * a, -3.0 * a) - sr).abs() < 1e-9 * sr);
        // Sr > Ti-O > O > between columns.
        let tio = p.at(0.5 * a, 0.5 * a);
        let o = p.at(0.5 * a, 0.0);
        let gap = p.at(0.25 * a, 0.25 * a);
        assert!(
            sr > tio && tio > o && o > 10.0 * gap,
            "{sr} {tio} {o} {gap}"
        );
        // Peak of one Sr atom: W/(2πs²).
        let want = atom_strength_v_a3(38) / (2.0 * std::f64::consts::PI * ATOM_WIDTH_A.powi(2));
        assert!((sr - want).abs() < 1e-3 * want, "{sr} vs {want}");
    }

    #[test]
    fn vacuum_is_zero() {
        let p = ProjectedPotential::new(&Crystal::Vacuum);
        assert_eq!(p.at(1.0, 2.0), 0.0);
    }
}
