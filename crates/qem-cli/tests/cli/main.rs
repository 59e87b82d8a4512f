//! End-to-end tests of the `quantem-gpu` binary: exit codes, JSON outputs and the demo (the
//! benchmark commands are `qem-bench`'s, tested in `crates/qem-bench/tests/cli.rs`).
//!
//! One test binary (`cli`), cut by job: this file holds the shared helpers that run the binary;
//! `basics` (device, usage, missing files), `demo`, `fixtures` (generated
//! acquisitions, `.npy` readers, naive references), `products`, `dpc`, `ssb`, `serve` and `hostile`
//! (hostile-input regression tests).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod basics;
mod demo;
mod dpc;
mod fixtures;
mod hostile;
mod products;
mod serve;
mod ssb;

use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

fn qg(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_quantem-gpu"))
        .args(args)
        .output()
        .expect("run quantem-gpu")
}

/// `quantem-gpu CMD SRC --out OUT EXTRA…`, the shape of every job command (products, dpc, ssb).
fn qg_job(cmd: &str, src: &str, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        cmd,
        src,
        "--out",
        out.to_str().expect("a UTF-8 output path"),
    ];
    args.extend_from_slice(extra);
    qg(&args)
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exit code")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Assert that the command exited with `expected` and that its standard error says `says`.
fn assert_fails(o: &Output, expected: i32, says: &str) {
    let e = stderr(o);
    assert_eq!(code(o), expected, "{e}");
    assert!(e.contains(says), "expected {says:?} in: {e}");
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

fn png_size(path: &Path) -> (u32, u32) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[1..4], b"PNG", "{}", path.display());
    let be = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    (be(16), be(20))
}
