//! `qem-cuda-check`: correctness and speed of the GPU bitshuffle/LZ4 decoder on this machine.
//!
//! ```text
//! qem-cuda-check --vectors DIR --out DIR [--sanitize-subset] [--frames N] [--warps 1,2,4,8]
//!                [--reps 20] [--gen-only]
//! ```
//! 1. probes the device; 2. compiles the kernels (cold NVRTC time, then cached loads);
//! 3. decodes every bitshuffle vector of DIR (`manifest.json`, `*.chunk.bin`,
//!    `*.expected.bin`) alone and in multi-chunk batches, byte-exact against the expected
//!    arrays and the CPU decoder; 4. runs every case of `lz4_malformed.json` through the plain
//!    LZ4 kernel and wrapped as block 1 of a 3-block u8 chunk, and thousands of mutated and
//!    truncated real chunks: every block's verdict, error code and byte position must equal
//!    the CPU decoder's; 5. (unless `--sanitize-subset`) generates realistic acquisitions on the
//!    host (Poisson disk frames), decodes them on the GPU, checks every frame byte-exactly and
//!    times the kernel with CUDA events (3 warm-ups, `--reps` timed launches per launch shape).
//!
//! Writes `cuda_bslz4_check.json` to `--out`, prints a table, exits 1 if any check failed
//! (4 if CUDA is unavailable, 2 on bad usage).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use qem_bench::timing::XorShift64Star;
use qem_codec::bslz4::{self, Decoder};
use qem_codec::lz4::{compress_block, decompress_block_exact};
use qem_codec::{CodecError, Lz4Fault};
use qem_core::{fnv1a64, Error, Result, Shape2, FNV_OFFSET};
use qem_cuda::bslz4::{codec_error, ItemStatus};
use qem_cuda::{nvrtc, Bslz4Batch, Bslz4Kernels, DeviceBatch, Gpu, LaunchShape};
use rayon::prelude::*;
use serde_json::{json, Value};

struct Args {
    vectors: PathBuf,
    out: PathBuf,
    sanitize_subset: bool,
    gen_only: bool,
    frames: usize,
    warps: Vec<u32>,
    reps: usize,
}

fn usage() -> ! {
    eprintln!(
        "usage: qem-cuda-check --vectors DIR --out DIR [--sanitize-subset] [--frames N] \
         [--warps 1,2,4,8] [--reps 20] [--gen-only]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut a = Args {
        vectors: PathBuf::new(),
        out: PathBuf::from("."),
        sanitize_subset: false,
        gen_only: false,
        frames: 32768,
        warps: vec![1, 2, 4, 8],
        reps: 20,
    };
    let mut have_vectors = false;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| usage());
        match arg.as_str() {
            "--vectors" => {
                a.vectors = PathBuf::from(val());
                have_vectors = true;
            }
            "--out" => a.out = PathBuf::from(val()),
            "--sanitize-subset" => a.sanitize_subset = true,
            "--gen-only" => a.gen_only = true,
            "--frames" => a.frames = val().parse().unwrap_or_else(|_| usage()),
            "--reps" => a.reps = val().parse::<usize>().unwrap_or_else(|_| usage()).max(1),
            "--warps" => {
                a.warps = val()
                    .split(',')
                    .map(|s| s.parse().unwrap_or_else(|_| usage()))
                    .collect()
            }
            "-h" | "--help" => usage(),
            _ => usage(),
        }
    }
    if !have_vectors && !a.gen_only {
        usage()
    }
    a
}

/// Pass/fail bookkeeping plus the JSON record.
struct Report {
    checks: Vec<(String, bool, String)>,
    json: serde_json::Map<String, Value>,
}

impl Report {
    fn check(&mut self, name: impl Into<String>, pass: bool, detail: impl Into<String>) {
        let (name, detail) = (name.into(), detail.into());
        println!("[{}] {name}: {detail}", if pass { "PASS" } else { "FAIL" });
        self.checks.push((name, pass, detail));
    }
    fn failed(&self) -> usize {
        self.checks.iter().filter(|c| !c.1).count()
    }
}

fn read(dir: &Path, name: &str) -> Result<Vec<u8>> {
    let p = dir.join(name);
    std::fs::read(&p).map_err(|e| Error::io("read test vector", &p, &e))
}

/// The kernel's code for a CPU fault (see bslz4_decode.cu).
fn fault_code(r: &Lz4Fault) -> u32 {
    match r {
        Lz4Fault::EmptyInput => 1,
        Lz4Fault::TruncatedLength => 2,
        Lz4Fault::TruncatedOffset => 3,
        Lz4Fault::LengthOverflow => 4,
        Lz4Fault::LiteralsPastInput { .. } => 5,
        Lz4Fault::LiteralsPastOutput { .. } => 6,
        Lz4Fault::MatchOffsetZero => 7,
        Lz4Fault::OffsetBeforeStart { .. } => 8,
        Lz4Fault::MatchPastOutput { .. } => 9,
        Lz4Fault::ShortOutput { .. } => 10,
        _ => 99,
    }
}

/// The CPU verdict for one LZ4 block as the kernel's (code, position).
fn cpu_block_verdict(payload: &[u8], out_len: usize) -> (ItemStatus, Vec<u8>) {
    let mut out = vec![0u8; out_len];
    match decompress_block_exact(payload, &mut out) {
        Ok(()) => (
            ItemStatus {
                code: 0,
                position: 0,
            },
            out,
        ),
        Err(CodecError::Lz4 {
            position, reason, ..
        }) => (
            ItemStatus {
                code: fault_code(&reason),
                position: position as u32,
            },
            out,
        ),
        Err(_) => (
            ItemStatus {
                code: 98,
                position: 0,
            },
            out,
        ),
    }
}

struct GpuRun {
    out: Vec<u8>,
    fault: Option<qem_cuda::bslz4::KernelFault>,
    statuses: Vec<ItemStatus>,
    dev: DeviceBatch,
}

/// Decodes run both ways (payload parsed from global memory and staged in shared memory) and
/// the ones whose bytes, first fault or item statuses differ between the two.
static PAIRED: AtomicUsize = AtomicUsize::new(0);
static PATHS_DIFFER: AtomicUsize = AtomicUsize::new(0);

/// Decode `batch` with `shape` and again with the other payload path
/// (`LaunchShape::stage_payload`); a difference counts in [`PATHS_DIFFER`]. Returns the run
/// with `shape` as given.
fn gpu_decode(
    gpu: &Gpu,
    k: &Bslz4Kernels,
    batch: &Bslz4Batch,
    shape: LaunchShape,
) -> Result<GpuRun> {
    let r = gpu_decode_once(gpu, k, batch, shape)?;
    let other = LaunchShape {
        stage_payload: !shape.stage_payload,
        ..shape
    };
    let o = gpu_decode_once(gpu, k, batch, other)?;
    PAIRED.fetch_add(1, Ordering::Relaxed);
    if o.out != r.out || o.fault != r.fault || o.statuses != r.statuses {
        PATHS_DIFFER.fetch_add(1, Ordering::Relaxed);
        eprintln!(
            "payload paths differ (staged {}): faults {:?} / {:?}",
            shape.stage_payload, r.fault, o.fault
        );
    }
    Ok(r)
}

fn gpu_decode_once(
    gpu: &Gpu,
    k: &Bslz4Kernels,
    batch: &Bslz4Batch,
    shape: LaunchShape,
) -> Result<GpuRun> {
    let mut dev = DeviceBatch::upload(gpu, batch)?;
    dev.poison_output(gpu, 0xA5)?;
    dev.reset_errors(gpu)?;
    dev.launch(gpu, k, shape)?;
    let fault = dev.first_fault(gpu)?;
    let statuses = dev.statuses(gpu)?;
    let out = dev.download(gpu)?;
    Ok(GpuRun {
        out,
        fault,
        statuses,
        dev,
    })
}

fn elem_size_of(dtype: &str) -> Option<usize> {
    match dtype {
        "uint8" => Some(1),
        "uint16" => Some(2),
        "uint32" => Some(4),
        _ => None,
    }
}

/// (name, elem size, chunk, expected) of every bitshuffle vector.
/// (name, element size, chunk bytes, expected bytes).
type Vector = (String, usize, Vec<u8>, Vec<u8>);
/// (CPU result, CPU output, mutated chunk).
type CpuCase = (std::result::Result<(), CodecError>, Vec<u8>, Vec<u8>);

fn load_vectors(dir: &Path) -> Result<Vec<Vector>> {
    let m: Value = serde_json::from_slice(&read(dir, "manifest.json")?)
        .map_err(|e| Error::source("read manifest", e.to_string()))?;
    let mut v = Vec::new();
    for e in m.as_array().cloned().unwrap_or_default() {
        if e["filter_id"].as_u64() != Some(32008) {
            continue;
        }
        let name = e["name"].as_str().unwrap_or("?").to_string();
        let Some(es) = e["dtype"].as_str().and_then(elem_size_of) else {
            continue;
        };
        let chunk = read(dir, &format!("{name}.chunk.bin"))?;
        let expected = read(dir, &format!("{name}.expected.bin"))?;
        v.push((name, es, chunk, expected));
    }
    Ok(v)
}

fn section_vectors(gpu: &Gpu, k: &Bslz4Kernels, dir: &Path, rep: &mut Report) -> Result<Value> {
    let vs = load_vectors(dir)?;
    rep.check(
        "vectors found",
        vs.len() >= 9,
        format!("{} bitshuffle vectors", vs.len()),
    );
    let mut results = Vec::new();
    for (name, es, chunk, expected) in &vs {
        let mut cpu = vec![0u8; expected.len()];
        let cpu_ok = Decoder::new().decode(chunk, *es, &mut cpu).is_ok() && cpu == *expected;
        let mut batch = Bslz4Batch::new(*es)?;
        batch.push_chunk(chunk, 0, 0, expected.len())?;
        let r = gpu_decode(gpu, k, &batch, LaunchShape::default())?;
        let pass = cpu_ok && r.fault.is_none() && r.out == *expected;
        let first_diff = r.out.iter().zip(expected).position(|(a, b)| a != b);
        rep.check(
            format!("vector {name}"),
            pass,
            format!(
                "{} B, cpu_ok={cpu_ok}, gpu_fault={:?}, first_diff={first_diff:?}",
                expected.len(),
                r.fault
            ),
        );
        results.push(json!({"name": name, "pass": pass, "bytes": expected.len()}));
    }
    // Multi-chunk batches per element size: every vector 3 times, plus a raw (filter-skipped)
    // chunk in the middle; outputs at unaligned offsets.
    for es in [2usize, 4] {
        let mine: Vec<_> = vs.iter().filter(|v| v.1 == es).collect();
        if mine.is_empty() {
            continue;
        }
        let mut batch = Bslz4Batch::new(es)?;
        let mut want = Vec::new();
        let mut frame = 0u64;
        for round in 0..3 {
            for (_, _, chunk, expected) in &mine {
                batch.push_chunk(chunk, 0, frame, expected.len())?;
                want.extend_from_slice(expected);
                frame += 1;
            }
            if round == 1 {
                let raw: Vec<u8> = (0..es * 7).map(|i| i as u8 ^ 0x5c).collect();
                batch.push_chunk(&raw, 1, frame, raw.len())?;
                want.extend_from_slice(&raw);
                frame += 1;
            }
        }
        for w in [1u32, 2, 4, 8] {
            let r = gpu_decode(
                gpu,
                k,
                &batch,
                LaunchShape {
                    warps_per_cta: w,
                    ..LaunchShape::default()
                },
            )?;
            let pass = r.fault.is_none() && r.out == want;
            rep.check(
                format!(
                    "multi-chunk batch u{} ({} chunks, {w} warps/CTA)",
                    es * 8,
                    batch.chunks().len()
                ),
                pass,
                format!("{} B, fault={:?}", want.len(), r.fault),
            );
        }
        // Grid-stride loop: a capped grid must give the same bytes.
        let r = gpu_decode(
            gpu,
            k,
            &batch,
            LaunchShape {
                warps_per_cta: 2,
                max_ctas: 3,
                ..LaunchShape::default()
            },
        )?;
        rep.check(
            format!("multi-chunk batch u{} with 3 CTAs (grid-stride)", es * 8),
            r.fault.is_none() && r.out == want,
            "",
        );
    }
    Ok(Value::Array(results))
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .filter_map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok())
        .collect()
}

/// A u8 bitshuffle chunk of 3 blocks of `n` bytes whose middle block's payload is `payload`.
fn wrap_u8_chunk(payload: &[u8], n: usize) -> (Vec<u8>, Vec<u8>) {
    let good_data: Vec<u8> = (0..n).map(|i| (i * 37 % 251) as u8).collect();
    let mut planes = vec![0u8; n];
    let _ = qem_codec::bitshuffle::transpose_block(&good_data, 1, &mut planes);
    let good = compress_block(&planes);
    let mut c = Vec::new();
    c.extend_from_slice(&((3 * n) as u64).to_be_bytes());
    c.extend_from_slice(&(n as u32).to_be_bytes());
    for p in [&good[..], payload, &good[..]] {
        c.extend_from_slice(&(p.len() as u32).to_be_bytes());
        c.extend_from_slice(p);
    }
    (c, good_data)
}

fn section_malformed(gpu: &Gpu, k: &Bslz4Kernels, dir: &Path, rep: &mut Report) -> Result<Value> {
    let cases: Value = serde_json::from_slice(&read(dir, "lz4_malformed.json")?)
        .map_err(|e| Error::source("read lz4_malformed.json", e.to_string()))?;
    let cases = cases.as_array().cloned().unwrap_or_default();
    rep.check(
        "malformed cases found",
        cases.len() >= 11,
        format!("{} cases", cases.len()),
    );
    let mut results = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let name = c["name"].as_str().unwrap_or("?");
        let input = unhex(c["hex"].as_str().unwrap_or(""));
        let out_size = c["out_size"].as_u64().unwrap_or(0) as usize;
        let expect_ok = c["expect"].as_str() == Some("ok");
        // (1) Plain LZ4 through the same kernel's LZ4 stage.
        let mut batch = Bslz4Batch::new_plain_lz4();
        batch.push_lz4_block(&input, out_size, 500 + i as u64)?;
        let r = gpu_decode(gpu, k, &batch, LaunchShape::default())?;
        let mut cpu_out = vec![0u8; out_size];
        let cpu = decompress_block_exact(&input, &mut cpu_out);
        let gpu_err = r
            .fault
            .and_then(|f| codec_error(f.code, f.block, f.position, f.a, f.b));
        let cpu_err = cpu.clone().err().map(|e| match e {
            CodecError::Lz4 {
                position, reason, ..
            } => CodecError::Lz4 {
                block: Some(0),
                position,
                reason,
            },
            other => other,
        });
        let verdict_ok = expect_ok == r.fault.is_none();
        let same = gpu_err == cpu_err && (cpu.is_err() || r.out == cpu_out);
        let frame_ok = r.fault.is_none()
            || r.dev
                .fault_error(&r.fault.unwrap_or(qem_cuda::bslz4::KernelFault {
                    code: 0,
                    chunk: 0,
                    block: 0,
                    position: 0,
                    a: 0,
                    b: 0,
                    count: 0,
                }))
                .frame
                == Some(500 + i as u64);
        rep.check(
            format!("malformed[{i}] {name} (plain LZ4)"),
            verdict_ok && same && frame_ok,
            format!(
                "expect {}, gpu: {}, cpu: {}",
                if expect_ok { "ok" } else { "reject" },
                gpu_err.as_ref().map_or("ok".into(), |e| e.to_string()),
                cpu_err.as_ref().map_or("ok".into(), |e| e.to_string())
            ),
        );
        // (2) As block 1 of a 3-block u8 bitshuffle chunk (out_size a positive multiple of 8).
        let mut wrapped = Value::Null;
        if out_size > 0 && out_size % 8 == 0 {
            let (chunk, _) = wrap_u8_chunk(&input, out_size);
            let mut b = Bslz4Batch::new(1)?;
            b.push_chunk(&chunk, 0, 900 + i as u64, 3 * out_size)?;
            let r = gpu_decode(gpu, k, &b, LaunchShape::default())?;
            let mut cpu_out = vec![0u8; 3 * out_size];
            let cpu = Decoder::new().decode(&chunk, 1, &mut cpu_out);
            let gpu_err = r
                .fault
                .and_then(|f| codec_error(f.code, f.block, f.position, f.a, f.b));
            let pass = expect_ok == r.fault.is_none()
                && gpu_err == cpu.clone().err()
                && (cpu.is_err() || r.out == cpu_out)
                && r.fault.is_none_or(|f| f.block == 1 && f.chunk == 0);
            let msg = r.fault.map(|f| r.dev.fault_error(&f).to_string());
            rep.check(
                format!("malformed[{i}] {name} (block 1 of a u8 chunk)"),
                pass,
                format!("gpu error: {msg:?}"),
            );
            wrapped = json!({"pass": pass, "gpu_error": msg});
        }
        results.push(json!({"name": name, "expect": c["expect"], "verdict_ok": verdict_ok, "same_as_cpu": same,
            "gpu_error": gpu_err.map(|e| e.to_string()), "wrapped": wrapped}));
    }
    Ok(Value::Array(results))
}

fn section_mutations(
    gpu: &Gpu,
    k: &Bslz4Kernels,
    dir: &Path,
    per_vector: usize,
    rep: &mut Report,
) -> Result<Value> {
    let vs = load_vectors(dir)?;
    // Deterministic mutations.
    let mut rng = XorShift64Star(0x9e37_79b9_7f4a_7c15);
    let mut stats = serde_json::Map::new();
    for es in [1usize, 2, 4] {
        let mut batch = Bslz4Batch::new(es)?;
        let mut cpu_results: Vec<CpuCase> = Vec::new();
        let (mut host_rejected, mut host_agree) = (0usize, 0usize);
        // u8: reinterpret the u16/u32 vectors' expected bytes as u8 frames, re-encoded.
        let bases: Vec<(Vec<u8>, usize)> = if es == 1 {
            vs.iter()
                .filter_map(|v| bslz4::encode_chunk(&v.3, 1, 0).ok().map(|c| (c, v.3.len())))
                .collect()
        } else {
            vs.iter()
                .filter(|v| v.1 == es)
                .map(|v| (v.2.clone(), v.3.len()))
                .collect()
        };
        for (base, out_len) in &bases {
            for _ in 0..per_vector {
                let mut m = base.clone();
                match rng.below(4) {
                    0 => {
                        for _ in 0..1 + rng.below(3) {
                            let i = 12 + rng.below(m.len().saturating_sub(12));
                            if i < m.len() {
                                m[i] ^= 1 << rng.below(8);
                            }
                        }
                    }
                    1 => {
                        let i = 12 + rng.below(m.len().saturating_sub(12));
                        if i < m.len() {
                            m[i] = if rng.below(2) == 0 { 0 } else { 0xff };
                        }
                    }
                    2 => {
                        let n = rng.below(m.len());
                        m.truncate(n);
                    }
                    _ => {
                        let i = 12 + rng.below(m.len().saturating_sub(12));
                        if i < m.len() {
                            m[i] = rng.next_u64() as u8;
                        }
                    }
                }
                let mut cpu_out = vec![0u8; *out_len];
                let cpu = Decoder::new().decode(&m, es, &mut cpu_out);
                let frame = cpu_results.len() as u64;
                match batch.push_chunk(&m, 0, frame, *out_len) {
                    Err(_) => {
                        host_rejected += 1;
                        if cpu.is_err() {
                            host_agree += 1;
                        }
                    }
                    Ok(()) => cpu_results.push((cpu, cpu_out, m)),
                }
            }
        }
        rep.check(
            format!(
                "mutations u{}: framing rejected on the host exactly when the CPU rejects",
                es * 8
            ),
            host_agree == host_rejected,
            format!("{host_rejected} rejected by the shared parser"),
        );
        let r = gpu_decode(gpu, k, &batch, LaunchShape::default())?;
        let (mut mismatches, mut gpu_rejects, mut first_bad) = (0usize, 0usize, None);
        for (ci, (cpu, cpu_out, m)) in cpu_results.iter().enumerate() {
            let c = batch.chunks()[ci];
            let layout = bslz4::parse_chunk(m, es, c.out_len as usize)
                .map_err(|e| Error::internal("mutations", e.to_string()))?;
            let mut chunk_ok = true;
            for (bi, span) in layout.blocks.iter().enumerate() {
                let payload = &m[span.payload_offset..span.payload_offset + span.payload_len];
                let (want, _) = cpu_block_verdict(payload, span.out_len);
                let got = r.statuses[c.first_block as usize + bi];
                if got.code != 0 {
                    chunk_ok = false;
                }
                if got != want {
                    mismatches += 1;
                    first_bad
                        .get_or_insert(format!("chunk {ci} block {bi}: gpu {got:?} cpu {want:?}"));
                }
            }
            if !chunk_ok {
                gpu_rejects += 1;
            }
            let range = c.out_offset as usize..(c.out_offset + c.out_len) as usize;
            if chunk_ok != cpu.is_ok() || (chunk_ok && r.out[range] != cpu_out[..]) {
                mismatches += 1;
                first_bad.get_or_insert(format!("chunk {ci}: gpu ok={chunk_ok} cpu={cpu:?}"));
            }
        }
        let pass = mismatches == 0 && !cpu_results.is_empty();
        rep.check(
            format!(
                "mutations u{}: every block's GPU verdict (code, byte) equals the CPU's",
                es * 8
            ),
            pass,
            format!(
                "{} chunks on GPU, {gpu_rejects} rejected, {mismatches} mismatches{}",
                cpu_results.len(),
                first_bad.map_or(String::new(), |s| format!("; first: {s}"))
            ),
        );
        stats.insert(
            format!("u{}", es * 8),
            json!({"host_rejected": host_rejected, "gpu_chunks": cpu_results.len(),
                   "gpu_rejected": gpu_rejects, "mismatches": mismatches, "pass": pass}),
        );
    }
    Ok(Value::Object(stats))
}

/// A generated acquisition: raw frames and their chunks.
struct Acq {
    raw: Vec<u8>,
    chunks: Vec<Vec<u8>>,
    frame_bytes: usize,
}

fn generate(frames: usize, shape: Shape2, es: usize, block_elems: usize) -> Result<Acq> {
    let pattern = qem_sim::DiskPattern::new(
        shape,
        30.0_f64.min(shape.rows as f64 / 3.0),
        0.15,
        200_000.0,
        7,
    )?;
    let npx = shape.len();
    let frame_bytes = npx * es;
    let mut raw = vec![0u8; frames * frame_bytes];
    raw.par_chunks_mut(frame_bytes)
        .enumerate()
        .for_each(|(n, out)| {
            let mut f = vec![0u16; npx];
            pattern.frame(n as u64, &mut f);
            if es == 2 {
                for (o, v) in out.chunks_exact_mut(2).zip(&f) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            } else {
                // u32: counts, plus a few pixels above 16 bits so the high planes are exercised.
                for (i, (o, v)) in out.chunks_exact_mut(4).zip(&f).enumerate() {
                    let mut x = *v as u32;
                    if i % 997 == n % 997 {
                        x += 65_536 * (1 + (n as u32 % 5));
                    }
                    o.copy_from_slice(&x.to_le_bytes());
                }
            }
        });
    let chunks: Vec<Vec<u8>> = raw
        .par_chunks(frame_bytes)
        .map(|f| bslz4::encode_chunk(f, es, block_elems))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| Error::internal("encode", e.to_string()))?;
    Ok(Acq {
        raw,
        chunks,
        frame_bytes,
    })
}

/// Sequences (tokens) in one LZ4 block (for explaining the speed).
fn count_sequences(p: &[u8]) -> usize {
    let (mut ip, mut n) = (0usize, 0usize);
    while ip < p.len() {
        n += 1;
        let t = p[ip];
        ip += 1;
        let mut lit = (t >> 4) as usize;
        if lit == 15 {
            while ip < p.len() {
                let b = p[ip];
                ip += 1;
                lit += b as usize;
                if b != 255 {
                    break;
                }
            }
        }
        ip += lit;
        if ip >= p.len() {
            break;
        }
        ip += 2;
        if t & 15 == 15 {
            while ip < p.len() {
                let b = p[ip];
                ip += 1;
                if b != 255 {
                    break;
                }
            }
        }
    }
    n
}

fn frame_hashes(data: &[u8], frame_bytes: usize) -> Vec<u64> {
    data.par_chunks(frame_bytes)
        .map(|f| fnv1a64(FNV_OFFSET, f))
        .collect()
}

fn combined(h: &[u64]) -> String {
    let mut s = FNV_OFFSET;
    for x in h {
        s = fnv1a64(s, &x.to_le_bytes());
    }
    format!("{s:016x}")
}

/// One decode of the whole acquisition into a poisoned output with `shape`: every frame
/// compared with the raw frames. Returns the record's fields (exact, bad frames, first diff).
#[allow(clippy::too_many_arguments)]
fn check_exact(
    gpu: &Gpu,
    k: &Bslz4Kernels,
    dev: &mut DeviceBatch,
    shape: LaunchShape,
    acq: &Acq,
    raw_hashes: &[u64],
    rep: &mut Report,
    name: &str,
) -> Result<Value> {
    let frames = raw_hashes.len();
    let path = if shape.stage_payload {
        "staged"
    } else {
        "global"
    };
    dev.poison_output(gpu, 0xA5)?;
    dev.reset_errors(gpu)?;
    dev.launch(gpu, k, shape)?;
    let err = dev.check_errors(gpu);
    let out = dev.download(gpu)?;
    let gpu_hashes = frame_hashes(&out, acq.frame_bytes);
    let bad: Vec<usize> = (0..frames)
        .filter(|&i| gpu_hashes[i] != raw_hashes[i])
        .collect();
    let mut first_diff = Value::Null;
    if let Some(&f) = bad.first() {
        let o = f * acq.frame_bytes;
        let p = (0..acq.frame_bytes)
            .find(|&j| out[o + j] != acq.raw[o + j])
            .unwrap_or(0);
        first_diff = json!({"frame": f, "byte": p, "gpu": out[o + p], "want": acq.raw[o + p]});
    }
    let exact = err.is_ok() && bad.is_empty() && out == acq.raw;
    rep.check(
        format!(
            "{name}: GPU output byte-exact, {path} payload (all {frames} frames, poisoned first)"
        ),
        exact,
        format!(
            "error={:?}, bad frames={}, first diff={first_diff}",
            err.err().map(|e| e.to_string()),
            bad.len()
        ),
    );
    Ok(
        json!({"exact": exact, "checksum": combined(&gpu_hashes), "bad_frames": bad.len(),
        "first_diff": first_diff}),
    )
}

#[allow(clippy::too_many_arguments)]
fn bench_case(
    gpu: Option<(&Gpu, &Bslz4Kernels)>,
    name: &str,
    frames: usize,
    shape: Shape2,
    es: usize,
    block_elems: usize,
    warps: &[u32],
    reps: usize,
    rep: &mut Report,
    table: &mut Vec<String>,
) -> Result<Value> {
    println!(
        "\n== {name}: {frames} frames {}x{} u{} block_elems {block_elems} ==",
        shape.rows,
        shape.cols,
        es * 8
    );
    let t = Instant::now();
    let acq = generate(frames, shape, es, block_elems)?;
    let gen_s = t.elapsed().as_secs_f64();
    let comp: usize = acq.chunks.iter().map(|c| c.len()).sum();
    let mut batch = Bslz4Batch::new(es)?;
    for (n, c) in acq.chunks.iter().enumerate() {
        batch.push_chunk(c, 0, n as u64, acq.frame_bytes)?;
    }
    let seqs: usize = (0..batch.n_blocks())
        .into_par_iter()
        .filter_map(|i| batch.block(i))
        .map(|(po, pl, ..)| count_sequences(&batch.input()[po as usize..po as usize + pl as usize]))
        .sum();
    let ratio = acq.raw.len() as f64 / comp as f64;
    let seq_per_block = seqs as f64 / batch.n_blocks().max(1) as f64;
    println!(
        "generated+encoded in {gen_s:.1} s: {} raw, {} compressed (ratio {ratio:.2}), {} blocks, {} copies, {seq_per_block:.1} LZ4 sequences/block",
        acq.raw.len(), comp, batch.n_blocks(), batch.n_copies()
    );
    // CPU reference decode (parallel) against the raw frames.
    let t = Instant::now();
    let mut cpu = vec![0u8; acq.raw.len()];
    let cpu_res: std::result::Result<Vec<()>, CodecError> = cpu
        .par_chunks_mut(acq.frame_bytes)
        .zip(acq.chunks.par_iter())
        .map_init(Decoder::new, |d, (o, c)| d.decode(c, es, o))
        .collect();
    let cpu_s = t.elapsed().as_secs_f64();
    let cpu_ok = cpu_res.is_ok() && cpu == acq.raw;
    drop(cpu);
    let raw_hashes = frame_hashes(&acq.raw, acq.frame_bytes);
    let mut rec = json!({
        "name": name, "frames": frames, "shape": [shape.rows, shape.cols], "elem_size": es,
        "block_elems": block_elems, "raw_bytes": acq.raw.len(), "compressed_bytes": comp,
        "ratio": ratio, "blocks": batch.n_blocks(), "copies": batch.n_copies(),
        "lz4_sequences_per_block": seq_per_block, "cpu_decode_s": cpu_s,
        "cpu_decode_gbps": acq.raw.len() as f64 / cpu_s / 1e9,
        "cpu_threads": rayon::current_num_threads(), "cpu_matches_raw": cpu_ok,
        "raw_checksum": combined(&raw_hashes),
    });
    rep.check(
        format!("{name}: CPU decode equals the raw frames"),
        cpu_ok,
        format!(
            "{:.2} GB/s on {} threads",
            acq.raw.len() as f64 / cpu_s / 1e9,
            rayon::current_num_threads()
        ),
    );
    let Some((gpu, k)) = gpu else { return Ok(rec) };

    let t = Instant::now();
    let mut dev = DeviceBatch::upload(gpu, &batch)?;
    gpu.synchronize()?;
    let up_s = t.elapsed().as_secs_f64();
    rec["upload_s"] = json!(up_s);
    // Correctness: poisoned output, one launch, every frame compared; both payload paths.
    let mut all_exact = true;
    for stage in [false, true] {
        let shape_c = LaunchShape {
            stage_payload: stage,
            ..LaunchShape::default()
        };
        let r = check_exact(gpu, k, &mut dev, shape_c, &acq, &raw_hashes, rep, name)?;
        all_exact &= r["exact"] == json!(true);
        rec[if stage { "gpu_staged" } else { "gpu_global" }] = r;
    }
    rec["gpu_exact"] = json!(all_exact);
    // Timing per launch shape.
    let mut timings = Vec::new();
    let mut best = 0.0f64;
    for (&w, stage) in warps.iter().flat_map(|w| [(w, false), (w, true)]) {
        let shape_l = LaunchShape {
            warps_per_cta: w,
            max_ctas: 0,
            stage_payload: stage,
        };
        let path = if stage { "staged" } else { "global" };
        for _ in 0..3 {
            dev.launch(gpu, k, shape_l)?;
        }
        gpu.synchronize()?;
        let mut ms = Vec::with_capacity(reps);
        for _ in 0..reps {
            ms.push(gpu.time_ms(|| dev.launch(gpu, k, shape_l))?);
        }
        let ok = dev.check_errors(gpu).is_ok();
        let p50 = qem_core::stats::percentile(
            &ms.iter().map(|&m| f64::from(m)).collect::<Vec<_>>(),
            50.0,
        );
        let min = ms.iter().copied().fold(f32::INFINITY, f32::min) as f64;
        let max = ms.iter().copied().fold(0.0f32, f32::max) as f64;
        let gbps = acq.raw.len() as f64 / (p50 * 1e-3) / 1e9;
        best = best.max(gbps);
        println!("  warps/CTA {w} {path}: p50 {p50:.3} ms (min {min:.3}, max {max:.3}) = {gbps:.1} GB/s decoded, {:.1} GB/s compressed in; errors after timing: {}", comp as f64 / (p50 * 1e-3) / 1e9, !ok);
        table.push(format!(
            "{name:<28} w{w} {path:<6} {p50:>8.3} ms  {gbps:>7.1} GB/s"
        ));
        timings.push(
            json!({"warps_per_cta": w, "payload": path, "p50_ms": p50, "min_ms": min, "max_ms": max,
            "decoded_gbps_p50": gbps, "compressed_gbps_p50": comp as f64 / (p50 * 1e-3) / 1e9,
            "reps": reps, "warmups": 3, "errors_after_timing": !ok}),
        );
        if !ok {
            rep.check(
                format!("{name}: no errors during timed launches (w{w}, {path})"),
                false,
                "",
            );
        }
    }
    // The output after all timed launches is still exact.
    let out = dev.download(gpu)?;
    let again = combined(&frame_hashes(&out, acq.frame_bytes)) == combined(&raw_hashes);
    rep.check(
        format!("{name}: output still exact after timed launches"),
        again,
        "",
    );
    rec["timings"] = Value::Array(timings);
    rec["best_decoded_gbps"] = json!(best);
    Ok(rec)
}

fn run(args: &Args, rep: &mut Report, table: &mut Vec<String>) -> Result<()> {
    rep.json.insert(
        "command".into(),
        json!(std::env::args().collect::<Vec<_>>()),
    );
    rep.json
        .insert("version".into(), json!(env!("CARGO_PKG_VERSION")));
    if args.gen_only {
        let r = bench_case(
            None,
            "u16 192x192 (gen only)",
            args.frames,
            Shape2::new(192, 192),
            2,
            0,
            &[],
            0,
            rep,
            table,
        )?;
        rep.json.insert("gen_only".into(), r);
        return Ok(());
    }
    println!("== device ==");
    let gpu = Gpu::new(0)?;
    println!("{}", gpu.info().summary());
    rep.json.insert(
        "device".into(),
        serde_json::to_value(gpu.info()).unwrap_or(Value::Null),
    );
    rep.json
        .insert("describe".into(), json!(gpu.info().summary()));

    println!("\n== kernels ==");
    let t = Instant::now();
    let cold = nvrtc::compile_cubin(
        "bslz4_decode.cu",
        qem_cuda::bslz4::KERNEL_SOURCE,
        &gpu.info().arch,
        &[("QEM_MAX_THREADS", "256")],
    );
    let cold_ms = t.elapsed().as_secs_f64() * 1e3;
    let cold_log = match &cold {
        Ok((c, log)) => format!("{} B CUBIN; log: {}", c.len(), log.trim()),
        Err(e) => e.to_string(),
    };
    rep.check(
        "NVRTC cold compile",
        cold.is_ok(),
        format!("{cold_ms:.1} ms; {cold_log}"),
    );
    let t = Instant::now();
    let k = Bslz4Kernels::load(&gpu)?;
    let first_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let k2 = Bslz4Kernels::load(&gpu)?;
    let second_ms = t.elapsed().as_secs_f64() * 1e3;
    println!("first load {first_ms:.1} ms (source {:?}, cache {:?}), second load {second_ms:.1} ms (source {:?})",
        k.module.source, k.module.cache_path, k2.module.source);
    let attrs = k.attributes();
    for a in &attrs {
        println!(
            "  {}: {} regs, {} B static smem, {} B local, sm_{}",
            a.name, a.registers, a.static_shared_bytes, a.local_bytes, a.binary_version
        );
    }
    rep.check(
        "kernels spill nothing",
        attrs.iter().all(|a| a.local_bytes == 0),
        "",
    );
    rep.json.insert("kernels".into(), json!({
        "cold_compile_ms": cold_ms, "first_load_ms": first_ms, "first_load": k.module,
        "second_load_ms": second_ms, "second_load_source": k2.module.source, "attributes": attrs,
    }));
    drop(k2);

    println!("\n== test vectors ==");
    let v = section_vectors(&gpu, &k, &args.vectors, rep)?;
    rep.json.insert("vectors".into(), v);
    println!("\n== malformed LZ4 ==");
    let v = section_malformed(&gpu, &k, &args.vectors, rep)?;
    rep.json.insert("malformed".into(), v);
    println!("\n== mutated chunks ==");
    let per = if args.sanitize_subset { 40 } else { 400 };
    let v = section_mutations(&gpu, &k, &args.vectors, per, rep)?;
    rep.json.insert("mutations".into(), v);
    if args.sanitize_subset {
        rep.json.insert("sanitize_subset".into(), json!(true));
        return Ok(());
    }
    let f = args.frames;
    let cases: [(&str, usize, Shape2, usize, usize); 4] = [
        ("u16 192x192", f, Shape2::new(192, 192), 2, 0),
        ("u32 192x192", f / 2, Shape2::new(192, 192), 4, 0),
        (
            "u16 192x192 block 256",
            f / 2,
            Shape2::new(192, 192),
            2,
            256,
        ),
        ("u16 100x99 (tail, partial)", f, Shape2::new(100, 99), 2, 0),
    ];
    let mut recs = Vec::new();
    for (name, frames, shape, es, be) in cases {
        let r = bench_case(
            Some((&gpu, &k)),
            name,
            frames.max(1),
            shape,
            es,
            be,
            &args.warps,
            args.reps,
            rep,
            table,
        )?;
        recs.push(r);
    }
    rep.json.insert("benchmarks".into(), Value::Array(recs));
    Ok(())
}

fn main() {
    let args = parse_args();
    let mut rep = Report {
        checks: Vec::new(),
        json: serde_json::Map::new(),
    };
    let mut table = Vec::new();
    let t = Instant::now();
    let result = run(&args, &mut rep, &mut table);
    let mut code = 0;
    if let Err(e) = &result {
        println!("\nERROR: {e}");
        rep.json.insert(
            "error".into(),
            json!({"kind": format!("{:?}", e.kind), "message": e.to_string()}),
        );
        code = if e.kind == qem_core::ErrorKind::BackendUnavailable {
            4
        } else {
            1
        };
    }
    let failed = rep.failed();
    if failed > 0 && code == 0 {
        code = 1;
    }
    rep.json.insert(
        "checks".into(),
        Value::Array(
            rep.checks
                .iter()
                .map(|(n, p, d)| json!({"name": n, "pass": p, "detail": d}))
                .collect(),
        ),
    );
    rep.json
        .insert("passed".into(), json!(rep.checks.len() - failed));
    rep.json.insert("failed".into(), json!(failed));
    rep.json
        .insert("wall_s".into(), json!(t.elapsed().as_secs_f64()));
    rep.json.insert("exit_code".into(), json!(code));
    let path = args.out.join("cuda_bslz4_check.json");
    let written = std::fs::create_dir_all(&args.out).and_then(|()| {
        std::fs::write(
            &path,
            serde_json::to_vec_pretty(&Value::Object(rep.json.clone())).unwrap_or_default(),
        )
    });
    println!("\n== summary ==");
    for row in &table {
        println!("{row}");
    }
    for (n, p, d) in rep.checks.iter().filter(|c| !c.1) {
        println!("FAILED: {n}: {d} ({p})");
    }
    println!(
        "checks: {} passed, {failed} failed; JSON: {} ({})",
        rep.checks.len() - failed,
        path.display(),
        written.map_or_else(|e| format!("NOT WRITTEN: {e}"), |()| "written".into())
    );
    println!("exit code {code}");
    std::process::exit(code);
}
