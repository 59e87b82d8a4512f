//! The façade calls whose CPU and CUDA forms differ, in one place.

use qem::{CudaArrayView, Dataset, DenseArray};

/// The whole dataset copied to host memory (a clone on the CPU, a download from the GPU).
pub fn to_host(ds: &Dataset) -> qem::Result<DenseArray> {
    ds.to_host()
}

/// The device buffer of a CUDA dataset (complete and synchronized); `None` for CPU datasets
/// and closed ones.
pub fn device_view(ds: &Dataset) -> Option<CudaArrayView> {
    ds.cuda_array()
}
