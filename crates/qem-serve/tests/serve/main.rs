//! The browse service's integration tests: one binary (one link), real HTTP over loopback, CPU
//! backend. `api`: every route against independent arithmetic and the façade; `security`: the
//! token, cookie, traversal, catalog confinement and input limits; `load`: queueing, stop and
//! the LRU. Bounded resident memory under 1,000 requests is `serve_memory.rs`, its own process.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod api;
mod common;
mod load;
mod security;
