//! Arbitrary bytes as an HDF5 file given to `qem_io::Source::open`: it must return, never panic.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("qem-fuzz-master-{}.h5", std::process::id()));
    if std::fs::write(&path, data).is_err() {
        return;
    }
    let _ = qem_io::Source::open(&path, &qem_io::OpenOptions::default());
    let _ = std::fs::remove_file(&path);
});
