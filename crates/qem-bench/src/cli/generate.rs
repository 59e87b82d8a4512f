//! `qem-bench generate-reference OUTDIR`: write the reference benchmark acquisition.
//!
//! Frames come from [`qem_sim::ReferencePattern`] (the recipe of
//! `tests/tools/make_reference_acquisition.py`), drawn in parallel (rayon) and written by
//! `qem_io::writer::write_acquisition` as Dectris files: `OUTDIR/scan_master.h5` plus
//! `scan_data_NNNNNN.h5` shards of bitshuffle/LZ4 chunks of one frame, written with direct
//! chunk writes. The master says `nimages = 1`, `ntrigger = N` like the recipe (readers infer a
//! square scan); a rectangular scan also records `stem/scan_shape` (line-triggered series) so
//! that it loads without `--scan-shape`.

use super::args::GenerateReferenceArgs;
use crate::machine::RecordStamp;
use anyhow::{anyhow, Context};
use qem::{DType, Shape2};
use qem_cli::shared::{print_out, shape2, write_json};
use qem_io::writer::{self, Calibration, WriteParams};
use qem_sim::{ReferenceParams, ReferencePattern};
use serde_json::json;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

thread_local! {
    /// Per-thread scratch: expectation and counts of one frame.
    static SCRATCH: RefCell<(Vec<f32>, Vec<u32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

pub fn run(a: &GenerateReferenceArgs, command_line: &str) -> anyhow::Result<()> {
    let scan = shape2(&a.scan).ok_or_else(|| anyhow!("--scan takes two numbers"))?;
    let det = match a.detector.as_slice() {
        [k] => Shape2::new(*k as usize, *k as usize),
        [r, c] => Shape2::new(*r as usize, *c as usize),
        _ => return Err(anyhow!("--detector takes one (square) or two numbers")),
    };
    let dtype = match a.dtype.to_ascii_lowercase().as_str() {
        "u16" | "uint16" => DType::U16,
        "u32" | "uint32" => DType::U32,
        other => {
            return Err(anyhow::Error::new(
                qem::Error::invalid("generate-reference", "unsupported --dtype")
                    .with_expected("u16 or u32")
                    .with_found(other.to_string()),
            ))
        }
    };
    let pattern = ReferencePattern::new(ReferenceParams {
        scan_shape: scan,
        detector_shape: det,
        radius_px: a.radius,
        dose_e_per_frame: a.dose,
        seed: a.seed,
    })?;
    let max_value = dtype.max_value() as u32;
    let record_scan_shape = scan.rows != scan.cols;
    let params = WriteParams {
        prefix: a.outdir.join("scan"),
        scan_shape: scan,
        detector_shape: det,
        dtype,
        frames_per_file: a.frames_per_file,
        frames_per_chunk: 1,
        pixel_mask: Some(pattern.pixel_mask()),
        calibration: Calibration {
            pixel_size_m: 1e-4,
            count_time_s: 1e-4,
            frame_time_s: 1e-4,
            saturation_value: Some(dtype.max_value() - 1),
            ..Calibration::default()
        },
        write_scan_shape: record_scan_shape,
        ..WriteParams::default()
    };
    let frames = scan.len() as u64;
    let frame_len = det.len();
    let raw_gb = (frames as usize * frame_len * dtype.size()) as f64 / 1e9;
    eprintln!(
        "generate-reference: {scan} scan x {det} detector {} ({raw_gb:.2} GB raw), dose {} e-/frame, radius {} px, {} frames per shard -> {}",
        dtype.numpy_name(),
        a.dose,
        a.radius,
        a.frames_per_file,
        a.outdir.display()
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(a.threads)
        .build()
        .context("cannot start the worker threads")?;
    let threads = pool.current_num_threads();
    let done = AtomicU64::new(0);
    let step = (frames / 20).max(1);
    let t = Instant::now();
    let written = pool
        .install(|| {
            writer::write_acquisition(&params, |n, buf| {
                SCRATCH.with(|s| {
                    let (lam, counts) = &mut *s.borrow_mut();
                    lam.resize(frame_len, 0.0);
                    counts.resize(frame_len, 0);
                    pattern.frame(n, max_value, lam, counts);
                    match dtype {
                        DType::U32 => {
                            for (dst, &v) in buf.chunks_exact_mut(4).zip(counts.iter()) {
                                dst.copy_from_slice(&v.to_le_bytes());
                            }
                        }
                        _ => {
                            for (dst, &v) in buf.chunks_exact_mut(2).zip(counts.iter()) {
                                dst.copy_from_slice(&(v as u16).to_le_bytes());
                            }
                        }
                    }
                });
                let k = done.fetch_add(1, Ordering::Relaxed) + 1;
                if k % step == 0 {
                    let s = t.elapsed().as_secs_f64();
                    eprintln!(
                        "generate-reference: {k}/{frames} frames, {s:.1} s, {:.0} frames/s",
                        k as f64 / s
                    );
                }
            })
        })
        .context("writing the reference acquisition")?;
    let seconds = t.elapsed().as_secs_f64();
    let file_bytes = written.file_bytes();
    let ratio = written.raw_bytes as f64 / written.compressed_bytes.max(1) as f64;
    let summary = RecordStamp::now().record(command_line, json!({
        "what": "reference benchmark acquisition (recipe of tests/tools/make_reference_acquisition.py)",
        "threads": threads,
        "master": written.master,
        "shards": written.data_files.len(),
        "frames_per_file": a.frames_per_file,
        "frames_per_chunk": 1,
        "scan_shape": [scan.rows, scan.cols],
        "detector_shape": [det.rows, det.cols],
        "dtype": dtype.numpy_name(),
        "dose_e_per_frame": a.dose,
        "radius_px": a.radius,
        "seed": a.seed,
        "bad_pixels": qem_sim::REFERENCE_BAD_PIXELS
            .iter()
            .filter(|((r, c), _)| *r < det.rows && *c < det.cols)
            .map(|((r, c), v)| json!({"row": r, "col": c, "pixel_mask": v, "value": max_value}))
            .collect::<Vec<_>>(),
        "scan_shape_recorded": record_scan_shape,
        "frames": frames,
        "raw_bytes": written.raw_bytes,
        "compressed_chunk_bytes": written.compressed_bytes,
        "file_bytes": file_bytes,
        "compression_ratio": ratio,
        "seconds": seconds,
        "frames_per_s": frames as f64 / seconds,
        "compression": "bitshuffle + LZ4 (HDF5 filter 32008), direct chunk writes, Dectris master + external shards",
    }));
    let json_path = a.outdir.join("reference_acquisition.json");
    let text = write_json(&json_path, &summary, "write summary")?;
    if a.json {
        return print_out(&text);
    }
    print_out(&format!(
        "generate-reference: {frames} frames ({scan} x {det} {}) in {seconds:.1} s on {threads} threads = {:.0} frames/s\n\
         raw {:.3} GB, compressed chunks {} bytes ({:.3} GB), files {:.3} GB, ratio {ratio:.3}x\n\
         master: {}\nsummary: {}\n",
        dtype.numpy_name(),
        frames as f64 / seconds,
        written.raw_bytes as f64 / 1e9,
        written.compressed_bytes,
        written.compressed_bytes as f64 / 1e9,
        file_bytes as f64 / 1e9,
        written.master.display(),
        json_path.display()
    ))
}
