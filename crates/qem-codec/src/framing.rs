//! Framing checks shared by the HDF5 filter decoders (bitshuffle/LZ4 and plain LZ4): both store
//! big-endian `u32` block-length prefixes, and both take an element size from the dataset.

use crate::CodecError;

/// The big-endian `u32` at `offset`, or `Truncated` naming `what` when the chunk ends first.
pub(crate) fn read_be_u32(
    chunk: &[u8],
    offset: usize,
    what: &'static str,
) -> Result<u32, CodecError> {
    match chunk.get(offset..offset + 4) {
        Some(&[a, b, c, d]) => Ok(u32::from_be_bytes([a, b, c, d])),
        _ => Err(CodecError::Truncated {
            what,
            offset,
            needed: 4,
            available: chunk.len().saturating_sub(offset),
        }),
    }
}

/// Read block `index`'s length prefix at `offset` (`what` names it in errors) and check that
/// its payload fits in the chunk; returns `(payload_offset, payload_len)`.
pub(crate) fn block_payload(
    chunk: &[u8],
    offset: usize,
    index: usize,
    what: &'static str,
) -> Result<(usize, usize), CodecError> {
    let c = read_be_u32(chunk, offset, what)? as usize;
    let payload_offset = offset + 4;
    let left = chunk.len() - payload_offset;
    check_payload_len(index, c, left, "bytes left in the chunk")?;
    Ok((payload_offset, c))
}

/// `PayloadLength` for block `index` when its `len` exceeds `limit` (`why` names the limit).
pub(crate) fn check_payload_len(
    index: usize,
    len: usize,
    limit: usize,
    why: &'static str,
) -> Result<(), CodecError> {
    if len > limit {
        return Err(CodecError::PayloadLength {
            block: index,
            found: len as u64,
            limit: limit as u64,
            why,
        });
    }
    Ok(())
}

/// An element size the bit transpose handles: 1 to [`crate::MAX_ELEM_SIZE`] bytes.
pub(crate) fn check_elem_size_range(elem_size: usize) -> Result<(), CodecError> {
    if elem_size == 0 {
        return Err(CodecError::UnsupportedElemSize {
            elem_size,
            reason: "element size must be at least 1 byte",
        });
    }
    if elem_size > crate::MAX_ELEM_SIZE {
        return Err(CodecError::UnsupportedElemSize {
            elem_size,
            reason: "element size above qem_codec::MAX_ELEM_SIZE",
        });
    }
    Ok(())
}
