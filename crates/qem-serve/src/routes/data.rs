//! Data views: the diffraction pattern over the scan (`dp`), one frame (`frame`) and the pattern
//! of a scan rectangle (`roi-dp`), each at a detector bin (exact block sums, block maxima for
//! `max`).

use super::{acquisition, AcqRequest};
use crate::catalog::cached;
use crate::error::{ApiError, ApiResult};
use crate::params::{rect, Reduce, DET_BINS};
use crate::payload::{ArrayData, ArrayOut};
use crate::views::{bin_max, bin_sum, binned_shape};
use axum::response::Response;
use qem::detector::ScanRoi;
use qem::DenseArray;

/// A pattern (sum or max) at `b`: the answer's data and shape.
fn pattern(sum_or_max: Pattern<'_>, rows: usize, cols: usize, b: usize) -> (ArrayData, Vec<usize>) {
    let (rb, cb) = binned_shape(rows, cols, b);
    let data = match sum_or_max {
        Pattern::Sum(s) if b == 1 => ArrayData::U64(s.to_vec()),
        Pattern::Sum(s) => ArrayData::U64(bin_sum(s, rows, cols, b)),
        Pattern::Max(m) if b == 1 => ArrayData::U32(m.to_vec()),
        Pattern::Max(m) => ArrayData::U32(bin_max(m, rows, cols, b)),
    };
    (data, vec![rb, cb])
}

enum Pattern<'a> {
    Sum(&'a [u64]),
    Max(&'a [u32]),
}

/// `GET …/{id}/dp?reduce=sum|mean|max&det_bin=`.
pub(crate) async fn dp(AcqRequest { st, id, p }: AcqRequest) -> ApiResult<Response> {
    let (reduce, b, npy) = (p.reduce()?, p.bin("det_bin", &DET_BINS)?, p.npy()?);
    let acq = acquisition(&st, &id).await?;
    let (mut out, ms) = st
        .engine(&acq, move |ds, acq| {
            let det = ds.detector_shape();
            let (data, shape) = match reduce {
                Reduce::Sum | Reduce::Mean => {
                    let s = cached(&acq.cache.sum_dp, || Ok(qem::detector::sum_dp(ds)?))?;
                    pattern(Pattern::Sum(s), det.rows, det.cols, b)
                }
                Reduce::Max => {
                    let m = cached(&acq.cache.max_dp, || Ok(qem::detector::max_dp(ds)?))?;
                    pattern(Pattern::Max(m), det.rows, det.cols, b)
                }
            };
            let mut out = ArrayOut::new(data, shape);
            if reduce == Reduce::Mean {
                out.divisor = Some(ds.scan_shape().len() as u64);
            }
            Ok(out)
        })
        .await?;
    out.det_bin = Some(b);
    out.elapsed_ms = ms;
    out.respond(npy, &format!("dp_{}", reduce_name(reduce)))
}

fn reduce_name(r: Reduce) -> &'static str {
    match r {
        Reduce::Sum => "sum",
        Reduce::Mean => "mean",
        Reduce::Max => "max",
    }
}

/// `GET …/{id}/frame?r=&c=&det_bin=`.
pub(crate) async fn frame(AcqRequest { st, id, p }: AcqRequest) -> ApiResult<Response> {
    let (r, c) = (p.usize("r")?, p.usize("c")?);
    let (b, npy) = (p.bin("det_bin", &DET_BINS)?, p.npy()?);
    let acq = acquisition(&st, &id).await?;
    let (mut out, ms) = st
        .engine(&acq, move |ds, _| {
            let det = ds.detector_shape();
            let f = qem::detector::frames(ds, &[(r, c)])?;
            let (rb, cb) = binned_shape(det.rows, det.cols, b);
            let narrow = |v: Vec<u64>| -> ApiResult<ArrayData> {
                // At most 64 pixels of u16 per block: always fits u32 (checked, not assumed).
                v.into_iter()
                    .map(|x| {
                        u32::try_from(x)
                            .map_err(|_| ApiError::internal("a u32 block sum overflowed"))
                    })
                    .collect::<ApiResult<Vec<u32>>>()
                    .map(ArrayData::U32)
            };
            let data = match (f, b) {
                (DenseArray::U8(v), 1) => ArrayData::U8(v),
                (DenseArray::U16(v), 1) => ArrayData::U16(v),
                (DenseArray::U32(v), 1) => ArrayData::U32(v),
                (DenseArray::U8(v), _) => narrow(bin_sum(&v, det.rows, det.cols, b))?,
                (DenseArray::U16(v), _) => narrow(bin_sum(&v, det.rows, det.cols, b))?,
                (DenseArray::U32(v), _) => ArrayData::U64(bin_sum(&v, det.rows, det.cols, b)),
            };
            Ok(ArrayOut::new(data, vec![rb, cb]))
        })
        .await?;
    out.det_bin = Some(b);
    out.elapsed_ms = ms;
    out.respond(npy, &format!("frame_{r}_{c}"))
}

/// `GET …/{id}/roi-dp?r0=&r1=&c0=&c1=&reduce=&det_bin=`.
pub(crate) async fn roi_dp(AcqRequest { st, id, p }: AcqRequest) -> ApiResult<Response> {
    let (r0, r1, c0, c1) = (
        p.usize("r0")?,
        p.usize("r1")?,
        p.usize("c0")?,
        p.usize("c1")?,
    );
    let (reduce, b, npy) = (p.reduce()?, p.bin("det_bin", &DET_BINS)?, p.npy()?);
    let acq = acquisition(&st, &id).await?;
    let (mut out, ms) = st
        .engine(&acq, move |ds, _| {
            let scan = ds.scan_shape();
            let det = ds.detector_shape();
            let region = rect(r0, r1, c0, c1, scan.rows, scan.cols, "scan ROI")?;
            let roi = qem::detector::roi_dp(ds, &ScanRoi::Rect(region))?;
            let (data, shape) = match reduce {
                Reduce::Max => pattern(Pattern::Max(&roi.max), det.rows, det.cols, b),
                _ => pattern(Pattern::Sum(&roi.sum), det.rows, det.cols, b),
            };
            let mut out = ArrayOut::new(data, shape);
            if reduce == Reduce::Mean {
                out.divisor = Some(roi.n_frames);
            }
            Ok(out)
        })
        .await?;
    out.det_bin = Some(b);
    out.elapsed_ms = ms;
    out.respond(npy, &format!("roi_dp_{}", reduce_name(reduce)))
}
