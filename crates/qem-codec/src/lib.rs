//! `qem-codec`: the byte formats of quantem.gpu, specified once in plain Rust.
//!
//! * [`lz4`]: a strict LZ4 *block* decoder (rejects offset 0, references before the block start,
//!   overruns and short output) and an encoder.
//! * [`bslz4`]: the bitshuffle/LZ4 chunk format of HDF5 filter 32008 (Dectris files): header
//!   parse, block table, decode, encode.
//!
//! Errors are [`CodecError`]s without file or frame; the IO and engine layers add those.
//! Depends only on `lz4_flex` (encoder, and a test oracle) — not on `qem-core`, so the GPU
//! engine and fuzz targets can use it alone.

pub mod bslz4;
pub mod lz4;

mod error;
pub use error::CodecError;
