//! End-to-end tests of the `quantem-gpu` binary: exit codes, JSON outputs, the demo and a tiny
//! benchmark.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

fn qg(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_quantem-gpu"))
        .args(args)
        .output()
        .expect("run quantem-gpu")
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exit code")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn json_stdout(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(&o.stdout),
            stderr(o)
        )
    })
}

#[test]
fn device_json_lists_cpu_available_and_cuda_with_a_reason() {
    let o = qg(&["device", "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json_stdout(&o);
    let backends = v["backends"].as_array().unwrap();
    let find = |name: &str| {
        backends
            .iter()
            .find(|b| b["name"] == name)
            .unwrap_or_else(|| panic!("no {name} in {v}"))
    };
    assert_eq!(find("cpu")["available"], true);
    // On a GPU machine CUDA is available (and auto picks it); elsewhere it says why not.
    assert!(!find("cuda")["detail"].as_str().unwrap().is_empty());
    if find("cuda")["available"] == true {
        assert_eq!(v["auto"], "cuda");
    } else {
        assert_eq!(v["auto"], "cpu");
    }
}

#[test]
fn inspect_of_a_missing_file_exits_3_naming_it() {
    let o = qg(&["inspect", "/definitely/not/here_master.h5"]);
    assert_eq!(code(&o), 3);
    let e = stderr(&o);
    assert!(e.starts_with("error: "), "{e}");
    assert!(e.contains("here_master.h5"), "{e}");
    assert!(o.stdout.is_empty());
}

#[test]
fn bad_usage_exits_2() {
    for args in [
        &[][..],
        &["frobnicate"],
        &["demo", "--bogus"],
        &["inspect"],
        &["inspect", "x.h5", "--scan-shape", "0", "4"],
        &["inspect", "x.h5", "--scan-shape", "4"],
        &["demo", "--backend", "tpu"],
    ] {
        let o = qg(args);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        // No subcommand prints the help (to stderr); every other case names the error.
        if !args.is_empty() {
            assert!(stderr(&o).contains("error"), "{args:?}");
        }
    }
    // Help is not an error.
    assert_eq!(code(&qg(&["--help"])), 0);
}

#[test]
fn demo_with_an_unusable_explicit_backend_exits_4() {
    // MPS is never usable on this engine (CUDA may be, on a GPU machine).
    let dir = tempfile::tempdir().unwrap();
    let o = qg(&[
        "demo",
        "--backend",
        "mps",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 4, "{}", stderr(&o));
    assert!(stderr(&o).to_lowercase().contains("mps"));
}

fn png_size(path: &Path) -> (u32, u32) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[1..4], b"PNG", "{}", path.display());
    let be = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    (be(16), be(20))
}

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
        // The 48 x 40 scan, upscaled 7x, then the scale bar (8 + 16 pixels).
        assert_eq!((w, h), (40 * 7 + 24, 48 * 7), "{name}");
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
    // 30°) within the bounds measured with margin (7 %, 9 %, 0.02 rad off on this dataset).
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

#[test]
fn tiny_bench_load_writes_a_record() {
    let dir = tempfile::tempdir().unwrap();
    let with_h5py = Command::new("python3")
        .args(["-c", "import h5py, hdf5plugin, numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    let mut args = vec![
        "bench",
        "load",
        "--scan",
        "5",
        "3",
        "--detector",
        "24",
        "20",
        "--repeats",
        "2",
        "--out",
    ];
    let out = dir.path().to_str().unwrap();
    args.push(out);
    if with_h5py {
        args.push("--h5py");
    }
    let o = qg(&args);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("quantem-gpu (cpu)"), "{text}");
    let files: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("cpu_load_") && name.ends_with(".json"),
        "{name}"
    );
    let rec: Value = serde_json::from_slice(&std::fs::read(&files[0]).unwrap()).unwrap();
    assert_eq!(rec["acquisition"]["frames"], 15);
    assert_eq!(rec["acquisition"]["raw_bytes"], 15 * 24 * 20 * 2);
    assert_eq!(rec["ours"]["seconds"].as_array().unwrap().len(), 2);
    assert!(rec["ours"]["checksum"]["total"].as_u64().unwrap() > 0);
    assert!(rec["machine"]["logical_cpus"].as_u64().unwrap() >= 1);
    if with_h5py {
        assert_eq!(rec["checksums_equal"], true, "{}", rec["h5py"]);
        assert!(rec["ratio_h5py_over_ours_p50"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn generate_reference_then_bench_the_source_against_the_cpu_engine() {
    let dir = tempfile::tempdir().unwrap();
    let acq = dir.path().join("ref");
    let acq_s = acq.to_str().unwrap();
    // Rectangular scan (recorded in the master), u32 frames, shards of 7 frames.
    let o = qg(&[
        "generate-reference",
        acq_s,
        "--scan",
        "6",
        "4",
        "--dtype",
        "u32",
        "--frames-per-file",
        "7",
        "--dose",
        "50000",
        "--json",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json_stdout(&o);
    assert_eq!(v["frames"], 24);
    assert_eq!(v["shards"], 4);
    assert_eq!(v["raw_bytes"], 24 * 192 * 192 * 4);
    assert!(v["compression_ratio"].as_f64().unwrap() > 2.0, "{v}");
    assert_eq!(v["bad_pixels"].as_array().unwrap().len(), 2);
    assert!(acq.join("reference_acquisition.json").exists());
    let master = acq.join("scan_master.h5");

    let o = qg(&["inspect", master.to_str().unwrap(), "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let i = json_stdout(&o);
    assert_eq!(i["bad_pixels"], 2, "{i}");

    let out = dir.path().join("results");
    let o = qg(&[
        "bench",
        "load",
        "--source",
        master.to_str().unwrap(),
        "--cpu-check",
        "--scan-region",
        "1",
        "5",
        "0",
        "3",
        "--det-bin",
        "2",
        "--repeats",
        "2",
        "--warmup",
        "0",
        "--out",
        out.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let rec = json_stdout(&o);
    assert_eq!(rec["passed"], true, "{rec}");
    assert_eq!(rec["cpu_check"]["byte_exact"], true, "{rec}");
    assert_eq!(rec["cpu_check"]["sampled_frames"], 12);
    assert_eq!(
        rec["plan"]["result_shape"],
        serde_json::json!([4, 3, 96, 96])
    );
    assert_eq!(rec["source"]["dtype"], "uint32");
    assert_eq!(rec["ours"]["seconds"].as_array().unwrap().len(), 2);
    let files: Vec<_> = std::fs::read_dir(&out).unwrap().collect();
    assert_eq!(files.len(), 1);

    // A backend other than cpu without --source is a usage error naming --source.
    let o = qg(&["bench", "load", "--backend", "cuda"]);
    assert_ne!(code(&o), 0);
    assert!(stderr(&o).contains("--source"), "{}", stderr(&o));
}

/// A NumPy stand-in for CuPy: enough of its surface for `bench load --cupy`'s snippet.
const FAKE_CUPY: &str = r#"
from numpy import *  # noqa
import numpy as _np
__version__ = "numpy-stand-in"
asarray = _np.asarray
class _Pool:
    def free_all_blocks(self): pass
    def total_bytes(self): return 0
def get_default_memory_pool(): return _Pool()
class _Device:
    id = 0
    def synchronize(self): pass
class _Runtime:
    @staticmethod
    def runtimeGetVersion(): return 0
    @staticmethod
    def getDeviceProperties(i): return {"name": b"numpy"}
class cuda:
    Device = _Device
    runtime = _Runtime
"#;

#[test]
fn bench_cupy_snippet_checksums_agree_with_ours_using_a_numpy_stand_in() {
    let has_h5py = Command::new("python3")
        .args(["-c", "import h5py, hdf5plugin, numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_h5py {
        eprintln!("skipped: python3 with h5py, hdf5plugin and numpy is not available");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let acq = dir.path().join("ref");
    let o = qg(&[
        "generate-reference",
        acq.to_str().unwrap(),
        "--scan",
        "5",
        "5",
        "--frames-per-file",
        "10",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let fake = dir.path().join("fake").join("cupy");
    std::fs::create_dir_all(&fake).unwrap();
    std::fs::write(fake.join("__init__.py"), FAKE_CUPY).unwrap();
    let pythonpath = match std::env::var("PYTHONPATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", fake.parent().unwrap().display()),
        _ => fake.parent().unwrap().display().to_string(),
    };
    let out = dir.path().join("results");
    let o = Command::new(env!("CARGO_BIN_EXE_quantem-gpu"))
        .args([
            "bench",
            "load",
            "--source",
            acq.join("scan_master.h5").to_str().unwrap(),
            "--cupy",
            "--cpu-check",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--json",
            "--out",
            out.to_str().unwrap(),
        ])
        .env("PYTHONPATH", pythonpath)
        .output()
        .unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let rec = json_stdout(&o);
    // The masked bad pixels are zeroed on both sides, so the checksums agree.
    assert_eq!(
        rec["cupy"]["checksum_equal_to_ours"], true,
        "{}",
        rec["cupy"]
    );
    assert_eq!(rec["cupy"]["masked_pixels"], 2, "{}", rec["cupy"]);
    assert_eq!(rec["cupy"]["seconds"].as_array().unwrap().len(), 1);
    assert_eq!(rec["passed"], true);
}

// ------------------------------------------------------------------ products and dpc

/// The shape, descr and data bytes of a `.npy` file (NPY v1.0, as our writer makes them).
fn read_npy(path: &Path) -> (Vec<usize>, String, Vec<u8>) {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&b[..8], b"\x93NUMPY\x01\x00", "{}", path.display());
    let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
    assert_eq!((10 + hl) % 64, 0, "header padding of {}", path.display());
    let header = std::str::from_utf8(&b[10..10 + hl]).unwrap();
    assert!(header.contains("'fortran_order': False"), "{header}");
    let descr = header.split("'descr': '").nth(1).unwrap();
    let descr = descr[..descr.find('\'').unwrap()].to_string();
    let dims = header.split("'shape': (").nth(1).unwrap();
    let dims = &dims[..dims.find(')').unwrap()];
    let shape: Vec<usize> = dims
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    (shape, descr, b[10 + hl..].to_vec())
}

fn npy_shape(path: &Path) -> Vec<usize> {
    read_npy(path).0
}

fn npy_u64(path: &Path) -> (Vec<usize>, Vec<u64>) {
    let (shape, descr, data) = read_npy(path);
    assert_eq!(descr, "<u8", "{}", path.display());
    let v = data
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (shape, v)
}

fn npy_f64(path: &Path) -> (Vec<usize>, Vec<f64>) {
    let (shape, descr, data) = read_npy(path);
    let v = match descr.as_str() {
        "<f8" => data
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        "<f4" => data
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
            .collect(),
        other => panic!("{}: descr {other}", path.display()),
    };
    (shape, v)
}

/// Write a Dectris acquisition of u16 `frames` (`scan.len()` frames of `det.len()` pixels).
fn write_acq(dir: &Path, scan: (usize, usize), det: (usize, usize), frames: &[u16]) -> String {
    use qem_io::writer::{self, WriteCompression, WriteLayout, WriteParams};
    let det_len = det.0 * det.1;
    assert_eq!(frames.len(), scan.0 * scan.1 * det_len);
    let params = WriteParams {
        prefix: dir.join("acq"),
        scan_shape: qem::Shape2::new(scan.0, scan.1),
        detector_shape: qem::Shape2::new(det.0, det.1),
        dtype: qem::DType::U16,
        frames_per_file: 16,
        frames_per_chunk: 1,
        block_elems: 0,
        compression: WriteCompression::Bslz4,
        layout: WriteLayout::Shards,
        pixel_mask: None,
        calibration: writer::Calibration::default(),
        skip_frames: Vec::new(),
        write_scan_shape: true,
    };
    let written = writer::write_acquisition(&params, |n, buf| {
        let f = &frames[n as usize * det_len..(n as usize + 1) * det_len];
        for (dst, v) in buf.chunks_exact_mut(2).zip(f) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
    })
    .unwrap();
    written.master.to_str().unwrap().to_string()
}

const P_SCAN: (usize, usize) = (5, 7);
const P_DET: (usize, usize) = (11, 13);

/// Frames with a bright disk of radius 3 around (5.2, 6.4), deterministic "noise", a few
/// all-zero frames.
/// [`disk_frames`] written (`P_SCAN`, `P_DET`) in a new temporary directory: the directory,
/// the frames and the master file.
fn disk_acquisition() -> (tempfile::TempDir, Vec<u16>, String) {
    let dir = tempfile::tempdir().unwrap();
    let frames = disk_frames();
    let master = write_acq(dir.path(), P_SCAN, P_DET, &frames);
    (dir, frames, master)
}

fn disk_frames() -> Vec<u16> {
    let (n, k) = (P_SCAN.0 * P_SCAN.1, P_DET.0 * P_DET.1);
    let mut v = Vec::with_capacity(n * k);
    for f in 0..n {
        for p in 0..k {
            let (i, j) = ((p / P_DET.1) as f64, (p % P_DET.1) as f64);
            let inside = (i - 5.2).powi(2) + (j - 6.4).powi(2) <= 9.0;
            let noise = ((f * 31 + p * 17) % 7) as u16;
            v.push(if f == 3 || f == 20 {
                0
            } else if inside {
                900 + 10 * noise + f as u16
            } else {
                noise
            });
        }
    }
    v
}

/// The BF disk of the naive mean DP (f32 values, statistics in f64, docs/science.md §3).
fn naive_disk(frames: &[u16], n: usize, det: (usize, usize)) -> ((f64, f64), f64) {
    let k = det.0 * det.1;
    let mut sum = vec![0u64; k];
    for f in 0..n {
        for p in 0..k {
            sum[p] += u64::from(frames[f * k + p]);
        }
    }
    let mean: Vec<f64> = sum
        .iter()
        .map(|&s| f64::from((s as f64 / n as f64) as f32))
        .collect();
    let mu = mean.iter().sum::<f64>() / k as f64;
    let sd = (mean.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / k as f64).sqrt();
    let (mut c, mut sr, mut sc) = (0usize, 0.0, 0.0);
    for (p, &v) in mean.iter().enumerate() {
        if v > mu + sd {
            c += 1;
            sr += (p / det.1) as f64;
            sc += (p % det.1) as f64;
        }
    }
    (
        (sr / c as f64, sc / c as f64),
        (c as f64 / std::f64::consts::PI).sqrt(),
    )
}

fn naive_ring(
    frames: &[u16],
    n: usize,
    det: (usize, usize),
    c: (f64, f64),
    lo: f64,
    hi: f64,
) -> Vec<u64> {
    let k = det.0 * det.1;
    (0..n)
        .map(|f| {
            let mut s = 0u64;
            for p in 0..k {
                let (dr, dc) = ((p / det.1) as f64 - c.0, (p % det.1) as f64 - c.1);
                let d2 = dr * dr + dc * dc;
                if lo * lo <= d2 && d2 <= hi * hi {
                    s += u64::from(frames[f * k + p]);
                }
            }
            s
        })
        .collect()
}

#[test]
fn products_writes_exact_arrays_pngs_and_json() {
    let (dir, frames, master) = disk_acquisition();
    let out = dir.path().join("out");
    let o = qg(&[
        "products",
        &master,
        "--out",
        out.to_str().unwrap(),
        "--backend",
        "cpu",
        "--json",
    ]);
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
        assert_eq!((w, h), (7 * scale + 24, 5 * scale), "{name}");
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
    let o = qg(&[
        "products",
        &master,
        "--out",
        out.to_str().unwrap(),
        "--products",
        "bf,moments",
        "--center",
        "0",
        "12.5",
        "--radius",
        "4",
        "--representation",
        "encoded",
    ]);
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
    let o = qg(&[
        "products", &master, "--out", out_s, "--inner", "5", "--outer", "1",
    ]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    let o = qg(&[
        "products",
        &master,
        "--out",
        out_s,
        "--products",
        "adf",
        "--inner",
        "1",
        "--outer",
        "2",
        "--unit",
        "mrad",
    ]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("mrad"), "{}", stderr(&o));
    // A missing source: 3, naming it.
    let o = qg(&["products", "/not/here_master.h5", "--out", out_s]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert!(stderr(&o).contains("here_master.h5"));
    let o = qg(&["dpc", "/not/here_master.h5", "--out", out_s]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    // An unusable explicit backend: 4, before anything is written.
    for cmd in ["products", "dpc"] {
        let o = qg(&[cmd, &master, "--out", out_s, "--backend", "mps"]);
        assert_eq!(code(&o), 4, "{cmd}: {}", stderr(&o));
    }
    assert!(!out.exists());
}

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
        let o = qg(&["dpc", &master, "--out", out.to_str().unwrap(), "--json"]);
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
            assert_eq!((w, h), (17 * s + 24, 15 * s), "{name}");
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
    let o = qg(&[
        "dpc",
        &master,
        "--out",
        out.to_str().unwrap(),
        "--rotation-deg",
        "-10",
        "--transpose",
        "false",
        "--edge",
        "mirror",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("rotation  -10.00°"));
    let rec: Value = serde_json::from_slice(&std::fs::read(out.join("dpc.json")).unwrap()).unwrap();
    assert_eq!(rec["rotation_deg"], -10.0);
    assert_eq!(rec["sign_criterion"], "explicit_rotation");
    assert_eq!(rec["params"]["edge"], "mirror");
}

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
    // Default detector sampling: α / r_BF.
    let dtheta = rec["det_sampling_mrad"].as_f64().unwrap();
    assert!(
        (dtheta - 20.0 / r).abs() < 1e-9 * dtheta,
        "{dtheta} vs {}",
        20.0 / r
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
    let o = qg(&[
        "ssb",
        &master,
        "--out",
        out.to_str().unwrap(),
        "--semiangle-mrad",
        "20",
        "--scan-step-a",
        "0.5",
    ]);
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

// ---- Hostile inputs (regression tests of a hostile-input campaign) ----

/// Run quantem-gpu with `args` (and `env`) under a deadline and an address-space limit (so an
/// attempt to allocate ~2^64 bytes, or one entry per declared frame, fails the test instead of
/// the machine); a hang is killed and reported.
fn qg_limited(args: &[&str], env: &[(&str, &str)], secs: u64) -> Output {
    let bin = env!("CARGO_BIN_EXE_quantem-gpu");
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg("ulimit -v 8000000; exec \"$0\" \"$@\"")
        .arg(bin)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().expect("spawn quantem-gpu");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(std::time::Duration::from_secs(secs)) {
        Ok(o) => o.expect("wait quantem-gpu"),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("quantem-gpu {args:?} hung for {secs} s");
        }
    }
}

#[test]
fn inspect_of_a_directory_fifo_loop_or_non_hdf5_file_exits_3_saying_why() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("scan_master.h5");
    std::fs::create_dir(&sub).unwrap();
    let fifo = dir.path().join("pipe_master.h5");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let (a, b) = (dir.path().join("a.h5"), dir.path().join("b.h5"));
    std::os::unix::fs::symlink(&b, &a).unwrap();
    std::os::unix::fs::symlink(&a, &b).unwrap();
    let text = dir.path().join("notes_master.h5");
    std::fs::write(&text, b"not an HDF5 file").unwrap();
    for (path, says) in [
        (&sub, "not a regular file: it is a directory"),
        (&fifo, "not a regular file: it is a FIFO"),
        (&a, "symlink loop"),
        (&text, "cannot open the file as HDF5"),
    ] {
        for cmd in [
            vec!["inspect", path.to_str().unwrap()],
            vec![
                "convert",
                path.to_str().unwrap(),
                "/nonexistent/out.qem",
                "--backend",
                "cpu",
            ],
        ] {
            let o = qg_limited(&cmd, &[], 30);
            let e = stderr(&o);
            assert_eq!(code(&o), 3, "{cmd:?}: {e}");
            if cmd[0] == "inspect" || !says.starts_with("cannot open") {
                assert!(e.contains(says), "{cmd:?}: {e}");
            }
            assert!(!e.contains("file not found"), "{cmd:?}: {e}");
        }
    }
    // Unreadable (permissions): only testable when not root.
    let locked = dir.path().join("locked_master.h5");
    std::fs::write(&locked, b"x").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000)).unwrap();
    if std::fs::File::open(&locked).is_err() {
        let o = qg_limited(&["inspect", locked.to_str().unwrap()], &[], 30);
        assert_eq!(code(&o), 3, "{}", stderr(&o));
        assert!(stderr(&o).contains("ermission denied"), "{}", stderr(&o));
    }
}

#[test]
fn a_scan_shape_whose_product_wraps_is_refused_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let frames = vec![1u16; 64 * 4];
    let master = write_acq(dir.path(), (8, 8), (2, 2), &frames);
    // 64 x (2^58 + 1) wraps to 64, the number of frames present.
    let wraps = ((1u64 << 58) + 1).to_string();
    let o = qg_limited(&["inspect", &master, "--scan-shape", "64", &wraps], &[], 60);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        out.contains("ready: NO") && out.contains("overflows"),
        "{out}"
    );
    let qem = dir.path().join("out.qem");
    let o = qg_limited(
        &[
            "convert",
            &master,
            qem.to_str().unwrap(),
            "--backend",
            "cpu",
            "--scan-shape",
            "64",
            &wraps,
        ],
        &[],
        60,
    );
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("overflows"), "{}", stderr(&o));
    assert!(!qem.exists());
}

#[test]
fn a_file_declaring_a_billion_frames_and_holding_one_fails_fast_naming_frame_1() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sparse.h5");
    qem_io::writer::write_sparse_dataset(
        &path,
        &[31623, 31623, 64, 64],
        &[1, 1, 64, 64],
        &[vec![0, 0, 0, 0]],
        3,
    )
    .unwrap();
    let p = path.to_str().unwrap();
    let o = qg_limited(&["inspect", p], &[], 60);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        out.contains("ready: NO") && out.contains("first: 1"),
        "{out}"
    );
    let qem = dir.path().join("out.qem");
    let o = qg_limited(
        &["convert", p, qem.to_str().unwrap(), "--backend", "cpu"],
        &[],
        60,
    );
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert!(stderr(&o).contains("frame 1 "), "{}", stderr(&o));
}

#[test]
fn shard_links_leaving_the_folder_are_refused_unless_allowed() {
    let top = tempfile::tempdir().unwrap();
    let acq = top.path().join("acq");
    std::fs::create_dir(&acq).unwrap();
    let frames = vec![2u16; 16 * 4];
    let master = write_acq(&acq, (4, 4), (2, 2), &frames);
    // Move the (only) shard out of the folder and leave a symlink to it in its place: the
    // link's stored target is inside the folder, the file it resolves to is not.
    let elsewhere = top.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let shard = acq.join("acq_data_000001.h5");
    std::fs::rename(&shard, elsewhere.join("acq_data_000001.h5")).unwrap();
    std::os::unix::fs::symlink("../elsewhere/acq_data_000001.h5", &shard).unwrap();
    let qem = acq.join("out.qem");
    let args = [
        "convert",
        master.as_str(),
        qem.to_str().unwrap(),
        "--backend",
        "cpu",
    ];
    let o = qg_limited(&args, &[], 60);
    let e = stderr(&o);
    assert_eq!(code(&o), 3, "{e}");
    assert!(
        e.contains("data_000001")
            && e.contains("acq_data_000001.h5")
            && e.contains("outside the acquisition's folder")
            && e.contains("QUANTEM_GPU_ALLOW_EXTERNAL_LINKS"),
        "{e}"
    );
    let o = qg_limited(&args, &[("QUANTEM_GPU_ALLOW_EXTERNAL_LINKS", "1")], 60);
    assert_eq!(code(&o), 0, "allowed: {}", stderr(&o));
    assert!(qem.is_file());
}

/// A small `.qem` made by `convert` from a generated acquisition.
fn small_qem(dir: &Path, name: &str, scan: (usize, usize)) -> (String, std::path::PathBuf) {
    let det = (8, 8);
    let n = scan.0 * scan.1 * det.0 * det.1;
    let frames: Vec<u16> = (0..n).map(|i| ((i * 2_654_435_761) % 7) as u16).collect();
    let sub = dir.join(format!("{name}_src"));
    std::fs::create_dir_all(&sub).unwrap();
    let master = write_acq(&sub, scan, det, &frames);
    let qem = dir.join(format!("{name}.qem"));
    let o = qg(&[
        "convert",
        &master,
        qem.to_str().unwrap(),
        "--backend",
        "cpu",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    (master, qem)
}

fn tmp_leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect()
}

/// Deterministic pseudo-random numbers (xorshift64*), seeded per test.
fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed.max(1);
    move || {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        s.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

#[test]
fn convert_killed_at_random_moments_keeps_the_old_file_and_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    // Big enough that a save takes a while: 64 x 64 frames.
    let (master, qem) = small_qem(dir.path(), "kill", (64, 64));
    let old = std::fs::read(&qem).unwrap();
    let mut next = rng(0x5eed_0001);
    let bin = env!("CARGO_BIN_EXE_quantem-gpu");
    // Time a full run to spread the kills over it.
    let t = std::time::Instant::now();
    let o = qg(&[
        "convert",
        &master,
        qem.to_str().unwrap(),
        "--backend",
        "cpu",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let full_ms = (t.elapsed().as_millis() as u64).max(20);
    let reference = std::fs::read(&qem).unwrap();
    assert!(qem::read_qem(&qem, &Default::default()).is_ok());
    let mut killed_mid_way = 0;
    for _ in 0..10 {
        let before = std::fs::read(&qem).unwrap();
        let delay = next() % (full_ms + full_ms / 4);
        let mut child = Command::new(bin)
            .args([
                "convert",
                &master,
                qem.to_str().unwrap(),
                "--backend",
                "cpu",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay));
        let _ = child.kill(); // SIGKILL
        let status = child.wait().unwrap();
        if !status.success() {
            killed_mid_way += 1;
        }
        // The target is always a complete file: the old one, or a complete new one.
        let now = std::fs::read(&qem).unwrap();
        if now != before {
            assert!(status.success(), "target changed by a killed save");
        }
        let q = qem::read_qem(&qem, &Default::default());
        assert!(
            q.is_ok(),
            "target after a kill at {delay} ms: {:?}",
            q.err()
        );
        assert_eq!(now.len(), reference.len().max(now.len()));
    }
    let _ = old;
    eprintln!("{killed_mid_way} of 10 saves killed before finishing (full run {full_ms} ms)");
    // The next save removes the temporaries the killed ones left behind.
    let o = qg(&[
        "convert",
        &master,
        qem.to_str().unwrap(),
        "--backend",
        "cpu",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(tmp_leftovers(dir.path()), Vec::<String>::new());
    // A stale temporary of a dead pid is removed; one of a live process is kept.
    let stale = dir.path().join("kill.qem.tmp-999999999-0");
    let live = dir
        .path()
        .join(format!("kill.qem.tmp-{}-7", std::process::id()));
    std::fs::write(&stale, b"partial").unwrap();
    std::fs::write(&live, b"in progress").unwrap();
    let o = qg(&[
        "convert",
        &master,
        qem.to_str().unwrap(),
        "--backend",
        "cpu",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(!stale.exists() && live.exists());
}

#[test]
fn two_hundred_random_bit_flips_of_a_qem_file_are_all_caught_on_load() {
    let dir = tempfile::tempdir().unwrap();
    let (_, qem) = small_qem(dir.path(), "flip", (4, 5));
    let good = std::fs::read(&qem).unwrap();
    let params = qem::LoadParams {
        backend: qem::BackendRequest::Cpu,
        ..qem::LoadParams::default()
    };
    assert!(qem::load(qem::SourceArg::Path(qem.clone()), &params).is_ok());
    let mut next = rng(0xb17f_11b5);
    let flipped = dir.path().join("flipped.qem");
    for k in 0..200 {
        let bit = next() % (good.len() as u64 * 8);
        let mut bytes = good.clone();
        bytes[(bit / 8) as usize] ^= 1 << (bit % 8);
        std::fs::write(&flipped, &bytes).unwrap();
        let r = qem::load(qem::SourceArg::Path(flipped.clone()), &params);
        match r {
            Ok(_) => panic!("flip {k}: bit {} of byte {} not caught", bit % 8, bit / 8),
            Err(e) => assert!(
                matches!(
                    e.kind,
                    qem::ErrorKind::Source | qem::ErrorKind::Decode | qem::ErrorKind::Io
                ),
                "flip {k} at byte {}: {e}",
                bit / 8
            ),
        }
    }
}
