//! iDPC integration with cuFFT: the periodic least-squares inverse gradient of
//! `qem_cpu::dpc::integrate` on the GPU — two real-to-complex transforms (D2Z, f64), the
//! `qem_idpc_combine` kernel (kernels/dpc.cu), one complex-to-real transform (Z2D). The mirror
//! edge mode is the CPU code's even extension around this solver (`qem_cpu::dpc::integrate_with`).
//!
//! cuFFT is loaded on first use; a machine without libcufft gets `BackendUnavailable`.

use cudarc::cufft::{result as cufft, sys as cufft_sys};
use std::sync::Mutex;

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use qem_core::{Error, ErrorKind, Result};

use crate::device::{driver_error, Gpu};
use crate::engine::engine;
use crate::mem::{par_copy, queue_then_wait, with_staging, DevBuf};
use crate::nvrtc::load_module;

const KERNEL_SOURCE: &str = include_str!("kernels/dpc.cu");

fn fft_error(what: &str, e: cufft::CufftError) -> Error {
    cufft_error("iDPC (cuFFT)", what, e)
}

/// A cuFFT failure of operation `op` as an internal error.
pub(crate) fn cufft_error(op: &str, what: &str, e: cufft::CufftError) -> Error {
    Error::new(ErrorKind::Internal, op, format!("{what}: {e:?}"))
}

/// `BackendUnavailable` for `op` when libcufft cannot be loaded.
pub(crate) fn require_cufft(op: &str) -> Result<()> {
    // SAFETY: only tries to dlopen libcufft and drops the handle.
    if unsafe { cufft_sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::BackendUnavailable,
            op,
            "libcufft was not found on the library path",
        ))
    }
}

/// A cuFFT plan, destroyed on drop.
pub(crate) struct Plan(pub(crate) cufft_sys::cufftHandle);

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: the handle came from plan_2d and is destroyed once.
        let _ = unsafe { cufft::destroy(self.0) };
    }
}

/// cuFFT plans, device buffers and the combine kernel of one `rows × cols` grid.
struct IdpcWork {
    rows: usize,
    cols: usize,
    fwd: Plan,
    inv: Plan,
    d_gr: DevBuf,
    d_gc: DevBuf,
    d_a: DevBuf,
    d_b: DevBuf,
    combine: CudaFunction,
}

/// The last grid's work area (one scan is typically integrated many times).
static IDPC_WORK: Mutex<Option<IdpcWork>> = Mutex::new(None);

impl IdpcWork {
    fn new(rows: usize, cols: usize) -> Result<IdpcWork> {
        let gpu = &engine()?.gpu;
        let (n, half) = (rows * cols, cols / 2 + 1);
        let spec = rows * half * 16;
        let fwd = Plan(
            cufft::plan_2d(rows as i32, cols as i32, cufft_sys::cufftType::CUFFT_D2Z)
                .map_err(|er| fft_error("plan D2Z", er))?,
        );
        let inv = Plan(
            cufft::plan_2d(rows as i32, cols as i32, cufft_sys::cufftType::CUFFT_Z2D)
                .map_err(|er| fft_error("plan Z2D", er))?,
        );
        let m = load_module(gpu, "dpc.cu", KERNEL_SOURCE, &[])?;
        let combine = m
            .module
            .load_function("qem_idpc_combine")
            .map_err(|er| driver_error("load kernel qem_idpc_combine", er))?;
        Ok(IdpcWork {
            rows,
            cols,
            fwd,
            inv,
            d_gr: DevBuf::alloc(gpu.ctx(), n * 8, None, "iDPC g_row")?,
            d_gc: DevBuf::alloc(gpu.ctx(), n * 8, None, "iDPC g_col")?,
            d_a: DevBuf::alloc(gpu.ctx(), spec, None, "iDPC spectrum A")?,
            d_b: DevBuf::alloc(gpu.ctx(), spec, None, "iDPC spectrum B")?,
            combine,
        })
    }

    /// The two forward transforms of `d_gr`, `d_gc`, the combine and the inverse into `d_gr`,
    /// queued on `stream` (the phase of the field in `d_gr`, `d_gc` ends in `d_gr`).
    fn queue_solve(&self, stream: &CudaStream) -> Result<()> {
        let (rows, cols) = (self.rows, self.cols);
        let (n, half) = (rows * cols, cols / 2 + 1);
        for p in [&self.fwd, &self.inv] {
            // SAFETY: a live plan and this context's stream.
            unsafe { cufft::set_stream(p.0, stream.cu_stream() as _) }
                .map_err(|er| fft_error("set stream", er))?;
        }
        // SAFETY: the plans are rows × cols D2Z/Z2D; inputs hold n f64, spectra rows·half
        // double2, all live until the caller's synchronize.
        unsafe {
            cufft::exec_d2z(
                self.fwd.0,
                self.d_gr.ptr() as *mut f64,
                self.d_a.ptr() as *mut cufft_sys::double2,
            )
            .map_err(|er| fft_error("D2Z g_row", er))?;
            cufft::exec_d2z(
                self.fwd.0,
                self.d_gc.ptr() as *mut f64,
                self.d_b.ptr() as *mut cufft_sys::double2,
            )
            .map_err(|er| fft_error("D2Z g_col", er))?;
        }
        let total = (rows * half) as u64;
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (pa, pb) = (self.d_a.ptr(), self.d_b.ptr());
        let (r32, c32, h32) = (rows as u32, cols as u32, half as u32);
        let scale = 1.0 / n as f64;
        let mut b = stream.launch_builder(&self.combine);
        b.arg(&pa)
            .arg(&pb)
            .arg(&r32)
            .arg(&c32)
            .arg(&h32)
            .arg(&scale);
        // SAFETY: matches `qem_idpc_combine(double2*, const double2*, u32, u32, u32, double)`;
        // both spectra hold rows·half double2, the grid-stride loop stays below that.
        unsafe { b.launch(cfg) }.map_err(|er| driver_error("launch iDPC combine", er))?;
        // SAFETY: inverse of the combined half spectrum into d_gr (n f64), live until the
        // caller's synchronize.
        unsafe {
            cufft::exec_z2d(
                self.inv.0,
                self.d_a.ptr() as *mut cufft_sys::double2,
                self.d_gr.ptr() as *mut f64,
            )
            .map_err(|er| fft_error("Z2D", er))?;
        }
        Ok(())
    }
}

/// Run `f` with the work area of a `rows × cols` grid (made, or kept from the last call of the
/// same grid) on the engine's GPU, bound to this thread.
fn with_work<R>(
    op: &str,
    rows: usize,
    cols: usize,
    f: impl FnOnce(&IdpcWork, &Gpu) -> Result<R>,
) -> Result<R> {
    require_cufft(op)?;
    let gpu = &engine()?.gpu;
    gpu.ctx()
        .bind_to_thread()
        .map_err(|err| driver_error("bind CUDA context", err))?;
    // Plans and buffers are kept for the last grid (making the two cuFFT plans costs more than
    // the transforms): a repeated iDPC of one scan pays only the copies and the transforms.
    let mut cache = IDPC_WORK
        .lock()
        .map_err(|_| Error::internal(op, "iDPC work area poisoned by an earlier panic"))?;
    if cache
        .as_ref()
        .is_none_or(|w| (w.rows, w.cols) != (rows, cols))
    {
        *cache = None; // free the old grid's buffers first
        *cache = Some(IdpcWork::new(rows, cols)?);
    }
    let Some(w) = cache.as_ref() else {
        return Err(Error::internal(op, "iDPC work area missing"));
    };
    f(w, gpu)
}

/// The periodic solve of a field already on the card: `fill(g_row, g_col)` queues the writes
/// of the `rows × cols` field into the work area's two buffers on the stream it is given,
/// then the solve is queued and `take(phase)` queues the reads of the phase (`rows × cols`
/// f64 in the buffer it is given); the host waits once, at the end.
pub(crate) fn solve_on_device(
    rows: usize,
    cols: usize,
    fill: impl FnOnce(&DevBuf, &DevBuf, &CudaStream) -> Result<()>,
    take: impl FnOnce(&DevBuf, &CudaStream) -> Result<()>,
) -> Result<()> {
    let op = "iDPC (cuFFT)";
    if rows == 0 || cols == 0 {
        return Err(Error::invalid(op, "empty grid")
            .with_expected("at least 1 x 1 positions")
            .with_found(format!("{rows} x {cols}")));
    }
    with_work(op, rows, cols, |w, gpu| {
        let stream = gpu.stream();
        queue_then_wait(stream, "synchronize iDPC", || {
            fill(&w.d_gr, &w.d_gc, stream)?;
            w.queue_solve(stream)?;
            take(&w.d_gr, stream)
        })
    })
}

/// `φ` with `∂φ/∂(scan step) ≈ (g_row, g_col)` on a periodic `rows × cols` grid (row-major),
/// zero mean — the GPU twin of the CPU's periodic solver (equal to rounding).
pub fn integrate_periodic(
    g_row: &[f64],
    g_col: &[f64],
    rows: usize,
    cols: usize,
) -> Result<Vec<f64>> {
    let op = "iDPC (cuFFT)";
    let n = rows * cols;
    if g_row.len() != n || g_col.len() != n || n == 0 {
        return Err(Error::invalid(op, "field size does not match the grid")
            .with_expected(format!("{rows} x {cols} = {n} values per component"))
            .with_found(format!("{} and {}", g_row.len(), g_col.len())));
    }
    with_work(op, rows, cols, |w, gpu| {
        let (d_gr, d_gc) = (&w.d_gr, &w.d_gc);
        let stream = gpu.stream();
        let bytes = n * 8;
        let mut phi = vec![0f64; n];
        // One pinned buffer for the two fields and the phase: the copies are queued with the
        // transforms and the host waits once (each synchronous copy is a driver round trip).
        let staged = with_staging(gpu.ctx(), 3 * bytes, |pin| {
            queue_then_wait(stream, "synchronize iDPC", || {
                par_copy(
                    &mut pin.as_mut_slice()[..bytes],
                    bytemuck::cast_slice(g_row),
                );
                par_copy(
                    &mut pin.as_mut_slice()[bytes..2 * bytes],
                    bytemuck::cast_slice(g_col),
                );
                pin.copy_range_to_device_async(0, d_gr, 0, bytes, stream)?;
                pin.copy_range_to_device_async(bytes, d_gc, 0, bytes, stream)?;
                w.queue_solve(stream)?;
                pin.copy_range_from_device_async(2 * bytes, d_gr, 0, bytes, stream)
            })?;
            par_copy(
                bytemuck::cast_slice_mut(&mut phi),
                &pin.as_slice()[2 * bytes..3 * bytes],
            );
            Ok(())
        });
        match staged {
            Some(r) => r?,
            None => {
                d_gr.write(0, bytemuck::cast_slice(g_row))?;
                d_gc.write(0, bytemuck::cast_slice(g_col))?;
                w.queue_solve(stream)?;
                stream
                    .synchronize()
                    .map_err(|er| driver_error("synchronize iDPC", er))?;
                d_gr.read(0, bytemuck::cast_slice_mut(&mut phi))?;
            }
        }
        Ok(phi)
    })
}
