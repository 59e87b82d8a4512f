//! End-to-end loads through the façade: files written by our Dectris writer, compared against the
//! generating data with an independent naive reference (u64 sums written here, not by the engine).
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic on setup failures

use qem::{
    load, DType, DenseArray, DtypeRequest, ErrorKind, LoadParams, Region, Shape2, SourceArg,
};
use qem_io::writer::{write_acquisition, Calibration, WriteCompression, WriteLayout, WriteParams};
use std::path::{Path, PathBuf};

/// Deterministic pseudo-random counts: mostly small, some large, a few above u16 for u32 data.
fn value(frame: u64, pixel: usize, big: bool) -> u32 {
    let mut x = frame
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((pixel as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9));
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 29;
    if big && frame == 1 && pixel == 0 {
        return 123_456; // guaranteed above u16
    }
    let r = (x % 1000) as u32;
    match r {
        0..=600 => 0,
        601..=950 => r % 7,
        951..=998 => r,
        _ if big => 70_000 + r,
        _ => 60_000 + r,
    }
}

struct Written {
    master: PathBuf,
    data: Vec<u32>,
    scan: Shape2,
    det: Shape2,
    mask: Vec<u32>,
}

fn write(dir: &Path, scan: Shape2, det: Shape2, dtype: DType, big: bool) -> Written {
    let frame_len = det.len();
    let n = scan.len() as u64;
    let data: Vec<u32> = (0..n)
        .flat_map(|f| (0..frame_len).map(move |p| value(f, p, big)))
        .collect();
    let mut mask = vec![0u32; frame_len];
    mask[frame_len / 3] = 1; // gap: bad
    mask[frame_len / 2] = 1 << 31; // virtual-pixel tag only: not bad
    mask[frame_len - 1] = 8; // over-responding: bad
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

/// Naive reference: mask (low 16 bits) → region → bin (u64, partial edges kept).
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

#[test]
fn full_load_matches_source_with_mask_rectangular_uneven_shards() {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = write(
        dir.path(),
        Shape2::new(5, 7),
        Shape2::new(13, 11),
        DType::U16,
        false,
    );
    let ds = load(SourceArg::Path(w.master.clone()), &LoadParams::default()).expect("load");
    assert_eq!(ds.shape(), [5, 7, 13, 11]);
    assert_eq!(ds.dtype(), DType::U16);
    let want = reference(&w, w.scan.full(), w.det.full(), 1);
    assert_eq!(as_u64(&ds.to_host().expect("host")), want);
    let p = ds.provenance();
    assert_eq!(p.mask_policy.bad_pixels, 2, "only low-16-bit flags are bad");
    assert!(p.mask_policy.applied);
    assert_eq!(p.backend, ds.backend().name());
    assert_eq!(p.memory.is_some(), ds.backend() == qem::Backend::Cuda);
    assert_eq!(p.files.len(), 1 + 5); // master + ceil(35 / 8) shards
                                      // A single frame equals the slice of the reference.
    let f = ds.frame(4, 6).expect("frame");
    assert_eq!(
        as_u64(&f),
        want[(4 * 7 + 6) * 143..(4 * 7 + 7) * 143].to_vec()
    );
    assert!(ds.frame(5, 0).is_err());
}

#[test]
fn apply_mask_false_keeps_raw_values() {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = write(
        dir.path(),
        Shape2::new(3, 4),
        Shape2::new(8, 8),
        DType::U16,
        false,
    );
    let params = LoadParams {
        apply_mask: false,
        ..LoadParams::default()
    };
    let ds = load(SourceArg::Path(w.master.clone()), &params).expect("load");
    let want: Vec<u64> = w.data.iter().map(|&v| v as u64).collect();
    assert_eq!(as_u64(&ds.to_host().expect("host")), want);
    assert!(!ds.provenance().mask_policy.applied);
}

#[test]
fn regions_and_binning_match_naive_reference() {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = write(
        dir.path(),
        Shape2::new(6, 5),
        Shape2::new(15, 13),
        DType::U16,
        false,
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
            ..LoadParams::default()
        };
        let ds = load(SourceArg::Path(w.master.clone()), &params).expect("load");
        let rs = dr.shape();
        assert_eq!(
            ds.shape(),
            [
                sr.shape().rows,
                sr.shape().cols,
                rs.rows.div_ceil(bin),
                rs.cols.div_ceil(bin)
            ]
        );
        // u16 data binned can exceed u16: native widens to u32 when bin > 1.
        assert_eq!(ds.dtype(), if bin > 1 { DType::U32 } else { DType::U16 });
        assert_eq!(
            as_u64(&ds.to_host().expect("host")),
            reference(&w, sr, dr, bin),
            "{sr} {dr} {bin}"
        );
        let p = ds.provenance();
        assert_eq!(p.det_bin, bin);
        assert_eq!(p.scan_region.is_some(), !sr.is_full(w.scan));
    }
}

#[test]
fn u32_source_dtype_policy() {
    let dir = tempfile::tempdir().expect("tempdir");
    // All values fit u16 (after masking the u32 sentinels? none here): u16 request works.
    let small = write(
        dir.path(),
        Shape2::new(2, 3),
        Shape2::new(6, 5),
        DType::U32,
        false,
    );
    let ds = load(
        SourceArg::Path(small.master.clone()),
        &LoadParams::default(),
    )
    .expect("load");
    assert_eq!(ds.dtype(), DType::U32);
    let want = reference(&small, small.scan.full(), small.det.full(), 1);
    assert_eq!(as_u64(&ds.to_host().expect("host")), want);
    let params = LoadParams {
        dtype: DtypeRequest::U16,
        ..LoadParams::default()
    };
    let ds16 = load(SourceArg::Path(small.master.clone()), &params).expect("narrow");
    assert_eq!(ds16.dtype(), DType::U16);
    assert_eq!(as_u64(&ds16.to_host().expect("host")), want);

    let dir2 = tempfile::tempdir().expect("tempdir");
    let big = write(
        dir2.path(),
        Shape2::new(2, 3),
        Shape2::new(6, 5),
        DType::U32,
        true,
    );
    let err = load(SourceArg::Path(big.master.clone()), &params).expect_err("must not narrow");
    assert_eq!(err.kind, ErrorKind::Overflow);
    assert!(err.frame.is_some(), "{err}");
    assert!(err.to_string().contains("does not fit u16"), "{err}");

    let params8 = LoadParams {
        dtype: DtypeRequest::U8Saturating,
        ..LoadParams::default()
    };
    let ds8 = load(SourceArg::Path(big.master.clone()), &params8).expect("u8");
    let want = reference(&big, big.scan.full(), big.det.full(), 1);
    let clipped = want.iter().filter(|&&v| v > 255).count() as u64;
    assert!(clipped > 0);
    assert_eq!(ds8.provenance().saturated_values, clipped);
    let got = as_u64(&ds8.to_host().expect("host"));
    assert_eq!(got, want.iter().map(|&v| v.min(255)).collect::<Vec<_>>());
}

#[test]
fn wrong_scan_shape_and_bad_arguments_are_typed_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = write(
        dir.path(),
        Shape2::new(3, 4),
        Shape2::new(8, 8),
        DType::U16,
        false,
    );
    let params = LoadParams {
        scan_shape: Some(Shape2::new(4, 4)),
        ..LoadParams::default()
    };
    let err = load(SourceArg::Path(w.master.clone()), &params).expect_err("wrong scan shape");
    assert_eq!(err.kind, ErrorKind::Source);
    assert!(err.expected.is_some() && err.found.is_some(), "{err}");
    let params = LoadParams {
        scan_region: Some(Region::new(0, 4, 0, 4)),
        ..LoadParams::default()
    };
    let err = load(SourceArg::Path(w.master.clone()), &params).expect_err("region outside");
    assert_eq!(err.kind, ErrorKind::InvalidArgument);
    let params = LoadParams {
        memory_budget: Some(100),
        ..LoadParams::default()
    };
    let err = load(SourceArg::Path(w.master.clone()), &params).expect_err("budget");
    assert_eq!(err.kind, ErrorKind::MemoryBudget);
    let params = LoadParams {
        backend: qem::BackendRequest::Cuda,
        ..LoadParams::default()
    };
    let err = load(SourceArg::Path(w.master.clone()), &params).expect_err("cuda");
    assert_eq!(err.kind, ErrorKind::BackendUnavailable);
}

#[test]
fn corrupt_and_truncated_chunks_name_file_and_frame() {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = write(
        dir.path(),
        Shape2::new(4, 4),
        Shape2::new(16, 16),
        DType::U16,
        false,
    );
    let src = qem_io::Source::open(&w.master, &qem_io::OpenOptions::default()).expect("open");
    // Corrupt the first LZ4 token of frame 9's chunk so that its literal run overruns.
    let rec = *src.chunk_of_frame(9).expect("chunk");
    let path = src.files[rec.file as usize].path.clone();
    let mut bytes = std::fs::read(&path).expect("read shard");
    let token = rec.offset as usize + 12 + 4;
    bytes[token] = 0xF0;
    bytes[token + 1] = 0xFF;
    bytes[token + 2] = 0xFF;
    std::fs::write(&path, &bytes).expect("write shard");
    let err = load(SourceArg::Path(w.master.clone()), &LoadParams::default()).expect_err("corrupt");
    assert_eq!(err.kind, ErrorKind::Decode, "{err}");
    assert_eq!(err.frame, Some(9), "{err}");
    assert_eq!(err.file.as_deref(), Some(path.as_path()), "{err}");
    // Loading a region that avoids frame 9 still works.
    let params = LoadParams {
        scan_region: Some(Region::new(0, 2, 0, 4)),
        ..LoadParams::default()
    };
    assert!(load(SourceArg::Path(w.master.clone()), &params).is_ok());

    // Truncate the shard holding frame 2 in the middle of its chunk. HDF5 itself notices the
    // shortened file when the shard is opened, so the error comes at open and names the shard.
    let rec = *src.chunk_of_frame(2).expect("chunk");
    let path = src.files[rec.file as usize].path.clone();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open shard");
    f.set_len(rec.offset + rec.size / 2).expect("truncate");
    drop(f);
    let err =
        load(SourceArg::Path(w.master.clone()), &LoadParams::default()).expect_err("truncated");
    assert_eq!(err.kind, ErrorKind::Source, "{err}");
    assert_eq!(err.file.as_deref(), Some(path.as_path()), "{err}");
    // A source opened before the truncation fails at the read, naming file and frame.
    let err = qem_cpu::load_dense(
        &src,
        Region::new(0, 1, 0, 4),
        &qem_cpu::FramePlan::new(src.detector_shape, None, 1, DType::U16, false, None)
            .expect("plan"),
        qem_cpu::LoadHooks {
            progress: &qem::NoProgress,
        },
    )
    .expect_err("short read");
    assert_eq!(err.frame, Some(2), "{err}");
    assert_eq!(err.file.as_deref(), Some(path.as_path()), "{err}");
}

#[test]
fn array_sources() {
    let det = Shape2::new(5, 4);
    let data: Vec<u16> = (0..6 * 20).map(|i| (i * 37 % 500) as u16).collect();
    let ds = load(
        SourceArg::Array {
            data: DenseArray::U16(data.clone()),
            shape: vec![2, 3, 5, 4],
        },
        &LoadParams::default(),
    )
    .expect("4-D array");
    assert_eq!(ds.shape(), [2, 3, 5, 4]);
    assert_eq!(&ds.to_host().expect("host"), &DenseArray::U16(data.clone()));
    let err = load(
        SourceArg::Array {
            data: DenseArray::U16(data.clone()),
            shape: vec![6, 5, 4],
        },
        &LoadParams::default(),
    )
    .expect_err("6 frames is not a square");
    assert_eq!(err.kind, ErrorKind::InvalidArgument);
    let params = LoadParams {
        scan_shape: Some(Shape2::new(3, 2)),
        det_bin: 2,
        ..LoadParams::default()
    };
    let ds = load(
        SourceArg::Array {
            data: DenseArray::U16(data.clone()),
            shape: vec![6, 5, 4],
        },
        &params,
    )
    .expect("3-D array with scan_shape");
    assert_eq!(ds.shape(), [3, 2, 3, 2]);
    // Frame 0, output pixel (2, 1) = source rows 4..5, cols 2..4 (a partial edge block).
    let f0: Vec<u64> = data[..20].iter().map(|&v| v as u64).collect();
    let want = f0[4 * 4 + 2] + f0[4 * 4 + 3];
    assert_eq!(ds.to_host().expect("host").get(2 * 2 + 1), Some(want));
    let _ = det;
}

/// Without a GPU: an explicit CUDA request is `BackendUnavailable` (never a CPU run), `auto`
/// runs on the CPU. With a GPU: CUDA loads equal CPU loads, element for element.
#[test]
fn cuda_requests_and_host_copies() {
    use qem::{resolve_backend, Backend, BackendRequest};
    let dir = tempfile::tempdir().expect("tempdir");
    let w = write(
        dir.path(),
        Shape2::new(3, 4),
        Shape2::new(9, 7),
        DType::U16,
        false,
    );
    let cpu = load(
        SourceArg::Path(w.master.clone()),
        &LoadParams {
            backend: BackendRequest::Cpu,
            ..LoadParams::default()
        },
    )
    .expect("cpu load");
    assert_eq!(cpu.backend(), Backend::Cpu);
    assert!(cpu.cuda_array().is_none());
    assert_eq!(&cpu.to_host().expect("host"), cpu.dense().expect("dense"));
    assert!(cpu.provenance().memory.is_none());
    let cuda_params = |region: Option<Region>, bin: usize| LoadParams {
        backend: BackendRequest::Cuda,
        scan_region: region,
        det_bin: bin,
        ..LoadParams::default()
    };
    match resolve_backend(BackendRequest::Cuda) {
        Err(e) => {
            assert_eq!(e.kind, ErrorKind::BackendUnavailable);
            assert_eq!(
                resolve_backend(BackendRequest::Auto).ok(),
                Some(Backend::Cpu)
            );
            let err = load(SourceArg::Path(w.master.clone()), &cuda_params(None, 1))
                .expect_err("no GPU here");
            assert_eq!(err.kind, ErrorKind::BackendUnavailable);
        }
        Ok(_) => {
            for (region, bin) in [
                (None, 1),
                (Some(Region::new(1, 3, 1, 4)), 1),
                (Some(Region::new(0, 2, 1, 3)), 2),
            ] {
                let gpu = load(SourceArg::Path(w.master.clone()), &cuda_params(region, bin))
                    .expect("cuda load");
                let host = load(
                    SourceArg::Path(w.master.clone()),
                    &LoadParams {
                        backend: BackendRequest::Cpu,
                        ..cuda_params(region, bin)
                    },
                )
                .expect("cpu load");
                assert_eq!(gpu.backend(), Backend::Cuda);
                assert!(gpu.dense().is_err());
                let view = gpu.cuda_array().expect("device array");
                assert_eq!(view.shape, host.shape());
                assert_eq!(view.dtype, host.dtype());
                assert_eq!(
                    &gpu.to_host().expect("download"),
                    host.dense().expect("dense")
                );
                assert_eq!(
                    gpu.frame(1, 1).expect("frame"),
                    host.frame(1, 1).expect("frame")
                );
                let m = gpu.provenance().memory.expect("memory report");
                assert!(m.process_peak_device_bytes >= gpu.nbytes_resident());
            }
        }
    }
}
