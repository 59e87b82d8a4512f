//! Dense arrays of counts.

use crate::dtype::DType;

/// A dense array of counts in row-major order, of one of the supported dtypes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DenseArray {
    /// 8-bit counts.
    U8(Vec<u8>),
    /// 16-bit counts.
    U16(Vec<u16>),
    /// 32-bit counts.
    U32(Vec<u32>),
}

impl DenseArray {
    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            DenseArray::U8(_) => DType::U8,
            DenseArray::U16(_) => DType::U16,
            DenseArray::U32(_) => DType::U32,
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            DenseArray::U8(v) => v.len(),
            DenseArray::U16(v) => v.len(),
            DenseArray::U32(v) => v.len(),
        }
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Size in bytes (an array that exists in memory cannot overflow this).
    pub fn nbytes(&self) -> usize {
        self.len().saturating_mul(self.dtype().size())
    }
    /// Element `i` widened to u64.
    pub fn get(&self, i: usize) -> Option<u64> {
        match self {
            DenseArray::U8(v) => v.get(i).map(|&x| x as u64),
            DenseArray::U16(v) => v.get(i).map(|&x| x as u64),
            DenseArray::U32(v) => v.get(i).map(|&x| x as u64),
        }
    }
    /// Copy of elements `[start, start + len)`.
    pub fn slice(&self, start: usize, len: usize) -> DenseArray {
        match self {
            DenseArray::U8(v) => DenseArray::U8(v[start..start + len].to_vec()),
            DenseArray::U16(v) => DenseArray::U16(v[start..start + len].to_vec()),
            DenseArray::U32(v) => DenseArray::U32(v[start..start + len].to_vec()),
        }
    }
}
