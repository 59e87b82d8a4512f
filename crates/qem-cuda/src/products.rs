//! One-pass detector reductions on the GPU ([`qem_core::ReduceRequest`] →
//! [`qem_core::ReduceResult`]), the wrapper of `kernels/products.cu` (the only place that knows
//! its kernel names and launch shapes). Over ENCODED data the rANS decode feeds the reductions
//! directly (`rans_decode_stream<Op>`, no dense frame in global memory); over dense data the
//! kernels read `u8`/`u16`/`u32` frames directly, and when only masks are asked for they read
//! only the pixel range that holds the masks' support (a BF disk reads about a third of each
//! 192×192 frame). Integer results are byte-exact against the CPU engine (`qem_cpu::products`);
//! float images are f64 sums in another order, equal to rounding.
//!
//! Shape of a launch: one warp per frame. The sum DP (and the max DP when it fits too) is
//! accumulated per CTA in shared `u32` and added to the `u64` result at the CTA's end; a CTA sums
//! at most [`MAX_FRAMES_PER_CTA`] frames of `u16` values, so its `u32`s cannot wrap. Data of
//! `u32` counts, or detectors too large for shared memory, use global atomics instead.
//! A request with more masks than one launch takes ([`MAX_BIN`] binary, [`MAX_WINT`] integer,
//! [`MAX_FLT`] float) is split into several launches over the same frames.
//!
//! Dense `u16` frames are read 16 bytes (8 pixels) per lane at a time; when `kc % 8 == 0` the
//! binary masks and moments of a group take two pixels per `dp2a` (products.cu `group8_u16`).
//! Over ENCODED data a lane's four values of each group of four decode steps do the same
//! (products.cu `PROD_GROUP4`, for kc ≥ 128 when moments are asked for).
//! All results come back with one wait: async copies into the process's pinned staging
//! buffer, then one stream synchronize (`mem::fetch_all`); the reduce's
//! [`ReduceResult::stages`] say where the time went (host set-up, the kernels by GPU events,
//! the wait and download). [`reduce_dense_on_device`] and [`reduce_encoded_on_device`] run the
//! same launches and leave the outputs in device memory instead ([`crate::device_result`]):
//! one stream synchronize, the fault check, no download.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    sys::{CUevent_flags, CUfunction_attribute_enum},
    CudaEvent, CudaFunction, DeviceRepr, LaunchConfig, PushKernelArg,
};
use qem_core::{
    DType, DetectorMask, Error, Moments, ReduceRequest, ReduceResult, Result, StageTiming,
    VirtualImage,
};
use std::time::Instant;

use crate::device::{driver_error, Gpu};
use crate::device_result::{DeviceMoments, DeviceReduceResult, DeviceVec, ResultDType};
use crate::engine::engine;
use crate::load::DeviceArray;
use crate::mem::DevBuf;
use crate::nvrtc::load_module;
use crate::rans::{self, fault_error, new_err_record, DeviceEncoded};

const KERNEL_SOURCE: &str = include_str!("kernels/products.cu");
const KERNEL_FILE: &str = "products.cu";
/// Binary masks one launch accumulates (bits of a per-pixel byte).
pub const MAX_BIN: usize = 8;
/// Integer-weighted masks one launch accumulates.
pub const MAX_WINT: usize = 2;
/// Float masks one launch accumulates.
pub const MAX_FLT: usize = 2;
/// Frames one CTA may add into its shared `u32` sum DP (65537 · 65535 < 2^32).
pub const MAX_FRAMES_PER_CTA: u64 = 65_536;
/// Warps per CTA without shared accumulators.
const WARPS_PLAIN: u32 = 8;
/// Warps per CTA with shared accumulators (one CTA per SM; launch bounds cap registers at 64).
const WARPS_SHARED: u32 = 32;

/// `ProdArgs` in products.cu: 10 pointers, 2 u64, 6 u32 (120 bytes, 8-byte aligned). What
/// the kernel computes comes from its module's defines ([`Shape`]), not from these fields.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ProdArgs {
    bits: u64,
    wint: u64,
    wflt: u64,
    frames: u64,
    img_int: u64,
    img_flt: u64,
    mom: u64,
    sum_dp: u64,
    max_dp: u64,
    cb4: u64,
    first: u64,
    count: u64,
    n: u32,
    kc: u32,
    /// [`row_magic`] of `kc`.
    kc_magic: u32,
    pad: [u32; 3],
}

// SAFETY: `ProdArgs` is `repr(C)` plain data with the exact layout of `struct ProdArgs` in
// products.cu.
unsafe impl DeviceRepr for ProdArgs {}

/// The multiplier with which the dense kernel finds the detector row of pixel `p` as
/// `(p · m) >> 32` (`__umulhi`) when `kc` is a multiple of 8 (else 0: that path is not taken).
/// `m = ⌊2^32 / kc⌋ + 1` exceeds `2^32/kc` by at most 1, so `p · m / 2^32` exceeds `p / kc` by at
/// most `p / 2^32`; with `p / kc = ⌊p / kc⌋ + r / kc`, `r ≤ kc − 1`, the floor is exact while
/// `p / 2^32 < 1 / kc`, i.e. `p · kc < 2^32` — always, as `p < n ≤ 2^16`
/// ([`qem_core::reduce::MAX_FRAME_PIXELS`]) and `kc ≤ n`.
fn row_magic(kc: usize) -> u32 {
    if kc < 8 || kc % 8 != 0 {
        return 0;
    }
    ((1u64 << 32) / kc as u64 + 1) as u32
}

/// The ENCODED kernel's per-group words (products.cu `ProdArgs::cb4`): for group `g` and lane
/// `l`, words `2·(32g + l)` and `2·(32g + l) + 1` are word `32g + l` of the model's context
/// classes in decoder order (`ctx4`, [`rans::interleave4`]) and of [`rans::interleave4`] of the
/// mask bytes (one zero group past the last, as there).
fn class_bits4(ctx4: &[u32], bits: &[u8]) -> Vec<u32> {
    let b4 = rans::interleave4(bits);
    ctx4.iter().zip(&b4).flat_map(|(&c, &b)| [c, b]).collect()
}

/// Bits 6 and 7 of the ENCODED mask bytes (products.cu `PROD_ROWFLAG`), per pixel `p` of an
/// `n`-pixel frame with `kc` ≥ 128 columns: pixel `p = 32·t + lane` of group `g = t / 4` is
/// compared with the lane's first pixel of the group `p0 = 128·g + lane`. Bit 7: `p` lies one
/// row below `p0` (with kc ≥ 128 a lane's group spans at most two rows); bit 6, on `p0` only:
/// the lane's first pixel of the next group, `p0 + 128`, lies one row below `p0`. Only the
/// full groups read them; the tail's values find their row by division.
fn row_flag_bits(n: usize, kc: usize) -> Vec<u8> {
    (0..n)
        .map(|p| {
            let (t, lane) = (p / 32, p % 32);
            let p0 = (t / 4) * 128 + lane;
            let mut b = u8::from(p / kc > p0 / kc) << 7;
            if p == p0 && (p0 + 128) / kc > p0 / kc {
                b |= 1 << 6;
            }
            b
        })
        .collect()
}

/// Fetches of `src` into `dst`, the vectors laid out one after another from byte 0 (a
/// launch's images of one kind, the three moments).
fn fetch_consecutive<'a, T: bytemuck::Pod>(
    src: &'a DevBuf,
    dst: &'a mut [Vec<T>],
    out: &mut Vec<Fetch<'a>>,
) {
    let mut offset = 0;
    for v in dst {
        let d: &mut [u8] = bytemuck::cast_slice_mut(v.as_mut_slice());
        let len = d.len();
        out.push(Fetch {
            src,
            offset,
            dst: d,
        });
        offset += len;
    }
}

/// What one launch computes: the products.cu defines of its module (one module per shape,
/// compiled on first use and kept, in memory and in NVRTC's on-disk CUBIN cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Shape {
    nbin: u32,
    nwint: u32,
    nflt: u32,
    mom: bool,
    /// 0 none, 1 shared u32 per CTA, 2 global atomics.
    sum: u32,
    /// 0 none, 1 shared u32 per CTA, 2 global atomics.
    max: u32,
    /// u32 values: u64 lane sums.
    wide: bool,
    /// Moments summed per detector row (u32), see products.cu.
    rowacc: bool,
    /// ENCODED: masks and moments per group of four steps (products.cu `PROD_GROUP4`).
    group4: bool,
    /// ENCODED with group4 and moments: the rows from flag bits 6 and 7 of the mask bytes
    /// ([`row_flag_bits`], products.cu `PROD_ROWFLAG`; at most 6 binary masks).
    rowflag: bool,
    warps: u32,
}

impl Shape {
    fn defines(&self) -> Vec<(String, String)> {
        let b = |x: bool| u32::from(x).to_string();
        vec![
            ("PROD_NBIN".into(), self.nbin.to_string()),
            ("PROD_NWINT".into(), self.nwint.to_string()),
            ("PROD_NFLT".into(), self.nflt.to_string()),
            ("PROD_MOM".into(), b(self.mom)),
            ("PROD_SUM".into(), self.sum.to_string()),
            ("PROD_MAX".into(), self.max.to_string()),
            ("PROD_WIDE".into(), b(self.wide)),
            ("PROD_ROWACC".into(), b(self.rowacc)),
            ("PROD_GROUP4".into(), b(self.group4)),
            ("PROD_ROWFLAG".into(), b(self.rowflag)),
            ("PROD_WARPS".into(), self.warps.to_string()),
        ]
    }
    fn shared(&self) -> bool {
        self.sum == 1 || self.max == 1
    }

    /// The module of `part`'s launch for `req` over frames of `kc` columns (ENCODED or dense)
    /// with the shared-memory `plan`: what decides whether a request finds its module in the
    /// shipped pack (src/kernels/shipped.txt; `tests::common_requests_ship_their_modules`).
    fn of(part: &Part, req: &ReduceRequest, encoded: bool, kc: usize, plan: &SmemPlan) -> Shape {
        let rest = part.carries_rest;
        let mode = |want: bool, shared: bool| match (want, shared) {
            (false, _) => 0,
            (true, true) => 1,
            (true, false) => 2,
        };
        Shape {
            nbin: part.bin.len() as u32,
            nwint: part.wint.len() as u32,
            nflt: part.flt.len() as u32,
            mom: rest && req.moments,
            sum: if rest {
                mode(req.sum_dp, plan.sum_shared)
            } else {
                0
            },
            max: if rest {
                mode(req.max_dp, plan.max_shared)
            } else {
                0
            },
            wide: !plan.small_values,
            rowacc: plan.small_values && kc <= 1024,
            // At most one row change per lane in a group of four steps (128 pixels on).
            group4: !(rest && req.moments) || kc >= 128,
            rowflag: encoded && rest && req.moments && kc >= 128 && part.bin.len() <= 6,
            warps: if rest && (plan.sum_shared || plan.max_shared) {
                WARPS_SHARED
            } else {
                WARPS_PLAIN
            },
        }
    }
}

/// Where a launch keeps its sum and max DP: in shared u32 per CTA for u8/u16 values when they
/// fit beside the model tables (the max too when there is room left), else global atomics.
#[derive(Debug, Clone, Copy)]
struct SmemPlan {
    /// u8/u16 values (or ENCODED, always u16): u32 sums per CTA cannot overflow.
    small_values: bool,
    sum_shared: bool,
    max_shared: bool,
    /// Dynamic shared memory of a launch: the model tables and the shared DP buffers, bytes.
    smem: u32,
}

impl SmemPlan {
    fn of(req: &ReduceRequest, n: usize, table_smem: u32, small_values: bool, budget: u32) -> Self {
        let frame_smem = (n * 4) as u32;
        let sum_shared = req.sum_dp && small_values && table_smem + frame_smem <= budget;
        let max_shared =
            req.max_dp && table_smem + frame_smem * (1 + u32::from(sum_shared)) <= budget;
        SmemPlan {
            small_values,
            sum_shared,
            max_shared,
            smem: table_smem + frame_smem * (u32::from(sum_shared) + u32::from(max_shared)),
        }
    }
}

/// The kernels of one [`Shape`].
#[derive(Debug)]
struct Variant {
    encoded: CudaFunction,
    dense_u8: CudaFunction,
    dense_u16: CudaFunction,
    dense_u32: CudaFunction,
}

/// The product kernels of one context: a module per request shape, compiled on first use.
#[derive(Debug)]
pub struct ProductKernels {
    variants: Mutex<HashMap<Shape, Arc<Variant>>>,
    sms: u32,
    max_smem_optin: u32,
}

impl ProductKernels {
    /// An empty cache for `gpu`'s device; modules are compiled (or fetched from the disk cache)
    /// per request shape. The source is rans.cu followed by products.cu (one program, so the
    /// fused decode is inlined).
    pub fn load(gpu: &Gpu) -> Result<ProductKernels> {
        Ok(ProductKernels {
            variants: Mutex::new(HashMap::new()),
            sms: gpu.info().multiprocessors.max(1) as u32,
            max_smem_optin: gpu.info().max_shared_per_block_optin.max(48 * 1024) as u32,
        })
    }

    fn variant(&self, gpu: &Gpu, shape: Shape) -> Result<Arc<Variant>> {
        if let Some(v) = self
            .variants
            .lock()
            .ok()
            .and_then(|m| m.get(&shape).cloned())
        {
            return Ok(v);
        }
        let src = format!("{}\n{}", rans::KERNEL_SOURCE, KERNEL_SOURCE);
        let defs = shape.defines();
        let refs: Vec<(&str, &str)> = defs.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        let m = load_module(gpu, KERNEL_FILE, &src, &refs)?;
        let f = |name: &str| {
            m.module
                .load_function(name)
                .map_err(|e| driver_error(&format!("load kernel {name}"), e))
        };
        let v = Arc::new(Variant {
            encoded: f("qem_products_encoded")?,
            dense_u8: f("qem_products_dense_u8")?,
            dense_u16: f("qem_products_dense_u16")?,
            dense_u32: f("qem_products_dense_u32")?,
        });
        if let Ok(mut map) = self.variants.lock() {
            map.insert(shape, v.clone());
        }
        Ok(v)
    }

    fn config(
        &self,
        f: &CudaFunction,
        smem: u32,
        count: u64,
        shape: &Shape,
    ) -> Result<LaunchConfig> {
        f.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(|e| driver_error("set kernel shared memory", e))?;
        let ctas = if shape.shared() {
            // One CTA per SM, but enough that no CTA sums more than MAX_FRAMES_PER_CTA frames:
            // a warp takes ⌈count / all warps⌉ frames, so a CTA sums at most
            // count/ctas + warps of them.
            let per = MAX_FRAMES_PER_CTA - shape.warps as u64;
            (self.sms as u64).max(count.div_ceil(per))
        } else {
            count
                .div_ceil(shape.warps as u64)
                .clamp(1, self.sms as u64 * 16)
        };
        Ok(LaunchConfig {
            grid_dim: (ctas.max(1) as u32, 1, 1),
            block_dim: (shape.warps * 32, 1, 1),
            shared_mem_bytes: smem,
        })
    }
}

/// One launch's share of a request: which masks, and whether it also carries the
/// frame-independent outputs (sum/max DP, moments: the first launch only).
struct Part {
    bin: Vec<usize>,
    wint: Vec<usize>,
    flt: Vec<usize>,
    carries_rest: bool,
}

/// Split the masks of `req` into launches of at most MAX_BIN/MAX_WINT/MAX_FLT masks.
fn partition(req: &ReduceRequest) -> Vec<Part> {
    let (mut bin, mut wint, mut flt) = (Vec::new(), Vec::new(), Vec::new());
    for (i, m) in req.masks.iter().enumerate() {
        match m {
            m if m.is_binary() => bin.push(i),
            DetectorMask::Int(_) => wint.push(i),
            DetectorMask::Float(_) => flt.push(i),
        }
    }
    let launches = [
        bin.len().div_ceil(MAX_BIN),
        wint.len().div_ceil(MAX_WINT),
        flt.len().div_ceil(MAX_FLT),
    ]
    .into_iter()
    .max()
    .unwrap_or(0)
    .max(1);
    (0..launches)
        .map(|l| Part {
            bin: bin
                .iter()
                .skip(l * MAX_BIN)
                .take(MAX_BIN)
                .copied()
                .collect(),
            wint: wint
                .iter()
                .skip(l * MAX_WINT)
                .take(MAX_WINT)
                .copied()
                .collect(),
            flt: flt
                .iter()
                .skip(l * MAX_FLT)
                .take(MAX_FLT)
                .copied()
                .collect(),
            carries_rest: l == 0,
        })
        .collect()
}

/// The data a pass reads.
enum Data<'a> {
    Encoded(&'a DeviceEncoded),
    Dense { ptr: u64, dtype: DType },
}

/// Device buffers of one launch, kept alive until its results are read.
struct PartBufs {
    part: Part,
    /// Mask uploads the launch reads (held until the synchronize).
    _bufs: Vec<DevBuf>,
    img_int: Option<DevBuf>,
    img_flt: Option<DevBuf>,
}

fn upload<T: bytemuck::Pod>(gpu: &Gpu, v: &[T], what: &str) -> Result<DevBuf> {
    crate::mem::upload(gpu.ctx(), v, None, what)
}

/// Upload `v` for a launch: the buffer is kept in `bufs` (alive until the launch is done) and
/// its device address returned.
fn upload_kept<T: bytemuck::Pod>(
    gpu: &Gpu,
    bufs: &mut Vec<DevBuf>,
    v: &[T],
    what: &str,
) -> Result<u64> {
    let b = upload(gpu, v, what)?;
    let ptr = b.ptr();
    bufs.push(b);
    Ok(ptr)
}

fn zeroed(gpu: &Gpu, bytes: usize, what: &str) -> Result<DevBuf> {
    let b = DevBuf::alloc(gpu.ctx(), bytes, None, what)?;
    b.zero()?;
    Ok(b)
}

use crate::mem::{fetch_all, Fetch};

/// The pixel range `[lo, hi)` a dense pass must read: the whole frame unless only masks are
/// requested, then the span of their support, widened to multiples of 8 for 16-byte loads.
fn pixel_range(req: &ReduceRequest, n: usize) -> (u32, u32) {
    if req.sum_dp || req.max_dp || req.moments {
        return (0, n as u32);
    }
    let (mut lo, mut hi) = (n, 0usize);
    for m in &req.masks {
        let s = m.support();
        if let (Some(&a), Some(&b)) = (s.first(), s.last()) {
            lo = lo.min(a as usize);
            hi = hi.max(b as usize + 1);
        }
    }
    if lo >= hi {
        return (0, 0);
    }
    let lo = lo & !7;
    let hi = hi.next_multiple_of(8).min(n);
    (lo as u32, hi as u32)
}

/// What [`launch`] queued on the engine's stream: the output buffers, the decode fault record
/// and the timing events, alive until the results are read ([`finish_host`]) or handed out
/// ([`finish_device`]). Every buffer a launch reads (mask uploads, the frame selection) is held
/// here too, so nothing is freed while a kernel may still use it.
struct Launched {
    gpu: &'static Gpu,
    parts: Vec<PartBufs>,
    sum_dp: Option<DevBuf>,
    max_dp: Option<DevBuf>,
    mom: Option<DevBuf>,
    err: DevBuf,
    _frames_buf: Option<DevBuf>,
    ev_start: CudaEvent,
    ev_end: CudaEvent,
    count: u64,
    n: usize,
    t0: Instant,
    t_launched: f64,
}

/// The operation name the reductions' errors carry.
const OP: &str = "detector reduction (CUDA)";

/// Check `req`, build the launches (one per [`Part`]) and queue them on the engine's stream;
/// nothing is waited for.
fn launch(
    data: Data<'_>,
    n_frames: u64,
    n: usize,
    kc: usize,
    req: &ReduceRequest,
) -> Result<Launched> {
    let t0 = Instant::now();
    req.validate(n_frames, n)?;
    let e = engine()?;
    let k = e.products()?;
    let gpu = &e.gpu;
    gpu.ctx()
        .bind_to_thread()
        .map_err(|err| driver_error("bind CUDA context", err))?;
    let count = req.n_selected(n_frames);
    let frames_buf = match &req.frames {
        Some(f) => Some(upload(gpu, f, "frame selection")?),
        None => None,
    };
    // The shared-memory plan: sums in shared u32 for u8/u16 values when they fit with the
    // model tables; the max too when there is room left.
    let (table_smem, small_values) = match &data {
        Data::Encoded(enc) => (enc.kernel_view().4, true),
        Data::Dense { dtype, .. } => (0u32, *dtype != DType::U32),
    };
    let plan = SmemPlan::of(req, n, table_smem, small_values, k.max_smem_optin);
    let smem = plan.smem;
    let (p_lo, p_hi) = pixel_range(req, n);
    let sum_dp = if req.sum_dp {
        Some(zeroed(gpu, n * 8, "sum DP")?)
    } else {
        None
    };
    let max_dp = if req.max_dp {
        Some(zeroed(gpu, n * 4, "max DP")?)
    } else {
        None
    };
    let mom = if req.moments {
        Some(DevBuf::alloc(
            gpu.ctx(),
            (3 * count as usize * 8).max(8),
            None,
            "moments",
        )?)
    } else {
        None
    };
    let err = new_err_record(gpu.ctx(), None)?;
    let stream = gpu.stream();
    let timed_event = || -> Result<CudaEvent> {
        gpu.ctx()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|er| driver_error("create event", er))
    };
    let (ev_start, ev_end) = (timed_event()?, timed_event()?);
    let mut parts = Vec::new();
    for part in partition(req) {
        let mut bufs = Vec::new();
        let mut a = ProdArgs {
            frames: frames_buf.as_ref().map_or(0, |b| b.ptr()),
            first: 0,
            count,
            n: n as u32,
            kc: kc as u32,
            kc_magic: row_magic(kc),
            ..Default::default()
        };
        let rest = part.carries_rest;
        let encoded = matches!(data, Data::Encoded(_));
        let shape = Shape::of(&part, req, encoded, kc, &plan);
        let var = k.variant(gpu, shape)?;
        let kernel = match &data {
            Data::Encoded(_) => &var.encoded,
            Data::Dense { dtype, .. } => match dtype {
                DType::U8 => &var.dense_u8,
                DType::U16 => &var.dense_u16,
                DType::U32 => &var.dense_u32,
            },
        };
        if !part.bin.is_empty() || shape.rowflag {
            let mut bits = if shape.rowflag {
                row_flag_bits(n, kc)
            } else {
                vec![0u8; n]
            };
            for (j, &mi) in part.bin.iter().enumerate() {
                if let DetectorMask::Int(w) = &req.masks[mi] {
                    for (b, &x) in bits.iter_mut().zip(w) {
                        *b |= u8::from(x != 0) << j;
                    }
                }
            }
            // Dense kernels read `bits` by pixel, the ENCODED one in the decoder's order beside
            // the model's classes (one 8-byte load per four steps, [`class_bits4`]).
            if let Data::Encoded(enc) = &data {
                let cb = class_bits4(enc.ctx4(), &bits);
                a.cb4 = upload_kept(gpu, &mut bufs, &cb, "classes and mask bits (decoder order)")?;
            } else {
                a.bits = upload_kept(gpu, &mut bufs, &bits, "mask bits")?;
            }
        }
        if !part.wint.is_empty() {
            let mut w16 = Vec::with_capacity(n * part.wint.len());
            for &mi in &part.wint {
                if let DetectorMask::Int(w) = &req.masks[mi] {
                    // validate() bounds integer weights by 65535.
                    w16.extend(w.iter().map(|&x| x as u16));
                }
            }
            a.wint = upload_kept(gpu, &mut bufs, &w16, "integer mask weights")?;
        }
        if !part.flt.is_empty() {
            let mut wf = Vec::with_capacity(n * part.flt.len());
            for &mi in &part.flt {
                if let DetectorMask::Float(w) = &req.masks[mi] {
                    wf.extend_from_slice(w);
                }
            }
            a.wflt = upload_kept(gpu, &mut bufs, &wf, "float mask weights")?;
        }
        let n_int = part.bin.len() + part.wint.len();
        let img_int = if n_int > 0 {
            Some(DevBuf::alloc(
                gpu.ctx(),
                n_int * count as usize * 8,
                None,
                "images",
            )?)
        } else {
            None
        };
        let img_flt = if !part.flt.is_empty() {
            Some(DevBuf::alloc(
                gpu.ctx(),
                part.flt.len() * count as usize * 8,
                None,
                "float images",
            )?)
        } else {
            None
        };
        a.img_int = img_int.as_ref().map_or(0, |b| b.ptr());
        a.img_flt = img_flt.as_ref().map_or(0, |b| b.ptr());
        if rest {
            a.mom = mom.as_ref().map_or(0, |b| b.ptr());
            a.sum_dp = sum_dp.as_ref().map_or(0, |b| b.ptr());
            a.max_dp = max_dp.as_ref().map_or(0, |b| b.ptr());
        }
        let this_smem = if shape.shared() { smem } else { table_smem };
        let cfg = k.config(kernel, this_smem, count, &shape)?;
        if parts.is_empty() {
            ev_start
                .record(stream)
                .map_err(|er| driver_error("record event", er))?;
        }
        let mut b = stream.launch_builder(kernel);
        let errp = err.ptr();
        match &data {
            Data::Encoded(enc) => {
                let (arena, alen, index, m, _) = enc.kernel_view();
                b.arg(&arena)
                    .arg(&alen)
                    .arg(&index)
                    .arg(&m)
                    .arg(&a)
                    .arg(&errp);
                // SAFETY: matches `qem_products_encoded(const u8*, u64, const u32*, RansModel,
                // ProdArgs, u32*)`. The arena, index and tables are the dataset's live buffers
                // and every stream access is bounds-checked by the decoder; every ProdArgs
                // pointer is a buffer above sized for `count` frames of `n` pixels (masks: n
                // bytes / n_wint·n u16 / n_flt·n f64; images count u64/f64 per mask; moments
                // 3·count u64; sum n u64; max n u32; frames count u64 < n_frames, checked by
                // validate); shared memory = tables + the shared accumulators the flags name.
                // All stay alive until the synchronize below.
                unsafe { b.launch(cfg) }
                    .map_err(|er| driver_error("launch products (encoded)", er))?;
            }
            Data::Dense { ptr, .. } => {
                b.arg(ptr).arg(&a).arg(&p_lo).arg(&p_hi);
                // SAFETY: matches `qem_products_dense_<T>(const T*, ProdArgs, u32, u32)`; the
                // data holds n_frames·n elements of T (the dataset's live array), p_lo ≤ p_hi ≤
                // n with p_lo a multiple of 8; ProdArgs buffers as for the encoded launch.
                unsafe { b.launch(cfg) }
                    .map_err(|er| driver_error("launch products (dense)", er))?;
            }
        }
        parts.push(PartBufs {
            part,
            _bufs: bufs,
            img_int,
            img_flt,
        });
    }
    ev_end
        .record(stream)
        .map_err(|er| driver_error("record event", er))?;
    let t_launched = t0.elapsed().as_secs_f64();
    Ok(Launched {
        gpu,
        parts,
        sum_dp,
        max_dp,
        mom,
        err,
        _frames_buf: frames_buf,
        ev_start,
        ev_end,
        count,
        n,
        t0,
        t_launched,
    })
}

/// The kernels' time between the launch's two events (0 when nothing was launched).
fn kernel_seconds(l: &Launched) -> Result<f64> {
    if l.parts.is_empty() {
        return Ok(0.0);
    }
    Ok(f64::from(
        l.ev_start
            .elapsed_ms(&l.ev_end)
            .map_err(|er| driver_error("event elapsed time", er))?,
    ) * 1e-3)
}

/// Bring every output of `l` to the host with one wait (mem::fetch_all), check the decode
/// fault record, and unpack the images into request order.
fn finish_host(l: Launched, req: &ReduceRequest) -> Result<ReduceResult> {
    let op = OP;
    let Launched {
        gpu,
        ref parts,
        ref sum_dp,
        ref max_dp,
        ref mom,
        ref err,
        count,
        n,
        t0,
        t_launched,
        ..
    } = l;
    let stream = gpu.stream();
    let c = count as usize;
    let mut err_words = [0u32; rans::ERR_WORDS];
    let mut part_images: Vec<Vec<Vec<u64>>> = Vec::new();
    let mut part_flt: Vec<Vec<Vec<f64>>> = Vec::new();
    for p in parts {
        part_images.push(vec![vec![0u64; c]; p.part.bin.len() + p.part.wint.len()]);
        part_flt.push(vec![vec![0f64; c]; p.part.flt.len()]);
    }
    let mut mom_v = mom
        .as_ref()
        .map(|_| [vec![0u64; c], vec![0u64; c], vec![0u64; c]]);
    let mut sum_v = sum_dp.as_ref().map(|_| vec![0u64; n]);
    let mut max_v = max_dp.as_ref().map(|_| vec![0u32; n]);
    {
        let mut fetches = vec![Fetch {
            src: err,
            offset: 0,
            dst: bytemuck::cast_slice_mut(&mut err_words),
        }];
        for ((p, ints), flts) in parts.iter().zip(&mut part_images).zip(&mut part_flt) {
            if let Some(b) = &p.img_int {
                fetch_consecutive(b, ints, &mut fetches);
            }
            if let Some(b) = &p.img_flt {
                fetch_consecutive(b, flts, &mut fetches);
            }
        }
        if let (Some(b), Some(vs)) = (&mom, &mut mom_v) {
            fetch_consecutive(b, vs, &mut fetches);
        }
        if let (Some(b), Some(v)) = (&sum_dp, &mut sum_v) {
            fetches.push(Fetch {
                src: b,
                offset: 0,
                dst: bytemuck::cast_slice_mut(v),
            });
        }
        if let (Some(b), Some(v)) = (&max_dp, &mut max_v) {
            fetches.push(Fetch {
                src: b,
                offset: 0,
                dst: bytemuck::cast_slice_mut(v),
            });
        }
        fetch_all(gpu.ctx(), stream, &mut fetches)?;
    }
    let t_done = t0.elapsed().as_secs_f64();
    if let Some(f) = rans::fault_from_words(&err_words) {
        return Err(fault_error(&f, f.frame).with_op(op));
    }
    let kernels_s = kernel_seconds(&l)?;
    let mut images: Vec<Option<VirtualImage>> = vec![None; req.masks.len()];
    for ((p, ints), flts) in parts.iter().zip(part_images).zip(part_flt) {
        for (&mi, v) in p.part.bin.iter().chain(&p.part.wint).zip(ints) {
            images[mi] = Some(VirtualImage::U64(v));
        }
        for (&mi, v) in p.part.flt.iter().zip(flts) {
            images[mi] = Some(VirtualImage::F64(v));
        }
    }
    let images = images
        .into_iter()
        .map(|x| x.ok_or_else(|| Error::internal(op, "a mask's image was not computed")))
        .collect::<Result<Vec<_>>>()?;
    let moments = mom_v.map(|[sum, m_row, m_col]| Moments { sum, m_row, m_col });
    Ok(ReduceResult {
        images,
        sum_dp: sum_v,
        max_dp: max_v,
        moments,
        n_frames: count,
        stages: vec![
            StageTiming::new("set-up and launch (host)", t_launched),
            StageTiming::new("kernels (GPU events, first launch to last end)", kernels_s),
            StageTiming::new(
                "wait and download (one batch of copies through pinned memory)",
                t_done - t_launched,
            ),
            StageTiming::new("unpack", t0.elapsed().as_secs_f64() - t_done),
        ],
    })
}

/// Run `req` over the frames of an ENCODED dataset on the GPU: one fused decode→reduce pass
/// (more only when the request has more masks than one launch takes).
pub fn reduce_encoded(enc: &DeviceEncoded, req: &ReduceRequest) -> Result<ReduceResult> {
    finish_host(launch_encoded(enc, req)?, req)
}

/// Run `req` over the frames of a dense GPU-resident dataset.
pub fn reduce_dense(arr: &DeviceArray, req: &ReduceRequest) -> Result<ReduceResult> {
    finish_host(launch_dense(arr, req)?, req)
}

/// [`reduce_encoded`] with the results left in device memory ([`DeviceReduceResult`]): the
/// same launches, then one stream synchronize and the fault check instead of the download.
pub fn reduce_encoded_on_device(
    enc: &DeviceEncoded,
    req: &ReduceRequest,
) -> Result<DeviceReduceResult> {
    finish_device(launch_encoded(enc, req)?, req)
}

/// [`reduce_dense`] with the results left in device memory ([`DeviceReduceResult`]).
pub fn reduce_dense_on_device(
    arr: &DeviceArray,
    req: &ReduceRequest,
) -> Result<DeviceReduceResult> {
    finish_device(launch_dense(arr, req)?, req)
}

fn launch_encoded(enc: &DeviceEncoded, req: &ReduceRequest) -> Result<Launched> {
    let shape = enc.frame_shape();
    launch(
        Data::Encoded(enc),
        enc.n_frames(),
        shape.len(),
        shape.cols,
        req,
    )
}

fn launch_dense(arr: &DeviceArray, req: &ReduceRequest) -> Result<Launched> {
    let [r, c, kr, kc] = arr.shape();
    launch(
        Data::Dense {
            ptr: arr.device_ptr(),
            dtype: arr.dtype(),
        },
        (r * c) as u64,
        kr * kc,
        kc,
        req,
    )
}

/// Hand the outputs of `l` out as device arrays, after waiting for the kernels.
///
/// Synchronize, not an event for the consumer: (1) the decode fault record must be read on the
/// host before any value is handed out (a fault means the values are wrong, and a plausible
/// wrong answer is never returned), and reading it needs the kernels to have ended anyway;
/// (2) the arrays are then complete for every stream, so a DLPack or CUDA Array Interface
/// consumer reading on its own stream (PyTorch's or CuPy's current stream, which do not wait for
/// this crate's non-blocking stream) has nothing to wait for, and `__dlpack__(stream=...)` is
/// honoured without further work. The cost is the one wait the host path has too, without the
/// download.
fn finish_device(l: Launched, req: &ReduceRequest) -> Result<DeviceReduceResult> {
    let stream = l.gpu.stream();
    stream
        .synchronize()
        .map_err(|e| driver_error("wait for the reduction kernels", e))?;
    let t_done = l.t0.elapsed().as_secs_f64();
    let mut err_words = [0u32; rans::ERR_WORDS];
    // After the synchronize above the record is final; `read` is a synchronous copy.
    l.err.read(0, bytemuck::cast_slice_mut(&mut err_words))?;
    if let Some(f) = rans::fault_from_words(&err_words) {
        return Err(fault_error(&f, f.frame).with_op(OP));
    }
    let kernels_s = kernel_seconds(&l)?;
    let ordinal = l.gpu.info().ordinal;
    let c = l.count as usize;
    let n = l.n;
    let mut images: Vec<Option<DeviceVec>> = vec![None; req.masks.len()];
    for p in l.parts {
        if let Some(b) = p.img_int {
            let b = Arc::new(b);
            for (j, &mi) in p.part.bin.iter().chain(&p.part.wint).enumerate() {
                images[mi] = Some(DeviceVec::new(
                    b.clone(),
                    j * c * 8,
                    c,
                    ResultDType::U64,
                    ordinal,
                )?);
            }
        }
        if let Some(b) = p.img_flt {
            let b = Arc::new(b);
            for (j, &mi) in p.part.flt.iter().enumerate() {
                images[mi] = Some(DeviceVec::new(
                    b.clone(),
                    j * c * 8,
                    c,
                    ResultDType::F64,
                    ordinal,
                )?);
            }
        }
    }
    let images = images
        .into_iter()
        .map(|x| x.ok_or_else(|| Error::internal(OP, "a mask's image was not computed")))
        .collect::<Result<Vec<_>>>()?;
    let whole = |b: DevBuf, len: usize, dtype: ResultDType| {
        DeviceVec::new(Arc::new(b), 0, len, dtype, ordinal)
    };
    let moments = match l.mom {
        Some(b) => {
            let b = Arc::new(b);
            let at = |k: usize| DeviceVec::new(b.clone(), k * c * 8, c, ResultDType::U64, ordinal);
            Some(DeviceMoments {
                sum: at(0)?,
                m_row: at(1)?,
                m_col: at(2)?,
            })
        }
        None => None,
    };
    Ok(DeviceReduceResult {
        images,
        sum_dp: l
            .sum_dp
            .map(|b| whole(b, n, ResultDType::U64))
            .transpose()?,
        max_dp: l
            .max_dp
            .map(|b| whole(b, n, ResultDType::U32))
            .transpose()?,
        moments,
        n_frames: l.count,
        stages: vec![
            StageTiming::new("set-up and launch (host)", l.t_launched),
            StageTiming::new("kernels (GPU events, first launch to last end)", kernels_s),
            StageTiming::new(
                "wait (stream synchronize; the results stay on the device)",
                t_done - l.t_launched,
            ),
            StageTiming::new("wrap", l.t0.elapsed().as_secs_f64() - t_done),
        ],
    })
}

#[cfg(test)]
mod tests;
