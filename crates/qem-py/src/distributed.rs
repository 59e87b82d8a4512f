//! The native functions behind `quantem.gpu.distributed`: the steps of a merge that must be the
//! engine's own arithmetic (not a Python copy of it), run on results merged from scan blocks.
//!
//! * [`distributed_fit_disk`]: the BF disk of the mean DP made from a merged exact sum DP
//!   (`qem::detector::fit_disk_from_mean`, the fit every single-process detector uses);
//! * [`distributed_dpc`]: DPC/iDPC on merged exact moments and ADF image
//!   (`qem::dpc::run_on_moments`, the second half of `dpc.run`).

use crate::dataset::{run_on, PyDataset};
use crate::errors::{to_pyerr, IntoPyResult};
use crate::products::disk_dict;
use numpy::{PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use qem::dpc::{self, AdfImage, DpcParams, EdgeMode};
use qem::{Error, Shape2};

const OP_DISK: &str = "distributed.fit_disk";
const OP_DPC: &str = "distributed.dpc";

/// A 2-D `uint64` array as (values, shape), or an error naming `what`.
fn u64_grid(op: &str, what: &str, a: &Bound<'_, PyAny>) -> PyResult<(Vec<u64>, Shape2)> {
    let arr = a.extract::<PyReadonlyArray2<'_, u64>>().map_err(|_| {
        to_pyerr(
            Error::invalid(op, format!("{what} must be a 2-D uint64 array"))
                .with_expected("uint64 (rows, cols)")
                .with_found(
                    a.getattr("dtype")
                        .and_then(|d| d.str())
                        .map(|d| format!("dtype {d}"))
                        .unwrap_or_else(|_| "another object".to_string()),
                ),
        )
    })?;
    let s = arr.shape();
    Ok((
        arr.as_array().iter().copied().collect(),
        Shape2::new(s[0], s[1]),
    ))
}

/// The BF disk fitted from the mean DP `sum_dp / n_frames` (float64 division, float32 mean,
/// as `detector.mean_dp`), as the dict `detector.fit_disk` returns.
#[pyfunction]
fn distributed_fit_disk<'py>(
    py: Python<'py>,
    sum_dp: &Bound<'py, PyAny>,
    n_frames: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let (sum, det) = u64_grid(OP_DISK, "sum_dp", sum_dp)?;
    if n_frames == 0 {
        return Err(to_pyerr(
            Error::invalid(OP_DISK, "the mean over no frames is undefined")
                .with_expected("n_frames >= 1")
                .with_found("0"),
        ));
    }
    let n = n_frames as f64;
    let mean: Vec<f32> = sum.iter().map(|&s| (s as f64 / n) as f32).collect();
    let d = qem::detector::fit_disk_from_mean(&mean, det);
    disk_dict(py, &d)
}

/// DPC on merged moments (`sum`, `m_row`, `m_col`: uint64 over the whole scan) and the merged
/// ADF image, with `dataset` (any block of the same source and load options) giving the
/// calibration, the engine and the provenance. Returns the dict `dpc.run`'s native call does.
#[pyfunction]
#[pyo3(signature = (
    dataset, sum, m_row, m_col, adf = None, adf_info = None, *, rotation_deg = None,
    transpose = None, edge = "periodic"
))]
#[allow(clippy::too_many_arguments)]
fn distributed_dpc<'py>(
    py: Python<'py>,
    dataset: PyRef<'py, PyDataset>,
    sum: &Bound<'py, PyAny>,
    m_row: &Bound<'py, PyAny>,
    m_col: &Bound<'py, PyAny>,
    adf: Option<&Bound<'py, PyAny>>,
    adf_info: Option<String>,
    rotation_deg: Option<f64>,
    transpose: Option<bool>,
    edge: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let (s, scan) = u64_grid(OP_DPC, "sum", sum)?;
    let (mr, sr) = u64_grid(OP_DPC, "m_row", m_row)?;
    let (mc, sc) = u64_grid(OP_DPC, "m_col", m_col)?;
    let adf = adf.map(|a| u64_grid(OP_DPC, "adf", a)).transpose()?;
    for (name, other) in [
        ("m_row", Some(sr)),
        ("m_col", Some(sc)),
        ("adf", adf.as_ref().map(|a| a.1)),
    ] {
        if let Some(o) = other {
            if o != scan {
                return Err(to_pyerr(
                    Error::invalid(OP_DPC, format!("{name} differs in shape from sum"))
                        .with_expected(format!("({}, {})", scan.rows, scan.cols))
                        .with_found(format!("({}, {})", o.rows, o.cols)),
                ));
            }
        }
    }
    let info: serde_json::Value = match adf_info {
        None => serde_json::Value::Null,
        Some(text) => serde_json::from_str(&text).map_err(|e| {
            to_pyerr(
                Error::invalid(OP_DPC, "adf_info is not JSON")
                    .with_expected("a JSON object describing the ADF image")
                    .with_found(e.to_string()),
            )
        })?,
    };
    let p = DpcParams {
        rotation_deg,
        transpose,
        edge: edge.parse::<EdgeMode>().py()?,
    };
    let moments = qem::detector::Moments {
        sum: s,
        m_row: mr,
        m_col: mc,
    };
    let adf_image = adf.map(|(v, _)| v);
    let r = run_on(py, &dataset, OP_DPC, move |ds, _| {
        let adf = adf_image.as_deref().map(|image| AdfImage {
            image,
            info: info.clone(),
        });
        dpc::run_on_moments(ds, &moments, adf, scan, &p)
    })?;
    crate::products::dpc_dict(py, r)
}

/// Add the functions to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(distributed_fit_disk, m)?)?;
    m.add_function(wrap_pyfunction!(distributed_dpc, m)?)?;
    Ok(())
}
