//! `qem-serve`: the browse service of quantem.gpu (docs/browse.md).
//!
//! A local HTTP API (axum on a tokio runtime of its own) and an embedded web page onto resident
//! acquisitions: a file, a folder's catalog, a dataset shared by the caller, or the built-in
//! demo. Engine work goes only through the `qem` façade, on blocking threads, one call at a time
//! per device. Users: the `quantem-gpu serve` command (qem-cli), the Python binding (qem-py) and
//! the latency benchmark (qem-bench). It may depend on `qem` and `qem-sim`, never on those users.
//!
//! Files: `config` (what and how to serve), `server` (start/stop), `auth` (the token), `catalog`
//! (ids, loading, LRU, per-acquisition cache), `state` (the device permit and blocking calls),
//! `params` (query parsing and limits), `views` (exact binning and masks on the host),
//! `payload` (raw and `.npy` answers), `error` (JSON errors), `jobs` (background fits) and
//! `routes/` (one file per area).

mod auth;
mod catalog;
mod config;
mod error;
mod jobs;
mod params;
mod payload;
mod routes;
mod server;
mod state;
mod views;

pub use config::{ServeOptions, ServeRoot, SharedDataset, TokenMode};
pub use server::{start, Server};
