//! The overlapped pipeline (module doc of [`super`]): per batch, read into a pinned slot and
//! queued on the device ([`super::queue`]: H2D on the copy stream, decode, region/bin and encode
//! on the compute stream, an encoding pass's sum DP beside the encode on a side stream); one
//! error-record check at the end.

use std::fs::File;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use qem_core::{DType, Error, MemoryReport, Result, Shape2, StageTiming};
use qem_io::{ChunkCodec, Source};

use super::buffers::{allocate, Buffers, EncodeState, Sizing};
use super::plan::{admit, plan_source, table_words, BatchPlan, LoadPlan, MemoryPlan};
use super::queue::{queue_batch, QueueBatch};
use super::reader::{read_batch, BatchInput, BatchTables};
use super::records::ErrorRecords;
use super::timings::{event, record, stage_timings, BatchEvents, HostSeconds, StageInputs};
use super::GpuLoadParams;
use crate::bslz4::{fault_from_record, fault_to_error, BlockTable, LaunchShape};
use crate::device::driver_error;
use crate::engine::{engine, Engine};
use crate::mem::{DevBuf, MemCounter};
use crate::rans::{self, DeviceModel, EncoderScratch, RansKernels};
use crate::transform::launch_zero_pixels;

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

/// What a pipeline settles before it allocates anything: the checks of its arguments, the
/// plan, the sizes of its buffers and their admission against the card's free memory.
struct Setup<'m> {
    e: &'static Engine,
    /// The encoder's model, kernels and arena capacity (an encoding sink).
    encode: Option<(&'m DeviceModel, &'m RansKernels, u64)>,
    /// Frames reach the result (or the encoder) unchanged.
    identity: bool,
    frame_bytes: u64,
    out_frame_elems: usize,
    out_es: usize,
    plan: LoadPlan<'m>,
    /// Decoding straight into the result.
    direct: bool,
    slots: usize,
    bad_idx: Vec<u32>,
    table_cap_words: usize,
    n_result: u64,
    enc_in_bytes: u64,
    dest_bytes: u64,
    mem: MemoryPlan,
    budget: u64,
    free0: u64,
    card_total: u64,
    /// Compute streams: 2 when decode overlaps encode ([`super::PipelineOptions::overlap_encode`]
    /// asked and admitted), else 1.
    lanes: usize,
}

/// The overlapped pipeline over source frames `frames` (result order). Result frames are
/// `params.result_dtype`; their values must fit `value_dtype` (the same dtype, or `u8` for `u8`
/// counts written as `u16`, how the encoder takes them). `planned`: the plan of `frames` made
/// beforehand by [`plan_source`] (an encoding sink's plan, made while the sample pass ran), else
/// it is made here.
///
/// Stages: [`setup`] (checks, plan, sizes, admission), then the buffers and streams, then
/// [`run_batches`] (read and queue every batch), [`wait_all`] (the final synchronize and the
/// records) and [`finish`] (the timings, the memory report, the release). The declarations
/// here fix the order of release: the streams drain before any buffer is freed, also on an
/// early error return.
pub(super) fn pipeline<'m>(
    src: &'m Source,
    params: &GpuLoadParams<'_>,
    frames: &[u64],
    planned: Option<(LoadPlan<'m>, bool)>,
    sink: Sink<'m>,
    value_dtype: DType,
) -> Result<PipelineOut> {
    let t_total = Instant::now();
    let z = setup(src, params, frames, planned, sink, value_dtype)?;
    let t_plan = t_total.elapsed().as_secs_f64();

    // ---- allocate
    let t = Instant::now();
    let e = z.e;
    let ctx = e.gpu.ctx().clone();
    let counter = Arc::new(MemCounter::default());
    let mut bufs = allocate(
        e,
        &ctx,
        &counter,
        &Sizing {
            encode: z.encode,
            dest_bytes: z.dest_bytes,
            n_result: z.n_result,
            out_frame_elems: z.out_frame_elems,
            enc_in_bytes: z.enc_in_bytes,
            identity: z.identity,
            direct: z.direct,
            slots: z.slots,
            table_cap_words: z.table_cap_words,
            plan: &z.plan,
            status_bytes: z.mem.status,
            lanes: z.lanes,
        },
        &z.bad_idx,
        params.bad_mask,
    )?;
    let t_buffers = t.elapsed().as_secs_f64();
    let (free_peak, _) = e.gpu.mem_info()?;
    let streams = Streams::new(&ctx, bufs.enc.is_some(), z.lanes)?;
    // Declared after every buffer, so dropped before them: on an early error return, queued
    // copies and kernels finish before their buffers are freed.
    let _drain = Drain(streams.all());
    let files: Vec<File> = src
        .files
        .iter()
        .map(|f| qem_io::open_regular("open", &f.path, "data file"))
        .collect::<Result<_>>()?;
    let pool = e.reader_pool(params.options.reader_threads)?;
    let t_alloc = t.elapsed().as_secs_f64();

    // ---- pipeline
    let lp = run_batches(
        &LoopInput {
            src,
            params,
            z: &z,
            streams: &streams,
            files: &files,
            pool: &pool,
            counter: &counter,
            value_dtype,
        },
        &mut bufs,
    )?;
    // Waited for here, while the buffers are still declared before the drain: an error of
    // the wait or of the records returns with every stream drained before any free.
    let waited = wait_all(src, params, &z, &bufs, &streams, value_dtype)?;
    finish(
        params,
        z,
        bufs,
        lp,
        waited,
        Finish {
            t_total,
            t_plan,
            t_alloc,
            t_buffers,
            free_peak,
            peak: &counter,
        },
    )
}

/// Check a pipeline's arguments, plan it (unless `planned`), size its buffers and admit them.
fn setup<'m>(
    src: &'m Source,
    params: &GpuLoadParams<'_>,
    frames: &[u64],
    planned: Option<(LoadPlan<'m>, bool)>,
    sink: Sink<'m>,
    value_dtype: DType,
) -> Result<Setup<'m>> {
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
    let frame_bytes = src.frame_bytes() as u64;
    let out_frame_elems = rplan.output.len();
    let out_es = params.result_dtype.size();
    let (plan, direct) = match planned {
        // Planned for an encoding sink, which never decodes into the result directly.
        Some(p) if encode.is_some() && !p.1 && p.0.frames == frames => p,
        Some(_) => return Err(Error::internal(op, "a plan made for other frames or sink")),
        None => plan_source(src, frames, identity && encode.is_none(), &opts)?,
    };
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
    let max_batch_frames = plan.max_decoded_bytes / frame_bytes.max(1);
    let table_cap_words = table_words(
        plan.max_chunks,
        blocks_per_chunk(src, &plan)?,
        max_batch_frames,
    ) + if encode.is_some() {
        max_batch_frames as usize
    } else {
        0
    };
    let n_result = plan.frames.len() as u64;
    // Encoding: an arena, the index, the encoder's scratch and (when frames change on the
    // way) a batch of transformed frames; the dense result does not exist.
    let enc_in_bytes = match encode {
        Some(_) if !identity => max_batch_frames * out_frame_elems as u64 * 2,
        _ => 0,
    };
    // Decode beside encode: unchanged frames encoded straight from the decode scratch, more
    // than one batch.
    let may_overlap =
        opts.overlap_encode && encode.is_some() && identity && !direct && plan.batches.len() > 1;
    let status_words = (table_cap_words as u64 / 8 * 8).max(256);
    let sizes = |lanes: u64| {
        let dest_bytes = match encode {
            None => n_result * out_frame_elems as u64 * out_es as u64,
            Some((_, k, capacity)) => {
                capacity
                    + n_result * rans::INDEX_ENTRY_BYTES as u64
                    + lanes * EncoderScratch::bytes_for(k, out_frame_elems)
                    + enc_in_bytes
            }
        };
        let mem = MemoryPlan {
            destination: dest_bytes,
            input: slots as u64 * plan.max_in_bytes.max(256),
            tables: slots as u64 * (table_cap_words as u64 * 4).max(256),
            scratch: if direct {
                0
            } else {
                lanes * plan.max_decoded_bytes
            },
            status: lanes * status_words,
            small: 256
                + if direct {
                    bad_idx.len() as u64 * 4
                } else {
                    rplan.source.len() as u64
                },
        };
        (dest_bytes, mem)
    };
    e.gpu
        .ctx()
        .bind_to_thread()
        .map_err(|err| driver_error("bind CUDA context", err))?;
    let (free0, card_total) = e.gpu.mem_info()?;
    // Two lanes when they fit the budget; else one, whose refusal is the load's error.
    let two = may_overlap
        .then(|| {
            let (d, m) = sizes(2);
            admit(m.total(), params.memory_budget, free0, opts.reserve_bytes)
                .ok()
                .map(|b| (d, m, b))
        })
        .flatten();
    let (lanes, dest_bytes, mem, budget) = match two {
        Some((d, m, b)) => (2, d, m, b),
        None => {
            let (d, m) = sizes(1);
            let b = admit(m.total(), params.memory_budget, free0, opts.reserve_bytes)?;
            (1, d, m, b)
        }
    };
    Ok(Setup {
        e,
        encode,
        identity,
        frame_bytes,
        out_frame_elems,
        out_es,
        plan,
        direct,
        slots,
        bad_idx,
        table_cap_words,
        n_result,
        enc_in_bytes,
        dest_bytes,
        mem,
        budget,
        free0,
        card_total,
        lanes,
    })
}

/// Blocks per chunk, from the first chunk's header (the tables grow if a later chunk has
/// more); 1 for raw or unfiltered chunks.
fn blocks_per_chunk(src: &Source, plan: &LoadPlan) -> Result<usize> {
    match plan.chunks.first() {
        Some(pc) if src.codec == ChunkCodec::Bslz4 && pc.rec.filter_mask & 1 == 0 => {
            let mut probe = Vec::new();
            src.read_chunk(pc.rec, &mut probe)?;
            let mut t = BlockTable::default();
            let out_len = pc.rec.frames_in_chunk as usize * src.frame_bytes();
            t.push_chunk(
                &probe,
                src.dtype.size(),
                0,
                pc.rec.first_frame,
                0,
                0,
                0,
                out_len,
            )
            .map_err(|err| err.with_file(&src.files[pc.rec.file as usize].path))?;
            Ok(t.n_blocks() + 1)
        }
        _ => Ok(1),
    }
}

/// A pipeline's streams: H2D copies, the decode/transform/encode chain (one per lane: batch
/// i runs on lane i mod lanes), and (encoding) the side stream of the sum DP.
struct Streams {
    copy: Arc<CudaStream>,
    compute: Vec<Arc<CudaStream>>,
    side: Option<Arc<CudaStream>>,
}

impl Streams {
    fn new(ctx: &Arc<CudaContext>, encoding: bool, lanes: usize) -> Result<Streams> {
        let copy = ctx
            .new_stream()
            .map_err(|err| driver_error("create copy stream", err))?;
        let compute = (0..lanes.max(1))
            .map(|_| {
                ctx.new_stream()
                    .map_err(|err| driver_error("create compute stream", err))
            })
            .collect::<Result<Vec<_>>>()?;
        // The sum DP of an encoding pass runs beside the encode: a memory-bound read of the
        // batch next to a compute-bound kernel (on one stream it added 7–8 ms to a load).
        let side = if encoding {
            Some(
                ctx.new_stream()
                    .map_err(|err| driver_error("create side stream", err))?,
            )
        } else {
            None
        };
        Ok(Streams {
            copy,
            compute,
            side,
        })
    }

    fn all(&self) -> Vec<&CudaStream> {
        std::iter::once(&*self.copy)
            .chain(self.compute.iter().map(|s| &**s))
            .chain(self.side.as_deref())
            .collect()
    }

    /// Wait for every compute stream (lane).
    fn sync_compute(&self, what: &str) -> Result<()> {
        for s in &self.compute {
            s.synchronize().map_err(|err| driver_error(what, err))?;
        }
        Ok(())
    }
}

/// What [`run_batches`] reads.
struct LoopInput<'a, 'm> {
    src: &'a Source,
    params: &'a GpuLoadParams<'a>,
    z: &'a Setup<'m>,
    streams: &'a Streams,
    files: &'a [File],
    pool: &'a rayon::ThreadPool,
    counter: &'a Arc<MemCounter>,
    value_dtype: DType,
}

/// The batch loop's events and host totals.
struct LoopTotals {
    evs: Vec<BatchEvents>,
    read_thread_s: f64,
    table_thread_s: f64,
    read_wall_s: f64,
    wait_s: f64,
    bytes_read: u64,
}

/// Read every batch into a pinned slot (waiting until the slot's last H2D is done) and queue
/// it on the device; a slot's tables and the decode status grow when a batch needs more.
/// Nothing waits for the queued work at the end: [`finish`] does.
fn run_batches(li: &LoopInput<'_, '_>, b: &mut Buffers<'_>) -> Result<LoopTotals> {
    let (z, src, params, streams) = (li.z, li.src, li.params, li.streams);
    let (e, plan, slots) = (z.e, &z.plan, z.slots);
    let ctx = e.gpu.ctx();
    let c = Some(li.counter);
    let progress = params.progress;
    if let Some(p) = progress {
        p.begin("load (cuda)", z.n_result);
    }
    let shape = LaunchShape {
        warps_per_cta: params.options.warps_per_cta.max(1),
        max_ctas: 0,
        stage_payload: params.options.stage_payload,
    };
    let mut t = LoopTotals {
        evs: Vec::with_capacity(plan.batches.len()),
        read_thread_s: 0.0,
        table_thread_s: 0.0,
        read_wall_s: 0.0,
        wait_s: 0.0,
        bytes_read: 0,
    };
    let mut h2d_done: Vec<Option<usize>> = vec![None; slots];
    let mut dec_done: Vec<Option<usize>> = vec![None; slots];
    let mut status_words = b.status[0].bytes() / 4;
    let mut tab_words_cap = vec![z.table_cap_words; slots];
    // The reader groups' descriptor tables, reused by every batch.
    let mut tables = BatchTables::default();
    for (bi, batch) in plan.batches.iter().enumerate() {
        if progress.is_some_and(|p| p.cancelled()) {
            let _ = streams.sync_compute("synchronize");
            let _ = streams.copy.synchronize();
            return Err(cancelled_error());
        }
        let s = bi % slots;
        // Lane: the compute stream, decode scratch, status and encoder scratch of this batch.
        // With two, batch i decodes on its lane while batch i − 1 encodes on the other; batch
        // i − 2, the last user of this lane's buffers, is ahead of it on the same stream.
        let lane = bi % streams.compute.len();
        let t0 = Instant::now();
        if let Some(i) = h2d_done[s] {
            t.evs[i]
                .h2d_end
                .synchronize()
                .map_err(|err| driver_error("wait for a free slot", err))?;
        }
        t.wait_s += t0.elapsed().as_secs_f64();

        // Read the chunks into the pinned slot and build the tables, in parallel.
        let t0 = Instant::now();
        let (rs, ts) = read_batch(
            &BatchInput {
                src,
                files: li.files,
                plan,
                batch,
                direct: z.direct,
                frame_bytes: z.frame_bytes,
                out_frame_bytes: (z.out_frame_elems * z.out_es) as u64,
                threads: params.options.reader_threads,
            },
            b.h_in[s].as_mut_slice(),
            li.pool,
            &mut tables,
        )?;
        t.read_thread_s += rs;
        t.table_thread_s += ts;
        t.bytes_read += batch.in_bytes;
        let (dst_map, local_map) =
            batch_maps(plan, batch, z.direct, b.enc.is_some() && !z.identity);
        let words = tables.words() + dst_map.len() + local_map.len();
        if words > tab_words_cap[s] {
            // A chunk with more blocks than the first one: grow this slot's tables (its last
            // decode must be over first).
            if let Some(i) = dec_done[s] {
                t.evs[i]
                    .last()
                    .synchronize()
                    .map_err(|err| driver_error("wait for a slot", err))?;
            }
            b.d_tab[s] = DevBuf::alloc(ctx, words * 4, c, "block table")?;
            b.h_tab[s] = e.take_pinned(words * 4, "table slot")?;
            tab_words_cap[s] = words;
        }
        if 2 * (tables.n_blocks() + tables.n_copies()) > status_words {
            streams.sync_compute("synchronize")?;
            let n = tables.n_blocks() + tables.n_copies();
            for st in b.status.iter_mut() {
                *st = DevBuf::alloc(ctx, 8 * n, c, "decode status")?;
            }
            status_words = b.status[0].bytes() / 4;
        }
        pack_tables(
            b.h_tab[s].as_mut_slice(),
            &tables,
            dst_map,
            &local_map,
            li.pool,
        );
        t.read_wall_s += t0.elapsed().as_secs_f64();

        // H2D on the copy stream, then decode, region/bin and encode on the compute stream.
        let be = queue_batch(&QueueBatch {
            e,
            copy_stream: &streams.copy,
            compute: &streams.compute[lane],
            side: streams.side.as_deref(),
            slot_free: dec_done[s].map(|i| t.evs[i].last()),
            h_in: &b.h_in[s],
            d_in: &b.d_in[s],
            h_tab: &b.h_tab[s],
            d_tab: &b.d_tab[s],
            words,
            batch,
            tables: &tables,
            dst_map_len: dst_map.len(),
            scratch: b.scratch.get(lane),
            dst: b.dst.as_ref(),
            dest_bytes: z.dest_bytes,
            enc: b.enc.as_ref(),
            lane,
            identity: z.identity,
            direct: z.direct,
            status: &b.status[lane],
            errs: &b.errs,
            shape,
            elem_size: src.dtype.size(),
            rplan: &params.detector,
            src_dtype: src.dtype,
            result_dtype: params.result_dtype,
            value_dtype: li.value_dtype,
            saturate: params.saturate,
            bad_buf: b.bad_buf.as_ref(),
            out_frame_elems: z.out_frame_elems,
            n_bad: z.bad_idx.len(),
        })?;
        t.evs.push(be);
        h2d_done[s] = Some(bi);
        dec_done[s] = Some(bi);
        if let Some(p) = progress {
            p.advance(wanted_frames(plan, batch));
        }
    }
    Ok(t)
}

/// The result frames a batch fills (its chunks' frames that the plan wants).
fn wanted_frames(plan: &LoadPlan, batch: &BatchPlan) -> u64 {
    let pcs = &plan.chunks[batch.chunks.clone()];
    let a = pcs.first().map_or(0, |p| p.dst_start);
    let b = pcs
        .last()
        .map_or(0, |p| p.dst_start + p.rec.frames_in_chunk as usize);
    plan.dst_frames[a..b]
        .iter()
        .filter(|&&f| f != u32::MAX)
        .count() as u64
}

/// The host times and memory figures [`finish`] reports.
struct Finish<'a> {
    t_total: Instant,
    t_plan: f64,
    t_alloc: f64,
    t_buffers: f64,
    free_peak: u64,
    peak: &'a Arc<MemCounter>,
}

/// What [`wait_all`] found.
struct Waited {
    mask_events: Option<(CudaEvent, CudaEvent)>,
    saturated: u64,
    enc_used: u64,
    enc_overflowed: u32,
    t_sync: f64,
}

/// After the last batch: zero the bad pixels of a direct result, wait for every stream and
/// read the records (a fault is the load's error).
fn wait_all(
    src: &Source,
    params: &GpuLoadParams<'_>,
    z: &Setup<'_>,
    b: &Buffers<'_>,
    streams: &Streams,
    value_dtype: DType,
) -> Result<Waited> {
    let e = z.e;
    // A direct load (the only one that zeroes bad pixels here) has one lane.
    let compute = &streams.compute[0];
    let mask_events = match (&b.bad_buf, z.direct, &b.dst) {
        (Some(bad), true, Some(dst)) => {
            let (a, zz) = (event(e)?, event(e)?);
            record(&a, compute)?;
            // SAFETY: the result holds n_result frames of `out_frame_elems` elements; the list
            // holds `bad_idx.len()` source (= result) pixel offsets < out_frame_elems.
            unsafe {
                launch_zero_pixels(
                    &e.transform,
                    compute,
                    params.result_dtype,
                    dst.ptr(),
                    z.n_result,
                    z.out_frame_elems as u64,
                    bad.ptr(),
                    z.bad_idx.len() as u32,
                )
            }?;
            record(&zz, compute)?;
            Some((a, zz))
        }
        _ => None,
    };
    let t = Instant::now();
    streams.sync_compute("synchronize compute stream")?;
    streams
        .copy
        .synchronize()
        .map_err(|err| driver_error("synchronize copy stream", err))?;
    let (saturated, enc_used, enc_overflowed) =
        check_records(src, &z.plan, value_dtype, &b.errs, b.enc.as_ref())?;
    Ok(Waited {
        mask_events,
        saturated,
        enc_used,
        enc_overflowed,
        t_sync: t.elapsed().as_secs_f64(),
    })
}

/// After [`wait_all`]: the timings and the memory report, and the release of everything but
/// the result (the pinned slots go back to the engine's pool).
fn finish(
    params: &GpuLoadParams<'_>,
    z: Setup<'_>,
    b: Buffers<'_>,
    lp: LoopTotals,
    w: Waited,
    f: Finish<'_>,
) -> Result<PipelineOut> {
    let e = z.e;
    let (enc_used, enc_overflowed, t_sync) = (w.enc_used, w.enc_overflowed, w.t_sync);
    if let Some(p) = params.progress {
        p.end();
    }
    let timings = stage_timings(&StageInputs {
        plan: &z.plan,
        evs: &lp.evs,
        direct: z.direct,
        encoding: b.enc.is_some(),
        raw_bytes: z.n_result * z.out_frame_elems as u64 * 2,
        enc_used,
        mask_events: w.mask_events.as_ref(),
        reader_threads: params.options.reader_threads,
        lanes: z.lanes,
        bytes_read: lp.bytes_read,
        host: HostSeconds {
            plan: f.t_plan,
            allocate: f.t_alloc,
            alloc_pinned: b.pinned_s,
            alloc_device: f.t_buffers - b.pinned_s,
            read_threads: lp.read_thread_s,
            table_threads: lp.table_thread_s,
            read_wall: lp.read_wall_s,
            wait: lp.wait_s,
            sync: t_sync,
        },
        total_s: f.t_total.elapsed().as_secs_f64(),
    });
    let memory = MemoryReport {
        planned_device_bytes: z.mem.total(),
        budget_bytes: z.budget,
        process_peak_device_bytes: f.peak.peak(),
        card_used_before_bytes: z.card_total.saturating_sub(z.free0),
        card_used_peak_bytes: z.card_total.saturating_sub(f.free_peak),
        card_total_bytes: z.card_total,
    };
    // Release everything but the result (after wait_all's synchronize).
    let (dst, enc) = b.release(e);
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
        output: params.detector.output,
        saturated: w.saturated,
        frames: z.n_result,
        bytes_read: lp.bytes_read,
        batches: z.plan.batches.len(),
        direct: z.direct,
        timings,
        memory,
    })
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
/// words (packed by the reader pool, [`BatchTables::pack`]), the result frame map, the local
/// frame map.
fn pack_tables(
    slot: &mut [u8],
    tables: &BatchTables,
    dst_map: &[u32],
    local_map: &[u32],
    pool: &rayon::ThreadPool,
) {
    let desc = tables.words();
    let words = desc + dst_map.len() + local_map.len();
    let w: &mut [u32] = bytemuck::cast_slice_mut(&mut slot[..words * 4]);
    let (a, rest) = w.split_at_mut(desc);
    tables.pack(a, pool);
    let (c, d) = rest.split_at_mut(dst_map.len());
    c.copy_from_slice(dst_map);
    d.copy_from_slice(local_map);
}
