//! The CPU reference of the one-pass detector reduction ([`ReduceRequest`] → [`ReduceResult`]):
//! virtual images from integer or float masks, the sum and max diffraction patterns and the
//! per-frame moments, all from one visit of each frame.
//!
//! This is the specification the CUDA kernels are checked against, so it is written plainly:
//!
//! * the selected frames (all, or `req.frames`) are cut into blocks of [`BLOCK_FRAMES`]
//!   consecutive selected frames; rayon hands blocks to threads;
//! * each thread folds its blocks into one partial result: per-frame outputs (images, moments)
//!   are kept per block, the sum DP and max DP are accumulated per thread and merged across
//!   threads at the end (addition and maximum, so the merge order cannot change a value);
//! * a frame is read once: a dense frame in place, an ENCODED frame decoded once into a
//!   per-thread scratch frame, and every requested reduction reads that one frame;
//! * a mask reads only its non-zero pixels ([`DetectorMask::support`], computed once per
//!   request), in ascending pixel order; the moments read the whole frame.
//!
//! Integer results are exact `u64` (the bounds in `qem_core::reduce` guarantee no wrap). A float
//! mask's image is `Σ_k w[k] · I[k]` in `f64`, added in ascending pixel order within a frame.

use crate::encoded::EncodedFrames;
use qem_core::{
    DenseArray, DetectorMask, Error, Moments, ReduceRequest, ReduceResult, Result, Shape2,
    VirtualImage,
};
use rayon::prelude::*;

/// Consecutive selected frames one rayon task reduces: large enough that the per-block
/// bookkeeping is negligible, small enough that blocks balance over threads.
pub const BLOCK_FRAMES: usize = 64;

/// Run `req` over a dense `[n_frames, detector.rows, detector.cols]` array (`u8`, `u16` or
/// `u32`), in parallel over frames.
///
/// The detector shape (not only its pixel count) is needed because the moments weight each
/// pixel by its row and column index.
pub fn reduce_dense(
    data: &DenseArray,
    n_frames: usize,
    detector: Shape2,
    req: &ReduceRequest,
) -> Result<ReduceResult> {
    let frame_len = detector.len();
    req.validate(n_frames as u64, frame_len)?;
    if data.len() != n_frames * frame_len {
        return Err(Error::internal(
            "detector reduction (CPU, dense)",
            "the array does not hold the frames it is said to hold",
        )
        .with_expected(format!(
            "{n_frames} frames x {frame_len} pixels = {} values",
            n_frames * frame_len
        ))
        .with_found(format!("{} values", data.len())));
    }
    match data {
        DenseArray::U8(v) => run(&Dense { data: v, frame_len }, n_frames, detector, req),
        DenseArray::U16(v) => run(&Dense { data: v, frame_len }, n_frames, detector, req),
        DenseArray::U32(v) => run(&Dense { data: v, frame_len }, n_frames, detector, req),
    }
}

/// Run `req` over ENCODED frames: each visited frame is decoded once (into a per-thread
/// scratch frame) and feeds every requested reduction. A corrupt stream is a `Decode` error
/// naming the frame (and the `.qem` file, when the frames came from one).
pub fn reduce_encoded(enc: &EncodedFrames, req: &ReduceRequest) -> Result<ReduceResult> {
    let detector = enc.frame_shape();
    req.validate(enc.n_frames() as u64, detector.len())?;
    run(&Encoded(enc), enc.n_frames(), detector, req)
}

/// Somewhere frames can be read from, one at a time.
trait FrameSource: Sync {
    /// Element type of a frame (`u8`, `u16`, `u32`; widened to `u64` for sums).
    type Elem: Copy + Default + Send + Sync + Into<u32>;
    /// Frame `n`; `scratch` is a per-thread buffer a source may decode into.
    fn frame<'a>(&'a self, n: usize, scratch: &'a mut Vec<Self::Elem>) -> Result<&'a [Self::Elem]>;
}

struct Dense<'d, T> {
    data: &'d [T],
    frame_len: usize,
}

impl<T: Copy + Default + Send + Sync + Into<u32>> FrameSource for Dense<'_, T> {
    type Elem = T;
    fn frame<'a>(&'a self, n: usize, _scratch: &'a mut Vec<T>) -> Result<&'a [T]> {
        let start = n * self.frame_len;
        self.data.get(start..start + self.frame_len).ok_or_else(|| {
            Error::internal("detector reduction (CPU, dense)", "frame outside the array")
                .with_frame(n as u64)
        })
    }
}

struct Encoded<'e>(&'e EncodedFrames);

impl FrameSource for Encoded<'_> {
    type Elem = u16;
    fn frame<'a>(&'a self, n: usize, scratch: &'a mut Vec<u16>) -> Result<&'a [u16]> {
        scratch.resize(self.0.frame_shape().len(), 0);
        self.0
            .decode_frame(n, scratch)
            .map_err(|e| e.with_op("detector reduction (CPU, encoded): decode"))?;
        Ok(scratch)
    }
}

/// A mask reduced to the pixels it reads: `(pixel index, weight)`, pixels ascending.
enum MaskPlan {
    Int(Vec<(usize, u64)>),
    Float(Vec<(usize, f64)>),
}

impl MaskPlan {
    fn new(m: &DetectorMask) -> MaskPlan {
        let support = m.support();
        match m {
            DetectorMask::Int(w) => MaskPlan::Int(
                support
                    .iter()
                    .map(|&i| (i as usize, u64::from(w[i as usize])))
                    .collect(),
            ),
            DetectorMask::Float(w) => MaskPlan::Float(
                support
                    .iter()
                    .map(|&i| (i as usize, w[i as usize]))
                    .collect(),
            ),
        }
    }
}

/// One block's per-frame outputs, one value per frame of the block.
#[derive(Default)]
struct BlockOut {
    /// The block's position in the selection.
    index: usize,
    /// Per mask (request order), one value per frame; only the variant of the mask is used.
    int_images: Vec<Vec<u64>>,
    float_images: Vec<Vec<f64>>,
    moments: Moments,
}

/// One thread's partial result.
struct Partial<E> {
    /// Empty until the first frame when requested (so that an identity element costs nothing).
    sum_dp: Vec<u64>,
    max_dp: Vec<u32>,
    blocks: Vec<BlockOut>,
    scratch: Vec<E>,
}

impl<E> Partial<E> {
    fn empty() -> Self {
        Partial {
            sum_dp: Vec::new(),
            max_dp: Vec::new(),
            blocks: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Combine two threads' partial results: sums add, maxima take the larger value, blocks
    /// are concatenated (their order is restored from `BlockOut::index` at the end).
    fn merge(mut self, mut other: Self) -> Self {
        if self.sum_dp.is_empty() {
            self.sum_dp = std::mem::take(&mut other.sum_dp);
        } else if !other.sum_dp.is_empty() {
            for (a, b) in self.sum_dp.iter_mut().zip(&other.sum_dp) {
                *a += b;
            }
        }
        if self.max_dp.is_empty() {
            self.max_dp = std::mem::take(&mut other.max_dp);
        } else if !other.max_dp.is_empty() {
            for (a, b) in self.max_dp.iter_mut().zip(&other.max_dp) {
                *a = (*a).max(*b);
            }
        }
        self.blocks.append(&mut other.blocks);
        self
    }
}

fn run<S: FrameSource>(
    src: &S,
    n_frames: usize,
    detector: Shape2,
    req: &ReduceRequest,
) -> Result<ReduceResult> {
    let frame_len = detector.len();
    let masks: Vec<MaskPlan> = req.masks.iter().map(MaskPlan::new).collect();
    let selected: Vec<usize> = match &req.frames {
        Some(f) => f.iter().map(|&n| n as usize).collect(),
        None => (0..n_frames).collect(),
    };
    let partial = selected
        .par_chunks(BLOCK_FRAMES)
        .enumerate()
        .try_fold(Partial::empty, |mut p, (index, frames)| {
            let block = reduce_block(src, &mut p, detector, req, &masks, index, frames)?;
            p.blocks.push(block);
            Ok::<_, Error>(p)
        })
        .try_reduce(Partial::empty, |a, b| Ok(a.merge(b)))?;
    let Partial {
        mut sum_dp,
        mut max_dp,
        mut blocks,
        ..
    } = partial;
    blocks.sort_by_key(|b| b.index);

    let n_sel = selected.len();
    let images = masks
        .iter()
        .enumerate()
        .map(|(m, plan)| match plan {
            MaskPlan::Int(_) => {
                let mut v = Vec::with_capacity(n_sel);
                for b in &blocks {
                    v.extend_from_slice(&b.int_images[m]);
                }
                VirtualImage::U64(v)
            }
            MaskPlan::Float(_) => {
                let mut v = Vec::with_capacity(n_sel);
                for b in &blocks {
                    v.extend_from_slice(&b.float_images[m]);
                }
                VirtualImage::F64(v)
            }
        })
        .collect();
    let moments = req.moments.then(|| {
        let mut m = Moments {
            sum: Vec::with_capacity(n_sel),
            m_row: Vec::with_capacity(n_sel),
            m_col: Vec::with_capacity(n_sel),
        };
        for b in &blocks {
            m.sum.extend_from_slice(&b.moments.sum);
            m.m_row.extend_from_slice(&b.moments.m_row);
            m.m_col.extend_from_slice(&b.moments.m_col);
        }
        m
    });
    // No frame visited (an empty scan): the sums are zero; so is the max, by convention.
    if req.sum_dp && sum_dp.is_empty() {
        sum_dp = vec![0; frame_len];
    }
    if req.max_dp && max_dp.is_empty() {
        max_dp = vec![0; frame_len];
    }
    Ok(ReduceResult {
        images,
        sum_dp: req.sum_dp.then_some(sum_dp),
        max_dp: req.max_dp.then_some(max_dp),
        moments,
        n_frames: n_sel as u64,
        stages: Vec::new(),
    })
}

/// One image buffer per mask: room for `n_frames` values where the mask is integer (`int`) or
/// float (`!int`) as asked, empty for the masks of the other kind.
fn images_of_kind<T>(masks: &[MaskPlan], int: bool, n_frames: usize) -> Vec<Vec<T>> {
    masks
        .iter()
        .map(|m| {
            if matches!(m, MaskPlan::Int(_)) == int {
                Vec::with_capacity(n_frames)
            } else {
                Vec::new()
            }
        })
        .collect()
}

/// Reduce the frames of one block (flat frame indices `frames`) into `p` (sum/max DP) and the
/// returned per-frame outputs.
fn reduce_block<S: FrameSource>(
    src: &S,
    p: &mut Partial<S::Elem>,
    detector: Shape2,
    req: &ReduceRequest,
    masks: &[MaskPlan],
    index: usize,
    frames: &[usize],
) -> Result<BlockOut> {
    let frame_len = detector.len();
    if req.sum_dp && p.sum_dp.is_empty() {
        p.sum_dp = vec![0; frame_len];
    }
    if req.max_dp && p.max_dp.is_empty() {
        p.max_dp = vec![0; frame_len];
    }
    let mut out = BlockOut {
        index,
        int_images: images_of_kind(masks, true, frames.len()),
        float_images: images_of_kind(masks, false, frames.len()),
        moments: Moments::default(),
    };
    let mut scratch = std::mem::take(&mut p.scratch);
    for &n in frames {
        let frame = src.frame(n, &mut scratch)?;
        for (m, plan) in masks.iter().enumerate() {
            match plan {
                MaskPlan::Int(px) => {
                    let mut acc = 0u64;
                    for &(i, w) in px {
                        acc += w * u64::from(frame[i].into());
                    }
                    out.int_images[m].push(acc);
                }
                MaskPlan::Float(px) => {
                    let mut acc = 0.0f64;
                    for &(i, w) in px {
                        acc += w * f64::from(frame[i].into());
                    }
                    out.float_images[m].push(acc);
                }
            }
        }
        if req.sum_dp {
            for (s, &x) in p.sum_dp.iter_mut().zip(frame) {
                *s += u64::from(x.into());
            }
        }
        if req.max_dp {
            for (m, &x) in p.max_dp.iter_mut().zip(frame) {
                *m = (*m).max(x.into());
            }
        }
        if req.moments {
            let (mut s, mut mr, mut mc) = (0u64, 0u64, 0u64);
            for (row, pixels) in frame.chunks_exact(detector.cols.max(1)).enumerate() {
                let mut row_sum = 0u64;
                for (col, &x) in pixels.iter().enumerate() {
                    let v = u64::from(x.into());
                    row_sum += v;
                    mc += col as u64 * v;
                }
                s += row_sum;
                mr += row as u64 * row_sum;
            }
            out.moments.sum.push(s);
            out.moments.m_row.push(mr);
            out.moments.m_col.push(mc);
        }
    }
    p.scratch = scratch;
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::encoded::fit_model;

    /// Deterministic counts with zeros, small values and a few large ones.
    fn counts(n: usize, top: u32) -> Vec<u32> {
        (0..n as u64)
            .map(|i| {
                let x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                match x % 10 {
                    0..=4 => 0,
                    5..=8 => (x % 13) as u32,
                    _ => top - (x % 97) as u32,
                }
            })
            .collect()
    }

    /// Integer image, float image, sum DP, max DP, moments.
    type Expected = (Vec<u64>, Vec<f64>, Vec<u64>, Vec<u32>, [Vec<u64>; 3]);

    /// Naive reference: every pixel of every selected frame, in the plainest loops.
    fn naive(
        data: &[u32],
        det: Shape2,
        frames: &[usize],
        mask_i: &[u32],
        mask_f: &[f64],
    ) -> Expected {
        let len = det.len();
        let (mut vi, mut vf) = (Vec::new(), Vec::new());
        let mut sum = vec![0u64; len];
        let mut max = vec![0u32; len];
        let mut mom = [Vec::new(), Vec::new(), Vec::new()];
        for &n in frames {
            let f = &data[n * len..(n + 1) * len];
            let (mut a, mut b) = (0u64, 0f64);
            let (mut s, mut mr, mut mc) = (0u64, 0u64, 0u64);
            for r in 0..det.rows {
                for c in 0..det.cols {
                    let k = r * det.cols + c;
                    a += mask_i[k] as u64 * f[k] as u64;
                    b += mask_f[k] * f[k] as f64;
                    sum[k] += f[k] as u64;
                    max[k] = max[k].max(f[k]);
                    s += f[k] as u64;
                    mr += r as u64 * f[k] as u64;
                    mc += c as u64 * f[k] as u64;
                }
            }
            vi.push(a);
            vf.push(b);
            mom[0].push(s);
            mom[1].push(mr);
            mom[2].push(mc);
        }
        (vi, vf, sum, max, mom)
    }

    fn full_request(det: Shape2, frames: Option<Vec<u64>>) -> (ReduceRequest, Vec<u32>, Vec<f64>) {
        let mask_i: Vec<u32> = (0..det.len()).map(|k| ((k * 7) % 5) as u32).collect();
        let mask_f: Vec<f64> = (0..det.len())
            .map(|k| {
                if k % 3 == 0 {
                    0.0
                } else {
                    (k as f64).sin() * 2.5
                }
            })
            .collect();
        let req = ReduceRequest {
            masks: vec![
                DetectorMask::Int(mask_i.clone()),
                DetectorMask::Float(mask_f.clone()),
            ],
            sum_dp: true,
            max_dp: true,
            moments: true,
            frames,
        };
        (req, mask_i, mask_f)
    }

    fn check(got: &ReduceResult, want: &Expected) {
        assert_eq!(got.images[0], VirtualImage::U64(want.0.clone()));
        let VirtualImage::F64(f) = &got.images[1] else {
            panic!("float image expected")
        };
        let num: f64 = f.iter().zip(&want.1).map(|(a, b)| (a - b).powi(2)).sum();
        let den: f64 = want.1.iter().map(|b| b * b).sum();
        assert!(num.sqrt() <= 1e-12 * den.sqrt().max(1e-300), "{num} {den}");
        assert_eq!(got.sum_dp.as_ref(), Some(&want.2));
        assert_eq!(got.max_dp.as_ref(), Some(&want.3));
        let m = got.moments.as_ref().unwrap();
        assert_eq!(m.sum, want.4[0]);
        assert_eq!(m.m_row, want.4[1]);
        assert_eq!(m.m_col, want.4[2]);
    }

    #[test]
    fn dense_all_dtypes_match_naive_loops() {
        // 150 frames: more than two blocks, the last one partial; odd detector.
        let det = Shape2::new(13, 11);
        let n = 150;
        // Four threads whatever the machine, so that per-thread partial sums and maxima are
        // really merged.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap();
        pool.install(|| dense_all_dtypes(det, n));
    }

    fn dense_all_dtypes(det: Shape2, n: usize) {
        for top in [255u32, 65535, u32::MAX] {
            let data = counts(n * det.len(), top);
            let arr = match top {
                255 => DenseArray::U8(data.iter().map(|&v| v as u8).collect()),
                65535 => DenseArray::U16(data.iter().map(|&v| v as u16).collect()),
                _ => DenseArray::U32(data.clone()),
            };
            let (req, mi, mf) = full_request(det, None);
            let all: Vec<usize> = (0..n).collect();
            let got = reduce_dense(&arr, n, det, &req).unwrap();
            assert_eq!(got.n_frames, n as u64);
            check(&got, &naive(&data, det, &all, &mi, &mf));
            let sel = vec![0u64, 3, 64, 65, 149];
            let (req, ..) = full_request(det, Some(sel.clone()));
            let got = reduce_dense(&arr, n, det, &req).unwrap();
            let sel: Vec<usize> = sel.iter().map(|&s| s as usize).collect();
            assert_eq!(got.n_frames, 5);
            check(&got, &naive(&data, det, &sel, &mi, &mf));
        }
    }

    #[test]
    fn encoded_equals_dense() {
        let det = Shape2::new(9, 14);
        let n = 70;
        let data = counts(n * det.len(), 65535);
        let d16: Vec<u16> = data.iter().map(|&v| v as u16).collect();
        let model = fit_model(d16.chunks_exact(det.len()), det.len()).unwrap();
        let enc = EncodedFrames::encode(model, det, &d16).unwrap();
        for frames in [None, Some(vec![1u64, 2, 69])] {
            let (req, ..) = full_request(det, frames);
            let a = reduce_encoded(&enc, &req).unwrap();
            let b = reduce_dense(&DenseArray::U16(d16.clone()), n, det, &req).unwrap();
            assert_eq!(a, b);
        }
    }

    #[test]
    fn bad_requests_and_sizes_are_errors() {
        let det = Shape2::new(4, 4);
        let arr = DenseArray::U16(vec![1; 3 * 16]);
        let req = ReduceRequest {
            masks: vec![DetectorMask::Int(vec![1; 15])],
            ..Default::default()
        };
        let e = reduce_dense(&arr, 3, det, &req).unwrap_err();
        assert_eq!(e.expected.as_deref(), Some("16 weights"), "{e}");
        let req = ReduceRequest {
            sum_dp: true,
            ..Default::default()
        };
        assert!(reduce_dense(&arr, 4, det, &req).is_err());
        let ok = reduce_dense(&arr, 3, det, &req).unwrap();
        assert_eq!(ok.sum_dp, Some(vec![3; 16]));
        assert!(ok.max_dp.is_none() && ok.moments.is_none() && ok.images.is_empty());
    }

    #[test]
    fn corrupt_encoded_frame_is_a_decode_error() {
        let det = Shape2::new(6, 6);
        let d16: Vec<u16> = counts(5 * det.len(), 65535)
            .iter()
            .map(|&v| v as u16)
            .collect();
        let model = fit_model(d16.chunks_exact(det.len()), det.len()).unwrap();
        let e = EncodedFrames::encode(model, det, &d16).unwrap();
        let mut streams = e.streams().to_vec();
        let at = e.index()[3].offset as usize + 16;
        streams[at..at + 4].copy_from_slice(&1u32.to_le_bytes());
        let bad =
            EncodedFrames::from_parts(e.model().clone(), det, e.index().to_vec(), streams).unwrap();
        let req = ReduceRequest {
            moments: true,
            ..Default::default()
        };
        let err = reduce_encoded(&bad, &req).unwrap_err();
        assert_eq!(err.kind, qem_core::ErrorKind::Decode);
        assert_eq!(err.frame, Some(3));
    }
}
