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
//! The host waits only for a free pinned slot (its H2D event). Kernel errors accumulate in one
//! record (chunk indices are global to the load) checked once at the end. Bad pixels are zeroed
//! by a small kernel over the result (pass-through) or inside region/bin.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{sys, CudaEvent, CudaStream};
use qem_core::{
    DType, DenseArray, Error, MemoryReport, Progress, Region, Result, Shape2, StageTiming,
};
use qem_io::{ChunkCodec, ChunkRecord, Source};
use rayon::prelude::*;

use crate::bslz4::{fault_from_record, fault_to_error, BlockTable, LaunchShape, RawDecode};
use crate::device::driver_error;
use crate::engine::{engine, Engine};
use crate::mem::{DevBuf, MemCounter};
use crate::rans::{self, DeviceEncoded, DeviceModel, EncoderScratch, RansKernels};
use crate::transform::{launch_region_bin, launch_zero_pixels, RegionBinArgs, RegionPlan};
use qem_codec::rans::{FloorPolicy, ModelParams};

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
        }
    }
}

/// What to load and how (the façade's plan, already validated).
#[derive(Clone, Copy)]
pub struct GpuLoadParams<'a> {
    /// Half-open scan region; only its frames' chunks are read.
    pub scan_region: Region,
    /// Half-open detector region in source pixels.
    pub detector_region: Option<Region>,
    /// Count-preserving bin factor.
    pub det_bin: usize,
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
            .field("detector_region", &self.detector_region)
            .field("det_bin", &self.det_bin)
            .field("result_dtype", &self.result_dtype)
            .field("saturate", &self.saturate)
            .field("memory_budget", &self.memory_budget)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// A dense `[R_r, R_c, k_r, k_c]` array in device memory (freed on drop).
#[derive(Debug)]
pub struct DeviceArray {
    buf: DevBuf,
    shape: [usize; 4],
    dtype: DType,
    ordinal: usize,
}

impl DeviceArray {
    /// `[R_r, R_c, k_r, k_c]`.
    pub fn shape(&self) -> [usize; 4] {
        self.shape
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes of data (the allocation may be slightly larger).
    pub fn nbytes(&self) -> u64 {
        (self.len() * self.dtype.size()) as u64
    }
    /// Device address of element 0.
    pub fn device_ptr(&self) -> u64 {
        self.buf.ptr()
    }
    /// Device ordinal.
    pub fn device_ordinal(&self) -> usize {
        self.ordinal
    }

    fn download_range(&self, start: usize, len: usize) -> Result<DenseArray> {
        let es = self.dtype.size();
        match self.dtype {
            DType::U8 => {
                let mut v = vec![0u8; len];
                self.buf.read(start * es, &mut v)?;
                Ok(DenseArray::U8(v))
            }
            DType::U16 => {
                let mut v = vec![0u16; len];
                self.buf
                    .read(start * es, bytemuck::cast_slice_mut(&mut v))?;
                Ok(DenseArray::U16(v))
            }
            DType::U32 => {
                let mut v = vec![0u32; len];
                self.buf
                    .read(start * es, bytemuck::cast_slice_mut(&mut v))?;
                Ok(DenseArray::U32(v))
            }
        }
    }

    /// Copy the whole array to the host.
    pub fn download(&self) -> Result<DenseArray> {
        self.download_range(0, self.len())
    }

    /// Copy result frame `index` (row-major over the scan) to the host.
    pub fn download_frame(&self, index: usize) -> Result<DenseArray> {
        let frame = self.shape[2] * self.shape[3];
        if index >= self.shape[0] * self.shape[1] {
            return Err(Error::invalid("frame", "frame index outside the array"));
        }
        self.download_range(index * frame, frame)
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

// ------------------------------------------------------------------------------------------
// Planning (pure, host only)

/// One stored chunk the load reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanChunk {
    /// The stored chunk.
    pub rec: ChunkRecord,
    /// Index into [`LoadPlan::dst_frames`] of this chunk's first frame.
    pub dst_start: usize,
}

/// A batch: a run of [`LoadPlan::chunks`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchPlan {
    /// Range of plan chunks.
    pub chunks: std::ops::Range<usize>,
    /// Compressed bytes.
    pub in_bytes: u64,
    /// Decoded bytes (all frames of the chunks).
    pub decoded_bytes: u64,
    /// Decoded frames (`frames_in_chunk` summed).
    pub frames: u64,
}

/// The read/decode plan of a load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadPlan {
    /// Chunks to read, sorted by `(file, offset)`.
    pub chunks: Vec<PlanChunk>,
    /// Per decoded frame of each chunk (`frames_in_chunk` entries from `dst_start`): its
    /// result frame index, or `u32::MAX` when the frame is not wanted.
    pub dst_frames: Vec<u32>,
    /// Source frame of each result frame.
    pub frames: Vec<u64>,
    /// Batches in read order.
    pub batches: Vec<BatchPlan>,
    /// Largest batch in compressed bytes.
    pub max_in_bytes: u64,
    /// Largest batch in decoded bytes.
    pub max_decoded_bytes: u64,
    /// Most chunks in one batch.
    pub max_chunks: usize,
}

/// Source frame indices of `region` of `scan`, in result (row-major) order.
pub fn region_frames(scan: Shape2, region: Region) -> Vec<u64> {
    let mut v = Vec::with_capacity(region.shape().len());
    for r in region.row_start..region.row_stop {
        for c in region.col_start..region.col_stop {
            v.push((r * scan.cols + c) as u64);
        }
    }
    v
}

/// Plan the chunk spans of `frames` (result order), `locate(frame)` giving the index in
/// `chunks` of the chunk holding it; batches of at most `batch_bytes` compressed (a larger
/// chunk is a batch alone) and, when `scratch_limit` is set, at most that many decoded bytes.
pub fn plan_chunks(
    chunks: &[ChunkRecord],
    frames: &[u64],
    frame_bytes: u64,
    locate: impl Fn(u64) -> Result<usize>,
    batch_bytes: u64,
    scratch_limit: Option<u64>,
) -> Result<LoadPlan> {
    if frames.len() > u32::MAX as usize - 1 {
        return Err(Error::invalid(
            "plan GPU load",
            "too many frames for one GPU load",
        ));
    }
    let mut slot_of: Vec<usize> = vec![usize::MAX; chunks.len()];
    let mut order: Vec<usize> = Vec::new();
    let mut chunk_of: Vec<usize> = Vec::with_capacity(frames.len());
    for &n in frames {
        let ci = locate(n)?;
        if ci >= chunks.len() {
            return Err(Error::internal("plan GPU load", "chunk index out of range"));
        }
        chunk_of.push(ci);
        if slot_of[ci] == usize::MAX {
            slot_of[ci] = order.len();
            order.push(ci);
        }
    }
    // Sort by (file, offset) for sequential reads.
    order.sort_by_key(|&ci| (chunks[ci].file, chunks[ci].offset));
    let mut plan_chunks = Vec::with_capacity(order.len());
    let mut dst_frames = Vec::new();
    for (pi, &ci) in order.iter().enumerate() {
        slot_of[ci] = pi;
        let rec = chunks[ci];
        plan_chunks.push(PlanChunk {
            rec,
            dst_start: dst_frames.len(),
        });
        dst_frames.extend(std::iter::repeat_n(u32::MAX, rec.frames_in_chunk as usize));
    }
    for (ri, (&n, &ci)) in frames.iter().zip(&chunk_of).enumerate() {
        let pc = &plan_chunks[slot_of[ci]];
        let k = n
            .checked_sub(pc.rec.first_frame)
            .filter(|&k| k < pc.rec.frames_in_chunk as u64)
            .ok_or_else(|| Error::internal("plan GPU load", "frame outside its chunk"))?;
        dst_frames[pc.dst_start + k as usize] = ri as u32;
    }
    let mut batches = Vec::new();
    let mut start = 0usize;
    let (mut inb, mut dec, mut fr) = (0u64, 0u64, 0u64);
    for (i, pc) in plan_chunks.iter().enumerate() {
        let d = pc.rec.frames_in_chunk as u64 * frame_bytes;
        let over_in = inb + pc.rec.size > batch_bytes;
        let over_dec = scratch_limit.is_some_and(|l| dec + d > l);
        if i > start && (over_in || over_dec) {
            batches.push(BatchPlan {
                chunks: start..i,
                in_bytes: inb,
                decoded_bytes: dec,
                frames: fr,
            });
            start = i;
            (inb, dec, fr) = (0, 0, 0);
        }
        inb += pc.rec.size;
        dec += d;
        fr += pc.rec.frames_in_chunk as u64;
    }
    if start < plan_chunks.len() {
        batches.push(BatchPlan {
            chunks: start..plan_chunks.len(),
            in_bytes: inb,
            decoded_bytes: dec,
            frames: fr,
        });
    }
    Ok(LoadPlan {
        max_in_bytes: batches.iter().map(|b| b.in_bytes).max().unwrap_or(0),
        max_decoded_bytes: batches.iter().map(|b| b.decoded_bytes).max().unwrap_or(0),
        max_chunks: batches.iter().map(|b| b.chunks.len()).max().unwrap_or(0),
        chunks: plan_chunks,
        dst_frames,
        frames: frames.to_vec(),
        batches,
    })
}

impl LoadPlan {
    /// True when every chunk's decoded frames are all wanted and consecutive in the result, so
    /// the kernel can decode straight into it (given a pass-through frame plan).
    pub fn chunks_map_contiguously(&self) -> bool {
        self.chunks.iter().all(|pc| {
            let d = &self.dst_frames[pc.dst_start..pc.dst_start + pc.rec.frames_in_chunk as usize];
            d.first().is_some_and(|&f0| {
                f0 != u32::MAX
                    && d.iter()
                        .enumerate()
                        .all(|(k, &f)| f != u32::MAX && f == f0 + k as u32)
            })
        })
    }
}

/// Every device buffer of a load, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryPlan {
    /// The result.
    pub destination: u64,
    /// Compressed input buffers (one per slot).
    pub input: u64,
    /// Descriptor tables (one per slot).
    pub tables: u64,
    /// Decode scratch (non-pass-through plans).
    pub scratch: u64,
    /// Per-item status of the decode kernel.
    pub status: u64,
    /// Error records, counters, bad-pixel tables.
    pub small: u64,
}

impl MemoryPlan {
    /// Sum of every buffer.
    pub fn total(&self) -> u64 {
        self.destination + self.input + self.tables + self.scratch + self.status + self.small
    }
}

/// Admit `planned` bytes against `min(budget, free − reserve)`; returns that limit, or a
/// `MemoryBudget` error naming both numbers (never a crop, bin or CPU fallback).
pub fn admit(planned: u64, budget: Option<u64>, free: u64, reserve: u64) -> Result<u64> {
    let device = free.saturating_sub(reserve);
    let available = budget.map_or(device, |b| b.min(device));
    if planned > available {
        let why = match budget {
            Some(b) if b <= device => "the memory_budget",
            _ => "the GPU's free memory less a reserve",
        };
        return Err(Error::memory_budget("load (cuda)", planned, available).with_op(format!(
            "load (cuda; limit: {why}; crop with scan_region, bin with det_bin, or raise memory_budget)"
        )));
    }
    Ok(available)
}

/// Descriptor words per batch, estimated from `blocks_per_chunk` (1 copy per chunk, + the
/// scratch frame map).
fn table_words(max_chunks: usize, blocks_per_chunk: usize, frames: u64) -> usize {
    max_chunks * (blocks_per_chunk + 1) * 8 + frames as usize
}

// ------------------------------------------------------------------------------------------
// The pipeline

fn event(e: &Engine) -> Result<CudaEvent> {
    e.gpu
        .ctx()
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|err| driver_error("create event", err))
}

fn record(ev: &CudaEvent, s: &CudaStream) -> Result<()> {
    ev.record(s).map_err(|e| driver_error("record event", e))
}

fn elapsed_s(a: &CudaEvent, b: &CudaEvent) -> f64 {
    a.elapsed_ms(b)
        .map(|ms| ms as f64 / 1e3)
        .unwrap_or(f64::NAN)
}

/// Synchronizes its streams when dropped.
struct Drain<'a>(&'a CudaStream, &'a CudaStream);

impl Drop for Drain<'_> {
    fn drop(&mut self) {
        let _ = self.0.synchronize();
        let _ = self.1.synchronize();
    }
}

struct BatchEvents {
    h2d_start: CudaEvent,
    h2d_end: CudaEvent,
    dec_start: CudaEvent,
    dec_end: CudaEvent,
    rb_end: Option<CudaEvent>,
    enc_start: Option<CudaEvent>,
    enc_end: Option<CudaEvent>,
}

impl BatchEvents {
    /// The event after the batch's last kernel (the slot's tables are free after it).
    fn last(&self) -> &CudaEvent {
        self.enc_end
            .as_ref()
            .or(self.rb_end.as_ref())
            .unwrap_or(&self.dec_end)
    }
}

fn overflow_error(frame: u64, orow: u32, ocol: u32, value: u64, dtype: DType) -> Error {
    Error::overflow(
        "load",
        format!(
            "value {value} at result pixel ({orow}, {ocol}) does not fit {dtype}; request dtype=\"u32\" (exact) or \"u8\" (saturating)"
        ),
    )
    .with_frame(frame)
    .with_expected(format!("<= {}", dtype.max_value()))
    .with_found(value.to_string())
}

fn cancelled_error() -> Error {
    Error::invalid("load", "cancelled by the caller")
}

/// Load `params.scan_region` of `src` into device memory with the overlapped pipeline.
pub fn load_source(src: &Source, params: &GpuLoadParams<'_>) -> Result<GpuLoad> {
    params.scan_region.validate(src.scan_shape, "scan_region")?;
    let frames = region_frames(src.scan_shape, params.scan_region);
    let out = pipeline(src, params, &frames, Sink::Dense)?;
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
    /// Stage timings: the sample pass, the fit, the main pass' stages.
    pub timings: Vec<StageTiming>,
    /// Device-memory accounting of the main pass (the sample pass' buffers are freed first).
    pub memory: MemoryReport,
}

/// Load `params.scan_region` of `src` into the GPU **encoded**: the model is fitted on an
/// evenly spread sample of frames (decoded densely on the GPU, then reduced by kernels), then
/// every batch is decoded, transformed and rANS-encoded on the GPU, so the dense acquisition
/// never exists in full on the device. The result dtype must be u16.
pub fn load_source_encoded(
    src: &Source,
    params: &GpuLoadParams<'_>,
    enc: &EncodeOptions,
) -> Result<GpuEncodedLoad> {
    let t0 = Instant::now();
    let op = "load encoded (cuda)";
    params.scan_region.validate(src.scan_shape, "scan_region")?;
    if params.result_dtype != DType::U16 {
        return Err(Error::invalid(
            op,
            format!(
                "the encoded representation holds u16 counts; the result dtype would be {} (use dtype \"u16\" or representation \"dense\")",
                params.result_dtype
            ),
        ));
    }
    let e = engine()?;
    let k = e.rans()?;
    let frames = region_frames(src.scan_shape, params.scan_region);
    let n = frames.len() as u64;
    // 1. Sample pass: dense, masked, transformed frames of the sample.
    let pick = rans::sample_frames(n, enc.sample_frames.max(1));
    let sample: Vec<u64> = pick.iter().map(|&i| frames[i as usize]).collect();
    let quiet = GpuLoadParams {
        progress: None,
        ..*params
    };
    let s_out = pipeline(src, &quiet, &sample, Sink::Dense)?;
    let out_shape = s_out.output;
    let frame_len = out_shape.len();
    let Some(s_buf) = s_out.dense else {
        return Err(Error::internal(op, "sample pass without frames"));
    };
    let t_sample = t0.elapsed().as_secs_f64();
    // 2. Fit, upload, and measure the sample's encoded size for the arena.
    let t = Instant::now();
    let model = rans::fit_on_device(
        &e.gpu,
        k,
        s_buf.ptr(),
        sample.len() as u64,
        frame_len,
        &enc.model,
    )?;
    let counter = Arc::new(MemCounter::default());
    let dmodel = DeviceModel::upload(e.gpu.ctx(), model, Some(&counter))?;
    let sample_bytes = measure_encoded_bytes(e, k, &dmodel, &s_buf, sample.len() as u64)?;
    drop(s_buf);
    let per_frame = sample_bytes as f64 / sample.len().max(1) as f64;
    let mut capacity = ((per_frame * n as f64 * enc.headroom.max(1.0)) as u64 + (4 << 20))
        .next_multiple_of(rans::STREAM_ALIGN);
    let t_fit = t.elapsed().as_secs_f64();
    // 3. Main pass (again with more room in the rare case the sample under-predicted).
    let mut retries = 0u32;
    loop {
        let out = pipeline(
            src,
            params,
            &frames,
            Sink::Encode {
                model: &dmodel,
                kernels: k,
                capacity,
            },
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
            StageTiming {
                stage: format!(
                    "sample pass (wall; {} frames decoded densely)",
                    sample.len()
                ),
                seconds: t_sample,
            },
            StageTiming {
                stage: format!(
                    "fit + upload model + sample encode (wall; {per_frame:.0} B/frame predicted)"
                ),
                seconds: t_fit,
            },
        ];
        timings.extend(out.timings);
        timings.push(StageTiming {
            stage: "encoded load (wall, all passes)".into(),
            seconds: t0.elapsed().as_secs_f64(),
        });
        let encoded = DeviceEncoded::from_parts(
            dmodel,
            eo.arena,
            eo.used,
            eo.index,
            n,
            out_shape,
            e.gpu.info().ordinal,
        );
        return Ok(GpuEncodedLoad {
            encoded,
            frames: n,
            bytes_read: out.bytes_read + s_out.bytes_read,
            batches: out.batches,
            retries,
            timings,
            memory: out.memory,
        });
    }
}

/// Encode a dense u16 array already on the GPU (e.g. an uploaded NumPy array): fit on an
/// evenly spread sample of its frames, then encode every frame. The array is left as it is.
pub fn encode_device_array(array: &DeviceArray, enc: &EncodeOptions) -> Result<GpuEncodedLoad> {
    let t0 = Instant::now();
    let op = "encode (cuda)";
    if array.dtype() != DType::U16 {
        return Err(Error::invalid(
            op,
            format!(
                "the encoded representation holds u16 counts; the array is {}",
                array.dtype()
            ),
        ));
    }
    let e = engine()?;
    let k = e.rans()?;
    let [r, c, kr, kc] = array.shape();
    let n = (r * c) as u64;
    let shape = Shape2::new(kr, kc);
    let frame_len = shape.len();
    let frame_bytes = frame_len * 2;
    // Gather the sample into one buffer (device-to-device copies of whole frames).
    let pick = rans::sample_frames(n, enc.sample_frames.max(1));
    let ctx = e.gpu.ctx();
    let sample = DevBuf::alloc(ctx, pick.len() * frame_bytes, None, "fit sample")?;
    let stream = e.gpu.stream();
    for (i, &f) in pick.iter().enumerate() {
        // SAFETY: both ranges lie inside their allocations (frame f < n of the array, slot
        // i < pick.len() of the sample); synchronized below.
        unsafe {
            sys::cuMemcpyDtoDAsync_v2(
                sample.ptr() + (i * frame_bytes) as u64,
                array.device_ptr() + f * frame_bytes as u64,
                frame_bytes,
                stream.cu_stream(),
            )
        }
        .result()
        .map_err(|err| driver_error("gather fit sample", err))?;
    }
    let model = rans::fit_on_device(
        &e.gpu,
        k,
        sample.ptr(),
        pick.len() as u64,
        frame_len,
        &enc.model,
    )?;
    let counter = Arc::new(MemCounter::default());
    let dmodel = DeviceModel::upload(ctx, model, Some(&counter))?;
    let sample_bytes = measure_encoded_bytes(e, k, &dmodel, &sample, pick.len() as u64)?;
    drop(sample);
    let per_frame = sample_bytes as f64 / pick.len().max(1) as f64;
    let mut capacity = ((per_frame * n as f64 * enc.headroom.max(1.0)) as u64 + (4 << 20))
        .next_multiple_of(rans::STREAM_ALIGN);
    let (free0, total) = e.gpu.mem_info()?;
    let mut retries = 0u32;
    loop {
        let arena = DevBuf::alloc(ctx, capacity as usize, Some(&counter), "encoded streams")?;
        let index = DevBuf::alloc(
            ctx,
            (n as usize * rans::INDEX_ENTRY_BYTES).max(16),
            Some(&counter),
            "stream index",
        )?;
        let err = DevBuf::alloc(ctx, 64, Some(&counter), "encoder records")?;
        err.write(0, &[0u8; 64])?;
        let scratch = EncoderScratch::new(ctx, k, frame_len, Some(&counter))?;
        let (sw, warps) = scratch.parts();
        let a = rans::EncodeArgs {
            frames: array.device_ptr(),
            n_frames: n,
            dst: 0,
            dst_base: 0,
            bad: 0,
            arena: arena.ptr(),
            capacity,
            cursor: err.ptr() + 32,
            index: index.ptr(),
            scratch_words: sw,
            scratch_warps: warps,
            err: err.ptr(),
        };
        let t = Instant::now();
        // SAFETY: the array holds n u16 frames of the model's length; the arena `capacity`
        // bytes (the kernel checks every write against it); index n entries; all alive until
        // the synchronize below.
        unsafe { rans::launch_encode(k, stream, &dmodel, &a) }?;
        stream
            .synchronize()
            .map_err(|err| driver_error("synchronize encode", err))?;
        let enc_s = t.elapsed().as_secs_f64();
        let (free1, _) = e.gpu.mem_info()?;
        let mut w = [0u8; 40];
        err.read(0, &mut w)?;
        let used = u64::from_le_bytes(w[32..40].try_into().unwrap_or([0; 8]));
        if let Some(f) = rans::fault_from_words(bytemuck::cast_slice(&w[..32])) {
            if f.code != 0 {
                return Err(rans::fault_error(&f, f.frame).with_op(op));
            }
            if f.overflowed > 0 && retries == 0 {
                retries += 1;
                capacity = used.next_multiple_of(rans::STREAM_ALIGN);
                continue;
            }
            if f.overflowed > 0 {
                return Err(Error::internal(
                    op,
                    "frames did not fit the arena after a retry",
                ));
            }
        }
        let memory = MemoryReport {
            planned_device_bytes: capacity,
            budget_bytes: free0,
            process_peak_device_bytes: counter.peak(),
            card_used_before_bytes: total.saturating_sub(free0),
            card_used_peak_bytes: total.saturating_sub(free1),
            card_total_bytes: total,
        };
        let encoded =
            DeviceEncoded::from_parts(dmodel, arena, used, index, n, shape, e.gpu.info().ordinal);
        return Ok(GpuEncodedLoad {
            encoded,
            frames: n,
            bytes_read: 0,
            batches: 1,
            retries,
            timings: vec![
                StageTiming {
                    stage: format!("encode (wall; {per_frame:.0} B/frame predicted)"),
                    seconds: enc_s,
                },
                StageTiming {
                    stage: "fit + encode (wall)".into(),
                    seconds: t0.elapsed().as_secs_f64(),
                },
            ],
            memory,
        });
    }
}

/// Encode `n` dense frames at `frames` with `model` into a throw-away arena; the bytes the
/// streams take (16-byte rounded).
fn measure_encoded_bytes(
    e: &Engine,
    k: &RansKernels,
    model: &DeviceModel,
    frames: &DevBuf,
    n: u64,
) -> Result<u64> {
    let ctx = e.gpu.ctx();
    let frame_len = model.model().frame_len();
    // Worst case per frame: header + every pixel a word + 15 extra bits.
    let worst = (rans::STREAM_HEADER_BYTES as u64 + 2 * frame_len as u64 + 2 * frame_len as u64)
        .next_multiple_of(rans::STREAM_ALIGN);
    let arena = DevBuf::alloc(ctx, (worst * n) as usize, None, "sample streams")?;
    let index = DevBuf::alloc(ctx, (n * 16) as usize, None, "sample index")?;
    let err = DevBuf::alloc(ctx, 64, None, "encoder records")?;
    err.write(0, &[0u8; 64])?;
    let scratch = EncoderScratch::new(ctx, k, frame_len, None)?;
    let (sw, warps) = scratch.parts();
    let a = rans::EncodeArgs {
        frames: frames.ptr(),
        n_frames: n,
        dst: 0,
        dst_base: 0,
        bad: 0,
        arena: arena.ptr(),
        capacity: worst * n,
        cursor: err.ptr() + 32,
        index: index.ptr(),
        scratch_words: sw,
        scratch_warps: warps,
        err: err.ptr(),
    };
    let stream = e.gpu.stream();
    // SAFETY: frames holds n dense frames of the model's length (the sample pass' result);
    // the arena has the worst-case size of n streams; index n entries; all alive until the
    // synchronize below.
    unsafe { rans::launch_encode(k, stream, model, &a) }?;
    stream
        .synchronize()
        .map_err(|err| driver_error("synchronize sample encode", err))?;
    let mut w = [0u8; 40];
    err.read(0, &mut w)?;
    if let Some(f) = rans::fault_from_words(bytemuck::cast_slice(&w[..32])) {
        return Err(rans::fault_error(&f, f.frame).with_op("encode sample (cuda)"));
    }
    Ok(u64::from_le_bytes(w[32..40].try_into().unwrap_or([0; 8])))
}

/// Where a pipeline's decoded frames go.
#[derive(Clone, Copy)]
enum Sink<'a> {
    /// A dense result array.
    Dense,
    /// Encoded with `model`, stream by stream, into an arena of `capacity` bytes.
    Encode {
        model: &'a DeviceModel,
        kernels: &'a RansKernels,
        capacity: u64,
    },
}

/// What [`pipeline`] produced.
struct PipelineOut {
    dense: Option<DevBuf>,
    encoded: Option<EncodedOut>,
    output: Shape2,
    saturated: u64,
    frames: u64,
    bytes_read: u64,
    batches: usize,
    direct: bool,
    timings: Vec<StageTiming>,
    memory: MemoryReport,
}

/// The encoded sink's buffers after a pipeline.
struct EncodedOut {
    arena: DevBuf,
    index: DevBuf,
    /// Bytes the encoder allocated (all streams, 16-byte rounded; more than the arena when
    /// frames overflowed).
    used: u64,
    /// Frames that did not fit the arena.
    overflowed: u32,
}

/// The encoder's buffers during a pipeline.
struct EncodeState<'a> {
    model: &'a DeviceModel,
    kernels: &'a RansKernels,
    arena: DevBuf,
    capacity: u64,
    index: DevBuf,
    scratch: EncoderScratch,
    input: Option<DevBuf>,
    /// Bad-pixel offsets, zeroed in the decoded batch before an identity plan's encode.
    bad_list: Option<DevBuf>,
    /// [0..32) error record, [32..40) arena cursor.
    err: DevBuf,
}

/// The overlapped pipeline over source frames `frames` (result order).
fn pipeline(
    src: &Source,
    params: &GpuLoadParams<'_>,
    frames: &[u64],
    sink: Sink<'_>,
) -> Result<PipelineOut> {
    let t_total = Instant::now();
    let op = "load (cuda)";
    if src.codec != ChunkCodec::Bslz4 && src.codec != ChunkCodec::Raw {
        return Err(Error::invalid(op, "unsupported chunk codec for the GPU"));
    }
    let e = engine()?;
    let opts = params.options;
    let slots = opts.slots.clamp(2, 4);
    let rplan = RegionPlan::new(src.detector_shape, params.detector_region, params.det_bin)?;
    let identity = rplan.is_identity(src.dtype, params.result_dtype);
    let encode = match sink {
        Sink::Dense => None,
        Sink::Encode {
            model,
            kernels,
            capacity,
        } => {
            if params.result_dtype != DType::U16 {
                return Err(Error::invalid(
                    op,
                    format!(
                        "the encoded representation holds u16 counts; the result dtype is {}",
                        params.result_dtype
                    ),
                ));
            }
            if model.model().frame_len() != rplan.output.len() {
                return Err(Error::internal(op, "model frame length != result frame"));
            }
            Some((model, kernels, capacity))
        }
    };
    let es = src.dtype.size();
    let frame_bytes = src.frame_bytes() as u64;
    let out_frame_elems = rplan.output.len();
    let out_es = params.result_dtype.size();
    let (plan, direct) = plan_source(src, frames, identity && encode.is_none(), &opts)?;
    let frames = &plan.frames;
    let bad_idx: Vec<u32> = params
        .bad_mask
        .map(|m| {
            m.iter()
                .enumerate()
                .filter_map(|(i, &b)| b.then_some(i as u32))
                .collect()
        })
        .unwrap_or_default();
    // Blocks per chunk, from the first chunk's header (tables grow if a later chunk has more).
    let mut probe = Vec::new();
    let blocks_per_chunk = match plan.chunks.first() {
        Some(pc) if src.codec == ChunkCodec::Bslz4 && pc.rec.filter_mask & 1 == 0 => {
            src.read_chunk(&pc.rec, &mut probe)?;
            let mut t = BlockTable::default();
            let out_len = pc.rec.frames_in_chunk as usize * frame_bytes as usize;
            t.push_chunk(&probe, es, 0, pc.rec.first_frame, 0, 0, 0, out_len)
                .map_err(|err| err.with_file(&src.files[pc.rec.file as usize].path))?;
            t.n_blocks() + 1
        }
        _ => 1,
    };
    let max_batch_frames = plan.max_decoded_bytes / frame_bytes.max(1);
    let table_cap_words = table_words(plan.max_chunks, blocks_per_chunk, max_batch_frames)
        + if encode.is_some() {
            max_batch_frames as usize
        } else {
            0
        };
    let n_result = frames.len() as u64;
    // Encoding: an arena, the index, the encoder's scratch and (when frames change on the
    // way) a batch of transformed frames; the dense result does not exist.
    let enc_in_bytes = match encode {
        Some(_) if !identity => max_batch_frames * out_frame_elems as u64 * 2,
        _ => 0,
    };
    let dest_bytes = match encode {
        None => n_result * out_frame_elems as u64 * out_es as u64,
        Some((_, k, capacity)) => {
            capacity
                + n_result * rans::INDEX_ENTRY_BYTES as u64
                + EncoderScratch::bytes_for(k, out_frame_elems)
                + enc_in_bytes
        }
    };
    let mem = MemoryPlan {
        destination: dest_bytes,
        input: slots as u64 * plan.max_in_bytes.max(256),
        tables: slots as u64 * (table_cap_words as u64 * 4).max(256),
        scratch: if direct { 0 } else { plan.max_decoded_bytes },
        status: (table_cap_words as u64 / 8 * 8).max(256),
        small: 256
            + if direct {
                bad_idx.len() as u64 * 4
            } else {
                rplan.source.len() as u64
            },
    };
    e.gpu
        .ctx()
        .bind_to_thread()
        .map_err(|err| driver_error("bind CUDA context", err))?;
    let (free0, card_total) = e.gpu.mem_info()?;
    let budget = admit(mem.total(), params.memory_budget, free0, opts.reserve_bytes)?;
    let t_plan = t_total.elapsed().as_secs_f64();

    // ---- allocate
    let t = Instant::now();
    let ctx = e.gpu.ctx().clone();
    let counter = Arc::new(MemCounter::default());
    let c = Some(&counter);
    let dst = match encode {
        None => Some(DevBuf::alloc(&ctx, dest_bytes as usize, c, "result")?),
        Some(_) => None,
    };
    let enc = match encode {
        None => None,
        Some((model, k, capacity)) => {
            let index = DevBuf::alloc(
                &ctx,
                (n_result as usize * rans::INDEX_ENTRY_BYTES).max(16),
                c,
                "stream index",
            )?;
            // Entries of frames never encoded (a failed load) read as empty streams.
            index.write(0, &vec![0u8; index.bytes()])?;
            let err = DevBuf::alloc(&ctx, 64, c, "encoder records")?;
            err.write(0, &[0u8; 64])?;
            Some(EncodeState {
                model,
                kernels: k,
                arena: DevBuf::alloc(&ctx, capacity as usize, c, "encoded streams")?,
                capacity,
                index,
                scratch: EncoderScratch::new(&ctx, k, out_frame_elems, c)?,
                input: if enc_in_bytes > 0 {
                    Some(DevBuf::alloc(
                        &ctx,
                        enc_in_bytes as usize,
                        c,
                        "encoder input batch",
                    )?)
                } else {
                    None
                },
                bad_list: if identity && !bad_idx.is_empty() {
                    let b = DevBuf::alloc(&ctx, bad_idx.len() * 4, c, "bad-pixel list")?;
                    b.write(0, bytemuck::cast_slice(&bad_idx))?;
                    Some(b)
                } else {
                    None
                },
                err,
            })
        }
    };
    let mut d_in = Vec::new();
    let mut d_tab = Vec::new();
    let mut h_in = Vec::new();
    let mut h_tab = Vec::new();
    for _ in 0..slots {
        d_in.push(DevBuf::alloc(
            &ctx,
            plan.max_in_bytes as usize,
            c,
            "compressed batch",
        )?);
        d_tab.push(DevBuf::alloc(&ctx, table_cap_words * 4, c, "block table")?);
        h_in.push(e.take_pinned(plan.max_in_bytes as usize, "batch slot")?);
        h_tab.push(e.take_pinned(table_cap_words * 4, "table slot")?);
    }
    let scratch = if direct {
        None
    } else {
        Some(DevBuf::alloc(
            &ctx,
            plan.max_decoded_bytes as usize,
            c,
            "decode scratch",
        )?)
    };
    let mut status = DevBuf::alloc(&ctx, mem.status as usize, c, "decode status")?;
    // [0..32) decode error record, [32..64) overflow record, [64..72) saturated counter.
    let errs = DevBuf::alloc(&ctx, 256, c, "error records")?;
    errs.write(0, &[0u8; 256])?;
    let bad_buf = if direct {
        if bad_idx.is_empty() {
            None
        } else {
            let b = DevBuf::alloc(&ctx, bad_idx.len() * 4, c, "bad-pixel list")?;
            b.write(0, bytemuck::cast_slice(&bad_idx))?;
            Some(b)
        }
    } else {
        match params.bad_mask {
            Some(m) if m.iter().any(|&b| b) => {
                let lut: Vec<u8> = m.iter().map(|&b| u8::from(b)).collect();
                let b = DevBuf::alloc(&ctx, lut.len(), c, "bad-pixel lookup")?;
                b.write(0, &lut)?;
                Some(b)
            }
            _ => None,
        }
    };
    let (free_peak, _) = e.gpu.mem_info()?;
    let copy_stream = ctx
        .new_stream()
        .map_err(|err| driver_error("create copy stream", err))?;
    let compute = ctx
        .new_stream()
        .map_err(|err| driver_error("create compute stream", err))?;
    // Declared after every buffer, so dropped before them: on an early error return, queued
    // copies and kernels finish before their buffers are freed.
    let _drain = Drain(&copy_stream, &compute);
    let files: Vec<File> = src
        .files
        .iter()
        .map(|f| File::open(&f.path).map_err(|err| Error::io("open", &f.path, &err)))
        .collect::<Result<_>>()?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.reader_threads.max(1))
        .build()
        .map_err(|err| Error::internal(op, format!("reader threads: {err}")))?;
    let t_alloc = t.elapsed().as_secs_f64();

    // ---- pipeline
    let progress = params.progress;
    if let Some(p) = progress {
        p.begin("load (cuda)", n_result);
    }
    let shape = LaunchShape {
        warps_per_cta: opts.warps_per_cta.max(1),
        max_ctas: 0,
    };
    let mut evs: Vec<BatchEvents> = Vec::with_capacity(plan.batches.len());
    let mut h2d_done: Vec<Option<usize>> = vec![None; slots];
    let mut dec_done: Vec<Option<usize>> = vec![None; slots];
    let (mut read_thread_s, mut table_thread_s, mut read_wall_s, mut wait_s) =
        (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    let mut bytes_read = 0u64;
    let mut status_words = status.bytes() / 4;
    let mut tab_words_cap = vec![table_cap_words; slots];
    for (bi, batch) in plan.batches.iter().enumerate() {
        if progress.is_some_and(|p| p.cancelled()) {
            let _ = compute.synchronize();
            let _ = copy_stream.synchronize();
            return Err(cancelled_error());
        }
        let s = bi % slots;
        let t = Instant::now();
        if let Some(i) = h2d_done[s] {
            evs[i]
                .h2d_end
                .synchronize()
                .map_err(|err| driver_error("wait for a free slot", err))?;
        }
        wait_s += t.elapsed().as_secs_f64();

        // Read the chunks into the pinned slot and build the tables, in parallel.
        let t = Instant::now();
        let (table, rs, ts) = read_batch(
            &BatchInput {
                src,
                files: &files,
                plan: &plan,
                batch,
                direct,
                frame_bytes,
                out_frame_bytes: (out_frame_elems * out_es) as u64,
                threads: opts.reader_threads,
            },
            h_in[s].as_mut_slice(),
            &pool,
        )?;
        read_thread_s += rs;
        table_thread_s += ts;
        let pcs = &plan.chunks[batch.chunks.clone()];
        bytes_read += batch.in_bytes;
        let n_blocks = table.n_blocks();
        let n_copies = table.n_copies();
        let dst_map: &[u32] = if direct {
            &[]
        } else {
            let a = pcs.first().map_or(0, |p| p.dst_start);
            let b = pcs
                .last()
                .map_or(0, |p| p.dst_start + p.rec.frames_in_chunk as usize);
            &plan.dst_frames[a..b]
        };
        // Encoding: batch-local frame slots (k, or u32::MAX for frames not wanted) for the
        // region/bin kernel, after the result frame map.
        let local_map: Vec<u32> = if enc.is_some() && !identity {
            dst_map
                .iter()
                .enumerate()
                .map(|(k, &f)| if f == u32::MAX { u32::MAX } else { k as u32 })
                .collect()
        } else {
            Vec::new()
        };
        let words = table.blocks.len() + table.copies.len() + dst_map.len() + local_map.len();
        if words > tab_words_cap[s] {
            // A chunk with more blocks than the first one: grow this slot's tables (its last
            // decode must be over first).
            if let Some(i) = dec_done[s] {
                evs[i]
                    .last()
                    .synchronize()
                    .map_err(|err| driver_error("wait for a slot", err))?;
            }
            d_tab[s] = DevBuf::alloc(&ctx, words * 4, c, "block table")?;
            h_tab[s] = e.take_pinned(words * 4, "table slot")?;
            tab_words_cap[s] = words;
        }
        if 2 * (n_blocks + n_copies) > status_words {
            compute
                .synchronize()
                .map_err(|err| driver_error("synchronize", err))?;
            status = DevBuf::alloc(&ctx, 8 * (n_blocks + n_copies), c, "decode status")?;
            status_words = status.bytes() / 4;
        }
        {
            let ht = h_tab[s].as_mut_slice();
            let w: &mut [u32] = bytemuck::cast_slice_mut(&mut ht[..words * 4]);
            let (a, rest) = w.split_at_mut(table.blocks.len());
            a.copy_from_slice(&table.blocks);
            let (b, rest) = rest.split_at_mut(table.copies.len());
            b.copy_from_slice(&table.copies);
            let (c2, d2) = rest.split_at_mut(dst_map.len());
            c2.copy_from_slice(dst_map);
            d2.copy_from_slice(&local_map);
        }
        read_wall_s += t.elapsed().as_secs_f64();

        // H2D on the copy stream once the previous decode from this device slot is over.
        let be = BatchEvents {
            h2d_start: event(e)?,
            h2d_end: event(e)?,
            dec_start: event(e)?,
            dec_end: event(e)?,
            rb_end: if direct || (enc.is_some() && identity) {
                None
            } else {
                Some(event(e)?)
            },
            enc_start: if enc.is_some() { Some(event(e)?) } else { None },
            enc_end: if enc.is_some() { Some(event(e)?) } else { None },
        };
        if let Some(i) = dec_done[s] {
            copy_stream
                .wait(evs[i].last())
                .map_err(|err| driver_error("stream wait", err))?;
        }
        record(&be.h2d_start, &copy_stream)?;
        h_in[s].copy_to_device_async(&d_in[s], 0, batch.in_bytes as usize, &copy_stream)?;
        h_tab[s].copy_to_device_async(&d_tab[s], 0, words * 4, &copy_stream)?;
        record(&be.h2d_end, &copy_stream)?;

        // Decode (and region/bin) on the compute stream after the copy.
        compute
            .wait(&be.h2d_end)
            .map_err(|err| driver_error("stream wait", err))?;
        record(&be.dec_start, &compute)?;
        let tab = d_tab[s].ptr();
        let (out, out_len) = match (&scratch, &dst) {
            (Some(sc), _) => (sc.ptr(), batch.decoded_bytes),
            (None, Some(d)) => (d.ptr(), dest_bytes),
            (None, None) => return Err(Error::internal(op, "no decode destination")),
        };
        let d = RawDecode {
            elem_size: es,
            input: d_in[s].ptr(),
            in_len: batch.in_bytes,
            blocks: tab,
            n_blocks: n_blocks as u32,
            copies: tab + 4 * table.blocks.len() as u64,
            n_copies: n_copies as u32,
            out,
            out_len,
            errors: errs.ptr(),
            status: status.ptr(),
            max_block_bytes: table.max_block_bytes,
        };
        // SAFETY: every address is one of this load's live allocations sized as `RawDecode`
        // says (input ≥ in_bytes, tables hold the words just copied, output = result or
        // scratch of out_len bytes, status ≥ 2 words per item, error record 8 words); all stay
        // alive until the final synchronize below.
        unsafe { e.decode.launch_raw(&compute, &d, shape) }?;
        record(&be.dec_end, &compute)?;
        let map_at = tab + 4 * (table.blocks.len() + table.copies.len()) as u64;
        if let (Some(sc), Some(rb)) = (&scratch, &be.rb_end) {
            // Dense: result frames named by the frame map; encoding: batch-local slots.
            let (dst_frame, dst_ptr) = match (&enc, &dst) {
                (Some(es), _) => (
                    map_at + 4 * dst_map.len() as u64,
                    es.input.as_ref().map_or(0, |b| b.ptr()),
                ),
                (None, Some(d)) => (map_at, d.ptr()),
                (None, None) => return Err(Error::internal(op, "no region/bin destination")),
            };
            let a = RegionBinArgs {
                src: sc.ptr(),
                src_dtype: src.dtype,
                n_frames: batch.frames as u32,
                dst_frame,
                dst: dst_ptr,
                dst_dtype: params.result_dtype,
                bad: bad_buf.as_ref().map_or(0, |b| b.ptr()),
                saturate: params.saturate,
                err: errs.ptr() + 32,
                saturated: errs.ptr() + 64,
            };
            // SAFETY: scratch holds `batch.frames` decoded source frames, the frame map
            // `batch.frames` words naming result frames < n_result, the result holds n_result
            // frames, the lookup is source-sized; all alive until the final synchronize.
            unsafe { launch_region_bin(&e.transform, &compute, &rplan, &a) }?;
            record(rb, &compute)?;
        }
        if let (Some(es), Some(sc), Some(ea), Some(eb)) =
            (&enc, &scratch, &be.enc_start, &be.enc_end)
        {
            record(ea, &compute)?;
            let (sw, warps) = es.scratch.parts();
            // Identity plans encode the decoded source frames (masking inside the encoder);
            // others the region/bin output (masked there).
            let frames_ptr = match &es.input {
                Some(inp) => inp.ptr(),
                None => {
                    if let Some(list) = &es.bad_list {
                        // SAFETY: scratch holds `batch.frames` decoded u16 frames of
                        // `out_frame_elems` (= source) pixels; the list holds
                        // `bad_idx.len()` offsets < out_frame_elems; both alive until the
                        // final synchronize.
                        unsafe {
                            launch_zero_pixels(
                                &e.transform,
                                &compute,
                                DType::U16,
                                sc.ptr(),
                                batch.frames,
                                out_frame_elems as u64,
                                list.ptr(),
                                bad_idx.len() as u32,
                            )
                        }?;
                    }
                    sc.ptr()
                }
            };
            let bad = 0;
            let a = rans::EncodeArgs {
                frames: frames_ptr,
                n_frames: batch.frames,
                dst: map_at,
                dst_base: 0,
                bad,
                arena: es.arena.ptr(),
                capacity: es.capacity,
                cursor: es.err.ptr() + 32,
                index: es.index.ptr(),
                scratch_words: sw,
                scratch_warps: warps,
                err: es.err.ptr(),
            };
            // SAFETY: the frames buffer holds `batch.frames` u16 frames of the model's frame
            // length (scratch of an identity u16 plan, or the region/bin output batch); the
            // map holds `batch.frames` words naming entries < n_result (or u32::MAX); index,
            // arena, cursor, scratch and records are this load's live buffers, alive until the
            // final synchronize.
            unsafe { rans::launch_encode(es.kernels, &compute, es.model, &a) }?;
            record(eb, &compute)?;
        }
        evs.push(be);
        h2d_done[s] = Some(bi);
        dec_done[s] = Some(bi);
        if let Some(p) = progress {
            p.advance(
                plan.dst_frames[pcs.first().map_or(0, |p| p.dst_start)
                    ..pcs
                        .last()
                        .map_or(0, |p| p.dst_start + p.rec.frames_in_chunk as usize)]
                    .iter()
                    .filter(|&&f| f != u32::MAX)
                    .count() as u64,
            );
        }
    }
    let mask_events = match (&bad_buf, direct, &dst) {
        (Some(b), true, Some(dst)) => {
            let (a, z) = (event(e)?, event(e)?);
            record(&a, &compute)?;
            // SAFETY: the result holds n_result frames of `out_frame_elems` elements; the list
            // holds `bad_idx.len()` source (= result) pixel offsets < out_frame_elems.
            unsafe {
                launch_zero_pixels(
                    &e.transform,
                    &compute,
                    params.result_dtype,
                    dst.ptr(),
                    n_result,
                    out_frame_elems as u64,
                    b.ptr(),
                    bad_idx.len() as u32,
                )
            }?;
            record(&z, &compute)?;
            Some((a, z))
        }
        _ => None,
    };
    let t = Instant::now();
    compute
        .synchronize()
        .map_err(|err| driver_error("synchronize compute stream", err))?;
    copy_stream
        .synchronize()
        .map_err(|err| driver_error("synchronize copy stream", err))?;
    let mut rec = [0u8; 72];
    errs.read(0, &mut rec)?;
    let words: &[u32] = bytemuck::cast_slice(&rec[..64]);
    if let Some(f) = fault_from_record(&words[..8]) {
        let pc = plan.chunks.get(f.chunk as usize);
        let err = fault_to_error(&f, pc.map(|p| p.rec.first_frame));
        return Err(match pc {
            Some(p) => err.with_file(&src.files[p.rec.file as usize].path),
            None => err,
        });
    }
    if words[8] != 0 {
        let df = words[9] as usize;
        let value = words[12] as u64 | (words[13] as u64) << 32;
        let frame = plan.frames.get(df).copied().unwrap_or(df as u64);
        return Err(overflow_error(
            frame,
            words[10],
            words[11],
            value,
            params.result_dtype,
        ));
    }
    let saturated = u64::from_le_bytes(rec[64..72].try_into().unwrap_or([0; 8]));
    let mut enc_used = 0u64;
    let mut enc_overflowed = 0u32;
    if let Some(es) = &enc {
        let mut w = [0u8; 40];
        es.err.read(0, &mut w)?;
        let words: &[u32] = bytemuck::cast_slice(&w[..32]);
        enc_used = u64::from_le_bytes(w[32..40].try_into().unwrap_or([0; 8]));
        if let Some(f) = rans::fault_from_words(words) {
            enc_overflowed = f.overflowed;
            if f.code != 0 {
                let frame = plan
                    .frames
                    .get(f.frame as usize)
                    .copied()
                    .unwrap_or(f.frame);
                return Err(rans::fault_error(&f, frame).with_op("encode (cuda)"));
            }
        }
    }
    let t_sync = t.elapsed().as_secs_f64();
    if let Some(p) = progress {
        p.end();
    }

    // ---- timings
    let sum = |f: &dyn Fn(&BatchEvents) -> f64| evs.iter().map(f).sum::<f64>();
    let h2d_s = sum(&|b| elapsed_s(&b.h2d_start, &b.h2d_end));
    let dec_s = sum(&|b| elapsed_s(&b.dec_start, &b.dec_end));
    let rb_s = sum(&|b| b.rb_end.as_ref().map_or(0.0, |r| elapsed_s(&b.dec_end, r)));
    let gbs = |bytes: u64, s: f64| if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 };
    let decoded_total: u64 = plan.batches.iter().map(|b| b.decoded_bytes).sum();
    let mut timings = vec![
        StageTiming {
            stage: format!(
                "plan (host: {} chunks, {} batches, admission)",
                plan.chunks.len(),
                plan.batches.len()
            ),
            seconds: t_plan,
        },
        StageTiming {
            stage: "allocate (device + pinned)".into(),
            seconds: t_alloc,
        },
        StageTiming {
            stage: format!(
                "read (threads, summed; {} threads, {:.1} GB)",
                opts.reader_threads,
                bytes_read as f64 / 1e9
            ),
            seconds: read_thread_s,
        },
        StageTiming {
            stage: "block table (threads, summed)".into(),
            seconds: table_thread_s,
        },
        StageTiming {
            stage: format!(
                "read+table (wall, summed over batches; {:.1} GB/s)",
                gbs(bytes_read, read_wall_s)
            ),
            seconds: read_wall_s,
        },
        StageTiming {
            stage: "wait for a free slot (host)".into(),
            seconds: wait_s,
        },
        StageTiming {
            stage: format!("h2d (events, summed; {:.1} GB/s)", gbs(bytes_read, h2d_s)),
            seconds: h2d_s,
        },
        StageTiming {
            stage: format!(
                "decode (events, summed; {:.1} GB/s decoded{})",
                gbs(decoded_total, dec_s),
                if direct {
                    ", straight into the result"
                } else {
                    ", into scratch"
                }
            ),
            seconds: dec_s,
        },
    ];
    if evs.iter().any(|b| b.rb_end.is_some()) {
        timings.push(StageTiming {
            stage: "region/bin (events, summed)".into(),
            seconds: rb_s,
        });
    }
    if enc.is_some() {
        let enc_s = sum(&|b| match (&b.enc_start, &b.enc_end) {
            (Some(a), Some(z)) => elapsed_s(a, z),
            _ => 0.0,
        });
        let raw = n_result * out_frame_elems as u64 * 2;
        timings.push(StageTiming {
            stage: format!(
                "encode (events, summed; {:.1} GB/s of u16 frames, {:.3} GB of streams)",
                gbs(raw, enc_s),
                enc_used as f64 / 1e9
            ),
            seconds: enc_s,
        });
    }
    if let Some((a, z)) = &mask_events {
        timings.push(StageTiming {
            stage: "mask (events)".into(),
            seconds: elapsed_s(a, z),
        });
    }
    timings.push(StageTiming {
        stage: "final sync + error check (host)".into(),
        seconds: t_sync,
    });
    timings.push(StageTiming {
        stage: "first product (n/a)".into(),
        seconds: 0.0,
    });
    timings.push(StageTiming {
        stage: "gpu load (wall)".into(),
        seconds: t_total.elapsed().as_secs_f64(),
    });
    let memory = MemoryReport {
        planned_device_bytes: mem.total(),
        budget_bytes: budget,
        process_peak_device_bytes: counter.peak(),
        card_used_before_bytes: card_total.saturating_sub(free0),
        card_used_peak_bytes: card_total.saturating_sub(free_peak),
        card_total_bytes: card_total,
    };
    // Release everything but the result (after the synchronize above); keep the pinned slots.
    drop((d_in, d_tab, scratch, status, errs, bad_buf));
    for b in h_in.into_iter().chain(h_tab) {
        e.give_pinned(b);
    }
    let encoded = enc.map(|es| EncodedOut {
        arena: es.arena,
        index: es.index,
        used: enc_used,
        overflowed: enc_overflowed,
    });
    Ok(PipelineOut {
        dense: dst,
        encoded,
        output: rplan.output,
        saturated,
        frames: n_result,
        bytes_read,
        batches: plan.batches.len(),
        direct,
        timings,
        memory,
    })
}

/// What [`read_batch`] needs.
struct BatchInput<'a> {
    src: &'a Source,
    files: &'a [File],
    plan: &'a LoadPlan,
    batch: &'a BatchPlan,
    direct: bool,
    frame_bytes: u64,
    out_frame_bytes: u64,
    threads: usize,
}

/// Read one batch's chunks into `slot` (packed in plan order) with the reader pool and build
/// its descriptor table (chunk indices global to the plan; output offsets = result positions
/// when `direct`, else packed decode-scratch offsets). Returns the table and the read and
/// table-building thread seconds.
fn read_batch(
    inp: &BatchInput<'_>,
    slot: &mut [u8],
    pool: &rayon::ThreadPool,
) -> Result<(BlockTable, f64, f64)> {
    let BatchInput {
        src,
        files,
        plan,
        batch,
        direct,
        frame_bytes,
        out_frame_bytes,
        ..
    } = *inp;
    let es = src.dtype.size();
    let pcs = &plan.chunks[batch.chunks.clone()];
    if slot.len() < batch.in_bytes as usize {
        return Err(Error::internal(
            "read batch",
            "pinned slot smaller than the batch",
        ));
    }
    // Groups of consecutive chunks, each with its contiguous part of the slot; a group's
    // chunks that are also contiguous in their file are read with one pread.
    let n_groups = (inp.threads.max(1) * 4).min(pcs.len()).max(1);
    let per = pcs.len().div_ceil(n_groups).max(1);
    let mut groups: Vec<(usize, u64, &mut [u8])> = Vec::with_capacity(n_groups);
    let mut rest: &mut [u8] = slot;
    let mut off = 0u64;
    for (g, run) in pcs.chunks(per).enumerate() {
        let bytes: u64 = run.iter().map(|p| p.rec.size).sum();
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(bytes as usize);
        groups.push((g * per, off, head));
        off += bytes;
        rest = tail;
    }
    let mut dec_off_of = Vec::with_capacity(pcs.len());
    let mut acc = 0u64;
    for pc in pcs {
        dec_off_of.push(acc);
        acc += pc.rec.frames_in_chunk as u64 * frame_bytes;
    }
    let dec_off_of = &dec_off_of;
    let first = batch.chunks.start;
    let results: Vec<Result<(BlockTable, f64, f64)>> = pool.install(|| {
        groups
            .par_iter_mut()
            .map(|(g0, g_off, buf)| {
                let mut table = BlockTable::default();
                let (mut rs, mut ts) = (0.0, 0.0);
                let run = &pcs[*g0..(*g0 + per).min(pcs.len())];
                // Read: coalesce chunks that follow each other in the same file.
                let t = Instant::now();
                let mut k = 0;
                let mut pos = 0usize;
                while k < run.len() {
                    let (f, start) = (run[k].rec.file, run[k].rec.offset);
                    let mut end = k + 1;
                    let mut len = run[k].rec.size;
                    while end < run.len()
                        && run[end].rec.file == f
                        && run[end].rec.offset == start + len
                    {
                        len += run[end].rec.size;
                        end += 1;
                    }
                    let path = &src.files[f as usize].path;
                    let file = files.get(f as usize).ok_or_else(|| {
                        Error::internal("read chunk", "chunk names a file this source lacks")
                    })?;
                    file.read_exact_at(&mut buf[pos..pos + len as usize], start)
                        .map_err(|err| {
                            Error::io("read chunk", path, &err).with_frame(run[k].rec.first_frame)
                        })?;
                    pos += len as usize;
                    k = end;
                }
                rs += t.elapsed().as_secs_f64();
                // Describe every chunk's blocks (the CPU parser validates the framing).
                let t = Instant::now();
                let mut pos = 0usize;
                for (k, pc) in run.iter().enumerate() {
                    let gi = first + *g0 + k;
                    let bytes = &buf[pos..pos + pc.rec.size as usize];
                    let in_off = *g_off + pos as u64;
                    pos += pc.rec.size as usize;
                    let out_len = pc.rec.frames_in_chunk as usize * frame_bytes as usize;
                    let out_off = if direct {
                        plan.dst_frames[pc.dst_start] as u64 * out_frame_bytes
                    } else {
                        dec_off_of[gi - first]
                    };
                    let fm = if src.codec == ChunkCodec::Raw {
                        1
                    } else {
                        pc.rec.filter_mask
                    };
                    table
                        .push_chunk(
                            bytes,
                            es,
                            fm,
                            pc.rec.first_frame,
                            gi as u32,
                            in_off,
                            out_off,
                            out_len,
                        )
                        .map_err(|err| err.with_file(&src.files[pc.rec.file as usize].path))?;
                }
                ts += t.elapsed().as_secs_f64();
                Ok((table, rs, ts))
            })
            .collect()
    });
    let mut table = BlockTable::default();
    let (mut rs_sum, mut ts_sum) = (0.0, 0.0);
    for r in results {
        let (tb, rs, ts) = r?;
        table.append(&tb);
        rs_sum += rs;
        ts_sum += ts;
    }
    Ok((table, rs_sum, ts_sum))
}

/// Plan the chunks of `scan_region` of `src`; returns the plan and whether the kernel can
/// decode straight into the result (`identity` frame plan and chunks that map 1:1 onto
/// consecutive result frames), else batches also limited by the decode scratch.
fn plan_source(
    src: &Source,
    frames: &[u64],
    identity: bool,
    opts: &PipelineOptions,
) -> Result<(LoadPlan, bool)> {
    let frame_bytes = src.frame_bytes() as u64;
    // Chunks are sorted by first frame; a frame not inside its candidate chunk gets the IO
    // crate's typed error (out of range, or a chunk that was never written).
    let locate = |n: u64| -> Result<usize> {
        let idx = src.chunks.partition_point(|c| c.first_frame <= n);
        if let Some(c) = idx.checked_sub(1).and_then(|i| src.chunks.get(i)) {
            if n < src.n_frames && n < c.first_frame + c.valid_frames as u64 {
                return Ok(idx - 1);
            }
        }
        src.chunk_of_frame(n)?;
        Err(Error::internal(
            "load",
            "chunk index is not sorted by frame",
        ))
    };
    if identity {
        let plan = plan_chunks(
            &src.chunks,
            frames,
            frame_bytes,
            locate,
            opts.batch_bytes,
            None,
        )?;
        if plan.chunks_map_contiguously() {
            return Ok((plan, true));
        }
    }
    // Scratch path: batches also bounded by the decode scratch (at least the largest chunk).
    let largest = src
        .chunks
        .iter()
        .map(|c| c.frames_in_chunk as u64 * frame_bytes)
        .max()
        .unwrap_or(0);
    let limit = opts.max_scratch_bytes.max(largest);
    let plan = plan_chunks(
        &src.chunks,
        frames,
        frame_bytes,
        locate,
        opts.batch_bytes,
        Some(limit),
    )?;
    Ok((plan, false))
}

/// Upload an in-memory array `[scan, detector]` and run the same region/bin path.
pub fn load_array(
    data: &DenseArray,
    scan: Shape2,
    detector: Shape2,
    params: &GpuLoadParams<'_>,
) -> Result<GpuLoad> {
    let t_total = Instant::now();
    let e = engine()?;
    params.scan_region.validate(scan, "scan_region")?;
    let rplan = RegionPlan::new(detector, params.detector_region, params.det_bin)?;
    let n_src = scan.len();
    if data.len() != n_src * detector.len() || n_src > u32::MAX as usize - 1 {
        return Err(Error::invalid(
            "load (cuda)",
            "array size does not match its shape",
        ));
    }
    let frames = region_frames(scan, params.scan_region);
    let mut dst_frame = vec![u32::MAX; n_src];
    for (ri, &n) in frames.iter().enumerate() {
        dst_frame[n as usize] = ri as u32;
    }
    let src_bytes = data.nbytes() as u64;
    let dest_bytes = (frames.len() * rplan.output.len() * params.result_dtype.size()) as u64;
    let bad_lut: Option<Vec<u8>> = params
        .bad_mask
        .filter(|m| m.iter().any(|&b| b))
        .map(|m| m.iter().map(|&b| u8::from(b)).collect());
    let planned = src_bytes + dest_bytes + 4 * n_src as u64 + 256 + detector.len() as u64;
    e.gpu
        .ctx()
        .bind_to_thread()
        .map_err(|err| driver_error("bind CUDA context", err))?;
    let (free0, card_total) = e.gpu.mem_info()?;
    let budget = admit(
        planned,
        params.memory_budget,
        free0,
        params.options.reserve_bytes,
    )?;
    let ctx = e.gpu.ctx().clone();
    let counter = Arc::new(MemCounter::default());
    let c = Some(&counter);
    let t = Instant::now();
    let dst = DevBuf::alloc(&ctx, dest_bytes as usize, c, "result")?;
    let sbuf = DevBuf::alloc(&ctx, src_bytes as usize, c, "source array")?;
    match data {
        DenseArray::U8(v) => sbuf.write(0, v)?,
        DenseArray::U16(v) => sbuf.write(0, bytemuck::cast_slice(v))?,
        DenseArray::U32(v) => sbuf.write(0, bytemuck::cast_slice(v))?,
    }
    let map = DevBuf::alloc(&ctx, 4 * n_src, c, "frame map")?;
    map.write(0, bytemuck::cast_slice(&dst_frame))?;
    let errs = DevBuf::alloc(&ctx, 256, c, "error records")?;
    errs.write(0, &[0u8; 256])?;
    let bad = match &bad_lut {
        Some(l) => {
            let b = DevBuf::alloc(&ctx, l.len(), c, "bad-pixel lookup")?;
            b.write(0, l)?;
            Some(b)
        }
        None => None,
    };
    let t_upload = t.elapsed().as_secs_f64();
    let (free_peak, _) = e.gpu.mem_info()?;
    let stream = ctx
        .new_stream()
        .map_err(|err| driver_error("create stream", err))?;
    let (a, z) = (event(e)?, event(e)?);
    record(&a, &stream)?;
    let args = RegionBinArgs {
        src: sbuf.ptr(),
        src_dtype: data.dtype(),
        n_frames: n_src as u32,
        dst_frame: map.ptr(),
        dst: dst.ptr(),
        dst_dtype: params.result_dtype,
        bad: bad.as_ref().map_or(0, |b| b.ptr()),
        saturate: params.saturate,
        err: errs.ptr() + 32,
        saturated: errs.ptr() + 64,
    };
    // SAFETY: the source holds n_src frames, the map n_src words naming result frames <
    // frames.len(), the result frames.len() frames; all alive until the synchronize below.
    unsafe { launch_region_bin(&e.transform, &stream, &rplan, &args) }?;
    record(&z, &stream)?;
    stream
        .synchronize()
        .map_err(|err| driver_error("synchronize", err))?;
    let mut rec = [0u8; 72];
    errs.read(0, &mut rec)?;
    let words: &[u32] = bytemuck::cast_slice(&rec[..64]);
    if words[8] != 0 {
        let df = words[9] as usize;
        let value = words[12] as u64 | (words[13] as u64) << 32;
        let frame = frames.get(df).copied().unwrap_or(df as u64);
        return Err(overflow_error(
            frame,
            words[10],
            words[11],
            value,
            params.result_dtype,
        ));
    }
    let saturated = u64::from_le_bytes(rec[64..72].try_into().unwrap_or([0; 8]));
    let timings = vec![
        StageTiming {
            stage: "upload (host, synchronous)".into(),
            seconds: t_upload,
        },
        StageTiming {
            stage: "region/bin (events)".into(),
            seconds: elapsed_s(&a, &z),
        },
        StageTiming {
            stage: "gpu load (wall)".into(),
            seconds: t_total.elapsed().as_secs_f64(),
        },
    ];
    let memory = MemoryReport {
        planned_device_bytes: planned,
        budget_bytes: budget,
        process_peak_device_bytes: counter.peak(),
        card_used_before_bytes: card_total.saturating_sub(free0),
        card_used_peak_bytes: card_total.saturating_sub(free_peak),
        card_total_bytes: card_total,
    };
    drop((sbuf, map, errs, bad));
    let rs = params.scan_region.shape();
    Ok(GpuLoad {
        array: DeviceArray {
            buf: dst,
            shape: [rs.rows, rs.cols, rplan.output.rows, rplan.output.cols],
            dtype: params.result_dtype,
            ordinal: e.gpu.info().ordinal,
        },
        saturated,
        frames: frames.len() as u64,
        bytes_read: 0,
        batches: 1,
        direct: false,
        timings,
        memory,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use qem_core::DtypeRequest;

    fn rec(file: u32, offset: u64, size: u64, first_frame: u64, n: u32) -> ChunkRecord {
        ChunkRecord {
            file,
            offset,
            size,
            filter_mask: 0,
            first_frame,
            frames_in_chunk: n,
            valid_frames: n,
        }
    }

    fn locate(chunks: &[ChunkRecord]) -> impl Fn(u64) -> Result<usize> + '_ {
        move |f| {
            chunks
                .iter()
                .position(|c| f >= c.first_frame && f < c.first_frame + c.valid_frames as u64)
                .ok_or_else(|| Error::source("locate", "missing"))
        }
    }

    #[test]
    fn batches_follow_file_order_and_the_byte_limit() {
        // 8 one-frame chunks spread over 2 files, listed in frame order but stored out of order.
        let chunks: Vec<ChunkRecord> = (0..8u64)
            .map(|i| rec((i % 2) as u32, 1000 - i * 100, 40 + i, i, 1))
            .collect();
        let frames: Vec<u64> = (0..8).collect();
        let p = plan_chunks(&chunks, &frames, 64, locate(&chunks), 100, None).unwrap();
        // Sorted by (file, offset).
        let keys: Vec<(u32, u64)> = p
            .chunks
            .iter()
            .map(|c| (c.rec.file, c.rec.offset))
            .collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
        // Every batch ≤ 100 bytes unless a single chunk; every chunk in exactly one batch.
        let mut covered = 0;
        for b in &p.batches {
            assert!(b.in_bytes <= 100 || b.chunks.len() == 1);
            assert_eq!(b.chunks.start, covered);
            covered = b.chunks.end;
            let sum: u64 = p.chunks[b.chunks.clone()].iter().map(|c| c.rec.size).sum();
            assert_eq!(sum, b.in_bytes);
            assert_eq!(b.decoded_bytes, 64 * b.chunks.len() as u64);
        }
        assert_eq!(covered, 8);
        // Result positions: frame i is result i.
        for pc in &p.chunks {
            assert_eq!(p.dst_frames[pc.dst_start] as u64, pc.rec.first_frame);
        }
        assert!(p.chunks_map_contiguously());
        assert_eq!(
            p.max_in_bytes,
            p.batches.iter().map(|b| b.in_bytes).max().unwrap()
        );
    }

    #[test]
    fn scan_regions_read_only_needed_chunks() {
        let scan = Shape2::new(4, 4);
        let chunks: Vec<ChunkRecord> = (0..16u64).map(|i| rec(0, i * 10, 10, i, 1)).collect();
        let frames = region_frames(scan, Region::new(1, 3, 2, 4));
        assert_eq!(frames, vec![6, 7, 10, 11]);
        let p = plan_chunks(&chunks, &frames, 8, locate(&chunks), 1 << 20, None).unwrap();
        assert_eq!(p.chunks.len(), 4);
        let got: Vec<(u64, u32)> = p
            .chunks
            .iter()
            .map(|c| (c.rec.first_frame, p.dst_frames[c.dst_start]))
            .collect();
        assert_eq!(got, vec![(6, 0), (7, 1), (10, 2), (11, 3)]);
        assert_eq!(p.batches.len(), 1);
        assert!(p.chunks_map_contiguously());
    }

    #[test]
    fn multi_frame_chunks_with_unwanted_frames_need_scratch() {
        // 4-frame chunks; a region taking frames 1..3 of the first chunk.
        let chunks = vec![rec(0, 0, 100, 0, 4), rec(0, 100, 100, 4, 4)];
        let frames = vec![1, 2, 5];
        let p = plan_chunks(&chunks, &frames, 16, locate(&chunks), 1 << 20, Some(64)).unwrap();
        assert_eq!(
            p.dst_frames,
            vec![u32::MAX, 0, 1, u32::MAX, u32::MAX, 2, u32::MAX, u32::MAX]
        );
        assert!(!p.chunks_map_contiguously());
        // Scratch limit 64 bytes = one 4-frame chunk per batch.
        assert_eq!(p.batches.len(), 2);
        assert_eq!(p.max_decoded_bytes, 64);
        assert_eq!(p.batches[1].frames, 4);
    }

    #[test]
    fn missing_frames_fail_in_the_plan() {
        let chunks = vec![rec(0, 0, 10, 0, 1)];
        let e = plan_chunks(&chunks, &[0, 1], 8, locate(&chunks), 100, None).unwrap_err();
        assert_eq!(e.kind, qem_core::ErrorKind::Source);
    }

    #[test]
    fn admission_names_both_numbers() {
        let gib = 1u64 << 30;
        // Fits: 10 GiB planned, 100 GiB free, 256 MiB reserve.
        assert_eq!(
            admit(10 * gib, None, 100 * gib, 256 << 20).unwrap(),
            100 * gib - (256 << 20)
        );
        // Budget binds.
        let e = admit(10 * gib, Some(8 * gib), 100 * gib, 256 << 20).unwrap_err();
        assert_eq!(e.kind, qem_core::ErrorKind::MemoryBudget);
        let s = e.to_string();
        assert!(
            s.contains(&(10 * gib).to_string()) || s.contains("10.0"),
            "{s}"
        );
        assert!(s.contains("memory_budget"), "{s}");
        // Free memory binds.
        let e = admit(10 * gib, Some(50 * gib), 9 * gib, 256 << 20).unwrap_err();
        assert!(e.to_string().contains("free memory"), "{e}");
        // Reserve larger than free: nothing fits.
        assert!(admit(1, None, 100, 256).is_err());
        let m = MemoryPlan {
            destination: 1,
            input: 2,
            tables: 3,
            scratch: 4,
            status: 5,
            small: 6,
        };
        assert_eq!(m.total(), 21);
    }

    /// The host half of the pipeline (plan, batched coalesced reads, descriptor tables) run
    /// against a CPU emulation of the kernels' descriptor semantics (LZ4 block + bit
    /// un-transpose to `out + out_offset`, raw copies, region/bin by `RegionPlan::source_block`,
    /// mask), compared with the CPU engine. Exercises direct decode, scan regions, binning,
    /// multi-frame chunks with a partial last chunk, and narrowing.
    #[test]
    fn host_pipeline_with_emulated_kernels_matches_the_cpu_engine() {
        use qem_io::writer::{
            write_acquisition, Calibration, WriteCompression, WriteLayout, WriteParams,
        };
        let dir = tempfile::tempdir().unwrap();
        let scan = Shape2::new(5, 7);
        let det = Shape2::new(13, 11);
        let mut mask = vec![0u32; det.len()];
        mask[det.len() / 3] = 1;
        mask[det.len() - 1] = 8;
        let value = |f: u64, p: usize, big: bool| -> u32 {
            let x = (f as u32).wrapping_mul(2_654_435_761) ^ (p as u32).wrapping_mul(40_503);
            match x % 100 {
                0..=59 => 0,
                60..=97 => x % 9,
                _ if big => 70_000 + x % 1000,
                _ => 60_000 + x % 1000,
            }
        };
        for (dtype, fpc, name) in [(DType::U16, 1, "a"), (DType::U32, 3, "b")] {
            let big = dtype == DType::U32;
            let params = WriteParams {
                prefix: dir.path().join(name),
                scan_shape: scan,
                detector_shape: det,
                dtype,
                frames_per_file: 8,
                frames_per_chunk: fpc,
                block_elems: 0,
                compression: WriteCompression::Bslz4,
                layout: WriteLayout::Shards,
                pixel_mask: Some(mask.clone()),
                calibration: Calibration::default(),
                skip_frames: Vec::new(),
                write_scan_shape: true,
            };
            let written = write_acquisition(&params, |f, out: &mut [u8]| {
                let es = dtype.size();
                for (p, o) in out.chunks_exact_mut(es).enumerate() {
                    let v = value(f, p, big);
                    o.copy_from_slice(&v.to_le_bytes()[..es]);
                }
            })
            .unwrap();
            let src = Source::open(&written.master, &qem_io::OpenOptions::default()).unwrap();
            let bad = src.bad_pixel_mask();
            let cases = [
                (scan.full(), 1, DtypeRequest::Native),
                (Region::new(1, 4, 2, 6), 1, DtypeRequest::Native),
                (Region::new(1, 4, 2, 6), 2, DtypeRequest::Native),
                (scan.full(), 3, DtypeRequest::U8Saturating),
                (scan.full(), 1, DtypeRequest::U16),
            ];
            for (region, bin, req) in cases {
                let rd = req.result_dtype(dtype, dtype.max_value() * (bin * bin) as u64);
                let saturate = req == DtypeRequest::U8Saturating;
                let fp =
                    qem_cpu::FramePlan::new(det, None, bin, rd, saturate, bad.as_deref()).unwrap();
                let cpu = qem_cpu::load_dense(
                    &src,
                    region,
                    &fp,
                    qem_cpu::LoadHooks {
                        progress: &qem_core::NoProgress,
                    },
                );
                let emu = emulate(&src, region, bin, rd, saturate, bad.as_deref());
                match (cpu, emu) {
                    (Ok(c), Ok((bytes, direct))) => {
                        let want: Vec<u8> = match &c.data {
                            DenseArray::U8(v) => v.clone(),
                            DenseArray::U16(v) => bytemuck::cast_slice(v).to_vec(),
                            DenseArray::U32(v) => bytemuck::cast_slice(v).to_vec(),
                        };
                        assert!(
                            bytes == want,
                            "{name} {region} bin {bin} {rd} direct {direct}"
                        );
                        let expect_direct = bin == 1 && rd == dtype && fpc == 1;
                        assert_eq!(direct, expect_direct, "{name} {region} bin {bin}");
                    }
                    (Err(c), Err(g)) => assert_eq!(c.kind, g.kind, "{c} / {g}"),
                    (c, g) => {
                        panic!("{name} {region} bin {bin} {rd}: cpu {c:?} vs emulation {g:?}")
                    }
                }
            }
        }
    }

    /// The pipeline's host half with the kernels emulated on the CPU.
    fn emulate(
        src: &Source,
        region: Region,
        bin: usize,
        rd: DType,
        saturate: bool,
        bad: Option<&[bool]>,
    ) -> Result<(Vec<u8>, bool)> {
        use qem_codec::bitshuffle::untranspose_block;
        use qem_codec::lz4::decompress_block_exact;
        let rplan = RegionPlan::new(src.detector_shape, None, bin)?;
        let identity = rplan.is_identity(src.dtype, rd);
        // Tiny batches and scratch so that there are many of each.
        let opts = PipelineOptions {
            reader_threads: 3,
            batch_bytes: 700,
            max_scratch_bytes: 4 * src.frame_bytes() as u64,
            ..PipelineOptions::default()
        };
        let (plan, direct) =
            plan_source(src, &region_frames(src.scan_shape, region), identity, &opts)?;
        let files: Vec<File> = src
            .files
            .iter()
            .map(|f| File::open(&f.path).unwrap())
            .collect();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let es = src.dtype.size();
        let out_es = rd.size();
        let frame_bytes = src.frame_bytes() as u64;
        let out_frame_elems = rplan.output.len();
        let mut dest = vec![0u8; plan.frames.len() * out_frame_elems * out_es];
        for batch in &plan.batches {
            let mut slot = vec![0xA5u8; batch.in_bytes as usize + 64];
            let (table, _, _) = read_batch(
                &BatchInput {
                    src,
                    files: &files,
                    plan: &plan,
                    batch,
                    direct,
                    frame_bytes,
                    out_frame_bytes: (out_frame_elems * out_es) as u64,
                    threads: 3,
                },
                &mut slot,
                &pool,
            )?;
            let mut scratch = vec![0u8; batch.decoded_bytes as usize];
            let out: &mut [u8] = if direct { &mut dest } else { &mut scratch };
            let mut tmp = Vec::new();
            for d in table.blocks.chunks_exact(8) {
                let p = (d[0] as u64 | (d[1] as u64) << 32) as usize;
                let o = (d[4] as u64 | (d[5] as u64) << 32) as usize;
                let (plen, olen) = (d[2] as usize, d[3] as usize);
                assert!((d[6] as usize) < plan.chunks.len());
                tmp.resize(olen, 0);
                decompress_block_exact(&slot[p..p + plen], &mut tmp).unwrap();
                untranspose_block(&tmp, es, &mut out[o..o + olen]).unwrap();
            }
            for d in table.copies.chunks_exact(8) {
                let sa = (d[0] as u64 | (d[1] as u64) << 32) as usize;
                let da = (d[2] as u64 | (d[3] as u64) << 32) as usize;
                let n = d[4] as usize;
                out[da..da + n].copy_from_slice(&slot[sa..sa + n]);
            }
            if !direct {
                let pcs = &plan.chunks[batch.chunks.clone()];
                let a = pcs[0].dst_start;
                let b = pcs
                    .last()
                    .map_or(a, |p| p.dst_start + p.rec.frames_in_chunk as usize);
                let get = |j: usize, k: usize| -> u64 {
                    let at = (j * rplan.source.len() + k) * es;
                    let mut w = [0u8; 8];
                    w[..es].copy_from_slice(&scratch[at..at + es]);
                    u64::from_le_bytes(w)
                };
                for (j, &df) in plan.dst_frames[a..b].iter().enumerate() {
                    if df == u32::MAX {
                        continue;
                    }
                    for orow in 0..rplan.output.rows {
                        for ocol in 0..rplan.output.cols {
                            let ((r0, r1), (c0, c1)) = rplan.source_block(orow, ocol);
                            let mut acc = 0u64;
                            for r in r0..r1 {
                                for c in c0..c1 {
                                    let k = r * rplan.source.cols + c;
                                    if bad.is_some_and(|m| m[k]) {
                                        continue;
                                    }
                                    acc += get(j, k);
                                }
                            }
                            let v = if acc <= rd.max_value() {
                                acc
                            } else if saturate {
                                rd.max_value()
                            } else {
                                return Err(overflow_error(
                                    plan.frames[df as usize],
                                    orow as u32,
                                    ocol as u32,
                                    acc,
                                    rd,
                                ));
                            };
                            let at =
                                (df as usize * out_frame_elems + orow * rplan.output.cols + ocol)
                                    * out_es;
                            dest[at..at + out_es].copy_from_slice(&v.to_le_bytes()[..out_es]);
                        }
                    }
                }
            }
        }
        if direct {
            if let Some(m) = bad {
                for f in 0..plan.frames.len() {
                    for (k, _) in m.iter().enumerate().filter(|(_, &b)| b) {
                        let at = (f * out_frame_elems + k) * out_es;
                        dest[at..at + out_es].fill(0);
                    }
                }
            }
        }
        Ok((dest, direct))
    }

    #[test]
    fn without_a_gpu_loads_are_backend_unavailable() {
        if crate::device::probe().is_ok() {
            return;
        }
        let data = DenseArray::U16(vec![1; 4 * 4]);
        let p = GpuLoadParams {
            scan_region: Region::new(0, 2, 0, 2),
            detector_region: None,
            det_bin: 1,
            result_dtype: DType::U16,
            saturate: false,
            bad_mask: None,
            memory_budget: None,
            options: PipelineOptions::default(),
            progress: None,
        };
        let e = load_array(&data, Shape2::new(2, 2), Shape2::new(2, 2), &p).unwrap_err();
        assert_eq!(e.kind, qem_core::ErrorKind::BackendUnavailable);
    }
}
