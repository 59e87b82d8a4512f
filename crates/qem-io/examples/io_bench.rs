//! Writer and chunk-index timings: writes a synthetic Dectris-style acquisition with our writer,
//! then opens it (one `H5Dchunk_iter` pass per shard) and reads + decodes every chunk.
//!
//! `cargo run --release -p qem-io --example io_bench -- [SCAN_R SCAN_C DET_R DET_C [OUT_DIR]]`
//! (default 64 64 96 96 in a temporary folder). Prints a table and one JSON line.

use qem_core::{DType, Shape2};
use qem_io::writer::{write_acquisition, Calibration, WriteParams};
use qem_io::{OpenOptions, Source};
use rayon::prelude::*;
use std::time::Instant;

/// Counting-like frame: a bright disk with small counts, sparse single electrons outside.
fn frame(n: u64, det: Shape2, buf: &mut [u8]) {
    let mut s = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let (cr, cc) = (det.rows as f64 / 2.0, det.cols as f64 / 2.0);
    let r2 = (det.rows.min(det.cols) as f64 / 6.0).powi(2);
    for (i, px) in buf.chunks_exact_mut(2).enumerate() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let (r, c) = ((i / det.cols) as f64, (i % det.cols) as f64);
        let inside = (r - cr).powi(2) + (c - cc).powi(2) < r2;
        let v: u16 = if inside {
            (s % 9) as u16
        } else {
            (s % 97 == 0) as u16
        };
        px.copy_from_slice(&v.to_le_bytes());
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .take(4)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (scan, det) = match args.as_slice() {
        [a, b, c, d] => (Shape2::new(*a, *b), Shape2::new(*c, *d)),
        _ => (Shape2::new(64, 64), Shape2::new(96, 96)),
    };
    let tmp = tempfile::tempdir()?;
    let out = std::env::args()
        .nth(5)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| tmp.path().to_path_buf());
    let p = WriteParams {
        prefix: out.join("bench"),
        scan_shape: scan,
        detector_shape: det,
        dtype: DType::U16,
        frames_per_file: 10_000,
        calibration: Calibration {
            energy_ev: Some(300e3),
            ..Calibration::default()
        },
        ..WriteParams::default()
    };
    let n = scan.len() as f64;
    let t = Instant::now();
    let w = write_acquisition(&p, |i, buf| frame(i, det, buf))?;
    let t_write = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let src = Source::open(&w.master, &OpenOptions::default())?;
    let t_open = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let fb = src.frame_bytes();
    let ok = src
        .chunks
        .par_iter()
        .map_init(
            || (Vec::new(), vec![0u8; fb]),
            |(buf, out), rec| -> Result<bool, String> {
                src.read_chunk(rec, buf).map_err(|e| e.to_string())?;
                qem_codec::bslz4::decode_chunk(buf, 2, out).map_err(|e| e.to_string())?;
                let mut want = vec![0u8; fb];
                frame(rec.first_frame, det, &mut want);
                Ok(*out == want)
            },
        )
        .collect::<Result<Vec<bool>, String>>()?;
    let t_read = t.elapsed().as_secs_f64();
    let all_ok = ok.iter().all(|&b| b);
    println!(
        "scan {scan}, detector {det}, u16, {} shards, {} threads",
        w.data_files.len(),
        rayon::current_num_threads()
    );
    println!(
        "{:<34}{:>12}",
        "raw GB",
        format!("{:.3}", w.raw_bytes as f64 / 1e9)
    );
    println!(
        "{:<34}{:>12}",
        "stored GB (ratio)",
        format!(
            "{:.3} ({:.2}x)",
            w.compressed_bytes as f64 / 1e9,
            w.raw_bytes as f64 / w.compressed_bytes as f64
        )
    );
    println!(
        "{:<34}{:>12.3}  ({:.0} frames/s, {:.0} MB/s raw)",
        "write s",
        t_write,
        n / t_write,
        w.raw_bytes as f64 / t_write / 1e6
    );
    println!(
        "{:<34}{:>12.4}  ({:.2} us/chunk)",
        "Source::open s (chunk index)",
        t_open,
        t_open / n * 1e6
    );
    println!(
        "{:<34}{:>12.3}  ({:.0} MB/s raw), equal={all_ok}",
        "pread+decode+compare all s",
        t_read,
        w.raw_bytes as f64 / t_read / 1e6
    );
    println!(
        "{{\"scan\":[{},{}],\"detector\":[{},{}],\"frames\":{},\"write_s\":{t_write:.4},\"open_s\":{t_open:.5},\"read_decode_s\":{t_read:.4},\"raw_bytes\":{},\"stored_bytes\":{},\"equal\":{all_ok}}}",
        scan.rows, scan.cols, det.rows, det.cols, n, w.raw_bytes, w.compressed_bytes
    );
    if !all_ok {
        return Err("decoded frames differ".into());
    }
    Ok(())
}
