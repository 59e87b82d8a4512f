//! The ENCODED representation in host memory: every frame as one rANS counts stream
//! (`qem_codec::rans`), packed into one arena with a 16-byte-aligned index.
//!
//! The layout is the `.qem` container's own (`qem_codec::qem_file`): the index entries are the
//! file's StreamIndex entries (offset into the arena, stream length, tag = frames in the stream
//! = 1), and the arena is the file's Streams section byte for byte, so saving writes the arena
//! as it is and reopening takes it back without re-encoding. The same index and arena can be
//! uploaded to a GPU as they are.
//!
//! Frames are `u16` counts (the codec codes values up to 65535). A dataset whose result dtype
//! is `u8` stores its frames widened to `u16` and narrows them on decode (the façade does that);
//! `u32` results cannot be held ENCODED.
//!
//! The model is fitted on a sample of frames ([`sample_indices`], [`fit_model`]) with every
//! symbol given a non-zero frequency in every context, so any `u16` frame is codable whatever
//! the sample saw (a value the sample never saw only costs more bits).

use qem_codec::qem_file::{StreamEntry, INDEX_ENTRY_LEN, STREAM_ALIGN};
use qem_codec::rans::{self, CountsModel, FloorPolicy, ModelParams, RansError};
use qem_core::{Error, ErrorKind, Result, Shape2};
use rayon::prelude::*;
use std::path::{Path, PathBuf};

/// Name of the codec, recorded in provenance and in `.qem` metadata.
pub const CODEC_NAME: &str = "rans-counts v2";
/// Version of the codec's stream and table format this build writes.
pub const CODEC_VERSION: u32 = 2;
/// Tag of every stream: the number of frames it holds (one).
pub const STREAM_TAG_ONE_FRAME: u32 = 1;
/// How many frames the model is fitted on (spread evenly over the frames; all if fewer).
pub const FIT_SAMPLE_FRAMES: usize = 4096;

/// The model parameters every ENCODED dataset is fitted with: the codec's defaults, with every
/// symbol given a frequency in every row ([`FloorPolicy::AllSymbols`]) because the model is
/// fitted on a sample and must code every frame.
pub fn model_params() -> ModelParams {
    ModelParams {
        floor: FloorPolicy::AllSymbols,
        ..ModelParams::default()
    }
}

/// `count` frame indices spread evenly over `0..n` (all of them when `n <= count`), ascending.
pub fn sample_indices(n: usize, count: usize) -> Vec<usize> {
    if n <= count {
        return (0..n).collect();
    }
    (0..count).map(|i| i * n / count).collect()
}

/// Fit the counts model on `frames` (each `frame_len` pixels) with [`model_params`], so that
/// every `u16` value is codable at every pixel.
pub fn fit_model<'a, I>(frames: I, frame_len: usize) -> Result<CountsModel>
where
    I: IntoIterator<Item = &'a [u16]>,
    I::IntoIter: Clone,
{
    CountsModel::fit(frames, frame_len, &model_params()).map_err(|e| rans_error("fit model", e))
}

/// A codec error as a library error of the right kind: a corrupt stream or model table is a
/// `Decode` error, everything else an `Internal` one (callers add file and frame).
pub fn rans_error(op: &str, e: RansError) -> Error {
    let kind = match &e {
        RansError::Corrupt { .. } | RansError::StreamSize { .. } | RansError::BadModel { .. } => {
            ErrorKind::Decode
        }
        RansError::NoFrames => ErrorKind::InvalidArgument,
        _ => ErrorKind::Internal,
    };
    let err = Error::new(kind, op, e.to_string());
    match e {
        RansError::StreamSize {
            expected, found, ..
        }
        | RansError::BadModel {
            expected, found, ..
        } => err
            .with_expected(expected.to_string())
            .with_found(found.to_string()),
        RansError::FrameLength {
            expected, found, ..
        } => err
            .with_expected(format!("{expected} pixels"))
            .with_found(format!("{found} pixels")),
        _ => err,
    }
}

/// Every frame of an acquisition (or of a region of it) as rANS streams in one arena.
#[derive(Clone)]
pub struct EncodedFrames {
    model: CountsModel,
    model_bytes: usize,
    index: Vec<StreamEntry>,
    streams: Vec<u8>,
    frame_shape: Shape2,
    origin: Option<PathBuf>,
}

impl std::fmt::Debug for EncodedFrames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncodedFrames")
            .field("n_frames", &self.index.len())
            .field("frame_shape", &self.frame_shape)
            .field("stream_bytes", &self.streams.len())
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

impl EncodedFrames {
    /// No frames yet, coded with `model` (whose frame length must be `frame_shape.len()`).
    pub fn new(model: CountsModel, frame_shape: Shape2) -> Result<EncodedFrames> {
        if model.frame_len() != frame_shape.len() {
            return Err(Error::internal(
                "encode",
                "the model's frame length does not match the frame shape",
            )
            .with_expected(format!("{} pixels ({frame_shape})", frame_shape.len()))
            .with_found(format!("{} pixels", model.frame_len())));
        }
        let model_bytes = model.to_bytes().len();
        Ok(EncodedFrames {
            model,
            model_bytes,
            index: Vec::new(),
            streams: Vec::new(),
            frame_shape,
            origin: None,
        })
    }

    /// Encode `frames` (`n · frame_shape.len()` values, row-major) with `model`, in parallel.
    pub fn encode(model: CountsModel, frame_shape: Shape2, frames: &[u16]) -> Result<Self> {
        let mut e = EncodedFrames::new(model, frame_shape)?;
        e.append(frames)?;
        Ok(e)
    }

    /// Encode `frames` (whole frames, row-major) in parallel and append them after the frames
    /// already held.
    pub fn append(&mut self, frames: &[u16]) -> Result<()> {
        let frame_len = self.frame_shape.len();
        if frame_len == 0 || frames.len() % frame_len != 0 {
            return Err(Error::internal("encode", "not a whole number of frames")
                .with_expected(format!("a multiple of {frame_len} values"))
                .with_found(format!("{} values", frames.len())));
        }
        let first = self.index.len() as u64;
        let model = &self.model;
        let encoded: Vec<Vec<u8>> = frames
            .par_chunks_exact(frame_len)
            .enumerate()
            .map(|(i, f)| {
                rans::encode_stream(model, f)
                    .map_err(|e| rans_error("encode", e).with_frame(first + i as u64))
            })
            .collect::<Result<_>>()?;
        let total: usize = encoded
            .iter()
            .map(|s| s.len() + STREAM_ALIGN as usize)
            .sum();
        self.streams.reserve(total);
        for s in &encoded {
            self.push_stream(s)?;
        }
        Ok(())
    }

    fn push_stream(&mut self, stream: &[u8]) -> Result<()> {
        let length = u32::try_from(stream.len()).map_err(|_| {
            Error::internal("encode", "a stream longer than 4 GiB")
                .with_frame(self.index.len() as u64)
        })?;
        let offset = self.streams.len().next_multiple_of(STREAM_ALIGN as usize);
        self.streams.resize(offset, 0);
        self.streams.extend_from_slice(stream);
        self.index.push(StreamEntry {
            offset: offset as u64,
            length,
            tag: STREAM_TAG_ONE_FRAME,
        });
        Ok(())
    }

    /// Take an index and arena as they are (e.g. from a `.qem` file) after checking that the
    /// index fits the arena: one-frame tags, 16-byte-aligned ascending offsets, no overlap,
    /// everything in bounds, zero gaps. Streams are not decoded here: the decoder's own checks
    /// run when a frame is decoded.
    pub fn from_parts(
        model: CountsModel,
        frame_shape: Shape2,
        index: Vec<StreamEntry>,
        streams: Vec<u8>,
    ) -> Result<EncodedFrames> {
        let mut e = EncodedFrames::new(model, frame_shape)?;
        let mut end = 0u64;
        for (i, entry) in index.iter().enumerate() {
            let bad = |what: &str, expected: String, found: String| {
                Err(
                    Error::decode("open encoded frames", format!("stream index: {what}"))
                        .with_frame(i as u64)
                        .with_expected(expected)
                        .with_found(found),
                )
            };
            if entry.tag != STREAM_TAG_ONE_FRAME {
                return bad(
                    "frames in the stream",
                    STREAM_TAG_ONE_FRAME.to_string(),
                    entry.tag.to_string(),
                );
            }
            if entry.offset % STREAM_ALIGN != 0 || entry.offset < end {
                return bad(
                    "stream offset",
                    format!("a multiple of {STREAM_ALIGN} at or after byte {end}"),
                    entry.offset.to_string(),
                );
            }
            let stop = entry.offset.saturating_add(u64::from(entry.length));
            if stop > streams.len() as u64 {
                return bad(
                    "stream end",
                    format!("<= {} (arena bytes)", streams.len()),
                    stop.to_string(),
                );
            }
            end = stop;
        }
        e.index = index;
        e.streams = streams;
        Ok(e)
    }

    /// Name `path` in decode errors (the `.qem` file the streams came from).
    pub fn with_origin(mut self, path: impl AsRef<Path>) -> Self {
        self.origin = Some(path.as_ref().to_path_buf());
        self
    }

    /// The file the streams came from, if any.
    pub fn origin(&self) -> Option<&Path> {
        self.origin.as_deref()
    }

    /// The counts model (context map and frequency tables).
    pub fn model(&self) -> &CountsModel {
        &self.model
    }

    /// One entry per frame, in frame order.
    pub fn index(&self) -> &[StreamEntry] {
        &self.index
    }

    /// The index as stored in a `.qem` file: 16 little-endian bytes per frame (`u64` offset,
    /// `u32` length, `u32` tag), ready to upload to a GPU.
    pub fn index_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.index.len() * INDEX_ENTRY_LEN);
        for e in &self.index {
            out.extend_from_slice(&e.offset.to_le_bytes());
            out.extend_from_slice(&e.length.to_le_bytes());
            out.extend_from_slice(&e.tag.to_le_bytes());
        }
        out
    }

    /// The arena: every stream at its index offset, gaps zero.
    pub fn streams(&self) -> &[u8] {
        &self.streams
    }

    /// The stream of frame `i`.
    pub fn stream(&self, i: usize) -> Result<&[u8]> {
        let e = self.index.get(i).ok_or_else(|| {
            Error::invalid("decode", "frame index out of range")
                .with_expected(format!("< {}", self.index.len()))
                .with_found(i.to_string())
        })?;
        let start = e.offset as usize;
        self.streams
            .get(start..start + e.length as usize)
            .ok_or_else(|| {
                Error::internal("decode", "stream out of bounds of the arena").with_frame(i as u64)
            })
    }

    /// Detector shape of every frame.
    pub fn frame_shape(&self) -> Shape2 {
        self.frame_shape
    }

    /// Number of frames held.
    pub fn n_frames(&self) -> usize {
        self.index.len()
    }

    /// Bytes held: arena + index + serialised model.
    pub fn nbytes(&self) -> u64 {
        (self.streams.len() + self.index.len() * INDEX_ENTRY_LEN + self.model_bytes) as u64
    }

    /// Bytes of the serialised model.
    pub fn model_nbytes(&self) -> u64 {
        self.model_bytes as u64
    }

    fn decode_error(&self, i: usize, e: RansError) -> Error {
        let err = rans_error("decode", e).with_frame(i as u64);
        match &self.origin {
            Some(p) => err.with_file(p),
            None => err,
        }
    }

    /// Decode frame `i` into `out` (`frame_shape.len()` values). A corrupt stream is a
    /// `Decode` error naming the frame (and the file, see [`with_origin`](Self::with_origin)).
    pub fn decode_frame(&self, i: usize, out: &mut [u16]) -> Result<()> {
        let stream = self.stream(i)?;
        rans::decode_stream(&self.model, stream, out).map_err(|e| self.decode_error(i, e))
    }

    /// Decode every frame into `out` (`n_frames · frame_shape.len()` values), in parallel.
    pub fn decode_into(&self, out: &mut [u16]) -> Result<()> {
        let frame_len = self.frame_shape.len();
        if out.len() != self.index.len() * frame_len {
            return Err(Error::internal("decode", "output has the wrong size")
                .with_expected(format!("{} values", self.index.len() * frame_len))
                .with_found(format!("{} values", out.len())));
        }
        out.par_chunks_exact_mut(frame_len.max(1))
            .enumerate()
            .try_for_each(|(i, slot)| self.decode_frame(i, slot))
    }

    /// Decode every frame into a new `[n_frames, k_r, k_c]` array, in parallel.
    pub fn decode_all(&self) -> Result<Vec<u16>> {
        let mut out = vec![0u16; self.index.len() * self.frame_shape.len()];
        self.decode_into(&mut out)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn frames(n: usize, len: usize) -> Vec<u16> {
        (0..n * len)
            .map(|i| {
                let x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                match x % 100 {
                    0..=70 => 0,
                    71..=97 => (x % 5) as u16,
                    _ => (x % 60_000) as u16,
                }
            })
            .collect()
    }

    /// `n` frames of `shape` ([`frames`]) coded with a model fitted on all of them.
    fn encoded(n: usize, shape: Shape2) -> EncodedFrames {
        let data = frames(n, shape.len());
        let model = fit_model(data.chunks_exact(shape.len()), shape.len()).unwrap();
        EncodedFrames::encode(model, shape, &data).unwrap()
    }

    #[test]
    fn round_trip_and_values_never_seen_by_the_sample() {
        let shape = Shape2::new(7, 9);
        let data = frames(20, shape.len());
        // Fit on frame 0 only, then code frames holding values it never saw (up to 65535).
        let model = fit_model([&data[..shape.len()]], shape.len()).unwrap();
        let mut data2 = data.clone();
        data2[5] = 65535;
        data2[100] = 40_000;
        let e = EncodedFrames::encode(model, shape, &data2).unwrap();
        assert_eq!(e.n_frames(), 20);
        assert_eq!(e.decode_all().unwrap(), data2);
        for entry in e.index() {
            assert_eq!(entry.offset % STREAM_ALIGN, 0);
            assert_eq!(entry.tag, 1);
        }
        let mut one = vec![0u16; shape.len()];
        e.decode_frame(3, &mut one).unwrap();
        assert_eq!(one, &data2[3 * shape.len()..4 * shape.len()]);
        let again = EncodedFrames::from_parts(
            e.model().clone(),
            shape,
            e.index().to_vec(),
            e.streams().to_vec(),
        )
        .unwrap();
        assert_eq!(again.decode_all().unwrap(), data2);
    }

    #[test]
    fn corrupt_stream_is_a_decode_error_naming_the_frame() {
        let shape = Shape2::new(8, 8);
        let e = encoded(4, shape);
        let mut streams = e.streams().to_vec();
        let at = e.index()[2].offset as usize + 16; // lane 0's final state (v2 header)
        streams[at..at + 4].copy_from_slice(&1u32.to_le_bytes());
        let bad = EncodedFrames::from_parts(e.model().clone(), shape, e.index().to_vec(), streams)
            .unwrap()
            .with_origin("x.qem");
        let err = bad.decode_all().unwrap_err();
        assert_eq!(err.kind, ErrorKind::Decode);
        assert_eq!(err.frame, Some(2));
        assert!(err.to_string().contains("x.qem"), "{err}");
    }

    #[test]
    fn index_out_of_bounds_is_refused() {
        let shape = Shape2::new(4, 4);
        let e = encoded(2, shape);
        let mut index = e.index().to_vec();
        index[1].length += 1000;
        let r = EncodedFrames::from_parts(e.model().clone(), shape, index, e.streams().to_vec());
        assert_eq!(r.unwrap_err().frame, Some(1));
    }

    #[test]
    fn sample_is_spread_evenly() {
        assert_eq!(sample_indices(3, 10), vec![0, 1, 2]);
        let s = sample_indices(100, 4);
        assert_eq!(s, vec![0, 25, 50, 75]);
    }
}
