//! Single-thread bslz4 decode throughput (decoded bytes per second) on a simulated 192×192
//! u16 Poisson frame (mean 5 counts/pixel), a sparse one (mean 0.5), and the hdf5plugin
//! fixture `u16_192x192`. Also times the LZ4 and un-transpose stages alone.
//!
//! Run: `cargo run --release -p qem-bench --example decode_speed`. Prints a table, then one
//! JSON line per case.

use std::time::{Duration, Instant};

use qem_bench::timing::XorShift64Star;
use qem_codec::{bitshuffle, bslz4, lz4};

/// Poisson sample by Knuth's product method (fine for small means).
fn poisson(rng: &mut XorShift64Star, mean: f64) -> u16 {
    let limit = (-mean).exp();
    let mut k = 0u16;
    let mut p = rng.uniform();
    while p > limit {
        k += 1;
        p *= rng.uniform();
    }
    k
}

fn poisson_frame(n: usize, mean: f64, seed: u64) -> Vec<u8> {
    let mut rng = XorShift64Star(seed);
    (0..n)
        .flat_map(|_| poisson(&mut rng, mean).to_le_bytes())
        .collect()
}

/// Run `f` repeatedly for about `budget`; return the best per-call time over 5 rounds.
fn time(budget: Duration, mut f: impl FnMut()) -> Duration {
    f();
    let start = Instant::now();
    let mut calls = 0u32;
    while start.elapsed() < budget / 10 {
        f();
        calls += 1;
    }
    let per_round = calls.max(1);
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..per_round {
            f();
        }
        best = best.min(t.elapsed() / per_round);
    }
    best
}

fn mb_s(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e6
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../qem-codec/tests/vectors/u16_192x192.chunk.bin");
    let mut cases: Vec<(String, Vec<u8>, usize)> = Vec::new();
    for (mean, seed) in [(5.0, 1u64), (0.5, 2)] {
        let frame = poisson_frame(192 * 192, mean, seed);
        let chunk = bslz4::encode_chunk(&frame, 2, 0)?;
        cases.push((format!("poisson mean {mean} (ours)"), chunk, frame.len()));
    }
    if let Ok(chunk) = std::fs::read(&fixture) {
        cases.push(("hdf5plugin u16_192x192".into(), chunk, 192 * 192 * 2));
    }

    let budget = Duration::from_millis(1500);
    let mut decoder = bslz4::Decoder::new();
    println!(
        "{:<28} {:>9} {:>7} {:>12} {:>12} {:>14}",
        "frame 192x192 u16", "chunk B", "ratio", "decode MB/s", "LZ4 MB/s", "untransp MB/s"
    );
    let mut json = Vec::new();
    for (name, chunk, out_len) in &cases {
        let mut out = vec![0u8; *out_len];
        let t_all = time(budget, || {
            if decoder.decode(chunk, 2, &mut out).is_err() {
                std::process::abort();
            }
        });
        // Stage by stage, with the block table parsed once.
        let layout = bslz4::parse_chunk(chunk, 2, *out_len)?;
        let mut planes = vec![0u8; *out_len];
        let t_lz4 = time(budget, || {
            for b in &layout.blocks {
                let src = &chunk[b.payload_offset..b.payload_offset + b.payload_len];
                let dst = &mut planes[b.out_offset..b.out_offset + b.out_len];
                if lz4::decompress_block_exact(src, dst).is_err() {
                    std::process::abort();
                }
            }
        });
        let t_tr = time(budget, || {
            for b in &layout.blocks {
                let r = b.out_offset..b.out_offset + b.out_len;
                if bitshuffle::untranspose_block(&planes[r.clone()], 2, &mut out[r]).is_err() {
                    std::process::abort();
                }
            }
        });
        println!(
            "{:<28} {:>9} {:>7.2} {:>12.0} {:>12.0} {:>14.0}",
            name,
            chunk.len(),
            *out_len as f64 / chunk.len() as f64,
            mb_s(*out_len, t_all),
            mb_s(*out_len, t_lz4),
            mb_s(*out_len, t_tr)
        );
        json.push(format!(
            "{{\"frame\":\"{name}\",\"chunk_bytes\":{},\"decode_mb_s\":{:.1},\"lz4_mb_s\":{:.1},\"untranspose_mb_s\":{:.1}}}",
            chunk.len(),
            mb_s(*out_len, t_all),
            mb_s(*out_len, t_lz4),
            mb_s(*out_len, t_tr)
        ));
    }
    for line in json {
        println!("{line}");
    }
    Ok(())
}
