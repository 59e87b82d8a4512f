//! `qem-py`: the PyO3 module `quantem.gpu._native` behind the Python package `quantem.gpu`.
//!
//! This crate only converts: Python arguments into [`qem`] parameters, [`qem::Error`] into the
//! Python exception hierarchy ([`errors`]), results into numpy arrays and dicts ([`convert`]).
//! Long calls run with the GIL released and honour Ctrl-C ([`watch`]). The Python-facing names,
//! signatures and doc strings users read live in `python/quantem/gpu/`; nothing depends on this
//! crate.

mod browse;
mod convert;
mod dataset;
mod device_array;
mod distributed;
mod dlpack;
mod engine;
mod errors;
mod products;
mod ssb;
mod watch;

use crate::convert::{numpy_to_source, region, shape2, to_py};
use crate::dataset::PyDataset;
use crate::errors::{to_pyerr, IntoPyResult};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use qem::{BackendRequest, DtypeRequest, Error, LoadParams, Representation, SourceArg};
use std::path::PathBuf;

fn parse_representation(name: Option<&str>) -> PyResult<Option<Representation>> {
    name.map(str::parse::<Representation>).transpose().py()
}

/// Load a source; see `quantem.gpu.io.load` for the documented signature.
#[pyfunction]
#[pyo3(signature = (
    source, *, backend = "auto", scan_shape = None, scan_region = None, detector_region = None,
    det_bin = 1, dtype = "native", representation = None, apply_mask = true,
    memory_budget = None, progress = None, dataset_path = None, format = None, shape = None,
    raw_dtype = None, file_header_bytes = 0, frame_header_bytes = 0, frame_footer_bytes = 0,
    float_scale = None, device = None
))]
#[allow(clippy::too_many_arguments)]
fn load(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
    backend: &str,
    scan_shape: Option<Vec<i64>>,
    scan_region: Option<Vec<i64>>,
    detector_region: Option<Vec<i64>>,
    det_bin: i64,
    dtype: &str,
    representation: Option<&str>,
    apply_mask: bool,
    memory_budget: Option<u64>,
    progress: Option<Py<PyAny>>,
    dataset_path: Option<String>,
    format: Option<&str>,
    shape: Option<Vec<u64>>,
    raw_dtype: Option<String>,
    file_header_bytes: u64,
    frame_header_bytes: u64,
    frame_footer_bytes: u64,
    float_scale: Option<f64>,
    device: Option<i64>,
) -> PyResult<PyDataset> {
    if source.is_instance_of::<PyBytes>() {
        // `quantem.gpu.io.load` decodes bytes paths with `os.fsdecode`; bytes that reach this
        // far are never read as an array of counts.
        return Err(to_pyerr(
            Error::invalid("load", "a bytes source must be decoded to a path first")
                .with_expected("str, os.PathLike or numpy array (os.fsdecode a bytes path)")
                .with_found("bytes"),
        ));
    }
    let source = if let Ok(path) = source.extract::<PathBuf>() {
        SourceArg::Path(path)
    } else {
        numpy_to_source(source)?
    };
    let det_bin = usize::try_from(det_bin).map_err(|_| {
        to_pyerr(
            Error::invalid("load", "det_bin must be a positive integer")
                .with_expected(">= 1")
                .with_found(det_bin.to_string()),
        )
    })?;
    let requested = parse_representation(representation)?;
    let device = device
        .map(|d| {
            usize::try_from(d).map_err(|_| {
                to_pyerr(
                    Error::invalid("load", "device must be a CUDA device index")
                        .with_expected("an integer >= 0 or None")
                        .with_found(d.to_string()),
                )
            })
        })
        .transpose()?;
    let backend = backend.parse::<BackendRequest>().py()?;
    let backend = py
        .detach(|| qem::backend::request_with_device(backend, device))
        .py()?;
    let mut params = LoadParams {
        backend,
        scan_shape: shape2("scan_shape", scan_shape)?,
        scan_region: region("scan_region", scan_region)?,
        detector_region: region("detector_region", detector_region)?,
        det_bin,
        dtype: dtype.parse::<DtypeRequest>().py()?,
        representation: requested,
        apply_mask,
        memory_budget,
        dataset_path,
        format: format
            .map(str::parse::<qem::load::Format>)
            .transpose()
            .py()?,
        raw: match (shape, raw_dtype) {
            (None, None) => None,
            (shape, dtype) => Some(qem::load::RawLayout {
                shape: shape.unwrap_or_default(),
                dtype: dtype.unwrap_or_default(),
                file_header_bytes,
                frame_header_bytes,
                frame_footer_bytes,
            }),
        },
        float_scale,
        progress: None,
    };
    let ds = watch::run_watched(py, "load", progress, move |w| {
        params.progress = Some(w);
        qem::load(source, &params)
    })?;
    if let Some(r) = requested {
        if ds.representation() != r {
            // Never hand back another representation than the one asked for.
            return Err(to_pyerr(
                Error::internal(
                    "load",
                    format!("representation {r:?} was asked for but another came back"),
                )
                .with_expected(format!("{r:?}"))
                .with_found(format!("{:?}", ds.representation())),
            ));
        }
    }
    Ok(PyDataset::new(ds))
}

/// Write `dataset` as a `.qem` file; returns a summary dict. See `quantem.gpu.io.save`.
#[pyfunction]
fn save<'py>(
    py: Python<'py>,
    dataset: PyRef<'py, PyDataset>,
    path: PathBuf,
) -> PyResult<Bound<'py, PyAny>> {
    let summary = dataset::run_on(py, &dataset, "save .qem", move |ds, watch| {
        qem::save(ds, &path, watch)
    })?;
    to_py(py, &summary)
}

/// Readiness report of a source as a dict, without decoding pixels.
#[pyfunction]
#[pyo3(signature = (source, scan_shape = None))]
fn inspect<'py>(
    py: Python<'py>,
    source: PathBuf,
    scan_shape: Option<Vec<i64>>,
) -> PyResult<Bound<'py, PyAny>> {
    let scan_shape = shape2("scan_shape", scan_shape)?;
    let report = watch::run_watched(py, "inspect", None, move |_| {
        qem::inspect(&source, scan_shape)
    })?;
    to_py(py, &report)
}

/// Every Dectris master file under `folder`, recursively, sorted.
#[pyfunction]
fn discover(py: Python<'_>, folder: PathBuf) -> PyResult<Vec<String>> {
    let found = py.detach(|| qem::discover(&folder)).py()?;
    Ok(found
        .into_iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect())
}

/// Every backend this build knows, in preference order: dicts with name, available, detail.
#[pyfunction]
fn backends<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for info in qem::available_backends() {
        list.append(to_py(py, &info)?)?;
    }
    Ok(list)
}

/// The backend `name` resolves to, or `BackendUnavailableError` with the reason.
#[pyfunction]
#[pyo3(signature = (name = "auto"))]
fn resolve_backend(name: &str) -> PyResult<String> {
    let request = name.parse::<BackendRequest>().py()?;
    Ok(qem::resolve_backend(request).py()?.name().to_string())
}

/// Wait for the CUDA engine's start on the `QEM_WARM_START` thread (registered with `atexit`
/// by the package, so that no exit happens while that thread is inside the driver).
#[pyfunction]
fn _finish_warm_start(py: Python<'_>) {
    py.detach(qem::backend::finish_warm_start);
}

/// Make the CUDA context lost on purpose (tests of how a lost device is reported): raises the
/// `DeviceLostError` the fault produced.
#[pyfunction]
fn _inject_cuda_fault(py: Python<'_>) -> PyResult<()> {
    py.detach(qem::backend::inject_cuda_fault).py()
}

/// The module `quantem.gpu._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // QEM_WARM_START: the CUDA engine starts on a thread before numpy's import below.
    m.add("_warm_start", qem::backend::warm_start_if_asked())?;
    // Load numpy's C API now, while no signal is pending: rust-numpy loads it lazily on first
    // use and panics (a `PanicException`) when that import fails, which it did when the first
    // array conversion ran with a Ctrl-C pending.
    numpy::PyArray1::<u8>::zeros(m.py(), 0, false);
    errors::register(m)?;
    m.add_class::<PyDataset>()?;
    m.add_function(wrap_pyfunction!(load, m)?)?;
    m.add_function(wrap_pyfunction!(inspect, m)?)?;
    m.add_function(wrap_pyfunction!(save, m)?)?;
    m.add_function(wrap_pyfunction!(discover, m)?)?;
    m.add_function(wrap_pyfunction!(backends, m)?)?;
    m.add_function(wrap_pyfunction!(resolve_backend, m)?)?;
    m.add_function(wrap_pyfunction!(_inject_cuda_fault, m)?)?;
    m.add_function(wrap_pyfunction!(_finish_warm_start, m)?)?;
    device_array::register(m)?;
    products::register(m)?;
    ssb::register(m)?;
    browse::register(m)?;
    distributed::register(m)?;
    Ok(())
}
