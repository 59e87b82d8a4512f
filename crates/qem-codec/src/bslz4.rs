//! Bitshuffle/LZ4 chunk format, HDF5 filter 32008 (Dectris frames), docs/formats.md §2.
//!
//! A chunk is a 12-byte big-endian header (`u64` total uncompressed bytes, `u32` block size in
//! **bytes**), then for each block a big-endian `u32` payload length and an LZ4 block holding
//! the bit-transposed block ([`crate::bitshuffle`]), then the last `N mod 8` elements raw.
//! With `N` elements and `B` elements per block there are `N / B` full blocks, then one block
//! of `L = (N mod B) − (N mod 8)` elements if `L > 0`.
//!
//! The block size is always read from each chunk's header, never assumed. [`parse_chunk`]
//! validates the framing (every check of docs/formats.md §2.5) and returns a [`ChunkLayout`], the
//! block table a GPU decoder consumes; [`Decoder`] decodes chunks on the CPU with reusable
//! scratch buffers, and [`encode_chunk`] writes the format as hdf5plugin does.

use crate::bitshuffle::{transpose_block, untranspose_unchecked};
use crate::framing::{block_payload, check_payload_len, read_be_u32};
use crate::lz4::{compress_block, compress_bound, decompress_block_exact};
use crate::CodecError;

/// HDF5 filter id of bitshuffle.
pub const FILTER_ID: u32 = 32008;

/// Bytes of the chunk header (`u64` total + `u32` block bytes, both big-endian).
pub const HEADER_BYTES: usize = 12;

/// Bitshuffle's default block size in elements for `elem_size`-byte elements:
/// `8192 / elem_size` rounded down to a multiple of 8, at least 128 (4096 for u16, 2048 for
/// u32). An `elem_size` of 0 is treated as 1.
pub const fn default_block_elems(elem_size: usize) -> usize {
    let s = if elem_size == 0 { 1 } else { elem_size };
    let b = 8192 / s / 8 * 8;
    if b < 128 {
        128
    } else {
        b
    }
}

/// One compressed block of a chunk: where its LZ4 payload is and where its decoded elements go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSpan {
    /// Offset of the LZ4 payload in the chunk (just past its 4-byte length prefix).
    pub payload_offset: usize,
    /// Length of the LZ4 payload in bytes (the prefix value).
    pub payload_len: usize,
    /// Offset of the block's decoded bytes in the chunk's uncompressed output.
    pub out_offset: usize,
    /// Decoded bytes of the block: `block_bytes`, or less for the last partial block (always a
    /// multiple of `8 * elem_size`). The LZ4 payload must decode to exactly this many bytes.
    pub out_len: usize,
}

/// The validated framing of one chunk: its block table and raw tail.
///
/// Produced by [`parse_chunk`]; every span lies inside the chunk and inside the output, the
/// spans tile the output from 0 up to `total_bytes - tail_len` in order, and the chunk ends
/// exactly after the raw tail. A GPU decoder can take this table as is (one LZ4 block per warp,
/// `out_len / (8 * elem_size)` bytes per bit-plane).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChunkLayout {
    /// Uncompressed bytes of the chunk (header field; equals the expected size).
    pub total_bytes: usize,
    /// Block size in bytes from the header (the last block may be shorter).
    pub block_bytes: usize,
    /// Element size in bytes.
    pub elem_size: usize,
    /// The compressed blocks in order.
    pub blocks: Vec<BlockSpan>,
    /// Offset in the chunk of the raw tail (the last `N mod 8` elements, stored as is).
    pub tail_offset: usize,
    /// Bytes of the raw tail (`(N mod 8) * elem_size`); they go to the end of the output.
    pub tail_len: usize,
}

impl ChunkLayout {
    /// Offset of the raw tail in the uncompressed output.
    pub fn tail_out_offset(&self) -> usize {
        self.total_bytes - self.tail_len
    }
}

fn check_elem_size(elem_size: usize, out_len: usize) -> Result<(), CodecError> {
    crate::framing::check_elem_size_range(elem_size)?;
    if out_len % elem_size != 0 {
        return Err(CodecError::UnsupportedElemSize {
            elem_size,
            reason: "the output length is not a multiple of the element size",
        });
    }
    Ok(())
}

/// Parse and validate the framing of `chunk` (`elem_size`-byte elements, `expected_bytes` of
/// uncompressed output). See [`parse_chunk_into`] for the checks.
pub fn parse_chunk(
    chunk: &[u8],
    elem_size: usize,
    expected_bytes: usize,
) -> Result<ChunkLayout, CodecError> {
    let mut layout = ChunkLayout::default();
    parse_chunk_into(chunk, elem_size, expected_bytes, &mut layout)?;
    Ok(layout)
}

/// [`parse_chunk`] into an existing layout, reusing its block vector (no allocation once it
/// has grown to the chunk's block count).
///
/// Checks (docs/formats.md §2.5): header present (≥ 12 bytes); header total == `expected_bytes`
/// (a multiple of `elem_size`); when there is data, block size ≠ 0, a multiple of
/// `8 * elem_size` and ≤ `i32::MAX`; every length prefix inside the chunk; every payload
/// length ≤ the bytes left and ≤ `LZ4_compressBound` of its block; after the last block,
/// exactly the raw tail left. On error `layout` holds partial results.
pub fn parse_chunk_into(
    chunk: &[u8],
    elem_size: usize,
    expected_bytes: usize,
    layout: &mut ChunkLayout,
) -> Result<(), CodecError> {
    check_elem_size(elem_size, expected_bytes)?;
    layout.blocks.clear();
    layout.elem_size = elem_size;
    if chunk.len() < HEADER_BYTES {
        return Err(CodecError::Truncated {
            what: "bitshuffle chunk header",
            offset: 0,
            needed: HEADER_BYTES,
            available: chunk.len(),
        });
    }
    let mut total = [0u8; 8];
    total.copy_from_slice(&chunk[..8]);
    let total = u64::from_be_bytes(total);
    if total != expected_bytes as u64 {
        return Err(CodecError::SizeMismatch {
            what: "bitshuffle chunk header total",
            expected: expected_bytes as u64,
            found: total,
        });
    }
    let block_bytes_u32 = read_be_u32(chunk, 8, "bitshuffle chunk header")?;
    let block_bytes = block_bytes_u32 as usize;
    layout.total_bytes = expected_bytes;
    layout.block_bytes = block_bytes;

    let n = expected_bytes / elem_size;
    let tail_elems = n % 8;
    let tail_len = tail_elems * elem_size;
    let blocked_bytes = expected_bytes - tail_len;
    layout.tail_len = tail_len;

    let mut offset = HEADER_BYTES;
    if blocked_bytes > 0 {
        let bad = |reason| CodecError::BlockSize {
            block_bytes: block_bytes_u32 as u64,
            elem_size,
            reason,
        };
        if block_bytes == 0 {
            return Err(bad("zero block size with data present"));
        }
        if block_bytes_u32 > i32::MAX as u32 {
            return Err(bad("block size above i32::MAX"));
        }
        if block_bytes % (8 * elem_size) != 0 {
            return Err(bad("block size not a multiple of 8 elements"));
        }
        let mut out_offset = 0usize;
        let mut index = 0usize;
        while out_offset < blocked_bytes {
            let out_len = block_bytes.min(blocked_bytes - out_offset);
            let (payload_offset, c) =
                block_payload(chunk, offset, index, "bitshuffle block length prefix")?;
            let bound = compress_bound(out_len);
            check_payload_len(index, c, bound, "LZ4 bound of the block size")?;
            layout.blocks.push(BlockSpan {
                payload_offset,
                payload_len: c,
                out_offset,
                out_len,
            });
            offset = payload_offset + c;
            out_offset += out_len;
            index += 1;
        }
    }
    let left = chunk.len() - offset;
    if left < tail_len {
        return Err(CodecError::Truncated {
            what: "bitshuffle raw tail",
            offset,
            needed: tail_len,
            available: left,
        });
    }
    if left > tail_len {
        return Err(CodecError::TrailingBytes {
            offset: offset + tail_len,
            count: left - tail_len,
            expected: tail_len,
        });
    }
    layout.tail_offset = offset;
    Ok(())
}

/// A bitshuffle/LZ4 chunk decoder that keeps its scratch buffers between calls, so a loop
/// over frames allocates only on the first chunk (or when a chunk has a larger block size).
#[derive(Debug, Default, Clone)]
pub struct Decoder {
    layout: ChunkLayout,
    scratch: Vec<u8>,
}

impl Decoder {
    /// A decoder with empty scratch buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Decode one chunk into `out` (`out.len()` = expected uncompressed bytes, a multiple of
    /// `elem_size`). Fails on any framing error ([`parse_chunk_into`]) or LZ4 error (with the
    /// block index). On error the contents of `out` are unspecified.
    pub fn decode(
        &mut self,
        chunk: &[u8],
        elem_size: usize,
        out: &mut [u8],
    ) -> Result<(), CodecError> {
        parse_chunk_into(chunk, elem_size, out.len(), &mut self.layout)?;
        let need = self.layout.blocks.first().map_or(0, |b| b.out_len);
        if self.scratch.len() < need {
            self.scratch.resize(need, 0);
        }
        for (i, span) in self.layout.blocks.iter().enumerate() {
            let payload = &chunk[span.payload_offset..span.payload_offset + span.payload_len];
            let planes = &mut self.scratch[..span.out_len];
            decompress_block_exact(payload, planes).map_err(|e| e.in_block(i))?;
            let dst = &mut out[span.out_offset..span.out_offset + span.out_len];
            untranspose_unchecked(planes, elem_size, dst);
        }
        let l = &self.layout;
        out[l.tail_out_offset()..]
            .copy_from_slice(&chunk[l.tail_offset..l.tail_offset + l.tail_len]);
        Ok(())
    }

    /// Like [`Decoder::decode`], but honours the chunk's HDF5 filter mask: when bit 0 is set
    /// the (optional) bitshuffle filter was skipped at write time and the chunk holds the raw
    /// bytes, which must be exactly `out.len()` long.
    pub fn decode_or_copy(
        &mut self,
        chunk: &[u8],
        filter_mask: u32,
        elem_size: usize,
        out: &mut [u8],
    ) -> Result<(), CodecError> {
        if filter_mask & 1 != 0 {
            copy_raw(chunk, elem_size, out)
        } else {
            self.decode(chunk, elem_size, out)
        }
    }

    /// The layout of the last chunk given to [`Decoder::decode`] (partial if it failed).
    pub fn layout(&self) -> &ChunkLayout {
        &self.layout
    }
}

fn copy_raw(chunk: &[u8], elem_size: usize, out: &mut [u8]) -> Result<(), CodecError> {
    check_elem_size(elem_size, out.len())?;
    if chunk.len() != out.len() {
        return Err(CodecError::SizeMismatch {
            what: "unfiltered (raw) chunk length",
            expected: out.len() as u64,
            found: chunk.len() as u64,
        });
    }
    out.copy_from_slice(chunk);
    Ok(())
}

/// Decode one chunk into `out` (`out.len()` = expected uncompressed bytes).
///
/// Allocates a block-sized scratch buffer per call; use a [`Decoder`] in loops.
pub fn decode_chunk(chunk: &[u8], elem_size: usize, out: &mut [u8]) -> Result<(), CodecError> {
    Decoder::new().decode(chunk, elem_size, out)
}

/// Decode a chunk read with its HDF5 filter mask: bit 0 set means the bitshuffle filter was
/// skipped and the bytes are raw (their length must equal `out.len()`); otherwise as
/// [`decode_chunk`].
pub fn decode_or_copy(
    chunk: &[u8],
    filter_mask: u32,
    elem_size: usize,
    out: &mut [u8],
) -> Result<(), CodecError> {
    Decoder::new().decode_or_copy(chunk, filter_mask, elem_size, out)
}

/// Encode `data` (elements of `elem_size` bytes, little-endian) as one chunk;
/// `block_elems == 0` selects the default block size ([`default_block_elems`]).
///
/// Writes what hdf5plugin's bitshuffle filter writes: the 12-byte header, each block's
/// big-endian length prefix and LZ4 block of its bit-transposed elements, then the raw tail.
/// Fails when `elem_size` is 0, `data.len()` is not a multiple of it, or `block_elems` is not a
/// multiple of 8 or makes a block larger than `i32::MAX` bytes.
pub fn encode_chunk(
    data: &[u8],
    elem_size: usize,
    block_elems: usize,
) -> Result<Vec<u8>, CodecError> {
    check_elem_size(elem_size, data.len())?;
    let block_elems = if block_elems == 0 {
        default_block_elems(elem_size)
    } else {
        block_elems
    };
    let block_bytes = block_elems.saturating_mul(elem_size);
    let bad = |reason| CodecError::BlockSize {
        block_bytes: block_bytes as u64,
        elem_size,
        reason,
    };
    if block_elems % 8 != 0 {
        return Err(bad("block size not a multiple of 8 elements"));
    }
    if block_bytes > i32::MAX as usize {
        return Err(bad("block size above i32::MAX"));
    }
    let n = data.len() / elem_size;
    let tail_len = (n % 8) * elem_size;
    let blocked = &data[..data.len() - tail_len];
    let n_blocks = blocked.len().div_ceil(block_bytes);
    let mut out = Vec::with_capacity(HEADER_BYTES + n_blocks * 4 + blocked.len() / 2 + tail_len);
    out.extend_from_slice(&(data.len() as u64).to_be_bytes());
    out.extend_from_slice(&(block_bytes as u32).to_be_bytes());
    let mut planes = vec![0u8; block_bytes.min(blocked.len())];
    for block in blocked.chunks(block_bytes) {
        let planes = &mut planes[..block.len()];
        transpose_block(block, elem_size, planes)?;
        let payload = compress_block(planes);
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        out.extend_from_slice(&payload);
    }
    out.extend_from_slice(&data[data.len() - tail_len..]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Vector A (docs/formats.md §2.6): u16 0..19, default block, 42 bytes.
    const VECTOR_A: [u8; 42] = [
        0, 0, 0, 0, 0, 0, 0, 0x28, 0, 0, 0x20, 0, 0, 0, 0, 0x12, 0x9e, 0xaa, 0xaa, 0xcc, 0xcc,
        0xf0, 0xf0, 0x00, 0xff, 0x00, 0x01, 0x00, 0x50, 0, 0, 0, 0, 0, 0x10, 0, 0x11, 0, 0x12, 0,
        0x13, 0,
    ];

    fn arange_u16(n: u16) -> Vec<u8> {
        (0..n).flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn default_block_sizes() {
        assert_eq!(default_block_elems(1), 8192);
        assert_eq!(default_block_elems(2), 4096);
        assert_eq!(default_block_elems(4), 2048);
        assert_eq!(default_block_elems(8), 1024);
        assert_eq!(default_block_elems(3), 2728);
        assert_eq!(default_block_elems(128), 128);
    }

    #[test]
    fn vector_a_layout_and_decode() {
        let layout = parse_chunk(&VECTOR_A, 2, 40).unwrap();
        assert_eq!(layout.block_bytes, 8192);
        assert_eq!(
            layout.blocks,
            vec![BlockSpan {
                payload_offset: 16,
                payload_len: 18,
                out_offset: 0,
                out_len: 32
            }]
        );
        assert_eq!((layout.tail_offset, layout.tail_len), (34, 8));
        let mut out = vec![0u8; 40];
        decode_chunk(&VECTOR_A, 2, &mut out).unwrap();
        assert_eq!(out, arange_u16(20));
    }

    #[test]
    fn vector_c_layout_uses_header_block_size() {
        // 44 u16 with 16-element blocks: blocks at 12, 33, 54 and an 8-byte raw tail.
        let data = arange_u16(44);
        let chunk = encode_chunk(&data, 2, 16).unwrap();
        let layout = parse_chunk(&chunk, 2, 88).unwrap();
        assert_eq!(layout.block_bytes, 32);
        let outs: Vec<_> = layout
            .blocks
            .iter()
            .map(|b| (b.out_offset, b.out_len))
            .collect();
        assert_eq!(outs, vec![(0, 32), (32, 32), (64, 16)]);
        assert_eq!(layout.tail_len, 8);
        let mut out = vec![0u8; 88];
        decode_chunk(&chunk, 2, &mut out).unwrap();
        assert_eq!(out, data);
    }

    #[test]
    fn framing_checks() {
        let mut out = vec![0u8; 40];
        // Short header, wrong total, trailing and missing bytes.
        assert!(matches!(
            decode_chunk(&VECTOR_A[..11], 2, &mut out),
            Err(CodecError::Truncated { .. })
        ));
        assert!(matches!(
            decode_chunk(&VECTOR_A, 2, &mut [0u8; 38]),
            Err(CodecError::SizeMismatch { .. })
        ));
        let mut long = VECTOR_A.to_vec();
        long.push(0);
        assert!(matches!(
            decode_chunk(&long, 2, &mut out),
            Err(CodecError::TrailingBytes { .. })
        ));
        assert!(matches!(
            decode_chunk(&VECTOR_A[..41], 2, &mut out),
            Err(CodecError::Truncated { .. })
        ));
        // Block size: zero, not a multiple of 8 elements, above i32::MAX.
        for bad in [0u32, 8, 0x8000_0000] {
            let mut c = VECTOR_A;
            c[8..12].copy_from_slice(&bad.to_be_bytes());
            assert!(
                matches!(
                    decode_chunk(&c, 2, &mut out),
                    Err(CodecError::BlockSize { .. })
                ),
                "{bad}"
            );
        }
        // Payload length past the chunk.
        let mut c = VECTOR_A;
        c[15] = 0x40;
        assert!(matches!(
            decode_chunk(&c, 2, &mut out),
            Err(CodecError::PayloadLength { .. })
        ));
        // Element size 0, and an output that is not a whole number of elements.
        assert!(matches!(
            decode_chunk(&VECTOR_A, 0, &mut out),
            Err(CodecError::UnsupportedElemSize { .. })
        ));
        assert!(matches!(
            decode_chunk(&VECTOR_A, 3, &mut out),
            Err(CodecError::UnsupportedElemSize { .. })
        ));
    }

    #[test]
    fn lz4_error_names_the_block() {
        let mut c = VECTOR_A;
        c[26] = 0; // the match offset of block 0, at payload byte 10
        let err = decode_chunk(&c, 2, &mut [0u8; 40]).unwrap_err();
        assert_eq!(err.to_string(), "LZ4 match offset 0 at byte 10 of block 0");
    }

    #[test]
    fn raw_chunks_by_filter_mask() {
        let data = arange_u16(20);
        let mut out = vec![0u8; 40];
        decode_or_copy(&data, 1, 2, &mut out).unwrap();
        assert_eq!(out, data);
        assert!(decode_or_copy(&data[..38], 1, 2, &mut out).is_err());
        out.fill(0);
        decode_or_copy(&VECTOR_A, 0, 2, &mut out).unwrap();
        assert_eq!(out, data);
    }

    #[test]
    fn empty_chunk_round_trip() {
        let chunk = encode_chunk(&[], 2, 0).unwrap();
        assert_eq!(chunk.len(), 12);
        decode_chunk(&chunk, 2, &mut []).unwrap();
        // Only a tail (fewer than 8 elements): no blocks.
        let data = arange_u16(7);
        let chunk = encode_chunk(&data, 2, 0).unwrap();
        assert_eq!(parse_chunk(&chunk, 2, 14).unwrap().blocks.len(), 0);
        let mut out = vec![0u8; 14];
        decode_chunk(&chunk, 2, &mut out).unwrap();
        assert_eq!(out, data);
    }

    #[test]
    fn encoder_rejects_bad_arguments() {
        assert!(encode_chunk(&[0; 8], 0, 0).is_err());
        assert!(encode_chunk(&[0; 7], 2, 0).is_err());
        assert!(encode_chunk(&[0; 64], 2, 12).is_err());
        assert!(encode_chunk(&[0; 64], 4, 1 << 30).is_err());
    }
}
