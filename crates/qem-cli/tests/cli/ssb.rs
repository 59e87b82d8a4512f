//! `ssb`: its files, the JSON, the object's scan mean and the fit record.

use crate::fixtures::{disk_acquisition, naive_disk, npy_f64, P_DET, P_SCAN};
use crate::{code, json_stdout, qg, qg_job, stderr};
use serde_json::Value;

/// `ssb`: the files, the JSON, and the object's scan mean, which the definitions fix
/// independently of the aberrations: every corrected spectrum gets the DC
/// `d = mean_b Σ_R I_b(R)`, so `mean_R O(R) = mean_b mean_R I_b(R)` (real), computed here from
/// the frames and the naive BF disk.
#[test]
fn ssb_writes_its_files_and_a_fit_record() {
    let (dir, frames, master) = disk_acquisition();
    let (n, k) = (P_SCAN.0 * P_SCAN.1, P_DET.0 * P_DET.1);
    let (c, r) = naive_disk(&frames, n, P_DET);
    let mut bf_sum = 0.0;
    let mut bf = 0usize;
    for p in 0..k {
        let (i, j) = ((p / P_DET.1) as f64, (p % P_DET.1) as f64);
        let total: u64 = (0..n).map(|f| u64::from(frames[f * k + p])).sum();
        if total > 0 && (i - c.0).powi(2) + (j - c.1).powi(2) <= r * r {
            bf += 1;
            bf_sum += total as f64 / n as f64;
        }
    }
    let want_mean = bf_sum / bf as f64;

    let out = dir.path().join("ssb");
    let base = [
        "ssb",
        &master,
        "--out",
        out.to_str().unwrap(),
        "--voltage-kv",
        "300",
        "--semiangle-mrad",
        "20",
        "--scan-step-a",
        "0.5",
        "0.6",
    ];
    let mut args = base.to_vec();
    args.extend(["--c10", "-40", "--c12", "10", "--phi12", "0.3", "--json"]);
    let o = qg(&args);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let rec = json_stdout(&o);
    let on_disk: Value =
        serde_json::from_slice(&std::fs::read(out.join("ssb.json")).unwrap()).unwrap();
    assert_eq!(rec, on_disk);
    assert_eq!(rec["n_bf_pixels"], bf, "{rec}");
    assert_eq!(rec["aberrations"]["C10"]["value"], -40.0);
    assert_eq!(rec["aberrations"]["C10"]["unit"], "Å");
    assert_eq!(rec["aberrations"]["phi12"]["unit"], "rad");
    assert_eq!(rec["fit"], Value::Null);
    assert_eq!(rec["params"]["scan_step_a"], serde_json::json!([0.5, 0.6]));
    // Default detector sampling: α / r_edge from the sub-pixel disk edge. The fixture draws
    // a hard disk of radius 3 px (pixel centres inside r² ≤ 9), so α / 3 px within the 2 %
    // a 3-pixel disk's pixelation allows (the threshold rule's radius is farther off).
    let dtheta = rec["det_sampling_mrad"].as_f64().unwrap();
    assert!(
        (dtheta - 20.0 / 3.0).abs() < 0.02 * 20.0 / 3.0,
        "{dtheta} vs {} (threshold radius {r})",
        20.0 / 3.0
    );
    assert_eq!(rec["provenance"]["operation"], "ssb.reconstruct");
    let (s_re, re) = npy_f64(&out.join("object_re.npy"));
    let (_, im) = npy_f64(&out.join("object_im.npy"));
    let (s_ph, ph) = npy_f64(&out.join("phase.npy"));
    let (_, amp) = npy_f64(&out.join("amplitude.npy"));
    assert_eq!(s_re, vec![P_SCAN.0, P_SCAN.1]);
    assert_eq!(s_ph, s_re);
    for i in 0..n {
        assert!((ph[i] - im[i].atan2(re[i])).abs() < 1e-12, "phase {i}");
        assert!(
            (amp[i] - re[i].hypot(im[i])).abs() < 1e-9 * amp[i].max(1.0),
            "amp {i}"
        );
    }
    let mean_re = re.iter().sum::<f64>() / n as f64;
    let mean_im = im.iter().sum::<f64>() / n as f64;
    assert!(
        (mean_re - want_mean).abs() < 1e-9 * want_mean,
        "{mean_re} vs {want_mean}"
    );
    assert!(mean_im.abs() < 1e-9 * want_mean, "{mean_im}");
    for name in ["phase", "weak_phase", "amplitude"] {
        assert!(out.join(format!("{name}.png")).exists(), "{name}");
    }
    let (_, weak) = npy_f64(&out.join("weak_phase.npy"));
    for i in 0..n {
        assert!((weak[i] - im[i] / mean_re).abs() < 1e-9, "weak phase {i}");
    }

    // A small fit, twice: the same record (deterministic for a seed).
    let mut args = base.to_vec();
    args.extend([
        "--fit",
        "--fit-params",
        "C10,C12",
        "--phi12",
        "0.25",
        "--global-evals",
        "6",
        "--local-max-iter",
        "5",
        "--seed",
        "7",
        "--json",
    ]);
    let a = json_stdout(&qg(&args));
    let b = json_stdout(&qg(&args));
    assert_eq!(a["fit"], b["fit"]);
    let f = &a["fit"];
    assert_eq!(f["fitted"], serde_json::json!(["C10", "C12"]));
    assert_eq!(f["seed"], 7);
    let curve: Vec<f64> = f["loss_curve"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(curve.len() as u64, f["evaluations"].as_u64().unwrap());
    assert!(curve.len() > 7, "start + 6 global points + Nelder–Mead");
    let best = curve.iter().cloned().fold(f64::INFINITY, f64::min);
    assert_eq!(f["loss"].as_f64().unwrap(), best);
    assert_eq!(a["aberrations"]["phi12"]["value"], 0.25, "not fitted: kept");
    assert_eq!(a["provenance"]["operation"], "ssb.fit");

    // Usage and input errors.
    let o = qg_job(
        "ssb",
        &master,
        &out,
        &["--semiangle-mrad", "20", "--scan-step-a", "0.5"],
    );
    assert_eq!(code(&o), 2, "missing --voltage-kv");
    assert!(stderr(&o).contains("--voltage-kv"), "{}", stderr(&o));
    let mut args = base.to_vec();
    args[5] = "-300";
    let o = qg(&args);
    assert_eq!(code(&o), 2, "an invalid argument: {}", stderr(&o));
    assert!(stderr(&o).contains("voltage_kv"), "{}", stderr(&o));
    let mut args = base.to_vec();
    args.extend(["--memory-budget", "100"]);
    assert_eq!(code(&qg(&args)), 5);
    // --engine cuda on host data: SSB on the card, or exit 4 (backend unavailable) — never a
    // silent CPU run.
    let mut args = base.to_vec();
    args.extend(["--backend", "cpu", "--engine", "cuda", "--json"]);
    let o = qg(&args);
    if qem::backend::cuda_unavailable_reason().is_some() {
        assert_eq!(code(&o), 4, "{}", stderr(&o));
        assert!(stderr(&o).contains("cuda"), "{}", stderr(&o));
    } else {
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        assert_eq!(json_stdout(&o)["engine"], "cuda");
    }
    let mut args = base.to_vec();
    args.extend(["--backend", "cpu", "--engine", "cpu", "--json"]);
    let o = qg(&args);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(json_stdout(&o)["engine"], "cpu");
}
