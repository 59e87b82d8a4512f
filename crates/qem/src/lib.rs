//! `qem`: the façade of quantem.gpu.
//!
//! Users (the CLI, the Python module, Rust programs) call this crate only. It resolves a backend
//! ([`backend`]), loads sources into a [`Dataset`] ([`load`]), and reports on sources without
//! decoding them ([`inspect`], [`discover`]), and saves/reopens ENCODED datasets as `.qem`
//! files ([`save`], [`read_qem`]). Engines (`qem-cpu`, `qem-cuda`) sit below it;
//! composite operations are written once here over their primitives.

/// `Display` as the type's own `name()` (the lower-case name its `FromStr` reads back).
macro_rules! display_by_name {
    ($($ty:ty),+) => {
        $(impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        })+
    };
}

pub mod backend;
pub mod calibration;
pub mod dataset;
pub mod detector;
pub mod dpc;
mod encode;
pub mod load;
pub mod progress;
pub mod qemfile;
pub mod result;
pub mod ssb;

pub use backend::{available_backends, resolve_backend, Backend, BackendInfo, BackendRequest};
pub use dataset::{CudaArrayView, Dataset, Representation};
pub use load::{
    default_representation, discover, inspect, load, Inspection, LoadParams, SourceArg,
    GIT_REVISION,
};
/// Summary statistics (percentiles) the tools print and record.
pub use qem_core::stats;
pub use qem_cpu::EncodedFrames;
pub use qemfile::{
    qem_file_error, read_qem, save, QemContents, QemReadParams, SaveSummary, QEM_FORMAT_NAME,
};
pub use result::ResultProvenance;

pub use qem_core::{
    CodecInfo, DType, DenseArray, DtypeRequest, Error, ErrorKind, MaskPolicy, MemoryReport,
    Metadata, NoProgress, Progress, Provenance, Region, Result, ScanShapeOrigin, Shape2,
    StageTiming,
};
