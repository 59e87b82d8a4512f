//! Batched bitshuffle/LZ4 (HDF5 filter 32008) decode on the GPU; the wrapper of
//! `kernels/bslz4_decode.cu` (the only place that knows its kernel names and launch shapes).
//!
//! **Planning (host, no GPU):** [`Bslz4Batch`] concatenates compressed chunks into one input
//! buffer and builds, with the CPU parser ([`qem_codec::bslz4::parse_chunk_into`], so every
//! framing check is shared with the CPU decoder), one 32-byte descriptor per LZ4 block
//! (payload offset in the batch, payload bytes, output byte offset, output bytes, chunk,
//! block index) and one per raw copy (a chunk's `N mod 8` tail, or a whole chunk whose filter
//! mask says the filter was skipped).
//!
//! **Kernel:** one warp per block. The warp decodes the LZ4 payload into its slice of shared
//! memory (all lanes parse the same token; literal and match copies are spread over the lanes;
//! every rule of docs/formats.md §4.2 checked in the same order as the CPU decoder), then
//! un-transposes the bit-planes to global memory: for blocks whose element count is a multiple
//! of 32, each lane loads the plane words of one 32-element group (consecutive words across
//! lanes, so no bank conflicts), transposes the bit matrix in registers and stores 16-byte
//! vectors; the last partial block takes a byte-granular path. Errors write a per-item status
//! `(code, position)` and the first error of the launch (atomicCAS) into a small record that
//! [`DeviceBatch::check_errors`] turns into a typed [`qem_core::Error`] naming frame, block,
//! byte and reason exactly as the CPU decoder would.

use cudarc::driver::{
    sys::CUfunction_attribute_enum, CudaFunction, CudaSlice, LaunchConfig, PushKernelArg,
};
use qem_codec::bslz4::{parse_chunk_into, ChunkLayout};
use qem_codec::{CodecError, Lz4Fault};
use qem_core::{Error, Result};
use serde::Serialize;

use crate::device::{driver_error, Gpu};
use crate::nvrtc::{load_module, ModuleInfo};

/// The kernel source, embedded.
pub const KERNEL_SOURCE: &str = include_str!("kernels/bslz4_decode.cu");
const KERNEL_FILE: &str = "bslz4_decode.cu";
/// Largest CTA the kernels are compiled for (`__launch_bounds__`).
const MAX_THREADS: u32 = 256;
/// Words per descriptor (8 × u32 = 32 bytes, two aligned 16-byte loads in the kernel).
const DESC_WORDS: usize = 8;
/// Words in the device error record.
const ERR_WORDS: usize = 8;

/// One decoded-output element size the kernels support.
fn kernel_name(elem_size: usize) -> Option<&'static str> {
    match elem_size {
        0 => Some("qem_lz4_decode_plain"),
        1 => Some("qem_bslz4_decode_u8"),
        2 => Some("qem_bslz4_decode_u16"),
        4 => Some("qem_bslz4_decode_u32"),
        _ => None,
    }
}

/// One chunk of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ChunkEntry {
    /// Byte offset of the chunk in the batch input.
    pub in_offset: u64,
    /// Compressed bytes of the chunk.
    pub in_len: u64,
    /// Byte offset of the chunk's decoded output in the batch output.
    pub out_offset: u64,
    /// Decoded bytes of the chunk.
    pub out_len: u64,
    /// Global frame index (for errors).
    pub frame: u64,
    /// HDF5 filter mask (bit 0 set: bitshuffle skipped, the chunk is raw).
    pub filter_mask: u32,
    /// Index of the chunk's first block descriptor.
    pub first_block: u32,
    /// Number of block descriptors of the chunk.
    pub n_blocks: u32,
}

/// A host-side plan: concatenated compressed chunks plus the kernel's descriptor tables.
#[derive(Debug, Clone, Default)]
pub struct Bslz4Batch {
    elem_size: usize,
    input: Vec<u8>,
    chunks: Vec<ChunkEntry>,
    blocks: Vec<u32>,
    copies: Vec<u32>,
    out_len: u64,
    max_block_bytes: usize,
    layout: ChunkLayout,
}

impl Bslz4Batch {
    /// An empty batch of bitshuffle/LZ4 chunks with `elem_size`-byte elements (1, 2 or 4).
    pub fn new(elem_size: usize) -> Result<Bslz4Batch> {
        if !matches!(elem_size, 1 | 2 | 4) {
            return Err(Error::invalid(
                "plan GPU decode",
                format!("element size {elem_size} bytes is not supported by the GPU decoder"),
            )
            .with_expected("1, 2 or 4")
            .with_found(elem_size.to_string()));
        }
        Ok(Bslz4Batch {
            elem_size,
            ..Default::default()
        })
    }

    /// An empty batch of plain LZ4 blocks (no bitshuffle, no chunk framing; see
    /// [`Bslz4Batch::push_lz4_block`]): the same LZ4 stage of the same kernel, used to test it
    /// against stand-alone LZ4 cases.
    pub fn new_plain_lz4() -> Bslz4Batch {
        Bslz4Batch::default()
    }

    /// Element size in bytes (0 for a plain LZ4 batch).
    pub fn elem_size(&self) -> usize {
        self.elem_size
    }

    /// The concatenated compressed input.
    pub fn input(&self) -> &[u8] {
        &self.input
    }

    /// The chunks in order.
    pub fn chunks(&self) -> &[ChunkEntry] {
        &self.chunks
    }

    /// Number of LZ4 block descriptors.
    pub fn n_blocks(&self) -> usize {
        self.blocks.len() / DESC_WORDS
    }

    /// Number of raw-copy descriptors (tails and unfiltered chunks).
    pub fn n_copies(&self) -> usize {
        self.copies.len() / DESC_WORDS
    }

    /// Total decoded bytes.
    pub fn out_len(&self) -> u64 {
        self.out_len
    }

    /// Largest decoded block in bytes (sets the shared memory per warp).
    pub fn max_block_bytes(&self) -> usize {
        self.max_block_bytes
    }

    /// Block descriptor `i` as `(payload offset, payload bytes, out offset, out bytes, chunk,
    /// block in chunk)`.
    pub fn block(&self, i: usize) -> Option<(u64, u32, u64, u32, u32, u32)> {
        let d = self.blocks.get(i * DESC_WORDS..(i + 1) * DESC_WORDS)?;
        Some((
            d[0] as u64 | (d[1] as u64) << 32,
            d[2],
            d[4] as u64 | (d[5] as u64) << 32,
            d[3],
            d[6],
            d[7],
        ))
    }

    /// Copy descriptor `i` as `(source offset, destination offset, bytes, chunk)`.
    pub fn copy(&self, i: usize) -> Option<(u64, u64, u32, u32)> {
        let d = self.copies.get(i * DESC_WORDS..(i + 1) * DESC_WORDS)?;
        Some((
            d[0] as u64 | (d[1] as u64) << 32,
            d[2] as u64 | (d[3] as u64) << 32,
            d[4],
            d[5],
        ))
    }

    fn chunk_index(&self, op: &str) -> Result<u32> {
        u32::try_from(self.chunks.len())
            .map_err(|_| Error::invalid(op, "more than u32::MAX chunks in one batch"))
    }

    fn push_block(
        &mut self,
        payload_off: u64,
        payload_len: usize,
        out_off: u64,
        out_len: usize,
        chunk: u32,
        block: u32,
    ) {
        let w = |v: u64| [v as u32, (v >> 32) as u32];
        let [p0, p1] = w(payload_off);
        let [o0, o1] = w(out_off);
        self.blocks.extend_from_slice(&[
            p0,
            p1,
            payload_len as u32,
            out_len as u32,
            o0,
            o1,
            chunk,
            block,
        ]);
        self.max_block_bytes = self.max_block_bytes.max(out_len);
    }

    fn push_copy(&mut self, src: u64, dst: u64, len: usize, chunk: u32) -> Result<()> {
        let len = u32::try_from(len)
            .map_err(|_| Error::invalid("plan GPU decode", "raw chunk larger than 4 GiB"))?;
        let w = |v: u64| [v as u32, (v >> 32) as u32];
        let [s0, s1] = w(src);
        let [d0, d1] = w(dst);
        self.copies
            .extend_from_slice(&[s0, s1, d0, d1, len, chunk, 0, 0]);
        Ok(())
    }

    /// Append one compressed chunk (as read from the file) whose decoded size is `out_len`
    /// bytes, for global frame `frame`. Its output follows the previous chunk's. The framing is
    /// validated here by the CPU parser (a framing error is a `Decode` error naming the frame
    /// and the batch is left unchanged); the LZ4 payloads are validated by the kernel.
    pub fn push_chunk(
        &mut self,
        chunk: &[u8],
        filter_mask: u32,
        frame: u64,
        out_len: usize,
    ) -> Result<()> {
        let op = "plan GPU decode";
        if self.elem_size == 0 {
            return Err(Error::invalid(op, "push_chunk on a plain-LZ4 batch"));
        }
        let ci = self.chunk_index(op)?;
        let in_offset = self.input.len() as u64;
        let out_offset = self.out_len;
        let first_block = self.n_blocks() as u32;
        if filter_mask & 1 != 0 {
            raw_chunk_fits(op, chunk.len(), out_len, frame)?;
            self.push_copy(in_offset, out_offset, chunk.len(), ci)?;
        } else {
            let mut layout = std::mem::take(&mut self.layout);
            let parsed = parse_chunk_into(chunk, self.elem_size, out_len, &mut layout);
            if let Err(e) = parsed {
                self.layout = layout;
                return Err(Error::decode(op, e.to_string()).with_frame(frame));
            }
            if layout.block_bytes > u32::MAX as usize / 2 {
                self.layout = layout;
                return Err(
                    Error::invalid(op, "block size too large for the GPU decoder")
                        .with_frame(frame),
                );
            }
            for (bi, b) in layout.blocks.iter().enumerate() {
                self.push_block(
                    in_offset + b.payload_offset as u64,
                    b.payload_len,
                    out_offset + b.out_offset as u64,
                    b.out_len,
                    ci,
                    bi as u32,
                );
            }
            if layout.tail_len > 0 {
                self.push_copy(
                    in_offset + layout.tail_offset as u64,
                    out_offset + layout.tail_out_offset() as u64,
                    layout.tail_len,
                    ci,
                )?;
            }
            self.layout = layout;
        }
        let n_blocks = self.n_blocks() as u32 - first_block;
        self.input.extend_from_slice(chunk);
        self.out_len += out_len as u64;
        self.chunks.push(ChunkEntry {
            in_offset,
            in_len: chunk.len() as u64,
            out_offset,
            out_len: out_len as u64,
            frame,
            filter_mask,
            first_block,
            n_blocks,
        });
        Ok(())
    }

    /// Append one stand-alone LZ4 block that must decode to exactly `out_len` bytes (plain-LZ4
    /// batches only). Each block is its own "chunk" with block index 0.
    pub fn push_lz4_block(&mut self, payload: &[u8], out_len: usize, frame: u64) -> Result<()> {
        let op = "plan GPU LZ4 decode";
        if self.elem_size != 0 {
            return Err(Error::invalid(op, "push_lz4_block on a bitshuffle batch"));
        }
        if payload.len() > u32::MAX as usize || out_len > u32::MAX as usize / 2 {
            return Err(Error::invalid(op, "LZ4 block too large"));
        }
        let ci = self.chunk_index(op)?;
        let in_offset = self.input.len() as u64;
        let first_block = self.n_blocks() as u32;
        self.push_block(in_offset, payload.len(), self.out_len, out_len, ci, 0);
        self.input.extend_from_slice(payload);
        self.chunks.push(ChunkEntry {
            in_offset,
            in_len: payload.len() as u64,
            out_offset: self.out_len,
            out_len: out_len as u64,
            frame,
            filter_mask: 0,
            first_block,
            n_blocks: 1,
        });
        self.out_len += out_len as u64;
        Ok(())
    }
}

/// The decode kernels loaded into one context.
#[derive(Debug, Clone)]
pub struct Bslz4Kernels {
    funcs: Vec<(usize, CudaFunction)>,
    /// How the module was obtained (cache, compile time).
    pub module: ModuleInfo,
    max_smem_optin: u32,
}

/// Resource usage of one kernel function, from `cuFuncGetAttribute`.
#[derive(Debug, Clone, Serialize)]
pub struct KernelAttributes {
    /// Kernel function name.
    pub name: String,
    /// Registers per thread.
    pub registers: i32,
    /// Static shared memory per CTA in bytes.
    pub static_shared_bytes: i32,
    /// Local memory (stack/spills) per thread in bytes.
    pub local_bytes: i32,
    /// Largest CTA the function can be launched with.
    pub max_threads_per_block: i32,
    /// SASS version (e.g. 90).
    pub binary_version: i32,
}

impl Bslz4Kernels {
    /// Compile (or fetch from the cache) and load the decode kernels for `gpu`'s device.
    pub fn load(gpu: &Gpu) -> Result<Bslz4Kernels> {
        let threads = MAX_THREADS.to_string();
        let m = load_module(
            gpu,
            KERNEL_FILE,
            KERNEL_SOURCE,
            &[("QEM_MAX_THREADS", &threads)],
        )?;
        let mut funcs = Vec::new();
        for es in [0usize, 1, 2, 4] {
            let Some(name) = kernel_name(es) else {
                continue;
            };
            let f = m
                .module
                .load_function(name)
                .map_err(|e| driver_error(&format!("load kernel {name}"), e))?;
            funcs.push((es, f));
        }
        Ok(Bslz4Kernels {
            funcs,
            module: m.info,
            max_smem_optin: gpu.info().max_shared_per_block_optin.max(48 * 1024) as u32,
        })
    }

    fn func(&self, elem_size: usize) -> Result<&CudaFunction> {
        self.funcs
            .iter()
            .find(|(e, _)| *e == elem_size)
            .map(|(_, f)| f)
            .ok_or_else(|| {
                Error::invalid(
                    "GPU decode",
                    format!("no kernel for element size {elem_size}"),
                )
            })
    }

    /// Register, shared- and local-memory usage of every kernel.
    pub fn attributes(&self) -> Vec<KernelAttributes> {
        self.funcs
            .iter()
            .map(|(es, f)| KernelAttributes {
                name: kernel_name(*es).unwrap_or("?").to_string(),
                registers: f.num_regs().unwrap_or(-1),
                static_shared_bytes: f.shared_size_bytes().unwrap_or(-1),
                local_bytes: f.local_size_bytes().unwrap_or(-1),
                max_threads_per_block: f.max_threads_per_block().unwrap_or(-1),
                binary_version: f.binary_version().unwrap_or(-1),
            })
            .collect()
    }
}

/// Descriptor tables for chunks whose bytes live in a buffer held elsewhere (the load
/// pipeline's pinned slots), with explicit input offsets, output offsets and chunk indices:
/// the output offset of a chunk can be its frame's position in the final result, and the chunk
/// index can be global to a whole load (so one error record serves every batch).
#[derive(Debug, Default, Clone)]
pub struct BlockTable {
    /// Block descriptors, 8 words each (layout of the `.cu` file).
    pub blocks: Vec<u32>,
    /// Copy descriptors, 8 words each.
    pub copies: Vec<u32>,
    /// Largest decoded block in bytes.
    pub max_block_bytes: usize,
    layout: ChunkLayout,
}

impl BlockTable {
    /// Forget every descriptor (keeps the allocations).
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.copies.clear();
        self.max_block_bytes = 0;
    }

    /// Number of block descriptors.
    pub fn n_blocks(&self) -> usize {
        self.blocks.len() / DESC_WORDS
    }

    /// Number of copy descriptors.
    pub fn n_copies(&self) -> usize {
        self.copies.len() / DESC_WORDS
    }

    /// Append another table's descriptors.
    pub fn append(&mut self, other: &BlockTable) {
        self.blocks.extend_from_slice(&other.blocks);
        self.copies.extend_from_slice(&other.copies);
        self.max_block_bytes = self.max_block_bytes.max(other.max_block_bytes);
    }

    /// Describe one stored chunk of `elem_size`-byte elements that sits at `in_offset` of the
    /// batch input and decodes to `out_len` bytes at `out_offset` of the output. The framing is
    /// validated by the CPU parser: an error is a `Decode` error naming `frame`, and the table
    /// is left unchanged.
    #[allow(clippy::too_many_arguments)]
    pub fn push_chunk(
        &mut self,
        chunk: &[u8],
        elem_size: usize,
        filter_mask: u32,
        frame: u64,
        chunk_index: u32,
        in_offset: u64,
        out_offset: u64,
        out_len: usize,
    ) -> Result<()> {
        let op = "plan GPU decode";
        let w = |v: u64| [v as u32, (v >> 32) as u32];
        if filter_mask & 1 != 0 {
            raw_chunk_fits(op, chunk.len(), out_len, frame)?;
            let len = u32::try_from(out_len)
                .map_err(|_| Error::invalid(op, "raw chunk larger than 4 GiB").with_frame(frame))?;
            let [s0, s1] = w(in_offset);
            let [d0, d1] = w(out_offset);
            self.copies
                .extend_from_slice(&[s0, s1, d0, d1, len, chunk_index, 0, 0]);
            return Ok(());
        }
        parse_chunk_into(chunk, elem_size, out_len, &mut self.layout)
            .map_err(|e| Error::decode(op, e.to_string()).with_frame(frame))?;
        if self.layout.block_bytes > u32::MAX as usize / 2 {
            return Err(
                Error::invalid(op, "block size too large for the GPU decoder").with_frame(frame),
            );
        }
        for (bi, b) in self.layout.blocks.iter().enumerate() {
            let [p0, p1] = w(in_offset + b.payload_offset as u64);
            let [o0, o1] = w(out_offset + b.out_offset as u64);
            self.blocks.extend_from_slice(&[
                p0,
                p1,
                b.payload_len as u32,
                b.out_len as u32,
                o0,
                o1,
                chunk_index,
                bi as u32,
            ]);
            self.max_block_bytes = self.max_block_bytes.max(b.out_len);
        }
        if self.layout.tail_len > 0 {
            let [s0, s1] = w(in_offset + self.layout.tail_offset as u64);
            let [d0, d1] = w(out_offset + self.layout.tail_out_offset() as u64);
            self.copies.extend_from_slice(&[
                s0,
                s1,
                d0,
                d1,
                self.layout.tail_len as u32,
                chunk_index,
                0,
                0,
            ]);
        }
        Ok(())
    }
}

/// One decode launch over raw device addresses (the load pipeline's buffers).
#[derive(Debug, Clone, Copy)]
pub struct RawDecode {
    /// Element size of the chunks (1, 2 or 4).
    pub elem_size: usize,
    /// Compressed input.
    pub input: u64,
    /// Bytes of input.
    pub in_len: u64,
    /// Block descriptors.
    pub blocks: u64,
    /// Number of block descriptors.
    pub n_blocks: u32,
    /// Copy descriptors.
    pub copies: u64,
    /// Number of copy descriptors.
    pub n_copies: u32,
    /// Output base.
    pub out: u64,
    /// Bytes of output (every descriptor is checked against it).
    pub out_len: u64,
    /// Error record (8 words).
    pub errors: u64,
    /// Status, 2 words per item.
    pub status: u64,
    /// Largest decoded block in bytes.
    pub max_block_bytes: usize,
}

impl Bslz4Kernels {
    /// Queue a decode over raw addresses on `stream` with `shape`.
    ///
    /// # Safety
    /// Every address must be a live device allocation of the size [`RawDecode`] describes
    /// (input `in_len` bytes, tables 8 words per item, output `out_len` bytes, status 2 words
    /// per item, error record 8 words), alive until the stream has passed this launch.
    pub unsafe fn launch_raw(
        &self,
        stream: &cudarc::driver::CudaStream,
        d: &RawDecode,
        shape: LaunchShape,
    ) -> Result<()> {
        let op = "launch GPU decode";
        let n_items = d.n_blocks as u64 + d.n_copies as u64;
        if n_items == 0 {
            return Ok(());
        }
        let f = self.func(d.elem_size)?;
        let smem_per_warp = warp_buffer_bytes(d.max_block_bytes, shape.stage_payload)
            .ok_or_else(|| Error::invalid(op, "block too large"))?;
        let stage = u32::from(shape.stage_payload);
        let cfg = decode_launch_config(f, smem_per_warp, self.max_smem_optin, n_items, shape)?;
        let mut b = stream.launch_builder(f);
        b.arg(&d.input)
            .arg(&d.in_len)
            .arg(&d.blocks)
            .arg(&d.n_blocks)
            .arg(&d.copies)
            .arg(&d.n_copies)
            .arg(&d.out)
            .arg(&d.out_len)
            .arg(&d.errors)
            .arg(&d.status)
            .arg(&smem_per_warp)
            .arg(&stage);
        // SAFETY: the argument list matches the kernel signature in bslz4_decode.cu (pointers
        // passed as 64-bit addresses); the caller guarantees the buffers (see the contract);
        // the kernel validates every descriptor against `in_len`, `out_len` and
        // `smem_per_warp` before use.
        unsafe { b.launch(cfg) }.map_err(|e| driver_error(op, e))?;
        Ok(())
    }
}

/// Launch shape of the decode kernel: warps per CTA (each warp owns one block at a time and
/// `max_block_bytes` of shared memory), an optional cap on the grid (0: one warp per item) and
/// where the LZ4 parser reads a block's payload from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LaunchShape {
    /// Warps per CTA, 1..=8.
    pub warps_per_cta: u32,
    /// Largest grid (CTAs); 0 means enough CTAs for one warp per work item.
    pub max_ctas: u32,
    /// Copy each block's payload into the end of its warp's shared buffer in one coalesced
    /// pass and parse it there, in place, instead of reading tokens, lengths and literals from
    /// global memory one dependent load at a time (`bslz4_decode.cu`, `decode_block`). The
    /// buffer grows by [`STAGE_MARGIN`] bytes; a block whose output would overtake its unread
    /// payload is decoded again from global memory, so the bytes and verdicts are the same
    /// either way. Not yet measured on a card, so off by default.
    pub stage_payload: bool,
}

impl Default for LaunchShape {
    fn default() -> Self {
        LaunchShape {
            warps_per_cta: 2,
            max_ctas: 0,
            stage_payload: false,
        }
    }
}

/// Bytes a staged payload may lead its block's output by, added to each warp's buffer. A block
/// parsed in place must keep every write below its first unread payload byte; the output ends
/// `buffer − out_len` bytes below the payload's end, and a valid block's remaining output falls
/// behind its remaining input only by token and length bytes of a literal-only tail (a few
/// bytes per 255 literals). 64 bytes keep the shared memory of one u16 block (8,192 + 64 bytes)
/// within 25 CTAs per SM at one warp per CTA. `bslz4_inplace_tests` replays the rule.
pub const STAGE_MARGIN: usize = 64;

/// Shared memory per warp of a decode whose largest block decodes to `max_block_bytes`: the
/// block rounded up to 16 bytes, plus [`STAGE_MARGIN`] when the payload is staged.
pub fn warp_buffer_bytes(max_block_bytes: usize, stage_payload: bool) -> Option<u32> {
    let margin = if stage_payload { STAGE_MARGIN } else { 0 };
    u32::try_from((max_block_bytes.div_ceil(16) * 16).max(16) + margin).ok()
}

/// A batch on the device: input, descriptor tables, output, per-item status and error record.
#[derive(Debug)]
pub struct DeviceBatch {
    elem_size: usize,
    chunks: Vec<ChunkEntry>,
    block_meta: Vec<(u32, u32)>,
    input: CudaSlice<u8>,
    in_len: u64,
    blocks: CudaSlice<u32>,
    n_blocks: u32,
    copies: CudaSlice<u32>,
    n_copies: u32,
    out: CudaSlice<u8>,
    out_len: u64,
    errors: CudaSlice<u32>,
    status: CudaSlice<u32>,
    max_block_bytes: usize,
}

/// The first error a launch recorded, as the kernel wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KernelFault {
    /// Kernel error code (see the `.cu` file).
    pub code: u32,
    /// Chunk index in the batch.
    pub chunk: u32,
    /// Block index in the chunk (`u32::MAX` for a raw copy).
    pub block: u32,
    /// Byte position in the block's LZ4 payload.
    pub position: u32,
    /// Detail values (lengths, offsets) depending on the code.
    pub a: u32,
    /// Second detail value.
    pub b: u32,
    /// Number of items that failed in the launch.
    pub count: u32,
}

/// Map a kernel error (code, position, details) to the CPU decoder's error for a block.
pub fn codec_error(code: u32, block: u32, position: u32, a: u32, b: u32) -> Option<CodecError> {
    let (a, b) = (a as usize, b as usize);
    let reason = match code {
        1 => Lz4Fault::EmptyInput,
        2 => Lz4Fault::TruncatedLength,
        3 => Lz4Fault::TruncatedOffset,
        4 => Lz4Fault::LengthOverflow,
        5 => Lz4Fault::LiteralsPastInput { len: a, left: b },
        6 => Lz4Fault::LiteralsPastOutput { len: a, room: b },
        7 => Lz4Fault::MatchOffsetZero,
        8 => Lz4Fault::OffsetBeforeStart {
            offset: a,
            decoded: b,
        },
        9 => Lz4Fault::MatchPastOutput { len: a, room: b },
        10 => Lz4Fault::ShortOutput {
            decoded: a,
            expected: b,
        },
        _ => return None,
    };
    Some(CodecError::Lz4 {
        block: Some(block as usize),
        position: position as usize,
        reason,
    })
}

/// The typed error for a kernel fault whose chunk holds `frame`.
pub fn fault_to_error(f: &KernelFault, frame: Option<u64>) -> Error {
    let op = "decode (GPU)";
    let detail = match codec_error(f.code, f.block, f.position, f.a, f.b) {
        Some(e) => e.to_string(),
        None => match f.code {
            11 => format!(
                "internal: block descriptor {} out of range (out {} bytes, payload {} bytes)",
                f.block, f.a, f.b
            ),
            12 => format!("internal: raw copy of {} bytes out of range", f.a),
            c => format!("internal: unknown kernel error code {c}"),
        },
    };
    let detail = if f.count > 1 {
        format!("{detail} ({} blocks failed in this batch)", f.count)
    } else {
        detail
    };
    let e = if f.code >= 11 {
        Error::internal(op, detail)
    } else {
        Error::decode(op, detail)
    };
    match frame {
        Some(fr) => e.with_frame(fr),
        None => e,
    }
}

/// The error record words (`err[0..8]` as the kernel writes them) as a fault, `None` if clean.
pub fn fault_from_record(v: &[u32]) -> Option<KernelFault> {
    if v.len() < ERR_WORDS || v[0] == 0 {
        return None;
    }
    Some(KernelFault {
        code: v[1],
        chunk: v[2],
        block: v[3],
        position: v[4],
        a: v[5],
        b: v[6],
        count: v[7],
    })
}

/// Per-item status of a launch, as the kernel wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ItemStatus {
    /// 0 for success, else the kernel error code.
    pub code: u32,
    /// Byte position in the payload of the error.
    pub position: u32,
}

impl DeviceBatch {
    /// Upload `batch` (input and tables) and allocate its output, status and error buffers on
    /// `gpu`'s stream.
    pub fn upload(gpu: &Gpu, batch: &Bslz4Batch) -> Result<DeviceBatch> {
        let s = gpu.stream();
        let up_u8 = |v: &[u8], what: &str| -> Result<CudaSlice<u8>> {
            if v.is_empty() {
                s.alloc_zeros::<u8>(16)
            } else {
                s.clone_htod(v)
            }
            .map_err(|e| driver_error(&format!("upload {what}"), e))
        };
        let up_u32 = |v: &[u32], what: &str| -> Result<CudaSlice<u32>> {
            if v.is_empty() {
                s.alloc_zeros::<u32>(DESC_WORDS)
            } else {
                s.clone_htod(v)
            }
            .map_err(|e| driver_error(&format!("upload {what}"), e))
        };
        let n_items = batch.n_blocks() + batch.n_copies();
        let too_many =
            || Error::invalid("upload GPU batch", "more than u32::MAX blocks in one batch");
        let out_len = usize::try_from(batch.out_len).map_err(|_| too_many())?;
        let out = s
            .alloc_zeros::<u8>(out_len.max(16))
            .map_err(|e| driver_error("allocate decode output", e))?;
        let block_meta = (0..batch.n_blocks())
            .filter_map(|i| batch.block(i).map(|b| (b.4, b.5)))
            .collect();
        Ok(DeviceBatch {
            elem_size: batch.elem_size,
            chunks: batch.chunks.clone(),
            block_meta,
            input: up_u8(&batch.input, "compressed chunks")?,
            in_len: batch.input.len() as u64,
            blocks: up_u32(&batch.blocks, "block table")?,
            n_blocks: u32::try_from(batch.n_blocks()).map_err(|_| too_many())?,
            copies: up_u32(&batch.copies, "copy table")?,
            n_copies: u32::try_from(batch.n_copies()).map_err(|_| too_many())?,
            out,
            out_len: batch.out_len,
            errors: s
                .alloc_zeros::<u32>(ERR_WORDS)
                .map_err(|e| driver_error("allocate error record", e))?,
            status: s
                .alloc_zeros::<u32>((2 * n_items).max(2))
                .map_err(|e| driver_error("allocate status", e))?,
            max_block_bytes: batch.max_block_bytes,
        })
    }

    /// Bytes of compressed input on the device.
    pub fn in_len(&self) -> u64 {
        self.in_len
    }

    /// Bytes of decoded output.
    pub fn out_len(&self) -> u64 {
        self.out_len
    }

    /// Fill the output with `byte` (to prove every byte is written by the next launch).
    pub fn poison_output(&mut self, gpu: &Gpu, byte: u8) -> Result<()> {
        use cudarc::driver::DevicePtrMut;
        let s = gpu.stream();
        let n = self.out.len();
        let (ptr, _sync) = self.out.device_ptr_mut(s);
        // SAFETY: `ptr` is this batch's output allocation of `n` bytes, on the same stream.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, byte, n, s.cu_stream()) }
            .map_err(|e| driver_error("poison output", e))
    }

    /// Clear the error record (the status array is overwritten by every launch).
    pub fn reset_errors(&mut self, gpu: &Gpu) -> Result<()> {
        gpu.stream()
            .memset_zeros(&mut self.errors)
            .map_err(|e| driver_error("reset error record", e))
    }

    /// Queue the decode of the whole batch on `gpu`'s stream (asynchronous). Call
    /// [`DeviceBatch::check_errors`] after it to learn whether every block decoded.
    pub fn launch(&mut self, gpu: &Gpu, kernels: &Bslz4Kernels, shape: LaunchShape) -> Result<()> {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let s = gpu.stream();
        // The guards record the buffers' use on this stream; they live past the launch.
        let (input, _g1) = self.input.device_ptr(s);
        let (blocks, _g2) = self.blocks.device_ptr(s);
        let (copies, _g3) = self.copies.device_ptr(s);
        let (out, _g4) = self.out.device_ptr_mut(s);
        let (errors, _g5) = self.errors.device_ptr_mut(s);
        let (status, _g6) = self.status.device_ptr_mut(s);
        let raw = RawDecode {
            elem_size: self.elem_size,
            input,
            in_len: self.in_len,
            blocks,
            n_blocks: self.n_blocks,
            copies,
            n_copies: self.n_copies,
            out,
            out_len: self.out_len,
            errors,
            status,
            max_block_bytes: self.max_block_bytes,
        };
        // SAFETY: the addresses are this batch's allocations with the lengths `raw` states
        // (input `in_len` bytes, tables 8 words per item, output `out_len` bytes, status 2
        // words per item, error record 8 words, all made in `upload`), and `self` outlives the
        // launch on this stream (the caller reads the error record before dropping it).
        unsafe { kernels.launch_raw(s, &raw, shape) }
    }

    /// Wait for the stream, then read the error record: `Ok` when every item decoded, else the
    /// first recorded error as a `Decode` error naming the frame, block, byte and reason.
    pub fn check_errors(&self, gpu: &Gpu) -> Result<()> {
        match self.first_fault(gpu)? {
            None => Ok(()),
            Some(f) => Err(self.fault_error(&f)),
        }
    }

    /// Wait for the stream, then read the raw error record (`None` when no item failed).
    pub fn first_fault(&self, gpu: &Gpu) -> Result<Option<KernelFault>> {
        let v = gpu
            .stream()
            .clone_dtoh(&self.errors)
            .map_err(|e| driver_error("read error record", e))?;
        gpu.synchronize()?;
        Ok(fault_from_record(&v))
    }

    /// The typed error for a kernel fault.
    pub fn fault_error(&self, f: &KernelFault) -> Error {
        fault_to_error(f, self.chunks.get(f.chunk as usize).map(|c| c.frame))
    }

    /// Wait for the stream, then read every item's status (blocks first, then copies), with
    /// each block's `(chunk, block in chunk)`.
    pub fn statuses(&self, gpu: &Gpu) -> Result<Vec<ItemStatus>> {
        let v = gpu
            .stream()
            .clone_dtoh(&self.status)
            .map_err(|e| driver_error("read status", e))?;
        gpu.synchronize()?;
        let n = self.n_blocks as usize + self.n_copies as usize;
        Ok(v.chunks_exact(2)
            .take(n)
            .map(|p| ItemStatus {
                code: p[0],
                position: p[1],
            })
            .collect())
    }

    /// `(chunk, block in chunk)` of block descriptor `i`.
    pub fn block_meta(&self, i: usize) -> Option<(u32, u32)> {
        self.block_meta.get(i).copied()
    }

    /// The chunks of the batch.
    pub fn chunks(&self) -> &[ChunkEntry] {
        &self.chunks
    }

    /// Copy the decoded output to the host (waits for the stream).
    pub fn download(&self, gpu: &Gpu) -> Result<Vec<u8>> {
        let mut v = gpu
            .stream()
            .clone_dtoh(&self.out)
            .map_err(|e| driver_error("download decode output", e))?;
        gpu.synchronize()?;
        v.truncate(self.out_len as usize);
        Ok(v)
    }
}

/// The launch shape of a decode of `n_items` items (blocks and copies): as many warps per CTA as
/// asked for (halved until their shared memory fits the opt-in limit), the kernel's dynamic
/// shared-memory attribute raised to match, and enough CTAs for one item per warp (capped by
/// `shape.max_ctas`). Shared by every decode launcher so they cannot drift apart.
fn decode_launch_config(
    f: &cudarc::driver::CudaFunction,
    smem_per_warp: u32,
    limit: u32,
    n_items: u64,
    shape: LaunchShape,
) -> Result<LaunchConfig> {
    let op = "launch GPU decode";
    let mut warps = shape.warps_per_cta.clamp(1, MAX_THREADS / 32);
    while warps > 1 && warps * smem_per_warp > limit {
        warps /= 2;
    }
    let smem = warps * smem_per_warp;
    if smem > limit {
        return Err(Error::invalid(
            op,
            format!(
                "a block of {smem_per_warp} bytes does not fit the GPU's shared memory ({limit} bytes per CTA)"
            ),
        ));
    }
    f.set_attribute(
        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .map_err(|e| driver_error("set kernel shared memory", e))?;
    let mut ctas = n_items.div_ceil(warps as u64).min(i32::MAX as u64) as u32;
    if shape.max_ctas > 0 {
        ctas = ctas.min(shape.max_ctas);
    }
    Ok(LaunchConfig {
        grid_dim: (ctas, 1, 1),
        block_dim: (warps * 32, 1, 1),
        shared_mem_bytes: smem,
    })
}

/// An unfiltered (raw) chunk must hold exactly its frames' bytes.
fn raw_chunk_fits(op: &str, chunk_len: usize, out_len: usize, frame: u64) -> Result<()> {
    if chunk_len == out_len {
        return Ok(());
    }
    let e = CodecError::SizeMismatch {
        what: "unfiltered (raw) chunk length",
        expected: out_len as u64,
        found: chunk_len as u64,
    };
    Err(Error::decode(op, e.to_string()).with_frame(frame))
}

#[cfg(test)]
#[path = "bslz4_inplace_tests.rs"]
mod inplace_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use qem_codec::bslz4::{encode_chunk, parse_chunk};

    fn arange_u16(n: u16) -> Vec<u8> {
        (0..n).flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn block_table_matches_the_cpu_layout_with_batch_offsets() {
        let a = encode_chunk(&arange_u16(44), 2, 16).unwrap(); // 3 blocks (16,16,8) + 4 tail
        let b = encode_chunk(&arange_u16(20), 2, 0).unwrap(); // 1 block of 16 + 4 tail
        let mut batch = Bslz4Batch::new(2).unwrap();
        batch.push_chunk(&a, 0, 7, 88).unwrap();
        batch.push_chunk(&b, 0, 8, 40).unwrap();
        assert_eq!(batch.input().len(), a.len() + b.len());
        assert_eq!(batch.n_blocks(), 4);
        assert_eq!(batch.n_copies(), 2);
        assert_eq!(batch.out_len(), 128);
        assert_eq!(batch.max_block_bytes(), 32);
        let la = parse_chunk(&a, 2, 88).unwrap();
        let lb = parse_chunk(&b, 2, 40).unwrap();
        for (i, s) in la.blocks.iter().enumerate() {
            let got = batch.block(i).unwrap();
            assert_eq!(
                got,
                (
                    s.payload_offset as u64,
                    s.payload_len as u32,
                    s.out_offset as u64,
                    s.out_len as u32,
                    0,
                    i as u32
                )
            );
        }
        let s = lb.blocks[0];
        let got = batch.block(3).unwrap();
        assert_eq!(got.0, a.len() as u64 + s.payload_offset as u64);
        assert_eq!(got.2, 88 + s.out_offset as u64);
        assert_eq!((got.4, got.5), (1, 0));
        assert_eq!(batch.copy(0).unwrap(), (la.tail_offset as u64, 80, 8, 0));
        assert_eq!(
            batch.copy(1).unwrap(),
            (a.len() as u64 + lb.tail_offset as u64, 88 + 32, 8, 1)
        );
        let c = batch.chunks();
        assert_eq!((c[1].frame, c[1].first_block, c[1].n_blocks), (8, 3, 1));
        assert_eq!((c[1].in_offset, c[1].out_offset), (a.len() as u64, 88));
    }

    #[test]
    fn framing_errors_name_the_frame_and_leave_the_batch_unchanged() {
        let a = encode_chunk(&arange_u16(44), 2, 16).unwrap();
        let mut batch = Bslz4Batch::new(2).unwrap();
        batch.push_chunk(&a, 0, 0, 88).unwrap();
        let before = (
            batch.input().len(),
            batch.n_blocks(),
            batch.n_copies(),
            batch.out_len(),
        );
        let e = batch.push_chunk(&a[..a.len() - 1], 0, 41, 88).unwrap_err();
        assert_eq!(e.kind, qem_core::ErrorKind::Decode);
        assert_eq!(e.frame, Some(41));
        let e = batch.push_chunk(&a, 0, 42, 90).unwrap_err();
        assert_eq!(e.frame, Some(42));
        let after = (
            batch.input().len(),
            batch.n_blocks(),
            batch.n_copies(),
            batch.out_len(),
        );
        assert_eq!(before, after);
    }

    #[test]
    fn block_table_places_chunks_at_explicit_offsets() {
        let a = encode_chunk(&arange_u16(44), 2, 16).unwrap();
        let b = encode_chunk(&arange_u16(20), 2, 0).unwrap();
        let mut batch = Bslz4Batch::new(2).unwrap();
        batch.push_chunk(&a, 0, 7, 88).unwrap();
        batch.push_chunk(&b, 0, 8, 40).unwrap();
        // Same chunks, input at 1000/2000, output at frame slots 5 and 2 of 88-byte frames,
        // global chunk indices 30 and 31.
        let mut t = BlockTable::default();
        t.push_chunk(&a, 2, 0, 7, 30, 1000, 5 * 88, 88).unwrap();
        t.push_chunk(&b, 2, 0, 8, 31, 2000, 2 * 88, 40).unwrap();
        assert_eq!(t.n_blocks(), batch.n_blocks());
        assert_eq!(t.n_copies(), batch.n_copies());
        assert_eq!(t.max_block_bytes, batch.max_block_bytes());
        for i in 0..t.n_blocks() {
            let want = batch.block(i).unwrap();
            let d = &t.blocks[i * 8..i * 8 + 8];
            let (in_base, out_base, ci) = if want.4 == 0 {
                (1000, 5 * 88, 30)
            } else {
                (2000 - a.len() as u64, 2 * 88 - 88, 31)
            };
            assert_eq!(d[0] as u64 | (d[1] as u64) << 32, want.0 + in_base);
            assert_eq!(d[2], want.1);
            assert_eq!(d[3], want.3);
            assert_eq!(d[4] as u64 | (d[5] as u64) << 32, want.2 + out_base);
            assert_eq!((d[6], d[7]), (ci, want.5));
        }
        // Framing errors name the frame and leave the table unchanged.
        let before = (t.n_blocks(), t.n_copies());
        let e = t
            .push_chunk(&a[..a.len() - 1], 2, 0, 41, 32, 0, 0, 88)
            .unwrap_err();
        assert_eq!(e.frame, Some(41));
        assert_eq!((t.n_blocks(), t.n_copies()), before);
        // Raw chunks: one copy with the explicit offsets.
        let raw = arange_u16(10);
        let mut r = BlockTable::default();
        r.push_chunk(&raw, 2, 1, 3, 9, 64, 640, 20).unwrap();
        assert_eq!(r.copies, vec![64, 0, 640, 0, 20, 9, 0, 0]);
        assert!(r.push_chunk(&raw, 2, 1, 4, 9, 64, 640, 22).is_err());
    }

    #[test]
    fn raw_chunks_become_one_copy() {
        let raw = arange_u16(10);
        let mut batch = Bslz4Batch::new(2).unwrap();
        batch.push_chunk(&raw, 1, 3, 20).unwrap();
        assert_eq!(batch.n_blocks(), 0);
        assert_eq!(batch.copy(0).unwrap(), (0, 0, 20, 0));
        assert!(batch.push_chunk(&raw, 1, 4, 22).is_err());
    }

    #[test]
    fn plain_lz4_blocks_and_unsupported_sizes() {
        let mut batch = Bslz4Batch::new_plain_lz4();
        batch.push_lz4_block(&[0x00], 0, 0).unwrap();
        batch.push_lz4_block(&[], 0, 1).unwrap();
        batch.push_lz4_block(&[0x10, 0xaa], 1, 2).unwrap();
        assert_eq!(batch.n_blocks(), 3);
        assert_eq!(batch.block(2).unwrap(), (1, 2, 0, 1, 2, 0));
        assert!(batch.push_chunk(&[0; 12], 0, 0, 0).is_err());
        assert!(Bslz4Batch::new(3).is_err());
        assert!(Bslz4Batch::new(8).is_err());
    }

    #[test]
    fn kernel_codes_map_to_cpu_errors() {
        let e = codec_error(7, 3, 88, 0, 0).unwrap();
        assert_eq!(e.to_string(), "LZ4 match offset 0 at byte 88 of block 3");
        let e = codec_error(8, 0, 10, 10, 9).unwrap();
        assert!(matches!(
            e,
            CodecError::Lz4 {
                reason: Lz4Fault::OffsetBeforeStart {
                    offset: 10,
                    decoded: 9
                },
                ..
            }
        ));
        assert!(codec_error(11, 0, 0, 0, 0).is_none());
    }

    #[test]
    fn kernel_source_has_the_names_the_wrapper_launches() {
        for es in [0, 1, 2, 4] {
            let name = kernel_name(es).unwrap();
            assert!(
                KERNEL_SOURCE.contains(&format!("QEM_KERNEL({name},")),
                "{name}"
            );
        }
    }
}
