//! Study (CPU only, no format change): how far would a **two-pixel symbol** take the rANS
//! decode? The GPU decode is issue-bound at ~65 warp-instructions per 32-pixel step (format
//! v2, crates/qem-cuda/NOTES.md), so the ENCODED products cost is set by decode steps per frame.
//!
//! Candidate ("v3 pairs"): lane j at pair step u codes pixels 64u + j and 64u + 32 + j (steps 2u
//! and 2u + 1 of v2, so the products see the same pixels in the same order) as **one joint
//! symbol** a·Q + b (Q = 8, both < 8) or an escape symbol (both values then as order-0
//! exp-Golomb raw bits), when all 64 pixels of the pair step have a context class below `d`
//! (a static, per-model choice: the warp stays in lock step); other pair steps are coded as two
//! v2 steps. Rows are per (table set, class of the first pixel), 12-bit frequencies.
//!
//! Reports per dose and `d`: estimated size against v2's **actual** encoded size (both from
//! the same −log2(f/4096) estimate, so the estimate's bias cancels; v2's actual size is printed
//! beside it), and decode steps per frame against v2's 1152 (192² detector).
//!
//! Run: `cargo run --release -p qem-bench --example pair_study [frames]` (default 300).

use qem_codec::rans::{encode_stream, fit_freq, symbol_of, CountsModel, FloorPolicy, ModelParams};

#[path = "shared/reference_frames.rs"]
mod reference_frames;

const Q: u32 = 8;

fn eg_bits(v: u32) -> f64 {
    (2 * (31 - (v + 1).leading_zeros()) + 1) as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = std::env::args()
        .nth(1)
        .map_or(300, |s| s.parse().unwrap_or(300));
    println!("dose     d  pair_steps  steps/frame (v2 1152)  est. size / v2 est.  v2 bytes/frame  escapes/pair");
    for dose in [20_000.0, 200_000.0, 1_000_000.0] {
        let fr = reference_frames::make_frames(n, dose)?;
        let len = fr[0].len();
        let model = CountsModel::fit(
            fr.iter().map(|f| f.as_slice()),
            len,
            &ModelParams::default(),
        )?;
        let (k, c_n, t_n) = (
            model.literals() as u32,
            model.contexts() as usize,
            model.table_sets() as usize,
        );
        let ctx = model.ctx_map();
        let sets: Vec<usize> = fr.iter().map(|f| model.table_set_for(f) as usize).collect();
        let v2_bytes: f64 = fr
            .iter()
            .map(|f| encode_stream(&model, f).map(|s| s.len() as f64))
            .sum::<Result<f64, _>>()?
            / n as f64;
        // v2 cost of one value in bits.
        let v2_bits = |set: usize, p: usize, v: u16| -> f64 {
            let Some((s, nb, _)) = symbol_of(u32::from(v), k) else {
                return f64::INFINITY; // not reached: every u16 has a symbol
            };
            let f = model.freq_row_of(set, ctx[p] as usize)[s as usize];
            -(f64::from(f) / 4096.0).log2() + f64::from(nb)
        };
        let v2_est: f64 = fr
            .iter()
            .zip(&sets)
            .map(|(f, &t)| {
                f.iter()
                    .enumerate()
                    .map(|(p, &v)| v2_bits(t, p, v))
                    .sum::<f64>()
            })
            .sum::<f64>()
            / n as f64;
        let pair_steps = len / 64;
        for d in (1..=c_n).rev() {
            let dark: Vec<bool> = (0..pair_steps)
                .map(|u| (64 * u..64 * u + 64).all(|p| (ctx[p] as usize) < d))
                .collect();
            // Joint histograms per (set, class of the first pixel): Q² pairs + escape.
            let s_j = (Q * Q + 1) as usize;
            let mut hist = vec![0u64; t_n * c_n * s_j];
            let sym = |a: u16, b: u16| -> usize {
                if u32::from(a) < Q && u32::from(b) < Q {
                    (u32::from(a) * Q + u32::from(b)) as usize
                } else {
                    (Q * Q) as usize
                }
            };
            for (f, &t) in fr.iter().zip(&sets) {
                for u in (0..pair_steps).filter(|&u| dark[u]) {
                    for j in 0..32 {
                        let p = 64 * u + j;
                        hist[(t * c_n + ctx[p] as usize) * s_j + sym(f[p], f[p + 32])] += 1;
                    }
                }
            }
            // fit_freq's rows have literals + 16 symbols: 49 + 16 = 65 = Q² + 1.
            let freq = fit_freq(
                &hist,
                t_n as u8,
                c_n as u8,
                (s_j - 16) as u8,
                FloorPolicy::SeenPlusOne,
            )?;
            let (mut bits, mut esc, mut pairs) = (0f64, 0u64, 0u64);
            for (f, &t) in fr.iter().zip(&sets) {
                for (u, &is_dark) in dark.iter().enumerate() {
                    for j in 0..32 {
                        let (p, q) = (64 * u + j, 64 * u + 32 + j);
                        if is_dark {
                            let s = sym(f[p], f[q]);
                            let fq = freq[(t * c_n + ctx[p] as usize) * s_j + s];
                            bits += -(f64::from(fq.max(1)) / 4096.0).log2();
                            pairs += 1;
                            if s == (Q * Q) as usize {
                                esc += 1;
                                bits += eg_bits(u32::from(f[p])) + eg_bits(u32::from(f[q]));
                            }
                        } else {
                            bits += v2_bits(t, p, f[p]) + v2_bits(t, q, f[q]);
                        }
                    }
                }
            }
            let est = bits / n as f64;
            let n_dark = dark.iter().filter(|&&x| x).count();
            let steps = n_dark + 2 * (pair_steps - n_dark);
            println!(
                "{:>8} {:>2}  {:>5}/{:<5}  {:>6}                 {:>6.3}               {:>8.0}        {:.4}",
                dose,
                d,
                n_dark,
                pair_steps,
                steps,
                est / v2_est,
                v2_bytes,
                esc as f64 / pairs.max(1) as f64
            );
        }
    }
    Ok(())
}
