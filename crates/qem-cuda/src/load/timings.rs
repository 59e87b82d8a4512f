//! The pipeline's events and stage timings: the CUDA events each batch records on its streams,
//! and the stage table of a load (host stages by wall clock, device stages by their events).

use cudarc::driver::{sys, CudaEvent, CudaStream};
use qem_core::{Result, StageTiming};

use super::plan::LoadPlan;
use crate::device::driver_error;
use crate::engine::Engine;

/// A new CUDA event (default flags: timed).
pub(super) fn event(e: &Engine) -> Result<CudaEvent> {
    e.gpu
        .ctx()
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|err| driver_error("create event", err))
}

/// Record `ev` on `s`.
pub(super) fn record(ev: &CudaEvent, s: &CudaStream) -> Result<()> {
    ev.record(s).map_err(|e| driver_error("record event", e))
}

/// Seconds from event `a` to event `b` (NaN when either has not completed).
pub(super) fn elapsed_s(a: &CudaEvent, b: &CudaEvent) -> f64 {
    a.elapsed_ms(b)
        .map(|ms| ms as f64 / 1e3)
        .unwrap_or(f64::NAN)
}

/// The events of one batch: H2D and decode on their streams, region/bin and encode when the
/// plan has them.
pub(super) struct BatchEvents {
    pub(super) h2d_start: CudaEvent,
    pub(super) h2d_end: CudaEvent,
    pub(super) dec_start: CudaEvent,
    pub(super) dec_end: CudaEvent,
    pub(super) rb_end: Option<CudaEvent>,
    pub(super) enc_start: Option<CudaEvent>,
    pub(super) enc_end: Option<CudaEvent>,
    /// The sum DP beside the encode: recorded on the compute stream when the batch's frames
    /// are ready, and on the side stream after the sums (the compute stream waits for it
    /// before `enc_end`).
    pub(super) sums: Option<(CudaEvent, CudaEvent)>,
}

impl BatchEvents {
    /// The event after the batch's last kernel (the slot's tables are free after it).
    pub(super) fn last(&self) -> &CudaEvent {
        self.enc_end
            .as_ref()
            .or(self.rb_end.as_ref())
            .unwrap_or(&self.dec_end)
    }
}

/// Host-side seconds of a pipeline's stages.
pub(super) struct HostSeconds {
    pub(super) plan: f64,
    pub(super) allocate: f64,
    /// Of `allocate`: taking the pinned slots, and the device buffers.
    pub(super) alloc_pinned: f64,
    pub(super) alloc_device: f64,
    pub(super) read_threads: f64,
    pub(super) table_threads: f64,
    pub(super) read_wall: f64,
    pub(super) wait: f64,
    pub(super) sync: f64,
}

/// What [`stage_timings`] reports from.
pub(super) struct StageInputs<'a> {
    pub(super) plan: &'a LoadPlan<'a>,
    pub(super) evs: &'a [BatchEvents],
    pub(super) direct: bool,
    pub(super) encoding: bool,
    /// Bytes of the u16 frames the encoder read.
    pub(super) raw_bytes: u64,
    pub(super) enc_used: u64,
    pub(super) mask_events: Option<&'a (CudaEvent, CudaEvent)>,
    pub(super) reader_threads: usize,
    /// Compute streams (2: decode beside encode).
    pub(super) lanes: usize,
    pub(super) bytes_read: u64,
    pub(super) host: HostSeconds,
    pub(super) total_s: f64,
}

/// A pipeline's stage timings: host stages by wall clock, device stages by their events
/// (summed over batches; overlapping stages are separate entries, never added into a wall).
pub(super) fn stage_timings(t: &StageInputs<'_>) -> Vec<StageTiming> {
    let sum = |f: &dyn Fn(&BatchEvents) -> f64| t.evs.iter().map(f).sum::<f64>();
    let h2d_s = sum(&|b| elapsed_s(&b.h2d_start, &b.h2d_end));
    let dec_s = sum(&|b| elapsed_s(&b.dec_start, &b.dec_end));
    let rb_s = sum(&|b| b.rb_end.as_ref().map_or(0.0, |r| elapsed_s(&b.dec_end, r)));
    let gbs = |bytes: u64, s: f64| if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 };
    let decoded_total: u64 = t.plan.batches.iter().map(|b| b.decoded_bytes).sum();
    let mut timings = vec![
        StageTiming::new(
            format!(
                "plan (host: {} chunks, {} batches, admission; {} compute stream{})",
                t.plan.chunks.len(),
                t.plan.batches.len(),
                t.lanes,
                if t.lanes == 1 { "" } else { "s" }
            ),
            t.host.plan,
        ),
        StageTiming::new(
            "allocate (device + pinned, streams, files, reader pool)",
            t.host.allocate,
        ),
        StageTiming::new(
            "of which pinned host slots (the engine's pool, else allocated)",
            t.host.alloc_pinned,
        ),
        StageTiming::new("of which device buffers", t.host.alloc_device),
        StageTiming::new(
            format!(
                "read (threads, summed; {} threads, {:.1} GB)",
                t.reader_threads,
                t.bytes_read as f64 / 1e9
            ),
            t.host.read_threads,
        ),
        StageTiming::new("block table (threads, summed)", t.host.table_threads),
        StageTiming::new(
            format!(
                "read+table (wall, summed over batches; {:.1} GB/s)",
                gbs(t.bytes_read, t.host.read_wall)
            ),
            t.host.read_wall,
        ),
        StageTiming::new("wait for a free slot (host)", t.host.wait),
        StageTiming::new(
            format!("h2d (events, summed; {:.1} GB/s)", gbs(t.bytes_read, h2d_s)),
            h2d_s,
        ),
        StageTiming::new(
            format!(
                "decode (events, summed; {:.1} GB/s decoded{})",
                gbs(decoded_total, dec_s),
                if t.direct {
                    ", straight into the result"
                } else {
                    ", into scratch"
                }
            ),
            dec_s,
        ),
    ];
    if t.evs.iter().any(|b| b.rb_end.is_some()) {
        timings.push(StageTiming::new("region/bin (events, summed)", rb_s));
    }
    if t.encoding {
        let enc_s = sum(&|b| match (&b.enc_start, &b.enc_end) {
            (Some(a), Some(z)) => elapsed_s(a, z),
            _ => 0.0,
        });
        timings.push(StageTiming::new(
            format!(
                "encode (events, summed; {:.1} GB/s of u16 frames, {:.3} GB of streams)",
                gbs(t.raw_bytes, enc_s),
                t.enc_used as f64 / 1e9
            ),
            enc_s,
        ));
        timings.push(StageTiming::new(
            "sum DP on a side stream beside the encode (events, summed; overlaps it)",
            sum(&|b| b.sums.as_ref().map_or(0.0, |(a, z)| elapsed_s(a, z))),
        ));
    }
    if let Some((a, z)) = t.mask_events {
        timings.push(StageTiming::new("mask (events)", elapsed_s(a, z)));
    }
    timings.push(StageTiming::new(
        "final sync + error check (host)",
        t.host.sync,
    ));
    timings.push(StageTiming::new("first product (n/a)", 0.0));
    timings.push(StageTiming::new("gpu load (wall)", t.total_s));
    timings
}
