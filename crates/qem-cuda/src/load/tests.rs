//! Plan and pipeline tests (host only; the kernels emulated on the CPU where needed).

use std::fs::File;

use super::pipeline::overflow_error;
use super::plan::plan_source;
use super::reader::{read_batch, BatchInput, BatchTables};
use super::*;

use qem_core::{DenseArray, DetectorPlan, DtypeRequest, Shape2};
use qem_io::ChunkRecord;

fn rec(file: u32, offset: u64, size: u64, first_frame: u64, n: u32) -> ChunkRecord {
    ChunkRecord {
        file,
        offset,
        size,
        filter_mask: 0,
        first_frame,
        frames_in_chunk: n,
        valid_frames: n,
    }
}

fn locate(chunks: &[ChunkRecord]) -> impl Fn(u64) -> Result<usize> + '_ {
    move |f| {
        chunks
            .iter()
            .position(|c| f >= c.first_frame && f < c.first_frame + c.valid_frames as u64)
            .ok_or_else(|| Error::source("locate", "missing"))
    }
}

#[test]
fn batches_follow_file_order_and_the_byte_limit() {
    // 8 one-frame chunks spread over 2 files, listed in frame order but stored out of order.
    let chunks: Vec<ChunkRecord> = (0..8u64)
        .map(|i| rec((i % 2) as u32, 1000 - i * 100, 40 + i, i, 1))
        .collect();
    let frames: Vec<u64> = (0..8).collect();
    let p = plan_chunks(&chunks, &frames, 64, locate(&chunks), 100, None).unwrap();
    // Sorted by (file, offset).
    let keys: Vec<(u32, u64)> = p
        .chunks
        .iter()
        .map(|c| (c.rec.file, c.rec.offset))
        .collect();
    let mut sorted = keys.clone();
    sorted.sort();
    assert_eq!(keys, sorted);
    // Every batch ≤ 100 bytes unless a single chunk; every chunk in exactly one batch.
    let mut covered = 0;
    for b in &p.batches {
        assert!(b.in_bytes <= 100 || b.chunks.len() == 1);
        assert_eq!(b.chunks.start, covered);
        covered = b.chunks.end;
        let sum: u64 = p.chunks[b.chunks.clone()].iter().map(|c| c.rec.size).sum();
        assert_eq!(sum, b.in_bytes);
        assert_eq!(b.decoded_bytes, 64 * b.chunks.len() as u64);
    }
    assert_eq!(covered, 8);
    // Result positions: frame i is result i.
    for pc in &p.chunks {
        assert_eq!(p.dst_frames[pc.dst_start] as u64, pc.rec.first_frame);
    }
    assert!(p.chunks_map_contiguously());
    assert_eq!(
        p.max_in_bytes,
        p.batches.iter().map(|b| b.in_bytes).max().unwrap()
    );
}

#[test]
fn scan_regions_read_only_needed_chunks() {
    let scan = Shape2::new(4, 4);
    let chunks: Vec<ChunkRecord> = (0..16u64).map(|i| rec(0, i * 10, 10, i, 1)).collect();
    let frames = region_frames(scan, Region::new(1, 3, 2, 4));
    assert_eq!(frames, vec![6, 7, 10, 11]);
    let p = plan_chunks(&chunks, &frames, 8, locate(&chunks), 1 << 20, None).unwrap();
    assert_eq!(p.chunks.len(), 4);
    let got: Vec<(u64, u32)> = p
        .chunks
        .iter()
        .map(|c| (c.rec.first_frame, p.dst_frames[c.dst_start]))
        .collect();
    assert_eq!(got, vec![(6, 0), (7, 1), (10, 2), (11, 3)]);
    assert_eq!(p.batches.len(), 1);
    assert!(p.chunks_map_contiguously());
}

#[test]
fn multi_frame_chunks_with_unwanted_frames_need_scratch() {
    // 4-frame chunks; a region taking frames 1..3 of the first chunk.
    let chunks = vec![rec(0, 0, 100, 0, 4), rec(0, 100, 100, 4, 4)];
    let frames = vec![1, 2, 5];
    let p = plan_chunks(&chunks, &frames, 16, locate(&chunks), 1 << 20, Some(64)).unwrap();
    assert_eq!(
        p.dst_frames,
        vec![u32::MAX, 0, 1, u32::MAX, u32::MAX, 2, u32::MAX, u32::MAX]
    );
    assert!(!p.chunks_map_contiguously());
    // Scratch limit 64 bytes = one 4-frame chunk per batch.
    assert_eq!(p.batches.len(), 2);
    assert_eq!(p.max_decoded_bytes, 64);
    assert_eq!(p.batches[1].frames, 4);
}

/// The one-pass plan of ascending frames gives the general plan's chunks and frame map, for
/// one-frame and multi-frame chunks over two files, whole scans, regions and a spread sample;
/// and it declines frames out of order and chunks stored out of frame order.
#[test]
fn the_ascending_plan_equals_the_general_plan() {
    let scan = Shape2::new(6, 8);
    let layouts: Vec<Vec<ChunkRecord>> = vec![
        (0..48u64)
            .map(|i| rec((i / 20) as u32, 100 + (i % 20) * 30, 30, i, 1))
            .collect(),
        (0..12u64)
            .map(|i| rec((i / 5) as u32, (i % 5) * 70, 70, 4 * i, 4))
            .collect(),
    ];
    let frame_lists: Vec<Vec<u64>> = vec![
        region_frames(scan, scan.full()),
        region_frames(scan, Region::new(1, 5, 2, 7)),
        vec![0, 5, 11, 17, 23, 29, 35, 47],
    ];
    for chunks in &layouts {
        let chunk_of = |_: usize, n: u64| locate(chunks)(n);
        for frames in &frame_lists {
            let fast = super::plan::ascending_plan(chunks, frames, &chunk_of)
                .unwrap()
                .expect("ascending frames over chunks in file order");
            let general = super::plan::general_plan(chunks, frames, &chunk_of).unwrap();
            assert_eq!(fast, general, "{frames:?}");
            // Every wanted frame is mapped once, to its result position.
            let mapped: Vec<u32> = fast.1.iter().copied().filter(|&f| f != u32::MAX).collect();
            assert_eq!(mapped, (0..frames.len() as u32).collect::<Vec<_>>());
        }
        let shuffled = vec![5u64, 0, 11];
        assert!(super::plan::ascending_plan(chunks, &shuffled, &chunk_of)
            .unwrap()
            .is_none());
    }
    // Stored in reverse: the general plan (sorted by file and offset) is needed.
    let reversed: Vec<ChunkRecord> = (0..8u64).map(|i| rec(0, 800 - i * 100, 10, i, 1)).collect();
    let chunk_of = |_: usize, n: u64| locate(&reversed)(n);
    let frames: Vec<u64> = (0..8).collect();
    assert!(super::plan::ascending_plan(&reversed, &frames, &chunk_of)
        .unwrap()
        .is_none());
}

#[test]
fn missing_frames_fail_in_the_plan() {
    let chunks = vec![rec(0, 0, 10, 0, 1)];
    let e = plan_chunks(&chunks, &[0, 1], 8, locate(&chunks), 100, None).unwrap_err();
    assert_eq!(e.kind, qem_core::ErrorKind::Source);
}

#[test]
fn admission_names_both_numbers() {
    let gib = 1u64 << 30;
    // Fits: 10 GiB planned, 100 GiB free, 256 MiB reserve.
    assert_eq!(
        admit(10 * gib, None, 100 * gib, 256 << 20).unwrap(),
        100 * gib - (256 << 20)
    );
    // Budget binds.
    let e = admit(10 * gib, Some(8 * gib), 100 * gib, 256 << 20).unwrap_err();
    assert_eq!(e.kind, qem_core::ErrorKind::MemoryBudget);
    let s = e.to_string();
    assert!(
        s.contains(&(10 * gib).to_string()) || s.contains("10.0"),
        "{s}"
    );
    assert!(s.contains("memory_budget"), "{s}");
    // Free memory binds.
    let e = admit(10 * gib, Some(50 * gib), 9 * gib, 256 << 20).unwrap_err();
    assert!(e.to_string().contains("free memory"), "{e}");
    // Reserve larger than free: nothing fits.
    assert!(admit(1, None, 100, 256).is_err());
    let m = MemoryPlan {
        destination: 1,
        input: 2,
        tables: 3,
        scratch: 4,
        status: 5,
        small: 6,
    };
    assert_eq!(m.total(), 21);
}

/// The host half of the pipeline (plan, batched coalesced reads, descriptor tables) run
/// against a CPU emulation of the kernels' descriptor semantics (LZ4 block + bit
/// un-transpose to `out + out_offset`, raw copies, region/bin by `DetectorPlan::source_block`,
/// mask), compared with the CPU engine. Exercises direct decode, scan regions, binning,
/// multi-frame chunks with a partial last chunk, and narrowing.
#[test]
fn host_pipeline_with_emulated_kernels_matches_the_cpu_engine() {
    use qem_io::writer::{
        write_acquisition, Calibration, WriteCompression, WriteLayout, WriteParams,
    };
    let dir = tempfile::tempdir().unwrap();
    let scan = Shape2::new(5, 7);
    let det = Shape2::new(13, 11);
    let mut mask = vec![0u32; det.len()];
    mask[det.len() / 3] = 1;
    mask[det.len() - 1] = 8;
    let value = |f: u64, p: usize, big: bool| -> u32 {
        let x = (f as u32).wrapping_mul(2_654_435_761) ^ (p as u32).wrapping_mul(40_503);
        match x % 100 {
            0..=59 => 0,
            60..=97 => x % 9,
            _ if big => 70_000 + x % 1000,
            _ => 60_000 + x % 1000,
        }
    };
    for (dtype, fpc, name) in [(DType::U16, 1, "a"), (DType::U32, 3, "b")] {
        let big = dtype == DType::U32;
        let params = WriteParams {
            prefix: dir.path().join(name),
            scan_shape: scan,
            detector_shape: det,
            dtype,
            frames_per_file: 8,
            frames_per_chunk: fpc,
            block_elems: 0,
            compression: WriteCompression::Bslz4,
            layout: WriteLayout::Shards,
            pixel_mask: Some(mask.clone()),
            calibration: Calibration::default(),
            skip_frames: Vec::new(),
            write_scan_shape: true,
        };
        let written = write_acquisition(&params, |f, out: &mut [u8]| {
            let es = dtype.size();
            for (p, o) in out.chunks_exact_mut(es).enumerate() {
                let v = value(f, p, big);
                o.copy_from_slice(&v.to_le_bytes()[..es]);
            }
        })
        .unwrap();
        let src = Source::open(&written.master, &qem_io::OpenOptions::default()).unwrap();
        let bad = src.bad_pixel_mask();
        let cases = [
            (scan.full(), 1, DtypeRequest::Native),
            (Region::new(1, 4, 2, 6), 1, DtypeRequest::Native),
            (Region::new(1, 4, 2, 6), 2, DtypeRequest::Native),
            (scan.full(), 3, DtypeRequest::U8Saturating),
            (scan.full(), 1, DtypeRequest::U16),
        ];
        for (region, bin, req) in cases {
            let rd = req.result_dtype(dtype, dtype.max_value() * (bin * bin) as u64);
            let saturate = req == DtypeRequest::U8Saturating;
            let fp = qem_cpu::FramePlan::new(det, None, bin, rd, saturate, bad.as_deref()).unwrap();
            let cpu = qem_cpu::load_dense(
                &src,
                region,
                &fp,
                qem_cpu::LoadHooks {
                    progress: &qem_core::NoProgress,
                },
            );
            let emu = emulate(&src, region, bin, rd, saturate, bad.as_deref());
            match (cpu, emu) {
                (Ok(c), Ok((bytes, direct))) => {
                    let want: Vec<u8> = match &c.data {
                        DenseArray::U8(v) => v.clone(),
                        DenseArray::U16(v) => bytemuck::cast_slice(v).to_vec(),
                        DenseArray::U32(v) => bytemuck::cast_slice(v).to_vec(),
                    };
                    assert!(
                        bytes == want,
                        "{name} {region} bin {bin} {rd} direct {direct}"
                    );
                    let expect_direct = bin == 1 && rd == dtype && fpc == 1;
                    assert_eq!(direct, expect_direct, "{name} {region} bin {bin}");
                }
                (Err(c), Err(g)) => assert_eq!(c.kind, g.kind, "{c} / {g}"),
                (c, g) => {
                    panic!("{name} {region} bin {bin} {rd}: cpu {c:?} vs emulation {g:?}")
                }
            }
        }
    }
}

/// The pipeline's host half with the kernels emulated on the CPU.
fn emulate(
    src: &Source,
    region: Region,
    bin: usize,
    rd: DType,
    saturate: bool,
    bad: Option<&[bool]>,
) -> Result<(Vec<u8>, bool)> {
    use qem_codec::bitshuffle::untranspose_block;
    use qem_codec::lz4::decompress_block_exact;
    let rplan = DetectorPlan::new(src.detector_shape, None, bin)?;
    let identity = rplan.is_identity(src.dtype, rd);
    // Tiny batches and scratch so that there are many of each.
    let opts = PipelineOptions {
        reader_threads: 3,
        batch_bytes: 700,
        max_scratch_bytes: 4 * src.frame_bytes() as u64,
        ..PipelineOptions::default()
    };
    let (plan, direct) = plan_source(src, &region_frames(src.scan_shape, region), identity, &opts)?;
    let files: Vec<File> = src
        .files
        .iter()
        .map(|f| File::open(&f.path).unwrap())
        .collect();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let es = src.dtype.size();
    let out_es = rd.size();
    let frame_bytes = src.frame_bytes() as u64;
    let out_frame_elems = rplan.output.len();
    let mut dest = vec![0u8; plan.frames.len() * out_frame_elems * out_es];
    for batch in &plan.batches {
        let mut slot = vec![0xA5u8; batch.in_bytes as usize + 64];
        let mut tables = BatchTables::default();
        read_batch(
            &BatchInput {
                src,
                files: &files,
                plan: &plan,
                batch,
                direct,
                frame_bytes,
                out_frame_bytes: (out_frame_elems * out_es) as u64,
                threads: 3,
            },
            &mut slot,
            &pool,
            &mut tables,
        )?;
        // The words as the slot holds them: block descriptors, then copy descriptors.
        let mut words = vec![0u32; tables.words()];
        tables.pack(&mut words, &pool);
        let (blocks, copies) = words.split_at(tables.block_words());
        assert_eq!(blocks.len(), 8 * tables.n_blocks());
        assert_eq!(copies.len(), 8 * tables.n_copies());
        let mut scratch = vec![0u8; batch.decoded_bytes as usize];
        let out: &mut [u8] = if direct { &mut dest } else { &mut scratch };
        let mut tmp = Vec::new();
        for d in blocks.chunks_exact(8) {
            let p = (d[0] as u64 | (d[1] as u64) << 32) as usize;
            let o = (d[4] as u64 | (d[5] as u64) << 32) as usize;
            let (plen, olen) = (d[2] as usize, d[3] as usize);
            assert!((d[6] as usize) < plan.chunks.len());
            tmp.resize(olen, 0);
            decompress_block_exact(&slot[p..p + plen], &mut tmp).unwrap();
            untranspose_block(&tmp, es, &mut out[o..o + olen]).unwrap();
        }
        for d in copies.chunks_exact(8) {
            let sa = (d[0] as u64 | (d[1] as u64) << 32) as usize;
            let da = (d[2] as u64 | (d[3] as u64) << 32) as usize;
            let n = d[4] as usize;
            out[da..da + n].copy_from_slice(&slot[sa..sa + n]);
        }
        if !direct {
            let pcs = &plan.chunks[batch.chunks.clone()];
            let a = pcs[0].dst_start;
            let b = pcs
                .last()
                .map_or(a, |p| p.dst_start + p.rec.frames_in_chunk as usize);
            let get = |j: usize, k: usize| -> u64 {
                let at = (j * rplan.source.len() + k) * es;
                let mut w = [0u8; 8];
                w[..es].copy_from_slice(&scratch[at..at + es]);
                u64::from_le_bytes(w)
            };
            for (j, &df) in plan.dst_frames[a..b].iter().enumerate() {
                if df == u32::MAX {
                    continue;
                }
                for orow in 0..rplan.output.rows {
                    for ocol in 0..rplan.output.cols {
                        let ((r0, r1), (c0, c1)) = rplan.source_block(orow, ocol);
                        let mut acc = 0u64;
                        for r in r0..r1 {
                            for c in c0..c1 {
                                let k = r * rplan.source.cols + c;
                                if bad.is_some_and(|m| m[k]) {
                                    continue;
                                }
                                acc += get(j, k);
                            }
                        }
                        let v = if acc <= rd.max_value() {
                            acc
                        } else if saturate {
                            rd.max_value()
                        } else {
                            return Err(overflow_error(
                                plan.frames[df as usize],
                                orow as u32,
                                ocol as u32,
                                acc,
                                rd,
                            ));
                        };
                        let at = (df as usize * out_frame_elems + orow * rplan.output.cols + ocol)
                            * out_es;
                        dest[at..at + out_es].copy_from_slice(&v.to_le_bytes()[..out_es]);
                    }
                }
            }
        }
    }
    if direct {
        if let Some(m) = bad {
            for f in 0..plan.frames.len() {
                for (k, _) in m.iter().enumerate().filter(|(_, &b)| b) {
                    let at = (f * out_frame_elems + k) * out_es;
                    dest[at..at + out_es].fill(0);
                }
            }
        }
    }
    Ok((dest, direct))
}

#[test]
fn without_a_gpu_loads_are_backend_unavailable() {
    if crate::device::probe().is_ok() {
        return;
    }
    let data = DenseArray::U16(vec![1; 4 * 4]);
    let p = GpuLoadParams {
        scan_region: Region::new(0, 2, 0, 2),
        detector: DetectorPlan::new(Shape2::new(2, 2), None, 1).unwrap(),
        result_dtype: DType::U16,
        saturate: false,
        bad_mask: None,
        memory_budget: None,
        options: PipelineOptions::default(),
        progress: None,
    };
    let e = load_array(&data, Shape2::new(2, 2), Shape2::new(2, 2), &p).unwrap_err();
    assert_eq!(e.kind, qem_core::ErrorKind::BackendUnavailable);
}
