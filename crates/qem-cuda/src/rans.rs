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

/// The kernel source, embedded.
pub const KERNEL_SOURCE: &str = include_str!("kernels/rans.cu");
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

/// The model argument of every kernel (`RansModel` in rans.cu: 5 pointers then 10 u32).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ModelArg {
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
    pub(crate) fn smem_tables(&self) -> u32 {
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

    pub(crate) fn arg(&self) -> ModelArg {
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

/// The typed error of a kernel fault (`frame` maps the index entry to the acquisition's frame).
pub fn fault_error(f: &RansFaultRecord, frame: u64) -> Error {
    let op = "rANS decode (GPU)";
    let (what, exp, found) = match f.code {
        1 => ("index entry outside the stream arena", None, None),
        2 => ("stream length", Some(f.a), Some(f.b)),
        3 => ("word/extra-bit counts larger than the frame allows", Some(f.a), Some(f.b)),
        4 => ("table set out of range", Some(f.a), Some(f.b)),
        5 => ("reserved header word", Some(f.a), Some(f.b)),
        6 => ("initial state below L (lane a)", Some(f.a), Some(f.b)),
        7 => ("non-zero pad word", Some(f.a), Some(f.b)),
        8 => ("non-zero unused extra bits", Some(f.a), Some(f.b)),
        9 => ("renormalisation word needed past the stream's words", Some(f.a), Some(f.b)),
        10 => ("extra bits needed past the stream's bits", Some(f.a), Some(f.b)),
        11 => ("final state != L (lane a)", Some(f.a), Some(f.b)),
        12 => ("words left unread", Some(f.a), Some(f.b)),
        13 => ("extra bits left unread", Some(f.a), Some(f.b)),
        14 => ("table set does not match the decoded frame", Some(f.a), Some(f.b)),
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
        c => {
            return Error::internal(op, format!("unknown rANS kernel code {c}")).with_frame(frame)
        }
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
    b.write(0, &[0u8; ERR_WORDS * 4])?;
    Ok(b)
}

pub(crate) fn read_err(b: &DevBuf) -> Result<Option<RansFaultRecord>> {
    let mut w = [0u8; ERR_WORDS * 4];
    b.read(0, &mut w)?;
    let v: &[u32] = bytemuck::cast_slice(&w);
    Ok(fault_from_words(v))
}

/// An acquisition held encoded on the GPU (one stream per frame).
#[derive(Debug)]
pub struct DeviceEncoded {
    model: DeviceModel,
    arena: DevBuf,
    arena_used: u64,
    index: DevBuf,
    n_frames: u64,
    frame_shape: Shape2,
    ordinal: usize,
}

impl DeviceEncoded {
    /// Assemble from parts the load pipeline produced (`index` holds `n_frames` entries that
    /// all point inside `arena[..arena_used]`).
    pub fn from_parts(
        model: DeviceModel,
        arena: DevBuf,
        arena_used: u64,
        index: DevBuf,
        n_frames: u64,
        frame_shape: Shape2,
        ordinal: usize,
    ) -> DeviceEncoded {
        DeviceEncoded {
            model,
            arena,
            arena_used,
            index,
            n_frames,
            frame_shape,
            ordinal,
        }
    }

    /// Upload a host-encoded acquisition as it is (no re-encode): the `.qem` reopen path.
    /// `index` entries must point inside `streams` at multiples of 16 (checked here).
    pub fn upload(
        gpu: &Gpu,
        model: CountsModel,
        index: &[StreamEntry],
        streams: &[u8],
        frame_shape: Shape2,
        counter: Option<&Arc<MemCounter>>,
    ) -> Result<DeviceEncoded> {
        let op = "upload encoded acquisition";
        if model.frame_len() != frame_shape.len() {
            return Err(Error::invalid(op, "model frame length != frame shape")
                .with_expected(frame_shape.len().to_string())
                .with_found(model.frame_len().to_string()));
        }
        for (i, e) in index.iter().enumerate() {
            if e.offset % STREAM_ALIGN != 0
                || e.offset.saturating_add(u64::from(e.length)) > streams.len() as u64
            {
                return Err(Error::decode(op, "stream index entry outside the streams")
                    .with_frame(i as u64)
                    .with_expected(format!("16-aligned range inside {} bytes", streams.len()))
                    .with_found(format!("offset {} length {}", e.offset, e.length)));
            }
        }
        let ctx = gpu.ctx();
        let dm = DeviceModel::upload(ctx, model, counter)?;
        let arena = DevBuf::alloc(ctx, streams.len(), counter, "encoded streams")?;
        arena.write(0, streams)?;
        let mut raw = Vec::with_capacity(index.len() * INDEX_ENTRY_BYTES);
        for e in index {
            raw.extend_from_slice(&e.offset.to_le_bytes());
            raw.extend_from_slice(&e.length.to_le_bytes());
            raw.extend_from_slice(&e.tag.to_le_bytes());
        }
        let d_index = DevBuf::alloc(ctx, raw.len(), counter, "stream index")?;
        d_index.write(0, &raw)?;
        Ok(DeviceEncoded {
            model: dm,
            arena,
            arena_used: streams.len() as u64,
            index: d_index,
            n_frames: index.len() as u64,
            frame_shape,
            ordinal: gpu.info().ordinal,
        })
    }

    /// Frames held.
    pub fn n_frames(&self) -> u64 {
        self.n_frames
    }

    /// What a fused decode kernel needs: arena address and used length, index address, the
    /// model argument and the shared memory its tables take.
    pub(crate) fn kernel_view(&self) -> (u64, u64, u64, ModelArg, u32) {
        (
            self.arena.ptr(),
            self.arena_used,
            self.index.ptr(),
            self.model.arg(),
            self.model.smem_tables(),
        )
    }

    /// Detector frame shape.
    pub fn frame_shape(&self) -> Shape2 {
        self.frame_shape
    }

    /// The model.
    pub fn model(&self) -> &CountsModel {
        self.model.model()
    }

    /// The model's context map in decoder order ([`DeviceModel::ctx4`]).
    pub fn ctx4(&self) -> &[u32] {
        self.model.ctx4()
    }

    /// CUDA device ordinal.
    pub fn device_ordinal(&self) -> usize {
        self.ordinal
    }

    /// Bytes of the streams (16-byte aligned, as laid out in the arena).
    pub fn stream_bytes(&self) -> u64 {
        self.arena_used
    }

    /// Device bytes the encoded form occupies: streams, index and model tables.
    pub fn nbytes(&self) -> u64 {
        self.arena_used + self.n_frames * INDEX_ENTRY_BYTES as u64 + self.model.nbytes()
    }

    fn check_range(&self, first: u64, count: u64) -> Result<()> {
        if first.checked_add(count).is_none_or(|e| e > self.n_frames) {
            return Err(
                Error::invalid("decode frames", "frame range outside the acquisition")
                    .with_expected(format!("<= {}", self.n_frames))
                    .with_found(format!("{first}..{}", first.saturating_add(count))),
            );
        }
        Ok(())
    }

    /// Queue the decode of frames `first..first + count` into `out` (u16, frame-contiguous) on
    /// `stream`; `err` receives the error record.
    ///
    /// # Safety
    /// `out` must hold `count × frame_len` u16 and `err` [`ERR_WORDS`] zeroed words, both alive
    /// until the stream has passed the launch.
    pub unsafe fn launch_decode_dense(
        &self,
        k: &RansKernels,
        stream: &CudaStream,
        first: u64,
        count: u64,
        out: u64,
        err: u64,
    ) -> Result<()> {
        self.check_range(first, count)?;
        if count == 0 {
            return Ok(());
        }
        let cfg = k.config(
            &k.decode_dense,
            DECODE_WARPS,
            self.model.smem_tables(),
            count,
        )?;
        let m = self.model.arg();
        let (arena, alen, index) = (self.arena.ptr(), self.arena_used, self.index.ptr());
        let mut b = stream.launch_builder(&k.decode_dense);
        b.arg(&arena)
            .arg(&alen)
            .arg(&index)
            .arg(&first)
            .arg(&count)
            .arg(&m)
            .arg(&out)
            .arg(&err);
        // SAFETY: matches `qem_rans_decode_dense(const u8*, u64, const u32*, u64, u64,
        // RansModel, u16*, u32*)`; the arena, index and tables are this object's live buffers,
        // every stream access is bounds-checked by the kernel; `out`/`err` per the contract.
        unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch rANS decode", e))?;
        Ok(())
    }

    /// Decode frames `first..first + count` to the host (u16, frame-contiguous), in pieces of
    /// at most 256 MiB of device scratch.
    pub fn download_frames(
        &self,
        gpu: &Gpu,
        k: &RansKernels,
        first: u64,
        count: u64,
    ) -> Result<Vec<u16>> {
        self.check_range(first, count)?;
        let n = self.frame_shape.len() as u64;
        let mut host = vec![0u16; (count * n) as usize];
        if count == 0 {
            return Ok(host);
        }
        let per = ((256u64 << 20) / (2 * n).max(1)).clamp(1, count);
        let ctx = gpu.ctx();
        let scratch = DevBuf::alloc(ctx, (per * n * 2) as usize, None, "decoded frames")?;
        let err = new_err_record(ctx, None)?;
        let stream = gpu.stream();
        let mut done = 0u64;
        while done < count {
            let c = per.min(count - done);
            // SAFETY: scratch holds `per × n` u16 ≥ `c × n`; err is a zeroed record; both live
            // until the synchronize below.
            unsafe {
                self.launch_decode_dense(k, stream, first + done, c, scratch.ptr(), err.ptr())
            }?;
            stream
                .synchronize()
                .map_err(|e| driver_error("synchronize rANS decode", e))?;
            if let Some(f) = read_err(&err)? {
                return Err(fault_error(&f, f.frame));
            }
            let dst = &mut host[(done * n) as usize..((done + c) * n) as usize];
            scratch.read(0, bytemuck::cast_slice_mut(dst))?;
            done += c;
        }
        Ok(host)
    }

    /// Exact per-frame totals, computed by the fused decode→reduce template (no frame is
    /// written to memory). The smallest product; it also checks every stream.
    pub fn frame_sums(&self, gpu: &Gpu, k: &RansKernels) -> Result<Vec<u64>> {
        let (v, fault) = self.frame_reduce(gpu, k, FrameReduce::Sum)?;
        match fault {
            Some(f) => Err(fault_error(&f, f.frame)),
            None => Ok(v),
        }
    }

    /// Per-frame hashes ([`frame_hash`]) of the decoded frames, fused with decode.
    pub fn frame_hashes(&self, gpu: &Gpu, k: &RansKernels) -> Result<Vec<u64>> {
        let (v, fault) = self.frame_reduce(gpu, k, FrameReduce::Hash)?;
        match fault {
            Some(f) => Err(fault_error(&f, f.frame)),
            None => Ok(v),
        }
    }

    /// One u64 per frame from a fused reduction, `u64::MAX` for each stream that failed its
    /// checks, and the launch's first fault (a per-stream verdict for tests of corrupt data).
    pub fn frame_reduce(
        &self,
        gpu: &Gpu,
        k: &RansKernels,
        what: FrameReduce,
    ) -> Result<(Vec<u64>, Option<RansFaultRecord>)> {
        let ctx = gpu.ctx();
        let n = self.n_frames;
        let out = DevBuf::alloc(ctx, (n.max(1) * 8) as usize, None, "per-frame results")?;
        let err = new_err_record(ctx, None)?;
        if n > 0 {
            let f = match what {
                FrameReduce::Sum => &k.frame_sums,
                FrameReduce::Hash => &k.frame_hashes,
            };
            let cfg = k.config(f, DECODE_WARPS, self.model.smem_tables(), n)?;
            let m = self.model.arg();
            let (arena, alen, index, first) =
                (self.arena.ptr(), self.arena_used, self.index.ptr(), 0u64);
            let (o, e) = (out.ptr(), err.ptr());
            let stream = gpu.stream();
            let mut b = stream.launch_builder(f);
            b.arg(&arena)
                .arg(&alen)
                .arg(&index)
                .arg(&first)
                .arg(&n)
                .arg(&m)
                .arg(&o)
                .arg(&e);
            // SAFETY: matches `qem_rans_frame_sums`/`qem_rans_frame_hashes(const u8*, u64,
            // const u32*, u64, u64, RansModel, u64*, u32*)`; `out` holds n u64; all buffers
            // live until the synchronize below.
            unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch rANS reduction", e))?;
            stream
                .synchronize()
                .map_err(|e| driver_error("synchronize rANS reduction", e))?;
        }
        let fault = read_err(&err)?;
        let mut v = vec![0u64; n as usize];
        out.read(0, bytemuck::cast_slice_mut(&mut v))?;
        Ok((v, fault))
    }

    /// Time one decode of every frame into a device scratch of `frames_per_launch` frames
    /// (events on the default stream), returning seconds. For benchmarks.
    pub fn time_decode_all(
        &self,
        gpu: &Gpu,
        k: &RansKernels,
        frames_per_launch: u64,
    ) -> Result<f64> {
        let n = self.frame_shape.len() as u64;
        let per = frames_per_launch.clamp(1, self.n_frames.max(1));
        let scratch = DevBuf::alloc(gpu.ctx(), (per * n * 2) as usize, None, "decoded frames")?;
        let err = new_err_record(gpu.ctx(), None)?;
        let stream = gpu.stream();
        let ms = gpu.time_ms(|| {
            let mut done = 0u64;
            while done < self.n_frames {
                let c = per.min(self.n_frames - done);
                // SAFETY: scratch holds `per × n` u16; err is a zeroed record; both live until
                // time_ms has synchronized.
                unsafe { self.launch_decode_dense(k, stream, done, c, scratch.ptr(), err.ptr()) }?;
                done += c;
            }
            Ok(())
        })?;
        if let Some(f) = read_err(&err)? {
            return Err(fault_error(&f, f.frame));
        }
        Ok(f64::from(ms) / 1e3)
    }

    /// The index and streams on the host, streams in frame order, packed at 16-byte
    /// boundaries (the `.qem` writer's layout).
    pub fn to_host(&self) -> Result<(Vec<StreamEntry>, Vec<u8>)> {
        let mut raw = vec![0u8; self.n_frames as usize * INDEX_ENTRY_BYTES];
        self.index.read(0, &mut raw)?;
        let mut arena = vec![0u8; self.arena_used as usize];
        self.arena.read(0, &mut arena)?;
        let mut index = Vec::with_capacity(self.n_frames as usize);
        let mut streams = Vec::with_capacity(arena.len());
        for (i, e) in raw.chunks_exact(INDEX_ENTRY_BYTES).enumerate() {
            let off = u64::from_le_bytes(e[0..8].try_into().unwrap_or([0; 8]));
            let len = u32::from_le_bytes(e[8..12].try_into().unwrap_or([0; 4]));
            let tag = u32::from_le_bytes(e[12..16].try_into().unwrap_or([0; 4]));
            let end = off.saturating_add(u64::from(len));
            if end > arena.len() as u64 {
                return Err(Error::internal(
                    "download encoded acquisition",
                    "index entry outside the arena",
                )
                .with_frame(i as u64));
            }
            let at = streams.len() as u64;
            streams.extend_from_slice(&arena[off as usize..end as usize]);
            streams.resize(streams.len().next_multiple_of(STREAM_ALIGN as usize), 0);
            index.push(StreamEntry {
                offset: at,
                length: len,
                tag,
            });
        }
        Ok((index, streams))
    }
}

/// Which fused per-frame reduction [`DeviceEncoded::frame_reduce`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameReduce {
    /// Exact total count per frame.
    Sum,
    /// [`frame_hash`] per frame.
    Hash,
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The position-weighted frame hash of rans.cu's `FrameHash`: `Σ v_p · splitmix64(p)`
/// (wrapping). Equal frames hash equal; a changed pixel changes the hash unless differences
/// cancel modulo 2^64.
pub fn frame_hash(frame: &[u16]) -> u64 {
    frame.iter().enumerate().fold(0u64, |h, (p, &v)| {
        h.wrapping_add(u64::from(v).wrapping_mul(splitmix64(p as u64)))
    })
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

/// Fit a model from `n_frames` dense, already-masked u16 frames at `frames` (device) with the
/// staged fit of `qem_codec::rans`: per-pixel sums, frame statistics and the histogram on the
/// GPU, the rest on the host. Synchronizes the device's default stream.
pub fn fit_on_device(
    gpu: &Gpu,
    k: &RansKernels,
    frames: u64,
    n_frames: u64,
    frame_len: usize,
    params: &ModelParams,
) -> Result<CountsModel> {
    let op = "fit rANS model (GPU)";
    let codec = |e: rans::RansError| Error::invalid(op, e.to_string());
    params.validate().map_err(codec)?;
    if n_frames == 0 || frame_len == 0 || frame_len > u32::MAX as usize {
        return Err(Error::invalid(op, "no frames to fit"));
    }
    let ctx = gpu.ctx();
    let stream = gpu.stream();
    let sync = || {
        stream
            .synchronize()
            .map_err(|e| driver_error("synchronize fit", e))
    };
    let n = frame_len as u32;
    // Pass 1: per-pixel sums -> context map and split.
    let sums = DevBuf::alloc(ctx, frame_len * 8, None, "pixel sums")?;
    sums.write(0, &vec![0u8; frame_len * 8])?;
    {
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256), n_frames.min(64) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let s = sums.ptr();
        let mut b = stream.launch_builder(&k.pixel_sums);
        b.arg(&frames).arg(&n_frames).arg(&n).arg(&s);
        // SAFETY: matches `qem_rans_pixel_sums(const u16*, u64, u32, u64*)`; frames holds
        // n_frames × n u16 (caller), sums n u64; synchronized below.
        unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch pixel sums", e))?;
    }
    sync()?;
    let mut h_sums = vec![0u64; frame_len];
    sums.read(0, bytemuck::cast_slice_mut(&mut h_sums))?;
    let cf = rans::fit_contexts(&h_sums, n_frames, params).map_err(codec)?;
    let d_ctx = DevBuf::alloc(ctx, frame_len, None, "context map")?;
    d_ctx.write(0, &cf.ctx_map)?;
    // Pass 2: frame statistics -> thresholds and each frame's table set.
    let t_sets = params.table_sets.max(1);
    let mut sets = vec![0u8; n_frames as usize];
    let mut thresholds = Vec::new();
    if t_sets > 1 {
        let stats = DevBuf::alloc(ctx, (n_frames * 8) as usize, None, "frame statistics")?;
        let cfg = LaunchConfig {
            grid_dim: (n_frames.div_ceil(8).min(65535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (c, sp, st) = (d_ctx.ptr(), u32::from(cf.split), stats.ptr());
        let mut b = stream.launch_builder(&k.frame_stats);
        b.arg(&frames)
            .arg(&n_frames)
            .arg(&n)
            .arg(&c)
            .arg(&sp)
            .arg(&st);
        // SAFETY: matches `qem_rans_frame_stats(const u16*, u64, u32, const u8*, u32, u64*)`;
        // frames n_frames × n u16, ctx n bytes, stats n_frames u64; synchronized below.
        unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch frame statistics", e))?;
        sync()?;
        let mut h = vec![0u64; n_frames as usize];
        stats.read(0, bytemuck::cast_slice_mut(&mut h))?;
        thresholds = rans::fit_thresholds(&h, t_sets);
        for (s, &v) in sets.iter_mut().zip(&h) {
            *s = rans::table_set_of(&thresholds, v);
        }
    }
    // Pass 3: the [set][ctx][symbol] histogram -> frequencies.
    let s = params.literals as usize + rans::BUCKETS;
    let entries = t_sets as usize * params.contexts as usize * s;
    let d_sets = DevBuf::alloc(ctx, sets.len(), None, "frame table sets")?;
    d_sets.write(0, &sets)?;
    let hist = DevBuf::alloc(ctx, entries * 8, None, "histogram")?;
    hist.write(0, &vec![0u8; entries * 8])?;
    let smem = (entries * 4) as u32;
    if smem > k.max_smem_optin {
        return Err(Error::invalid(op, "histogram does not fit shared memory"));
    }
    k.histogram
        .set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(|e| driver_error("set kernel shared memory", e))?;
    let total = n_frames * frame_len as u64;
    let cfg = LaunchConfig {
        grid_dim: (total.div_ceil(256).clamp(1, k.sms as u64 * 8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: smem,
    };
    let (c, st, h) = (d_ctx.ptr(), d_sets.ptr(), hist.ptr());
    let (kk, ss, cc, ee) = (
        u32::from(params.literals),
        s as u32,
        u32::from(params.contexts),
        entries as u32,
    );
    let mut b = stream.launch_builder(&k.histogram);
    b.arg(&frames)
        .arg(&n_frames)
        .arg(&n)
        .arg(&c)
        .arg(&st)
        .arg(&kk)
        .arg(&ss)
        .arg(&cc)
        .arg(&ee)
        .arg(&h);
    // SAFETY: matches `qem_rans_histogram(const u16*, u64, u32, const u8*, const u8*, u32, u32,
    // u32, u32, u64*)`; frames n_frames × n u16, ctx n bytes (< C), sets n_frames bytes
    // (< T), hist `entries` u64 = T·C·S; synchronized below.
    unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch histogram", e))?;
    sync()?;
    let mut h_hist = vec![0u64; entries];
    hist.read(0, bytemuck::cast_slice_mut(&mut h_hist))?;
    let freq = rans::fit_freq(
        &h_hist,
        t_sets,
        params.contexts,
        params.literals,
        params.floor,
    )
    .map_err(codec)?;
    CountsModel::from_parts(
        params.literals,
        params.contexts,
        t_sets,
        cf.split,
        cf.ctx_map,
        thresholds,
        freq,
    )
    .map_err(codec)
}

/// Frames `0..n` spread evenly over `total` frames for fitting a model: all of them when
/// `total <= target`, else `target` frames at `⌊i·total/target⌋`. The CPU and CUDA engines
/// use this same rule, so they fit the same model.
pub fn sample_frames(total: u64, target: u64) -> Vec<u64> {
    if total <= target {
        return (0..total).collect();
    }
    (0..target)
        .map(|i| (u128::from(i) * u128::from(total) / u128::from(target)) as u64)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(freq_row: &[u16], literals: u8) -> CountsModel {
        CountsModel::from_parts(
            literals,
            1,
            1,
            0,
            vec![0u8; 64],
            Vec::new(),
            freq_row.to_vec(),
        )
        .unwrap()
    }

    #[test]
    fn coarse_lookup_points_at_or_before_the_symbol_of_every_slot() {
        // A row with zero-frequency symbols and ranges not aligned to 16.
        let k = 4u8;
        let s = k as usize + rans::BUCKETS;
        let mut row = vec![0u16; s];
        row[0] = 3000;
        row[1] = 7;
        row[3] = 1000;
        row[5] = 89;
        let m = model(&row, k);
        let (tab, lut) = device_tables(&m);
        assert_eq!(tab.len(), s | 1);
        assert_eq!(lut.len(), LUT_PER_ROW * CPAD);
        for slot in 0..rans::PROB_SCALE {
            // The kernel's lookup (class 0: the model has one) and walk.
            let mut sym = lut[slot as usize & 0xff0] as usize;
            let mut r = slot.wrapping_sub(tab[sym] & 0xffff);
            assert!(r < 4096, "slot {slot}: the entry starts after the slot");
            while r >= tab[sym] >> 16 {
                sym += 1;
                r = slot - (tab[sym] & 0xffff);
            }
            // Independent answer from the frequencies.
            let mut cum = 0u32;
            let mut want = usize::MAX;
            for (i, &f) in row.iter().enumerate() {
                if slot >= cum && slot < cum + u32::from(f) {
                    want = i;
                }
                cum += u32::from(f);
            }
            assert_eq!(sym, want, "slot {slot}");
        }
    }

    #[test]
    fn float_division_is_exact_where_the_encoder_uses_it() {
        // rans.cu `div_freq`, step by step: u32 → f32 and 1/f rounded to nearest, the product
        // rounded to nearest, truncated, then one remainder correction. The encoder divides
        // x < f·2^20 by 1 ≤ f ≤ 4096; test both ends of every quotient range near multiples of
        // f, the largest x, and a spread of x for every f.
        fn div_freq(x: u32, f: u32) -> u32 {
            let mut q = ((x as f32) * (1.0f32 / f as f32)) as u32;
            let r = i64::from(x) - i64::from(q) * i64::from(f);
            if r < 0 {
                q -= 1;
            } else if r >= i64::from(f) {
                q += 1;
            }
            q
        }
        let mut checked = 0u64;
        for f in 1u32..=4096 {
            let top = (u64::from(f) << 20) - 1;
            let mut xs: Vec<u64> = vec![0, 1, top, top - 1, top.saturating_sub(u64::from(f))];
            for q in (0u64..(1 << 20)).step_by(997).chain([(1 << 20) - 1]) {
                let base = q * u64::from(f);
                xs.extend([base, base + u64::from(f) - 1, base + u64::from(f) / 2]);
                if base > 0 {
                    xs.push(base - 1);
                }
            }
            for x in xs.into_iter().filter(|&x| x <= top) {
                let x = x as u32;
                assert_eq!(div_freq(x, f), x / f, "x {x} f {f}");
                checked += 1;
            }
        }
        assert!(checked > 4096 * 4000, "{checked}");
    }

    /// The decoder's view (rans.cu: step t, lane l reads byte t % 4 of word (t / 4)·32 + l)
    /// gives back every pixel's byte, on a frame that is a multiple of 128 pixels, one that
    /// ends inside a step, and one that ends inside a group; the padding is zero.
    #[test]
    fn interleave4_is_read_back_in_decoder_order() {
        for n in [36_864usize, 143, 100, 1] {
            let map: Vec<u8> = (0..n).map(|p| (p * 7 % 251) as u8 + 1).collect();
            let w = interleave4(&map);
            let steps = n.div_ceil(32);
            assert_eq!(w.len(), (steps.div_ceil(4) + 1) * 32, "n {n}");
            for t in 0..(steps.div_ceil(4) + 1) * 4 {
                for lane in 0..32 {
                    let got = (w[(t / 4) * 32 + lane] >> (8 * (t % 4))) & 0xff;
                    let p = t * 32 + lane;
                    let want = map.get(p).map_or(0, |&b| u32::from(b));
                    assert_eq!(got, want, "n {n} step {t} lane {lane}");
                }
            }
        }
    }

    #[test]
    fn sample_frames_spread_and_stay_in_range() {
        assert_eq!(sample_frames(5, 10), vec![0, 1, 2, 3, 4]);
        let s = sample_frames(262_144, 4096);
        assert_eq!(s.len(), 4096);
        assert_eq!(s[0], 0);
        assert!(s.windows(2).all(|w| w[1] - w[0] == 64));
        let s = sample_frames(1000, 7);
        assert!(s.windows(2).all(|w| w[1] > w[0]));
        assert!(*s.last().unwrap() < 1000);
    }

    #[test]
    fn fault_records_name_the_frame() {
        let v = [1u32, 11, 7, 0, 3, 65537, 2, 0];
        let f = fault_from_words(&v).unwrap();
        assert_eq!(f.frame, 7);
        let e = fault_error(&f, 1234);
        assert_eq!(e.frame, Some(1234));
        assert_eq!(e.kind, qem_core::ErrorKind::Decode);
        assert!(fault_from_words(&[0u32; 8]).is_none());
    }

    #[test]
    fn kernels_compile_with_nvrtc_when_present() {
        match crate::nvrtc::compile_cubin(KERNEL_FILE, KERNEL_SOURCE, "sm_90", &[]) {
            Ok((cubin, _log)) => assert!(!cubin.is_empty()),
            Err(e) => assert_eq!(e.kind, qem_core::ErrorKind::BackendUnavailable, "{e}"),
        }
    }
}

/// The kernels' algorithms replayed on the host, lane by lane, against the CPU specification:
/// catches ordering and bit-packing mistakes without a GPU.
#[cfg(test)]
#[allow(clippy::needless_range_loop, clippy::precedence)]
mod warp_emulation {
    use super::*;

    const L: u64 = 1 << 16;

    fn sym_of(v: u32, k: u32) -> u32 {
        if v < k {
            v
        } else {
            k + (31 - (v - k + 1).leading_zeros())
        }
    }

    /// rans.cu `qem_rans_encode` for one frame, step by step as a warp runs it.
    fn emulate_encode(m: &CountsModel, frame: &[u16]) -> Vec<u8> {
        let (tab, _) = device_tables(m);
        let n = frame.len();
        let k = u32::from(m.literals());
        let ctx = m.ctx_map();
        let set = if m.table_sets() > 1 {
            rans::table_set_of(m.thresholds(), m.statistic(frame)) as usize
        } else {
            0
        };
        let sp = table_stride(m);
        let c = m.contexts() as usize;
        let tset = &tab[set * c * sp..];
        let steps = n.div_ceil(32);
        // Extra bits through the 20-word window.
        let mut bits: Vec<u32> = vec![0; (15 * n >> 5) + 2];
        let mut win = [0u32; 20];
        let mut bitpos = 0u64;
        for t in 0..steps {
            let mut nb = [0u32; 32];
            let mut ex = [0u32; 32];
            for lane in 0..32 {
                let p = t * 32 + lane;
                if p < n {
                    let v = u32::from(frame[p]);
                    let sy = sym_of(v, k);
                    if sy >= k {
                        nb[lane] = sy - k;
                        ex[lane] = v - k + 1 - (1 << nb[lane]);
                    }
                }
            }
            if nb.iter().all(|&b| b == 0)
                && (0..32).all(|l| t * 32 + l >= n || sym_of(u32::from(frame[t * 32 + l]), k) < k)
            {
                continue;
            }
            let mut incl = [0u32; 32];
            let mut acc = 0;
            for lane in 0..32 {
                acc += nb[lane];
                incl[lane] = acc;
            }
            let tot = incl[31];
            for lane in 0..32 {
                if nb[lane] == 0
                    && !(t * 32 + lane < n && sym_of(u32::from(frame[t * 32 + lane]), k) >= k)
                {
                    continue;
                }
                let o0 = (bitpos & 31) as u32 + incl[lane] - nb[lane];
                win[(o0 >> 5) as usize] |= ex[lane] << (o0 & 31);
                if (o0 & 31) + nb[lane] > 32 {
                    win[(o0 >> 5) as usize + 1] |= ex[lane] >> (32 - (o0 & 31));
                }
            }
            let fill = (bitpos & 31) as u32 + tot;
            let full = (fill >> 5) as usize;
            let wbase = (bitpos >> 5) as usize;
            bits[wbase..wbase + full].copy_from_slice(&win[..full]);
            let carry = win[full];
            win = [0; 20];
            win[0] = carry;
            bitpos += u64::from(tot);
        }
        if bitpos & 31 != 0 {
            bits[(bitpos >> 5) as usize] = win[0];
        }
        // rANS, steps last to first, words at their encoder-order index.
        let mut x = [L as u32; 32];
        let mut wl: Vec<u16> = vec![0; n];
        let mut cnt = 0usize;
        for t in (0..steps).rev() {
            let mut emit = [false; 32];
            let mut fc = [(1u32, 0u32); 32];
            for lane in 0..32 {
                let p = t * 32 + lane;
                if p < n {
                    let e = tset[ctx[p] as usize * sp + sym_of(u32::from(frame[p]), k) as usize];
                    fc[lane] = (e >> 16, e & 0xffff);
                    emit[lane] = u64::from(x[lane]) >= u64::from(fc[lane].0) << 20;
                }
            }
            let total = emit.iter().filter(|&&b| b).count();
            for lane in 0..32 {
                if emit[lane] {
                    let r = emit[..lane].iter().filter(|&&b| b).count();
                    wl[cnt + total - 1 - r] = (x[lane] & 0xffff) as u16;
                    x[lane] >>= 16;
                }
            }
            cnt += total;
            for lane in 0..32 {
                if t * 32 + lane < n {
                    let (f, cu) = fc[lane];
                    x[lane] = (x[lane] / f) * 4096 + (x[lane] % f) + cu;
                }
            }
        }
        let n_ex = (bitpos as usize).div_ceil(32);
        let mut out = Vec::new();
        for w in [cnt as u32, bitpos as u32, set as u32, 0] {
            out.extend_from_slice(&w.to_le_bytes());
        }
        for v in x {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for i in 0..cnt {
            out.extend_from_slice(&wl[cnt - 1 - i].to_le_bytes());
        }
        if cnt % 2 == 1 {
            out.extend_from_slice(&[0, 0]);
        }
        for w in &bits[..n_ex] {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out
    }

    /// rans.cu `rans_decode_stream` (valid streams), with the coarse lookup walk.
    fn emulate_decode(m: &CountsModel, st: &[u8]) -> Vec<u16> {
        let (tab, lut) = device_tables(m);
        let n = m.frame_len();
        let k = u32::from(m.literals());
        let sp = table_stride(m);
        let c = m.contexts() as usize;
        let rd = |o: usize| u32::from_le_bytes(st[o..o + 4].try_into().unwrap());
        let (n_words, set) = (rd(0) as usize, rd(8) as usize);
        let mut x: Vec<u32> = (0..32).map(|l| rd(16 + 4 * l)).collect();
        let wb = 144;
        let ex0 = wb + 4 * n_words.div_ceil(2);
        let word = |i: usize| u32::from(u16::from_le_bytes([st[wb + 2 * i], st[wb + 2 * i + 1]]));
        let exw = |i: usize| u64::from(rd(ex0 + 4 * i));
        let n_ex = (st.len() - ex0) / 4;
        let mut base = 0usize;
        let mut bitpos = 0u32;
        let mut out = vec![0u16; n];
        // The classes as the kernel reads them: one ctx4 word per lane and group of 4 steps.
        let ctx4 = interleave4(m.ctx_map());
        for t in 0..n.div_ceil(32) {
            let mut sy = [0u32; 32];
            let mut need = [false; 32];
            for lane in 0..32 {
                let p = t * 32 + lane;
                if p >= n {
                    continue;
                }
                let class = (ctx4[(t / 4) * 32 + lane] >> (8 * (t % 4))) & 0xff;
                // lds_u8(lb + ((x & 0xff0) | c)), the entry at c·SP + s, then the walk.
                let lset = &lut[set * LUT_PER_ROW * CPAD..];
                let tset = &tab[set * c * sp..];
                let mut sym = lset[(x[lane] & 0xff0 | class) as usize] as usize;
                let slot = x[lane] & 4095;
                let mut e = tset[class as usize * sp + sym];
                let mut r = slot - (e & 0xffff);
                while r >= e >> 16 {
                    sym += 1;
                    e = tset[class as usize * sp + sym];
                    r = slot - (e & 0xffff);
                }
                x[lane] = (e >> 16) * (x[lane] >> 12) + r;
                sy[lane] = sym as u32;
                need[lane] = x[lane] < L as u32;
            }
            // Every lane reads its would-be word, clamped to the last one; the needy take it.
            let wlim = n_words.saturating_sub(1);
            for lane in 0..32 {
                let r = need[..lane].iter().filter(|&&b| b).count();
                let w = if n_words == 0 {
                    0
                } else {
                    word((base + r).min(wlim))
                };
                if need[lane] {
                    x[lane] = (x[lane] << 16) | w;
                }
            }
            base += need.iter().filter(|&&b| b).count();
            let mut acc = 0u32;
            for lane in 0..32 {
                let p = t * 32 + lane;
                if p >= n {
                    continue;
                }
                let mut v = sy[lane];
                if sy[lane] >= k {
                    let nb = sy[lane] - k;
                    let off = bitpos + acc;
                    let wi = (off >> 5) as usize;
                    // __funnelshift_r(lo, hi, off & 31): the low word of (hi:lo) >> (off & 31).
                    let lo = exw(wi);
                    let hi = if wi + 1 < n_ex { exw(wi + 1) } else { 0 };
                    let e = (((hi << 32 | lo) >> (off & 31)) as u32) & ((1 << nb) - 1);
                    v = k - 1 + (1 << nb) + e;
                    acc += nb;
                }
                out[p] = v as u16;
            }
            bitpos += acc;
        }
        assert!(x.iter().all(|&v| v == L as u32));
        assert_eq!(base, n_words);
        // rans_run's statistic of a full group: byte j of `fl` is 1 when step j's class is
        // below split, two values per dp2a.
        let split4 = (128 - u32::from(m.split())).wrapping_mul(0x0101_0101);
        let dp2a = |q: u32, b: u32, hi: bool| {
            let b = if hi { b >> 16 } else { b };
            (q & 0xffff) * (b & 0xff) + (q >> 16) * ((b >> 8) & 0xff)
        };
        let mut stat = 0u64;
        for g in 0..n / 128 {
            for lane in 0..32 {
                let cw = ctx4[g * 32 + lane];
                let fl = !(cw.wrapping_add(split4) >> 7) & 0x0101_0101;
                let v = |j: usize| u32::from(out[(4 * g + j) * 32 + lane]);
                let q01 = v(0) | v(1) << 16;
                let q23 = v(2) | v(3) << 16;
                stat += u64::from(dp2a(q01, fl, false) + dp2a(q23, fl, true));
            }
        }
        for p in n / 128 * 128..n {
            if m.ctx_map()[p] < m.split() {
                stat += u64::from(out[p]);
            }
        }
        assert_eq!(stat, m.statistic(&out), "the group statistic");
        out
    }

    fn frames(n: usize, len: usize, seed: u64) -> Vec<Vec<u16>> {
        let mut z = seed;
        let mut rnd = move || {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            z
        };
        (0..n)
            .map(|f| {
                (0..len)
                    .map(|p| {
                        let r = rnd();
                        // Bright middle, sparse edges, an occasional large value, a frame scale.
                        let bright = p % 37 < 9;
                        let scale = 1 + (f % 3) as u64;
                        match r % 97 {
                            0 => (r >> 20) as u16,
                            _ if bright => ((r >> 8) % (60 * scale)) as u16,
                            _ => ((r >> 8) % (3 * scale) / 2) as u16,
                        }
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn kernel_encoder_and_decoder_match_the_specification() {
        for &(len, t_sets, k) in &[
            (1000usize, 4u8, 32u8),
            (333, 1, 8),
            (36, 2, 128),
            (31, 1, 4),
        ] {
            let fr = frames(24, len, 0x1234 + len as u64);
            let params = ModelParams {
                table_sets: t_sets,
                literals: k,
                floor: rans::FloorPolicy::AllSymbols,
                ..ModelParams::default()
            };
            let m = CountsModel::fit(fr.iter().map(|f| f.as_slice()), len, &params).unwrap();
            for f in &fr {
                let spec = rans::encode_stream(&m, f).unwrap();
                let emu = emulate_encode(&m, f);
                assert_eq!(emu, spec, "len {len} T {t_sets} K {k}");
                assert_eq!(&emulate_decode(&m, &spec), f);
            }
        }
    }
}
