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
//! `G_b(0)/60000` (half the bytes, 11 significant bits), else that f16 rounded to 12 bits (3
//! bytes a value, 7 significant bits: what lets 8,653 BF pixels of a 512² scan fit a 6 GiB card
//! beside the data resident ENCODED). Batches of BF pixels are sized so that
//! G, the work buffers and the batch's images, cuFFT work areas and decode scratch stay within the
//! budget; a G that does not fit even as C12 is a `MemoryBudget` error naming the bytes.
//!
//! Each evaluation ([`GpuSsb::object`], [`GpuSsb::coherence`], [`GpuSsb::phase_variance`])
//! uploads nothing but its 8 aberration coefficients: a tiny kernel tabulates `P(k_b)`, the
//! accumulate kernel forms `Σ_b C_b(ν)` (the object's phase-only `G Γ*/|Γ|`, the coherence
//! loss's `G Γ*`), `Σ_b |Γ_b(ν)|²` and `Σ |G_b|²` over the full plane in one read of G, and only
//! the object (N complex values) or a few thousand per-block partial sums come back. When χ
//! is quadratic (only C10, C12, φ12 — the default fit) the accumulate kernel needs no χ and no
//! sincos per pixel: `Γ_b(±ν) = A(k_b) E^{±1} W_±` with `E = exp(2i k_bᵀMν)` carried along each
//! detector row by one complex product (kernels/ssb.cu, `quad_terms`; [`quad_gamma`] is the same
//! algebra in f64, tested against `qem_cpu::ssb::gamma`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::cufft::{result as cufft, sys as cufft_sys};
use cudarc::driver::{
    sys, CudaEvent, CudaFunction, CudaStream, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use qem_core::optics::{chi_polynomial, Aberrations, Optics};
use qem_core::{DType, Error, Result, Shape2};

use crate::device::{driver_error, Gpu};
use crate::engine::{engine, Engine};
use crate::fft::{cufft_error, require_cufft, Plan};
use crate::load::DeviceArray;
use crate::mem::{read_vec, upload, DevBuf, MemCounter, PinnedBuf};
use crate::nvrtc::load_module;
use crate::rans::{fault_error, new_err_record, read_err, DeviceEncoded};

const KERNEL_SOURCE: &str = include_str!("../kernels/ssb.cu");
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
    /// C16's values rounded to 12 bits each (sign, exponent, 6 mantissa bits: a relative
    /// rounding error ≤ 2⁻⁷), 3 bytes a value.
    C12,
}

impl GStorage {
    /// Name used in provenance.
    pub fn name(self) -> &'static str {
        match self {
            GStorage::C32 => "half spectrum, complex f32",
            GStorage::C16 => "half spectrum, complex f16 scaled by G_b(0)/60000 per pixel",
            GStorage::C12 => {
                "half spectrum, complex f12 (f16 rounded to 7 significant bits) scaled by \
                 G_b(0)/60000 per pixel"
            }
        }
    }
    fn bytes_per_value(self) -> u64 {
        match self {
            GStorage::C32 => 8,
            GStorage::C16 => 4,
            GStorage::C12 => 3,
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
    /// Force a storage (`None` = C32 when it fits, else C16 when it fits, else C12).
    pub storage: Option<GStorage>,
}

/// How a preparation went.
#[derive(Debug, Clone, PartialEq)]
pub struct PrepareStats {
    /// Storage of G.
    pub storage: GStorage,
    /// Bytes of G.
    pub g_bytes: u64,
    /// BF pixels per prepare batch (FFT batch).
    pub batch_pixels: usize,
    /// ENCODED data under a tight budget: BF pixels per decode pass, staged as u16 images
    /// before their FFT batches (0 = not staged: each batch decodes every frame).
    pub staged_pixels: usize,
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
    explained: CudaFunction,
    phase_accum: CudaFunction,
    phase_var: CudaFunction,
    gather_u8: CudaFunction,
    gather_u16: CudaFunction,
    gather_u32: CudaFunction,
    /// Decoded u16 frames into staged u16 images (the ENCODED route under a tight budget).
    gather_u16_to_u16: CudaFunction,
    store: CudaFunction,
    u32_to_f32: CudaFunction,
    u16_to_f32: CudaFunction,
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

mod geometry;
mod plan;
mod prepare;
#[cfg(test)]
mod tests;

use geometry::*;
use plan::*;

/// Buffers of the phase-variance loss (allocated on its first use).
struct PvWork {
    batch: usize,
    buf: DevBuf,
    s1: DevBuf,
    s2: DevBuf,
    plans: Vec<(usize, SizedPlan)>,
}

/// G's geometry as kernel arguments: G and its per-pixel scales (device addresses), the scan
/// frequencies along rows and columns (device addresses), the scan's rows and columns, the
/// half-spectrum width and the optics.
struct SpectrumArgs {
    g: u64,
    gscale: u64,
    fr: u64,
    fc: u64,
    rows: u32,
    cols: u32,
    half: u32,
    optics: OpticsArg,
}

impl SpectrumArgs {
    /// Push the scan frequencies, the scan's rows and columns, the half width and the optics:
    /// the run of arguments the accumulate and corrected kernels share, in their signatures'
    /// order.
    fn push_scan<'a>(&'a self, lb: &mut LaunchArgs<'a>) {
        lb.arg(&self.fr)
            .arg(&self.fc)
            .arg(&self.rows)
            .arg(&self.cols)
            .arg(&self.half)
            .arg(&self.optics);
    }
}

/// Per-evaluation buffers.
struct Work {
    pk: DevBuf,
    s_part: DevBuf,
    s: DevBuf,
    d_part: DevBuf,
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
        GStorage::C12 => (
            "qem_ssb_accumulate_g12",
            "qem_ssb_accumulate_quad_g12",
            "qem_ssb_corrected_g12",
            "qem_ssb_store_g12",
        ),
    };
    Ok(Funcs {
        probe_table: get("qem_ssb_probe_table")?,
        accumulate: get(acc)?,
        accumulate_quad: get(quad)?,
        corrected: get(cor)?,
        sum_slices: get("qem_ssb_sum_slices")?,
        finish: get("qem_ssb_finish")?,
        explained: get("qem_ssb_explained")?,
        phase_accum: get("qem_ssb_phase_accum")?,
        phase_var: get("qem_ssb_phase_var")?,
        gather_u8: get("qem_ssb_gather_u8")?,
        gather_u16: get("qem_ssb_gather_u16")?,
        gather_u32: get("qem_ssb_gather_u32")?,
        gather_u16_to_u16: get("qem_ssb_gather_u16_to_u16")?,
        store: get(store)?,
        u32_to_f32: get("qem_ssb_u32_to_f32")?,
        u16_to_f32: get("qem_ssb_u16_to_f32")?,
    })
}

impl GpuSsb {
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

    /// The arguments of G's geometry that the accumulate and the corrected-spectrum kernels
    /// both take.
    fn spectrum_args(&self) -> SpectrumArgs {
        SpectrumArgs {
            g: self.g.ptr(),
            gscale: self.gscale.ptr(),
            fr: self.fr.ptr(),
            fc: self.fc.ptr(),
            rows: self.scan.rows as u32,
            cols: self.scan.cols as u32,
            half: self.half as u32,
            optics: self.optics,
        }
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

    /// Queue P(k_b) and the accumulate launch over pixels `0..used`, then for the object
    /// (`matched` false) the slice sum and the mean spectrum into `s`, for the coherence loss
    /// (`matched`) its numerator's block partials into `fin_part`; returns the accumulate grid's
    /// x size (its blocks' power partials are `slices` × that).
    fn queue_mean_spectrum(
        &self,
        w: &Work,
        ab: &AbArg,
        quad: Option<QuadArg>,
        used: usize,
        matched: bool,
    ) -> Result<u32> {
        let stream = self.gpu.stream();
        let (kb, pk, nb) = (self.kb.ptr(), w.pk.ptr(), self.b as u32);
        let used32 = used as u32;
        self.queue_probe_table(w, ab)?;
        // The same slices over fewer pixels: each no larger than at prepare (shared memory).
        let per_slice = used32.div_ceil(self.slices);
        let sa = self.spectrum_args();
        let (sp, dp, pp) = (w.s_part.ptr(), w.d_part.ptr(), w.pow_part.ptr());
        let matched32 = u32::from(matched);
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
        lb.arg(&sa.g)
            .arg(&sa.gscale)
            .arg(&nb)
            .arg(&used32)
            .arg(&per_slice)
            .arg(&kb)
            .arg(&pk)
            .arg(&ak)
            .arg(&cont);
        sa.push_scan(&mut lb);
        lb.arg(ab)
            .arg(&q)
            .arg(&matched32)
            .arg(&hl)
            .arg(&n_list)
            .arg(&gen_blocks)
            .arg(&sp)
            .arg(&dp)
            .arg(&pp);
        // SAFETY: matches `qem_ssb_accumulate[_quad]_g{32,16,12}(const void*, const float*, u32,
        // u32, u32, const float2*, const float2*, const float*, const unsigned char*, const float*,
        // const float*, u32, u32, u32, SsbOptics, SsbAb, SsbQuad, u32, const u32*, u32, u32,
        // float2*, float*, double*)`: G holds b·padded_half(nr·half) values of its storage (tiled),
        // used ≤ b, gscale/kb/pk/ak/cont b entries, fr/fc nr/nc floats, hlist n_list (≥ 1) u32 with
        // gen_blocks·256 ≥ n_list, s_part slices·n float2, d_part slices·n f32, pow_part slices·(blocks_x +
        // ⌈n_list / 256⌉) f64 ≥ slices·grid_x; the dynamic shared memory holds
        // per_slice·ACC_TABLE_BYTES (≤ 45 KB by MAX_SLICE_PIXELS); the grid is (grid_x, slices)
        // with blocks_x·256 ≥ nr·half.
        unsafe { lb.launch(cfg) }.map_err(|er| driver_error("launch ssb accumulate", er))?;
        let n = self.scan.len() as u64;
        let slices = self.slices;
        if matched {
            let fp = w.fin_part.ptr();
            let mut lb = stream.launch_builder(&self.f.explained);
            lb.arg(&sp).arg(&dp).arg(&slices).arg(&n).arg(&fp);
            // SAFETY: matches `qem_ssb_explained(const float2*, const float*, u32, u64,
            // double*)`; s_part holds slices·n float2, d_part slices·n f32, fin_part 4096 f64 ≥
            // the grid's blocks (grid_1d caps at 4096).
            unsafe { lb.launch(grid_1d(n)) }
                .map_err(|er| driver_error("launch ssb explained", er))?;
            return Ok(grid_x);
        }
        let (add, s) = (0u32, w.s.ptr());
        let mut lb = stream.launch_builder(&self.f.sum_slices);
        lb.arg(&sp).arg(&slices).arg(&n).arg(&add).arg(&s);
        // SAFETY: matches `qem_ssb_sum_slices(const float2*, u32, u64, u32, float2*)`; s_part
        // holds slices·n float2, s n float2.
        unsafe { lb.launch(grid_1d(n)) }.map_err(|er| driver_error("launch ssb sum", er))?;
        let (inv_b, dc, fp) = (1.0f32 / used as f32, self.dc as f32, w.fin_part.ptr());
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
        self.queue_mean_spectrum(&w, &a, self.quad_arg(ab), self.b, false)?;
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

    /// The CPU engine's coherence objective (`qem_cpu::ssb::Objective::Coherence`) at `ab`.
    pub fn coherence(&self, ab: &Aberrations) -> Result<f64> {
        self.coherence_over(ab, self.b)
    }

    /// Pixels `0..used` of `0..b` (past the end: all of them).
    fn used(&self, used: usize) -> usize {
        used.min(self.b)
    }

    /// [`GpuSsb::coherence`] over the first `used` BF pixels only
    /// (`qem_cpu::ssb::Prepared::objective_over`).
    pub fn coherence_over(&self, ab: &Aberrations, used: usize) -> Result<f64> {
        let used = self.used(used);
        let w = self.lock()?;
        let a = self.ab_arg(ab);
        let grid_x = self.queue_mean_spectrum(&w, &a, self.quad_arg(ab), used, true)?;
        self.sync("coherence")?;
        let pw: Vec<f64> = read_vec(&w.pow_part, self.slices as usize * grid_x as usize)?;
        let blocks = grid_1d(self.scan.len() as u64).grid_dim.0 as usize;
        let fin: Vec<f64> = read_vec(&w.fin_part, blocks)?;
        let power: f64 = pw.iter().sum();
        if power <= 0.0 {
            return Ok(0.0);
        }
        Ok(-fin.iter().sum::<f64>() / power)
    }

    /// The CPU engine's phase-variance objective (`qem_cpu::ssb::Objective::PhaseVariance`) at
    /// `ab`: per BF pixel an inverse FFT, in batches (their buffers are allocated on the first
    /// call, within the budget).
    pub fn phase_variance(&self, ab: &Aberrations) -> Result<f64> {
        self.phase_variance_over(ab, self.b)
    }

    /// [`GpuSsb::phase_variance`] over the first `used` BF pixels only.
    pub fn phase_variance_over(&self, ab: &Aberrations, used: usize) -> Result<f64> {
        let used = self.used(used);
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
        self.queue_probe_table(&w, &a)?;
        let sa = self.spectrum_args();
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
        for b0 in (0..used).step_by(pv.batch) {
            let nbj = pv.batch.min(used - b0);
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
            lb.arg(&sa.g)
                .arg(&sa.gscale)
                .arg(&b032)
                .arg(&nb32)
                .arg(&kb)
                .arg(&pk);
            sa.push_scan(&mut lb);
            lb.arg(&a).arg(&dc).arg(&buf);
            // SAFETY: matches `qem_ssb_corrected_g{32,16,12}(const void*, const float*, u32, u32,
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
        let inv_b = 1.0 / used as f64;
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
