use super::*;

/// products.cu `__dp2a_lo` / `__dp2a_hi`: the two u16 halves of `a` times bytes 0–1 / 2–3
/// of `b`, plus `c`.
fn dp2a(a: u32, b: u32, c: u32, hi: bool) -> u32 {
    let sh = if hi { 16 } else { 0 };
    let (b0, b1) = ((b >> sh) & 0xff, (b >> (sh + 8)) & 0xff);
    c.wrapping_add((a & 0xffff) * b0)
        .wrapping_add((a >> 16) * b1)
}

/// `ProdDecodeOp::group_done` (PROD_GROUP4) replayed lane by lane: the moments of the full
/// groups of four steps from Σ v, Σ t·v and Σ row·v, the row change inside a group from
/// `jb`, and the masks by dp2a, against the direct sums, for every kc the host allows it
/// (≥ 128) up to 1024 with frames of several rows and a partial last row.
#[test]
fn group4_masks_and_moments_match_direct_sums() {
    let mut z = 0x1234_5678_9abc_def0u64;
    let mut rnd = move || {
        z ^= z << 13;
        z ^= z >> 7;
        z ^= z << 17;
        z
    };
    for kc in (128u32..=1024)
        .step_by(7)
        .chain([128, 192, 256, 384, 512, 1024])
    {
        let rows = (65_536 / kc).min(5 + kc % 4);
        let n = kc * rows - (kc % 5); // not a multiple of the row
        let vals: Vec<u32> = (0..n)
            .map(|_| match rnd() % 4 {
                0 => 65_535,
                1 => 0,
                _ => (rnd() % 300) as u32,
            })
            .collect();
        let bits: Vec<u32> = (0..n).map(|_| (rnd() % 4) as u32).collect();
        let full_groups = (n >> 5) >> 2;
        for lane in 0..32u32 {
            let (mut row, mut col) = (lane / kc, lane % kc);
            let (mut gs, mut gt, mut gr) = (0u32, 0u64, 0u64);
            let mut bin = [0u32; 2];
            let (mut ws, mut wr, mut wc, mut wb) = (0u64, 0u64, 0u64, [0u64; 2]);
            for g in 0..full_groups {
                let p = |j: u32| ((4 * g + j) << 5) + lane;
                let v: Vec<u32> = (0..4).map(|j| vals[p(j) as usize]).collect();
                let bw: u32 = (0..4).map(|j| bits[p(j) as usize] << (8 * j)).sum();
                let (q01, q23) = (v[0] | v[1] << 16, v[2] | v[3] << 16);
                for (m, b) in bin.iter_mut().enumerate() {
                    let mb = (bw >> m) & 0x0101_0101;
                    *b += dp2a(q23, mb, dp2a(q01, mb, 0, false), true);
                }
                let s4 = dp2a(q23, 0x0101_0000, dp2a(q01, 0x0000_0101, 0, false), true);
                let jv = dp2a(q23, 0x0302_0000, dp2a(q01, 0x0000_0100, 0, false), true);
                gs += s4;
                gt += u64::from((g << 2) * s4 + jv);
                let jb = (kc - col + 31) >> 5;
                let dl = if jb >= 4 {
                    0
                } else {
                    0x0101_0101u32 << (8 * jb)
                };
                let ds = dp2a(q23, dl, dp2a(q01, dl, 0, false), true);
                gr += u64::from(row * s4 + ds);
                col += 128;
                if col >= kc {
                    col -= kc;
                    row += 1;
                }
                for j in 0..4 {
                    let q = p(j);
                    let x = u64::from(vals[q as usize]);
                    ws += x;
                    wr += u64::from(q / kc) * x;
                    wc += u64::from(q % kc) * x;
                    for (m, b) in wb.iter_mut().enumerate() {
                        *b += x * u64::from((bits[q as usize] >> m) & 1);
                    }
                }
            }
            let mc = 32 * gt + u64::from(lane) * u64::from(gs) - u64::from(kc) * gr;
            assert_eq!(
                (u64::from(gs), gr, mc),
                (ws, wr, wc),
                "kc {kc} n {n} lane {lane}"
            );
            assert_eq!(
                [u64::from(bin[0]), u64::from(bin[1])],
                wb,
                "kc {kc} lane {lane}"
            );
            // Where the tail starts: the position of step 4·full_groups.
            let p_tail = (full_groups << 7) + lane;
            assert_eq!(
                (row, col),
                (p_tail / kc, p_tail % kc),
                "kc {kc} lane {lane}"
            );
        }
    }
}

/// `ProdDecodeOp::group_done` with `PROD_ROWFLAG`: Σ row·v of the full groups from the
/// flag bits of [`row_flag_bits`] (row of the group's first pixel, carried by bit 6; the
/// next-row steps by bit 7), against the direct sum, for every kc the host allows it (≥ 128)
/// up to 1024 and frames with a partial last row; and the flags stay out of the mask bits
/// 0..6.
#[test]
fn row_flags_give_every_full_groups_rows() {
    for kc in (128usize..=1024)
        .step_by(3)
        .chain([128, 129, 160, 192, 255, 256, 384, 512, 1024])
    {
        let rows = (65_536 / kc).min(6 + kc % 5);
        let n = kc * rows - (kc % 7);
        let flags = row_flag_bits(n, kc);
        assert!(flags.iter().all(|&b| b & 0x3f == 0), "kc {kc}");
        let full_groups = n / 128;
        for lane in 0..32usize {
            // Values that tell rows apart: v = 1 + (p mod 251).
            let v = |p: usize| (1 + p % 251) as u32;
            let mut row = (lane / kc) as u32;
            let (mut gr, mut want) = (0u64, 0u64);
            for g in 0..full_groups {
                let p = |j: usize| (4 * g + j) * 32 + lane;
                let bw: u32 = (0..4).map(|j| u32::from(flags[p(j)]) << (8 * j)).sum();
                let dl = (bw >> 7) & 0x0101_0101;
                let (q01, q23) = (v(p(0)) | v(p(1)) << 16, v(p(2)) | v(p(3)) << 16);
                let s4 = (0..4).map(|j| v(p(j))).sum::<u32>();
                let ds = dp2a(q23, dl, dp2a(q01, dl, 0, false), true);
                gr += u64::from(row * s4 + ds);
                row += (bw >> 6) & 1;
                want += (0..4)
                    .map(|j| (p(j) / kc) as u64 * u64::from(v(p(j))))
                    .sum::<u64>();
            }
            assert_eq!(gr, want, "kc {kc} n {n} lane {lane}");
            // The row carried past the last full group is that of the tail's first pixel.
            if full_groups * 128 + lane < n {
                assert_eq!(row as usize, (full_groups * 128 + lane) / kc, "kc {kc}");
            }
        }
    }
}

/// products.cu `ProdDecodeOp::fetch` reads `cb4[2·(32g + l)]` as the classes and the next
/// word as the mask bits of group g, lane l: byte j of each is pixel (4g + j)·32 + l's.
#[test]
fn class_bits4_pairs_classes_and_masks_per_group_and_lane() {
    for n in [36_864usize, 1000, 100] {
        let ctx: Vec<u8> = (0..n).map(|p| (p % 13) as u8).collect();
        let bits: Vec<u8> = (0..n).map(|p| (p * 7 % 251) as u8).collect();
        let cb = class_bits4(&rans::interleave4(&ctx), &bits);
        let groups = n.div_ceil(32).div_ceil(4) + 1;
        assert_eq!(cb.len(), 2 * 32 * groups, "n {n}");
        for g in 0..groups {
            for l in 0..32 {
                let (cw, bw) = (cb[2 * (32 * g + l)], cb[2 * (32 * g + l) + 1]);
                for j in 0..4 {
                    let p = (4 * g + j) * 32 + l;
                    let byte = |w: u32| (w >> (8 * j)) as u8;
                    assert_eq!(byte(cw), ctx.get(p).copied().unwrap_or(0), "n {n} p {p}");
                    assert_eq!(byte(bw), bits.get(p).copied().unwrap_or(0), "n {n} p {p}");
                }
            }
        }
    }
}

#[test]
fn row_magic_gives_every_pixels_row() {
    let kcs = (8..=1024)
        .step_by(8)
        .chain([1032, 2048, 4096, 8192, 8200, 32768, 65536]);
    for kc in kcs {
        let m = row_magic(kc) as u64;
        assert!(m > 0, "kc {kc}");
        for p in 0..qem_core::reduce::MAX_FRAME_PIXELS as u64 {
            assert_eq!((p * m) >> 32, p / kc as u64, "pixel {p}, kc {kc}");
        }
    }
    // kc = 2^16: m = 2^16 + 1, still a u32.
    assert_eq!(row_magic(65536), 65537);
    assert_eq!(row_magic(192), (4294967296u64 / 192 + 1) as u32);
    for kc in [1, 4, 7, 9, 191, 193] {
        assert_eq!(row_magic(kc), 0, "kc {kc}");
    }
}

#[test]
fn masks_are_split_by_kind_and_launch_capacity() {
    let bin = DetectorMask::Int(vec![1, 0]);
    let wint = DetectorMask::Int(vec![3, 0]);
    let flt = DetectorMask::Float(vec![0.5, 0.0]);
    let mut req = ReduceRequest {
        masks: vec![bin.clone(); 9],
        ..Default::default()
    };
    req.masks.push(wint.clone());
    req.masks.push(flt.clone());
    let parts = partition(&req);
    assert_eq!(parts.len(), 2);
    assert_eq!(parts[0].bin, (0..8).collect::<Vec<_>>());
    assert_eq!(parts[1].bin, vec![8]);
    assert_eq!(parts[0].wint, vec![9]);
    assert_eq!(parts[0].flt, vec![10]);
    assert!(parts[0].carries_rest && !parts[1].carries_rest);
    let all: usize = parts
        .iter()
        .map(|p| p.bin.len() + p.wint.len() + p.flt.len())
        .sum();
    assert_eq!(all, req.masks.len());
    // No masks: still one launch (sum/max/moments).
    assert_eq!(partition(&ReduceRequest::default()).len(), 1);
}

#[test]
fn only_masks_read_only_their_pixel_span() {
    let mut w = vec![0u32; 100];
    w[21] = 1;
    w[50] = 1;
    let mut req = ReduceRequest {
        masks: vec![DetectorMask::Int(w)],
        ..Default::default()
    };
    assert_eq!(pixel_range(&req, 100), (16, 56));
    req.moments = true;
    assert_eq!(pixel_range(&req, 100), (0, 100));
    let req = ReduceRequest {
        masks: vec![DetectorMask::Int(vec![0; 100])],
        ..Default::default()
    };
    assert_eq!(pixel_range(&req, 100), (0, 0));
}

#[test]
fn kernels_compile_with_nvrtc_when_present() {
    // Every feature at once (narrow and wide values), and the smallest shape.
    let src = format!("{}\n{}", rans::KERNEL_SOURCE, KERNEL_SOURCE);
    let all = Shape {
        nbin: MAX_BIN as u32,
        nwint: MAX_WINT as u32,
        nflt: MAX_FLT as u32,
        mom: true,
        sum: 1,
        max: 2,
        wide: false,
        rowacc: true,
        group4: true,
        rowflag: false,
        warps: WARPS_SHARED,
    };
    // The fused four over ENCODED data as the reference acquisition runs them.
    let flags = Shape {
        nbin: 2,
        nwint: 0,
        nflt: 0,
        max: 0,
        rowflag: true,
        ..all
    };
    let wide = Shape {
        sum: 2,
        max: 1,
        wide: true,
        rowacc: false,
        ..all
    };
    let small = Shape {
        nbin: 1,
        nwint: 0,
        nflt: 0,
        mom: false,
        sum: 0,
        max: 0,
        group4: false,
        warps: WARPS_PLAIN,
        ..all
    };
    for shape in [all, wide, small, flags] {
        let defs = shape.defines();
        let refs: Vec<(&str, &str)> = defs.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        match crate::nvrtc::compile_cubin(KERNEL_FILE, &src, "sm_90", &refs) {
            Ok((cubin, _log)) => assert!(!cubin.is_empty(), "{shape:?}"),
            Err(e) => assert_eq!(e.kind, qem_core::ErrorKind::BackendUnavailable, "{e}"),
        }
    }
}

/// The `products.cu` modules of src/kernels/shipped.txt, each as its sorted `NAME=VALUE`
/// defines, with the `{a,b,...}` lists expanded.
fn shipped_products_modules() -> std::collections::HashSet<Vec<String>> {
    let mut out = std::collections::HashSet::new();
    for t in crate::shipped::manifest_tokens(include_str!("../kernels/shipped.txt")) {
        if t.first() != Some(&"products.cu") {
            continue;
        }
        let sets = crate::shipped::expand_defines(&t[2..]).expect("NAME=VALUE defines");
        for d in sets {
            let mut s: Vec<String> = d.iter().map(|(k, v)| format!("{k}={v}")).collect();
            s.sort();
            out.insert(s);
        }
    }
    out
}

/// The requests the public API makes most find their module in the shipped pack, on dense u16
/// and ENCODED data, for 192² frames (sum DP in shared memory) and 256² (global atomics): a
/// change to the shape rules or to the manifest that would silently send them back to NVRTC
/// (1.7 s on first use, docs/performance.md "First use") fails here.
#[test]
fn common_requests_ship_their_modules() {
    let shipped = shipped_products_modules();
    assert!(
        shipped.len() > 20,
        "{} products modules in the manifest",
        shipped.len()
    );
    let budget = 232_448; // the H100/H200 opt-in shared memory per block
    for kc in [192usize, 256] {
        let n = kc * kc;
        let mask = || DetectorMask::Int((0..n).map(|i| u32::from(i % 3 == 0)).collect());
        let masks = |k: usize| (0..k).map(|_| mask()).collect::<Vec<_>>();
        let req = |k: usize, sum_dp: bool, max_dp: bool, moments: bool| ReduceRequest {
            masks: masks(k),
            sum_dp,
            max_dp,
            moments,
            frames: None,
        };
        let requests = [
            ("sum DP / mean DP", req(0, true, false, false)),
            ("max DP", req(0, false, true, false)),
            ("moments / CoM", req(0, false, false, true)),
            ("one virtual detector", req(1, false, false, false)),
            ("three virtual detectors", req(3, false, false, false)),
            ("dpc.run (ADF + moments)", req(1, false, false, true)),
            ("three detectors + moments", req(3, false, false, true)),
            ("fused: bf, adf, sum DP, CoM", req(2, true, false, true)),
            (
                "fused: bf, abf, adf, sum DP, CoM",
                req(3, true, false, true),
            ),
            (
                "integer virtual_image",
                ReduceRequest {
                    masks: vec![DetectorMask::Int(vec![2; n])],
                    ..Default::default()
                },
            ),
            (
                "float virtual_image",
                ReduceRequest {
                    masks: vec![DetectorMask::Float(vec![0.5; n])],
                    ..Default::default()
                },
            ),
        ];
        for (encoded, table_smem) in [(false, 0u32), (true, 40 * 1024)] {
            for (what, r) in &requests {
                let plan = SmemPlan::of(r, n, table_smem, true, budget);
                for part in partition(r) {
                    let mut defs: Vec<String> = Shape::of(&part, r, encoded, kc, &plan)
                        .defines()
                        .into_iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect();
                    defs.sort();
                    assert!(
                        shipped.contains(&defs),
                        "{what} ({kc}², encoded {encoded}) needs a module the pack lacks: {defs:?}"
                    );
                }
            }
        }
    }
}
