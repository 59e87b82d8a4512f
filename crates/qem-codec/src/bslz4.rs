//! Bitshuffle/LZ4 chunk format, HDF5 filter 32008 (placeholder API).

use crate::CodecError;

/// HDF5 filter id of bitshuffle.
pub const FILTER_ID: u32 = 32008;

/// Decode one chunk into `out` (`out.len()` = expected uncompressed bytes).
pub fn decode_chunk(_chunk: &[u8], _elem_size: usize, _out: &mut [u8]) -> Result<(), CodecError> {
    Err(CodecError::Other("bslz4 decoder not implemented yet".into()))
}

/// Encode `data` (elements of `elem_size` bytes, little-endian) as one chunk;
/// `block_elems == 0` selects the default block size.
pub fn encode_chunk(_data: &[u8], _elem_size: usize, _block_elems: usize) -> Result<Vec<u8>, CodecError> {
    Err(CodecError::Other("bslz4 encoder not implemented yet".into()))
}
