//! Size of the rANS counts codec ([`qem_codec::rans`], format v2) against bitshuffle/LZ4
//! ([`qem_codec::bslz4::encode_chunk`], default blocks) on the **reference acquisition**
//! ([`qem_sim::ReferencePattern`], default parameters: 512² scan, 192² detector, disk radius
//! 30 px) at 20k, 200k (reference) and 1M e⁻/frame.
//!
//! `frames` frames are drawn spread over the whole scan (frame index `k·2654435761 mod 512²`,
//! a permutation, so the lattice phase `ph` takes all its values); the two bad pixels of
//! [`qem_sim::ReferencePattern::pixel_mask`] are zeroed first (as the loader does). Every model
//! is fitted on those frames (or every `sample_every`-th of them) and codes all of them.
//!
//! Sizes per frame: `rans` = stream bytes (header, states, words, pad, extra) **plus the model
//! bytes amortised over the full 512² scan** (model bytes / 262 144; the model is per dataset);
//! `bslz4` = `encode_chunk` output of the frame alone. `ratio` = rans / bslz4.
//!
//! Run: `cargo run --release -p qem-bench --example rans_ratio [frames [sweep|floor|default]]`
//! (defaults 2000 frames, `sweep`: the configurations of the v2 study; `floor`: the
//! `AllSymbols` study; `default`: only `ModelParams::default()`). The first configuration of
//! each dose is also decoded and checked (round trip) and its decode speed is in the JSON. Prints one table per
//! dose and one JSON line per (dose, configuration).

use std::time::Instant;

use qem_codec::bslz4;
use qem_codec::rans::{
    decode_stream, encode_stream, ContextRule, CountsModel, FloorPolicy, ModelParams, SplitRule,
};

#[path = "shared/reference_frames.rs"]
mod reference_frames;

/// Frames of the full reference scan (the model's amortisation base).
const SCAN_FRAMES: f64 = 512.0 * 512.0;

struct Row {
    label: String,
    rans: f64,
    words: f64,
    extra: f64,
    header: f64,
    model_bytes: usize,
    fit_s: f64,
    enc_mbs: f64,
    dec_mbs: f64,
    sets_used: Vec<usize>,
}

fn run(
    frames: &[Vec<u16>],
    params: &ModelParams,
    label: &str,
    check: bool,
) -> Result<Row, Box<dyn std::error::Error>> {
    let n = frames.len();
    let len = frames[0].len();
    let t = Instant::now();
    let model = CountsModel::fit(frames.iter().map(|f| f.as_slice()), len, params)?;
    let fit_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let streams = frames
        .iter()
        .map(|f| encode_stream(&model, f))
        .collect::<Result<Vec<_>, _>>()?;
    let enc_s = t.elapsed().as_secs_f64();
    let mut dec_mbs = 0.0;
    if check {
        let mut out = vec![0u16; len];
        let t = Instant::now();
        for (s, f) in streams.iter().zip(frames) {
            decode_stream(&model, s, &mut out)?;
            if out != *f {
                return Err("round trip mismatch".into());
            }
        }
        dec_mbs = (n * len * 2) as f64 / t.elapsed().as_secs_f64() / 1e6;
    }
    let u32_at = |s: &[u8], at: usize| u32::from_le_bytes([s[at], s[at + 1], s[at + 2], s[at + 3]]);
    let (mut words, mut extra, mut header, mut total) = (0usize, 0usize, 0usize, 0usize);
    let mut sets_used = vec![0usize; model.table_sets() as usize];
    for s in &streams {
        let w = 2 * u32_at(s, 0) as usize;
        let e = 4 * (u32_at(s, 4) as usize).div_ceil(32);
        words += w;
        extra += e;
        header += s.len() - w - e; // 144 + pad
        total += s.len();
        sets_used[u32_at(s, 8) as usize] += 1;
    }
    let model_bytes = model.to_bytes().len();
    let nf = n as f64;
    Ok(Row {
        label: label.to_string(),
        rans: total as f64 / nf + model_bytes as f64 / SCAN_FRAMES,
        words: words as f64 / nf,
        extra: extra as f64 / nf,
        header: header as f64 / nf,
        model_bytes,
        fit_s,
        enc_mbs: (n * len * 2) as f64 / enc_s / 1e6,
        dec_mbs,
        sets_used,
    })
}

/// The letter a configuration's name gives its context rule.
fn rule_letter(rule: ContextRule) -> &'static str {
    if rule == ContextRule::Quantiles {
        "Q"
    } else {
        "L"
    }
}

fn configs(mode: &str) -> Vec<(String, ModelParams)> {
    let d = ModelParams::default();
    if mode == "default" {
        return vec![("default".into(), d)];
    }
    if mode == "floor" {
        let mut v = vec![("default".to_string(), d)];
        for rule in [ContextRule::Quantiles, ContextRule::LogBins] {
            for k in [32u8, 48, 64, 96, 128] {
                for (t, every) in [(4u8, 1usize), (8, 1), (4, 8)] {
                    let r = rule_letter(rule);
                    v.push((
                        format!("C16 K{k} T{t} {r} AllSym every {every}"),
                        ModelParams {
                            contexts: 16,
                            literals: k,
                            table_sets: t,
                            context_rule: rule,
                            floor: FloorPolicy::AllSymbols,
                            sample_every: every,
                            ..d
                        },
                    ));
                }
            }
        }
        return v;
    }
    let mut v = Vec::new();
    let base = ModelParams {
        contexts: 8,
        literals: 32,
        table_sets: 1,
        ..d
    };
    v.push(("v1-like C8 K32 T1 Q".to_string(), base));
    for rule in [ContextRule::Quantiles, ContextRule::LogBins] {
        for c in [8u8, 16] {
            for k in [32u8, 64, 128] {
                for t in [1u8, 2, 4, 8] {
                    let r = rule_letter(rule);
                    v.push((
                        format!("C{c} K{k} T{t} {r}"),
                        ModelParams {
                            contexts: c,
                            literals: k,
                            table_sets: t,
                            context_rule: rule,
                            ..d
                        },
                    ));
                }
            }
        }
    }
    let best = ModelParams {
        contexts: 16,
        literals: 128,
        table_sets: 4,
        context_rule: ContextRule::LogBins,
        ..d
    };
    for (name, split) in [("all", 16u8), ("C-1", 15), ("C/2", 8), ("1", 1)] {
        v.push((
            format!("C16 K128 T4 L split={name}"),
            ModelParams {
                split: SplitRule::Classes(split),
                ..best
            },
        ));
    }
    v.push((
        "C16 K128 T4 L AllSymbols".into(),
        ModelParams {
            floor: FloorPolicy::AllSymbols,
            ..best
        },
    ));
    v.push((
        "C16 K128 T4 L AllSymbols every 8".into(),
        ModelParams {
            floor: FloorPolicy::AllSymbols,
            sample_every: 8,
            ..best
        },
    ));
    v.push((
        "C16 K32 T4 L AllSymbols".into(),
        ModelParams {
            floor: FloorPolicy::AllSymbols,
            literals: 32,
            ..best
        },
    ));
    v
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = match std::env::args().nth(1) {
        Some(a) => a.parse()?,
        None => 2000,
    };
    let mode = std::env::args().nth(2).unwrap_or_else(|| "sweep".into());
    let mut json = Vec::new();
    for dose in [20_000.0, 200_000.0, 1_000_000.0] {
        let t = Instant::now();
        let frames = reference_frames::make_frames(n, dose)?;
        let gen_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut bslz4_bytes = 0usize;
        for f in &frames {
            let bytes: Vec<u8> = f.iter().flat_map(|v| v.to_le_bytes()).collect();
            bslz4_bytes += bslz4::encode_chunk(&bytes, 2, 0)?.len();
        }
        let bslz4_s = t.elapsed().as_secs_f64();
        let bslz4_pf = bslz4_bytes as f64 / n as f64;
        let mean = frames
            .iter()
            .map(|f| f.iter().map(|&v| u64::from(v)).sum::<u64>())
            .sum::<u64>() as f64
            / (n * frames[0].len()) as f64;
        println!(
            "\n# dose {dose} e-/frame: {n} frames (gen {gen_s:.1} s, bslz4 {bslz4_s:.1} s), \
             mean {mean:.3}/px, bslz4 {bslz4_pf:.0} B/frame ({:.2}x raw)",
            (frames[0].len() * 2) as f64 / bslz4_pf
        );
        println!(
            "{:<34} {:>9} {:>9} {:>7} {:>8} {:>8} {:>8} {:>7} {:>6} {:>6}  sets",
            "config",
            "rans B/fr",
            "bslz4 B",
            "ratio",
            "words B",
            "extra B",
            "header B",
            "model B",
            "fit s",
            "enc MB/s"
        );
        for (i, (label, p)) in configs(&mode).iter().enumerate() {
            let r = run(&frames, p, label, i == 0)?;
            let ratio = r.rans / bslz4_pf;
            println!(
                "{:<34} {:>9.1} {:>9.1} {:>7.4} {:>8.1} {:>8.1} {:>8.1} {:>7} {:>6.2} {:>6.0}  {:?}",
                r.label,
                r.rans,
                bslz4_pf,
                ratio,
                r.words,
                r.extra,
                r.header,
                r.model_bytes,
                r.fit_s,
                r.enc_mbs,
                r.sets_used
            );
            json.push(format!(
                "{{\"dose_e_per_frame\":{dose},\"frames\":{n},\"config\":\"{}\",\
                 \"rans_bytes_per_frame\":{:.1},\"bslz4_bytes_per_frame\":{bslz4_pf:.1},\
                 \"rans_size_vs_bslz4\":{ratio:.4},\"words_bytes_per_frame\":{:.1},\
                 \"extra_bytes_per_frame\":{:.1},\"header_bytes_per_frame\":{:.1},\
                 \"model_bytes\":{},\"encode_mb_s\":{:.1},\"decode_mb_s\":{:.1}}}",
                r.label, r.rans, r.words, r.extra, r.header, r.model_bytes, r.enc_mbs, r.dec_mbs
            ));
        }
    }
    for j in json {
        println!("{j}");
    }
    Ok(())
}
