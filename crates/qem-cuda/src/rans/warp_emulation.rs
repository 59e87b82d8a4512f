//! The kernels' algorithms replayed on the host, lane by lane, against the CPU specification:
//! catches ordering and bit-packing mistakes without a GPU.

use super::*;

const L: u64 = 1 << 16;

fn sym_of(v: u32, k: u32) -> u32 {
    if v < k {
        v
    } else {
        k + (31 - (v - k + 1).leading_zeros())
    }
}

/// rans.cu `qem_rans_encode` for one frame, step by step as a warp runs it.
fn emulate_encode(m: &CountsModel, frame: &[u16]) -> Vec<u8> {
    let (tab, _) = device_tables(m);
    let n = frame.len();
    let k = u32::from(m.literals());
    let ctx = m.ctx_map();
    let set = if m.table_sets() > 1 {
        rans::table_set_of(m.thresholds(), m.statistic(frame)) as usize
    } else {
        0
    };
    let sp = table_stride(m);
    let c = m.contexts() as usize;
    let tset = &tab[set * c * sp..];
    let steps = n.div_ceil(32);
    // Extra bits through the 20-word window.
    let mut bits: Vec<u32> = vec![0; (15 * n >> 5) + 2];
    let mut win = [0u32; 20];
    let mut bitpos = 0u64;
    for t in 0..steps {
        let mut nb = [0u32; 32];
        let mut ex = [0u32; 32];
        for lane in 0..32 {
            let p = t * 32 + lane;
            if p < n {
                let v = u32::from(frame[p]);
                let sy = sym_of(v, k);
                if sy >= k {
                    nb[lane] = sy - k;
                    ex[lane] = v - k + 1 - (1 << nb[lane]);
                }
            }
        }
        if nb.iter().all(|&b| b == 0)
            && (0..32).all(|l| t * 32 + l >= n || sym_of(u32::from(frame[t * 32 + l]), k) < k)
        {
            continue;
        }
        let mut incl = [0u32; 32];
        let mut acc = 0;
        for lane in 0..32 {
            acc += nb[lane];
            incl[lane] = acc;
        }
        let tot = incl[31];
        for lane in 0..32 {
            if nb[lane] == 0
                && !(t * 32 + lane < n && sym_of(u32::from(frame[t * 32 + lane]), k) >= k)
            {
                continue;
            }
            let o0 = (bitpos & 31) as u32 + incl[lane] - nb[lane];
            win[(o0 >> 5) as usize] |= ex[lane] << (o0 & 31);
            if (o0 & 31) + nb[lane] > 32 {
                win[(o0 >> 5) as usize + 1] |= ex[lane] >> (32 - (o0 & 31));
            }
        }
        let fill = (bitpos & 31) as u32 + tot;
        let full = (fill >> 5) as usize;
        let wbase = (bitpos >> 5) as usize;
        bits[wbase..wbase + full].copy_from_slice(&win[..full]);
        let carry = win[full];
        win = [0; 20];
        win[0] = carry;
        bitpos += u64::from(tot);
    }
    if bitpos & 31 != 0 {
        bits[(bitpos >> 5) as usize] = win[0];
    }
    // rANS, steps last to first, words at their encoder-order index.
    let mut x = [L as u32; 32];
    let mut wl: Vec<u16> = vec![0; n];
    let mut cnt = 0usize;
    for t in (0..steps).rev() {
        let mut emit = [false; 32];
        let mut fc = [(1u32, 0u32); 32];
        for lane in 0..32 {
            let p = t * 32 + lane;
            if p < n {
                let e = tset[ctx[p] as usize * sp + sym_of(u32::from(frame[p]), k) as usize];
                fc[lane] = (e >> 16, e & 0xffff);
                emit[lane] = u64::from(x[lane]) >= u64::from(fc[lane].0) << 20;
            }
        }
        let total = emit.iter().filter(|&&b| b).count();
        for lane in 0..32 {
            if emit[lane] {
                let r = emit[..lane].iter().filter(|&&b| b).count();
                wl[cnt + total - 1 - r] = (x[lane] & 0xffff) as u16;
                x[lane] >>= 16;
            }
        }
        cnt += total;
        for lane in 0..32 {
            if t * 32 + lane < n {
                let (f, cu) = fc[lane];
                x[lane] = (x[lane] / f) * 4096 + (x[lane] % f) + cu;
            }
        }
    }
    let n_ex = (bitpos as usize).div_ceil(32);
    let mut out = Vec::new();
    for w in [cnt as u32, bitpos as u32, set as u32, 0] {
        out.extend_from_slice(&w.to_le_bytes());
    }
    for v in x {
        out.extend_from_slice(&v.to_le_bytes());
    }
    for i in 0..cnt {
        out.extend_from_slice(&wl[cnt - 1 - i].to_le_bytes());
    }
    if cnt % 2 == 1 {
        out.extend_from_slice(&[0, 0]);
    }
    for w in &bits[..n_ex] {
        out.extend_from_slice(&w.to_le_bytes());
    }
    out
}

/// rans.cu `rans_decode_stream` (valid streams), with the coarse lookup walk.
fn emulate_decode(m: &CountsModel, st: &[u8]) -> Vec<u16> {
    let (tab, lut) = device_tables(m);
    let n = m.frame_len();
    let k = u32::from(m.literals());
    let sp = table_stride(m);
    let c = m.contexts() as usize;
    let rd = |o: usize| u32::from_le_bytes(st[o..o + 4].try_into().unwrap());
    let (n_words, set) = (rd(0) as usize, rd(8) as usize);
    let mut x: Vec<u32> = (0..32).map(|l| rd(16 + 4 * l)).collect();
    let wb = 144;
    let ex0 = wb + 4 * n_words.div_ceil(2);
    let word = |i: usize| u32::from(u16::from_le_bytes([st[wb + 2 * i], st[wb + 2 * i + 1]]));
    let exw = |i: usize| u64::from(rd(ex0 + 4 * i));
    let n_ex = (st.len() - ex0) / 4;
    let mut base = 0usize;
    let mut bitpos = 0u32;
    let mut out = vec![0u16; n];
    // The classes as the kernel reads them: one ctx4 word per lane and group of 4 steps.
    let ctx4 = interleave4(m.ctx_map());
    for t in 0..n.div_ceil(32) {
        let mut sy = [0u32; 32];
        let mut need = [false; 32];
        for lane in 0..32 {
            let p = t * 32 + lane;
            if p >= n {
                continue;
            }
            let class = (ctx4[(t / 4) * 32 + lane] >> (8 * (t % 4))) & 0xff;
            // lds_u8(lb + ((x & 0xff0) | c)), the entry at c·SP + s, then the walk.
            let lset = &lut[set * LUT_PER_ROW * CPAD..];
            let tset = &tab[set * c * sp..];
            let mut sym = lset[(x[lane] & 0xff0 | class) as usize] as usize;
            let slot = x[lane] & 4095;
            let mut e = tset[class as usize * sp + sym];
            let mut r = slot - (e & 0xffff);
            while r >= e >> 16 {
                sym += 1;
                e = tset[class as usize * sp + sym];
                r = slot - (e & 0xffff);
            }
            x[lane] = (e >> 16) * (x[lane] >> 12) + r;
            sy[lane] = sym as u32;
            need[lane] = x[lane] < L as u32;
        }
        // Every lane reads its would-be word, clamped to the last one; the needy take it.
        let wlim = n_words.saturating_sub(1);
        for lane in 0..32 {
            let r = need[..lane].iter().filter(|&&b| b).count();
            let w = if n_words == 0 {
                0
            } else {
                word((base + r).min(wlim))
            };
            if need[lane] {
                x[lane] = (x[lane] << 16) | w;
            }
        }
        base += need.iter().filter(|&&b| b).count();
        let mut acc = 0u32;
        for lane in 0..32 {
            let p = t * 32 + lane;
            if p >= n {
                continue;
            }
            let mut v = sy[lane];
            if sy[lane] >= k {
                let nb = sy[lane] - k;
                let off = bitpos + acc;
                let wi = (off >> 5) as usize;
                // __funnelshift_r(lo, hi, off & 31): the low word of (hi:lo) >> (off & 31).
                let lo = exw(wi);
                let hi = if wi + 1 < n_ex { exw(wi + 1) } else { 0 };
                let e = (((hi << 32 | lo) >> (off & 31)) as u32) & ((1 << nb) - 1);
                v = k - 1 + (1 << nb) + e;
                acc += nb;
            }
            out[p] = v as u16;
        }
        bitpos += acc;
    }
    assert!(x.iter().all(|&v| v == L as u32));
    assert_eq!(base, n_words);
    // rans_run's statistic of a full group: byte j of `fl` is 1 when step j's class is
    // below split, two values per dp2a.
    let split4 = (128 - u32::from(m.split())).wrapping_mul(0x0101_0101);
    let dp2a = |q: u32, b: u32, hi: bool| {
        let b = if hi { b >> 16 } else { b };
        (q & 0xffff) * (b & 0xff) + (q >> 16) * ((b >> 8) & 0xff)
    };
    let mut stat = 0u64;
    for g in 0..n / 128 {
        for lane in 0..32 {
            let cw = ctx4[g * 32 + lane];
            let fl = !(cw.wrapping_add(split4) >> 7) & 0x0101_0101;
            let v = |j: usize| u32::from(out[(4 * g + j) * 32 + lane]);
            let q01 = v(0) | v(1) << 16;
            let q23 = v(2) | v(3) << 16;
            stat += u64::from(dp2a(q01, fl, false) + dp2a(q23, fl, true));
        }
    }
    for p in n / 128 * 128..n {
        if m.ctx_map()[p] < m.split() {
            stat += u64::from(out[p]);
        }
    }
    assert_eq!(stat, m.statistic(&out), "the group statistic");
    out
}

fn frames(n: usize, len: usize, seed: u64) -> Vec<Vec<u16>> {
    let mut z = seed;
    let mut rnd = move || {
        z ^= z << 13;
        z ^= z >> 7;
        z ^= z << 17;
        z
    };
    (0..n)
        .map(|f| {
            (0..len)
                .map(|p| {
                    let r = rnd();
                    // Bright middle, sparse edges, an occasional large value, a frame scale.
                    let bright = p % 37 < 9;
                    let scale = 1 + (f % 3) as u64;
                    match r % 97 {
                        0 => (r >> 20) as u16,
                        _ if bright => ((r >> 8) % (60 * scale)) as u16,
                        _ => ((r >> 8) % (3 * scale) / 2) as u16,
                    }
                })
                .collect()
        })
        .collect()
}

#[test]
fn kernel_encoder_and_decoder_match_the_specification() {
    for &(len, t_sets, k) in &[
        (1000usize, 4u8, 32u8),
        (333, 1, 8),
        (36, 2, 128),
        (31, 1, 4),
    ] {
        let fr = frames(24, len, 0x1234 + len as u64);
        let params = ModelParams {
            table_sets: t_sets,
            literals: k,
            floor: rans::FloorPolicy::AllSymbols,
            ..ModelParams::default()
        };
        let m = CountsModel::fit(fr.iter().map(|f| f.as_slice()), len, &params).unwrap();
        for f in &fr {
            let spec = rans::encode_stream(&m, f).unwrap();
            let emu = emulate_encode(&m, f);
            assert_eq!(emu, spec, "len {len} T {t_sets} K {k}");
            assert_eq!(&emulate_decode(&m, &spec), f);
        }
    }
}
