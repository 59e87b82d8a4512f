//! The kernel error records of a load, in one small device buffer with a named layout:
//!
//! | bytes | record | written by |
//! |---|---|---|
//! | `0..32` | decode fault: 8 words (`bslz4::fault_from_record`) | `bslz4_decode.cu` |
//! | `32..64` | region/bin overflow: `[0]` flag, `[1]` result frame, `[2]` row, `[3]` column, `[4..6)` value (u64), `[6]` count | `region_bin.cu` |
//! | `64..72` | values clipped by a saturating u8 request (u64) | `region_bin.cu` |
//!
//! Both the pipeline and [`super::load_array`] read it once, after synchronizing.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use qem_core::{DType, Result};

use super::pipeline::overflow_error;
use crate::mem::{DevBuf, MemCounter};

const DECODE_AT: usize = 0;
const OVERFLOW_AT: usize = 32;
const SATURATED_AT: usize = 64;
const USED_BYTES: usize = 72;

/// The device buffer of a load's error records (zeroed when made).
#[derive(Debug)]
pub(super) struct ErrorRecords {
    buf: DevBuf,
}

/// What the records said after the kernels ran.
pub(super) struct RecordsRead {
    /// The decode fault record's 8 words.
    pub(super) decode: [u32; 8],
    /// The region/bin overflow record's 8 words.
    overflow: [u32; 8],
    /// Values clipped by a saturating request.
    pub(super) saturated: u64,
}

impl ErrorRecords {
    pub(super) fn new(ctx: &Arc<CudaContext>, counter: Option<&Arc<MemCounter>>) -> Result<Self> {
        let buf = DevBuf::alloc(ctx, 256, counter, "error records")?;
        buf.zero()?;
        Ok(ErrorRecords { buf })
    }
    /// Device address of the decode fault record.
    pub(super) fn decode_ptr(&self) -> u64 {
        self.buf.ptr() + DECODE_AT as u64
    }
    /// Device address of the region/bin overflow record.
    pub(super) fn overflow_ptr(&self) -> u64 {
        self.buf.ptr() + OVERFLOW_AT as u64
    }
    /// Device address of the saturated-value counter.
    pub(super) fn saturated_ptr(&self) -> u64 {
        self.buf.ptr() + SATURATED_AT as u64
    }
    /// Read every record (the caller has synchronized the streams that write them).
    pub(super) fn read(&self) -> Result<RecordsRead> {
        let mut raw = [0u8; USED_BYTES];
        self.buf.read(0, &mut raw)?;
        let word = |i: usize| {
            u32::from_le_bytes([raw[4 * i], raw[4 * i + 1], raw[4 * i + 2], raw[4 * i + 3]])
        };
        let mut decode = [0u32; 8];
        let mut overflow = [0u32; 8];
        for i in 0..8 {
            decode[i] = word(DECODE_AT / 4 + i);
            overflow[i] = word(OVERFLOW_AT / 4 + i);
        }
        let mut sat = [0u8; 8];
        sat.copy_from_slice(&raw[SATURATED_AT..SATURATED_AT + 8]);
        Ok(RecordsRead {
            decode,
            overflow,
            saturated: u64::from_le_bytes(sat),
        })
    }
}

impl RecordsRead {
    /// The overflow error, if region/bin found a value that does not fit `dtype`; `frames`
    /// maps a result frame to the acquisition's frame.
    pub(super) fn overflow(&self, frames: &[u64], dtype: DType) -> Result<()> {
        let o = &self.overflow;
        if o[0] == 0 {
            return Ok(());
        }
        let df = o[1] as usize;
        let value = u64::from(o[4]) | u64::from(o[5]) << 32;
        let frame = frames.get(df).copied().unwrap_or(df as u64);
        Err(overflow_error(frame, o[2], o[3], value, dtype))
    }
}

/// The rANS encoder's records (`rans.cu` `qem_rans_encode`): its fault record (8 words,
/// `rans::fault_from_words`) at 0 and the arena cursor (u64: bytes the encoder allocated, all
/// streams 16-byte rounded; past the capacity when frames overflowed) at 32.
#[derive(Debug)]
pub(super) struct EncoderRecords {
    buf: DevBuf,
}

/// What the encoder's records said.
pub(super) struct EncoderRead {
    /// The fault record, `None` when clean.
    pub(super) fault: Option<crate::rans::RansFaultRecord>,
    /// Bytes the encoder allocated in the arena.
    pub(super) used: u64,
}

impl EncoderRecords {
    const CURSOR_AT: usize = 32;

    pub(super) fn new(ctx: &Arc<CudaContext>, counter: Option<&Arc<MemCounter>>) -> Result<Self> {
        let buf = DevBuf::alloc(ctx, 64, counter, "encoder records")?;
        buf.zero()?;
        Ok(EncoderRecords { buf })
    }
    /// Device address of the fault record.
    pub(super) fn err_ptr(&self) -> u64 {
        self.buf.ptr()
    }
    /// Device address of the arena cursor.
    pub(super) fn cursor_ptr(&self) -> u64 {
        self.buf.ptr() + Self::CURSOR_AT as u64
    }
    /// Read both (the caller has synchronized the encoder's stream).
    pub(super) fn read(&self) -> Result<EncoderRead> {
        let mut raw = [0u8; 40];
        self.buf.read(0, &mut raw)?;
        let mut words = [0u32; 8];
        for (i, w) in words.iter_mut().enumerate() {
            *w = u32::from_le_bytes([raw[4 * i], raw[4 * i + 1], raw[4 * i + 2], raw[4 * i + 3]]);
        }
        let mut cursor = [0u8; 8];
        cursor.copy_from_slice(&raw[Self::CURSOR_AT..Self::CURSOR_AT + 8]);
        Ok(EncoderRead {
            fault: crate::rans::fault_from_words(&words),
            used: u64::from_le_bytes(cursor),
        })
    }
}
