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
//!
//! # Files
//!
//! This module holds the constants, the dimension checks and the symbol mapping; `error` the
//! [`RansError`] / [`RansFault`] types; `fit` the fit parameters and the staged fit functions;
//! `model` [`CountsModel`] (fit, validation, model byte layout); `encode` [`encode_stream`];
//! `decode` [`decode_stream`] / [`decode_stream_with`]; `tests` the unit tests.

mod decode;
mod encode;
mod error;
mod fit;
mod model;
#[cfg(test)]
mod tests;

pub use decode::{decode_stream, decode_stream_with};
pub use encode::encode_stream;
pub use error::{RansError, RansFault};
pub use fit::{
    fit_contexts, fit_freq, fit_thresholds, frame_statistic, histogram_add, table_set_of,
    ContextFit, ContextRule, FloorPolicy, ModelParams, SplitRule,
};
pub use model::CountsModel;

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
