//! Host-side tests of the wrapper (tables, interleaving, records; the CUDA paths where a GPU is present).

use super::*;
use qem_core::ErrorKind;

fn model(freq_row: &[u16], literals: u8) -> CountsModel {
    CountsModel::from_parts(
        literals,
        1,
        1,
        0,
        vec![0u8; 64],
        Vec::new(),
        freq_row.to_vec(),
    )
    .unwrap()
}

#[test]
fn coarse_lookup_points_at_or_before_the_symbol_of_every_slot() {
    // A row with zero-frequency symbols and ranges not aligned to 16.
    let k = 4u8;
    let s = k as usize + rans::BUCKETS;
    let mut row = vec![0u16; s];
    row[0] = 3000;
    row[1] = 7;
    row[3] = 1000;
    row[5] = 89;
    let m = model(&row, k);
    let (tab, lut) = device_tables(&m);
    assert_eq!(tab.len(), s | 1);
    assert_eq!(lut.len(), LUT_PER_ROW * CPAD);
    for slot in 0..rans::PROB_SCALE {
        // The kernel's lookup (class 0: the model has one) and walk.
        let mut sym = lut[slot as usize & 0xff0] as usize;
        let mut r = slot.wrapping_sub(tab[sym] & 0xffff);
        assert!(r < 4096, "slot {slot}: the entry starts after the slot");
        while r >= tab[sym] >> 16 {
            sym += 1;
            r = slot - (tab[sym] & 0xffff);
        }
        // Independent answer from the frequencies.
        let mut cum = 0u32;
        let mut want = usize::MAX;
        for (i, &f) in row.iter().enumerate() {
            if slot >= cum && slot < cum + u32::from(f) {
                want = i;
            }
            cum += u32::from(f);
        }
        assert_eq!(sym, want, "slot {slot}");
    }
}

#[test]
fn float_division_is_exact_where_the_encoder_uses_it() {
    // rans.cu `div_freq`, step by step: u32 → f32 rounded to nearest, 1/f from the
    // hardware's approximate reciprocal (within one ulp: here 1/f rounded to nearest and the
    // floats one ulp below and above it), the product rounded to nearest, truncated, then one
    // remainder correction in 32 bits. The encoder divides x < f·2^20 by 1 ≤ f ≤ 4096; test
    // both ends of every quotient range near multiples of f, the largest x (where q·f wraps
    // past 2^32 for f = 4096), and a spread of x for every f, with each of the reciprocals.
    fn div_freq(x: u32, f: u32, ulps: i32) -> u32 {
        let near = 1.0f32 / f as f32;
        let rcp = f32::from_bits(near.to_bits().wrapping_add_signed(ulps));
        let mut q = ((x as f32) * rcp) as u32;
        // 32-bit wrapping arithmetic read as signed, as the kernel computes it.
        let r = x.wrapping_sub(q.wrapping_mul(f)) as i32;
        if r < 0 {
            q -= 1;
        } else if r >= f as i32 {
            q += 1;
        }
        q
    }
    let mut checked = 0u64;
    for f in 1u32..=4096 {
        let top = (u64::from(f) << 20) - 1;
        let mut xs: Vec<u64> = vec![0, 1, top, top - 1, top.saturating_sub(u64::from(f))];
        for q in (0u64..(1 << 20)).step_by(997).chain([(1 << 20) - 1]) {
            let base = q * u64::from(f);
            xs.extend([base, base + u64::from(f) - 1, base + u64::from(f) / 2]);
            if base > 0 {
                xs.push(base - 1);
            }
        }
        for x in xs.into_iter().filter(|&x| x <= top) {
            let x = x as u32;
            for ulps in [-1, 0, 1] {
                assert_eq!(div_freq(x, f, ulps), x / f, "x {x} f {f} ulps {ulps}");
            }
            checked += 1;
        }
    }
    assert!(checked > 4096 * 4000, "{checked}");
}

/// The decoder's view (rans.cu: step t, lane l reads byte t % 4 of word (t / 4)·32 + l)
/// gives back every pixel's byte, on a frame that is a multiple of 128 pixels, one that
/// ends inside a step, and one that ends inside a group; the padding is zero.
#[test]
fn interleave4_is_read_back_in_decoder_order() {
    for n in [36_864usize, 143, 100, 1] {
        let map: Vec<u8> = (0..n).map(|p| (p * 7 % 251) as u8 + 1).collect();
        let w = interleave4(&map);
        let steps = n.div_ceil(32);
        assert_eq!(w.len(), (steps.div_ceil(4) + 1) * 32, "n {n}");
        for t in 0..(steps.div_ceil(4) + 1) * 4 {
            for lane in 0..32 {
                let got = (w[(t / 4) * 32 + lane] >> (8 * (t % 4))) & 0xff;
                let p = t * 32 + lane;
                let want = map.get(p).map_or(0, |&b| u32::from(b));
                assert_eq!(got, want, "n {n} step {t} lane {lane}");
            }
        }
    }
}

#[test]
fn sample_frames_spread_and_stay_in_range() {
    assert_eq!(sample_frames(5, 10), vec![0, 1, 2, 3, 4]);
    let s = sample_frames(262_144, 4096);
    assert_eq!(s.len(), 4096);
    assert_eq!(s[0], 0);
    assert!(s.windows(2).all(|w| w[1] - w[0] == 64));
    let s = sample_frames(1000, 7);
    assert!(s.windows(2).all(|w| w[1] > w[0]));
    assert!(*s.last().unwrap() < 1000);
}

#[test]
fn fault_records_name_the_frame() {
    let v = [1u32, 11, 7, 0, 3, 65537, 2, 0];
    let f = fault_from_words(&v).unwrap();
    assert_eq!(f.frame, 7);
    let e = fault_error(&f, 1234);
    assert_eq!(e.frame, Some(1234));
    assert_eq!(e.kind, ErrorKind::Decode);
    assert!(fault_from_words(&[0u32; 8]).is_none());
}

#[test]
fn fault_codes_give_their_reason_and_values() {
    let fault = |code| RansFaultRecord {
        code,
        frame: 0,
        a: 40,
        b: 41,
        count: 1,
        overflowed: 0,
    };
    // (code, kind, words the message holds, expected, found)
    let cases = [
        (
            1,
            ErrorKind::Decode,
            "index entry outside the stream arena",
            None,
            None,
        ),
        (
            2,
            ErrorKind::Decode,
            "corrupt stream: stream length",
            Some("40"),
            Some("41"),
        ),
        (
            9,
            ErrorKind::Decode,
            "needed past the stream's words",
            Some("40"),
            Some("41"),
        ),
        (
            14,
            ErrorKind::Decode,
            "table set does not match",
            Some("40"),
            Some("41"),
        ),
        (
            17,
            ErrorKind::Decode,
            "a decoded value above 65535",
            Some("40"),
            None,
        ),
        (
            15,
            ErrorKind::InvalidArgument,
            "value 41 at pixel 40 has no symbol",
            None,
            None,
        ),
        (
            16,
            ErrorKind::Internal,
            "unknown rANS kernel code 16",
            None,
            None,
        ),
    ];
    for (code, kind, says, expected, found) in cases {
        let e = fault_error(&fault(code), 5);
        assert_eq!(e.kind, kind, "code {code}: {e}");
        assert!(e.detail.contains(says), "code {code}: {e}");
        assert_eq!(e.expected.as_deref(), expected, "code {code}");
        assert_eq!(e.found.as_deref(), found, "code {code}");
        assert_eq!(e.frame, Some(5), "code {code}");
    }
}

#[test]
fn kernels_compile_with_nvrtc_when_present() {
    match crate::nvrtc::compile_cubin(KERNEL_FILE, KERNEL_SOURCE, "sm_90", &[]) {
        Ok((cubin, _log)) => assert!(!cubin.is_empty()),
        Err(e) => assert_eq!(e.kind, qem_core::ErrorKind::BackendUnavailable, "{e}"),
    }
}

/// rans.cu `encode_frames`: the bucket map's bits are shifted into one register while the steps
/// run from the last down, and a word is stored when its lowest step (tt & 31 == 0) is done.
/// Every word must come out as the map written bit by bit: bit tt & 31 of word tt >> 5 set
/// exactly when step tt has a bucket symbol; frames of whole and partial words.
#[test]
fn the_encoders_bucket_map_is_the_bit_per_step_map() {
    let mut seed = 0x0123_4567_89ab_cdefu64;
    for steps in [1u32, 31, 32, 33, 63, 64, 65, 1152, 1153, 4] {
        let words = steps.div_ceil(32) as usize;
        let flags: Vec<bool> = (0..steps)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed % 3 == 0
            })
            .collect();
        let mut want = vec![0u32; words];
        for (t, &f) in flags.iter().enumerate() {
            if f {
                want[t >> 5] |= 1 << (t & 31);
            }
        }
        // The kernel's form; the map starts as garbage: every word must be stored.
        let mut got = vec![0xdead_beefu32; words];
        let mut bword = 0u32;
        for tt in (0..steps).rev() {
            bword = (bword << 1) | u32::from(flags[tt as usize]);
            if tt & 31 == 0 {
                got[(tt >> 5) as usize] = bword;
            }
        }
        assert_eq!(got, want, "steps {steps}");
    }
}
