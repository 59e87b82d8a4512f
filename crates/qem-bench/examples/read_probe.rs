//! Probe (issue 23 item 3, "load past the page-cache wall"): the routes by which the host can
//! hand the card an acquisition's compressed bytes, each against the H2D floor. It reads whole
//! files (the HDF5 shards: chunks plus a little metadata), warm page cache (one untimed pass of
//! every route first), and reports the median of `--repeats` passes:
//!
//! * `pread → pinned, T threads`: 8 MiB `pread`s by T threads, each into its own 8 MiB slot
//!   of page-locked memory (the loader's route: its readers `pread` chunks into pinned slots);
//! * `pinned → card`: a 256 MiB pinned buffer copied to the card until as many bytes moved,
//!   one wait (the H2D floor);
//! * `mmap + register → card`: each file mapped read-only and registered with
//!   `cuMemHostRegister(READ_ONLY)`, then copied to the card straight from the page cache (no
//!   host copy); registration, copy and unregistration timed apart;
//! * `O_DIRECT → pinned, T threads`: as the first, bypassing the page cache (an error is
//!   reported where the file system refuses it).
//!
//! Run (on the GPU host): `read_probe OUT.json FILE... [--threads 8,16,32] [--repeats 3]`.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use qem_cuda::mem::{DevBuf, HostRegistration, PinnedBuf};
use rayon::prelude::*;
use serde_json::{json, Value};

/// Bytes per read and per reader slot.
const PIECE: usize = 8 << 20;
/// Bytes of the device buffer every copy lands in (overwritten), and of the H2D-floor buffer.
const DEV_BYTES: usize = 256 << 20;
/// `O_DIRECT` needs offsets, lengths and addresses aligned to the logical block.
const DIRECT_ALIGN: usize = 4096;

/// One read: `len` bytes of file `file` from `offset`.
struct Piece {
    file: usize,
    offset: u64,
    len: usize,
}

fn pieces(sizes: &[u64]) -> Vec<Piece> {
    let mut v = Vec::new();
    for (file, &size) in sizes.iter().enumerate() {
        let mut offset = 0u64;
        while offset < size {
            let len = (size - offset).min(PIECE as u64) as usize;
            v.push(Piece { file, offset, len });
            offset += len as u64;
        }
    }
    v
}

/// Read every piece once with `threads` threads, each into its own slot of `ring`; seconds.
/// `direct`: lengths rounded up to the block (the file's end reads short).
fn read_pass(
    files: &[File],
    ps: &[Piece],
    ring: &mut PinnedBuf,
    threads: usize,
    direct: bool,
) -> Result<f64> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    let next = AtomicUsize::new(0);
    let t = Instant::now();
    let slots: Vec<&mut [u8]> = ring
        .as_mut_slice()
        .chunks_mut(PIECE)
        .take(threads)
        .collect();
    if slots.len() < threads {
        bail!("the ring holds {} slots for {threads} threads", slots.len());
    }
    pool.install(|| {
        slots.into_par_iter().try_for_each(|slot| -> Result<()> {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(p) = ps.get(i) else { return Ok(()) };
                let len = if direct {
                    p.len.next_multiple_of(DIRECT_ALIGN)
                } else {
                    p.len
                };
                let mut done = 0usize;
                while done < p.len {
                    let n = files[p.file].read_at(&mut slot[done..len], p.offset + done as u64)?;
                    if n == 0 {
                        bail!("file {} ended at {}", p.file, p.offset + done as u64);
                    }
                    done += n;
                }
            }
        })
    })?;
    Ok(t.elapsed().as_secs_f64())
}

/// Copy `total` bytes from the pinned buffer to the card in `DEV_BYTES` pieces, one wait.
fn h2d_pass(src: &PinnedBuf, dst: &DevBuf, total: u64) -> Result<f64> {
    let e = qem_cuda::engine()?;
    let stream = e.gpu.stream();
    let t = Instant::now();
    let mut moved = 0u64;
    while moved < total {
        let n = (total - moved).min(DEV_BYTES as u64) as usize;
        src.copy_range_to_device_async(0, dst, 0, n, stream)?;
        moved += n as u64;
    }
    stream
        .synchronize()
        .map_err(|er| anyhow!("synchronize: {er:?}"))?;
    Ok(t.elapsed().as_secs_f64())
}

/// Map every file read-only, register it, copy it to the card, unregister and unmap it:
/// seconds of (register, copy, unregister + unmap).
fn mapped_pass(files: &[File], sizes: &[u64], dst: &DevBuf) -> Result<[f64; 3]> {
    let e = qem_cuda::engine()?;
    let stream = e.gpu.stream();
    let page = 4096usize;
    let mut secs = [0.0f64; 3];
    for (f, &size) in files.iter().zip(sizes) {
        let len = (size as usize).next_multiple_of(page);
        // SAFETY: a fresh shared read-only mapping of an open file; unmapped below, after the
        // registration that refers to it is dropped.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(f),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            bail!("mmap: {}", std::io::Error::last_os_error());
        }
        let mut run = || -> Result<()> {
            let t = Instant::now();
            // SAFETY: the mapping stays until after `reg` is dropped; mmap returns page-aligned
            // addresses.
            let reg = unsafe { HostRegistration::new(e.gpu.ctx(), base as *const u8, len, true) }?;
            secs[0] += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let mut at = 0usize;
            while at < size as usize {
                let n = (size as usize - at).min(DEV_BYTES);
                reg.copy_to_device_async(at, dst, 0, n, stream)?;
                at += n;
            }
            stream
                .synchronize()
                .map_err(|er| anyhow!("synchronize: {er:?}"))?;
            secs[1] += t.elapsed().as_secs_f64();
            let t = Instant::now();
            drop(reg);
            secs[2] += t.elapsed().as_secs_f64();
            Ok(())
        };
        let r = run();
        let t = Instant::now();
        // SAFETY: the mapping made above, no longer registered, unmapped once.
        unsafe { libc::munmap(base, len) };
        secs[2] += t.elapsed().as_secs_f64();
        r?;
    }
    Ok(secs)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The p50 of `repeats` runs of `f` after one untimed run, as a record row.
fn route(name: &str, bytes: u64, repeats: usize, mut f: impl FnMut() -> Result<f64>) -> Value {
    let mut runs = Vec::new();
    let first = f();
    if let Err(er) = first {
        println!("{name:<40} error: {er:#}");
        return json!({"route": name, "error": format!("{er:#}")});
    }
    for _ in 0..repeats {
        match f() {
            Ok(s) => runs.push(s),
            Err(er) => return json!({"route": name, "error": format!("{er:#}")}),
        }
    }
    let p50 = median(runs.clone());
    let gbs = bytes as f64 / p50 / 1e9;
    println!("{name:<40} p50 {:>8.1} ms  {gbs:>6.1} GB/s", p50 * 1e3);
    json!({"route": name, "p50_s": p50, "runs_s": runs, "gbs": gbs})
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let out = args.next().ok_or_else(|| {
        anyhow!("usage: read_probe OUT.json FILE... [--threads 8,16,32] [--repeats 3]")
    })?;
    let (mut paths, mut threads, mut repeats) = (Vec::new(), vec![8usize, 16, 32], 3usize);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--threads" => {
                let v = args
                    .next()
                    .ok_or_else(|| anyhow!("--threads needs a list"))?;
                threads = v.split(',').map(str::parse).collect::<Result<_, _>>()?;
            }
            "--repeats" => {
                repeats = args
                    .next()
                    .ok_or_else(|| anyhow!("--repeats needs a count"))?
                    .parse()?;
            }
            _ => paths.push(a),
        }
    }
    if paths.is_empty() || threads.is_empty() || repeats == 0 {
        bail!("no files, threads or repeats");
    }
    let files: Vec<File> = paths.iter().map(File::open).collect::<Result<_, _>>()?;
    let sizes: Vec<u64> = files
        .iter()
        .map(|f| f.metadata().map(|m| m.len()))
        .collect::<Result<_, _>>()?;
    let total: u64 = sizes.iter().sum();
    let ps = pieces(&sizes);
    let e = qem_cuda::engine()?;
    let ctx = e.gpu.ctx();
    let max_t = threads.iter().copied().max().unwrap_or(1);
    let mut ring = PinnedBuf::alloc(ctx, (max_t * PIECE).max(DEV_BYTES), "probe ring")?;
    let dev = DevBuf::alloc(ctx, DEV_BYTES, None, "probe target")?;
    println!(
        "{} files, {:.2} GB, host cores {}",
        files.len(),
        total as f64 / 1e9,
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    let mut rows = Vec::new();
    for &t in &threads {
        rows.push(route(
            &format!("pread -> pinned, {t} threads"),
            total,
            repeats,
            || read_pass(&files, &ps, &mut ring, t, false),
        ));
    }
    rows.push(route("pinned -> card (H2D floor)", total, repeats, || {
        h2d_pass(&ring, &dev, total)
    }));
    let mut parts = Vec::new();
    rows.push(route(
        "mmap + register (read-only) -> card",
        total,
        repeats,
        || {
            let s = mapped_pass(&files, &sizes, &dev)?;
            parts.push(s);
            Ok(s.iter().sum())
        },
    ));
    let direct: std::io::Result<Vec<File>> = paths
        .iter()
        .map(|p| {
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(p)
        })
        .collect();
    match direct {
        Ok(dfiles) => {
            for &t in &threads {
                rows.push(route(
                    &format!("O_DIRECT -> pinned, {t} threads"),
                    total,
                    repeats,
                    || read_pass(&dfiles, &ps, &mut ring, t, true),
                ));
            }
        }
        Err(er) => {
            rows.push(json!({"route": "O_DIRECT -> pinned", "error": format!("open: {er}")}))
        }
    }
    let split: Vec<Value> = parts
        .iter()
        .map(|s| json!({"register_s": s[0], "copy_s": s[1], "unregister_unmap_s": s[2]}))
        .collect();
    if let Some(s) = parts.last() {
        println!(
            "mmap route, last pass: register {:.1} ms ({:.1} GB/s), copy {:.1} ms ({:.1} GB/s), unregister + unmap {:.1} ms",
            s[0] * 1e3,
            total as f64 / s[0] / 1e9,
            s[1] * 1e3,
            total as f64 / s[1] / 1e9,
            s[2] * 1e3
        );
    }
    let rec = json!({
        "tool": "read_probe (crates/qem-bench/examples/read_probe.rs)",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "device": e.gpu.info().summary(),
        "git_revision": qem_bench::machine::git_revision(),
        "files": paths, "bytes": total, "piece_bytes": PIECE, "repeats": repeats,
        "host_cores": std::thread::available_parallelism().map_or(0, usize::from),
        "cache_state": "warm page cache: one untimed pass of each route first",
        "routes": rows, "mmap_route_parts": split,
    });
    std::fs::write(&out, serde_json::to_string_pretty(&rec)?)?;
    Ok(())
}
