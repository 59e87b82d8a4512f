// A build script reports failure by panicking: cargo prints the message and stops the build.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]
//! Shipped kernels (feature `shipped-kernels`): compiles the modules listed in
//! `src/kernels/shipped.txt` with NVRTC to CUBIN for each of [`SASS`] and to PTX for [`PTX`],
//! LZ4-compresses them and writes `$OUT_DIR/shipped_pack.bin` plus its index
//! `$OUT_DIR/shipped_index.rs` (included by `src/shipped/mod.rs`). No GPU is needed: NVRTC only
//! compiles. NVRTC is taken from `$QEM_NVRTC` (the `libnvrtc.so.*` file or its folder, e.g. from
//! the PyPI package `nvidia-cuda-nvrtc`: `scripts/fetch_nvrtc.sh`). Without the feature, or
//! without `$QEM_NVRTC`, the pack is empty and every module is compiled at run time as before
//! (with `QEM_SHIP_KERNELS=require` a missing NVRTC fails the build instead). Compiles are
//! cached under `$OUT_DIR/cache` by key and target, so a rebuild recompiles only changed
//! sources; they run on all cores.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

include!("src/shipped/key.rs");

/// CUBIN targets (a CUBIN for `sm_XY` also runs on `sm_XZ`, Z > Y).
const SASS: &[u32] = &[80, 86, 89, 90, 100, 120];
/// PTX targets, JIT-compiled by the driver on devices newer than every CUBIN.
const PTX: &[u32] = &[120];
/// The options of a shipped compile besides the target and the defines (no `-lineinfo`: it
/// more than doubles a CUBIN; a profiling run can set `QEM_KERNELS=nvrtc`).
const OPTIONS: &[&str] = &["-default-device", "-std=c++17"];

type Prog = *mut c_void;

/// The NVRTC entry points the build uses.
struct Nvrtc {
    _lib: libloading::Library,
    create: unsafe extern "C" fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int,
    destroy: unsafe extern "C" fn(*mut Prog) -> c_int,
    log_size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
    log: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    cubin_size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
    cubin: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    ptx_size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
    ptx: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int,
}

/// Open `libnvrtc` at `path` (a file or a folder holding `libnvrtc.so*`). Its builtins library
/// is opened first by full path with `RTLD_GLOBAL`, so NVRTC finds it without
/// `LD_LIBRARY_PATH`.
fn open_nvrtc(path: &Path) -> Result<Nvrtc, String> {
    let (dir, file) = if path.is_dir() {
        let mut names: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| format!("{}: {e}", path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                n.starts_with("libnvrtc.so") && !n.contains("alt")
            })
            .collect();
        names.sort();
        let f = names
            .pop()
            .ok_or_else(|| format!("no libnvrtc.so* in {}", path.display()))?;
        (path.to_path_buf(), f)
    } else {
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        (dir, path.to_path_buf())
    };
    // SAFETY: loading NVRTC runs its initialisers, which have no preconditions; the builtins
    // library is kept open (leaked) for the life of the build script.
    unsafe {
        if let Ok(rd) = std::fs::read_dir(&dir) {
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.starts_with("libnvrtc-builtins.so") && !n.contains("alt") {
                    let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL;
                    if let Ok(l) = libloading::os::unix::Library::open(Some(e.path()), flags) {
                        std::mem::forget(l);
                    }
                }
            }
        }
        let lib =
            libloading::Library::new(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        macro_rules! sym {
            ($n:literal) => {
                *lib.get($n)
                    .map_err(|e| format!("{}: {e}", String::from_utf8_lossy($n)))?
            };
        }
        Ok(Nvrtc {
            create: sym!(b"nvrtcCreateProgram"),
            compile: sym!(b"nvrtcCompileProgram"),
            destroy: sym!(b"nvrtcDestroyProgram"),
            log_size: sym!(b"nvrtcGetProgramLogSize"),
            log: sym!(b"nvrtcGetProgramLog"),
            cubin_size: sym!(b"nvrtcGetCUBINSize"),
            cubin: sym!(b"nvrtcGetCUBIN"),
            ptx_size: sym!(b"nvrtcGetPTXSize"),
            ptx: sym!(b"nvrtcGetPTX"),
            version: sym!(b"nvrtcVersion"),
            _lib: lib,
        })
    }
}

impl Nvrtc {
    fn version(&self) -> (i32, i32) {
        let (mut a, mut b) = (0, 0);
        // SAFETY: two valid out pointers.
        unsafe { (self.version)(&mut a, &mut b) };
        (a, b)
    }

    /// Compile `src` for `target` (`sm_XY` → CUBIN, `compute_XY` → PTX).
    fn compile(
        &self,
        name: &str,
        src: &str,
        target: &str,
        opts: &[String],
    ) -> Result<Vec<u8>, String> {
        let c_src = CString::new(src).map_err(|e| e.to_string())?;
        let c_name = CString::new(name).map_err(|e| e.to_string())?;
        let c_opts: Vec<CString> = opts
            .iter()
            .map(|o| CString::new(o.as_str()))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let ptrs: Vec<*const c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();
        let ptx = target.starts_with("compute_");
        let mut prog: Prog = std::ptr::null_mut();
        // SAFETY: NVRTC's documented calling sequence on a program created here and destroyed
        // once at the end; every buffer is sized by the matching *Size call.
        unsafe {
            let r = (self.create)(
                &mut prog,
                c_src.as_ptr(),
                c_name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            if r != 0 {
                return Err(format!("nvrtcCreateProgram({name}) = {r}"));
            }
            let r = (self.compile)(prog, ptrs.len() as c_int, ptrs.as_ptr());
            let out = if r != 0 {
                let mut n = 0usize;
                (self.log_size)(prog, &mut n);
                let mut log = vec![0u8; n.max(1)];
                (self.log)(prog, log.as_mut_ptr().cast());
                Err(format!(
                    "NVRTC failed on {name} for {target} ({r}), options {opts:?}:\n{}",
                    String::from_utf8_lossy(&log)
                ))
            } else {
                let (size_fn, get_fn) = if ptx {
                    (self.ptx_size, self.ptx)
                } else {
                    (self.cubin_size, self.cubin)
                };
                let mut n = 0usize;
                let r1 = size_fn(prog, &mut n);
                let mut buf = vec![0u8; n];
                let r2 = get_fn(prog, buf.as_mut_ptr().cast());
                if r1 != 0 || r2 != 0 {
                    Err(format!(
                        "reading the output of {name} for {target}: {r1}/{r2}"
                    ))
                } else {
                    Ok(buf)
                }
            };
            (self.destroy)(&mut prog);
            out
        }
    }
}

/// One module of the manifest after expansion.
struct Module {
    name: String,
    src: String,
    defines: Vec<(String, String)>,
}

/// Expand `{a,b,c}` tokens into one define list per combination ([`expand_defines`]).
fn expand(tokens: &[&str]) -> Vec<Vec<(String, String)>> {
    expand_defines(tokens)
        .unwrap_or_else(|| panic!("shipped.txt: a define of {tokens:?} is not NAME=VALUE"))
}

/// The manifest's modules: `NAME SOURCES [DEFINE ...]`, SOURCES being `+`-joined files of
/// `src/kernels` that the wrapper concatenates with a newline between them.
fn manifest(dir: &Path) -> Vec<Module> {
    let text = std::fs::read_to_string(dir.join("shipped.txt")).expect("src/kernels/shipped.txt");
    let mut mods = Vec::new();
    for tok in manifest_tokens(&text) {
        assert!(tok.len() >= 2, "shipped.txt: `{tok:?}` needs NAME SOURCES");
        let src = tok[1]
            .split('+')
            .map(|f| std::fs::read_to_string(dir.join(f)).unwrap_or_else(|e| panic!("{f}: {e}")))
            .collect::<Vec<_>>()
            .join("\n");
        for defines in expand(&tok[2..]) {
            mods.push(Module {
                name: tok[0].to_string(),
                src: src.clone(),
                defines,
            });
        }
    }
    mods
}

fn write_empty(out: &Path, why: &str) {
    std::fs::write(out.join("shipped_pack.bin"), b"").expect("write pack");
    let index = format!(
        "/// Why the pack is empty.\npub const STATUS: &str = {why:?};\n/// NVRTC that compiled the pack.\npub const NVRTC: (i32, i32) = (0, 0);\n/// (key, target, offset, compressed bytes, raw bytes); target = SM number, PTX + 1000.\npub static ENTRIES: &[(u64, u32, u32, u32, u32)] = &[];\n"
    );
    std::fs::write(out.join("shipped_index.rs"), index).expect("write index");
}

fn main() {
    println!("cargo:rerun-if-changed=src/kernels");
    println!("cargo:rerun-if-changed=src/shipped/key.rs");
    println!("cargo:rerun-if-env-changed=QEM_NVRTC");
    println!("cargo:rerun-if-env-changed=QEM_SHIP_KERNELS");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    if std::env::var_os("CARGO_FEATURE_SHIPPED_KERNELS").is_none() {
        write_empty(&out, "built without the shipped-kernels feature");
        return;
    }
    let require = std::env::var("QEM_SHIP_KERNELS").is_ok_and(|v| v == "require");
    let nv = match std::env::var_os("QEM_NVRTC").filter(|p| !p.is_empty()) {
        None => Err("QEM_NVRTC is not set".to_string()),
        Some(p) => open_nvrtc(Path::new(&p)),
    };
    let nv = match nv {
        Ok(nv) => nv,
        Err(e) => {
            assert!(
                !require,
                "QEM_SHIP_KERNELS=require but NVRTC cannot be opened: {e}"
            );
            println!(
                "cargo:warning=qem-cuda: no kernels shipped ({e}); they are compiled at run time"
            );
            write_empty(&out, &format!("no NVRTC at build time: {e}"));
            return;
        }
    };
    let ver = nv.version();
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("manifest dir"))
        .join("src/kernels");
    let mods = manifest(&dir);
    let cache = out.join("cache");
    std::fs::create_dir_all(&cache).expect("cache dir");
    let targets: Vec<(u32, String)> = SASS
        .iter()
        .map(|&s| (s, format!("sm_{s}")))
        .chain(PTX.iter().map(|&s| (1000 + s, format!("compute_{s}"))))
        .collect();
    let jobs: Vec<(usize, usize)> = (0..mods.len())
        .flat_map(|m| (0..targets.len()).map(move |t| (m, t)))
        .collect();
    let results: Mutex<BTreeMap<(u64, u32), Vec<u8>>> = Mutex::new(BTreeMap::new());
    let errors: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let next = AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let j = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(m, t)) = jobs.get(j) else { break };
                let md = &mods[m];
                let (tid, target) = &targets[t];
                let defs: Vec<(&str, &str)> = md
                    .defines
                    .iter()
                    .map(|(a, b)| (a.as_str(), b.as_str()))
                    .collect();
                let key = shipped_key(&md.name, &md.src, &defs);
                let file = cache.join(format!("{key:016x}-{tid}-nvrtc{}.{}.bin", ver.0, ver.1));
                let bytes = match std::fs::read(&file) {
                    Ok(b) if !b.is_empty() => b,
                    _ => {
                        let mut opts = vec![format!("--gpu-architecture={target}")];
                        opts.extend(OPTIONS.iter().map(|o| o.to_string()));
                        opts.extend(
                            md.defines
                                .iter()
                                .map(|(k, v)| format!("--define-macro={k}={v}")),
                        );
                        match nv.compile(&md.name, &md.src, target, &opts) {
                            Ok(b) => {
                                let _ = std::fs::write(&file, &b);
                                b
                            }
                            Err(e) => {
                                errors.lock().expect("errors").push(e);
                                continue;
                            }
                        }
                    }
                };
                results.lock().expect("results").insert((key, *tid), bytes);
            });
        }
    });
    let errors = errors.into_inner().expect("errors");
    assert!(
        errors.is_empty(),
        "shipped kernels failed to compile:\n{}",
        errors.join("\n")
    );
    let mut pack = Vec::new();
    let mut index = String::new();
    let (mut raw_total, mut n) = (0usize, 0usize);
    for ((key, tid), raw) in results.into_inner().expect("results") {
        let z = lz4_flex::block::compress(&raw);
        let _ = writeln!(
            index,
            "    (0x{key:016x}, {tid}, {}, {}, {}),",
            pack.len(),
            z.len(),
            raw.len()
        );
        pack.extend_from_slice(&z);
        raw_total += raw.len();
        n += 1;
    }
    std::fs::write(out.join("shipped_pack.bin"), &pack).expect("write pack");
    let status = format!(
        "{n} entries ({} modules × {} targets), {raw_total} bytes of CUBIN/PTX in {} bytes (LZ4)",
        mods.len(),
        targets.len(),
        pack.len()
    );
    let head = format!(
        "/// What the pack holds.\npub const STATUS: &str = {status:?};\n/// NVRTC that compiled the pack.\npub const NVRTC: (i32, i32) = ({}, {});\n/// (key, target, offset, compressed bytes, raw bytes); target = SM number, PTX + 1000.\npub static ENTRIES: &[(u64, u32, u32, u32, u32)] = &[\n",
        ver.0, ver.1
    );
    std::fs::write(out.join("shipped_index.rs"), format!("{head}{index}];\n"))
        .expect("write index");
}
