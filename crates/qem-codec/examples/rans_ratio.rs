//! Size and single-thread speed of the rANS counts codec ([`qem_codec::rans`]) against raw u16
//! and bitshuffle/LZ4 ([`qem_codec::bslz4::encode_chunk`], default blocks) on simulated 192×192
//! electron-counting frames at three doses (≈ 20k, 200k, 1M e⁻/frame).
//!
//! The generator follows formats.md §5.2: a bright-field disk of radius 24 px whose centre
//! jitters by σ = 1 px, a bright-field fraction N(0.75, 0.1) per frame, a radially falling dark
//! field, Poisson electrons per pixel. The model is fitted to all frames of a dose; every stream is one frame including its 136-byte header and states.
//!
//! Run: `cargo run --release -p qem-codec --example rans_ratio [frames [contexts [literals
//! [logbins]]]]` (defaults 1000, 8, 32, quantile classes). Prints
//! a table, then one JSON line per dose. MB/s counts u16-equivalent bytes (2 per pixel).

use std::time::Instant;

use qem_codec::bslz4;
use qem_codec::rans::{decode_stream, encode_stream, ContextRule, CountsModel, ModelParams};

const NY: usize = 192;
const NX: usize = 192;

/// xorshift64* with uniform, normal and Poisson samples.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f64 {
        let u = self.uniform().max(1e-300);
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * self.uniform()).cos()
    }

    /// Knuth's product method below mean 30, a rounded normal above (fine for benchmark data).
    fn poisson(&mut self, mean: f64) -> u32 {
        if mean <= 0.0 {
            return 0;
        }
        if mean > 30.0 {
            return (mean + mean.sqrt() * self.normal()).round().max(0.0) as u32;
        }
        let limit = (-mean).exp();
        let mut k = 0u32;
        let mut p = self.uniform();
        while p > limit {
            k += 1;
            p *= self.uniform();
        }
        k
    }
}

fn make_frames(n: usize, dose: f64, seed: u64) -> Vec<Vec<u16>> {
    let mut rng = Rng(seed | 1);
    let radius = 24.0;
    let mut lam = vec![0f64; NY * NX];
    (0..n)
        .map(|_| {
            let cy = 96.0 + rng.normal();
            let cx = 96.0 + rng.normal();
            let fbf = (0.75 + 0.1 * rng.normal()).clamp(0.3, 0.98);
            let (mut bf_sum, mut df_sum) = (0.0, 0.0);
            for row in 0..NY {
                for col in 0..NX {
                    let r = ((row as f64 - cy).powi(2) + (col as f64 - cx).powi(2)).sqrt();
                    if r <= radius {
                        bf_sum += 1.0;
                    } else {
                        let d = r - radius;
                        df_sum += (-d / 18.0).exp() / (1.0 + (d / 40.0).powi(2));
                    }
                }
            }
            let electrons = rng.poisson(dose) as f64;
            for row in 0..NY {
                for col in 0..NX {
                    let r = ((row as f64 - cy).powi(2) + (col as f64 - cx).powi(2)).sqrt();
                    lam[row * NX + col] = if r <= radius {
                        fbf / bf_sum
                    } else {
                        let d = r - radius;
                        (1.0 - fbf) * (-d / 18.0).exp() / (1.0 + (d / 40.0).powi(2)) / df_sum
                    } * electrons;
                }
            }
            lam.iter()
                .map(|&l| rng.poisson(l).min(65535) as u16)
                .collect()
        })
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = match std::env::args().nth(1) {
        Some(a) => a.parse()?,
        None => 1000,
    };
    let mut params = ModelParams::default();
    if let Some(a) = std::env::args().nth(2) {
        params.contexts = a.parse()?;
    }
    if let Some(a) = std::env::args().nth(3) {
        params.literals = a.parse()?;
    }
    if std::env::args().nth(4).as_deref() == Some("logbins") {
        params.context_rule = ContextRule::LogBins;
    }
    let raw_frame = (NY * NX * 2) as f64;
    println!(
        "{:>9} {:>8} {:>6} {:>10} {:>10} {:>9} {:>9} {:>10} {:>10} {:>10}",
        "e-/frame",
        "mean/px",
        "max",
        "rans B/fr",
        "bslz4 B/fr",
        "rans x",
        "bslz4 x",
        "rans/bslz4",
        "enc MB/s",
        "dec MB/s"
    );
    let mut json = Vec::new();
    for (dose, seed) in [(20_000.0, 7u64), (200_000.0, 8), (1_000_000.0, 9)] {
        let frames = make_frames(n, dose, seed);
        let mean = frames
            .iter()
            .flat_map(|f| f.iter().map(|&v| f64::from(v)))
            .sum::<f64>()
            / (n * NY * NX) as f64;
        let max = frames
            .iter()
            .flat_map(|f| f.iter().copied())
            .max()
            .unwrap_or(0);
        let t_fit = Instant::now();
        let model = CountsModel::fit(frames.iter().map(|f| f.as_slice()), NY * NX, &params)?;
        let fit_s = t_fit.elapsed().as_secs_f64();

        let t = Instant::now();
        let mut streams = Vec::with_capacity(n);
        for f in &frames {
            streams.push(encode_stream(&model, f)?);
        }
        let enc_s = t.elapsed().as_secs_f64();

        let mut out = vec![0u16; NY * NX];
        let t = Instant::now();
        for (s, f) in streams.iter().zip(&frames) {
            decode_stream(&model, s, &mut out)?;
            if out != *f {
                return Err("round trip mismatch".into());
            }
        }
        let dec_s = t.elapsed().as_secs_f64();

        let mut bslz4_bytes = 0usize;
        for f in &frames {
            let bytes: Vec<u8> = f.iter().flat_map(|v| v.to_le_bytes()).collect();
            bslz4_bytes += bslz4::encode_chunk(&bytes, 2, 0)?.len();
        }
        let rans_bytes: usize = streams.iter().map(Vec::len).sum();
        let u32_at =
            |s: &[u8], at: usize| u32::from_le_bytes([s[at], s[at + 1], s[at + 2], s[at + 3]]);
        let words_pf = streams
            .iter()
            .map(|s| 2 * u32_at(s, 0) as usize)
            .sum::<usize>() as f64
            / n as f64;
        let extra_pf = streams
            .iter()
            .map(|s| 4 * (u32_at(s, 4) as usize).div_ceil(32))
            .sum::<usize>() as f64
            / n as f64;
        let rans_pf = rans_bytes as f64 / n as f64;
        let bslz4_pf = bslz4_bytes as f64 / n as f64;
        let raw_total = raw_frame * n as f64;
        let enc_mbs = raw_total / enc_s / 1e6;
        let dec_mbs = raw_total / dec_s / 1e6;
        println!(
            "{:>9} {:>8.3} {:>6} {:>10.0} {:>10.0} {:>9.2} {:>9.2} {:>10.3} {:>10.0} {:>10.0}",
            dose,
            mean,
            max,
            rans_pf,
            bslz4_pf,
            raw_frame / rans_pf,
            raw_frame / bslz4_pf,
            rans_pf / bslz4_pf,
            enc_mbs,
            dec_mbs
        );
        json.push(format!(
            "{{\"dose_e_per_frame\":{dose},\"frames\":{n},\"mean_per_px\":{mean:.4},\"max\":{max},\
             \"rans_bytes_per_frame\":{rans_pf:.1},\"bslz4_bytes_per_frame\":{bslz4_pf:.1},\
             \"ratio_rans_vs_raw\":{:.3},\"ratio_bslz4_vs_raw\":{:.3},\"rans_size_vs_bslz4\":{:.4},\
             \"words_bytes_per_frame\":{words_pf:.1},\"extra_bytes_per_frame\":{extra_pf:.1},\
             \"encode_mb_s\":{enc_mbs:.1},\"decode_mb_s\":{dec_mbs:.1},\"fit_s\":{fit_s:.3},\
             \"model_bytes\":{}}}",
            raw_frame / rans_pf,
            raw_frame / bslz4_pf,
            rans_pf / bslz4_pf,
            model.to_bytes().len()
        ));
    }
    for j in json {
        println!("{j}");
    }
    Ok(())
}
