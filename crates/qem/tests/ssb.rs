//! SSB ptychography through the façade (`qem::ssb`) on a synthetic weak-phase object whose 4D
//! data is simulated here, independently of the code under test: a known phase φ(R) (periodic
//! sum of Gaussians), a hard-aperture probe with known C10/C12 built with its own χ, frames
//! `|FFT(p(r − R)·exp(iφ(r)))|²` on a fine grid, rounded to u16 counts.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic on setup failures

use qem::ssb::{Aberrations, Fidelity, FitParams, GStorage, Objective, Ssb, SsbParams};
mod common;

use common::{load_array, pearson, rel_l2};
use qem::{BackendRequest, Dataset, DenseArray, ErrorKind, LoadParams, Representation, Shape2};

/// Minimal complex number (the test does not depend on rustfft).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Complex64 {
    re: f64,
    im: f64,
}

impl Complex64 {
    fn new(re: f64, im: f64) -> Self {
        Complex64 { re, im }
    }
    fn from_polar(r: f64, t: f64) -> Self {
        Complex64::new(r * t.cos(), r * t.sin())
    }
    fn norm_sqr(self) -> f64 {
        self.re * self.re + self.im * self.im
    }
}

impl std::ops::Mul for Complex64 {
    type Output = Complex64;
    fn mul(self, o: Complex64) -> Complex64 {
        Complex64::new(
            self.re * o.re - self.im * o.im,
            self.re * o.im + self.im * o.re,
        )
    }
}

/// Naive 1-D DFT (`sign` −1 forward, +1 inverse, unnormalised) with a precomputed table.
fn dft(x: &mut [Complex64], table: &[Complex64]) {
    let n = x.len();
    let out: Vec<Complex64> = (0..n)
        .map(|k| {
            let mut acc = Complex64::new(0.0, 0.0);
            for (j, &v) in x.iter().enumerate() {
                let t = v * table[(j * k) % n];
                acc.re += t.re;
                acc.im += t.im;
            }
            acc
        })
        .collect();
    x.copy_from_slice(&out);
}
use std::f64::consts::PI;

const KV: f64 = 300.0;
const ALPHA: f64 = 0.02; // rad
const M: usize = 32; // window = detector size
const DET: Shape2 = Shape2::new(M, M);
const R_BF: f64 = 8.0; // BF disk radius, detector px
const STEP_PX: usize = 1; // scan step in window pixels (0.246 Å: the scan samples the whole 2k_max SSB band)

/// Relativistic wavelength (Å), written out here (CODATA 2018).
fn wavelength() -> f64 {
    let (h, m0, e, c) = (
        6.626_070_15e-34,
        9.109_383_701_5e-31,
        1.602_176_634e-19,
        299_792_458.0,
    );
    let ev = e * KV * 1e3;
    h / (2.0 * m0 * ev * (1.0 + ev / (2.0 * m0 * c * c))).sqrt() * 1e10
}

fn kmax() -> f64 {
    ALPHA / wavelength()
}
fn dk() -> f64 {
    kmax() / R_BF
}
fn dx() -> f64 {
    1.0 / (M as f64 * dk())
}

struct Sim {
    ds: Dataset,
    truth: Vec<f64>,
    scan: Shape2,
    /// The frames, for loading the same data elsewhere.
    data: Vec<u16>,
}

impl Sim {
    /// The same frames loaded on `backend` as `repr`.
    fn reload(&self, backend: BackendRequest, repr: Representation) -> Dataset {
        let params = LoadParams {
            backend,
            representation: Some(repr),
            ..LoadParams::default()
        };
        load_array(DenseArray::U16(self.data.clone()), self.scan, DET, &params)
    }
}

/// Sample frequencies of an `n`-point DFT with spacing `d`: `0, 1, …, ⌈n/2⌉−1, −⌊n/2⌋, …, −1`
/// over `n·d`.
fn fftfreq(n: usize, d: f64) -> Vec<f64> {
    let half = n.div_ceil(2);
    let non_negative = (0..half).map(|i| i as f64);
    let negative = (half..n).map(|i| i as f64 - n as f64);
    non_negative
        .chain(negative)
        .map(|s| s / (n as f64 * d))
        .collect()
}

/// Simulate a `scan` of a periodic weak-phase object with probe aberrations `(c10, c12, phi12)`.
fn simulate(scan: Shape2, c10: f64, c12: f64, phi12: f64, repr: Option<Representation>) -> Sim {
    let lam = wavelength();
    let (pr, pc) = (scan.rows * STEP_PX, scan.cols * STEP_PX); // object period, fine px
    let d = dx();
    // Phase: Gaussians of σ = 0.5 Å (atom-like: SSB transfers little below ~0.1 k_max) at
    // pseudo-random places, 0.05–0.15 rad, periodic.
    let mut seed = 12345u64;
    let mut rnd = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 11) as f64 / (1u64 << 53) as f64
    };
    let gauss: Vec<(f64, f64, f64)> = (0..6)
        .map(|_| (rnd() * pr as f64, rnd() * pc as f64, 0.05 + 0.1 * rnd()))
        .collect();
    let sigma = 0.5 / d; // px
    let mut phi = vec![0.0; pr * pc];
    for r in 0..pr {
        for c in 0..pc {
            let mut v = 0.0;
            for &(gr, gc, a) in &gauss {
                let mut dr = (r as f64 - gr).rem_euclid(pr as f64);
                if dr > pr as f64 / 2.0 {
                    dr -= pr as f64;
                }
                let mut dc = (c as f64 - gc).rem_euclid(pc as f64);
                if dc > pc as f64 / 2.0 {
                    dc -= pc as f64;
                }
                v += a * (-(dr * dr + dc * dc) / (2.0 * sigma * sigma)).exp();
            }
            phi[r * pc + c] = v;
        }
    }
    // Probe: P(q) = [|q| ≤ k_max] exp(−iχ(q)) exp(−2πi q·r0), r0 = window centre.
    let q = fftfreq(M, d);
    let r0 = (M / 2) as f64 * d;
    let mut probe_q = vec![Complex64::new(0.0, 0.0); M * M];
    for i in 0..M {
        for j in 0..M {
            let (qr, qc) = (q[i], q[j]);
            let qq = (qr * qr + qc * qc).sqrt();
            if qq <= kmax() {
                let a = lam * qq;
                let ph = qc.atan2(qr);
                let chi = PI / lam * a * a * (c10 + c12 * (2.0 * (ph - phi12)).cos());
                probe_q[i * M + j] = Complex64::from_polar(1.0, -chi - 2.0 * PI * (qr + qc) * r0);
            }
        }
    }
    let tab = |sign: f64| -> Vec<Complex64> {
        (0..M)
            .map(|j| Complex64::from_polar(1.0, sign * 2.0 * PI * j as f64 / M as f64))
            .collect()
    };
    let (f_tab, i_tab) = (tab(-1.0), tab(1.0));
    let fft2 = |buf: &mut Vec<Complex64>, inverse: bool| {
        let f = if inverse { &i_tab } else { &f_tab };
        for row in buf.chunks_exact_mut(M) {
            dft(row, f);
        }
        let mut col = vec![Complex64::new(0.0, 0.0); M];
        for c in 0..M {
            for r in 0..M {
                col[r] = buf[r * M + c];
            }
            dft(&mut col, f);
            for r in 0..M {
                buf[r * M + c] = col[r];
            }
        }
    };
    let mut probe_r = probe_q.clone();
    fft2(&mut probe_r, true);
    probe_r.iter_mut().for_each(|v| {
        v.re /= (M * M) as f64;
        v.im /= (M * M) as f64;
    });
    // |FFT(p_r)|² = |P|² = 1 in the disk, so 10⁴ counts per BF pixel.
    let scale = 1e4;
    let mut data = vec![0u16; scan.len() * M * M];
    let mut truth = vec![0.0; scan.len()];
    for i in 0..scan.rows {
        for j in 0..scan.cols {
            let mut w = vec![Complex64::new(0.0, 0.0); M * M];
            for x in 0..M {
                for y in 0..M {
                    let (or, oc) = ((i * STEP_PX + x) % pr, (j * STEP_PX + y) % pc);
                    w[x * M + y] =
                        probe_r[x * M + y] * Complex64::from_polar(1.0, phi[or * pc + oc]);
                }
            }
            fft2(&mut w, false);
            let n = i * scan.cols + j;
            let frame = &mut data[n * M * M..(n + 1) * M * M];
            for a in 0..M {
                for b in 0..M {
                    // fftshift: detector pixel (a, b) is q = ((a − M/2)Δk, (b − M/2)Δk).
                    let v = w[((a + M / 2) % M) * M + (b + M / 2) % M].norm_sqr() * scale;
                    frame[a * M + b] = v.round().min(65535.0) as u16;
                }
            }
            truth[n] = phi[((i * STEP_PX + M / 2) % pr) * pc + (j * STEP_PX + M / 2) % pc];
        }
    }
    let params = LoadParams {
        backend: BackendRequest::Cpu,
        representation: repr,
        ..LoadParams::default()
    };
    let ds = load_array(DenseArray::U16(data.clone()), scan, DET, &params);
    Sim {
        ds,
        truth,
        scan,
        data,
    }
}

fn params() -> SsbParams {
    SsbParams {
        voltage_kv: KV,
        semiangle_mrad: ALPHA * 1e3,
        scan_step_a: (STEP_PX as f64 * dx(), STEP_PX as f64 * dx()),
        det_sampling_mrad: Some(wavelength() * dk() * 1e3),
        ..SsbParams::default()
    }
}

const C10: f64 = 100.0;
const C12: f64 = 30.0;
const PHI12: f64 = 0.5;

/// Fit parameters: the defaults with the coherence objective.
fn coherence() -> FitParams {
    FitParams {
        objective: Objective::Coherence,
        ..FitParams::default()
    }
}

fn truth_ab() -> Aberrations {
    Aberrations {
        c10: C10,
        c12: C12,
        phi12: PHI12,
        ..Default::default()
    }
}

#[test]
fn reconstruct_true_aberrations_recovers_phase_wrong_defocus_does_not() {
    let sim = simulate(Shape2::new(24, 30), C10, C12, PHI12, None);
    let s = Ssb::new(&sim.ds, &params()).unwrap();
    assert!(s.n_bf_pixels() > 150, "{}", s.n_bf_pixels());
    let r = s.reconstruct(&truth_ab()).unwrap();
    assert_eq!(r.scan_shape, sim.scan);
    let good = pearson(&r.phase, &sim.truth);
    let wrong = Aberrations {
        c10: -C10,
        ..truth_ab()
    };
    let bad = pearson(&s.reconstruct(&wrong).unwrap().phase, &sim.truth);
    let zero = pearson(
        &s.reconstruct(&Aberrations::default()).unwrap().phase,
        &sim.truth,
    );
    println!("corr true {good:.4}, C10 = -{C10} {bad:.4}, no aberrations {zero:.4}");
    assert!(good > 0.9, "{good}");
    // Re O is the constant DC (Γ(k, −ν) = −Γ(k, ν)* makes the corrected spectrum
    // anti-Hermitian off the DC), and the weak phase is Im O over it.
    let n = r.object_re.len() as f64;
    let d = r.object_re.iter().sum::<f64>() / n;
    let spread = r
        .object_re
        .iter()
        .map(|v| (v - d).abs())
        .fold(0.0, f64::max);
    assert!(
        d > 0.0 && spread <= 1e-9 * d,
        "Re O spread {spread} around {d}"
    );
    for (w, i) in r.weak_phase.iter().zip(&r.object_im) {
        assert!(
            (w - i / d).abs() <= 1e-12 * (1.0 + w.abs()),
            "{w} vs {}",
            i / d
        );
    }
    let weak = pearson(&r.weak_phase, &sim.truth);
    println!("weak phase corr {weak:.4}");
    assert!(weak > 0.9, "{weak}");
    assert!(bad < good - 0.3, "{bad} vs {good}");
    // Both losses are lower at the truth than at wrong defocus.
    for kind in [Objective::PhaseVariance, Objective::Coherence] {
        let (lt, lw) = (
            s.objective(&truth_ab(), kind).unwrap(),
            s.objective(&wrong, kind).unwrap(),
        );
        println!("{kind:?}: truth {lt:.6}, wrong {lw:.6}");
        assert!(lt < lw, "{kind:?}");
    }
}

#[test]
fn fit_recovers_c10_c12_and_is_deterministic() {
    let sim = simulate(Shape2::new(24, 30), C10, C12, PHI12, None);
    let s = Ssb::new(&sim.ds, &params()).unwrap();
    let fp = FitParams::default();
    let t0 = std::time::Instant::now();
    let f = s.fit(&fp).unwrap();
    let secs = t0.elapsed().as_secs_f64();
    let a = f.aberrations;
    println!(
        "fit: C10 {:.3} Å, C12 {:.3} Å, phi12 {:.4} rad, loss {:.6}, {} evaluations, {secs:.2} s",
        a.c10, a.c12, a.phi12, f.loss, f.evaluations
    );
    assert!((a.c10 - C10).abs() < 0.02 * C10, "C10 {}", a.c10);
    assert!((a.c12 - C12).abs() < 0.1 * C12, "C12 {}", a.c12);
    assert_eq!(f.evaluations, f.loss_curve.len());
    assert!(f.loss <= f.loss_curve.iter().cloned().fold(f64::INFINITY, f64::min) + 1e-15);
    let corr = pearson(&f.result.phase, &sim.truth);
    println!("fit reconstruction corr {corr:.4}");
    assert!(corr > 0.9);
    // Same seed → identical answer; the robust objective also lands on the truth.
    let small = FitParams {
        global_evals: 60,
        local_max_iter: 60,
        local_starts: 1,
        ..FitParams::default()
    };
    let f1 = s.fit(&small).unwrap();
    let f2 = s.fit(&small).unwrap();
    assert_eq!(f1.aberrations, f2.aberrations);
    assert_eq!(f1.loss_curve, f2.loss_curve);
    let fc = s.fit(&coherence()).unwrap();
    println!(
        "coherence fit: C10 {:.3}, C12 {:.3}, phi12 {:.4}, {} evaluations",
        fc.aberrations.c10, fc.aberrations.c12, fc.aberrations.phi12, fc.evaluations
    );
    assert!((fc.aberrations.c10 - C10).abs() < 0.05 * C10);
}

/// Where the coherence loss is lowest along C10 and along C12 (the other parameters at the
/// truth), to 0.01 Å by a parabola through the lowest of 0.1 Å steps: within 0.3 Å of the
/// truth on this simulation (weak phase ≤ 0.15 rad, hard aperture, 10⁴ counts per BF pixel;
/// the engine models a soft aperture edge). By Cauchy–Schwarz the model-fit form is largest
/// exactly where `Γ ∝ G`, so only the data's departures from the weak-phase model (second-order
/// terms, the aperture edge, rounding to counts) may move the minimum.
#[test]
fn coherence_minimum_lies_at_the_truth() {
    let sim = simulate(Shape2::new(24, 30), C10, C12, PHI12, None);
    let s = Ssb::new(&sim.ds, &params()).unwrap();
    let argmin = |set: &dyn Fn(f64) -> Aberrations, centre: f64| -> f64 {
        let xs: Vec<f64> = (-30..=30).map(|i| centre + 0.1 * i as f64).collect();
        let ls: Vec<f64> = xs
            .iter()
            .map(|&x| s.objective(&set(x), Objective::Coherence).unwrap())
            .collect();
        let k = (1..ls.len() - 1)
            .min_by(|&a, &b| ls[a].total_cmp(&ls[b]))
            .unwrap();
        let (l0, l1, l2) = (ls[k - 1], ls[k], ls[k + 1]);
        xs[k] + 0.05 * (l0 - l2) / (l0 - 2.0 * l1 + l2)
    };
    let c10 = argmin(
        &|x| Aberrations {
            c10: x,
            ..truth_ab()
        },
        C10,
    );
    let c12 = argmin(
        &|x| Aberrations {
            c12: x,
            ..truth_ab()
        },
        C12,
    );
    println!("coherence lowest at C10 {c10:.3} Å, C12 {c12:.3} Å (truth {C10}, {C12})");
    assert!((c10 - C10).abs() < 0.3, "C10 minimum at {c10}");
    assert!((c12 - C12).abs() < 0.3, "C12 minimum at {c12}");
}

/// The coherence loss is continuous in the aberrations: profiled along C10 in 0.05 Å steps
/// through the truth (±15 Å), no step changes the loss by more than 4× the median step. A loss
/// of the phase-only corrected spectra `G Γ*/|Γ|` (the object's) failed this at 8.9× (a jump at
/// C10 = 108.8 Å): its terms for pixels inside both discs flip sign where the transfer
/// `sin χ(ν)` passes through 0; in `Σ_b G Γ*` with `Σ_b |Γ|²` they pass through 0 smoothly.
#[test]
fn coherence_loss_is_continuous_in_c10() {
    let sim = simulate(Shape2::new(24, 30), C10, C12, PHI12, None);
    let s = Ssb::new(&sim.ds, &params()).unwrap();
    let losses: Vec<f64> = (0..=600)
        .map(|i| {
            let ab = Aberrations {
                c10: C10 - 15.0 + 0.05 * i as f64,
                ..truth_ab()
            };
            s.objective(&ab, Objective::Coherence).unwrap()
        })
        .collect();
    let mut steps: Vec<f64> = losses.windows(2).map(|w| (w[1] - w[0]).abs()).collect();
    let (at, largest) =
        steps
            .iter()
            .enumerate()
            .fold((0, 0.0f64), |m, (i, &v)| if v > m.1 { (i, v) } else { m });
    steps.sort_by(f64::total_cmp);
    let median = steps[steps.len() / 2];
    println!(
        "largest step {largest:.3e} at C10 {:.2}, median {median:.3e}",
        C10 - 15.0 + 0.05 * at as f64
    );
    assert!(
        largest <= 4.0 * median,
        "a jump of {largest:.3e} (median step {median:.3e}) at C10 {:.2}",
        C10 - 15.0 + 0.05 * at as f64
    );
}

/// The coarse stages (here with a sample of every fourth detector row of a small disk): the
/// sample comes first in `bf_pixels`, its loss is a different function from the full one but
/// also lowest at the truth, and the coarse fit ends where the all-pixel fit does.
#[test]
fn coarse_fit_lands_where_the_full_fit_does() {
    let sim = simulate(Shape2::new(24, 30), C10, C12, PHI12, None);
    let p = SsbParams {
        coarse_min_pixels: 16,
        ..params()
    };
    let s = Ssb::new(&sim.ds, &p).unwrap();
    let (n, b) = (s.coarse_pixels(), s.n_bf_pixels());
    assert!(n >= 16 && 3 * n < b, "{n} of {b}: about a quarter");
    let rows: Vec<usize> = s.bf_pixels.iter().map(|p| p.0).collect();
    let r0 = rows[0] % 4;
    assert!(rows[..n].iter().all(|r| r % 4 == r0));
    assert!(rows[n..].iter().all(|r| r % 4 != r0));
    // Without the option the same disk has no coarse sample (fewer than the default minimum).
    let plain = Ssb::new(&sim.ds, &params()).unwrap();
    assert_eq!(plain.coarse_pixels(), 0);
    let wrong = Aberrations {
        c10: -C10,
        ..truth_ab()
    };
    let at = |ab: &Aberrations, f| s.objective_at(ab, Objective::Coherence, f).unwrap();
    let (ct, cw) = (
        at(&truth_ab(), Fidelity::Coarse),
        at(&wrong, Fidelity::Coarse),
    );
    let (ft, fw) = (at(&truth_ab(), Fidelity::Full), at(&wrong, Fidelity::Full));
    println!("coarse: truth {ct:.6} wrong {cw:.6}; full: truth {ft:.6} wrong {fw:.6}");
    assert!(ct < cw && ft < fw);
    assert_ne!(ct, ft, "the coarse loss is over fewer pixels");
    // The full loss does not depend on the pixel order (to rounding).
    let (fo, fp) = (
        plain.objective(&truth_ab(), Objective::Coherence).unwrap(),
        ft,
    );
    assert!((fo - fp).abs() <= 1e-12 * fo.abs(), "{fo} vs {fp}");
    let fc = s.fit(&coherence()).unwrap();
    let ff = s
        .fit(&FitParams {
            coarse: false,
            ..coherence()
        })
        .unwrap();
    let fit = &fc.provenance.params["fit"];
    println!(
        "coarse fit: C10 {:.3} C12 {:.3} phi12 {:.4}, {} evaluations ({} coarse); all-pixel fit: C10 {:.3} C12 {:.3} phi12 {:.4}, {} evaluations",
        fc.aberrations.c10, fc.aberrations.c12, fc.aberrations.phi12, fc.evaluations,
        fit["coarse_evaluations"], ff.aberrations.c10, ff.aberrations.c12, ff.aberrations.phi12,
        ff.evaluations
    );
    assert_eq!(fit["coarse"], true);
    let n_coarse = fit["coarse_evaluations"].as_u64().unwrap() as usize;
    assert!(
        n_coarse > fc.evaluations / 2,
        "{n_coarse} of {}",
        fc.evaluations
    );
    assert_eq!(ff.provenance.params["fit"]["coarse_evaluations"], 0);
    assert!(
        (fc.aberrations.c10 - C10).abs() < 0.02 * C10,
        "{:?}",
        fc.aberrations
    );
    assert!(
        (fc.aberrations.c12 - C12).abs() < 0.1 * C12,
        "{:?}",
        fc.aberrations
    );
    // Same minimum as the all-pixel fit: C10 within 0.2 Å of 100, C12 within 0.1 Å.
    assert!((fc.aberrations.c10 - ff.aberrations.c10).abs() < 0.2);
    assert!((fc.aberrations.c12 - ff.aberrations.c12).abs() < 0.1);
    assert!(
        fc.loss <= ff.loss + 1e-6 * ff.loss.abs(),
        "{} vs {}",
        fc.loss,
        ff.loss
    );
}

#[test]
fn odd_scan_shape_encoded_and_default_sampling() {
    let scan = Shape2::new(15, 22);
    let sim = simulate(scan, C10, C12, PHI12, None);
    let s = Ssb::new(&sim.ds, &params()).unwrap();
    let r = s.reconstruct(&truth_ab()).unwrap();
    assert_eq!(r.phase.len(), 15 * 22);
    let c = pearson(&r.phase, &sim.truth);
    println!("15x22 corr {c:.4}");
    assert!(c > 0.9, "{c}");
    // ENCODED data gathers the same images: identical reconstruction.
    let enc = simulate(scan, C10, C12, PHI12, Some(Representation::Encoded));
    assert_eq!(enc.ds.representation(), Representation::Encoded);
    let se = Ssb::new(&enc.ds, &params()).unwrap();
    assert_eq!(se.reconstruct(&truth_ab()).unwrap().phase, r.phase);
    // Default detector sampling α / r_BF from the fitted disk: close to the true 2.5 mrad/px.
    let sd = Ssb::new(
        &sim.ds,
        &SsbParams {
            det_sampling_mrad: None,
            ..params()
        },
    )
    .unwrap();
    let want = wavelength() * dk() * 1e3;
    println!(
        "default sampling {:.4} mrad/px (true {want:.4})",
        sd.det_sampling_mrad
    );
    assert!((sd.det_sampling_mrad - want).abs() < 0.05 * want);
    let cd = pearson(&sd.reconstruct(&truth_ab()).unwrap().phase, &sim.truth);
    assert!(cd > 0.85, "{cd}");
    // The compat option doubles it.
    let s2 = Ssb::new(
        &sim.ds,
        &SsbParams {
            det_sampling_mrad: None,
            compat_2alpha: true,
            ..params()
        },
    )
    .unwrap();
    // The compat option is the anchor's 2α over the anchor's threshold radius.
    let alpha = params().semiangle_mrad;
    assert!((s2.det_sampling_mrad - 2.0 * alpha / s2.disk.radius_px).abs() < 1e-12);
    // The default comes from the sub-pixel disk edge, with its source and uncertainty.
    let smp = sd.sampling.as_ref().unwrap();
    assert!(smp.source.contains("BF disk edge"), "{}", smp.source);
    assert!(smp.sigma_stat_mrad_per_px > 0.0 && smp.edge.is_some());
    // The reported σ is the statistical one and the 0.3 % systematic floor in quadrature.
    let want = smp.sigma_stat_mrad_per_px.hypot(0.003 * smp.mrad_per_px);
    assert!(
        (smp.sigma_mrad_per_px - want).abs() <= 1e-12 * want,
        "{smp:?}"
    );
    assert!(smp.sigma_mrad_per_px >= 0.003 * smp.mrad_per_px);
}

#[test]
fn errors_bad_params_and_memory_budget() {
    let sim = simulate(Shape2::new(5, 6), C10, C12, PHI12, None);
    let bad = [
        SsbParams {
            voltage_kv: -1.0,
            ..params()
        },
        SsbParams {
            semiangle_mrad: 0.0,
            ..params()
        },
        SsbParams {
            scan_step_a: (1.0, f64::NAN),
            ..params()
        },
        SsbParams {
            det_sampling_mrad: Some(0.0),
            ..params()
        },
        SsbParams {
            bf_threshold: 1.5,
            ..params()
        },
        SsbParams {
            rotation_deg: f64::INFINITY,
            ..params()
        },
    ];
    for p in bad {
        let e = Ssb::new(&sim.ds, &p).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{p:?}");
    }
    let e = Ssb::new(
        &sim.ds,
        &SsbParams {
            memory_budget: Some(1000),
            ..params()
        },
    )
    .unwrap_err();
    assert_eq!(e.kind, ErrorKind::MemoryBudget);
    let s = Ssb::new(&sim.ds, &params()).unwrap();
    for fp in [
        FitParams {
            fit: vec!["C99".into()],
            ..FitParams::default()
        },
        FitParams {
            fit: vec![],
            ..FitParams::default()
        },
        FitParams {
            ranges: [("C10".to_string(), (5.0, -5.0))].into_iter().collect(),
            ..FitParams::default()
        },
        FitParams {
            ranges: [("C30".to_string(), (0.0, 1.0))].into_iter().collect(),
            ..FitParams::default()
        },
    ] {
        assert_eq!(
            s.fit(&fp).unwrap_err().kind,
            ErrorKind::InvalidArgument,
            "{fp:?}"
        );
    }
}

/// The CUDA engine against the CPU reference on the same frames: even (Nyquist lines) and odd
/// scans, dense and ENCODED on the card, G as f32 and as f16. Bounds: object rel L2 ≤ 1e-4
/// (f32) / 5e-3 (f16), losses within 1e-4 / 5e-3 relative; the fit on the GPU lands on the
/// truth. Skips (and says so) without a GPU — the H200 run is the evidence.
/// Without a GPU, asking for the CUDA engine is a typed error (not a silent CPU run); with
/// one it runs there.
#[test]
fn cuda_engine_request_is_honoured_or_refused() {
    let sim = simulate(Shape2::new(15, 22), C10, C12, PHI12, None);
    let r = Ssb::new(
        &sim.ds,
        &SsbParams {
            engine: BackendRequest::Cuda,
            ..params()
        },
    );
    match qem::backend::cuda_unavailable_reason() {
        Some(_) => {
            let e = r.unwrap_err();
            assert_eq!(e.kind, ErrorKind::BackendUnavailable, "{e}");
            assert!(e.to_string().contains("cuda"), "{e}");
        }
        None => assert_eq!(r.unwrap().engine_name(), "cuda"),
    }
    let e = Ssb::new(
        &sim.ds,
        &SsbParams {
            engine: BackendRequest::Mps,
            ..params()
        },
    )
    .unwrap_err();
    assert_eq!(e.kind, ErrorKind::BackendUnavailable, "{e}");
    let cpu = Ssb::new(
        &sim.ds,
        &SsbParams {
            engine: BackendRequest::Cpu,
            ..params()
        },
    )
    .unwrap();
    assert_eq!(cpu.engine_name(), "cpu");
}

#[test]
fn cuda_engine_matches_cpu_reference() {
    if let Some(why) = qem::backend::cuda_unavailable_reason() {
        println!("skipped: CUDA unavailable ({why})");
        return;
    }
    for scan in [Shape2::new(24, 30), Shape2::new(15, 22)] {
        let sim = simulate(scan, C10, C12, PHI12, None);
        let cpu = Ssb::new(&sim.ds, &params()).unwrap();
        assert_eq!(cpu.engine_name(), "cpu");
        let want = cpu.reconstruct(&truth_ab()).unwrap();
        let wrong = Aberrations {
            c10: -C10,
            c12: 5.0,
            ..truth_ab()
        };
        for repr in [Representation::Dense, Representation::Encoded] {
            let ds = sim.reload(BackendRequest::Cuda, repr);
            for (storage, tol) in [
                (GStorage::C32, 1e-4),
                (GStorage::C16, 5e-3),
                (GStorage::C12, 5e-3),
            ] {
                let g = Ssb::new(
                    &ds,
                    &SsbParams {
                        g_storage: Some(storage),
                        ..params()
                    },
                )
                .unwrap();
                assert_eq!(g.engine_name(), "cuda");
                assert_eq!(g.n_bf_pixels(), cpu.n_bf_pixels());
                assert_eq!(g.cuda_stats().unwrap().storage, storage);
                let got = g.reconstruct(&truth_ab()).unwrap();
                let e_re = rel_l2(&got.object_re, &want.object_re);
                let e_im = rel_l2(&got.object_im, &want.object_im);
                println!("{scan} {repr:?} {storage:?}: object rel L2 re {e_re:.2e} im {e_im:.2e}");
                assert!(e_re <= tol && e_im <= tol, "{scan} {repr:?} {storage:?}");
                // χ is quadratic here, so that was the quadratic kernel; the general one on the
                // same G gives the same object (both f32, different algebra).
                g.set_cuda_quadratic_kernel(false);
                let general = g.reconstruct(&truth_ab()).unwrap();
                g.set_cuda_quadratic_kernel(true);
                let (q_re, q_im) = (
                    rel_l2(&got.object_re, &general.object_re),
                    rel_l2(&got.object_im, &general.object_im),
                );
                println!("  quadratic vs general kernel: rel L2 re {q_re:.2e} im {q_im:.2e}");
                assert!(q_re <= 1e-4 && q_im <= 1e-4, "{scan} {repr:?} {storage:?}");
                for kind in [Objective::Coherence, Objective::PhaseVariance] {
                    for ab in [truth_ab(), wrong] {
                        let (lc, lg) = (
                            cpu.objective(&ab, kind).unwrap(),
                            g.objective(&ab, kind).unwrap(),
                        );
                        let rel = (lg - lc).abs() / lc.abs();
                        println!("  {kind:?} cpu {lc:.8} cuda {lg:.8} rel {rel:.2e}");
                        assert!(rel <= tol, "{scan} {repr:?} {storage:?} {kind:?}");
                    }
                }
            }
        }
    }
    // The coarse loss (the first pixels of G only) on the card = the CPU's.
    let sim = simulate(Shape2::new(24, 30), C10, C12, PHI12, None);
    let p = SsbParams {
        coarse_min_pixels: 16,
        ..params()
    };
    let cpu = Ssb::new(&sim.ds, &p).unwrap();
    for repr in [Representation::Dense, Representation::Encoded] {
        let g = Ssb::new(&sim.reload(BackendRequest::Cuda, repr), &p).unwrap();
        assert_eq!(g.coarse_pixels(), cpu.coarse_pixels());
        assert!(g.coarse_pixels() > 0);
        for kind in [Objective::Coherence, Objective::PhaseVariance] {
            for quad in [true, false] {
                g.set_cuda_quadratic_kernel(quad);
                let (lc, lg) = (
                    cpu.objective_at(&truth_ab(), kind, Fidelity::Coarse)
                        .unwrap(),
                    g.objective_at(&truth_ab(), kind, Fidelity::Coarse).unwrap(),
                );
                let full = g.objective(&truth_ab(), kind).unwrap();
                let rel = (lg - lc).abs() / lc.abs();
                println!("  coarse {repr:?} {kind:?} quad {quad}: cpu {lc:.8} cuda {lg:.8} rel {rel:.2e} (full {full:.8})");
                assert!(rel <= 1e-4, "{repr:?} {kind:?} {quad}");
                assert!((full - lg).abs() > 10.0 * (lg - lc).abs(), "coarse ≠ full");
            }
        }
    }
    // Data held on the host, SSB on the card (engine = Cuda): the same object; and the CPU
    // engine refuses data that lies on the card.
    let sim = simulate(Shape2::new(15, 22), C10, C12, PHI12, None);
    let want = Ssb::new(&sim.ds, &params())
        .unwrap()
        .reconstruct(&truth_ab())
        .unwrap();
    let host = Ssb::new(
        &sim.ds,
        &SsbParams {
            engine: BackendRequest::Cuda,
            ..params()
        },
    )
    .unwrap();
    assert_eq!(host.engine_name(), "cuda");
    let got = host.reconstruct(&truth_ab()).unwrap();
    let (e_re, e_im) = (
        rel_l2(&got.object_re, &want.object_re),
        rel_l2(&got.object_im, &want.object_im),
    );
    println!("host data, CUDA SSB: object rel L2 re {e_re:.2e} im {e_im:.2e}");
    assert!(e_re <= 1e-4 && e_im <= 1e-4);
    let on_card = sim.reload(BackendRequest::Cuda, Representation::Encoded);
    let e = Ssb::new(
        &on_card,
        &SsbParams {
            engine: BackendRequest::Cpu,
            ..params()
        },
    )
    .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    // The fit with the loss on the GPU (the search is the CPU's code) finds the truth.
    let sim = simulate(Shape2::new(24, 30), C10, C12, PHI12, None);
    let ds = sim.reload(BackendRequest::Cuda, Representation::Encoded);
    let g = Ssb::new(&ds, &params()).unwrap();
    let f = g.fit(&coherence()).unwrap();
    let a = f.aberrations;
    println!(
        "cuda fit: C10 {:.3}, C12 {:.3}, phi12 {:.4}, {} evaluations",
        a.c10, a.c12, a.phi12, f.evaluations
    );
    assert!((a.c10 - C10).abs() < 0.02 * C10, "C10 {}", a.c10);
    assert!((a.c12 - C12).abs() < 0.1 * C12, "C12 {}", a.c12);
    let f2 = g.fit(&coherence()).unwrap();
    assert_eq!(
        f.loss_curve, f2.loss_curve,
        "deterministic for a seed on CUDA"
    );
    // A budget too small for G even as f12 is a typed error naming the bytes.
    let e = Ssb::new(
        &ds,
        &SsbParams {
            memory_budget: Some(100_000),
            ..params()
        },
    )
    .unwrap_err();
    assert_eq!(e.kind, ErrorKind::MemoryBudget, "{e}");
}

/// ENCODED data under a budget that leaves G little room: the gather stages the BF pixels as u16
/// images, many per decode pass, instead of decoding every frame for each small FFT batch; the
/// object is that of an unbudgeted preparation. Skips without a GPU.
#[test]
fn cuda_tight_budget_stages_the_encoded_gather() {
    if let Some(why) = qem::backend::cuda_unavailable_reason() {
        println!("skipped: CUDA unavailable ({why})");
        return;
    }
    let sim = simulate(Shape2::new(24, 30), C10, C12, PHI12, None);
    let ds = sim.reload(BackendRequest::Cuda, Representation::Encoded);
    let with = |budget: Option<u64>| {
        Ssb::new(
            &ds,
            &SsbParams {
                memory_budget: budget,
                g_storage: Some(GStorage::C12),
                ..params()
            },
        )
    };
    let free = with(None).unwrap();
    assert_eq!(free.cuda_stats().unwrap().staged_pixels, 0);
    let want = free.reconstruct(&truth_ab()).unwrap();
    let b = free.n_bf_pixels();
    // 193 BF pixels: more than four FFT batches of 32.
    assert!(b > 128, "{b} BF pixels: too few for more than four passes");
    // The smallest budget that prepares (bisection; below it a MemoryBudget error).
    let (mut lo, mut hi) = (0u64, free.cuda_stats().unwrap().peak_bytes);
    while hi - lo > 1024 {
        let mid = lo + (hi - lo) / 2;
        match with(Some(mid)) {
            Ok(_) => hi = mid,
            Err(e) => {
                assert_eq!(e.kind, ErrorKind::MemoryBudget, "{e}");
                lo = mid;
            }
        }
    }
    let mut staged = 0;
    for extra in [0u64, 20_000, 100_000, 400_000] {
        let g = with(Some(hi + extra)).unwrap();
        let st = g.cuda_stats().unwrap().clone();
        println!(
            "budget {} + {extra}: {} passes, FFT batches of {}, {} staged per pass",
            hi, st.batches, st.batch_pixels, st.staged_pixels
        );
        assert!(st.peak_bytes <= hi + extra, "{st:?}");
        if st.staged_pixels > 0 {
            staged += 1;
            assert!(st.staged_pixels > st.batch_pixels, "{st:?}");
            assert_eq!(st.batches, b.div_ceil(st.staged_pixels), "{st:?}");
        } else {
            assert_eq!(st.batches, b.div_ceil(st.batch_pixels), "{st:?}");
        }
        let got = g.reconstruct(&truth_ab()).unwrap();
        let (e_re, e_im) = (
            rel_l2(&got.object_re, &want.object_re),
            rel_l2(&got.object_im, &want.object_im),
        );
        assert!(e_re <= 1e-6 && e_im <= 1e-6, "{e_re:.2e} {e_im:.2e} {st:?}");
    }
    assert!(staged > 0, "no budget staged the gather");
}
