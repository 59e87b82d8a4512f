//! `qem-cuda-products-check`: the GPU detector reductions against the CPU specification
//! (`qem_cpu::reduce_dense` / `reduce_encoded`), and their timings on the reference acquisition.
//!
//! ```text
//! qem-cuda-products-check [--out DIR] [--load MASTER [--repeats R]]
//! ```
//! Part A (generated frames, always): several cases (reference-recipe u16 frames on a
//! rectangular scan, an odd 13×11 detector with all-zero frames and values up to 65535, u32 and
//! u8 dense data); per case one request with binary masks (BF disk, ADF annulus, an edge mask,
//! and nine more to force a split launch), an integer-weighted mask, a float mask, sum/max DP and
//! moments, plus a frame-selection request. GPU ENCODED and GPU dense must equal the CPU engine's
//! integers exactly; float images must agree to a relative L2 of 1e-12.
//!
//! Part B (`--load`): the acquisition loaded ENCODED and dense on the GPU; BF, ADF (disk fitted
//! from the mean DP as docs/science.md §3 says), sum DP, CoM moments, each alone and the four fused in one
//! pass, p50 of R after a warm-up, on both representations (wall time of the whole call: launch,
//! kernel, result copies). The fused results must equal the separate ones and ENCODED must equal
//! dense; every 64th frame is also checked against the CPU engine.
//!
//! Writes `products_check.json` to `--out`; exits 1 when a check failed, 4 without CUDA.

use std::path::{Path, PathBuf};
use std::time::Instant;

use qem_bench::timing::time_p50;
use qem_core::{
    DType, DenseArray, DetectorMask, DetectorPlan, ReduceRequest, ReduceResult, Result, Shape2,
    VirtualImage,
};
use qem_cpu::EncodedFrames;
use qem_cuda::rans::DeviceEncoded;
use qem_cuda::{
    engine, load_array, load_source, load_source_encoded, reduce_dense, reduce_encoded,
    DeviceArray, EncodeOptions, GpuLoadParams, PipelineOptions,
};
use qem_io::{OpenOptions, Source};
use qem_sim::{ReferenceParams, ReferencePattern};
use rayon::prelude::*;
use serde_json::{json, Value};

fn usage() -> ! {
    eprintln!("usage: qem-cuda-products-check [--out DIR] [--load MASTER [--repeats R]]");
    std::process::exit(2)
}

/// splitmix64, for reproducible test values.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// BF disk from the sum DP as docs/science.md §3 defines it: threshold mean + population std of the
/// f32 mean DP, strict `>`, unweighted centroid, equal-area radius.
fn fit_disk(sum_dp: &[u64], n_frames: u64, det: Shape2) -> ((f64, f64), f64) {
    let mean: Vec<f64> = sum_dp
        .iter()
        .map(|&s| f64::from((s as f64 / n_frames as f64) as f32))
        .collect();
    let m = mean.iter().sum::<f64>() / mean.len() as f64;
    let sd = (mean.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / mean.len() as f64).sqrt();
    let (mut n, mut sr, mut sc) = (0usize, 0f64, 0f64);
    for (p, &x) in mean.iter().enumerate() {
        if x > m + sd {
            n += 1;
            sr += (p / det.cols) as f64;
            sc += (p % det.cols) as f64;
        }
    }
    if n == 0 {
        return (
            (det.rows as f64 / 2.0, det.cols as f64 / 2.0),
            det.rows.min(det.cols) as f64 / 4.0,
        );
    }
    (
        (sr / n as f64, sc / n as f64),
        (n as f64 / std::f64::consts::PI).sqrt(),
    )
}

/// Binary annulus `lo² ≤ |k − c|² ≤ hi²` (f64, both inclusive).
fn annulus(det: Shape2, c: (f64, f64), lo: f64, hi: f64) -> DetectorMask {
    DetectorMask::Int(
        (0..det.len())
            .map(|p| {
                let (dr, dc) = ((p / det.cols) as f64 - c.0, (p % det.cols) as f64 - c.1);
                let d2 = dr * dr + dc * dc;
                u32::from(lo * lo <= d2 && d2 <= hi * hi)
            })
            .collect(),
    )
}

fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// Compare two results: integers exactly, float images by relative L2 ≤ 1e-12. Returns the
/// list of differences (empty = equal) and the worst float rel L2.
fn compare(got: &ReduceResult, want: &ReduceResult) -> (Vec<String>, f64) {
    let mut diffs = Vec::new();
    let mut worst = 0f64;
    if got.images.len() != want.images.len() {
        diffs.push(format!(
            "{} images vs {}",
            got.images.len(),
            want.images.len()
        ));
    }
    for (i, (g, w)) in got.images.iter().zip(&want.images).enumerate() {
        match (g, w) {
            (VirtualImage::U64(a), VirtualImage::U64(b)) => {
                if let Some(p) = a.iter().zip(b).position(|(x, y)| x != y) {
                    diffs.push(format!(
                        "image {i} differs first at frame {p}: {} vs {}",
                        a[p], b[p]
                    ));
                } else if a.len() != b.len() {
                    diffs.push(format!("image {i} length"));
                }
            }
            (VirtualImage::F64(a), VirtualImage::F64(b)) => {
                let e = rel_l2(a, b);
                worst = worst.max(e);
                if e.is_nan() || e > 1e-12 || a.len() != b.len() {
                    diffs.push(format!("float image {i}: rel L2 {e:e}"));
                }
            }
            _ => diffs.push(format!("image {i}: kind differs")),
        }
    }
    if got.sum_dp != want.sum_dp {
        diffs.push("sum DP differs".into());
    }
    if got.max_dp != want.max_dp {
        diffs.push("max DP differs".into());
    }
    if got.moments != want.moments {
        diffs.push("moments differ".into());
    }
    if got.n_frames != want.n_frames {
        diffs.push("frame count differs".into());
    }
    (diffs, worst)
}

struct Case {
    name: &'static str,
    scan: Shape2,
    det: Shape2,
    data: DenseArray,
}

fn reference_case(scan: Shape2) -> Result<Case> {
    let det = Shape2::new(192, 192);
    let pat = ReferencePattern::new(ReferenceParams {
        detector_shape: det,
        dose_e_per_frame: 120_000.0,
        ..ReferenceParams::default()
    })?;
    let total = pat.frames();
    let n = scan.len() as u64;
    let frames: Vec<Vec<u16>> = (0..n)
        .into_par_iter()
        .map(|i| {
            let mut lam = vec![0f32; det.len()];
            let mut out = vec![0u32; det.len()];
            pat.loaded_frame(i * total / n, &mut lam, &mut out)
        })
        .collect();
    Ok(Case {
        name: "reference 120k e-/frame, scan 37x41",
        scan,
        det,
        data: DenseArray::U16(frames.concat()),
    })
}

/// Values of every size, every 5th frame all zero, a saturated pixel in some frames.
fn odd_values(scan: Shape2, det: Shape2, max: u64, seed: u64) -> Vec<u64> {
    let mut v = Vec::with_capacity(scan.len() * det.len());
    for f in 0..scan.len() as u64 {
        for p in 0..det.len() as u64 {
            let r = mix(seed ^ (f << 20) ^ p);
            let x = if f % 5 == 0 {
                0
            } else if r % 97 == 0 {
                max
            } else {
                match r % 4 {
                    0 => 0,
                    1 => r >> 60,
                    2 => (r >> 40) % 300,
                    _ => (r >> 20) % (max + 1),
                }
            };
            v.push(x);
        }
    }
    v
}

/// [`odd_values`] as an array of `dtype` (its largest value the dtype's maximum).
fn odd_array(scan: Shape2, det: Shape2, dtype: DType, seed: u64) -> DenseArray {
    let v = odd_values(scan, det, dtype.max_value(), seed).into_iter();
    match dtype {
        DType::U8 => DenseArray::U8(v.map(|x| x as u8).collect()),
        DType::U16 => DenseArray::U16(v.map(|x| x as u16).collect()),
        DType::U32 => DenseArray::U32(v.map(|x| x as u32).collect()),
    }
}

fn requests(det: Shape2, n_frames: u64, sum_dp: &[u64]) -> Vec<(&'static str, ReduceRequest)> {
    let (c, r) = fit_disk(sum_dp, n_frames, det);
    let edge: Vec<u32> = (0..det.len())
        .map(|p| u32::from(p / det.cols == 0 || p % det.cols == det.cols - 1))
        .collect();
    let wint: Vec<u32> = (0..det.len() as u64)
        .map(|p| (mix(p ^ 77) % 65536) as u32)
        .collect();
    let wflt: Vec<f64> = (0..det.len() as u64)
        .map(|p| (mix(p ^ 91) % 2001) as f64 / 1000.0 - 1.0)
        .collect();
    let mut masks = vec![
        annulus(det, c, 0.0, r),
        annulus(det, c, r, 2.0 * r),
        DetectorMask::Int(edge),
        DetectorMask::Int(wint),
        DetectorMask::Float(wflt.clone()),
    ];
    // Nine more binary masks (rings): with the three above, two launches of binary masks.
    for j in 0..9 {
        masks.push(annulus(
            det,
            c,
            j as f64 * r / 3.0,
            (j + 1) as f64 * r / 3.0,
        ));
    }
    masks.push(DetectorMask::Float(wflt.iter().map(|x| x * 0.5).collect()));
    masks.push(DetectorMask::Float(wflt.iter().map(|x| -x).collect()));
    let sel: Vec<u64> = (0..n_frames).filter(|f| f % 3 == 1).collect();
    vec![
        (
            "all products, every frame",
            ReduceRequest {
                masks: masks.clone(),
                sum_dp: true,
                max_dp: true,
                moments: true,
                frames: None,
            },
        ),
        (
            "BF + ADF only (pixel span)",
            ReduceRequest {
                masks: masks[..2].to_vec(),
                ..Default::default()
            },
        ),
        (
            "frame selection: masks, sum and max DP",
            ReduceRequest {
                masks: masks[..5].to_vec(),
                sum_dp: true,
                max_dp: true,
                moments: false,
                frames: Some(sel),
            },
        ),
        (
            "sum DP only",
            ReduceRequest {
                sum_dp: true,
                ..Default::default()
            },
        ),
    ]
}

fn upload_dense(data: &DenseArray, scan: Shape2, det: Shape2) -> Result<DeviceArray> {
    let params = GpuLoadParams {
        scan_region: scan.full(),
        detector: DetectorPlan::new(det, None, 1)?,
        result_dtype: data.dtype(),
        saturate: false,
        bad_mask: None,
        memory_budget: None,
        options: PipelineOptions::default(),
        progress: None,
    };
    Ok(load_array(data, scan, det, &params)?.array)
}

fn run_case(case: &Case) -> Result<(Value, bool)> {
    let e = engine()?;
    let n = case.scan.len();
    let sum = qem_cpu::reduce_dense(
        &case.data,
        n,
        case.det,
        &ReduceRequest {
            sum_dp: true,
            ..Default::default()
        },
    )?
    .sum_dp
    .unwrap_or_default();
    let dense = upload_dense(&case.data, case.scan, case.det)?;
    let encoded = match &case.data {
        DenseArray::U16(v) => {
            let frames = v.chunks_exact(case.det.len());
            let model = qem_cpu::fit_model(frames, case.det.len())?;
            let enc = EncodedFrames::encode(model, case.det, v)?;
            Some((
                DeviceEncoded::upload(
                    &e.gpu,
                    enc.model().clone(),
                    enc.index(),
                    enc.streams(),
                    case.det,
                    None,
                )?,
                enc,
            ))
        }
        _ => None,
    };
    let mut rows = Vec::new();
    let mut ok = true;
    for (what, req) in requests(case.det, n as u64, &sum) {
        let want = qem_cpu::reduce_dense(&case.data, n, case.det, &req)?;
        let (d_diffs, d_worst) = compare(&reduce_dense(&dense, &req)?, &want);
        let mut row = json!({"request": what, "dense_equal": d_diffs.is_empty(),
            "dense_diffs": d_diffs, "dense_float_rel_l2": d_worst});
        ok &= d_diffs.is_empty();
        if let Some((gpu_enc, cpu_enc)) = &encoded {
            let (e_diffs, e_worst) = compare(&reduce_encoded(gpu_enc, &req)?, &want);
            let (c_diffs, _) = compare(&qem_cpu::reduce_encoded(cpu_enc, &req)?, &want);
            ok &= e_diffs.is_empty() && c_diffs.is_empty();
            row["encoded_equal"] = json!(e_diffs.is_empty());
            row["encoded_diffs"] = json!(e_diffs);
            row["encoded_float_rel_l2"] = json!(e_worst);
            row["cpu_encoded_equals_cpu_dense"] = json!(c_diffs.is_empty());
        }
        println!(
            "{:<40} {:<40} dense {} encoded {}",
            case.name,
            what,
            if row["dense_equal"] == json!(true) {
                "="
            } else {
                "DIFFERS"
            },
            match row.get("encoded_equal") {
                Some(v) if v == &json!(true) => "=",
                Some(_) => "DIFFERS",
                None => "n/a",
            }
        );
        rows.push(row);
    }
    Ok((
        json!({"case": case.name, "scan": [case.scan.rows, case.scan.cols],
            "detector": [case.det.rows, case.det.cols], "dtype": case.data.dtype().to_string(),
            "requests": rows, "pass": ok}),
        ok,
    ))
}

fn run_load(master: &Path, repeats: usize) -> Result<(Value, bool)> {
    let e = engine()?;
    let src = Source::open(master, &OpenOptions::default())?;
    let bad = src.bad_pixel_mask();
    let params = qem_bench::whole_u16_load(&src, bad.as_deref())?;
    let det = src.detector_shape;
    let n = src.scan_shape.len() as u64;
    let enc = load_source_encoded(&src, &params, &EncodeOptions::default())?.encoded;
    let dense = load_source(&src, &params)?.array;
    let sum_req = ReduceRequest {
        sum_dp: true,
        ..Default::default()
    };
    let sum = reduce_encoded(&enc, &sum_req)?.sum_dp.unwrap_or_default();
    let (c, r) = fit_disk(&sum, n, det);
    let bf = annulus(det, c, 0.0, r);
    let adf = annulus(det, c, r, 2.0 * r);
    let bf_px = bf.support().len();
    let adf_px = adf.support().len();
    let one = |m: &DetectorMask| ReduceRequest {
        masks: vec![m.clone()],
        ..Default::default()
    };
    let cases: Vec<(&str, ReduceRequest)> = vec![
        ("bf", one(&bf)),
        ("adf", one(&adf)),
        ("sum_dp", sum_req.clone()),
        (
            "com_moments",
            ReduceRequest {
                moments: true,
                ..Default::default()
            },
        ),
        (
            "fused bf+adf+sum_dp+moments",
            ReduceRequest {
                masks: vec![bf.clone(), adf.clone()],
                sum_dp: true,
                moments: true,
                ..Default::default()
            },
        ),
    ];
    let raw = n * det.len() as u64 * 2;
    let mut rows = Vec::new();
    let mut ok = true;
    let mut fused: Vec<ReduceResult> = Vec::new();
    let mut separate: Vec<Vec<ReduceResult>> = vec![Vec::new(), Vec::new()];
    for (ri, rep) in ["encoded", "dense"].iter().enumerate() {
        for (name, req) in &cases {
            let (mid, all, res) = time_p50(repeats, || {
                if ri == 0 {
                    reduce_encoded(&enc, req)
                } else {
                    reduce_dense(&dense, req)
                }
            })?;
            // Bytes the pass must read: the streams (encoded) or the frames' pixel span (dense).
            let read = if ri == 0 {
                enc.stream_bytes()
            } else if req.sum_dp || req.moments {
                raw
            } else {
                let s = req
                    .masks
                    .iter()
                    .flat_map(|m| m.support())
                    .collect::<Vec<_>>();
                let lo = s.iter().min().copied().unwrap_or(0) as u64 & !7;
                let hi = (s.iter().max().copied().unwrap_or(0) as u64 + 1).next_multiple_of(8);
                n * (hi - lo) * 2
            };
            println!(
                "{rep:<8} {name:<30} p50 {:>8.2} ms  (min {:.2}, max {:.2})  reads {:.2} GB = {:.0} GB/s",
                mid * 1e3,
                all.iter().cloned().fold(f64::INFINITY, f64::min) * 1e3,
                all.iter().cloned().fold(0.0, f64::max) * 1e3,
                read as f64 / 1e9,
                read as f64 / mid / 1e9
            );
            rows.push(
                json!({"representation": rep, "product": name, "p50_s": mid, "runs_s": all,
                "bytes_read": read, "read_gbs": read as f64 / mid / 1e9,
                "u16_equivalent_gbs": raw as f64 / mid / 1e9}),
            );
            if name.starts_with("fused") {
                fused.push(res);
            } else {
                separate[ri].push(res);
            }
        }
    }
    // Fused = separate, encoded = dense.
    let mut checks = Vec::new();
    for (ri, f) in fused.iter().enumerate() {
        let s = &separate[ri];
        let eq = f.images.first() == s[0].images.first()
            && f.images.get(1) == s[1].images.first()
            && f.sum_dp == s[2].sum_dp
            && f.moments == s[3].moments;
        ok &= eq;
        checks.push(json!({"representation": ri, "fused_equals_separate": eq}));
    }
    let (d, _) = compare(&fused[0], &fused[1]);
    ok &= d.is_empty();
    // Every 64th frame against the CPU engine (frames decoded by the GPU, reduced by the CPU).
    let sel: Vec<u64> = (0..n).step_by(64).collect();
    let mut frames = Vec::with_capacity(sel.len() * det.len());
    let k = e.rans()?;
    for &f in &sel {
        frames.extend(enc.download_frames(&e.gpu, k, f, 1)?);
    }
    let cpu_req = ReduceRequest {
        masks: vec![bf.clone(), adf.clone()],
        sum_dp: true,
        max_dp: true,
        moments: true,
        frames: None,
    };
    let cpu = qem_cpu::reduce_dense(&DenseArray::U16(frames), sel.len(), det, &cpu_req)?;
    let gpu_req = ReduceRequest {
        frames: Some(sel.clone()),
        ..cpu_req
    };
    let (cd, _) = compare(&reduce_encoded(&enc, &gpu_req)?, &cpu);
    let (dd, _) = compare(&reduce_dense(&dense, &gpu_req)?, &cpu);
    ok &= cd.is_empty() && dd.is_empty();
    println!(
        "fused = separate: {:?}; encoded = dense: {}; every 64th frame vs CPU: encoded {} dense {}",
        checks,
        d.is_empty(),
        cd.is_empty(),
        dd.is_empty()
    );
    Ok((
        json!({"source": master.display().to_string(), "scan_shape": [src.scan_shape.rows, src.scan_shape.cols],
            "detector_shape": [det.rows, det.cols], "frames": n, "raw_u16_bytes": raw,
            "stream_bytes": enc.stream_bytes(), "disk": {"center_px": [c.0, c.1], "radius_px": r,
            "bf_pixels": bf_px, "adf_pixels": adf_px},
            "bf_total": fused[0].images.first().map(|i| i.to_f64().iter().sum::<f64>()),
            "sum_dp_total": fused[0].sum_dp.as_ref().map(|s| s.iter().sum::<u64>()),
            "cache_state": "data resident on the GPU (ENCODED and dense copies); one warm-up call per product",
            "timing": "wall of the whole call (launch, kernels, result copies to the host), p50",
            "repeats": repeats, "rows": rows, "fused_checks": checks, "encoded_equals_dense": d.is_empty(),
            "cpu_check_every_64th_frame": {"frames": sel.len(), "encoded_equal": cd.is_empty(), "dense_equal": dd.is_empty(),
                "encoded_diffs": cd, "dense_diffs": dd}, "pass": ok}),
        ok,
    ))
}

/// Corrupt ENCODED data must give a typed decode error naming a corrupted frame, on every
/// request shape, never a result: byte flips in the middle of chosen streams, a truncated index
/// length, an index pointing outside the arena, and forged extra bits (values above 65535).
fn run_corrupt() -> Result<(Value, bool)> {
    let e = engine()?;
    let det = Shape2::new(13, 11);
    let scan = Shape2::new(9, 7);
    let v: Vec<u16> = odd_values(scan, det, 65535, 9)
        .into_iter()
        .map(|x| x as u16)
        .collect();
    let model = qem_cpu::fit_model(v.chunks_exact(det.len()), det.len())?;
    let enc = EncodedFrames::encode(model, det, &v)?;
    let reqs = requests(det, scan.len() as u64, &vec![1u64; det.len()]);
    let mut rows = Vec::new();
    let mut ok = true;
    let targets = [4usize, 17, 40];
    for (what, mutate) in [
        ("flip a byte in the word/bit area", 0u8),
        ("length one word short", 1),
        ("offset outside the arena", 2),
        ("every extra bit set (buckets above 65535)", 3),
    ] {
        let mut streams = enc.streams().to_vec();
        let mut index = enc.index().to_vec();
        // The frames whose bytes the mutation really touches (a flip placed past the end of a
        // short stream lands in the next stream's header).
        let mut touched: Vec<usize> = Vec::new();
        for &f in &targets {
            let ent = &mut index[f];
            match mutate {
                0 => {
                    let at = ent.offset as usize + 144 + (ent.length as usize - 144) / 2;
                    streams[at] ^= 0x5a;
                    touched.extend(enc.index().iter().position(|e| {
                        (e.offset as usize..e.offset as usize + e.length as usize).contains(&at)
                    }));
                }
                1 => {
                    ent.length -= 4;
                    touched.push(f);
                }
                3 => {
                    // Only the values change: the stream stays consistent, and the u16 range
                    // check must reject it (where the frame has an nb = 15 bucket).
                    let o = ent.offset as usize;
                    let word = |at: usize| {
                        u32::from_le_bytes([
                            streams[o + at],
                            streams[o + at + 1],
                            streams[o + at + 2],
                            streams[o + at + 3],
                        ]) as usize
                    };
                    let (n_words, n_bits) = (word(0), word(4));
                    let ex0 = o + 144 + 4 * n_words.div_ceil(2);
                    for b in 0..n_bits {
                        streams[ex0 + b / 8] |= 1 << (b % 8);
                    }
                    touched.push(f);
                }
                _ => {
                    ent.offset = (streams.len() as u64 + 4096).next_multiple_of(16);
                    touched.push(f);
                }
            }
        }
        let up = DeviceEncoded::upload(&e.gpu, enc.model().clone(), &index, &streams, det, None);
        let dev = match (mutate, up) {
            // The upload itself refuses an index outside the arena: that is the typed error.
            (2, Err(er)) => {
                rows.push(json!({"mutation": what, "verdict": "refused at upload", "error": er.to_string()}));
                continue;
            }
            (_, Err(er)) => return Err(er),
            (_, Ok(d)) => d,
        };
        for (name, req) in &reqs {
            let r = reduce_encoded(&dev, req);
            let (pass, msg) = match &r {
                Err(er) => (
                    er.kind == qem_core::ErrorKind::Decode
                        && er.frame.is_some_and(|f| touched.contains(&(f as usize))),
                    er.to_string(),
                ),
                Ok(_) => (false, "returned a result".to_string()),
            };
            // A byte flip may leave a stream decodable (the codec cannot see every flip): the
            // CPU decoder is the judge of which frames really are corrupt.
            let cpu_verdict = match EncodedFrames::from_parts(
                enc.model().clone(),
                det,
                index.clone(),
                streams.clone(),
            ) {
                Err(_) => true,
                Ok(c) => qem_cpu::reduce_encoded(&c, req).is_err(),
            };
            let pass = pass || (!cpu_verdict && r.is_ok());
            ok &= pass;
            rows.push(json!({"mutation": what, "request": name, "gpu_error": msg,
                "touched_frames": touched, "cpu_rejects": cpu_verdict, "pass": pass}));
        }
    }
    println!(
        "corrupt ENCODED data: {} verdicts, {}",
        rows.len(),
        if ok {
            "all typed errors where the CPU rejects"
        } else {
            "SOME DIFFER"
        }
    );
    Ok((json!({"rows": rows, "pass": ok}), ok))
}

/// cuFFT iDPC against the CPU solver (periodic and mirror, odd and even grids), and its time.
fn run_idpc() -> Result<(Value, bool)> {
    use qem_cpu::dpc::{integrate, integrate_with, EdgeMode};
    let mut rows = Vec::new();
    let mut ok = true;
    for (r, c) in [(37usize, 41usize), (64, 48), (512, 512)] {
        let shape = Shape2::new(r, c);
        let field = |seed: u64| -> Vec<f64> {
            (0..(r * c) as u64)
                .map(|p| (mix(seed ^ p) % 20001) as f64 / 1e4 - 1.0)
                .collect()
        };
        let (gr, gc) = (field(5), field(6));
        for edge in [EdgeMode::Periodic, EdgeMode::Mirror] {
            let t = Instant::now();
            let want = integrate(&gr, &gc, shape, edge)?;
            let cpu_s = t.elapsed().as_secs_f64();
            let (mid, all, got) = time_p50(20, || {
                integrate_with(&gr, &gc, shape, edge, qem_cuda::fft::integrate_periodic)
            })?;
            let e = rel_l2(&got, &want);
            let pass = e <= 1e-10;
            ok &= pass;
            println!(
                "iDPC {r}x{c} {:<8} GPU p50 {:.3} ms (CPU one run {:.3} ms), rel L2 vs CPU {e:.2e} {}",
                edge.name(),
                mid * 1e3,
                cpu_s * 1e3,
                if pass { "=" } else { "DIFFERS" }
            );
            rows.push(
                json!({"scan": [r, c], "edge": edge.name(), "gpu_p50_s": mid, "gpu_runs_s": all,
                "cpu_single_run_s": cpu_s, "rel_l2_vs_cpu": e, "pass": pass}),
            );
        }
    }
    Ok((
        json!({"timing": "wall of integrate_with(.., cuFFT): host mirror, upload, plans, 2 D2Z, combine, Z2D, download", "rows": rows, "pass": ok}),
        ok,
    ))
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let (mut out, mut load, mut repeats) = (PathBuf::from("."), None, 10usize);
    let mut i = 0;
    while i < argv.len() {
        let v = argv.get(i + 1).cloned().unwrap_or_else(|| usage());
        match argv[i].as_str() {
            "--out" => out = PathBuf::from(v),
            "--load" => load = Some(PathBuf::from(v)),
            "--repeats" => repeats = v.parse::<usize>().unwrap_or_else(|_| usage()).max(1),
            _ => usage(),
        }
        i += 2;
    }
    let run = || -> Result<(Value, bool)> {
        let info = qem_bench::cuda_device_or_exit();
        let odd = Shape2::new(13, 11);
        let scan = Shape2::new(9, 7);
        let cases = vec![
            reference_case(Shape2::new(37, 41))?,
            Case {
                name: "odd 13x11 u16, zero frames, 65535",
                scan,
                det: odd,
                data: odd_array(scan, odd, DType::U16, 1),
            },
            Case {
                // 120 pixels (16-byte loads) in rows of 10: groups of 8 cross rows.
                name: "12x10 u16, 8-pixel groups across rows",
                scan,
                det: Shape2::new(12, 10),
                data: odd_array(scan, Shape2::new(12, 10), DType::U16, 4),
            },
            Case {
                // kc = 136 ≥ 128: the ENCODED moments go by groups of four steps, whose row
                // change falls at every step position across the lanes (kc % 32 != 0).
                name: "21x136 u16, ENCODED moments by 4-step groups",
                scan,
                det: Shape2::new(21, 136),
                data: odd_array(scan, Shape2::new(21, 136), DType::U16, 5),
            },
            Case {
                name: "odd 13x11 u32 (dense only)",
                scan,
                det: odd,
                data: odd_array(scan, odd, DType::U32, 2),
            },
            Case {
                name: "odd 13x11 u8 (dense only)",
                scan,
                det: odd,
                data: odd_array(scan, odd, DType::U8, 3),
            },
        ];
        let mut all = true;
        let mut out_cases = Vec::new();
        for c in &cases {
            let (v, ok) = run_case(c)?;
            all &= ok;
            out_cases.push(v);
        }
        let (idpc_v, idpc_ok) = run_idpc()?;
        all &= idpc_ok;
        let (corrupt_v, corrupt_ok) = run_corrupt()?;
        all &= corrupt_ok;
        let load_v = match &load {
            Some(m) => {
                let (v, ok) = run_load(m, repeats)?;
                all &= ok;
                v
            }
            None => Value::Null,
        };
        Ok((
            json!({"tool": "qem-cuda-products-check", "device": info,
                "git_revision": std::env::var("QEM_GIT_REVISION").unwrap_or_else(|_| "unknown".into()),
                "command": std::env::args().collect::<Vec<_>>().join(" "),
                "cases": out_cases, "idpc": idpc_v, "corrupt": corrupt_v, "load": load_v, "pass": all}),
            all,
        ))
    };
    qem_bench::finish_check(&out, "products_check.json", run())
}
