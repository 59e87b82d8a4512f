//! End-to-end tests of the `qem-bench` binary: the tiny load benchmark record,
//! `generate-reference` then a source benchmark against the CPU engine, and the CuPy snippet's
//! checksums (with a NumPy stand-in).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use std::process::{Command, Output};

fn qb(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qem-bench"))
        .args(args)
        .output()
        .expect("run qem-bench")
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exit code")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// stdout parsed as JSON (the test fails with stdout and stderr shown when it is not).
fn json_stdout(o: &Output) -> Value {
    let parsed = serde_json::from_slice(&o.stdout);
    parsed.unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {o:?}"))
}

#[test]
fn tiny_bench_load_writes_a_record() {
    let dir = tempfile::tempdir().unwrap();
    let with_h5py = Command::new("python3")
        .args(["-c", "import h5py, hdf5plugin, numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    let mut args = vec![
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
    let o = qb(&args);
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
    let o = qb(&[
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

    let i = qem::inspect(&master, None).unwrap();
    assert_eq!(i.bad_pixels, Some(2), "{i:?}");

    let out = dir.path().join("results");
    let o = qb(&[
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
    let o = qb(&["load", "--backend", "cuda"]);
    assert_ne!(code(&o), 0);
    assert!(stderr(&o).contains("--source"), "{}", stderr(&o));
}

/// A NumPy stand-in for CuPy: enough of its surface for `load --cupy`'s snippet.
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
    let o = qb(&[
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
    let o = Command::new(env!("CARGO_BIN_EXE_qem-bench"))
        .args([
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
