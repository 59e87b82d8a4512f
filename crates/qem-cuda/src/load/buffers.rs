//! The pipeline's buffers, allocated after admission: the destination (a dense result, or the
//! encoder's arena, index and scratch), the pinned and device slots, the decode scratch and
//! status, the error records and the bad-pixel table.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use qem_core::Result;

use super::plan::LoadPlan;
use super::records::{EncoderRecords, ErrorRecords};
use crate::engine::Engine;
use crate::mem::{DevBuf, MemCounter, PinnedBuf};
use crate::rans::{self, DeviceModel, EncoderScratch, RansKernels};

/// The encoder's buffers during a pipeline.
pub(super) struct EncodeState<'a> {
    pub(super) model: &'a DeviceModel,
    pub(super) kernels: &'a RansKernels,
    pub(super) arena: DevBuf,
    pub(super) capacity: u64,
    pub(super) index: DevBuf,
    /// The encoder's per-warp scratch, one per compute stream (lane) encoding.
    pub(super) scratch: Vec<EncoderScratch>,
    pub(super) input: Option<DevBuf>,
    /// Bad-pixel offsets, zeroed in the decoded batch before an identity plan's encode.
    pub(super) bad_list: Option<DevBuf>,
    /// Fault record and arena cursor.
    pub(super) err: EncoderRecords,
    /// The sum DP of the frames encoded, one u64 per result pixel (taken on the way, so the
    /// first product that needs it finds it cached).
    pub(super) sums: DevBuf,
}

/// What [`allocate`] sizes the buffers from.
pub(super) struct Sizing<'a, 'm> {
    pub(super) encode: Option<(&'m DeviceModel, &'m RansKernels, u64)>,
    pub(super) dest_bytes: u64,
    pub(super) n_result: u64,
    pub(super) out_frame_elems: usize,
    pub(super) enc_in_bytes: u64,
    pub(super) identity: bool,
    pub(super) direct: bool,
    pub(super) slots: usize,
    pub(super) table_cap_words: usize,
    pub(super) plan: &'a LoadPlan<'a>,
    pub(super) status_bytes: u64,
    /// Compute streams (1, or 2 when decode overlaps encode): decode scratch, status and
    /// encoder scratch each.
    pub(super) lanes: usize,
}

/// Every buffer of a pipeline: the destination (a dense result, or the encoder's), the pinned
/// and device slots, the decode scratch and status, the error records and the bad-pixel table.
pub(super) struct Buffers<'m> {
    pub(super) dst: Option<DevBuf>,
    pub(super) enc: Option<EncodeState<'m>>,
    pub(super) d_in: Vec<DevBuf>,
    pub(super) d_tab: Vec<DevBuf>,
    pub(super) h_in: Vec<PinnedBuf>,
    pub(super) h_tab: Vec<PinnedBuf>,
    /// Decode scratch per lane (none when decoding straight into the result).
    pub(super) scratch: Vec<DevBuf>,
    /// Decode status per lane.
    pub(super) status: Vec<DevBuf>,
    pub(super) errs: ErrorRecords,
    pub(super) bad_buf: Option<DevBuf>,
    /// Seconds spent taking the pinned slots (allocations when the engine's pool had none).
    pub(super) pinned_s: f64,
}

impl<'m> Buffers<'m> {
    /// Keep the result (the dense array or the encoder's buffers), give the pinned slots back
    /// to the engine's pool and free the rest. Only after every stream that used them has
    /// been synchronized.
    pub(super) fn release(mut self, e: &Engine) -> (Option<DevBuf>, Option<EncodeState<'m>>) {
        for pb in self.h_in.drain(..).chain(self.h_tab.drain(..)) {
            e.give_pinned(pb);
        }
        (self.dst.take(), self.enc.take())
    }
}

/// Allocate a pipeline's buffers (after admission), each counted in `counter`.
pub(super) fn allocate<'m>(
    e: &Engine,
    ctx: &Arc<CudaContext>,
    counter: &Arc<MemCounter>,
    z: &Sizing<'_, 'm>,
    bad_idx: &[u32],
    bad_mask: Option<&[bool]>,
) -> Result<Buffers<'m>> {
    let ctx = ctx.clone();
    let c = Some(counter);
    let dst = match z.encode {
        None => Some(DevBuf::alloc(&ctx, z.dest_bytes as usize, c, "result")?),
        Some(_) => None,
    };
    let enc = match z.encode {
        None => None,
        Some((model, k, capacity)) => {
            let index = DevBuf::alloc(
                &ctx,
                (z.n_result as usize * rans::INDEX_ENTRY_BYTES).max(16),
                c,
                "stream index",
            )?;
            // Entries of frames never encoded (a failed load) read as empty streams.
            index.zero()?;
            let err = EncoderRecords::new(&ctx, c)?;
            let sums = DevBuf::alloc(&ctx, z.out_frame_elems * 8, c, "sum DP")?;
            sums.zero()?;
            Some(EncodeState {
                model,
                kernels: k,
                arena: DevBuf::alloc(&ctx, capacity as usize, c, "encoded streams")?,
                capacity,
                index,
                scratch: (0..z.lanes)
                    .map(|_| EncoderScratch::new(&ctx, k, z.out_frame_elems, c))
                    .collect::<Result<_>>()?,
                input: if z.enc_in_bytes > 0 {
                    Some(DevBuf::alloc(
                        &ctx,
                        z.enc_in_bytes as usize,
                        c,
                        "encoder input batch",
                    )?)
                } else {
                    None
                },
                bad_list: if z.identity {
                    upload_bad_list(&ctx, c, bad_idx)?
                } else {
                    None
                },
                err,
                sums,
            })
        }
    };
    let mut d_in = Vec::with_capacity(z.slots);
    let mut d_tab = Vec::with_capacity(z.slots);
    let mut h_in = Vec::with_capacity(z.slots);
    let mut h_tab = Vec::with_capacity(z.slots);
    let mut pinned_s = 0.0;
    for _ in 0..z.slots {
        d_in.push(DevBuf::alloc(
            &ctx,
            z.plan.max_in_bytes as usize,
            c,
            "compressed batch",
        )?);
        d_tab.push(DevBuf::alloc(
            &ctx,
            z.table_cap_words * 4,
            c,
            "block table",
        )?);
        let t = std::time::Instant::now();
        h_in.push(e.take_pinned(z.plan.max_in_bytes as usize, "batch slot")?);
        h_tab.push(e.take_pinned(z.table_cap_words * 4, "table slot")?);
        pinned_s += t.elapsed().as_secs_f64();
    }
    let scratch = if z.direct {
        Vec::new()
    } else {
        (0..z.lanes)
            .map(|_| DevBuf::alloc(&ctx, z.plan.max_decoded_bytes as usize, c, "decode scratch"))
            .collect::<Result<_>>()?
    };
    let status = (0..z.lanes)
        .map(|_| DevBuf::alloc(&ctx, z.status_bytes as usize, c, "decode status"))
        .collect::<Result<_>>()?;
    // [0..32) decode error record, [32..64) overflow record, [64..72) saturated counter.
    let errs = ErrorRecords::new(&ctx, c)?;
    let bad_buf = if z.direct {
        upload_bad_list(&ctx, c, bad_idx)?
    } else {
        match bad_mask {
            Some(m) if m.iter().any(|&b| b) => {
                let lut: Vec<u8> = m.iter().map(|&b| u8::from(b)).collect();
                let b = DevBuf::alloc(&ctx, lut.len(), c, "bad-pixel lookup")?;
                b.write(0, &lut)?;
                Some(b)
            }
            _ => None,
        }
    };
    Ok(Buffers {
        dst,
        enc,
        d_in,
        d_tab,
        h_in,
        h_tab,
        scratch,
        status,
        errs,
        bad_buf,
        pinned_s,
    })
}

/// The bad-pixel offsets `bad_idx` uploaded as a u32 list, or `None` when there are none.
fn upload_bad_list(
    ctx: &Arc<CudaContext>,
    c: Option<&Arc<MemCounter>>,
    bad_idx: &[u32],
) -> Result<Option<DevBuf>> {
    if bad_idx.is_empty() {
        return Ok(None);
    }
    let b = DevBuf::alloc(ctx, bad_idx.len() * 4, c, "bad-pixel list")?;
    b.write(0, bytemuck::cast_slice(bad_idx))?;
    Ok(Some(b))
}
