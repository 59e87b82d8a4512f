//! cuFFT plans with the work areas we allocate (so the budget sees them), and the memory plan of
//! a preparation: G storage (f32 or f16) and the batch of BF pixels per pass.

use super::*;

/// A cuFFT plan with the work area we allocated for it (so the budget sees it).
pub(super) struct SizedPlan {
    pub(super) plan: Plan,
    pub(super) _work: Option<DevBuf>,
}

/// A batched 2-D plan of `kind` over `scan` (basic layout) without a work area, and the bytes
/// of the work area it needs.
pub(super) fn bare_plan(
    scan: Shape2,
    kind: cufft_sys::cufftType,
    batch: usize,
) -> Result<(Plan, usize)> {
    let h = cufft::create().map_err(|e| cufft_error(OP, "create plan", e))?;
    let plan = Plan(h);
    let mut n = [scan.rows as i32, scan.cols as i32];
    // SAFETY: a fresh plan; `n` outlives the call; null embeds select the basic layout.
    let work = unsafe {
        cufft::set_auto_allocation(plan.0, false).map_err(|e| cufft_error(OP, "plan", e))?;
        cufft::make_plan_many(
            plan.0,
            2,
            n.as_mut_ptr(),
            std::ptr::null_mut(),
            1,
            0,
            std::ptr::null_mut(),
            1,
            0,
            kind,
            batch as i32,
        )
        .map_err(|e| cufft_error(OP, &format!("make plan ({batch} transforms)"), e))?
    };
    Ok((plan, work))
}

/// A batched 2-D plan of `kind` over `scan` with its work area counted in `counter`.
pub(super) fn make_plan(
    gpu: &Gpu,
    scan: Shape2,
    kind: cufft_sys::cufftType,
    batch: usize,
    counter: &Arc<MemCounter>,
) -> Result<SizedPlan> {
    let (plan, work) = bare_plan(scan, kind, batch)?;
    let work = if work > 0 {
        let w = DevBuf::alloc(gpu.ctx(), work, Some(counter), "cuFFT work area")?;
        // SAFETY: the plan is live and the area holds the `work` bytes cuFFT asked for.
        unsafe { cufft::set_work_area(plan.0, w.ptr() as *mut std::ffi::c_void) }
            .map_err(|e| cufft_error(OP, "set work area", e))?;
        Some(w)
    } else {
        None
    };
    // SAFETY: a live plan and the engine's stream.
    unsafe { cufft::set_stream(plan.0, gpu.stream().cu_stream() as _) }
        .map_err(|e| cufft_error(OP, "set stream", e))?;
    Ok(SizedPlan { plan, _work: work })
}

/// The plan of `n` transforms in `plans`, made by `make` on first use.
pub(super) fn cached_plan(
    plans: &mut Vec<(usize, SizedPlan)>,
    n: usize,
    make: impl FnOnce() -> Result<SizedPlan>,
) -> Result<&SizedPlan> {
    let i = match plans.iter().position(|(k, _)| *k == n) {
        Some(i) => i,
        None => {
            plans.push((n, make()?));
            plans.len() - 1
        }
    };
    Ok(&plans[i].1)
}

/// Bytes of the cuFFT work area a plan would take (asked of cuFFT without allocating; the
/// plan is destroyed unused).
pub(super) fn plan_work_bytes(
    scan: Shape2,
    kind: cufft_sys::cufftType,
    batch: usize,
) -> Result<u64> {
    Ok(bare_plan(scan, kind, batch)?.1 as u64)
}

/// Sizes that decide the plan of a preparation (bytes, except `b`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Sizes {
    /// BF pixels.
    pub(super) b: u64,
    /// Scan positions.
    pub(super) n: u64,
    /// Half-spectrum values per pixel.
    pub(super) nh: u64,
    /// Work buffers kept for the evaluations, tables.
    pub(super) fixed: u64,
    /// Decode scratch (ENCODED sources).
    pub(super) scratch: u64,
    /// Bytes of one decoded u16 frame (ENCODED sources).
    pub(super) frame_bytes: u64,
}

impl Sizes {
    /// Bytes per BF pixel of a prepare batch's buffers: its f32 image and its f32 spectrum
    /// (cuFFT's layout, before the store into G's tiles).
    pub(super) fn batch_px(&self) -> u64 {
        self.n * 4 + self.nh * 8
    }
    /// [`Sizes::batch_px`] and an estimate of the R2C work area (about one spectrum).
    pub(super) fn per_px(&self) -> u64 {
        self.batch_px() + self.nh * 8
    }
    /// G as `st` and the work buffers: what stays for the evaluations.
    pub(super) fn resident(&self, st: GStorage) -> u64 {
        self.b * padded_half(self.nh) * st.bytes_per_value() + self.fixed
    }
    pub(super) fn need(&self, st: GStorage, batch: u64) -> u64 {
        self.resident(st) + self.scratch + batch * self.per_px()
    }
}

/// Storage of G and BF pixels per prepare batch within `budget`: the widest of C32, C16 and C12
/// with which G and a batch of 32 pixels fit (or `forced`); the batch as large as the rest of
/// the budget allows (at most [`MAX_PREPARE_BATCH`]). Too little room even for C12 is a
/// `MemoryBudget` error.
pub(super) fn choose_plan(
    sz: &Sizes,
    budget: u64,
    forced: Option<GStorage>,
) -> Result<(GStorage, usize)> {
    let min_batch = sz.b.min(32);
    let storage = match forced {
        Some(st) => st,
        None if sz.need(GStorage::C32, min_batch) <= budget => GStorage::C32,
        None if sz.need(GStorage::C16, min_batch) <= budget => GStorage::C16,
        None => GStorage::C12,
    };
    let need = sz.need(storage, min_batch);
    if need > budget {
        return Err(Error::memory_budget(OP, need, budget).with_op(format!(
            "{OP} prepare (G for {} BF pixels × {} scan positions as {}; raise memory_budget, \
             bin the detector, crop the scan, or hold the data on the host — backend cpu — \
             with SSB engine cuda, so that the card holds G alone)",
            sz.b,
            sz.n,
            storage.name()
        )));
    }
    let room = budget - sz.need(storage, 0);
    let batch = ((room / sz.per_px()) as usize)
        .clamp(1, MAX_PREPARE_BATCH)
        .min(sz.b as usize);
    Ok((storage, batch))
}

/// Over ENCODED data at most this many FFT batches each decode every frame themselves; with
/// more, the BF pixels are staged as u16 images (see [`encoded_passes`]).
pub(super) const DIRECT_PASSES: usize = 4;
/// The smallest decode scratch a staged ENCODED gather takes.
const MIN_SCRATCH: u64 = 16 << 20;
/// The largest FFT batch of a staged ENCODED gather (32 R2C of the scan keep cuFFT busy).
const STAGED_BATCH: usize = 32;
/// Frames one decode launch needs to keep an H100 busy: [`DECODE_SCRATCH`]'s 3,640 frames of
/// 192² decode at the full rate (~20 ms for 262,144), 780 took ~5× as long per frame.
const FULL_DECODE_FRAMES: f64 = 3640.0;

/// How an ENCODED source is gathered (bytes, except the pixel counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct EncodedPasses {
    /// BF pixels per decode pass, staged as u16 images; 0 = not staged (each FFT batch decodes
    /// every frame).
    pub(super) stage: usize,
    /// BF pixels per FFT batch.
    pub(super) batch: usize,
    /// Decode scratch.
    pub(super) scratch: u64,
}

impl EncodedPasses {
    /// Not staged: each FFT batch of `batch` pixels decodes every frame through `scratch`.
    pub(super) fn direct(batch: usize, scratch: u64) -> EncodedPasses {
        EncodedPasses {
            stage: 0,
            batch,
            scratch,
        }
    }

    /// Decode passes over every frame.
    pub(super) fn passes(&self, b: usize) -> usize {
        b.div_ceil(if self.stage > 0 {
            self.stage
        } else {
            self.batch
        })
    }
}

/// The gather of an ENCODED source within `budget`, given G's `storage` and the `batch`
/// [`choose_plan`] made; `work(k)` = the cuFFT work area of k R2C transforms. Each decode pass
/// decodes every frame (~20 ms at 512² × 192² on an H100), so when more than [`DIRECT_PASSES`]
/// batches would each take one (G nearly fills the budget), the pixels are staged instead: a
/// pass gathers as many BF pixels as fit as u16 images (2 bytes per scan position, where an FFT
/// batch takes ~16 per pixel), then FFT batches of at most [`STAGED_BATCH`] pixels convert and
/// transform them. The decode scratch trades against the staging: a decode launch needs
/// [`FULL_DECODE_FRAMES`] frames to fill an H100 (with 780 frames of 192², a pass took ~100 ms
/// instead of ~20: r53 under 6 GiB, `h100_ssb_r53.json`), so the scratch is the candidate
/// (16 MiB … the full scratch, doubling) with the least predicted decode time,
/// passes × max(1, FULL_DECODE_FRAMES / frames per launch). Staging that would not save decode
/// time is not used.
pub(super) fn encoded_passes(
    sz: &Sizes,
    storage: GStorage,
    batch: usize,
    budget: u64,
    work: impl Fn(usize) -> Result<u64>,
) -> Result<EncodedPasses> {
    let direct = EncodedPasses::direct(batch, sz.scratch);
    let b = sz.b as usize;
    if b.div_ceil(batch) <= DIRECT_PASSES {
        return Ok(direct);
    }
    let base = sz.resident(storage);
    let fb = batch.min(STAGED_BATCH);
    let fft = fb as u64 * sz.batch_px() + work(fb)?;
    let mut best: Option<(f64, EncodedPasses)> = None;
    let mut scratch = MIN_SCRATCH.min(sz.scratch);
    loop {
        let used = base + scratch + fft;
        let stage = (budget.saturating_sub(used) / (sz.n * 2)).min(sz.b) as usize;
        // At least one FFT batch staged; round down to whole FFT batches unless one pass
        // takes every pixel, so only the very last batch is short.
        let stage = if stage >= b { b } else { stage / fb * fb };
        if stage >= fb {
            let p = EncodedPasses {
                stage,
                batch: fb,
                scratch,
            };
            let cost = p.passes(b) as f64 * launch_cost(scratch, sz.frame_bytes);
            if best.as_ref().is_none_or(|(c, _)| cost < *c) {
                best = Some((cost, p));
            }
        }
        if scratch >= sz.scratch {
            break;
        }
        scratch = (scratch * 2).min(sz.scratch);
    }
    let direct_cost = direct.passes(b) as f64 * launch_cost(sz.scratch, sz.frame_bytes);
    Ok(match best {
        Some((cost, p)) if cost < direct_cost => p,
        _ => direct,
    })
}

/// The decode time of one pass relative to a full-rate one, with `scratch` bytes of decoded
/// frames per launch.
fn launch_cost(scratch: u64, frame_bytes: u64) -> f64 {
    let frames = (scratch / frame_bytes.max(1)).max(1) as f64;
    (FULL_DECODE_FRAMES / frames).max(1.0)
}
