//! Queueing one batch on the device (module doc of [`super`]): its H2D copies on the copy
//! stream, then on the compute stream the bitshuffle/LZ4 decode, the region/bin transform and
//! the rANS encode its plan needs (an encoding pass's sum DP beside the encode on the side
//! stream), with the batch's events. Nothing here waits on the host; [`super::pipeline()`] runs
//! the loop that reads batches and calls [`queue_batch`].

use cudarc::driver::{CudaEvent, CudaStream};
use qem_core::{DType, DetectorPlan, Error, Result};

use super::buffers::EncodeState;
use super::plan::BatchPlan;
use super::reader::BatchTables;
use super::records::ErrorRecords;
use super::timings::{event, record, BatchEvents};
use crate::bslz4::{LaunchShape, RawDecode};
use crate::device::driver_error;
use crate::engine::Engine;
use crate::mem::{DevBuf, PinnedBuf};
use crate::rans;
use crate::transform::{launch_region_bin, launch_zero_pixels, RegionBinArgs};

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
    lane: usize,
    batch_frames: u64,
    map_at: u64,
    out_frame_elems: usize,
    n_bad: usize,
) -> Result<()> {
    let compute = st.compute;
    let (sw, warps) = es.scratch[lane].parts();
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
    table: &'a BatchTables,
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
        copies: d.tables_at + 4 * d.table.block_words() as u64,
        n_copies: d.table.n_copies() as u32,
        out: d.out,
        out_len: d.out_len,
        errors: errs.decode_ptr(),
        status: d.status,
        max_block_bytes: d.table.max_block_bytes(),
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

/// What [`queue_batch`] queues one batch with.
pub(super) struct QueueBatch<'a> {
    pub(super) e: &'a Engine,
    pub(super) copy_stream: &'a CudaStream,
    pub(super) compute: &'a CudaStream,
    /// The stream of the sum DP beside the encode (encoding passes).
    pub(super) side: Option<&'a CudaStream>,
    /// The event after the last kernel that read this slot's device buffers (none on first use).
    pub(super) slot_free: Option<&'a CudaEvent>,
    pub(super) h_in: &'a PinnedBuf,
    pub(super) d_in: &'a DevBuf,
    pub(super) h_tab: &'a PinnedBuf,
    pub(super) d_tab: &'a DevBuf,
    /// Table words packed in `h_tab` (blocks, copies, frame maps).
    pub(super) words: usize,
    pub(super) batch: &'a BatchPlan,
    pub(super) tables: &'a BatchTables,
    pub(super) dst_map_len: usize,
    pub(super) scratch: Option<&'a DevBuf>,
    pub(super) dst: Option<&'a DevBuf>,
    pub(super) dest_bytes: u64,
    pub(super) enc: Option<&'a EncodeState<'a>>,
    /// The compute stream (`compute`) and the scratch, status and encoder scratch are this
    /// lane's.
    pub(super) lane: usize,
    pub(super) identity: bool,
    pub(super) direct: bool,
    pub(super) status: &'a DevBuf,
    pub(super) errs: &'a ErrorRecords,
    pub(super) shape: LaunchShape,
    pub(super) elem_size: usize,
    pub(super) rplan: &'a DetectorPlan,
    pub(super) src_dtype: DType,
    pub(super) result_dtype: DType,
    pub(super) value_dtype: DType,
    pub(super) saturate: bool,
    pub(super) bad_buf: Option<&'a DevBuf>,
    pub(super) out_frame_elems: usize,
    pub(super) n_bad: usize,
}

/// Queue one batch on the device: its H2D copies on the copy stream once the slot is free,
/// then on the compute stream (waiting for the copies) the decode, the region/bin transform
/// and the encode its plan needs; returns the batch's events. Nothing here waits on the host.
pub(super) fn queue_batch(q: &QueueBatch<'_>) -> Result<BatchEvents> {
    const OP: &str = "load (cuda)";
    let (e, copy_stream, compute, batch) = (q.e, q.copy_stream, q.compute, q.batch);
    let (es, table, status, errs, shape, rplan) =
        (q.elem_size, q.tables, q.status, q.errs, q.shape, q.rplan);
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
    let map_at = tab + 4 * table.words() as u64;
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
            q.lane,
            batch.frames,
            map_at,
            q.out_frame_elems,
            q.n_bad,
        )?;
        record(eb, compute)?;
    }
    Ok(be)
}
