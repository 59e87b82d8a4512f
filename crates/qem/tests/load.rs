//! End-to-end loads through the façade: files written by our Dectris writer, compared against the
//! generating data with an independent naive reference (u64 sums written here, not by the engine).
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic on setup failures

mod common;

use common::{as_u64, load_path, mix, reference, reference_full, sparse_count, Dims, Written};
use qem::{
    load, DType, DenseArray, DtypeRequest, ErrorKind, LoadParams, Region, Shape2, SourceArg,
};
use std::path::Path;

/// Deterministic pseudo-random counts: mostly small, some large, a few above u16 for u32 data.
fn value(frame: u64, pixel: usize, big: bool) -> u32 {
    if big && frame == 1 && pixel == 0 {
        return 123_456; // guaranteed above u16
    }
    sparse_count(mix(frame, pixel), 998, |x| {
        (x % 1000) as u32 + if big { 70_000 } else { 60_000 }
    })
}

/// `scan × det` frames of [`value`] written as `dtype` into `dir`, with a mask of two bad pixels.
fn write(dir: &Path, scan: Dims, det: Dims, dtype: DType, big: bool) -> Written {
    common::write(dir, scan, det, dtype, move |f, p| value(f, p, big))
}

#[test]
fn full_load_matches_source_with_mask_rectangular_uneven_shards() {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = write(dir.path(), (5, 7), (13, 11), DType::U16, false);
    let ds = load_path(&w.master, &LoadParams::default()).expect("load");
    assert_eq!(ds.shape(), [5, 7, 13, 11]);
    assert_eq!(ds.dtype(), DType::U16);
    let want = reference_full(&w);
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
    let w = write(dir.path(), (3, 4), (8, 8), DType::U16, false);
    let params = LoadParams {
        apply_mask: false,
        ..LoadParams::default()
    };
    let ds = load_path(&w.master, &params).expect("load");
    let want: Vec<u64> = w.data.iter().map(|&v| v as u64).collect();
    assert_eq!(as_u64(&ds.to_host().expect("host")), want);
    assert!(!ds.provenance().mask_policy.applied);
}

#[test]
fn regions_and_binning_match_naive_reference() {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = write(dir.path(), (6, 5), (15, 13), DType::U16, false);
    for (sr, dr, bin) in common::REGION_CASES {
        let params = LoadParams {
            scan_region: Some(sr),
            detector_region: Some(dr),
            det_bin: bin,
            ..LoadParams::default()
        };
        let ds = load_path(&w.master, &params).expect("load");
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
    let small = write(dir.path(), (2, 3), (6, 5), DType::U32, false);
    let ds = load_path(&small.master, &LoadParams::default()).expect("load");
    assert_eq!(ds.dtype(), DType::U32);
    let want = reference_full(&small);
    assert_eq!(as_u64(&ds.to_host().expect("host")), want);
    let params = LoadParams {
        dtype: DtypeRequest::U16,
        ..LoadParams::default()
    };
    let ds16 = load_path(&small.master, &params).expect("narrow");
    assert_eq!(ds16.dtype(), DType::U16);
    assert_eq!(as_u64(&ds16.to_host().expect("host")), want);

    let dir2 = tempfile::tempdir().expect("tempdir");
    let big = write(dir2.path(), (2, 3), (6, 5), DType::U32, true);
    let err = load_path(&big.master, &params).expect_err("must not narrow");
    assert_eq!(err.kind, ErrorKind::Overflow);
    assert!(err.frame.is_some(), "{err}");
    assert!(err.to_string().contains("does not fit u16"), "{err}");

    let params8 = LoadParams {
        dtype: DtypeRequest::U8Saturating,
        ..LoadParams::default()
    };
    let ds8 = load_path(&big.master, &params8).expect("u8");
    let want = reference_full(&big);
    let clipped = want.iter().filter(|&&v| v > 255).count() as u64;
    assert!(clipped > 0);
    assert_eq!(ds8.provenance().saturated_values, clipped);
    let got = as_u64(&ds8.to_host().expect("host"));
    assert_eq!(got, want.iter().map(|&v| v.min(255)).collect::<Vec<_>>());
}

#[test]
fn wrong_scan_shape_and_bad_arguments_are_typed_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = write(dir.path(), (3, 4), (8, 8), DType::U16, false);
    let params = LoadParams {
        scan_shape: Some(Shape2::new(4, 4)),
        ..LoadParams::default()
    };
    let err = load_path(&w.master, &params).expect_err("wrong scan shape");
    assert_eq!(err.kind, ErrorKind::Source);
    assert!(err.expected.is_some() && err.found.is_some(), "{err}");
    let params = LoadParams {
        scan_region: Some(Region::new(0, 4, 0, 4)),
        ..LoadParams::default()
    };
    let err = load_path(&w.master, &params).expect_err("region outside");
    assert_eq!(err.kind, ErrorKind::InvalidArgument);
    let params = LoadParams {
        memory_budget: Some(100),
        ..LoadParams::default()
    };
    let err = load_path(&w.master, &params).expect_err("budget");
    assert_eq!(err.kind, ErrorKind::MemoryBudget);
    let params = LoadParams {
        backend: qem::BackendRequest::Cuda,
        ..LoadParams::default()
    };
    let err = load_path(&w.master, &params).expect_err("cuda");
    assert_eq!(err.kind, ErrorKind::BackendUnavailable);
}

#[test]
fn corrupt_and_truncated_chunks_name_file_and_frame() {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = write(dir.path(), (4, 4), (16, 16), DType::U16, false);
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
    let err = load_path(&w.master, &LoadParams::default()).expect_err("corrupt");
    assert_eq!(err.kind, ErrorKind::Decode, "{err}");
    assert_eq!(err.frame, Some(9), "{err}");
    assert_eq!(err.file.as_deref(), Some(path.as_path()), "{err}");
    // Loading a region that avoids frame 9 still works.
    let params = LoadParams {
        scan_region: Some(Region::new(0, 2, 0, 4)),
        ..LoadParams::default()
    };
    assert!(load_path(&w.master, &params).is_ok());

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
    let err = load_path(&w.master, &LoadParams::default()).expect_err("truncated");
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
    let w = write(dir.path(), (3, 4), (9, 7), DType::U16, false);
    let cpu = load_path(
        &w.master,
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
            let err = load_path(&w.master, &cuda_params(None, 1)).expect_err("no GPU here");
            assert_eq!(err.kind, ErrorKind::BackendUnavailable);
        }
        Ok(_) => {
            for (region, bin) in [
                (None, 1),
                (Some(Region::new(1, 3, 1, 4)), 1),
                (Some(Region::new(0, 2, 1, 3)), 2),
            ] {
                let gpu = load_path(&w.master, &cuda_params(region, bin)).expect("cuda load");
                let host = load_path(
                    &w.master,
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
