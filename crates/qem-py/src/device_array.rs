//! `quantem.gpu.results.DeviceArray`: one result array left in GPU memory
//! (`device_result=True`), holding a [`DeviceVec`] (an `Arc`-held device allocation) and its
//! shape. It converts nothing implicitly: `__dlpack__` / `__cuda_array_interface__` hand the
//! device memory to CuPy, PyTorch, JAX or Numba without a copy, `to_numpy()` is the explicit
//! host copy, and `np.asarray` is refused (as CuPy refuses it) rather than copying behind the
//! caller's back.

use crate::convert::array;
use crate::dlpack::{Capsule, Source};
use crate::errors::to_pyerr;
use numpy::PyArrayDescr;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use qem::detector::{DeviceVec, HostVec, ResultDType};
use qem::Error;

/// An array in GPU memory: a result of ``device_result=True``.
///
/// ``shape``, ``dtype``, ``device`` (CUDA ordinal), ``nbytes``; ``__dlpack__`` /
/// ``__dlpack_device__`` (``torch.from_dlpack``, ``cupy.from_dlpack``, ``jax.dlpack``) and
/// ``__cuda_array_interface__`` (``cupy.asarray``, Numba) view it without a copy, and the view
/// keeps the memory alive after this object is gone. ``to_numpy()`` copies it to the host;
/// ``np.asarray`` raises ``TypeError`` (no implicit copy).
#[pyclass(name = "DeviceArray", module = "quantem.gpu.results", frozen)]
#[derive(Debug)]
pub struct PyDeviceArray {
    vec: DeviceVec,
    shape: Vec<usize>,
}

impl PyDeviceArray {
    /// `vec` viewed as `shape` (row-major); an internal error when the sizes differ.
    pub fn wrap(py: Python<'_>, vec: DeviceVec, shape: &[usize]) -> PyResult<Py<PyAny>> {
        let n: usize = shape.iter().product();
        if n != vec.len() {
            return Err(to_pyerr(
                Error::internal("device result", "the shape does not match the values")
                    .with_expected(format!("{n} values for shape {shape:?}"))
                    .with_found(format!("{} values", vec.len())),
            ));
        }
        let obj = PyDeviceArray {
            vec,
            shape: shape.to_vec(),
        };
        Ok(Py::new(py, obj)?.into_any())
    }

    fn device_name(&self) -> String {
        format!("cuda:{}", self.vec.device_ordinal())
    }

    fn shape_text(&self) -> String {
        match self.shape.as_slice() {
            [n] => format!("({n},)"),
            s => format!(
                "({})",
                s.iter()
                    .map(|n| n.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

/// The CUDA Array Interface (version 3) of a contiguous row-major array of `shape` at device
/// address `ptr`: writable, no strides, no stream (the values are complete before the dict
/// exists). Shared by `DeviceArray` and the CUDA dataset.
pub(crate) fn cuda_array_interface<'py>(
    py: Python<'py>,
    shape: &[usize],
    typestr: &str,
    ptr: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("version", 3)?;
    dict.set_item("shape", PyTuple::new(py, shape)?)?;
    dict.set_item("typestr", typestr)?;
    dict.set_item("data", (ptr, false))?;
    dict.set_item("strides", py.None())?;
    dict.set_item("stream", py.None())?;
    Ok(dict)
}

fn numpy_dtype(py: Python<'_>, d: ResultDType) -> Bound<'_, PyArrayDescr> {
    match d {
        ResultDType::U32 => numpy::dtype::<u32>(py),
        ResultDType::U64 => numpy::dtype::<u64>(py),
        ResultDType::F64 => numpy::dtype::<f64>(py),
        ResultDType::F32 => numpy::dtype::<f32>(py),
    }
}

#[pymethods]
impl PyDeviceArray {
    /// Shape, row-major (``(R_r, R_c)`` for images, ``(k_r, k_c)`` for patterns).
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// Number of dimensions.
    #[getter]
    fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Number of values.
    #[getter]
    fn size(&self) -> usize {
        self.vec.len()
    }

    /// Bytes of the values in device memory.
    #[getter]
    fn nbytes(&self) -> usize {
        self.vec.nbytes()
    }

    /// NumPy dtype of the values (``uint64`` sums, ``float64`` float-mask images and CoM,
    /// ``float32`` mean DP, ``uint32`` max DP).
    #[getter]
    fn dtype<'py>(&self, py: Python<'py>) -> Bound<'py, PyArrayDescr> {
        numpy_dtype(py, self.vec.dtype())
    }

    /// CUDA ordinal of the device holding the values.
    #[getter]
    fn device(&self) -> usize {
        self.vec.device_ordinal()
    }

    /// The CUDA Array Interface (version 3): the device address, shape and type, for
    /// ``cupy.asarray`` and Numba. ``stream`` is ``None``: the values were complete (the
    /// engine synchronized) before this object existed. CuPy and Numba keep a reference to
    /// this object for as long as their array lives, which keeps the memory.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let typestr = match self.vec.dtype() {
            ResultDType::U32 => "<u4",
            ResultDType::U64 => "<u8",
            ResultDType::F64 => "<f8",
            ResultDType::F32 => "<f4",
        };
        cuda_array_interface(py, &self.shape, typestr, self.vec.device_ptr())
    }

    /// DLPack: a zero-copy view for ``torch.from_dlpack``, ``cupy.from_dlpack``,
    /// ``jax.dlpack``. The tensor keeps the device memory alive after this object (and the
    /// dataset) are gone. ``max_version`` of 1.0 or later gives a versioned capsule (writable:
    /// the memory is the caller's), otherwise the legacy one. Any ``stream`` is accepted (the
    /// values are complete for every stream). ``copy=True`` with ``dl_device=(1, 0)`` exports
    /// a host copy (``np.from_dlpack(a, device="cpu", copy=True)``); any other ``copy=True``
    /// and a ``dl_device`` other than ``(2, device)`` raise ``BufferError``.
    #[pyo3(
        signature = (**kw),
        text_signature = "($self, *, stream=None, max_version=None, dl_device=None, copy=None)"
    )]
    fn __dlpack__<'py>(&self, py: Python<'py>, kw: Option<&Bound<'py, PyDict>>) -> Capsule<'py> {
        crate::dlpack::export(py, Source::Result(&self.vec, &self.shape), kw)
    }

    /// ``(2, device)``: kDLCUDA and the CUDA ordinal.
    fn __dlpack_device__(&self) -> (i32, i32) {
        crate::dlpack::result_device(&self.vec)
    }

    /// A host copy as a NumPy array of the same shape and dtype (waits for every stream of
    /// the device first, so writes a consumer queued are included).
    fn to_numpy(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let vec = self.vec.clone();
        let host = py.detach(move || vec.to_host()).map_err(to_pyerr)?;
        match host {
            HostVec::U32(v) => array(py, v, &self.shape),
            HostVec::U64(v) => array(py, v, &self.shape),
            HostVec::F64(v) => array(py, v, &self.shape),
            HostVec::F32(v) => array(py, v, &self.shape),
        }
    }

    /// ``a * factor`` as a new ``float64`` DeviceArray computed on the card (one IEEE multiply
    /// per value, as NumPy's): a calibration applied after the engine's pass
    /// (``calibration.dpc_rescale``). Private: results are not general arrays.
    fn _scaled(&self, py: Python<'_>, factor: f64) -> PyResult<Py<PyAny>> {
        let vec = self.vec.clone();
        let out = py
            .detach(move || qem::detector::scale_on_device(&vec, factor))
            .map_err(to_pyerr)?;
        PyDeviceArray::wrap(py, out, &self.shape)
    }

    /// ``np.asarray(a)`` is refused: the values are in GPU memory and copying them must be
    /// asked for (``to_numpy()``).
    #[pyo3(signature = (dtype = None, copy = None))]
    fn __array__(&self, dtype: Option<Bound<'_, PyAny>>, copy: Option<bool>) -> PyResult<()> {
        let _ = (dtype, copy);
        Err(PyTypeError::new_err(format!(
            "this DeviceArray lives on {} (device_result=True): no implicit copy to the host; \
             use .to_numpy() for a host copy, or cupy/torch.from_dlpack for a device view",
            self.device_name()
        )))
    }

    fn __len__(&self) -> usize {
        self.shape.first().copied().unwrap_or(0)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "DeviceArray(shape={}, dtype={}, device='{}')",
            self.shape_text(),
            numpy_dtype(py, self.vec.dtype()),
            self.device_name()
        )
    }

    /// The notebook summary: shape, dtype, where it lives, bytes.
    fn _repr_html_(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let this = slf.get();
        let rows = PyList::empty(py);
        rows.append(("shape", this.shape_text()))?;
        rows.append(("dtype", this.vec.dtype().numpy_name()))?;
        rows.append(("on", this.device_name()))?;
        rows.append(("bytes", this.vec.nbytes()))?;
        let display = py.import("quantem.gpu._display")?;
        Ok(display
            .getattr("table_html")?
            .call1(("DeviceArray", rows))?
            .unbind())
    }
}

/// Add the class to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDeviceArray>()
}
