//! `dpc`: recovering a known rotation from generated frames, and its files.

use crate::fixtures::{npy_f64, npy_shape, write_acq};
use crate::{code, json_stdout, png_size, qg_job, stderr};
use serde_json::Value;

/// Frames whose centre of mass is the gradient of a positive potential rotated by −θ into the
/// detector (components exchanged when `transpose`), and a dark-field ring following the
/// potential (what the sign criterion reads). Returns (frames, potential).
fn dpc_frames(scan: (usize, usize), theta_deg: f64, transpose: bool) -> (Vec<u16>, Vec<f64>) {
    let det = (31usize, 33usize);
    let c0 = (15.0, 16.0);
    let (sigma, spot) = (1.5f64, 20000.0f64);
    let w = 2.2f64;
    let bumps = [(3.5, 4.0), (3.5, 12.0), (10.5, 4.5), (10.5, 12.5)];
    let n = scan.0 * scan.1;
    let potential = |r: f64, c: f64| -> f64 {
        bumps
            .iter()
            .map(|&(r0, c0)| (-((r - r0).powi(2) + (c - c0).powi(2)) / (2.0 * w * w)).exp())
            .sum()
    };
    // The field is the central-difference gradient of φ (evaluated past the edges too), so
    // the central-difference curl the rotation search minimises is exactly zero at 23°.
    let mut phi = vec![0.0; n];
    let mut g = vec![(0.0, 0.0); n];
    for f in 0..n {
        let (r, c) = ((f / scan.1) as f64, (f % scan.1) as f64);
        phi[f] = potential(r, c);
        g[f] = (
            potential(r + 1.0, c) - potential(r - 1.0, c),
            potential(r, c + 1.0) - potential(r, c - 1.0),
        );
    }
    let pmax = phi.iter().cloned().fold(0.0, f64::max);
    let (s, co) = (-theta_deg.to_radians()).sin_cos();
    let mut frames = Vec::with_capacity(n * det.0 * det.1);
    let mut spot_sum = 0.0;
    for i in 0..det.0 {
        for j in 0..det.1 {
            spot_sum += (-((i as f64 - c0.0).powi(2) + (j as f64 - c0.1).powi(2))
                / (2.0 * sigma * sigma))
                .exp();
        }
    }
    spot_sum *= spot;
    for f in 0..n {
        let (a, b) = (co * g[f].0 - s * g[f].1, s * g[f].0 + co * g[f].1);
        let (mu_r, mu_c) = if transpose { (b, a) } else { (a, b) };
        let ring_i = 400.0 * phi[f] / pmax;
        let mut ring_sum = 0.0;
        for i in 0..det.0 {
            for j in 0..det.1 {
                let d2 = (i as f64 - c0.0).powi(2) + (j as f64 - c0.1).powi(2);
                if (4.2f64 * 4.2..=5.8 * 5.8).contains(&d2) {
                    ring_sum += ring_i;
                }
            }
        }
        let k = (spot_sum + ring_sum) / spot_sum;
        for i in 0..det.0 {
            for j in 0..det.1 {
                let (x, y) = (i as f64, j as f64);
                let d2 = (x - c0.0).powi(2) + (y - c0.1).powi(2);
                let ring = if (4.2f64 * 4.2..=5.8 * 5.8).contains(&d2) {
                    ring_i
                } else {
                    0.0
                };
                let e = (-((x - c0.0 - k * mu_r).powi(2) + (y - c0.1 - k * mu_c).powi(2))
                    / (2.0 * sigma * sigma))
                    .exp();
                frames.push((spot * e + ring).round() as u16);
            }
        }
    }
    (frames, phi)
}

/// Pearson correlation coefficient: the centred dot product over the centred norms.
fn pearson(a: &[f64], b: &[f64]) -> f64 {
    let centred = |v: &[f64]| -> Vec<f64> {
        let m = v.iter().sum::<f64>() / v.len() as f64;
        v.iter().map(|x| x - m).collect()
    };
    let dot = |u: &[f64], v: &[f64]| -> f64 { u.iter().zip(v).map(|(x, y)| x * y).sum() };
    let (da, db) = (centred(a), centred(b));
    dot(&da, &db) / (dot(&da, &da) * dot(&db, &db)).sqrt()
}

#[test]
fn dpc_recovers_a_known_rotation_and_writes_its_files() {
    let scan = (15usize, 17usize);
    for transpose in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (frames, phi) = dpc_frames(scan, 23.0, transpose);
        let master = write_acq(dir.path(), scan, (31, 33), &frames);
        let out = dir.path().join("dpc");
        let o = qg_job("dpc", &master, &out, &["--json"]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let rec = json_stdout(&o);
        let on_disk: Value =
            serde_json::from_slice(&std::fs::read(out.join("dpc.json")).unwrap()).unwrap();
        assert_eq!(rec, on_disk);
        let rot = rec["rotation_deg"].as_f64().unwrap();
        assert!(
            (rot - 23.0).abs() < 0.1,
            "transpose {transpose}: rotation {rot}"
        );
        assert_eq!(rec["transpose"], transpose);
        assert_eq!(rec["confident"], true, "{rec}");
        assert_eq!(rec["sign_criterion"], "adf_correlation");
        assert!(rec["sign_confidence"].as_f64().unwrap() > 0.5);
        assert_eq!(rec["unit"], "px");
        assert_eq!(rec["provenance"]["operation"], "dpc.run");
        for name in ["com_row", "com_col", "phase"] {
            let (w, h) = png_size(&out.join(format!("{name}.png")));
            let s = 256u32.div_ceil(15);
            assert_eq!((w, h), (17 * s + 120, 15 * s + 32), "{name}");
            assert_eq!(rec["arrays"][name]["dtype"], "float64");
        }
        let (shape, phase) = npy_f64(&out.join("phase.npy"));
        assert_eq!(shape, vec![15, 17]);
        assert!(pearson(&phase, &phi) > 0.99, "{}", pearson(&phase, &phi));
        for name in ["com_row", "com_col", "dpc_row", "dpc_col"] {
            assert_eq!(npy_shape(&out.join(format!("{name}.npy"))), vec![15, 17]);
        }
    }
    // An explicit (negative) rotation is used as given.
    let dir = tempfile::tempdir().unwrap();
    let (frames, _) = dpc_frames(scan, 23.0, false);
    let master = write_acq(dir.path(), scan, (31, 33), &frames);
    let out = dir.path().join("dpc");
    let o = qg_job(
        "dpc",
        &master,
        &out,
        &[
            "--rotation-deg",
            "-10",
            "--transpose",
            "false",
            "--edge",
            "mirror",
        ],
    );
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("rotation  -10.00°"));
    let rec: Value = serde_json::from_slice(&std::fs::read(out.join("dpc.json")).unwrap()).unwrap();
    assert_eq!(rec["rotation_deg"], -10.0);
    assert_eq!(rec["sign_criterion"], "explicit_rotation");
    assert_eq!(rec["params"]["edge"], "mirror");
}
