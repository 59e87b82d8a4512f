//! `qem-cuda-rans-check`: the GPU rANS codec against the CPU specification (`qem_codec::rans`).
//!
//! ```text
//! qem-cuda-rans-check [--out DIR] [--frames N] [--load MASTER [--repeats R] [--qem PATH]]
//! ```
//! Part A (generated frames, always): for reference-recipe frames at several doses and an odd
//! detector, the model fitted on the GPU must equal the CPU fit of the same frames; every
//! GPU-encoded stream must equal the CPU's `encode_stream` byte for byte; GPU decode must
//! return the frames; the fused per-frame sum and hash must equal the CPU's; ~2,000 mutated
//! streams must get the CPU decoder's verdict (accepted or rejected) stream by stream. Encode and
//! decode throughput are timed with events.
//!
//! Part B (`--load`): the acquisition is loaded **encoded** (`load_source_encoded`): one
//! warm-up and R timed loads (p50, stage timings, memory), then sizes against the bslz4 bytes,
//! decode throughput (dense output and the fused sum), the fused hash of every frame against
//! the CPU engine's frames, a byte-exact comparison of every 64th GPU stream with the CPU
//! encoder's, and a `.qem` write and warm reopen straight to the device.
//!
//! Writes `rans_check.json` to `--out`; exits 1 when any check failed, 4 without CUDA.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use qem_bench::timing::p50;
use qem_codec::qem_file::{QemFile, QemWriter, StreamEntry};
use qem_codec::rans::{self, CountsModel, FloorPolicy, ModelParams};
use qem_core::{DType, Error, Region, Result, Shape2};
use qem_cpu::{FramePlan, LoadHooks};
use qem_cuda::mem::{DevBuf, MemCounter};
use qem_cuda::rans::{
    fit_on_device, frame_hash, launch_encode, DeviceEncoded, DeviceModel, EncodeArgs,
    EncoderScratch, FrameReduce, RansKernels,
};
use qem_cuda::{engine, load_source_encoded, EncodeOptions, Gpu};
use qem_io::{OpenOptions, Source};
use qem_sim::{ReferenceParams, ReferencePattern};
use rayon::prelude::*;
use serde_json::{json, Value};

struct Args {
    out: PathBuf,
    frames: u64,
    load: Option<PathBuf>,
    repeats: usize,
    qem: PathBuf,
    /// Model overrides for Part B (A/B runs of speed against size): contexts, literals, rule.
    contexts: Option<u8>,
    literals: Option<u8>,
    quantiles: bool,
    /// Part B: parse the LZ4 payloads from shared memory (`PipelineOptions::stage_payload`).
    lz4_stage: bool,
    /// Part B: decode beside encode on two compute streams (`PipelineOptions::overlap_encode`).
    overlap: bool,
}

fn usage() -> ! {
    eprintln!(
        "usage: qem-cuda-rans-check [--out DIR] [--frames N] [--load MASTER [--repeats R] [--qem PATH] [--contexts C] [--literals K] [--rule quantiles|logbins] [--lz4-stage on|off] [--overlap on|off]]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut a = Args {
        out: PathBuf::from("."),
        frames: 2048,
        load: None,
        repeats: 5,
        qem: PathBuf::from("/tmp/rans_check.qem"),
        contexts: None,
        literals: None,
        quantiles: false,
        lz4_stage: false,
        overlap: false,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let v = argv.get(i + 1).cloned().unwrap_or_else(|| usage());
        match argv[i].as_str() {
            "--out" => a.out = PathBuf::from(v),
            "--frames" => a.frames = v.parse().unwrap_or_else(|_| usage()),
            "--load" => a.load = Some(PathBuf::from(v)),
            "--repeats" => a.repeats = v.parse::<usize>().unwrap_or_else(|_| usage()).max(1),
            "--qem" => a.qem = PathBuf::from(v),
            "--contexts" => a.contexts = Some(v.parse().unwrap_or_else(|_| usage())),
            "--literals" => a.literals = Some(v.parse().unwrap_or_else(|_| usage())),
            "--lz4-stage" => a.lz4_stage = qem_bench::on_off(&v).unwrap_or_else(|| usage()),
            "--overlap" => a.overlap = qem_bench::on_off(&v).unwrap_or_else(|| usage()),
            "--rule" => {
                a.quantiles = match v.as_str() {
                    "quantiles" => true,
                    "logbins" => false,
                    _ => usage(),
                }
            }
            _ => usage(),
        }
        i += 2;
    }
    a
}

/// Reference-recipe frames spread over the scan, bad pixels zeroed (as the loader does).
fn make_frames(detector: Shape2, dose: f64, radius: f64, n: u64) -> Result<Vec<u16>> {
    let pat = ReferencePattern::new(ReferenceParams {
        detector_shape: detector,
        dose_e_per_frame: dose,
        radius_px: radius,
        ..ReferenceParams::default()
    })?;
    let len = detector.len();
    let total = pat.frames();
    let pick = qem_cuda::rans::sample_frames(total, n);
    let frames: Vec<Vec<u16>> = pick
        .par_iter()
        .map(|&f| {
            let mut lam = vec![0f32; len];
            let mut out = vec![0u32; len];
            pat.loaded_frame(f, &mut lam, &mut out)
        })
        .collect();
    Ok(frames.concat())
}

fn upload_u16(gpu: &Gpu, v: &[u16], what: &str) -> Result<DevBuf> {
    let b = DevBuf::alloc(gpu.ctx(), v.len() * 2, None, what)?;
    b.write(0, bytemuck::cast_slice(v))?;
    Ok(b)
}

/// What one encoder launch left: the arena, the index, the fault record, the arena cursor
/// (bytes allocated, overflowing streams included) and the launch's milliseconds.
struct Launched {
    arena: DevBuf,
    index: DevBuf,
    fault: Option<qem_cuda::rans::RansFaultRecord>,
    used: u64,
    ms: f32,
}

/// Encode `n` frames at `frames` on the GPU with `dm` into a fresh arena of `capacity` bytes
/// (0: no stream is written, every one only counted, as the encoded load sizes its arena).
fn launch_into(
    k: &RansKernels,
    dm: &DeviceModel,
    frames: &DevBuf,
    n: u64,
    shape: Shape2,
    capacity: u64,
) -> Result<Launched> {
    let e = engine()?;
    let ctx = e.gpu.ctx();
    let arena = DevBuf::alloc(ctx, capacity.max(16) as usize, None, "arena")?;
    let index = DevBuf::alloc(ctx, (n * 16) as usize, None, "index")?;
    let err = DevBuf::alloc(ctx, 64, None, "err")?;
    err.zero()?;
    let scratch = EncoderScratch::new(ctx, k, shape.len(), None)?;
    let (sw, warps) = scratch.parts();
    let a = EncodeArgs {
        frames: frames.ptr(),
        n_frames: n,
        dst: 0,
        dst_base: 0,
        bad: 0,
        arena: arena.ptr(),
        capacity,
        cursor: err.ptr() + 32,
        index: index.ptr(),
        scratch_words: sw,
        scratch_warps: warps,
        err: err.ptr(),
    };
    let ms = e.gpu.time_ms(|| {
        // SAFETY: frames holds n frames of `len` u16; the arena holds `capacity` bytes (the
        // kernel checks every write against it); index n entries; all alive until time_ms has
        // synchronized.
        unsafe { launch_encode(k, e.gpu.stream(), dm, &a) }
    })?;
    let mut w = [0u8; 40];
    err.read(0, &mut w)?;
    Ok(Launched {
        arena,
        index,
        fault: qem_cuda::rans::fault_from_words(bytemuck::cast_slice(&w[..32])),
        used: u64::from_le_bytes(w[32..40].try_into().unwrap_or([0; 8])),
        ms,
    })
}

/// Encode `n` frames at `frames` on the GPU into a fresh arena; (encoded, encode seconds).
fn gpu_encode(
    k: &RansKernels,
    model: CountsModel,
    frames: &DevBuf,
    n: u64,
    shape: Shape2,
) -> Result<(DeviceEncoded, f64)> {
    let e = engine()?;
    let dm = DeviceModel::upload(e.gpu.ctx(), model, None)?;
    let worst = (rans::STREAM_HEADER_BYTES as u64 + 4 * shape.len() as u64).next_multiple_of(16);
    let l = launch_into(k, &dm, frames, n, shape, worst * n)?;
    if let Some(f) = l.fault {
        return Err(qem_cuda::rans::fault_error(&f, f.frame));
    }
    let enc =
        DeviceEncoded::from_parts(dm, l.arena, l.used, l.index, n, shape, e.gpu.info().ordinal);
    Ok((enc, f64::from(l.ms) / 1e3))
}

struct Case {
    name: &'static str,
    detector: Shape2,
    dose: f64,
    radius: f64,
    params: ModelParams,
}

fn run_case(k: &RansKernels, c: &Case, n: u64) -> Result<(Value, bool)> {
    let e = engine()?;
    let len = c.detector.len();
    let frames = make_frames(c.detector, c.dose, c.radius, n)?;
    let n = (frames.len() / len) as u64;
    let slices: Vec<&[u16]> = frames.chunks_exact(len).collect();
    // CPU reference: fit and encode.
    let t = Instant::now();
    let cpu_model = CountsModel::fit(slices.iter().copied(), len, &c.params)
        .map_err(|er| Error::invalid("cpu fit", er.to_string()))?;
    let cpu_fit_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let cpu_streams: Vec<Vec<u8>> = slices
        .par_iter()
        .map(|f| rans::encode_stream(&cpu_model, f))
        .collect::<std::result::Result<_, _>>()
        .map_err(|er| Error::invalid("cpu encode", er.to_string()))?;
    let cpu_enc_s = t.elapsed().as_secs_f64();
    let stream_bytes: u64 = cpu_streams.iter().map(|s| s.len() as u64).sum();
    let bslz4_bytes: u64 = slices
        .par_iter()
        .map(|f| {
            qem_codec::bslz4::encode_chunk(bytemuck::cast_slice(f), 2, 0)
                .map(|v| v.len() as u64)
                .unwrap_or(0)
        })
        .sum();
    // GPU fit of the same frames.
    let d_frames = upload_u16(&e.gpu, &frames, "frames")?;
    let t = Instant::now();
    let gpu_model = fit_on_device(&e.gpu, k, d_frames.ptr(), n, len, &c.params)?;
    let gpu_fit_s = t.elapsed().as_secs_f64();
    let model_equal = gpu_model == cpu_model;
    // GPU encode with the CPU model; streams byte-exact.
    let (enc, enc_s) = gpu_encode(k, cpu_model.clone(), &d_frames, n, c.detector)?;
    let (_, host_streams) = enc.to_host()?;
    let (idx, _) = enc.to_host()?;
    let mut stream_mismatch = 0u64;
    for (i, s) in cpu_streams.iter().enumerate() {
        let e = idx[i];
        let g = &host_streams[e.offset as usize..e.offset as usize + e.length as usize];
        if g != s.as_slice() {
            stream_mismatch += 1;
        }
    }
    // Count-only encode (capacity 0, how an encoded load sizes its arena from its sample):
    // every stream overflows and the cursor must equal the CPU streams' 16-byte-rounded sizes.
    let counted = {
        let dm = DeviceModel::upload(e.gpu.ctx(), cpu_model.clone(), None)?;
        let l = launch_into(k, &dm, &d_frames, n, c.detector, 0)?;
        let overflowed = l
            .fault
            .map_or(0, |f| if f.code == 0 { f.overflowed } else { 0 });
        (overflowed as u64, l.used)
    };
    let cpu_rounded: u64 = cpu_streams
        .iter()
        .map(|s| (s.len() as u64).next_multiple_of(qem_cuda::rans::STREAM_ALIGN))
        .sum();
    let count_equal = counted == (n, cpu_rounded);
    // GPU decode: dense frames, fused sums and hashes.
    let t = Instant::now();
    let decoded = enc.download_frames(&e.gpu, k, 0, n)?;
    let dl_s = t.elapsed().as_secs_f64();
    let decode_equal = decoded == frames;
    let dec_s = enc.time_decode_all(&e.gpu, k, n)?;
    let sums = enc.frame_sums(&e.gpu, k)?;
    let hashes = enc.frame_hashes(&e.gpu, k)?;
    let cpu_sums: Vec<u64> = slices
        .iter()
        .map(|f| f.iter().map(|&v| u64::from(v)).sum())
        .collect();
    let cpu_hashes: Vec<u64> = slices.iter().map(|f| frame_hash(f)).collect();
    let sums_equal = sums == cpu_sums;
    let hashes_equal = hashes == cpu_hashes;
    let raw = n * len as u64 * 2;
    let pass = model_equal
        && stream_mismatch == 0
        && count_equal
        && decode_equal
        && sums_equal
        && hashes_equal;
    println!(
        "{:<22} n={n:<5} model {} | streams {} ({} differ, count-only {}) | decode {} | sums {} | hashes {} | ratio vs bslz4 {:.3} | enc {:.1} GB/s dec {:.1} GB/s (u16) -> {}",
        c.name,
        if model_equal { "=" } else { "DIFF" },
        cpu_streams.len(),
        stream_mismatch,
        if count_equal { "=" } else { "DIFF" },
        if decode_equal { "exact" } else { "DIFF" },
        if sums_equal { "=" } else { "DIFF" },
        if hashes_equal { "=" } else { "DIFF" },
        stream_bytes as f64 / bslz4_bytes.max(1) as f64,
        raw as f64 / enc_s / 1e9,
        raw as f64 / dec_s / 1e9,
        if pass { "PASS" } else { "FAIL" }
    );
    Ok((
        json!({
            "case": c.name, "detector": [c.detector.rows, c.detector.cols], "dose_e_per_frame": c.dose,
            "radius_px": c.radius, "frames": n,
            "params": {"contexts": c.params.contexts, "literals": c.params.literals,
                       "table_sets": c.params.table_sets, "floor": format!("{:?}", c.params.floor)},
            "model_gpu_equals_cpu": model_equal, "streams_differing": stream_mismatch,
            "count_only_bytes": counted.1, "count_only_overflowed": counted.0, "count_only_equal": count_equal,
            "decode_equal": decode_equal, "frame_sums_equal": sums_equal, "frame_hashes_equal": hashes_equal,
            "stream_bytes": stream_bytes, "model_bytes": cpu_model.to_bytes().len(),
            "bslz4_bytes": bslz4_bytes, "ratio_vs_bslz4": stream_bytes as f64 / bslz4_bytes.max(1) as f64,
            "raw_u16_bytes": raw,
            "gpu_encode_s": enc_s, "gpu_encode_gbs_u16": raw as f64 / enc_s / 1e9,
            "gpu_decode_dense_s": dec_s, "gpu_decode_gbs_u16": raw as f64 / dec_s / 1e9,
            "gpu_download_s": dl_s, "gpu_fit_s": gpu_fit_s,
            "cpu_fit_s": cpu_fit_s, "cpu_encode_s": cpu_enc_s, "pass": pass,
        }),
        pass,
    ))
}

/// Mutated streams: the GPU's per-stream verdict and sum must equal the CPU decoder's.
fn run_mutations(k: &RansKernels) -> Result<(Value, bool)> {
    let e = engine()?;
    let shape = Shape2::new(64, 48);
    let len = shape.len();
    let mut frames = make_frames(shape, 8000.0, 10.0, 64)?;
    // Frame 5 holds a 65535 and a 40000: their bucket (nb = 15) can be forged below to decode
    // above 65535 with every rANS check still consistent (extra bits do not touch the states).
    frames[5 * len + 100] = 65535;
    frames[5 * len + 101] = 40000;
    let slices: Vec<&[u16]> = frames.chunks_exact(len).collect();
    let params = ModelParams {
        floor: FloorPolicy::SeenPlusOne,
        ..ModelParams::default()
    };
    let model = CountsModel::fit(slices.iter().copied(), len, &params)
        .map_err(|er| Error::invalid("cpu fit", er.to_string()))?;
    let base: Vec<Vec<u8>> = slices
        .iter()
        .map(|f| rans::encode_stream(&model, f))
        .collect::<std::result::Result<_, _>>()
        .map_err(|er| Error::invalid("cpu encode", er.to_string()))?;
    // Deterministic mutations (xorshift).
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut muts: Vec<Vec<u8>> = Vec::new();
    for i in 0..2048usize {
        let mut s = base[i % base.len()].clone();
        match i % 8 {
            0..=3 => {
                // One bit flip anywhere.
                let b = (rnd() % (s.len() as u64 * 8)) as usize;
                s[b / 8] ^= 1 << (b % 8);
            }
            4 => {
                // A flip in the header or states.
                let b = (rnd() % (rans::STREAM_HEADER_BYTES as u64 * 8)) as usize;
                s[b / 8] ^= 1 << (b % 8);
            }
            5 => {
                // Truncate by a multiple of 4 (keeps alignment).
                let cut = 4 * (1 + rnd() % 8) as usize;
                s.truncate(s.len().saturating_sub(cut));
            }
            6 => {
                // Two flips in the words.
                for _ in 0..2 {
                    let b = (rnd() % (s.len() as u64 * 8)) as usize;
                    s[b / 8] ^= 1 << (b % 8);
                }
            }
            _ => {} // untouched: must be accepted
        }
        muts.push(s);
    }
    // Forged extra bits: frame 5 with all of its n_bits extra bits set. Only the values change
    // (buckets decode to their largest member), so the stream stays consistent and only the
    // u16 range check (the CPU's ValueTooLarge) can reject it; and frame 5 untouched.
    {
        let s = &base[5];
        let word = |o: usize| u32::from_le_bytes([s[o], s[o + 1], s[o + 2], s[o + 3]]);
        let (n_words, n_bits) = (word(0) as usize, word(4) as usize);
        let ex0 = rans::STREAM_HEADER_BYTES + 4 * n_words.div_ceil(2);
        let mut f = s.clone();
        for b in 0..n_bits {
            f[ex0 + b / 8] |= 1 << (b % 8);
        }
        muts.push(f);
        muts.push(s.clone());
    }
    let forged = muts.len() - 2;
    let cpu: Vec<Option<u64>> = muts
        .iter()
        .map(|s| {
            let mut out = vec![0u16; len];
            rans::decode_stream(&model, s, &mut out)
                .ok()
                .map(|_| out.iter().map(|&v| u64::from(v)).sum())
        })
        .collect();
    // The forged stream must be rejected by both (the CPU's reason: a value above 65535).
    let forged_cpu = {
        let mut out = vec![0u16; len];
        match rans::decode_stream(&model, &muts[forged], &mut out) {
            Err(er) => er.to_string(),
            Ok(()) => "accepted".into(),
        }
    };
    let mut index = Vec::new();
    let mut streams = Vec::new();
    for s in &muts {
        index.push(StreamEntry {
            offset: streams.len() as u64,
            length: s.len() as u32,
            tag: 1,
        });
        streams.extend_from_slice(s);
        streams.resize(streams.len().next_multiple_of(16), 0);
    }
    let enc = DeviceEncoded::upload(&e.gpu, model, &index, &streams, shape, None)?;
    let (gpu, _) = enc.frame_reduce(&e.gpu, k, FrameReduce::Sum)?;
    let mut disagree = 0usize;
    let mut rejected = 0usize;
    for (c, &g) in cpu.iter().zip(&gpu) {
        let gv = (g != u64::MAX).then_some(g);
        if gv != *c {
            disagree += 1;
        }
        if c.is_none() {
            rejected += 1;
        }
    }
    let forged_ok = cpu[forged].is_none() && gpu[forged] == u64::MAX && cpu[forged + 1].is_some();
    let pass = disagree == 0 && forged_ok;
    println!(
        "mutations: {} streams, {} rejected by the CPU, {} verdicts differ; forged extra bits: CPU {forged_cpu:?}, GPU {} -> {}",
        muts.len(),
        rejected,
        disagree,
        if gpu[forged] == u64::MAX { "rejects" } else { "ACCEPTS" },
        if pass { "PASS" } else { "FAIL" }
    );
    Ok((
        json!({"streams": muts.len(), "cpu_rejected": rejected, "verdicts_differing": disagree,
            "forged_extra_bits": {"cpu": forged_cpu, "gpu_rejects": gpu[forged] == u64::MAX, "pass": forged_ok},
            "pass": pass}),
        pass,
    ))
}

fn run_load(k: &RansKernels, a: &Args, master: &std::path::Path) -> Result<(Value, bool)> {
    let e = engine()?;
    let t = Instant::now();
    let src = Source::open(master, &OpenOptions::default())?;
    let open_s = t.elapsed().as_secs_f64();
    let bad = src.bad_pixel_mask();
    let mut params = qem_bench::whole_u16_load(&src, bad.as_deref())?;
    params.options.stage_payload = a.lz4_stage;
    params.options.overlap_encode = a.overlap;
    let mut opts = EncodeOptions::default();
    if let Some(c) = a.contexts {
        opts.model.contexts = c;
    }
    if let Some(k) = a.literals {
        opts.model.literals = k;
    }
    if a.quantiles {
        opts.model.context_rule = rans::ContextRule::Quantiles;
    }
    let t = Instant::now();
    let warm = load_source_encoded(&src, &params, &opts)?;
    let warm_s = t.elapsed().as_secs_f64();
    drop(warm);
    // One encoded acquisition alive at a time, so the card peak is one load's.
    let mut walls = Vec::new();
    let mut stages = Vec::new();
    let mut last = None;
    for _ in 0..a.repeats {
        drop(last.take());
        let t = Instant::now();
        let l = load_source_encoded(&src, &params, &opts)?;
        walls.push(t.elapsed().as_secs_f64());
        stages.push((l.timings.clone(), l.memory, l.retries));
        last = Some(l);
    }
    let mid = p50(&walls);
    let pi = walls.iter().position(|&w| w == mid).unwrap_or(0);
    let Some(l) = last else {
        return Err(Error::internal("check", "no load"));
    };
    let (p50_timings, p50_memory, p50_retries) = stages.swap_remove(pi);
    let enc = &l.encoded;
    let n = enc.n_frames();
    let len = enc.frame_shape().len();
    let raw = n * len as u64 * 2;
    let bslz4 = src.compressed_bytes();
    println!(
        "encoded load: p50 {mid:.3} s (min {:.3}, max {:.3}; warm-up {warm_s:.3} s) | streams {:.3} GB + index/model -> resident {:.3} GB | ratio vs bslz4 {:.3} | retries {}",
        walls.iter().cloned().fold(f64::INFINITY, f64::min),
        walls.iter().cloned().fold(0.0, f64::max),
        enc.stream_bytes() as f64 / 1e9,
        enc.nbytes() as f64 / 1e9,
        enc.stream_bytes() as f64 / bslz4 as f64,
        p50_retries
    );
    for t in &p50_timings {
        println!("    {:<70} {:.4} s", t.stage, t.seconds);
    }
    // Decode throughput.
    let mut dec = Vec::new();
    let mut fused = Vec::new();
    for _ in 0..5 {
        dec.push(enc.time_decode_all(&e.gpu, k, 16384)?);
        let t = Instant::now();
        enc.frame_sums(&e.gpu, k)?;
        fused.push(t.elapsed().as_secs_f64());
    }
    let (dec_s, fused_s) = (p50(&dec), p50(&fused));
    println!(
        "decode all frames: dense out {dec_s:.4} s = {:.1} GB/s (u16); fused frame sums {fused_s:.4} s (wall, incl. sync) = {:.1} GB/s",
        raw as f64 / dec_s / 1e9,
        raw as f64 / fused_s / 1e9
    );
    // Every frame against the CPU engine (fused hash), bands of rows.
    let t = Instant::now();
    let gpu_hashes = enc.frame_hashes(&e.gpu, k)?;
    let plan = FramePlan::new(
        src.detector_shape,
        None,
        1,
        DType::U16,
        false,
        bad.as_deref(),
    )?;
    let scan = src.scan_shape;
    let band = 16usize;
    let mut hash_mismatch = Vec::new();
    let mut byte_checked = 0u64;
    let mut stream_mismatch = 0u64;
    let (index, streams) = enc.to_host()?;
    let model = enc.model().clone();
    let mut r0 = 0;
    while r0 < scan.rows {
        let r1 = (r0 + band).min(scan.rows);
        let region = Region::new(r0, r1, 0, scan.cols);
        let d = qem_cpu::load_dense(
            &src,
            region,
            &plan,
            LoadHooks {
                progress: &qem_core::NoProgress,
            },
        )?;
        let qem_core::DenseArray::U16(v) = &d.data else {
            return Err(Error::internal("check", "CPU load is not u16"));
        };
        let f0 = (r0 * scan.cols) as u64;
        let res: Vec<(u64, bool, Option<bool>)> = v
            .par_chunks_exact(len)
            .enumerate()
            .map(|(i, f)| {
                let fi = f0 + i as u64;
                let hash_ok = frame_hash(f) == gpu_hashes[fi as usize];
                let bytes_ok = (fi % 64 == 0).then(|| {
                    let e = index[fi as usize];
                    let g = &streams[e.offset as usize..e.offset as usize + e.length as usize];
                    rans::encode_stream(&model, f)
                        .map(|s| s == g)
                        .unwrap_or(false)
                });
                (fi, hash_ok, bytes_ok)
            })
            .collect();
        for (fi, h, b) in res {
            if !h {
                hash_mismatch.push(fi);
            }
            if let Some(ok) = b {
                byte_checked += 1;
                if !ok {
                    stream_mismatch += 1;
                }
            }
        }
        r0 = r1;
    }
    let check_s = t.elapsed().as_secs_f64();
    println!(
        "every frame vs the CPU engine: {} of {n} hashes differ; {} of {byte_checked} sampled streams differ from the CPU encoder ({check_s:.1} s)",
        hash_mismatch.len(),
        stream_mismatch
    );
    // .qem write and warm reopen straight to the device.
    let t = Instant::now();
    let mut w = QemWriter::create(&a.qem).map_err(|er| Error::invalid("qem", er.to_string()))?;
    w.metadata(json!({"format": "quantem.gpu encoded counts", "shape": [scan.rows, scan.cols, enc.frame_shape().rows, enc.frame_shape().cols], "dtype": "uint16"}));
    w.codec_tables(model.to_bytes());
    for e in &index {
        w.stream(&streams[e.offset as usize..e.offset as usize + e.length as usize])
            .map_err(|er| Error::invalid("qem", er.to_string()))?;
    }
    let summary = w
        .finish()
        .map_err(|er| Error::invalid("qem", er.to_string()))?;
    let write_s = t.elapsed().as_secs_f64();
    let _ = summary;
    let qem_bytes = std::fs::metadata(&a.qem).map(|m| m.len()).unwrap_or(0);
    let mut reopen = Vec::new();
    let mut reopen_ok = true;
    for _ in 0..3 {
        let t = Instant::now();
        let f = QemFile::open_lazy(&a.qem).map_err(|er| Error::invalid("qem", er.to_string()))?;
        let m = CountsModel::from_bytes(f.codec_tables())
            .map_err(|er| Error::invalid("qem", er.to_string()))?;
        let idx: Vec<StreamEntry> = (0..f.n_streams())
            .map(|i| f.stream_entry(i))
            .collect::<std::result::Result<_, _>>()
            .map_err(|er| Error::invalid("qem", er.to_string()))?;
        let counter = Arc::new(MemCounter::default());
        let d = DeviceEncoded::upload(
            &e.gpu,
            m,
            &idx,
            f.streams_bytes(),
            enc.frame_shape(),
            Some(&counter),
        )?;
        reopen.push(t.elapsed().as_secs_f64());
        let h = d.frame_hashes(&e.gpu, k)?;
        reopen_ok &= h == gpu_hashes;
    }
    println!(
        ".qem: {:.3} GB written in {write_s:.2} s; warm reopen to the device p50 {:.3} s; decoded hashes equal: {reopen_ok}",
        qem_bytes as f64 / 1e9,
        p50(&reopen)
    );
    let _ = std::fs::remove_file(&a.qem);
    let pass = hash_mismatch.is_empty() && stream_mismatch == 0 && reopen_ok;
    let m = &p50_memory;
    Ok((
        json!({
            "source": master.display().to_string(), "scan_shape": [scan.rows, scan.cols],
            "detector_shape": [src.detector_shape.rows, src.detector_shape.cols], "source_dtype": src.dtype.to_string(),
            "open_s": open_s, "cache_state": "warm page cache, warm process (one untimed warm-up load)",
            "lz4_stage_payload": a.lz4_stage, "overlap_encode": a.overlap,
            "encode_options": {"sample_frames": opts.sample_frames, "headroom": opts.headroom,
                "contexts": opts.model.contexts, "literals": opts.model.literals, "table_sets": opts.model.table_sets,
                "floor": format!("{:?}", opts.model.floor), "context_rule": format!("{:?}", opts.model.context_rule)},
            "load_wall_s": walls, "load_p50_s": mid, "warmup_s": warm_s,
            "stages_of_p50_run": p50_timings.iter().map(|t| json!({"stage": t.stage, "seconds": t.seconds})).collect::<Vec<_>>(),
            "retries": p50_retries,
            "memory": {"planned_device_bytes": m.planned_device_bytes, "process_peak_device_bytes": m.process_peak_device_bytes,
                "card_used_before_bytes": m.card_used_before_bytes, "card_used_peak_bytes": m.card_used_peak_bytes,
                "card_total_bytes": m.card_total_bytes, "encoded_resident_bytes": enc.nbytes()},
            "sizes": {"bslz4_bytes": bslz4, "stream_bytes": enc.stream_bytes(), "resident_bytes": enc.nbytes(),
                "raw_u16_bytes": raw, "ratio_streams_vs_bslz4": enc.stream_bytes() as f64 / bslz4 as f64,
                "ratio_resident_vs_bslz4": enc.nbytes() as f64 / bslz4 as f64},
            "decode_dense_p50_s": dec_s, "decode_dense_gbs_u16": raw as f64 / dec_s / 1e9,
            "fused_frame_sums_p50_s": fused_s, "fused_frame_sums_gbs_u16": raw as f64 / fused_s / 1e9,
            "cpu_comparison": {"frames": n, "hash_mismatches": hash_mismatch.len(), "first_mismatches": hash_mismatch.iter().take(10).collect::<Vec<_>>(),
                "streams_byte_compared": byte_checked, "streams_differing": stream_mismatch, "seconds": check_s},
            "qem": {"bytes": qem_bytes, "write_s": write_s, "reopen_to_device_s": reopen, "reopen_p50_s": p50(&reopen), "decoded_hashes_equal": reopen_ok},
            "pass": pass,
        }),
        pass,
    ))
}

fn main() {
    let a = parse_args();
    let info = qem_bench::cuda_device_or_exit();
    let run = || -> Result<(Value, bool)> {
        let e = engine()?;
        let t = Instant::now();
        let k = e.rans()?;
        println!(
            "rANS kernels: {:?} in {:.2} s",
            k.module,
            t.elapsed().as_secs_f64()
        );
        let def = ModelParams {
            floor: FloorPolicy::AllSymbols,
            ..ModelParams::default()
        };
        let cases = [
            Case {
                name: "reference 200k",
                detector: Shape2::new(192, 192),
                dose: 200_000.0,
                radius: 30.0,
                params: def,
            },
            Case {
                name: "low dose 20k",
                detector: Shape2::new(192, 192),
                dose: 20_000.0,
                radius: 30.0,
                params: def,
            },
            Case {
                name: "high dose 1M",
                detector: Shape2::new(192, 192),
                dose: 1_000_000.0,
                radius: 30.0,
                params: def,
            },
            Case {
                name: "odd 100x99 T=1",
                detector: Shape2::new(100, 99),
                dose: 50_000.0,
                radius: 17.0,
                params: ModelParams {
                    table_sets: 1,
                    ..def
                },
            },
            Case {
                name: "K128 C16 seen+1",
                detector: Shape2::new(192, 192),
                dose: 200_000.0,
                radius: 53.0,
                params: ModelParams {
                    literals: 128,
                    contexts: 16,
                    floor: FloorPolicy::SeenPlusOne,
                    ..def
                },
            },
        ];
        let mut out = Vec::new();
        let mut all = true;
        for c in &cases {
            let (v, ok) = run_case(k, c, a.frames)?;
            all &= ok;
            out.push(v);
        }
        let (mv, mok) = run_mutations(k)?;
        all &= mok;
        let load = match &a.load {
            Some(m) => {
                let (v, ok) = run_load(k, &a, m)?;
                all &= ok;
                v
            }
            None => Value::Null,
        };
        Ok((
            json!({
                "tool": "qem-cuda-rans-check", "device": info, "git_revision": std::env::var("QEM_GIT_REVISION").unwrap_or_else(|_| option_env!("QEM_GIT_REVISION").unwrap_or("unknown").to_string()),
                "command": std::env::args().collect::<Vec<_>>().join(" "),
                "generated_cases": out, "mutations": mv, "load": load, "pass": all,
            }),
            all,
        ))
    };
    qem_bench::finish_check(&a.out, "rans_check.json", run())
}
