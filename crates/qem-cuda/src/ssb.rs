//! Single-sideband ptychography on the GPU: the wrapper of `kernels/ssb.cu` (the only place
//! that knows its kernel names and launch shapes). `qem_cpu::ssb` is the specification; this
//! module computes the same object and losses in f32 (sums across threads in f64, in a fixed
//! order, so a result does not change from run to run).
//!
//! [`GpuSsb::prepare`] gathers the BF pixels' images from the dataset where it lies on the card
//! (dense `u8`/`u16`/`u32` read in place; ENCODED decoded frame chunk by frame chunk into a
//! scratch, one decode pass per batch of BF pixels), FFTs them with cuFFT (R2C, batched) and
//! keeps `G_b(ν)` as half spectra (the other half is the mirror of a real image's spectrum),
//! tiled so that each accumulate block streams one contiguous region (kernels/ssb.cu, `g_at`):
//! complex f32 when that fits the memory budget, else complex f16 scaled per pixel by
//! `G_b(0)/60000` (half the bytes, 11 significant bits). Batches of BF pixels are sized so that
//! G, the work buffers and the batch's images, cuFFT work areas and decode scratch stay within the
//! budget; a G that does not fit even as f16 is a `MemoryBudget` error naming the bytes.
//!
//! Each evaluation ([`GpuSsb::object`], [`GpuSsb::coherence`], [`GpuSsb::phase_variance`])
//! uploads nothing but its 8 aberration coefficients: a tiny kernel tabulates `P(k_b)`, the
//! accumulate kernel forms `Σ_b C_b(ν)` and `Σ |C_b|²` over the full plane in one read of G, and
//! only the object (N complex values) or a few hundred per-block partial sums come back. When χ
//! is quadratic (only C10, C12, φ12 — the default fit) the accumulate kernel needs no χ and no
//! sincos per pixel: `Γ_b(±ν) = A(k_b) E^{±1} W_±` with `E = exp(2i k_bᵀMν)` carried along each
//! detector row by one complex product (kernels/ssb.cu, `quad_terms`; [`quad_gamma`] is the same
//! algebra in f64, tested against `qem_cpu::ssb::gamma`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::cufft::{result as cufft, sys as cufft_sys};
use cudarc::driver::{
    sys, CudaEvent, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use qem_core::{DType, Error, Result, Shape2};
use qem_cpu::ssb::{chi_polynomial, Aberrations, Optics};

use crate::device::{driver_error, Gpu};
use crate::engine::{engine, Engine};
use crate::fft::{cufft_error, require_cufft, Plan};
use crate::load::DeviceArray;
use crate::mem::{read_vec, upload, DevBuf, MemCounter, PinnedBuf};
use crate::nvrtc::load_module;
use crate::rans::{fault_error, new_err_record, read_err, DeviceEncoded};

const KERNEL_SOURCE: &str = include_str!("kernels/ssb.cu");
const KERNEL_FILE: &str = "ssb.cu";
const OP: &str = "ssb (CUDA)";
/// cuFFT's `CUFFT_INVERSE`.
const CUFFT_INVERSE: i32 = 1;
/// Threads per block of every SSB kernel (the block reductions assume 256).
const THREADS: u32 = 256;
/// Most BF pixels in one accumulate slice: its tables (ssb.cu ACC_TABLE_BYTES = 28 bytes a
/// pixel) and the 2 KB reduction must fit the 48 KB a block gets without opting in.
const MAX_SLICE_PIXELS: u32 = 1600;
const ACC_TABLE_BYTES: u32 = 28;
/// G16 stores `G_b(ν)·60000/G_b(0)`: below f16's largest finite value (65504).
const G16_FULL_SCALE: f64 = 60_000.0;
/// Most BF pixels one prepare batch takes (bounds the images buffer, 1 MiB per pixel at 512²).
const MAX_PREPARE_BATCH: usize = 4096;
/// Most BF pixels one phase-variance batch inverse-transforms at once.
const MAX_PV_BATCH: usize = 256;
/// Device bytes left free when no budget is given (cuFFT plans, the driver, other work).
const FREE_MARGIN: u64 = 512 << 20;
/// Decode scratch of an ENCODED gather, at most.
const DECODE_SCRATCH: u64 = 256 << 20;

/// How `G_b(ν)` is stored on the card.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GStorage {
    /// Complex f32 half spectra (8 bytes a value).
    C32,
    /// Complex f16 half spectra scaled per pixel (4 bytes a value).
    C16,
}

impl GStorage {
    /// Name used in provenance.
    pub fn name(self) -> &'static str {
        match self {
            GStorage::C32 => "half spectrum, complex f32",
            GStorage::C16 => "half spectrum, complex f16 scaled by G_b(0)/60000 per pixel",
        }
    }
    fn bytes_per_value(self) -> u64 {
        match self {
            GStorage::C32 => 8,
            GStorage::C16 => 4,
        }
    }
}

/// The BF pixels' images of a dataset the card does not hold, produced by the host a few
/// pixels at a time (so neither the card nor the host holds all of them at once).
pub trait HostImages: Sync {
    /// The counts of BF pixels `[p0, p0 + np)` (indices into [`Setup::pixels`]) over the scan,
    /// `out[j·N + R]` for pixel `p0 + j` at scan position `R` (N = the scan's length);
    /// `out.len() == np·N`.
    fn fill(&self, p0: usize, np: usize, out: &mut [u32]) -> Result<()>;
}

/// Where the BF pixels' counts come from.
#[derive(Clone, Copy)]
pub enum Source<'a> {
    /// A dense `[R_r, R_c, k_r, k_c]` array on the card.
    Dense(&'a DeviceArray),
    /// ENCODED frames on the card.
    Encoded(&'a DeviceEncoded),
    /// The BF pixels' images from the host, for a dataset the card does not hold: filled into
    /// two pinned buffers of at most [`HOST_CHUNK_BYTES`] in turn and uploaded asynchronously
    /// (the host fills the next while the card copies and transforms the last), so the card
    /// holds G and one batch, never the acquisition.
    Host {
        /// Produces the images.
        images: &'a dyn HostImages,
        /// Detector shape (for the pixel-index check and the detector rows).
        frame: Shape2,
    },
}

impl std::fmt::Debug for Source<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Dense(a) => f.debug_tuple("Dense").field(a).finish(),
            Source::Encoded(e) => f.debug_tuple("Encoded").field(e).finish(),
            Source::Host { frame, .. } => f.debug_struct("Host").field("frame", frame).finish(),
        }
    }
}

/// Bytes of each of the two pinned buffers the host route fills and uploads in turn.
pub const HOST_CHUNK_BYTES: usize = 128 << 20;

/// The host route's pinned buffers; on drop (also on an error) the stream is synchronized
/// before they go back to the engine, so no queued copy outlives its source.
struct Staging<'a> {
    bufs: Vec<(PinnedBuf, CudaEvent, bool)>,
    stream: &'a CudaStream,
    engine: &'a Engine,
}

impl Drop for Staging<'_> {
    fn drop(&mut self) {
        if self.bufs.is_empty() {
            return;
        }
        let _ = self.stream.synchronize();
        for (b, _, _) in self.bufs.drain(..) {
            self.engine.give_pinned(b);
        }
    }
}

/// What [`GpuSsb::prepare`] needs besides the data: the BF pixels, their k vectors and the
/// exact sums `G_b(0) = Σ_R I_R(p_b)`, the scan and its frequencies, the optics.
#[derive(Debug, Clone)]
pub struct Setup<'a> {
    /// Flat detector indices of the BF pixels.
    pub pixels: &'a [usize],
    /// Their reciprocal vectors (rotated), Å⁻¹.
    pub k: &'a [(f64, f64)],
    /// `Σ` over the scan of each BF pixel's counts (the sum DP at the pixel).
    pub g0: &'a [f64],
    /// Scan grid (= the dataset's scan shape).
    pub scan: Shape2,
    /// `fftfreq` of the scan rows and columns, Å⁻¹.
    pub nu_r: &'a [f64],
    /// See `nu_r`.
    pub nu_c: &'a [f64],
    /// Optics.
    pub optics: Optics,
    /// Device bytes this SSB may hold at once (`None` = free device memory less a margin).
    pub budget: Option<u64>,
    /// Force a storage (`None` = C32 when it fits, else C16).
    pub storage: Option<GStorage>,
}

/// How a preparation went.
#[derive(Debug, Clone, PartialEq)]
pub struct PrepareStats {
    /// Storage of G.
    pub storage: GStorage,
    /// Bytes of G.
    pub g_bytes: u64,
    /// BF pixels per prepare batch.
    pub batch_pixels: usize,
    /// Prepare batches (over ENCODED data: decode passes).
    pub batches: usize,
    /// Seconds to gather the images (incl. decode) and FFT them, wall, synchronized.
    pub seconds: f64,
    /// Peak device bytes this SSB allocated while preparing (G, work, batch buffers, cuFFT work
    /// areas, decode scratch).
    pub peak_bytes: u64,
    /// The budget the plan was sized for.
    pub budget: u64,
}

/// `SsbOptics` of ssb.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct OpticsArg {
    lambda: f32,
    alpha: f32,
    dr2: f32,
    dc2: f32,
}
// SAFETY: repr(C) plain f32s with the layout of `struct SsbOptics`.
unsafe impl DeviceRepr for OpticsArg {}

/// `SsbAb` of ssb.cu: the [`chi_polynomial`] coefficients.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AbArg([f32; 8]);
// SAFETY: repr(C) plain f32s with the layout of `struct SsbAb`.
unsafe impl DeviceRepr for AbArg {}

/// `SsbQuad` of ssb.cu: χ's quadratic form and the step of k along a detector row.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct QuadArg {
    m_rr: f32,
    m_cc: f32,
    m_rc: f32,
    dx: f32,
    dy: f32,
    rin2: f32,
    rout2: f32,
    inv_d: f32,
    soft: u32,
}
// SAFETY: repr(C) plain 4-byte fields with the layout of `struct SsbQuad` (ssb.cu asserts the
// same 36 bytes).
unsafe impl DeviceRepr for QuadArg {}
const _: () = assert!(std::mem::size_of::<QuadArg>() == 36);

#[derive(Debug)]
struct Funcs {
    probe_table: CudaFunction,
    accumulate: CudaFunction,
    accumulate_quad: CudaFunction,
    corrected: CudaFunction,
    sum_slices: CudaFunction,
    finish: CudaFunction,
    phase_accum: CudaFunction,
    phase_var: CudaFunction,
    gather_u8: CudaFunction,
    gather_u16: CudaFunction,
    gather_u32: CudaFunction,
    store: CudaFunction,
    u32_to_f32: CudaFunction,
}

impl Funcs {
    fn gather(&self, dtype: DType) -> &CudaFunction {
        match dtype {
            DType::U8 => &self.gather_u8,
            DType::U16 => &self.gather_u16,
            DType::U32 => &self.gather_u32,
        }
    }
}

/// A cuFFT plan with the work area we allocated for it (so the budget sees it).
struct SizedPlan {
    plan: Plan,
    _work: Option<DevBuf>,
}

/// A batched 2-D plan of `kind` over `scan` (basic layout) without a work area, and the bytes
/// of the work area it needs.
fn bare_plan(scan: Shape2, kind: cufft_sys::cufftType, batch: usize) -> Result<(Plan, usize)> {
    let h = cufft::create().map_err(|e| cufft_error(OP, "create plan", e))?;
    let plan = Plan(h);
    let mut n = [scan.rows as i32, scan.cols as i32];
    // SAFETY: a fresh plan; `n` outlives the call; null embeds select the basic layout.
    let work = unsafe {
        cufft::set_auto_allocation(plan.0, false).map_err(|e| cufft_error(OP, "plan", e))?;
        cufft::make_plan_many(
            plan.0,
            2,
            n.as_mut_ptr(),
            std::ptr::null_mut(),
            1,
            0,
            std::ptr::null_mut(),
            1,
            0,
            kind,
            batch as i32,
        )
        .map_err(|e| cufft_error(OP, &format!("make plan ({batch} transforms)"), e))?
    };
    Ok((plan, work))
}

/// A batched 2-D plan of `kind` over `scan` with its work area counted in `counter`.
fn make_plan(
    gpu: &Gpu,
    scan: Shape2,
    kind: cufft_sys::cufftType,
    batch: usize,
    counter: &Arc<MemCounter>,
) -> Result<SizedPlan> {
    let (plan, work) = bare_plan(scan, kind, batch)?;
    let work = if work > 0 {
        let w = DevBuf::alloc(gpu.ctx(), work, Some(counter), "cuFFT work area")?;
        // SAFETY: the plan is live and the area holds the `work` bytes cuFFT asked for.
        unsafe { cufft::set_work_area(plan.0, w.ptr() as *mut std::ffi::c_void) }
            .map_err(|e| cufft_error(OP, "set work area", e))?;
        Some(w)
    } else {
        None
    };
    // SAFETY: a live plan and the engine's stream.
    unsafe { cufft::set_stream(plan.0, gpu.stream().cu_stream() as _) }
        .map_err(|e| cufft_error(OP, "set stream", e))?;
    Ok(SizedPlan { plan, _work: work })
}

/// The plan of `n` transforms in `plans`, made by `make` on first use.
fn cached_plan(
    plans: &mut Vec<(usize, SizedPlan)>,
    n: usize,
    make: impl FnOnce() -> Result<SizedPlan>,
) -> Result<&SizedPlan> {
    let i = match plans.iter().position(|(k, _)| *k == n) {
        Some(i) => i,
        None => {
            plans.push((n, make()?));
            plans.len() - 1
        }
    };
    Ok(&plans[i].1)
}

/// Bytes of the cuFFT work area a plan would take (asked of cuFFT without allocating; the
/// plan is destroyed unused).
fn plan_work_bytes(scan: Shape2, kind: cufft_sys::cufftType, batch: usize) -> Result<u64> {
    Ok(bare_plan(scan, kind, batch)?.1 as u64)
}

/// Buffers of the phase-variance loss (allocated on its first use).
struct PvWork {
    batch: usize,
    buf: DevBuf,
    s1: DevBuf,
    s2: DevBuf,
    plans: Vec<(usize, SizedPlan)>,
}

/// Per-evaluation buffers.
struct Work {
    pk: DevBuf,
    s_part: DevBuf,
    s: DevBuf,
    pow_part: DevBuf,
    fin_part: DevBuf,
    object_plan: SizedPlan,
    pv: Option<PvWork>,
}

/// SSB prepared on the card.
pub struct GpuSsb {
    gpu: &'static Gpu,
    f: Funcs,
    g: DevBuf,
    gscale: DevBuf,
    kb: DevBuf,
    ak: DevBuf,
    cont: DevBuf,
    /// Step of k along a detector row (Å⁻¹), for the quadratic-χ kernel.
    k_step: (f64, f64),
    /// `SsbQuad`'s `rin2`, `rout2`: |v|² (Å⁻²) inside which A(v) = 1 and outside which A(v) = 0.
    aperture_radii: (f32, f32),
    /// `SsbQuad`'s `inv_d` where the soft aperture has one δ (`aperture_soft`).
    aperture_soft: Option<f32>,
    quad_enabled: AtomicBool,
    fr: DevBuf,
    fc: DevBuf,
    /// The quadratic kernel's general pairs (`general_pairs`, `n_list` of them), taken by its
    /// first ⌈n_list / THREADS⌉ blocks.
    hlist: DevBuf,
    n_list: u32,
    b: usize,
    scan: Shape2,
    half: usize,
    optics: OpticsArg,
    lambda: f64,
    dc: f64,
    slices: u32,
    blocks_x: u32,
    budget: u64,
    counter: Arc<MemCounter>,
    work: Mutex<Work>,
    /// How the preparation went.
    pub stats: PrepareStats,
}

impl std::fmt::Debug for GpuSsb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuSsb")
            .field("b", &self.b)
            .field("scan", &self.scan)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

fn load_funcs(gpu: &Gpu, storage: GStorage) -> Result<Funcs> {
    let m = load_module(gpu, KERNEL_FILE, KERNEL_SOURCE, &[])?;
    let get = |name: &str| {
        m.module
            .load_function(name)
            .map_err(|e| driver_error(&format!("load kernel {name}"), e))
    };
    let (acc, quad, cor, store) = match storage {
        GStorage::C32 => (
            "qem_ssb_accumulate_g32",
            "qem_ssb_accumulate_quad_g32",
            "qem_ssb_corrected_g32",
            "qem_ssb_store_g32",
        ),
        GStorage::C16 => (
            "qem_ssb_accumulate_g16",
            "qem_ssb_accumulate_quad_g16",
            "qem_ssb_corrected_g16",
            "qem_ssb_store_g16",
        ),
    };
    Ok(Funcs {
        probe_table: get("qem_ssb_probe_table")?,
        accumulate: get(acc)?,
        accumulate_quad: get(quad)?,
        corrected: get(cor)?,
        sum_slices: get("qem_ssb_sum_slices")?,
        finish: get("qem_ssb_finish")?,
        phase_accum: get("qem_ssb_phase_accum")?,
        phase_var: get("qem_ssb_phase_var")?,
        gather_u8: get("qem_ssb_gather_u8")?,
        gather_u16: get("qem_ssb_gather_u16")?,
        gather_u32: get("qem_ssb_gather_u32")?,
        store: get(store)?,
        u32_to_f32: get("qem_ssb_u32_to_f32")?,
    })
}

/// Sizes that decide the plan of a preparation (bytes, except `b`).
#[derive(Debug, Clone, Copy)]
struct Sizes {
    /// BF pixels.
    b: u64,
    /// Scan positions.
    n: u64,
    /// Half-spectrum values per pixel.
    nh: u64,
    /// Work buffers kept for the evaluations, tables.
    fixed: u64,
    /// Decode scratch (ENCODED sources).
    scratch: u64,
}

impl Sizes {
    /// Transient bytes per BF pixel of a prepare batch: its f32 image, its f32 spectrum (cuFFT's
    /// layout, before the store into G's tiles) and an estimate of the R2C work area (about one
    /// spectrum).
    fn per_px(&self) -> u64 {
        self.n * 4 + self.nh * 8 + self.nh * 8
    }
    fn need(&self, st: GStorage, batch: u64) -> u64 {
        self.b * padded_half(self.nh) * st.bytes_per_value()
            + self.fixed
            + self.scratch
            + batch * self.per_px()
    }
}

/// Storage of G and BF pixels per prepare batch within `budget`: C32 when G as f32 and a batch
/// of 32 pixels fit, else C16 (or `forced`); the batch as large as the rest of the budget allows
/// (at most [`MAX_PREPARE_BATCH`]). Too little room even for C16 is a `MemoryBudget` error.
fn choose_plan(sz: &Sizes, budget: u64, forced: Option<GStorage>) -> Result<(GStorage, usize)> {
    let min_batch = sz.b.min(32);
    let storage = match forced {
        Some(st) => st,
        None if sz.need(GStorage::C32, min_batch) <= budget => GStorage::C32,
        None => GStorage::C16,
    };
    let need = sz.need(storage, min_batch);
    if need > budget {
        return Err(Error::memory_budget(OP, need, budget).with_op(format!(
            "{OP} prepare (G for {} BF pixels × {} scan positions as {}; raise memory_budget, \
             bin the detector, crop the scan, or hold the data on the host — backend cpu — \
             with SSB engine cuda, so that the card holds G alone)",
            sz.b,
            sz.n,
            storage.name()
        )));
    }
    let room = budget - sz.need(storage, 0);
    let batch = ((room / sz.per_px()) as usize)
        .clamp(1, MAX_PREPARE_BATCH)
        .min(sz.b as usize);
    Ok((storage, batch))
}

/// |v|² (Å⁻²) at and below which the soft aperture is 1, and at and above which it is 0, when δ
/// is the same in every direction (square pixels); `(−1, ∞)` otherwise (no shortcut). Shrunk and
/// grown by 1e-6 so that f32 rounding of |v|² cannot take a value across an edge.
fn aperture_radii(o: &Optics) -> (f32, f32) {
    let (dr, dc) = o.dtheta_rad;
    if dr != dc {
        return (-1.0, f32::INFINITY);
    }
    let half = 0.5 * dr.abs();
    let inner = ((o.alpha_rad - half).max(0.0) / o.lambda_a).powi(2);
    let outer = ((o.alpha_rad + half) / o.lambda_a).powi(2);
    ((inner * (1.0 - 1e-6)) as f32, (outer * (1.0 + 1e-6)) as f32)
}

/// `SsbQuad`'s `inv_d` = 1/δ for the branch-free soft aperture `A(v) = sat((α − λ|v|)/δ + ½)`,
/// the CPU's formula, where δ is one constant (square pixels) and not 0; `None` elsewhere (the
/// kernel then takes `aperture_q`).
fn aperture_soft(o: &Optics) -> Option<f32> {
    let (dr, dc) = o.dtheta_rad;
    let d = dr.abs();
    // The kernels' `aperture` takes a hard edge at δ² ≤ 1e-30 (f32).
    (dr == dc && (d * d) as f32 > 1e-30).then(|| (1.0 / d) as f32)
}

/// The half-spectrum indices the quadratic accumulate kernel leaves to its list blocks: pairs
/// whose mirror is not −ν (on the Nyquist lines), from ssb.cu `pair_of` on the same f32
/// frequencies (`take && two && !sym`).
fn general_pairs(nr: usize, nc: usize, fr: &[f32], fc: &[f32]) -> Vec<u32> {
    (1..nr * (nc / 2 + 1))
        .filter(|&h| host_pair(h, nr, nc, fr, fc).is_some_and(|p| !p.simple))
        .map(|h| h as u32)
        .collect()
}

/// The pair a half-spectrum index stands for, as ssb.cu `pair_of` decides it.
struct HostPair {
    /// Its full-plane index and its mirror's (when the mirror is another index); read by the
    /// test that checks the split covers the plane once.
    #[cfg_attr(not(test), allow(dead_code))]
    i1: usize,
    #[cfg_attr(not(test), allow(dead_code))]
    i2: Option<usize>,
    /// The quadratic terms can take it: the mirror is −ν, or the index is its own mirror.
    simple: bool,
}

/// ssb.cu `pair_of` for index `h` of the `nr × (nc/2 + 1)` half spectrum; `None` where the
/// mirror's thread takes the pair.
fn host_pair(h: usize, nr: usize, nc: usize, fr: &[f32], fc: &[f32]) -> Option<HostPair> {
    let half = nc / 2 + 1;
    let (r, c) = (h / half, h % half);
    let (rm, cm) = ((nr - r) % nr, (nc - c) % nc);
    let mut two = true;
    if cm < half {
        if rm == r && cm == c {
            two = false;
        } else if rm < r {
            return None;
        }
    }
    let sym = two && fr[rm] == -fr[r] && fc[cm] == -fc[c];
    Some(HostPair {
        i1: r * nc + c,
        i2: two.then_some(rm * nc + cm),
        simple: !two || sym,
    })
}

/// Values per pixel in G: the half spectrum padded to whole tiles of `G_TILE` (ssb.cu) = THREADS.
fn padded_half(nh: u64) -> u64 {
    nh.div_ceil(u64::from(THREADS)) * u64::from(THREADS)
}

fn grid_1d(items: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            items.div_ceil(u64::from(THREADS)).clamp(1, 4096) as u32,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn to_f32_pairs(v: &[(f64, f64)]) -> Vec<f32> {
    v.iter().flat_map(|&(a, b)| [a as f32, b as f32]).collect()
}

impl GpuSsb {
    /// Gather, FFT and keep `G_b(ν)` for every BF pixel (module docs).
    pub fn prepare(src: Source<'_>, s: &Setup<'_>) -> Result<GpuSsb> {
        require_cufft(OP)?;
        let b = s.pixels.len();
        let scan = s.scan;
        let n = scan.len();
        let (frames, frame_len, det_cols) = match src {
            Source::Dense(a) => {
                let [r, c, kr, kc] = a.shape();
                (r * c, kr * kc, kc)
            }
            Source::Encoded(e) => (
                e.n_frames() as usize,
                e.frame_shape().len(),
                e.frame_shape().cols,
            ),
            Source::Host { frame, .. } => (n, frame.len(), frame.cols),
        };
        if b == 0 || s.k.len() != b || s.g0.len() != b || n == 0 || frames != n {
            return Err(
                Error::invalid(OP, "BF pixels, k vectors, sums and scan disagree")
                    .with_expected(format!("{b} k vectors and sums, {n} frames"))
                    .with_found(format!(
                        "{} k vectors, {} sums, {frames} frames",
                        s.k.len(),
                        s.g0.len()
                    )),
            );
        }
        if s.nu_r.len() != scan.rows || s.nu_c.len() != scan.cols {
            return Err(Error::invalid(OP, "scan frequencies do not match the scan")
                .with_expected(format!("{} and {}", scan.rows, scan.cols))
                .with_found(format!("{} and {}", s.nu_r.len(), s.nu_c.len())));
        }
        if let Some(&p) = s.pixels.iter().find(|&&p| p >= frame_len) {
            return Err(Error::invalid(OP, "pixel index outside the frame")
                .with_expected(format!("< {frame_len}"))
                .with_found(p.to_string()));
        }
        let t0 = Instant::now();
        let e = engine()?;
        let gpu = &e.gpu;
        gpu.ctx()
            .bind_to_thread()
            .map_err(|er| driver_error("bind CUDA context", er))?;
        let half = scan.cols / 2 + 1;
        let nh = (scan.rows * half) as u64;
        let n64 = n as u64;
        let budget = match s.budget {
            Some(v) => v,
            None => gpu.mem_info()?.0.saturating_sub(FREE_MARGIN),
        };
        // Launch shape of the accumulate kernel: enough slices of BF pixels for ~16 blocks/SM.
        let blocks_x = nh.div_ceil(u64::from(THREADS)) as u32;
        let sms = gpu.info().multiprocessors.max(1) as u32;
        // A slice's per-pixel tables live in the block's shared memory (ACC_TABLE_BYTES each,
        // ≤ 48 KB): at least ⌈b / MAX_SLICE_PIXELS⌉ slices.
        let slices = (16 * sms)
            .div_ceil(blocks_x)
            .max((b as u32).div_ceil(MAX_SLICE_PIXELS))
            .clamp(1, 32)
            .min(b as u32);
        if (b as u32).div_ceil(slices) > MAX_SLICE_PIXELS {
            return Err(
                Error::invalid(OP, "too many BF pixels for the accumulate kernel")
                    .with_expected(format!("at most {} BF pixels", 32 * MAX_SLICE_PIXELS))
                    .with_found(format!("{b} (bin the detector)")),
            );
        }
        // The quadratic kernel's list blocks: at most the two Nyquist lines' pairs.
        let list_max = (scan.rows + scan.cols + 2) as u64;
        let gen_max = list_max.div_ceil(u64::from(THREADS));
        let fixed = (b as u64) * (8 + 8 + 8 + 4)
            + (scan.rows + scan.cols) as u64 * 4
            + list_max * 4
            + u64::from(slices) * n64 * 8
            + n64 * 8
            + (u64::from(slices) * (u64::from(blocks_x) + gen_max) + 4096) * 8
            + plan_work_bytes(scan, cufft_sys::cufftType::CUFFT_C2C, 1)?;
        let scratch = match src {
            Source::Dense(_) | Source::Host { .. } => 0,
            Source::Encoded(_) => DECODE_SCRATCH.min(frames as u64 * frame_len as u64 * 2) + 64,
        };
        let sz = Sizes {
            b: b as u64,
            n: n64,
            nh,
            fixed,
            scratch,
        };
        let (storage, mut batch) = choose_plan(&sz, budget, s.storage)?;
        let f = load_funcs(gpu, storage)?;
        // The R2C work area is asked of cuFFT; shrink the batch until everything fits.
        loop {
            let w = plan_work_bytes(scan, cufft_sys::cufftType::CUFFT_R2C, batch)?;
            let used = sz.need(storage, batch as u64) - batch as u64 * nh * 8 + w;
            if used <= budget {
                break;
            }
            if batch == 1 {
                return Err(Error::memory_budget(OP, used, budget).with_op(format!(
                    "{OP} prepare (G for {b} BF pixels as {} and the FFT work area of one \
                     pixel; raise memory_budget, bin the detector or crop the scan)",
                    storage.name()
                )));
            }
            batch = (batch / 2).max(1);
        }
        let counter = Arc::new(MemCounter::default());
        let ctx = gpu.ctx();
        let c = Some(&counter);
        let pix32: Vec<u32> = s.pixels.iter().map(|&p| p as u32).collect();
        let gscale: Vec<f32> =
            s.g0.iter()
                .map(|&v| {
                    if v > 0.0 {
                        (v / G16_FULL_SCALE) as f32
                    } else {
                        1.0
                    }
                })
                .collect();
        let d_pix = upload(ctx, &pix32, c, "BF pixel list")?;
        let d_gscale = upload(ctx, &gscale, c, "G16 scales")?;
        let kb = upload(ctx, &to_f32_pairs(s.k), c, "BF k vectors")?;
        // A(k_b) (aberration-free) and the detector-row continuations for the quadratic kernel.
        let ak32: Vec<f32> =
            s.k.iter()
                .map(|&(x, y)| s.optics.aperture(x, y) as f32)
                .collect();
        let cont: Vec<u8> = (0..b)
            .map(|i| {
                u8::from(i > 0 && s.pixels[i] == s.pixels[i - 1] + 1 && s.pixels[i] % det_cols != 0)
            })
            .collect();
        let k_step = (1..b).find(|&i| cont[i] == 1).map_or((0.0, 0.0), |i| {
            (s.k[i].0 - s.k[i - 1].0, s.k[i].1 - s.k[i - 1].1)
        });
        let ak = upload(ctx, &ak32, c, "A(k_b)")?;
        let d_cont = upload(ctx, &cont, c, "detector-row continuations")?;
        let fr32: Vec<f32> = s.nu_r.iter().map(|&v| v as f32).collect();
        let fc32: Vec<f32> = s.nu_c.iter().map(|&v| v as f32).collect();
        let fr = upload(ctx, &fr32, c, "scan frequencies (rows)")?;
        let list = general_pairs(scan.rows, scan.cols, &fr32, &fc32);
        let hlist = upload(
            ctx,
            if list.is_empty() { &[0u32][..] } else { &list },
            c,
            "Nyquist-line pairs",
        )?;
        let fc = upload(ctx, &fc32, c, "scan frequencies (cols)")?;
        let g = DevBuf::alloc(
            ctx,
            (b as u64 * padded_half(nh) * storage.bytes_per_value()) as usize,
            c,
            "G (BF pixel spectra)",
        )?;
        let batches = b.div_ceil(batch);
        {
            let stream = gpu.stream();
            let images = DevBuf::alloc(ctx, batch * n * 4, c, "BF pixel images")?;
            // cuFFT writes [pixel][h]; the store kernel moves each batch into G's tiles.
            let temp = DevBuf::alloc(ctx, (batch as u64 * nh * 8) as usize, c, "batch spectra")?;
            let mut plans: Vec<(usize, SizedPlan)> = Vec::new();
            // The host route's two pinned buffers (filled and uploaded in turn), each with the
            // event of its last upload.
            let chunk_px = (HOST_CHUNK_BYTES / (n * 4)).clamp(1, batch);
            let mut staging = Staging {
                bufs: Vec::new(),
                stream,
                engine: e,
            };
            if matches!(src, Source::Host { .. }) {
                for _ in 0..2 {
                    let buf = e.take_pinned(chunk_px * n * 4, "SSB host images")?;
                    let ev = ctx
                        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                        .map_err(|er| driver_error("create event", er))?;
                    staging.bufs.push((buf, ev, false));
                }
            }
            let mut turn = 0usize;
            let (dec, err) = match src {
                Source::Encoded(_) => (
                    Some(DevBuf::alloc(ctx, scratch as usize, c, "decoded frames")?),
                    Some(new_err_record(ctx, c)?),
                ),
                Source::Dense(_) | Source::Host { .. } => (None, None),
            };
            for p0 in (0..b).step_by(batch) {
                let np = batch.min(b - p0);
                let pix_ptr = d_pix.ptr() + (p0 * 4) as u64;
                let out = images.ptr();
                match src {
                    Source::Dense(a) => {
                        launch_gather(
                            stream,
                            f.gather(a.dtype()),
                            a.device_ptr(),
                            frame_len,
                            frames,
                            0,
                            n,
                            pix_ptr,
                            np,
                            out,
                        )?;
                    }
                    Source::Host { images: host, .. } => {
                        // The copies queue behind the last batch's R2C (which reads `images`)
                        // in stream order; the host waits only for a buffer's previous copy,
                        // so it fills the next chunk while the card copies and transforms.
                        for c0 in (p0..p0 + np).step_by(chunk_px) {
                            let cn = chunk_px.min(p0 + np - c0);
                            let (buf, ev, used) = &mut staging.bufs[turn % 2];
                            turn += 1;
                            if *used {
                                ev.synchronize()
                                    .map_err(|er| driver_error("wait for an SSB upload", er))?;
                            }
                            let bytes = cn * n * 4;
                            let out: &mut [u32] =
                                bytemuck::try_cast_slice_mut(&mut buf.as_mut_slice()[..bytes])
                                    .map_err(|_| {
                                        Error::internal(OP, "pinned buffer not 4-byte aligned")
                                    })?;
                            host.fill(c0, cn, out)?;
                            buf.copy_to_device_async(&images, (c0 - p0) * n * 4, bytes, stream)?;
                            ev.record(stream)
                                .map_err(|er| driver_error("record an SSB upload", er))?;
                            *used = true;
                        }
                        let (buf, len) = (images.ptr(), (np * n) as u64);
                        let mut lb = stream.launch_builder(&f.u32_to_f32);
                        lb.arg(&buf).arg(&len);
                        // SAFETY: matches `qem_ssb_u32_to_f32(unsigned int*, u64)`; `images`
                        // holds batch·n ≥ np·n 4-byte values; grid-stride loop.
                        unsafe { lb.launch(grid_1d(len)) }
                            .map_err(|er| driver_error("launch ssb u32_to_f32", er))?;
                    }
                    Source::Encoded(enc) => {
                        let (Some(dec), Some(err)) = (dec.as_ref(), err.as_ref()) else {
                            return Err(Error::internal(OP, "decode scratch missing"));
                        };
                        let rk = e.rans()?;
                        let per = (scratch / (frame_len as u64 * 2)).max(1) as usize;
                        for f0 in (0..frames).step_by(per) {
                            let nf = per.min(frames - f0);
                            // SAFETY: `dec` holds `per × frame_len` u16 ≥ nf frames; `err` is a
                            // zeroed record; both live until the synchronize after the loop, and
                            // the gather below reads `dec` in stream order before the next decode.
                            unsafe {
                                enc.launch_decode_dense(
                                    rk,
                                    stream,
                                    f0 as u64,
                                    nf as u64,
                                    dec.ptr(),
                                    err.ptr(),
                                )
                            }?;
                            launch_gather(
                                stream,
                                f.gather(DType::U16),
                                dec.ptr(),
                                frame_len,
                                nf,
                                f0,
                                n,
                                pix_ptr,
                                np,
                                out,
                            )?;
                        }
                    }
                }
                let plan = cached_plan(&mut plans, np, || {
                    make_plan(gpu, scan, cufft_sys::cufftType::CUFFT_R2C, np, &counter)
                })?;
                // SAFETY: the plan is `np` R2C transforms of the scan; `images` holds np·n f32
                // and `temp` batch·nh ≥ np·nh complex f32; stream order.
                unsafe {
                    cufft::exec_r2c(
                        plan.plan.0,
                        images.ptr() as *mut f32,
                        temp.ptr() as *mut cufft_sys::cufftComplex,
                    )
                }
                .map_err(|er| cufft_error(OP, "R2C of the BF images", er))?;
                let (tp, gs, gp) = (temp.ptr(), d_gscale.ptr(), g.ptr());
                let (np32, p032, nb32) = (np as u32, p0 as u32, b as u32);
                let mut lb = stream.launch_builder(&f.store);
                lb.arg(&tp).arg(&nh).arg(&np32).arg(&p032).arg(&nb32);
                if storage == GStorage::C16 {
                    lb.arg(&gs);
                }
                lb.arg(&gp);
                // SAFETY: matches `qem_ssb_store_g32(const float2*, u64, u32, u32, u32, float2*)`
                // or `qem_ssb_store_g16(const float2*, u64, u32, u32, u32, const float*,
                // ushort2*)`; temp holds np·nh float2, G b·padded_half(nh) values with
                // p0 + np ≤ b, gscale b floats; grid-stride loop.
                unsafe { lb.launch(grid_1d(nh * np as u64)) }
                    .map_err(|er| driver_error("launch ssb store", er))?;
            }
            stream
                .synchronize()
                .map_err(|er| driver_error("synchronize ssb prepare", er))?;
            if let Some(err) = &err {
                if let Some(fault) = read_err(err)? {
                    return Err(fault_error(&fault, fault.frame).with_op("ssb gather_pixels"));
                }
            }
        }
        let seconds = t0.elapsed().as_secs_f64();
        let peak_prepare = counter.peak();
        let dc = s.g0.iter().sum::<f64>() / b as f64;
        let work = Work {
            pk: DevBuf::alloc(ctx, b * 8, c, "P(k_b)")?,
            s_part: DevBuf::alloc(ctx, slices as usize * n * 8, c, "slice spectra")?,
            s: DevBuf::alloc(ctx, n * 8, c, "mean spectrum")?,
            pow_part: DevBuf::alloc(
                ctx,
                (slices as usize * (blocks_x as usize + list.len().div_ceil(THREADS as usize))) * 8,
                c,
                "power partials",
            )?,
            fin_part: DevBuf::alloc(ctx, 4096 * 8, c, "coherence partials")?,
            object_plan: make_plan(gpu, scan, cufft_sys::cufftType::CUFFT_C2C, 1, &counter)?,
            pv: None,
        };
        let dt = s.optics.dtheta_rad;
        let optics = OpticsArg {
            lambda: s.optics.lambda_a as f32,
            alpha: s.optics.alpha_rad as f32,
            dr2: (dt.0 * dt.0) as f32,
            dc2: (dt.1 * dt.1) as f32,
        };
        let stats = PrepareStats {
            storage,
            g_bytes: g.bytes() as u64,
            batch_pixels: batch,
            batches,
            seconds,
            peak_bytes: peak_prepare.max(counter.peak()),
            budget,
        };
        drop(d_pix);
        Ok(GpuSsb {
            gpu,
            f,
            g,
            gscale: d_gscale,
            kb,
            ak,
            cont: d_cont,
            k_step,
            aperture_radii: aperture_radii(&s.optics),
            aperture_soft: aperture_soft(&s.optics),
            quad_enabled: AtomicBool::new(true),
            fr,
            fc,
            hlist,
            n_list: list.len() as u32,
            b,
            scan,
            half,
            optics,
            lambda: s.optics.lambda_a,
            dc,
            slices,
            blocks_x,
            budget,
            counter,
            work: Mutex::new(work),
            stats,
        })
    }

    /// Number of BF pixels.
    pub fn n_pixels(&self) -> usize {
        self.b
    }

    /// Peak device bytes this SSB has allocated at once so far (preparation included).
    pub fn peak_bytes(&self) -> u64 {
        self.counter.peak()
    }

    /// Device bytes it holds now.
    pub fn current_bytes(&self) -> u64 {
        self.counter.current()
    }

    fn ab_arg(&self, ab: &Aberrations) -> AbArg {
        let c = chi_polynomial(ab, self.lambda);
        AbArg(c.map(|v| v as f32))
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Work>> {
        self.work
            .lock()
            .map_err(|_| Error::internal(OP, "SSB work buffers poisoned by an earlier panic"))
    }

    /// `χ`'s quadratic form (only C10, C12, φ12 set) for the quadratic kernel, else `None`.
    fn quad_arg(&self, ab: &Aberrations) -> Option<QuadArg> {
        if ab.c21 != 0.0 || ab.c23 != 0.0 || ab.c30 != 0.0 {
            return None;
        }
        if !self.quad_enabled.load(Ordering::Relaxed) {
            return None;
        }
        let c = chi_polynomial(ab, self.lambda);
        let (rin2, rout2) = self.aperture_radii;
        let (inv_d, soft) = match self.aperture_soft {
            Some(v) => (v, 1),
            None => (0.0, 0),
        };
        Some(QuadArg {
            m_rr: (c[0] + c[1]) as f32,
            m_cc: (c[0] - c[1]) as f32,
            m_rc: c[2] as f32,
            dx: self.k_step.0 as f32,
            dy: self.k_step.1 as f32,
            rin2,
            rout2,
            inv_d,
            soft,
        })
    }

    /// Use the quadratic-χ accumulate kernel where χ allows (the default), or always the general
    /// one (for benchmarks and tests that compare the two on the same G).
    pub fn set_quadratic_kernel(&self, on: bool) {
        self.quad_enabled.store(on, Ordering::Relaxed);
    }

    /// Queue the table `w.pk[b] = P(k_b)` at `ab`.
    fn queue_probe_table(&self, w: &Work, ab: &AbArg) -> Result<()> {
        let (kb, pk, nb) = (self.kb.ptr(), w.pk.ptr(), self.b as u32);
        let o = self.optics;
        let mut lb = self.gpu.stream().launch_builder(&self.f.probe_table);
        lb.arg(&kb).arg(&nb).arg(&o).arg(ab).arg(&pk);
        // SAFETY: matches `qem_ssb_probe_table(const float2*, u32, SsbOptics, SsbAb, float2*)`;
        // kb and pk hold b float2.
        unsafe { lb.launch(grid_1d(self.b as u64)) }
            .map_err(|er| driver_error("launch ssb probe table", er))?;
        Ok(())
    }

    /// Queue P(k_b), the accumulate launch and the slice sum; returns the accumulate grid's x
    /// size (its blocks' power partials are `slices` × that).
    fn queue_mean_spectrum(&self, w: &Work, ab: &AbArg, quad: Option<QuadArg>) -> Result<u32> {
        let stream = self.gpu.stream();
        let (kb, pk, nb) = (self.kb.ptr(), w.pk.ptr(), self.b as u32);
        let o = self.optics;
        self.queue_probe_table(w, ab)?;
        let per_slice = (self.b as u32).div_ceil(self.slices);
        let (g, gs, fr, fc) = (
            self.g.ptr(),
            self.gscale.ptr(),
            self.fr.ptr(),
            self.fc.ptr(),
        );
        let (nr, nc, half) = (
            self.scan.rows as u32,
            self.scan.cols as u32,
            self.half as u32,
        );
        let (sp, pp) = (w.s_part.ptr(), w.pow_part.ptr());
        let gen_blocks = if quad.is_some() {
            self.n_list.div_ceil(THREADS)
        } else {
            0
        };
        let grid_x = self.blocks_x + gen_blocks;
        let cfg = LaunchConfig {
            grid_dim: (grid_x, self.slices, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: (per_slice * ACC_TABLE_BYTES).next_multiple_of(16),
        };
        let kernel = match quad {
            Some(_) => &self.f.accumulate_quad,
            None => &self.f.accumulate,
        };
        let q = quad.unwrap_or_default();
        let (ak, cont) = (self.ak.ptr(), self.cont.ptr());
        let (hl, n_list) = (self.hlist.ptr(), self.n_list);
        let mut lb = stream.launch_builder(kernel);
        lb.arg(&g)
            .arg(&gs)
            .arg(&nb)
            .arg(&per_slice)
            .arg(&kb)
            .arg(&pk)
            .arg(&ak)
            .arg(&cont)
            .arg(&fr)
            .arg(&fc)
            .arg(&nr)
            .arg(&nc)
            .arg(&half)
            .arg(&o)
            .arg(ab)
            .arg(&q)
            .arg(&hl)
            .arg(&n_list)
            .arg(&gen_blocks)
            .arg(&sp)
            .arg(&pp);
        // SAFETY: matches `qem_ssb_accumulate[_quad]_g{32,16}(const void*, const float*, u32,
        // u32, const float2*, const float2*, const float*, const unsigned char*, const float*,
        // const float*, u32, u32, u32, SsbOptics, SsbAb, SsbQuad, const u32*, u32, u32, float2*,
        // double*)`: G holds b·padded_half(nr·half) values of its storage (tiled),
        // gscale/kb/pk/ak/cont b entries, fr/fc nr/nc floats, hlist n_list (≥ 1) u32 with
        // gen_blocks·256 ≥ n_list, s_part slices·n float2, pow_part slices·(blocks_x +
        // ⌈n_list / 256⌉) f64 ≥ slices·grid_x; the dynamic shared memory holds
        // per_slice·ACC_TABLE_BYTES (≤ 45 KB by MAX_SLICE_PIXELS); the grid is (grid_x, slices)
        // with blocks_x·256 ≥ nr·half.
        unsafe { lb.launch(cfg) }.map_err(|er| driver_error("launch ssb accumulate", er))?;
        let n = self.scan.len() as u64;
        let (add, s) = (0u32, w.s.ptr());
        let slices = self.slices;
        let mut lb = stream.launch_builder(&self.f.sum_slices);
        lb.arg(&sp).arg(&slices).arg(&n).arg(&add).arg(&s);
        // SAFETY: matches `qem_ssb_sum_slices(const float2*, u32, u64, u32, float2*)`; s_part
        // holds slices·n float2, s n float2.
        unsafe { lb.launch(grid_1d(n)) }.map_err(|er| driver_error("launch ssb sum", er))?;
        let (inv_b, dc, fp) = (1.0f32 / self.b as f32, self.dc as f32, w.fin_part.ptr());
        let mut lb = stream.launch_builder(&self.f.finish);
        lb.arg(&s).arg(&n).arg(&inv_b).arg(&dc).arg(&fp);
        // SAFETY: matches `qem_ssb_finish(float2*, u64, float, float, double*)`; s holds n
        // float2, fin_part 4096 f64 ≥ the grid's blocks (grid_1d caps at 4096).
        unsafe { lb.launch(grid_1d(n)) }.map_err(|er| driver_error("launch ssb finish", er))?;
        Ok(grid_x)
    }

    fn sync(&self, what: &str) -> Result<()> {
        self.gpu
            .stream()
            .synchronize()
            .map_err(|er| driver_error(&format!("synchronize ssb {what}"), er))
    }

    /// `O(R)` at `ab` (1/N normalised, row-major): `(re, im)`.
    pub fn object(&self, ab: &Aberrations) -> Result<(Vec<f64>, Vec<f64>)> {
        let w = self.lock()?;
        let a = self.ab_arg(ab);
        self.queue_mean_spectrum(&w, &a, self.quad_arg(ab))?;
        let s = w.s.ptr();
        // SAFETY: a 1-transform C2C plan of the scan, in place on s (n complex f32).
        unsafe {
            cufft::exec_c2c(
                w.object_plan.plan.0,
                s as *mut cufft_sys::cufftComplex,
                s as *mut cufft_sys::cufftComplex,
                CUFFT_INVERSE,
            )
        }
        .map_err(|er| cufft_error(OP, "inverse FFT of the object", er))?;
        self.sync("object")?;
        let n = self.scan.len();
        let v: Vec<f32> = read_vec(&w.s, 2 * n)?;
        let inv = 1.0 / n as f64;
        let re = v.iter().step_by(2).map(|&x| f64::from(x) * inv).collect();
        let im = v
            .iter()
            .skip(1)
            .step_by(2)
            .map(|&x| f64::from(x) * inv)
            .collect();
        Ok((re, im))
    }

    /// [`qem_cpu::ssb::Objective::Coherence`] at `ab`.
    pub fn coherence(&self, ab: &Aberrations) -> Result<f64> {
        let w = self.lock()?;
        let a = self.ab_arg(ab);
        let grid_x = self.queue_mean_spectrum(&w, &a, self.quad_arg(ab))?;
        self.sync("coherence")?;
        let pw: Vec<f64> = read_vec(&w.pow_part, self.slices as usize * grid_x as usize)?;
        let blocks = grid_1d(self.scan.len() as u64).grid_dim.0 as usize;
        let fin: Vec<f64> = read_vec(&w.fin_part, blocks)?;
        let power: f64 = pw.iter().sum();
        if power <= 0.0 {
            return Ok(0.0);
        }
        let bf = self.b as f64;
        let coh = fin.iter().sum::<f64>() * bf * bf;
        Ok(-coh / (bf * power))
    }

    /// [`qem_cpu::ssb::Objective::PhaseVariance`] at `ab`: per BF pixel an inverse FFT, in
    /// batches (their buffers are allocated on the first call, within the budget).
    pub fn phase_variance(&self, ab: &Aberrations) -> Result<f64> {
        let mut w = self.lock()?;
        let n = self.scan.len();
        if w.pv.is_none() {
            let have = self.counter.current();
            let room = self.budget.saturating_sub(have + 2 * n as u64 * 8);
            let per_px = n as u64 * 8 * 2; // buffer + a C2C work area of about the same size
            let batch = ((room / per_px) as usize)
                .clamp(1, MAX_PV_BATCH)
                .min(self.b);
            if room < per_px {
                return Err(Error::memory_budget(
                    "ssb phase_variance (CUDA)",
                    have + 2 * n as u64 * 8 + per_px,
                    self.budget,
                ));
            }
            let ctx = self.gpu.ctx();
            let c = Some(&self.counter);
            w.pv = Some(PvWork {
                batch,
                buf: DevBuf::alloc(ctx, batch * n * 8, c, "corrected spectra")?,
                s1: DevBuf::alloc(ctx, n * 8, c, "phase sums")?,
                s2: DevBuf::alloc(ctx, n * 8, c, "phase square sums")?,
                plans: Vec::new(),
            });
        }
        let a = self.ab_arg(ab);
        let stream = self.gpu.stream();
        let (kb, pk) = (self.kb.ptr(), w.pk.ptr());
        let o = self.optics;
        self.queue_probe_table(&w, &a)?;
        let (g, gs, fr, fc) = (
            self.g.ptr(),
            self.gscale.ptr(),
            self.fr.ptr(),
            self.fc.ptr(),
        );
        let (nr, nc, half) = (
            self.scan.rows as u32,
            self.scan.cols as u32,
            self.half as u32,
        );
        let nh = (self.scan.rows * self.half) as u64;
        let dc = self.dc as f32;
        let scan = self.scan;
        let counter = self.counter.clone();
        let gpu = self.gpu;
        let Some(pv) = w.pv.as_mut() else {
            return Err(Error::internal(OP, "phase-variance buffers missing"));
        };
        let (buf, s1, s2) = (pv.buf.ptr(), pv.s1.ptr(), pv.s2.ptr());
        let n64 = n as u64;
        for b0 in (0..self.b).step_by(pv.batch) {
            let nbj = pv.batch.min(self.b - b0);
            let b032 = b0 as u32;
            let cfg = LaunchConfig {
                grid_dim: (
                    nh.div_ceil(u64::from(THREADS)).min(1024) as u32,
                    nbj as u32,
                    1,
                ),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let nb32 = self.b as u32;
            let mut lb = stream.launch_builder(&self.f.corrected);
            lb.arg(&g)
                .arg(&gs)
                .arg(&b032)
                .arg(&nb32)
                .arg(&kb)
                .arg(&pk)
                .arg(&fr)
                .arg(&fc)
                .arg(&nr)
                .arg(&nc)
                .arg(&half)
                .arg(&o)
                .arg(&a)
                .arg(&dc)
                .arg(&buf);
            // SAFETY: matches `qem_ssb_corrected_g{32,16}(const void*, const float*, u32, u32,
            // const float2*, const float2*, const float*, const float*, u32, u32, u32,
            // SsbOptics, SsbAb, float, float2*)`; pixels b0..b0+nbj < b; buf holds batch·n
            // float2 ≥ nbj·n; grid-stride over the half spectrum.
            unsafe { lb.launch(cfg) }.map_err(|er| driver_error("launch ssb corrected", er))?;
            let plan = cached_plan(&mut pv.plans, nbj, || {
                make_plan(gpu, scan, cufft_sys::cufftType::CUFFT_C2C, nbj, &counter)
            })?;
            // SAFETY: nbj C2C transforms of the scan in place on buf (nbj·n complex f32).
            unsafe {
                cufft::exec_c2c(
                    plan.plan.0,
                    buf as *mut cufft_sys::cufftComplex,
                    buf as *mut cufft_sys::cufftComplex,
                    CUFFT_INVERSE,
                )
            }
            .map_err(|er| cufft_error(OP, "inverse FFTs of the corrected spectra", er))?;
            let (nbj32, add) = (nbj as u32, u32::from(b0 > 0));
            let mut lb = stream.launch_builder(&self.f.phase_accum);
            lb.arg(&buf)
                .arg(&nbj32)
                .arg(&n64)
                .arg(&add)
                .arg(&s1)
                .arg(&s2);
            // SAFETY: matches `qem_ssb_phase_accum(const float2*, u32, u64, u32, double*,
            // double*)`; buf holds nbj·n float2, s1/s2 n f64.
            unsafe { lb.launch(grid_1d(n64)) }
                .map_err(|er| driver_error("launch ssb phase accumulate", er))?;
        }
        let inv_b = 1.0 / self.b as f64;
        let fp = w.fin_part.ptr();
        let mut lb = stream.launch_builder(&self.f.phase_var);
        lb.arg(&s1).arg(&s2).arg(&n64).arg(&inv_b).arg(&fp);
        // SAFETY: matches `qem_ssb_phase_var(const double*, const double*, u64, double,
        // double*)`; s1/s2 hold n f64, fin_part 4096 f64 ≥ the grid's blocks.
        unsafe { lb.launch(grid_1d(n64)) }
            .map_err(|er| driver_error("launch ssb phase variance", er))?;
        self.sync("phase variance")?;
        let blocks = grid_1d(n64).grid_dim.0 as usize;
        let fin: Vec<f64> = read_vec(&w.fin_part, blocks)?;
        Ok(fin.iter().sum::<f64>() / n as f64)
    }
}

/// Queue `gather`: BF pixels `pix[0..np)` of frames `[0, nf)` at `data` into `out[j·n_out + f0
/// + f]`.
#[allow(clippy::too_many_arguments)]
fn launch_gather(
    stream: &cudarc::driver::CudaStream,
    gather: &CudaFunction,
    data: u64,
    frame_len: usize,
    nf: usize,
    f0: usize,
    n_out: usize,
    pix: u64,
    np: usize,
    out: u64,
) -> Result<()> {
    let cfg = LaunchConfig {
        grid_dim: (nf.div_ceil(32) as u32, np.div_ceil(32) as u32, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    let (fl, nf64, f064, no, np32) = (
        frame_len as u64,
        nf as u64,
        f0 as u64,
        n_out as u64,
        np as u32,
    );
    let mut lb = stream.launch_builder(gather);
    lb.arg(&data)
        .arg(&fl)
        .arg(&nf64)
        .arg(&f064)
        .arg(&no)
        .arg(&pix)
        .arg(&np32)
        .arg(&out);
    // SAFETY: matches `qem_ssb_gather_<T>(const T*, u64, u64, u64, u64, const u32*, u32,
    // float*)`: data holds nf frames of frame_len elements of the kernel's type, pix np
    // indices < frame_len (checked by prepare), out np rows of n_out floats with f0 + nf ≤ n_out.
    unsafe { lb.launch(cfg) }.map_err(|er| driver_error("launch ssb gather", er))?;
    Ok(())
}

/// `Γ(k, ν)` by the quadratic-χ factorisation of `quad_terms` in kernels/ssb.cu, in f64:
/// `A(k) exp(2i kᵀMν) [A(k−ν) exp(−iχ(ν)) − A(k+ν) exp(iχ(ν))]` (only C10, C12, φ12 count).
pub fn quad_gamma(o: &Optics, ab: &Aberrations, k: (f64, f64), nu: (f64, f64)) -> (f64, f64) {
    let c = chi_polynomial(ab, o.lambda_a);
    let (m_rr, m_cc, m_rc) = (c[0] + c[1], c[0] - c[1], c[2]);
    let form = |a: (f64, f64), b: (f64, f64)| {
        m_rr * a.0 * b.0 + m_cc * a.1 * b.1 + m_rc * (a.0 * b.1 + a.1 * b.0)
    };
    let (am, ap) = (
        o.aperture(k.0 - nu.0, k.1 - nu.1),
        o.aperture(k.0 + nu.0, k.1 + nu.1),
    );
    let (su, cu) = (-form(nu, nu)).sin_cos(); // U = exp(−iχ(ν))
    let w = ((am - ap) * cu, (am + ap) * su);
    let (se, ce) = (2.0 * form(k, nu)).sin_cos(); // E = exp(2i kᵀMν)
    let a_k = o.aperture(k.0, k.1);
    (a_k * (ce * w.0 - se * w.1), a_k * (ce * w.1 + se * w.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 300 kV, 25 mrad, detector pixels of `dr` × `dc` rad.
    fn optics(dr: f64, dc: f64) -> Optics {
        Optics {
            lambda_a: 0.019_687,
            alpha_rad: 0.025,
            dtheta_rad: (dr, dc),
        }
    }

    #[test]
    fn quadratic_factorisation_equals_gamma() {
        let o = optics(0.0009, 0.0009);
        let ab = Aberrations {
            c10: -140.0,
            c12: 35.0,
            phi12: 1.1,
            ..Default::default()
        };
        let mut n = 0;
        for i in -6..=6 {
            for j in -6..=6 {
                let k = (0.2 * i as f64, 0.17 * j as f64 - 0.05);
                for nu in [(0.3, -0.4), (-1.1, 0.2), (0.05, 0.9), (1.2, 1.2)] {
                    let want = qem_cpu::ssb::gamma(&o, &ab, k, nu);
                    let got = quad_gamma(&o, &ab, k, nu);
                    let err = ((got.0 - want.re).powi(2) + (got.1 - want.im).powi(2)).sqrt();
                    assert!(
                        err <= 1e-12 * (1.0 + want.norm()),
                        "{k:?} {nu:?}: {got:?} vs {want}"
                    );
                    n += usize::from(want.norm() > 1e-3);
                }
            }
        }
        assert!(n > 100, "too few non-zero Γ sampled: {n}");
        // The mirror: Γ(−ν) from the same factors (E → E*, the apertures swapped).
        let (k, nu) = ((0.4, -0.2), (0.7, 0.3));
        let want = qem_cpu::ssb::gamma(&o, &ab, k, (-nu.0, -nu.1));
        let got = quad_gamma(&o, &ab, k, (-nu.0, -nu.1));
        assert!((got.0 - want.re).abs() < 1e-12 && (got.1 - want.im).abs() < 1e-12);
    }

    /// Both accumulate kernels write C_b(−ν) = −C_b(ν)* (the corrected term of the mirror
    /// frequency, G(−ν) = G(ν)*) without computing it: checked here with qem_cpu's Γ in f64.
    #[test]
    fn quadratic_mirror_term_is_minus_conjugate() {
        let o = optics(0.0009, 0.0009);
        let ab = Aberrations {
            c10: 95.0,
            c12: -20.0,
            phi12: -0.4,
            ..Default::default()
        };
        // C = G Γ*/|Γ| on (re, im) pairs; `gamma` returns rustfft's Complex64.
        let corrected = |g: (f64, f64), gam: (f64, f64)| {
            let n = gam.0.hypot(gam.1);
            (
                (g.0 * gam.0 + g.1 * gam.1) / n,
                (g.1 * gam.0 - g.0 * gam.1) / n,
            )
        };
        let gamma = |ab: &Aberrations, k, nu: (f64, f64)| {
            let v = qem_cpu::ssb::gamma(&o, ab, k, nu);
            (v.re, v.im)
        };
        // |C(−ν) + C(ν)*|
        let mismatch = |ab: &Aberrations, k, nu: (f64, f64), g: (f64, f64)| {
            let c1 = corrected(g, gamma(ab, k, nu));
            let c2 = corrected((g.0, -g.1), gamma(ab, k, (-nu.0, -nu.1)));
            ((c2.0 + c1.0).hypot(c2.1 - c1.1), c1.0.hypot(c1.1))
        };
        let mut n = 0;
        for i in -5..=5 {
            for j in -5..=5 {
                let k = (0.23 * i as f64, 0.21 * j as f64 + 0.03);
                for (t, nu) in [(0.3, -0.4), (-1.1, 0.2), (0.05, 0.9)]
                    .into_iter()
                    .enumerate()
                {
                    let gp = gamma(&ab, k, nu);
                    if gp.0.hypot(gp.1) < 1e-6 {
                        continue;
                    }
                    let g = (1.0 + t as f64, -0.7 * i as f64);
                    let (err, size) = mismatch(&ab, k, nu, g);
                    assert!(err <= 1e-12 * (1.0 + size), "{k:?} {nu:?}: {err}");
                    n += 1;
                }
            }
        }
        assert!(n > 60, "too few non-zero Γ sampled: {n}");
        // It does not need χ to be even: Γ(k, −ν) = −Γ(k, ν)* for any χ.
        let odd = Aberrations {
            c21: 400.0,
            c23: -150.0,
            ..ab
        };
        let (err, size) = mismatch(&odd, (0.2, 0.1), (0.5, -0.3), (1.0, 0.5));
        assert!(size > 1e-3 && err <= 1e-12 * (1.0 + size), "{err} {size}");
    }

    /// Inside `rin2` the f64 aperture is 1, outside `rout2` it is 0 (square and hard-edged
    /// detectors); a non-square detector gets no shortcut.
    #[test]
    fn aperture_radii_bound_the_soft_edge() {
        for dt in [0.0009, 0.0, 0.0004717] {
            let o = optics(dt, dt);
            let (rin2, rout2) = aperture_radii(&o);
            assert!(rin2 > 0.0 && rin2 <= rout2, "{rin2} {rout2}");
            let (mut inside, mut outside, mut edge) = (0, 0, 0);
            for i in 0..4000 {
                let r = 1.0 + 0.6 * (i as f64 / 4000.0 - 0.5);
                let phi = 0.37 * i as f64;
                let v = (
                    r * (o.alpha_rad / o.lambda_a) * phi.cos(),
                    r * (o.alpha_rad / o.lambda_a) * phi.sin(),
                );
                let q2 = (v.0 * v.0 + v.1 * v.1) as f32;
                let a = o.aperture(v.0, v.1);
                if q2 <= rin2 {
                    assert_eq!(a, 1.0, "{v:?}");
                    inside += 1;
                } else if q2 >= rout2 {
                    assert_eq!(a, 0.0, "{v:?}");
                    outside += 1;
                } else {
                    edge += 1;
                }
            }
            assert!(inside > 1000 && outside > 1000, "{inside} {outside} {edge}");
            if dt > 0.0 {
                assert!(edge > 10, "soft edge not sampled: {edge}");
            }
        }
        let o = optics(0.0009, 0.0008);
        assert_eq!(aperture_radii(&o), (-1.0, f32::INFINITY));
    }

    /// The branch-free aperture of the quadratic kernel (ssb.cu `aperture_soft`, replayed in
    /// f32) follows the CPU's `Optics::aperture` across the soft edge and outside it; no
    /// coefficients where δ is not one constant or is 0.
    #[test]
    fn soft_aperture_follows_the_cpu_aperture() {
        for dt in [0.0009, 0.0004717, 0.0025] {
            let o = optics(dt, dt);
            let inv_d = aperture_soft(&o).expect("square pixels");
            let (lam, alpha) = (o.lambda_a as f32, o.alpha_rad as f32);
            let mut edge = 0;
            for i in 0..20_000 {
                let r = 1.0 + 0.4 * (i as f64 / 20_000.0 - 0.5);
                let phi = 0.37 * i as f64;
                let q = r * (o.alpha_rad / o.lambda_a);
                let (x, y) = ((q * phi.cos()) as f32, (q * phi.sin()) as f32);
                let q2 = (x * x + y * y).max(1e-30);
                let gpu = (alpha - lam * (q2 * (1.0 / q2.sqrt())))
                    .mul_add(inv_d, 0.5)
                    .clamp(0.0, 1.0);
                let cpu = o.aperture(f64::from(x), f64::from(y));
                // f32 against f64: α − λ|v| cancels to ~1e-9 absolute, ~2e-6 after 1/δ, also at
                // the ends of the edge (a few 1e-6 for the CPU's exact 0 or 1, as in `aperture`).
                assert!(
                    (f64::from(gpu) - cpu).abs() < 1e-5,
                    "dt {dt} r {r}: {gpu} vs {cpu}"
                );
                if cpu > 0.0 && cpu < 1.0 {
                    edge += 1;
                }
            }
            assert!(edge > 20, "soft edge not sampled: {edge}");
        }
        assert_eq!(aperture_soft(&optics(0.0, 0.0)), None);
        assert_eq!(aperture_soft(&optics(0.0009, 0.0008)), None);
    }

    /// The quadratic kernel's split of the half spectrum (ssb.cu `accumulate`): quadratic blocks
    /// take the pairs whose mirror is −ν or themselves, the list blocks the `general_pairs`;
    /// together every full-plane frequency but the DC is written exactly once, on even, odd
    /// and mixed scans.
    #[test]
    fn general_pairs_and_quadratic_pairs_cover_the_plane_once() {
        let freq = |n: usize| -> Vec<f32> {
            qem_cpu::ssb::fftfreq(n, 0.4)
                .iter()
                .map(|&v| v as f32)
                .collect()
        };
        for (nr, nc) in [
            (512, 512),
            (15, 22),
            (24, 30),
            (7, 9),
            (8, 5),
            (1, 6),
            (6, 1),
        ] {
            let (fr, fc) = (freq(nr), freq(nc));
            let list = general_pairs(nr, nc, &fr, &fc);
            let mut hits = vec![0u32; nr * nc];
            for h in 1..nr * (nc / 2 + 1) {
                let Some(p) = host_pair(h, nr, nc, &fr, &fc) else {
                    continue;
                };
                assert_eq!(list.contains(&(h as u32)), !p.simple, "{nr}x{nc} h {h}");
                hits[p.i1] += 1;
                if let Some(i2) = p.i2 {
                    hits[i2] += 1;
                }
            }
            assert_eq!(hits[0], 0, "{nr}x{nc}: the DC is the finishing kernel's");
            for (i, &n) in hits.iter().enumerate().skip(1) {
                assert_eq!(n, 1, "{nr}x{nc}: frequency {i} written {n} times");
            }
            // A Nyquist line has general pairs where the other axis has a frequency that is not
            // its own negative.
            let expect = nr % 2 == 0 && nc >= 3 || nc % 2 == 0 && nr >= 3;
            assert_eq!(
                !list.is_empty(),
                expect,
                "{nr}x{nc}: {} general pairs",
                list.len()
            );
        }
    }

    #[test]
    fn kernels_compile_with_nvrtc_when_present() {
        match crate::nvrtc::compile_cubin(KERNEL_FILE, KERNEL_SOURCE, "sm_90", &[]) {
            Ok((cubin, _log)) => assert!(!cubin.is_empty()),
            Err(e) => assert_eq!(e.kind, qem_core::ErrorKind::BackendUnavailable, "{e}"),
        }
    }

    fn sizes(b: u64) -> Sizes {
        Sizes {
            b,
            n: 512 * 512,
            nh: 512 * 257,
            fixed: 64 << 20,
            scratch: 256 << 20,
        }
    }

    #[test]
    fn plan_picks_f32_then_f16_then_refuses() {
        let gib = 1u64 << 30;
        // 2,827 BF pixels: G as f32 is 2.97 GB, as f16 1.49 GB.
        let sz = sizes(2827);
        let (st, batch) = choose_plan(&sz, 64 * gib, None).unwrap();
        assert_eq!((st, batch), (GStorage::C32, MAX_PREPARE_BATCH.min(2827)));
        let (st, batch) = choose_plan(&sz, 4 * gib, None).unwrap();
        assert_eq!(st, GStorage::C32);
        assert!(
            batch >= 32 && sz.need(st, batch as u64) <= 4 * gib,
            "{batch}"
        );
        assert!(sz.need(st, batch as u64 + 1) > 4 * gib || batch == 2827);
        let (st, _) = choose_plan(&sz, 3 * gib, None).unwrap();
        assert_eq!(st, GStorage::C16);
        let e = choose_plan(&sz, gib, None).unwrap_err();
        assert_eq!(e.kind, qem_core::ErrorKind::MemoryBudget);
        assert!(e.to_string().contains("2827 BF pixels"), "{e}");
        // A forced storage is kept, or refused, never swapped.
        assert_eq!(
            choose_plan(&sz, 64 * gib, Some(GStorage::C16)).unwrap().0,
            GStorage::C16
        );
        assert!(choose_plan(&sz, 3 * gib, Some(GStorage::C32)).is_err());
        // 8,825 pixels (r = 53 px) under 6 GiB: f32 does not fit, f16 (4.6 GB) does.
        let (st, _) = choose_plan(&sizes(8825), 6 * gib, None).unwrap();
        assert_eq!(st, GStorage::C16);
    }
}
