//! `Source::open` on the formats of `qem_io::formats`: files written by `npyz` (the NumPy
//! format's Rust writer) and raw binaries in their documented layout, read back byte for byte
//! through `read_chunk`, and malformed ones with their typed errors.

use npyz::WriterBuilder;
use qem_core::{ErrorKind, Shape2};
use qem_io::{FloatScale, Format, OpenOptions, RawLayout, Source, SourceKind};
use std::path::Path;

fn frames_of(src: &Source) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = Vec::new();
    for rec in &src.chunks {
        src.read_chunk(rec, &mut buf)
            .unwrap_or_else(|e| panic!("{e}"));
        out.extend_from_slice(&buf);
    }
    out
}

fn write_npy<T: npyz::Serialize + npyz::AutoSerialize + Copy>(
    path: &Path,
    shape: &[u64],
    data: &[T],
    descr: Option<&str>,
) {
    let f = std::fs::File::create(path).unwrap_or_else(|e| panic!("{e}"));
    let b = npyz::WriteOptions::new().shape(shape).writer(f);
    let b = match descr {
        Some(d) => b.dtype(npyz::DType::Plain(
            d.parse().unwrap_or_else(|e| panic!("{e:?}")),
        )),
        None => b.default_dtype(),
    };
    let mut w = b.begin_nd().unwrap_or_else(|e| panic!("{e}"));
    w.extend(data.iter().copied())
        .unwrap_or_else(|e| panic!("{e}"));
    w.finish().unwrap_or_else(|e| panic!("{e}"));
}

fn counts(n: usize) -> Vec<u16> {
    (0..n).map(|i| ((i * 7919) % 4099) as u16).collect()
}

#[test]
fn npy_u16_4d_reads_byte_exact() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("scan.npy");
    let data = counts(3 * 5 * 6 * 4);
    write_npy(&p, &[3, 5, 6, 4], &data, None);
    let src = Source::open(&p, &OpenOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(src.kind, SourceKind::Npy);
    assert_eq!(src.scan_shape, Shape2::new(3, 5));
    assert_eq!(src.detector_shape, Shape2::new(6, 4));
    assert!(!src.needs_host_decode());
    let want: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(frames_of(&src), want);
}

#[test]
fn npy_big_endian_is_swapped() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("be.npy");
    let data = counts(4 * 3 * 3);
    write_npy(&p, &[4, 3, 3], &data, Some(">u2"));
    let src = Source::open(&p, &OpenOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    assert!(src.needs_host_decode());
    let want: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(frames_of(&src), want);
    // the bytes in the file really are big-endian
    let raw = std::fs::read(&p).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(&raw[raw.len() - 2..], &data[data.len() - 1].to_be_bytes());
}

#[test]
fn npy_float32_needs_consent_then_rounds() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("f.npy");
    let data: Vec<f32> = vec![0.4, 1.6, -0.6, 2.5, 10.0, 3.49, 7.0, -3.0, 0.0];
    write_npy(&p, &[1, 3, 3], &data, None);
    let e = Source::open(&p, &OpenOptions::default())
        .err()
        .unwrap_or_else(|| panic!("no error"));
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("float_scale"), "{e}");
    let opts = OpenOptions {
        float_scale: Some(FloatScale(1.0)),
        ..OpenOptions::default()
    };
    let src = Source::open(&p, &opts).unwrap_or_else(|e| panic!("{e}"));
    let want: Vec<u8> = [0u32, 2, 0, 3, 10, 3, 7, 0, 0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(frames_of(&src), want);
    assert_eq!(src.host_decode().map(|h| h.negatives_clamped()), Some(2));
}

#[test]
fn truncated_npy_names_the_first_incomplete_frame() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("cut.npy");
    write_npy(&p, &[4, 4, 8, 8], &counts(4 * 4 * 64), None);
    let len = std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap_or_else(|e| panic!("{e}"));
    f.set_len(len - 200).unwrap_or_else(|e| panic!("{e}"));
    let e = Source::open(&p, &OpenOptions::default())
        .err()
        .unwrap_or_else(|| panic!("no error"));
    assert_eq!(e.kind, ErrorKind::Source);
    let s = e.to_string();
    assert!(s.contains("truncated") && s.contains("frame 14"), "{s}");
}

#[test]
fn raw_binary_with_headers_and_footers() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("scan.bin");
    let data = counts(2 * 3 * 5 * 4);
    let mut bytes = vec![0xAAu8; 32];
    for frame in data.chunks(20) {
        bytes.extend_from_slice(&[0x55; 12]);
        bytes.extend(frame.iter().flat_map(|v| v.to_le_bytes()));
        bytes.extend_from_slice(&[0x77; 4]);
    }
    std::fs::write(&p, &bytes).unwrap_or_else(|e| panic!("{e}"));
    let layout = RawLayout {
        shape: vec![2, 3, 5, 4],
        dtype: "uint16".into(),
        file_header_bytes: 32,
        frame_header_bytes: 12,
        frame_footer_bytes: 4,
    };
    let opts = OpenOptions {
        format: Some(Format::Raw),
        raw: Some(layout.clone()),
        ..OpenOptions::default()
    };
    let src = Source::open(&p, &opts).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(src.scan_shape, Shape2::new(2, 3));
    let want: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(frames_of(&src), want);
    // one byte short: a typed error, not a partial read
    std::fs::write(&p, &bytes[..bytes.len() - 1]).unwrap_or_else(|e| panic!("{e}"));
    let e = Source::open(&p, &opts)
        .err()
        .unwrap_or_else(|| panic!("no error"));
    assert_eq!(e.kind, ErrorKind::Source);
    assert!(e.to_string().contains("5 whole frames"), "{e}");
}

#[test]
fn unknown_files_and_shards_are_refused() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("notes.txt");
    std::fs::write(&p, b"not an acquisition").unwrap_or_else(|e| panic!("{e}"));
    let e = Source::open(&p, &OpenOptions::default())
        .err()
        .unwrap_or_else(|| panic!("no error"));
    let s = e.to_string();
    assert!(
        s.contains("unrecognised file format") && s.contains("npy") && s.contains("mib"),
        "{s}"
    );
    let shard = dir.path().join("scan_data_000001.h5");
    std::fs::write(&shard, b"\x89HDF\r\n\x1a\n and the rest").unwrap_or_else(|e| panic!("{e}"));
    let e = Source::open(&shard, &OpenOptions::default())
        .err()
        .unwrap_or_else(|| panic!("no error"));
    assert!(e.to_string().contains("open the *_master.h5"), "{e}");
    assert!(e.to_string().contains("scan_master.h5"), "{e}");
}

/// A header of deeply nested brackets is refused before the Python-literal parser sees it:
/// that parser backtracks exponentially on them (found by the fuzzer as a hang).
#[test]
fn npy_header_with_deep_brackets_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("deep.npy");
    let text = "{".repeat(40);
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(text.len() as u16).to_le_bytes());
    bytes.extend_from_slice(text.as_bytes());
    std::fs::write(&p, &bytes).unwrap();
    let e = Source::open(&p, &OpenOptions::default()).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Source);
    let s = e.to_string();
    assert!(
        s.contains("nests brackets too deeply") && s.contains("40 deep"),
        "{s}"
    );

    // A header longer than any NumPy writes is refused by its length, not read.
    let mut bytes = b"\x93NUMPY\x02\x00".to_vec();
    bytes.extend_from_slice(&(100_000_000u32).to_le_bytes());
    bytes.extend_from_slice(b"{'descr': '<u2'");
    std::fs::write(&p, &bytes).unwrap();
    let s = Source::open(&p, &OpenOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        s.contains("implausibly long") && s.contains("100000000"),
        "{s}"
    );
}

/// `inspect` reports a NumPy file (and says why a truncated one is not ready) instead of
/// calling it "not HDF5"; a `.qem` container is refused saying what to do.
#[test]
fn inspect_reports_non_hdf5_formats() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("scan.npy");
    write_npy(&p, &[3, 5, 6, 4], &counts(3 * 5 * 6 * 4), None);
    let ins = qem_io::inspect(&p, None).unwrap();
    assert!(ins.verdict.ready, "{ins:?}");
    assert_eq!(ins.source_kind, Some(SourceKind::Npy));
    assert_eq!(ins.scan_shape, Some(Shape2::new(3, 5)));
    assert_eq!(ins.detector_shape, Some(Shape2::new(6, 4)));
    assert_eq!(ins.actual_frames, Some(15));

    let cut = dir.path().join("cut.npy");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() - 10]).unwrap();
    let ins = qem_io::inspect(&cut, None).unwrap();
    assert!(!ins.verdict.ready);
    let why = ins.verdict.reason.unwrap();
    assert!(why.contains("frame") && !why.contains("HDF5"), "{why}");

    let q = dir.path().join("x.qem");
    std::fs::write(&q, b"QEM4DSTM and then nothing").unwrap();
    let e = qem_io::inspect(&q, None).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Source);
    assert!(e.to_string().contains(".qem"), "{e}");
}
