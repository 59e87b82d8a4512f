//! `qem-codec`: the byte formats of quantem.gpu, specified once in plain Rust.
//!
//! * [`lz4`]: a strict LZ4 *block* decoder (rejects offset 0, references before the block start,
//!   overruns and short output) and an encoder.
//! * [`bitshuffle`]: the bit transpose of one block and its inverse (8×8 bit-matrix swaps).
//! * [`bslz4`]: the bitshuffle/LZ4 chunk format of HDF5 filter 32008 (Dectris files): header
//!   parse, block table ([`bslz4::ChunkLayout`], also the GPU decoder's input), decode with
//!   reusable scratch ([`bslz4::Decoder`]), encode, and raw (filter-skipped) chunks.
//! * [`lz4_filter`]: decode of the plain HDF5 LZ4 filter 32004 (older EIGER files).
//!
//! Errors are [`CodecError`]s without file or frame; the IO and engine layers add those.
//! Depends only on `lz4_flex` (encoder, and a test oracle) — not on `qem-core`, so the GPU
//! engine and fuzz targets can use it alone.

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod bitshuffle;
pub mod bslz4;
pub mod lz4;
pub mod lz4_filter;
pub mod qem_file;
pub mod rans;

mod error;
mod framing;
pub use error::{CodecError, Lz4Fault};

/// Largest element size (bytes) the chunk codecs accept; keeps `8 * elem_size` far from overflow.
pub const MAX_ELEM_SIZE: usize = 1 << 16;
