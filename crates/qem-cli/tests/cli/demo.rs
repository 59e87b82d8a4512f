//! `demo`: its images and report, then `inspect` of what it wrote.

use crate::fixtures::npy_shape;
use crate::{code, json_stdout, png_size, qg, stderr};
use serde_json::Value;

#[test]
fn demo_writes_images_and_a_sane_report_then_inspect_sees_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("demo out"); // a space, on purpose
    let o = qg(&["demo", "--out", out.to_str().unwrap(), "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let printed = json_stdout(&o);
    let report: Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(printed, report);

    for name in [
        "bf", "abf", "adf", "haadf", "df", "com_row", "com_col", "phase",
    ] {
        let (w, h) = png_size(&out.join(format!("{name}.png")));
        assert!(w.min(h) >= 256, "{name}: {w} x {h}");
        // The 48 x 40 scan, upscaled 7x, then the colour bar with its labels (120 pixels) and
        // the scale-bar strip below (32).
        assert_eq!((w, h), (40 * 7 + 120, 48 * 7 + 32), "{name}");
        let shape = npy_shape(&out.join(format!("{name}.npy")));
        assert_eq!(shape, vec![48, 40], "{name}");
    }
    for name in ["sum_dp", "mean_dp", "max_dp"] {
        assert_eq!(
            npy_shape(&out.join(format!("{name}.npy"))),
            vec![64, 64],
            "{name}"
        );
        assert!(out.join(format!("{name}.png")).exists(), "{name}");
    }
    // Products and DPC of the simulated SrTiO3: no scan rotation, no transpose, positive phase
    // on the atom columns.
    let d = &report["dpc"];
    let rot = d["rotation_deg"].as_f64().unwrap();
    assert!(rot.min(360.0 - rot) < 5.0, "rotation {rot}");
    assert_eq!(d["transpose"], false, "{d}");
    assert!(
        d["correlation_with_projected_potential"].as_f64().unwrap() > 0.5,
        "{d}"
    );
    assert_eq!(
        d["unit"], "mrad",
        "the demo files record the angular sampling"
    );
    for name in ["abf", "haadf", "df"] {
        assert!(
            report["images"][name]["stats"]["std"].as_f64().unwrap() > 0.0,
            "{name}"
        );
    }
    assert_eq!(report["images"]["df"]["outer_px"], Value::Null);
    assert!(report["output_files"].as_array().unwrap().len() >= 25);
    // SSB on the 2x2-binned load: the fit finds the simulated probe (C10 = 50 Å, C12 = 20 Å at
    // 30°) within the bounds measured with margin (4.5 %, 9.6 %, 0.016 rad off on this dataset).
    let s = &report["ssb"];
    assert_eq!(s["det_bin"], 2, "{s}");
    assert_eq!(s["true_aberrations"]["C10"]["value"], 50.0);
    let e = &s["fit_error"];
    assert!(e["C10_rel"].as_f64().unwrap().abs() < 0.15, "{e}");
    assert!(e["C12_rel"].as_f64().unwrap().abs() < 0.25, "{e}");
    assert!(e["phi12_rad"].as_f64().unwrap().abs() < 0.15, "{e}");
    assert!(
        s["correlation_with_projected_potential"].as_f64().unwrap() > 0.5,
        "{s}"
    );
    assert!(
        s["weak_phase_correlation_with_projected_potential"]
            .as_f64()
            .unwrap()
            > 0.5,
        "{s}"
    );
    assert_eq!(
        npy_shape(&out.join("ssb").join("weak_phase.npy")),
        vec![48, 40]
    );
    assert_eq!(npy_shape(&out.join("ssb").join("phase.npy")), vec![48, 40]);
    assert!(out.join("ssb").join("phase.png").exists());
    assert!(out.join("ssb").join("ssb.json").exists());
    // Provenance and the round trip through the files.
    assert_eq!(report["load"]["provenance"]["backend"], "cpu");
    assert_eq!(report["load"]["backend"], "cpu");
    assert_eq!(report["load"]["loaded_equals_simulated"], true);
    assert_eq!(report["load"]["shape"], serde_json::json!([48, 40, 64, 64]));
    assert!(report["files"]["compression_ratio"].as_f64().unwrap() > 1.5);
    assert_eq!(report["files"]["data_files"].as_array().unwrap().len(), 2);
    for stage in ["simulate", "write", "load", "products", "dpc", "ssb"] {
        assert!(
            report["timings_s"][stage].as_f64().unwrap() >= 0.0,
            "{stage}"
        );
    }
    assert!(report["command"].as_str().unwrap().contains("'"));
    // The BF disk is where and as large as the simulation says.
    let fit = &report["disk_fit"];
    let r = fit["radius_px"].as_f64().unwrap();
    let r0 = fit["expected_radius_px"].as_f64().unwrap();
    assert!((r - r0).abs() < 1.0, "radius {r} vs {r0}");
    for i in 0..2 {
        let c = fit["center_px"][i].as_f64().unwrap();
        let c0 = fit["expected_center_px"][i].as_f64().unwrap();
        assert!((c - c0).abs() < 0.3, "centre {c} vs {c0}");
    }
    // Images are not constant and follow the known lattice: ADF bright on the columns (positive
    // correlation with the projected potential), BF dark there.
    let img = |n: &str| &report["images"][n];
    for n in ["bf", "adf"] {
        let st = &img(n)["stats"];
        assert!(st["std"].as_f64().unwrap() > 0.0, "{n} is constant");
        assert!(st["p99_5"].as_f64().unwrap() > st["p0_5"].as_f64().unwrap());
    }
    let corr = |n: &str| {
        img(n)["correlation_with_projected_potential"]
            .as_f64()
            .unwrap()
    };
    assert!(corr("adf") > 0.3, "ADF correlation {}", corr("adf"));
    assert!(corr("bf") < -0.3, "BF correlation {}", corr("bf"));

    // inspect on what the demo wrote.
    let master = out.join("demo_master.h5");
    let o = qg(&["inspect", master.to_str().unwrap(), "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let ins = json_stdout(&o);
    assert_eq!(ins["ready"], true, "{ins}");
    assert_eq!(ins["actual_frames"], 1920);
    assert_eq!(ins["bad_pixels"], 3);
    let o = qg(&["inspect", master.to_str().unwrap()]);
    assert_eq!(code(&o), 0);
    assert!(String::from_utf8_lossy(&o.stdout).contains("ready: yes"));
}
