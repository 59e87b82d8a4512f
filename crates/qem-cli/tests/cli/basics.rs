//! Basic CLI contract: `device --json`, exit codes of a missing file, bad usage and an unusable
//! explicit backend.

use crate::{code, json_stdout, qg, stderr};

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
