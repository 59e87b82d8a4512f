//! `qem-bench load`: time `qem::load` on the CPU (and optionally h5py) on one file.
//! With `--source` (or a backend other than cpu) the work is [`super::load_source`]'s.
//!
//! The acquisition comes from `qem_sim::DiskPattern` (Poisson counts of a fixed BF disk of
//! radius `min(k)/4` with 5 % of the dose in a dark-field halo; no specimen) because a full
//! simulation of a 128×128 × 192×192 scan is slow; loading and decoding only need realistic
//! counting statistics. It is written as Dectris files (bitshuffle-LZ4, one frame per chunk,
//! 10 000 frames per shard) into a temporary folder that is removed afterwards. The page cache
//! is not dropped between runs (warm reads, stated in the record).

use super::args::BenchLoadArgs;
use crate::machine::RecordStamp;
use anyhow::{anyhow, Context};
use qem::{BackendRequest, DType, DenseArray, LoadParams, SourceArg};
use qem_cli::shared::{print_out, shape2, write_json};
use qem_io::writer::{self, WriteParams};
use serde_json::json;
use std::process::Command;
use std::time::Instant;

const FRAMES_PER_FILE: u64 = 10_000;
const HALO_FRACTION: f64 = 0.05;

/// Order-sensitive checksum shared with the h5py snippet: the u64 total, and
/// `Σ_n (n+1)·Σ_k (k+1)·v[n,k]` modulo 2⁶⁴.
pub(super) fn checksum_of<T: Copy + Into<u64>>(v: &[T], frame_len: usize) -> (u64, u64) {
    let (mut total, mut weighted) = (0u64, 0u64);
    for (n, frame) in v.chunks_exact(frame_len).enumerate() {
        let mut s = 0u64;
        for (k, &x) in frame.iter().enumerate() {
            let x: u64 = x.into();
            total = total.wrapping_add(x);
            s = s.wrapping_add(x.wrapping_mul(k as u64 + 1));
        }
        weighted = weighted.wrapping_add(s.wrapping_mul(n as u64 + 1));
    }
    (total, weighted)
}

fn checksum(data: &DenseArray, frame_len: usize) -> (u64, u64) {
    match data {
        DenseArray::U8(v) => checksum_of(v, frame_len),
        DenseArray::U16(v) => checksum_of(v, frame_len),
        DenseArray::U32(v) => checksum_of(v, frame_len),
    }
}

/// Reads every `/entry/data/data_NNNNNN` link of a master into one preallocated array with
/// `read_direct`, `repeats` times, and prints JSON with the times and the same checksum.
const H5PY_SNIPPET: &str = r#"
import json, sys, time
import numpy as np, h5py, hdf5plugin
master, n, kr, kc, warmup, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
def read():
    out = np.empty((n, kr, kc), dtype=np.uint16)
    lo = 0
    with h5py.File(master, "r") as f:
        g = f["entry/data"]
        for name in sorted(k for k in g.keys() if k.startswith("data_")):
            ds = g[name]
            m = ds.shape[0]
            ds.read_direct(out, dest_sel=np.s_[lo:lo + m])
            lo += m
    return out, lo
times = []
for i in range(warmup + repeats):
    t = time.perf_counter()
    arr, frames = read()
    if i >= warmup:
        times.append(time.perf_counter() - t)
    if i + 1 < warmup + repeats:
        del arr
flat = arr.reshape(n, kr * kc)
w = np.arange(1, kr * kc + 1, dtype=np.uint64)
s = np.empty(n, dtype=np.uint64)
for b in range(0, n, 256):
    s[b:b + 256] = flat[b:b + 256].astype(np.uint64) @ w
weighted = int((s * np.arange(1, n + 1, dtype=np.uint64)).sum(dtype=np.uint64))
total = int(flat.sum(dtype=np.uint64))
print(json.dumps({"seconds": times, "frames": frames, "total": total, "weighted": weighted,
                  "versions": {"h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version,
                               "hdf5plugin": hdf5plugin.version, "numpy": np.__version__,
                               "python": sys.version.split()[0]}}))
"#;

pub(super) fn p50(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
    }
}

pub(super) fn min_max(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

/// The header of the readers table, its first column `width` wide.
pub(super) fn reader_header(width: usize) -> String {
    format!(
        "{:<width$} {:>8} {:>8} {:>8} {:>10}\n",
        "reader", "p50 s", "min s", "max s", "GB/s raw"
    )
}

/// One row of the readers table: `reader`, its `(p50, min, max)` seconds and the raw GB/s at
/// its p50.
pub(super) fn reader_row(
    width: usize,
    reader: &str,
    (p50_s, min_s, max_s): (f64, f64, f64),
    raw_gb_s: f64,
) -> String {
    format!("{reader:<width$} {p50_s:>8.3} {min_s:>8.3} {max_s:>8.3} {raw_gb_s:>10.2}\n")
}

/// Run the h5py snippet; its JSON output, or why it could not run.
fn run_h5py(
    master: &std::path::Path,
    frames: usize,
    det: qem::Shape2,
    warmup: u32,
    repeats: u32,
) -> anyhow::Result<serde_json::Value> {
    let out = Command::new("python3")
        .arg("-c")
        .arg(H5PY_SNIPPET)
        .arg(master)
        .args([
            frames.to_string(),
            det.rows.to_string(),
            det.cols.to_string(),
            warmup.to_string(),
            repeats.to_string(),
        ])
        .output()
        .context("cannot run python3")?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("").to_string();
        return Err(anyhow!("python3 h5py read failed: {last}"));
    }
    serde_json::from_slice(&out.stdout).context("python3 h5py read printed no JSON")
}

pub fn run(a: &BenchLoadArgs, command_line: &str) -> anyhow::Result<()> {
    let source_only = a.backend != BackendRequest::Cpu
        || a.cpu_check
        || a.cupy
        || a.scan_shape.is_some()
        || a.scan_region.is_some()
        || a.det_bin != 1
        || a.dtype != qem::DtypeRequest::Native;
    if a.source.is_some() || source_only {
        return super::load_source::run(a, command_line);
    }
    let scan = shape2(&a.scan).ok_or_else(|| anyhow!("--scan takes two numbers"))?;
    let det = shape2(&a.detector).ok_or_else(|| anyhow!("--detector takes two numbers"))?;
    let frames = scan.len();
    let frame_len = det.len();
    let radius = det.rows.min(det.cols) as f64 / 4.0;
    let pattern = qem_sim::DiskPattern::new(det, radius, HALO_FRACTION, a.dose, 0)?;

    // Generate and write.
    let tmp = tempfile::Builder::new()
        .prefix("quantem-bench-")
        .tempdir()
        .context("cannot create a temporary folder")?;
    let write_params = WriteParams {
        prefix: tmp.path().join("bench"),
        scan_shape: scan,
        detector_shape: det,
        dtype: DType::U16,
        frames_per_file: FRAMES_PER_FILE,
        ..Default::default()
    };
    eprintln!(
        "bench load: writing {scan} x {det} u16 ({:.2} GB raw) to {} ...",
        (frames * frame_len * 2) as f64 / 1e9,
        tmp.path().display()
    );
    let t = Instant::now();
    let written = writer::write_acquisition(&write_params, |n, buf| {
        let mut frame = vec![0u16; frame_len];
        pattern.frame(n, &mut frame);
        for (dst, v) in buf.chunks_exact_mut(2).zip(frame) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
    })
    .context("writing the benchmark acquisition")?;
    let t_write = t.elapsed().as_secs_f64();
    let file_bytes = written.file_bytes();

    // Our loads.
    let load_params = LoadParams {
        backend: BackendRequest::Cpu,
        ..Default::default()
    };
    let mut ours = Vec::new();
    let mut ours_checksum = (0, 0);
    let mut stage_timings = Vec::new();
    let mut device = String::new();
    for i in 0..a.warmup + a.repeats {
        let timed = i >= a.warmup;
        eprintln!(
            "bench load: quantem-gpu load {}/{}{} ...",
            i + 1,
            a.warmup + a.repeats,
            if timed { "" } else { " (warm-up)" }
        );
        let t = Instant::now();
        let ds = qem::load(SourceArg::Path(written.master.clone()), &load_params)
            .context("loading the benchmark acquisition")?;
        if timed {
            ours.push(t.elapsed().as_secs_f64());
        }
        if i == 0 {
            ours_checksum = checksum(ds.dense()?, frame_len);
            stage_timings = ds.provenance().timings.clone();
            device = ds.device().to_string();
        }
    }

    // h5py.
    let h5py = if a.h5py {
        eprintln!("bench load: h5py + hdf5plugin read x{} ...", a.repeats);
        match run_h5py(&written.master, frames, det, a.warmup, a.repeats) {
            Ok(v) => Some(Ok(v)),
            Err(e) => {
                eprintln!("warning: {e:#}");
                Some(Err(format!("{e:#}")))
            }
        }
    } else {
        None
    };

    let raw = written.raw_bytes as f64;
    let (o_min, o_max) = min_max(&ours);
    let o_p50 = p50(&ours);
    let mut h5py_json = serde_json::Value::Null;
    let mut h5py_row = None;
    let mut ratio = None;
    let mut equal = None;
    match &h5py {
        Some(Ok(v)) => {
            let secs: Vec<f64> = v["seconds"]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
                .unwrap_or_default();
            let (h_min, h_max) = min_max(&secs);
            let h_p50 = p50(&secs);
            let same = v["total"].as_u64() == Some(ours_checksum.0)
                && v["weighted"].as_u64() == Some(ours_checksum.1);
            ratio = Some(h_p50 / o_p50);
            equal = Some(same);
            h5py_row = Some((h_p50, h_min, h_max));
            h5py_json = json!({
                "seconds": secs,
                "p50_s": h_p50,
                "min_s": h_min,
                "max_s": h_max,
                "throughput_raw_gb_s": raw / h_p50 / 1e9,
                "checksum": {"total": v["total"], "weighted": v["weighted"]},
                "checksum_equal_to_ours": same,
                "versions": v["versions"],
                "method": "h5py.File + read_direct of every /entry/data/data_NNNNNN link into one preallocated (N, k_r, k_c) uint16 array",
            });
        }
        Some(Err(e)) => h5py_json = json!({ "error": e }),
        None => {}
    }

    let stamp = RecordStamp::now();
    let record = stamp.record(command_line, json!({
        "benchmark": "cpu_load",
        "generator": format!("qem_sim::DiskPattern: Poisson counts of a fixed disk of radius {radius} px with {}% of the dose in a (r/d)^4 halo; no specimen; seed 0", HALO_FRACTION * 100.0),
        "acquisition": {
            "scan_shape": [scan.rows, scan.cols],
            "detector_shape": [det.rows, det.cols],
            "dtype": "u16",
            "frames": frames,
            "dose_e_per_frame": a.dose,
            "raw_bytes": written.raw_bytes,
            "compressed_chunk_bytes": written.compressed_bytes,
            "file_bytes": file_bytes,
            "compression_ratio": raw / written.compressed_bytes.max(1) as f64,
            "files": 1 + written.data_files.len(),
            "frames_per_file": FRAMES_PER_FILE,
            "frames_per_chunk": 1,
            "compression": "bitshuffle + LZ4 (HDF5 filter 32008), Dectris master + external shards",
        },
        "cache": "warm: the files were just written and the page cache was not dropped",
        "write_s": t_write,
        "ours": {
            "backend": "cpu",
            "device": device,
            "repeats": a.repeats,
            "warmup_runs_excluded": a.warmup,
            "seconds": ours,
            "p50_s": o_p50,
            "min_s": o_min,
            "max_s": o_max,
            "throughput_raw_gb_s": raw / o_p50 / 1e9,
            "stage_timings_first_load": stage_timings,
            "checksum": {"total": ours_checksum.0, "weighted": ours_checksum.1},
        },
        "h5py": h5py_json,
        "ratio_h5py_over_ours_p50": ratio,
        "checksums_equal": equal,
    }));
    std::fs::create_dir_all(&a.out)
        .map_err(|e| qem::Error::io("create output folder", &a.out, &e))?;
    let path = a.out.join(stamp.file_name("cpu_load"));
    let text = write_json(&path, &record, "write benchmark record")?;

    if a.json {
        return print_out(&text);
    }
    let mut s = format!(
        "bench load: {scan} scan x {det} detector, u16, {frames} frames; {:.2} GB raw, {:.2} GB on disk ({:.1}x), written in {t_write:.1} s\n",
        raw / 1e9,
        file_bytes as f64 / 1e9,
        raw / written.compressed_bytes.max(1) as f64
    );
    s.push_str(&reader_header(22));
    s.push_str(&reader_row(
        22,
        "quantem-gpu (cpu)",
        (o_p50, o_min, o_max),
        raw / o_p50 / 1e9,
    ));
    if let Some(row) = h5py_row {
        s.push_str(&reader_row(22, "h5py + hdf5plugin", row, raw / row.0 / 1e9));
    }
    if let (Some(r), Some(eq)) = (ratio, equal) {
        s.push_str(&format!(
            "h5py / quantem-gpu (p50): {r:.2}x; same data (checksum): {}\n",
            if eq { "yes" } else { "NO" }
        ));
    }
    s.push_str(&format!("record: {}\n", path.display()));
    print_out(&s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_is_order_sensitive() {
        let a = checksum_of(&[1u16, 2, 3, 4], 2);
        let b = checksum_of(&[3u16, 4, 1, 2], 2);
        assert_eq!(a.0, b.0);
        assert_ne!(a.1, b.1);
        // (1·1 + 2·2)·1 + (3·1 + 4·2)·2 = 5 + 22
        assert_eq!(a, (10, 27));
    }

    #[test]
    fn median() {
        assert_eq!(p50(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(p50(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
