//! The Python `Dataset` class: a thin handle on a [`qem::Dataset`].
//!
//! The dataset is shared (`Arc`) between the Python object and the worker threads of running
//! calls ([`run_on`]), behind a read-write lock: every call holds a read guard while it runs,
//! and nothing ever waits for a write. `close()` asks for the data to be released: at once
//! when no call is running, else by the last running call when it ends (a call interrupted by
//! Ctrl-C may still be finishing in the background). From the moment `close()` returns, the
//! dataset reads as closed and new calls are refused. A DLPack export ([`crate::dlpack`]) holds
//! the data the same way until the consumer deletes its tensor. So closing from another thread, or in a
//! `with` block's exit after Ctrl-C, never blocks and never fails. The class is `frozen` (no
//! `&mut self`), so PyO3's borrow flag (`RuntimeError: Already borrowed`) never comes into it.

use crate::convert::{dense_to_numpy, to_py};
use crate::dlpack::Capsule;
use crate::errors::{to_pyerr, IntoPyResult};
use crate::watch::{run_watched, Watch};
use numpy::PyArrayDescr;
use pyo3::exceptions::{PyAttributeError, PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use qem::{DType, Error, ErrorKind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock, TryLockError};

/// Above this many bytes `to_numpy()` / `np.asarray()` refuse unless `force=True`.
const TO_NUMPY_LIMIT: u64 = 4 << 30;

/// A loaded 4D-STEM acquisition ``I[R_r, R_c, k_r, k_c]``.
///
/// Made by ``io.load``. ``ds[r, c]`` is one detector frame as numpy; ``ds.to_numpy()`` the
/// dense 4-D array. Use as a context manager (or call ``close()``) to release its memory.
#[pyclass(name = "Dataset", module = "quantem.gpu.io", frozen)]
#[derive(Debug)]
pub struct PyDataset {
    shared: Arc<Shared>,
}

/// The dataset and its close request, shared with running calls.
#[derive(Debug)]
pub struct Shared {
    ds: RwLock<qem::Dataset>,
    close_requested: AtomicBool,
    /// Live DLPack exports; the data stays while any is alive.
    exports: AtomicUsize,
}

impl Shared {
    /// `f(dataset)` under a read guard; afterwards a pending close is carried out if no other
    /// guard is held.
    pub fn read<R>(&self, f: impl FnOnce(&qem::Dataset) -> R) -> R {
        let out = {
            let guard = self.ds.read().unwrap_or_else(PoisonError::into_inner);
            f(&guard)
        };
        self.settle();
        out
    }

    /// True once `close()` was called (the data may still be in use by a finishing call).
    pub fn closing(&self) -> bool {
        self.close_requested.load(Ordering::SeqCst)
    }

    fn request_close(&self) {
        self.close_requested.store(true, Ordering::SeqCst);
        self.settle();
    }

    /// A DLPack export starts (called under a read guard).
    pub fn begin_export(&self) {
        self.exports.fetch_add(1, Ordering::SeqCst);
    }

    /// A DLPack export ended (its tensor was deleted): a pending close may now be carried out.
    pub fn end_export(&self) {
        self.exports.fetch_sub(1, Ordering::SeqCst);
        self.settle();
    }

    /// Release the data if a close was asked for and no call or export holds it. Never waits:
    /// a call holding a read guard runs `settle` itself when it ends, an export when it ends.
    fn settle(&self) {
        if !self.closing() || self.exports.load(Ordering::SeqCst) > 0 {
            return;
        }
        let mut guard = match self.ds.try_write() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return,
        };
        if !guard.is_closed() {
            guard.close();
        }
    }
}

/// The error of a call on a closed dataset (the engine's own words for it).
pub fn closed_error(op: &str) -> PyErr {
    to_pyerr(
        Error::invalid(op, "the dataset has been closed")
            .with_expected("an open dataset")
            .with_found("closed"),
    )
}

impl PyDataset {
    pub fn new(inner: qem::Dataset) -> Self {
        PyDataset {
            shared: Arc::new(Shared {
                ds: RwLock::new(inner),
                close_requested: AtomicBool::new(false),
                exports: AtomicUsize::new(0),
            }),
        }
    }

    /// `f(dataset)` on the calling thread (short calls and metadata).
    pub fn with<R>(&self, f: impl FnOnce(&qem::Dataset) -> R) -> R {
        self.shared.read(f)
    }

    /// The shared dataset, for holders that outlive one call (the browse service).
    pub fn shared(&self) -> Arc<Shared> {
        Arc::clone(&self.shared)
    }

    /// Refuse a call on a dataset that is closed or closing.
    pub fn check_open(&self, op: &str) -> PyResult<()> {
        if self.shared.closing() {
            Err(closed_error(op))
        } else {
            Ok(())
        }
    }
}

/// Run `work(dataset, watch)` as a long call (see [`crate::watch`]): on a worker thread that
/// holds the dataset for as long as it runs, with Ctrl-C answered at once.
pub fn run_on<T, F>(py: Python<'_>, dataset: &PyDataset, op: &str, work: F) -> PyResult<T>
where
    T: Send + 'static,
    F: FnOnce(&qem::Dataset, &Watch) -> qem::Result<T> + Send + 'static,
{
    dataset.check_open(op)?;
    let shared = Arc::clone(&dataset.shared);
    run_watched(py, op, None, move |w| shared.read(|ds| work(ds, &w)))
}

/// [`run_on`] with the user's progress `callback` (`callback(stage, done, total)` on the calling
/// thread): the engine passes inside `work` then run in blocks of frames and report as stage
/// `label` ([`qem::progress::with_progress`]); without a callback this is [`run_on`].
pub fn run_on_progress<T, F>(
    py: Python<'_>,
    dataset: &PyDataset,
    op: &str,
    callback: Option<Py<PyAny>>,
    work: F,
) -> PyResult<T>
where
    T: Send + 'static,
    F: FnOnce(&qem::Dataset, &Watch) -> qem::Result<T> + Send + 'static,
{
    if callback.is_none() {
        return run_on(py, dataset, op, work);
    }
    dataset.check_open(op)?;
    let shared = Arc::clone(&dataset.shared);
    let label = op.to_string();
    run_watched(py, op, callback, move |w| {
        let observer: Arc<dyn qem::Progress> = w.clone();
        qem::progress::with_progress(observer, &label, || shared.read(|ds| work(ds, &w)))
    })
}

fn numpy_dtype(py: Python<'_>, dtype: DType) -> Bound<'_, PyArrayDescr> {
    match dtype {
        DType::U8 => numpy::dtype::<u8>(py),
        DType::U16 => numpy::dtype::<u16>(py),
        DType::U32 => numpy::dtype::<u32>(py),
    }
}

fn representation<'py>(py: Python<'py>, r: qem::Representation) -> PyResult<Bound<'py, PyAny>> {
    let value = match r {
        qem::Representation::Dense => "dense",
        qem::Representation::Encoded => "encoded",
    };
    py.import("quantem.gpu._enums")?
        .getattr("DataRepresentation")?
        .call1((value,))
}

/// Python-style index `i` into `0..n` (negative counts from the end).
fn wrap_index(axis: &str, i: isize, n: usize) -> PyResult<usize> {
    let n_signed = isize::try_from(n).unwrap_or(isize::MAX);
    let j = if i < 0 { i + n_signed } else { i };
    if (0..n_signed).contains(&j) {
        Ok(j as usize)
    } else {
        Err(PyIndexError::new_err(format!(
            "scan {axis} index {i} is out of range for {n} {axis}s"
        )))
    }
}

#[pymethods]
impl PyDataset {
    /// ``(R_r, R_c, k_r, k_c)`` of the loaded data (after regions and binning).
    #[getter]
    fn shape(&self) -> (usize, usize, usize, usize) {
        let [a, b, c, d] = self.with(|d| d.shape());
        (a, b, c, d)
    }

    /// numpy dtype of the counts.
    #[getter]
    fn dtype<'py>(&self, py: Python<'py>) -> Bound<'py, PyArrayDescr> {
        numpy_dtype(py, self.with(|d| d.dtype()))
    }

    /// Backend holding the data (``"cpu"`` or ``"cuda"``).
    #[getter]
    fn backend(&self) -> String {
        self.with(|d| d.backend().name().to_string())
    }

    /// Device description (CPU model and threads, or GPU model).
    #[getter]
    fn device(&self) -> String {
        self.with(|d| d.device().to_string())
    }

    /// Source metadata as a dict (``None`` where the source does not say).
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.with(|d| to_py(py, d.metadata()))
    }

    /// How the dataset was made: files, regions, bins, dtypes, mask policy, backend, version.
    #[getter]
    fn provenance<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.with(|d| to_py(py, d.provenance()))
    }

    /// Bytes the data occupies where it lives (0 once closed); for ENCODED data the streams,
    /// their index and the model.
    #[getter]
    fn nbytes_resident(&self) -> u64 {
        if self.shared.closing() {
            return 0;
        }
        self.with(|d| d.nbytes_resident())
    }

    /// ``io.DataRepresentation.DENSE`` or ``.ENCODED``.
    #[getter]
    fn representation<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        representation(py, self.with(|d| d.representation()))
    }

    /// True after ``close()``.
    #[getter]
    fn closed(&self) -> bool {
        self.shared.closing() || self.with(|d| d.is_closed())
    }

    /// True once the data is actually released (``close()`` may wait for running calls and
    /// DLPack views; tests and diagnostics read this).
    #[getter]
    fn _released(&self) -> bool {
        self.with(|d| d.is_closed())
    }

    /// ``ds[row, col]``: one detector frame ``(k_r, k_c)`` (negative counts from the end);
    /// any other NumPy-style index of integers, slices and ``...`` (``ds[0:16, :, 10, 10]``,
    /// ``ds[..., r, c]``) reads only the selected frames (``quantem.gpu._index``).
    fn __getitem__(slf: &Bound<'_, Self>, index: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let this = slf.get();
        let pair = index
            .extract::<(Bound<'_, pyo3::types::PyInt>, Bound<'_, pyo3::types::PyInt>)>()
            .ok()
            .and_then(|(r, c)| Some((r.extract::<isize>().ok()?, c.extract::<isize>().ok()?)));
        let Some((row, col)) = pair else {
            return Ok(py
                .import("quantem.gpu._index")?
                .getattr("getitem")?
                .call1((slf, index))?
                .unbind());
        };
        let [rows, cols, k_r, k_c] = this.with(|d| d.shape());
        let r = wrap_index("row", row, rows)?;
        let c = wrap_index("column", col, cols)?;
        this.check_open("frame")?;
        let frame = py.detach(|| this.with(|d| d.frame(r, c))).py()?;
        dense_to_numpy(py, frame, &[k_r, k_c])
    }

    /// Dense 4-D copy ``(R_r, R_c, k_r, k_c)`` as numpy.
    ///
    /// Parameters
    /// ----------
    /// force : bool
    ///     Make the copy even above 4 GiB (otherwise a ``MemoryBudgetError``).
    #[pyo3(signature = (force = false))]
    fn to_numpy(&self, py: Python<'_>, force: bool) -> PyResult<Py<PyAny>> {
        let (shape, dtype) = self.with(|d| (d.shape(), d.dtype()));
        let nbytes = shape.iter().map(|&n| n as u64).product::<u64>() * dtype.size() as u64;
        if nbytes > TO_NUMPY_LIMIT && !force {
            return Err(to_pyerr(
                Error::new(
                    ErrorKind::MemoryBudget,
                    "to_numpy",
                    format!(
                        "a dense copy of {:?} {} needs {:.2} GiB; pass force=True to make it anyway",
                        shape,
                        dtype.numpy_name(),
                        nbytes as f64 / f64::from(1u32 << 30)
                    ),
                )
                .with_expected(format!("<= {TO_NUMPY_LIMIT} bytes"))
                .with_found(format!("{nbytes} bytes")),
            ));
        }
        let dense = run_on(py, self, "to_numpy", |d, _| crate::engine::to_host(d))?;
        dense_to_numpy(py, dense, &shape)
    }

    /// The CUDA Array Interface (version 3) of a dataset on the GPU (``backend == "cuda"``), so
    /// that ``cupy.asarray(ds)`` (or Numba, PyTorch) views the device array without a copy.
    ///
    /// The data is complete and synchronized (``stream`` is ``None``); the view stays valid
    /// while the dataset is open: do not ``close()`` it while arrays made from it are in use.
    /// CPU datasets have no such attribute (``hasattr(ds, "__cuda_array_interface__")`` is
    /// ``False``); use ``to_numpy()``.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (backend, repr) = self.with(|d| (d.backend().name(), d.representation()));
        if backend != "cuda" {
            return Err(PyAttributeError::new_err(format!(
                "__cuda_array_interface__: this dataset is on backend \"{backend}\", not on the GPU; use to_numpy()"
            )));
        }
        if repr == qem::Representation::Encoded {
            return Err(PyAttributeError::new_err(
                "__cuda_array_interface__: this dataset is held ENCODED on the GPU (no dense array exists); load with representation=\"dense\" for a zero-copy CuPy view, or use ds[r, c] / to_numpy()",
            ));
        }
        let view = if self.shared.closing() {
            None
        } else {
            self.with(crate::engine::device_view)
        };
        let view = view.ok_or_else(|| {
            PyAttributeError::new_err(
                "__cuda_array_interface__: the dataset has been closed (its device memory is released)",
            )
        })?;
        let typestr = match view.dtype {
            DType::U8 => "|u1",
            DType::U16 => "<u2",
            DType::U32 => "<u4",
        };
        crate::device_array::cuda_array_interface(py, &view.shape, typestr, view.device_ptr)
    }

    /// DLPack: a zero-copy view of the dense array for ``torch.from_dlpack``,
    /// ``cupy.from_dlpack``, ``jax.dlpack`` or (CPU datasets) ``np.from_dlpack``.
    ///
    /// Keywords as the array API has them (``stream``, ``max_version``, ``dl_device``,
    /// ``copy``). ``max_version`` of 1.0 or later gives a versioned capsule marked read-only
    /// (the counts are the dataset's: NumPy's array is not writeable); otherwise the legacy
    /// capsule. The view keeps the data alive: ``close()`` while a tensor made from it exists
    /// releases the memory only when that tensor is deleted. ``copy=True`` on a CPU dataset
    /// exports a writable copy of the counts (decoded if ENCODED); a view of an ENCODED
    /// dataset, ``copy=True`` on the GPU and a ``dl_device`` other than the dataset's raise
    /// ``BufferError``.
    #[pyo3(
        signature = (**kw),
        text_signature = "($self, *, stream=None, max_version=None, dl_device=None, copy=None)"
    )]
    fn __dlpack__<'py>(&self, py: Python<'py>, kw: Option<&Bound<'py, PyDict>>) -> Capsule<'py> {
        crate::dlpack::export(py, crate::dlpack::Source::Dataset(self), kw)
    }

    /// ``(device_type, device_id)`` as DLPack numbers them: ``(1, 0)`` CPU, ``(2, k)`` CUDA
    /// device ``k``.
    fn __dlpack_device__(&self) -> (i32, i32) {
        crate::dlpack::device(self)
    }

    /// ``np.asarray(ds)``: the dense copy (same size guard as ``to_numpy``).
    #[pyo3(signature = (dtype = None, copy = None))]
    fn __array__(
        &self,
        py: Python<'_>,
        dtype: Option<Bound<'_, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        if copy == Some(false) {
            return Err(PyValueError::new_err(
                "a Dataset cannot be viewed without a copy; use np.array(ds) or ds.to_numpy()",
            ));
        }
        let arr = self.to_numpy(py, false)?;
        match dtype {
            Some(dt) if !dt.is_none() => Ok(arr.call_method1(py, "astype", (dt,))?),
            _ => Ok(arr),
        }
    }

    /// Release the data; later frame or array access raises ``InvalidArgumentError``.
    ///
    /// Safe from any thread and while a call on the dataset is running (or finishing in the
    /// background after Ctrl-C): the data is released when the last such call ends.
    fn close(&self) {
        self.shared.request_close();
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.shared.request_close();
        false
    }

    /// The notebook summary (``quantem.gpu._display``).
    fn _repr_html_(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        let display = slf.py().import("quantem.gpu._display")?;
        Ok(display.getattr("dataset_html")?.call1((slf,))?.unbind())
    }

    /// Plot the mean diffraction pattern with matplotlib; returns the ``Axes``.
    #[pyo3(signature = (**kwargs))]
    fn show(slf: &Bound<'_, Self>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Py<PyAny>> {
        let display = slf.py().import("quantem.gpu._display")?;
        Ok(display.getattr("show")?.call((slf,), kwargs)?.unbind())
    }

    fn __repr__(&self) -> String {
        let (repr, dtype, backend) = self.with(|d| (d.representation(), d.dtype(), d.backend()));
        let r = match repr {
            qem::Representation::Dense => "dense",
            qem::Representation::Encoded => "encoded",
        };
        format!(
            "Dataset(shape={:?}, dtype={}, backend='{}', representation='{}'{})",
            self.shape(),
            dtype.numpy_name(),
            backend.name(),
            r,
            if self.closed() { ", closed" } else { "" }
        )
    }
}
