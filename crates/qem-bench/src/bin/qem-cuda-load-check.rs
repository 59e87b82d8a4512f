//! `qem-cuda-load-check`: the CUDA load pipeline against the CPU engine on one acquisition.
//!
//! ```text
//! qem-cuda-load-check --load MASTER [--region r0 r1 c0 c1] [--bin B] [--repeats N]
//!                     [--threads T] [--batch-mb M] [--slots S] [--no-mask] [--out DIR]
//! ```
//! Cases: (1) the full load (native dtype, mask applied); (2) a rectangular scan region
//! (`--region`, default the middle half of rows × middle three quarters of columns) with
//! `det_bin` B (default 2); (3) on a u32 source, an explicit u16 request. Each case: one
//! untimed warm-up, N timed GPU loads (synchronized wall time; p50/min/max and the stage
//! timings of the p50 run), then one CPU load (`qem_cpu::load_dense`) compared byte-exactly
//! with the downloaded GPU array (full array plus a per-frame diff report). Errors must agree
//! in kind (e.g. both Overflow). Writes `cuda_load_check.json` to `--out`; exits 1 when any
//! comparison failed, 4 when CUDA is unavailable, 2 on bad usage.

use std::path::PathBuf;
use std::time::Instant;

use qem_core::{DType, DenseArray, DetectorPlan, DtypeRequest, Error, Region, Result};
use qem_cpu::{FramePlan, LoadHooks};
use qem_cuda::{load_source, GpuLoadParams, PipelineOptions};
use qem_io::{OpenOptions, Source};
use serde_json::{json, Value};

struct Args {
    master: PathBuf,
    region: Option<Region>,
    bin: usize,
    repeats: usize,
    out: PathBuf,
    options: PipelineOptions,
    mask: bool,
}

fn usage() -> ! {
    eprintln!(
        "usage: qem-cuda-load-check --load MASTER [--region r0 r1 c0 c1] [--bin B] \
         [--repeats N] [--threads T] [--batch-mb M] [--slots S] [--lz4-stage on|off] [--no-mask] \
         [--out DIR]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut a = Args {
        master: PathBuf::new(),
        region: None,
        bin: 2,
        repeats: 5,
        out: PathBuf::from("."),
        options: PipelineOptions::default(),
        mask: true,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    let num =
        |s: Option<&String>| -> usize { s.and_then(|v| v.parse().ok()).unwrap_or_else(|| usage()) };
    let path = |s: Option<&String>| -> PathBuf { s.map(PathBuf::from).unwrap_or_else(|| usage()) };
    while i < argv.len() {
        match argv[i].as_str() {
            "--load" => {
                a.master = path(argv.get(i + 1));
                i += 2;
            }
            "--region" => {
                let v: Vec<usize> = (1..=4).map(|k| num(argv.get(i + k))).collect();
                a.region = Some(Region::new(v[0], v[1], v[2], v[3]));
                i += 5;
            }
            "--bin" => {
                a.bin = num(argv.get(i + 1));
                i += 2;
            }
            "--repeats" => {
                a.repeats = num(argv.get(i + 1)).max(1);
                i += 2;
            }
            "--threads" => {
                a.options.reader_threads = num(argv.get(i + 1)).max(1);
                i += 2;
            }
            "--batch-mb" => {
                a.options.batch_bytes = (num(argv.get(i + 1)).max(1) as u64) << 20;
                i += 2;
            }
            "--slots" => {
                a.options.slots = num(argv.get(i + 1));
                i += 2;
            }
            "--lz4-stage" => {
                a.options.stage_payload = argv
                    .get(i + 1)
                    .and_then(|v| qem_bench::on_off(v))
                    .unwrap_or_else(|| usage());
                i += 2;
            }
            "--no-mask" => {
                a.mask = false;
                i += 1;
            }
            "--out" => {
                a.out = path(argv.get(i + 1));
                i += 2;
            }
            _ => usage(),
        }
    }
    if a.master.as_os_str().is_empty() {
        usage()
    }
    a
}

struct Case {
    name: String,
    region: Region,
    bin: usize,
    dtype: DtypeRequest,
}

fn bytes_of(a: &DenseArray) -> &[u8] {
    match a {
        DenseArray::U8(v) => v,
        DenseArray::U16(v) => bytemuck::cast_slice(v),
        DenseArray::U32(v) => bytemuck::cast_slice(v),
    }
}

fn run_case(src: &Source, bad: Option<&[bool]>, a: &Args, c: &Case) -> Result<(Value, bool)> {
    let bin2 = (c.bin * c.bin) as u64;
    let result_dtype = c
        .dtype
        .result_dtype(src.dtype, src.dtype.max_value().saturating_mul(bin2));
    let saturate = c.dtype == DtypeRequest::U8Saturating;
    let params = GpuLoadParams {
        scan_region: c.region,
        detector: DetectorPlan::new(src.detector_shape, None, c.bin)?,
        result_dtype,
        saturate,
        bad_mask: bad,
        memory_budget: None,
        options: a.options,
        progress: None,
    };
    let plan = FramePlan::new(src.detector_shape, None, c.bin, result_dtype, saturate, bad)?;
    // CPU reference first (its error decides what the GPU must say).
    let t = Instant::now();
    let cpu = qem_cpu::load_dense(
        src,
        c.region,
        &plan,
        LoadHooks {
            progress: &qem_core::NoProgress,
        },
    );
    let cpu_s = t.elapsed().as_secs_f64();
    // Warm-up (context, kernels, pinned slots, first touch), then timed runs.
    let warm = Instant::now();
    let first = load_source(src, &params);
    let warm_s = warm.elapsed().as_secs_f64();
    let (cpu, gpu) = match (cpu, first) {
        (Err(ce), Err(ge)) => {
            let ok = ce.kind == ge.kind;
            println!(
                "{:<28} both failed: cpu {:?} / gpu {:?} -> {}",
                c.name,
                ce.kind,
                ge.kind,
                if ok { "PASS" } else { "FAIL" }
            );
            return Ok((
                json!({"case": c.name, "pass": ok, "cpu_error": ce.to_string(),
                       "gpu_error": ge.to_string()}),
                ok,
            ));
        }
        (Ok(_), Err(ge)) => {
            println!("{:<28} FAIL: gpu error {ge}", c.name);
            return Ok((
                json!({"case": c.name, "pass": false, "gpu_error": ge.to_string()}),
                false,
            ));
        }
        (Err(ce), Ok(_)) => {
            println!("{:<28} FAIL: cpu error {ce} but the gpu succeeded", c.name);
            return Ok((
                json!({"case": c.name, "pass": false, "cpu_error": ce.to_string()}),
                false,
            ));
        }
        (Ok(cpu), Ok(gpu)) => (cpu, gpu),
    };
    // Compare.
    let t = Instant::now();
    let host = gpu.array.download()?;
    let download_s = t.elapsed().as_secs_f64();
    let (gb, cb) = (bytes_of(&host), bytes_of(&cpu.data));
    let out_shape = plan.output_shape();
    let frame_bytes = out_shape.len() * result_dtype.size();
    let mut bad_frames = Vec::new();
    let mut n_bad_frames = 0usize;
    if gb.len() == cb.len() && frame_bytes > 0 {
        for (fi, (g, cc)) in gb
            .chunks_exact(frame_bytes)
            .zip(cb.chunks_exact(frame_bytes))
            .enumerate()
        {
            if g != cc {
                n_bad_frames += 1;
                if bad_frames.len() < 10 {
                    let es = result_dtype.size();
                    let px = g
                        .chunks_exact(es)
                        .zip(cc.chunks_exact(es))
                        .filter(|(x, y)| x != y)
                        .count();
                    let (r, col) = (fi / c.region.shape().cols, fi % c.region.shape().cols);
                    bad_frames.push(json!({"result_frame": fi, "scan": [c.region.row_start + r,
                        c.region.col_start + col], "pixels_differing": px}));
                }
            }
        }
    }
    let gpu_saturated = gpu.saturated;
    let exact = gb.len() == cb.len() && gb == cb && gpu_saturated == cpu.saturated;
    let mut runs = Vec::new();
    let mut timings_of = Vec::new();
    drop(gpu);
    for _ in 0..a.repeats {
        let t = Instant::now();
        let g = load_source(src, &params)?;
        runs.push(t.elapsed().as_secs_f64());
        timings_of.push((g.timings.clone(), g.memory, g.batches, g.direct));
        drop(g);
    }
    let mut sorted = runs.clone();
    sorted.sort_by(f64::total_cmp);
    let p50 = qem_core::stats::percentile_sorted(&sorted, 50.0);
    let p50_i = runs.iter().position(|&x| x == p50).unwrap_or(0);
    let (timings, memory, batches, direct) = timings_of[p50_i].clone();
    let compressed: u64 = cpu.bytes_read;
    println!(
        "{:<28} {} | p50 {:.3} s  min {:.3}  max {:.3} | {:.2} GB compressed -> {:.2} GB/s | \
         cpu {:.2} s | {} batches{} | frames differing: {}",
        c.name,
        if exact { "BYTE-EXACT" } else { "MISMATCH" },
        p50,
        sorted[0],
        sorted[sorted.len() - 1],
        compressed as f64 / 1e9,
        compressed as f64 / p50 / 1e9,
        cpu_s,
        batches,
        if direct {
            ", direct"
        } else {
            ", scratch+region/bin"
        },
        n_bad_frames
    );
    for t in &timings {
        println!("    {:<64} {:>9.4} s", t.stage, t.seconds);
    }
    println!(
        "    memory: planned {:.2} GB, budget {:.2} GB, process peak {:.2} GB, card used {:.2} -> {:.2} of {:.2} GB",
        memory.planned_device_bytes as f64 / 1e9,
        memory.budget_bytes as f64 / 1e9,
        memory.process_peak_device_bytes as f64 / 1e9,
        memory.card_used_before_bytes as f64 / 1e9,
        memory.card_used_peak_bytes as f64 / 1e9,
        memory.card_total_bytes as f64 / 1e9
    );
    Ok((
        json!({
            "case": c.name,
            "pass": exact,
            "scan_region": [c.region.row_start, c.region.row_stop, c.region.col_start, c.region.col_stop],
            "det_bin": c.bin,
            "result_dtype": result_dtype.to_string(),
            "result_shape": [c.region.shape().rows, c.region.shape().cols, out_shape.rows, out_shape.cols],
            "byte_exact": exact,
            "frames_differing": n_bad_frames,
            "first_differing_frames": bad_frames,
            "saturated": {"gpu": gpu_saturated, "cpu": cpu.saturated},
            "compressed_bytes": compressed,
            "warmup_s": warm_s,
            "runs_s": runs,
            "p50_s": p50,
            "min_s": sorted[0],
            "max_s": sorted[sorted.len() - 1],
            "p50_stage_timings": timings.iter().map(|t| json!({"stage": t.stage, "seconds": t.seconds})).collect::<Vec<_>>(),
            "memory": memory,
            "batches": batches,
            "direct_decode": direct,
            "cpu_load_s": cpu_s,
            "download_s": download_s,
        }),
        exact,
    ))
}

fn main() {
    let a = parse_args();
    let info = qem_bench::cuda_device_or_exit();
    let run = || -> Result<(Vec<Value>, bool)> {
        let t = Instant::now();
        let src = Source::open(&a.master, &OpenOptions::default())?;
        println!(
            "source: {} scan {} detector {} {} | {} chunks, {:.2} GB compressed | open {:.3} s",
            a.master.display(),
            src.scan_shape,
            src.detector_shape,
            src.dtype,
            src.chunks.len(),
            src.compressed_bytes() as f64 / 1e9,
            t.elapsed().as_secs_f64()
        );
        let bad = if a.mask { src.bad_pixel_mask() } else { None };
        let scan = src.scan_shape;
        let region = a.region.unwrap_or(Region::new(
            scan.rows / 4,
            (3 * scan.rows / 4).max(scan.rows / 4 + 1),
            scan.cols / 8,
            (7 * scan.cols / 8).max(scan.cols / 8 + 1),
        ));
        let mut cases = vec![
            Case {
                name: "full (native)".into(),
                region: scan.full(),
                bin: 1,
                dtype: DtypeRequest::Native,
            },
            Case {
                name: format!("region {region} bin {}", a.bin),
                region,
                bin: a.bin,
                dtype: DtypeRequest::Native,
            },
        ];
        if src.dtype == DType::U32 {
            cases.push(Case {
                name: "full, u16 from u32".into(),
                region: scan.full(),
                bin: 1,
                dtype: DtypeRequest::U16,
            });
        }
        let mut out = Vec::new();
        let mut all = true;
        for c in &cases {
            let (v, ok) = run_case(&src, bad.as_deref(), &a, c)?;
            all &= ok;
            out.push(v);
        }
        Ok((out, all))
    };
    let (cases, ok) = match run() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1)
        }
    };
    let record = json!({
        "tool": "qem-cuda-load-check",
        "device": info,
        "source": a.master,
        "options": {
            "reader_threads": a.options.reader_threads,
            "batch_bytes": a.options.batch_bytes,
            "slots": a.options.slots,
            "warps_per_cta": a.options.warps_per_cta,
            "stage_payload": a.options.stage_payload,
            "repeats": a.repeats,
            "mask": a.mask,
        },
        "cases": cases,
        "pass": ok,
    });
    let path = a.out.join("cuda_load_check.json");
    let write = std::fs::create_dir_all(&a.out)
        .map_err(|e| Error::io("write record", &a.out, &e))
        .and_then(|_| {
            std::fs::write(
                &path,
                serde_json::to_string_pretty(&record).unwrap_or_default(),
            )
            .map_err(|e| Error::io("write record", &path, &e))
        });
    if let Err(e) = write {
        eprintln!("error: {e}");
    } else {
        println!("wrote {}", path.display());
    }
    println!("{}", if ok { "ALL PASS" } else { "FAILED" });
    std::process::exit(if ok { 0 } else { 1 })
}
