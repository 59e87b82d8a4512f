//! Every route against independent arithmetic on the counts the test wrote, and against the
//! façade's own functions where the route is defined as one of them.

use crate::common::*;
use qem::detector::{DetectorKind, DetectorParams};

/// The fixture loaded by the test itself, for the façade's answers.
fn facade_dataset(dir: &std::path::Path) -> qem::Dataset {
    load_cpu(&dir.join("scan_master.h5"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capabilities_catalog_and_detail() {
    let dir = tempfile::tempdir().expect("tmp");
    let (s, _) = TestServer::fixture(dir.path());
    let c = s.get("/api/v1/capabilities").await;
    assert_eq!(c.status, 200);
    let c = c.json();
    assert_eq!(c["protocol"], "quantem-gpu-browse");
    assert_eq!(c["version"], 1);
    assert_eq!(c["backend"], "cpu");
    assert!(c["memory"]["budget_bytes"].as_u64().expect("budget") > 0);
    assert_eq!(c["limits"]["det_bin"], serde_json::json!([1, 2, 4, 8]));
    assert!(!c["revision"].as_str().expect("revision").is_empty());

    let l = s.get("/api/v1/acquisitions").await.json();
    assert_eq!(l.as_array().expect("list").len(), 1);
    assert_eq!(l[0]["path"], "scan_master.h5");
    assert_eq!(l[0]["ready"], true);
    assert_eq!(l[0]["loaded"], false);
    assert_eq!(
        l[0]["shape"],
        serde_json::json!([SCAN.0, SCAN.1, DET.0, DET.1])
    );
    let id = l[0]["id"].as_str().expect("id");

    let d = s.get(&format!("/api/v1/acquisitions/{id}")).await;
    assert_eq!(d.status, 200);
    let d = d.json();
    let fit = qem::detector::fit_disk(&facade_dataset(dir.path())).expect("fit");
    // serde_json's default float parsing may be one ulp off the printed shortest form.
    let close = |v: &serde_json::Value, want: f64| {
        (v.as_f64().expect("number") - want).abs() < 1e-12 * want.abs().max(1.0)
    };
    assert!(close(&d["disk"]["row"], fit.center_px.0), "{}", d["disk"]);
    assert!(close(&d["disk"]["col"], fit.center_px.1), "{}", d["disk"]);
    assert!(close(&d["disk"]["radius"], fit.radius_px), "{}", d["disk"]);
    assert_eq!(d["calibration"]["voltage_kv"].as_f64(), Some(300.0));
    assert_eq!(
        d["calibration"]["scan_step_a"],
        serde_json::json!([0.5, 0.5])
    );
    assert!(d["provenance"].is_object() && d["metadata"].is_object());
    assert_eq!(
        s.get("/api/v1/acquisitions").await.json()[0]["loaded"],
        true
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_native_and_binned() {
    let dir = tempfile::tempdir().expect("tmp");
    let (s, data) = TestServer::fixture(dir.path());
    let id = s.first_id().await;
    let (r, c) = (7, 3);
    let want = frame(&data, DET, r * SCAN.1 + c);
    let a = s
        .get(&format!("/api/v1/acquisitions/{id}/frame?r={r}&c={c}"))
        .await;
    assert_eq!(a.status, 200);
    assert_eq!(
        (a.header("x-dtype"), a.header("x-det-bin")),
        ("uint16", "1")
    );
    assert_eq!(a.shape(), vec![DET.0, DET.1]);
    assert_eq!(le_u16(&a.body), want);
    let wide: Vec<u64> = want.iter().map(|&v| u64::from(v)).collect();
    for b in [2usize, 4, 8] {
        let a = s
            .get(&format!(
                "/api/v1/acquisitions/{id}/frame?r={r}&c={c}&det_bin={b}"
            ))
            .await;
        assert_eq!(a.status, 200);
        assert_eq!(a.header("x-dtype"), "uint32");
        assert_eq!(a.shape(), vec![DET.0.div_ceil(b), DET.1.div_ceil(b)]);
        let got = le_u32_as_u64(&a.body);
        assert_eq!(got, block_sums(&wide, DET.0, DET.1, b), "det_bin {b}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diffraction_sum_mean_max_and_npy() {
    let dir = tempfile::tempdir().expect("tmp");
    let (s, data) = TestServer::fixture(dir.path());
    let id = s.get("/api/v1/acquisitions").await.json()[0]["id"]
        .as_str()
        .expect("id")
        .to_string();
    let sum = sum_dp(&data, DET);
    let max: Vec<u64> = (0..DET.0 * DET.1)
        .map(|k| {
            data.chunks_exact(DET.0 * DET.1)
                .map(|f| u64::from(f[k]))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let a = s
        .get(&format!("/api/v1/acquisitions/{id}/dp?reduce=sum"))
        .await;
    assert_eq!((a.status, a.header("x-dtype")), (200, "uint64"));
    assert_eq!(le_u64(&a.body), sum);
    let a = s
        .get(&format!(
            "/api/v1/acquisitions/{id}/dp?reduce=mean&det_bin=2"
        ))
        .await;
    assert_eq!(a.header("x-divisor"), (SCAN.0 * SCAN.1).to_string());
    assert_eq!(le_u64(&a.body), block_sums(&sum, DET.0, DET.1, 2));
    let a = s
        .get(&format!("/api/v1/acquisitions/{id}/dp?reduce=max"))
        .await;
    assert_eq!(a.header("x-dtype"), "uint32");
    assert_eq!(le_u32_as_u64(&a.body), max);
    // Binned max: the block maximum, written out here.
    let a = s
        .get(&format!(
            "/api/v1/acquisitions/{id}/dp?reduce=max&det_bin=4"
        ))
        .await;
    let (rb, cb) = (DET.0.div_ceil(4), DET.1.div_ceil(4));
    let mut want = vec![0u64; rb * cb];
    for i in 0..DET.0 {
        for j in 0..DET.1 {
            let w = &mut want[(i / 4) * cb + j / 4];
            *w = (*w).max(max[i * DET.1 + j]);
        }
    }
    assert_eq!(le_u32_as_u64(&a.body), want);
    // .npy: magic, a header naming '<u8' and the shape, then the same little-endian sums.
    let a = s
        .get(&format!(
            "/api/v1/acquisitions/{id}/dp?reduce=sum&format=npy"
        ))
        .await;
    assert_eq!(a.status, 200);
    assert!(a.header("content-disposition").starts_with("attachment"));
    assert_eq!(&a.body[..6], b"\x93NUMPY");
    let hlen = u16::from_le_bytes([a.body[8], a.body[9]]) as usize;
    let header = String::from_utf8_lossy(&a.body[10..10 + hlen]).to_string();
    assert!(
        header.contains("'<u8'") && header.contains(&format!("'shape': ({}, {}", DET.0, DET.1)),
        "{header}"
    );
    assert_eq!(le_u64(&a.body[10 + hlen..]), sum);
}

/// The mask of the detector viewed at `b`: binned pixel centres (I, J) tested, then expanded.
fn binned_mask(b: usize, inside: impl Fn(f64, f64) -> bool) -> Vec<bool> {
    let mut m = Vec::new();
    for i in 0..DET.0 {
        for j in 0..DET.1 {
            m.push(inside((i / b) as f64, (j / b) as f64));
        }
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn virtual_geometry_at_det_bin_1_and_2() {
    let dir = tempfile::tempdir().expect("tmp");
    let (s, data) = TestServer::fixture(dir.path());
    let id = s.first_id().await;
    for b in [1usize, 2] {
        let cases: Vec<(String, Vec<bool>)> = vec![
            (
                "mode=annulus&cr=4.5&cc=4&inner=1.5&outer=3".into(),
                binned_mask(b, |i, j| {
                    let d2 = (i - 4.5).powi(2) + (j - 4.0).powi(2);
                    (2.25..=9.0).contains(&d2)
                }),
            ),
            (
                "mode=disk&cr=5&cc=4&radius=2.5".into(),
                binned_mask(b, |i, j| (i - 5.0).powi(2) + (j - 4.0).powi(2) <= 6.25),
            ),
            (
                "mode=rect&r0=1&r1=6.5&c0=2&c1=5".into(),
                binned_mask(b, |i, j| (1.0..6.5).contains(&i) && (2.0..5.0).contains(&j)),
            ),
        ];
        for (q, mask) in cases {
            let a = s
                .get(&format!(
                    "/api/v1/acquisitions/{id}/virtual?{q}&det_bin={b}"
                ))
                .await;
            assert_eq!(a.status, 200, "{q}: {}", String::from_utf8_lossy(&a.body));
            assert_eq!(a.header("x-det-bin"), b.to_string());
            assert_eq!(a.shape(), vec![SCAN.0, SCAN.1]);
            assert_eq!(
                le_u64(&a.body),
                virtual_sum(&data, DET, &mask),
                "{q} det_bin {b}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn virtual_named_match_the_facade_and_scan_bin_region() {
    let dir = tempfile::tempdir().expect("tmp");
    let (s, data) = TestServer::fixture(dir.path());
    let id = s.first_id().await;
    let ds = facade_dataset(dir.path());
    for kind in [DetectorKind::Bf, DetectorKind::Adf, DetectorKind::Df] {
        let want =
            qem::detector::detector_image(&ds, kind, &DetectorParams::default()).expect("img");
        let a = s
            .get(&format!("/api/v1/acquisitions/{id}/virtual?mode={kind}"))
            .await;
        assert_eq!(le_u64(&a.body), want.image, "{kind}");
    }
    // scan_bin 2 of the full scan: 9 × 11 → 4 × 5, last row and column dropped.
    let mask = binned_mask(1, |i, j| (i - 10.0).powi(2) + (j - 8.0).powi(2) <= 16.0);
    let img = virtual_sum(&data, DET, &mask);
    let a = s
        .get(&format!(
            "/api/v1/acquisitions/{id}/virtual?mode=disk&cr=10&cc=8&radius=4&scan_bin=2"
        ))
        .await;
    assert_eq!(a.shape(), vec![4, 5]);
    assert_eq!(a.header("x-scan-bin"), "2");
    let mut want = vec![0u64; 20];
    for r in 0..8 {
        for c in 0..10 {
            want[(r / 2) * 5 + c / 2] += img[r * SCAN.1 + c];
        }
    }
    assert_eq!(le_u64(&a.body), want);
    // region 1..8 × 2..11 (7 × 9), then scan_bin 4 → 1 × 2.
    let a = s
        .get(&format!("/api/v1/acquisitions/{id}/virtual?mode=disk&cr=10&cc=8&radius=4&region=1,8,2,11&scan_bin=4"))
        .await;
    assert_eq!(a.shape(), vec![1, 2]);
    let cell = |r0: usize, c0: usize| -> u64 {
        (r0..r0 + 4)
            .flat_map(|r| (c0..c0 + 4).map(move |c| (r, c)))
            .map(|(r, c)| img[r * SCAN.1 + c])
            .sum()
    };
    assert_eq!(le_u64(&a.body), vec![cell(1, 2), cell(1, 6)]);
    // An uploaded mask of the detector viewed at det_bin 2 (11 × 9): a checkerboard of blocks.
    let (vr, vc) = (DET.0.div_ceil(2), DET.1.div_ceil(2));
    let up: Vec<u8> = (0..vr * vc)
        .map(|k| u8::from((k / vc + k % vc) % 2 == 0))
        .collect();
    let a = s
        .post(
            &format!("/api/v1/acquisitions/{id}/virtual-mask?det_bin=2"),
            up.clone(),
        )
        .await;
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    let mask = binned_mask(2, |i, j| up[i as usize * vc + j as usize] != 0);
    assert_eq!(le_u64(&a.body), virtual_sum(&data, DET, &mask));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roi_dp_and_com_dpc() {
    let dir = tempfile::tempdir().expect("tmp");
    let (s, data) = TestServer::fixture(dir.path());
    let id = s.first_id().await;
    let (r0, r1, c0, c1) = (2, 5, 3, 9);
    let mut sum = vec![0u64; DET.0 * DET.1];
    let mut max = vec![0u32; DET.0 * DET.1];
    for r in r0..r1 {
        for c in c0..c1 {
            for (k, &v) in frame(&data, DET, r * SCAN.1 + c).iter().enumerate() {
                sum[k] += u64::from(v);
                max[k] = max[k].max(u32::from(v));
            }
        }
    }
    let q = format!("r0={r0}&r1={r1}&c0={c0}&c1={c1}");
    let a = s
        .get(&format!("/api/v1/acquisitions/{id}/roi-dp?{q}&reduce=mean"))
        .await;
    assert_eq!(a.status, 200);
    assert_eq!(a.header("x-divisor"), ((r1 - r0) * (c1 - c0)).to_string());
    assert_eq!(le_u64(&a.body), sum);
    let a = s
        .get(&format!("/api/v1/acquisitions/{id}/roi-dp?{q}&reduce=max"))
        .await;
    assert_eq!(le_u32(&a.body), max);
    let a = s
        .get(&format!("/api/v1/acquisitions/{id}/roi-dp?{q}&det_bin=2"))
        .await;
    assert_eq!(le_u64(&a.body), block_sums(&sum, DET.0, DET.1, 2));

    let ds = facade_dataset(dir.path());
    let com = qem::dpc::center_of_mass(&ds, true).expect("com");
    for mode in ["com_row", "com_col", "com_mag", "dpc_phase"] {
        let a = s
            .get(&format!(
                "/api/v1/acquisitions/{id}/virtual?mode={mode}&det_bin=2"
            ))
            .await;
        assert_eq!(a.status, 200, "{mode}");
        assert_eq!(
            (a.header("x-dtype"), a.header("x-det-bin")),
            ("float32", "1")
        );
        assert_eq!(a.shape(), vec![SCAN.0, SCAN.1]);
        let v = le_f32(&a.body);
        assert!(v.iter().all(|x| x.is_finite()), "{mode}");
        if mode == "com_row" {
            let want: Vec<f32> = com.com_row.iter().map(|&x| x as f32).collect();
            assert_eq!(v, want);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssb_prepare_reconstruct_and_fit_job() {
    let dir = tempfile::tempdir().expect("tmp");
    let sim = qem_sim::SimParams {
        scan_shape: qem::Shape2::new(12, 10),
        detector_shape: qem::Shape2::new(32, 32),
        aberrations: qem_sim::Aberrations {
            c10_a: 20.0,
            c12_a: 5.0,
            ..Default::default()
        },
        ..Default::default()
    };
    qem_sim::demo::write_demo(dir.path(), &sim).expect("demo files");
    let s = TestServer::start(
        qem_serve::ServeRoot::Path(dir.path().to_path_buf()),
        cpu_opts(),
    );
    let id = s.first_id().await;
    // Omitted values come from the calibration the demo wrote.
    let a = s
        .post(
            &format!("/api/v1/acquisitions/{id}/ssb/prepare"),
            b"{}".to_vec(),
        )
        .await;
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    let p = a.json();
    assert!(p["n_bf_pixels"].as_u64().expect("n") > 0);
    assert_eq!(p["params"]["voltage_kv"].as_f64(), Some(sim.voltage_kv));
    let a = s
        .get(&format!(
            "/api/v1/acquisitions/{id}/ssb/reconstruct?C10=50&C12=20&phi12=0.5"
        ))
        .await;
    assert_eq!((a.status, a.header("x-dtype")), (200, "float32"));
    assert_eq!(a.shape(), vec![12, 10]);
    assert!(le_f32(&a.body).iter().all(|x| x.is_finite()));
    let body = br#"{"seed": 1, "fit": ["C10"], "ranges": {"C10": [0, 100]}, "global_evals": 6, "local_max_iter": 4, "local_starts": 1}"#;
    let a = s
        .post(&format!("/api/v1/acquisitions/{id}/ssb/fit"), body.to_vec())
        .await;
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    let job = a.json()["job"].as_str().expect("job").to_string();
    let mut last = serde_json::Value::Null;
    for _ in 0..600 {
        last = s.get(&format!("/api/v1/jobs/{job}")).await.json();
        if last["state"] != "running" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(last["state"], "done", "{last}");
    let done = last["progress"]["done"].as_u64().expect("done");
    assert!(done >= 7, "{last}"); // the start point and 6 global points at least
    assert_eq!(last["progress"]["total"].as_u64(), Some(done));
    assert_eq!(last["result"]["evaluations"].as_u64(), Some(done));
    let c10 = last["result"]["aberrations"]["C10"].as_f64().expect("C10");
    assert!((0.0..=100.0).contains(&c10));
    assert_eq!(s.get("/api/v1/jobs/job-999").await.status, 404);

    // The façade's fit with and without the progress hook: the same losses in the same order,
    // and the service's answer is that fit.
    let ds = load_cpu(&dir.path().join("demo_master.h5"));
    let ssb_params = qem::ssb::SsbParams {
        voltage_kv: sim.voltage_kv,
        semiangle_mrad: sim.semiangle_mrad,
        scan_step_a: (sim.scan_step_a, sim.scan_step_a),
        ..Default::default()
    };
    let ssb = qem::ssb::Ssb::new(&ds, &ssb_params).expect("prepare");
    let fp = qem::ssb::FitParams {
        seed: 1,
        fit: vec!["C10".into()],
        ranges: [("C10".to_string(), (0.0, 100.0))].into_iter().collect(),
        global_evals: 6,
        local_max_iter: 4,
        local_starts: 1,
        ..Default::default()
    };
    let plain = ssb.fit(&fp).expect("fit");
    let seen = std::sync::Mutex::new(Vec::new());
    let hooked = ssb
        .fit_with_progress(&fp, &|d, t| seen.lock().unwrap().push((d, t)))
        .expect("fit");
    assert_eq!(plain.loss_curve, hooked.loss_curve);
    assert_eq!(plain.aberrations, hooked.aberrations);
    let seen = seen.into_inner().unwrap();
    assert_eq!(
        seen.first(),
        Some(&(7, fp.evaluation_estimate())),
        "the global batch first"
    );
    assert_eq!(seen.last().map(|p| p.0), Some(plain.evaluations));
    assert!(seen.windows(2).all(|w| w[0].0 < w[1].0 && w[0].0 <= w[0].1));
    assert_eq!(
        last["result"]["evaluations"].as_u64(),
        Some(plain.evaluations as u64)
    );
    let c10_plain = plain.aberrations.c10;
    assert!(
        (c10 - c10_plain).abs() <= 1e-9 * c10_plain.abs().max(1.0),
        "{c10} vs {c10_plain}"
    );

    // On the CPU engine a long fit runs beside the views: a frame is answered while the fit
    // (3,000 global points) is still running.
    let body = br#"{"seed": 2, "global_evals": 3000, "local_max_iter": 200, "local_starts": 3}"#;
    let a = s
        .post(&format!("/api/v1/acquisitions/{id}/ssb/fit"), body.to_vec())
        .await;
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    let job = a.json()["job"].as_str().expect("job").to_string();
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let t = std::time::Instant::now();
    let f = s
        .get(&format!("/api/v1/acquisitions/{id}/frame?r=1&c=2"))
        .await;
    let waited = t.elapsed();
    assert_eq!(f.status, 200);
    let st = s.get(&format!("/api/v1/jobs/{job}")).await.json();
    assert_eq!(
        st["state"], "running",
        "the fit ended before the test could see it: {st}"
    );
    assert!(
        waited.as_secs_f64() < 2.0,
        "a frame waited {waited:?} behind the fit"
    );
}
