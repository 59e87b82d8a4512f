//! Arbitrary bytes as an HDF5 file given to `qem_io::Source::open`: it must return, never panic.
//!
//! Every input goes to a fresh path. `Source::open` keeps an in-process index cache keyed by
//! path and served while the file's size and mtime are unchanged; mtime has jiffy granularity,
//! so rewriting one path would let a same-sized mutant be answered from the cache of an earlier
//! input without being parsed at all.
//!
//! HDF5 is C code that trusts sizes read from the file: with the sanitizer's defaults a corrupt
//! length makes `malloc` of terabytes abort the run (`allocation-size-too-big`), where a normal
//! build gets NULL and HDF5 returns an error, and a few of its error paths leak small strings.
//! Both are HDF5's (see fuzz/regressions/master_file/README.md), so this target lets `malloc`
//! return NULL and suppresses leaks allocated in HDF5's C sources; leaks of memory allocated by
//! Rust code (qem-io, the hdf5-metno bindings) are still reported.

#![no_main]

use std::sync::atomic::{AtomicU64, Ordering};

use libfuzzer_sys::fuzz_target;

/// Read by AddressSanitizer at start-up; `ASAN_OPTIONS` still overrides it.
#[no_mangle]
pub extern "C" fn __asan_default_options() -> *const std::ffi::c_char {
    c"allocator_may_return_null=1".as_ptr()
}

/// Read by LeakSanitizer at start-up: leaks allocated by HDF5's C sources (the `hdf5-metno-src`
/// crate) are HDF5's own.
#[no_mangle]
pub extern "C" fn __lsan_default_suppressions() -> *const std::ffi::c_char {
    c"leak:hdf5-metno-src\n".as_ptr()
}

fuzz_target!(|data: &[u8]| {
    static N: AtomicU64 = AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!(
        "qem-fuzz-master-{}-{}.h5",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    if std::fs::write(&path, data).is_err() {
        return;
    }
    let _ = qem_io::Source::open(&path, &qem_io::OpenOptions::default());
    let _ = std::fs::remove_file(&path);
});
