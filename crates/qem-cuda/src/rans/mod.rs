//! The rANS counts codec on the GPU: the wrapper of `kernels/rans.cu` (the only place that
//! knows its kernel names and launch shapes).
//!
//! * [`DeviceModel`]: a [`CountsModel`] uploaded as the kernels read it ([`device_tables`]:
//!   packed `freq << 16 | cum` rows of an odd stride and a 256-bucket coarse symbol lookup
//!   addressed straight from the state, staged into shared memory by every CTA; the per-pixel
//!   context map, also in decoder order ([`interleave4`]), and the table-set thresholds in
//!   global memory);
//! * [`DeviceEncoded`]: an acquisition held encoded on the GPU — one stream per frame in an
//!   arena, a 16-byte index entry per frame (the `.qem` StreamIndex layout: offset, length,
//!   tag), and the model. It decodes frames (to host or device), runs the fused per-frame sum,
//!   and converts to and from the host form (for `.qem` files) without re-encoding;
//! * [`launch_encode`]: the encoder the load pipeline runs batch by batch;
//! * [`fit_on_device`]: the model fitted from a dense sample already on the GPU — the three
//!   big reductions run as kernels and the host finishes with `qem_codec::rans`'s staged
//!   fitting functions, so a CPU and a GPU fit of the same sample give the same model.
//!
//! Errors from a kernel come back through an 8-word record (first failing stream, code,
//! detail) and become [`Error`]s naming the frame; a corrupt stream never makes a kernel read
//! or write outside its buffers (rans.cu checks the index against the arena and the header
//! against the stream, and clamps every word read to the stream's last word).

use std::sync::Arc;

use cudarc::driver::{
    sys::CUfunction_attribute_enum, CudaContext, CudaFunction, CudaStream, DeviceRepr,
    LaunchConfig, PushKernelArg,
};
use qem_codec::qem_file::StreamEntry;
pub use qem_codec::rans::STREAM_HEADER_BYTES;
use qem_codec::rans::{self, CountsModel, ModelParams};
use qem_core::{Error, Result, Shape2};

use crate::device::{driver_error, Gpu};
use crate::mem::{DevBuf, MemCounter};
use crate::nvrtc::{load_module, ModuleInfo};

mod encoded;
mod fit;
#[cfg(test)]
mod tests;
#[cfg(test)]
#[allow(clippy::needless_range_loop, clippy::precedence)]
mod warp_emulation;

pub use encoded::{frame_hash, DeviceEncoded, FrameReduce};
pub use fit::{fit_on_device, sample_frames};

/// The kernel source, embedded.
pub const KERNEL_SOURCE: &str = include_str!("../kernels/rans.cu");
const KERNEL_FILE: &str = "rans.cu";
/// Coarse lookup entries per table row (slot >> 4).
pub const LUT_PER_ROW: usize = 256;
/// Alignment of the staged lookup in shared memory (rans.cu `stage_model`).
const LUT_ALIGN: u32 = 4096;
/// Words of the kernels' error record.
pub const ERR_WORDS: usize = 8;
/// Bytes of one index entry.
pub const INDEX_ENTRY_BYTES: usize = 16;
/// Streams start at multiples of this in the arena.
pub const STREAM_ALIGN: u64 = 16;
/// Warps per CTA of the decode kernels.
const DECODE_WARPS: u32 = 16;
/// Warps per CTA of the encoder.
const ENCODE_WARPS: u32 = 8;
/// Encoder CTAs per SM the scratch is sized for.
const ENCODE_CTAS_PER_SM: u64 = 8;
/// Bit-staging words per encoder warp (rans.cu).
const ENCODE_WINDOW_WORDS: u32 = 20;

/// The model argument of every kernel (`RansModel` in rans.cu: 5 pointers then 10 u32); public
/// for studies that launch kernels of their own on a model's tables (`pair_probe`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ModelArg {
    ctx: u64,
    tab: u64,
    lut: u64,
    thr: u64,
    ctx4: u64,
    n: u32,
    k: u32,
    s: u32,
    c: u32,
    t: u32,
    split: u32,
    /// `(128 − split)·0x01010101` (rans.cu: the class flags of a group's statistic).
    split4: u32,
    /// The table's row stride ([`table_stride`]).
    sp: u32,
    /// `4·sp`, the row stride in bytes.
    sp4: u32,
    pad: u32,
}

// SAFETY: `ModelArg` is `repr(C)` plain data with the exact layout of `struct RansModel` in
// rans.cu (five 8-byte pointers, ten 4-byte integers, 80 bytes, 8-byte aligned).
unsafe impl DeviceRepr for ModelArg {}

/// The rANS kernels loaded into one context.
#[derive(Debug, Clone)]
pub struct RansKernels {
    decode_dense: CudaFunction,
    frame_sums: CudaFunction,
    frame_hashes: CudaFunction,
    encode: CudaFunction,
    pixel_sums: CudaFunction,
    frame_stats: CudaFunction,
    histogram: CudaFunction,
    /// How the module was obtained.
    pub module: ModuleInfo,
    sms: u32,
    max_smem_optin: u32,
}

impl RansKernels {
    /// Compile (or fetch from the cache) and load the rANS kernels for `gpu`'s device.
    pub fn load(gpu: &Gpu) -> Result<RansKernels> {
        let m = load_module(gpu, KERNEL_FILE, KERNEL_SOURCE, &[])?;
        let f = |name: &str| {
            m.module
                .load_function(name)
                .map_err(|e| driver_error(&format!("load kernel {name}"), e))
        };
        Ok(RansKernels {
            decode_dense: f("qem_rans_decode_dense")?,
            frame_sums: f("qem_rans_frame_sums")?,
            frame_hashes: f("qem_rans_frame_hashes")?,
            encode: f("qem_rans_encode")?,
            pixel_sums: f("qem_rans_pixel_sums")?,
            frame_stats: f("qem_rans_frame_stats")?,
            histogram: f("qem_rans_histogram")?,
            module: m.info,
            sms: gpu.info().multiprocessors.max(1) as u32,
            max_smem_optin: gpu.info().max_shared_per_block_optin.max(48 * 1024) as u32,
        })
    }

    fn config(&self, f: &CudaFunction, warps: u32, smem: u32, items: u64) -> Result<LaunchConfig> {
        if smem > self.max_smem_optin {
            return Err(Error::invalid(
                "rANS (GPU)",
                format!(
                    "the model's tables need {smem} bytes of shared memory; the GPU has {} per CTA",
                    self.max_smem_optin
                ),
            ));
        }
        f.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(|e| driver_error("set kernel shared memory", e))?;
        // Persistent-style grid: enough CTAs to fill the GPU several times, no more than items.
        let ctas = items.div_ceil(warps as u64).clamp(1, self.sms as u64 * 16) as u32;
        Ok(LaunchConfig {
            grid_dim: (ctas, 1, 1),
            block_dim: (warps * 32, 1, 1),
            shared_mem_bytes: smem,
        })
    }
}

/// Class columns of a coarse-lookup bucket (rans.cu `CPAD`): the lookup's byte offset in a set
/// is `(x & 0xff0) | class`.
pub const CPAD: usize = rans::MAX_CONTEXTS;

/// Row stride of the device table (rans.cu `SP`): `S | 1`, odd, so lanes reading one symbol in
/// different classes, or different symbols in one class, hit different shared-memory banks.
pub fn table_stride(model: &CountsModel) -> usize {
    model.symbols() | 1
}

/// The device tables of `model` (rans.cu): packed `freq << 16 | cum` at `[set][class]` rows of
/// [`table_stride`] entries (the pad entry zero), and the coarse lookup `[set][slot >> 4][class]`
/// ([`CPAD`] class columns, zero past `C`) = the symbol whose range holds slot `16·(slot >> 4)`.
pub fn device_tables(model: &CountsModel) -> (Vec<u32>, Vec<u8>) {
    let sp = table_stride(model);
    let c_n = model.contexts() as usize;
    let t_n = model.table_sets() as usize;
    let mut tab = vec![0u32; t_n * c_n * sp];
    let mut lut = vec![0u8; t_n * LUT_PER_ROW * CPAD];
    for set in 0..t_n {
        for c in 0..c_n {
            let row = model.freq_row_of(set, c);
            let mut cum = 0u32;
            for (sym, &f) in row.iter().enumerate() {
                let f = u32::from(f);
                tab[(set * c_n + c) * sp + sym] = f << 16 | cum;
                // Buckets b whose first slot 16b lies in [cum, cum + f).
                let mut b = cum.div_ceil(16);
                while b < 256 && 16 * b < cum + f {
                    lut[(set * LUT_PER_ROW + b as usize) * CPAD + c] = sym as u8;
                    b += 1;
                }
                cum += f;
            }
        }
    }
    (tab, lut)
}

/// A per-pixel byte map in the decoder's order (`ctx4` in rans.cu): word `g·32 + lane` holds,
/// in byte `j`, the byte of pixel `(4g + j)·32 + lane` (0 past the map), so in step t of a
/// stream (pixels 32t..32t+31, one per lane) a lane reads the bytes of four steps with one
/// coalesced 4-byte load. `(⌈⌈n/32⌉/4⌉ + 1)·32` words: one zero group past the last, so the
/// kernels may load group `g + 1` while working on group `g` without a bounds check.
pub fn interleave4(map: &[u8]) -> Vec<u32> {
    let groups = map.len().div_ceil(32).div_ceil(4);
    let mut out = vec![0u32; (groups + 1) * 32];
    for (p, &b) in map.iter().enumerate() {
        let (t, lane) = (p / 32, p % 32);
        out[(t / 4) * 32 + lane] |= u32::from(b) << (8 * (t % 4));
    }
    out
}

/// A [`CountsModel`] in device memory.
#[derive(Debug)]
pub struct DeviceModel {
    model: CountsModel,
    /// The context map in decoder order as uploaded (products pair it with their mask bits).
    ctx4_host: Vec<u32>,
    ctx: DevBuf,
    ctx4: DevBuf,
    tab: DevBuf,
    lut: DevBuf,
    thr: DevBuf,
    tab_bytes: u32,
    lut_bytes: u32,
}

impl DeviceModel {
    /// Upload `model` (synchronous, small).
    pub fn upload(
        ctx: &Arc<CudaContext>,
        model: CountsModel,
        counter: Option<&Arc<MemCounter>>,
    ) -> Result<DeviceModel> {
        let (tab, lut) = device_tables(&model);
        let d_ctx = DevBuf::alloc(ctx, model.frame_len(), counter, "rANS context map")?;
        d_ctx.write(0, model.ctx_map())?;
        let ctx4 = interleave4(model.ctx_map());
        let d_ctx4 = DevBuf::alloc(ctx, ctx4.len() * 4, counter, "rANS context map (decoder)")?;
        d_ctx4.write(0, bytemuck::cast_slice(&ctx4))?;
        let d_tab = DevBuf::alloc(ctx, tab.len() * 4, counter, "rANS tables")?;
        d_tab.write(0, bytemuck::cast_slice(&tab))?;
        let d_lut = DevBuf::alloc(ctx, lut.len(), counter, "rANS lookup")?;
        d_lut.write(0, &lut)?;
        let thr = model.thresholds();
        let d_thr = DevBuf::alloc(ctx, thr.len().max(1) * 8, counter, "rANS thresholds")?;
        if !thr.is_empty() {
            d_thr.write(0, bytemuck::cast_slice(thr))?;
        }
        Ok(DeviceModel {
            tab_bytes: (tab.len() * 4) as u32,
            lut_bytes: lut.len() as u32,
            model,
            ctx: d_ctx,
            ctx4: d_ctx4,
            ctx4_host: ctx4,
            tab: d_tab,
            lut: d_lut,
            thr: d_thr,
        })
    }

    /// The host model.
    pub fn model(&self) -> &CountsModel {
        &self.model
    }

    /// The context map in decoder order ([`interleave4`] of the model's map).
    pub fn ctx4(&self) -> &[u32] {
        &self.ctx4_host
    }

    /// Device bytes held.
    pub fn nbytes(&self) -> u64 {
        (self.ctx.bytes()
            + self.ctx4.bytes()
            + self.tab.bytes()
            + self.lut.bytes()
            + self.thr.bytes()) as u64
    }

    /// Shared memory every CTA stages the tables into: the lookup starts at the next 4 KB
    /// boundary of the shared window after the table (rans.cu `stage_model`).
    pub fn smem_tables(&self) -> u32 {
        self.tab_bytes + LUT_ALIGN + self.lut_bytes
    }

    /// Shared memory of an encoder CTA: the frequency table (no lookup), the warps' bit
    /// windows and their per-step bucket maps (the divisions need no table: rans.cu
    /// `div_freq`).
    fn smem_encoder(&self) -> u32 {
        let steps = (self.model.frame_len() as u32).div_ceil(32);
        let map_words = steps.div_ceil(32);
        self.tab_bytes + ENCODE_WARPS * ENCODE_WINDOW_WORDS * 4 + ENCODE_WARPS * map_words * 4
    }

    /// The kernel argument of this model (valid while it lives).
    pub fn arg(&self) -> ModelArg {
        let m = &self.model;
        ModelArg {
            ctx: self.ctx.ptr(),
            tab: self.tab.ptr(),
            lut: self.lut.ptr(),
            thr: self.thr.ptr(),
            ctx4: self.ctx4.ptr(),
            n: m.frame_len() as u32,
            k: u32::from(m.literals()),
            s: m.symbols() as u32,
            c: u32::from(m.contexts()),
            t: u32::from(m.table_sets()),
            split: u32::from(m.split()),
            split4: (128 - u32::from(m.split())).wrapping_mul(0x0101_0101),
            sp: table_stride(m) as u32,
            sp4: 4 * table_stride(m) as u32,
            pad: 0,
        }
    }
}

/// What a kernel's error record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RansFaultRecord {
    /// Kernel code (rans.cu `R_*`).
    pub code: u32,
    /// Index entry (frame) of the first failing stream.
    pub frame: u64,
    /// Detail values.
    pub a: u32,
    /// Second detail value.
    pub b: u32,
    /// Streams that failed.
    pub count: u32,
    /// Encoder: frames that did not fit the arena.
    pub overflowed: u32,
}

/// The error record words as a fault, `None` if clean.
pub fn fault_from_words(v: &[u32]) -> Option<RansFaultRecord> {
    if v.len() < ERR_WORDS || (v[0] == 0 && v[7] == 0) {
        return None;
    }
    Some(RansFaultRecord {
        code: if v[0] == 0 { 0 } else { v[1] },
        frame: u64::from(v[2]) | u64::from(v[3]) << 32,
        a: v[4],
        b: v[5],
        count: v[6],
        overflowed: v[7],
    })
}

/// What a stream-integrity code (2..=14) of the decode kernel means; the fault's `a` and `b`
/// are then the expected and the found value.
fn stream_fault(code: u32) -> Option<&'static str> {
    Some(match code {
        2 => "stream length",
        3 => "word/extra-bit counts larger than the frame allows",
        4 => "table set out of range",
        5 => "reserved header word",
        6 => "initial state below L (lane a)",
        7 => "non-zero pad word",
        8 => "non-zero unused extra bits",
        9 => "renormalisation word needed past the stream's words",
        10 => "extra bits needed past the stream's bits",
        11 => "final state != L (lane a)",
        12 => "words left unread",
        13 => "extra bits left unread",
        14 => "table set does not match the decoded frame",
        _ => return None,
    })
}

/// The typed error of a kernel fault (`frame` maps the index entry to the acquisition's frame).
pub fn fault_error(f: &RansFaultRecord, frame: u64) -> Error {
    let op = "rANS decode (GPU)";
    let (what, exp, found) = match f.code {
        1 => ("index entry outside the stream arena", None, None),
        17 => ("a decoded value above 65535", Some(f.a), None),
        15 => {
            return Error::invalid(
                "rANS encode (GPU)",
                format!(
                    "value {} at pixel {} has no symbol in the model (fitted on a sample without flooring?)",
                    f.b, f.a
                ),
            )
            .with_frame(frame)
        }
        c => match stream_fault(c) {
            Some(what) => (what, Some(f.a), Some(f.b)),
            None => {
                return Error::internal(op, format!("unknown rANS kernel code {c}"))
                    .with_frame(frame)
            }
        },
    };
    let mut e = Error::decode(
        op,
        format!(
            "corrupt stream: {what}{}",
            if f.count > 1 {
                format!(" ({} streams failed)", f.count)
            } else {
                String::new()
            }
        ),
    )
    .with_frame(frame);
    if let Some(x) = exp {
        e = e.with_expected(x.to_string());
    }
    if let Some(x) = found {
        e = e.with_found(x.to_string());
    }
    e
}

pub(crate) fn new_err_record(
    ctx: &Arc<CudaContext>,
    counter: Option<&Arc<MemCounter>>,
) -> Result<DevBuf> {
    let b = DevBuf::alloc(ctx, ERR_WORDS * 4, counter, "rANS error record")?;
    b.zero()?;
    Ok(b)
}

pub(crate) fn read_err(b: &DevBuf) -> Result<Option<RansFaultRecord>> {
    let mut w = [0u8; ERR_WORDS * 4];
    b.read(0, &mut w)?;
    let v: &[u32] = bytemuck::cast_slice(&w);
    Ok(fault_from_words(v))
}

/// Arguments of one encoder launch (device addresses as raw `u64`).
#[derive(Debug, Clone, Copy)]
pub struct EncodeArgs {
    /// Dense u16 frames, frame-contiguous (`frame_len` each).
    pub frames: u64,
    /// Frames at `frames`.
    pub n_frames: u64,
    /// Per frame: index entry to fill (`u32::MAX` = skip), or 0 to use `dst_base + k`.
    pub dst: u64,
    /// First index entry when `dst` is 0.
    pub dst_base: u64,
    /// Frame-sized u8 bad-pixel lookup (coded as 0), or 0.
    pub bad: u64,
    /// Stream arena.
    pub arena: u64,
    /// Arena capacity in bytes.
    pub capacity: u64,
    /// The arena's u64 allocation cursor.
    pub cursor: u64,
    /// Index (16 bytes per entry).
    pub index: u64,
    /// Encoder scratch from [`EncoderScratch`].
    pub scratch_words: u64,
    /// Warps the scratch serves.
    pub scratch_warps: u64,
    /// Error record ([`ERR_WORDS`] words).
    pub err: u64,
}

/// Per-warp encoder scratch (the words of one frame in encoder order) for a fixed number of
/// warps.
#[derive(Debug)]
pub struct EncoderScratch {
    words: DevBuf,
    warps: u64,
}

impl EncoderScratch {
    /// Scratch for the encoder's grid on this GPU for frames of `frame_len` pixels.
    pub fn new(
        ctx: &Arc<CudaContext>,
        k: &RansKernels,
        frame_len: usize,
        counter: Option<&Arc<MemCounter>>,
    ) -> Result<EncoderScratch> {
        let warps = Self::warps(k);
        let n = frame_len as u64;
        let words = DevBuf::alloc(
            ctx,
            (warps * n * 2) as usize,
            counter,
            "encoder word scratch",
        )?;
        Ok(EncoderScratch { words, warps })
    }

    /// Bytes the scratch takes for `frame_len`-pixel frames (for admission).
    pub fn bytes_for(k: &RansKernels, frame_len: usize) -> u64 {
        let n = frame_len as u64;
        Self::warps(k) * n * 2
    }

    fn warps(k: &RansKernels) -> u64 {
        k.sms as u64 * ENCODE_CTAS_PER_SM * ENCODE_WARPS as u64
    }

    /// Device address and warp count for [`EncodeArgs`].
    pub fn parts(&self) -> (u64, u64) {
        (self.words.ptr(), self.warps)
    }
}

/// Queue one encoder launch on `stream`.
///
/// # Safety
/// Every address in `a` must be a live device allocation of the described size (frames:
/// `n_frames × frame_len` u16; dst: `n_frames` u32 naming entries < the index's length; index:
/// 16 bytes per entry; cursor: one zero-initialised u64 shared by every launch into the same
/// arena; scratch from one [`EncoderScratch`] for this model's frame length), alive until the
/// stream has passed the launch.
pub unsafe fn launch_encode(
    k: &RansKernels,
    stream: &CudaStream,
    model: &DeviceModel,
    a: &EncodeArgs,
) -> Result<()> {
    if a.n_frames == 0 {
        return Ok(());
    }
    let smem = model.smem_encoder();
    let mut cfg = k.config(&k.encode, ENCODE_WARPS, smem, a.n_frames)?;
    let max_ctas = (a.scratch_warps / ENCODE_WARPS as u64).max(1) as u32;
    cfg.grid_dim.0 = cfg.grid_dim.0.min(max_ctas);
    let m = model.arg();
    let mut b = stream.launch_builder(&k.encode);
    b.arg(&a.frames)
        .arg(&a.n_frames)
        .arg(&a.dst)
        .arg(&a.dst_base)
        .arg(&a.bad)
        .arg(&m)
        .arg(&a.arena)
        .arg(&a.capacity)
        .arg(&a.cursor)
        .arg(&a.index)
        .arg(&a.scratch_words)
        .arg(&a.scratch_warps)
        .arg(&a.err);
    // SAFETY: matches `qem_rans_encode(const u16*, u64, const u32*, u64, const u8*, RansModel,
    // u8*, u64, u64*, u32*, u16*, u64, u32*)`; the grid has at most `scratch_warps`
    // warps; buffers per the function's contract; the kernel checks every arena write against
    // `capacity`.
    unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch rANS encode", e))?;
    Ok(())
}
