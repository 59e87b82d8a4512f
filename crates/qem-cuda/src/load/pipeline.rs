//! The overlapped pipeline (module doc of [`super`]): per batch, read into a pinned slot, H2D on
//! the copy stream, decode (and region/bin, and encode) on the compute stream, an encoding
//! pass's sum DP beside the encode on a side stream, with events ordering them; one
//! error-record check at the end.

use std::fs::File;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaEvent, CudaStream};
use qem_core::{DType, DetectorPlan, Error, MemoryReport, Result, Shape2, StageTiming};
use qem_io::{ChunkCodec, Source};

use super::buffers::{allocate, Buffers, EncodeState, Sizing};
use super::plan::{admit, plan_source, table_words, BatchPlan, LoadPlan, MemoryPlan};
use super::reader::{read_batch, BatchInput};
use super::records::ErrorRecords;
use super::timings::{event, record, stage_timings, BatchEvents, HostSeconds, StageInputs};
use super::GpuLoadParams;
use crate::bslz4::{fault_from_record, fault_to_error, BlockTable, LaunchShape, RawDecode};
use crate::device::driver_error;
use crate::engine::{engine, Engine};
use crate::mem::{DevBuf, MemCounter, PinnedBuf};
use crate::rans::{self, DeviceModel, EncoderScratch, RansKernels};
use crate::transform::{launch_region_bin, launch_zero_pixels, RegionBinArgs};

/// Synchronizes its streams when dropped.
struct Drain<'a>(Vec<&'a CudaStream>);

impl Drop for Drain<'_> {
    fn drop(&mut self) {
        for s in &self.0 {
            let _ = s.synchronize();
        }
    }
}

pub(super) fn overflow_error(frame: u64, orow: u32, ocol: u32, value: u64, dtype: DType) -> Error {
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

/// Where a pipeline's decoded frames go.
#[derive(Clone, Copy)]
pub(super) enum Sink<'a> {
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
pub(super) struct PipelineOut {
    pub(super) dense: Option<DevBuf>,
    pub(super) encoded: Option<EncodedOut>,
    pub(super) output: Shape2,
    pub(super) saturated: u64,
    pub(super) frames: u64,
    pub(super) bytes_read: u64,
    pub(super) batches: usize,
    pub(super) direct: bool,
    pub(super) timings: Vec<StageTiming>,
    pub(super) memory: MemoryReport,
}

/// The encoded sink's buffers after a pipeline.
pub(super) struct EncodedOut {
    pub(super) arena: DevBuf,
    pub(super) index: DevBuf,
    /// Bytes the encoder allocated (all streams, 16-byte rounded; more than the arena when
    /// frames overflowed).
    pub(super) used: u64,
    /// Frames that did not fit the arena.
    pub(super) overflowed: u32,
    /// The sum DP of the frames encoded (u64 per result pixel).
    pub(super) sums: DevBuf,
}

/// The overlapped pipeline over source frames `frames` (result order). Result frames are
/// `params.result_dtype`; their values must fit `value_dtype` (the same dtype, or `u8` for `u8`
/// counts written as `u16`, how the encoder takes them). `planned`: the plan of `frames` made
/// beforehand by [`plan_source`] (an encoding sink's plan, made while the sample pass ran), else
/// it is made here.
pub(super) fn pipeline(
    src: &Source,
    params: &GpuLoadParams<'_>,
    frames: &[u64],
    planned: Option<(LoadPlan, bool)>,
    sink: Sink<'_>,
    value_dtype: DType,
) -> Result<PipelineOut> {
    let t_total = Instant::now();
    let op = "load (cuda)";
    if src.codec != ChunkCodec::Bslz4 && src.codec != ChunkCodec::Raw {
        return Err(Error::invalid(op, "unsupported chunk codec for the GPU"));
    }
    let e = engine()?;
    let opts = params.options;
    let rplan = params.detector;
    if rplan.source != src.detector_shape {
        return Err(
            Error::internal(op, "detector plan made for another detector")
                .with_expected(src.detector_shape.to_string())
                .with_found(rplan.source.to_string()),
        );
    }
    if value_dtype.size() > params.result_dtype.size() {
        return Err(Error::internal(op, "values wider than the result dtype"));
    }
    // Frames whose values are capped below their dtype's range always pass the transform.
    let identity =
        rplan.is_identity(src.dtype, params.result_dtype) && value_dtype == params.result_dtype;
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
    let (plan, direct) = match planned {
        // Planned for an encoding sink, which never decodes into the result directly.
        Some(p) if encode.is_some() && !p.1 && p.0.frames == frames => p,
        Some(_) => return Err(Error::internal(op, "a plan made for other frames or sink")),
        None => plan_source(src, frames, identity && encode.is_none(), &opts)?,
    };
    let frames = &plan.frames;
    // Slots in flight, never more than the batches: a one-batch pass (the encoded load's
    // sample) page-locks one slot, not three it would never fill (first load: ~30 ms).
    let slots = opts.slots.clamp(2, 4).min(plan.batches.len()).max(1);
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
    let Buffers {
        dst,
        enc,
        d_in,
        mut d_tab,
        mut h_in,
        mut h_tab,
        scratch,
        mut status,
        errs,
        bad_buf,
        pinned_s,
    } = allocate(
        e,
        &ctx,
        &counter,
        &Sizing {
            encode,
            dest_bytes,
            n_result,
            out_frame_elems,
            enc_in_bytes,
            identity,
            direct,
            slots,
            table_cap_words,
            plan: &plan,
            status_bytes: mem.status,
        },
        &bad_idx,
        params.bad_mask,
    )?;
    let t_buffers = t.elapsed().as_secs_f64();
    let (free_peak, _) = e.gpu.mem_info()?;
    let copy_stream = ctx
        .new_stream()
        .map_err(|err| driver_error("create copy stream", err))?;
    let compute = ctx
        .new_stream()
        .map_err(|err| driver_error("create compute stream", err))?;
    // The sum DP of an encoding pass runs here beside the encode: a memory-bound read of the
    // batch next to a compute-bound kernel (on one stream it added 7–8 ms to a load).
    let side = match enc {
        Some(_) => Some(
            ctx.new_stream()
                .map_err(|err| driver_error("create side stream", err))?,
        ),
        None => None,
    };
    // Declared after every buffer, so dropped before them: on an early error return, queued
    // copies and kernels finish before their buffers are freed.
    let _drain = Drain(
        [Some(&*copy_stream), Some(&*compute), side.as_deref()]
            .into_iter()
            .flatten()
            .collect(),
    );
    let files: Vec<File> = src
        .files
        .iter()
        .map(|f| qem_io::open_regular("open", &f.path, "data file"))
        .collect::<Result<_>>()?;
    let pool = e.reader_pool(opts.reader_threads)?;
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
        let (dst_map, local_map) = batch_maps(&plan, batch, direct, enc.is_some() && !identity);
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
        pack_tables(h_tab[s].as_mut_slice(), &table, dst_map, &local_map);
        read_wall_s += t.elapsed().as_secs_f64();

        // H2D on the copy stream, then decode, region/bin and encode on the compute stream.
        let be = queue_batch(&QueueBatch {
            e,
            copy_stream: &copy_stream,
            compute: &compute,
            side: side.as_deref(),
            slot_free: dec_done[s].map(|i| evs[i].last()),
            h_in: &h_in[s],
            d_in: &d_in[s],
            h_tab: &h_tab[s],
            d_tab: &d_tab[s],
            words,
            batch,
            table: &table,
            dst_map_len: dst_map.len(),
            scratch: scratch.as_ref(),
            dst: dst.as_ref(),
            dest_bytes,
            enc: enc.as_ref(),
            identity,
            direct,
            status: &status,
            errs: &errs,
            shape,
            elem_size: es,
            rplan: &rplan,
            src_dtype: src.dtype,
            result_dtype: params.result_dtype,
            value_dtype,
            saturate: params.saturate,
            bad_buf: bad_buf.as_ref(),
            out_frame_elems,
            n_bad: bad_idx.len(),
        })?;
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
    let (saturated, enc_used, enc_overflowed) =
        check_records(src, &plan, value_dtype, &errs, enc.as_ref())?;
    let t_sync = t.elapsed().as_secs_f64();
    if let Some(p) = progress {
        p.end();
    }

    let timings = stage_timings(&StageInputs {
        plan: &plan,
        evs: &evs,
        direct,
        encoding: enc.is_some(),
        raw_bytes: n_result * out_frame_elems as u64 * 2,
        enc_used,
        mask_events: mask_events.as_ref(),
        reader_threads: opts.reader_threads,
        bytes_read,
        host: HostSeconds {
            plan: t_plan,
            allocate: t_alloc,
            alloc_pinned: pinned_s,
            alloc_device: t_buffers - pinned_s,
            read_threads: read_thread_s,
            table_threads: table_thread_s,
            read_wall: read_wall_s,
            wait: wait_s,
            sync: t_sync,
        },
        total_s: t_total.elapsed().as_secs_f64(),
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
        sums: es.sums,
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

/// The streams of one batch's encode: the encode on `compute`, the sum DP on `side` between
/// `sums` (ready on `compute`, done on `side`).
struct EncodeStreams<'a> {
    compute: &'a CudaStream,
    side: &'a CudaStream,
    sums: &'a (CudaEvent, CudaEvent),
}

/// Queue the rANS encode of one decoded batch on `compute`: the region/bin output when the
/// plan transforms frames, else the decoded source frames in `scratch` (their bad pixels
/// zeroed first); `map_at` is the batch's frame map (entries of the stream index). The sum DP
/// of the same frames runs on the side stream meanwhile, and `compute` waits for it after the
/// encode, so the next batch's decode (which overwrites the frames) and the slot's release
/// come after both.
#[allow(clippy::too_many_arguments)]
fn encode_batch(
    e: &Engine,
    st: &EncodeStreams<'_>,
    es: &EncodeState<'_>,
    scratch: &DevBuf,
    batch_frames: u64,
    map_at: u64,
    out_frame_elems: usize,
    n_bad: usize,
) -> Result<()> {
    let compute = st.compute;
    let (sw, warps) = es.scratch.parts();
    // Identity plans encode the decoded source frames (masking here); others the region/bin
    // output (masked there).
    let frames_ptr = match &es.input {
        Some(inp) => inp.ptr(),
        None => {
            if let Some(list) = &es.bad_list {
                // SAFETY: scratch holds `batch_frames` decoded u16 frames of `out_frame_elems`
                // (= source) pixels; the list holds `n_bad` offsets < out_frame_elems; both
                // alive until the pipeline's final synchronize.
                unsafe {
                    launch_zero_pixels(
                        &e.transform,
                        compute,
                        DType::U16,
                        scratch.ptr(),
                        batch_frames,
                        out_frame_elems as u64,
                        list.ptr(),
                        n_bad as u32,
                    )
                }?;
            }
            scratch.ptr()
        }
    };
    let a = rans::EncodeArgs {
        frames: frames_ptr,
        n_frames: batch_frames,
        dst: map_at,
        dst_base: 0,
        bad: 0,
        arena: es.arena.ptr(),
        capacity: es.capacity,
        cursor: es.err.cursor_ptr(),
        index: es.index.ptr(),
        scratch_words: sw,
        scratch_warps: warps,
        err: es.err.err_ptr(),
    };
    let (ready, done) = st.sums;
    record(ready, compute)?;
    st.side
        .wait(ready)
        .map_err(|err| driver_error("stream wait", err))?;
    // SAFETY: the frames buffer holds `batch_frames` u16 frames of `out_frame_elems` pixels (the
    // model's frame length), the map `batch_frames` words, `sums` out_frame_elems u64; all the
    // load's live buffers until the pipeline's final synchronize; the side stream reads them
    // after `ready` (frames complete), and nothing overwrites them before `compute` has
    // waited for `done` below.
    unsafe {
        crate::transform::launch_frame_sums(
            &e.transform,
            st.side,
            frames_ptr,
            batch_frames,
            out_frame_elems as u64,
            map_at,
            es.sums.ptr(),
        )
    }?;
    record(done, st.side)?;
    // SAFETY: the frames buffer holds `batch_frames` u16 frames of the model's frame length
    // (scratch of an identity u16 plan, or the region/bin output batch); the map holds
    // `batch_frames` words naming entries < the result's frames (or u32::MAX); index, arena,
    // cursor, scratch and records are the load's live buffers, alive until the pipeline's
    // final synchronize.
    unsafe { rans::launch_encode(es.kernels, compute, es.model, &a) }?;
    compute
        .wait(done)
        .map_err(|err| driver_error("stream wait", err))
}

/// One batch for the decode kernel: its compressed bytes on the device, its block table and
/// where the decoded frames go.
struct DecodeBatch<'a> {
    elem_size: usize,
    input: u64,
    in_len: u64,
    table: &'a BlockTable,
    /// Device address of the batch's tables: the block words, then the copy words.
    tables_at: u64,
    out: u64,
    out_len: u64,
    status: u64,
}

/// Queue the bitshuffle/LZ4 decode of one batch on `stream`; faults go to `errs`' decode record.
///
/// # Safety
/// Every address in `d` is a live allocation of the size it states (input ≥ `in_len`, the
/// tables hold `d.table`'s words, the output `out_len` bytes, status ≥ 2 words per block and
/// copy), alive until the stream has passed the launch.
unsafe fn decode_batch(
    e: &Engine,
    stream: &CudaStream,
    d: &DecodeBatch<'_>,
    errs: &ErrorRecords,
    shape: LaunchShape,
) -> Result<()> {
    let raw = RawDecode {
        elem_size: d.elem_size,
        input: d.input,
        in_len: d.in_len,
        blocks: d.tables_at,
        n_blocks: d.table.n_blocks() as u32,
        copies: d.tables_at + 4 * d.table.blocks.len() as u64,
        n_copies: d.table.n_copies() as u32,
        out: d.out,
        out_len: d.out_len,
        errors: errs.decode_ptr(),
        status: d.status,
        max_block_bytes: d.table.max_block_bytes,
    };
    // SAFETY: the caller's contract covers every address of `raw`; the error record is the
    // load's 8-word decode record.
    unsafe { e.decode.launch_raw(stream, &raw, shape) }
}

/// One region/bin launch: `n_frames` source frames at `src` into the result frames the map at
/// `dst_frame` names (`u32::MAX`: not wanted) in `dst`.
pub(super) struct RegionBinBatch {
    pub(super) src: u64,
    pub(super) src_dtype: DType,
    pub(super) n_frames: u64,
    pub(super) dst_frame: u64,
    pub(super) dst: u64,
}

/// Queue region, bin, bad-pixel zeroing and the dtype change of one batch on `stream`;
/// overflows and clipped values go to `errs`. Used by the pipeline and by `load_array`.
///
/// # Safety
/// `b.src` holds `n_frames` frames of the plan's source shape and `src_dtype`, the map
/// `n_frames` words naming frames of `b.dst` (which holds every result frame of
/// `result_dtype`), `bad` (if any) is a source-sized lookup; all alive until the stream has
/// passed the launch. Values must fit `value_dtype` (see [`RegionBinArgs::value_dtype`]).
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn region_bin_batch(
    e: &Engine,
    stream: &CudaStream,
    rplan: &DetectorPlan,
    b: &RegionBinBatch,
    result_dtype: DType,
    value_dtype: DType,
    saturate: bool,
    bad: Option<&DevBuf>,
    errs: &ErrorRecords,
) -> Result<()> {
    let a = RegionBinArgs {
        src: b.src,
        src_dtype: b.src_dtype,
        n_frames: b.n_frames as u32,
        dst_frame: b.dst_frame,
        dst: b.dst,
        dst_dtype: result_dtype,
        value_dtype,
        bad: bad.map_or(0, |x| x.ptr()),
        saturate,
        err: errs.overflow_ptr(),
        saturated: errs.saturated_ptr(),
    };
    // SAFETY: the caller's contract covers every address of `a`; the records are the load's.
    unsafe { launch_region_bin(&e.transform, stream, rplan, &a) }
}

/// Read the load's records after the final synchronize: a decode fault (named by file and
/// frame), a region/bin overflow, or an encoder fault is the load's error; else the clipped
/// values, the arena bytes the encoder used and the frames that overflowed the arena.
fn check_records(
    src: &Source,
    plan: &LoadPlan,
    result_dtype: DType,
    errs: &ErrorRecords,
    enc: Option<&EncodeState<'_>>,
) -> Result<(u64, u64, u32)> {
    let rec = errs.read()?;
    if let Some(f) = fault_from_record(&rec.decode) {
        let pc = plan.chunks.get(f.chunk as usize);
        let err = fault_to_error(&f, pc.map(|p| p.rec.first_frame));
        return Err(match pc {
            Some(p) => err.with_file(&src.files[p.rec.file as usize].path),
            None => err,
        });
    }
    rec.overflow(&plan.frames, result_dtype)?;
    let (mut used, mut overflowed) = (0u64, 0u32);
    if let Some(es) = enc {
        let r = es.err.read()?;
        used = r.used;
        if let Some(f) = r.fault {
            overflowed = f.overflowed;
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
    Ok((rec.saturated, used, overflowed))
}

/// The frame maps of one batch: the result frame of each decoded frame (`u32::MAX`: not
/// wanted; empty when decoding straight into the result) and, when frames are transformed on
/// their way to the encoder, each wanted frame's batch-local slot for the region/bin kernel.
fn batch_maps<'p>(
    plan: &'p LoadPlan,
    batch: &BatchPlan,
    direct: bool,
    local: bool,
) -> (&'p [u32], Vec<u32>) {
    if direct {
        return (&[], Vec::new());
    }
    let pcs = &plan.chunks[batch.chunks.clone()];
    let a = pcs.first().map_or(0, |p| p.dst_start);
    let b = pcs
        .last()
        .map_or(0, |p| p.dst_start + p.rec.frames_in_chunk as usize);
    let dst_map = &plan.dst_frames[a..b];
    let local_map = if local {
        dst_map
            .iter()
            .enumerate()
            .map(|(k, &f)| if f == u32::MAX { u32::MAX } else { k as u32 })
            .collect()
    } else {
        Vec::new()
    };
    (dst_map, local_map)
}

/// Lay a batch's tables out in its pinned slot as the kernels read them: block words, copy
/// words, the result frame map, the local frame map.
fn pack_tables(slot: &mut [u8], table: &BlockTable, dst_map: &[u32], local_map: &[u32]) {
    let words = table.blocks.len() + table.copies.len() + dst_map.len() + local_map.len();
    let w: &mut [u32] = bytemuck::cast_slice_mut(&mut slot[..words * 4]);
    let (a, rest) = w.split_at_mut(table.blocks.len());
    a.copy_from_slice(&table.blocks);
    let (b, rest) = rest.split_at_mut(table.copies.len());
    b.copy_from_slice(&table.copies);
    let (c, d) = rest.split_at_mut(dst_map.len());
    c.copy_from_slice(dst_map);
    d.copy_from_slice(local_map);
}

/// What [`queue_batch`] queues one batch with.
struct QueueBatch<'a> {
    e: &'a Engine,
    copy_stream: &'a CudaStream,
    compute: &'a CudaStream,
    /// The stream of the sum DP beside the encode (encoding passes).
    side: Option<&'a CudaStream>,
    /// The event after the last kernel that read this slot's device buffers (none on first use).
    slot_free: Option<&'a CudaEvent>,
    h_in: &'a PinnedBuf,
    d_in: &'a DevBuf,
    h_tab: &'a PinnedBuf,
    d_tab: &'a DevBuf,
    /// Table words packed in `h_tab` (blocks, copies, frame maps).
    words: usize,
    batch: &'a BatchPlan,
    table: &'a BlockTable,
    dst_map_len: usize,
    scratch: Option<&'a DevBuf>,
    dst: Option<&'a DevBuf>,
    dest_bytes: u64,
    enc: Option<&'a EncodeState<'a>>,
    identity: bool,
    direct: bool,
    status: &'a DevBuf,
    errs: &'a ErrorRecords,
    shape: LaunchShape,
    elem_size: usize,
    rplan: &'a DetectorPlan,
    src_dtype: DType,
    result_dtype: DType,
    value_dtype: DType,
    saturate: bool,
    bad_buf: Option<&'a DevBuf>,
    out_frame_elems: usize,
    n_bad: usize,
}

/// Queue one batch on the device: its H2D copies on the copy stream once the slot is free,
/// then on the compute stream (waiting for the copies) the decode, the region/bin transform
/// and the encode its plan needs; returns the batch's events. Nothing here waits on the host.
fn queue_batch(q: &QueueBatch<'_>) -> Result<BatchEvents> {
    const OP: &str = "load (cuda)";
    let (e, copy_stream, compute, batch) = (q.e, q.copy_stream, q.compute, q.batch);
    let (es, table, status, errs, shape, rplan) =
        (q.elem_size, q.table, q.status, q.errs, q.shape, q.rplan);
    let be = BatchEvents {
        h2d_start: event(e)?,
        h2d_end: event(e)?,
        dec_start: event(e)?,
        dec_end: event(e)?,
        rb_end: if q.direct || (q.enc.is_some() && q.identity) {
            None
        } else {
            Some(event(e)?)
        },
        enc_start: if q.enc.is_some() {
            Some(event(e)?)
        } else {
            None
        },
        enc_end: if q.enc.is_some() {
            Some(event(e)?)
        } else {
            None
        },
        sums: if q.enc.is_some() {
            Some((event(e)?, event(e)?))
        } else {
            None
        },
    };
    if let Some(ev) = q.slot_free {
        copy_stream
            .wait(ev)
            .map_err(|err| driver_error("stream wait", err))?;
    }
    record(&be.h2d_start, copy_stream)?;
    q.h_in
        .copy_to_device_async(q.d_in, 0, batch.in_bytes as usize, copy_stream)?;
    q.h_tab
        .copy_to_device_async(q.d_tab, 0, q.words * 4, copy_stream)?;
    record(&be.h2d_end, copy_stream)?;

    // Decode (and region/bin) on the compute stream after the copy.
    compute
        .wait(&be.h2d_end)
        .map_err(|err| driver_error("stream wait", err))?;
    record(&be.dec_start, compute)?;
    let tab = q.d_tab.ptr();
    let (out, out_len) = match (q.scratch, q.dst) {
        (Some(sc), _) => (sc.ptr(), batch.decoded_bytes),
        (None, Some(d)) => (d.ptr(), q.dest_bytes),
        (None, None) => return Err(Error::internal(OP, "no decode destination")),
    };
    // SAFETY: the tables hold the words just copied (blocks, then copies), the input slot
    // the batch's bytes, the output is the result or the scratch of `out_len` bytes, the
    // status buffer ≥ 2 words per item; all alive until the pipeline's final synchronize.
    unsafe {
        decode_batch(
            e,
            compute,
            &DecodeBatch {
                elem_size: es,
                input: q.d_in.ptr(),
                in_len: batch.in_bytes,
                table,
                tables_at: tab,
                out,
                out_len,
                status: status.ptr(),
            },
            errs,
            shape,
        )
    }?;
    record(&be.dec_end, compute)?;
    let map_at = tab + 4 * (table.blocks.len() + table.copies.len()) as u64;
    if let (Some(sc), Some(rb)) = (q.scratch, &be.rb_end) {
        // Dense: result frames named by the frame map; encoding: batch-local slots.
        let (dst_frame, dst_ptr) = match (q.enc, q.dst) {
            (Some(es), _) => (
                map_at + 4 * q.dst_map_len as u64,
                es.input.as_ref().map_or(0, |b| b.ptr()),
            ),
            (None, Some(d)) => (map_at, d.ptr()),
            (None, None) => return Err(Error::internal(OP, "no region/bin destination")),
        };
        // SAFETY: scratch holds `batch.frames` decoded source frames, the frame map
        // `batch.frames` words naming result frames < n_result, the result holds n_result
        // frames, the lookup is source-sized; all alive until the pipeline's final synchronize.
        unsafe {
            region_bin_batch(
                e,
                compute,
                rplan,
                &RegionBinBatch {
                    src: sc.ptr(),
                    src_dtype: q.src_dtype,
                    n_frames: batch.frames,
                    dst_frame,
                    dst: dst_ptr,
                },
                q.result_dtype,
                q.value_dtype,
                q.saturate,
                q.bad_buf,
                errs,
            )
        }?;
        record(rb, compute)?;
    }
    if let (Some(es), Some(sc), Some(ea), Some(eb), Some(side), Some(sums)) = (
        q.enc,
        q.scratch,
        &be.enc_start,
        &be.enc_end,
        q.side,
        &be.sums,
    ) {
        record(ea, compute)?;
        encode_batch(
            e,
            &EncodeStreams {
                compute,
                side,
                sums,
            },
            es,
            sc,
            batch.frames,
            map_at,
            q.out_frame_elems,
            q.n_bad,
        )?;
        record(eb, compute)?;
    }
    Ok(be)
}
