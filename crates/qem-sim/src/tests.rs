//! Physics and convention tests of the simulator.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

fn small(crystal: Crystal) -> SimParams {
    SimParams {
        scan_shape: Shape2::new(6, 5),
        detector_shape: Shape2::new(32, 32),
        crystal,
        ..SimParams::default()
    }
}

#[test]
fn default_is_valid_and_rectangular() {
    let p = SimParams::default();
    p.validate().unwrap();
    assert_ne!(p.scan_shape.rows, p.scan_shape.cols);
    // BF radius = a quarter of the detector by default.
    assert!((p.semiangle_mrad / p.angular_sampling_mrad() - 16.0).abs() < 1e-12);
}

#[test]
fn validate_names_the_bad_parameter() {
    let p = SimParams {
        scan_step_a: -1.0,
        ..SimParams::default()
    };
    let e = p.validate().unwrap_err();
    assert!(e.to_string().contains("scan_step_a"), "{e}");
    let p = SimParams {
        aberrations: Aberrations {
            c10_a: 5000.0,
            ..Default::default()
        },
        ..SimParams::default()
    };
    assert!(p.validate().unwrap_err().to_string().contains("probe"));
    assert!(simulate(&SimParams {
        scan_shape: Shape2::new(0, 3),
        ..SimParams::default()
    })
    .is_err());
}

#[test]
fn counts_per_frame_match_the_dose() {
    let p = small(Crystal::default());
    let out = simulate(&p).unwrap();
    let k = p.detector_shape.len();
    let dose = p.dose_e_per_frame;
    let sums: Vec<f64> = out
        .counts
        .chunks_exact(k)
        .map(|f| f.iter().map(|&c| c as f64).sum())
        .collect();
    // Poisson σ of the total is √dose ≈ 141 (0.7 %); a little intensity scatters beyond the
    // detector. Generous bounds: every frame within 5 %, the mean within 2 %.
    for s in &sums {
        assert!(
            (s - dose).abs() < 0.05 * dose,
            "frame total {s} vs dose {dose}"
        );
    }
    let mean = sums.iter().sum::<f64>() / sums.len() as f64;
    assert!((mean - dose).abs() < 0.02 * dose, "mean {mean}");
}

#[test]
fn vacuum_pattern_is_the_aperture_disk_centred_at_k_over_2() {
    // Odd and even detector sizes, with aberrations (pure phase: they must not change |ψ̂|²).
    for det in [Shape2::new(64, 64), Shape2::new(63, 65)] {
        let p = SimParams {
            scan_shape: Shape2::new(2, 3),
            detector_shape: det,
            crystal: Crystal::Vacuum,
            keep_intensities: true,
            ..SimParams::default()
        };
        let out = simulate(&p).unwrap();
        let cal = out.calibration;
        assert_eq!(
            cal.beam_center_px,
            ((det.rows / 2) as f64, (det.cols / 2) as f64)
        );
        let ints = out.intensities.unwrap();
        let frame = &ints[..det.len()];
        // Every frame is the same pattern (a shift of the probe does not change |ψ̂|²).
        for f in ints.chunks_exact(det.len()) {
            for (a, b) in f.iter().zip(frame) {
                assert!((a - b).abs() < 1e-6, "{a} vs {b}");
            }
        }
        let total: f64 = frame.iter().map(|&v| v as f64).sum();
        assert!((total - 1.0).abs() < 1e-4, "total {total}");
        // Centroid and equal-area radius of the disk.
        let (mut s, mut sr, mut sc) = (0.0, 0.0, 0.0);
        for (i, row) in frame.chunks_exact(det.cols).enumerate() {
            for (j, &v) in row.iter().enumerate() {
                let v = v as f64;
                s += v;
                sr += v * i as f64;
                sc += v * j as f64;
            }
        }
        let (cr, cc) = (sr / s, sc / s);
        assert!((cr - cal.beam_center_px.0).abs() < 1e-3, "row centre {cr}");
        assert!((cc - cal.beam_center_px.1).abs() < 1e-3, "col centre {cc}");
        // The aperture *amplitude* ramps linearly across the edge, so the amplitude's area is
        // that of a hard disk of radius α/Δθ.
        let peak = frame.iter().cloned().fold(0.0f32, f32::max) as f64;
        let area: f64 = frame.iter().map(|&v| (v as f64 / peak).sqrt()).sum();
        let r = (area / PI).sqrt();
        assert!(
            (r - cal.bf_radius_px).abs() < 0.05,
            "radius {r} vs {}",
            cal.bf_radius_px
        );
        // Nothing outside the disk edge ramp.
        for (i, row) in frame.chunks_exact(det.cols).enumerate() {
            for (j, &v) in row.iter().enumerate() {
                let d = ((i as f64 - cr).powi(2) + (j as f64 - cc).powi(2)).sqrt();
                if d > cal.bf_radius_px + 1.0 {
                    assert!(v < 1e-9, "pixel ({i},{j}) at {d} px has {v}");
                }
            }
        }
    }
}

/// Bright-field image: noise-free intensities summed over the disk of the expected radius.
///
/// (Noise-free, because a BF detector as large as the disk sees weak contrast from a thin
/// specimen: only what scatters out of the disk changes the sum.)
fn bf_image(out: &SimOutput) -> Vec<f64> {
    let det = out.params.detector_shape;
    let (cr, cc) = out.calibration.beam_center_px;
    let r2 = out.calibration.bf_radius_px.powi(2);
    out.intensities
        .as_ref()
        .unwrap()
        .chunks_exact(det.len())
        .map(|f| {
            let mut s = 0.0;
            for (i, row) in f.chunks_exact(det.cols).enumerate() {
                for (j, &v) in row.iter().enumerate() {
                    if (i as f64 - cr).powi(2) + (j as f64 - cc).powi(2) <= r2 {
                        s += v as f64;
                    }
                }
            }
            s
        })
        .collect()
}

/// |DFT|² of a real image at integer frequency (u, v) (cycles per image).
fn power_at(img: &[f64], shape: Shape2, u: usize, v: usize) -> f64 {
    let mean = img.iter().sum::<f64>() / img.len() as f64;
    let (mut re, mut im) = (0.0, 0.0);
    for i in 0..shape.rows {
        for j in 0..shape.cols {
            let ph = -2.0
                * PI
                * (u as f64 * i as f64 / shape.rows as f64
                    + v as f64 * j as f64 / shape.cols as f64);
            let x = img[i * shape.cols + j] - mean;
            re += x * ph.cos();
            im += x * ph.sin();
        }
    }
    re * re + im * im
}

/// Power of an image over the non-redundant half-plane of frequencies, DC left out.
struct LatticePower {
    total: f64,
    /// At multiples of the lattice's fundamental frequencies.
    on_lattice: f64,
    /// The strongest frequency: `(power, u, v)`.
    strongest: (f64, usize, usize),
}

/// [`LatticePower`] of `img` (`shape`) for a lattice of `(cells_row, cells_col)` cells per
/// image, i.e. fundamental frequencies `(cells_row, 0)` and `(0, cells_col)`.
fn lattice_power(
    img: &[f64],
    shape: Shape2,
    (cells_row, cells_col): (usize, usize),
) -> LatticePower {
    let mut p = LatticePower {
        total: 0.0,
        on_lattice: 0.0,
        strongest: (0.0, 0, 0),
    };
    for u in 0..shape.rows {
        for v in 0..=shape.cols / 2 {
            if u == 0 && v == 0 {
                continue;
            }
            let pw = power_at(img, shape, u, v);
            p.total += pw;
            if u % cells_row == 0 && v % cells_col == 0 {
                p.on_lattice += pw;
            }
            if pw > p.strongest.0 {
                p.strongest = (pw, u, v);
            }
        }
    }
    p
}

/// The lattice tests' simulation: a `scan` at `scan_step_a` on a 32 x 32 detector, keeping the
/// noiseless intensities for [`bf_image`].
fn lattice_scan(scan: Shape2, scan_step_a: f64) -> SimParams {
    SimParams {
        scan_shape: scan,
        detector_shape: Shape2::new(32, 32),
        scan_step_a,
        keep_intensities: true,
        ..SimParams::default()
    }
}

/// More than 90 % of an image's power (`total`) is at the lattice's frequencies.
fn assert_lattice_dominates(total: f64, on_lattice: f64) {
    assert!(
        on_lattice > 0.9 * total,
        "lattice holds {:.3} of the power",
        on_lattice / total
    );
}

#[test]
fn bf_image_shows_the_lattice_with_rows_and_columns_in_place() {
    // Rectangular lattice: 3.0 Å along rows, 4.0 Å along columns, step 0.5 Å -> periods of 6 and
    // 8 scan pixels; a 36 x 32 scan holds 6 x 4 cells, so the lattice frequencies are (6, 0) and
    // (0, 4) cycles per image. Swapping rows and columns would put them at (8, 0)/(0, 3)-like bins.
    let scan = Shape2::new(36, 32);
    let p = SimParams {
        crystal: Crystal::RectangularLattice {
            a_row_a: 3.0,
            a_col_a: 4.0,
            z: 38,
            atoms_per_column: 1,
        },
        aberrations: Aberrations {
            c10_a: 30.0,
            ..Default::default()
        },
        ..lattice_scan(scan, 0.5)
    };
    let out = simulate(&p).unwrap();
    let bf = bf_image(&out);
    let LatticePower {
        total,
        on_lattice,
        strongest: best,
    } = lattice_power(&bf, scan, (6, 4));
    assert!(
        (best.1, best.2) == (6, 0) || (best.1, best.2) == (30, 0) || (best.1, best.2) == (0, 4),
        "strongest frequency ({}, {})",
        best.1,
        best.2
    );
    assert_lattice_dominates(total, on_lattice);
    // Both fundamental frequencies are present.
    let noise = (total - on_lattice) / (scan.rows * (scan.cols / 2 + 1)) as f64;
    assert!(power_at(&bf, scan, 6, 0) > 100.0 * noise);
    assert!(power_at(&bf, scan, 0, 4) > 100.0 * noise);
}

#[test]
fn srtio3_bf_image_has_the_cubic_period() {
    // a = 3.905 Å sampled at a/8: 8-pixel period along both axes; 32 x 24 scan = 4 x 3 cells.
    let scan = Shape2::new(32, 24);
    let p = lattice_scan(scan, SRTIO3_A / 8.0);
    let out = simulate(&p).unwrap();
    let bf = bf_image(&out);
    let LatticePower {
        total, on_lattice, ..
    } = lattice_power(&bf, scan, (4, 3));
    assert_lattice_dominates(total, on_lattice);
    // Ground truth: the potential peaks on the Sr column at scan (0, 0) and repeats every 8 px.
    let v = &out.projected_potential;
    let max = v.iter().cloned().fold(0.0f32, f32::max);
    assert_eq!(v[0], max);
    assert!((v[8 * scan.cols + 16] - max).abs() < 1e-3 * max);
}

#[test]
fn same_seed_same_counts_for_any_thread_count() {
    let p = small(Crystal::default());
    let a = simulate(&p).unwrap();
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let b = one.install(|| simulate(&p)).unwrap();
    assert_eq!(a.counts, b.counts);
    let c = simulate(&SimParams { seed: 1, ..p }).unwrap();
    assert_ne!(a.counts, c.counts);
}

#[test]
fn beam_is_deflected_towards_the_atom() {
    // One heavy column at the origin; the probe at +0.5 Å along rows (frame (1, 0)) and along
    // columns (frame (0, 1)) must have its intensity centre of mass moved towards the atom, i.e.
    // to smaller detector row / column indices (no rotation, no flip between scan and detector).
    let p = SimParams {
        scan_shape: Shape2::new(2, 2),
        detector_shape: Shape2::new(48, 48),
        scan_step_a: 0.5,
        crystal: Crystal::RectangularLattice {
            a_row_a: 12.0,
            a_col_a: 12.0,
            z: 38,
            atoms_per_column: 1,
        },
        aberrations: Aberrations::default(),
        keep_intensities: true,
        ..SimParams::default()
    };
    let out = simulate(&p).unwrap();
    let det = p.detector_shape;
    let ints = out.intensities.as_ref().unwrap();
    let com = |n: usize| {
        let f = &ints[n * det.len()..(n + 1) * det.len()];
        let (mut s, mut sr, mut sc) = (0.0, 0.0, 0.0);
        for (i, row) in f.chunks_exact(det.cols).enumerate() {
            for (j, &v) in row.iter().enumerate() {
                s += v as f64;
                sr += v as f64 * i as f64;
                sc += v as f64 * j as f64;
            }
        }
        (
            sr / s - out.calibration.beam_center_px.0,
            sc / s - out.calibration.beam_center_px.1,
        )
    };
    let (r0, c0) = com(0);
    assert!(
        r0.abs() < 1e-3 && c0.abs() < 1e-3,
        "on the atom: ({r0}, {c0})"
    );
    let (r, c) = com(2); // frame (1, 0): probe at +row from the atom
    assert!(r < -0.05 && c.abs() < 1e-3, "({r}, {c})");
    let (r, c) = com(1); // frame (0, 1): probe at +col from the atom
    assert!(c < -0.05 && r.abs() < 1e-3, "({r}, {c})");
}
