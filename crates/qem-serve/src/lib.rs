//! `qem-serve`: the browse service of quantem.gpu (docs/browse.md).
//!
//! A local HTTP API (axum on a tokio runtime of its own) and an embedded web page onto resident
//! acquisitions: a file, a folder's catalog, a dataset shared by the caller, or the built-in
//! demo. Engine work goes only through the `qem` façade, on blocking threads, one call at a time
//! per device. Users: the `quantem-gpu serve` command (qem-cli), the Python binding (qem-py) and
//! the latency benchmark (qem-bench). It may depend on `qem` and `qem-sim`, never on those users.

mod config;
mod server;

pub use config::{ServeOptions, ServeRoot, SharedDataset, TokenMode};
pub use server::{start, Server};
