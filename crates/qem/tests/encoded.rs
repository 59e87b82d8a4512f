//! The ENCODED representation on the CPU engine and `.qem` files, end to end: acquisitions
//! written by our Dectris writer, compared frame by frame against an independent naive
//! reference (mask, regions and u64 bin sums written here, not by the engine).
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic on setup failures

use qem::{
    load, read_qem, save, BackendRequest, DType, DenseArray, DtypeRequest, ErrorKind, LoadParams,
    NoProgress, QemReadParams, Region, Representation, Shape2, SourceArg,
};
use qem_codec::qem_file::{crc32c, QemFile, SectionKind};
use qem_io::writer::{write_acquisition, Calibration, WriteCompression, WriteLayout, WriteParams};
use std::path::{Path, PathBuf};

/// Deterministic counts: mostly 0 and small, some near 1000, a few in `top - 99 ..= top`
/// (`top >= 99`).
fn value(frame: u64, pixel: usize, top: u32) -> u32 {
    let mut x = frame
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((pixel as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9));
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 29;
    let r = (x % 1000) as u32;
    match r {
        0..=600 => 0,
        601..=950 => r % 7,
        951..=997 => r,
        _ => top - (x % 100) as u32,
    }
}

struct Written {
    master: PathBuf,
    data: Vec<u32>,
    scan: Shape2,
    det: Shape2,
    mask: Vec<u32>,
}

fn write(dir: &Path, scan: Shape2, det: Shape2, dtype: DType, top: u32) -> Written {
    let frame_len = det.len();
    let data: Vec<u32> = (0..scan.len() as u64)
        .flat_map(|f| (0..frame_len).map(move |p| value(f, p, top)))
        .collect();
    let mut mask = vec![0u32; frame_len];
    mask[frame_len / 3] = 1; // bad
    mask[frame_len / 2] = 1 << 31; // not bad
    mask[frame_len - 1] = 8; // bad
    let params = WriteParams {
        prefix: dir.join("scan"),
        scan_shape: scan,
        detector_shape: det,
        dtype,
        frames_per_file: 8,
        frames_per_chunk: 1,
        block_elems: 0,
        compression: WriteCompression::Bslz4,
        layout: WriteLayout::Shards,
        pixel_mask: Some(mask.clone()),
        calibration: Calibration::default(),
        skip_frames: Vec::new(),
        write_scan_shape: true,
    };
    let d = &data;
    let written = write_acquisition(&params, |f, out: &mut [u8]| {
        let frame = &d[f as usize * frame_len..(f as usize + 1) * frame_len];
        match dtype {
            DType::U16 => {
                for (o, v) in out.chunks_exact_mut(2).zip(frame) {
                    o.copy_from_slice(&(*v as u16).to_le_bytes());
                }
            }
            DType::U32 => {
                for (o, v) in out.chunks_exact_mut(4).zip(frame) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
            DType::U8 => {
                for (o, v) in out.iter_mut().zip(frame) {
                    *o = *v as u8;
                }
            }
        }
    })
    .expect("write acquisition");
    Written {
        master: written.master,
        data,
        scan,
        det,
        mask,
    }
}

/// Naive reference: mask (low 16 bits) → regions → bin (u64 sums, partial edges kept).
fn reference(w: &Written, scan_region: Region, det_region: Region, bin: usize) -> Vec<u64> {
    let rs = det_region.shape();
    let (orows, ocols) = (rs.rows.div_ceil(bin), rs.cols.div_ceil(bin));
    let mut out = Vec::new();
    for r in scan_region.row_start..scan_region.row_stop {
        for c in scan_region.col_start..scan_region.col_stop {
            let f = r * w.scan.cols + c;
            let mut frame = vec![0u64; orows * ocols];
            for i in det_region.row_start..det_region.row_stop {
                for j in det_region.col_start..det_region.col_stop {
                    let p = i * w.det.cols + j;
                    if w.mask[p] & 0xFFFF != 0 {
                        continue;
                    }
                    let o = ((i - det_region.row_start) / bin) * ocols
                        + (j - det_region.col_start) / bin;
                    frame[o] += w.data[f * w.det.len() + p] as u64;
                }
            }
            out.extend(frame);
        }
    }
    out
}

fn as_u64(a: &DenseArray) -> Vec<u64> {
    (0..a.len()).map(|i| a.get(i).unwrap_or(u64::MAX)).collect()
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
    let w = write(
        dir.path(),
        Shape2::new(5, 7),
        Shape2::new(13, 11),
        DType::U16,
        65535,
    );
    let want = reference(&w, w.scan.full(), w.det.full(), 1);
    let enc = load(SourceArg::Path(w.master.clone()), &encoded_cpu()).unwrap();
    let dense = load(SourceArg::Path(w.master.clone()), &dense_cpu()).unwrap();
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
    let default = load(
        SourceArg::Path(w.master.clone()),
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
    let w = write(
        dir.path(),
        Shape2::new(8, 6),
        Shape2::new(32, 32),
        DType::U16,
        200,
    );
    let enc = load(SourceArg::Path(w.master.clone()), &encoded_cpu()).unwrap();
    let dense_bytes = (8 * 6 * 32 * 32 * 2) as u64;
    assert!(
        enc.nbytes_resident() < dense_bytes,
        "{} >= {dense_bytes}",
        enc.nbytes_resident()
    );
    check_frames(&enc, &reference(&w, w.scan.full(), w.det.full(), 1));
}

#[test]
fn encoded_regions_det_bin_and_u8_match_reference() {
    let dir = tempfile::tempdir().unwrap();
    let w = write(
        dir.path(),
        Shape2::new(6, 5),
        Shape2::new(15, 13),
        DType::U16,
        2000,
    );
    for (sr, dr, bin) in [
        (Region::new(1, 4, 2, 5), Region::new(0, 15, 0, 13), 1),
        (Region::new(0, 6, 0, 5), Region::new(0, 15, 0, 13), 2),
        (Region::new(2, 3, 0, 5), Region::new(3, 14, 1, 12), 4),
        (Region::new(0, 6, 4, 5), Region::new(2, 9, 0, 13), 3),
    ] {
        let params = LoadParams {
            scan_region: Some(sr),
            detector_region: Some(dr),
            det_bin: bin,
            dtype: DtypeRequest::U16,
            ..encoded_cpu()
        };
        let ds = load(SourceArg::Path(w.master.clone()), &params).unwrap();
        assert_eq!(ds.representation(), Representation::Encoded);
        check_frames(&ds, &reference(&w, sr, dr, bin));
    }
    // u8 (saturating) results are held as u16 counts and come back as u8.
    let params = LoadParams {
        det_bin: 2,
        dtype: DtypeRequest::U8Saturating,
        ..encoded_cpu()
    };
    let ds = load(SourceArg::Path(w.master.clone()), &params).unwrap();
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
    let w = write(
        dir.path(),
        Shape2::new(2, 3),
        Shape2::new(8, 8),
        DType::U32,
        90_000,
    );
    let e = load(SourceArg::Path(w.master.clone()), &encoded_cpu()).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("65535"), "{e}");
    // Native u16 with det_bin widens to u32: refused too, with the same advice.
    let w16 = write(
        &dir.path().join("b"),
        Shape2::new(2, 3),
        Shape2::new(8, 8),
        DType::U16,
        100,
    );
    let params = LoadParams {
        det_bin: 2,
        ..encoded_cpu()
    };
    let e = load(SourceArg::Path(w16.master), &params).unwrap_err();
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
    let w = write(
        dir,
        Shape2::new(4, 6),
        Shape2::new(12, 10),
        DType::U16,
        65535,
    );
    let ds = load(SourceArg::Path(w.master.clone()), &encoded_cpu()).unwrap();
    let out = dir.join("scan.qem");
    let summary = save(&ds, &out, &NoProgress).unwrap();
    assert_eq!(summary.n_frames, 24);
    (w, out)
}

#[test]
fn qem_round_trip_equals_the_source() {
    let dir = tempfile::tempdir().unwrap();
    let (w, out) = make_qem(dir.path());
    let want = reference(&w, w.scan.full(), w.det.full(), 1);
    let back = load(SourceArg::Path(out.clone()), &dense_cpu()).unwrap();
    assert_eq!(back.representation(), Representation::Dense);
    check_frames(&back, &want);
    let enc = load(SourceArg::Path(out.clone()), &encoded_cpu()).unwrap();
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
    let again = load(SourceArg::Path(renamed), &encoded_cpu()).unwrap();
    check_frames(&again, &want);
    // The host frames for a GPU upload.
    let q = read_qem(&out, &QemReadParams::default()).unwrap();
    assert_eq!(q.frames.n_frames(), 24);
    assert_eq!(q.scan_shape, Shape2::new(4, 6));
    // A dense dataset saves too (encoded on the way), and reloads equal.
    let dense = load(SourceArg::Path(w.master.clone()), &dense_cpu()).unwrap();
    let out2 = dir.path().join("dense.qem");
    save(&dense, &out2, &NoProgress).unwrap();
    check_frames(&load(SourceArg::Path(out2), &encoded_cpu()).unwrap(), &want);
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
        let e = load(SourceArg::Path(out.clone()), &params).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    }
}

fn assert_names_file(e: &qem::Error, file: &Path) {
    assert_eq!(e.file.as_deref(), Some(file), "{e}");
}

#[test]
fn damaged_qem_files_are_typed_errors_naming_the_file_and_section() {
    let dir = tempfile::tempdir().unwrap();
    let (_, out) = make_qem(dir.path());
    let bytes = std::fs::read(&out).unwrap();
    let bad = dir.path().join("bad.qem");

    // Truncated.
    std::fs::write(&bad, &bytes[..bytes.len() - 100]).unwrap();
    let e = load(SourceArg::Path(bad.clone()), &encoded_cpu()).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Source, "{e}");
    assert_names_file(&e, &bad);
    assert!(e.to_string().contains("truncated"), "{e}");

    // One bit flipped inside the Streams section: a checksum (Decode) error.
    let f = QemFile::open(&out).unwrap();
    let streams = *f
        .sections()
        .iter()
        .find(|s| s.kind == SectionKind::Streams)
        .unwrap();
    let mut flipped = bytes.clone();
    flipped[streams.offset as usize + 300] ^= 0x10;
    std::fs::write(&bad, &flipped).unwrap();
    let e = load(SourceArg::Path(bad.clone()), &encoded_cpu()).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Decode, "{e}");
    assert_names_file(&e, &bad);
    assert!(e.to_string().contains("Streams"), "{e}");

    // One bit flipped in the header.
    let mut flipped = bytes.clone();
    flipped[17] ^= 0x01;
    std::fs::write(&bad, &flipped).unwrap();
    let e = load(SourceArg::Path(bad.clone()), &encoded_cpu()).unwrap_err();
    assert!(
        matches!(e.kind, ErrorKind::Source | ErrorKind::Decode),
        "{e}"
    );
    assert_names_file(&e, &bad);
    assert!(e.to_string().contains("header"), "{e}");

    // Another major version (with a valid header checksum).
    let mut v2 = bytes.clone();
    v2[8..10].copy_from_slice(&2u16.to_le_bytes());
    let crc = crc32c(&v2[..60]);
    v2[60..64].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&bad, &v2).unwrap();
    let e = load(SourceArg::Path(bad.clone()), &encoded_cpu()).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Source, "{e}");
    assert_names_file(&e, &bad);
    assert!(e.to_string().contains("version"), "{e}");

    // A .qem name without the magic.
    let mut wrong = bytes.clone();
    wrong[0] = b'X';
    std::fs::write(&bad, &wrong).unwrap();
    let e = load(SourceArg::Path(bad.clone()), &encoded_cpu()).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Source, "{e}");
    assert_names_file(&e, &bad);
}

#[test]
fn corrupt_stream_is_a_decode_error_naming_file_and_frame() {
    let dir = tempfile::tempdir().unwrap();
    let (_, out) = make_qem(dir.path());
    let f = QemFile::open(&out).unwrap();
    let streams = *f
        .sections()
        .iter()
        .find(|s| s.kind == SectionKind::Streams)
        .unwrap();
    let frame = 13;
    let entry = f.stream_entry(frame).unwrap();
    let mut bytes = std::fs::read(&out).unwrap();
    // Lane 0's final state (after the 16-byte v2 stream header) set below L = 65536.
    let at = (streams.offset + entry.offset) as usize + 16;
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
    let e = load(SourceArg::Path(bad.clone()), &dense_cpu()).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Decode, "{e}");
}
