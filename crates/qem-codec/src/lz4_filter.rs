//! HDF5 LZ4 filter, id 32004 (older EIGER files with `compression = "lz4"`), docs/formats.md §3.
//!
//! A chunk is a big-endian `u64` total of uncompressed bytes and a big-endian `u32` block size
//! in bytes, then for each block (the last one holds `total mod block` bytes) a big-endian
//! `u32` length `c` and `c` bytes: the block stored raw when `c` equals the block's size,
//! otherwise one LZ4 block that must decode to exactly the block's size. No bit transpose.

use crate::framing::{block_payload, read_be_u32};
use crate::lz4::decompress_block_exact;
use crate::CodecError;

/// HDF5 filter id of the LZ4 filter.
pub const FILTER_ID: u32 = 32004;

/// Decode one filter-32004 chunk into `out` (`out.len()` = expected uncompressed bytes).
///
/// Checks: header present; header total == `out.len()`; block size ≠ 0 when there is data;
/// every length prefix and payload inside the chunk; each LZ4 block decodes to exactly its
/// block's size; nothing left after the last block. LZ4 errors carry the block index.
pub fn decode_chunk(chunk: &[u8], out: &mut [u8]) -> Result<(), CodecError> {
    if chunk.len() < 12 {
        return Err(CodecError::Truncated {
            what: "LZ4 filter chunk header",
            offset: 0,
            needed: 12,
            available: chunk.len(),
        });
    }
    let mut total = [0u8; 8];
    total.copy_from_slice(&chunk[..8]);
    let total = u64::from_be_bytes(total);
    if total != out.len() as u64 {
        return Err(CodecError::SizeMismatch {
            what: "LZ4 filter chunk header total",
            expected: out.len() as u64,
            found: total,
        });
    }
    let block_bytes = read_be_u32(chunk, 8, "LZ4 filter chunk header")? as usize;
    if block_bytes == 0 && !out.is_empty() {
        return Err(CodecError::BlockSize {
            block_bytes: 0,
            elem_size: 1,
            reason: "zero block size with data present",
        });
    }
    let mut offset = 12usize;
    let mut out_offset = 0usize;
    let mut index = 0usize;
    while out_offset < out.len() {
        let len = block_bytes.min(out.len() - out_offset);
        let (start, c) = block_payload(chunk, offset, index, "LZ4 filter block length prefix")?;
        let payload = &chunk[start..start + c];
        let dst = &mut out[out_offset..out_offset + len];
        if c == len {
            dst.copy_from_slice(payload);
        } else {
            decompress_block_exact(payload, dst).map_err(|e| e.in_block(index))?;
        }
        offset = start + c;
        out_offset += len;
        index += 1;
    }
    if offset != chunk.len() {
        return Err(CodecError::TrailingBytes {
            offset,
            count: chunk.len() - offset,
            expected: 0,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_and_compressed_blocks() {
        // Two 4-byte blocks: one stored raw (c == 4), one LZ4 (`40 01 02 03 04` is 4 literals,
        // c = 5 != 4), then a 2-byte last block stored raw.
        let mut chunk = Vec::new();
        chunk.extend(10u64.to_be_bytes());
        chunk.extend(4u32.to_be_bytes());
        chunk.extend(4u32.to_be_bytes());
        chunk.extend([9, 8, 7, 6]);
        chunk.extend(5u32.to_be_bytes());
        chunk.extend([0x40, 1, 2, 3, 4]);
        chunk.extend(2u32.to_be_bytes());
        chunk.extend([5, 5]);
        let mut out = [0u8; 10];
        decode_chunk(&chunk, &mut out).unwrap();
        assert_eq!(out, [9, 8, 7, 6, 1, 2, 3, 4, 5, 5]);
        chunk.push(0);
        assert!(matches!(
            decode_chunk(&chunk, &mut out),
            Err(CodecError::TrailingBytes { .. })
        ));
        assert!(decode_chunk(&chunk[..20], &mut out).is_err());
    }
}
