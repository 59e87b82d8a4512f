//! The `.qem` container: round trips, corruption (every truncation, every bit flip), versions,
//! index validation, atomic writes and concurrent readers.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use qem_codec::qem_file::{
    crc32c, Location, QemFile, QemFileError, QemWriter, SectionKind, FORMAT_MAJOR, MAGIC,
    SECTION_ALIGN, STREAM_ALIGN,
};
use serde_json::json;

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "qem_file_test-{}-{}-{name}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
    /// Names of entries in the directory, sorted.
    fn entries(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Deterministic pseudo-random bytes (xorshift64, bits 24..32 of each state).
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let step = |x: u64| {
        let x = x ^ (x << 13);
        let x = x ^ (x >> 7);
        x ^ (x << 17)
    };
    let first = step(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    std::iter::successors(Some(first), |&x| Some(step(x)))
        .take(n)
        .map(|x| (x >> 24) as u8)
        .collect()
}

fn meta() -> serde_json::Value {
    json!({
        "scan_shape": [3, 4],
        "detector_shape": [192, 192],
        "codec": "rans-counts",
        "provenance": {"source": "/data/scan_master.h5", "git": "abc123", "note": "µ-ünïcode"},
    })
}

/// Write a small file and return its bytes.
fn small_file(dir: &TempDir) -> (PathBuf, Vec<u8>) {
    let path = dir.path("small.qem");
    let mut w = QemWriter::create(&path).unwrap();
    w.metadata(json!({"a": 1}));
    w.codec_tables(vec![7u8, 8, 9]);
    w.stream(&[1, 2, 3, 4, 5]).unwrap();
    w.stream(&[]).unwrap();
    w.stream_tagged(&[0xAA; 19], 4).unwrap();
    w.finish().unwrap();
    let b = std::fs::read(&path).unwrap();
    (path, b)
}

fn assert_round_trip(streams: &[Vec<u8>], tags: &[u32]) {
    let dir = TempDir::new("rt");
    let path = dir.path("scan.qem");
    let tables = bytes(99, 1234);
    let mut w = QemWriter::create(&path).unwrap();
    w.metadata(meta()).codec_tables(tables.clone());
    for (s, &t) in streams.iter().zip(tags) {
        w.stream_tagged(s, t).unwrap();
    }
    let summary = w.finish().unwrap();
    assert_eq!(summary.n_streams, streams.len());
    assert_eq!(
        summary.file_bytes,
        std::fs::metadata(&path).unwrap().len(),
        "summary length is the file length"
    );
    assert_eq!(
        dir.entries(),
        vec!["scan.qem".to_string()],
        "no temp file left"
    );

    for lazy in [false, true] {
        let mut f = if lazy {
            QemFile::open_lazy(&path).unwrap()
        } else {
            QemFile::open(&path).unwrap()
        };
        assert_eq!(f.streams_verified(), !lazy);
        f.verify().unwrap();
        assert!(f.streams_verified());
        assert_eq!(f.version().major, FORMAT_MAJOR);
        assert_eq!(f.metadata(), &meta());
        assert_eq!(f.codec_tables(), &tables[..]);
        assert_eq!(f.n_streams(), streams.len());
        assert_eq!(f.index_raw().len(), 16 * streams.len());
        for s in f.sections() {
            assert_eq!(s.offset % SECTION_ALIGN, 0, "{s:?} aligned");
        }
        for (i, s) in streams.iter().enumerate() {
            assert_eq!(f.stream(i).unwrap(), &s[..], "stream {i}");
            let e = f.stream_entry(i).unwrap();
            assert_eq!(e.offset % STREAM_ALIGN, 0);
            assert_eq!(e.length as usize, s.len());
            assert_eq!(e.tag, tags[i]);
            // The raw index is the documented little-endian layout.
            let raw = &f.index_raw()[16 * i..16 * i + 16];
            assert_eq!(u64::from_le_bytes(raw[0..8].try_into().unwrap()), e.offset);
            assert_eq!(u32::from_le_bytes(raw[8..12].try_into().unwrap()), e.length);
            assert_eq!(u32::from_le_bytes(raw[12..16].try_into().unwrap()), e.tag);
            let start = e.offset as usize;
            assert_eq!(&f.streams_bytes()[start..start + s.len()], &s[..]);
        }
        assert!(matches!(
            f.stream(streams.len()),
            Err(QemFileError::StreamOutOfRange { index, n_streams }) if index == streams.len() && n_streams == streams.len()
        ));
    }
}

#[test]
fn round_trip_zero_streams() {
    assert_round_trip(&[], &[]);
}

#[test]
fn round_trip_one_stream() {
    assert_round_trip(&[bytes(1, 200)], &[1]);
}

#[test]
fn round_trip_one_empty_stream() {
    assert_round_trip(&[vec![]], &[0]);
}

#[test]
fn round_trip_10000_streams_of_varying_sizes() {
    let streams: Vec<Vec<u8>> = (0..10_000u64)
        .map(|i| {
            let len = match i % 7 {
                0 => 0,                       // empty streams
                1 => 1,                       // shorter than the alignment
                2 => 16,                      // exactly the alignment
                3 => 128 + (i % 97) as usize, // a typical sparse frame
                _ => (i * 31 % 700) as usize,
            };
            bytes(i, len)
        })
        .collect();
    let tags: Vec<u32> = (0..10_000u32).map(|i| i % 5).collect();
    assert_round_trip(&streams, &tags);
}

#[test]
fn streams_from_iterator_and_default_metadata() {
    let dir = TempDir::new("iter");
    let path = dir.path("x.qem");
    let mut w = QemWriter::create(&path).unwrap();
    let n = w
        .streams_from((0..5u64).map(|i| bytes(i, i as usize * 10)))
        .unwrap();
    assert_eq!(n, 5);
    w.finish().unwrap();
    let f = QemFile::open(&path).unwrap();
    assert_eq!(f.metadata(), &json!({}));
    assert_eq!(f.codec_tables(), &[] as &[u8]);
    assert_eq!(f.n_streams(), 5);
    assert_eq!(f.stream(3).unwrap(), &bytes(3, 30)[..]);
}

#[test]
fn documented_header_fields() {
    let dir = TempDir::new("hdr");
    let (_, b) = small_file(&dir);
    assert_eq!(&b[0..8], &MAGIC);
    assert_eq!(u16::from_le_bytes([b[8], b[9]]), 1);
    assert_eq!(u16::from_le_bytes([b[10], b[11]]), 0);
    assert_eq!(u32::from_le_bytes(b[16..20].try_into().unwrap()), 4);
    assert_eq!(
        u32::from_le_bytes(b[20..24].try_into().unwrap()),
        crc32c(&b[64..64 + 4 * 32])
    );
    assert_eq!(u64::from_le_bytes(b[24..32].try_into().unwrap()), 64);
    assert_eq!(
        u64::from_le_bytes(b[32..40].try_into().unwrap()),
        b.len() as u64
    );
    assert_eq!(
        u32::from_le_bytes(b[60..64].try_into().unwrap()),
        crc32c(&b[..60])
    );
    assert_eq!(b.len() % 64, 0);
}

#[test]
fn every_truncation_is_a_typed_error() {
    let dir = TempDir::new("trunc");
    let (_, b) = small_file(&dir);
    assert!(QemFile::from_bytes(b.clone()).is_ok());
    for len in 0..b.len() {
        match QemFile::from_bytes(b[..len].to_vec()) {
            Err(QemFileError::Truncated {
                needed, available, ..
            }) => {
                assert_eq!(available, len as u64);
                assert!(needed > available);
            }
            other => panic!("truncated to {len} of {}: {other:?}", b.len()),
        }
    }
    // And through the file system, for a few lengths.
    let p = dir.path("cut.qem");
    for len in [0, 1, 63, 64, 65, b.len() - 1] {
        std::fs::write(&p, &b[..len]).unwrap();
        assert!(matches!(
            QemFile::open(&p),
            Err(QemFileError::Truncated { .. })
        ));
    }
}

#[test]
fn every_single_bit_flip_is_rejected() {
    // Exhaustive over a small file: every bit is covered (header CRC, table CRC, section CRCs,
    // zero padding, recorded file length).
    let dir = TempDir::new("flip");
    let (_, b) = small_file(&dir);
    let mut n = 0;
    for byte in 0..b.len() {
        for bit in 0..8 {
            let mut c = b.clone();
            c[byte] ^= 1 << bit;
            match QemFile::from_bytes(c) {
                Err(
                    QemFileError::Checksum { .. }
                    | QemFileError::Malformed { .. }
                    | QemFileError::BadMagic { .. }
                    | QemFileError::Version { .. },
                ) => n += 1,
                other => panic!("bit {bit} of byte {byte} flipped: {other:?}"),
            }
        }
    }
    assert_eq!(n, b.len() * 8);
}

#[test]
fn bit_flip_in_streams_is_a_streams_checksum_error_and_lazy_open_defers_it() {
    let dir = TempDir::new("flip2");
    let (path, mut b) = small_file(&dir);
    let f = QemFile::open(&path).unwrap();
    let streams = f
        .sections()
        .iter()
        .find(|s| s.kind == SectionKind::Streams)
        .copied()
        .unwrap();
    b[streams.offset as usize + 2] ^= 0x10;
    std::fs::write(&path, &b).unwrap();
    assert!(matches!(
        QemFile::open(&path),
        Err(QemFileError::Checksum {
            location: Location::Section(SectionKind::Streams),
            ..
        })
    ));
    let mut lazy = QemFile::open_lazy(&path).unwrap();
    assert!(!lazy.streams_verified());
    assert!(matches!(
        lazy.verify(),
        Err(QemFileError::Checksum {
            location: Location::Section(SectionKind::Streams),
            ..
        })
    ));
}

#[test]
fn wrong_magic() {
    let dir = TempDir::new("magic");
    let (_, mut b) = small_file(&dir);
    b[0..8].copy_from_slice(b"\x89HDF\r\n\x1a\n");
    match QemFile::from_bytes(b) {
        Err(QemFileError::BadMagic { found }) => assert_eq!(&found, b"\x89HDF\r\n\x1a\n"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn newer_major_version_names_expected_and_found() {
    let dir = TempDir::new("major");
    let (_, mut b) = small_file(&dir);
    b[8..10].copy_from_slice(&2u16.to_le_bytes());
    let crc = crc32c(&b[..60]);
    b[60..64].copy_from_slice(&crc.to_le_bytes());
    let err = QemFile::from_bytes(b).unwrap_err();
    assert_eq!(
        err,
        QemFileError::Version {
            expected: 1,
            found: 2
        }
    );
    assert!(err.to_string().contains("version 2"), "{err}");
}

#[test]
fn unknown_required_flag_is_rejected_optional_flag_ignored() {
    let dir = TempDir::new("flags");
    let (_, b) = small_file(&dir);
    let with_flags = |flags: u32| {
        let mut c = b.clone();
        c[12..16].copy_from_slice(&flags.to_le_bytes());
        let crc = crc32c(&c[..60]);
        c[60..64].copy_from_slice(&crc.to_le_bytes());
        QemFile::from_bytes(c)
    };
    assert!(matches!(
        with_flags(1),
        Err(QemFileError::Malformed {
            location: Location::Header,
            ..
        })
    ));
    assert_eq!(with_flags(1 << 16).unwrap().flags(), 1 << 16);
}

// ---- An independent assembler of the documented layout, for files our writer never makes. ----

/// Build a file from `(kind id, bytes)` sections laid out in the given order.
fn assemble(minor: u16, sections: &[(u32, Vec<u8>)]) -> Vec<u8> {
    let align = |x: usize| x.div_ceil(64) * 64;
    let table_len = 32 * sections.len();
    let mut out = vec![0u8; align(64 + table_len)];
    let mut table = Vec::new();
    for (kind, data) in sections {
        let off = align(out.len());
        out.resize(off, 0);
        out.extend_from_slice(data);
        table.extend_from_slice(&kind.to_le_bytes());
        table.extend_from_slice(&0u32.to_le_bytes());
        table.extend_from_slice(&(off as u64).to_le_bytes());
        table.extend_from_slice(&(data.len() as u64).to_le_bytes());
        table.extend_from_slice(&crc32c(data).to_le_bytes());
        table.extend_from_slice(&0u32.to_le_bytes());
    }
    let len = align(out.len());
    out.resize(len, 0);
    out[64..64 + table_len].copy_from_slice(&table);
    out[0..8].copy_from_slice(&MAGIC);
    out[8..10].copy_from_slice(&1u16.to_le_bytes());
    out[10..12].copy_from_slice(&minor.to_le_bytes());
    out[16..20].copy_from_slice(&(sections.len() as u32).to_le_bytes());
    out[20..24].copy_from_slice(&crc32c(&table).to_le_bytes());
    out[24..32].copy_from_slice(&64u64.to_le_bytes());
    out[32..40].copy_from_slice(&(len as u64).to_le_bytes());
    let crc = crc32c(&out[..60]);
    out[60..64].copy_from_slice(&crc.to_le_bytes());
    out
}

/// `(offset, length, tag)` of one index entry.
type Entry = (u64, u32, u32);

fn index(entries: &[Entry]) -> Vec<u8> {
    let mut v = Vec::new();
    for &(o, l, t) in entries {
        v.extend_from_slice(&o.to_le_bytes());
        v.extend_from_slice(&l.to_le_bytes());
        v.extend_from_slice(&t.to_le_bytes());
    }
    v
}

fn with_index(entries: &[(u64, u32, u32)], streams: Vec<u8>) -> Vec<u8> {
    assemble(
        0,
        &[
            (1, b"{\"k\":[1,2]}".to_vec()),
            (2, vec![5; 10]),
            (3, index(entries)),
            (4, streams),
        ],
    )
}

#[test]
fn independent_assembler_agrees_with_the_reader() {
    let streams: Vec<u8> = (0..48u8).collect();
    let f =
        QemFile::from_bytes(with_index(&[(0, 5, 1), (16, 0, 0), (16, 32, 2)], streams)).unwrap();
    assert_eq!(f.metadata(), &json!({"k": [1, 2]}));
    assert_eq!(f.n_streams(), 3);
    assert_eq!(f.stream(0).unwrap(), &[0, 1, 2, 3, 4]);
    assert_eq!(f.stream(1).unwrap(), &[] as &[u8]);
    assert_eq!(f.stream(2).unwrap(), &(16..48u8).collect::<Vec<_>>()[..]);
}

#[test]
fn unknown_sections_from_same_or_newer_minor_are_skipped() {
    for minor in [0u16, 3, u16::MAX] {
        let b = assemble(
            minor,
            &[
                (4, vec![9; 40]),
                (77, b"future section".to_vec()),
                (3, index(&[(0, 40, 0)])),
                (1, b"{}".to_vec()),
                (2, vec![]),
                (0xFFFF_FFFF, vec![1; 100]),
            ],
        );
        let f = QemFile::from_bytes(b).unwrap();
        assert_eq!(f.version().minor, minor);
        assert_eq!(f.stream(0).unwrap(), &[9; 40]);
        let unknown: Vec<_> = f
            .sections()
            .iter()
            .filter_map(|s| match s.kind {
                SectionKind::Unknown(k) => Some(k),
                _ => None,
            })
            .collect();
        assert_eq!(unknown, vec![77, 0xFFFF_FFFF]);
    }
}

#[test]
fn index_entries_out_of_bounds_overlapping_or_misaligned_are_rejected() {
    let s = vec![0u8; 64];
    let bad: &[(&str, Vec<Entry>)] = &[
        ("past the end", vec![(48, 17, 0)]),
        ("far past the end", vec![(u64::MAX - 15, 100, 0)]),
        ("overlap", vec![(0, 20, 0), (16, 4, 0)]),
        ("not monotonic", vec![(32, 4, 0), (0, 4, 0)]),
        ("unaligned", vec![(8, 4, 0)]),
        ("huge length", vec![(0, u32::MAX, 0)]),
    ];
    for (what, entries) in bad {
        match QemFile::from_bytes(with_index(entries, s.clone())) {
            Err(QemFileError::Malformed {
                location: Location::Section(SectionKind::StreamIndex),
                ..
            }) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    // An index whose length is not a whole number of entries.
    let b = assemble(
        0,
        &[
            (1, b"1".to_vec()),
            (2, vec![]),
            (3, vec![0; 15]),
            (4, vec![]),
        ],
    );
    assert!(matches!(
        QemFile::from_bytes(b),
        Err(QemFileError::Malformed {
            location: Location::Section(SectionKind::StreamIndex),
            ..
        })
    ));
    // The edge that is allowed: a stream ending exactly at the section end.
    assert!(QemFile::from_bytes(with_index(&[(48, 16, 0)], s)).is_ok());
}

#[test]
fn structural_errors() {
    let ok = [
        (1u32, b"{}".to_vec()),
        (2, vec![]),
        (3, vec![]),
        (4, vec![]),
    ];
    assert!(QemFile::from_bytes(assemble(0, &ok)).is_ok());
    // Missing a required section.
    assert!(matches!(
        QemFile::from_bytes(assemble(0, &ok[..3])),
        Err(QemFileError::Malformed {
            location: Location::SectionTable,
            ..
        })
    ));
    // A known section twice.
    let mut dup = ok.to_vec();
    dup.push((2, vec![1]));
    assert!(matches!(
        QemFile::from_bytes(assemble(0, &dup)),
        Err(QemFileError::Malformed { .. })
    ));
    // Kind 0.
    let mut zero = ok.to_vec();
    zero.push((0, vec![]));
    assert!(QemFile::from_bytes(assemble(0, &zero)).is_err());
    // Metadata that is not JSON / not UTF-8.
    for m in [b"{".to_vec(), vec![b'"', 0xff, b'"']] {
        let mut v = ok.to_vec();
        v[0] = (1, m);
        assert!(matches!(
            QemFile::from_bytes(assemble(0, &v)),
            Err(QemFileError::Malformed {
                location: Location::Section(SectionKind::Metadata),
                ..
            })
        ));
    }
    // Trailing bytes after the recorded length.
    let mut t = assemble(0, &ok);
    t.push(0);
    assert!(matches!(
        QemFile::from_bytes(t),
        Err(QemFileError::Malformed {
            location: Location::File,
            ..
        })
    ));
    // Overlapping sections: point the second entry at the first section's offset.
    let mut o = assemble(
        0,
        &[(1, vec![b'1'; 100]), (2, vec![]), (3, vec![]), (4, vec![])],
    );
    let first_off = o[64 + 8..64 + 16].to_vec();
    o[64 + 32 + 8..64 + 32 + 16].copy_from_slice(&first_off);
    let tcrc = crc32c(&o[64..64 + 128]);
    o[20..24].copy_from_slice(&tcrc.to_le_bytes());
    let hcrc = crc32c(&o[..60]);
    o[60..64].copy_from_slice(&hcrc.to_le_bytes());
    assert!(matches!(
        QemFile::from_bytes(o),
        Err(QemFileError::Malformed { .. })
    ));
}

// ---- Atomic writes ----

fn no_temp_files(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .unwrap()
        .all(|e| !e.unwrap().file_name().to_string_lossy().contains(".tmp-"))
}

/// A writer for `a.qem` in a new temporary directory, one stream `[1, 2, 3]` written.
fn writing(tag: &str) -> (TempDir, PathBuf, QemWriter) {
    let dir = TempDir::new(tag);
    let path = dir.path("a.qem");
    let mut w = QemWriter::create(&path).unwrap();
    w.stream(&[1, 2, 3]).unwrap();
    (dir, path, w)
}

#[test]
fn temp_file_is_used_then_renamed() {
    let (dir, path, w) = writing("tmp");
    // While writing: only the temporary file exists, named after the target and the pid.
    let names = dir.entries();
    assert_eq!(names.len(), 1);
    assert!(
        names[0].starts_with(&format!("a.qem.tmp-{}", std::process::id())),
        "{names:?}"
    );
    assert!(!path.exists());
    w.finish().unwrap();
    assert_eq!(dir.entries(), vec!["a.qem".to_string()]);
}

#[test]
fn dropped_writer_leaves_nothing_and_keeps_the_old_file() {
    let (dir, path, w) = writing("drop");
    w.finish().unwrap();
    let before = std::fs::read(&path).unwrap();
    {
        let mut w = QemWriter::create(&path).unwrap();
        w.metadata(json!({"replaced": true}));
        w.stream(&[9; 1000]).unwrap();
        // dropped without finish
    }
    assert!(no_temp_files(&dir.0));
    assert_eq!(std::fs::read(&path).unwrap(), before, "old file untouched");
    // A finished writer replaces it.
    let mut w = QemWriter::create(&path).unwrap();
    w.metadata(json!({"replaced": true}));
    w.finish().unwrap();
    assert_eq!(
        QemFile::open(&path).unwrap().metadata(),
        &json!({"replaced": true})
    );
    assert!(no_temp_files(&dir.0));
}

#[test]
fn failing_finish_removes_the_temp_file() {
    let dir = TempDir::new("fail");
    // The target is a non-empty directory: the rename fails.
    let path = dir.path("busy.qem");
    std::fs::create_dir(&path).unwrap();
    std::fs::write(path.join("keep"), b"x").unwrap();
    let mut w = QemWriter::create(&path).unwrap();
    w.stream(&[1; 100]).unwrap();
    match w.finish() {
        Err(QemFileError::Io { op, path: p, .. }) => {
            assert!(op.contains("rename"), "{op}");
            assert!(p.to_string_lossy().contains(".tmp-"), "{}", p.display());
        }
        other => panic!("{other:?}"),
    }
    assert!(no_temp_files(&dir.0));
    assert!(path.join("keep").exists());
}

#[test]
fn io_errors_carry_the_path() {
    let dir = TempDir::new("io");
    let missing = dir.path("no/such/dir/x.qem");
    match QemWriter::create(&missing) {
        Err(QemFileError::Io { path, .. }) => assert!(path.starts_with(dir.path("no"))),
        other => panic!("{other:?}"),
    }
    let absent = dir.path("absent.qem");
    match QemFile::open(&absent) {
        Err(e @ QemFileError::Io { .. }) => {
            assert!(e.to_string().contains("absent.qem"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    assert!(dir.entries().is_empty());
}

#[test]
fn concurrent_readers() {
    let dir = TempDir::new("conc");
    let path = dir.path("c.qem");
    let streams: Vec<Vec<u8>> = (0..300u64).map(|i| bytes(i, (i % 50) as usize)).collect();
    let mut w = QemWriter::create(&path).unwrap();
    w.metadata(meta());
    w.streams_from(&streams).unwrap();
    w.finish().unwrap();
    std::thread::scope(|s| {
        for t in 0..8 {
            let (path, streams) = (&path, &streams);
            s.spawn(move || {
                for _ in 0..5 {
                    let f = if t % 2 == 0 {
                        QemFile::open(path).unwrap()
                    } else {
                        QemFile::open_lazy(path).unwrap()
                    };
                    assert_eq!(f.metadata(), &meta());
                    for (i, st) in streams.iter().enumerate() {
                        assert_eq!(f.stream(i).unwrap(), &st[..]);
                    }
                }
            });
        }
    });
    // One opened file shared by threads (QemFile is Sync).
    let f = QemFile::open(&path).unwrap();
    std::thread::scope(|s| {
        for t in 0..4usize {
            let (f, streams) = (&f, &streams);
            s.spawn(move || {
                for i in (t..streams.len()).step_by(4) {
                    assert_eq!(f.stream(i).unwrap(), &streams[i][..]);
                }
            });
        }
    });
}
