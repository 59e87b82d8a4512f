//! Finding CUDA: driver and NVRTC libraries, device 0, and what it is (for provenance).
//!
//! cudarc loads `libcuda`/`libnvrtc` lazily and **panics** when a library or symbol is missing,
//! so every entry point here first checks that the libraries can be opened and also runs the
//! first calls under `catch_unwind`: the caller always gets a typed
//! [`ErrorKind::BackendUnavailable`](qem_core::ErrorKind) error, never a panic.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream, DriverError};
use qem_core::{Error, ErrorKind, Result};
use serde::Serialize;

/// What the device and its software stack are (serialisable for provenance and JSON records).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DeviceInfo {
    /// Device ordinal (0).
    pub ordinal: usize,
    /// Device name as the driver reports it, e.g. `"NVIDIA H200"`.
    pub name: String,
    /// Compute capability `(major, minor)`, e.g. `(9, 0)`.
    pub compute_capability: (i32, i32),
    /// The CUBIN target the kernels are compiled for, e.g. `"sm_90"`.
    pub arch: String,
    /// Total device memory in bytes.
    pub total_mem_bytes: u64,
    /// Free device memory in bytes when probed.
    pub free_mem_bytes: u64,
    /// Number of streaming multiprocessors.
    pub multiprocessors: i32,
    /// Largest dynamic shared memory one CTA may opt in to, in bytes.
    pub max_shared_per_block_optin: i32,
    /// Shared memory per multiprocessor, in bytes.
    pub max_shared_per_sm: i32,
    /// L2 cache size in bytes.
    pub l2_bytes: i32,
    /// CUDA version the driver supports (`cuDriverGetVersion`), e.g. 13000.
    pub driver_version: i32,
    /// NVRTC version `(major, minor)`.
    pub nvrtc_version: (i32, i32),
    /// Milliseconds it took to create the context (first driver use in the process).
    pub context_ms: f64,
}

impl DeviceInfo {
    /// One line for logs and provenance, e.g.
    /// `NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB), CUDA driver 13.0, NVRTC 13.0`.
    pub fn summary(&self) -> String {
        format!(
            "{} ({}, {} SMs, {:.1} GiB), CUDA driver {}.{}, NVRTC {}.{}",
            self.name,
            self.arch,
            self.multiprocessors,
            self.total_mem_bytes as f64 / (1u64 << 30) as f64,
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10,
            self.nvrtc_version.0,
            self.nvrtc_version.1
        )
    }
}

/// Turn a driver error into a typed error (`op` names what was attempted).
pub(crate) fn driver_error(op: &str, e: DriverError) -> Error {
    let kind = if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        ErrorKind::MemoryBudget
    } else {
        ErrorKind::Internal
    };
    Error::new(kind, op.to_string(), format!("CUDA driver error: {e}"))
}

/// Run `f`, turning a panic inside cudarc (a missing library or symbol) into a
/// `BackendUnavailable` error.
pub(crate) fn guard<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(Error::backend_unavailable(
                "cuda",
                format!("{what}: the CUDA library failed: {msg}"),
            ))
        }
    }
}

/// Check that `libnvrtc` can be loaded (without panicking); compiling needs no driver.
pub fn nvrtc_present() -> Result<()> {
    // SAFETY: `is_culib_present` only tries to dlopen the library names and drops the handle.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::backend_unavailable(
            "cuda",
            "libnvrtc not found: install the CUDA runtime compiler (libnvrtc.so.13 / .12) or add \
             its directory to LD_LIBRARY_PATH",
        ))
    }
}

/// Check that `libcuda` and `libnvrtc` can be loaded (without panicking).
pub fn libraries_present() -> Result<()> {
    // SAFETY: `is_culib_present` only tries to dlopen the library names and drops the handle.
    let cuda = unsafe { cudarc::driver::sys::is_culib_present() };
    if !cuda {
        return Err(Error::backend_unavailable(
            "cuda",
            "libcuda not found: no NVIDIA driver library (libcuda.so / libcuda.so.1) on the \
             loader path",
        ));
    }
    // SAFETY: as above, for libnvrtc.
    let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if !nvrtc {
        return Err(Error::backend_unavailable(
            "cuda",
            "libnvrtc not found: install the CUDA runtime compiler (libnvrtc.so.13 / .12) or add \
             its directory to LD_LIBRARY_PATH",
        ));
    }
    Ok(())
}

/// NVRTC's version `(major, minor)` (requires only NVRTC).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    nvrtc_present()?;
    guard("nvrtcVersion", || {
        let (mut major, mut minor) = (0i32, 0i32);
        // SAFETY: both pointers are valid for the call; NVRTC writes two ints.
        let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        r.result()
            .map_err(|e| Error::backend_unavailable("cuda", format!("nvrtcVersion failed: {e}")))?;
        Ok((major, minor))
    })
}

/// An open CUDA device: its context, one stream, and what it is.
#[derive(Debug, Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
}

impl Gpu {
    /// Open device `ordinal` (checks the libraries first; never panics).
    pub fn new(ordinal: usize) -> Result<Gpu> {
        libraries_present()?;
        let nvrtc_version = nvrtc_version()?;
        guard("open device", || {
            let unavailable = |what: &str, e: DriverError| {
                Error::backend_unavailable("cuda", format!("{what} failed: {e}"))
            };
            let t = Instant::now();
            let ctx = CudaContext::new(ordinal)
                .map_err(|e| unavailable(&format!("creating a context on device {ordinal}"), e))?;
            let context_ms = t.elapsed().as_secs_f64() * 1e3;
            let name = ctx.name().map_err(|e| unavailable("cuDeviceGetName", e))?;
            let cc = ctx
                .compute_capability()
                .map_err(|e| unavailable("compute capability", e))?;
            let (free, total) = ctx
                .mem_get_info()
                .map_err(|e| unavailable("cuMemGetInfo", e))?;
            let attr = |a: sys::CUdevice_attribute| ctx.attribute(a).unwrap_or(-1);
            use sys::CUdevice_attribute as A;
            let mut driver_version = 0i32;
            // SAFETY: valid out pointer; the driver library is loaded (checked above).
            unsafe { sys::cuDriverGetVersion(&mut driver_version) }
                .result()
                .map_err(|e| unavailable("cuDriverGetVersion", e))?;
            let stream = ctx
                .new_stream()
                .map_err(|e| unavailable("creating a stream", e))?;
            let info = DeviceInfo {
                ordinal,
                name,
                compute_capability: cc,
                arch: format!("sm_{}{}", cc.0, cc.1),
                total_mem_bytes: total as u64,
                free_mem_bytes: free as u64,
                multiprocessors: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
                max_shared_per_block_optin: attr(
                    A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                ),
                max_shared_per_sm: attr(
                    A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                ),
                l2_bytes: attr(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
                driver_version,
                nvrtc_version,
                context_ms,
            };
            Ok(Gpu { ctx, stream, info })
        })
    }

    /// What the device is.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The cudarc context (for this crate's kernel wrappers and check binaries; crates above
    /// `qem-cuda` never name cudarc types).
    pub fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream all work of this handle is queued on (same audience as [`Gpu::ctx`]).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Wait for all work queued on the stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| driver_error("synchronize stream", e))
    }

    /// Free and total device memory now, in bytes.
    pub fn mem_info(&self) -> Result<(u64, u64)> {
        let (f, t) = self
            .ctx
            .mem_get_info()
            .map_err(|e| driver_error("cuMemGetInfo", e))?;
        Ok((f as u64, t as u64))
    }

    /// Run `f` (which queues work on this handle's stream) between two timing events and
    /// return the device milliseconds between them (waits for the end event).
    pub fn time_ms(&self, f: impl FnOnce() -> Result<()>) -> Result<f32> {
        let ev = || -> Result<CudaEvent> {
            self.ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| driver_error("create event", e))
        };
        let (start, end) = (ev()?, ev()?);
        start
            .record(&self.stream)
            .map_err(|e| driver_error("record event", e))?;
        f()?;
        end.record(&self.stream)
            .map_err(|e| driver_error("record event", e))?;
        end.synchronize()
            .map_err(|e| driver_error("synchronize event", e))?;
        start
            .elapsed_ms(&end)
            .map_err(|e| driver_error("event elapsed time", e))
    }
}

/// Probe device 0: libraries, context, name, compute capability, memory, driver and NVRTC
/// versions. Returns a `BackendUnavailable` error (never panics) when CUDA cannot be used.
pub fn probe() -> Result<DeviceInfo> {
    Gpu::new(0).map(|g| g.info)
}

/// One line for provenance: the device summary, or why CUDA is unavailable.
pub fn describe() -> String {
    match probe() {
        Ok(info) => info.summary(),
        Err(e) => format!("cuda unavailable: {}", e.detail),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On this build machine there is no GPU: probing must give a typed error, not a panic.
    /// (On a GPU machine the probe succeeds and the info must be sane.)
    #[test]
    fn probe_is_typed_error_or_sane_info() {
        match probe() {
            Err(e) => {
                assert_eq!(e.kind, ErrorKind::BackendUnavailable, "{e}");
                assert!(e.detail.contains("cuda"), "{e}");
                assert!(describe().starts_with("cuda unavailable"));
            }
            Ok(info) => {
                assert!(!info.name.is_empty());
                assert!(info.arch.starts_with("sm_"));
                assert!(info.total_mem_bytes > 0);
            }
        }
    }

    #[test]
    fn guard_turns_panics_into_errors() {
        let r: Result<()> = guard("test", || panic!("boom"));
        let e = r.unwrap_err();
        assert_eq!(e.kind, ErrorKind::BackendUnavailable);
        assert!(e.detail.contains("boom"));
    }
}
