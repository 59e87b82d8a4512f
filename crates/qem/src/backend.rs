//! Backend selection: which engine runs an operation.
//!
//! `auto` picks CUDA when it is usable (a context on the process's device and its kernels
//! load), else the CPU, and records which. An explicit `cuda` or
//! `mps` that is not usable is an error, never a CPU run.
//!
//! Device index. A process's CUDA engine lives on one device: ordinal 0 unless
//! [`select_cuda_device`] (Python: `io.load(..., device=k)`) chose another before its first
//! use. Several GPUs of one host are used by several processes (one Dask worker per GPU with
//! its own `CUDA_VISIBLE_DEVICES`, see docs/distributed.md).

use qem_core::{Error, Result};

/// What the caller asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BackendRequest {
    /// CUDA when usable, else CPU.
    #[default]
    Auto,
    /// The multi-core CPU reference engine.
    Cpu,
    /// The NVIDIA CUDA engine.
    Cuda,
    /// Apple Metal (not supported by this build).
    Mps,
}

qem_core::named_choice! {
    /// Lower-case name (`"auto"`, `"cpu"`, `"cuda"`, `"mps"`), what `from_str` reads back
    /// (which also takes `"gpu"` for CUDA and `"metal"` for MPS).
    BackendRequest, "resolve backend", "backend", {
        Auto => "auto",
        Cpu => "cpu",
        Cuda => "cuda" | "gpu",
        Mps => "mps" | "metal",
    }
}

/// A backend that can actually run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// The CPU engine.
    Cpu,
    /// The CUDA engine (the process's device, see [`select_cuda_device`]).
    Cuda,
}

impl Backend {
    /// Lower-case name (`"cpu"`, `"cuda"`).
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
        }
    }
}

display_by_name!(Backend);

/// What is known about one backend on this machine.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BackendInfo {
    /// `"cpu"`, `"cuda"` or `"mps"`.
    pub name: String,
    /// Whether it can run here.
    pub available: bool,
    /// Device description when available, else why not.
    pub detail: String,
}

/// Why CUDA cannot run here (the probe's reason), or `None` when it can. The probe runs once
/// per process (the CUDA engine keeps its context and compiled kernels).
pub fn cuda_unavailable_reason() -> Option<String> {
    qem_cuda::engine_info().err().map(|e| e.detail.clone())
}

/// One line describing the GPU (model, memory, driver/CUDA and NVRTC versions), or why CUDA is
/// not usable.
pub fn cuda_description() -> String {
    match qem_cuda::engine_info() {
        Ok(info) => info.summary(),
        Err(e) => format!("cuda unavailable: {}", e.detail),
    }
}

/// Total memory of the CUDA device in bytes, or `None` when CUDA is not usable.
pub fn cuda_total_memory() -> Option<u64> {
    qem_cuda::engine_info()
        .ok()
        .map(|info| info.total_mem_bytes)
}

/// Start the CUDA engine on a background thread when the environment variable
/// `QEM_WARM_START` is `1`, `true` or `yes` (any case); returns whether it did. The Python
/// extension calls it as it loads, so the context is created while numpy is imported
/// (docs/performance.md, "First use"). Off by default: a process that imports the package
/// without using CUDA would hold a context, the device is fixed before a `device=` argument
/// could choose another, and a process forked afterwards cannot use CUDA.
pub fn warm_start_if_asked() -> bool {
    let asked = std::env::var("QEM_WARM_START").is_ok_and(|v| {
        ["1", "true", "yes"]
            .iter()
            .any(|y| v.trim().eq_ignore_ascii_case(y))
    });
    if asked {
        qem_cuda::engine::warm_start();
    }
    asked
}

/// Wait for the engine start of [`warm_start_if_asked`] to finish (a no-op when none runs).
pub fn finish_warm_start() {
    qem_cuda::engine::finish_warm_start();
}

/// Why MPS cannot run here.
pub fn mps_unavailable_reason() -> String {
    format!(
        "Apple Metal (MPS) is not supported by quantem.gpu's Rust engine, and this platform is {}-{}",
        std::env::consts::OS,
        std::env::consts::ARCH
    )
}

/// One-line description of the CPU: model name and worker threads.
pub fn cpu_description() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!("{model} ({} threads)", rayon::current_num_threads())
}

/// Every backend this build knows, in preference order, with its availability.
pub fn available_backends() -> Vec<BackendInfo> {
    let cuda = qem_cuda::engine_info();
    vec![
        BackendInfo {
            name: "cuda".into(),
            available: cuda.is_ok(),
            detail: match cuda {
                Ok(info) => info.summary(),
                Err(e) => e.detail.clone(),
            },
        },
        BackendInfo {
            name: "mps".into(),
            available: false,
            detail: mps_unavailable_reason(),
        },
        BackendInfo {
            name: "cpu".into(),
            available: true,
            detail: cpu_description(),
        },
    ]
}

/// Make the CUDA context lost on purpose (`qem_cuda::fault::inject_fault`), for tests of how
/// a lost device is reported. Returns the error the fault produced.
#[doc(hidden)]
pub fn inject_cuda_fault() -> Result<()> {
    qem_cuda::fault::inject_fault()
}

/// How many CUDA devices this process sees, or why CUDA is not usable (`BackendUnavailable`).
pub fn cuda_device_count() -> Result<usize> {
    qem_cuda::engine::device_count()
}

/// Put this process's CUDA engine on device `ordinal` and check that it runs there.
///
/// Errors: `BackendUnavailable` when CUDA is not usable here (no driver, no device);
/// `InvalidArgument` for an ordinal past the device count, or another device than the one this
/// process's engine already uses (a process holds one device).
pub fn select_cuda_device(ordinal: usize) -> Result<()> {
    qem_cuda::engine::select_device(ordinal)?;
    let info = qem_cuda::engine_info()?;
    if info.ordinal != ordinal {
        return Err(Error::invalid(
            "select CUDA device",
            "this process's CUDA engine started on another device meanwhile",
        )
        .with_expected(format!("device {ordinal}"))
        .with_found(format!("device {}", info.ordinal)));
    }
    Ok(())
}

/// The backend request a load gets when the caller also names a CUDA `device`: the device is
/// selected ([`select_cuda_device`]) and `auto` becomes `cuda` (a device index asks for a GPU;
/// without one that is an error, never a CPU run). A device index with `cpu` or `mps` is an
/// `InvalidArgument` error; `None` leaves the request as it is.
pub fn request_with_device(
    request: BackendRequest,
    device: Option<usize>,
) -> Result<BackendRequest> {
    let Some(ordinal) = device else {
        return Ok(request);
    };
    match request {
        BackendRequest::Cpu | BackendRequest::Mps => Err(Error::invalid(
            "load",
            format!(
                "device={ordinal} selects a CUDA device, but backend \"{}\" has none",
                request.name()
            ),
        )
        .with_expected("device=None, or backend \"cuda\" / \"auto\" with a device index")
        .with_found(format!("backend \"{}\", device={ordinal}", request.name()))),
        BackendRequest::Auto | BackendRequest::Cuda => {
            select_cuda_device(ordinal)?;
            Ok(BackendRequest::Cuda)
        }
    }
}

/// Resolve a request to a usable backend, or a `BackendUnavailable` error with the reason.
pub fn resolve_backend(request: BackendRequest) -> Result<Backend> {
    match request {
        BackendRequest::Cpu => Ok(Backend::Cpu),
        BackendRequest::Auto => match qem_cuda::engine() {
            Ok(_) => Ok(Backend::Cuda),
            // A lost context is said, never papered over by a CPU run.
            Err(e) if e.kind == qem_core::ErrorKind::DeviceLost => Err(e),
            Err(_) => Ok(Backend::Cpu),
        },
        BackendRequest::Cuda => match qem_cuda::engine() {
            Ok(_) => Ok(Backend::Cuda),
            Err(e)
                if matches!(
                    e.kind,
                    qem_core::ErrorKind::BackendUnavailable | qem_core::ErrorKind::DeviceLost
                ) =>
            {
                Err(e)
            }
            Err(e) => Err(Error::backend_unavailable("cuda", e.to_string())),
        },
        BackendRequest::Mps => Err(Error::backend_unavailable("mps", mps_unavailable_reason())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use qem_core::ErrorKind;

    #[test]
    fn explicit_unusable_backends_are_errors_not_cpu_runs() {
        let cuda = resolve_backend(BackendRequest::Cuda);
        let cuda_usable = cuda_unavailable_reason().is_none();
        if cuda_usable {
            assert_eq!(cuda.ok(), Some(Backend::Cuda));
        } else {
            assert!(matches!(cuda, Err(ref e) if e.kind == ErrorKind::BackendUnavailable));
        }
        let mps = resolve_backend(BackendRequest::Mps);
        assert!(
            matches!(mps, Err(ref e) if e.kind == ErrorKind::BackendUnavailable
            && e.to_string().contains("Metal"))
        );
        assert_eq!(
            resolve_backend(BackendRequest::Auto).ok(),
            Some(if cuda_usable {
                Backend::Cuda
            } else {
                Backend::Cpu
            })
        );
        let listed = available_backends();
        let c = listed.iter().find(|b| b.name == "cuda").unwrap();
        assert_eq!(c.available, cuda_usable);
        assert!(!c.detail.is_empty());
        assert_eq!(Backend::Cuda.name(), "cuda");
    }

    #[test]
    fn device_index_is_checked() {
        let cpu = request_with_device(BackendRequest::Cpu, Some(0));
        assert!(
            matches!(cpu, Err(ref e) if e.kind == ErrorKind::InvalidArgument
            && e.to_string().contains("device=0"))
        );
        assert_eq!(
            request_with_device(BackendRequest::Auto, None).ok(),
            Some(BackendRequest::Auto)
        );
        match cuda_device_count() {
            Err(e) => {
                // No GPU here: a device index is refused as unavailable, never run on the CPU.
                assert_eq!(e.kind, ErrorKind::BackendUnavailable);
                let r = request_with_device(BackendRequest::Auto, Some(0));
                assert!(matches!(r, Err(ref e) if e.kind == ErrorKind::BackendUnavailable));
            }
            Ok(n) => {
                let r = request_with_device(BackendRequest::Cuda, Some(n + 3));
                assert!(
                    matches!(r, Err(ref e) if e.kind == ErrorKind::InvalidArgument
                    && e.to_string().contains("out of range"))
                );
            }
        }
    }

    #[test]
    fn parse_backend_names() {
        assert_eq!(
            "CUDA".parse::<BackendRequest>().ok(),
            Some(BackendRequest::Cuda)
        );
        assert!("tpu".parse::<BackendRequest>().is_err());
    }
}
