//! Kernel module cache: embedded `.cu` sources compiled by NVRTC to a CUBIN for the present
//! device (`sm_{major}{minor}`), cached in memory and on disk.
//!
//! A CUBIN (not PTX) is loaded so that a newer NVRTC never produces PTX the driver cannot JIT.
//! The cache key hashes the source, the kernel name, the arch, the defines, the compile options
//! and the NVRTC version, so any change recompiles. The disk cache lives in
//! `$QUANTEM_GPU_KERNEL_CACHE`, else `$XDG_CACHE_HOME/quantem-gpu/kernels`, else
//! `~/.cache/quantem-gpu/kernels`; files are written atomically (temp file + rename) and a file
//! that fails to load is recompiled and replaced. Cache write failures are not errors (they are
//! reported in [`ModuleInfo::cache_note`]).
//!
//! Before all of that, [`load_module`] looks in the kernels shipped inside the library
//! ([`crate::shipped`], compiled at build time): a module found there is loaded without NVRTC
//! and without the disk. `QEM_KERNEL_LOG=path` appends one JSON line per module load (name,
//! defines, source, milliseconds) to `path`, so a run can show which modules were compiled.

use std::collections::HashMap;
use std::ffi::CString;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys, Ptx};
use qem_core::{Error, Result};
use serde::Serialize;

use crate::device::{driver_error, guard, nvrtc_present, nvrtc_version, Gpu};

/// Where a loaded module's CUBIN came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheSource {
    /// Shipped inside the library (compiled at build time, [`crate::shipped`]).
    Shipped,
    /// This process compiled it before.
    Memory,
    /// Read from the disk cache.
    Disk,
    /// Compiled now by NVRTC.
    Compiled,
}

/// How a module was obtained (for logs and JSON records).
#[derive(Debug, Clone, Serialize)]
pub struct ModuleInfo {
    /// Kernel source name, e.g. `"bslz4_decode.cu"`.
    pub name: String,
    /// Target, e.g. `"sm_90"`.
    pub arch: String,
    /// `NAME=VALUE` defines passed to NVRTC.
    pub defines: Vec<String>,
    /// Hex cache key.
    pub key: String,
    /// Where the CUBIN came from.
    pub source: CacheSource,
    /// Milliseconds spent compiling (0 unless `source == Compiled`).
    pub compile_ms: f64,
    /// Milliseconds to obtain the CUBIN and load it into the context, in all.
    pub total_ms: f64,
    /// CUBIN size in bytes.
    pub cubin_bytes: usize,
    /// The disk cache file, when there is a cache directory.
    pub cache_path: Option<PathBuf>,
    /// NVRTC's log (warnings) when compiled now.
    pub compile_log: String,
    /// Problems with the disk cache (not fatal), if any.
    pub cache_note: Option<String>,
}

/// A module loaded into a context, with how it was obtained.
#[derive(Debug, Clone)]
pub struct LoadedModule {
    pub(crate) module: Arc<CudaModule>,
    /// How the module was obtained.
    pub info: ModuleInfo,
}

impl LoadedModule {
    /// Kernel `name` of the module (for studies that launch kernels of their own).
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        self.module
            .load_function(name)
            .map_err(|e| driver_error(&format!("load kernel {name}"), e))
    }
}

/// The disk cache directory (see the module docs), if one can be named.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("QUANTEM_GPU_KERNEL_CACHE").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|p| !p.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })?;
    Some(base.join("quantem-gpu").join("kernels"))
}

/// The compile options for `arch` and `defines` (also part of the cache key).
pub fn compile_options(arch: &str, defines: &[(&str, &str)]) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "-default-device".to_string(),
        "-std=c++17".to_string(),
        "-lineinfo".to_string(),
    ];
    o.extend(
        defines
            .iter()
            .map(|(k, v)| format!("--define-macro={k}={v}")),
    );
    o
}

/// 64-bit FNV-1a (stable across processes and Rust versions, unlike `DefaultHasher`).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff; // part separator
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The cache key of a compile.
pub fn cache_key(
    name: &str,
    src: &str,
    arch: &str,
    defines: &[(&str, &str)],
    nvrtc: (i32, i32),
) -> String {
    let opts = compile_options(arch, defines).join(" ");
    let ver = format!("{}.{}", nvrtc.0, nvrtc.1);
    format!(
        "{:016x}",
        fnv1a(&[
            name.as_bytes(),
            src.as_bytes(),
            opts.as_bytes(),
            ver.as_bytes()
        ])
    )
}

fn c_chars_to_string(v: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = v
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compile `src` with NVRTC to a CUBIN for `arch` (no caching). Returns the CUBIN and NVRTC's
/// log. A compile error is an `Internal` error carrying the full NVRTC log.
pub fn compile_cubin(
    name: &str,
    src: &str,
    arch: &str,
    defines: &[(&str, &str)],
) -> Result<(Vec<u8>, String)> {
    nvrtc_present()?;
    let op = "compile kernel";
    let c_src = CString::new(src)
        .map_err(|_| Error::internal(op, format!("{name}: source contains a NUL byte")))?;
    let c_name = CString::new(name)
        .map_err(|_| Error::internal(op, format!("{name}: name contains a NUL byte")))?;
    let opts = compile_options(arch, defines);
    if opts.iter().any(|o| o.contains('\0')) {
        return Err(Error::invalid(op, "a define contains a NUL byte"));
    }
    guard("NVRTC", || {
        let prog = nvrtc_result::create_program(&c_src, Some(&c_name))
            .map_err(|e| Error::internal(op, format!("{name}: nvrtcCreateProgram failed: {e}")))?;
        // SAFETY: `prog` was just created and is destroyed below exactly once; the options
        // contain no NUL bytes (checked above), so compile_program's CString::new cannot fail.
        let compiled = unsafe { nvrtc_result::compile_program(prog, &opts) };
        // SAFETY: `prog` is a live program.
        let log = unsafe { nvrtc_result::get_program_log(prog) }
            .map(|l| c_chars_to_string(&l))
            .unwrap_or_default();
        let cubin = match compiled {
            Err(e) => Err(Error::internal(
                op,
                format!(
                    "NVRTC failed to compile {name} for {arch} ({e}), options {opts:?}; log:\n{log}"
                ),
            )),
            Ok(()) => {
                let mut size = 0usize;
                // SAFETY: `prog` compiled successfully; `size` is a valid out pointer.
                let r = unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) };
                match r.result() {
                    Err(e) => Err(Error::internal(
                        op,
                        format!("{name}: nvrtcGetCUBINSize: {e}"),
                    )),
                    Ok(()) => {
                        let mut buf = vec![0u8; size];
                        // SAFETY: `buf` holds exactly the `size` bytes NVRTC reported.
                        let r = unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()) };
                        r.result()
                            .map(|()| buf)
                            .map_err(|e| Error::internal(op, format!("{name}: nvrtcGetCUBIN: {e}")))
                    }
                }
            }
        };
        // SAFETY: `prog` is live and not used after this.
        let _ = unsafe { nvrtc_result::destroy_program(prog) };
        cubin.map(|c| (c, log))
    })
}

fn memory_cache() -> &'static Mutex<HashMap<String, Arc<Vec<u8>>>> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<Vec<u8>>>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

fn looks_like_cubin(b: &[u8]) -> bool {
    b.len() > 64 && b.starts_with(b"\x7fELF")
}

/// Load the shipped module for `name`/`src`/`defines`, if the pack has one for `gpu`'s
/// device and the driver loads it (else `None`, with the driver's refusal as a note).
fn load_shipped(
    gpu: &Gpu,
    name: &str,
    src: &str,
    defines: &[(&str, &str)],
    t0: Instant,
) -> (Option<LoadedModule>, Option<String>) {
    let arch = gpu.info().arch.clone();
    let Some(s) = crate::shipped::find(name, src, defines, &arch) else {
        return (None, None);
    };
    let bytes = s.image.len();
    let image = if s.ptx {
        Ptx::from_src(String::from_utf8_lossy(&s.image).into_owned())
    } else {
        Ptx::from_binary(s.image)
    };
    match gpu.ctx().load_module(image) {
        Err(e) => (
            None,
            Some(format!(
                "the shipped {} ({}) failed to load ({e}); compiled instead",
                s.target, s.key
            )),
        ),
        Ok(module) => (
            Some(LoadedModule {
                module,
                info: ModuleInfo {
                    name: name.to_string(),
                    arch,
                    defines: defines.iter().map(|(k, v)| format!("{k}={v}")).collect(),
                    key: s.key,
                    source: CacheSource::Shipped,
                    compile_ms: 0.0,
                    total_ms: t0.elapsed().as_secs_f64() * 1e3,
                    cubin_bytes: bytes,
                    cache_path: None,
                    compile_log: String::new(),
                    cache_note: Some(format!("shipped {}", s.target)),
                },
            }),
            None,
        ),
    }
}

/// Append `info` as one JSON line to `$QEM_KERNEL_LOG`, when set (errors are ignored: the log
/// is a measuring aid).
fn log_load(info: &ModuleInfo) {
    let Some(path) = std::env::var_os("QEM_KERNEL_LOG").filter(|p| !p.is_empty()) else {
        return;
    };
    let line = serde_json::json!({
        "name": info.name,
        "arch": info.arch,
        "defines": info.defines,
        "source": info.source,
        "compile_ms": info.compile_ms,
        "total_ms": info.total_ms,
        "bytes": info.cubin_bytes,
        "note": info.cache_note,
    });
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        use std::io::Write;
        let _ = writeln!(f, "{line}");
    }
}

/// Kernel `name` of the module built from `src` (file name `file`, no defines) on `gpu`, the
/// context bound to this thread first.
pub(crate) fn kernel(gpu: &Gpu, file: &str, src: &str, name: &str) -> Result<CudaFunction> {
    gpu.ctx()
        .bind_to_thread()
        .map_err(|e| driver_error("bind CUDA context", e))?;
    load_module(gpu, file, src, &[])?.function(name)
}

/// Load kernel source `name`/`src` for `gpu`'s device, from the shipped kernels, the memory
/// cache, the disk cache, or a fresh NVRTC compile (in that order).
pub fn load_module(
    gpu: &Gpu,
    name: &str,
    src: &str,
    defines: &[(&str, &str)],
) -> Result<LoadedModule> {
    let r = load_module_inner(gpu, name, src, defines);
    if let Ok(m) = &r {
        log_load(&m.info);
    }
    r
}

fn load_module_inner(
    gpu: &Gpu,
    name: &str,
    src: &str,
    defines: &[(&str, &str)],
) -> Result<LoadedModule> {
    let t0 = Instant::now();
    let (shipped, shipped_note) = load_shipped(gpu, name, src, defines, t0);
    if let Some(m) = shipped {
        return Ok(m);
    }
    let arch = gpu.info().arch.clone();
    let key = cache_key(name, src, &arch, defines, nvrtc_version()?);
    let stem = name.trim_end_matches(".cu");
    let cache_path = cache_dir().map(|d| d.join(format!("{stem}-{arch}-{key}.cubin")));
    let mut note = shipped_note;
    let mut compile_ms = 0.0;
    let mut compile_log = String::new();

    let cached = memory_cache()
        .lock()
        .ok()
        .and_then(|m| m.get(&key).cloned());
    let (cubin, mut source) = match cached {
        Some(c) => (c, CacheSource::Memory),
        None => {
            let from_disk = cache_path
                .as_ref()
                .and_then(|p| std::fs::read(p).ok())
                .filter(|b| looks_like_cubin(b));
            match from_disk {
                Some(b) => (Arc::new(b), CacheSource::Disk),
                None => {
                    let t = Instant::now();
                    let (c, log) = compile_cubin(name, src, &arch, defines)?;
                    compile_ms = t.elapsed().as_secs_f64() * 1e3;
                    compile_log = log;
                    (Arc::new(c), CacheSource::Compiled)
                }
            }
        }
    };
    let load = |bytes: &[u8]| {
        gpu.ctx()
            .load_module(Ptx::from_binary(bytes.to_vec()))
            .map_err(|e| driver_error(&format!("load module {name} ({arch})"), e))
    };
    let (module, cubin) = match load(&cubin) {
        Ok(m) => (m, cubin),
        Err(e) if source != CacheSource::Compiled => {
            // A stale or damaged cache entry: compile afresh.
            note = Some(format!("cached CUBIN failed to load ({e}); recompiled"));
            let t = Instant::now();
            let (c, log) = compile_cubin(name, src, &arch, defines)?;
            compile_ms = t.elapsed().as_secs_f64() * 1e3;
            compile_log = log;
            source = CacheSource::Compiled;
            (load(&c)?, Arc::new(c))
        }
        Err(e) => return Err(e),
    };
    if source == CacheSource::Compiled {
        if let Some(p) = &cache_path {
            if let Err(e) = write_atomically(p, &cubin) {
                note = Some(format!(
                    "could not write the disk cache {}: {e}",
                    p.display()
                ));
            }
        }
    }
    if source != CacheSource::Memory {
        if let Ok(mut m) = memory_cache().lock() {
            m.insert(key.clone(), cubin.clone());
        }
    }
    Ok(LoadedModule {
        module,
        info: ModuleInfo {
            name: name.to_string(),
            arch,
            defines: defines.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            key,
            source,
            compile_ms,
            total_ms: t0.elapsed().as_secs_f64() * 1e3,
            cubin_bytes: cubin.len(),
            cache_path,
            compile_log,
            cache_note: note,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_changes_with_every_input() {
        let k = cache_key("a.cu", "src", "sm_90", &[], (13, 0));
        assert_eq!(k.len(), 16);
        assert_eq!(k, cache_key("a.cu", "src", "sm_90", &[], (13, 0)));
        assert_ne!(k, cache_key("a.cu", "src2", "sm_90", &[], (13, 0)));
        assert_ne!(k, cache_key("a.cu", "src", "sm_89", &[], (13, 0)));
        assert_ne!(k, cache_key("a.cu", "src", "sm_90", &[("X", "1")], (13, 0)));
        assert_ne!(k, cache_key("a.cu", "src", "sm_90", &[], (13, 1)));
        assert_ne!(k, cache_key("b.cu", "src", "sm_90", &[], (13, 0)));
    }

    #[test]
    fn options_carry_arch_and_defines() {
        let o = compile_options("sm_90", &[("QEM_MAX_THREADS", "256")]);
        assert!(o.contains(&"--gpu-architecture=sm_90".to_string()));
        assert!(o.contains(&"--define-macro=QEM_MAX_THREADS=256".to_string()));
        assert!(o.contains(&"-lineinfo".to_string()));
    }

    /// Compiles the real kernel when NVRTC is on the loader path (it is not on the build
    /// machine by default; set LD_LIBRARY_PATH to an NVRTC to run it), else checks the error.
    #[test]
    fn bslz4_kernel_compiles_or_reports_unavailable() {
        match compile_cubin("bslz4_decode.cu", crate::bslz4::KERNEL_SOURCE, "sm_90", &[]) {
            Ok((cubin, _log)) => assert!(looks_like_cubin(&cubin)),
            Err(e) => assert_eq!(e.kind, qem_core::ErrorKind::BackendUnavailable, "{e}"),
        }
    }

    #[test]
    fn compile_errors_carry_the_log() {
        match compile_cubin("bad.cu", "this is not C++;", "sm_90", &[]) {
            Ok(_) => panic!("compiled garbage"),
            Err(e) if e.kind == qem_core::ErrorKind::BackendUnavailable => {}
            Err(e) => assert!(
                e.detail.contains("bad.cu") && e.detail.contains("log"),
                "{e}"
            ),
        }
    }
}
