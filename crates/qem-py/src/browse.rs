//! The browse service started from Python: `_browse_serve` and the `BrowseServer` handle.
//!
//! The server ([`qem_serve`]) runs on threads of its own and never touches Python. A dataset
//! served from Python is shared, not copied: the server holds the same `Arc<Shared>` as the
//! Python `Dataset` and reads it through [`Shared::read`], like every long call of this crate
//! (a read guard while it works, never a write, so `ds.close()` never waits for the server and
//! the server never waits for Python). Once `close()` was asked for, the server is told
//! "closed" without touching the data. Starting and stopping release the GIL; the argument
//! checks users read are in `python/quantem/gpu/browse.py`.

use crate::dataset::{PyDataset, Shared};
use crate::errors::{to_pyerr, IntoPyResult};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyString};
use qem::{BackendRequest, Error, Representation};
use qem_serve::{ServeOptions, ServeRoot, Server, SharedDataset, TokenMode};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A Python `Dataset` as the server sees it: the live dataset, refused once closing.
#[derive(Debug)]
struct LiveDataset(Arc<Shared>);

/// The error the server answers as `closed` (410) for a dataset closed from Python.
fn closed(op: &str) -> Error {
    Error::invalid(op, "the dataset has been closed")
        .with_expected("an open dataset")
        .with_found("closed")
}

impl SharedDataset for LiveDataset {
    fn with_dataset(&self, f: &mut dyn FnMut(&qem::Dataset)) -> qem::Result<()> {
        // Checked before and under the guard: a close asked for while a request is running
        // releases the data when that request ends, and the next one is refused here.
        if self.0.closing() {
            return Err(closed("browse"));
        }
        self.0.read(|ds| {
            if ds.is_closed() {
                Err(closed("browse"))
            } else {
                f(ds);
                Ok(())
            }
        })
    }
}

/// The name the catalog shows for a dataset: its first source file's name, else its kind.
fn dataset_name(ds: &qem::Dataset) -> String {
    let prov = ds.provenance();
    prov.files
        .first()
        .and_then(|f| f.path.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| prov.source_kind.clone())
}

/// A running browse service (made by `quantem.gpu.browse.serve`); stopped on `stop()` or when
/// the handle is dropped.
#[pyclass(name = "BrowseServer", module = "quantem.gpu._native", frozen)]
#[derive(Debug)]
pub struct PyBrowseServer {
    server: Server,
    url: String,
    token: Option<String>,
    host: String,
    port: u16,
    stopped: AtomicBool,
}

impl PyBrowseServer {
    fn stop_once(&self) {
        if !self.stopped.swap(true, Ordering::SeqCst) {
            self.server.stop();
        }
    }
}

impl Drop for PyBrowseServer {
    fn drop(&mut self) {
        // Stopping waits for requests in flight (an engine call may take seconds): without the
        // GIL, so Python threads keep running meanwhile. The server never needs the GIL, so
        // stopping with it held (an interpreter shutting down) cannot deadlock either.
        let this = &*self;
        if Python::try_attach(|py| py.detach(|| this.stop_once())).is_none() {
            this.stop_once();
        }
    }
}

#[pymethods]
impl PyBrowseServer {
    /// The page's address, with `?token=` when a token is required.
    #[getter]
    fn url(&self) -> &str {
        &self.url
    }

    /// The token requests must carry (`None` when disabled).
    #[getter]
    fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// The address the service is bound to.
    #[getter]
    fn host(&self) -> &str {
        &self.host
    }

    /// The port the service listens on.
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// True once `stop()` was called.
    #[getter]
    fn stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// Stop serving and free the port (the GIL is released while the server shuts down);
    /// calling it again does nothing.
    fn stop(&self, py: Python<'_>) {
        py.detach(|| self.stop_once());
    }
}

/// Start the browse service; see `quantem.gpu.browse.serve` for the documented signature.
///
/// `source` is a `Dataset`, the `str` `"demo"`, or a path (`str` other than `"demo"`, or
/// `os.PathLike`); `token` is `None` (random), `False` (disabled) or the fixed token.
#[pyfunction]
#[pyo3(signature = (source, backend, host, port, token, memory_budget, representation))]
#[allow(clippy::too_many_arguments)]
fn _browse_serve(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
    backend: &str,
    host: String,
    port: u16,
    token: Option<&Bound<'_, PyAny>>,
    memory_budget: Option<u64>,
    representation: Option<&str>,
) -> PyResult<PyBrowseServer> {
    let root = if let Ok(ds) = source.cast::<PyDataset>() {
        let ds = ds.get();
        ds.check_open("browse.serve")?;
        ServeRoot::Dataset {
            name: ds.with(dataset_name),
            handle: Arc::new(LiveDataset(ds.shared())),
        }
    } else if source.is_instance_of::<PyString>() && source.extract::<String>()? == "demo" {
        ServeRoot::Demo
    } else {
        ServeRoot::Path(source.extract::<PathBuf>()?)
    };
    let token = match token {
        None => TokenMode::Random,
        Some(t) if t.is_instance_of::<PyBool>() => {
            if t.extract::<bool>()? {
                TokenMode::Random
            } else {
                TokenMode::Disabled
            }
        }
        Some(t) => TokenMode::Fixed(t.extract::<String>()?),
    };
    let opts = ServeOptions {
        host,
        port,
        token,
        backend: backend.parse::<BackendRequest>().py()?,
        representation: representation
            .map(str::parse::<Representation>)
            .transpose()
            .py()?,
        memory_budget,
    };
    let server = py
        .detach(|| qem_serve::start(root, opts))
        .map_err(to_pyerr)?;
    let addr = server.addr();
    Ok(PyBrowseServer {
        url: server.url(),
        token: server.token(),
        host: addr.ip().to_string(),
        port: addr.port(),
        server,
        stopped: AtomicBool::new(false),
    })
}

/// Add the browse class and function to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBrowseServer>()?;
    m.add_function(wrap_pyfunction!(_browse_serve, m)?)?;
    Ok(())
}
