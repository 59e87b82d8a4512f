//! Detector products whose arrays stay in GPU memory: [`reduce_on_device`] and the `_on_device`
//! forms of the virtual images, named detectors, sum/mean/max DP, moments and [`products`]. The
//! arrays are [`DeviceVec`]s (a range of a device allocation held by an `Arc`), for handing on
//! to other GPU code without a copy (DLPack, the CUDA Array Interface); everything else about a
//! result (bounds, disk, provenance) is as on the host path.
//!
//! Rules:
//! * only a CUDA dataset has device results: on a CPU dataset every function here is an
//!   `InvalidArgument` error naming the backend, never a host array in disguise (contract 2);
//! * the values are those of the host path, bit for bit: the same kernels run, only the
//!   download is left out (the tests compare them); the mean DP and the centre of mass are
//!   finished on the card from the exact sums (`qem_cuda::device_forms`), with the host form's
//!   `f64` operations in the host form's order;
//! * with a progress observer installed the pass is still one engine call (merging blocks would
//!   need device-side adds); it is reported as one block of every frame, and cannot be
//!   cancelled part-way.

use super::images::{moments_in, virtual_image_in};
use super::named::detector_image_in;
use super::patterns::check_frames;
use super::products::{finish, products_pass, Finished};
use super::target::{one_product, Device};
use super::{live, DetectorImage, DetectorKind, DetectorMask, DetectorParams, DiskFit, Product};
use super::{ReduceRequest, VirtualImage};
use crate::dataset::{Dataset, Storage};
use crate::dpc::CenterOfMass;
use crate::result::ResultProvenance;
use qem_core::{Error, Result};

pub use qem_cuda::{DeviceMoments, DeviceReduceResult, DeviceVec, HostVec, ResultDType};

/// The error of a device result asked of a dataset that is not on the GPU.
fn not_on_gpu(op: &str, ds: &Dataset) -> Error {
    Error::invalid(
        op,
        format!(
            "device_result=True needs a CUDA dataset; this dataset is on the {}",
            ds.backend().name().to_uppercase()
        ),
    )
    .with_expected("a dataset loaded with backend \"cuda\" (or results on the host)")
    .with_found(format!("backend \"{}\"", ds.backend().name()))
}

/// Refuse early (before a disk fit or any pass) when `ds` cannot give device results.
pub(super) fn check_on_gpu(ds: &Dataset, op: &str) -> Result<()> {
    live(ds, op)?;
    match &ds.storage {
        Storage::CudaDense(_) | Storage::CudaEncoded(_) => Ok(()),
        _ => Err(not_on_gpu(op, ds)),
    }
}

/// [`super::reduce`] with the results left on the device: one engine pass over the frames of
/// a CUDA dataset, checked against the request like the host result. A CPU dataset is an
/// `InvalidArgument` error naming its backend.
pub fn reduce_on_device(ds: &Dataset, req: &ReduceRequest) -> Result<DeviceReduceResult> {
    const OP: &str = "detector reduction (device result)";
    check_on_gpu(ds, OP)?;
    let n_frames = ds.scan_shape.len() as u64;
    let progress = crate::progress::current();
    if let Some((p, label)) = &progress {
        p.begin(label, req.n_selected(n_frames));
    }
    let result = match &ds.storage {
        Storage::CudaDense(a) => qem_cuda::reduce_dense_on_device(a, req),
        Storage::CudaEncoded(e) => qem_cuda::reduce_encoded_on_device(e, req),
        Storage::CpuDense(_) | Storage::CpuEncoded(_) => Err(not_on_gpu(OP, ds)),
        Storage::Closed => Err(Error::invalid(OP, "the dataset has been closed")),
    };
    if let Some((p, _)) = &progress {
        if result.is_ok() {
            p.advance(req.n_selected(n_frames));
        }
        p.end();
    }
    let result = result?;
    check_device_result(&result, req, n_frames, ds.detector_shape.len())?;
    Ok(result)
}

/// A device result that does not fit its request is an internal error, never an answer.
fn check_device_result(
    r: &DeviceReduceResult,
    req: &ReduceRequest,
    n_frames: u64,
    frame_len: usize,
) -> Result<()> {
    let n_sel = req.n_selected(n_frames) as usize;
    let bad = |what: &str| {
        Err(Error::internal(
            "detector reduction (device result)",
            format!("the engine returned a malformed result: {what}"),
        ))
    };
    if r.n_frames as usize != n_sel || r.images.len() != req.masks.len() {
        return bad("frames visited or number of images");
    }
    for (im, m) in r.images.iter().zip(&req.masks) {
        let dtype = match m {
            DetectorMask::Int(_) => ResultDType::U64,
            DetectorMask::Float(_) => ResultDType::F64,
        };
        if im.dtype() != dtype || im.len() != n_sel {
            return bad("an image");
        }
    }
    let ok = |v: &Option<DeviceVec>, wanted: bool, dtype: ResultDType| match v {
        Some(v) => wanted && v.len() == frame_len && v.dtype() == dtype,
        None => !wanted,
    };
    if !ok(&r.sum_dp, req.sum_dp, ResultDType::U64) || !ok(&r.max_dp, req.max_dp, ResultDType::U32)
    {
        return bad("sum_dp or max_dp");
    }
    let moments_ok = match (&r.moments, req.moments) {
        (None, false) => true,
        (Some(m), true) => [&m.sum, &m.m_row, &m.m_col]
            .iter()
            .all(|v| v.len() == n_sel && v.dtype() == ResultDType::U64),
        _ => false,
    };
    if !moments_ok {
        return bad("moments");
    }
    Ok(())
}

/// [`super::virtual_image`] on the device: `u64` for an integer mask, `f64` for a float mask,
/// one value per scan position (row-major `[R_r, R_c]`).
pub fn virtual_image_on_device(ds: &Dataset, mask: &DetectorMask) -> Result<DeviceVec> {
    virtual_image_in::<Device>(ds, mask)
}

/// [`super::sum_dp`] on the device: the exact `u64` sum per detector pixel. Always one pass
/// (the dataset's cached host sum is not uploaded: the result is the engine's own).
pub fn sum_dp_on_device(ds: &Dataset) -> Result<DeviceVec> {
    let req = ReduceRequest {
        sum_dp: true,
        ..Default::default()
    };
    one_product::<Device, _>(ds, "detector sum_dp", &req, |r| r.sum_dp, "sum")
}

/// [`super::mean_dp`] on the device: the `u64` sum DP of one pass divided by the frame count in
/// `f64`, as `f32` per pixel — the host's values bit for bit (the host cache of the sum is not
/// uploaded: the sum is the engine's own).
pub fn mean_dp_on_device(ds: &Dataset) -> Result<DeviceVec> {
    const OP: &str = "detector mean_dp";
    let req = ReduceRequest {
        sum_dp: true,
        ..Default::default()
    };
    let sum = one_product::<Device, _>(ds, OP, &req, |r| r.sum_dp, "sum")?;
    mean_on_device(&sum, ds.scan_shape.len() as u64, OP)
}

/// The mean DP of a device sum DP over `n_frames` frames (errors carry `op`).
pub(super) fn mean_on_device(sum: &DeviceVec, n_frames: u64, op: &str) -> Result<DeviceVec> {
    check_frames(n_frames, op)?;
    qem_cuda::device_forms::mean_dp(sum, n_frames).map_err(|e| e.with_op(op))
}

/// [`super::max_dp`] on the device: the `u32` maximum per detector pixel.
pub fn max_dp_on_device(ds: &Dataset) -> Result<DeviceVec> {
    let req = ReduceRequest {
        max_dp: true,
        ..Default::default()
    };
    one_product::<Device, _>(ds, "detector max_dp", &req, |r| r.max_dp, "max")
}

/// [`super::moments`] on the device: exact `u64` `sum`, `m_row`, `m_col` per scan position.
pub fn moments_on_device(ds: &Dataset) -> Result<DeviceMoments> {
    moments_in::<Device>(ds)
}

/// [`super::detector_image`] with the image left on the device: the same disk, bounds, mask
/// and provenance (plus `"result_device": "cuda:N"`), the image a `u64` [`DeviceVec`].
pub fn detector_image_on_device(
    ds: &Dataset,
    kind: DetectorKind,
    p: &DetectorParams,
) -> Result<DetectorImage<DeviceVec>> {
    detector_image_in::<Device>(ds, kind, p)
}

/// What [`products_on_device`] returns: the fields of [`super::Products`] with device arrays,
/// each `Some` (or `images` non-empty) exactly when asked.
#[derive(Debug, Clone)]
pub struct DeviceProducts {
    /// One image per requested detector kind, in the order first requested.
    pub images: Vec<DetectorImage<DeviceVec>>,
    /// Exact `u64` sum DP.
    pub sum_dp: Option<DeviceVec>,
    /// `f32` mean DP.
    pub mean_dp: Option<DeviceVec>,
    /// `u32` max DP.
    pub max_dp: Option<DeviceVec>,
    /// Exact per-frame moments.
    pub moments: Option<DeviceMoments>,
    /// Centred centre of mass (`f64` arrays).
    pub com: Option<CenterOfMass<DeviceVec>>,
    /// The BF disk, when a detector image was asked.
    pub disk: Option<DiskFit>,
    /// How it was computed (as [`super::Products`]'s, with `"result_device": "cuda:N"`).
    pub provenance: ResultProvenance,
}

/// [`super::products`] with every array left on the device: one pass for every detector image,
/// the sum DP, the max DP and the moments; the mean DP and the centre of mass finished on the
/// card from that pass's sum and moments.
pub fn products_on_device(
    ds: &Dataset,
    which: &[Product],
    p: &DetectorParams,
) -> Result<DeviceProducts> {
    const OP: &str = "detector products";
    // The device never serves the sum DP from the host cache: the result is the engine's own.
    let mut pass = products_pass::<Device>(ds, which, p, OP, None)?;
    let sum = pass.reduced.sum_dp.take();
    let Finished {
        mean_dp,
        moments,
        com,
        provenance,
    } = finish(ds, which, p, &mut pass, sum.as_ref(), OP)?;
    Ok(DeviceProducts {
        images: pass.images,
        sum_dp: sum.filter(|_| which.contains(&Product::SumDp)),
        mean_dp,
        max_dp: pass.reduced.max_dp,
        moments,
        com,
        disk: pass.g.map(|g| g.disk),
        provenance,
    })
}

/// `v · factor` as a new `f64` device result, on the card (one IEEE multiply per value): a
/// factor applied after a pass (the Python layer's calibration rescale of a device CoM).
pub fn scale_on_device(v: &DeviceVec, factor: f64) -> Result<DeviceVec> {
    qem_cuda::device_forms::scale(v, factor)
}

/// The values of a device image as the host path's [`VirtualImage`] (a download; for tests and
/// comparisons).
pub fn download_image(v: &DeviceVec) -> Result<VirtualImage> {
    match v.to_host()? {
        HostVec::U64(x) => Ok(VirtualImage::U64(x)),
        HostVec::F64(x) => Ok(VirtualImage::F64(x)),
        HostVec::U32(_) | HostVec::F32(_) => Err(Error::internal(
            "device result download",
            "an image holds neither u64 nor f64 values",
        )
        .with_expected("uint64 or float64")
        .with_found(v.dtype().numpy_name())),
    }
}
