//! `qem-bench load --source MASTER [--backend cuda] [--cpu-check] [--cupy]`: the GPU
//! evidence bundle of docs/concepts.md §8 ("GPU evidence") for loading an existing acquisition.
//!
//! What it does, in this order (so that memory is freed before the next part needs it):
//! 1. `qem::inspect` the source (shape, dtype, stored chunk bytes); the machine, the backends and
//!    `nvidia-smi`'s GPU model, driver and CUDA version.
//! 2. `warmup` untimed + `repeats` timed `qem::load` calls on the requested backend; each
//!    dataset is closed and dropped before the next load (its device memory is freed); the wall
//!    time of each call is synchronized (the façade returns complete data). The record keeps
//!    every run's stage times (CUDA-event stage times on the GPU) and memory report, and picks
//!    the p50 run's for the table, with decode and H2D rates from its stage times.
//! 3. The last dataset is copied to the host and checksummed (u64 total and the
//!    position-weighted sum of `bench load`).
//! 4. `--cpu-check`: the CPU engine loads the same source with the same plan; the record holds
//!    both checksums and an exact comparison of ~1,000 sampled frames (`frame(r, c)` of both).
//! 5. `--cupy`: a `python3` subprocess does what users do today — h5py + hdf5plugin into one
//!    NumPy array, `cupy.asarray`, zero the masked pixels on the GPU — 1 warm-up + `repeats`
//!    times, and checksums the CuPy array on the GPU; comparable with ours for full,
//!    unbinned, native-dtype loads.
//!
//! Any failed comparison exits non-zero after the record and table are written.

use super::args::BenchLoadArgs;
use super::load::{min_max, p50, reader_header, reader_row};
use crate::machine::RecordStamp;
use anyhow::{anyhow, Context};
use qem::{BackendRequest, DenseArray, LoadParams, Region, SourceArg, StageTiming};
use qem_cli::shared::{print_out, shape2, write_json};
use rayon::prelude::*;
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::time::Instant;

/// Frames compared one by one by `--cpu-check` (all of them when there are fewer).
const SAMPLED_FRAMES: usize = 1000;

/// `bench load`'s checksum, in parallel: the u64 total and
/// `Σ_n (n+1)·Σ_k (k+1)·v[n,k]` modulo 2⁶⁴ (wrapping sums are order-independent).
fn checksum_par<T: Copy + Into<u64> + Sync>(v: &[T], frame_len: usize) -> (u64, u64) {
    v.par_chunks(frame_len.max(1))
        .enumerate()
        .map(|(n, frame)| {
            let (mut total, mut s) = (0u64, 0u64);
            for (k, &x) in frame.iter().enumerate() {
                let x: u64 = x.into();
                total = total.wrapping_add(x);
                s = s.wrapping_add(x.wrapping_mul(k as u64 + 1));
            }
            (total, s.wrapping_mul(n as u64 + 1))
        })
        .reduce(
            || (0, 0),
            |a, b| (a.0.wrapping_add(b.0), a.1.wrapping_add(b.1)),
        )
}

fn checksum(data: &DenseArray, frame_len: usize) -> (u64, u64) {
    match data {
        DenseArray::U8(v) => checksum_par(v, frame_len),
        DenseArray::U16(v) => checksum_par(v, frame_len),
        DenseArray::U32(v) => checksum_par(v, frame_len),
    }
}

/// ~`count` scan positions spread over the scan: the four corners, then a deterministic
/// pseudo-random sample (SplitMix64); every position when the scan has fewer.
fn sample_positions(rows: usize, cols: usize, count: usize) -> Vec<(usize, usize)> {
    let n = rows * cols;
    if n <= count {
        return (0..n).map(|k| (k / cols, k % cols)).collect();
    }
    let mut out = vec![(0, 0), (0, cols - 1), (rows - 1, 0), (rows - 1, cols - 1)];
    let mut state = 0x5EED_u64;
    while out.len() < count {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let k = (z % n as u64) as usize;
        out.push((k / cols, k % cols));
    }
    out
}

/// `nvidia-smi`'s view of the GPUs (model, driver, memory, CUDA version), or why not.
fn nvidia_smi() -> Value {
    let query = Command::new("nvidia-smi")
        .args([
            "--query-gpu=index,name,driver_version,memory.total,memory.used,pci.bus_id",
            "--format=csv,noheader",
        ])
        .output();
    let gpus: Vec<String> = match &query {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(|l| l.trim().to_string())
            .filter(|l| !l.is_empty())
            .collect(),
        Ok(o) => {
            return json!({"error": format!("nvidia-smi failed: {}", String::from_utf8_lossy(&o.stderr).trim())})
        }
        Err(e) => return json!({"error": format!("cannot run nvidia-smi: {e}")}),
    };
    // The CUDA version the driver supports is only in the banner.
    let cuda = Command::new("nvidia-smi")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .and_then(|s| {
            let i = s.find("CUDA Version:")?;
            s[i + 13..].split_whitespace().next().map(str::to_string)
        });
    json!({
        "gpus": gpus,
        "columns": "index, name, driver_version, memory.total, memory.used, pci.bus_id",
        "driver_cuda_version": cuda,
    })
}

/// The stage whose name contains `needle` (case-insensitive), preferring a CUDA-event time
/// (`"... (events, ...)"`) over a host-measured one.
fn stage<'a>(timings: &'a [StageTiming], needle: &str) -> Option<&'a StageTiming> {
    let matching = || {
        timings
            .iter()
            .filter(move |t| t.stage.to_ascii_lowercase().contains(needle))
    };
    matching()
        .find(|t| t.stage.to_ascii_lowercase().contains("event"))
        .or_else(|| matching().next())
}

/// Reads every `/entry/data/data_NNNNNN` link of a master with h5py + hdf5plugin into one
/// NumPy array (`read_direct`), `cupy.asarray`s it, zeroes the masked pixels on the GPU
/// (`pixel_mask & 0xFFFF != 0`, as our load does by default), synchronizes; 1 + N times.
/// Then the checksum of `bench load` on the GPU, and JSON on stdout.
const CUPY_SNIPPET: &str = r#"
import json, sys, time
import numpy as np, h5py, hdf5plugin, cupy as cp
master, warmup, repeats, apply_mask = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
def links(f):
    g = f["entry/data"]
    return [g[k] for k in sorted(k for k in g.keys() if k.startswith("data_"))]
with h5py.File(master, "r") as f:
    ds = links(f)
    if not ds:
        raise SystemExit("no /entry/data/data_NNNNNN links in " + master)
    n = sum(d.shape[0] for d in ds); kr, kc = ds[0].shape[1:]; dtype = ds[0].dtype
    mask = None
    p = "entry/instrument/detector/detectorSpecific/pixel_mask"
    if apply_mask and p in f:
        bad = np.argwhere((f[p][()].astype(np.uint64) & 0xFFFF) != 0)
        mask = [(int(r), int(c)) for r, c in bad] or None
def load():
    t0 = time.perf_counter()
    out = np.empty((n, kr, kc), dtype=dtype)
    lo = 0
    with h5py.File(master, "r") as f:
        for d in links(f):
            m = d.shape[0]
            d.read_direct(out, dest_sel=np.s_[lo:lo + m])
            lo += m
    t1 = time.perf_counter()
    g = cp.asarray(out)
    if mask is not None:
        if len(mask) <= 64:
            for r, c in mask:
                g[:, r, c] = 0
        else:
            rc = np.array(mask)
            g[:, cp.asarray(rc[:, 0]), cp.asarray(rc[:, 1])] = 0
    cp.cuda.Device().synchronize()
    t2 = time.perf_counter()
    return g, t1 - t0, t2 - t1
total_s, read_s, gpu_s = [], [], []
for i in range(warmup + repeats):
    t = time.perf_counter()
    g, r, h = load()
    dt = time.perf_counter() - t
    if i >= warmup:
        total_s.append(dt); read_s.append(r); gpu_s.append(h)
    if i + 1 < warmup + repeats:
        del g
        cp.get_default_memory_pool().free_all_blocks()
pool_bytes = int(cp.get_default_memory_pool().total_bytes())
flat = g.reshape(n, kr * kc)
w = cp.arange(1, kr * kc + 1, dtype=cp.uint64)
s = cp.empty(n, dtype=cp.uint64)
step = max(1, (1 << 28) // (kr * kc * 8))
for b in range(0, n, step):
    s[b:b + step] = (flat[b:b + step].astype(cp.uint64) * w[None, :]).sum(axis=1, dtype=cp.uint64)
weighted = int((s * cp.arange(1, n + 1, dtype=cp.uint64)).sum(dtype=cp.uint64))
total = int(flat.sum(dtype=cp.uint64))
dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
print(json.dumps({"seconds": total_s, "h5py_read_seconds": read_s, "asarray_mask_sync_seconds": gpu_s,
                  "frames": n, "shape": [n, kr, kc], "dtype": str(dtype), "mask_applied": mask is not None, "masked_pixels": len(mask or []),
                  "total": total, "weighted": weighted, "cupy_pool_bytes": pool_bytes,
                  "versions": {"h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version,
                               "hdf5plugin": hdf5plugin.version, "numpy": np.__version__,
                               "cupy": cp.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
                               "gpu": dev["name"].decode() if isinstance(dev["name"], bytes) else str(dev["name"]),
                               "python": sys.version.split()[0]}}))
"#;

fn run_cupy(master: &Path, warmup: u32, repeats: u32, apply_mask: bool) -> anyhow::Result<Value> {
    // PYTHONPATH (e.g. a carried hdf5plugin) is inherited from our environment.
    let out = Command::new("python3")
        .arg("-c")
        .arg(CUPY_SNIPPET)
        .arg(master)
        .args([
            warmup.to_string(),
            repeats.to_string(),
            if apply_mask { "1" } else { "0" }.to_string(),
        ])
        .output()
        .context("cannot run python3")?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(3).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return Err(anyhow!(
            "python3 h5py + cupy read failed: {}",
            tail.join(" | ")
        ));
    }
    serde_json::from_slice(&out.stdout).context("python3 h5py + cupy read printed no JSON")
}

fn timings_json(t: &[StageTiming]) -> Value {
    Value::Array(
        t.iter()
            .map(|s| json!({"stage": s.stage, "seconds": s.seconds}))
            .collect(),
    )
}

/// One timed (or warm-up) load.
struct Run {
    seconds: f64,
    timings: Vec<StageTiming>,
    memory: Value,
}

pub fn run(a: &BenchLoadArgs, command_line: &str) -> anyhow::Result<()> {
    let source = a.source.clone().ok_or_else(|| {
        anyhow::Error::new(
            qem::Error::invalid(
                "bench load",
                "--backend other than cpu, --cpu-check, --cupy, --scan-shape, --scan-region, --det-bin and --dtype need --source MASTER (make one with `qem-bench generate-reference DIR`)",
            )
            .with_expected("--source MASTER")
            .with_found("no --source"),
        )
    })?;
    let scan_shape = match &a.scan_shape {
        Some(v) => Some(shape2(v).ok_or_else(|| anyhow!("--scan-shape takes two numbers"))?),
        None => None,
    };
    let scan_region = match a.scan_region.as_deref() {
        Some(&[r0, r1, c0, c1]) => Some(Region {
            row_start: r0 as usize,
            row_stop: r1 as usize,
            col_start: c0 as usize,
            col_stop: c1 as usize,
        }),
        Some(_) => return Err(anyhow!("--scan-region takes four numbers R0 R1 C0 C1")),
        None => None,
    };

    // 1. The source and the machine.
    let inspection = qem::inspect(&source, scan_shape).context("inspecting --source")?;
    if !inspection.verdict.ready {
        return Err(anyhow::Error::new(
            qem::Error::source(
                "bench load",
                format!(
                    "{} is not ready: {}",
                    source.display(),
                    inspection.verdict.reason.clone().unwrap_or_default()
                ),
            )
            .with_file(&source),
        ));
    }
    let src_scan = inspection
        .scan_shape
        .ok_or_else(|| anyhow!("the source's scan shape is unknown: pass --scan-shape R C"))?;
    let src_det = inspection
        .detector_shape
        .ok_or_else(|| anyhow!("the source's detector shape is unknown"))?;
    let src_dtype = inspection
        .dtype
        .ok_or_else(|| anyhow!("the source's dtype is unknown"))?;
    let src_frames = src_scan.len();
    let src_raw_bytes = (src_frames * src_det.len() * src_dtype.size()) as u64;
    let compressed = inspection.compressed_bytes;
    let backends = qem::available_backends();
    let wants_gpu = a.backend != BackendRequest::Cpu || a.cupy;
    let smi = if wants_gpu { nvidia_smi() } else { Value::Null };

    let params = LoadParams {
        backend: a.backend,
        scan_shape,
        scan_region,
        det_bin: a.det_bin as usize,
        dtype: a.dtype,
        ..LoadParams::default()
    };
    let region = scan_region.unwrap_or(src_scan.full());
    let frames_read = region.shape().len();
    let decoded_bytes = (frames_read * src_det.len() * src_dtype.size()) as u64;
    // Chunk bytes the loads move: exact for full loads, proportional otherwise.
    let h2d_bytes = compressed.map(|c| {
        if frames_read == src_frames {
            c
        } else {
            (c as f64 * frames_read as f64 / src_frames as f64).round() as u64
        }
    });

    // 2. Timed loads.
    let total_runs = a.warmup + a.repeats;
    let mut runs: Vec<Run> = Vec::new();
    let mut last = None;
    for i in 0..total_runs {
        let timed = i >= a.warmup;
        eprintln!(
            "bench load: qem::load backend {:?} {}/{}{} ...",
            a.backend,
            i + 1,
            total_runs,
            if timed { "" } else { " (warm-up)" }
        );
        let t = Instant::now();
        let ds = qem::load(SourceArg::Path(source.clone()), &params)
            .with_context(|| format!("loading {}", source.display()))?;
        let seconds = t.elapsed().as_secs_f64();
        if timed {
            runs.push(Run {
                seconds,
                timings: ds.provenance().timings.clone(),
                memory: serde_json::to_value(ds.provenance().memory).unwrap_or(Value::Null),
            });
        }
        if i + 1 < total_runs {
            let mut ds = ds;
            ds.close();
            drop(ds);
        } else {
            last = Some(ds);
        }
    }
    let mut ds = last.ok_or_else(|| anyhow!("no load ran (--repeats must be at least 1)"))?;
    let seconds: Vec<f64> = runs.iter().map(|r| r.seconds).collect();
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by(|&x, &y| runs[x].seconds.total_cmp(&runs[y].seconds));
    let p50_index = order[(order.len() - 1) / 2];
    let p50_run = &runs[p50_index];
    let (t_min, t_max) = min_max(&seconds);
    let t_p50 = p50(&seconds);
    let decode_stage = stage(&p50_run.timings, "decode");
    let h2d_stage = stage(&p50_run.timings, "h2d");
    let decode = decode_stage.map(|s| s.seconds);
    let h2d = h2d_stage.map(|s| s.seconds);
    let decode_gb_s = decode
        .filter(|&s| s > 0.0)
        .map(|s| decoded_bytes as f64 / s / 1e9);
    let h2d_gb_s = match (h2d, h2d_bytes) {
        (Some(s), Some(b)) if s > 0.0 => Some(b as f64 / s / 1e9),
        _ => None,
    };
    let shape = ds.shape();
    let result_dtype = ds.dtype();
    let result_bytes = shape.iter().product::<usize>() as u64 * result_dtype.size() as u64;
    let backend_name = ds.backend().name().to_string();
    let device = ds.device().to_string();
    let provenance = serde_json::to_value(ds.provenance()).unwrap_or(Value::Null);
    let frame_len = shape[2] * shape[3];

    // 3. Our checksum.
    eprintln!("bench load: copying the result to the host for its checksum ...");
    let t = Instant::now();
    let host = ds.to_host().context("copying the dataset to the host")?;
    let to_host_s = t.elapsed().as_secs_f64();
    let ours = checksum(&host, frame_len);
    drop(host);

    // 4. CPU check.
    let mut failures: Vec<String> = Vec::new();
    let cpu_check = if a.cpu_check {
        eprintln!("bench load: CPU engine load of the same plan for the comparison ...");
        let cpu_params = LoadParams {
            backend: BackendRequest::Cpu,
            ..params.clone()
        };
        let t = Instant::now();
        let cpu = qem::load(SourceArg::Path(source.clone()), &cpu_params)
            .context("CPU reference load")?;
        let cpu_s = t.elapsed().as_secs_f64();
        let shape_equal = cpu.shape() == shape && cpu.dtype() == result_dtype;
        let theirs = checksum(cpu.dense()?, frame_len);
        let positions = sample_positions(shape[0], shape[1], SAMPLED_FRAMES);
        let mut mismatched = Vec::new();
        for &(r, c) in &positions {
            let equal = match (ds.frame(r, c), cpu.frame(r, c)) {
                (Ok(x), Ok(y)) => x == y,
                _ => false,
            };
            if !equal {
                mismatched.push(json!([r, c]));
            }
        }
        let checksum_equal = theirs == ours;
        if !shape_equal {
            failures.push(format!(
                "CPU shape/dtype {:?} {} != ours {:?} {}",
                cpu.shape(),
                cpu.dtype().numpy_name(),
                shape,
                result_dtype.numpy_name()
            ));
        }
        if !checksum_equal {
            failures.push(format!(
                "checksum of the CPU load {theirs:?} != ours {ours:?}"
            ));
        }
        if !mismatched.is_empty() {
            failures.push(format!(
                "{} of {} sampled frames differ from the CPU load",
                mismatched.len(),
                positions.len()
            ));
        }
        let n_mismatched = mismatched.len();
        mismatched.truncate(20);
        Some(json!({
            "cpu_load_s": cpu_s,
            "cpu_device": cpu.device(),
            "shape_and_dtype_equal": shape_equal,
            "checksum": {"total": theirs.0, "weighted": theirs.1},
            "checksum_equal": checksum_equal,
            "sampled_frames": positions.len(),
            "sampled_frames_equal": positions.len() - n_mismatched,
            "first_mismatched_positions": mismatched,
            "byte_exact": shape_equal && checksum_equal && n_mismatched == 0,
            "method": "same LoadParams with backend cpu; checksums of the whole array (u64 total and sum_n (n+1)*sum_k (k+1)*v[n,k] mod 2^64) and exact equality of frame(r, c) at the 4 corners plus pseudo-random scan positions",
        }))
    } else {
        None
    };
    ds.close();
    drop(ds);

    // 5. CuPy.
    let plain = scan_region.is_none_or(|r| r.is_full(src_scan))
        && a.det_bin == 1
        && result_dtype == src_dtype;
    let mut cupy_row = None;
    let cupy = if a.cupy {
        eprintln!(
            "bench load: h5py + hdf5plugin + cupy.asarray, 1 warm-up + {} ...",
            a.repeats
        );
        match run_cupy(&source, 1, a.repeats, params.apply_mask) {
            Ok(v) => {
                let secs: Vec<f64> = v["seconds"]
                    .as_array()
                    .map(|x| x.iter().filter_map(Value::as_f64).collect())
                    .unwrap_or_default();
                let (lo, hi) = min_max(&secs);
                let p = p50(&secs);
                let equal = plain.then(|| {
                    v["total"].as_u64() == Some(ours.0) && v["weighted"].as_u64() == Some(ours.1)
                });
                if equal == Some(false) {
                    failures.push("the CuPy array's checksum differs from ours".into());
                }
                cupy_row = Some((p, lo, hi));
                Some(json!({
                    "seconds": secs,
                    "p50_s": p,
                    "min_s": lo,
                    "max_s": hi,
                    "h5py_read_seconds": v["h5py_read_seconds"],
                    "asarray_mask_sync_seconds": v["asarray_mask_sync_seconds"],
                    "mask_applied": v["mask_applied"],
                    "masked_pixels": v["masked_pixels"],
                    "cupy_pool_bytes": v["cupy_pool_bytes"],
                    "checksum": {"total": v["total"], "weighted": v["weighted"]},
                    "checksum_equal_to_ours": equal,
                    "comparable": plain,
                    "ratio_cupy_over_ours_p50": p / t_p50,
                    "versions": v["versions"],
                    "method": "python3: h5py.File + read_direct of every /entry/data/data_NNNNNN link into one preallocated NumPy array, cupy.asarray, zero pixel_mask & 0xFFFF != 0 pixels on the GPU, device synchronize; 1 warm-up + N timed; checksum on the GPU",
                }))
            }
            Err(e) => {
                eprintln!("warning: {e:#}");
                failures.push(format!("the CuPy comparison did not run: {e:#}"));
                Some(json!({"error": format!("{e:#}")}))
            }
        }
    } else {
        None
    };

    // The record.
    let stamp = RecordStamp::now();
    let record = stamp.record(command_line, json!({
        "benchmark": format!("{backend_name}_load"),
        "gpu": smi,
        "backends": backends,
        "source": {
            "path": source,
            "kind": inspection.source_kind,
            "scan_shape": [src_scan.rows, src_scan.cols],
            "detector_shape": [src_det.rows, src_det.cols],
            "dtype": src_dtype.numpy_name(),
            "frames": src_frames,
            "raw_bytes": src_raw_bytes,
            "compressed_chunk_bytes": compressed,
            "compression_ratio": compressed.map(|c| src_raw_bytes as f64 / c.max(1) as f64),
            "shards": inspection.shards.len(),
            "bad_pixels": inspection.bad_pixels,
        },
        "plan": {
            "backend_requested": format!("{:?}", a.backend).to_lowercase(),
            "backend": backend_name,
            "device": device,
            "scan_region": scan_region.map(|r| [r.row_start, r.row_stop, r.col_start, r.col_stop]),
            "det_bin": a.det_bin,
            "dtype_requested": a.dtype.to_string(),
            "apply_mask": params.apply_mask,
            "result_shape": shape,
            "result_dtype": result_dtype.numpy_name(),
            "result_bytes": result_bytes,
            "frames_read": frames_read,
        },
        "cache": if a.warmup > 0 {
            "warm: page cache not dropped (the files were read by the warm-up run)"
        } else {
            "warm: page cache not dropped (no warm-up run: the first timed run may have read from disk)"
        },
        "ours": {
            "repeats": a.repeats,
            "warmup_runs_excluded": a.warmup,
            "seconds": seconds,
            "p50_s": t_p50,
            "min_s": t_min,
            "max_s": t_max,
            "timing": "wall time of qem::load(...) returning complete (synchronized) data; each dataset closed and dropped before the next load",
            "raw_gb_s_at_p50": src_raw_bytes as f64 * frames_read as f64 / src_frames as f64 / t_p50 / 1e9,
            "p50_run_index": p50_index,
            "p50_run_stage_timings": timings_json(&p50_run.timings),
            "p50_run_memory": p50_run.memory,
            "decoded_bytes": decoded_bytes,
            "h2d_bytes": h2d_bytes,
            "h2d_bytes_note": if frames_read == src_frames { "stored chunk bytes of the source" } else { "stored chunk bytes scaled by frames read / frames (estimate)" },
            "decode_stage": decode_stage.map(|s| s.stage.clone()),
            "decode_s": decode,
            "decode_gb_s": decode_gb_s,
            "h2d_stage": h2d_stage.map(|s| s.stage.clone()),
            "h2d_s": h2d,
            "h2d_gb_s": h2d_gb_s,
            "all_runs": runs.iter().map(|r| json!({"seconds": r.seconds, "stage_timings": timings_json(&r.timings), "memory": r.memory})).collect::<Vec<_>>(),
            "to_host_s": to_host_s,
            "checksum": {"total": ours.0, "weighted": ours.1},
            "provenance_last_run": provenance,
        },
        "cpu_check": cpu_check,
        "cupy": cupy,
        "failures": failures,
        "passed": failures.is_empty(),
    }));
    std::fs::create_dir_all(&a.out)
        .map_err(|e| qem::Error::io("create output folder", &a.out, &e))?;
    let path = a.out.join(stamp.file_name(&format!("{backend_name}_load")));
    let text = write_json(&path, &record, "write benchmark record")?;

    if a.json {
        print_out(&text)?;
    } else {
        print_out(&table(&record, cupy_row, &path))?;
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(anyhow!(
            "comparison failed: {} (record: {})",
            failures.join("; "),
            path.display()
        ))
    }
}

fn fmt_opt(v: Option<f64>, prec: usize) -> String {
    v.map(|x| format!("{x:.prec$}"))
        .unwrap_or_else(|| "-".into())
}

fn gb(v: &Value) -> String {
    v.as_u64()
        .map(|b| format!("{:.2} GB", b as f64 / 1e9))
        .unwrap_or_else(|| "-".into())
}

/// `yes` where the record's `v` is `true`, else `no` (also where it is missing).
fn when_true<'a>(v: &Value, yes: &'a str, no: &'a str) -> &'a str {
    if v.as_bool() == Some(true) {
        yes
    } else {
        no
    }
}

/// The closing table.
fn table(r: &Value, cupy_row: Option<(f64, f64, f64)>, path: &Path) -> String {
    let o = &r["ours"];
    let s = &r["source"];
    let p = &r["plan"];
    let mut t = String::new();
    let gpu = r["gpu"]["gpus"]
        .as_array()
        .and_then(|g| g.first())
        .and_then(Value::as_str)
        .unwrap_or("-");
    t.push_str(&format!(
        "bench load: {} on {} (GPU: {gpu}; driver CUDA {})\n",
        p["backend"].as_str().unwrap_or("?"),
        p["device"].as_str().unwrap_or("?"),
        r["gpu"]["driver_cuda_version"].as_str().unwrap_or("-"),
    ));
    t.push_str(&format!(
        "source: {} {} x {} {}, {} raw, {} stored ({}x); plan: region {}, bin {}, dtype {} -> {} {}; cache warm\n",
        s["path"].as_str().unwrap_or("?"),
        s["scan_shape"],
        s["detector_shape"],
        s["dtype"].as_str().unwrap_or("?"),
        gb(&s["raw_bytes"]),
        gb(&s["compressed_chunk_bytes"]),
        fmt_opt(s["compression_ratio"].as_f64(), 2),
        p["scan_region"],
        p["det_bin"],
        p["dtype_requested"].as_str().unwrap_or("?"),
        p["result_shape"],
        p["result_dtype"].as_str().unwrap_or("?"),
    ));
    t.push_str(&reader_header(34));
    // The CuPy path always reads the whole source.
    let raw_read = s["raw_bytes"].as_u64().map_or(f64::NAN, |b| b as f64 / 1e9);
    let secs = |key: &str| o[key].as_f64().unwrap_or(f64::NAN);
    t.push_str(&reader_row(
        34,
        &format!("quantem-gpu ({})", p["backend"].as_str().unwrap_or("?")),
        (secs("p50_s"), secs("min_s"), secs("max_s")),
        secs("raw_gb_s_at_p50"),
    ));
    if let Some(row) = cupy_row {
        t.push_str(&reader_row(
            34,
            "h5py+hdf5plugin -> cupy.asarray",
            row,
            raw_read / row.0,
        ));
    }
    t.push_str("stages of the p50 run:\n");
    if let Some(stages) = o["p50_run_stage_timings"].as_array() {
        for st in stages {
            t.push_str(&format!(
                "  {:<40} {:>10.4} s\n",
                st["stage"].as_str().unwrap_or("?"),
                st["seconds"].as_f64().unwrap_or(f64::NAN)
            ));
        }
    }
    t.push_str(&format!(
        "decode {} GB/s (decoded bytes / decode stage), H2D {} GB/s (chunk bytes / h2d stage)\n",
        fmt_opt(o["decode_gb_s"].as_f64(), 1),
        fmt_opt(o["h2d_gb_s"].as_f64(), 1)
    ));
    let mem = &o["p50_run_memory"];
    if mem.is_object() {
        t.push_str(&format!(
            "memory: planned {}, budget {}, process peak {}, card used before {} / peak {} / total {}\n",
            gb(&mem["planned_device_bytes"]),
            gb(&mem["budget_bytes"]),
            gb(&mem["process_peak_device_bytes"]),
            gb(&mem["card_used_before_bytes"]),
            gb(&mem["card_used_peak_bytes"]),
            gb(&mem["card_total_bytes"]),
        ));
    } else {
        t.push_str("memory: not reported by this backend\n");
    }
    if r["cpu_check"].is_object() {
        let c = &r["cpu_check"];
        t.push_str(&format!(
            "CPU check: checksum {}, {}/{} sampled frames equal -> {}\n",
            when_true(&c["checksum_equal"], "equal", "DIFFERENT"),
            c["sampled_frames_equal"],
            c["sampled_frames"],
            when_true(&c["byte_exact"], "byte-exact", "MISMATCH"),
        ));
    }
    if let Some(c) = r["cupy"].as_object() {
        if let Some(e) = c.get("error") {
            t.push_str(&format!("CuPy: did not run: {e}\n"));
        } else {
            t.push_str(&format!(
                "CuPy: p50 {} s = {}x ours; checksum {}\n",
                fmt_opt(c.get("p50_s").and_then(Value::as_f64), 3),
                fmt_opt(c.get("ratio_cupy_over_ours_p50").and_then(Value::as_f64), 2),
                match c.get("checksum_equal_to_ours").and_then(Value::as_bool) {
                    Some(true) => "equal",
                    Some(false) => "DIFFERENT",
                    None => "not comparable (region/bin/dtype)",
                }
            ));
        }
    }
    t.push_str(&format!(
        "result: {}\nrecord: {}\n",
        when_true(&r["passed"], "PASS", "FAIL"),
        path.display()
    ));
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_checksum_equals_the_sequential_one() {
        let v: Vec<u16> = (0..10_000u32).map(|i| (i * 7919 % 65_536) as u16).collect();
        assert_eq!(
            checksum_par(&v, 100),
            super::super::load::checksum_of(&v, 100)
        );
        assert_eq!(checksum_par(&[1u16, 2, 3, 4], 2), (10, 27));
    }

    #[test]
    fn sampled_positions_cover_corners_and_stay_inside() {
        let p = sample_positions(512, 300, 1000);
        assert_eq!(p.len(), 1000);
        assert!(p.contains(&(511, 299)) && p.contains(&(0, 0)));
        assert!(p.iter().all(|&(r, c)| r < 512 && c < 300));
        assert_eq!(sample_positions(3, 4, 1000).len(), 12);
    }

    #[test]
    fn stage_lookup_is_case_insensitive() {
        let t = vec![
            StageTiming::new("H2D (events, summed)", 0.5),
            StageTiming::new("decode (events, summed)", 0.25),
        ];
        assert_eq!(stage(&t, "h2d").map(|s| s.seconds), Some(0.5));
        let mut t2 = vec![StageTiming::new("decode (thread-s)", 9.0)];
        t2.extend(t.iter().cloned());
        assert_eq!(stage(&t2, "decode").map(|s| s.seconds), Some(0.25));
        assert_eq!(stage(&t, "decode").map(|s| s.seconds), Some(0.25));
        assert!(stage(&t, "read").is_none());
    }
}
