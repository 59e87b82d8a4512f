//! One-pass detector reductions: what an engine is asked to compute over the frames of a
//! dataset, and what it returns. The CPU engine (`qem-cpu`) and the CUDA engine (`qem-cuda`)
//! both implement a [`ReduceRequest`] → [`ReduceResult`] pass; the façade (`qem`) builds the
//! requests (virtual detectors, diffraction sums, moments) and checks them once here.
//!
//! Exactness (docs/concepts.md §3, contract 3): integer masks give exact `u64` images, the sum DP and the
//! moments are exact `u64`, the max DP is exact. Float masks accumulate in `f64`; the order of
//! the additions is engine-defined, so float images agree between engines to rounding only.

use crate::error::{Error, Result};
use crate::provenance::StageTiming;

/// The largest weight an integer mask may hold. With `u32` counts and frames of up to 2^16
/// pixels, `65535 · (2^32 − 1) · 2^16 < 2^64`, so an integer image can never wrap.
pub const MAX_INT_WEIGHT: u32 = 65535;

/// The largest frame (detector pixels) a reduction accepts; it bounds the moments and integer
/// images of `u32` data below 2^64 (see [`MAX_INT_WEIGHT`]).
pub const MAX_FRAME_PIXELS: usize = 1 << 16;

/// Frames per chunk of a deterministic scan sum (a scan mean, a centring): each chunk summed
/// serially, then the chunk sums in chunk order, so the bits do not depend on the thread count.
/// One value for both engines: the CPU's `ordered_sums` and the CUDA centre-of-mass mean use it,
/// which keeps their means equal bit for bit.
pub const ORDERED_CHUNK: usize = 8192;

/// Weights over the detector (`k_r · k_c` values, row-major) for one virtual image.
#[derive(Debug, Clone, PartialEq)]
pub enum DetectorMask {
    /// Integer weights `0..=MAX_INT_WEIGHT` (a bool mask is 0/1): the image is an exact `u64`
    /// sum `V[R] = Σ_k w[k] · I[R, k]`.
    Int(Vec<u32>),
    /// Float weights: the image is accumulated in `f64`.
    Float(Vec<f64>),
}

impl DetectorMask {
    /// Number of detector pixels the mask covers.
    pub fn len(&self) -> usize {
        match self {
            DetectorMask::Int(w) => w.len(),
            DetectorMask::Float(w) => w.len(),
        }
    }
    /// True for a mask of no pixels.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Indices of the pixels with a non-zero weight, ascending: the only pixels a dense
    /// engine needs to read.
    pub fn support(&self) -> Vec<u32> {
        match self {
            DetectorMask::Int(w) => nonzero(w.iter().map(|&x| x != 0)),
            DetectorMask::Float(w) => nonzero(w.iter().map(|&x| x != 0.0)),
        }
    }
    /// True when every weight is 0 or 1 (a plain binary detector).
    pub fn is_binary(&self) -> bool {
        matches!(self, DetectorMask::Int(w) if w.iter().all(|&x| x <= 1))
    }
}

fn nonzero(it: impl Iterator<Item = bool>) -> Vec<u32> {
    it.enumerate()
        .filter(|&(_, nz)| nz)
        .map(|(i, _)| i as u32)
        .collect()
}

/// What one pass over the frames computes. Every field is optional; an empty request is an
/// error (nothing to do).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReduceRequest {
    /// One virtual image per mask, each `k_r · k_c` weights.
    pub masks: Vec<DetectorMask>,
    /// Exact `u64` sum of the frames, per detector pixel.
    pub sum_dp: bool,
    /// Element-wise maximum of the frames, per detector pixel.
    pub max_dp: bool,
    /// Exact per-frame moments `S = Σ I`, `m_row = Σ k_r I`, `m_col = Σ k_c I` (whole
    /// detector, pixel centres at their 0-based indices).
    pub moments: bool,
    /// Restrict the pass to these flat frame indices (`n = R_r · N_Rc + R_c`), strictly
    /// ascending — a scan ROI. Per-frame outputs then have one value per listed frame, in this
    /// order. `None` means every frame.
    pub frames: Option<Vec<u64>>,
}

impl ReduceRequest {
    /// Check the request against a dataset of `n_frames` frames of `frame_len` pixels: mask
    /// sizes, integer weight range, finite float weights, frame list order and range, frame
    /// size bound.
    pub fn validate(&self, n_frames: u64, frame_len: usize) -> Result<()> {
        const OP: &str = "detector reduction";
        if self.masks.is_empty() && !self.sum_dp && !self.max_dp && !self.moments {
            return Err(Error::invalid(OP, "nothing requested")
                .with_expected("at least one mask, sum_dp, max_dp or moments"));
        }
        if frame_len > MAX_FRAME_PIXELS {
            return Err(
                Error::invalid(OP, "detector frame too large for exact u64 reductions")
                    .with_expected(format!("at most {MAX_FRAME_PIXELS} pixels"))
                    .with_found(format!("{frame_len} pixels")),
            );
        }
        for (i, m) in self.masks.iter().enumerate() {
            if m.len() != frame_len {
                return Err(
                    Error::invalid(OP, format!("mask {i} does not match the detector"))
                        .with_expected(format!("{frame_len} weights"))
                        .with_found(format!("{} weights", m.len())),
                );
            }
            match m {
                DetectorMask::Int(w) => {
                    if let Some((p, &x)) = w.iter().enumerate().find(|(_, &x)| x > MAX_INT_WEIGHT) {
                        return Err(Error::invalid(
                            OP,
                            format!("integer mask {i} weight at pixel {p} is too large"),
                        )
                        .with_expected(format!(
                            "0..={MAX_INT_WEIGHT} (use a float mask for larger weights)"
                        ))
                        .with_found(x.to_string()));
                    }
                }
                DetectorMask::Float(w) => {
                    if let Some((p, &x)) = w.iter().enumerate().find(|(_, x)| !x.is_finite()) {
                        return Err(Error::invalid(
                            OP,
                            format!("float mask {i} weight at pixel {p} is not finite"),
                        )
                        .with_expected("finite weights")
                        .with_found(x.to_string()));
                    }
                }
            }
        }
        if let Some(frames) = &self.frames {
            if frames.is_empty() {
                return Err(Error::invalid(OP, "the frame selection is empty")
                    .with_expected("at least one frame"));
            }
            if let Some(w) = frames.windows(2).find(|w| w[0] >= w[1]) {
                return Err(Error::invalid(OP, "frame selection not strictly ascending")
                    .with_expected("strictly ascending flat frame indices")
                    .with_found(format!("{} then {}", w[0], w[1])));
            }
            if let Some(&last) = frames.last() {
                if last >= n_frames {
                    return Err(Error::invalid(OP, "frame selection outside the scan")
                        .with_expected(format!("indices < {n_frames}"))
                        .with_found(last.to_string()));
                }
            }
        }
        Ok(())
    }

    /// Frames the pass visits.
    pub fn n_selected(&self, n_frames: u64) -> u64 {
        self.frames.as_ref().map_or(n_frames, |f| f.len() as u64)
    }
}

/// One virtual image, one value per visited frame.
#[derive(Debug, Clone, PartialEq)]
pub enum VirtualImage {
    /// From an integer mask: exact.
    U64(Vec<u64>),
    /// From a float mask.
    F64(Vec<f64>),
}

impl VirtualImage {
    /// Values as `f64` (exact for integer images below 2^53).
    pub fn to_f64(&self) -> Vec<f64> {
        match self {
            VirtualImage::U64(v) => v.iter().map(|&x| x as f64).collect(),
            VirtualImage::F64(v) => v.clone(),
        }
    }
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            VirtualImage::U64(v) => v.len(),
            VirtualImage::F64(v) => v.len(),
        }
    }
    /// True when it holds no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Exact per-frame moments of the counts over the whole detector.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Moments {
    /// `S = Σ_k I[k]`.
    pub sum: Vec<u64>,
    /// `m_row = Σ_k k_r · I[k]`.
    pub m_row: Vec<u64>,
    /// `m_col = Σ_k k_c · I[k]`.
    pub m_col: Vec<u64>,
}

/// What a [`ReduceRequest`] returns; a field is `Some` (or non-empty) exactly when requested.
/// Equality compares the values only, not [`ReduceResult::stages`].
#[derive(Debug, Clone, Default)]
pub struct ReduceResult {
    /// One image per requested mask, in request order.
    pub images: Vec<VirtualImage>,
    /// Exact sum over the visited frames, per detector pixel.
    pub sum_dp: Option<Vec<u64>>,
    /// Maximum over the visited frames, per detector pixel.
    pub max_dp: Option<Vec<u32>>,
    /// Per-frame moments.
    pub moments: Option<Moments>,
    /// Frames visited.
    pub n_frames: u64,
    /// Where the engine spent the time (the CUDA engine: set-up, the kernels by GPU events,
    /// the wait, the download); empty when the engine does not say.
    pub stages: Vec<StageTiming>,
}

impl PartialEq for ReduceResult {
    fn eq(&self, o: &Self) -> bool {
        // Exhaustive: a new field fails to compile here until it is compared or excluded.
        let ReduceResult {
            images,
            sum_dp,
            max_dp,
            moments,
            n_frames,
            stages: _,
        } = self;
        *images == o.images
            && *sum_dp == o.sum_dp
            && *max_dp == o.max_dp
            && *moments == o.moments
            && *n_frames == o.n_frames
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> ReduceRequest {
        ReduceRequest {
            sum_dp: true,
            ..Default::default()
        }
    }

    #[test]
    fn equality_compares_values_not_timings() {
        let a = ReduceResult {
            sum_dp: Some(vec![1, 2]),
            n_frames: 3,
            ..Default::default()
        };
        let mut b = a.clone();
        b.stages.push(StageTiming::new("kernels", 0.5));
        assert_eq!(a, b);
        b.sum_dp = Some(vec![1, 3]);
        assert_ne!(a, b);
        let mut c = a.clone();
        c.n_frames = 4;
        assert_ne!(a, c);
    }

    #[test]
    fn validation_names_what_is_wrong() {
        assert!(ReduceRequest::default().validate(4, 4).is_err());
        assert!(req().validate(4, 4).is_ok());
        let mut r = req();
        r.masks = vec![DetectorMask::Int(vec![1; 3])];
        let e = r.validate(4, 4).unwrap_err();
        assert!(e.to_string().contains("mask 0"), "{e}");
        r.masks = vec![DetectorMask::Int(vec![0, 0, MAX_INT_WEIGHT + 1, 0])];
        assert!(r
            .validate(4, 4)
            .unwrap_err()
            .to_string()
            .contains("pixel 2"));
        r.masks = vec![DetectorMask::Float(vec![0.0, f64::NAN, 0.0, 0.0])];
        assert!(r.validate(4, 4).is_err());
        let mut r = req();
        r.frames = Some(vec![0, 2, 2]);
        assert!(r.validate(4, 4).is_err());
        r.frames = Some(vec![1, 4]);
        assert!(r.validate(4, 4).is_err());
        r.frames = Some(vec![]);
        assert!(r.validate(4, 4).is_err());
        r.frames = Some(vec![0, 3]);
        assert!(r.validate(4, 4).is_ok());
        assert_eq!(r.n_selected(4), 2);
        assert!(req().validate(1, MAX_FRAME_PIXELS + 1).is_err());
    }

    #[test]
    fn support_and_binary() {
        let m = DetectorMask::Int(vec![0, 1, 0, 1]);
        assert_eq!(m.support(), vec![1, 3]);
        assert!(m.is_binary());
        assert!(!DetectorMask::Int(vec![2, 0]).is_binary());
        assert!(!DetectorMask::Float(vec![1.0, 0.0]).is_binary());
        assert_eq!(DetectorMask::Float(vec![0.0, -0.5]).support(), vec![1]);
    }
}
