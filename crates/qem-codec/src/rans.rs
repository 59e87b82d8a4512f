//! The counts codec ("ANS-4D", formats.md §5.3): 32-lane interleaved rANS over electron counts,
//! with a static per-dataset model of per-pixel context classes. This CPU code is the
//! **specification** the GPU encoder and decoder must match byte for byte.
//!
//! # Parameters (fixed)
//!
//! * state `x`: 32 bits, normalised interval `[L, 2^32)` with `L = 2^16` ([`STATE_LOWER`]);
//! * renormalisation: one 16-bit word at a time, at most one per symbol;
//! * probabilities: `PROB_BITS = 12`, every frequency row sums to `M = 4096`;
//! * `LANES = 32` interleaved states; lane `j` at step `t` codes pixel `p = 32·t + j`;
//! * symbols: `K` literal symbols (`ModelParams::literals`, default 32) then `NB = 16`
//!   exp-Golomb bucket symbols ([`BUCKETS`]), `S = K + 16` symbols in all.
//!
//! # Symbol mapping
//!
//! A value `v < K` is the symbol `v` with no extra bits. Otherwise `u = v − K + 1`,
//! `nb = ⌊log2 u⌋`, the symbol is `K + nb` and the `nb` extra bits are `u − 2^nb`, stored raw.
//! The decoder rebuilds `v = K − 1 + 2^nb + extra`. With `NB = 16` the largest codable value is
//! `K − 1 + 2^16 − 1 = K + 65534` ([`CountsModel::max_value`]), so **every u16 value has a
//! symbol** for any `K ≥ 1`. Whether it can be *coded* depends on its symbol having a non-zero
//! frequency in the pixel's context; if not, [`encode_stream`] fails naming the pixel and value.
//!
//! # rANS step (exact arithmetic)
//!
//! For pixel `p` of context `c = ctx_map[p]`, symbol `s` with frequency `f = freq[c][s]` and
//! cumulative frequency `cu = Σ_{s' < s} freq[c][s']`:
//!
//! * encode (state `x` of lane `p mod 32`): if `x ≥ (2^(16−12) << 16) · f = 2^20 · f`, emit the
//!   word `x & 0xFFFF` and set `x ← x >> 16`; then `x ← (x / f) · 4096 + (x mod f) + cu`;
//! * decode: `slot = x & 4095`, `s` is the symbol with `cu ≤ slot < cu + f`,
//!   `x ← f · (x >> 12) + slot − cu`; if `x < 2^16`, `x ← (x << 16) | next_word`.
//!
//! The encoder starts every lane at `x = L`, processes steps `t` from last to first and, within
//! a step, lanes `j` from 31 down to 0 (lanes with `p ≥ n` are skipped: their state does not
//! change), appending emitted words to a list. The list is **reversed** at the end, so the
//! decoder, processing steps ascending and lanes ascending, reads the words front to back: the
//! words of one step are contiguous, in ascending lane order among the lanes that need one (the
//! GPU's `__ballot_sync` + `__popc(mask & lanemask_lt)` fetch, formats.md §5.4).
//!
//! Extra bits are written in raster pixel order (= ascending `(t, j)`), LSB-first: the extra
//! bits of a pixel occupy stream bit positions `bitpos .. bitpos + nb`, value bit `i` at
//! position `bitpos + i`, and bit position `b` is bit `b mod 32` of extra word `b / 32`.
//!
//! # Stream byte layout (one stream = one frame; all little-endian)
//!
//! ```text
//! offset            size                 field
//! 0                 4                    n_words      u32: number of 16-bit renormalisation words
//! 4                 4                    n_extra_bits u32: number of raw extra bits
//! 8                 128                  state[32]    u32: final encoder states, lane 0 first
//! 136               2·n_words            words[]      u16: renormalisation words, decoder order
//! 136+2·n_words     2·(n_words mod 2)    pad          u16 = 0 so the extra words are 4-aligned
//! …                 4·⌈n_extra_bits/32⌉  extra[]      u32: extra bits, LSB-first, raster order
//! ```
//!
//! The stream length is exactly `136 + 4·⌈n_words/2⌉ + 4·⌈n_extra_bits/32⌉` bytes; nothing
//! may follow. The decoder additionally requires: the pad word and the unused high bits of the
//! last extra word are zero; `n_words ≤ n` and `n_extra_bits ≤ 15·n` for `n` pixels; every
//! initial state is in `[L, 2^32)`; no word or bit is read past its count; and at the end all 32
//! states equal `L`, exactly `n_words` words and `n_extra_bits` bits were consumed. These checks
//! detect corruption without a checksum (formats.md §5.4). The 8-byte header is our choice
//! over a separate index: it keeps a stream self-describing (a dataset index may repeat the two
//! counts together with the stream's byte offset).
//!
//! # Model byte layout ([`CountsModel::to_bytes`], all little-endian)
//!
//! ```text
//! 0    8               magic  "QRANSM\0\x01"
//! 8    1               prob_bits (= 12)
//! 9    1               K      literal symbols, 1..=128
//! 10   1               NB     bucket symbols (= 16)
//! 11   1               C      context classes, 1..=16
//! 12   1               lanes  (= 32)
//! 13   3               reserved, zero
//! 16   4               frame_len  u32 pixels per frame (≥ 1)
//! 20   frame_len       ctx_map    u8 per pixel, raster order, each < C
//! …    2·C·(K+NB)      freq       u16[C][K+NB], each row sums to 4096
//! ```
//!
//! # Model fitting policy ([`CountsModel::fit`])
//!
//! Over the sampled frames (every `sample_every`-th, starting with the first): the per-pixel
//! sum gives the mean pattern. With [`ContextRule::Quantiles`] (default) pixels are ranked by it
//! (ties by pixel index) and split into `C` classes of equal size by rank quantiles, then every
//! pixel whose sum equals a quantile boundary's sum joins the boundary's class, so equal means
//! always share a class (the same as quantiles of `log(mean)`, as the log is monotone). With
//! [`ContextRule::LogBins`] the classes are equal-width bins of `ln((sum + 0.5) / frames)`.
//! Classes may end up empty. The rule only affects fitting: the stored `ctx_map` is the model. A histogram of
//! symbols is taken per class and quantised to 4096 with `f = max(⌊count·4096/total⌋, floor)`,
//! then the largest frequencies are adjusted (lowest symbol first on ties) until the row sums to
//! 4096. **Floor policy:** let `s_max` be the largest symbol seen in *any* class; every symbol
//! `0 ..= min(s_max + 1, S − 1)` gets a frequency ≥ 1 in *every* class, so values seen anywhere
//! in the sample, plus one more literal or one more bucket size, are codable at every pixel.
//! Symbols above that get frequency 0 (the simulation showed flooring all symbols costs ~20% at
//! the lowest doses) and a value mapping to one is an encode error
//! ([`RansError::Uncodable`]).
//!
//! # Not yet implemented (TODO)
//!
//! * `frames_per_stream G > 1` (one stream over several frames, for very sparse data) and
//!   `bands > 1`: both are options of formats.md §5.3; every stream here is one whole frame.
//! * u32 sources: [`symbol_of`] already maps any `u32` and rejects values above
//!   [`CountsModel::max_value`], but there is no `encode_stream` over `&[u32]` yet.
//! * `RansError` is its own error type because `CodecError` (error.rs) is owned elsewhere; it
//!   can be folded into `CodecError` as one variant.

use std::fmt;

/// Interleaved lanes (states) per stream: one per GPU warp lane.
pub const LANES: usize = 32;
/// Probability precision: frequency rows sum to `1 << PROB_BITS`.
pub const PROB_BITS: u32 = 12;
/// Sum of every frequency row (`M = 4096`).
pub const PROB_SCALE: u32 = 1 << PROB_BITS;
/// Lower bound `L` of the normalised state interval `[L, 2^32)`; also the encoder's start state
/// and the decoder's required final state.
pub const STATE_LOWER: u32 = 1 << 16;
/// Bucket (exp-Golomb) symbols after the literals: bucket `nb` holds `nb` raw extra bits.
pub const BUCKETS: usize = 16;
/// Most context classes a model may have.
pub const MAX_CONTEXTS: usize = 16;
/// Most literal symbols a model may have (so `K + NB` fits a `u8` decode table).
pub const MAX_LITERALS: usize = 128;
/// Bytes of a stream before the words: `n_words`, `n_extra_bits`, 32 states.
pub const STREAM_HEADER_BYTES: usize = 8 + 4 * LANES;
/// Magic of a serialised model.
pub const MODEL_MAGIC: [u8; 8] = *b"QRANSM\0\x01";
/// Bytes of the fixed part of a serialised model (before `ctx_map`).
pub const MODEL_HEADER_BYTES: usize = 20;

/// Emit threshold factor: a word is emitted when `x ≥ RENORM_FACTOR · f` (`2^(16−12) << 16`).
const RENORM_FACTOR: u64 = ((STATE_LOWER as u64) >> PROB_BITS) << 16;

/// Why the counts codec refused a model, a frame or a stream.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RansError {
    /// A [`ModelParams`] field or a model dimension is out of range.
    #[error("rANS model: bad {what} {found}: {rule}")]
    BadParam {
        /// The field, e.g. `"contexts"`.
        what: &'static str,
        /// The value found.
        found: u64,
        /// The rule it breaks.
        rule: &'static str,
    },
    /// A serialised model or model part is malformed.
    #[error("rANS model table: {what} at byte {offset}: expected {expected}, found {found}")]
    BadModel {
        /// What is wrong, e.g. `"row sum of context 3"`.
        what: &'static str,
        /// Byte offset in the serialised model (0 when built from parts).
        offset: usize,
        /// Expected value.
        expected: u64,
        /// Value found.
        found: u64,
    },
    /// A frame or output buffer has the wrong number of pixels.
    #[error("rANS {what}: expected {expected} pixels, found {found}")]
    FrameLength {
        /// Which buffer, e.g. `"encode frame"`.
        what: &'static str,
        /// The model's frame length.
        expected: usize,
        /// The buffer's length.
        found: usize,
    },
    /// No frame was sampled when fitting a model.
    #[error("rANS model fit: no frames sampled")]
    NoFrames,
    /// A value the model cannot code (its symbol has frequency 0 in the pixel's context, or it
    /// is above [`CountsModel::max_value`]).
    #[error("rANS encode: pixel {pixel} value {value} (symbol {symbol}, context {context}) has no code in the model")]
    Uncodable {
        /// Pixel index in the frame (raster order).
        pixel: usize,
        /// The value.
        value: u32,
        /// Its symbol (`u32::MAX` when above the largest bucket).
        symbol: u32,
        /// The pixel's context class.
        context: u8,
    },
    /// The stream length does not match its header, or a header field is impossible.
    #[error("rANS stream: {what}: expected {expected}, found {found}")]
    StreamSize {
        /// Which field, e.g. `"stream bytes"` or `"n_words"`.
        what: &'static str,
        /// The expected value (or the limit).
        expected: u64,
        /// The value found.
        found: u64,
    },
    /// The stream's content is inconsistent (corrupt data).
    #[error("rANS stream corrupt at pixel {pixel}: {fault}")]
    Corrupt {
        /// Pixel being decoded (the pixel count when found at the end).
        pixel: usize,
        /// What was wrong.
        fault: RansFault,
    },
}

/// The specific inconsistency of a corrupt stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RansFault {
    /// A stored state is below `L`.
    StateOutOfRange {
        /// Lane.
        lane: usize,
        /// The state.
        state: u32,
    },
    /// A renormalisation word was needed but all `n_words` were consumed.
    WordsExhausted,
    /// Extra bits were needed past `n_extra_bits`.
    ExtraBitsExhausted,
    /// A decoded value is larger than `u16::MAX`.
    ValueTooLarge {
        /// The value.
        value: u32,
    },
    /// After the last pixel a lane's state is not `L`.
    FinalState {
        /// Lane.
        lane: usize,
        /// The state.
        state: u32,
    },
    /// Fewer words were consumed than the header says.
    WordsLeft {
        /// Words consumed.
        used: usize,
        /// `n_words`.
        total: usize,
    },
    /// Fewer extra bits were consumed than the header says.
    ExtraBitsLeft {
        /// Bits consumed.
        used: usize,
        /// `n_extra_bits`.
        total: usize,
    },
    /// The pad word or the unused bits of the last extra word are not zero.
    NonZeroPadding,
}

impl fmt::Display for RansFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            RansFault::StateOutOfRange { lane, state } => {
                write!(f, "state of lane {lane} is {state}, below 65536")
            }
            RansFault::WordsExhausted => write!(f, "renormalisation words exhausted"),
            RansFault::ExtraBitsExhausted => write!(f, "extra bits exhausted"),
            RansFault::ValueTooLarge { value } => write!(f, "value {value} above 65535"),
            RansFault::FinalState { lane, state } => {
                write!(f, "final state of lane {lane} is {state}, expected 65536")
            }
            RansFault::WordsLeft { used, total } => {
                write!(f, "{used} of {total} words consumed")
            }
            RansFault::ExtraBitsLeft { used, total } => {
                write!(f, "{used} of {total} extra bits consumed")
            }
            RansFault::NonZeroPadding => write!(f, "non-zero padding bits"),
        }
    }
}

/// Parameters of [`CountsModel::fit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelParams {
    /// Context classes `C`, 1..=16 (default 8).
    pub contexts: u8,
    /// Literal symbols `K`, 1..=128 (default 32): values `0..K` are coded directly.
    pub literals: u8,
    /// Probability bits; must be 12 (kept as a field so files and the GPU can check it).
    pub prob_bits: u8,
    /// Use every `sample_every`-th frame (the first always) to fit; ≥ 1 (default 1 = all).
    pub sample_every: usize,
    /// How pixels are split into classes (fit only; not stored: the model keeps `ctx_map`).
    pub context_rule: ContextRule,
}

/// How [`CountsModel::fit`] assigns context classes from the mean pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ContextRule {
    /// Classes of (about) equal pixel count: rank quantiles of the mean (formats.md §5.3;
    /// default).
    #[default]
    Quantiles,
    /// Classes of equal width in `ln(mean)` between its minimum and maximum. Gives the few bright
    /// (bright-field) pixels classes of their own. On simulated 192² frames with C = 8 the
    /// streams are 12% smaller at 20k e⁻/frame, 3.6% at 200k, 2% at 1M than with `Quantiles`
    /// (the `rans_ratio` example).
    LogBins,
}

impl Default for ModelParams {
    fn default() -> Self {
        ModelParams {
            contexts: 8,
            literals: 32,
            prob_bits: 12,
            sample_every: 1,
            context_rule: ContextRule::Quantiles,
        }
    }
}

impl ModelParams {
    /// Check every field's range.
    pub fn validate(&self) -> Result<(), RansError> {
        let bad = |what, found: u64, rule| Err(RansError::BadParam { what, found, rule });
        if self.contexts == 0 || self.contexts as usize > MAX_CONTEXTS {
            return bad("contexts", self.contexts.into(), "must be 1..=16");
        }
        if self.literals == 0 || self.literals as usize > MAX_LITERALS {
            return bad("literals", self.literals.into(), "must be 1..=128");
        }
        if u32::from(self.prob_bits) != PROB_BITS {
            return bad("prob_bits", self.prob_bits.into(), "must be 12");
        }
        if self.sample_every == 0 {
            return bad("sample_every", 0, "must be >= 1");
        }
        Ok(())
    }
}

/// Map a value to `(symbol, nb, extra)` for `literals = K` (see the module doc); `None` when the
/// value is above the largest bucket (`K + 65534`).
pub fn symbol_of(value: u32, literals: u32) -> Option<(u32, u32, u32)> {
    if value < literals {
        return Some((value, 0, 0));
    }
    let u = value - literals + 1;
    let nb = 31 - u.leading_zeros();
    if nb as usize >= BUCKETS {
        return None;
    }
    Some((literals + nb, nb, u - (1 << nb)))
}

/// The static per-dataset model: context class per pixel and a frequency row per class.
///
/// Build with [`CountsModel::fit`] from data, [`CountsModel::new`] from parts, or
/// [`CountsModel::from_bytes`]. Also holds the derived decode tables (not serialised).
#[derive(Clone, PartialEq, Eq)]
pub struct CountsModel {
    literals: u8,
    contexts: u8,
    ctx_map: Vec<u8>,
    /// `freq[c * S + s]`.
    freq: Vec<u16>,
    /// `cum[c * S + s]`, exclusive prefix sums of each row.
    cum: Vec<u16>,
    /// `lut[c * 4096 + slot]` = symbol.
    lut: Vec<u8>,
}

impl fmt::Debug for CountsModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountsModel")
            .field("frame_len", &self.ctx_map.len())
            .field("literals", &self.literals)
            .field("contexts", &self.contexts)
            .finish_non_exhaustive()
    }
}

impl CountsModel {
    /// Build a model from its parts, with the same validation as [`CountsModel::from_bytes`]:
    /// `ctx_map` has one class `< contexts` per pixel (at least one pixel, at most `u32::MAX`),
    /// `freq` is `contexts` rows of `literals + 16` frequencies, each row summing to 4096.
    pub fn new(
        literals: u8,
        contexts: u8,
        ctx_map: Vec<u8>,
        freq: Vec<u16>,
    ) -> Result<CountsModel, RansError> {
        ModelParams {
            contexts,
            literals,
            prob_bits: PROB_BITS as u8,
            sample_every: 1,
            context_rule: ContextRule::Quantiles,
        }
        .validate()?;
        if ctx_map.is_empty() || ctx_map.len() > u32::MAX as usize {
            return Err(RansError::BadParam {
                what: "frame_len",
                found: ctx_map.len() as u64,
                rule: "must be 1..=u32::MAX",
            });
        }
        Self::check_parts(literals, contexts, &ctx_map, &freq, 0, 0)?;
        let s = literals as usize + BUCKETS;
        let mut cum = vec![0u16; freq.len()];
        let mut lut = vec![0u8; contexts as usize * PROB_SCALE as usize];
        for c in 0..contexts as usize {
            let mut acc = 0usize;
            for sym in 0..s {
                cum[c * s + sym] = acc as u16;
                let f = freq[c * s + sym] as usize;
                lut[c * PROB_SCALE as usize + acc..c * PROB_SCALE as usize + acc + f]
                    .fill(sym as u8);
                acc += f;
            }
        }
        Ok(CountsModel {
            literals,
            contexts,
            ctx_map,
            freq,
            cum,
            lut,
        })
    }

    /// Validate sizes, classes and row sums; offsets are for serialised models.
    fn check_parts(
        literals: u8,
        contexts: u8,
        ctx_map: &[u8],
        freq: &[u16],
        ctx_offset: usize,
        freq_offset: usize,
    ) -> Result<(), RansError> {
        let s = literals as usize + BUCKETS;
        if let Some(p) = ctx_map.iter().position(|&c| c >= contexts) {
            return Err(RansError::BadModel {
                what: "ctx_map class",
                offset: ctx_offset + p,
                expected: u64::from(contexts) - 1,
                found: ctx_map[p].into(),
            });
        }
        let want = contexts as usize * s;
        if freq.len() != want {
            return Err(RansError::BadModel {
                what: "freq entries",
                offset: freq_offset,
                expected: want as u64,
                found: freq.len() as u64,
            });
        }
        for (c, row) in freq.chunks_exact(s).enumerate() {
            let sum: u64 = row.iter().map(|&f| u64::from(f)).sum();
            if sum != u64::from(PROB_SCALE) {
                return Err(RansError::BadModel {
                    what: "freq row sum",
                    offset: freq_offset + 2 * c * s,
                    expected: PROB_SCALE.into(),
                    found: sum,
                });
            }
        }
        Ok(())
    }

    /// Fit a model to `frames` (each exactly `frame_len` pixels) as the module doc describes:
    /// context classes from rank quantiles of the sampled mean pattern, one symbol histogram per
    /// class, frequencies quantised to 4096 with the documented floor policy.
    ///
    /// One pass over the frames; memory `frame_len · (K + 16) · 4` bytes of per-pixel counts.
    pub fn fit<'a, I>(
        frames: I,
        frame_len: usize,
        params: &ModelParams,
    ) -> Result<CountsModel, RansError>
    where
        I: IntoIterator<Item = &'a [u16]>,
    {
        params.validate()?;
        if frame_len == 0 || frame_len > u32::MAX as usize {
            return Err(RansError::BadParam {
                what: "frame_len",
                found: frame_len as u64,
                rule: "must be 1..=u32::MAX",
            });
        }
        let k = u32::from(params.literals);
        let s = k as usize + BUCKETS;
        let nc = params.contexts as usize;
        let mut sums = vec![0u64; frame_len];
        let mut counts = vec![0u32; frame_len * s];
        let mut sampled = 0usize;
        for (i, frame) in frames.into_iter().enumerate() {
            if frame.len() != frame_len {
                return Err(RansError::FrameLength {
                    what: "fit frame",
                    expected: frame_len,
                    found: frame.len(),
                });
            }
            if i % params.sample_every != 0 {
                continue;
            }
            sampled += 1;
            for (p, &v) in frame.iter().enumerate() {
                sums[p] += u64::from(v);
                // Every u16 has a symbol (NB = 16); `unwrap_or` keeps the library panic-free.
                let sym = symbol_of(v.into(), k).map_or(s - 1, |t| t.0 as usize);
                let cnt = &mut counts[p * s + sym];
                *cnt = cnt.saturating_add(1);
            }
        }
        if sampled == 0 {
            return Err(RansError::NoFrames);
        }

        let ctx_map: Vec<u8> = match params.context_rule {
            ContextRule::Quantiles => {
                // Rank quantiles of the per-pixel sum (∝ mean, same order as log(mean)).
                let mut order: Vec<usize> = (0..frame_len).collect();
                order.sort_by_key(|&p| (sums[p], p));
                let thresholds: Vec<u64> =
                    (1..nc).map(|i| sums[order[i * frame_len / nc]]).collect();
                sums.iter()
                    .map(|&m| thresholds.iter().filter(|&&q| q <= m).count() as u8)
                    .collect()
            }
            ContextRule::LogBins => {
                // Equal-width bins of ln((sum + 0.5) / sampled) between its minimum and maximum.
                let lm: Vec<f64> = sums
                    .iter()
                    .map(|&m| ((m as f64 + 0.5) / sampled as f64).ln())
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

        // Histograms per class.
        let mut hist = vec![0u64; nc * s];
        for (p, &c) in ctx_map.iter().enumerate() {
            for sym in 0..s {
                hist[c as usize * s + sym] += u64::from(counts[p * s + sym]);
            }
        }
        let s_max = (0..s)
            .rev()
            .find(|&sym| (0..nc).any(|c| hist[c * s + sym] > 0))
            .unwrap_or(0);
        let floor_to = (s_max + 1).min(s - 1);
        let mut freq = Vec::with_capacity(nc * s);
        for c in 0..nc {
            freq.extend(quantise_row(&hist[c * s..(c + 1) * s], floor_to));
        }
        Self::new(params.literals, params.contexts, ctx_map, freq)
    }

    /// Serialise (layout in the module doc).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(MODEL_HEADER_BYTES + self.ctx_map.len() + 2 * self.freq.len());
        out.extend_from_slice(&MODEL_MAGIC);
        out.extend_from_slice(&[
            PROB_BITS as u8,
            self.literals,
            BUCKETS as u8,
            self.contexts,
            LANES as u8,
            0,
            0,
            0,
        ]);
        out.extend_from_slice(&(self.ctx_map.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.ctx_map);
        for f in &self.freq {
            out.extend_from_slice(&f.to_le_bytes());
        }
        out
    }

    /// Parse and validate a serialised model (layout in the module doc): magic, fixed
    /// parameters, reserved bytes, exact length, classes `< C`, row sums 4096.
    pub fn from_bytes(bytes: &[u8]) -> Result<CountsModel, RansError> {
        let bad = |what, offset, expected: u64, found: u64| RansError::BadModel {
            what,
            offset,
            expected,
            found,
        };
        if bytes.len() < MODEL_HEADER_BYTES {
            return Err(bad(
                "model length",
                0,
                MODEL_HEADER_BYTES as u64,
                bytes.len() as u64,
            ));
        }
        if bytes[..8] != MODEL_MAGIC {
            return Err(bad(
                "magic",
                0,
                u64::from_le_bytes(MODEL_MAGIC),
                u64::from_le_bytes([
                    bytes[0], bytes[1], bytes[2], bytes[3], bytes[4], bytes[5], bytes[6], bytes[7],
                ]),
            ));
        }
        let checks: [(&'static str, usize, u8); 6] = [
            ("prob_bits", 8, PROB_BITS as u8),
            ("NB", 10, BUCKETS as u8),
            ("lanes", 12, LANES as u8),
            ("reserved", 13, 0),
            ("reserved", 14, 0),
            ("reserved", 15, 0),
        ];
        for (what, at, want) in checks {
            if bytes[at] != want {
                return Err(bad(what, at, want.into(), bytes[at].into()));
            }
        }
        let literals = bytes[9];
        let contexts = bytes[11];
        if literals == 0 || literals as usize > MAX_LITERALS {
            return Err(bad("K", 9, MAX_LITERALS as u64, literals.into()));
        }
        if contexts == 0 || contexts as usize > MAX_CONTEXTS {
            return Err(bad("C", 11, MAX_CONTEXTS as u64, contexts.into()));
        }
        let frame_len = u32::from_le_bytes([bytes[16], bytes[17], bytes[18], bytes[19]]) as usize;
        if frame_len == 0 {
            return Err(bad("frame_len", 16, 1, 0));
        }
        let s = literals as usize + BUCKETS;
        let freq_offset = MODEL_HEADER_BYTES + frame_len;
        let total = freq_offset as u64 + 2 * (contexts as u64) * (s as u64);
        if bytes.len() as u64 != total {
            return Err(bad("model length", 0, total, bytes.len() as u64));
        }
        let ctx_map = bytes[MODEL_HEADER_BYTES..freq_offset].to_vec();
        let freq: Vec<u16> = bytes[freq_offset..]
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        Self::check_parts(
            literals,
            contexts,
            &ctx_map,
            &freq,
            MODEL_HEADER_BYTES,
            freq_offset,
        )?;
        Self::new(literals, contexts, ctx_map, freq)
    }

    /// Pixels per frame.
    pub fn frame_len(&self) -> usize {
        self.ctx_map.len()
    }

    /// Literal symbols `K`.
    pub fn literals(&self) -> u8 {
        self.literals
    }

    /// Context classes `C`.
    pub fn contexts(&self) -> u8 {
        self.contexts
    }

    /// Symbols per row, `K + 16`.
    pub fn symbols(&self) -> usize {
        self.literals as usize + BUCKETS
    }

    /// Context class per pixel, raster order.
    pub fn ctx_map(&self) -> &[u8] {
        &self.ctx_map
    }

    /// Frequency row of class `c` (`K + 16` entries summing to 4096); empty if `c ≥ C`.
    pub fn freq_row(&self, c: usize) -> &[u16] {
        let s = self.symbols();
        self.freq.get(c * s..(c + 1) * s).unwrap_or(&[])
    }

    /// Largest value the symbol alphabet reaches: `K − 1 + 2^16 − 1` (≥ 65535). Whether a value
    /// is codable at a pixel also needs its symbol's frequency there to be non-zero.
    pub fn max_value(&self) -> u32 {
        u32::from(self.literals) + (1 << BUCKETS) - 2
    }
}

/// Quantise one histogram row to frequencies summing to 4096: `max(⌊count·4096/total⌋, floor)`
/// where `floor` is 1 for seen symbols and symbols `≤ floor_to`, else 0; then adjust the largest
/// frequency (lowest symbol on ties) until the sum is 4096.
fn quantise_row(hist: &[u64], floor_to: usize) -> Vec<u16> {
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

/// Encode one frame as one stream (layout in the module doc).
///
/// Fails when `frame.len()` is not the model's frame length, or a value's symbol has frequency
/// 0 in its pixel's context ([`RansError::Uncodable`], naming the first such pixel).
pub fn encode_stream(model: &CountsModel, frame: &[u16]) -> Result<Vec<u8>, RansError> {
    let n = model.frame_len();
    if frame.len() != n {
        return Err(RansError::FrameLength {
            what: "encode frame",
            expected: n,
            found: frame.len(),
        });
    }
    let k = u32::from(model.literals);
    let s = model.symbols();
    // Pass 1 (raster order): symbols, and the extra bits packed LSB-first.
    let mut syms = vec![0u8; n];
    let mut extra: Vec<u32> = Vec::new();
    let mut acc: u64 = 0;
    let mut acc_bits: u32 = 0;
    let mut n_extra_bits: u64 = 0;
    for (p, &v) in frame.iter().enumerate() {
        let c = model.ctx_map[p];
        let code = symbol_of(v.into(), k).filter(|&(sym, _, _)| {
            (sym as usize) < s && model.freq[c as usize * s + sym as usize] > 0
        });
        let Some((sym, nb, e)) = code else {
            return Err(RansError::Uncodable {
                pixel: p,
                value: v.into(),
                symbol: symbol_of(v.into(), k).map_or(u32::MAX, |t| t.0),
                context: c,
            });
        };
        syms[p] = sym as u8;
        if nb > 0 {
            acc |= u64::from(e) << acc_bits;
            acc_bits += nb;
            n_extra_bits += u64::from(nb);
            if acc_bits >= 32 {
                extra.push(acc as u32);
                acc >>= 32;
                acc_bits -= 32;
            }
        }
    }
    if acc_bits > 0 {
        extra.push(acc as u32);
    }
    // Pass 2: rANS, steps last to first, lanes 31 down to 0.
    let mut x = [u64::from(STATE_LOWER); LANES];
    let mut words: Vec<u16> = Vec::with_capacity(n / 4);
    let steps = n.div_ceil(LANES);
    for t in (0..steps).rev() {
        for j in (0..LANES).rev() {
            let p = t * LANES + j;
            if p >= n {
                continue;
            }
            let idx = model.ctx_map[p] as usize * s + syms[p] as usize;
            let f = u64::from(model.freq[idx]);
            let cu = u64::from(model.cum[idx]);
            let mut xs = x[j];
            if xs >= RENORM_FACTOR * f {
                words.push((xs & 0xFFFF) as u16);
                xs >>= 16;
            }
            x[j] = (xs / f) * u64::from(PROB_SCALE) + (xs % f) + cu;
        }
    }
    words.reverse();

    let n_words = words.len();
    let mut out = Vec::with_capacity(STREAM_HEADER_BYTES + 2 * n_words + 2 + 4 * extra.len());
    out.extend_from_slice(&(n_words as u32).to_le_bytes());
    out.extend_from_slice(&(n_extra_bits as u32).to_le_bytes());
    for xs in x {
        out.extend_from_slice(&(xs as u32).to_le_bytes());
    }
    for w in &words {
        out.extend_from_slice(&w.to_le_bytes());
    }
    if n_words % 2 == 1 {
        out.extend_from_slice(&[0, 0]);
    }
    for e in &extra {
        out.extend_from_slice(&e.to_le_bytes());
    }
    Ok(out)
}

/// Decode one stream into `out` (the model's frame length). On error `out` holds partial,
/// unverified values and must be discarded.
pub fn decode_stream(model: &CountsModel, stream: &[u8], out: &mut [u16]) -> Result<(), RansError> {
    if out.len() != model.frame_len() {
        return Err(RansError::FrameLength {
            what: "decode output",
            expected: model.frame_len(),
            found: out.len(),
        });
    }
    decode_stream_with(model, stream, |p, v| {
        if let Some(o) = out.get_mut(p) {
            *o = v;
        }
    })
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    match b.get(at..at + 4) {
        Some(w) => u32::from_le_bytes([w[0], w[1], w[2], w[3]]),
        None => 0,
    }
}

/// Decode one stream, calling `sink(pixel_index, value)` once per pixel in raster order (the CPU
/// mirror of the GPU's fused decode → reduce). The stream's integrity is only confirmed when
/// this returns `Ok`: on `Err` everything passed to `sink` must be discarded.
pub fn decode_stream_with<F>(
    model: &CountsModel,
    stream: &[u8],
    mut sink: F,
) -> Result<(), RansError>
where
    F: FnMut(usize, u16),
{
    let n = model.frame_len();
    let size = |what, expected: u64, found: u64| RansError::StreamSize {
        what,
        expected,
        found,
    };
    if stream.len() < STREAM_HEADER_BYTES {
        return Err(size(
            "stream header bytes",
            STREAM_HEADER_BYTES as u64,
            stream.len() as u64,
        ));
    }
    let n_words = le_u32(stream, 0) as usize;
    let n_extra_bits = le_u32(stream, 4) as usize;
    if n_words > n {
        return Err(size(
            "n_words (at most one per pixel)",
            n as u64,
            n_words as u64,
        ));
    }
    if n_extra_bits as u64 > 15 * n as u64 {
        return Err(size(
            "n_extra_bits (at most 15 per pixel)",
            15 * n as u64,
            n_extra_bits as u64,
        ));
    }
    let words_off = STREAM_HEADER_BYTES;
    let extra_off = words_off + 4 * n_words.div_ceil(2);
    let n_extra = n_extra_bits.div_ceil(32);
    let total = extra_off + 4 * n_extra;
    if stream.len() != total {
        return Err(size("stream bytes", total as u64, stream.len() as u64));
    }
    let corrupt = |pixel, fault| RansError::Corrupt { pixel, fault };
    if n_words % 2 == 1 && (stream[total - 4 * n_extra - 2] | stream[total - 4 * n_extra - 1]) != 0
    {
        return Err(corrupt(0, RansFault::NonZeroPadding));
    }
    if n_extra_bits % 32 != 0 {
        let last = le_u32(stream, total - 4);
        if last >> (n_extra_bits % 32) != 0 {
            return Err(corrupt(0, RansFault::NonZeroPadding));
        }
    }
    let mut x = [0u32; LANES];
    for (j, xs) in x.iter_mut().enumerate() {
        *xs = le_u32(stream, 8 + 4 * j);
        if *xs < STATE_LOWER {
            return Err(corrupt(
                0,
                RansFault::StateOutOfRange {
                    lane: j,
                    state: *xs,
                },
            ));
        }
    }
    let words = &stream[words_off..words_off + 2 * n_words];
    let extra = &stream[extra_off..];
    let k = u32::from(model.literals);
    let s = model.symbols();
    let mask = PROB_SCALE - 1;
    let mut wpos = 0usize;
    let mut bitpos = 0usize;
    for p in 0..n {
        let j = p % LANES;
        let c = model.ctx_map[p] as usize;
        let xs = x[j];
        let slot = xs & mask;
        let sym = model.lut[c * PROB_SCALE as usize + slot as usize] as usize;
        let idx = c * s + sym;
        let f = u32::from(model.freq[idx]);
        let cu = u32::from(model.cum[idx]);
        // f · (x >> 12) ≤ 4096 · (2^20 − 1) and slot − cu < f, so this stays below 2^32.
        let mut xn = f * (xs >> PROB_BITS) + slot - cu;
        if xn < STATE_LOWER {
            let Some(w) = words.get(2 * wpos..2 * wpos + 2) else {
                return Err(corrupt(p, RansFault::WordsExhausted));
            };
            xn = (xn << 16) | u32::from(u16::from_le_bytes([w[0], w[1]]));
            wpos += 1;
        }
        x[j] = xn;
        let value = if (sym as u32) < k {
            sym as u32
        } else {
            let nb = sym as u32 - k;
            if bitpos + nb as usize > n_extra_bits {
                return Err(corrupt(p, RansFault::ExtraBitsExhausted));
            }
            let e = read_bits(extra, bitpos, nb);
            bitpos += nb as usize;
            k - 1 + (1 << nb) + e
        };
        let Ok(v) = u16::try_from(value) else {
            return Err(corrupt(p, RansFault::ValueTooLarge { value }));
        };
        sink(p, v);
    }
    for (j, &xs) in x.iter().enumerate() {
        if xs != STATE_LOWER {
            return Err(corrupt(n, RansFault::FinalState { lane: j, state: xs }));
        }
    }
    if wpos != n_words {
        return Err(corrupt(
            n,
            RansFault::WordsLeft {
                used: wpos,
                total: n_words,
            },
        ));
    }
    if bitpos != n_extra_bits {
        return Err(corrupt(
            n,
            RansFault::ExtraBitsLeft {
                used: bitpos,
                total: n_extra_bits,
            },
        ));
    }
    Ok(())
}

/// `nb ≤ 15` bits at bit position `bitpos` of the LSB-first u32 words in `extra` (missing bytes
/// read as 0; the caller has checked `bitpos + nb ≤ n_extra_bits`).
fn read_bits(extra: &[u8], bitpos: usize, nb: u32) -> u32 {
    let w = bitpos / 32;
    let lo = u64::from(le_u32(extra, 4 * w));
    let hi = u64::from(le_u32(extra, 4 * (w + 1)));
    let window = lo | (hi << 32);
    ((window >> (bitpos % 32)) & ((1u64 << nb) - 1)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbol_mapping_matches_the_spec() {
        assert_eq!(symbol_of(0, 32), Some((0, 0, 0)));
        assert_eq!(symbol_of(31, 32), Some((31, 0, 0)));
        assert_eq!(symbol_of(32, 32), Some((32, 0, 0))); // u = 1, nb = 0
        assert_eq!(symbol_of(33, 32), Some((33, 1, 0))); // u = 2
        assert_eq!(symbol_of(34, 32), Some((33, 1, 1))); // u = 3
        assert_eq!(symbol_of(65535, 32), Some((47, 15, 65504 - 32768)));
        assert_eq!(symbol_of(32 + 65534, 32), Some((47, 15, 32767)));
        assert_eq!(symbol_of(32 + 65535, 32), None);
        for k in 1..=128u32 {
            assert!(symbol_of(65535, k).is_some());
        }
    }

    #[test]
    fn quantised_rows_sum_to_4096_and_respect_floors() {
        let mut h = vec![0u64; 48];
        h[0] = 1_000_000;
        h[1] = 3;
        h[40] = 1;
        let f = quantise_row(&h, 41);
        assert_eq!(f.iter().map(|&x| u32::from(x)).sum::<u32>(), 4096);
        assert!(f[..=41].iter().all(|&x| x >= 1));
        assert!(f[42..].iter().all(|&x| x == 0));
        let f = quantise_row(&[0; 48], 0);
        assert_eq!(f[0], 4096);
    }
}
