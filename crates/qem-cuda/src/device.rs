//! Finding CUDA: driver and NVRTC libraries, device 0, and what it is (for provenance).
//!
//! cudarc loads `libcuda`/`libnvrtc` lazily and **panics** when a library or symbol is missing,
//! so every entry point here first checks that the libraries can be opened and also runs the
//! first calls under `catch_unwind`: the caller always gets a typed
//! [`ErrorKind::BackendUnavailable`](qem_core::ErrorKind) error, never a panic.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};
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
    /// NVRTC version `(major, minor)` when the device opened; `None` when NVRTC was not loaded
    /// because the shipped kernels cover this build (it loads with the first module outside
    /// the pack; [`DeviceInfo::nvrtc`] reports it from then on).
    pub nvrtc_version: Option<(i32, i32)>,
    /// Milliseconds it took to find the driver (and NVRTC, when it is needed) libraries.
    pub libraries_ms: f64,
    /// Milliseconds it took to load NVRTC and ask its version (0 when not loaded).
    pub nvrtc_ms: f64,
    /// Milliseconds of `cuInit` (the driver's start in this process).
    pub init_ms: f64,
    /// Milliseconds it took to create (retain) the device's primary context after `cuInit`.
    pub context_ms: f64,
    /// Milliseconds of the device queries and the stream after the context.
    pub query_ms: f64,
}

impl DeviceInfo {
    /// One line for logs and provenance, e.g.
    /// `NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB), CUDA driver 13.0, NVRTC 13.0`.
    pub fn summary(&self) -> String {
        let nvrtc = self.nvrtc();
        format!(
            "{} ({}, {} SMs, {:.1} GiB), CUDA driver {}.{}, {nvrtc}",
            self.name,
            self.arch,
            self.multiprocessors,
            self.total_mem_bytes as f64 / (1u64 << 30) as f64,
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10,
        )
    }

    /// `"NVRTC 13.0"` (when the device opened, or since: a module outside the shipped pack
    /// loads it later), or `"NVRTC not loaded (shipped kernels)"`.
    pub fn nvrtc(&self) -> String {
        nvrtc_label(self.nvrtc_version.or_else(|| NVRTC_LOADED.get().copied()))
    }
}

fn nvrtc_label(version: Option<(i32, i32)>) -> String {
    match version {
        Some((major, minor)) => format!("NVRTC {major}.{minor}"),
        None => "NVRTC not loaded (shipped kernels)".to_string(),
    }
}

/// NVRTC's version once this process has asked it ([`nvrtc_version`]): the [`DeviceInfo`] of a
/// device opened with shipped kernels was made before NVRTC loaded.
static NVRTC_LOADED: OnceLock<(i32, i32)> = OnceLock::new();

/// Turn a driver error into a typed error (`op` names what was attempted). A sticky fault
/// ([`is_sticky`]) is latched in [`LOST`] and reported as [`ErrorKind::DeviceLost`].
pub(crate) fn driver_error(op: &str, e: DriverError) -> Error {
    if is_sticky(e.0) {
        return LOST.note(op, &format!("{e}"));
    }
    let kind = if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        ErrorKind::MemoryBudget
    } else {
        ErrorKind::Internal
    };
    Error::new(kind, op.to_string(), format!("CUDA driver error: {e}"))
}

/// Driver results after which the context is unusable: every later call in the process fails
/// (CUDA's "sticky" errors, from a kernel's illegal access, trap or failed launch).
pub(crate) fn is_sticky(code: sys::CUresult) -> bool {
    use sys::CUresult as R;
    matches!(
        code,
        R::CUDA_ERROR_ILLEGAL_ADDRESS
            | R::CUDA_ERROR_LAUNCH_FAILED
            | R::CUDA_ERROR_MISALIGNED_ADDRESS
            | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | R::CUDA_ERROR_INVALID_PC
            | R::CUDA_ERROR_HARDWARE_STACK_ERROR
            | R::CUDA_ERROR_ASSERT
            | R::CUDA_ERROR_LAUNCH_TIMEOUT
            | R::CUDA_ERROR_ECC_UNCORRECTABLE
            | R::CUDA_ERROR_CONTEXT_IS_DESTROYED
    )
}

/// The first sticky fault of a context: where it happened and what the driver said. After it,
/// every entry point of the engine answers one [`ErrorKind::DeviceLost`] error naming it,
/// instead of a confusing later error, a hang, or a result computed from lost memory.
#[derive(Debug, Default)]
pub struct LostLatch {
    first: OnceLock<(String, String)>,
}

impl LostLatch {
    /// Record a sticky fault seen in `op` (only the first one is kept) and return the
    /// error for this call.
    pub fn note(&self, op: &str, driver: &str) -> Error {
        self.first
            .get_or_init(|| (op.to_string(), driver.to_string()));
        self.error(op)
            .unwrap_or_else(|| Error::internal(op, driver.to_string()))
    }

    /// The `DeviceLost` error for a call to `op`, if a fault was recorded.
    pub fn error(&self, op: &str) -> Option<Error> {
        self.first.get().map(|(first_op, driver)| {
            Error::new(
                ErrorKind::DeviceLost,
                op.to_string(),
                format!(
                    "the GPU context is lost: the first fault was {driver} in `{first_op}`; \
                     everything resident on the GPU is gone, and every CUDA call in this process \
                     will fail — restart the process (the CPU backend still works)"
                ),
            )
        })
    }

    /// `Ok` while no fault has been recorded, else the `DeviceLost` error for `op`.
    pub fn check(&self, op: &str) -> Result<()> {
        match self.error(op) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// This process's latch (one context: device 0's primary context).
pub(crate) static LOST: LostLatch = LostLatch {
    first: OnceLock::new(),
};

/// `Ok` while the process's CUDA context is usable, else the `DeviceLost` error for `op`.
pub fn check_alive(op: &str) -> Result<()> {
    LOST.check(op)
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
    // With shipped kernels NVRTC is needed only for modules outside the pack (their load
    // reports a missing NVRTC then), so it is not even opened here: dlopen of the ~100 MB
    // library is part of a fresh process's first load.
    // SAFETY: as above, for libnvrtc.
    if !crate::shipped::available() && !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
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
        let _ = NVRTC_LOADED.set((major, minor));
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
        let t = Instant::now();
        libraries_present()?;
        let libraries_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let nvrtc_version = if crate::shipped::available() {
            None
        } else {
            Some(nvrtc_version()?)
        };
        let nvrtc_ms = t.elapsed().as_secs_f64() * 1e3;
        guard("open device", || {
            let unavailable = |what: &str, e: DriverError| {
                Error::backend_unavailable("cuda", format!("{what} failed: {e}"))
            };
            // cuInit apart from the context, so the provenance tells the two first-use costs
            // apart (CudaContext::new calls it again, then a no-op).
            let t = Instant::now();
            cudarc::driver::result::init().map_err(|e| unavailable("cuInit", e))?;
            let init_ms = t.elapsed().as_secs_f64() * 1e3;
            let t = Instant::now();
            let ctx = CudaContext::new(ordinal)
                .map_err(|e| unavailable(&format!("creating a context on device {ordinal}"), e))?;
            let context_ms = t.elapsed().as_secs_f64() * 1e3;
            let t = Instant::now();
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
                libraries_ms,
                nvrtc_ms,
                init_ms,
                context_ms,
                query_ms: t.elapsed().as_secs_f64() * 1e3,
            };
            Ok(Gpu { ctx, stream, info })
        })
    }

    /// What the device is.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The cudarc context (for this crate's kernel wrappers and qem-bench's check binaries;
    /// crates above `qem-cuda` never name cudarc types).
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
    fn a_sticky_fault_is_latched_and_named_by_every_later_call() {
        let latch = LostLatch::default();
        assert!(latch.check("load").is_ok());
        let e = latch.note("launch products (encoded)", "CUDA_ERROR_ILLEGAL_ADDRESS");
        assert_eq!(e.kind, ErrorKind::DeviceLost, "{e}");
        // A second fault does not replace the first.
        let _ = latch.note("synchronize", "CUDA_ERROR_LAUNCH_FAILED");
        let later = latch.check("detector bf").unwrap_err();
        assert_eq!(later.kind, ErrorKind::DeviceLost);
        assert_eq!(later.op, "detector bf");
        let msg = later.to_string();
        assert!(msg.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{msg}");
        assert!(msg.contains("launch products (encoded)"), "{msg}");
        assert!(!msg.contains("LAUNCH_FAILED"), "{msg}");
        assert_eq!(later.kind.exit_code(), 4);
    }

    #[test]
    fn the_nvrtc_label_names_a_version_or_the_shipped_kernels() {
        assert_eq!(nvrtc_label(Some((13, 0))), "NVRTC 13.0");
        assert_eq!(nvrtc_label(Some((12, 8))), "NVRTC 12.8");
        assert_eq!(nvrtc_label(None), "NVRTC not loaded (shipped kernels)");
    }

    /// A version asked after the device opened is remembered for `DeviceInfo::nvrtc` (here
    /// only when this machine has NVRTC; the CI machine may not).
    #[test]
    fn a_late_nvrtc_version_is_remembered() {
        if let Ok(v) = nvrtc_version() {
            assert_eq!(NVRTC_LOADED.get().copied(), Some(v));
        } else {
            assert!(nvrtc_present().is_err());
        }
    }

    #[test]
    fn only_context_killing_results_are_sticky() {
        use sys::CUresult as R;
        assert!(is_sticky(R::CUDA_ERROR_ILLEGAL_ADDRESS));
        assert!(is_sticky(R::CUDA_ERROR_LAUNCH_FAILED));
        assert!(!is_sticky(R::CUDA_ERROR_OUT_OF_MEMORY));
        assert!(!is_sticky(R::CUDA_ERROR_INVALID_VALUE));
        assert!(!is_sticky(R::CUDA_SUCCESS));
    }

    #[test]
    fn guard_turns_panics_into_errors() {
        let r: Result<()> = guard("test", || panic!("boom"));
        let e = r.unwrap_err();
        assert_eq!(e.kind, ErrorKind::BackendUnavailable);
        assert!(e.detail.contains("boom"));
    }
}
