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

    for name in ["bf.png", "adf.png"] {
        let (w, h) = png_size(&out.join(name));
        assert!(w.min(h) >= 256, "{name}: {w} x {h}");
        assert_eq!(h * 40, w * 48, "{name}: aspect of the 48 x 40 scan");
    }
    // Provenance and the round trip through the files.
    assert_eq!(report["load"]["provenance"]["backend"], "cpu");
    assert_eq!(report["load"]["backend"], "cpu");
    assert_eq!(report["load"]["loaded_equals_simulated"], true);
    assert_eq!(report["load"]["shape"], serde_json::json!([48, 40, 64, 64]));
    assert!(report["files"]["compression_ratio"].as_f64().unwrap() > 1.5);
    assert_eq!(report["files"]["data_files"].as_array().unwrap().len(), 2);
    for stage in ["simulate", "write", "load", "products"] {
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
