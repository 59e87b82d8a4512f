//! Virtual images: named detectors about the fitted disk, disk/annulus/rect geometry and
//! uploaded masks on the (binned) detector, CoM and the DPC phase; then the scan `region` and
//! `scan_bin` (docs/browse.md, "Virtual images").

use super::{acquisition, body_bytes, disk, AcqRequest};
use crate::catalog::{cached, Acq};
use crate::error::{ApiError, ApiResult};
use crate::params::{check_geometry, Params, DET_BINS, SCAN_BINS};
use crate::payload::{ArrayData, ArrayOut};
use crate::state::AppState;
use crate::views::{binned_shape, crop, expand_mask, region_shape, scan_bin_mean, scan_bin_sum};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::response::Response;
use qem::detector::{annulus_mask, DetectorKind, DetectorMask, VirtualImage};
use qem::{Dataset, Region, Shape2};
use std::str::FromStr;
use std::sync::Arc;

/// What a virtual image is made from.
#[derive(Debug, Clone)]
enum Source {
    /// A named detector; `center`/`radius` override the fitted disk (viewed pixels).
    Named {
        kind: DetectorKind,
        center: (Option<f64>, Option<f64>),
        radius: Option<f64>,
    },
    Annulus {
        center: (f64, f64),
        inner: f64,
        outer: f64,
    },
    Rect {
        r0: f64,
        r1: f64,
        c0: f64,
        c1: f64,
    },
    /// A mask of the viewed detector, non-zero = in.
    Mask(Vec<u8>),
    ComRow,
    ComCol,
    ComMag,
    DpcPhase,
}

/// Checked geometry of `mode`, in pixels of the detector viewed at `b`.
fn source(p: &Params, det: Shape2, b: usize) -> ApiResult<Source> {
    let (vr, vc) = binned_shape(det.rows, det.cols, b);
    let g = |k: &str| -> ApiResult<Option<f64>> {
        p.f64_opt(k)?
            .map(|v| check_geometry(k, v, vr, vc))
            .transpose()
    };
    let req = |k: &str| -> ApiResult<f64> {
        g(k)?.ok_or_else(|| ApiError::bad_request(format!("missing parameter {k}")))
    };
    let nonneg = |k: &str, v: f64| -> ApiResult<f64> {
        if v >= 0.0 {
            Ok(v)
        } else {
            Err(ApiError::bad_request(format!(
                "{k}={v}: expected a value >= 0"
            )))
        }
    };
    let mode = p
        .str("mode")
        .ok_or_else(|| ApiError::bad_request("missing parameter mode"))?;
    Ok(match mode {
        "bf" | "abf" | "adf" | "haadf" | "df" => Source::Named {
            kind: DetectorKind::from_str(mode)?,
            center: (g("cr")?, g("cc")?),
            radius: g("radius")?.map(|r| nonneg("radius", r)).transpose()?,
        },
        "disk" => Source::Annulus {
            center: (req("cr")?, req("cc")?),
            inner: 0.0,
            outer: nonneg("radius", req("radius")?)?,
        },
        "annulus" => {
            let (inner, outer) = (
                nonneg("inner", req("inner")?)?,
                nonneg("outer", req("outer")?)?,
            );
            if inner > outer {
                return Err(ApiError::bad_request(format!(
                    "inner={inner} > outer={outer}"
                )));
            }
            Source::Annulus {
                center: (req("cr")?, req("cc")?),
                inner,
                outer,
            }
        }
        "rect" => Source::Rect {
            r0: req("r0")?,
            r1: req("r1")?,
            c0: req("c0")?,
            c1: req("c1")?,
        },
        "com_row" => Source::ComRow,
        "com_col" => Source::ComCol,
        "com_mag" => Source::ComMag,
        "dpc_phase" => Source::DpcPhase,
        o => {
            return Err(ApiError::bad_request(format!(
                "mode={o}: expected bf, abf, adf, haadf, df, disk, annulus, rect, com_row, \
                 com_col, com_mag or dpc_phase"
            )))
        }
    })
}

/// The 0/1 mask of the viewed detector (`vr × vc`) a pixel centre at a time.
fn viewed_mask(ds: &Dataset, acq: &Acq, src: &Source, b: usize) -> ApiResult<Vec<u32>> {
    let det = ds.detector_shape();
    let (vr, vc) = binned_shape(det.rows, det.cols, b);
    let viewed = Shape2::new(vr, vc);
    Ok(match src {
        Source::Named {
            kind,
            center,
            radius,
        } => {
            // The fitted disk in viewed pixels: original pixel x sits at (x − (b−1)/2)/b.
            let d = disk(ds, acq)?;
            let half = (b as f64 - 1.0) / 2.0;
            let cr = center.0.unwrap_or((d.center_px.0 - half) / b as f64);
            let cc = center.1.unwrap_or((d.center_px.1 - half) / b as f64);
            let r = radius.unwrap_or(d.radius_px / b as f64);
            let (lo, hi) = kind
                .default_bounds(r)
                .ok_or_else(|| ApiError::internal("a named detector has no default bounds"))?;
            annulus_mask(viewed, (cr, cc), lo, hi)
        }
        Source::Annulus {
            center,
            inner,
            outer,
        } => annulus_mask(viewed, *center, *inner, *outer),
        Source::Rect { r0, r1, c0, c1 } => {
            let mut m = Vec::with_capacity(vr * vc);
            for i in 0..vr {
                for j in 0..vc {
                    let (x, y) = (i as f64, j as f64);
                    m.push(u32::from(*r0 <= x && x < *r1 && *c0 <= y && y < *c1));
                }
            }
            m
        }
        Source::Mask(bytes) => bytes.iter().map(|&v| u32::from(v != 0)).collect(),
        _ => return Err(ApiError::internal("not a mask mode")),
    })
}

/// The full-scan image of `src` (integer or float) and the detector bin it was computed at.
fn full_image(ds: &Dataset, acq: &Acq, src: &Source, b: usize) -> ApiResult<(ImageData, usize)> {
    let com = || {
        cached(&acq.cache.com, || {
            let c = qem::dpc::center_of_mass(ds, true)?;
            let f = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
            Ok((f(&c.com_row), f(&c.com_col)))
        })
    };
    Ok(match src {
        Source::ComRow => (ImageData::F32(com()?.0.clone()), 1),
        Source::ComCol => (ImageData::F32(com()?.1.clone()), 1),
        Source::ComMag => {
            let (r, c) = com()?;
            let m = r
                .iter()
                .zip(c)
                .map(|(&a, &b)| (f64::from(a).hypot(f64::from(b))) as f32);
            (ImageData::F32(m.collect()), 1)
        }
        Source::DpcPhase => {
            let ph = cached(&acq.cache.dpc_phase, || {
                let r = qem::dpc::run(ds, &qem::dpc::DpcParams::default())?;
                Ok(r.phase.iter().map(|&x| x as f32).collect())
            })?;
            (ImageData::F32(ph.clone()), 1)
        }
        _ => {
            let det = ds.detector_shape();
            let viewed = viewed_mask(ds, acq, src, b)?;
            let mask = if b == 1 {
                viewed
            } else {
                expand_mask(&viewed, det.rows, det.cols, b)
            };
            match qem::detector::virtual_image(ds, &DetectorMask::Int(mask))? {
                VirtualImage::U64(v) => (ImageData::U64(v), b),
                VirtualImage::F64(_) => {
                    return Err(ApiError::internal("an integer mask gave a float image"))
                }
            }
        }
    })
}

enum ImageData {
    U64(Vec<u64>),
    F32(Vec<f32>),
}

/// Crop to `region`, then bin the scan by `s`: the answer.
fn finish(img: ImageData, scan: Shape2, region: Option<Region>, s: usize) -> ArrayOut {
    let (rows, cols) = region.map_or((scan.rows, scan.cols), |r| region_shape(&r));
    match img {
        ImageData::U64(v) => {
            let v = region.map_or(v.clone(), |r| crop(&v, scan.cols, &r));
            let (v, rb, cb) = scan_bin_sum(&v, rows, cols, s);
            ArrayOut::new(ArrayData::U64(v), vec![rb, cb])
        }
        ImageData::F32(v) => {
            let v = region.map_or(v.clone(), |r| crop(&v, scan.cols, &r));
            let (v, rb, cb) = scan_bin_mean(&v, rows, cols, s);
            ArrayOut::new(ArrayData::F32(v), vec![rb, cb])
        }
    }
}

async fn run(
    st: Arc<AppState>,
    id: String,
    p: Params,
    body: Option<Vec<u8>>,
) -> ApiResult<Response> {
    let (b, s, npy) = (
        p.bin("det_bin", &DET_BINS)?,
        p.bin("scan_bin", &SCAN_BINS)?,
        p.npy()?,
    );
    let acq = acquisition(&st, &id).await?;
    let name = body.as_ref().map_or_else(
        || p.str("mode").unwrap_or("virtual").to_string(),
        |_| "mask".into(),
    );
    let (mut out, ms) = st
        .engine(&acq, move |ds, acq| {
            let det = ds.detector_shape();
            let scan = ds.scan_shape();
            let region = p.region(scan.rows, scan.cols)?;
            let src = match body {
                Some(m) => {
                    let (vr, vc) = binned_shape(det.rows, det.cols, b);
                    if m.len() != vr * vc {
                        return Err(ApiError::bad_request(format!(
                            "the mask has {} bytes; the detector viewed at det_bin={b} is \
                             {vr} x {vc} = {} pixels",
                            m.len(),
                            vr * vc
                        )));
                    }
                    Source::Mask(m)
                }
                None => source(&p, det, b)?,
            };
            let (rows, cols) = region.map_or((scan.rows, scan.cols), |r| region_shape(&r));
            if rows < s || cols < s {
                return Err(ApiError::bad_request(format!(
                    "scan_bin={s} leaves no whole block of the {rows} x {cols} scan"
                )));
            }
            let (img, used_b) = full_image(ds, acq, &src, b)?;
            let mut out = finish(img, scan, region, s);
            out.det_bin = Some(used_b);
            Ok(out)
        })
        .await?;
    out.scan_bin = Some(s);
    out.elapsed_ms = ms;
    out.respond(npy, &name)
}

/// `GET …/{id}/virtual?mode=…&det_bin=&scan_bin=&region=`.
pub(crate) async fn virtual_image(AcqRequest { st, id, p }: AcqRequest) -> ApiResult<Response> {
    run(st, id, p, None).await
}

/// `POST …/{id}/virtual-mask?det_bin=&scan_bin=` with a `uint8` mask body.
pub(crate) async fn virtual_mask(
    AcqRequest { st, id, p }: AcqRequest,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let body = body_bytes(body)?;
    run(st, id, p, Some(body.to_vec())).await
}
