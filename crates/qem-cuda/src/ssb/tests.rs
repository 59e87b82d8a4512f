//! Host-side tests: the quadratic factorisation against the CPU Γ, apertures, pair lists, the
//! memory plan; NVRTC compiles the kernels where it is present.

use super::*;

/// 300 kV, 25 mrad, detector pixels of `dr` × `dc` rad.
fn optics(dr: f64, dc: f64) -> Optics {
    Optics {
        lambda_a: 0.019_687,
        alpha_rad: 0.025,
        dtheta_rad: (dr, dc),
    }
}

#[test]
fn quadratic_factorisation_equals_gamma() {
    let o = optics(0.0009, 0.0009);
    let ab = Aberrations {
        c10: -140.0,
        c12: 35.0,
        phi12: 1.1,
        ..Default::default()
    };
    let mut n = 0;
    for i in -6..=6 {
        for j in -6..=6 {
            let k = (0.2 * i as f64, 0.17 * j as f64 - 0.05);
            for nu in [(0.3, -0.4), (-1.1, 0.2), (0.05, 0.9), (1.2, 1.2)] {
                let want = qem_cpu::ssb::gamma(&o, &ab, k, nu);
                let got = quad_gamma(&o, &ab, k, nu);
                let err = ((got.0 - want.re).powi(2) + (got.1 - want.im).powi(2)).sqrt();
                assert!(
                    err <= 1e-12 * (1.0 + want.norm()),
                    "{k:?} {nu:?}: {got:?} vs {want}"
                );
                n += usize::from(want.norm() > 1e-3);
            }
        }
    }
    assert!(n > 100, "too few non-zero Γ sampled: {n}");
    // The mirror: Γ(−ν) from the same factors (E → E*, the apertures swapped).
    let (k, nu) = ((0.4, -0.2), (0.7, 0.3));
    let want = qem_cpu::ssb::gamma(&o, &ab, k, (-nu.0, -nu.1));
    let got = quad_gamma(&o, &ab, k, (-nu.0, -nu.1));
    assert!((got.0 - want.re).abs() < 1e-12 && (got.1 - want.im).abs() < 1e-12);
}

/// Both accumulate kernels write C_b(−ν) = −C_b(ν)* (the corrected term of the mirror
/// frequency, G(−ν) = G(ν)*) without computing it: checked here with qem_cpu's Γ in f64.
#[test]
fn quadratic_mirror_term_is_minus_conjugate() {
    let o = optics(0.0009, 0.0009);
    let ab = Aberrations {
        c10: 95.0,
        c12: -20.0,
        phi12: -0.4,
        ..Default::default()
    };
    // C = G Γ*/|Γ| on (re, im) pairs; `gamma` returns rustfft's Complex64.
    let corrected = |g: (f64, f64), gam: (f64, f64)| {
        let n = gam.0.hypot(gam.1);
        (
            (g.0 * gam.0 + g.1 * gam.1) / n,
            (g.1 * gam.0 - g.0 * gam.1) / n,
        )
    };
    let gamma = |ab: &Aberrations, k, nu: (f64, f64)| {
        let v = qem_cpu::ssb::gamma(&o, ab, k, nu);
        (v.re, v.im)
    };
    // |C(−ν) + C(ν)*|
    let mismatch = |ab: &Aberrations, k, nu: (f64, f64), g: (f64, f64)| {
        let c1 = corrected(g, gamma(ab, k, nu));
        let c2 = corrected((g.0, -g.1), gamma(ab, k, (-nu.0, -nu.1)));
        ((c2.0 + c1.0).hypot(c2.1 - c1.1), c1.0.hypot(c1.1))
    };
    let mut n = 0;
    for i in -5..=5 {
        for j in -5..=5 {
            let k = (0.23 * i as f64, 0.21 * j as f64 + 0.03);
            for (t, nu) in [(0.3, -0.4), (-1.1, 0.2), (0.05, 0.9)]
                .into_iter()
                .enumerate()
            {
                let gp = gamma(&ab, k, nu);
                if gp.0.hypot(gp.1) < 1e-6 {
                    continue;
                }
                let g = (1.0 + t as f64, -0.7 * i as f64);
                let (err, size) = mismatch(&ab, k, nu, g);
                assert!(err <= 1e-12 * (1.0 + size), "{k:?} {nu:?}: {err}");
                n += 1;
            }
        }
    }
    assert!(n > 60, "too few non-zero Γ sampled: {n}");
    // It does not need χ to be even: Γ(k, −ν) = −Γ(k, ν)* for any χ.
    let odd = Aberrations {
        c21: 400.0,
        c23: -150.0,
        ..ab
    };
    let (err, size) = mismatch(&odd, (0.2, 0.1), (0.5, -0.3), (1.0, 0.5));
    assert!(size > 1e-3 && err <= 1e-12 * (1.0 + size), "{err} {size}");
}

/// Inside `rin2` the f64 aperture is 1, outside `rout2` it is 0 (square and hard-edged
/// detectors); a non-square detector gets no shortcut.
#[test]
fn aperture_radii_bound_the_soft_edge() {
    for dt in [0.0009, 0.0, 0.0004717] {
        let o = optics(dt, dt);
        let (rin2, rout2) = aperture_radii(&o);
        assert!(rin2 > 0.0 && rin2 <= rout2, "{rin2} {rout2}");
        let (mut inside, mut outside, mut edge) = (0, 0, 0);
        for i in 0..4000 {
            let r = 1.0 + 0.6 * (i as f64 / 4000.0 - 0.5);
            let phi = 0.37 * i as f64;
            let v = (
                r * (o.alpha_rad / o.lambda_a) * phi.cos(),
                r * (o.alpha_rad / o.lambda_a) * phi.sin(),
            );
            let q2 = (v.0 * v.0 + v.1 * v.1) as f32;
            let a = o.aperture(v.0, v.1);
            if q2 <= rin2 {
                assert_eq!(a, 1.0, "{v:?}");
                inside += 1;
            } else if q2 >= rout2 {
                assert_eq!(a, 0.0, "{v:?}");
                outside += 1;
            } else {
                edge += 1;
            }
        }
        assert!(inside > 1000 && outside > 1000, "{inside} {outside} {edge}");
        if dt > 0.0 {
            assert!(edge > 10, "soft edge not sampled: {edge}");
        }
    }
    let o = optics(0.0009, 0.0008);
    assert_eq!(aperture_radii(&o), (-1.0, f32::INFINITY));
}

/// The branch-free aperture of the quadratic kernel (ssb.cu `aperture_soft`, replayed in
/// f32) follows `Optics::aperture` across the soft edge and outside it; no
/// coefficients where δ is not one constant or is 0.
#[test]
fn soft_aperture_follows_the_cpu_aperture() {
    for dt in [0.0009, 0.0004717, 0.0025] {
        let o = optics(dt, dt);
        let inv_d = aperture_soft(&o).expect("square pixels");
        let (lam, alpha) = (o.lambda_a as f32, o.alpha_rad as f32);
        let mut edge = 0;
        for i in 0..20_000 {
            let r = 1.0 + 0.4 * (i as f64 / 20_000.0 - 0.5);
            let phi = 0.37 * i as f64;
            let q = r * (o.alpha_rad / o.lambda_a);
            let (x, y) = ((q * phi.cos()) as f32, (q * phi.sin()) as f32);
            let q2 = (x * x + y * y).max(1e-30);
            let gpu = (alpha - lam * (q2 * (1.0 / q2.sqrt())))
                .mul_add(inv_d, 0.5)
                .clamp(0.0, 1.0);
            let cpu = o.aperture(f64::from(x), f64::from(y));
            // f32 against f64: α − λ|v| cancels to ~1e-9 absolute, ~2e-6 after 1/δ, also at
            // the ends of the edge (a few 1e-6 for the CPU's exact 0 or 1, as in `aperture`).
            assert!(
                (f64::from(gpu) - cpu).abs() < 1e-5,
                "dt {dt} r {r}: {gpu} vs {cpu}"
            );
            if cpu > 0.0 && cpu < 1.0 {
                edge += 1;
            }
        }
        assert!(edge > 20, "soft edge not sampled: {edge}");
    }
    assert_eq!(aperture_soft(&optics(0.0, 0.0)), None);
    assert_eq!(aperture_soft(&optics(0.0009, 0.0008)), None);
}

/// The quadratic kernel's split of the half spectrum (ssb.cu `accumulate`): quadratic blocks
/// take the pairs whose mirror is −ν or themselves, the list blocks the `general_pairs`;
/// together every full-plane frequency but the DC is written exactly once, on even, odd
/// and mixed scans.
#[test]
fn general_pairs_and_quadratic_pairs_cover_the_plane_once() {
    let freq = |n: usize| -> Vec<f32> {
        qem_cpu::ssb::fftfreq(n, 0.4)
            .iter()
            .map(|&v| v as f32)
            .collect()
    };
    for (nr, nc) in [
        (512, 512),
        (15, 22),
        (24, 30),
        (7, 9),
        (8, 5),
        (1, 6),
        (6, 1),
    ] {
        let (fr, fc) = (freq(nr), freq(nc));
        let list = general_pairs(nr, nc, &fr, &fc);
        let mut hits = vec![0u32; nr * nc];
        for h in 1..nr * (nc / 2 + 1) {
            let Some(p) = host_pair(h, nr, nc, &fr, &fc) else {
                continue;
            };
            assert_eq!(list.contains(&(h as u32)), !p.simple, "{nr}x{nc} h {h}");
            hits[p.i1] += 1;
            if let Some(i2) = p.i2 {
                hits[i2] += 1;
            }
        }
        assert_eq!(hits[0], 0, "{nr}x{nc}: the DC is the finishing kernel's");
        for (i, &n) in hits.iter().enumerate().skip(1) {
            assert_eq!(n, 1, "{nr}x{nc}: frequency {i} written {n} times");
        }
        // A Nyquist line has general pairs where the other axis has a frequency that is not
        // its own negative.
        let expect = nr % 2 == 0 && nc >= 3 || nc % 2 == 0 && nr >= 3;
        assert_eq!(
            !list.is_empty(),
            expect,
            "{nr}x{nc}: {} general pairs",
            list.len()
        );
    }
}

#[test]
fn kernels_compile_with_nvrtc_when_present() {
    match crate::nvrtc::compile_cubin(KERNEL_FILE, KERNEL_SOURCE, "sm_90", &[]) {
        Ok((cubin, _log)) => assert!(!cubin.is_empty()),
        Err(e) => assert_eq!(e.kind, qem_core::ErrorKind::BackendUnavailable, "{e}"),
    }
}

fn sizes(b: u64) -> Sizes {
    Sizes {
        b,
        n: 512 * 512,
        nh: 512 * 257,
        fixed: 64 << 20,
        scratch: 256 << 20,
        frame_bytes: 192 * 192 * 2,
    }
}

#[test]
fn plan_picks_f32_then_f16_then_f12_then_refuses() {
    let gib = 1u64 << 30;
    // 2,827 BF pixels: G as f32 is 2.97 GB, as f16 1.49 GB, as f12 1.12 GB.
    let sz = sizes(2827);
    let (st, batch) = choose_plan(&sz, 64 * gib, None).unwrap();
    assert_eq!((st, batch), (GStorage::C32, MAX_PREPARE_BATCH.min(2827)));
    let (st, batch) = choose_plan(&sz, 4 * gib, None).unwrap();
    assert_eq!(st, GStorage::C32);
    assert!(
        batch >= 32 && sz.need(st, batch as u64) <= 4 * gib,
        "{batch}"
    );
    assert!(sz.need(st, batch as u64 + 1) > 4 * gib || batch == 2827);
    let (st, _) = choose_plan(&sz, 3 * gib, None).unwrap();
    assert_eq!(st, GStorage::C16);
    // 1.5 GiB: f16 (1.70 GiB with the scratch and fixed buffers) does not fit, f12 (1.45 GiB
    // with 32 pixels' batch buffers) does.
    let (st, batch) = choose_plan(&sz, 1536 << 20, None).unwrap();
    assert_eq!(st, GStorage::C12);
    assert!(
        batch >= 32 && sz.need(st, batch as u64) <= 1536 << 20,
        "{batch}"
    );
    let e = choose_plan(&sz, gib, None).unwrap_err();
    assert_eq!(e.kind, qem_core::ErrorKind::MemoryBudget);
    assert!(e.to_string().contains("2827 BF pixels"), "{e}");
    assert!(e.to_string().contains("f12"), "{e}");
    // A forced storage is kept, or refused, never swapped.
    assert_eq!(
        choose_plan(&sz, 64 * gib, Some(GStorage::C16)).unwrap().0,
        GStorage::C16
    );
    assert!(choose_plan(&sz, 3 * gib, Some(GStorage::C32)).is_err());
    // 8,825 pixels (r = 53 px) under 6 GiB: f32 does not fit, f16 (4.6 GB) does; beside 1.9 GB
    // of resident data (about 4 GB left) f16 does not, f12 (3.5 GB) does.
    let (st, _) = choose_plan(&sizes(8825), 6 * gib, None).unwrap();
    assert_eq!(st, GStorage::C16);
    let (st, _) = choose_plan(&sizes(8825), 4_000_000_000, None).unwrap();
    assert_eq!(st, GStorage::C12);
}

#[test]
fn encoded_gather_is_staged_only_where_g_leaves_little_room() {
    let gib = 1u64 << 30;
    let work = |k: usize| Ok(k as u64 * 512 * 257 * 8);
    // 8,825 BF pixels on a large card: FFT batches of 4,096, three decode passes, no staging.
    let sz = sizes(8825);
    let (st, batch) = choose_plan(&sz, 64 * gib, None).unwrap();
    let p = encoded_passes(&sz, st, batch, 64 * gib, work).unwrap();
    assert_eq!((p.stage, p.batch, p.scratch), (0, 4096, 256 << 20));
    assert_eq!(p.passes(8825), 3);
    // Beside 1.9 GB of resident data (about 4 GB left, f12): ~60 pixels per FFT batch would mean
    // ~150 decode passes; staged as u16 images, a few hundred pixels per pass.
    let budget = 4_000_000_000;
    let (st, batch) = choose_plan(&sz, budget, None).unwrap();
    assert_eq!(st, GStorage::C12);
    assert!(8825usize.div_ceil(batch) > 50, "{batch}");
    let p = encoded_passes(&sz, st, batch, budget, work).unwrap();
    assert!(p.stage >= 300 && p.batch == 32, "{p:?}");
    assert!(p.passes(8825) <= 30, "{p:?}");
    // The decode scratch by its cost: 128 MiB (1,820 frames a launch, 2x a full-rate pass)
    // with 23 passes beats 64 MiB (4x) with 17 and 256 MiB (1x) with 69.
    assert_eq!(p.scratch, 128 << 20, "{p:?}");
    assert_eq!(p.passes(8825), 23, "{p:?}");
    let g = 8825 * padded_half(512 * 257) * 3;
    let used = g
        + sz.fixed
        + p.scratch
        + p.batch as u64 * (512 * 512 * 4 + 512 * 257 * 16)
        + p.stage as u64 * 512 * 512 * 2;
    assert!(used <= budget, "{used} > {budget}");
    // Few pixels: four passes or fewer are left direct.
    let small = sizes(100);
    let p = encoded_passes(&small, GStorage::C32, 25, 64 * gib, work).unwrap();
    assert_eq!(p.stage, 0);
    // Too little room for even one staged pixel beside one FFT image: direct, as planned.
    let p = encoded_passes(&sz, GStorage::C12, 1, g + sz.fixed + (16 << 20), work).unwrap();
    assert_eq!((p.stage, p.batch), (0, 1));
}
