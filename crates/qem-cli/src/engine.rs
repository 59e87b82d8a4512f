//! The few façade calls the benchmarks need that differ between the CPU and CUDA engines,
//! in one place.

use qem::{Dataset, DenseArray};

/// The whole dataset `[R_r, R_c, k_r, k_c]` copied to host memory (both backends).
pub fn to_host(ds: &Dataset) -> qem::Result<DenseArray> {
    ds.to_host()
}

/// `provenance().memory` as JSON (`null` on the CPU engine or when not recorded).
pub fn memory_json(ds: &Dataset) -> serde_json::Value {
    serde_json::to_value(ds.provenance().memory).unwrap_or(serde_json::Value::Null)
}
