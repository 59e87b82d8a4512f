//! Errors of the counts codec: [`RansError`] (bad parameters, models, frames, streams) and
//! [`RansFault`] (what a stream's integrity check found). Returned by every stage of the codec;
//! the GPU engine maps its device fault records onto the same faults.

use std::fmt;

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
