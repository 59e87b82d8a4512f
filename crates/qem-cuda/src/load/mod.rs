//! The overlapped load pipeline: stored chunks → a dense GPU-resident array.
//!
//! 1. **Plan (host, no GPU):** the chunks holding the requested scan region's frames, sorted by
//!    `(file, offset)`, cut into batches of about [`PipelineOptions::batch_bytes`] compressed
//!    ([`plan_chunks`]); every device buffer is planned and admitted against
//!    `min(memory_budget, free − reserve)` before anything is allocated ([`admit`]).
//! 2. **Read (host threads):** a pool of reader threads `pread`s each batch's chunks straight
//!    into one of 2–3 reusable pinned slots and builds the batch's block table with the CPU
//!    parser (a framing error is a `Decode` error naming file and frame).
//! 3. **H2D (copy stream)** of the slot's bytes and tables, after the event that says the
//!    previous decode from that device slot has finished; an event marks the copy's end.
//! 4. **Decode (compute stream)** waits on that event. For a pass-through plan (whole
//!    detector, no bin, result dtype = source dtype) the kernel writes each chunk straight to
//!    its frames' place in the result; otherwise into a scratch buffer that the region/bin
//!    kernel turns into result frames.
//!
//! 5. **Encode (compute stream, ENCODED loads):** the rANS encoder takes the batch's frames,
//!    while a side stream sums them into the sum DP; the next batch's decode waits for both.
//!
//! The host waits only for a free pinned slot (its H2D event). Kernel errors accumulate in one
//! record (chunk indices are global to the load) checked once at the end. Bad pixels are zeroed
//! by a small kernel over the result (pass-through) or inside region/bin. Files: `plan` (1),
//! `reader` (2), `queue` (3–5 for one batch), `pipeline` (the loop, buffers' life, records),
//! `buffers`, `timings`, `records`; `encode` and `array` for the encoded and in-memory loads.

use std::sync::Arc;
use std::time::Instant;

use qem_core::{DType, DetectorPlan, Error, MemoryReport, Progress, Region, Result, StageTiming};
use qem_io::Source;

use crate::engine::engine;
use crate::mem::MemCounter;
use crate::rans::{self, DeviceEncoded};
use qem_codec::rans::{FloorPolicy, ModelParams};

mod array;
mod buffers;
mod encode;
mod pipeline;
mod plan;
mod queue;
mod reader;
mod records;
#[cfg(test)]
mod tests;
mod timings;

pub use array::{load_array, DeviceArray};
pub use encode::encode_device_array;
use encode::fit_and_size;
use pipeline::{pipeline, Sink};
use plan::plan_source;
pub use plan::{admit, plan_chunks, region_frames, BatchPlan, LoadPlan, MemoryPlan, PlanChunk};

/// Tuning of the pipeline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PipelineOptions {
    /// Host reader threads.
    pub reader_threads: usize,
    /// Target compressed bytes per batch.
    pub batch_bytes: u64,
    /// Pinned host slots (and device input buffers) in flight, 2..=4.
    pub slots: usize,
    /// Largest decode scratch (non-pass-through plans) in bytes.
    pub max_scratch_bytes: u64,
    /// Device memory left free for the allocator and other users.
    pub reserve_bytes: u64,
    /// Warps per CTA of the decode kernel.
    pub warps_per_cta: u32,
    /// Parse each LZ4 payload from the warp's shared buffer instead of global memory
    /// ([`crate::LaunchShape::stage_payload`]; same bytes and verdicts). Off until measured.
    pub stage_payload: bool,
    /// Encoding loads of unchanged frames: decode a batch on a second compute stream while the
    /// previous batch encodes on the first, with a second decode scratch, decode status and
    /// encoder scratch (admitted only when they fit; otherwise one stream as before). Off
    /// until measured on a card.
    pub overlap_encode: bool,
}

impl Default for PipelineOptions {
    fn default() -> Self {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(4);
        PipelineOptions {
            reader_threads: cores.clamp(2, 16),
            batch_bytes: 128 << 20,
            slots: 3,
            max_scratch_bytes: 512 << 20,
            reserve_bytes: 256 << 20,
            warps_per_cta: 1,
            stage_payload: false,
            overlap_encode: false,
        }
    }
}

/// What to load and how (the façade's plan, already validated).
#[derive(Clone, Copy)]
pub struct GpuLoadParams<'a> {
    /// Half-open scan region; only its frames' chunks are read.
    pub scan_region: Region,
    /// Detector region and bin, validated by the caller ([`DetectorPlan::new`]); its source
    /// shape must be the source's detector.
    pub detector: DetectorPlan,
    /// Result dtype.
    pub result_dtype: DType,
    /// Clip to the result dtype (explicit u8) instead of failing on overflow.
    pub saturate: bool,
    /// Source-sized bad-pixel mask (true = zero it), when masking.
    pub bad_mask: Option<&'a [bool]>,
    /// Caller's device-memory budget in bytes.
    pub memory_budget: Option<u64>,
    /// Pipeline tuning.
    pub options: PipelineOptions,
    /// Progress receiver (frames) and cancellation between batches.
    pub progress: Option<&'a dyn Progress>,
}

impl std::fmt::Debug for GpuLoadParams<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuLoadParams")
            .field("scan_region", &self.scan_region)
            .field("detector", &self.detector)
            .field("result_dtype", &self.result_dtype)
            .field("saturate", &self.saturate)
            .field("memory_budget", &self.memory_budget)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// A finished GPU load.
#[derive(Debug)]
pub struct GpuLoad {
    /// The result, synchronized.
    pub array: DeviceArray,
    /// Values clipped by a saturating u8 request.
    pub saturated: u64,
    /// Result frames.
    pub frames: u64,
    /// Compressed bytes read.
    pub bytes_read: u64,
    /// Batches.
    pub batches: usize,
    /// True when the kernel decoded straight into the result.
    pub direct: bool,
    /// Stage timings (overlapping stages are separate entries, never summed).
    pub timings: Vec<StageTiming>,
    /// Device-memory accounting.
    pub memory: MemoryReport,
}

/// Load `params.scan_region` of `src` into device memory with the overlapped pipeline.
pub fn load_source(src: &Source, params: &GpuLoadParams<'_>) -> Result<GpuLoad> {
    params.scan_region.validate(src.scan_shape, "scan_region")?;
    let frames = region_frames(src.scan_shape, params.scan_region);
    let out = pipeline(src, params, &frames, None, Sink::Dense, params.result_dtype)?;
    let rs = params.scan_region.shape();
    let Some(buf) = out.dense else {
        return Err(Error::internal(
            "load (cuda)",
            "dense pipeline without a result",
        ));
    };
    let e = engine()?;
    Ok(GpuLoad {
        array: DeviceArray {
            buf,
            shape: [rs.rows, rs.cols, out.output.rows, out.output.cols],
            dtype: params.result_dtype,
            ordinal: e.gpu.info().ordinal,
        },
        saturated: out.saturated,
        frames: out.frames,
        bytes_read: out.bytes_read,
        batches: out.batches,
        direct: out.direct,
        timings: out.timings,
        memory: out.memory,
    })
}

/// How an encoded load fits its model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EncodeOptions {
    /// Model parameters (`floor` should be `AllSymbols`: the model is fitted on a sample).
    pub model: ModelParams,
    /// Frames of the sample the model is fitted on (spread evenly over the scan region).
    pub sample_frames: u64,
    /// Arena headroom over the size the sample predicts (1.0 = none).
    pub headroom: f64,
}

impl Default for EncodeOptions {
    fn default() -> Self {
        EncodeOptions {
            model: ModelParams {
                floor: FloorPolicy::AllSymbols,
                ..ModelParams::default()
            },
            sample_frames: 4096,
            headroom: 1.08,
        }
    }
}

/// A finished encoded GPU load.
#[derive(Debug)]
pub struct GpuEncodedLoad {
    /// The acquisition, encoded on the device.
    pub encoded: DeviceEncoded,
    /// Result frames.
    pub frames: u64,
    /// Compressed bytes read (sample pass included).
    pub bytes_read: u64,
    /// Batches of the main pass.
    pub batches: usize,
    /// Times the arena had to be enlarged and the frames re-encoded (0 normally).
    pub retries: u32,
    /// Values clipped by a saturating u8 request (main pass).
    pub saturated: u64,
    /// Stage timings: the sample pass, the fit, the main pass' stages.
    pub timings: Vec<StageTiming>,
    /// Device-memory accounting of the main pass (the sample pass' buffers are freed first).
    pub memory: MemoryReport,
    /// The sum DP of the frames as loaded (masked, transformed), taken on the way by the load
    /// (u64 per detector pixel, exact); `None` where the frames were not all seen here.
    pub sum_dp: Option<Vec<u64>>,
}

/// Load `params.scan_region` of `src` into the GPU **encoded**: the model is fitted on an
/// evenly spread sample of frames (decoded densely on the GPU, then reduced by kernels), then
/// every batch is decoded, transformed and rANS-encoded on the GPU, so the dense acquisition
/// never exists in full on the device. The result dtype must be u16 or u8: u8 counts are
/// transformed straight into u16 frames (their values capped at 255, as a u8 result is) and
/// coded as u16 symbols, as the CPU engine widens them, so both engines write the same streams.
pub fn load_source_encoded(
    src: &Source,
    params: &GpuLoadParams<'_>,
    enc: &EncodeOptions,
) -> Result<GpuEncodedLoad> {
    let t0 = Instant::now();
    let op = "load encoded (cuda)";
    params.scan_region.validate(src.scan_shape, "scan_region")?;
    let value_dtype = params.result_dtype;
    if !matches!(value_dtype, DType::U8 | DType::U16) {
        return Err(Error::invalid(
            op,
            format!(
                "the encoded representation holds u16 counts; the result dtype would be {} (use dtype \"u16\" or representation \"dense\")",
                params.result_dtype
            ),
        ));
    }
    let wide = GpuLoadParams {
        result_dtype: DType::U16,
        ..*params
    };
    let params = &wide;
    let t = Instant::now();
    let e = engine()?;
    let k = e.rans()?;
    let t_engine = t.elapsed().as_secs_f64();
    let frames = region_frames(src.scan_shape, params.scan_region);
    let n = frames.len() as u64;
    // 1. Sample pass: dense, masked, transformed frames of the sample.
    let pick = rans::sample_frames(n, enc.sample_frames.max(1));
    let sample: Vec<u64> = pick.iter().map(|&i| frames[i as usize]).collect();
    let quiet = GpuLoadParams {
        progress: None,
        ..*params
    };
    // The main pass's plan (host work over 262,144 chunks: 11.4 ms on the H100's host before
    // the plan held references instead of record copies, 1.6–2.9 ms after on the 2-core VM)
    // is made on another thread while the sample pass runs.
    let (s_out, main_plan) = std::thread::scope(|sc| {
        let planner = sc.spawn(|| {
            let t = Instant::now();
            plan_source(src, &frames, false, &params.options).map(|p| (p, t.elapsed()))
        });
        let s_out = pipeline(src, &quiet, &sample, None, Sink::Dense, value_dtype);
        let plan = planner
            .join()
            .map_err(|_| Error::internal(op, "the load planner panicked"))
            .and_then(|r| r);
        (s_out, plan)
    });
    let s_out = s_out?;
    let (main_plan, t_main_plan) = main_plan?;
    let mut main_plan = Some(main_plan);
    // The sample pass's own stages (its first-use costs: pinned slots, device buffers, reader
    // pool), reported under its name.
    let mut sample_stages: Vec<StageTiming> = s_out
        .timings
        .iter()
        .map(|st| StageTiming::new(format!("sample pass: {}", st.stage), st.seconds))
        .collect();
    let out_shape = s_out.output;
    let frame_len = out_shape.len();
    let Some(s_buf) = s_out.dense else {
        return Err(Error::internal(op, "sample pass without frames"));
    };
    let t_sample = t0.elapsed().as_secs_f64();
    // 2. Fit, upload, and measure the sample's encoded size for the arena.
    let t = Instant::now();
    let counter = Arc::new(MemCounter::default());
    let fitted = fit_and_size(
        e,
        k,
        s_buf,
        sample.len() as u64,
        frame_len,
        n,
        enc,
        &counter,
    )?;
    let (dmodel, per_frame, mut capacity) = (fitted.model, fitted.per_frame, fitted.capacity);
    let mut fit_stages = fitted.stages;
    let t_fit = t.elapsed().as_secs_f64();
    // 3. Main pass (again with more room in the rare case the sample under-predicted).
    let mut retries = 0u32;
    loop {
        let out = pipeline(
            src,
            params,
            &frames,
            main_plan.take(),
            Sink::Encode {
                model: &dmodel,
                kernels: k,
                capacity,
            },
            value_dtype,
        )?;
        let Some(eo) = out.encoded else {
            return Err(Error::internal(op, "encode pass without streams"));
        };
        if eo.overflowed > 0 {
            if retries >= 1 {
                return Err(Error::internal(
                    op,
                    format!(
                        "{} frames did not fit an arena of {} bytes after a retry",
                        eo.overflowed, capacity
                    ),
                ));
            }
            retries += 1;
            capacity = eo.used.next_multiple_of(rans::STREAM_ALIGN);
            continue;
        }
        let mut timings = vec![
            StageTiming::new(
                "engine and rANS kernels (module loads on first use)",
                t_engine,
            ),
            StageTiming::new(
                format!(
                    "sample pass (wall; {} frames decoded densely)",
                    sample.len()
                ),
                t_sample,
            ),
            StageTiming::new(
                format!(
                    "fit + upload model + sample encode (wall; {per_frame:.0} B/frame predicted)"
                ),
                t_fit,
            ),
            StageTiming::new(
                "main pass plan (host thread, beside the sample pass)",
                t_main_plan.as_secs_f64(),
            ),
        ];
        timings.append(&mut fit_stages);
        timings.append(&mut sample_stages);
        timings.extend(out.timings);
        timings.push(StageTiming::new(
            "encoded load (wall, all passes)",
            t0.elapsed().as_secs_f64(),
        ));
        let encoded = DeviceEncoded::from_parts(
            dmodel,
            eo.arena,
            eo.used,
            eo.index,
            n,
            out_shape,
            e.gpu.info().ordinal,
        );
        // Read after the pipeline's final synchronize.
        let sum_dp = Some(crate::mem::read_vec::<u64>(&eo.sums, frame_len)?);
        return Ok(GpuEncodedLoad {
            encoded,
            frames: n,
            bytes_read: out.bytes_read + s_out.bytes_read,
            batches: out.batches,
            retries,
            saturated: out.saturated,
            timings,
            memory: out.memory,
            sum_dp,
        });
    }
}
