//! The Python exception hierarchy and the conversion of [`qem::Error`] into it.
//!
//! `QuantemError(Exception)` is the root; each [`ErrorKind`] has one subclass. Three of them also
//! derive from the built-in exception a Python user would catch for that kind of problem
//! (`ValueError`, `OSError`), so they are made with `type(name, bases, ns)` at module import.
//! The message is the Rust `Display` string; `kind`, `op`, `file`, `frame`, `expected`, `found`
//! and `detail` are set on the instance.

use pyo3::exceptions::{PyException, PyOSError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use qem::{Error, ErrorKind};

pyo3::create_exception!(
    quantem.gpu,
    QuantemError,
    PyException,
    "Base class of every error raised by quantem.gpu."
);
pyo3::create_exception!(
    quantem.gpu,
    SourceError,
    QuantemError,
    "The source is missing, malformed, inconsistent or incomplete (missing shard, unwritten chunk, wrong scan shape)."
);
pyo3::create_exception!(
    quantem.gpu,
    DecodeError,
    QuantemError,
    "Compressed bytes do not decode (corrupt LZ4, truncated chunk, bad header)."
);
pyo3::create_exception!(
    quantem.gpu,
    BackendUnavailableError,
    QuantemError,
    "The requested backend cannot be used here; the message says why."
);
pyo3::create_exception!(
    quantem.gpu,
    DeviceLostError,
    QuantemError,
    "The GPU context hit a sticky fault: everything resident on it is lost; the message names the first fault and where it happened. Restart the process to use the GPU again (the CPU backend keeps working)."
);
pyo3::create_exception!(
    quantem.gpu,
    MemoryBudgetError,
    QuantemError,
    "The operation needs more memory than the budget allows."
);

/// The exception classes with two bases, made once per interpreter.
struct DualTypes {
    invalid_argument: Py<PyType>,
    /// `ArgumentTypeError(InvalidArgumentError, TypeError)`: an argument of the wrong type (a
    /// float where an integer is meant, a string for a flag). Raised by the Python layer's
    /// argument checks; a `TypeError` too, so code that caught the built-in still does.
    argument_type: Py<PyType>,
    overflow: Py<PyType>,
    io: Py<PyType>,
}

static DUAL_TYPES: PyOnceLock<DualTypes> = PyOnceLock::new();

fn dual_type(
    py: Python<'_>,
    name: &str,
    builtin: Bound<'_, PyType>,
    doc: &str,
) -> PyResult<Py<PyType>> {
    class_with_bases(py, name, [py.get_type::<QuantemError>(), builtin], doc)
}

fn class_with_bases<'py>(
    py: Python<'py>,
    name: &str,
    bases: [Bound<'py, PyType>; 2],
    doc: &str,
) -> PyResult<Py<PyType>> {
    let bases = PyTuple::new(py, bases)?;
    let ns = PyDict::new(py);
    ns.set_item("__module__", "quantem.gpu")?;
    ns.set_item("__doc__", doc)?;
    let ty = py
        .import("builtins")?
        .getattr("type")?
        .call1((name, bases, ns))?;
    Ok(ty.cast_into::<PyType>()?.unbind())
}

fn dual_types(py: Python<'_>) -> PyResult<&'static DualTypes> {
    DUAL_TYPES.get_or_try_init(py, || {
        let invalid_argument = dual_type(
            py,
            "InvalidArgumentError",
            py.get_type::<PyValueError>(),
            "An argument is invalid (region out of bounds, zero bin, unknown name, closed dataset).",
        )?;
        let argument_type = class_with_bases(
            py,
            "ArgumentTypeError",
            [
                invalid_argument.bind(py).clone(),
                py.get_type::<PyTypeError>(),
            ],
            "An argument has the wrong type (a float where an integer is meant, a non-bool flag); an InvalidArgumentError and a TypeError.",
        )?;
        Ok(DualTypes {
            invalid_argument,
            argument_type,
            overflow: dual_type(
                py,
                "DtypeOverflowError",
                py.get_type::<PyValueError>(),
                "A value does not fit the requested dtype (u32 data narrowed to u16).",
            )?,
            io: dual_type(
                py,
                "QuantemIOError",
                py.get_type::<PyOSError>(),
                "An operating-system I/O error (open, read, write).",
            )?,
        })
    })
}

/// The Python class for `kind`.
fn class_for<'py>(py: Python<'py>, kind: ErrorKind) -> PyResult<Bound<'py, PyType>> {
    let dual = dual_types(py)?;
    Ok(match kind {
        ErrorKind::Source => py.get_type::<SourceError>(),
        ErrorKind::Decode => py.get_type::<DecodeError>(),
        ErrorKind::InvalidArgument => dual.invalid_argument.bind(py).clone(),
        ErrorKind::Overflow => dual.overflow.bind(py).clone(),
        ErrorKind::BackendUnavailable => py.get_type::<BackendUnavailableError>(),
        ErrorKind::MemoryBudget => py.get_type::<MemoryBudgetError>(),
        ErrorKind::DeviceLost => py.get_type::<DeviceLostError>(),
        ErrorKind::Io => dual.io.bind(py).clone(),
        ErrorKind::Internal => py.get_type::<QuantemError>(),
    })
}

fn kind_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Source => "source",
        ErrorKind::Decode => "decode",
        ErrorKind::InvalidArgument => "invalid_argument",
        ErrorKind::Overflow => "overflow",
        ErrorKind::BackendUnavailable => "backend_unavailable",
        ErrorKind::MemoryBudget => "memory_budget",
        ErrorKind::DeviceLost => "device_lost",
        ErrorKind::Io => "io",
        ErrorKind::Internal => "internal",
    }
}

fn build(py: Python<'_>, err: &Error) -> PyResult<PyErr> {
    let cls = class_for(py, err.kind)?;
    let exc = cls.call1((err.to_string(),))?;
    exc.setattr("kind", kind_name(err.kind))?;
    exc.setattr("op", &err.op)?;
    exc.setattr(
        "file",
        err.file.as_ref().map(|f| f.to_string_lossy().into_owned()),
    )?;
    exc.setattr("frame", err.frame)?;
    exc.setattr("expected", err.expected.as_deref())?;
    exc.setattr("found", err.found.as_deref())?;
    exc.setattr("detail", &err.detail)?;
    Ok(PyErr::from_value(exc))
}

/// Convert a library error into its Python exception (a failure to build it becomes that failure).
pub fn to_pyerr(err: Error) -> PyErr {
    Python::attach(|py| build(py, &err).unwrap_or_else(|e| e))
}

/// `Result` conversion used by every binding.
pub trait IntoPyResult<T> {
    /// Map the error into its Python exception.
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for qem::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_pyerr)
    }
}

/// Add the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("QuantemError", py.get_type::<QuantemError>())?;
    m.add("SourceError", py.get_type::<SourceError>())?;
    m.add("DecodeError", py.get_type::<DecodeError>())?;
    m.add(
        "BackendUnavailableError",
        py.get_type::<BackendUnavailableError>(),
    )?;
    m.add("MemoryBudgetError", py.get_type::<MemoryBudgetError>())?;
    m.add("DeviceLostError", py.get_type::<DeviceLostError>())?;
    let dual = dual_types(py)?;
    m.add("InvalidArgumentError", dual.invalid_argument.bind(py))?;
    m.add("ArgumentTypeError", dual.argument_type.bind(py))?;
    m.add("DtypeOverflowError", dual.overflow.bind(py))?;
    m.add("QuantemIOError", dual.io.bind(py))?;
    Ok(())
}
