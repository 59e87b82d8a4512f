//! Device results finished on the card from other device results (`kernels/device_forms.cu`):
//! the mean DP from the exact sum DP ([`mean_dp`]), the centre of mass from the exact moments
//! ([`com_from_moments`]), and one factor applied to an `f64` result ([`scale`]). Each kernel
//! does the host form's `f64` operations in the host form's order, so the values are the host
//! path's bit for bit (the façade's tests compare them).
//!
//! Every function waits for its own launches before it returns (the result is complete for
//! every stream, as the engine's device results are); the inputs are complete device results.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use qem_core::{Error, Result};

use crate::device::{driver_error, Gpu};
use crate::device_result::{DeviceMoments, DeviceVec, ResultDType};
use crate::engine::engine;
use crate::mem::{read_vec, DevBuf};
use crate::nvrtc::kernel;

const KERNEL_SOURCE: &str = include_str!("kernels/device_forms.cu");

/// Frames per ordered chunk of the CoM's scan mean (chunks summed serially, then the chunk sums
/// in chunk order): the vocabulary's
/// [`ORDERED_CHUNK`](qem_core::reduce::ORDERED_CHUNK), the CPU engine's too, so the two means
/// agree bit for bit (`crates/qem/tests/device_result.rs` compares them over several chunks).
pub use qem_core::reduce::ORDERED_CHUNK as COM_CHUNK;

const THREADS: u32 = 256;

/// The centre of mass left on the device: `f64` per scan position, and the frames with no
/// counts.
#[derive(Debug, Clone)]
pub struct DeviceCom {
    /// `μ_r` per frame.
    pub com_row: DeviceVec,
    /// `μ_c` per frame.
    pub com_col: DeviceVec,
    /// Frames with `S = 0` (their CoM is 0 before centring).
    pub zero_frames: u64,
}

/// The module's function `name` on `gpu`.
fn function(gpu: &Gpu, name: &str) -> Result<CudaFunction> {
    kernel(gpu, "device_forms.cu", KERNEL_SOURCE, name)
}

/// A grid-stride launch over `n` items.
pub(crate) fn config(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            (n as u64).div_ceil(THREADS as u64).clamp(1, 4096) as u32,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(crate) fn check(
    v: &DeviceVec,
    dtype: ResultDType,
    len: usize,
    op: &str,
    what: &str,
) -> Result<()> {
    if v.dtype() != dtype || v.len() != len {
        return Err(
            Error::internal(op, format!("{what} is not what the step takes"))
                .with_expected(format!("{len} {}", dtype.numpy_name()))
                .with_found(format!("{} {}", v.len(), v.dtype().numpy_name())),
        );
    }
    Ok(())
}

/// A new device result of `len` values of `dtype` (its own allocation).
pub(crate) fn alloc(gpu: &Gpu, len: usize, dtype: ResultDType, what: &str) -> Result<DeviceVec> {
    let b = DevBuf::alloc(gpu.ctx(), len * dtype.size(), None, what)?;
    DeviceVec::new(Arc::new(b), 0, len, dtype, gpu.info().ordinal)
}

/// The `K` sums each of `items` blocks wrote to `parts` (block-major), read back.
pub(crate) fn read_parts<const K: usize>(parts: &DevBuf, items: usize) -> Result<Vec<[f64; K]>> {
    let flat: Vec<f64> = read_vec(parts, K * items)?;
    Ok(flat
        .chunks_exact(K)
        .map(|c| std::array::from_fn(|q| c[q]))
        .collect())
}

/// Per-chunk sums added in chunk order from 0.0: the last step of the CPU engine's ordered sums
/// (`qem_core::reduce::ORDERED_CHUNK` chunks), so the totals have its bits.
pub(crate) fn add_in_order<const K: usize>(parts: &[[f64; K]]) -> [f64; K] {
    let mut t = [0.0f64; K];
    for p in parts {
        for (a, b) in t.iter_mut().zip(p) {
            *a += b;
        }
    }
    t
}

pub(crate) fn wait(gpu: &Gpu, what: &str) -> Result<()> {
    gpu.stream()
        .synchronize()
        .map_err(|e| driver_error(&format!("wait for {what}"), e))
}

/// The mean DP `(sum / n_frames)` in `f64`, rounded to `f32` per pixel, from the exact `u64`
/// sum DP: `qem::detector::mean_dp`'s arithmetic. `n_frames` must be positive (the façade
/// refuses 0 first).
pub fn mean_dp(sum: &DeviceVec, n_frames: u64) -> Result<DeviceVec> {
    const OP: &str = "mean DP on the device";
    check(sum, ResultDType::U64, sum.len(), OP, "the sum DP")?;
    if n_frames == 0 {
        return Err(Error::internal(OP, "the mean over no frames"));
    }
    let gpu = &engine()?.gpu;
    let f = function(gpu, "qem_mean_dp")?;
    let out = alloc(gpu, sum.len(), ResultDType::F32, "the mean DP")?;
    let (src, dst, n, nf) = (
        sum.device_ptr(),
        out.device_ptr(),
        sum.len() as u64,
        n_frames as f64,
    );
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&src).arg(&dst).arg(&n).arg(&nf);
    // SAFETY: matches `qem_mean_dp(const u64*, float*, u64, double)`; `sum` holds n u64 and
    // `out` n f32 (checked and allocated above), both alive until the wait below.
    unsafe { b.launch(config(sum.len())) }.map_err(|e| driver_error("launch mean DP", e))?;
    wait(gpu, "the mean DP")?;
    Ok(out)
}

/// The centre of mass from exact per-frame moments (`qem_cpu::dpc::com_from_moments`):
/// `μ = m / S` in `f64` (0 where `S = 0`, counted), the scan mean removed when `centered`
/// (summed in [`COM_CHUNK`]-frame chunks, then the chunk sums in order, as the CPU does), then
/// each component multiplied by `factor` when given (the detector sampling in mrad).
pub fn com_from_moments(
    m: &DeviceMoments,
    centered: bool,
    factor: Option<(f64, f64)>,
) -> Result<DeviceCom> {
    const OP: &str = "centre of mass on the device";
    let n = m.sum.len();
    for (v, what) in [
        (&m.sum, "the moment sum"),
        (&m.m_row, "m_row"),
        (&m.m_col, "m_col"),
    ] {
        check(v, ResultDType::U64, n, OP, what)?;
    }
    let gpu = &engine()?.gpu;
    let com_row = alloc(gpu, n, ResultDType::F64, "the CoM rows")?;
    let com_col = alloc(gpu, n, ResultDType::F64, "the CoM columns")?;
    let (s, mr, mc) = (
        m.sum.device_ptr(),
        m.m_row.device_ptr(),
        m.m_col.device_ptr(),
    );
    let (row, col, n64) = (com_row.device_ptr(), com_col.device_ptr(), n as u64);
    let divide = function(gpu, "qem_com_divide")?;
    let mut b = gpu.stream().launch_builder(&divide);
    b.arg(&s).arg(&mr).arg(&mc).arg(&row).arg(&col).arg(&n64);
    // SAFETY: matches `qem_com_divide(const u64* ×3, double* ×2, u64)`; the moments hold n u64
    // each, the outputs n f64 each (checked and allocated above), all alive until the waits.
    unsafe { b.launch(config(n)) }.map_err(|e| driver_error("launch CoM divide", e))?;
    let n_chunks = n.div_ceil(COM_CHUNK);
    let parts = DevBuf::alloc(gpu.ctx(), n_chunks * 16, None, "CoM chunk sums")?;
    let zeros = DevBuf::alloc(gpu.ctx(), n_chunks * 8, None, "CoM zero frames")?;
    let sums = function(gpu, "qem_com_chunk_sums")?;
    let (chunk, nc, pp, zp) = (COM_CHUNK as u64, n_chunks as u64, parts.ptr(), zeros.ptr());
    let mut b = gpu.stream().launch_builder(&sums);
    b.arg(&s).arg(&row).arg(&col).arg(&n64).arg(&chunk).arg(&nc);
    b.arg(&pp).arg(&zp);
    // SAFETY: matches `qem_com_chunk_sums(const u64*, const double* ×2, u64, u64, u64, double*,
    // u64*)`; block j reads its chunk's frames below n and writes parts[2j..2j+2] and zeros[j]
    // (2·n_chunks f64 and n_chunks u64 allocated above).
    let cfg = LaunchConfig {
        grid_dim: (n_chunks.max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch CoM sums", e))?;
    wait(gpu, "the CoM chunk sums")?;
    let parts = read_parts::<2>(&parts, n_chunks)?;
    let zeros: Vec<u64> = read_vec(&zeros, n_chunks)?;
    let zero_frames = zeros.iter().sum();
    let center = centered && n > 0;
    if center || factor.is_some() {
        let [tr, tc] = add_in_order(&parts);
        let (mean_r, mean_c) = (tr / n as f64, tc / n as f64);
        let (f_r, f_c) = factor.unwrap_or((1.0, 1.0));
        let (c32, s32) = (i32::from(center), i32::from(factor.is_some()));
        let finish = function(gpu, "qem_com_finish")?;
        let mut b = gpu.stream().launch_builder(&finish);
        b.arg(&row)
            .arg(&col)
            .arg(&n64)
            .arg(&c32)
            .arg(&mean_r)
            .arg(&mean_c);
        b.arg(&s32).arg(&f_r).arg(&f_c);
        // SAFETY: matches `qem_com_finish(double*, double*, u64, int, double, double, int,
        // double, double)`; both arrays hold n f64.
        unsafe { b.launch(config(n)) }.map_err(|e| driver_error("launch CoM finish", e))?;
        wait(gpu, "the CoM")?;
    }
    Ok(DeviceCom {
        com_row,
        com_col,
        zero_frames,
    })
}

/// `v · factor` as a new `f64` device result (`v` is left as it is).
pub fn scale(v: &DeviceVec, factor: f64) -> Result<DeviceVec> {
    const OP: &str = "scale a device result";
    check(v, ResultDType::F64, v.len(), OP, "the array")?;
    let gpu = &engine()?.gpu;
    // A consumer may have written `v` on a stream of its own: wait for the whole device.
    gpu.ctx()
        .synchronize()
        .map_err(|e| driver_error("synchronize before a scale", e))?;
    let f = function(gpu, "qem_scale_f64")?;
    let out = alloc(gpu, v.len(), ResultDType::F64, "the scaled array")?;
    let (src, dst, n) = (v.device_ptr(), out.device_ptr(), v.len() as u64);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&src).arg(&dst).arg(&n).arg(&factor);
    // SAFETY: matches `qem_scale_f64(const double*, double*, u64, double)`; both hold n f64.
    unsafe { b.launch(config(v.len())) }.map_err(|e| driver_error("launch scale", e))?;
    wait(gpu, "the scaled array")?;
    Ok(out)
}
