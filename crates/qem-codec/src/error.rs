//! Codec errors (no file or frame: callers add those).

use std::fmt;

/// Why a compressed buffer was rejected.
///
/// Every variant says what was expected and what was found, with byte positions where they
/// help; the IO and engine layers prefix the file and frame. Positions inside an LZ4 payload
/// ([`CodecError::Lz4`]) count from the first byte of that payload (not of the chunk); the
/// payload's own offset in the chunk is in [`crate::bslz4::ChunkLayout`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The input ended before a fixed-size field could be read.
    #[error(
        "truncated input: {what} needs {needed} bytes at byte {offset}, only {available} left"
    )]
    Truncated {
        /// The field being read, e.g. `"chunk header"` or `"block 3 length prefix"`.
        what: &'static str,
        /// Byte position of the field in the input.
        offset: usize,
        /// Bytes the field needs.
        needed: usize,
        /// Bytes that were left at `offset`.
        available: usize,
    },
    /// A size in the data does not match the size the caller expects.
    #[error("size mismatch: {what}: expected {expected} bytes, found {found}")]
    SizeMismatch {
        /// Which size, e.g. `"chunk header total"`.
        what: &'static str,
        /// Size the caller expects (usually the output buffer's length).
        expected: u64,
        /// Size found in the data.
        found: u64,
    },
    /// The block size (from a chunk header or an encoder argument) is not usable.
    #[error("bad block size {block_bytes} bytes (element size {elem_size}): {reason}")]
    BlockSize {
        /// The block size in bytes as found.
        block_bytes: u64,
        /// Element size in bytes.
        elem_size: usize,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// A block's compressed length prefix is larger than any valid payload can be.
    #[error("block {block}: compressed length {found} exceeds {limit} bytes ({why})")]
    PayloadLength {
        /// Block index in the chunk.
        block: usize,
        /// The length prefix as found.
        found: u64,
        /// The largest value allowed here.
        limit: u64,
        /// Which limit: the bytes left in the chunk, or the LZ4 bound of the block size.
        why: &'static str,
    },
    /// An LZ4 block is malformed.
    #[error("LZ4 {reason} at byte {position}{}", BlockSuffix(*.block))]
    Lz4 {
        /// Block index in the chunk, or `None` for a stand-alone LZ4 block.
        block: Option<usize>,
        /// Byte position in the LZ4 payload where the offending token or field starts.
        position: usize,
        /// What was wrong.
        reason: Lz4Fault,
    },
    /// Bytes were left over after everything the header describes was read.
    #[error("{count} trailing bytes after byte {offset} (expected {expected} bytes of raw tail)")]
    TrailingBytes {
        /// Byte position where the unexpected bytes start.
        offset: usize,
        /// How many bytes are left over.
        count: usize,
        /// Tail bytes that were expected at this point (already accounted in `offset`).
        expected: usize,
    },
    /// The element size is not supported (0, or not matching the buffer).
    #[error("unsupported element size {elem_size}: {reason}")]
    UnsupportedElemSize {
        /// The element size given.
        elem_size: usize,
        /// Why it cannot be used.
        reason: &'static str,
    },
}

/// Formats `" of block N"` when the block is known.
struct BlockSuffix(Option<usize>);

impl fmt::Display for BlockSuffix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(b) => write!(f, " of block {b}"),
            None => Ok(()),
        }
    }
}

/// The specific rule an LZ4 block broke (see docs/formats.md §4.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Lz4Fault {
    /// The block has no bytes at all (a valid empty block is the single token `00`).
    EmptyInput,
    /// A length-extension byte was due but the input ended.
    TruncatedLength,
    /// The 2-byte match offset was due but fewer than 2 bytes were left.
    TruncatedOffset,
    /// A length (literal or match) grew past the output size while reading extension bytes.
    LengthOverflow,
    /// The literal run reaches past the end of the input.
    LiteralsPastInput {
        /// Literal run length.
        len: usize,
        /// Input bytes left.
        left: usize,
    },
    /// The literal run reaches past the end of the output.
    LiteralsPastOutput {
        /// Literal run length.
        len: usize,
        /// Output bytes left.
        room: usize,
    },
    /// A match offset of 0 (corrupt by the specification).
    MatchOffsetZero,
    /// A match offset reaching before the start of the block.
    OffsetBeforeStart {
        /// The offset.
        offset: usize,
        /// Bytes decoded so far (the largest valid offset).
        decoded: usize,
    },
    /// The match reaches past the end of the output.
    MatchPastOutput {
        /// Match length.
        len: usize,
        /// Output bytes left.
        room: usize,
    },
    /// The input ended before the output was full.
    ShortOutput {
        /// Bytes decoded.
        decoded: usize,
        /// Bytes expected.
        expected: usize,
    },
}

impl fmt::Display for Lz4Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Lz4Fault::EmptyInput => write!(f, "empty input"),
            Lz4Fault::TruncatedLength => write!(f, "truncated length extension"),
            Lz4Fault::TruncatedOffset => write!(f, "truncated match offset"),
            Lz4Fault::LengthOverflow => write!(f, "length extension larger than the output"),
            Lz4Fault::LiteralsPastInput { len, left } => {
                write!(
                    f,
                    "literal run of {len} bytes past the input end ({left} left)"
                )
            }
            Lz4Fault::LiteralsPastOutput { len, room } => {
                write!(
                    f,
                    "literal run of {len} bytes past the output end ({room} left)"
                )
            }
            Lz4Fault::MatchOffsetZero => write!(f, "match offset 0"),
            Lz4Fault::OffsetBeforeStart { offset, decoded } => write!(
                f,
                "match offset {offset} before the block start ({decoded} bytes decoded)"
            ),
            Lz4Fault::MatchPastOutput { len, room } => {
                write!(f, "match of {len} bytes past the output end ({room} left)")
            }
            Lz4Fault::ShortOutput { decoded, expected } => {
                write!(f, "input ended after {decoded} of {expected} output bytes")
            }
        }
    }
}

impl CodecError {
    /// Attach a block index to an LZ4 error (other errors pass through unchanged).
    pub(crate) fn in_block(self, index: usize) -> Self {
        match self {
            CodecError::Lz4 {
                position, reason, ..
            } => CodecError::Lz4 {
                block: Some(index),
                position,
                reason,
            },
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lz4_message_reads_like_the_style_guide() {
        let e = CodecError::Lz4 {
            block: Some(3),
            position: 88,
            reason: Lz4Fault::MatchOffsetZero,
        };
        assert_eq!(e.to_string(), "LZ4 match offset 0 at byte 88 of block 3");
        let e = CodecError::Lz4 {
            block: None,
            position: 0,
            reason: Lz4Fault::EmptyInput,
        };
        assert_eq!(e.to_string(), "LZ4 empty input at byte 0");
    }
}
