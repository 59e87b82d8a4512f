//! Model fitting, staged (module doc of `rans`): [`ModelParams`] and its rules, then context
//! classes and `split` ([`fit_contexts`]), thresholds ([`fit_thresholds`]), histograms
//! ([`histogram_add`]) and frequency quantisation ([`fit_freq`]). Called by
//! [`CountsModel::fit`](super::CountsModel::fit) and by the GPU fit, which computes the big sums
//! itself and finishes with these functions.

use super::{check_dims, symbol_u16, RansError, BUCKETS, PROB_BITS, PROB_SCALE};

/// Parameters of [`CountsModel::fit`] (and of the staged fit functions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelParams {
    /// Context classes `C`, 1..=16 (default 16).
    pub contexts: u8,
    /// Literal symbols `K`, 1..=128 (default 64): values `0..K` are coded directly.
    pub literals: u8,
    /// Table sets `T`, 1..=8 (default 4; frame classes with their own tables, module doc).
    pub table_sets: u8,
    /// Probability bits; must be 12 (kept as a field so files and the GPU can check it).
    pub prob_bits: u8,
    /// Use every `sample_every`-th frame (the first always) to fit; ≥ 1 (1 = all).
    pub sample_every: usize,
    /// How pixels are split into classes (default [`ContextRule::LogBins`]; fit only, not
    /// stored: the model keeps `ctx_map`).
    pub context_rule: ContextRule,
    /// How the frame statistic's `split` is chosen (fit only; the model stores `split`).
    pub split: SplitRule,
    /// Which symbols get a non-zero frequency (default [`FloorPolicy::AllSymbols`]: the model
    /// can code every u16 frame).
    pub floor: FloorPolicy,
}

/// How [`fit_contexts`] assigns context classes from the per-pixel sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ContextRule {
    /// Classes of (about) equal pixel count: rank quantiles of the mean (docs/formats.md §5.3).
    Quantiles,
    /// Classes of equal width in `ln(mean)` between its minimum and maximum (default). Gives the
    /// few bright (bright-field) pixels classes of their own: with C = 16, K = 64, T = 4 on the
    /// reference acquisition the streams are 6.6% (20k e⁻/frame) and 2.8% (200k) smaller than
    /// with `Quantiles`, 0.3% larger at 1M.
    #[default]
    LogBins,
}

/// How [`fit_contexts`] chooses `split` (the classes whose values make the frame statistic).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SplitRule {
    /// Every class below the first one holding a bright pixel (module doc); 0 when `T = 1`.
    #[default]
    Auto,
    /// Exactly this many classes (clamped to `C`; 0 when `T = 1`).
    Classes(u8),
}

/// Which symbols [`fit_freq`] gives a non-zero frequency.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FloorPolicy {
    /// Symbols seen in the sample, plus one more, in every row (format v1 behaviour): cheapest
    /// when the model is fitted on all the frames it will code, but a frame with a larger value
    /// than the sample had is an encode error.
    SeenPlusOne,
    /// Every symbol of every row ≥ 1 (default): every u16 value codable at every pixel. For
    /// models fitted on a sample of the frames they will code. Measured cost against
    /// `SeenPlusOne` (reference acquisition, C = 16, T = 4, LogBins): K = 32: +1.5% at 20k
    /// e⁻/frame, +0.2% at 200k; K = 64: +3.5% / +0.2%; K = 128: +7.8% / +0.7%; ≤ +0.1% at 1M.
    #[default]
    AllSymbols,
}

impl Default for ModelParams {
    fn default() -> Self {
        // Measured on the reference acquisition (qem-bench/examples/rans_ratio.rs, 4000 frames
        // across the scan, model fitted on them): size / bitshuffle-LZ4 = 0.463 (20k e⁻/frame),
        // 0.587 (200k), 0.746 (1M). The decode tables are T·C·4096 B = 256 KB (one set: 64 KB).
        ModelParams {
            contexts: 16,
            literals: 64,
            table_sets: 4,
            prob_bits: 12,
            sample_every: 1,
            context_rule: ContextRule::LogBins,
            split: SplitRule::Auto,
            floor: FloorPolicy::AllSymbols,
        }
    }
}

impl ModelParams {
    /// Check every field's range.
    pub fn validate(&self) -> Result<(), RansError> {
        let bad = |what, found: u64, rule| Err(RansError::BadParam { what, found, rule });
        check_dims(self.literals, self.contexts, self.table_sets)?;
        if u32::from(self.prob_bits) != PROB_BITS {
            return bad("prob_bits", self.prob_bits.into(), "must be 12");
        }
        if self.sample_every == 0 {
            return bad("sample_every", 0, "must be >= 1");
        }
        Ok(())
    }
}

/// Result of [`fit_contexts`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextFit {
    /// Context class per pixel, raster order, darkest class 0.
    pub ctx_map: Vec<u8>,
    /// Classes `< split` make the frame statistic (0 when `T = 1`).
    pub split: u8,
}

/// Fit stage 1: context classes and `split` from the per-pixel sums of `sampled_frames`
/// frames (module doc). Uses `params.contexts`, `context_rule`, `table_sets` and `split`.
pub fn fit_contexts(
    pixel_sums: &[u64],
    sampled_frames: u64,
    params: &ModelParams,
) -> Result<ContextFit, RansError> {
    params.validate()?;
    let n = pixel_sums.len();
    if n == 0 || n > u32::MAX as usize {
        return Err(RansError::BadParam {
            what: "frame_len",
            found: n as u64,
            rule: "must be 1..=u32::MAX",
        });
    }
    if sampled_frames == 0 {
        return Err(RansError::NoFrames);
    }
    let nc = params.contexts as usize;
    let sums = pixel_sums;
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&p| (sums[p], p));
    let ctx_map: Vec<u8> = match params.context_rule {
        ContextRule::Quantiles => {
            // Rank quantiles of the per-pixel sum (∝ mean, same order as log(mean)).
            let thresholds: Vec<u64> = (1..nc).map(|i| sums[order[i * n / nc]]).collect();
            sums.iter()
                .map(|&m| thresholds.iter().filter(|&&q| q <= m).count() as u8)
                .collect()
        }
        ContextRule::LogBins => {
            // Equal-width bins of ln((sum + 0.5) / sampled) between its minimum and maximum.
            let lm: Vec<f64> = sums
                .iter()
                .map(|&m| ((m as f64 + 0.5) / sampled_frames as f64).ln())
                .collect();
            let lo = lm.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = lm.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let width = (hi - lo) / nc as f64;
            lm.iter()
                .map(|&l| {
                    if width > 0.0 {
                        (((l - lo) / width) as usize).min(nc - 1) as u8
                    } else {
                        0
                    }
                })
                .collect()
        }
    };
    let split = if params.table_sets <= 1 {
        0
    } else {
        match params.split {
            SplitRule::Classes(k) => k.min(params.contexts),
            SplitRule::Auto => {
                let reference = sums[order[n - 1 - n / 256]];
                if reference == 0 {
                    params.contexts
                } else {
                    sums.iter()
                        .zip(&ctx_map)
                        .filter(|&(&s, _)| u128::from(s) * 4 >= u128::from(reference))
                        .map(|(_, &c)| c)
                        .min()
                        .unwrap_or(params.contexts)
                }
            }
        }
    };
    Ok(ContextFit { ctx_map, split })
}

/// The frame statistic: the sum of the values of the pixels whose class is `< split`.
/// Pixels beyond the shorter of `ctx_map` and `frame` are ignored.
pub fn frame_statistic(ctx_map: &[u8], split: u8, frame: &[u16]) -> u64 {
    if split == 0 {
        return 0;
    }
    ctx_map
        .iter()
        .zip(frame)
        .filter(|&(&c, _)| c < split)
        .map(|(_, &v)| u64::from(v))
        .sum()
}

/// Fit stage 2: `table_sets − 1` thresholds, the quantiles of the sampled frames' statistics
/// (module doc). Empty for `table_sets ≤ 1`.
pub fn fit_thresholds(stats: &[u64], table_sets: u8) -> Vec<u64> {
    let t = table_sets.max(1) as usize;
    if stats.is_empty() {
        return vec![u64::MAX; t - 1];
    }
    let mut sorted = stats.to_vec();
    sorted.sort_unstable();
    let m = sorted.len();
    (1..t).map(|i| sorted[i * m / t]).collect()
}

/// The table set of a statistic: how many thresholds are `≤ stat`.
pub fn table_set_of(thresholds: &[u64], stat: u64) -> u8 {
    thresholds.iter().filter(|&&q| q <= stat).count() as u8
}

/// Fit stage 3: add one frame's symbols to `hist` (layout `[T][C][S]`, `u64` counts) in the rows
/// of `table_set`. Pixels beyond the shorter of `ctx_map` and `frame` are ignored.
///
/// # Panics
/// When `hist` is shorter than `(table_set + 1)·C·S` or a class is `≥ contexts` (caller bugs).
pub fn histogram_add(
    hist: &mut [u64],
    ctx_map: &[u8],
    table_set: u8,
    contexts: u8,
    literals: u8,
    frame: &[u16],
) {
    let k = u32::from(literals);
    let s = literals as usize + BUCKETS;
    let nc = contexts as usize;
    let base = table_set as usize * nc * s;
    assert!(
        hist.len() >= base + nc * s,
        "histogram_add: hist has {} entries, table set {table_set} needs {}",
        hist.len(),
        base + nc * s
    );
    let set = &mut hist[base..base + nc * s];
    for (&c, &v) in ctx_map.iter().zip(frame) {
        assert!(
            c < contexts,
            "histogram_add: class {c} >= contexts {contexts}"
        );
        set[c as usize * s + symbol_u16(v, k)] += 1;
    }
}

/// Fit stage 4: quantise `hist` (`[T][C][S]` counts) to frequency rows summing to 4096 with
/// the floor `floor` (module doc). Output layout `[T][C][S]`, as [`CountsModel::from_parts`]
/// takes it.
pub fn fit_freq(
    hist: &[u64],
    table_sets: u8,
    contexts: u8,
    literals: u8,
    floor: FloorPolicy,
) -> Result<Vec<u16>, RansError> {
    check_dims(literals, contexts, table_sets)?;
    let s = literals as usize + BUCKETS;
    let rows = table_sets as usize * contexts as usize;
    if hist.len() != rows * s {
        return Err(RansError::BadModel {
            what: "histogram entries",
            offset: 0,
            expected: (rows * s) as u64,
            found: hist.len() as u64,
        });
    }
    let floor_to = match floor {
        FloorPolicy::AllSymbols => s - 1,
        FloorPolicy::SeenPlusOne => {
            let s_max = (0..s)
                .rev()
                .find(|&sym| (0..rows).any(|r| hist[r * s + sym] > 0))
                .unwrap_or(0);
            (s_max + 1).min(s - 1)
        }
    };
    let mut freq = Vec::with_capacity(rows * s);
    for row in hist.chunks_exact(s) {
        freq.extend(quantise_row(row, floor_to));
    }
    Ok(freq)
}

/// Quantise one histogram row to frequencies summing to 4096: `max(⌊count·4096/total⌋, floor)`
/// where `floor` is 1 for seen symbols and symbols `≤ floor_to`, else 0; then adjust the largest
/// frequency (lowest symbol on ties) until the sum is 4096.
pub(super) fn quantise_row(hist: &[u64], floor_to: usize) -> Vec<u16> {
    let total: u64 = hist.iter().sum();
    let min: Vec<u32> = hist
        .iter()
        .enumerate()
        .map(|(sym, &h)| u32::from(h > 0 || sym <= floor_to))
        .collect();
    let mut f: Vec<u32> = hist
        .iter()
        .zip(&min)
        .map(|(&h, &m)| {
            let q = if total == 0 {
                0
            } else {
                (u128::from(h) * u128::from(PROB_SCALE) / u128::from(total)) as u32
            };
            q.max(m)
        })
        .collect();
    let argmax = |f: &[u32], pred: &dyn Fn(usize) -> bool| -> Option<usize> {
        let mut best: Option<usize> = None;
        for i in 0..f.len() {
            if pred(i) && best.is_none_or(|b| f[i] > f[b]) {
                best = Some(i);
            }
        }
        best
    };
    loop {
        let sum: u32 = f.iter().sum();
        if sum == PROB_SCALE {
            break;
        }
        if sum < PROB_SCALE {
            // Give the shortfall to the most frequent symbol (symbol 0 when the row is empty).
            let i = argmax(&f, &|_| true).unwrap_or(0);
            let i = if f[i] == 0 { 0 } else { i };
            f[i] += PROB_SCALE - sum;
        } else {
            let excess = sum - PROB_SCALE;
            let Some(i) = argmax(&f, &|i| f[i] > min[i]) else {
                break; // unreachable: at most 144 symbols with floor 1 < 4096
            };
            f[i] -= excess.min(f[i] - min[i]);
        }
    }
    f.into_iter().map(|x| x as u16).collect()
}
