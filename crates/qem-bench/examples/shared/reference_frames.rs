//! Frames of the simulated reference scan for the codec examples (`rans_ratio`, `pair_study`),
//! shared through `#[path]` so both study the same frames: frame `k` of a request is scan frame
//! `k · 2654435761 mod total`, made on all cores.

use qem_sim::{ReferenceParams, ReferencePattern};

/// `n` loaded frames of the reference pattern at `dose` electrons per frame.
pub fn make_frames(n: usize, dose: f64) -> Result<Vec<Vec<u16>>, Box<dyn std::error::Error>> {
    let pat = ReferencePattern::new(ReferenceParams {
        dose_e_per_frame: dose,
        ..ReferenceParams::default()
    })?;
    let len = pat.params().detector_shape.len();
    let total = pat.frames();
    let threads = std::thread::available_parallelism().map_or(2, |t| t.get());
    let mut frames = vec![Vec::new(); n];
    std::thread::scope(|sc| {
        // At least 1: `chunks_mut(0)` panics, and `n` may be 0.
        let per = n.div_ceil(threads).max(1);
        for (part, chunk) in frames.chunks_mut(per).enumerate() {
            let pat = &pat;
            let base = part * per;
            sc.spawn(move || {
                let mut lam = vec![0f32; len];
                let mut out = vec![0u32; len];
                for (i, f) in chunk.iter_mut().enumerate() {
                    let k = (base + i) as u64;
                    let idx = k.wrapping_mul(2_654_435_761) % total;
                    *f = pat.loaded_frame(idx, &mut lam, &mut out);
                }
            });
        }
    });
    Ok(frames)
}
