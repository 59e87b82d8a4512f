//! Arbitrary bytes as a Gatan `.dm4`/`.dm3`, Merlin `.mib` (processed and raw R64) or NumPy
//! `.npy` file: `qem_io::Source::open` must return, never panic, and when it opens the file,
//! reading every frame (host decoding included: byte swaps, float32 counts, raw unpacking) must
//! return too. The first byte picks the extension (recognition uses it for DM files); the rest
//! is the file. Each input goes to a fresh path (see master_file.rs for why).

#![no_main]

use std::sync::atomic::{AtomicU64, Ordering};

use libfuzzer_sys::fuzz_target;

const EXT: [&str; 4] = ["dm4", "dm3", "mib", "npy"];

fuzz_target!(|data: &[u8]| {
    let Some((&pick, file)) = data.split_first() else {
        return;
    };
    static N: AtomicU64 = AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!(
        "qem-fuzz-det-{}-{}.{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        EXT[usize::from(pick) % EXT.len()]
    ));
    if std::fs::write(&path, file).is_err() {
        return;
    }
    let opts = qem_io::OpenOptions {
        float_scale: Some(qem_io::FloatScale(1.0)),
        ..qem_io::OpenOptions::default()
    };
    if let Ok(src) = qem_io::Source::open(&path, &opts) {
        // Frames come from the file, so their total is bounded by its size; stop early anyway
        // on a record claiming more than the input could hold.
        let mut buf = Vec::new();
        for rec in src.chunks.iter().take(4096) {
            if src.read_chunk(rec, &mut buf).is_err() {
                break;
            }
        }
    }
    let _ = std::fs::remove_file(&path);
});
