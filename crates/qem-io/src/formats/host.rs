//! Work done on the host between a frame's stored bytes and the little-endian integer counts
//! the engines take: HDF5 filter pipelines we decode ourselves (deflate, shuffle, Fletcher-32,
//! Zstd, LZ4 32004; Blosc 32001 through c-blosc), 4-D chunks that cover several partial scan
//! rows, byte order, float32 counts, big-endian Merlin pixels and raw Merlin (R64) counters.
//!
//! A [`Source`](crate::Source) with a [`HostDecode`] presents itself to the engines as
//! [`ChunkCodec::Raw`](crate::ChunkCodec::Raw): [`Source::read_chunk`](crate::Source::read_chunk)
//! returns the decoded frames of a chunk record (`frames_in_chunk` frames, exactly). The CUDA
//! engine reads chunk bytes straight from the files, so the façade decodes such sources with the
//! CPU reader and uploads the frames (see `Source::needs_host_decode`).

use crate::ChunkRecord;
use qem_core::{Error, Result};
use std::cell::RefCell;
use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

const OP: &str = "decode";

/// One HDF5 filter we undo on the host, in the order the writer applied them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum H5Filter {
    /// Filter 1, zlib stream (`compression="gzip"`).
    Deflate,
    /// Filter 2, byte shuffle with this element size.
    Shuffle(usize),
    /// Filter 3, a 4-byte checksum appended to the chunk.
    Fletcher32,
    /// Filter 32015, one Zstandard frame.
    Zstd,
    /// Filter 32004, HDF5 LZ4 framing (decoded by `qem_codec::lz4_filter`).
    Lz4,
    /// Filter 32001, a Blosc 1 buffer (any of its codecs and shuffles; [`blosc_decode`]).
    Blosc,
}

impl H5Filter {
    /// The filter for HDF5 filter `id` (and its element size for shuffle), if we decode it.
    pub(crate) fn from_id(id: i32, cd_values: &[u32], elem: usize) -> Option<H5Filter> {
        match id {
            1 => Some(H5Filter::Deflate),
            2 => Some(H5Filter::Shuffle(
                cd_values.first().map_or(elem, |&e| e as usize).max(1),
            )),
            3 => Some(H5Filter::Fletcher32),
            32015 => Some(H5Filter::Zstd),
            32004 => Some(H5Filter::Lz4),
            32001 => Some(H5Filter::Blosc),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            H5Filter::Deflate => "deflate",
            H5Filter::Shuffle(_) => "shuffle",
            H5Filter::Fletcher32 => "fletcher32",
            H5Filter::Zstd => "zstd",
            H5Filter::Lz4 => "lz4",
            H5Filter::Blosc => "blosc",
        }
    }
}

/// Decode one Blosc 1 buffer (HDF5 filter 32001) into `out`, which must be exactly its
/// uncompressed size.
///
/// Blosc is a container of its own (blocks, byte or bit shuffle, one of several codecs:
/// blosclz, LZ4, zlib, Zstd, ...); c-blosc (the `blosc-src` crate, built from source) reads it
/// rather than a copy of it here. The buffer is validated first: its header's compressed size
/// must fit the stored bytes and its uncompressed size must be `out.len()`, so the library
/// never reads past `src` nor writes past `out`.
pub(crate) fn blosc_decode(src: &[u8], out: &mut [u8]) -> std::result::Result<(), String> {
    const HEADER: usize = 16;
    if src.len() < HEADER {
        return Err(format!(
            "{} bytes, shorter than its 16-byte header",
            src.len()
        ));
    }
    let mut nbytes = 0usize;
    // SAFETY: `src` is valid for `src.len()` bytes; the call reads the header and checks the
    // header's compressed size against `src.len()`; `nbytes` is a valid out-pointer.
    let ok =
        unsafe { blosc_src::blosc_cbuffer_validate(src.as_ptr().cast(), src.len(), &mut nbytes) };
    if ok < 0 {
        return Err("the header is invalid or claims more bytes than are stored".into());
    }
    if nbytes != out.len() {
        return Err(format!(
            "it holds {nbytes} bytes, the chunk needs {}",
            out.len()
        ));
    }
    // SAFETY: the header was validated against `src.len()` above, and `out` is writable for
    // `out.len()` bytes, which is the destination size passed (the library writes at most
    // that). One internal thread: the call is made from our own worker threads.
    let n = unsafe {
        blosc_src::blosc_decompress_ctx(src.as_ptr().cast(), out.as_mut_ptr().cast(), out.len(), 1)
    };
    if n < 0 || n as usize != out.len() {
        return Err(format!("decompression failed (c-blosc returned {n})"));
    }
    Ok(())
}

/// How stored elements become the source's integer elements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum ElemConv {
    /// Stored as the engines want them.
    Same,
    /// Big-endian integers of this many bytes.
    Swap(usize),
    /// IEEE float32 (little- or big-endian): `round(value / scale)`, negatives to 0, as `u32`.
    Float32 { scale: f64, big_endian: bool },
    /// IEEE float64, the same rule as [`ElemConv::Float32`].
    Float64 { scale: f64, big_endian: bool },
    /// Signed integers of `size` bytes (1, 2 or 4) read as the unsigned counts of that width; a
    /// negative value is a decode error naming the frame, pixel and value.
    Signed { size: usize, big_endian: bool },
    /// 64-bit integers (signed or not) read as `u32` counts; a value outside `0..=u32::MAX` is a
    /// decode error naming the frame, pixel and value.
    Int64 { signed: bool, big_endian: bool },
    /// Merlin raw (`R64`) counters unpacked and assembled ([`super::mib_raw`]).
    MerlinRaw(super::mib_raw::RawMib),
}

/// Several partial scan rows per chunk: a 4-D chunk `(a, b, k_r, k_c)` is presented to the
/// engines as one record per scan row it touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockGeom {
    /// Scan rows per chunk.
    pub rows: u64,
    /// Scan columns per chunk.
    pub cols: u64,
    /// Scan columns of the dataset.
    pub scan_cols: u64,
}

/// What to do to a chunk record's stored bytes.
#[derive(Debug)]
pub struct HostDecode {
    pub(crate) filters: Vec<H5Filter>,
    pub(crate) block: Option<BlockGeom>,
    pub(crate) elem: ElemConv,
    /// Bytes of one stored frame after the filters (before the element conversion).
    pub(crate) stored_frame_bytes: usize,
    /// Bytes of one decoded frame.
    pub(crate) frame_bytes: usize,
    /// Float values that rounded below zero and were read as 0.
    negatives: AtomicU64,
}

impl HostDecode {
    pub(crate) fn new(
        filters: Vec<H5Filter>,
        block: Option<BlockGeom>,
        elem: ElemConv,
        stored_frame_bytes: usize,
        frame_bytes: usize,
    ) -> HostDecode {
        HostDecode {
            filters,
            block,
            elem,
            stored_frame_bytes,
            frame_bytes,
            negatives: AtomicU64::new(0),
        }
    }

    /// The same decoding with its counters at zero (for a new open of the same files).
    pub(crate) fn fresh(&self) -> HostDecode {
        HostDecode::new(
            self.filters.clone(),
            self.block,
            self.elem,
            self.stored_frame_bytes,
            self.frame_bytes,
        )
    }

    /// True when the frames are floats (float32 or float64) read as counts.
    pub fn is_float(&self) -> bool {
        matches!(
            self.elem,
            ElemConv::Float32 { .. } | ElemConv::Float64 { .. }
        )
    }

    /// A short description for provenance, e.g. `"hdf5 filters [shuffle, deflate]; float32 / 1"`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if !self.filters.is_empty() {
            let names: Vec<&str> = self.filters.iter().map(|f| f.name()).collect();
            parts.push(format!("hdf5 filters [{}]", names.join(", ")));
        }
        if let Some(b) = self.block {
            parts.push(format!(
                "4-D chunks of {}x{} scan positions",
                b.rows, b.cols
            ));
        }
        match self.elem {
            ElemConv::Same => {}
            ElemConv::Swap(n) => parts.push(format!("big-endian {}-byte integers", n)),
            ElemConv::Float32 { scale, .. } => parts.push(format!(
                "float32 counts: round(value / {scale}), values below -0.5 read as 0"
            )),
            ElemConv::Float64 { scale, .. } => parts.push(format!(
                "float64 counts: round(value / {scale}), values below -0.5 read as 0"
            )),
            ElemConv::Signed { size, .. } => parts.push(format!(
                "int{} read as uint{} (negative values are errors)",
                size * 8,
                size * 8
            )),
            ElemConv::Int64 { signed, .. } => parts.push(format!(
                "{} read as uint32 (values outside 0..=4294967295 are errors)",
                if signed { "int64" } else { "uint64" }
            )),
            ElemConv::MerlinRaw(r) => parts.push(format!(
                "Merlin raw R64 {}-bit counters{}",
                r.bits,
                if r.quad { ", 2x2 quad assembled" } else { "" }
            )),
        }
        parts.join("; ")
    }

    /// Float values that rounded below zero and were read as 0, so far.
    pub fn negatives_clamped(&self) -> u64 {
        self.negatives.load(Ordering::Relaxed)
    }

    /// Decode the stored bytes of one record (`first_frame`, `frames` frames; `filter_mask` as
    /// HDF5 reports it) into `out` (resized to `frames · frame_bytes`).
    pub(crate) fn decode(
        &self,
        file: &Path,
        rec: &ChunkRecord,
        stored: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let (first_frame, frames, filter_mask) = (
            rec.first_frame,
            rec.frames_in_chunk as usize,
            rec.filter_mask,
        );
        let err = |msg: String| {
            Error::decode(OP, msg)
                .with_file(file)
                .with_frame(first_frame)
        };
        // Frames held by the stored unit (a whole 4-D block, or the record itself).
        let (unit_frames, skip) = match self.block {
            Some(b) => {
                let row = first_frame / b.scan_cols.max(1);
                (
                    (b.rows * b.cols) as usize,
                    ((row % b.rows) * b.cols) as usize,
                )
            }
            None => (frames, 0),
        };
        let want = unit_frames
            .checked_mul(self.stored_frame_bytes)
            .ok_or_else(|| err("chunk size overflows".into()))?;
        let emit = |unfiltered: &[u8], out: &mut Vec<u8>| -> Result<()> {
            let a = skip * self.stored_frame_bytes;
            let b = a + frames * self.stored_frame_bytes;
            let part = unfiltered.get(a..b).ok_or_else(|| {
                err(format!(
                    "decoded chunk holds {} bytes, frames need {b}",
                    unfiltered.len()
                ))
            })?;
            self.convert(file, first_frame, part, out)
        };
        if self.filters.is_empty() {
            if stored.len() != want {
                return Err(err("stored chunk has the wrong size".into())
                    .with_expected(format!("{want} bytes"))
                    .with_found(format!("{} bytes", stored.len())));
            }
            return emit(stored, out);
        }
        if self.block.is_some() {
            // The same block serves `rows` records in a row: keep the last one per thread.
            let key = (self as *const HostDecode as usize, rec.file, rec.offset);
            let hit = LAST_BLOCK.with(|c| {
                let c = c.borrow();
                match &*c {
                    Some((k, bytes)) if *k == key => Some(emit(bytes, out)),
                    _ => None,
                }
            });
            if let Some(r) = hit {
                return r;
            }
            let bytes = self.unfilter(file, first_frame, filter_mask, stored, want)?;
            let r = emit(&bytes, out);
            LAST_BLOCK.with(|c| *c.borrow_mut() = Some((key, bytes)));
            return r;
        }
        let bytes = self.unfilter(file, first_frame, filter_mask, stored, want)?;
        emit(&bytes, out)
    }

    /// Undo the filter pipeline (last applied first); a filter whose `filter_mask` bit is set was
    /// skipped by the writer. The result must be exactly `want` bytes.
    fn unfilter(
        &self,
        file: &Path,
        frame: u64,
        filter_mask: u32,
        stored: &[u8],
        want: usize,
    ) -> Result<Vec<u8>> {
        let err = |msg: String| Error::decode(OP, msg).with_file(file).with_frame(frame);
        let mut cur: Vec<u8> = stored.to_vec();
        for (i, f) in self.filters.iter().enumerate().rev() {
            if i < 32 && filter_mask & (1 << i) != 0 {
                continue;
            }
            cur = match *f {
                H5Filter::Deflate => {
                    let mut out = Vec::with_capacity(want);
                    let mut d =
                        flate2::read::ZlibDecoder::new(cur.as_slice()).take(want as u64 + 1);
                    d.read_to_end(&mut out)
                        .map_err(|e| err(format!("deflate stream is corrupt: {e}")))?;
                    out
                }
                H5Filter::Zstd => {
                    let mut out = Vec::with_capacity(want);
                    let mut d = zstd_decoder(&cur).map_err(|e| err(format!("zstd: {e}")))?;
                    (&mut d)
                        .take(want as u64 + 1)
                        .read_to_end(&mut out)
                        .map_err(|e| err(format!("zstd frame is corrupt: {e}")))?;
                    out
                }
                H5Filter::Lz4 => {
                    let mut out = vec![0u8; want];
                    qem_codec::lz4_filter::decode_chunk(&cur, &mut out)
                        .map_err(|e| err(format!("HDF5 LZ4 (32004) chunk: {e}")))?;
                    out
                }
                H5Filter::Blosc => {
                    let mut out = vec![0u8; want];
                    blosc_decode(&cur, &mut out).map_err(|m| err(format!("Blosc chunk: {m}")))?;
                    out
                }
                H5Filter::Fletcher32 => {
                    if cur.len() < 4 {
                        return Err(err("Fletcher-32 chunk shorter than its checksum".into()));
                    }
                    let n = cur.len() - 4;
                    if fletcher32(&cur[..n])
                        != u32::from_le_bytes([cur[n], cur[n + 1], cur[n + 2], cur[n + 3]])
                    {
                        return Err(err("Fletcher-32 checksum mismatch".into()));
                    }
                    cur.truncate(n);
                    cur
                }
                H5Filter::Shuffle(es) => unshuffle(&cur, es),
            };
        }
        if cur.len() != want {
            return Err(err("decoded chunk has the wrong size".into())
                .with_expected(format!("{want} bytes"))
                .with_found(format!("{} bytes", cur.len())));
        }
        Ok(cur)
    }

    /// Stored element bytes of whole frames → the source's little-endian elements.
    fn convert(&self, file: &Path, first_frame: u64, part: &[u8], out: &mut Vec<u8>) -> Result<()> {
        out.clear();
        match self.elem {
            ElemConv::Same => out.extend_from_slice(part),
            ElemConv::Swap(n) => {
                out.extend_from_slice(part);
                for e in out.chunks_exact_mut(n.max(1)) {
                    e.reverse();
                }
            }
            ElemConv::Float32 { scale, big_endian } => {
                let f = |b: &[u8]| {
                    let a = [b[0], b[1], b[2], b[3]];
                    f64::from(if big_endian {
                        f32::from_be_bytes(a)
                    } else {
                        f32::from_le_bytes(a)
                    })
                };
                self.float_counts(file, first_frame, part, out, (4, scale), f)?
            }
            ElemConv::Float64 { scale, big_endian } => {
                let f = |b: &[u8]| {
                    let a: [u8; 8] = b.try_into().unwrap_or([0; 8]);
                    if big_endian {
                        f64::from_be_bytes(a)
                    } else {
                        f64::from_le_bytes(a)
                    }
                };
                self.float_counts(file, first_frame, part, out, (8, scale), f)?
            }
            ElemConv::Signed { size, big_endian } => {
                self.checked_integers(file, first_frame, part, out, (size, true, big_endian))?
            }
            ElemConv::Int64 { signed, big_endian } => {
                self.checked_integers(file, first_frame, part, out, (8, signed, big_endian))?
            }
            ElemConv::MerlinRaw(r) => r.convert(part, out),
        }
        if out.len() != part.len() / self.stored_frame_bytes.max(1) * self.frame_bytes {
            return Err(
                Error::internal(OP, "element conversion produced the wrong size")
                    .with_file(file)
                    .with_frame(first_frame),
            );
        }
        Ok(())
    }

    /// The error for stored value `found` at element `i` of `part` (frames from `first_frame`).
    fn value_error(&self, file: &Path, first_frame: u64, i: usize, es: usize) -> Error {
        let per_frame = (self.stored_frame_bytes / es.max(1)).max(1);
        Error::decode(
            OP,
            format!("the value at pixel {} is not a count", i % per_frame),
        )
        .with_file(file)
        .with_frame(first_frame + (i / per_frame) as u64)
    }

    /// Floats of `es` bytes (read by `read`) → `u32` counts `round(value / scale)`; values that
    /// round below zero read 0 (counted), NaN, infinities and counts past `u32::MAX` are errors.
    fn float_counts(
        &self,
        file: &Path,
        first_frame: u64,
        part: &[u8],
        out: &mut Vec<u8>,
        (es, scale): (usize, f64),
        read: impl Fn(&[u8]) -> f64,
    ) -> Result<()> {
        out.reserve(part.len() / es * 4);
        let mut neg = 0u64;
        for (i, b) in part.chunks_exact(es).enumerate() {
            let v = read(b);
            let c = (v / scale).round();
            let n = if c.is_nan() || c > f64::from(u32::MAX) {
                return Err(self
                    .value_error(file, first_frame, i, es)
                    .with_expected(format!("finite, round(value / {scale}) <= {}", u32::MAX))
                    .with_found(format!("{v}")));
            } else if c < 0.0 {
                neg += 1;
                0
            } else {
                c as u32
            };
            out.extend_from_slice(&n.to_le_bytes());
        }
        if neg > 0 {
            self.negatives.fetch_add(neg, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Integers of `es` bytes (1, 2, 4 or 8; signed or not; either byte order) → little-endian
    /// unsigned counts of the same width, or `u32` for 8-byte values; a value that does not fit
    /// (negative, or past `u32::MAX` for 8 bytes) is an error naming its frame and pixel.
    fn checked_integers(
        &self,
        file: &Path,
        first_frame: u64,
        part: &[u8],
        out: &mut Vec<u8>,
        (es, signed, big_endian): (usize, bool, bool),
    ) -> Result<()> {
        let out_es = es.min(4);
        let max = (1u64 << (8 * out_es)) - 1;
        out.reserve(part.len() / es.max(1) * out_es);
        for (i, b) in part.chunks_exact(es.max(1)).enumerate() {
            let mut w = [0u8; 8];
            w[..es].copy_from_slice(b);
            if big_endian {
                w[..es].reverse();
            }
            let v = if signed {
                let shift = 64 - 8 * es as u32;
                i128::from((i64::from_le_bytes(w) << shift) >> shift)
            } else {
                i128::from(u64::from_le_bytes(w))
            };
            if v < 0 || v > i128::from(max) {
                return Err(self
                    .value_error(file, first_frame, i, es)
                    .with_expected(format!("counts in 0..={max}"))
                    .with_found(v.to_string()));
            }
            out.extend_from_slice(&(v as u64).to_le_bytes()[..out_es]);
        }
        Ok(())
    }
}

type BlockKey = (usize, u32, u64);

thread_local! {
    static LAST_BLOCK: RefCell<Option<(BlockKey, Vec<u8>)>> = const { RefCell::new(None) };
}

/// HDF5's shuffle filter undone: byte `j` of element `i` was stored at `j·n + i`; a tail of
/// `len mod es` bytes is stored as it is.
pub(crate) fn unshuffle(src: &[u8], es: usize) -> Vec<u8> {
    if es <= 1 {
        return src.to_vec();
    }
    let n = src.len() / es;
    let mut out = vec![0u8; src.len()];
    for j in 0..es {
        let plane = &src[j * n..(j + 1) * n];
        for (i, &b) in plane.iter().enumerate() {
            out[i * es + j] = b;
        }
    }
    out[n * es..].copy_from_slice(&src[n * es..]);
    out
}

/// HDF5's Fletcher-32 (`H5_checksum_fletcher32`): 16-bit big-endian words, an odd last byte as
/// the high byte of a word, sums folded with `(s & 0xffff) + (s >> 16)`.
pub(crate) fn fletcher32(data: &[u8]) -> u32 {
    let fold = |s: u32| (s & 0xffff) + (s >> 16);
    let (mut s1, mut s2) = (0u32, 0u32);
    let mut words = data.chunks_exact(2);
    let mut k = 0;
    for w in words.by_ref() {
        s1 += (u32::from(w[0]) << 8) | u32::from(w[1]);
        s2 += s1;
        k += 1;
        if k == 360 {
            (s1, s2, k) = (fold(s1), fold(s2), 0);
        }
    }
    (s1, s2) = (fold(s1), fold(s2));
    if let [b] = words.remainder() {
        s1 += u32::from(*b) << 8;
        s2 += s1;
        (s1, s2) = (fold(s1), fold(s2));
    }
    (s1, s2) = (fold(s1), fold(s2));
    (s2 << 16) | s1
}

fn zstd_decoder(bytes: &[u8]) -> std::io::Result<impl Read + '_> {
    ruzstd::decoding::StreamingDecoder::new(bytes)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unshuffle_inverts_the_layout() {
        // u16 elements 0x0201, 0x0403, 0x0605 + one tail byte 7
        let stored = [1u8, 3, 5, 2, 4, 6, 7];
        assert_eq!(unshuffle(&stored, 2), vec![1, 2, 3, 4, 5, 6, 7]);
    }

    /// A buffer made by c-blosc's compressor with `codec` and `shuffle` (0 none, 1 byte,
    /// 2 bit) from u16 values.
    fn blosc_buffer(data: &[u16], codec: &std::ffi::CStr, shuffle: i32) -> Vec<u8> {
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut out = vec![0u8; bytes.len() + 16];
        // SAFETY: the buffers are valid for the sizes passed; the compressor writes at most
        // `out.len()` bytes.
        let n = unsafe {
            blosc_src::blosc_compress_ctx(
                5,
                shuffle,
                2,
                bytes.len(),
                bytes.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                out.len(),
                codec.as_ptr(),
                0,
                1,
            )
        };
        assert!(n > 0, "compress failed: {n}");
        out.truncate(n as usize);
        out
    }

    #[test]
    fn blosc_round_trips_every_codec_and_shuffle_and_refuses_bad_buffers() {
        let data: Vec<u16> = (0..20_000u32).map(|i| ((i * 7919) % 613) as u16).collect();
        let want: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        for codec in [c"blosclz", c"lz4", c"lz4hc", c"zlib", c"zstd"] {
            for shuffle in [0, 1, 2] {
                let buf = blosc_buffer(&data, codec, shuffle);
                let mut out = vec![0u8; want.len()];
                blosc_decode(&buf, &mut out).unwrap();
                assert!(out == want, "{codec:?} shuffle {shuffle}");
            }
        }
        let buf = blosc_buffer(&data, c"lz4", 1);
        let mut out = vec![0u8; want.len()];
        // Truncated: the header claims more bytes than are stored.
        let e = blosc_decode(&buf[..buf.len() - 1], &mut out).unwrap_err();
        assert!(e.contains("claims more bytes"), "{e}");
        assert!(blosc_decode(&buf[..10], &mut out)
            .unwrap_err()
            .contains("16-byte header"));
        // The wrong size for the chunk.
        let mut short = vec![0u8; want.len() - 2];
        assert!(blosc_decode(&buf, &mut short)
            .unwrap_err()
            .contains("the chunk needs"));
        // Corrupt payload bytes: an error or (if the codec cannot tell) different bytes, never
        // a read or write out of bounds (the fuzz and ASan runs cover the rest).
        let mut bad = buf.clone();
        for b in bad.iter_mut().skip(40).step_by(7) {
            *b ^= 0x5a;
        }
        let mut out2 = vec![0u8; want.len()];
        assert!(blosc_decode(&bad, &mut out2).is_err() || out2 != want);
    }
}
