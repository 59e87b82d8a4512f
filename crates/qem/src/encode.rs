//! Making the ENCODED representation on the CPU: fit the counts model on a sample of frames,
//! then encode the frames in bands of scan rows, so the whole dense acquisition is never held.

use qem_core::{
    CodecInfo, DType, DenseArray, Error, NoProgress, Progress, Region, Result, Shape2, StageTiming,
};
use qem_cpu::{EncodedFrames, FramePlan, LoadHooks};
use rayon::prelude::*;
use std::time::Instant;

/// Dense bytes of one band of scan rows (and the most the fitting sample may take).
const BAND_BYTES: usize = 256 << 20;

/// What an encoded load produced.
#[derive(Debug)]
pub(crate) struct EncodedLoad {
    /// The frames.
    pub frames: EncodedFrames,
    /// Values clipped by a saturating request.
    pub saturated: u64,
    /// Compressed bytes read for the frames (the bands; the fitting sample is not counted).
    pub bytes_read: u64,
    /// Frames the model was fitted on.
    pub fit_frames: u64,
    /// Stage timings.
    pub timings: Vec<StageTiming>,
}

/// Forwards progress and cancellation of the bands, but not their begin/end: one stage spans
/// every band.
struct BandProgress<'a>(&'a dyn Progress);

impl Progress for BandProgress<'_> {
    fn begin(&self, _what: &str, _total: u64) {}
    fn advance(&self, n: u64) {
        self.0.advance(n);
    }
    fn end(&self) {}
    fn cancelled(&self) -> bool {
        self.0.cancelled()
    }
}

fn cancelled(op: &str) -> Error {
    Error::invalid(op, "cancelled by the caller")
}

/// Counts of a `u8` or `u16` dense array as `u16` (refusing `u32`, which ENCODED cannot hold).
pub(crate) fn to_u16(data: DenseArray) -> Result<Vec<u16>> {
    match data {
        DenseArray::U16(v) => Ok(v),
        DenseArray::U8(v) => Ok(v.into_iter().map(u16::from).collect()),
        DenseArray::U32(_) => Err(u32_refusal("encode")),
    }
}

/// The error for a `u32` result asked to be ENCODED.
pub(crate) fn u32_refusal(op: &str) -> Error {
    Error::invalid(
        op,
        "ENCODED holds counts up to 65535: use representation='dense' or dtype='u16'",
    )
    .with_expected("result dtype u8 or u16")
    .with_found("u32")
}

/// Frames in the fitting sample: about [`qem_cpu::FIT_SAMPLE_FRAMES`], fewer for large frames
/// so the sample stays within one band's bytes.
pub(crate) fn sample_count(frame_bytes: usize) -> usize {
    (BAND_BYTES / frame_bytes.max(1)).clamp(64, qem_cpu::FIT_SAMPLE_FRAMES)
}

/// Load `region` of `src` through `plan` as ENCODED frames: fit the model on a sample of frames
/// spread evenly over the region, then load, encode and append bands of about 256 MiB of scan
/// rows. `budget` bounds the encoded bytes (checked after every band).
pub(crate) fn encode_source(
    src: &qem_io::Source,
    region: Region,
    plan: &FramePlan,
    budget: Option<u64>,
    progress: &dyn Progress,
) -> Result<EncodedLoad> {
    let out_shape = plan.output_shape();
    let frame_len = plan.output_len();
    let frame_bytes = frame_len * plan.result_dtype().size();
    if plan.result_dtype() == DType::U32 {
        return Err(u32_refusal("load"));
    }
    let shape = region.shape();
    let n = shape.len();

    // 1. Fit on a sample spread evenly over the region (row-major order of the region).
    let t = Instant::now();
    let picks = qem_cpu::sample_indices(n, sample_count(frame_bytes));
    progress.begin("fit model", picks.len() as u64);
    let sample: Result<Vec<Vec<u16>>> = picks
        .par_iter()
        .map(|&i| {
            if progress.cancelled() {
                return Err(cancelled("load"));
            }
            let r = region.row_start + i / shape.cols;
            let c = region.col_start + i % shape.cols;
            let one = qem_cpu::load_dense(
                src,
                Region::new(r, r + 1, c, c + 1),
                plan,
                LoadHooks {
                    progress: &NoProgress,
                },
            )?;
            progress.advance(1);
            to_u16(one.data)
        })
        .collect();
    progress.end();
    let sample = sample?;
    let model = qem_cpu::fit_model(sample.iter().map(Vec::as_slice), frame_len)?;
    drop(sample);
    let t_fit = t.elapsed().as_secs_f64();

    // 2. Bands of scan rows: load dense, encode, append.
    let t = Instant::now();
    let mut frames = EncodedFrames::new(model, out_shape)?;
    let rows_per_band = (BAND_BYTES / (shape.cols * frame_bytes).max(1)).max(1);
    let mut saturated = 0;
    let mut bytes_read = 0;
    let mut encode_s = 0.0;
    progress.begin("load+encode", n as u64);
    let band_progress = BandProgress(progress);
    let result = (|| -> Result<()> {
        let mut row = region.row_start;
        while row < region.row_stop {
            if progress.cancelled() {
                return Err(cancelled("load"));
            }
            let stop = (row + rows_per_band).min(region.row_stop);
            let band = qem_cpu::load_dense(
                src,
                Region::new(row, stop, region.col_start, region.col_stop),
                plan,
                LoadHooks {
                    progress: &band_progress,
                },
            )?;
            saturated += band.saturated;
            bytes_read += band.bytes_read;
            let counts = to_u16(band.data)?;
            let te = Instant::now();
            frames
                .append(&counts)
                .map_err(|e| source_frame(e, region, src.scan_shape.cols))?;
            encode_s += te.elapsed().as_secs_f64();
            if let Some(b) = budget {
                if frames.nbytes() > b {
                    return Err(Error::memory_budget("load (ENCODED)", frames.nbytes(), b)
                        .with_op("load (ENCODED; limit: the memory_budget)"));
                }
            }
            row = stop;
        }
        Ok(())
    })();
    progress.end();
    result?;
    Ok(EncodedLoad {
        frames,
        saturated,
        bytes_read,
        fit_frames: picks.len() as u64,
        timings: vec![
            StageTiming::new("fit model (wall; sample read+decode+fit)", t_fit),
            StageTiming::new(
                "read+decode+encode in bands (wall)",
                t.elapsed().as_secs_f64(),
            ),
            StageTiming::new("encode (wall, within the bands)", encode_s),
        ],
    })
}

/// An encode error names the frame by its index in the region (row-major); make it the
/// source's flat frame index.
fn source_frame(e: Error, region: Region, source_cols: usize) -> Error {
    let cols = region.shape().cols.max(1);
    match e.frame {
        Some(i) => {
            let i = i as usize;
            let r = region.row_start + i / cols;
            let c = region.col_start + i % cols;
            let mut e = e;
            e.frame = Some((r * source_cols + c) as u64);
            e
        }
        None => e,
    }
}

/// Encode dense `u8`/`u16` frames (`[n, frame_shape]`) held in memory: fit on a sample spread
/// evenly over them, then encode in pieces (progress per piece).
pub(crate) fn encode_dense(
    data: &DenseArray,
    frame_shape: Shape2,
    progress: &dyn Progress,
) -> Result<(EncodedFrames, u64)> {
    let frame_len = frame_shape.len().max(1);
    let n = data.len() / frame_len;
    let frame_bytes = frame_len * data.dtype().size();
    let picks = qem_cpu::sample_indices(n, sample_count(frame_bytes));
    let frame_u16 = |i: usize| -> Result<Vec<u16>> { to_u16(data.slice(i * frame_len, frame_len)) };
    let model = match data {
        DenseArray::U16(v) => qem_cpu::fit_model(
            picks
                .iter()
                .map(|&i| &v[i * frame_len..(i + 1) * frame_len]),
            frame_len,
        )?,
        DenseArray::U8(_) => {
            let sample = picks
                .iter()
                .map(|&i| frame_u16(i))
                .collect::<Result<Vec<_>>>()?;
            qem_cpu::fit_model(sample.iter().map(Vec::as_slice), frame_len)?
        }
        DenseArray::U32(_) => return Err(u32_refusal("encode")),
    };
    let mut frames = EncodedFrames::new(model, frame_shape)?;
    let piece = (BAND_BYTES / frame_bytes.max(1)).clamp(1, 4096);
    progress.begin("encode", n as u64);
    let result = (|| -> Result<()> {
        let mut start = 0;
        while start < n {
            if progress.cancelled() {
                return Err(cancelled("encode"));
            }
            let stop = (start + piece).min(n);
            match data {
                DenseArray::U16(v) => frames.append(&v[start * frame_len..stop * frame_len])?,
                _ => frames.append(&to_u16(
                    data.slice(start * frame_len, (stop - start) * frame_len),
                )?)?,
            }
            progress.advance((stop - start) as u64);
            start = stop;
        }
        Ok(())
    })();
    progress.end();
    result?;
    Ok((frames, picks.len() as u64))
}

/// The provenance record of the codec of frames coded with `m`, `encoded` bytes in all (streams,
/// index and model), on the host or on the GPU.
pub(crate) fn codec_info(
    m: &qem_codec::rans::CountsModel,
    encoded: u64,
    fit_frames: u64,
    dense_bytes: u64,
    source_compressed_bytes: Option<u64>,
) -> CodecInfo {
    let model_bytes = m.serialized_len() as u64;
    let ratio = |num: u64| {
        if encoded == 0 {
            0.0
        } else {
            num as f64 / encoded as f64
        }
    };
    CodecInfo {
        name: qem_cpu::CODEC_NAME.to_string(),
        version: qem_cpu::CODEC_VERSION,
        model: serde_json::json!({
            "contexts": m.contexts(),
            "literals": m.literals(),
            "symbols": m.symbols(),
            "table_sets": m.table_sets(),
            "split": m.split(),
            "context_rule": "quantiles",
            "prob_bits": qem_codec::rans::PROB_BITS,
            "lanes": qem_codec::rans::LANES,
            "frame_len": m.frame_len(),
            "floor": "all_symbols",
            "frames_per_stream": 1,
            "model_bytes": model_bytes,
        }),
        fit_frames,
        encoded_bytes: encoded,
        dense_bytes,
        ratio_to_dense: ratio(dense_bytes),
        source_compressed_bytes,
        ratio_to_source: source_compressed_bytes.map(ratio),
    }
}
