//! Hostile inputs (regression tests of a hostile-input campaign): directories, FIFOs, loops,
//! non-HDF5 files, wrapping scan shapes, lying frame counts, shard links leaving the folder,
//! `convert` killed mid-write, and bit flips of a `.qem` file.

use crate::fixtures::write_acq;
use crate::{assert_fails, code, qg, stderr};
use std::path::Path;
use std::process::{Command, Output};

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
        assert_fails(&o, 3, "ermission denied");
    }
}

#[test]
fn a_scan_shape_whose_product_wraps_is_refused_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let frames = vec![1u16; 64 * 4];
    let master = write_acq(dir.path(), (8, 8), (2, 2), &frames);
    // 64 x (2^58 + 1) wraps to 64, the number of frames present.
    let wraps = ((1u64 << 58) + 1).to_string();
    let shape = ["--scan-shape", "64", &wraps];
    inspect_says_not_ready(&master, &shape, "overflows");
    let qem = dir.path().join("out.qem");
    convert_fails(&master, &qem, &shape, 2, "overflows");
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
    inspect_says_not_ready(p, &[], "first: 1");
    convert_fails(p, &dir.path().join("out.qem"), &[], 3, "frame 1 ");
}

/// `inspect SOURCE EXTRA...` succeeds and reports the source not ready, saying `why`.
fn inspect_says_not_ready(source: &str, extra: &[&str], why: &str) {
    let args: Vec<&str> = ["inspect", source].iter().chain(extra).copied().collect();
    let o = qg_limited(&args, &[], 60);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(out.contains("ready: NO") && out.contains(why), "{out}");
}

/// `convert SOURCE QEM --backend cpu EXTRA...` exits `want_code` saying `why` on stderr.
fn convert_fails(source: &str, qem: &Path, extra: &[&str], want_code: i32, why: &str) {
    let args: Vec<&str> = convert_args(source, qem)
        .iter()
        .chain(extra)
        .copied()
        .collect();
    let o = qg_limited(&args, &[], 60);
    assert_eq!(code(&o), want_code, "{}", stderr(&o));
    assert!(stderr(&o).contains(why), "{}", stderr(&o));
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
    let args = convert_args(&master, &qem);
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
    convert_ok(&master, &qem);
    (master, qem)
}

/// `convert MASTER QEM --backend cpu`.
fn convert_args<'a>(master: &'a str, qem: &'a Path) -> [&'a str; 5] {
    ["convert", master, qem.to_str().unwrap(), "--backend", "cpu"]
}

/// Run `convert MASTER QEM --backend cpu` and require it to succeed.
fn convert_ok(master: &str, qem: &Path) {
    let o = qg(&convert_args(master, qem));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
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
    convert_ok(&master, &qem);
    let full_ms = (t.elapsed().as_millis() as u64).max(20);
    let reference = std::fs::read(&qem).unwrap();
    assert!(qem::read_qem(&qem, &Default::default()).is_ok());
    let mut killed_mid_way = 0;
    for _ in 0..10 {
        let before = std::fs::read(&qem).unwrap();
        let delay = next() % (full_ms + full_ms / 4);
        let mut child = Command::new(bin)
            .args(convert_args(&master, &qem))
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
        // A kill can land after the rename and before the process exits, so a
        // killed save may have replaced the target; then it must be whole (same
        // length as a finished save, and it must read back below).
        let now = std::fs::read(&qem).unwrap();
        if now != before && !status.success() {
            assert_eq!(
                now.len(),
                reference.len(),
                "a killed save changed the target to a partial file (kill at {delay} ms)"
            );
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
    convert_ok(&master, &qem);
    assert_eq!(tmp_leftovers(dir.path()), Vec::<String>::new());
    // A stale temporary of a dead pid is removed; one of a live process is kept.
    let stale = dir.path().join("kill.qem.tmp-999999999-0");
    let live = dir
        .path()
        .join(format!("kill.qem.tmp-{}-7", std::process::id()));
    std::fs::write(&stale, b"partial").unwrap();
    std::fs::write(&live, b"in progress").unwrap();
    convert_ok(&master, &qem);
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
