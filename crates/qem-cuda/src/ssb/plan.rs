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
}

impl Sizes {
    /// Transient bytes per BF pixel of a prepare batch: its f32 image, its f32 spectrum (cuFFT's
    /// layout, before the store into G's tiles) and an estimate of the R2C work area (about one
    /// spectrum).
    pub(super) fn per_px(&self) -> u64 {
        self.n * 4 + self.nh * 8 + self.nh * 8
    }
    pub(super) fn need(&self, st: GStorage, batch: u64) -> u64 {
        self.b * padded_half(self.nh) * st.bytes_per_value()
            + self.fixed
            + self.scratch
            + batch * self.per_px()
    }
}

/// Storage of G and BF pixels per prepare batch within `budget`: C32 when G as f32 and a batch
/// of 32 pixels fit, else C16 (or `forced`); the batch as large as the rest of the budget allows
/// (at most [`MAX_PREPARE_BATCH`]). Too little room even for C16 is a `MemoryBudget` error.
pub(super) fn choose_plan(
    sz: &Sizes,
    budget: u64,
    forced: Option<GStorage>,
) -> Result<(GStorage, usize)> {
    let min_batch = sz.b.min(32);
    let storage = match forced {
        Some(st) => st,
        None if sz.need(GStorage::C32, min_batch) <= budget => GStorage::C32,
        None => GStorage::C16,
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
