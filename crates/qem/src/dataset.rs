//! [`Dataset`]: a loaded acquisition `I[R_r, R_c, k_r, k_c]` with its metadata and provenance.

use crate::backend::Backend;
use qem_core::{DType, DenseArray, Error, Metadata, Provenance, Result, Shape2};

/// How the counts are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Representation {
    /// Plain `u8`/`u16`/`u32` array.
    Dense,
    /// rANS-coded counts (a later issue).
    Encoded,
}

/// A dense array in GPU memory, for zero-copy hand-off (e.g. `__cuda_array_interface__` or
/// DLPack). The data is fully written and synchronized when this is returned, and stays valid
/// while the [`Dataset`] is alive and not closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaArrayView {
    /// Device address of element 0.
    pub device_ptr: u64,
    /// `[R_r, R_c, k_r, k_c]`, row-major, contiguous.
    pub shape: [usize; 4],
    /// Element type.
    pub dtype: DType,
    /// CUDA device ordinal.
    pub device_ordinal: usize,
}

/// Where the data lives.
#[derive(Debug)]
pub(crate) enum Storage {
    /// Dense array in host memory (CPU engine).
    CpuDense(DenseArray),
    /// Dense array in GPU memory (CUDA engine).
    CudaDense(qem_cuda::DeviceArray),
    /// Released by [`Dataset::close`].
    Closed,
}

/// A loaded 4D-STEM acquisition.
#[derive(Debug)]
pub struct Dataset {
    pub(crate) scan_shape: Shape2,
    pub(crate) detector_shape: Shape2,
    pub(crate) dtype: DType,
    pub(crate) backend: Backend,
    pub(crate) device: String,
    pub(crate) metadata: Metadata,
    pub(crate) provenance: Provenance,
    pub(crate) storage: Storage,
}

impl Dataset {
    /// `[R_r, R_c, k_r, k_c]` of the loaded data (after regions and binning).
    pub fn shape(&self) -> [usize; 4] {
        [
            self.scan_shape.rows,
            self.scan_shape.cols,
            self.detector_shape.rows,
            self.detector_shape.cols,
        ]
    }
    /// Scan grid of the loaded data.
    pub fn scan_shape(&self) -> Shape2 {
        self.scan_shape
    }
    /// Detector frame shape of the loaded data.
    pub fn detector_shape(&self) -> Shape2 {
        self.detector_shape
    }
    /// Element type of the loaded data.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Engine holding the data.
    pub fn backend(&self) -> Backend {
        self.backend
    }
    /// Device description.
    pub fn device(&self) -> &str {
        &self.device
    }
    /// Source metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }
    /// How this dataset was made.
    pub fn provenance(&self) -> &Provenance {
        &self.provenance
    }
    /// Dense or encoded.
    pub fn representation(&self) -> Representation {
        Representation::Dense
    }
    /// Bytes the data occupies where it lives (0 once closed).
    pub fn nbytes_resident(&self) -> u64 {
        match &self.storage {
            Storage::CpuDense(a) => a.nbytes() as u64,
            Storage::CudaDense(a) => a.nbytes(),
            Storage::Closed => 0,
        }
    }
    /// True after [`Dataset::close`].
    pub fn is_closed(&self) -> bool {
        matches!(self.storage, Storage::Closed)
    }
    /// Release the data (host or device memory); later access is an error.
    pub fn close(&mut self) {
        self.storage = Storage::Closed;
    }
    fn dense_ref(&self, op: &str) -> Result<&DenseArray> {
        match &self.storage {
            Storage::CpuDense(a) => Ok(a),
            Storage::CudaDense(_) => Err(Error::invalid(
                op,
                "the data is on the GPU (backend \"cuda\"); use to_host() for a host copy",
            )),
            Storage::Closed => Err(Error::invalid(op, "the dataset has been closed")),
        }
    }
    /// A host copy of the whole dense array: a clone on the CPU, a download from the GPU.
    pub fn to_host(&self) -> Result<DenseArray> {
        match &self.storage {
            Storage::CpuDense(a) => Ok(a.clone()),
            Storage::CudaDense(a) => a.download(),
            Storage::Closed => Err(Error::invalid("to_host", "the dataset has been closed")),
        }
    }
    /// The GPU-resident array, when the data is on the GPU (`None` on the CPU or once closed).
    pub fn cuda_array(&self) -> Option<CudaArrayView> {
        match &self.storage {
            Storage::CudaDense(a) => Some(CudaArrayView {
                device_ptr: a.device_ptr(),
                shape: a.shape(),
                dtype: a.dtype(),
                device_ordinal: a.device_ordinal(),
            }),
            _ => None,
        }
    }
    /// One frame `(k_r, k_c)` at scan position `(row, col)`, as a copy.
    pub fn frame(&self, row: usize, col: usize) -> Result<DenseArray> {
        if row >= self.scan_shape.rows || col >= self.scan_shape.cols {
            return Err(Error::invalid(
                "frame",
                format!("scan position ({row}, {col}) is outside the scan"),
            )
            .with_expected(format!(
                "row < {}, col < {}",
                self.scan_shape.rows, self.scan_shape.cols
            ))
            .with_found(format!("({row}, {col})")));
        }
        let frame_len = self.detector_shape.len();
        let index = row * self.scan_shape.cols + col;
        if let Storage::CudaDense(a) = &self.storage {
            return a.download_frame(index);
        }
        Ok(self.dense_ref("frame")?.slice(index * frame_len, frame_len))
    }
    /// The whole dense array `[R_r, R_c, k_r, k_c]`, borrowed (CPU datasets only; a CUDA
    /// dataset answers with an error pointing to [`Dataset::to_host`]).
    pub fn dense(&self) -> Result<&DenseArray> {
        self.dense_ref("dense")
    }
}
