//! [`Dataset`]: a loaded acquisition `I[R_r, R_c, k_r, k_c]` with its metadata and provenance.

use crate::backend::Backend;
use qem_core::{DType, DenseArray, Error, Metadata, Provenance, Result, Shape2};

/// How the counts are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Representation {
    /// Plain `u8`/`u16`/`u32` array.
    Dense,
    /// rANS-coded counts, decoded on the fly (one stream per frame).
    Encoded,
}

qem_core::named_choice! {
    /// Lower-case name (`"dense"`, `"encoded"`).
    Representation, "load", "representation", { Dense => "dense", Encoded => "encoded" }
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

/// Where the data lives, and in which representation. A new form (e.g. `CudaEncoded`) adds a
/// variant here and an arm in the few `match`es of this file; nothing else matches on it.
#[derive(Debug)]
pub(crate) enum Storage {
    /// Dense array in host memory (CPU engine).
    CpuDense(DenseArray),
    /// Dense array in GPU memory (CUDA engine).
    CudaDense(qem_cuda::DeviceArray),
    /// rANS-coded frames in host memory (CPU engine). Frames are `u16`; a `u8` dataset
    /// narrows them on decode ([`Dataset::dtype`] says which).
    CpuEncoded(qem_cpu::EncodedFrames),
    /// rANS-coded frames in GPU memory (CUDA engine; `u16` counts).
    CudaEncoded(qem_cuda::DeviceEncoded),
    /// Released by [`Dataset::close`].
    Closed,
}

impl Storage {
    /// The representation of live storage (`None` once closed).
    pub(crate) fn representation(&self) -> Option<Representation> {
        match self {
            Storage::CpuEncoded(_) | Storage::CudaEncoded(_) => Some(Representation::Encoded),
            Storage::CpuDense(_) | Storage::CudaDense(_) => Some(Representation::Dense),
            Storage::Closed => None,
        }
    }
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
    /// Results a detector operation may reuse (the sum DP behind the BF disk fit).
    pub(crate) detector_cache: crate::detector::DetectorCache,
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
    /// Dense or encoded (a closed dataset answers what it held).
    pub fn representation(&self) -> Representation {
        self.storage
            .representation()
            .unwrap_or(match self.provenance.representation.as_deref() {
                Some("encoded") => Representation::Encoded,
                _ => Representation::Dense,
            })
    }
    /// Bytes the data occupies where it lives (0 once closed): the dense array, or for ENCODED
    /// data the streams, their index and the model.
    pub fn nbytes_resident(&self) -> u64 {
        match &self.storage {
            Storage::CpuDense(a) => a.nbytes() as u64,
            Storage::CudaDense(a) => a.nbytes(),
            Storage::CpuEncoded(e) => e.nbytes(),
            Storage::CudaEncoded(e) => e.nbytes(),
            Storage::Closed => 0,
        }
    }
    /// Bytes a dense copy of the whole dataset takes.
    pub fn nbytes_dense(&self) -> u64 {
        self.shape().iter().map(|&n| n as u64).product::<u64>() * self.dtype.size() as u64
    }
    /// The host-resident encoded frames (`None` unless the dataset is ENCODED on the CPU).
    pub fn encoded(&self) -> Option<&qem_cpu::EncodedFrames> {
        match &self.storage {
            Storage::CpuEncoded(e) => Some(e),
            _ => None,
        }
    }
    /// The GPU-resident encoded frames (`None` unless the dataset is ENCODED on CUDA).
    pub fn encoded_cuda(&self) -> Option<&qem_cuda::DeviceEncoded> {
        match &self.storage {
            Storage::CudaEncoded(e) => Some(e),
            _ => None,
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
            Storage::CpuEncoded(_) | Storage::CudaEncoded(_) => Err(Error::invalid(
                op,
                "the data is held ENCODED (rANS); use to_host() for a decoded copy or frame() for one frame",
            )
            .with_expected("representation dense")
            .with_found("representation encoded")),
            Storage::Closed => Err(Error::invalid(op, "the dataset has been closed")),
        }
    }
    /// A host copy of the whole dense array: a clone on the CPU, a download from the GPU, a
    /// parallel decode of ENCODED data (admitted against the host's available memory first).
    pub fn to_host(&self) -> Result<DenseArray> {
        match &self.storage {
            Storage::CpuDense(a) => Ok(a.clone()),
            Storage::CudaDense(a) => a.download(),
            Storage::CpuEncoded(e) => {
                crate::load::admit(self.nbytes_dense(), None)
                    .map_err(|err| err.with_op("to_host (decode ENCODED data)"))?;
                let counts = e.decode_all()?;
                Ok(narrow(counts, self.dtype))
            }
            Storage::CudaEncoded(e) => {
                crate::load::admit(self.nbytes_dense(), None)
                    .map_err(|err| err.with_op("to_host (decode ENCODED data on the GPU)"))?;
                let eng = qem_cuda::engine()?;
                let counts = e.download_frames(&eng.gpu, eng.rans()?, 0, e.n_frames())?;
                Ok(narrow(counts, self.dtype))
            }
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
    /// The CUDA device ordinal holding the data (`None` for CPU datasets and closed ones).
    pub fn cuda_ordinal(&self) -> Option<usize> {
        match &self.storage {
            Storage::CudaDense(a) => Some(a.device_ordinal()),
            Storage::CudaEncoded(e) => Some(e.device_ordinal()),
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
        match &self.storage {
            Storage::CudaDense(a) => return a.download_frame(index),
            Storage::CpuEncoded(e) => {
                let mut out = vec![0u16; frame_len];
                e.decode_frame(index, &mut out)?;
                return Ok(narrow(out, self.dtype));
            }
            Storage::CudaEncoded(e) => {
                let eng = qem_cuda::engine()?;
                let out = e.download_frames(&eng.gpu, eng.rans()?, index as u64, 1)?;
                return Ok(narrow(out, self.dtype));
            }
            _ => {}
        }
        Ok(self.dense_ref("frame")?.slice(index * frame_len, frame_len))
    }
    /// The whole dense array `[R_r, R_c, k_r, k_c]`, borrowed (CPU datasets only; a CUDA
    /// dataset answers with an error pointing to [`Dataset::to_host`]).
    pub fn dense(&self) -> Result<&DenseArray> {
        self.dense_ref("dense")
    }
}

/// Decoded `u16` counts in the dataset's dtype: `u8` datasets were stored widened from `u8`
/// values, so narrowing is exact.
pub(crate) fn narrow(counts: Vec<u16>, dtype: DType) -> DenseArray {
    match dtype {
        DType::U8 => DenseArray::U8(counts.into_iter().map(|v| v as u8).collect()),
        _ => DenseArray::U16(counts),
    }
}
