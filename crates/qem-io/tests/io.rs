//! Integration tests of qem-io: our writer → Source::open → decoded frames, malformed sources,
//! and cross-checks against the independent Python stack (h5py + hdf5plugin) when present.

use qem_core::{DType, ErrorKind, ScanShapeOrigin, Shape2};
use qem_io::writer::{
    write_acquisition, Calibration, WriteCompression, WriteLayout, WriteParams, Written,
};
use qem_io::{inspect, ChunkCodec, OpenOptions, Source, SourceKind};
use std::path::{Path, PathBuf};

/// Deterministic test value of pixel `i` of frame `n` (sparse, like counting data, and with
/// values above 65535 for u32).
fn value(n: u64, i: usize, dtype: DType) -> u32 {
    let h = (n.wrapping_mul(2_654_435_761) ^ (i as u64).wrapping_mul(40_503)) % 97;
    let v = if h < 7 {
        (h as u32 + 1) * (n as u32 % 13 + 1)
    } else {
        0
    };
    match dtype {
        DType::U8 => v % 256,
        DType::U16 => v + (i as u32 % 5 == 0) as u32,
        DType::U32 => v * 70_001 + (i as u32 % 3),
    }
}

fn fill(n: u64, buf: &mut [u8], dtype: DType) {
    let es = dtype.size();
    for (i, px) in buf.chunks_exact_mut(es).enumerate() {
        let v = value(n, i, dtype);
        px.copy_from_slice(&v.to_le_bytes()[..es]);
    }
}

fn expected_frame(n: u64, det: Shape2, dtype: DType) -> Vec<u8> {
    let mut b = vec![0u8; det.len() * dtype.size()];
    fill(n, &mut b, dtype);
    b
}

fn params(dir: &Path, name: &str, scan: Shape2, det: Shape2, dtype: DType) -> WriteParams {
    WriteParams {
        prefix: dir.join(name),
        scan_shape: scan,
        detector_shape: det,
        dtype,
        frames_per_file: 8,
        calibration: Calibration {
            energy_ev: Some(300e3),
            semiangle_mrad: Some(20.0),
            scan_step_a: Some((0.3, 0.25)),
            angular_sampling_mrad: Some((1.0, 1.0)),
            ..Calibration::default()
        },
        ..WriteParams::default()
    }
}

fn s2(rows: usize, cols: usize) -> Shape2 {
    Shape2::new(rows, cols)
}

/// Opening `path` with the default options fails: the error.
fn open_err(path: &Path) -> qem_core::Error {
    expect_err(Source::open(path, &OpenOptions::default()))
}

/// The error of a call that must fail.
fn expect_err<T>(r: Result<T, qem_core::Error>) -> qem_core::Error {
    r.err().unwrap_or_else(|| panic!("expected error"))
}

/// The error names a file ending in `tail`.
fn names_file(e: &qem_core::Error, tail: &str) -> bool {
    e.file.as_ref().is_some_and(|f| f.ends_with(tail))
}

/// [`params`] for `name`, adjusted by `change`, written in a new temporary directory.
fn written(
    name: &str,
    scan: Shape2,
    det: Shape2,
    dtype: DType,
    change: impl FnOnce(&mut WriteParams),
) -> (tempfile::TempDir, Written) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut p = params(dir.path(), name, scan, det, dtype);
    change(&mut p);
    let w = write(&p);
    (dir, w)
}

fn write(p: &WriteParams) -> Written {
    let dtype = p.dtype;
    match write_acquisition(p, |n, buf| fill(n, buf, dtype)) {
        Ok(w) => w,
        Err(e) => panic!("write failed: {e}"),
    }
}

fn open(path: &Path) -> Source {
    match Source::open(path, &OpenOptions::default()) {
        Ok(s) => s,
        Err(e) => panic!("open failed: {e}"),
    }
}

/// Decode every present frame of `src` through read_chunk (pread) + qem_codec.
fn decoded_frames(src: &Source) -> Vec<Option<Vec<u8>>> {
    let fb = src.frame_bytes();
    let mut out = vec![None; src.n_frames as usize];
    let mut buf = Vec::new();
    for rec in &src.chunks {
        src.read_chunk(rec, &mut buf)
            .unwrap_or_else(|e| panic!("read_chunk: {e}"));
        let mut raw = vec![0u8; fb * rec.frames_in_chunk as usize];
        if src.codec == ChunkCodec::Bslz4 && !rec.is_unfiltered() {
            qem_codec::bslz4::decode_chunk(&buf, src.dtype.size(), &mut raw)
                .unwrap_or_else(|e| panic!("decode chunk of frame {}: {e}", rec.first_frame));
        } else {
            raw.copy_from_slice(&buf);
        }
        for k in 0..rec.valid_frames as usize {
            out[rec.first_frame as usize + k] = Some(raw[k * fb..(k + 1) * fb].to_vec());
        }
    }
    out
}

fn assert_frames_match(src: &Source) {
    let frames = decoded_frames(src);
    for (n, f) in frames.iter().enumerate() {
        let n = n as u64;
        if src.missing_frames.contains(&n) {
            assert!(f.is_none(), "missing frame {n} has data");
            continue;
        }
        let got = f
            .as_ref()
            .unwrap_or_else(|| panic!("frame {n} has no chunk"));
        assert!(
            *got == expected_frame(n, src.detector_shape, src.dtype),
            "frame {n} differs"
        );
    }
}

#[test]
fn rectangular_scan_over_uneven_shards_round_trips() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (scan, det) = (Shape2::new(7, 5), Shape2::new(24, 20));
    let p = params(dir.path(), "rect", scan, det, DType::U16);
    let w = write(&p);
    assert_eq!(w.data_files.len(), 5); // 8+8+8+8+3
    let src = open(&w.master);
    assert_eq!(src.kind, SourceKind::DectrisMaster);
    assert_eq!(src.files.len(), 6);
    assert_eq!(src.dataset_path, "/entry/data/data");
    assert_eq!(src.dtype, DType::U16);
    assert_eq!(src.detector_shape, det);
    assert_eq!(src.n_frames, 35);
    assert_eq!(src.scan_shape, scan);
    assert_eq!(
        src.metadata.scan_shape_origin,
        Some(ScanShapeOrigin::Attribute)
    );
    assert_eq!(src.codec, ChunkCodec::Bslz4);
    assert_eq!(src.chunks.len(), 35);
    assert!(src
        .chunks
        .windows(2)
        .all(|w| w[0].first_frame < w[1].first_frame));
    assert_eq!(src.chunks[8].file, 2);
    assert!(src.missing_frames.is_empty());
    assert_eq!(src.compressed_bytes(), w.compressed_bytes);
    assert_eq!(w.raw_bytes, 35 * 24 * 20 * 2);
    assert_eq!(src.frame_bytes(), 24 * 20 * 2);
    assert_eq!(
        src.chunk_index_digest(),
        open(&w.master).chunk_index_digest()
    );
    assert_eq!(src.chunk_index_digest().len(), 16);
    // metadata
    let m = &src.metadata;
    assert_eq!(m.energy_ev, Some(300e3));
    assert_eq!(m.semiangle_mrad, Some(20.0));
    assert_eq!(m.scan_step_a, Some((0.3, 0.25)));
    assert_eq!(m.angular_sampling_mrad, Some((1.0, 1.0)));
    assert!(
        m.wavelength_a.is_some_and(|w| (w - 0.01969).abs() < 1e-4),
        "{:?}",
        m.wavelength_a
    );
    assert!(m
        .pixel_size_m
        .is_some_and(|(r, c)| (r - 75e-6).abs() < 1e-9 && (c - 75e-6).abs() < 1e-9));
    assert_eq!(m.bit_depth_image, Some(16));
    assert_eq!(m.saturation_value, Some(65534));
    assert_eq!(m.trigger_mode.as_deref(), Some("exts"));
    assert_eq!((m.ntrigger, m.nimages), (Some(7), Some(5)));
    assert_eq!(m.beam_center_px, Some((11.5, 9.5)));
    assert_eq!(m.pixel_mask_applied, Some(false));
    assert!(m.count_time_s.is_some_and(|t| (t - 1e-4).abs() < 1e-9));
    assert!(
        m.extra
            .contains_key("/entry/instrument/detector/sensor_material"),
        "{:?}",
        m.extra.keys()
    );
    assert_eq!(
        src.bad_pixel_mask()
            .map(|m| m.iter().filter(|&&b| b).count()),
        Some(0)
    );
    assert_frames_match(&src);
    let chunk = src.chunk_of_frame(34).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(chunk.first_frame, 34);
    assert!(src.chunk_of_frame(35).is_err());

    let ins = inspect(&w.master, None).unwrap_or_else(|e| panic!("{e}"));
    assert!(ins.verdict.ready, "{:?}", ins.verdict.reason);
    assert_eq!(ins.shards.len(), 5);
    assert_eq!(ins.shards[4].frames, Some(3));
    assert_eq!(
        (ins.shards[1].image_nr_low, ins.shards[1].image_nr_high),
        (Some(9), Some(16))
    );
    assert_eq!(ins.actual_frames, Some(35));
    assert_eq!(ins.expected_frames, Some(35));
    assert_eq!(ins.scan_shape, Some(scan));
    assert_eq!(ins.compressed_bytes, Some(w.compressed_bytes));
    let json = serde_json::to_string(&ins).unwrap_or_default();
    assert!(
        json.contains("\"source_kind\":\"dectris_master\""),
        "{json}"
    );
}

#[test]
fn u32_frames_pixel_mask_and_small_blocks() {
    let det = Shape2::new(19, 23); // 437 elements: partial block and a raw tail
    let mut mask = vec![0u32; det.len()];
    mask[3] = 1; // gap
    mask[40] = 8; // over-responding
    mask[41] = 1 << 31; // virtual pixel only: not bad
    mask[100] = 0x100; // user mask
    let (_dir, w) = written("u32", s2(4, 4), det, DType::U32, |p| {
        p.block_elems = 256;
        p.pixel_mask = Some(mask.clone());
    });
    let src = open(&w.master);
    assert_eq!(src.dtype, DType::U32);
    assert_eq!(src.pixel_mask.as_ref(), Some(&mask));
    let bad = src.bad_pixel_mask().unwrap_or_default();
    let bad_idx: Vec<usize> = bad
        .iter()
        .enumerate()
        .filter(|(_, &b)| b)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(bad_idx, vec![3, 40, 100]);
    assert_eq!(src.metadata.bad_pixel_count, Some(3));
    assert_eq!(src.metadata.scan_shape, Some(Shape2::new(4, 4)));
    // the block size in the chunk header is 256 elements * 4 bytes
    let mut buf = Vec::new();
    src.read_chunk(&src.chunks[0], &mut buf)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(&buf[8..12], &1024u32.to_be_bytes());
    assert_frames_match(&src);
    let ins = inspect(&w.master, None).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ins.bad_pixels, Some(3));
}

#[test]
fn multi_frame_chunks_with_partial_last_chunk() {
    // shards of 8, 8, 4 frames -> chunks 3+3+2, 3+3+2, 3+1
    let (_dir, w) = written("mf", s2(4, 5), s2(16, 12), DType::U16, |p| {
        p.frames_per_chunk = 3
    });
    let src = open(&w.master);
    assert_eq!(src.chunks.len(), 8);
    let valid: Vec<u32> = src.chunks.iter().map(|c| c.valid_frames).collect();
    assert_eq!(valid, vec![3, 3, 2, 3, 3, 2, 3, 1]);
    assert!(src.chunks.iter().all(|c| c.frames_in_chunk == 3));
    let firsts: Vec<u64> = src.chunks.iter().map(|c| c.first_frame).collect();
    assert_eq!(firsts, vec![0, 3, 6, 8, 11, 14, 16, 19]);
    assert_eq!(src.chunk_of_frame(7).map(|c| c.first_frame).ok(), Some(6));
    assert_eq!(src.chunk_of_frame(19).map(|c| c.first_frame).ok(), Some(19));
    assert_frames_match(&src);
}

#[test]
fn inline_layout_is_a_plain_dataset() {
    let (_dir, w) = written("inl", s2(3, 6), s2(10, 14), DType::U16, |p| {
        p.layout = WriteLayout::Inline
    });
    assert!(w.data_files.is_empty());
    let src = open(&w.master);
    assert_eq!(src.kind, SourceKind::Hdf5Dataset);
    assert_eq!(src.dataset_path, "/entry/data/data");
    assert_eq!(src.files.len(), 1);
    assert_eq!(src.scan_shape, Shape2::new(3, 6));
    assert_eq!(src.chunks.len(), 18);
    assert!(src.chunks.iter().all(|c| c.file == 0));
    assert_frames_match(&src);
}

#[test]
fn uncompressed_layout_reads_raw() {
    let (_dir, w) = written("raw", s2(5, 3), s2(8, 9), DType::U8, |p| {
        p.compression = WriteCompression::None
    });
    let src = open(&w.master);
    assert_eq!(src.codec, ChunkCodec::Raw);
    assert!(src.chunks.iter().all(|c| c.size == 72));
    assert_eq!(w.compressed_bytes, w.raw_bytes);
    assert_frames_match(&src);
}

#[test]
fn scan_shape_inference_and_errors() {
    let det = Shape2::new(4, 4);
    // perfect square, nothing recorded
    let (dir, w) = written("sq", s2(6, 6), det, DType::U16, |p| {
        p.write_scan_shape = false;
        p.compression = WriteCompression::None;
    });
    let src = open(&w.master);
    assert_eq!(src.scan_shape, Shape2::new(6, 6));
    assert_eq!(
        src.metadata.scan_shape_origin,
        Some(ScanShapeOrigin::PerfectSquare)
    );

    // 6 x 5, nothing recorded: an error that tells the user to pass scan_shape
    let mut p = params(dir.path(), "rect", s2(6, 5), det, DType::U16);
    p.write_scan_shape = false;
    p.compression = WriteCompression::None;
    let w = write(&p);
    let e = Source::open(&w.master, &OpenOptions::default()).err();
    let e = e.unwrap_or_else(|| panic!("expected a scan-shape error"));
    assert_eq!(e.kind, ErrorKind::Source);
    assert!(e.to_string().contains("scan_shape"), "{e}");
    assert!(names_file(&e, "rect_master.h5"));
    let ins = inspect(&w.master, None).unwrap_or_else(|e| panic!("{e}"));
    assert!(!ins.verdict.ready);
    assert!(
        ins.verdict
            .action
            .as_deref()
            .is_some_and(|a| a.contains("scan_shape")),
        "{:?}",
        ins.verdict.action
    );
    // ... and passing it works, with origin Argument
    let opts = OpenOptions {
        scan_shape: Some(Shape2::new(5, 6)),
        ..OpenOptions::default()
    };
    let src = Source::open(&w.master, &opts).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(src.scan_shape, Shape2::new(5, 6));
    assert_eq!(
        src.metadata.scan_shape_origin,
        Some(ScanShapeOrigin::Argument)
    );
    assert!(inspect(&w.master, Some(Shape2::new(3, 10))).is_ok_and(|i| i.verdict.ready));
}

#[test]
fn wrong_scan_shape_names_expected_and_found() {
    let (_dir, w) = written("w", s2(7, 5), s2(6, 6), DType::U16, |p| {
        p.compression = WriteCompression::None
    });
    let opts = OpenOptions {
        scan_shape: Some(Shape2::new(6, 6)),
        ..OpenOptions::default()
    };
    let e = expect_err(Source::open(&w.master, &opts));
    assert_eq!(e.kind, ErrorKind::Source);
    assert_eq!(e.expected.as_deref(), Some("36 frames (6 x 6)"));
    assert_eq!(e.found.as_deref(), Some("35 frames"));
}

#[test]
fn missing_shard_is_named() {
    let (_dir, w) = written("ms", s2(7, 5), s2(6, 6), DType::U16, |p| {
        p.compression = WriteCompression::None
    });
    let gone = w.data_files[2].clone();
    std::fs::remove_file(&gone).unwrap_or_else(|e| panic!("{e}"));
    let e = open_err(&w.master);
    assert_eq!(e.kind, ErrorKind::Source);
    assert!(names_file(&e, "ms_data_000003.h5"), "{e}");
    assert!(e.to_string().contains("ms_data_000003.h5"), "{e}");
    let ins = inspect(&w.master, None).unwrap_or_else(|e| panic!("{e}"));
    assert!(!ins.verdict.ready);
    assert_eq!(ins.missing_shards.len(), 1);
    assert!(ins.missing_shards[0].ends_with("ms_data_000003.h5"));
    assert!(!ins.shards[2].exists && ins.shards[1].exists);
    assert!(ins
        .verdict
        .reason
        .as_deref()
        .is_some_and(|r| r.contains("ms_data_000003.h5")));
}

#[test]
fn master_opened_from_another_directory_resolves_shards_next_to_it() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let sub = dir.path().join("a/b");
    let mut p = params(&sub, "cwd", s2(3, 3), s2(5, 5), DType::U16);
    p.compression = WriteCompression::None;
    let w = write(&p);
    // a relative path from the parent (the test's CWD is the crate dir; use an absolute one
    // with a `..` component instead of changing the process CWD)
    let odd = sub.join("../b").join("cwd_master.h5");
    let src = Source::open(&odd, &OpenOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(src.files.len(), 3);
    assert!(src.files[1].path.ends_with("a/b/cwd_data_000001.h5"));
    assert_eq!(
        src.files[0].path,
        std::fs::canonicalize(&w.master).unwrap_or_default()
    );
}

#[test]
fn unwritten_chunks_are_missing_frames() {
    let (_dir, w) = written("sk", s2(4, 5), s2(6, 7), DType::U16, |p| {
        p.skip_frames = vec![3, 9, 19]
    });
    let src = open(&w.master);
    assert_eq!(src.missing_frames, vec![3, 9, 19]);
    assert_eq!(src.chunks.len(), 17);
    let e = expect_err(src.chunk_of_frame(9));
    assert_eq!(e.kind, ErrorKind::Source);
    assert_eq!(e.frame, Some(9));
    assert!(e.to_string().contains("frame 9"), "{e}");
    assert!(names_file(&e, "sk_data_000002.h5"), "{e}");
    assert!(src.chunk_of_frame(8).is_ok());
    assert_frames_match(&src);
    let ins = inspect(&w.master, None).unwrap_or_else(|e| panic!("{e}"));
    assert!(!ins.verdict.ready);
    assert_eq!(ins.unwritten.n_missing_frames, 3);
    assert_eq!(ins.unwritten.missing_frames, vec![3, 9, 19]);
}

#[test]
fn truncated_shard_fails_read_chunk_with_file_and_frame() {
    let (_dir, w) = written("tr", s2(4, 4), s2(32, 32), DType::U16, |p| {
        p.compression = WriteCompression::None
    });
    let src = open(&w.master);
    // cut shard 2 (frames 8..16) in the middle of its last chunk
    let last = src.chunks[15];
    assert_eq!(last.file, 2);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&w.data_files[1])
        .unwrap_or_else(|e| panic!("{e}"));
    f.set_len(last.offset + last.size / 2)
        .unwrap_or_else(|e| panic!("{e}"));
    drop(f);
    let mut buf = Vec::new();
    let e = expect_err(src.read_chunk(&last, &mut buf));
    assert_eq!(e.kind, ErrorKind::Source);
    assert_eq!(e.frame, Some(15));
    assert!(names_file(&e, "tr_data_000002.h5"), "{e}");
    assert!(e.found.is_some() && e.expected.is_some());
    assert!(src.read_chunk(&src.chunks[0], &mut buf).is_ok());
    // re-opening the truncated acquisition fails and names the shard
    let e = open_err(&w.master);
    assert!(names_file(&e, "tr_data_000002.h5"), "{e}");
}

#[test]
fn concurrent_reads_from_many_threads() {
    use rayon::prelude::*;
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Source>();
    let (_dir, w) = written("cc", s2(8, 8), s2(16, 16), DType::U16, |p| {
        p.compression = WriteCompression::None
    });
    let src = open(&w.master);
    let ok = src.chunks.par_iter().all(|rec| {
        let mut buf = Vec::new();
        src.read_chunk(rec, &mut buf).is_ok()
            && buf == expected_frame(rec.first_frame, src.detector_shape, src.dtype)
    });
    assert!(ok);
}

#[test]
fn discover_finds_masters_recursively() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    for (sub, name) in [("x", "b"), ("x/y", "a"), ("z", "c")] {
        let mut p = params(
            &dir.path().join(sub),
            name,
            Shape2::new(2, 2),
            Shape2::new(4, 4),
            DType::U16,
        );
        p.compression = WriteCompression::None;
        write(&p);
    }
    let found = qem_io::discover(dir.path()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(found.len(), 3);
    assert!(found.iter().all(|f| f.is_absolute()));
    let mut sorted = found.clone();
    sorted.sort();
    assert_eq!(found, sorted);
    assert!(found[0].ends_with("x/b_master.h5"));
    let e = expect_err(qem_io::discover(&dir.path().join("nope")));
    assert_eq!(e.kind, ErrorKind::Source);
    assert!(inspect(&dir.path().join("nope.h5"), None).is_err());
}

// ---------------------------------------------------------------------------------------------
// Plain HDF5 files written with hdf5-metno / raw hdf5-sys.

/// Create `(dims)` u16 dataset `name` in a new file with chunking `cdims` and the given raw
/// filter (id, cd_values), without writing data.
fn raw_dataset(path: &Path, dims: &[u64], cdims: &[u64], filter: Option<(i32, &[u32])>) {
    let f = hdf5::File::create(path).unwrap_or_else(|e| panic!("{e}"));
    // Source::open registers filter 32008 and calls H5open; make sure HDF5 is up.
    let _ = Source::open(Path::new("/nonexistent"), &OpenOptions::default());
    hdf5::sync::sync(|| {
        // SAFETY: test-only raw calls on ids created here; arrays outlive the calls.
        unsafe {
            let space =
                hdf5_sys::h5s::H5Screate_simple(dims.len() as i32, dims.as_ptr(), std::ptr::null());
            let dcpl = hdf5_sys::h5p::H5Pcreate(*hdf5_sys::h5p::H5P_CLS_DATASET_CREATE);
            assert!(hdf5_sys::h5p::H5Pset_chunk(dcpl, cdims.len() as i32, cdims.as_ptr()) >= 0);
            if let Some((id, cd)) = filter {
                assert!(
                    hdf5_sys::h5p::H5Pset_filter(
                        dcpl,
                        id,
                        hdf5_sys::h5z::H5Z_FLAG_OPTIONAL,
                        cd.len(),
                        cd.as_ptr()
                    ) >= 0
                );
            }
            let name = c"data";
            let ds = hdf5_sys::h5d::H5Dcreate2(
                f.id(),
                name.as_ptr(),
                *hdf5_sys::h5t::H5T_STD_U16LE,
                space,
                hdf5_sys::h5p::H5P_DEFAULT,
                dcpl,
                hdf5_sys::h5p::H5P_DEFAULT,
            );
            assert!(ds >= 0);
            hdf5_sys::h5d::H5Dclose(ds);
            hdf5_sys::h5p::H5Pclose(dcpl);
            hdf5_sys::h5s::H5Sclose(space);
        }
    });
}

#[test]
fn zstd_and_unknown_filters_are_rejected() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let z = dir.path().join("zstd.h5");
    raw_dataset(
        &z,
        &[4, 8, 8],
        &[1, 8, 8],
        Some((32008, &[0, 4, 2, 0, 3, 3])),
    );
    let e = open_err(&z);
    assert_eq!(e.kind, ErrorKind::Source);
    assert!(e.to_string().contains("zstd"), "{e}");

    // bzip2 (307) is not read (Blosc, 32001, is since 2026-12-05).
    let b = dir.path().join("bzip2.h5");
    raw_dataset(&b, &[4, 8, 8], &[1, 8, 8], Some((307, &[9])));
    let e = open_err(&b);
    assert!(e.to_string().contains("307"), "{e}");

    let es = dir.path().join("es.h5");
    raw_dataset(&es, &[4, 8, 8], &[1, 8, 8], Some((32008, &[0, 4, 4, 0, 2])));
    let e = open_err(&es);
    assert!(e.to_string().contains("element size"), "{e}");

    let cs = dir.path().join("cs.h5");
    raw_dataset(&cs, &[4, 8, 8], &[1, 4, 8], None);
    let e = open_err(&cs);
    assert!(e.to_string().contains("unsupported chunk shape"), "{e}");

    // an empty but valid dataset: every frame missing
    let em = dir.path().join("empty.h5");
    raw_dataset(&em, &[4, 8, 8], &[2, 8, 8], None);
    let src = Source::open(&em, &OpenOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(src.missing_frames, vec![0, 1, 2, 3]);
    assert!(src.chunks.is_empty());
}

fn frames_u16(n: usize, det: Shape2) -> Vec<u16> {
    let mut v = vec![0u16; n * det.len()];
    for (k, px) in v.iter_mut().enumerate() {
        *px = value((k / det.len()) as u64, k % det.len(), DType::U16) as u16;
    }
    v
}

#[test]
fn four_d_dataset_with_row_part_chunks_and_contiguous_3d() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let det = Shape2::new(8, 6);
    let path = dir.path().join("four.h5");
    {
        let f = hdf5::File::create(&path).unwrap_or_else(|e| panic!("{e}"));
        let g = f.create_group("scan").unwrap_or_else(|e| panic!("{e}"));
        let data = frames_u16(12, det);
        let ds = g
            .new_dataset::<u16>()
            .shape([3usize, 4, 8, 6])
            .chunk([1usize, 3, 8, 6])
            .create("frames")
            .unwrap_or_else(|e| panic!("{e}"));
        ds.write_raw(&data).unwrap_or_else(|e| panic!("{e}"));
        // a second, contiguous 3-D dataset in another file
        let f2 = hdf5::File::create(dir.path().join("contig.h5")).unwrap_or_else(|e| panic!("{e}"));
        let ds2 = f2
            .new_dataset::<u16>()
            .shape([9usize, 8, 6])
            .create("frames")
            .unwrap_or_else(|e| panic!("{e}"));
        ds2.write_raw(&frames_u16(9, det))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let src = Source::open(&path, &OpenOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(src.kind, SourceKind::Hdf5Dataset);
    assert_eq!(src.dataset_path, "/scan/frames");
    assert_eq!(src.scan_shape, Shape2::new(3, 4));
    assert_eq!(
        src.metadata.scan_shape_origin,
        Some(ScanShapeOrigin::ArrayShape)
    );
    // rows of 4 positions in chunks of 3: (first, valid) = (0,3) (3,1) (4,3) (7,1) (8,3) (11,1)
    let fv: Vec<(u64, u32)> = src
        .chunks
        .iter()
        .map(|c| (c.first_frame, c.valid_frames))
        .collect();
    assert_eq!(fv, vec![(0, 3), (3, 1), (4, 3), (7, 1), (8, 3), (11, 1)]);
    assert_frames_match(&src);
    let bad = OpenOptions {
        scan_shape: Some(Shape2::new(2, 5)),
        ..OpenOptions::default()
    };
    assert!(Source::open(&path, &bad).is_err());
    let ok = OpenOptions {
        scan_shape: Some(Shape2::new(2, 6)),
        ..OpenOptions::default()
    };
    assert_eq!(
        Source::open(&path, &ok).map(|s| s.scan_shape).ok(),
        Some(Shape2::new(2, 6))
    );

    let c = dir.path().join("contig.h5");
    let src = Source::open(&c, &OpenOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(src.codec, ChunkCodec::Raw);
    assert_eq!(src.chunks.len(), 9);
    assert_eq!(src.scan_shape, Shape2::new(3, 3));
    assert_frames_match(&src);
}

// ---------------------------------------------------------------------------------------------
// Cross-checks with the independent Python stack.

/// The repository's independent test-data tools (`tests/tools`, h5py + hdf5plugin + numpy only).
fn tools_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/tools")
}

/// Runs `python3 -c script`.
fn python(script: &str) -> std::process::Output {
    let out = std::process::Command::new("python3")
        .args(["-c", script])
        .output();
    out.unwrap_or_else(|e| panic!("{e}"))
}

fn python_ok() -> bool {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import h5py, hdf5plugin, numpy"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("SKIPPED: python3 with h5py + hdf5plugin + numpy is not available");
    }
    ok
}

#[test]
fn reads_make_dectris_output() {
    if !python_ok() {
        return;
    }
    let tool = tools_dir().join("make_dectris.py");
    assert!(
        tool.is_file(),
        "{} is part of the repository",
        tool.display()
    );
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let prefix = dir.path().join("x");
    let out = std::process::Command::new("python3")
        .arg(&tool)
        .args([
            "--synthetic",
            "5",
            "7",
            "24",
            "20",
            "--frames-per-file",
            "8",
            "--out",
        ])
        .arg(&prefix)
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let master = dir.path().join("x_master.h5");
    let src = open(&master);
    assert_eq!(src.kind, SourceKind::DectrisMaster);
    assert_eq!(src.scan_shape, Shape2::new(5, 7));
    assert_eq!(
        src.metadata.scan_shape_origin,
        Some(ScanShapeOrigin::Attribute)
    );
    assert_eq!(src.detector_shape, Shape2::new(24, 20));
    assert_eq!(src.n_frames, 35);
    assert_eq!(src.chunks.len(), 35);
    assert_eq!(src.files.len(), 6);
    assert_eq!(src.codec, ChunkCodec::Bslz4);
    let m = &src.metadata;
    assert_eq!(m.energy_ev, Some(300e3));
    assert_eq!(m.semiangle_mrad, Some(20.0));
    assert_eq!(m.scan_step_a, Some((0.3, 0.3)));
    assert_eq!(m.angular_sampling_mrad, Some((1.0, 1.0)));
    assert!(m
        .pixel_size_m
        .is_some_and(|(r, _)| (r - 100e-6).abs() < 1e-9));
    assert_eq!(
        m.detector_description.as_deref(),
        Some("DECTRIS ARINA Si (simulated)")
    );
    assert!(
        m.detector_distance_m
            .is_some_and(|d| (d - 0.1).abs() < 1e-6),
        "{:?}",
        m.detector_distance_m
    );
    assert_eq!(m.beam_center_px, Some((11.5, 9.5)));
    // the pixel mask is bitshuffle-compressed in this file: read through our HDF5 filter
    assert_eq!(src.pixel_mask.as_ref().map(Vec::len), Some(24 * 20));
    assert_eq!(
        src.bad_pixel_mask().map(|b| b.iter().any(|&x| x)),
        Some(false)
    );
    // every chunk decodes to the right size (values checked against h5py below)
    let frames = decoded_frames(&src);
    assert!(frames
        .iter()
        .all(|f| f.as_ref().is_some_and(|f| f.len() == 24 * 20 * 2)));
    // compare frame 17 against h5py
    let raw = dir.path().join("f17.bin");
    let script = format!(
        "import h5py, hdf5plugin\nf = h5py.File(r'{}', 'r')\nf['/entry/data/data_000003'][1].tofile(r'{}')",
        master.display(),
        raw.display()
    );
    let out = python(&script);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want = std::fs::read(&raw).unwrap_or_default();
    assert_eq!(frames[17].as_deref(), Some(want.as_slice()));
    let ins = inspect(&master, None).unwrap_or_else(|e| panic!("{e}"));
    assert!(ins.verdict.ready, "{:?}", ins.verdict.reason);
    assert_eq!(ins.shards.len(), 5);
}

#[test]
fn h5py_reads_our_writer_output() {
    if !python_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    for (name, dtype, block, fpc) in [("a", DType::U16, 0usize, 1u32), ("b", DType::U32, 256, 3)] {
        let (scan, det) = (Shape2::new(3, 7), Shape2::new(13, 11));
        let mut p = params(dir.path(), name, scan, det, dtype);
        p.block_elems = block;
        p.frames_per_chunk = fpc;
        let mut mask = vec![0u32; det.len()];
        mask[5] = 2;
        p.pixel_mask = Some(mask);
        let w = write(&p);
        let raw = dir.path().join(format!("{name}.bin"));
        let mut all = Vec::new();
        for n in 0..scan.len() as u64 {
            all.extend(expected_frame(n, det, dtype));
        }
        std::fs::write(&raw, &all).unwrap_or_else(|e| panic!("{e}"));
        let script = format!(
            r#"
import h5py, hdf5plugin, numpy as np
f = h5py.File(r'{master}', 'r')
g = f['/entry/data']
names = sorted(k for k in g.keys() if k.startswith('data_'))
arr = np.concatenate([g[k][()] for k in names])
want = np.fromfile(r'{raw}', dtype='{np}').reshape(arr.shape)
assert arr.dtype == np.dtype('{np}'), arr.dtype
assert np.array_equal(arr, want), 'frames differ'
d = g[names[0]]
assert d.chunks == (min({fpc}, d.shape[0]) if False else {fpc}, 13, 11), d.chunks
assert tuple(f['/entry/instrument/stem/scan_shape'][()]) == (3, 7)
assert int(d.attrs['image_nr_low']) == 1
assert f['/entry/instrument/detector/detectorSpecific/pixel_mask'][()].ravel()[5] == 2
print('ok', arr.shape)
"#,
            master = w.master.display(),
            raw = raw.display(),
            np = dtype.numpy_name(),
            fpc = fpc,
        );
        let out = python(&script);
        assert!(
            out.status.success(),
            "h5py check of {name} failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn second_open_reuses_the_index_until_a_file_changes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let params = WriteParams {
        prefix: dir.path().join("cache"),
        scan_shape: Shape2::new(3, 4),
        detector_shape: Shape2::new(8, 8),
        dtype: DType::U16,
        frames_per_file: 5,
        ..WriteParams::default()
    };
    let written = write_acquisition(&params, |f, out: &mut [u8]| {
        out.iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (f as usize + i) as u8)
    })
    .expect("write");
    let first = Source::open(&written.master, &OpenOptions::default()).expect("open");
    let second = Source::open(&written.master, &OpenOptions::default()).expect("reopen");
    assert!(!first.index_from_cache || second.index_from_cache);
    assert!(
        second.index_from_cache,
        "an unchanged source is served from the cache"
    );
    assert_eq!(first.chunks, second.chunks);
    assert_eq!(first.files, second.files);
    // Growing a shard (as a detector still writing would) forces a fresh index.
    let shard = &written.data_files[1];
    let len = std::fs::metadata(shard).expect("stat").len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(shard)
        .expect("open shard")
        .set_len(len + 4096)
        .expect("grow");
    let third = Source::open(&written.master, &OpenOptions::default()).expect("after change");
    assert!(!third.index_from_cache, "a changed file is re-indexed");
    // Different options are a different entry.
    let other = Source::open(
        &written.master,
        &OpenOptions {
            scan_shape: Some(Shape2::new(4, 3)),
            ..OpenOptions::default()
        },
    )
    .expect("other options");
    assert!(!other.index_from_cache);
    assert_eq!(other.scan_shape, Shape2::new(4, 3));
}
