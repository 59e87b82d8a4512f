//! Where a detector operation leaves its arrays, and the one engine call that differs between
//! the two places: [`Host`] runs [`reduce`] (arrays in host memory), [`Device`] runs
//! [`reduce_on_device`] (arrays left in GPU memory, CUDA datasets only). The operations that
//! have both forms (virtual images, moments, named detectors, products) are written once,
//! generic over [`Target`], so the two forms share their request, disk fit, masks, checks and
//! provenance. The centre of mass ([`crate::dpc::center_of_mass`], the `com` of `products`)
//! is too: [`Target::com`] is the arithmetic on the moments, on the host or on the card.

use super::device::{check_on_gpu, mean_on_device, reduce_on_device, DeviceMoments, DeviceVec};
use super::patterns::mean_from_sum;
use super::{live, reduce, Moments, ReduceRequest, VirtualImage};
use crate::dataset::Dataset;
use crate::result::ResultProvenance;
use qem_core::{Error, Result, StageTiming};
use serde_json::json;

/// The arrays of one engine pass, in the target's types; a field is `Some` (or `images`
/// non-empty) exactly when requested.
pub(crate) struct Reduced<T: Target> {
    pub(crate) images: Vec<T::Image>,
    pub(crate) sum_dp: Option<T::SumDp>,
    pub(crate) max_dp: Option<T::MaxDp>,
    pub(crate) moments: Option<T::Moments>,
    pub(crate) stages: Vec<StageTiming>,
}

/// An engine result ([`super::ReduceResult`] or [`super::DeviceReduceResult`], whose fields
/// have the same names) as a [`Reduced`].
macro_rules! reduced {
    ($r:expr) => {
        Reduced {
            images: $r.images,
            sum_dp: $r.sum_dp,
            max_dp: $r.max_dp,
            moments: $r.moments,
            stages: $r.stages,
        }
    };
}

impl<T: Target> Default for Reduced<T> {
    fn default() -> Self {
        Reduced {
            images: Vec::new(),
            sum_dp: None,
            max_dp: None,
            moments: None,
            stages: Vec::new(),
        }
    }
}

/// Host or device: the types of the arrays, the check before any work, the engine pass and
/// what a result made there says about it.
pub(crate) trait Target: Sized {
    /// One virtual image (integer or float mask).
    type Image;
    /// One image of an integer mask (a named detector).
    type U64Image;
    /// The sum DP.
    type SumDp;
    /// The max DP.
    type MaxDp;
    /// Per-frame moments.
    type Moments;
    /// An `f64` value per scan position (a centre-of-mass component).
    type Field;
    /// The mean DP (`f32`).
    type MeanDp;
    /// The stage name of a named detector's pass.
    const IMAGE_STAGE: &'static str;
    /// The stage name of the shared pass of `products`.
    const PRODUCTS_STAGE: &'static str;
    /// Refuse `ds` before any work (a disk fit, a pass) when it cannot give this target's
    /// results; errors carry `op`.
    fn check(ds: &Dataset, op: &str) -> Result<()>;
    /// One engine pass of `req` over `ds`, checked against the request.
    fn pass(ds: &Dataset, req: &ReduceRequest) -> Result<Reduced<Self>>;
    /// The image of an integer mask; `None` for a float image.
    fn u64_image(image: Self::Image) -> Option<Self::U64Image>;
    /// Record in a result's provenance where its arrays are (nothing on the host).
    fn mark(prov: &mut ResultProvenance, ds: &Dataset);
    /// The mean DP of the sum DP `sum` over `n_frames` frames: `sum / n` in `f64`, as `f32`
    /// (0 frames is an error carrying `op`).
    fn mean_dp(sum: &Self::SumDp, n_frames: u64, op: &str) -> Result<Self::MeanDp>;
    /// The centre of mass of `m` and its frames with no counts: `μ = m / S` in `f64` (0 where
    /// `S = 0`), the scan mean removed when `centered`, then each component times `factor`
    /// when given (the detector sampling in mrad) — `qem_cpu::dpc::com_from_moments` and the
    /// calibration, the same operations in the same order on both targets.
    fn com(
        m: &Self::Moments,
        centered: bool,
        factor: Option<(f64, f64)>,
    ) -> Result<(Self::Field, Self::Field, u64)>;
}

/// Arrays in host memory: `Vec`s and [`VirtualImage`]s.
pub(crate) struct Host;

impl Target for Host {
    type Image = VirtualImage;
    type U64Image = Vec<u64>;
    type SumDp = Vec<u64>;
    type MaxDp = Vec<u32>;
    type Moments = Moments;
    type Field = Vec<f64>;
    type MeanDp = Vec<f32>;
    const IMAGE_STAGE: &'static str = "reduce";
    const PRODUCTS_STAGE: &'static str = "reduce (shared pass)";

    fn check(ds: &Dataset, op: &str) -> Result<()> {
        live(ds, op)
    }

    fn pass(ds: &Dataset, req: &ReduceRequest) -> Result<Reduced<Self>> {
        reduce(ds, req).map(|r| reduced!(r))
    }

    fn u64_image(image: VirtualImage) -> Option<Vec<u64>> {
        match image {
            VirtualImage::U64(v) => Some(v),
            VirtualImage::F64(_) => None,
        }
    }

    fn mark(_: &mut ResultProvenance, _: &Dataset) {}

    fn mean_dp(sum: &Vec<u64>, n_frames: u64, op: &str) -> Result<Vec<f32>> {
        mean_from_sum(sum, n_frames, op)
    }

    fn com(
        m: &Moments,
        centered: bool,
        factor: Option<(f64, f64)>,
    ) -> Result<(Vec<f64>, Vec<f64>, u64)> {
        let c = qem_cpu::dpc::com_from_moments(m, centered);
        let (mut row, mut col) = (c.com_row, c.com_col);
        if let Some((fr, fc)) = factor {
            row.iter_mut().for_each(|v| *v *= fr);
            col.iter_mut().for_each(|v| *v *= fc);
        }
        Ok((row, col, c.zero_frames))
    }
}

/// Arrays left in GPU memory: [`DeviceVec`]s (CUDA datasets only).
pub(crate) struct Device;

impl Target for Device {
    type Image = DeviceVec;
    type U64Image = DeviceVec;
    type SumDp = DeviceVec;
    type MaxDp = DeviceVec;
    type Moments = DeviceMoments;
    type Field = DeviceVec;
    type MeanDp = DeviceVec;
    const IMAGE_STAGE: &'static str = "reduce (result on the device)";
    const PRODUCTS_STAGE: &'static str = "reduce (shared pass, result on the device)";

    fn check(ds: &Dataset, op: &str) -> Result<()> {
        check_on_gpu(ds, op)
    }

    fn pass(ds: &Dataset, req: &ReduceRequest) -> Result<Reduced<Self>> {
        reduce_on_device(ds, req).map(|r| reduced!(r))
    }

    /// The engine checked the image's dtype against its mask already.
    fn u64_image(image: DeviceVec) -> Option<DeviceVec> {
        Some(image)
    }

    /// Adds `"result_device": "cuda:N"` to the provenance parameters.
    fn mark(prov: &mut ResultProvenance, ds: &Dataset) {
        let ordinal = ds.cuda_ordinal().unwrap_or(0);
        if let Some(params) = prov.params.as_object_mut() {
            params.insert("result_device".into(), json!(format!("cuda:{ordinal}")));
        }
    }

    /// On the card (`qem_cuda::device_forms`), bit for bit the host's values.
    fn mean_dp(sum: &DeviceVec, n_frames: u64, op: &str) -> Result<DeviceVec> {
        mean_on_device(sum, n_frames, op)
    }

    /// On the card (`qem_cuda::device_forms`), bit for bit the host's values.
    fn com(
        m: &DeviceMoments,
        centered: bool,
        factor: Option<(f64, f64)>,
    ) -> Result<(DeviceVec, DeviceVec, u64)> {
        let c = qem_cuda::device_forms::com_from_moments(m, centered, factor)?;
        Ok((c.com_row, c.com_col, c.zero_frames))
    }
}

/// One pass of `req` on target `T` for a single product: `ds` checked first, errors carrying
/// `op`, and the part `take` picks from the result, whose absence is an internal error
/// ("the reduction returned no {what}").
pub(crate) fn one_product<T: Target, V>(
    ds: &Dataset,
    op: &str,
    req: &ReduceRequest,
    take: impl FnOnce(Reduced<T>) -> Option<V>,
    what: &str,
) -> Result<V> {
    T::check(ds, op)?;
    let r = T::pass(ds, req).map_err(|e| e.with_op(op))?;
    take(r).ok_or_else(|| Error::internal(op, format!("the reduction returned no {what}")))
}
