//! Loading sources into a [`Dataset`], and reporting on them.

use crate::backend::BackendRequest;
use crate::dataset::{Dataset, Representation};
use qem_core::Progress;
use qem_core::DenseArray;
use qem_core::{DtypeRequest, Error, Region, Result, Shape2};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What to load.
#[derive(Debug)]
pub enum SourceArg {
    /// A Dectris master file, a plain HDF5 file with a 3-D/4-D dataset, or (later) a `.qem` file.
    Path(PathBuf),
    /// An in-memory array of shape `(R_r, R_c, k_r, k_c)` or `(N, k_r, k_c)` (then the scan
    /// shape comes from [`LoadParams::scan_shape`] or a perfect square).
    Array {
        /// The counts, row-major.
        data: DenseArray,
        /// 3 or 4 dimensions.
        shape: Vec<usize>,
    },
}

/// Options of [`load`]; `Default` is "everything, native dtype, auto backend".
#[derive(Clone)]
pub struct LoadParams {
    /// Which engine.
    pub backend: BackendRequest,
    /// Scan shape override (checked against the frames present).
    pub scan_shape: Option<Shape2>,
    /// Half-open scan region; only these frames are read.
    pub scan_region: Option<Region>,
    /// Half-open detector region in source pixels (applied before binning).
    pub detector_region: Option<Region>,
    /// Count-preserving detector binning factor (1 = none).
    pub det_bin: usize,
    /// Result dtype policy.
    pub dtype: DtypeRequest,
    /// Dense or encoded; `None` = the backend's default.
    pub representation: Option<Representation>,
    /// Zero bad pixels (from `pixel_mask`) before narrowing and binning.
    pub apply_mask: bool,
    /// Upper bound on bytes the result may occupy.
    pub memory_budget: Option<u64>,
    /// HDF5 dataset path inside a plain HDF5 file.
    pub dataset_path: Option<String>,
    /// Progress receiver.
    pub progress: Option<Arc<dyn Progress>>,
}

impl std::fmt::Debug for LoadParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadParams")
            .field("backend", &self.backend)
            .field("scan_shape", &self.scan_shape)
            .field("scan_region", &self.scan_region)
            .field("detector_region", &self.detector_region)
            .field("det_bin", &self.det_bin)
            .field("dtype", &self.dtype)
            .field("representation", &self.representation)
            .field("apply_mask", &self.apply_mask)
            .field("memory_budget", &self.memory_budget)
            .field("dataset_path", &self.dataset_path)
            .finish_non_exhaustive()
    }
}

impl Default for LoadParams {
    fn default() -> Self {
        LoadParams {
            backend: BackendRequest::Auto,
            scan_shape: None,
            scan_region: None,
            detector_region: None,
            det_bin: 1,
            dtype: DtypeRequest::Native,
            representation: None,
            apply_mask: true,
            memory_budget: None,
            dataset_path: None,
            progress: None,
        }
    }
}

/// Readiness report of a source, made without decoding pixels (placeholder until `qem-io`'s
/// inspection lands; serialises to the JSON the CLI prints and Python returns as a dict).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Inspection {
    /// Whether the source can be loaded as it is.
    pub ready: bool,
    /// Why not, when not ready.
    pub reason: Option<String>,
}

/// Load `source` with `params`.
pub fn load(_source: SourceArg, _params: &LoadParams) -> Result<Dataset> {
    Err(Error::internal(
        "load",
        "the CPU engine is not wired in yet",
    ))
}

/// Report on a source's readiness without decoding pixels.
pub fn inspect(path: &Path, _scan_shape: Option<Shape2>) -> Result<Inspection> {
    Err(Error::internal("inspect", "not wired in yet").with_file(path))
}

/// Every Dectris master file (`*_master.h5`) under `folder`, recursively, sorted.
pub fn discover(folder: &Path) -> Result<Vec<PathBuf>> {
    Err(Error::internal("discover", "not wired in yet").with_file(folder))
}
