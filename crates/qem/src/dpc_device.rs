//! The centre of mass written once for both targets (`qem::dpc::device`, a child of
//! [`crate::dpc`] so that it shares the private calibration rule): [`center_of_mass_in`] on the
//! host is [`super::center_of_mass`], on the card [`center_of_mass_on_device`], whose arrays stay
//! in GPU memory (`DeviceVec`s, CUDA datasets only) and hold the host form's values bit for bit
//! (the same moments, the same `f64` operations in the same order: `Target::com`).

use super::{Calibration, CenterOfMass};
use crate::dataset::Dataset;
use crate::detector::target::{Device, Target};
use crate::detector::{moments_in, DeviceVec};
use crate::result::ResultProvenance;
use qem_core::Result;
use serde_json::json;
use std::time::Instant;

/// [`super::center_of_mass`] with `com_row` and `com_col` left on the device (`f64`
/// [`DeviceVec`]s, row-major `[R_r, R_c]`); the unit, zero frames and provenance are the host
/// result's, the provenance adding `"result_device": "cuda:N"`. A CPU dataset is an
/// `InvalidArgument` error naming its backend.
pub fn center_of_mass_on_device(ds: &Dataset, centered: bool) -> Result<CenterOfMass<DeviceVec>> {
    center_of_mass_in::<Device>(ds, centered)
}

/// The centre of mass with its arrays on target `T`: one moments pass, `T::com` with the
/// detector sampling (mrad) when the metadata gives it, the provenance.
pub(super) fn center_of_mass_in<T: Target>(
    ds: &Dataset,
    centered: bool,
) -> Result<CenterOfMass<T::Field>> {
    const OP: &str = "dpc center_of_mass";
    let t0 = Instant::now();
    let m = moments_in::<T>(ds).map_err(|e| e.with_op(OP))?;
    let t_reduce = t0.elapsed().as_secs_f64();
    let cal = Calibration::of(ds);
    let (com_row, com_col, zero_frames) =
        T::com(&m, centered, cal.det_mrad).map_err(|e| e.with_op(OP))?;
    let mut provenance = ResultProvenance::new(
        ds,
        "dpc.center_of_mass",
        json!({
            "centered": centered,
            "unit": cal.unit(),
            "origin": "detector pixel (0, 0)",
            "zero_frames": zero_frames,
            "det_bin": ds.provenance().det_bin,
            "calibration": cal.json(),
        }),
    );
    T::mark(&mut provenance, ds);
    provenance.stage("reduce (moments)", t_reduce);
    provenance.stage("total (wall)", t0.elapsed().as_secs_f64());
    Ok(CenterOfMass {
        com_row,
        com_col,
        scan_shape: ds.scan_shape(),
        centered,
        zero_frames,
        unit: cal.unit().to_string(),
        provenance,
    })
}
