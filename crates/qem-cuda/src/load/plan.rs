//! Planning a load (host only, no GPU): the chunks that hold the requested frames, sorted by
//! `(file, offset)` and cut into batches; the device buffers of a load and their admission.

use qem_core::{Error, Region, Result, Shape2};
use qem_io::{ChunkRecord, Source};

use super::PipelineOptions;

/// One stored chunk the load reads (16 bytes: a plan of 262,144 chunks is 4 MB, where copies
/// of the records made it 12.6 MB of fresh pages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanChunk<'s> {
    /// The stored chunk (the source's record).
    pub rec: &'s ChunkRecord,
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
pub struct LoadPlan<'s> {
    /// Chunks to read, sorted by `(file, offset)`.
    pub chunks: Vec<PlanChunk<'s>>,
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
pub fn plan_chunks<'s>(
    chunks: &'s [ChunkRecord],
    frames: &[u64],
    frame_bytes: u64,
    locate: impl Fn(u64) -> Result<usize>,
    batch_bytes: u64,
    scratch_limit: Option<u64>,
) -> Result<LoadPlan<'s>> {
    if frames.len() > u32::MAX as usize - 1 {
        return Err(Error::invalid(
            "plan GPU load",
            "too many frames for one GPU load",
        ));
    }
    // Frames in scan order mostly lie in the previous frame's chunk or the next one: checked
    // first, so the search (`locate`) runs only at jumps (a scan region's row starts).
    let holds = |ci: usize, n: u64| {
        chunks
            .get(ci)
            .is_some_and(|c| c.first_frame <= n && n < c.first_frame + c.valid_frames as u64)
    };
    let chunk_of = |last: usize, n: u64| -> Result<usize> {
        let ci = if holds(last, n) {
            last
        } else if holds(last.wrapping_add(1), n) {
            last + 1
        } else {
            locate(n)?
        };
        if ci >= chunks.len() {
            return Err(Error::internal("plan GPU load", "chunk index out of range"));
        }
        Ok(ci)
    };
    let (plan_chunks, dst_frames) = match ascending_plan(chunks, frames, &chunk_of)? {
        Some(p) => p,
        None => general_plan(chunks, frames, &chunk_of)?,
    };
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

/// The chunks and frame map of frames in ascending order whose chunks, taken in that order,
/// are also in `(file, offset)` order (every scan region of a written acquisition): one pass,
/// each chunk entered when its first wanted frame comes. `None` when the frames or the chunks
/// are not in that order ([`general_plan`] then).
pub(super) fn ascending_plan<'s>(
    chunks: &'s [ChunkRecord],
    frames: &[u64],
    chunk_of: &impl Fn(usize, u64) -> Result<usize>,
) -> Result<Option<(Vec<PlanChunk<'s>>, Vec<u32>)>> {
    if !frames.is_sorted_by(|a, b| a < b) {
        return Ok(None);
    }
    // Room for the common case (a chunk per frame; untouched capacity costs no pages), so
    // neither vector is copied while it grows.
    let mut plan_chunks: Vec<PlanChunk<'s>> = Vec::with_capacity(frames.len().min(chunks.len()));
    let mut dst_frames: Vec<u32> = Vec::with_capacity(frames.len());
    let mut last = usize::MAX;
    for (ri, &n) in frames.iter().enumerate() {
        let ci = chunk_of(last, n)?;
        if ci != last {
            let rec = &chunks[ci];
            if plan_chunks
                .last()
                .is_some_and(|p| (p.rec.file, p.rec.offset) >= (rec.file, rec.offset))
            {
                return Ok(None);
            }
            plan_chunks.push(PlanChunk {
                rec,
                dst_start: dst_frames.len(),
            });
            dst_frames.resize(dst_frames.len() + rec.frames_in_chunk as usize, u32::MAX);
            last = ci;
        }
        let pc = plan_chunks[plan_chunks.len() - 1];
        let k = frame_in_chunk(&pc, n)?;
        dst_frames[pc.dst_start + k] = ri as u32;
    }
    Ok(Some((plan_chunks, dst_frames)))
}

/// The chunks and frame map of frames in any order: each chunk once, the chunks sorted by
/// `(file, offset)` for sequential reads.
pub(super) fn general_plan<'s>(
    chunks: &'s [ChunkRecord],
    frames: &[u64],
    chunk_of: &impl Fn(usize, u64) -> Result<usize>,
) -> Result<(Vec<PlanChunk<'s>>, Vec<u32>)> {
    let mut slot_of: Vec<usize> = vec![usize::MAX; chunks.len()];
    let mut order: Vec<usize> = Vec::with_capacity(chunks.len().min(frames.len()));
    let mut frame_chunk: Vec<usize> = Vec::with_capacity(frames.len());
    let mut last = usize::MAX;
    for &n in frames {
        let ci = chunk_of(last, n)?;
        last = ci;
        frame_chunk.push(ci);
        if slot_of[ci] == usize::MAX {
            slot_of[ci] = order.len();
            order.push(ci);
        }
    }
    order.sort_by_key(|&ci| (chunks[ci].file, chunks[ci].offset));
    let mut plan_chunks = Vec::with_capacity(order.len());
    let mut decoded = 0usize;
    for (pi, &ci) in order.iter().enumerate() {
        slot_of[ci] = pi;
        let rec = &chunks[ci];
        plan_chunks.push(PlanChunk {
            rec,
            dst_start: decoded,
        });
        decoded += rec.frames_in_chunk as usize;
    }
    let mut dst_frames = vec![u32::MAX; decoded];
    for (ri, (&n, &ci)) in frames.iter().zip(&frame_chunk).enumerate() {
        let pc = &plan_chunks[slot_of[ci]];
        dst_frames[pc.dst_start + frame_in_chunk(pc, n)?] = ri as u32;
    }
    Ok((plan_chunks, dst_frames))
}

/// Frame `n`'s place in its plan chunk.
fn frame_in_chunk(pc: &PlanChunk, n: u64) -> Result<usize> {
    n.checked_sub(pc.rec.first_frame)
        .filter(|&k| k < pc.rec.frames_in_chunk as u64)
        .map(|k| k as usize)
        .ok_or_else(|| Error::internal("plan GPU load", "frame outside its chunk"))
}

impl LoadPlan<'_> {
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
pub(super) fn table_words(max_chunks: usize, blocks_per_chunk: usize, frames: u64) -> usize {
    max_chunks * (blocks_per_chunk + 1) * 8 + frames as usize
}

/// Plan the chunks of `scan_region` of `src`; returns the plan and whether the kernel can
/// decode straight into the result (`identity` frame plan and chunks that map 1:1 onto
/// consecutive result frames), else batches also limited by the decode scratch.
pub(super) fn plan_source<'s>(
    src: &'s Source,
    frames: &[u64],
    identity: bool,
    opts: &PipelineOptions,
) -> Result<(LoadPlan<'s>, bool)> {
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
    // `scratch`: the decode-scratch bound on a batch, `None` on the identity path.
    let plan_with = |scratch: Option<u64>| {
        plan_chunks(
            &src.chunks,
            frames,
            frame_bytes,
            locate,
            opts.batch_bytes,
            scratch,
        )
    };
    if identity {
        let plan = plan_with(None)?;
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
    Ok((plan_with(Some(limit))?, false))
}
