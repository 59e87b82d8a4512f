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

/// Where the data lives.
#[derive(Debug)]
pub(crate) enum Storage {
    /// Dense array in host memory (CPU engine).
    CpuDense(DenseArray),
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
            Storage::Closed => 0,
        }
    }
    /// True after [`Dataset::close`].
    pub fn is_closed(&self) -> bool {
        matches!(self.storage, Storage::Closed)
    }
    /// Release the data; later access is an error.
    pub fn close(&mut self) {
        self.storage = Storage::Closed;
    }
    fn dense_ref(&self, op: &str) -> Result<&DenseArray> {
        match &self.storage {
            Storage::CpuDense(a) => Ok(a),
            Storage::Closed => Err(Error::invalid(op, "the dataset has been closed")),
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
        let start = (row * self.scan_shape.cols + col) * frame_len;
        Ok(self.dense_ref("frame")?.slice(start, frame_len))
    }
    /// The whole dense array `[R_r, R_c, k_r, k_c]`, borrowed.
    pub fn dense(&self) -> Result<&DenseArray> {
        self.dense_ref("dense")
    }
}
