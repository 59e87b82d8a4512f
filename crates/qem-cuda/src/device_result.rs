//! Reduction results that stay in device memory ([`DeviceReduceResult`]), for callers that hand
//! them on to other GPU code (DLPack, the CUDA Array Interface) instead of bringing them to the
//! host: [`crate::products::reduce_dense_on_device`] and
//! [`crate::products::reduce_encoded_on_device`] make them.
//!
//! Ownership: each array ([`DeviceVec`]) is a range of one device allocation held by an `Arc`;
//! the allocation is freed when the last `DeviceVec` viewing it is dropped. A consumer that
//! keeps a clone (an exported DLPack tensor keeps one until its deleter runs) keeps the memory,
//! whatever happens to the dataset the result came from (a result owns its own allocations) or
//! to the result object that handed it out.
//!
//! Completeness: the engine synchronizes its stream before a result exists (see
//! `products::finish_device`), so the values are final for every stream and every reader.

use std::sync::Arc;

use qem_core::{Error, Moments, ReduceResult, Result, StageTiming, VirtualImage};

use crate::mem::DevBuf;

/// Element type of a device result array.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResultDType {
    /// `u32` (the max DP).
    U32,
    /// `u64` (exact sums: integer images, the sum DP, the moments).
    U64,
    /// `f64` (images of float masks, the centre of mass).
    F64,
    /// `f32` (the mean DP).
    F32,
}

impl ResultDType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ResultDType::U32 | ResultDType::F32 => 4,
            ResultDType::U64 | ResultDType::F64 => 8,
        }
    }

    /// NumPy's name (`"uint32"`, `"uint64"`, `"float64"`, `"float32"`).
    pub fn numpy_name(self) -> &'static str {
        match self {
            ResultDType::U32 => "uint32",
            ResultDType::U64 => "uint64",
            ResultDType::F64 => "float64",
            ResultDType::F32 => "float32",
        }
    }

    /// True for floating-point elements.
    pub fn is_float(self) -> bool {
        matches!(self, ResultDType::F64 | ResultDType::F32)
    }
}

/// The values of a [`DeviceVec`] brought to the host.
#[derive(Debug, Clone, PartialEq)]
pub enum HostVec {
    /// `u32` values.
    U32(Vec<u32>),
    /// `u64` values.
    U64(Vec<u64>),
    /// `f64` values.
    F64(Vec<f64>),
    /// `f32` values.
    F32(Vec<f32>),
}

/// One result array in device memory: `len` values of `dtype` from byte `offset` of a device
/// allocation shared with the other arrays of the same launch (the images of one launch lie one
/// after another in one buffer). Cloning shares the allocation; it is freed when the last clone
/// is dropped.
#[derive(Debug, Clone)]
pub struct DeviceVec {
    buf: Arc<DevBuf>,
    offset: usize,
    len: usize,
    dtype: ResultDType,
    ordinal: usize,
}

impl DeviceVec {
    /// `len` values of `dtype` at byte `offset` of `buf` (on device `ordinal`); an error when
    /// the range leaves the buffer or is not aligned to the element size.
    pub(crate) fn new(
        buf: Arc<DevBuf>,
        offset: usize,
        len: usize,
        dtype: ResultDType,
        ordinal: usize,
    ) -> Result<DeviceVec> {
        let end = len
            .checked_mul(dtype.size())
            .and_then(|b| b.checked_add(offset));
        if end.is_none_or(|e| e > buf.bytes()) || offset % dtype.size() != 0 {
            return Err(Error::internal(
                "device result",
                "a result range lies outside its device buffer",
            )
            .with_expected(format!("{} bytes, element-aligned", buf.bytes()))
            .with_found(format!("{len} {} from byte {offset}", dtype.numpy_name())));
        }
        Ok(DeviceVec {
            buf,
            offset,
            len,
            dtype,
            ordinal,
        })
    }

    /// The allocation and the byte offset of element 0 in it.
    pub(crate) fn buffer(&self) -> (&DevBuf, usize) {
        (&self.buf, self.offset)
    }

    /// Device address of element 0 (aligned to the element size).
    pub fn device_ptr(&self) -> u64 {
        self.buf.ptr() + self.offset as u64
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when it holds no value.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Element type.
    pub fn dtype(&self) -> ResultDType {
        self.dtype
    }

    /// Bytes of the values.
    pub fn nbytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// CUDA ordinal of the device holding it.
    pub fn device_ordinal(&self) -> usize {
        self.ordinal
    }

    /// True when both view the same allocation (the images of one launch do).
    pub fn shares_allocation(&self, other: &DeviceVec) -> bool {
        Arc::ptr_eq(&self.buf, &other.buf)
    }

    /// A host copy of the values (synchronous).
    ///
    /// The whole context is synchronized first: a consumer that was handed the memory (DLPack,
    /// CUDA Array Interface) may have queued writes on a stream of its own, which the copy
    /// (on the legacy stream) would not otherwise wait for. An explicit copy may wait.
    pub fn to_host(&self) -> Result<HostVec> {
        let gpu = &crate::engine::engine()?.gpu;
        gpu.ctx()
            .synchronize()
            .map_err(|e| crate::device::driver_error("synchronize before a download", e))?;
        fn read<T: bytemuck::Pod + Default + Clone>(v: &DeviceVec) -> Result<Vec<T>> {
            let mut out = vec![T::default(); v.len];
            v.buf
                .read(v.offset, bytemuck::cast_slice_mut(out.as_mut_slice()))?;
            Ok(out)
        }
        Ok(match self.dtype {
            ResultDType::U32 => HostVec::U32(read(self)?),
            ResultDType::U64 => HostVec::U64(read(self)?),
            ResultDType::F64 => HostVec::F64(read(self)?),
            ResultDType::F32 => HostVec::F32(read(self)?),
        })
    }
}

/// Exact per-frame moments in device memory (`u64`, one value per visited frame).
#[derive(Debug, Clone)]
pub struct DeviceMoments {
    /// `S = Σ_k I[k]`.
    pub sum: DeviceVec,
    /// `m_row = Σ_k k_r · I[k]`.
    pub m_row: DeviceVec,
    /// `m_col = Σ_k k_c · I[k]`.
    pub m_col: DeviceVec,
}

/// What a reduction returns when its results stay on the device: the fields of
/// [`ReduceResult`], each array a [`DeviceVec`] (`u64` images of integer masks, `f64` of float
/// masks, `u64` sum DP, `u32` max DP, `u64` moments). A field is `Some` (or `images` non-empty)
/// exactly when requested.
#[derive(Debug, Clone)]
pub struct DeviceReduceResult {
    /// One image per requested mask, in request order.
    pub images: Vec<DeviceVec>,
    /// Exact sum over the visited frames, per detector pixel.
    pub sum_dp: Option<DeviceVec>,
    /// Maximum over the visited frames, per detector pixel.
    pub max_dp: Option<DeviceVec>,
    /// Per-frame moments.
    pub moments: Option<DeviceMoments>,
    /// Frames visited.
    pub n_frames: u64,
    /// Where the engine spent the time (set-up, the kernels by GPU events, the wait).
    pub stages: Vec<StageTiming>,
}

fn kind_error(what: &str, expected: ResultDType, found: ResultDType) -> Error {
    Error::internal("device result download", format!("{what} has another type"))
        .with_expected(expected.numpy_name())
        .with_found(found.numpy_name())
}

fn u64s(v: &DeviceVec, what: &str) -> Result<Vec<u64>> {
    match v.to_host()? {
        HostVec::U64(x) => Ok(x),
        _ => Err(kind_error(what, ResultDType::U64, v.dtype)),
    }
}

impl DeviceReduceResult {
    /// A host copy of every array, as the host path returns it (for comparisons and tests;
    /// `stages` are this result's).
    pub fn to_host(&self) -> Result<ReduceResult> {
        let images = self
            .images
            .iter()
            .map(|im| {
                Ok(match im.to_host()? {
                    HostVec::U64(v) => VirtualImage::U64(v),
                    HostVec::F64(v) => VirtualImage::F64(v),
                    HostVec::U32(_) | HostVec::F32(_) => {
                        return Err(kind_error("an image", ResultDType::U64, im.dtype))
                    }
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let max_dp = match &self.max_dp {
            Some(v) => match v.to_host()? {
                HostVec::U32(x) => Some(x),
                _ => return Err(kind_error("the max DP", ResultDType::U32, v.dtype)),
            },
            None => None,
        };
        let moments = match &self.moments {
            Some(m) => Some(Moments {
                sum: u64s(&m.sum, "the moment sum")?,
                m_row: u64s(&m.m_row, "the moment m_row")?,
                m_col: u64s(&m.m_col, "the moment m_col")?,
            }),
            None => None,
        };
        Ok(ReduceResult {
            images,
            sum_dp: self
                .sum_dp
                .as_ref()
                .map(|v| u64s(v, "the sum DP"))
                .transpose()?,
            max_dp,
            moments,
            n_frames: self.n_frames,
            stages: self.stages.clone(),
        })
    }
}
