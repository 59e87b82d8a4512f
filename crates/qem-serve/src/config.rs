//! What the service serves ([`ServeRoot`]) and how ([`ServeOptions`], [`TokenMode`]).

use std::path::PathBuf;
use std::sync::Arc;

/// What the service serves.
#[derive(Debug, Clone)]
pub enum ServeRoot {
    /// A file (one acquisition) or a folder (a catalog of every acquisition under it, rescanned
    /// on each catalog request).
    Path(PathBuf),
    /// A dataset already loaded by the caller (e.g. from Python), shared, never copied and never
    /// released by the service.
    Dataset {
        /// The name the catalog shows.
        name: String,
        /// The caller's dataset.
        handle: Arc<dyn SharedDataset>,
    },
    /// The built-in simulated acquisition, written to a temporary folder that lives as long as
    /// the server.
    Demo,
}

/// A dataset the caller owns and the service reads.
pub trait SharedDataset: Send + Sync + std::fmt::Debug + 'static {
    /// Run `f` with the dataset; an error (e.g. kind `InvalidArgument`, "closed") when it was
    /// closed. The service answers such an error with `closed` (410).
    fn with_dataset(&self, f: &mut dyn FnMut(&qem::Dataset)) -> qem::Result<()>;
}

/// How requests are authorised.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum TokenMode {
    /// A random 32-byte token (64 hex digits) made at start.
    #[default]
    Random,
    /// This token (non-empty).
    Fixed(String),
    /// No token: allowed on loopback addresses only.
    Disabled,
}

/// Options of [`crate::start`].
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Address to bind (default `"127.0.0.1"`).
    pub host: String,
    /// Port to bind (0 = any free port).
    pub port: u16,
    /// How requests are authorised.
    pub token: TokenMode,
    /// Engine for acquisitions the service loads itself.
    pub backend: qem::BackendRequest,
    /// Representation of acquisitions the service loads (`None`: the backend's default).
    pub representation: Option<qem::Representation>,
    /// Upper bound on the bytes of acquisitions the service keeps loaded (`None`: 80 % of the
    /// device memory on CUDA, half of the machine's memory on the CPU).
    pub memory_budget: Option<u64>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            host: "127.0.0.1".into(),
            port: 0,
            token: TokenMode::Random,
            backend: qem::BackendRequest::Auto,
            representation: None,
            memory_budget: None,
        }
    }
}
