//! Hostile inputs (regression tests of a hostile-input campaign): shape products that wrap,
//! files that declare far more frames than they hold, paths and links that are not regular
//! files or leave the acquisition's folder, symlink loops, faithful attribute reporting.
//!
//! Every test that could hang before its fix runs the call on a thread with a deadline.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use qem_core::{ErrorKind, Shape2};
use qem_io::writer::write_sparse_dataset;
use qem_io::{inspect, Inspection, OpenOptions, Source};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

/// 2^58 + 1: `64 * (2^58 + 1)` wraps to 64 in 64-bit arithmetic.
const WRAPS: usize = (1 << 58) + 1;

fn acquisition(dir: &Path, name: &str, scan: Shape2) -> PathBuf {
    common::small_acquisition(dir, name, scan, 4)
}

/// Run `f` on a thread; panic if it does not return within `secs` (a hang is a failure).
fn within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs))
        .unwrap_or_else(|_| panic!("{what} did not return within {secs} s (hang)"))
}

fn open_err(path: &Path, opts: OpenOptions) -> qem_core::Error {
    let p = path.to_path_buf();
    match within(20, "Source::open", move || Source::open(&p, &opts)) {
        Ok(s) => panic!("expected an error, opened {} frames", s.n_frames),
        Err(e) => e,
    }
}

/// The inspection says not ready, for a reason that says `says`.
fn assert_not_ready(ins: &Inspection, says: &str) {
    assert!(!ins.verdict.ready, "{ins:?}");
    let reason = ins.verdict.reason.as_deref().unwrap_or_default();
    assert!(
        reason.contains(says),
        "expected {says:?} in the reason: {ins:?}"
    );
}

fn inspect_within(path: &Path, scan: Option<Shape2>) -> qem_core::Result<Inspection> {
    let p = path.to_path_buf();
    within(20, "inspect", move || inspect(&p, scan))
}

fn mkfifo(path: &Path) {
    let st = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(st.success());
}

/// Peak resident memory of this process in bytes (`VmHWM`).
fn peak_rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |k| k * 1024)
}

// ---- 1. shape products ----

#[test]
fn scan_shape_argument_whose_product_wraps_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let master = acquisition(dir.path(), "wrap", Shape2::new(8, 8));
    let bad = Shape2::new(64, WRAPS);
    let e = open_err(
        &master,
        OpenOptions {
            scan_shape: Some(bad),
            ..OpenOptions::default()
        },
    );
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains("overflows"), "{e}");
    let ins = inspect_within(&master, Some(bad)).unwrap();
    assert_not_ready(&ins, "overflows");
}

#[test]
fn recorded_scan_shape_whose_product_wraps_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let master = acquisition(dir.path(), "wrapattr", Shape2::new(8, 8));
    {
        let f = hdf5::File::open_rw(&master).unwrap();
        let stem = f.group("/entry/instrument/stem").unwrap();
        stem.unlink("scan_shape").unwrap();
        stem.new_dataset::<u64>()
            .shape([2])
            .create("scan_shape")
            .unwrap()
            .write(&[64u64, WRAPS as u64])
            .unwrap();
    }
    let e = open_err(&master, OpenOptions::default());
    assert_eq!(e.kind, ErrorKind::Source, "{e}");
    assert!(e.to_string().contains("overflows"), "{e}");
    let ins = inspect_within(&master, None).unwrap();
    assert!(!ins.verdict.ready, "{ins:?}");
}

#[test]
fn four_d_extent_whose_frame_count_wraps_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge4d.h5");
    // 2^33 x 2^33 scan positions: 2^66 frames (HDF5 cannot index a chunk of it; none written).
    write_sparse_dataset(&path, &[1 << 33, 1 << 33, 2, 2], &[1, 1, 2, 2], &[], 1).unwrap();
    let e = open_err(&path, OpenOptions::default());
    assert_eq!(e.kind, ErrorKind::Source, "{e}");
    assert!(e.to_string().contains("overflows"), "{e}");
}

// ---- 2. bookkeeping sized by declared frames ----

#[test]
fn declared_frames_are_never_allocated_one_entry_each() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sparse.h5");
    // ~10^9 declared frames of 64 x 64, one chunk written.
    write_sparse_dataset(
        &path,
        &[31623, 31623, 64, 64],
        &[1, 1, 64, 64],
        &[vec![0, 0, 0, 0]],
        7,
    )
    .unwrap();
    assert!(std::fs::metadata(&path).unwrap().len() < 64 * 1024);
    let p = path.clone();
    let src = within(60, "Source::open", move || {
        Source::open(&p, &OpenOptions::default())
    })
    .unwrap();
    assert_eq!(src.n_frames, 31623 * 31623);
    assert_eq!(src.chunks.len(), 1);
    let ins = inspect_within(&path, None).unwrap();
    assert_not_ready(&ins, "first: 1");
    assert_eq!(ins.unwritten.n_missing_frames, 31623 * 31623 - 1);
    assert_eq!(ins.unwritten.missing_frames.first(), Some(&1));
    assert!(
        peak_rss() < 1 << 30,
        "peak RSS {} bytes: bookkeeping sized by declared frames",
        peak_rss()
    );
}

// ---- 3. only regular files, links confined to the acquisition's folder ----

#[test]
fn fifo_directory_and_device_paths_are_refused_without_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe_master.h5");
    mkfifo(&fifo);
    let sub = dir.path().join("folder.h5");
    std::fs::create_dir(&sub).unwrap();
    for (path, what) in [
        (fifo.as_path(), "FIFO"),
        (sub.as_path(), "directory"),
        (Path::new("/dev/zero"), "device"),
    ] {
        let e = open_err(path, OpenOptions::default());
        assert_eq!(e.kind, ErrorKind::Source, "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("not a regular file") && msg.contains(what),
            "{msg}"
        );
        let e = inspect_within(path, None).err().unwrap();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert_eq!(e.kind.exit_code(), 3);
    }
}

/// Replace shard link `data_000001` of `master` by an external link to `target`.
fn relink(master: &Path, target: &str) {
    let f = hdf5::File::open_rw(master).unwrap();
    let g = f.group("/entry/data").unwrap();
    g.unlink("data_000001").unwrap();
    g.link_external(target, "/entry/data/data", "data_000001")
        .unwrap();
}

#[test]
fn external_links_to_fifos_or_outside_the_folder_are_refused() {
    let top = tempfile::tempdir().unwrap();
    let dir = top.path().join("acq");
    std::fs::create_dir(&dir).unwrap();
    // A valid shard outside the folder, a FIFO inside it.
    let outside = acquisition(top.path(), "outside", Shape2::new(2, 2));
    let outside_shard = top.path().join("outside_data_000001.h5");
    assert!(outside_shard.is_file(), "{outside:?}");
    mkfifo(&dir.join("fifo_data.h5"));
    for (i, target) in [
        "/etc/passwd".to_string(),
        "/dev/zero".to_string(),
        "../outside_data_000001.h5".to_string(),
        outside_shard.display().to_string(),
        "fifo_data.h5".to_string(),
    ]
    .iter()
    .enumerate()
    {
        let master = acquisition(&dir, &format!("l{i}"), Shape2::new(2, 2));
        relink(&master, target);
        let e = open_err(&master, OpenOptions::default());
        assert_eq!(e.kind, ErrorKind::Source, "{target}: {e}");
        let msg = e.to_string();
        assert!(msg.contains("data_000001"), "names the link: {msg}");
        assert!(
            msg.contains(target.trim_start_matches("../")),
            "names the target: {msg}"
        );
        assert!(
            msg.contains("outside the acquisition's folder") || msg.contains("not a regular file"),
            "names the rule: {msg}"
        );
        let ins = inspect_within(&master, None).unwrap();
        assert!(!ins.verdict.ready, "{target}: {ins:?}");
    }
}

#[test]
fn dataset_path_through_an_external_link_to_a_fifo_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    mkfifo(&dir.path().join("pipe.h5"));
    let path = dir.path().join("plain.h5");
    {
        let f = hdf5::File::create(&path).unwrap();
        f.link_external("pipe.h5", "/data", "frames").unwrap();
    }
    let e = open_err(
        &path,
        OpenOptions {
            dataset_path: Some("/frames".into()),
            ..OpenOptions::default()
        },
    );
    assert_eq!(e.kind, ErrorKind::Source, "{e}");
    assert!(e.to_string().contains("not a regular file"), "{e}");
}

// ---- 4. symlink loops, negative image_nr_low ----

#[test]
fn a_symlink_loop_is_reported_as_one() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (
        dir.path().join("a_master.h5"),
        dir.path().join("b_master.h5"),
    );
    std::os::unix::fs::symlink(&b, &a).unwrap();
    std::os::unix::fs::symlink(&a, &b).unwrap();
    let e = inspect_within(&a, None).err().unwrap();
    assert!(e.to_string().contains("symlink loop"), "{e}");
    assert_eq!(e.kind.exit_code(), 3);
    let e = open_err(&a, OpenOptions::default());
    assert!(e.to_string().contains("symlink loop"), "{e}");
}

#[test]
fn a_negative_image_nr_low_is_reported_faithfully() {
    let dir = tempfile::tempdir().unwrap();
    let master = acquisition(dir.path(), "neg", Shape2::new(2, 4));
    {
        let f = hdf5::File::open_rw(dir.path().join("neg_data_000001.h5")).unwrap();
        let ds = f.dataset("/entry/data/data").unwrap();
        ds.delete_attr("image_nr_low").unwrap();
        ds.new_attr::<i64>()
            .shape(())
            .create("image_nr_low")
            .unwrap()
            .write_scalar(&-5i64)
            .unwrap();
    }
    let e = open_err(&master, OpenOptions::default());
    assert_eq!(e.kind, ErrorKind::Source, "{e}");
    assert!(e.to_string().contains("-5"), "{e}");
    let ins = inspect_within(&master, None).unwrap();
    assert!(!ins.verdict.ready);
    let v = serde_json::to_value(&ins.shards[0]).unwrap();
    assert_eq!(v["image_nr_low"], serde_json::json!(-5), "{v}");
}
