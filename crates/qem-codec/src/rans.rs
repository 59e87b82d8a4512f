//! The counts codec ("ANS-4D", docs/formats.md §5), format **v2**: 32-lane interleaved rANS over
//! electron counts, with a static per-dataset model of per-pixel context classes and `T`
//! **table sets** (frame classes, each with its own frequency tables). This CPU code is the
//! **specification** the GPU encoder and decoder must match byte for byte.
//!
//! # Parameters (fixed)
//!
//! * state `x`: 32 bits, normalised interval `[L, 2^32)` with `L = 2^16` ([`STATE_LOWER`]);
//! * renormalisation: one 16-bit word at a time, at most one per symbol;
//! * probabilities: `PROB_BITS = 12`, every frequency row sums to `M = 4096`;
//! * `LANES = 32` interleaved states; lane `j` at step `t` codes pixel `p = 32·t + j`;
//! * symbols: `K` literal symbols (`ModelParams::literals`) then `NB = 16`
//!   exp-Golomb bucket symbols ([`BUCKETS`]), `S = K + 16` symbols in all.
//!
//! # Symbol mapping
//!
//! A value `v < K` is the symbol `v` with no extra bits. Otherwise `u = v − K + 1`,
//! `nb = ⌊log2 u⌋`, the symbol is `K + nb` and the `nb` extra bits are `u − 2^nb`, stored raw.
//! The decoder rebuilds `v = K − 1 + 2^nb + extra`. With `NB = 16` the largest codable value is
//! `K − 1 + 2^16 − 1 = K + 65534` ([`CountsModel::max_value`]), so **every u16 value has a
//! symbol** for any `K ≥ 1`. Whether it can be *coded* depends on its symbol having a non-zero
//! frequency in the pixel's row; if not, [`encode_stream`] fails naming the pixel and value
//! ([`FloorPolicy::AllSymbols`] makes every u16 value codable everywhere).
//!
//! # Table sets and the frame statistic
//!
//! The model has `T` table sets (1..=8), each with `C` rows of `S` frequencies: row
//! `(ts, c)` starts at `freq[(ts·C + c)·S]`. Each stream (frame) is coded with **one** table
//! set, chosen by an integer rule the decoder re-checks:
//!
//! * frame statistic `stat = Σ_{p : ctx_map[p] < split} v_p` as `u64` ([`frame_statistic`]);
//! * table set = the number of `thresholds` (`T − 1` non-decreasing `u64`) that are `≤ stat`
//!   ([`table_set_of`]), so `0 ..= T − 1`.
//!
//! `split` is in `0 ..= C` and must be 0 when `T = 1` (then `stat = 0` and the set is 0).
//! Context classes are numbered darkest first, so with a split below the bright-field classes
//! the statistic counts the dark-field electrons of the frame: the reference acquisition's
//! halo changes by ±50 % with the scan position while the total dose stays constant, and a
//! static model that averages over those frames wastes bits.
//!
//! # rANS step (exact arithmetic)
//!
//! For pixel `p` of context `c = ctx_map[p]` in a stream of table set `ts`, let the row be
//! `r = ts·C + c`, the symbol `s` with frequency `f = freq[r·S + s]` and cumulative frequency
//! `cu = Σ_{s' < s} freq[r·S + s']`:
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
//! GPU's `__ballot_sync` + `__popc(mask & lanemask_lt)` fetch, docs/formats.md §5.4).
//!
//! Extra bits are written in raster pixel order (= ascending `(t, j)`), LSB-first: the extra
//! bits of a pixel occupy stream bit positions `bitpos .. bitpos + nb`, value bit `i` at
//! position `bitpos + i`, and bit position `b` is bit `b mod 32` of extra word `b / 32`.
//!
//! # Stream byte layout, v2 (one stream = one frame; all little-endian)
//!
//! ```text
//! offset            size                 field
//! 0                 4                    n_words      u32: number of 16-bit renormalisation words
//! 4                 4                    n_extra_bits u32: number of raw extra bits
//! 8                 4                    table_set    u32: table set used, < T
//! 12                4                    reserved     u32 = 0
//! 16                128                  state[32]    u32: final encoder states, lane 0 first
//! 144               2·n_words            words[]      u16: renormalisation words, decoder order
//! 144+2·n_words     2·(n_words mod 2)    pad          u16 = 0 so the extra words are 4-aligned
//! …                 4·⌈n_extra_bits/32⌉  extra[]      u32: extra bits, LSB-first, raster order
//! ```
//!
//! The stream length is exactly `144 + 4·⌈n_words/2⌉ + 4·⌈n_extra_bits/32⌉` bytes
//! ([`STREAM_HEADER_BYTES`] = 144); nothing may follow. The decoder requires, in this order:
//! the length; `n_words ≤ n` and `n_extra_bits ≤ 15·n` for `n` pixels; `table_set < T`
//! ([`RansFault::TableSetOutOfRange`]); `reserved = 0` ([`RansFault::NonZeroReserved`]); the
//! pad word and the unused high bits of the last extra word are zero; every initial state is in
//! `[L, 2^32)`; no word or bit is read past its count; and at the end all 32 states equal `L`,
//! exactly `n_words` words and `n_extra_bits` bits were consumed, and finally the statistic of
//! the **decoded** frame maps to the stored `table_set` ([`RansFault::TableSetMismatch`]). These
//! checks detect corruption without a checksum (docs/formats.md §5.5). The header is our choice
//! over a separate index: it keeps a stream self-describing.
//!
//! # Model byte layout, v2 ([`CountsModel::to_bytes`], all little-endian)
//!
//! ```text
//! 0    8               magic  "QRANSM\0\x02"   (v1 "QRANSM\0\x01" is rejected)
//! 8    1               prob_bits (= 12)
//! 9    1               K      literal symbols, 1..=128
//! 10   1               NB     bucket symbols (= 16)
//! 11   1               C      context classes, 1..=16
//! 12   1               lanes  (= 32)
//! 13   1               T      table sets, 1..=8
//! 14   1               split  0..=C; 0 when T = 1
//! 15   1               reserved, zero
//! 16   4               frame_len  u32 pixels per frame (≥ 1)
//! 20   frame_len       ctx_map    u8 per pixel, raster order, each < C
//! …    8·(T−1)         thresholds u64, non-decreasing
//! …    2·T·C·(K+NB)    freq       u16[T][C][K+NB], each row sums to 4096
//! ```
//!
//! # Model fitting ([`CountsModel::fit`], staged so a GPU can compute the sums)
//!
//! Only the sampled frames are used (every `sample_every`-th, starting with the first). The
//! stages are public so the big sums can be computed elsewhere and finished by the same code:
//!
//! 1. per-pixel `u64` sums over the sampled frames → [`fit_contexts`] → `ctx_map`, `split`;
//! 2. [`frame_statistic`] of every sampled frame → [`fit_thresholds`] → `thresholds`;
//! 3. [`histogram_add`] of every sampled frame with its set ([`table_set_of`]) →
//!    [`fit_freq`] → `freq`; then [`CountsModel::from_parts`].
//!
//! **Contexts** ([`fit_contexts`]). With [`ContextRule::Quantiles`] pixels are ranked by their
//! sum (ties by pixel index) and split into `C` classes of equal size by rank quantiles, then
//! every pixel whose sum equals a quantile boundary's sum joins the boundary's class, so equal
//! means always share a class. With [`ContextRule::LogBins`] the classes are equal-width bins of
//! `ln((sum + 0.5) / frames)` between its minimum and maximum (f64). Classes may be empty; both
//! rules number classes darkest first. **Split** ([`SplitRule`]): 0 when `T = 1`; with
//! [`SplitRule::Auto`], let `ref` be the pixel sum of rank `n − 1 − ⌊n/256⌋` in ascending order
//! (robust to a few hot pixels); the bright pixels are those with `4·sum ≥ ref`, and `split` is
//! the smallest class holding a bright pixel (`C` when `ref = 0`), so the statistic sums the
//! classes below the bright field. [`SplitRule::Classes`] fixes it (clamped to `C`).
//!
//! **Thresholds** ([`fit_thresholds`]): the sampled statistics sorted ascending, `thresholds[i −
//! 1] = sorted[⌊i·m/T⌋]` for `i = 1..T` (`m` statistics): quantiles, so the sets hold about
//! equally many frames. With no statistics every threshold is `u64::MAX`.
//!
//! **Frequencies** ([`fit_freq`]): each row's histogram is quantised to 4096 with
//! `f = max(⌊count·4096/total⌋, floor)`, then, while the sum is not 4096: if below, the
//! shortfall goes to the largest frequency (lowest symbol on ties; symbol 0 when all are 0);
//! if above, the largest frequency that is above its floor (lowest symbol on ties) gives back
//! as much of the excess as it can. Floors ([`FloorPolicy`]): with `SeenPlusOne`, let `s_max`
//! be the largest symbol seen in *any* row of any set; every symbol `0 ..= min(s_max + 1, S − 1)`
//! gets a frequency ≥ 1 in *every* row (and symbols seen in a row get ≥ 1 there); symbols above
//! get 0 and a value mapping to one is an encode error ([`RansError::Uncodable`]). With
//! `AllSymbols` every symbol of every row gets ≥ 1, so every u16 value is codable at every
//! pixel whatever frame it is in (for models fitted on a sample). All of this is integer
//! arithmetic except `LogBins`.
//!
//! # Not yet implemented (TODO)
//!
//! * `frames_per_stream G > 1` (one stream over several frames, for very sparse data) and
//!   `bands > 1`: both are options of the format (docs/formats.md §5.9); every stream here is
//!   one whole frame.
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
/// Most table sets a model may have.
pub const MAX_TABLE_SETS: usize = 8;
/// Bytes of a stream before the words: `n_words`, `n_extra_bits`, `table_set`, `reserved`,
/// 32 states.
pub const STREAM_HEADER_BYTES: usize = 16 + 4 * LANES;
/// Magic of a serialised model (format v2).
pub const MODEL_MAGIC: [u8; 8] = *b"QRANSM\0\x02";
/// Magic of the retired format v1 (one table set, 136-byte stream headers); rejected.
pub const MODEL_MAGIC_V1: [u8; 8] = *b"QRANSM\0\x01";
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
        /// What is wrong, e.g. `"freq row sum"`.
        what: &'static str,
        /// Byte offset in the serialised model (0 or an element index when built from parts).
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
    /// A value the model cannot code (its symbol has frequency 0 in the pixel's row, or it
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
        /// Pixel being decoded (the pixel count when found at the end, 0 for header faults).
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
    /// The header's `table_set` is not below the model's `T`.
    TableSetOutOfRange {
        /// The stored table set.
        table_set: u32,
        /// The model's `T`.
        table_sets: u8,
    },
    /// The header's reserved word is not zero.
    NonZeroReserved {
        /// The stored value.
        value: u32,
    },
    /// The decoded frame's statistic maps to another table set than the stored one.
    TableSetMismatch {
        /// The table set stored in the header (used for decoding).
        stored: u32,
        /// The table set the decoded frame's statistic maps to.
        expected: u8,
        /// The decoded frame's statistic.
        statistic: u64,
    },
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
            RansFault::TableSetOutOfRange {
                table_set,
                table_sets,
            } => write!(
                f,
                "table_set {table_set} not below the model's {table_sets} table sets"
            ),
            RansFault::NonZeroReserved { value } => {
                write!(f, "reserved header word is {value}, expected 0")
            }
            RansFault::TableSetMismatch {
                stored,
                expected,
                statistic,
            } => write!(
                f,
                "table_set {stored} stored, but the decoded frame's statistic {statistic} \
                 maps to table set {expected}"
            ),
        }
    }
}

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

/// Ranges of `K`, `C`, `T`.
fn check_dims(literals: u8, contexts: u8, table_sets: u8) -> Result<(), RansError> {
    let bad = |what, found: u8, rule| {
        Err(RansError::BadParam {
            what,
            found: found.into(),
            rule,
        })
    };
    if contexts == 0 || contexts as usize > MAX_CONTEXTS {
        return bad("contexts", contexts, "must be 1..=16");
    }
    if literals == 0 || literals as usize > MAX_LITERALS {
        return bad("literals", literals, "must be 1..=128");
    }
    if table_sets == 0 || table_sets as usize > MAX_TABLE_SETS {
        return bad("table_sets", table_sets, "must be 1..=8");
    }
    Ok(())
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

/// Symbol of a u16 value (always exists since `NB = 16`).
#[inline]
fn symbol_u16(v: u16, literals: u32) -> usize {
    let v = u32::from(v);
    if v < literals {
        v as usize
    } else {
        (literals + 31 - (v - literals + 1).leading_zeros()) as usize
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

/// The static per-dataset model: context class per pixel, the frame-statistic rule (`split`,
/// `thresholds`) and `T·C` frequency rows.
///
/// Build with [`CountsModel::fit`] from data, [`CountsModel::from_parts`] (or
/// [`CountsModel::new`] for `T = 1`) from parts, or [`CountsModel::from_bytes`]. Also holds the
/// derived decode tables (not serialised).
#[derive(Clone, PartialEq, Eq)]
pub struct CountsModel {
    literals: u8,
    contexts: u8,
    table_sets: u8,
    split: u8,
    ctx_map: Vec<u8>,
    thresholds: Vec<u64>,
    /// `freq[(ts·C + c)·S + s]`.
    freq: Vec<u16>,
    /// `cum[(ts·C + c)·S + s]`, exclusive prefix sums of each row.
    cum: Vec<u16>,
    /// `lut[(ts·C + c)·4096 + slot]` = symbol.
    lut: Vec<u8>,
}

impl fmt::Debug for CountsModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountsModel")
            .field("frame_len", &self.ctx_map.len())
            .field("literals", &self.literals)
            .field("contexts", &self.contexts)
            .field("table_sets", &self.table_sets)
            .field("split", &self.split)
            .field("thresholds", &self.thresholds)
            .finish_non_exhaustive()
    }
}

impl CountsModel {
    /// A one-table-set model (`T = 1`, `split = 0`, no thresholds) from its parts; see
    /// [`CountsModel::from_parts`].
    pub fn new(
        literals: u8,
        contexts: u8,
        ctx_map: Vec<u8>,
        freq: Vec<u16>,
    ) -> Result<CountsModel, RansError> {
        Self::from_parts(literals, contexts, 1, 0, ctx_map, Vec::new(), freq)
    }

    /// Build a model from its parts, with the same validation as [`CountsModel::from_bytes`]:
    /// `K`, `C`, `T` in range; `split ≤ C` and 0 when `T = 1`; `ctx_map` has one class `< C`
    /// per pixel (at least one pixel, at most `u32::MAX`); `T − 1` non-decreasing thresholds;
    /// `freq` is `T·C` rows of `K + 16` frequencies (layout `[T][C][S]`), each summing to 4096.
    pub fn from_parts(
        literals: u8,
        contexts: u8,
        table_sets: u8,
        split: u8,
        ctx_map: Vec<u8>,
        thresholds: Vec<u64>,
        freq: Vec<u16>,
    ) -> Result<CountsModel, RansError> {
        check_dims(literals, contexts, table_sets)?;
        if ctx_map.is_empty() || ctx_map.len() > u32::MAX as usize {
            return Err(RansError::BadParam {
                what: "frame_len",
                found: ctx_map.len() as u64,
                rule: "must be 1..=u32::MAX",
            });
        }
        Self::check_split(contexts, table_sets, split, 0)?;
        Self::check_parts(
            literals,
            contexts,
            table_sets,
            &ctx_map,
            &thresholds,
            &freq,
            [0; 3],
        )?;
        let s = literals as usize + BUCKETS;
        let rows = table_sets as usize * contexts as usize;
        let m = PROB_SCALE as usize;
        let mut cum = vec![0u16; freq.len()];
        let mut lut = vec![0u8; rows * m];
        for r in 0..rows {
            let mut acc = 0usize;
            for sym in 0..s {
                cum[r * s + sym] = acc as u16;
                let f = freq[r * s + sym] as usize;
                lut[r * m + acc..r * m + acc + f].fill(sym as u8);
                acc += f;
            }
        }
        Ok(CountsModel {
            literals,
            contexts,
            table_sets,
            split,
            ctx_map,
            thresholds,
            freq,
            cum,
            lut,
        })
    }

    fn check_split(contexts: u8, table_sets: u8, split: u8, at: usize) -> Result<(), RansError> {
        let limit = if table_sets == 1 { 0 } else { contexts };
        if split > limit {
            return Err(RansError::BadModel {
                what: "split (≤ C, 0 when T = 1)",
                offset: at,
                expected: limit.into(),
                found: split.into(),
            });
        }
        Ok(())
    }

    /// Validate classes, thresholds, sizes and row sums; `offsets` = byte offsets of
    /// `ctx_map`, `thresholds` and `freq` for serialised models (0 from parts).
    fn check_parts(
        literals: u8,
        contexts: u8,
        table_sets: u8,
        ctx_map: &[u8],
        thresholds: &[u64],
        freq: &[u16],
        offsets: [usize; 3],
    ) -> Result<(), RansError> {
        let [ctx_offset, thr_offset, freq_offset] = offsets;
        let s = literals as usize + BUCKETS;
        if let Some(p) = ctx_map.iter().position(|&c| c >= contexts) {
            return Err(RansError::BadModel {
                what: "ctx_map class",
                offset: ctx_offset + p,
                expected: u64::from(contexts) - 1,
                found: ctx_map[p].into(),
            });
        }
        if thresholds.len() != table_sets as usize - 1 {
            return Err(RansError::BadModel {
                what: "thresholds (T - 1)",
                offset: thr_offset,
                expected: u64::from(table_sets) - 1,
                found: thresholds.len() as u64,
            });
        }
        if let Some(i) = thresholds.windows(2).position(|w| w[1] < w[0]) {
            return Err(RansError::BadModel {
                what: "thresholds non-decreasing",
                offset: thr_offset + 8 * (i + 1),
                expected: thresholds[i],
                found: thresholds[i + 1],
            });
        }
        let want = table_sets as usize * contexts as usize * s;
        if freq.len() != want {
            return Err(RansError::BadModel {
                what: "freq entries",
                offset: freq_offset,
                expected: want as u64,
                found: freq.len() as u64,
            });
        }
        for (r, row) in freq.chunks_exact(s).enumerate() {
            let sum: u64 = row.iter().map(|&f| u64::from(f)).sum();
            if sum != u64::from(PROB_SCALE) {
                return Err(RansError::BadModel {
                    what: "freq row sum",
                    offset: freq_offset + 2 * r * s,
                    expected: PROB_SCALE.into(),
                    found: sum,
                });
            }
        }
        Ok(())
    }

    /// Fit a model to `frames` (each exactly `frame_len` pixels) in the stages of the module
    /// doc: three passes over the frames (hence `Clone` on the iterator), the sampled ones
    /// only. Memory: `frame_len` sums and `T·C·(K + 16)` counts.
    pub fn fit<'a, I>(
        frames: I,
        frame_len: usize,
        params: &ModelParams,
    ) -> Result<CountsModel, RansError>
    where
        I: IntoIterator<Item = &'a [u16]>,
        I::IntoIter: Clone,
    {
        params.validate()?;
        if frame_len == 0 || frame_len > u32::MAX as usize {
            return Err(RansError::BadParam {
                what: "frame_len",
                found: frame_len as u64,
                rule: "must be 1..=u32::MAX",
            });
        }
        let frames = frames.into_iter();
        let every = params.sample_every;
        let sampled = || frames.clone().step_by(every);
        // Pass 1: per-pixel sums (every frame's length is checked).
        let mut sums = vec![0u64; frame_len];
        let mut n_sampled = 0u64;
        for (i, frame) in frames.clone().enumerate() {
            if frame.len() != frame_len {
                return Err(RansError::FrameLength {
                    what: "fit frame",
                    expected: frame_len,
                    found: frame.len(),
                });
            }
            if i % every != 0 {
                continue;
            }
            n_sampled += 1;
            for (s, &v) in sums.iter_mut().zip(frame) {
                *s += u64::from(v);
            }
        }
        if n_sampled == 0 {
            return Err(RansError::NoFrames);
        }
        let ContextFit { ctx_map, split } = fit_contexts(&sums, n_sampled, params)?;
        // Pass 2: frame statistics → thresholds.
        let stats: Vec<u64> = sampled()
            .map(|f| frame_statistic(&ctx_map, split, f))
            .collect();
        let thresholds = fit_thresholds(&stats, params.table_sets);
        // Pass 3: histograms per table set.
        let s = params.literals as usize + BUCKETS;
        let mut hist = vec![0u64; params.table_sets as usize * params.contexts as usize * s];
        for (f, &stat) in sampled().zip(&stats) {
            histogram_add(
                &mut hist,
                &ctx_map,
                table_set_of(&thresholds, stat),
                params.contexts,
                params.literals,
                f,
            );
        }
        let freq = fit_freq(
            &hist,
            params.table_sets,
            params.contexts,
            params.literals,
            params.floor,
        )?;
        Self::from_parts(
            params.literals,
            params.contexts,
            params.table_sets,
            split,
            ctx_map,
            thresholds,
            freq,
        )
    }

    /// Serialise (layout in the module doc).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            MODEL_HEADER_BYTES
                + self.ctx_map.len()
                + 8 * self.thresholds.len()
                + 2 * self.freq.len(),
        );
        out.extend_from_slice(&MODEL_MAGIC);
        out.extend_from_slice(&[
            PROB_BITS as u8,
            self.literals,
            BUCKETS as u8,
            self.contexts,
            LANES as u8,
            self.table_sets,
            self.split,
            0,
        ]);
        out.extend_from_slice(&(self.ctx_map.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.ctx_map);
        for q in &self.thresholds {
            out.extend_from_slice(&q.to_le_bytes());
        }
        for f in &self.freq {
            out.extend_from_slice(&f.to_le_bytes());
        }
        out
    }

    /// Parse and validate a serialised model (layout in the module doc): magic (v1 is
    /// rejected), fixed parameters, reserved byte, `K`/`C`/`T`/`split` ranges, exact length,
    /// classes `< C`, non-decreasing thresholds, row sums 4096.
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
        let magic = u64::from_le_bytes([
            bytes[0], bytes[1], bytes[2], bytes[3], bytes[4], bytes[5], bytes[6], bytes[7],
        ]);
        if bytes[..8] == MODEL_MAGIC_V1 {
            return Err(bad(
                "magic (format v1 model; v2 required)",
                0,
                u64::from_le_bytes(MODEL_MAGIC),
                magic,
            ));
        }
        if bytes[..8] != MODEL_MAGIC {
            return Err(bad("magic", 0, u64::from_le_bytes(MODEL_MAGIC), magic));
        }
        let checks: [(&'static str, usize, u8); 4] = [
            ("prob_bits", 8, PROB_BITS as u8),
            ("NB", 10, BUCKETS as u8),
            ("lanes", 12, LANES as u8),
            ("reserved", 15, 0),
        ];
        for (what, at, want) in checks {
            if bytes[at] != want {
                return Err(bad(what, at, want.into(), bytes[at].into()));
            }
        }
        let (literals, contexts, table_sets, split) = (bytes[9], bytes[11], bytes[13], bytes[14]);
        if literals == 0 || literals as usize > MAX_LITERALS {
            return Err(bad("K", 9, MAX_LITERALS as u64, literals.into()));
        }
        if contexts == 0 || contexts as usize > MAX_CONTEXTS {
            return Err(bad("C", 11, MAX_CONTEXTS as u64, contexts.into()));
        }
        if table_sets == 0 || table_sets as usize > MAX_TABLE_SETS {
            return Err(bad("T", 13, MAX_TABLE_SETS as u64, table_sets.into()));
        }
        Self::check_split(contexts, table_sets, split, 14)?;
        let frame_len = u32::from_le_bytes([bytes[16], bytes[17], bytes[18], bytes[19]]) as usize;
        if frame_len == 0 {
            return Err(bad("frame_len", 16, 1, 0));
        }
        let s = literals as usize + BUCKETS;
        let thr_offset = MODEL_HEADER_BYTES + frame_len;
        let freq_offset = thr_offset + 8 * (table_sets as usize - 1);
        let total = freq_offset as u64 + 2 * u64::from(table_sets) * u64::from(contexts) * s as u64;
        if bytes.len() as u64 != total {
            return Err(bad("model length", 0, total, bytes.len() as u64));
        }
        let ctx_map = bytes[MODEL_HEADER_BYTES..thr_offset].to_vec();
        let thresholds: Vec<u64> = bytes[thr_offset..freq_offset]
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
            .collect();
        let freq: Vec<u16> = bytes[freq_offset..]
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        Self::check_parts(
            literals,
            contexts,
            table_sets,
            &ctx_map,
            &thresholds,
            &freq,
            [MODEL_HEADER_BYTES, thr_offset, freq_offset],
        )?;
        Self::from_parts(
            literals, contexts, table_sets, split, ctx_map, thresholds, freq,
        )
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

    /// Table sets `T`.
    pub fn table_sets(&self) -> u8 {
        self.table_sets
    }

    /// Classes `< split` make the frame statistic.
    pub fn split(&self) -> u8 {
        self.split
    }

    /// The `T − 1` non-decreasing thresholds of the frame statistic.
    pub fn thresholds(&self) -> &[u64] {
        &self.thresholds
    }

    /// Symbols per row, `K + 16`.
    pub fn symbols(&self) -> usize {
        self.literals as usize + BUCKETS
    }

    /// Context class per pixel, raster order.
    pub fn ctx_map(&self) -> &[u8] {
        &self.ctx_map
    }

    /// All frequencies, layout `[T][C][S]` (row `(ts·C + c)` at `(ts·C + c)·S`).
    pub fn freq(&self) -> &[u16] {
        &self.freq
    }

    /// Frequency row of class `c` in table set 0; empty if `c ≥ C`.
    pub fn freq_row(&self, c: usize) -> &[u16] {
        if c >= self.contexts as usize {
            return &[];
        }
        self.freq_row_of(0, c)
    }

    /// Frequency row of class `c` in table set `ts` (`K + 16` entries summing to 4096); empty
    /// if out of range.
    pub fn freq_row_of(&self, ts: usize, c: usize) -> &[u16] {
        let s = self.symbols();
        if ts >= self.table_sets as usize || c >= self.contexts as usize {
            return &[];
        }
        let r = ts * self.contexts as usize + c;
        &self.freq[r * s..(r + 1) * s]
    }

    /// The frame statistic of `frame` under this model ([`frame_statistic`]).
    pub fn statistic(&self, frame: &[u16]) -> u64 {
        frame_statistic(&self.ctx_map, self.split, frame)
    }

    /// The table set `frame` is coded with.
    pub fn table_set_for(&self, frame: &[u16]) -> u8 {
        table_set_of(&self.thresholds, self.statistic(frame))
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

/// Encode one frame as one stream (layout in the module doc), with the table set its
/// statistic maps to.
///
/// Fails when `frame.len()` is not the model's frame length, or a value's symbol has frequency
/// 0 in its pixel's row ([`RansError::Uncodable`], naming the first such pixel).
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
    let table_set = model.table_set_for(frame);
    let row0 = table_set as usize * model.contexts as usize;
    // Pass 1 (raster order): symbols, and the extra bits packed LSB-first.
    let mut syms = vec![0u8; n];
    let mut extra: Vec<u32> = Vec::new();
    let mut acc: u64 = 0;
    let mut acc_bits: u32 = 0;
    let mut n_extra_bits: u64 = 0;
    for (p, &v) in frame.iter().enumerate() {
        let c = model.ctx_map[p];
        let code = symbol_of(v.into(), k).filter(|&(sym, _, _)| {
            (sym as usize) < s && model.freq[(row0 + c as usize) * s + sym as usize] > 0
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
            let idx = (row0 + model.ctx_map[p] as usize) * s + syms[p] as usize;
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
    out.extend_from_slice(&u32::from(table_set).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
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
    let table_set = le_u32(stream, 8);
    let reserved = le_u32(stream, 12);
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
    if table_set >= u32::from(model.table_sets) {
        return Err(corrupt(
            0,
            RansFault::TableSetOutOfRange {
                table_set,
                table_sets: model.table_sets,
            },
        ));
    }
    if reserved != 0 {
        return Err(corrupt(0, RansFault::NonZeroReserved { value: reserved }));
    }
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
        *xs = le_u32(stream, 16 + 4 * j);
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
    let split = model.split;
    let row0 = table_set as usize * model.contexts as usize;
    let mask = PROB_SCALE - 1;
    let mut wpos = 0usize;
    let mut bitpos = 0usize;
    let mut stat = 0u64;
    for p in 0..n {
        let j = p % LANES;
        let c = model.ctx_map[p];
        let r = row0 + c as usize;
        let xs = x[j];
        let slot = xs & mask;
        let sym = model.lut[r * PROB_SCALE as usize + slot as usize] as usize;
        let idx = r * s + sym;
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
        if c < split {
            stat += u64::from(v);
        }
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
    let expected = table_set_of(&model.thresholds, stat);
    if u32::from(expected) != table_set {
        return Err(corrupt(
            n,
            RansFault::TableSetMismatch {
                stored: table_set,
                expected,
                statistic: stat,
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
            for v in [0u16, 1, 5, 31, 32, 127, 128, 129, 1000, 65535] {
                assert_eq!(
                    symbol_u16(v, k),
                    symbol_of(v.into(), k).map(|t| t.0 as usize).unwrap()
                );
            }
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
        let f = quantise_row(&[0; 144], 143);
        assert!(f.iter().all(|&x| x >= 1));
        assert_eq!(f.iter().map(|&x| u32::from(x)).sum::<u32>(), 4096);
    }

    #[test]
    fn thresholds_are_quantiles_and_sets_count_them() {
        let stats: Vec<u64> = (0..100).rev().collect();
        assert_eq!(fit_thresholds(&stats, 4), vec![25, 50, 75]);
        assert_eq!(fit_thresholds(&stats, 1), Vec::<u64>::new());
        assert_eq!(fit_thresholds(&[], 3), vec![u64::MAX; 2]);
        let q = [10, 20, 20];
        assert_eq!(table_set_of(&q, 0), 0);
        assert_eq!(table_set_of(&q, 10), 1);
        assert_eq!(table_set_of(&q, 19), 1);
        assert_eq!(table_set_of(&q, 20), 3);
        assert_eq!(table_set_of(&[], 99), 0);
    }

    #[test]
    fn split_auto_excludes_the_bright_classes() {
        // 1024 pixels: 64 bright (sum 1000) and a dark ramp 0..=9.
        let sums: Vec<u64> = (0..1024)
            .map(|p| if p < 64 { 1000 } else { (p % 10) as u64 })
            .collect();
        let p = ModelParams {
            contexts: 4,
            table_sets: 2,
            context_rule: ContextRule::Quantiles,
            ..ModelParams::default()
        };
        let fit = fit_contexts(&sums, 10, &p).unwrap();
        let bright_class = fit.ctx_map[0];
        assert_eq!(fit.split, bright_class);
        assert!(fit.split >= 1);
        // Quantiles: class 3 holds values 8, 9 and the bright pixels; classes 0..3 are dark.
        assert_eq!(fit.split, 3);
        assert!(fit
            .ctx_map
            .iter()
            .zip(&sums)
            .all(|(&c, &s)| (c < fit.split) == (s < 8)));
        // Log bins: the bright pixels get the top class alone, every dark pixel is below.
        let logp = ModelParams {
            context_rule: ContextRule::LogBins,
            ..p
        };
        let fit = fit_contexts(&sums, 10, &logp).unwrap();
        assert_eq!(fit.ctx_map[0], 3);
        assert_eq!(fit.split, 3);
        assert!(fit.ctx_map[64..].iter().all(|&c| c < fit.split));
        let one = fit_contexts(&sums, 10, &ModelParams { table_sets: 1, ..p }).unwrap();
        assert_eq!(one.split, 0);
        let fixed = ModelParams {
            split: SplitRule::Classes(9),
            ..p
        };
        assert_eq!(fit_contexts(&sums, 10, &fixed).unwrap().split, 4);
    }
}
