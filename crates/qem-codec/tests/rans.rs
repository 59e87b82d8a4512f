//! The counts codec (`qem_codec::rans`): round trips at several doses and shapes, the documented
//! byte layout on a hand-built stream, model (de)serialisation, and hostile streams never panic.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use proptest::prelude::*;
use qem_codec::rans::{
    decode_stream, decode_stream_with, encode_stream, fit_contexts, fit_freq, fit_thresholds,
    frame_statistic, histogram_add, symbol_of, table_set_of, ContextFit, ContextRule, CountsModel,
    FloorPolicy, ModelParams, RansError, RansFault, SplitRule, STATE_LOWER, STREAM_HEADER_BYTES,
};

/// xorshift64* uniform in [0, 1).
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f64 {
        let x = self.0 ^ (self.0 >> 12);
        let x = x ^ (x << 25);
        self.0 = x ^ (x >> 27);
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn poisson(&mut self, mean: f64) -> u16 {
        if mean > 50.0 {
            // Normal approximation (Box–Muller) is enough for test data.
            let g = (-2.0 * self.uniform().max(1e-300).ln()).sqrt()
                * (std::f64::consts::TAU * self.uniform()).cos();
            return (mean + mean.sqrt() * g).round().clamp(0.0, 65535.0) as u16;
        }
        // Knuth: the number of further uniform factors before the product falls to e^−mean.
        let limit = (-mean).exp();
        let mut p = self.uniform();
        (0u16..)
            .find(|_| {
                let done = p <= limit;
                if !done {
                    p *= self.uniform();
                }
                done
            })
            .unwrap()
    }
}

/// Frames of `ny × nx` pixels: a bright disk (mean `peak`) on a radially falling halo.
fn frames(ny: usize, nx: usize, n: usize, peak: f64, seed: u64) -> Vec<Vec<u16>> {
    disk_frames((ny, nx), n, peak, seed, |_| 1.0)
}

/// `n` frames of a bright disk (mean `peak`) on a radially falling halo scaled by `halo(i)`
/// in frame `i`.
fn disk_frames(
    (ny, nx): (usize, usize),
    n: usize,
    peak: f64,
    seed: u64,
    halo: impl Fn(usize) -> f64,
) -> Vec<Vec<u16>> {
    let mut rng = Rng(seed | 1);
    let (cy, cx) = (ny as f64 / 2.0, nx as f64 / 2.0);
    let r0 = ny.min(nx) as f64 / 8.0;
    (0..n)
        .map(|i| {
            let halo = halo(i);
            let mut f = Vec::with_capacity(ny * nx);
            for row in 0..ny {
                for col in 0..nx {
                    let r = ((row as f64 - cy).powi(2) + (col as f64 - cx).powi(2)).sqrt();
                    let lam = if r <= r0 {
                        peak
                    } else {
                        peak * 0.05 * halo * (-(r - r0) / 10.0).exp()
                    };
                    f.push(rng.poisson(lam));
                }
            }
            f
        })
        .collect()
}

/// The parameters most tests pin (they were format v1's defaults, plus T = 4): C = 8, K = 32,
/// quantile classes, the `SeenPlusOne` floor. `ModelParams::default()` is tested on its own.
fn base() -> ModelParams {
    ModelParams {
        contexts: 8,
        literals: 32,
        table_sets: 4,
        context_rule: ContextRule::Quantiles,
        floor: FloorPolicy::SeenPlusOne,
        ..ModelParams::default()
    }
}

/// [`base`] with one change.
fn base_with(change: impl FnOnce(&mut ModelParams)) -> ModelParams {
    let mut p = base();
    change(&mut p);
    p
}

#[test]
fn default_params_round_trip_and_code_any_u16() {
    let d = ModelParams::default();
    assert!(d.validate().is_ok());
    assert_eq!(d.floor, FloorPolicy::AllSymbols);
    let fr = varying_frames(48, 48, 12, 20.0, 57);
    let model = fit(&fr, 48 * 48, &d);
    assert_eq!(model.contexts(), d.contexts);
    assert_eq!(model.literals(), d.literals);
    assert_eq!(model.table_sets(), d.table_sets);
    round_trip_all(&model, &fr);
    let mut odd = fr[3].clone();
    odd[0] = 65535;
    odd[100] = 9999;
    round_trip_all(&model, &[odd]);
}

fn fit(frames: &[Vec<u16>], len: usize, params: &ModelParams) -> CountsModel {
    CountsModel::fit(frames.iter().map(|f| f.as_slice()), len, params).unwrap()
}

fn round_trip_all(model: &CountsModel, frames: &[Vec<u16>]) -> usize {
    let mut bytes = 0;
    let mut out = vec![0u16; model.frame_len()];
    for f in frames {
        let s = encode_stream(model, f).unwrap();
        bytes += s.len();
        out.fill(0xAAAA);
        decode_stream(model, &s, &mut out).unwrap();
        assert_eq!(&out, f);
        // The callback form sees the same values, in raster order.
        let mut seen = Vec::with_capacity(f.len());
        decode_stream_with(model, &s, |p, v| {
            assert_eq!(p, seen.len());
            seen.push(v);
        })
        .unwrap();
        assert_eq!(&seen, f);
    }
    bytes
}

#[test]
fn round_trip_at_several_doses() {
    for (peak, seed) in [(0.01, 1u64), (0.5, 2), (5.0, 3), (300.0, 4)] {
        let fr = frames(64, 64, 12, peak, seed);
        let model = fit(&fr, 64 * 64, &base());
        let bytes = round_trip_all(&model, &fr);
        assert!(
            bytes < fr.len() * 64 * 64 * 2 + fr.len() * 200,
            "peak {peak}"
        );
    }
}

#[test]
fn round_trip_high_values_near_65535() {
    let mut fr = frames(32, 48, 6, 400.0, 9);
    for (i, f) in fr.iter_mut().enumerate() {
        f[7 + i] = 65535;
        f[100 + i] = 65000 - i as u16;
        f[1000] = 40000;
    }
    let model = fit(&fr, 32 * 48, &base());
    round_trip_all(&model, &fr);
}

#[test]
fn round_trip_odd_frame_length() {
    // 100 × 99 = 9900 pixels, not a multiple of 32: the last step has 12 lanes.
    let fr = frames(100, 99, 5, 3.0, 5);
    for contexts in [1u8, 4, 16] {
        let p = ModelParams { contexts, ..base() };
        let model = fit(&fr, 100 * 99, &p);
        assert_eq!(model.contexts(), contexts);
        round_trip_all(&model, &fr);
    }
    // Fewer pixels than lanes.
    let tiny: Vec<Vec<u16>> = vec![vec![0, 1, 2, 3, 40, 0, 7]];
    let model = fit(&tiny, 7, &base());
    round_trip_all(&model, &tiny);
}

#[test]
fn round_trip_all_zero_frames() {
    let fr = vec![vec![0u16; 1000]; 3];
    let model = fit(&fr, 1000, &base());
    let bytes = round_trip_all(&model, &fr);
    // Header + states only (zero has probability 4095/4096: no words at all for 1000 pixels).
    assert_eq!(bytes, 3 * STREAM_HEADER_BYTES);
    // The floor policy makes the next symbol (value 1) codable too, but not 2.
    let mut one = vec![0u16; 1000];
    one[999] = 1;
    round_trip_all(&model, &[one.clone()]);
    one[5] = 2;
    assert!(matches!(
        encode_stream(&model, &one),
        Err(RansError::Uncodable {
            pixel: 5,
            value: 2,
            ..
        })
    ));
}

#[test]
fn round_trip_every_u16_extreme_and_small_literal_counts() {
    let mut f: Vec<u16> = vec![0, 1, 30, 31, 32, 33, 34, 63, 64, 65, 255, 256, 32767, 32768];
    f.extend([65502, 65503, 65504, 65534, 65535, 1000, 4095, 4096, 4097]);
    f.extend((0..=15).map(|b| 1u16 << b));
    f.extend((1..=16).map(|b| ((1u32 << b) - 1) as u16));
    let fr = vec![f.clone(), f.iter().rev().copied().collect()];
    for literals in [1u8, 2, 16, 32, 64, 128] {
        let p = ModelParams {
            literals,
            contexts: 3,
            ..base()
        };
        let model = fit(&fr, f.len(), &p);
        assert_eq!(model.max_value(), u32::from(literals) + 65534);
        round_trip_all(&model, &fr);
    }
}

#[test]
fn sampled_fit_still_codes_unsampled_frames_within_the_floor() {
    let fr = frames(40, 40, 20, 2.0, 11);
    let model = fit(&fr, 1600, &base_with(|m| m.sample_every = 7));
    // Frames 1..6 were not sampled; with a modest dose their maxima are within the floor.
    round_trip_all(&model, &fr[..3]);
}

#[test]
fn fit_rejects_bad_input() {
    let fr = [vec![0u16; 10]];
    let it = || fr.iter().map(|f| f.as_slice());
    let bad = |p: ModelParams| CountsModel::fit(it(), 10, &p).unwrap_err();
    let d = base();
    for p in [
        ModelParams { contexts: 0, ..d },
        ModelParams { contexts: 17, ..d },
        ModelParams { literals: 0, ..d },
        ModelParams { literals: 129, ..d },
        ModelParams { table_sets: 0, ..d },
        ModelParams { table_sets: 9, ..d },
        ModelParams { prob_bits: 15, ..d },
        ModelParams {
            sample_every: 0,
            ..d
        },
    ] {
        assert!(matches!(bad(p), RansError::BadParam { .. }), "{p:?}");
    }
    assert!(matches!(
        CountsModel::fit(it(), 11, &d),
        Err(RansError::FrameLength { .. })
    ));
    assert!(matches!(
        CountsModel::fit(std::iter::empty(), 10, &d),
        Err(RansError::NoFrames)
    ));
    let model = CountsModel::fit(it(), 10, &d).unwrap();
    assert!(matches!(
        encode_stream(&model, &[0; 9]),
        Err(RansError::FrameLength { .. })
    ));
    let s = encode_stream(&model, &[0; 10]).unwrap();
    assert!(matches!(
        decode_stream(&model, &s, &mut [0; 11]),
        Err(RansError::FrameLength { .. })
    ));
}

#[test]
fn contexts_follow_the_mean_pattern() {
    let fr = frames(64, 64, 30, 20.0, 21);
    let model = fit(&fr, 4096, &base());
    let ctx = model.ctx_map();
    // The disk centre is brighter than the corner: a higher class.
    assert!(ctx[32 * 64 + 32] > ctx[0]);
    assert_eq!(ctx[32 * 64 + 32], 7);
    for c in 0..8 {
        let row = model.freq_row(c);
        assert_eq!(row.len(), 48);
        assert_eq!(row.iter().map(|&f| u32::from(f)).sum::<u32>(), 4096);
    }
}

#[test]
fn log_bin_contexts_round_trip_and_isolate_the_disk() {
    let fr = frames(64, 64, 30, 20.0, 22);
    let p = base_with(|m| m.context_rule = ContextRule::LogBins);
    let model = fit(&fr, 4096, &p);
    let ctx = model.ctx_map();
    assert_eq!(ctx[32 * 64 + 32], 7);
    // Only the disk (radius 8 px, ~200 pixels) reaches the top class, unlike quantiles (512).
    let top = ctx.iter().filter(|&&c| c == 7).count();
    assert!(top < 300, "{top}");
    round_trip_all(&model, &fr[..4]);
    // Constant data: one class.
    let flat = vec![vec![3u16; 100]; 2];
    let model = fit(&flat, 100, &p);
    assert!(model.ctx_map().iter().all(|&c| c == 0));
    round_trip_all(&model, &flat);
}

#[test]
fn model_bytes_round_trip_and_corruption_is_rejected() {
    let fr = frames(20, 30, 4, 4.0, 31);
    let model = fit(&fr, 600, &base_with(|m| m.table_sets = 1));
    let b = model.to_bytes();
    assert_eq!(b.len(), 20 + 600 + 2 * 8 * 48);
    assert_eq!(&b[..8], b"QRANSM\0\x02");
    assert_eq!(&b[8..16], &[12, 32, 16, 8, 32, 1, 0, 0]);
    assert_eq!(u32::from_le_bytes([b[16], b[17], b[18], b[19]]), 600);
    let back = CountsModel::from_bytes(&b).unwrap();
    assert_eq!(back, model);
    assert_eq!(back.to_bytes(), b);

    let corrupt = |at: usize, val: u8| {
        let mut c = b.clone();
        c[at] = val;
        CountsModel::from_bytes(&c)
    };
    assert!(corrupt(0, b'X').is_err()); // magic
    assert!(corrupt(8, 13).is_err()); // prob_bits
    assert!(corrupt(9, 0).is_err()); // K = 0
    assert!(corrupt(10, 17).is_err()); // NB
    assert!(corrupt(11, 17).is_err()); // C
    assert!(corrupt(12, 16).is_err()); // lanes
    assert!(corrupt(15, 1).is_err()); // reserved
    assert!(corrupt(13, 0).is_err()); // T = 0
    assert!(corrupt(13, 9).is_err()); // T = 9
    assert!(corrupt(14, 1).is_err()); // split must be 0 when T = 1
    assert!(matches!(
        corrupt(7, 1),
        Err(RansError::BadModel { what, .. }) if what.contains("v1")
    )); // a v1 model
    assert!(corrupt(16, 0x59).is_err()); // frame_len changes the length
    assert!(matches!(
        corrupt(20 + 5, 8),
        Err(RansError::BadModel {
            what: "ctx_map class",
            offset: 25,
            ..
        })
    ));
    // A frequency changed by one breaks its row sum.
    let fo = 20 + 600 + 2 * 48 * 3 + 2 * 5;
    let mut c = b.clone();
    c[fo] ^= 1;
    assert!(matches!(
        CountsModel::from_bytes(&c),
        Err(RansError::BadModel {
            what: "freq row sum",
            ..
        })
    ));
    // Moving one unit between two symbols of a row is a valid (different) model.
    let mut c = b.clone();
    let f0 = 20 + 600;
    let a = u16::from_le_bytes([c[f0], c[f0 + 1]]);
    c[f0..f0 + 2].copy_from_slice(&(a - 1).to_le_bytes());
    let z = u16::from_le_bytes([c[f0 + 2 * 47], c[f0 + 2 * 47 + 1]]);
    c[f0 + 2 * 47..f0 + 2 * 48].copy_from_slice(&(z + 1).to_le_bytes());
    assert!(CountsModel::from_bytes(&c).is_ok());
    // Truncations and extensions.
    for cut in [0, 7, 19, 20, b.len() - 1] {
        assert!(CountsModel::from_bytes(&b[..cut]).is_err(), "cut {cut}");
    }
    let mut longer = b.clone();
    longer.push(0);
    assert!(CountsModel::from_bytes(&longer).is_err());
}

/// A tiny model: 32 pixels, K = 2, C = 2 (pixel p in class p mod 2).
/// Class 0: symbol 0 → 2048, symbol 1 → 1024, bucket nb=0 (symbol 2) → 512, nb=2 (symbol 4) → 512.
/// Class 1: symbol 0 → 4096.
fn tiny_model() -> CountsModel {
    let s = 2 + 16;
    let mut freq = vec![0u16; 2 * s];
    freq[0] = 2048;
    freq[1] = 1024;
    freq[2] = 512;
    freq[4] = 512;
    freq[s] = 4096;
    let ctx = (0..32).map(|p| (p % 2) as u8).collect();
    CountsModel::new(2, 2, ctx, freq).unwrap()
}

#[test]
fn stream_layout_on_a_hand_made_example() {
    let model = tiny_model();
    // Hand-encoded by the module doc's rules. Pixels: p = 0 → value 1 (class 0), p = 2 → value
    // 2 (symbol 2: u = 1, nb = 0), p = 4 → value 6 (u = 5, nb = 2, symbol 4, extra 1 = 0b01),
    // p = 6 → value 4 (u = 3, nb = 1 → symbol 3 has frequency 0: not used), all others 0.
    let mut frame = [0u16; 32];
    frame[0] = 1;
    frame[2] = 2;
    frame[4] = 6;
    frame[8] = 7; // u = 6, nb = 2, extra 2 = 0b10
                  // One step (t = 0); each lane codes one symbol from x = L = 65536. No lane emits a word
                  // (x = 65536 < 2^20 · f for every f ≥ 1). x' = (L / f) · 4096 + (L mod f) + cu:
                  //   symbol 0 class 0 (f 2048, cu 0):    32 · 4096            = 131072
                  //   symbol 1 (f 1024, cu 2048):         64 · 4096 + 2048     = 264192
                  //   symbol 2 (f 512, cu 3072):          128 · 4096 + 3072    = 527360
                  //   symbol 4 (f 512, cu 3584):          128 · 4096 + 3584    = 527872
                  //   symbol 0 class 1 (f 4096, cu 0):    16 · 4096            = 65536
    let mut states = [65536u32; 32];
    for (j, st) in states.iter_mut().enumerate() {
        if j % 2 == 0 {
            *st = 131072;
        }
    }
    states[0] = 264192;
    states[2] = 527360;
    states[4] = 527872;
    states[8] = 527872;
    let mut hand = Vec::new();
    hand.extend_from_slice(&0u32.to_le_bytes()); // n_words
    hand.extend_from_slice(&4u32.to_le_bytes()); // n_extra_bits: 2 + 2
    hand.extend_from_slice(&0u32.to_le_bytes()); // table_set
    hand.extend_from_slice(&0u32.to_le_bytes()); // reserved
    for st in states {
        hand.extend_from_slice(&st.to_le_bytes());
    }
    // No words, no pad; extra bits LSB-first in raster order: p4 → 0b01, p8 → 0b10 → 0b1001.
    hand.extend_from_slice(&0b1001u32.to_le_bytes());
    assert_eq!(hand.len(), 16 + 128 + 4);

    let enc = encode_stream(&model, &frame).unwrap();
    assert_eq!(enc, hand);
    let mut out = [0u16; 32];
    decode_stream(&model, &hand, &mut out).unwrap();
    assert_eq!(out, frame);

    // Value 4 (symbol 3, frequency 0 in class 0) is an encode error naming the pixel.
    frame[6] = 4;
    assert_eq!(
        encode_stream(&model, &frame),
        Err(RansError::Uncodable {
            pixel: 6,
            value: 4,
            symbol: 3,
            context: 0
        })
    );
    // A non-zero value in class 1 (only symbol 0 has a frequency) also fails.
    frame[6] = 0;
    frame[7] = 1;
    assert!(matches!(
        encode_stream(&model, &frame),
        Err(RansError::Uncodable { pixel: 7, .. })
    ));
}

#[test]
fn stream_layout_words_and_pad() {
    // Many steps of a skewed symbol force renormalisation words; check their position, the pad
    // and the word order by decoding a stream whose words were permuted (must fail).
    let model = tiny_model();
    let s = 18;
    let mut freq = vec![0u16; 2 * s];
    freq[0] = 1;
    freq[1] = 4095;
    freq[s] = 1;
    freq[s + 1] = 4095;
    let model2 = CountsModel::new(2, 2, model.ctx_map().to_vec(), freq).unwrap();
    let frame = [0u16; 32]; // symbol 0 with f = 1: 12 bits per pixel → words every other step
    let enc = encode_stream(&model2, &frame).unwrap();
    let n_words = u32::from_le_bytes([enc[0], enc[1], enc[2], enc[3]]) as usize;
    let n_bits = u32::from_le_bytes([enc[4], enc[5], enc[6], enc[7]]);
    assert_eq!(n_bits, 0);
    // From L: one symbol (f = 1) → x = 65536 · 4096 = 2^28 ≥ 2^20 would emit on the next symbol;
    // with one step there is no second symbol, so no words, state 2^28 per lane.
    assert_eq!(n_words, 0);
    assert_eq!(enc.len(), 144);
    for j in 0..32 {
        let st = u32::from_le_bytes(enc[16 + 4 * j..20 + 4 * j].try_into().unwrap());
        assert_eq!(st, 1 << 28);
    }
    // Two frames' worth as one larger model: 64 pixels, two steps, lanes emit once each.
    let ctx = vec![0u8; 64];
    let m64 = CountsModel::new(2, 2, ctx, model2.freq_row(0).repeat(2)).unwrap();
    let mut f64v = vec![0u16; 64];
    f64v[33] = 1; // lane 1 at step 1 codes a likely symbol: no word for lane 1
    let enc = encode_stream(&m64, &f64v).unwrap();
    let n_words = u32::from_le_bytes([enc[0], enc[1], enc[2], enc[3]]) as usize;
    // Encoding step 1 first (from L, no words), then step 0: lanes with a 2^28 state emit
    // (2^28 ≥ 2^20 · 1); lane 1 has state 16 · 4096 + 16 + 1 (< 2^20 · 1) and does not.
    assert_eq!(n_words, 31);
    // Odd word count → a zero pad u16 before the (empty) extra section.
    assert_eq!(enc.len(), 144 + 2 * 31 + 2);
    assert_eq!(&enc[enc.len() - 2..], &[0, 0]);
    // Each emitted word is the low 16 bits of 2^28 = 0; decoded in order they round-trip.
    let mut out = vec![0u16; 64];
    decode_stream(&m64, &enc, &mut out).unwrap();
    assert_eq!(out, f64v);
    // A non-zero pad is rejected.
    let mut bad = enc.clone();
    let at = bad.len() - 1;
    bad[at] = 1;
    assert!(matches!(
        decode_stream(&m64, &bad, &mut out),
        Err(RansError::Corrupt {
            fault: RansFault::NonZeroPadding,
            ..
        })
    ));
}

#[test]
fn word_order_is_ascending_lane_within_a_step() {
    // 16 classes, lane j in class j / 2 with f(symbol 0) = 1 + class: after one symbol each
    // lane pair has its own state, so the word list reveals the lane order.
    let s = 18;
    let mut freq = vec![0u16; 16 * s];
    for c in 0..16 {
        freq[c * s] = 1 + c as u16;
        freq[c * s + 1] = 4095 - c as u16;
    }
    let ctx: Vec<u8> = (0..64).map(|p| ((p % 32) / 2) as u8).collect();
    let model = CountsModel::new(2, 16, ctx, freq).unwrap();
    let frame = vec![0u16; 64];
    let enc = encode_stream(&model, &frame).unwrap();
    let n_words = u32::from_le_bytes(enc[0..4].try_into().unwrap()) as usize;
    // Independent recomputation: step 1 takes every lane from L to x1(j); step 0 emits
    // x1(j) & 0xFFFF when x1(j) >= 2^20 * f(j) (true for all f <= 16).
    let f = |j: usize| 1 + (j / 2) as u64;
    let x1 = |j: usize| (65536 / f(j)) * 4096 + 65536 % f(j);
    let expected: Vec<u16> = (0..32)
        .filter(|&j| x1(j) >= (1 << 20) * f(j))
        .map(|j| (x1(j) & 0xFFFF) as u16)
        .collect();
    assert_eq!(expected.len(), 32);
    // Reversed lane order would give a different list.
    assert_ne!(expected, expected.iter().rev().copied().collect::<Vec<_>>());
    assert_eq!(n_words, expected.len());
    let words: Vec<u16> = enc[144..144 + 2 * n_words]
        .chunks_exact(2)
        .map(|w| u16::from_le_bytes([w[0], w[1]]))
        .collect();
    assert_eq!(words, expected);
    let mut out = vec![0u16; 64];
    decode_stream(&model, &enc, &mut out).unwrap();
    assert_eq!(out, frame);
    // Swapping two different words breaks decoding.
    assert_ne!(words[0], words[4]);
    let mut bad = enc.clone();
    bad.swap(144, 144 + 8);
    bad.swap(145, 144 + 9);
    assert!(decode_stream(&model, &bad, &mut out).is_err());
}

#[test]
fn corrupt_streams_are_typed_errors() {
    let fr = frames(24, 24, 2, 6.0, 41);
    let model = fit(&fr, 576, &base());
    let enc = encode_stream(&model, &fr[0]).unwrap();
    let mut out = vec![0u16; 576];
    // Truncated header.
    assert!(matches!(
        decode_stream(&model, &enc[..100], &mut out),
        Err(RansError::StreamSize { .. })
    ));
    // Length mismatch.
    assert!(matches!(
        decode_stream(&model, &enc[..enc.len() - 1], &mut out),
        Err(RansError::StreamSize { .. })
    ));
    // A state below L.
    let mut bad = enc.clone();
    bad[16..20].copy_from_slice(&5u32.to_le_bytes());
    assert!(matches!(
        decode_stream(&model, &bad, &mut out),
        Err(RansError::Corrupt {
            fault: RansFault::StateOutOfRange { lane: 0, state: 5 },
            ..
        })
    ));
    // A changed state decodes to something whose final state is not L (or another fault).
    let mut bad = enc.clone();
    bad[16 + 4 * 3] ^= 0x10;
    assert!(decode_stream(&model, &bad, &mut out).is_err());
    // Absurd counts.
    let mut bad = enc.clone();
    bad[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        decode_stream(&model, &bad, &mut out),
        Err(RansError::StreamSize { .. })
    ));
    assert_eq!(STATE_LOWER, 65536);
}

/// Extra bits do not touch the rANS states, so a stream whose extra bits are all set stays
/// consistent (words, bit count and final states all check out) while its buckets decode to
/// their largest member: for the nb = 15 bucket that is above 65535, and only the u16 range
/// check rejects it (the GPU decoder mirrors this check, qem-cuda-rans-check "forged").
#[test]
fn forged_extra_bits_above_65535_are_rejected() {
    let mut fr = frames(24, 24, 2, 6.0, 43);
    fr[0][10] = 65535;
    fr[0][11] = 40000;
    let model = fit(&fr, 576, &ModelParams::default());
    let enc = encode_stream(&model, &fr[0]).unwrap();
    let n_words = header_u32(&enc, 0) as usize;
    let n_bits = header_u32(&enc, 4) as usize;
    assert!(n_bits >= 30, "both large values have 15 extra bits");
    let ex0 = STREAM_HEADER_BYTES + 4 * n_words.div_ceil(2);
    let mut forged = enc.clone();
    for b in 0..n_bits {
        forged[ex0 + b / 8] |= 1 << (b % 8);
    }
    let mut out = vec![0u16; 576];
    decode_stream(&model, &enc, &mut out).unwrap();
    assert_eq!(out, fr[0]);
    match decode_stream(&model, &forged, &mut out) {
        Err(RansError::Corrupt {
            fault: RansFault::ValueTooLarge { value },
            ..
        }) => assert!(value > 65535),
        other => panic!("expected ValueTooLarge, got {other:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Random frames round-trip with a model fitted to them.
    #[test]
    fn random_frames_round_trip(
        len in 1usize..300,
        mean in 0.0f64..40.0,
        seed in any::<u64>(),
        contexts in 1u8..=16,
        literals in 1u8..=64,
    ) {
        let mut rng = Rng(seed | 1);
        let fr: Vec<Vec<u16>> = (0..3)
            .map(|_| (0..len).map(|p| rng.poisson(mean * (p % 7) as f64 / 3.0)).collect())
            .collect();
        let p = ModelParams { contexts, literals, ..base() };
        let model = fit(&fr, len, &p);
        round_trip_all(&model, &fr);
    }

    /// Bit flips and truncations never panic; an accepted stream decodes to exactly the original
    /// or to a frame that re-encodes to the very same bytes.
    #[test]
    fn damaged_streams_never_panic(
        seed in any::<u64>(),
        flips in prop::collection::vec((any::<usize>(), 0u8..8), 0..4),
        cut in any::<usize>(),
        do_cut in any::<bool>(),
    ) {
        let fr = frames(13, 17, 1, 3.0 + (seed % 5) as f64, seed);
        let model = fit(&fr, 13 * 17, &base());
        let enc = encode_stream(&model, &fr[0]).unwrap();
        let mut bad = enc.clone();
        for (at, bit) in flips {
            let i = at % bad.len();
            bad[i] ^= 1 << bit;
        }
        if do_cut {
            bad.truncate(cut % (bad.len() + 1));
        }
        let mut out = vec![0u16; 13 * 17];
        if decode_stream(&model, &bad, &mut out).is_ok() {
            if bad == enc {
                prop_assert_eq!(&out, &fr[0]);
            } else {
                // A different stream that passes every check must be that frame's encoding.
                prop_assert_eq!(&encode_stream(&model, &out).unwrap(), &bad);
            }
        }
        let mut count = 0usize;
        let _ = decode_stream_with(&model, &bad, |_, _| count += 1);
        prop_assert!(count <= 13 * 17);
    }

    /// Arbitrary bytes as a stream: never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        let model = tiny_model();
        let mut out = [0u16; 32];
        let _ = decode_stream(&model, &bytes, &mut out);
        let _ = CountsModel::from_bytes(&bytes);
    }
}

#[test]
fn symbol_of_covers_u16() {
    for v in 0..=u16::MAX as u32 {
        let (s, nb, e) = symbol_of(v, 32).unwrap();
        let back = if s < 32 { s } else { 32 - 1 + (1 << nb) + e };
        assert_eq!(back, v);
        assert!(nb < 16 && e < (1 << nb).max(1));
    }
}

/// Frames whose halo changes by ±50 % from frame to frame (like the reference acquisition's
/// `1 + 0.5·ph`), so the frame statistic separates them into table sets.
fn varying_frames(ny: usize, nx: usize, n: usize, peak: f64, seed: u64) -> Vec<Vec<u16>> {
    disk_frames((ny, nx), n, peak, seed, |i| {
        1.0 + 0.5 * (i as f64 * 0.7).cos()
    })
}

fn header_u32(stream: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(stream[at..at + 4].try_into().unwrap())
}

#[test]
fn round_trip_with_one_and_several_table_sets() {
    let fr = varying_frames(48, 48, 24, 30.0, 51);
    for rule in [ContextRule::Quantiles, ContextRule::LogBins] {
        for t in [1u8, 2, 4, 8] {
            let p = ModelParams {
                table_sets: t,
                context_rule: rule,
                ..base()
            };
            let model = fit(&fr, 48 * 48, &p);
            assert_eq!(model.table_sets(), t);
            assert_eq!(model.thresholds().len(), t as usize - 1);
            assert!(model.thresholds().windows(2).all(|w| w[0] <= w[1]));
            assert!(model.split() <= model.contexts());
            assert_eq!(model.freq().len(), t as usize * 8 * 48);
            round_trip_all(&model, &fr);
            let mut sets = std::collections::BTreeSet::new();
            for f in &fr {
                let enc = encode_stream(&model, f).unwrap();
                let ts = header_u32(&enc, 8);
                assert!(ts < u32::from(t));
                assert_eq!(header_u32(&enc, 12), 0);
                // The stored set is the one the documented rule gives (recomputed here).
                let stat: u64 = f
                    .iter()
                    .zip(model.ctx_map())
                    .filter(|&(_, &c)| c < model.split())
                    .map(|(&v, _)| u64::from(v))
                    .sum();
                let set = model.thresholds().iter().filter(|&&q| q <= stat).count();
                assert_eq!(ts as usize, set);
                sets.insert(ts);
            }
            if t == 1 {
                assert_eq!(model.split(), 0);
                assert_eq!(sets.len(), 1);
            } else {
                // The halo varies: every set is used (quantile thresholds over 24 frames).
                assert!(model.split() > 0 && model.split() < 8, "{}", model.split());
                assert_eq!(sets.len(), t as usize, "{rule:?} T={t}");
            }
        }
    }
}

#[test]
fn fixed_split_round_trips() {
    let fr = varying_frames(24, 24, 8, 5.0, 56);
    for split in [0u8, 1, 8, 200] {
        let p = ModelParams {
            table_sets: 2,
            split: SplitRule::Classes(split),
            ..base()
        };
        let model = fit(&fr, 576, &p);
        assert_eq!(model.split(), split.min(8));
        round_trip_all(&model, &fr);
    }
}

#[test]
fn table_sets_make_varying_frames_smaller() {
    let fr = varying_frames(64, 64, 40, 60.0, 52);
    let size = |t: u8| {
        let p = base_with(|m| m.table_sets = t);
        let model = fit(&fr, 64 * 64, &p);
        round_trip_all(&model, &fr)
    };
    let (one, four) = (size(1), size(4));
    assert!(four < one, "T=4 {four} B, T=1 {one} B");
}

#[test]
fn staged_fit_equals_fit() {
    let fr = varying_frames(40, 36, 30, 12.0, 53);
    for (t, every, floor, rule) in [
        (
            4u8,
            3usize,
            FloorPolicy::SeenPlusOne,
            ContextRule::Quantiles,
        ),
        (3, 1, FloorPolicy::AllSymbols, ContextRule::LogBins),
        (1, 2, FloorPolicy::SeenPlusOne, ContextRule::Quantiles),
    ] {
        let p = ModelParams {
            table_sets: t,
            sample_every: every,
            floor,
            context_rule: rule,
            contexts: 6,
            literals: 20,
            ..base()
        };
        let len = 40 * 36;
        let sampled: Vec<&Vec<u16>> = fr.iter().step_by(every).collect();
        let mut sums = vec![0u64; len];
        for f in &sampled {
            for (s, &v) in sums.iter_mut().zip(f.iter()) {
                *s += u64::from(v);
            }
        }
        let ContextFit { ctx_map, split } = fit_contexts(&sums, sampled.len() as u64, &p).unwrap();
        let stats: Vec<u64> = sampled
            .iter()
            .map(|f| frame_statistic(&ctx_map, split, f))
            .collect();
        let thresholds = fit_thresholds(&stats, t);
        let mut hist = vec![0u64; t as usize * 6 * 36];
        for (f, &st) in sampled.iter().zip(&stats) {
            let ts = table_set_of(&thresholds, st);
            histogram_add(&mut hist, &ctx_map, ts, 6, 20, f);
        }
        assert_eq!(hist.iter().sum::<u64>(), (sampled.len() * len) as u64);
        let freq = fit_freq(&hist, t, 6, 20, floor).unwrap();
        let staged = CountsModel::from_parts(20, 6, t, split, ctx_map, thresholds, freq).unwrap();
        let whole = fit(&fr, len, &p);
        assert_eq!(staged, whole);
        assert_eq!(staged.to_bytes(), whole.to_bytes());
    }
}

#[test]
fn all_symbols_floor_makes_every_u16_codable() {
    let fr = varying_frames(32, 32, 6, 2.0, 54);
    for t in [1u8, 4] {
        let p = ModelParams {
            table_sets: t,
            floor: FloorPolicy::AllSymbols,
            ..base()
        };
        let model = fit(&fr, 1024, &p);
        assert!(model.freq().iter().all(|&f| f >= 1));
        // 65535 in a dark corner pixel (never above a few counts in the sample), large values
        // elsewhere; also one frame of all 65535.
        let mut odd = fr[0].clone();
        odd[0] = 65535;
        odd[1] = 40000;
        odd[33] = 1000;
        odd[512 + 16] = 129;
        round_trip_all(
            &model,
            &[
                odd.clone(),
                vec![65535; 1024],
                (0..1024).map(|v| v * 64).collect(),
            ],
        );
        // The default floor cannot code it.
        let seen = fit(&fr, 1024, &base_with(|m| m.table_sets = t));
        assert!(matches!(
            encode_stream(&seen, &odd),
            Err(RansError::Uncodable {
                pixel: 0,
                value: 65535,
                ..
            })
        ));
    }
}

/// A hand-built two-set model: 32 pixels, K = 2, C = 2 (pixel p in class p mod 2), split 1
/// (the statistic sums the even pixels), threshold 3. Set 0, class 0: symbols 0/1/2/4 with
/// 2048/1024/512/512; set 1, class 0: 1024/2048/512/512; class 1 in both sets: symbol 0 only.
fn two_set_model(same_rows: bool) -> CountsModel {
    let s = 18;
    let mut freq = vec![0u16; 4 * s];
    for (ts, (f0, f1)) in [(2048u16, 1024u16), (1024, 2048)].into_iter().enumerate() {
        let (f0, f1) = if same_rows { (2048, 1024) } else { (f0, f1) };
        let r = 2 * ts * s;
        freq[r] = f0;
        freq[r + 1] = f1;
        freq[r + 2] = 512;
        freq[r + 4] = 512;
        freq[r + s] = 4096;
    }
    let ctx = (0..32).map(|p| (p % 2) as u8).collect();
    CountsModel::from_parts(2, 2, 2, 1, ctx, vec![3], freq).unwrap()
}

#[test]
fn stream_table_set_on_a_hand_made_example() {
    let model = two_set_model(false);
    // Statistic 1 (< 3): set 0. Lane 0 codes symbol 1 (f 1024, cu 2048): 64·4096 + 2048;
    // other even lanes symbol 0 (f 2048): 32·4096; odd lanes (f 4096): L.
    let mut a = [0u16; 32];
    a[0] = 1;
    let enc = encode_stream(&model, &a).unwrap();
    let mut hand = vec![0u8; 16];
    for j in 0..32u32 {
        let st: u32 = match j {
            0 => 64 * 4096 + 2048,
            _ if j % 2 == 0 => 32 * 4096,
            _ => 65536,
        };
        hand.extend_from_slice(&st.to_le_bytes());
    }
    assert_eq!(enc, hand);
    // Statistic 3 (≥ 3): set 1. Symbol 1 is now f 2048, cu 1024: 32·4096 + 1024; symbol 0 is
    // f 1024: 64·4096.
    let mut b = [0u16; 32];
    b[0] = 1;
    b[2] = 1;
    b[4] = 1;
    let enc = encode_stream(&model, &b).unwrap();
    let mut hand = vec![0u8; 16];
    hand[8] = 1; // table_set
    for j in 0..32u32 {
        let st: u32 = match j {
            0 | 2 | 4 => 32 * 4096 + 1024,
            _ if j % 2 == 0 => 64 * 4096,
            _ => 65536,
        };
        hand.extend_from_slice(&st.to_le_bytes());
    }
    assert_eq!(enc, hand);
    let mut out = [0u16; 32];
    decode_stream(&model, &enc, &mut out).unwrap();
    assert_eq!(out, b);
}

#[test]
fn corrupt_table_set_and_reserved_are_rejected() {
    let model = two_set_model(true);
    let mut a = [0u16; 32];
    a[0] = 1; // statistic 1: set 0
    let enc = encode_stream(&model, &a).unwrap();
    assert_eq!(header_u32(&enc, 8), 0);
    // `patched(stream, at, v)`: the stream with byte `at` set to `v`, decoded.
    let patched = |stream: &[u8], at: usize, v: u8| {
        let mut bad = stream.to_vec();
        bad[at] = v;
        decode_stream(&model, &bad, &mut [0u16; 32])
    };
    // Both sets have the same rows, so a stream claiming set 1 decodes cleanly to the same
    // frame: only the final statistic check catches it.
    assert_eq!(
        patched(&enc, 8, 1),
        Err(RansError::Corrupt {
            pixel: 32,
            fault: RansFault::TableSetMismatch {
                stored: 1,
                expected: 0,
                statistic: 1
            }
        })
    );
    assert_eq!(
        patched(&enc, 8, 2),
        Err(RansError::Corrupt {
            pixel: 0,
            fault: RansFault::TableSetOutOfRange {
                table_set: 2,
                table_sets: 2
            }
        })
    );
    // table_set 2^31
    assert!(matches!(
        patched(&enc, 11, 0x80),
        Err(RansError::Corrupt {
            fault: RansFault::TableSetOutOfRange { .. },
            ..
        })
    ));
    assert_eq!(
        patched(&enc, 14, 7),
        Err(RansError::Corrupt {
            pixel: 0,
            fault: RansFault::NonZeroReserved { value: 7 << 16 }
        })
    );
    // A set-1 frame (statistic 3) stored as set 0 is also a mismatch.
    let mut b = a;
    b[2] = 2;
    let enc = encode_stream(&model, &b).unwrap();
    assert_eq!(header_u32(&enc, 8), 1);
    assert!(matches!(
        patched(&enc, 8, 0),
        Err(RansError::Corrupt {
            fault: RansFault::TableSetMismatch {
                stored: 0,
                expected: 1,
                statistic: 3
            },
            ..
        })
    ));
    // With different rows per set, a wrong set fails some check too.
    let model = two_set_model(false);
    let mut bad = encode_stream(&model, &b).unwrap();
    bad[8] = 0;
    assert!(decode_stream(&model, &bad, &mut [0u16; 32]).is_err());
}

#[test]
fn multi_set_model_bytes_round_trip_and_corruption_is_rejected() {
    let fr = varying_frames(20, 30, 12, 8.0, 55);
    let p = ModelParams {
        table_sets: 3,
        contexts: 5,
        literals: 10,
        ..base()
    };
    let model = fit(&fr, 600, &p);
    let b = model.to_bytes();
    let s = 26;
    assert_eq!(b.len(), 20 + 600 + 8 * 2 + 2 * 3 * 5 * s);
    assert_eq!(&b[..8], b"QRANSM\0\x02");
    assert_eq!(&b[8..14], &[12, 10, 16, 5, 32, 3]);
    assert_eq!(b[14], model.split());
    assert_eq!(b[15], 0);
    assert_eq!(&b[20..620], model.ctx_map());
    let t0 = u64::from_le_bytes(b[620..628].try_into().unwrap());
    let t1 = u64::from_le_bytes(b[628..636].try_into().unwrap());
    assert_eq!(vec![t0, t1], model.thresholds());
    assert!(t0 <= t1 && t0 > 0);
    let back = CountsModel::from_bytes(&b).unwrap();
    assert_eq!(back, model);
    assert_eq!(back.to_bytes(), b);
    round_trip_all(&back, &fr);

    // Decreasing thresholds.
    let mut c = b.clone();
    c[620..628].copy_from_slice(&(t1 + 1).to_le_bytes());
    assert!(matches!(
        CountsModel::from_bytes(&c),
        Err(RansError::BadModel {
            what: "thresholds non-decreasing",
            offset: 628,
            ..
        })
    ));
    // split > C.
    let mut c = b.clone();
    c[14] = 6;
    assert!(CountsModel::from_bytes(&c).is_err());
    // split = C is allowed (every pixel in the statistic).
    let mut c = b.clone();
    c[14] = 5;
    assert!(CountsModel::from_bytes(&c).is_ok());
    // T changed: the length no longer fits.
    for t in [2u8, 4] {
        let mut c = b.clone();
        c[13] = t;
        assert!(CountsModel::from_bytes(&c).is_err());
    }
    // A row sum in the last set.
    let mut c = b.clone();
    let last = b.len() - 2;
    c[last] ^= 1;
    assert!(matches!(
        CountsModel::from_bytes(&c),
        Err(RansError::BadModel {
            what: "freq row sum",
            ..
        })
    ));

    // from_parts validates the same things.
    let parts = |t: u8, split: u8, thr: Vec<u64>, nfreq: usize| {
        let mut freq = vec![0u16; nfreq];
        for r in freq.chunks_exact_mut(s) {
            r[0] = 4096;
        }
        CountsModel::from_parts(10, 5, t, split, vec![0; 600], thr, freq)
    };
    assert!(parts(3, 2, vec![1, 2], 3 * 5 * s).is_ok());
    assert!(parts(3, 2, vec![1], 3 * 5 * s).is_err());
    assert!(parts(3, 2, vec![2, 1], 3 * 5 * s).is_err());
    assert!(parts(3, 6, vec![1, 2], 3 * 5 * s).is_err());
    assert!(parts(3, 2, vec![1, 2], 2 * 5 * s).is_err());
    assert!(parts(1, 1, vec![], 5 * s).is_err());
    assert!(parts(9, 0, vec![0; 8], 9 * 5 * s).is_err());
}
