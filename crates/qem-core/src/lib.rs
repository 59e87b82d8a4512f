//! `qem-core`: the vocabulary every other crate of quantem.gpu speaks.
//!
//! It holds shapes and regions in `(row, col)` order, the dtype policy, acquisition metadata,
//! provenance records, the shared electron optics ([`optics`]: wavelength, aberrations, χ,
//! aperture) and the single [`Error`] type. It depends on nothing of ours; every crate
//! may depend on it. Nothing here touches files, HDF5, CUDA or the terminal.

pub mod calibration;
pub mod dense;
pub mod dtype;
pub mod error;
pub mod geometry;
pub mod metadata;
pub mod optics;
pub mod plan;
pub mod progress;
pub mod provenance;
pub mod reduce;
pub mod stats;

pub use calibration::{fit_disk_edge, DiskEdge};
pub use dense::DenseArray;
pub use dtype::{DType, DtypeRequest};
pub use error::{parse_choice, Error, ErrorDetails, ErrorKind, Result};
pub use geometry::{bin_extent, checked_product, Region, Shape2};
pub use metadata::{MaskPolicy, Metadata, ScanShapeOrigin};
pub use plan::DetectorPlan;
pub use progress::{NoProgress, Progress};
pub use provenance::{
    fnv1a64, CodecInfo, FileIdentity, MemoryReport, Provenance, StageTiming, FNV_OFFSET,
};
pub use reduce::{DetectorMask, Moments, ReduceRequest, ReduceResult, VirtualImage};

/// The package version, recorded in every provenance.
pub const PACKAGE_VERSION: &str = env!("CARGO_PKG_VERSION");
