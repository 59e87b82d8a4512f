//! Encoding a dense array already on the GPU ([`encode_device_array`]) and measuring what a
//! sample's streams take ([`measure_encoded_bytes`], which sizes an encoded load's arena).

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys;
use qem_core::{DType, DetectorPlan, Error, MemoryReport, Result, Shape2, StageTiming};

use super::queue::{region_bin_batch, RegionBinBatch};
use super::records::{EncoderRead, EncoderRecords, ErrorRecords};
use super::{DeviceArray, EncodeOptions, GpuEncodedLoad};
use crate::device::driver_error;
use crate::engine::{engine, Engine};
use crate::mem::{DevBuf, MemCounter};
use crate::rans::{self, DeviceEncoded, DeviceModel, EncoderScratch, RansKernels};

/// A u16 copy of a u8 array on the device (the region/bin kernel's u8 → u16 pass with an
/// identity plan: every value is kept), counted in `counter`.
fn widen_u8(e: &Engine, array: &DeviceArray, counter: &Arc<MemCounter>) -> Result<DevBuf> {
    let [r, c, kr, kc] = array.shape();
    let n = r * c;
    if n >= u32::MAX as usize {
        return Err(Error::invalid(
            "encode (cuda)",
            "too many frames for one widening pass",
        ));
    }
    let shape = Shape2::new(kr, kc);
    let plan = DetectorPlan::new(shape, None, 1)?;
    let ctx = e.gpu.ctx();
    let out = DevBuf::alloc(ctx, n * shape.len() * 2, Some(counter), "u16 frames")?;
    let ids: Vec<u32> = (0..n as u32).collect();
    let map = DevBuf::alloc(ctx, (4 * n).max(4), None, "frame map")?;
    map.write(0, bytemuck::cast_slice(&ids))?;
    let errs = ErrorRecords::new(ctx, None)?;
    let stream = e.gpu.stream();
    // SAFETY: the array holds n u8 frames of `shape`, the map n words naming frames < n,
    // `out` n u16 frames; all alive until the synchronize below.
    unsafe {
        region_bin_batch(
            e,
            stream,
            &plan,
            &RegionBinBatch {
                src: array.device_ptr(),
                src_dtype: DType::U8,
                n_frames: n as u64,
                dst_frame: map.ptr(),
                dst: out.ptr(),
            },
            DType::U16,
            DType::U16,
            false,
            None,
            &errs,
        )
    }?;
    stream
        .synchronize()
        .map_err(|err| driver_error("synchronize widen", err))?;
    Ok(out)
}

/// Encode a dense u16 or u8 array already on the GPU (e.g. an uploaded NumPy array): fit on an
/// evenly spread sample of its frames, then encode every frame. The array is left as it is; a
/// u8 array is widened to a u16 copy first (u8 counts are coded as u16 symbols, as the CPU
/// engine widens them).
pub fn encode_device_array(array: &DeviceArray, enc: &EncodeOptions) -> Result<GpuEncodedLoad> {
    let t0 = Instant::now();
    let op = "encode (cuda)";
    let e = engine()?;
    let counter = Arc::new(MemCounter::default());
    let widened = match array.dtype() {
        DType::U16 => None,
        DType::U8 => Some(widen_u8(e, array, &counter)?),
        other => {
            return Err(Error::invalid(
                op,
                format!("the encoded representation holds u16 counts; the array is {other}"),
            ))
        }
    };
    let frames_ptr = widened.as_ref().map_or(array.device_ptr(), DevBuf::ptr);
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
                frames_ptr + f * frame_bytes as u64,
                frame_bytes,
                stream.cu_stream(),
            )
        }
        .result()
        .map_err(|err| driver_error("gather fit sample", err))?;
    }
    let fitted = fit_and_size(e, k, sample, pick.len() as u64, frame_len, n, enc, &counter)?;
    let (dmodel, per_frame, mut capacity) = (fitted.model, fitted.per_frame, fitted.capacity);
    let mut fit_stages = fitted.stages;
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
        let err = EncoderRecords::new(ctx, Some(&counter))?;
        let scratch = EncoderScratch::new(ctx, k, frame_len, Some(&counter))?;
        let a = dense_args(frames_ptr, n, &arena, capacity, &index, &err, &scratch);
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
        let EncoderRead { fault, used } = err.read()?;
        if let Some(f) = fault {
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
            saturated: 0,
            timings: {
                let mut t = std::mem::take(&mut fit_stages);
                t.push(StageTiming::new(
                    format!("encode (wall; {per_frame:.0} B/frame predicted)"),
                    enc_s,
                ));
                t.push(StageTiming::new(
                    "fit + encode (wall)",
                    t0.elapsed().as_secs_f64(),
                ));
                t
            },
            memory,
            sum_dp: None,
        });
    }
}

/// The bytes `n` dense frames at `frames` take encoded with `model` (16-byte rounded), without
/// keeping the streams: the encoder runs with an arena of capacity 0, so every frame
/// "overflows", is written nowhere and is still counted in the arena cursor (rans.cu
/// `qem_rans_encode` places a stream after coding it). A worst-case arena for a 4,096-frame
/// sample was 604 MB, allocated and freed in every encoded load.
fn measure_encoded_bytes(
    e: &Engine,
    k: &RansKernels,
    model: &DeviceModel,
    frames: &DevBuf,
    n: u64,
) -> Result<u64> {
    let ctx = e.gpu.ctx();
    let frame_len = model.model().frame_len();
    let arena = DevBuf::alloc(ctx, 16, None, "sample streams (none kept)")?;
    let index = DevBuf::alloc(ctx, (n * 16) as usize, None, "sample index")?;
    let err = EncoderRecords::new(ctx, None)?;
    let scratch = EncoderScratch::new(ctx, k, frame_len, None)?;
    let a = dense_args(frames.ptr(), n, &arena, 0, &index, &err, &scratch);
    let stream = e.gpu.stream();
    // SAFETY: frames holds n dense frames of the model's length (the sample pass' result);
    // with capacity 0 the kernel writes no stream byte, only n index entries (index holds n)
    // and the records; all alive until the synchronize below.
    unsafe { rans::launch_encode(k, stream, model, &a) }?;
    stream
        .synchronize()
        .map_err(|err| driver_error("synchronize sample encode", err))?;
    let r = err.read()?;
    if let Some(f) = r.fault.filter(|f| f.code != 0) {
        return Err(rans::fault_error(&f, f.frame).with_op("encode sample (cuda)"));
    }
    let counted = r.fault.map_or(0, |f| u64::from(f.overflowed));
    if counted != n {
        return Err(Error::internal(
            "encode sample (cuda)",
            format!("{counted} of {n} sample frames counted without an arena"),
        ));
    }
    Ok(r.used)
}

/// The encoder's arguments for `n_frames` dense frames at `frames` into index entries
/// `0..n_frames` (no frame map, no bad-pixel lookup), writing `arena` (`capacity` bytes),
/// `index`, the records `err` and the warps of `scratch`.
fn dense_args(
    frames: u64,
    n_frames: u64,
    arena: &DevBuf,
    capacity: u64,
    index: &DevBuf,
    err: &EncoderRecords,
    scratch: &EncoderScratch,
) -> rans::EncodeArgs {
    let (scratch_words, scratch_warps) = scratch.parts();
    rans::EncodeArgs {
        frames,
        n_frames,
        dst: 0,
        dst_base: 0,
        bad: 0,
        arena: arena.ptr(),
        capacity,
        cursor: err.cursor_ptr(),
        index: index.ptr(),
        scratch_words,
        scratch_warps,
        err: err.err_ptr(),
    }
}

/// A model fitted on a dense sample already on the device, uploaded, and the arena it
/// predicts for `n` frames.
pub(super) struct Fitted {
    pub(super) model: DeviceModel,
    /// Encoded bytes per frame the sample took.
    pub(super) per_frame: f64,
    /// Arena bytes for `n` frames: the sample's rate × `enc.headroom`, + 4 MiB, 16-aligned.
    pub(super) capacity: u64,
    /// The fit's, the upload's and the sample encode's seconds.
    pub(super) stages: Vec<StageTiming>,
}

/// Fit a model on the `n_sample` dense frames in `sample`, upload it (counted in `counter`)
/// and size the arena of `n` frames from the sample's encoded size. Shared by the encoded
/// load and [`encode_device_array`], so both fit and size alike. The sample is freed on
/// return, before the caller allocates the arena.
#[allow(clippy::too_many_arguments)]
pub(super) fn fit_and_size(
    e: &Engine,
    k: &RansKernels,
    sample: DevBuf,
    n_sample: u64,
    frame_len: usize,
    n: u64,
    enc: &EncodeOptions,
    counter: &Arc<MemCounter>,
) -> Result<Fitted> {
    let t = Instant::now();
    let model = rans::fit_on_device(&e.gpu, k, sample.ptr(), n_sample, frame_len, &enc.model)?;
    let t_fit = t.elapsed().as_secs_f64();
    let model = DeviceModel::upload(e.gpu.ctx(), model, Some(counter))?;
    let t_upload = t.elapsed().as_secs_f64();
    let sample_bytes = measure_encoded_bytes(e, k, &model, &sample, n_sample)?;
    drop(sample);
    let t_measure = t.elapsed().as_secs_f64();
    let stages = vec![
        StageTiming::new(
            "fit: the sample's statistics on the card and the model on the host",
            t_fit,
        ),
        StageTiming::new("fit: model upload", t_upload - t_fit),
        StageTiming::new(
            "fit: sample encode, counted only (the arena's size)",
            t_measure - t_upload,
        ),
    ];
    let per_frame = sample_bytes as f64 / n_sample.max(1) as f64;
    let capacity = ((per_frame * n as f64 * enc.headroom.max(1.0)) as u64 + (4 << 20))
        .next_multiple_of(rans::STREAM_ALIGN);
    Ok(Fitted {
        model,
        per_frame,
        capacity,
        stages,
    })
}
