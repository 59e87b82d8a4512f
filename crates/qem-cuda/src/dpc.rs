//! The stages of `dpc.run` after the reduction, on the card (kernels/dpc.cu), so that the CoM
//! fields never make a host round trip before the result is downloaded once: the curl moments
//! of the rotation search ([`curl_row_sums`]), the aligned field and the gradient
//! ([`align`]), the iDPC integration with either edge mode ([`integrate`], cuFFT), the sign
//! statistics ([`sign_sums`]), the flip ([`negate`]) and one batched download
//! ([`download_f64_into`]).
//!
//! Each stage does `qem_cpu::dpc`'s `f64` operations in its order (the reductions keep the
//! CPU's row order and [`ORDERED_CHUNK`] chunks), so everything but the transforms equals the
//! CPU engine bit for bit. The sums come back raw; the scalar decisions made from them (the
//! rotation's closed form, Pearson's r, the skewness, the sign rule) stay `qem_cpu::dpc`'s,
//! called by `qem::dpc`.
//!
//! Every function waits for its own launches before it returns, as `device_forms` does.

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use qem_core::reduce::ORDERED_CHUNK;
use qem_core::{Error, Result};

use crate::device::{driver_error, Gpu};
use crate::device_forms::{add_in_order, alloc, check, config, read_parts, wait};
use crate::device_result::{DeviceVec, ResultDType};
use crate::engine::engine;
use crate::fft::solve_on_device;
use crate::mem::{fetch_all, DevBuf, Fetch};
use crate::nvrtc::kernel;

const KERNEL_SOURCE: &str = include_str!("kernels/dpc.cu");

const OP: &str = "dpc run (on the card)";

/// The module's function `name` on `gpu`.
fn function(gpu: &Gpu, name: &str) -> Result<CudaFunction> {
    kernel(gpu, "dpc.cu", KERNEL_SOURCE, name)
}

/// One block of 256 threads per item (an interior row, an ordered chunk): the kernels stage
/// each item's terms in shared memory and add them in order on one thread.
fn per_block(items: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (items.max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Check that `a` and `b` are `f64` fields of `rows × cols` positions.
fn check_pair(a: &DeviceVec, b: &DeviceVec, rows: usize, cols: usize) -> Result<()> {
    check(a, ResultDType::F64, rows * cols, OP, "the row component")?;
    check(b, ResultDType::F64, rows * cols, OP, "the column component")
}

/// The per-row sums of `qem_cpu::dpc::CurlMoments::pair_of` of a field on the card (`rows`,
/// `cols` ≥ 3): entry `r − 1` holds interior row r's `Σ curl², Σ div², Σ curl·div` of the
/// field, then of the transposed field, each summed over the row in order from 0.0 by one
/// thread, as the CPU does (`CurlMoments::pair_from_rows` adds them).
pub fn curl_row_sums(
    g_row: &DeviceVec,
    g_col: &DeviceVec,
    rows: usize,
    cols: usize,
) -> Result<Vec<[f64; 6]>> {
    check_pair(g_row, g_col, rows, cols)?;
    if rows < 3 || cols < 3 {
        return Err(Error::invalid(OP, "the scan has no interior for the curl")
            .with_expected("at least 3 x 3 scan positions")
            .with_found(format!("{rows} x {cols}")));
    }
    let gpu = &engine()?.gpu;
    let interior = rows - 2;
    let parts = DevBuf::alloc(gpu.ctx(), interior * 48, None, "curl moments per row")?;
    let f = function(gpu, "qem_dpc_curl_rows")?;
    let (pr, pc, pp) = (g_row.device_ptr(), g_col.device_ptr(), parts.ptr());
    let (r32, c32) = (rows as u32, cols as u32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&pr).arg(&pc).arg(&r32).arg(&c32).arg(&pp);
    // SAFETY: matches `qem_dpc_curl_rows(const double* ×2, u32, u32, double*)`; both fields
    // hold rows·cols f64 (checked), block t < rows − 2 reads rows t..t+2 and writes
    // parts[6t..6t+6] (6·(rows − 2) f64 allocated above).
    unsafe { b.launch(per_block(interior)) }.map_err(|e| driver_error("launch curl moments", e))?;
    wait(gpu, "the curl moments")?;
    read_parts::<6>(&parts, interior)
}

/// The aligned CoM field and the gradient the integration takes.
#[derive(Debug, Clone)]
pub struct Aligned {
    /// `cosθ·a − sinθ·b`.
    pub dpc_row: DeviceVec,
    /// `sinθ·a + cosθ·b`.
    pub dpc_col: DeviceVec,
    /// `dpc_row · k_r`.
    pub g_row: DeviceVec,
    /// `dpc_col · k_c`.
    pub g_col: DeviceVec,
}

/// `qem_cpu::dpc::align(com_row, com_col, theta, transpose)` on the card, and the gradient
/// `(dpc_row · scale.0, dpc_col · scale.1)`.
pub fn align(
    com_row: &DeviceVec,
    com_col: &DeviceVec,
    theta: f64,
    transpose: bool,
    scale: (f64, f64),
) -> Result<Aligned> {
    let n = com_row.len();
    check_pair(com_row, com_col, n, 1)?;
    let (a, b) = if transpose {
        (com_col, com_row)
    } else {
        (com_row, com_col)
    };
    let gpu = &engine()?.gpu;
    let out = Aligned {
        dpc_row: alloc(gpu, n, ResultDType::F64, "the aligned rows")?,
        dpc_col: alloc(gpu, n, ResultDType::F64, "the aligned columns")?,
        g_row: alloc(gpu, n, ResultDType::F64, "the gradient rows")?,
        g_col: alloc(gpu, n, ResultDType::F64, "the gradient columns")?,
    };
    let (s, c) = theta.sin_cos();
    let f = function(gpu, "qem_dpc_align")?;
    let (pa, pb, n64) = (a.device_ptr(), b.device_ptr(), n as u64);
    let (dr, dc) = (out.dpc_row.device_ptr(), out.dpc_col.device_ptr());
    let (gr, gc) = (out.g_row.device_ptr(), out.g_col.device_ptr());
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&pa).arg(&pb).arg(&n64).arg(&c).arg(&s);
    l.arg(&scale.0).arg(&scale.1);
    l.arg(&dr).arg(&dc).arg(&gr).arg(&gc);
    // SAFETY: matches `qem_dpc_align(const double* ×2, u64, double ×4, double* ×4)`; every
    // array holds n f64 (checked and allocated above).
    unsafe { l.launch(config(n)) }.map_err(|e| driver_error("launch align", e))?;
    wait(gpu, "the aligned field")?;
    Ok(out)
}

/// Queue `qem_dpc_crop`: the top-left `rows × cols` of a grid `ec` values wide into `out`
/// (`ec = cols` copies).
fn queue_crop(
    gpu: &Gpu,
    stream: &CudaStream,
    src: u64,
    (rows, cols, ec): (usize, usize, usize),
    out: u64,
) -> Result<()> {
    let f = function(gpu, "qem_dpc_crop")?;
    let (r32, c32, e32) = (rows as u32, cols as u32, ec as u32);
    let mut b = stream.launch_builder(&f);
    b.arg(&src).arg(&r32).arg(&c32).arg(&e32).arg(&out);
    // SAFETY: matches `qem_dpc_crop(const double*, u32, u32, u32, double*)`; the callers pass
    // a source of at least rows·ec f64 and an output of rows·cols f64.
    unsafe { b.launch(config(rows * cols)) }.map_err(|e| driver_error("launch crop", e))?;
    Ok(())
}

/// `qem_cpu::dpc::integrate_with(g_row, g_col, shape, edge, cuFFT)` on the card: the periodic
/// solve of `rows × cols`, or (`mirror`) of the mirrored `2rows × 2cols` extension whose
/// top-left quarter, mean removed in the CPU's chunk order, is the phase.
pub fn integrate(
    g_row: &DeviceVec,
    g_col: &DeviceVec,
    rows: usize,
    cols: usize,
    mirror: bool,
) -> Result<DeviceVec> {
    check_pair(g_row, g_col, rows, cols)?;
    let gpu = &engine()?.gpu;
    let phase = alloc(gpu, rows * cols, ResultDType::F64, "the phase")?;
    let (pr, pc, out) = (g_row.device_ptr(), g_col.device_ptr(), phase.device_ptr());
    if !mirror {
        solve_on_device(
            rows,
            cols,
            |wr, wc, stream| {
                queue_crop(gpu, stream, pr, (rows, cols, cols), wr.ptr())?;
                queue_crop(gpu, stream, pc, (rows, cols, cols), wc.ptr())
            },
            |w, stream| queue_crop(gpu, stream, w.ptr(), (rows, cols, cols), out),
        )?;
    } else {
        let (er, ec) = (2 * rows, 2 * cols);
        solve_on_device(
            er,
            ec,
            |wr, wc, stream| {
                let f = function(gpu, "qem_dpc_mirror")?;
                let (r32, c32, xr, xc) = (rows as u32, cols as u32, wr.ptr(), wc.ptr());
                let mut b = stream.launch_builder(&f);
                b.arg(&pr).arg(&pc).arg(&r32).arg(&c32).arg(&xr).arg(&xc);
                // SAFETY: matches `qem_dpc_mirror(const double* ×2, u32, u32, double* ×2)`;
                // the fields hold rows·cols f64, the work buffers er·ec (the grid's).
                unsafe { b.launch(config(er * ec)) }
                    .map_err(|e| driver_error("launch mirror", e))?;
                Ok(())
            },
            |w, stream| queue_crop(gpu, stream, w.ptr(), (rows, cols, ec), out),
        )?;
        let [sum, _] = ordered_sums(gpu, &phase, None)?;
        shift(gpu, &phase, sum / (rows * cols) as f64, false)?;
    }
    Ok(phase)
}

/// The CPU's ordered sums of `a` (and of `b` as `f64`, when given) on the card: one block per
/// [`ORDERED_CHUNK`] chunk, the chunk sums added here in chunk order.
fn ordered_sums(gpu: &Gpu, a: &DeviceVec, b: Option<&DeviceVec>) -> Result<[f64; 2]> {
    let n = a.len();
    let n_chunks = n.div_ceil(ORDERED_CHUNK).max(1);
    let parts = DevBuf::alloc(gpu.ctx(), n_chunks * 16, None, "chunk sums")?;
    let f = function(gpu, "qem_dpc_chunk_sums")?;
    let (pa, pb, pp) = (a.device_ptr(), b.map_or(0, |v| v.device_ptr()), parts.ptr());
    let (n64, chunk, nc) = (n as u64, ORDERED_CHUNK as u64, n_chunks as u64);
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&pa).arg(&pb).arg(&n64).arg(&chunk).arg(&nc).arg(&pp);
    // SAFETY: matches `qem_dpc_chunk_sums(const double*, const u64*, u64, u64, u64, double*)`;
    // `a` (and `b` when not null) hold n values (the callers check), parts 2·n_chunks f64, one
    // block per chunk.
    unsafe { l.launch(per_block(n_chunks)) }.map_err(|e| driver_error("launch chunk sums", e))?;
    wait(gpu, "the chunk sums")?;
    Ok(add_in_order(&read_parts::<2>(&parts, n_chunks)?))
}

/// `x = ±(x − by)` in place (`negate`: the minus sign; exact when `by = 0`).
fn shift(gpu: &Gpu, x: &DeviceVec, by: f64, negate: bool) -> Result<()> {
    check(x, ResultDType::F64, x.len(), OP, "the array")?;
    let f = function(gpu, "qem_dpc_shift")?;
    let (px, n64, neg) = (x.device_ptr(), x.len() as u64, i32::from(negate));
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&px).arg(&n64).arg(&by).arg(&neg);
    // SAFETY: matches `qem_dpc_shift(double*, u64, double, int)`; x holds n f64.
    unsafe { l.launch(config(x.len())) }.map_err(|e| driver_error("launch shift", e))?;
    wait(gpu, "the shift")
}

/// Negate an `f64` device array in place (the 180° flip).
pub fn negate(x: &DeviceVec) -> Result<()> {
    shift(&engine()?.gpu, x, 0.0, true)
}

/// The centred sums behind `qem_cpu::dpc`'s sign statistics of `phase`, with the CPU's bits:
/// `[Σ dx·dy, Σ dx², Σ dy², Σ dx²·dx]` with `dx = phase − mean`, `dy = adf − mean` (`adf` is
/// the `u64` ADF image taken as `f64`; without it `dy = 0`). The means come from the ordered
/// chunk sums, the centred sums from the same chunks (`qem_cpu::dpc::sign_statistics_from`
/// turns them into Pearson's r and the skewness).
pub fn sign_sums(phase: &DeviceVec, adf: Option<&DeviceVec>) -> Result<[f64; 4]> {
    let n = phase.len();
    check(phase, ResultDType::F64, n, OP, "the phase")?;
    if let Some(b) = adf {
        check(b, ResultDType::U64, n, OP, "the ADF image")?;
    }
    if n == 0 {
        return Err(Error::invalid(OP, "no phase values").with_expected("at least 1 value"));
    }
    let gpu = &engine()?.gpu;
    let nf = n as f64;
    let [sa, sb] = ordered_sums(gpu, phase, adf)?;
    let (ma, mb) = (sa / nf, sb / nf);
    let n_chunks = n.div_ceil(ORDERED_CHUNK);
    let parts = DevBuf::alloc(gpu.ctx(), n_chunks * 32, None, "centred sums")?;
    let f = function(gpu, "qem_dpc_centred_sums")?;
    let (pa, pb, pp) = (
        phase.device_ptr(),
        adf.map_or(0, |v| v.device_ptr()),
        parts.ptr(),
    );
    let (n64, chunk, nc) = (n as u64, ORDERED_CHUNK as u64, n_chunks as u64);
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(&pa).arg(&pb).arg(&n64).arg(&chunk).arg(&nc);
    l.arg(&ma).arg(&mb).arg(&pp);
    // SAFETY: matches `qem_dpc_centred_sums(const double*, const u64*, u64, u64, u64, double,
    // double, double*)`; phase (and the image when not null) hold n values (checked), parts
    // 4·n_chunks f64.
    unsafe { l.launch(per_block(n_chunks)) }.map_err(|e| driver_error("launch centred sums", e))?;
    wait(gpu, "the centred sums")?;
    Ok(add_in_order(&read_parts::<4>(&parts, n_chunks)?))
}

/// The `f64` arrays `vs` copied into `out` (one host vector per array, each already as long
/// as its array), through one batch of copies and one wait. Vectors whose pages are already
/// touched take the copies ~10× faster than fresh ones (measured here: 0.4 against 4 ms for
/// 10 MB), which is why the caller brings its own.
pub fn download_f64_into(vs: &[&DeviceVec], out: &mut [Vec<f64>]) -> Result<()> {
    if vs.len() != out.len() || vs.iter().zip(out.iter()).any(|(v, o)| v.len() != o.len()) {
        return Err(Error::internal(
            OP,
            "download targets do not match the arrays",
        ));
    }
    for v in vs {
        check(v, ResultDType::F64, v.len(), OP, "a downloaded array")?;
    }
    let gpu = &engine()?.gpu;
    let mut fetches: Vec<Fetch<'_>> = vs
        .iter()
        .zip(out.iter_mut())
        .map(|(v, o)| {
            let (buf, offset) = v.buffer();
            Fetch {
                src: buf,
                offset,
                dst: bytemuck::cast_slice_mut(o.as_mut_slice()),
            }
        })
        .collect();
    fetch_all(gpu.ctx(), gpu.stream(), &mut fetches)
}
