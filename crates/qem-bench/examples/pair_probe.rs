//! Probe (study, no format change): how much faster would the GPU decode **two-pixel
//! symbols**? `pair_study` estimated the steps on the CPU (0.57× at the reference dose, +3.7 %
//! size); this measures the decode on the card before anyone builds a format version.
//!
//! Candidate ("pairs"): lane j at pair step u codes pixels 64u + j and 64u + 32 + j (v2 steps
//! 2u and 2u + 1) as one joint symbol a·8 + b (a, b < 8) from a pair table row (table set, class
//! of the first pixel), or the escape 64 followed, for the escaping lanes only, by both values
//! as v2 symbols (buckets and extra bits as in v2); a pair step is coded so when all 64 of its
//! pixels have a class below `d` (static, from the context map), else as two v2 steps. Every
//! rANS detail (state, renormalisation, word order, extra-bit order, header) is v2's.
//!
//! Encoded here on the CPU (this file's encoder; in `flat` mode it must give the v2 encoder's
//! bytes, checked on every frame), decoded on the card by a study kernel compiled with rans.cu
//! that reuses its per-step decode (`rans_decode_symbol`, `rans_bucket_value`, `rans_open`,
//! `rans_close`) and sums each frame. Rows, each a p50 of `repeats` over the same frames:
//!
//! * `v2 production frame sums`: the engine's `qem_rans_frame_sums` on the v2 streams;
//! * `v2, study loop`: the study kernel with no pair steps, on the v2 streams (3 CTAs per SM);
//! * `v2, study loop, pair smem`: the same with the pair tables' shared memory reserved
//!   (2 CTAs per SM, the occupancy the pair kernel gets);
//! * `pairs d=…`: the study kernel on the pair streams.
//!
//! Every row's frame sums must equal the CPU's (and every stream close cleanly: words, extra
//! bits, final states, table set). Run on the GPU host:
//! `pair_probe OUT.json [--frames 32768] [--dose 120000] [--d 6,8,10] [--repeats 5]`; with
//! `--cpu-only` it stops after the CPU checks (the encoder against v2, the CPU decode of every
//! candidate's first 256 frames), which need no card.

use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use qem_codec::rans::{
    encode_stream, fit_freq, symbol_of, CountsModel, FloorPolicy, ModelParams, PROB_BITS,
    STATE_LOWER, STREAM_HEADER_BYTES,
};
use qem_core::Shape2;
use qem_cuda::mem::DevBuf;
use qem_cuda::{engine, DeviceEncoded, DeviceModel};
use rayon::prelude::*;
use serde_json::{json, Value};

#[path = "shared/reference_frames.rs"]
mod reference_frames;

/// Joint alphabet: a·Q + b for a, b < Q, then the escape.
const Q: u32 = 8;
const ESCAPE: u32 = Q * Q;
const LANES: usize = 32;

/// The study kernel, compiled after rans.cu (whose device functions it calls).
const STUDY_KERNEL: &str = r#"
// Study kernel (crates/qem-bench/examples/pair_probe.rs): per-frame sums of streams whose pair
// steps (bit u of `pairs`, when use_pairs) hold one joint symbol of the pair tables `mp`.
extern "C" __global__ void __launch_bounds__(512, 3) qem_pair_frame_sums(
    const u8* __restrict__ arena, u64 arena_len, const u32* __restrict__ index, u64 first,
    u64 count, RansModel m, RansModel mp, const u32* __restrict__ pairs, u32 use_pairs,
    u64* __restrict__ out, u32* err) {
    extern __shared__ __align__(16) u32 smem_p[];
    m = stage_model(m, smem_p);
    if (use_pairs) mp = stage_model(mp, (u32*)(m.lut + m.T * LUT_PER_ROW * CPAD));
    // The engine's warp loop written out (QEM_RANS_WARP_LOOP's body may hold no top-level comma).
    const u32 lane = threadIdx.x & 31u;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 k = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); k < count; k += warps) {
        const u64 i = first + k;
        const u8* st;
        u64 len;
        u32 a = 0u;
        u32 b = 0u;
        u32 code = R_INDEX;
        u64 acc = 0ull;
        if (stream_at(arena, arena_len, index, i, st, len)) {
            RansStream s;
            code = rans_open(st, len, m, lane, s, a, b);
            if (code == R_OK) {
                StreamCtx kp = s.k;
                if (use_pairs) {
                    kp.tb = (u32)__cvta_generic_to_shared(mp.tab) + s.set * mp.C * mp.sp4;
                    kp.lb = (u32)__cvta_generic_to_shared(mp.lut) + s.set * LUT_PER_ROW * CPAD;
                    kp.sp4 = mp.sp4;
                }
                const u32 n = m.n;
                const u32 units = n >> 6;
                u32 part = 0u;
                for (u32 u = 0; u < units; ++u) {
                    const u32 pa = (u << 6) + lane;
                    const u32 pb = pa + 32u;
                    const u32 ca = __ldg(m.ctx + pa);
                    const u32 cb = __ldg(m.ctx + pb);
                    u32 va;
                    u32 vb;
                    if (use_pairs && ((__ldg(pairs + (u >> 5)) >> (u & 31u)) & 1u)) {
                        const u32 sj = rans_decode_symbol<false>(s.d, kp, pa, ca, lane);
                        const bool esc = sj >= 64u;
                        va = sj >> 3;
                        vb = sj & 7u;
                        if (__any_sync(FULL_MASK, esc)) {
                            u32 sa = rans_decode_symbol<true>(s.d, s.k, esc ? pa : n, ca, lane);
                            u32 sb = rans_decode_symbol<true>(s.d, s.k, esc ? pb : n, cb, lane);
                            sa = rans_bucket_value(s.d, s.k, sa, esc, lane);
                            sb = rans_bucket_value(s.d, s.k, sb, esc, lane);
                            if (esc) {
                                va = sa;
                                vb = sb;
                            }
                        }
                    } else {
                        u32 sa = rans_decode_symbol<false>(s.d, s.k, pa, ca, lane);
                        u32 sb = rans_decode_symbol<false>(s.d, s.k, pb, cb, lane);
                        if (__any_sync(FULL_MASK, max(sa, sb) >= s.k.K)) {
                            sa = rans_bucket_value(s.d, s.k, sa, true, lane);
                            sb = rans_bucket_value(s.d, s.k, sb, true, lane);
                        }
                        va = sa;
                        vb = sb;
                    }
                    if (ca < m.split) s.d.stat += va;
                    if (cb < m.split) s.d.stat += vb;
                    part += va + vb;
                    if ((u & 15u) == 15u) {
                        acc += part;
                        part = 0u;
                        s.flush_stat();
                    }
                }
                acc += part;
                for (u32 t = units << 1; t < ((n + 31u) >> 5); ++t) {
                    const u32 p = (t << 5) + lane;
                    const u32 c = p < n ? __ldg(m.ctx + p) : 0u;
                    acc += rans_symbol<true>(s.d, s.k, p, c, lane);
                }
                s.flush_stat();
                code = rans_close(s, m, a, b);
            }
        }
        const u64 t = warp_sum_u64(acc);
        if (lane == 0u) out[k] = code == R_OK ? t : ~0ull;
        if (code != R_OK && lane == 0u) rans_report(err, i, code, a, b);
    }
}
"#;

/// One coded symbol of a step: the lane, its frequency and cumulative frequency.
#[derive(Clone, Copy)]
struct Ev {
    lane: usize,
    f: u32,
    cu: u32,
}

/// A frame's coding events in decoder order: steps of events (lanes ascending) and the extra
/// bits (value, count) in the order the decoder reads them.
#[derive(Default)]
struct Events {
    steps: Vec<Vec<Ev>>,
    extras: Vec<(u32, u32)>,
}

/// Frequencies and cumulative frequencies of table rows of `s` symbols.
struct Rows {
    freq: Vec<u16>,
    cum: Vec<u32>,
    s: usize,
}

impl Rows {
    fn new(freq: Vec<u16>, s: usize) -> Rows {
        let mut cum = vec![0u32; freq.len()];
        for (r, row) in freq.chunks(s).enumerate() {
            let mut c = 0u32;
            for (i, &f) in row.iter().enumerate() {
                cum[r * s + i] = c;
                c += u32::from(f);
            }
        }
        Rows { freq, cum, s }
    }
    fn ev(&self, lane: usize, row: usize, sym: u32) -> Result<Ev> {
        let i = row * self.s + sym as usize;
        let f = u32::from(self.freq[i]);
        if f == 0 {
            bail!("symbol {sym} of row {row} has frequency 0");
        }
        Ok(Ev {
            lane,
            f,
            cu: self.cum[i],
        })
    }
}

/// The lanes' pixels of pair step u: the first pixels (v2 step 2u) and the second (2u + 1).
fn pair_lanes(u: usize) -> [Vec<Option<usize>>; 2] {
    [0, 32].map(|o| (0..LANES).map(|j| Some(64 * u + o + j)).collect())
}

/// The lanes' pixels of v2 step t (`None` past the frame's `n` pixels).
fn step_lanes(t: usize, n: usize) -> Vec<Option<usize>> {
    (0..LANES)
        .map(|j| Some(LANES * t + j).filter(|&p| p < n))
        .collect()
}

/// `ps` with only the escaping lanes kept.
fn escaping(ps: &[Option<usize>], esc: &[bool]) -> Vec<Option<usize>> {
    ps.iter().zip(esc).map(|(p, &e)| p.filter(|_| e)).collect()
}

/// What the encoder needs of a model and its pair tables.
struct Coder<'a> {
    model: &'a CountsModel,
    v2: Rows,
    pair: Option<(Rows, usize, Vec<bool>)>,
}

impl<'a> Coder<'a> {
    /// The coder of `model` with its v2 rows, and the pair rows (rows, d, pair steps) if any.
    fn new(model: &'a CountsModel, pair: Option<(Rows, usize, Vec<bool>)>) -> Coder<'a> {
        Coder {
            model,
            v2: Rows::new(model.freq().to_vec(), model.symbols()),
            pair,
        }
    }

    /// A v2 step over `pixels` (one per lane, `None` past the frame), its extra bits after.
    fn v2_step(
        &self,
        ev: &mut Events,
        set: usize,
        frame: &[u16],
        pixels: &[Option<usize>],
    ) -> Result<()> {
        let (k, c_n) = (
            u32::from(self.model.literals()),
            self.model.contexts() as usize,
        );
        let ctx = self.model.ctx_map();
        let mut step = Vec::with_capacity(LANES);
        for (lane, p) in pixels.iter().enumerate() {
            let Some(p) = *p else { continue };
            let (s, nb, extra) =
                symbol_of(u32::from(frame[p]), k).ok_or_else(|| anyhow!("no symbol"))?;
            step.push(self.v2.ev(lane, set * c_n + ctx[p] as usize, s)?);
            if nb > 0 {
                ev.extras.push((extra, nb));
            }
        }
        ev.steps.push(step);
        Ok(())
    }

    fn events(&self, frame: &[u16], set: usize) -> Result<Events> {
        let n = frame.len();
        let ctx = self.model.ctx_map();
        let mut ev = Events::default();
        let units = n / 64;
        for u in 0..units {
            let [pa, pb] = pair_lanes(u);
            match &self.pair {
                Some((rows, d, dark)) if dark[u] => {
                    let mut step = Vec::with_capacity(LANES);
                    let mut esc = vec![false; LANES];
                    for j in 0..LANES {
                        let (a, b) = (
                            u32::from(frame[64 * u + j]),
                            u32::from(frame[64 * u + 32 + j]),
                        );
                        let sym = if a < Q && b < Q { a * Q + b } else { ESCAPE };
                        esc[j] = sym == ESCAPE;
                        step.push(rows.ev(j, set * d + ctx[64 * u + j] as usize, sym)?);
                    }
                    ev.steps.push(step);
                    if esc.iter().any(|&e| e) {
                        // Both sub-steps' symbols first, then their extra bits (A's lanes, then B's).
                        let mut a = Events::default();
                        let mut b = Events::default();
                        self.v2_step(&mut a, set, frame, &escaping(&pa, &esc))?;
                        self.v2_step(&mut b, set, frame, &escaping(&pb, &esc))?;
                        ev.steps.append(&mut a.steps);
                        ev.steps.append(&mut b.steps);
                        ev.extras.append(&mut a.extras);
                        ev.extras.append(&mut b.extras);
                    }
                }
                _ => {
                    // Two v2 steps; the study kernel reads both symbols, then both steps' bits.
                    self.v2_step(&mut ev, set, frame, &pa)?;
                    self.v2_step(&mut ev, set, frame, &pb)?;
                }
            }
        }
        for t in (units * 2)..n.div_ceil(LANES) {
            self.v2_step(&mut ev, set, frame, &step_lanes(t, n))?;
        }
        Ok(ev)
    }

    /// The stream of `frame`: v2's header, words and extra-bit layout.
    fn encode(&self, frame: &[u16]) -> Result<Vec<u8>> {
        let set = self.model.table_set_for(frame) as usize;
        let ev = self.events(frame, set)?;
        let mut x = [STATE_LOWER; LANES];
        let mut words: Vec<u16> = Vec::new();
        for step in ev.steps.iter().rev() {
            for e in step.iter().rev() {
                let s = &mut x[e.lane];
                if u64::from(*s) >= (u64::from(e.f) << (32 - PROB_BITS)) {
                    words.push(*s as u16);
                    *s >>= 16;
                }
                *s = (*s / e.f) * (1 << PROB_BITS) + (*s % e.f) + e.cu;
            }
        }
        words.reverse();
        let n_bits: u64 = ev.extras.iter().map(|&(_, nb)| u64::from(nb)).sum();
        let mut extra = vec![0u32; n_bits.div_ceil(32) as usize];
        let mut at = 0u64;
        for &(v, nb) in &ev.extras {
            for i in 0..nb {
                if (v >> i) & 1 == 1 {
                    extra[(at / 32) as usize] |= 1 << (at % 32);
                }
                at += 1;
            }
        }
        let mut out =
            Vec::with_capacity(STREAM_HEADER_BYTES + 2 * words.len() + 4 * extra.len() + 2);
        for w in [words.len() as u32, n_bits as u32, set as u32, 0] {
            out.extend_from_slice(&w.to_le_bytes());
        }
        for s in x {
            out.extend_from_slice(&s.to_le_bytes());
        }
        for w in &words {
            out.extend_from_slice(&w.to_le_bytes());
        }
        if words.len() % 2 == 1 {
            out.extend_from_slice(&[0, 0]);
        }
        for w in &extra {
            out.extend_from_slice(&w.to_le_bytes());
        }
        Ok(out)
    }
}

/// The study decoder on the CPU (the kernel's order, step by step): the frame of `stream`, or
/// why it is not a clean stream. Checks the encoder before any card is involved.
fn decode(c: &Coder<'_>, stream: &[u8], n: usize) -> Result<Vec<u16>> {
    let word = |i: usize| {
        u32::from_le_bytes([
            stream[4 * i],
            stream[4 * i + 1],
            stream[4 * i + 2],
            stream[4 * i + 3],
        ])
    };
    let (n_words, n_bits, set) = (word(0) as usize, word(1) as usize, word(2) as usize);
    let mut x: Vec<u32> = (0..LANES).map(|j| word(4 + j)).collect();
    let wbase = STREAM_HEADER_BYTES;
    let words: Vec<u32> = (0..n_words)
        .map(|i| {
            u32::from(u16::from_le_bytes([
                stream[wbase + 2 * i],
                stream[wbase + 2 * i + 1],
            ]))
        })
        .collect();
    let ebase = wbase + 4 * n_words.div_ceil(2);
    let (mut wi, mut bi) = (0usize, 0usize);
    let (k, c_n) = (u32::from(c.model.literals()), c.model.contexts() as usize);
    let ctx = c.model.ctx_map();
    let mut out = vec![0u16; n];
    // One step: lanes with Some(row) decode a symbol of `rows` row `row`, then renormalise in
    // lane order.
    let mut step = |rows: &Rows, lanes: &[Option<usize>], x: &mut Vec<u32>| -> Result<Vec<u32>> {
        let mut sym = vec![0u32; LANES];
        for (j, r) in lanes.iter().enumerate() {
            let Some(r) = *r else { continue };
            let slot = x[j] & ((1 << PROB_BITS) - 1);
            let row = &rows.freq[r * rows.s..(r + 1) * rows.s];
            let cum = &rows.cum[r * rows.s..(r + 1) * rows.s];
            let s = (0..rows.s)
                .find(|&i| cum[i] <= slot && slot < cum[i] + u32::from(row[i]))
                .ok_or_else(|| anyhow!("no symbol holds slot {slot}"))?;
            x[j] = u32::from(row[s]) * (x[j] >> PROB_BITS) + slot - cum[s];
            if x[j] < STATE_LOWER {
                let w = *words.get(wi).ok_or_else(|| anyhow!("words ran out"))?;
                wi += 1;
                x[j] = (x[j] << 16) | w;
            }
            sym[j] = s as u32;
        }
        Ok(sym)
    };
    let mut bits = |nb: u32| -> Result<u32> {
        let mut v = 0u32;
        for i in 0..nb {
            if bi >= n_bits {
                bail!("extra bits ran out");
            }
            let w = u32::from_le_bytes(
                stream[ebase + 4 * (bi / 32)..ebase + 4 * (bi / 32) + 4].try_into()?,
            );
            v |= ((w >> (bi % 32)) & 1) << i;
            bi += 1;
        }
        Ok(v)
    };
    let value = |s: u32, bits: &mut dyn FnMut(u32) -> Result<u32>| -> Result<u32> {
        Ok(if s < k {
            s
        } else {
            let nb = s - k;
            k - 1 + (1 << nb) + bits(nb)?
        })
    };
    let v2_rows = |ps: &[Option<usize>]| -> Vec<Option<usize>> {
        ps.iter()
            .map(|p| p.map(|p| set * c_n + ctx[p] as usize))
            .collect()
    };
    let units = n / 64;
    // The values of a (sub)step's lanes, their extra bits read in lane order.
    let mut values = |ps: &[Option<usize>], ss: &[u32], out: &mut Vec<u16>| -> Result<()> {
        for (p, &s) in ps.iter().zip(ss) {
            if let Some(p) = *p {
                out[p] = value(s, &mut bits)? as u16;
            }
        }
        Ok(())
    };
    for u in 0..units {
        let [pa, pb] = pair_lanes(u);
        match &c.pair {
            Some((rows, d, dark)) if dark[u] => {
                let pr: Vec<Option<usize>> = pa
                    .iter()
                    .map(|p| p.map(|p| set * d + ctx[p] as usize))
                    .collect();
                let sj = step(rows, &pr, &mut x)?;
                let esc: Vec<bool> = sj.iter().map(|&s| s == ESCAPE).collect();
                for j in 0..LANES {
                    out[64 * u + j] = (sj[j] / Q) as u16;
                    out[64 * u + 32 + j] = (sj[j] % Q) as u16;
                }
                if esc.iter().any(|&e| e) {
                    let (ea, eb) = (escaping(&pa, &esc), escaping(&pb, &esc));
                    let sa = step(&c.v2, &v2_rows(&ea), &mut x)?;
                    let sb = step(&c.v2, &v2_rows(&eb), &mut x)?;
                    values(&ea, &sa, &mut out)?;
                    values(&eb, &sb, &mut out)?;
                }
            }
            _ => {
                let sa = step(&c.v2, &v2_rows(&pa), &mut x)?;
                let sb = step(&c.v2, &v2_rows(&pb), &mut x)?;
                values(&pa, &sa, &mut out)?;
                values(&pb, &sb, &mut out)?;
            }
        }
    }
    for t in (units * 2)..n.div_ceil(LANES) {
        let ps = step_lanes(t, n);
        let ss = step(&c.v2, &v2_rows(&ps), &mut x)?;
        values(&ps, &ss, &mut out)?;
    }
    if x.iter().any(|&s| s != STATE_LOWER) || wi != n_words || bi != n_bits {
        bail!(
            "unclean end: states {:?}, words {wi}/{n_words}, bits {bi}/{n_bits}",
            &x[..4]
        );
    }
    Ok(out)
}

/// The pair tables for classes below `d`: rows (set, class) of Q² + 1 symbols fitted on
/// `frames` (`fit_freq` rows are literals + 16 symbols: 49 + 16 = 65), and the pair steps.
fn pair_tables(
    model: &CountsModel,
    frames: &[Vec<u16>],
    d: usize,
) -> Result<(Vec<u16>, Vec<bool>)> {
    let ctx = model.ctx_map();
    let t_n = model.table_sets() as usize;
    let units = ctx.len() / 64;
    let dark: Vec<bool> = (0..units)
        .map(|u| (64 * u..64 * u + 64).all(|p| (ctx[p] as usize) < d))
        .collect();
    let s_j = (ESCAPE + 1) as usize;
    let mut hist = vec![0u64; t_n * d * s_j];
    for f in frames {
        let t = model.table_set_for(f) as usize;
        for u in (0..units).filter(|&u| dark[u]) {
            for j in 0..LANES {
                let (a, b) = (u32::from(f[64 * u + j]), u32::from(f[64 * u + 32 + j]));
                let sym = if a < Q && b < Q { a * Q + b } else { ESCAPE };
                hist[(t * d + ctx[64 * u + j] as usize) * s_j + sym as usize] += 1;
            }
        }
    }
    let freq = fit_freq(
        &hist,
        t_n as u8,
        d as u8,
        (s_j - 16) as u8,
        FloorPolicy::AllSymbols,
    )?;
    Ok((freq, dark))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Streams packed 16-aligned into an arena and their index (u64 offset, u32 length, u32 0).
fn pack(streams: &[Vec<u8>]) -> (Vec<u8>, Vec<u32>) {
    let mut arena = Vec::new();
    let mut index = Vec::with_capacity(4 * streams.len());
    for s in streams {
        let off = arena.len() as u64;
        index.extend_from_slice(&[off as u32, (off >> 32) as u32, s.len() as u32, 0]);
        arena.extend_from_slice(s);
        arena.resize(arena.len().next_multiple_of(16), 0);
    }
    (arena, index)
}

fn upload(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    bytes: &[u8],
    what: &str,
) -> Result<DevBuf> {
    let b = DevBuf::alloc(ctx, bytes.len(), None, what)?;
    b.write(0, bytes)?;
    Ok(b)
}

/// One timed row of the study kernel: p50 seconds, and whether every frame sum equals `want`.
#[allow(clippy::too_many_arguments)]
fn study_row(
    name: &str,
    f: &cudarc::driver::CudaFunction,
    streams: &[Vec<u8>],
    m: &DeviceModel,
    mp: Option<(&DeviceModel, &DevBuf)>,
    smem: u32,
    want: &[u64],
    repeats: usize,
) -> Result<Value> {
    let e = engine()?;
    let ctx = e.gpu.ctx();
    let (arena_h, index_h) = pack(streams);
    let arena = upload(ctx, &arena_h, "arena")?;
    let index = upload(ctx, bytemuck::cast_slice(&index_h), "index")?;
    let n = streams.len() as u64;
    let out = DevBuf::alloc(ctx, 8 * streams.len(), None, "sums")?;
    let err = DevBuf::alloc(ctx, 64, None, "err")?;
    err.zero()?;
    let dummy = DevBuf::alloc(ctx, 256, None, "no pairs")?;
    dummy.zero()?;
    let (ma, (mpa, pairs, use_pairs)) = (
        m.arg(),
        mp.map_or((m.arg(), &dummy, 0u32), |(p, b)| (p.arg(), b, 1u32)),
    );
    f.set_attribute(
        cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .map_err(|er| anyhow!("{er:?}"))?;
    let sms = e.gpu.info().multiprocessors.max(1) as u64;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(16).clamp(1, sms * 16) as u32, 1, 1),
        block_dim: (512, 1, 1),
        shared_mem_bytes: smem,
    };
    let (a_ptr, a_len, i_ptr, first, p_ptr, o_ptr, e_ptr) = (
        arena.ptr(),
        arena_h.len() as u64,
        index.ptr(),
        0u64,
        pairs.ptr(),
        out.ptr(),
        err.ptr(),
    );
    let stream = e.gpu.stream();
    let mut runs = Vec::new();
    for r in 0..=repeats {
        let ms = e.gpu.time_ms(|| {
            let mut b = stream.launch_builder(f);
            b.arg(&a_ptr)
                .arg(&a_len)
                .arg(&i_ptr)
                .arg(&first)
                .arg(&n)
                .arg(&ma)
                .arg(&mpa)
                .arg(&p_ptr)
                .arg(&use_pairs)
                .arg(&o_ptr)
                .arg(&e_ptr);
            // SAFETY: matches `qem_pair_frame_sums` (study kernel above); arena and index hold
            // the packed streams, out n u64, err 16 words, pairs the pair-step bits (or 64
            // zero words, unread without pairs); alive until time_ms has synchronized.
            unsafe { b.launch(cfg) }
                .map(|_| ())
                .map_err(|er| qem_core::Error::internal("pair probe", format!("{er:?}")))
        })?;
        if r > 0 {
            runs.push(f64::from(ms) / 1e3);
        }
    }
    let mut got = vec![0u64; streams.len()];
    out.read(0, bytemuck::cast_slice_mut(&mut got))?;
    let mut ew = [0u32; 16];
    err.read(0, bytemuck::cast_slice_mut(&mut ew))?;
    let equal = got == want && ew[0] == 0;
    let p50 = median(runs.clone());
    println!(
        "{name:<44} p50 {:>7.2} ms  sums {}",
        p50 * 1e3,
        if equal { "= CPU" } else { "DIFFER" }
    );
    Ok(
        json!({"row": name, "p50_s": p50, "runs_s": runs, "sums_equal_cpu": equal,
              "error_record": ew[..8].to_vec(), "smem_bytes": smem}),
    )
}

/// The command line.
struct Args {
    out: String,
    frames: usize,
    dose: f64,
    ds: Vec<usize>,
    repeats: usize,
    cpu_only: bool,
}

fn parse_args() -> Result<Args> {
    let mut args = std::env::args().skip(1);
    let out = args.next().ok_or_else(|| {
        anyhow!("usage: pair_probe OUT.json [--frames N] [--dose E] [--d 6,8,10] [--repeats R] [--cpu-only]")
    })?;
    let mut a = Args {
        out,
        frames: 32768,
        dose: 120_000.0,
        ds: vec![6, 8, 10],
        repeats: 5,
        cpu_only: false,
    };
    while let Some(o) = args.next() {
        if o == "--cpu-only" {
            a.cpu_only = true;
            continue;
        }
        let v = args.next().ok_or_else(|| anyhow!("{o} needs a value"))?;
        match o.as_str() {
            "--frames" => a.frames = v.parse()?,
            "--dose" => a.dose = v.parse()?,
            "--d" => a.ds = v.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--repeats" => a.repeats = v.parse()?,
            _ => bail!("unknown option {o}"),
        }
    }
    Ok(a)
}

/// The frames, their model and v2 streams, checked on the CPU: the study encoder in flat mode
/// must give the v2 bytes and the study decoder the frames.
struct Base {
    frames: Vec<Vec<u16>>,
    model: CountsModel,
    v2: Vec<Vec<u8>>,
    want: Vec<u64>,
}

impl Base {
    fn make(n: usize, dose: f64) -> Result<Base> {
        let t = Instant::now();
        let frames = reference_frames::make_frames(n, dose).map_err(|er| anyhow!("{er}"))?;
        let len = frames[0].len();
        println!(
            "{n} frames of {len} pixels at {dose} e-/frame made in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        let sample: Vec<&[u16]> = frames
            .iter()
            .step_by((n / 4096).max(1))
            .map(Vec::as_slice)
            .collect();
        let model = CountsModel::fit(sample.iter().copied(), len, &ModelParams::default())?;
        let want: Vec<u64> = frames
            .iter()
            .map(|f| f.iter().map(|&v| u64::from(v)).sum())
            .collect();
        let v2: Vec<Vec<u8>> = frames
            .par_iter()
            .map(|f| encode_stream(&model, f))
            .collect::<Result<_, _>>()?;
        let base = Base {
            frames,
            model,
            v2,
            want,
        };
        let flat = Coder::new(&base.model, None);
        let flat_equal = base
            .frames
            .par_iter()
            .zip(&base.v2)
            .all(|(f, s)| flat.encode(f).is_ok_and(|x| &x == s));
        println!("study encoder in flat mode = v2 encoder on every frame: {flat_equal}");
        if !flat_equal {
            bail!("the study encoder does not reproduce v2: its pair streams would mean nothing");
        }
        let checked = base.checked();
        let flat_decodes = base.frames[..checked]
            .par_iter()
            .zip(&base.v2[..checked])
            .all(|(f, st)| decode(&flat, st, len).is_ok_and(|d| &d == f));
        println!("study decoder on the v2 streams = frames ({checked} checked): {flat_decodes}");
        if !flat_decodes {
            bail!("the study decoder does not reproduce the v2 frames");
        }
        Ok(base)
    }

    /// Frames decoded on the CPU per candidate.
    fn checked(&self) -> usize {
        self.frames.len().min(256)
    }

    fn v2_bytes(&self) -> usize {
        self.v2.iter().map(Vec::len).sum()
    }
}

/// One `d`: its pair tables, pair steps and streams (encoded and partly decoded on the CPU).
struct Candidate {
    d: usize,
    pfreq: Vec<u16>,
    dark: Vec<bool>,
    streams: Vec<Vec<u8>>,
    escapes_per_pair: f64,
}

impl Candidate {
    fn make(b: &Base, d: usize) -> Result<Candidate> {
        let (frames, len, checked) = (&b.frames, b.frames[0].len(), b.checked());
        let (pfreq, dark) = pair_tables(&b.model, &frames[..frames.len().min(4096)], d)?;
        let rows = Rows::new(pfreq.clone(), (ESCAPE + 1) as usize);
        let coder = Coder::new(&b.model, Some((rows, d, dark.clone())));
        let streams: Vec<Vec<u8>> = frames
            .par_iter()
            .map(|f| coder.encode(f))
            .collect::<Result<_>>()?;
        let decodes = frames[..checked]
            .par_iter()
            .zip(&streams[..checked])
            .all(|(f, st)| decode(&coder, st, len).is_ok_and(|x| &x == f));
        let c = Candidate {
            d,
            pfreq,
            dark,
            streams,
            escapes_per_pair: 0.0,
        };
        let escapes: usize = frames[..checked]
            .iter()
            .map(|f| {
                (0..c.dark.len())
                    .filter(|&u| c.dark[u])
                    .map(|u| {
                        (0..LANES)
                            .filter(|&j| {
                                f[64 * u + j] >= Q as u16 || f[64 * u + 32 + j] >= Q as u16
                            })
                            .count()
                    })
                    .sum::<usize>()
            })
            .sum();
        let escapes_per_pair = escapes as f64 / (checked * c.pair_steps() * LANES).max(1) as f64;
        println!(
            "d={d}: {}/{} pair steps, {} steps per frame (v2 {}), size {:.4}× v2, escapes per pair {escapes_per_pair:.4}, CPU decode = frames: {decodes}",
            c.pair_steps(),
            c.dark.len(),
            c.steps(),
            len / LANES,
            c.bytes() as f64 / b.v2_bytes() as f64
        );
        if !decodes {
            bail!("the study decoder does not reproduce the frames at d = {d}");
        }
        Ok(Candidate {
            escapes_per_pair,
            ..c
        })
    }

    fn pair_steps(&self) -> usize {
        self.dark.iter().filter(|&&x| x).count()
    }

    /// Decode steps per frame (v2 takes two per pair step).
    fn steps(&self) -> usize {
        self.pair_steps() + 2 * (self.dark.len() - self.pair_steps())
    }

    fn bytes(&self) -> usize {
        self.streams.iter().map(Vec::len).sum()
    }
}

/// The engine's frame sums (`qem_rans_frame_sums`) on the v2 streams, as a record row.
fn production_row(b: &Base, repeats: usize) -> Result<Value> {
    let e = engine()?;
    let ctx = e.gpu.ctx();
    let (n, len) = (b.frames.len(), b.frames[0].len());
    let (arena_h, index_h) = pack(&b.v2);
    let arena = upload(ctx, &arena_h, "arena")?;
    let index = upload(ctx, bytemuck::cast_slice(&index_h), "index")?;
    let side = (len as f64).sqrt() as usize;
    let enc = DeviceEncoded::from_parts(
        DeviceModel::upload(ctx, b.model.clone(), None)?,
        arena,
        arena_h.len() as u64,
        index,
        n as u64,
        Shape2::new(side, len / side),
        e.gpu.info().ordinal,
    );
    let mut runs = Vec::new();
    let mut got = Vec::new();
    for r in 0..=repeats {
        let t = Instant::now();
        got = enc.frame_sums(&e.gpu, e.rans()?)?;
        if r > 0 {
            runs.push(t.elapsed().as_secs_f64());
        }
    }
    let p50 = median(runs.clone());
    println!(
        "{:<44} p50 {:>7.2} ms  sums {}",
        "v2 production frame sums (with download)",
        p50 * 1e3,
        if got == b.want { "= CPU" } else { "DIFFER" }
    );
    Ok(
        json!({"row": "v2 production frame sums (qem_rans_frame_sums, host wall incl. download)", "p50_s": p50, "runs_s": runs, "sums_equal_cpu": got == b.want}),
    )
}

/// The study kernel's rows: the v2 streams at v2's shared memory, then per candidate (the
/// first with the v2 streams at the pairs' shared memory before it) its pair streams.
fn study_rows(b: &Base, cands: Vec<Candidate>, repeats: usize) -> Result<Vec<Value>> {
    let e = engine()?;
    let ctx = e.gpu.ctx();
    let dm = DeviceModel::upload(ctx, b.model.clone(), None)?;
    let src = format!("{}\n{}", qem_cuda::rans::KERNEL_SOURCE, STUDY_KERNEL);
    let module = qem_cuda::nvrtc::load_module(&e.gpu, "pair_probe.cu", &src, &[])?;
    let f = module.function("qem_pair_frame_sums")?;
    let smem_v2 = dm.smem_tables();
    let (want, v2) = (&b.want, &b.v2);
    let mut rows = vec![study_row(
        "v2, study loop (3 CTAs/SM)",
        &f,
        v2,
        &dm,
        None,
        smem_v2,
        want,
        repeats,
    )?];
    for (ci, c) in cands.into_iter().enumerate() {
        // The pair rows as a model of their own (49 literals + 16 = 65 symbols, d classes), so
        // the engine builds their shared-memory table and lookup; its split and context map are
        // never read (the kernel takes both from the v2 model).
        let pmodel = CountsModel::from_parts(
            (ESCAPE + 1 - 16) as u8,
            c.d as u8,
            b.model.table_sets(),
            0,
            vec![0u8; b.frames[0].len()],
            b.model.thresholds().to_vec(),
            c.pfreq.clone(),
        )?;
        let pm = DeviceModel::upload(ctx, pmodel, None)?;
        let mut bits = vec![0u32; c.dark.len().div_ceil(32)];
        for (u, _) in c.dark.iter().enumerate().filter(|(_, &dk)| dk) {
            bits[u / 32] |= 1 << (u % 32);
        }
        let pairs = upload(ctx, bytemuck::cast_slice(&bits), "pair steps")?;
        let smem = smem_v2 + pm.smem_tables() + 4096;
        if ci == 0 {
            rows.push(study_row(
                "v2, study loop, pair smem (2 CTAs/SM)",
                &f,
                v2,
                &dm,
                None,
                smem,
                want,
                repeats,
            )?);
        }
        let name = format!(
            "pairs d={}: {}/{} pair steps",
            c.d,
            c.pair_steps(),
            c.dark.len()
        );
        let mut r = study_row(
            &name,
            &f,
            &c.streams,
            &dm,
            Some((&pm, &pairs)),
            smem,
            want,
            repeats,
        )?;
        if let Some(o) = r.as_object_mut() {
            o.insert("d".into(), json!(c.d));
            o.insert(
                "size_vs_v2".into(),
                json!(c.bytes() as f64 / b.v2_bytes() as f64),
            );
            o.insert("steps_per_frame".into(), json!(c.steps()));
            o.insert("pair_steps".into(), json!(c.pair_steps()));
            o.insert("escapes_per_pair".into(), json!(c.escapes_per_pair));
        }
        rows.push(r);
    }
    Ok(rows)
}

fn main() -> Result<()> {
    let a = parse_args()?;
    let b = Base::make(a.frames, a.dose)?;
    // Every candidate encoded (and its first frames decoded) on the CPU before the card.
    let cands =
        a.ds.iter()
            .map(|&d| Candidate::make(&b, d))
            .collect::<Result<Vec<_>>>()?;
    if a.cpu_only {
        return Ok(());
    }
    let mut rows = vec![production_row(&b, a.repeats)?];
    rows.extend(study_rows(&b, cands, a.repeats)?);
    let len = b.frames[0].len();
    let rec = json!({
        "tool": "pair_probe (crates/qem-bench/examples/pair_probe.rs)",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "device": engine()?.gpu.info().summary(),
        "frames": a.frames, "dose_e_per_frame": a.dose, "detector_pixels": len,
        "v2_steps_per_frame": len / LANES, "v2_bytes": b.v2_bytes(),
        "study_encoder_flat_equals_v2": true,
        "rows": rows,
    });
    std::fs::write(&a.out, serde_json::to_string_pretty(&rec)?)?;
    Ok(())
}
