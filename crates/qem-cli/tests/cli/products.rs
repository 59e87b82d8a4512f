//! `products`: exact arrays, PNGs and JSON; a given disk and a subset, then the summary; exit
//! codes of `products` and `dpc`.

use crate::fixtures::{
    disk_acquisition, disk_frames, naive_disk, naive_ring, npy_f64, npy_u64, read_npy, write_acq,
    P_DET, P_SCAN,
};
use crate::{assert_fails, code, json_stdout, png_size, qg, qg_job, stderr};
use serde_json::Value;

#[test]
fn products_writes_exact_arrays_pngs_and_json() {
    let (dir, frames, master) = disk_acquisition();
    let out = dir.path().join("out");
    let o = qg_job("products", &master, &out, &["--backend", "cpu", "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let printed = json_stdout(&o);
    let rec: Value =
        serde_json::from_slice(&std::fs::read(out.join("products.json")).unwrap()).unwrap();
    assert_eq!(printed, rec);
    let n = P_SCAN.0 * P_SCAN.1;
    let k = P_DET.0 * P_DET.1;

    // The disk against the naive fit.
    let (c, r) = naive_disk(&frames, n, P_DET);
    let disk = &rec["disk"];
    assert!(
        (disk["center_px"][0].as_f64().unwrap() - c.0).abs() < 1e-9,
        "{disk}"
    );
    assert!(
        (disk["center_px"][1].as_f64().unwrap() - c.1).abs() < 1e-9,
        "{disk}"
    );
    assert!(
        (disk["radius_px"].as_f64().unwrap() - r).abs() < 1e-9,
        "{disk}"
    );
    assert_eq!(disk["fitted"], true);

    // Every default detector, exact.
    for (name, lo, hi) in [
        ("bf", 0.0, r),
        ("abf", 0.5 * r, r),
        ("adf", r, 2.0 * r),
        ("haadf", 2.0 * r, 4.0 * r),
        ("df", r, f64::INFINITY),
    ] {
        let (shape, img) = npy_u64(&out.join(format!("{name}.npy")));
        assert_eq!(shape, vec![P_SCAN.0, P_SCAN.1], "{name}");
        assert_eq!(img, naive_ring(&frames, n, P_DET, c, lo, hi), "{name}");
        let e = &rec["products"][name];
        assert_eq!(e["dtype"], "uint64");
        assert_eq!(e["png"], format!("{name}.png"));
        assert_eq!(
            e["stats"]["max"].as_f64().unwrap(),
            *img.iter().max().unwrap() as f64,
            "{name}"
        );
        assert!(e["display"]["hi"].as_f64().unwrap() >= e["display"]["lo"].as_f64().unwrap());
        let (w, h) = png_size(&out.join(format!("{name}.png")));
        let scale = 256u32.div_ceil(5);
        // The colour bar with its labels (120 pixels) and the scale-bar strip (32).
        assert_eq!((w, h), (7 * scale + 120, 5 * scale + 32), "{name}");
    }
    assert_eq!(rec["products"]["df"]["outer_px"], Value::Null);

    // Diffraction patterns.
    let mut sum = vec![0u64; k];
    let mut max = vec![0u64; k];
    for f in 0..n {
        for p in 0..k {
            sum[p] += u64::from(frames[f * k + p]);
            max[p] = max[p].max(u64::from(frames[f * k + p]));
        }
    }
    let (shape, got) = npy_u64(&out.join("sum_dp.npy"));
    assert_eq!((shape, got), (vec![P_DET.0, P_DET.1], sum.clone()));
    let (_, mean) = npy_f64(&out.join("mean_dp.npy"));
    for p in 0..k {
        assert_eq!(
            mean[p],
            f64::from((sum[p] as f64 / n as f64) as f32),
            "pixel {p}"
        );
    }
    let (shape, descr, bytes) = read_npy(&out.join("max_dp.npy"));
    assert_eq!((shape, descr.as_str()), (vec![P_DET.0, P_DET.1], "<u4"));
    let got: Vec<u64> = bytes
        .chunks_exact(4)
        .map(|c| u64::from(u32::from_le_bytes(c.try_into().unwrap())))
        .collect();
    assert_eq!(got, max);
    assert_eq!(rec["products"]["sum_dp"]["display"]["scale"], "log1p");
    // No calibration in this source: the scale bars count samples, ticks label the colour bar.
    assert_eq!(
        rec["products"]["sum_dp"]["display"]["scale_bar"]["unit"],
        "px"
    );
    assert!(!rec["products"]["sum_dp"]["display"]["ticks"]
        .as_array()
        .unwrap()
        .is_empty());

    // Centre of mass (centred, zero frames counted).
    let (mut mr, mut mc) = (vec![0.0; n], vec![0.0; n]);
    for f in 0..n {
        let (mut s, mut a, mut b) = (0u64, 0u64, 0u64);
        for p in 0..k {
            let v = u64::from(frames[f * k + p]);
            s += v;
            a += (p / P_DET.1) as u64 * v;
            b += (p % P_DET.1) as u64 * v;
        }
        if s > 0 {
            mr[f] = a as f64 / s as f64;
            mc[f] = b as f64 / s as f64;
        }
    }
    for v in [&mut mr, &mut mc] {
        let m = v.iter().sum::<f64>() / n as f64;
        v.iter_mut().for_each(|x| *x -= m);
    }
    let (_, got_r) = npy_f64(&out.join("com_row.npy"));
    let (_, got_c) = npy_f64(&out.join("com_col.npy"));
    for f in 0..n {
        assert!(
            (got_r[f] - mr[f]).abs() < 1e-9 && (got_c[f] - mc[f]).abs() < 1e-9,
            "frame {f}"
        );
    }
    assert_eq!(rec["products"]["com"]["zero_frames"], 2);
    assert_eq!(rec["products"]["com"]["unit"], "px");

    // Provenance and parameters.
    assert_eq!(rec["dataset"]["shape"], serde_json::json!([5, 7, 11, 13]));
    assert_eq!(rec["dataset"]["backend"], "cpu");
    assert_eq!(rec["provenance"]["backend"], "cpu");
    assert_eq!(rec["params"]["unit"], "px");
    assert!(rec["command"].as_str().unwrap().contains("products"));
    let requested: Vec<&str> = rec["requested"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        requested,
        ["bf", "abf", "adf", "haadf", "df", "sum_dp", "mean_dp", "max_dp", "com"]
    );
}

#[test]
fn products_with_a_given_disk_and_a_subset_then_the_summary() {
    let (dir, frames, master) = disk_acquisition();
    let out = dir.path().join("subset");
    let o = qg_job(
        "products",
        &master,
        &out,
        &[
            "--products",
            "bf,moments",
            "--center",
            "0",
            "12.5",
            "--radius",
            "4",
            "--representation",
            "encoded",
        ],
    );
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("BF disk") && text.contains("given"), "{text}");
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "bf.npy",
            "bf.png",
            "moments_m_col.npy",
            "moments_m_col.png",
            "moments_m_row.npy",
            "moments_m_row.png",
            "moments_sum.npy",
            "moments_sum.png",
            "products.json"
        ]
    );
    let n = P_SCAN.0 * P_SCAN.1;
    // A disk in the corner touches two detector edges.
    let (_, bf) = npy_u64(&out.join("bf.npy"));
    assert_eq!(bf, naive_ring(&frames, n, P_DET, (0.0, 12.5), 0.0, 4.0));
    let (_, s) = npy_u64(&out.join("moments_sum.npy"));
    let k = P_DET.0 * P_DET.1;
    let want: Vec<u64> = (0..n)
        .map(|f| {
            frames[f * k..(f + 1) * k]
                .iter()
                .map(|&v| u64::from(v))
                .sum()
        })
        .collect();
    assert_eq!(s, want);
    let rec: Value =
        serde_json::from_slice(&std::fs::read(out.join("products.json")).unwrap()).unwrap();
    assert_eq!(rec["disk"]["fitted"], false);
    assert_eq!(rec["dataset"]["representation"], "encoded");
    assert_eq!(rec["params"]["center"], serde_json::json!([0.0, 12.5]));
}

#[test]
fn products_and_dpc_exit_codes() {
    let dir = tempfile::tempdir().unwrap();
    let master = write_acq(dir.path(), P_SCAN, P_DET, &disk_frames());
    let out = dir.path().join("o");
    let out_s = out.to_str().unwrap();
    // Usage: unknown product, unit, edge; missing --out.
    for args in [
        &["products", &master, "--out", out_s, "--products", "bf,ssb"][..],
        &["products", &master, "--out", out_s, "--unit", "furlong"],
        &["products", &master],
        &["dpc", &master, "--out", out_s, "--edge", "wrap"],
        &["dpc", &master, "--out", out_s, "--transpose", "maybe"],
    ] {
        let o = qg(args);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
    }
    // Invalid parameters the library refuses (exit 2 too: invalid argument), named.
    let o = qg_job("products", &master, &out, &["--inner", "5", "--outer", "1"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    let o = qg_job(
        "products",
        &master,
        &out,
        &[
            "--products",
            "adf",
            "--inner",
            "1",
            "--outer",
            "2",
            "--unit",
            "mrad",
        ],
    );
    assert_fails(&o, 2, "mrad");
    // A missing source: 3, naming it.
    let o = qg(&["products", "/not/here_master.h5", "--out", out_s]);
    assert_fails(&o, 3, "here_master.h5");
    let o = qg(&["dpc", "/not/here_master.h5", "--out", out_s]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    // An unusable explicit backend: 4, before anything is written.
    for cmd in ["products", "dpc"] {
        let o = qg(&[cmd, &master, "--out", out_s, "--backend", "mps"]);
        assert_eq!(code(&o), 4, "{cmd}: {}", stderr(&o));
    }
    assert!(!out.exists());
}
