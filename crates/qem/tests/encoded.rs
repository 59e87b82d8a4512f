//! The ENCODED representation on the CPU engine and `.qem` files, end to end: acquisitions
//! written by our Dectris writer, compared frame by frame against an independent naive
//! reference (mask, regions and u64 bin sums written here, not by the engine).
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic on setup failures

mod common;

use common::{as_u64, load_path, mix, reference, reference_full, sparse_count, Dims, Written};
use qem::{
    load, read_qem, save, BackendRequest, DType, DenseArray, DtypeRequest, ErrorKind, LoadParams,
    NoProgress, QemReadParams, Region, Representation, Shape2, SourceArg,
};
use qem_codec::qem_file::{crc32c, QemFile, SectionKind};
use std::path::{Path, PathBuf};

/// Deterministic counts: mostly 0 and small, some near 1000, a few in `top - 99 ..= top`
/// (`top >= 99`).
fn value(frame: u64, pixel: usize, top: u32) -> u32 {
    sparse_count(mix(frame, pixel), 997, |x| top - (x % 100) as u32)
}

/// `scan × det` frames of [`value`] written as `dtype` into `dir`, with a mask of two bad pixels.
fn write(dir: &Path, scan: Dims, det: Dims, dtype: DType, top: u32) -> Written {
    common::write(dir, scan, det, dtype, move |f, p| value(f, p, top))
}

fn encoded_cpu() -> LoadParams {
    LoadParams {
        backend: BackendRequest::Cpu,
        representation: Some(Representation::Encoded),
        ..LoadParams::default()
    }
}

fn dense_cpu() -> LoadParams {
    LoadParams {
        backend: BackendRequest::Cpu,
        representation: Some(Representation::Dense),
        ..LoadParams::default()
    }
}

/// Every frame through `frame(r, c)` against the reference, and the whole array.
fn check_frames(ds: &qem::Dataset, want: &[u64]) {
    let [rows, cols, kr, kc] = ds.shape();
    let n = kr * kc;
    for r in 0..rows {
        for c in 0..cols {
            let i = r * cols + c;
            let f = ds.frame(r, c).expect("frame");
            assert_eq!(as_u64(&f), want[i * n..(i + 1) * n], "frame ({r}, {c})");
        }
    }
    assert_eq!(as_u64(&ds.to_host().expect("to_host")), want);
}

#[test]
fn encoded_load_equals_dense_load_and_reference_rectangular_with_bad_pixels() {
    let dir = tempfile::tempdir().unwrap();
    let w = write(dir.path(), (5, 7), (13, 11), DType::U16, 65535);
    let want = reference_full(&w);
    let enc = load_path(&w.master, &encoded_cpu()).unwrap();
    let dense = load_path(&w.master, &dense_cpu()).unwrap();
    assert_eq!(enc.representation(), Representation::Encoded);
    assert_eq!(dense.representation(), Representation::Dense);
    assert_eq!(enc.shape(), [5, 7, 13, 11]);
    assert_eq!(enc.dtype(), DType::U16);
    check_frames(&enc, &want);
    assert_eq!(
        enc.to_host().unwrap(),
        dense.to_host().unwrap(),
        "encoded == dense"
    );
    assert!(enc.nbytes_resident() > 0);
    let e = enc.dense().unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    let p = enc.provenance();
    assert_eq!(p.representation.as_deref(), Some("encoded"));
    let codec = p.codec.as_ref().expect("codec provenance");
    assert_eq!(codec.name, "rans-counts v2");
    assert_eq!(codec.encoded_bytes, enc.nbytes_resident());
    assert_eq!(codec.fit_frames, 35);
    assert!(codec.source_compressed_bytes.is_some());
    assert!(p.mask_policy.applied && p.mask_policy.bad_pixels == 2);
    // The default on the CPU stays DENSE.
    let default = load_path(
        &w.master,
        &LoadParams {
            backend: BackendRequest::Cpu,
            ..LoadParams::default()
        },
    )
    .unwrap();
    assert_eq!(default.representation(), Representation::Dense);
    assert_eq!(dense.provenance().representation.as_deref(), Some("dense"));
}

#[test]
fn encoded_is_smaller_than_dense_on_sparse_counts() {
    let dir = tempfile::tempdir().unwrap();
    let w = write(dir.path(), (8, 6), (32, 32), DType::U16, 200);
    let enc = load_path(&w.master, &encoded_cpu()).unwrap();
    let dense_bytes = (8 * 6 * 32 * 32 * 2) as u64;
    assert!(
        enc.nbytes_resident() < dense_bytes,
        "{} >= {dense_bytes}",
        enc.nbytes_resident()
    );
    check_frames(&enc, &reference_full(&w));
}

#[test]
fn encoded_regions_det_bin_and_u8_match_reference() {
    let dir = tempfile::tempdir().unwrap();
    let w = write(dir.path(), (6, 5), (15, 13), DType::U16, 2000);
    for (sr, dr, bin) in common::REGION_CASES {
        let params = LoadParams {
            scan_region: Some(sr),
            detector_region: Some(dr),
            det_bin: bin,
            dtype: DtypeRequest::U16,
            ..encoded_cpu()
        };
        let ds = load_path(&w.master, &params).unwrap();
        assert_eq!(ds.representation(), Representation::Encoded);
        check_frames(&ds, &reference(&w, sr, dr, bin));
    }
    // u8 (saturating) results are held as u16 counts and come back as u8.
    let params = LoadParams {
        det_bin: 2,
        dtype: DtypeRequest::U8Saturating,
        ..encoded_cpu()
    };
    let ds = load_path(&w.master, &params).unwrap();
    assert_eq!(ds.dtype(), DType::U8);
    assert!(matches!(ds.frame(0, 0).unwrap(), DenseArray::U8(_)));
    let want: Vec<u64> = reference(&w, w.scan.full(), w.det.full(), 2)
        .into_iter()
        .map(|v| v.min(255))
        .collect();
    check_frames(&ds, &want);
}

#[test]
fn u32_results_are_refused_when_encoded() {
    let dir = tempfile::tempdir().unwrap();
    let w = write(dir.path(), (2, 3), (8, 8), DType::U32, 90_000);
    let e = load_path(&w.master, &encoded_cpu()).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("65535"), "{e}");
    // Native u16 with det_bin widens to u32: refused too, with the same advice.
    let w16 = write(&dir.path().join("b"), (2, 3), (8, 8), DType::U16, 100);
    let params = LoadParams {
        det_bin: 2,
        ..encoded_cpu()
    };
    let e = load_path(&w16.master, &params).unwrap_err();
    assert!(e.to_string().contains("dtype='u16'"), "{e}");
}

#[test]
fn array_sources_encode_too() {
    let scan = Shape2::new(3, 4);
    let det = Shape2::new(9, 7);
    let data: Vec<u16> = (0..scan.len() * det.len())
        .map(|i| value(i as u64 / 63, i % 63, 65535) as u16)
        .collect();
    let ds = load(
        SourceArg::Array {
            data: DenseArray::U16(data.clone()),
            shape: vec![3, 4, 9, 7],
        },
        &encoded_cpu(),
    )
    .unwrap();
    assert_eq!(ds.representation(), Representation::Encoded);
    let want: Vec<u64> = data.iter().map(|&v| v as u64).collect();
    check_frames(&ds, &want);
}

fn make_qem(dir: &Path) -> (Written, PathBuf) {
    let w = write(dir, (4, 6), (12, 10), DType::U16, 65535);
    let ds = load_path(&w.master, &encoded_cpu()).unwrap();
    let out = dir.join("scan.qem");
    let summary = save(&ds, &out, &NoProgress).unwrap();
    assert_eq!(summary.n_frames, 24);
    (w, out)
}

#[test]
fn qem_round_trip_equals_the_source() {
    let dir = tempfile::tempdir().unwrap();
    let (w, out) = make_qem(dir.path());
    let want = reference_full(&w);
    let back = load_path(&out, &dense_cpu()).unwrap();
    assert_eq!(back.representation(), Representation::Dense);
    check_frames(&back, &want);
    let enc = load_path(&out, &encoded_cpu()).unwrap();
    assert_eq!(enc.representation(), Representation::Encoded);
    check_frames(&enc, &want);
    let p = enc.provenance();
    assert_eq!(p.source_kind, "qem");
    assert!(p.mask_policy.applied);
    let orig = p.converted_from.as_ref().expect("original provenance");
    assert!(orig.files[0].path.ends_with("scan_master.h5"));
    assert_eq!(enc.metadata().scan_shape, Some(Shape2::new(4, 6)));
    // Recognised by its magic, not its name.
    let renamed = dir.path().join("renamed.bin");
    std::fs::copy(&out, &renamed).unwrap();
    let again = load_path(&renamed, &encoded_cpu()).unwrap();
    check_frames(&again, &want);
    // The host frames for a GPU upload.
    let q = read_qem(&out, &QemReadParams::default()).unwrap();
    assert_eq!(q.frames.n_frames(), 24);
    assert_eq!(q.scan_shape, Shape2::new(4, 6));
    // A dense dataset saves too (encoded on the way), and reloads equal.
    let dense = load_path(&w.master, &dense_cpu()).unwrap();
    let out2 = dir.path().join("dense.qem");
    save(&dense, &out2, &NoProgress).unwrap();
    check_frames(&load_path(&out2, &encoded_cpu()).unwrap(), &want);
    // Options that would change the meaning of a .qem load are refused.
    for params in [
        LoadParams {
            scan_region: Some(Region::new(0, 1, 0, 1)),
            ..encoded_cpu()
        },
        LoadParams {
            det_bin: 2,
            ..encoded_cpu()
        },
        LoadParams {
            dtype: DtypeRequest::U32,
            ..encoded_cpu()
        },
    ] {
        let e = load_path(&out, &params).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    }
}

fn assert_names_file(e: &qem::Error, file: &Path) {
    assert_eq!(e.file.as_deref(), Some(file), "{e}");
}

/// Where the Streams section of a `.qem` file starts.
fn streams_offset(f: &QemFile) -> u64 {
    let streams = f.sections().iter().find(|s| s.kind == SectionKind::Streams);
    streams.unwrap().offset
}

#[test]
fn damaged_qem_files_are_typed_errors_naming_the_file_and_section() {
    let dir = tempfile::tempdir().unwrap();
    let (_, out) = make_qem(dir.path());
    let bytes = std::fs::read(&out).unwrap();
    let bad = dir.path().join("bad.qem");
    // `damaged` writes the bytes to `bad` and loads it: the error must name that file.
    let damaged = |content: &[u8]| -> qem::Error {
        std::fs::write(&bad, content).unwrap();
        let e = load_path(&bad, &encoded_cpu()).unwrap_err();
        assert_names_file(&e, &bad);
        e
    };

    // Truncated.
    let e = damaged(&bytes[..bytes.len() - 100]);
    assert_eq!(e.kind, ErrorKind::Source, "{e}");
    assert!(e.to_string().contains("truncated"), "{e}");

    // One bit flipped inside the Streams section: a checksum (Decode) error.
    let mut flipped = bytes.clone();
    flipped[streams_offset(&QemFile::open(&out).unwrap()) as usize + 300] ^= 0x10;
    let e = damaged(&flipped);
    assert_eq!(e.kind, ErrorKind::Decode, "{e}");
    assert!(e.to_string().contains("Streams"), "{e}");

    // One bit flipped in the header.
    let mut flipped = bytes.clone();
    flipped[17] ^= 0x01;
    let e = damaged(&flipped);
    assert!(
        matches!(e.kind, ErrorKind::Source | ErrorKind::Decode),
        "{e}"
    );
    assert!(e.to_string().contains("header"), "{e}");

    // Another major version (with a valid header checksum).
    let mut v2 = bytes.clone();
    v2[8..10].copy_from_slice(&2u16.to_le_bytes());
    let crc = crc32c(&v2[..60]);
    v2[60..64].copy_from_slice(&crc.to_le_bytes());
    let e = damaged(&v2);
    assert_eq!(e.kind, ErrorKind::Source, "{e}");
    assert!(e.to_string().contains("version"), "{e}");

    // A .qem name without the magic.
    let mut wrong = bytes.clone();
    wrong[0] = b'X';
    let e = damaged(&wrong);
    assert_eq!(e.kind, ErrorKind::Source, "{e}");
}

#[test]
fn corrupt_stream_is_a_decode_error_naming_file_and_frame() {
    let dir = tempfile::tempdir().unwrap();
    let (_, out) = make_qem(dir.path());
    let f = QemFile::open(&out).unwrap();
    let frame = 13;
    let entry = f.stream_entry(frame).unwrap();
    let mut bytes = std::fs::read(&out).unwrap();
    // Lane 0's final state (after the 16-byte v2 stream header) set below L = 65536.
    let at = (streams_offset(&f) + entry.offset) as usize + 16;
    bytes[at..at + 4].copy_from_slice(&7u32.to_le_bytes());
    let bad = dir.path().join("corrupt_stream.qem");
    std::fs::write(&bad, &bytes).unwrap();
    // Without the Streams checksum, the decoder's own checks catch it, naming file and frame.
    let q = read_qem(
        &bad,
        &QemReadParams {
            verify_streams: false,
        },
    )
    .unwrap();
    let mut out_frame = vec![0u16; 120];
    q.frames.decode_frame(frame - 1, &mut out_frame).unwrap();
    let e = q.frames.decode_frame(frame, &mut out_frame).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Decode, "{e}");
    assert_eq!(e.frame, Some(frame as u64));
    assert_names_file(&e, &bad);
    let e = q.frames.decode_all().unwrap_err();
    assert_eq!(e.frame, Some(frame as u64), "{e}");
    // A load checks the Streams checksum first.
    let e = load_path(&bad, &dense_cpu()).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Decode, "{e}");
}
