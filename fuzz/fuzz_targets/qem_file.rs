//! Arbitrary bytes as a `.qem` file: opening, validating and reading every stream must never
//! panic, and an accepted file must keep every stream inside the Streams section.
//!
//! Mutated files almost always fail a CRC first, so each input is also tried with its checksums
//! and recorded length recomputed (`fix_checksums`): that lets the fuzzer reach the section-table,
//! padding, JSON and stream-index checks behind them.

#![no_main]

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use libfuzzer_sys::fuzz_target;
use qem_codec::qem_file::{crc32c, QemFile};

fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn le_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Rewrite the section CRCs, the table CRC, the file length and the header CRC (format 1.0
/// layout) wherever they are in bounds.
fn fix_checksums(data: &[u8]) -> Option<Vec<u8>> {
    if data.len() < 64 {
        return None;
    }
    let mut b = data.to_vec();
    let count = usize::try_from(le_u32(&b, 16)?).ok()?;
    let table = usize::try_from(le_u64(&b, 24)?).ok()?;
    let table_end = table.checked_add(count.checked_mul(32)?)?;
    if table_end > b.len() {
        return None;
    }
    for i in 0..count {
        let e = table + 32 * i;
        let off = usize::try_from(le_u64(&b, e + 8)?).ok()?;
        let len = usize::try_from(le_u64(&b, e + 16)?).ok()?;
        if let Some(sec) = off.checked_add(len).and_then(|end| b.get(off..end)) {
            let crc = crc32c(sec);
            b[e + 24..e + 28].copy_from_slice(&crc.to_le_bytes());
        }
    }
    let tcrc = crc32c(&b[table..table_end]);
    b[20..24].copy_from_slice(&tcrc.to_le_bytes());
    let len = b.len() as u64;
    b[32..40].copy_from_slice(&len.to_le_bytes());
    let hcrc = crc32c(&b[..60]);
    b[60..64].copy_from_slice(&hcrc.to_le_bytes());
    Some(b)
}

/// Read everything an accepted file offers, checking the index against the section bounds.
fn exercise(mut f: QemFile) {
    let _ = f.metadata().to_string();
    let _ = f.codec_tables().len();
    let n = f.n_streams();
    assert_eq!(f.index_raw().len(), 16 * n);
    let streams_len = f.streams_bytes().len() as u64;
    for i in 0..n {
        let e = f.stream_entry(i).expect("index entry in range");
        assert!(e.offset + u64::from(e.length) <= streams_len);
        let s = f.stream(i).expect("validated stream");
        assert_eq!(s.len(), e.length as usize);
    }
    assert!(f.stream(n).is_err());
    let _ = f.verify();
}

fuzz_target!(|data: &[u8]| {
    // In memory: full and lazy verification must agree on everything but the Streams checksum.
    let full = QemFile::from_bytes(data.to_vec());
    // Through the file system, as users open files.
    static N: AtomicU64 = AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!(
        "qem_fuzz-{}-{}.qem",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let written = std::fs::File::create(&path).and_then(|mut f| f.write_all(data));
    if written.is_ok() {
        let opened = QemFile::open(&path);
        assert_eq!(opened.is_ok(), full.is_ok());
        if let Ok(f) = opened {
            exercise(f);
        }
        if let Ok(mut lazy) = QemFile::open_lazy(&path) {
            let verified = lazy.verify().is_ok();
            assert_eq!(verified, full.is_ok());
            exercise(lazy);
        } else {
            assert!(full.is_err());
        }
    }
    let _ = std::fs::remove_file(&path);
    if let Ok(f) = full {
        exercise(f);
    }
    if let Some(fixed) = fix_checksums(data) {
        if let Ok(f) = QemFile::from_bytes(fixed) {
            exercise(f);
        }
    }
});
