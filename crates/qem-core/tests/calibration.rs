//! `fit_disk_edge` on synthetic mean diffraction patterns with a known aperture edge: hard
//! (pixel-integrated) and blurred (a disk convolved with a Gaussian, as a finite source or
//! partial coherence makes it) edges, ellipses, off-centre and cut disks, Poisson noise from
//! 10³ to 10⁶ e⁻/frame, bad pixels. The truth is the generator's radius, not the fit's.

use qem_core::calibration::EdgeModel;
use qem_core::{fit_disk_edge, DiskEdge, Shape2};
use std::f64::consts::PI;

/// splitmix64 uniform in [0, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.next().max(1e-300), self.next());
        (-2.0 * u.ln()).sqrt() * (2.0 * PI * v).cos()
    }
    /// Poisson(λ): Knuth below 30, else the rounded normal approximation.
    fn poisson(&mut self, lam: f64) -> f64 {
        if lam <= 0.0 {
            return 0.0;
        }
        if lam < 30.0 {
            let (l, mut k, mut p) = ((-lam).exp(), 0.0, 1.0);
            loop {
                p *= self.next();
                if p <= l {
                    return k;
                }
                k += 1.0;
            }
        }
        (lam + lam.sqrt() * self.normal()).round().max(0.0)
    }
}

/// Fraction of a 2-D Gaussian (σ per axis) centred at distance `r` from the centre of a disk of
/// radius `big_r` that falls inside it (the disk convolved with the Gaussian, exactly up to the
/// quadrature: for each distance t from the point, the fraction of that circle inside).
fn blurred_disk(r: f64, big_r: f64, sigma: f64) -> f64 {
    let n = 600;
    let tmax = 7.0 * sigma;
    let dt = tmax / n as f64;
    let mut s = 0.0;
    for i in 0..n {
        let t = (i as f64 + 0.5) * dt;
        let frac = if r == 0.0 {
            f64::from(u8::from(t <= big_r))
        } else if t + r <= big_r {
            1.0
        } else if (r - t).abs() >= big_r {
            0.0
        } else {
            ((r * r + t * t - big_r * big_r) / (2.0 * r * t))
                .clamp(-1.0, 1.0)
                .acos()
                / PI
        };
        s += t / (sigma * sigma) * (-(t * t) / (2.0 * sigma * sigma)).exp() * frac * dt;
    }
    s
}

/// A synthetic mean DP (per frame, normalised to a plateau of 1 on a background `bg`).
struct Disk {
    shape: Shape2,
    center: (f64, f64),
    radius: f64,
    /// Major / minor semi-axis.
    ratio: f64,
    /// Major axis angle from the row axis toward the column axis, rad.
    angle: f64,
    /// Gaussian blur σ, pixels (0 = hard edge).
    blur: f64,
    /// abTEM's soft aperture instead: the amplitude falls linearly from 1 to 0 over `taper`
    /// pixels, ½ at the radius, the intensity is its square, sampled at pixel centres (0 =
    /// off).
    taper: f64,
    bg: f64,
}

impl Disk {
    fn circle(n: usize, center: (f64, f64), radius: f64, blur: f64) -> Disk {
        Disk {
            shape: Shape2::new(n, n),
            center,
            radius,
            ratio: 1.0,
            angle: 0.0,
            blur,
            taper: 0.0,
            bg: 0.01,
        }
    }

    /// abTEM's default aperture edge: `A = clip((R − ρ)/τ + ½, 0, 1)`, intensity `A²` at each
    /// pixel centre (point-sampled, as a multislice simulation's detector grid is).
    fn tapered(n: usize, center: (f64, f64), radius: f64, taper: f64) -> Disk {
        Disk {
            taper,
            ..Disk::circle(n, center, radius, 0.0)
        }
    }

    fn render(&self) -> Vec<f64> {
        let (a, b) = (
            self.radius * self.ratio.sqrt(),
            self.radius / self.ratio.sqrt(),
        );
        let (sa, ca) = self.angle.sin_cos();
        let sub = 8;
        let mut table = Vec::new();
        let dr = 0.005;
        if self.blur > 0.0 {
            let rmax = self.radius * self.ratio + 8.0 * self.blur + 4.0;
            table = (0..=(rmax / dr) as usize)
                .map(|i| blurred_disk(i as f64 * dr, self.radius, self.blur))
                .collect();
        }
        let mut out = vec![0.0; self.shape.len()];
        if self.taper > 0.0 {
            for i in 0..self.shape.rows {
                for j in 0..self.shape.cols {
                    let y = i as f64 - self.center.0;
                    let x = j as f64 - self.center.1;
                    let u = ca * y + sa * x;
                    let v = -sa * y + ca * x;
                    let rho = self.radius * ((u / a).powi(2) + (v / b).powi(2)).sqrt();
                    let amp = ((self.radius - rho) / self.taper + 0.5).clamp(0.0, 1.0);
                    out[i * self.shape.cols + j] = self.bg + amp * amp;
                }
            }
            return out;
        }
        for i in 0..self.shape.rows {
            for j in 0..self.shape.cols {
                let mut acc = 0.0;
                for si in 0..sub {
                    for sj in 0..sub {
                        let y = i as f64 - 0.5 + (si as f64 + 0.5) / sub as f64 - self.center.0;
                        let x = j as f64 - 0.5 + (sj as f64 + 0.5) / sub as f64 - self.center.1;
                        // Coordinates along the major (u) and minor (v) axes.
                        let u = ca * y + sa * x;
                        let v = -sa * y + ca * x;
                        // Elliptical radius in units of the geometric-mean radius.
                        let rho = self.radius * ((u / a).powi(2) + (v / b).powi(2)).sqrt();
                        acc += if self.blur > 0.0 {
                            let k = (rho / dr) as usize;
                            if k + 1 < table.len() {
                                let f = rho / dr - k as f64;
                                table[k] * (1.0 - f) + table[k + 1] * f
                            } else {
                                0.0
                            }
                        } else {
                            f64::from(u8::from(rho <= self.radius))
                        };
                    }
                }
                out[i * self.shape.cols + j] = self.bg + acc / (sub * sub) as f64;
            }
        }
        out
    }
}

/// Poisson counts of `frames` frames at `dose` electrons per frame, as the mean DP.
fn noisy(clean: &[f64], dose: f64, frames: f64, seed: u64) -> Vec<f64> {
    let total: f64 = clean.iter().sum();
    let mut rng = Rng(seed);
    clean
        .iter()
        .map(|&v| rng.poisson(v / total * dose * frames) / frames)
        .collect()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b) / b
}

/// [`fit_disk_edge`] of `img`, checked to read `radius` within the relative `tol`; `case` names
/// the input in the failure message.
fn fit_within(img: &[f64], shape: Shape2, radius: f64, tol: f64, case: &str) -> DiskEdge {
    let e = fit_disk_edge(img, shape).unwrap_or_else(|err| panic!("{case}: {err}"));
    let err = rel(e.radius_px, radius);
    assert!(
        err.abs() < tol,
        "{case}: fitted {} for {radius} ({:+.4} %): {e:?}",
        e.radius_px,
        100.0 * err
    );
    e
}

#[test]
fn hard_and_soft_edges_give_the_aperture_radius() {
    // (radius, blur σ): hard edges and Gaussian blurs up to 2.5 px, small and large disks.
    for &(radius, blur) in &[
        (18.68, 0.0),
        (18.68, 0.8),
        (18.68, 2.0),
        (12.3, 1.5),
        (30.2, 2.5),
        (9.4, 0.0),
    ] {
        let d = Disk::circle(64, (32.3, 31.6), radius, blur);
        let e = fit_within(&d.render(), d.shape, radius, 0.001, &format!("blur {blur}"));
        assert!(
            (e.center_px.0 - 32.3).abs() < 0.02 && (e.center_px.1 - 31.6).abs() < 0.02,
            "{e:?}"
        );
        assert!(
            e.axis_ratio < 1.002,
            "circle read as ratio {}",
            e.axis_ratio
        );
        assert!(e.edge_complete);
        // A hard or blurred edge is not read as an amplitude taper.
        assert!(
            e.model_weights.amplitude_taper < 0.05,
            "R {radius} blur {blur}: {:?}",
            e.model_weights
        );
    }
}

#[test]
fn amplitude_tapered_edges_give_the_amplitude_midpoint() {
    // abTEM's soft aperture: the intensity falls to 50 % where the amplitude is 0.707, τ(½ −
    // 0.707) = 0.21 τ inside the aperture; the fit must report the amplitude midpoint.
    for &radius in &[9.4, 18.68, 30.2] {
        for &taper in &[0.5, 1.0, 1.5] {
            let d = Disk::tapered(72, (35.3, 36.6), radius, taper);
            let e = fit_within(
                &d.render(),
                d.shape,
                radius,
                0.0005,
                &format!("taper {taper}"),
            );
            assert_eq!(e.edge_model, EdgeModel::AmplitudeTaper, "{e:?}");
            assert!(
                (e.taper_width_px - taper).abs() < 0.1 * taper,
                "taper {taper}: fitted {}",
                e.taper_width_px
            );
            // The intensity edge alone is where the old rule put it: 0.21 τ inside.
            assert!(
                e.radius_50_px < radius - 0.15 * taper,
                "R {radius} taper {taper}: 50 % contour {}",
                e.radius_50_px
            );
        }
    }
}

#[test]
fn amplitude_tapered_edges_under_poisson_noise() {
    // 1024 frames from 10^3 to 10^6 e-/frame, two radii and tapers: within 0.5 % and 4 σ.
    for &(radius, taper) in &[(18.68, 1.0), (12.3, 0.7), (26.0, 1.4)] {
        let d = Disk::tapered(64, (31.7, 32.4), radius, taper);
        let clean = d.render();
        for (k, &dose) in [1e3, 1e4, 1e5, 1e6].iter().enumerate() {
            for seed in 0..2u64 {
                let img = noisy(&clean, dose, 1024.0, 1000 + 100 * k as u64 + seed);
                let e = fit_disk_edge(&img, d.shape).unwrap();
                let err = e.radius_px - radius;
                assert!(
                    rel(e.radius_px, radius).abs() < 0.005,
                    "R {radius} taper {taper} dose {dose}: {} ({:+.3} %)",
                    e.radius_px,
                    100.0 * err / radius
                );
                assert!(
                    err.abs() < 4.0 * e.radius_sigma_px + 0.005,
                    "R {radius} taper {taper} dose {dose} seed {seed}: error {err} px vs sigma {}",
                    e.radius_sigma_px
                );
            }
        }
    }
    // 16 frames at 10^3 e-: the taper is barely seen; the σ must cover the error.
    let d = Disk::tapered(64, (31.7, 32.4), 18.68, 1.0);
    let e = fit_disk_edge(&noisy(&d.render(), 1e3, 16.0, 9), d.shape).unwrap();
    let err = e.radius_px - 18.68;
    assert!(
        err.abs() < 4.0 * e.radius_sigma_px && rel(e.radius_px, 18.68).abs() < 0.01,
        "{} ± {}",
        e.radius_px,
        e.radius_sigma_px
    );
}

#[test]
fn the_anchor_threshold_rule_is_biased_on_soft_edges_and_this_one_is_not() {
    // The old rule (mean + std threshold, equal-area radius) drops a soft edge's skirt: the
    // check that this test can tell the two apart.
    let d = Disk::circle(64, (32.0, 32.0), 18.68, 2.0);
    let img = d.render();
    let n = img.len() as f64;
    let mu = img.iter().sum::<f64>() / n;
    let sd = (img.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / n).sqrt();
    let count = img.iter().filter(|&&v| v > mu + sd).count() as f64;
    let anchor = (count / PI).sqrt();
    let e = fit_disk_edge(&img, d.shape).unwrap();
    assert!(rel(anchor, 18.68).abs() > 0.01, "anchor radius {anchor}");
    assert!(rel(e.radius_px, 18.68).abs() < 0.001, "{e:?}");
}

#[test]
fn poisson_noise_from_1e3_to_1e6_electrons_per_frame() {
    // 32 x 32 = 1024 frames; the uncertainty must cover the error (|err| < 4 σ) and the error
    // must stay under 0.5 %.
    let d = Disk::circle(64, (31.2, 33.7), 18.68, 0.8);
    let clean = d.render();
    for (k, &dose) in [1e3, 1e4, 1e5, 1e6].iter().enumerate() {
        for seed in 0..3u64 {
            let img = noisy(&clean, dose, 1024.0, 100 * k as u64 + seed);
            let e = fit_disk_edge(&img, d.shape).unwrap();
            let err = e.radius_px - 18.68;
            assert!(
                rel(e.radius_px, 18.68).abs() < 0.005,
                "dose {dose}: {} ({:+.3} %)",
                e.radius_px,
                100.0 * err / 18.68
            );
            assert!(
                err.abs() < 4.0 * e.radius_sigma_px + 0.005,
                "dose {dose} seed {seed}: error {err} px vs sigma {}",
                e.radius_sigma_px
            );
        }
    }
    // Few frames at the lowest dose: 16 frames of 10^3 e- is 16,000 electrons in all.
    let img = noisy(&clean, 1e3, 16.0, 7);
    let e = fit_disk_edge(&img, d.shape).unwrap();
    assert!(rel(e.radius_px, 18.68).abs() < 0.005, "{}", e.radius_px);
    assert!(e.radius_sigma_px > 0.005 && e.radius_sigma_px < 0.2);
}

#[test]
fn bad_pixels_are_rejected() {
    let d = Disk::circle(64, (32.0, 32.0), 18.68, 0.8);
    let mut img = noisy(&d.render(), 1e5, 1024.0, 3);
    let cols = 64;
    // Dead pixels inside the disk, on the edge, and hot pixels outside; a dead column segment.
    for &(r, c) in &[(32, 32), (40, 25), (14, 32), (32, 50), (20, 20)] {
        img[r * cols + c] = 0.0;
    }
    for &(r, c) in &[(5, 5), (60, 10), (32, 51), (13, 40)] {
        img[r * cols + c] = 500.0 * img[32 * cols + 32].max(1.0);
    }
    for r in 10..30 {
        img[r * cols + 45] = 0.0;
    }
    let e = fit_disk_edge(&img, d.shape).unwrap();
    assert!(
        rel(e.radius_px, 18.68).abs() < 0.002,
        "{} ({} rejected)",
        e.radius_px,
        e.n_pixels_rejected
    );
    assert!(e.n_pixels_rejected >= 5, "{}", e.n_pixels_rejected);
}

#[test]
fn ellipses_are_measured() {
    for &(ratio, angle) in &[(1.05, 0.3), (1.10, -1.0), (1.02, 1.4), (1.08, 0.0)] {
        let d = Disk {
            ratio,
            angle,
            ..Disk::circle(64, (32.4, 31.8), 18.68, 0.8)
        };
        let e = fit_disk_edge(&noisy(&d.render(), 1e5, 1024.0, 11), d.shape).unwrap();
        assert!(
            rel(e.radius_px, 18.68).abs() < 0.002,
            "ratio {ratio}: radius {}",
            e.radius_px
        );
        assert!(
            (e.axis_ratio - ratio).abs() < 0.003,
            "ratio {ratio}: fitted {} ± {}",
            e.axis_ratio,
            e.axis_ratio_sigma
        );
        // The major axis direction modulo π.
        let mut da = (e.major_axis_rad - angle).rem_euclid(PI);
        if da > PI / 2.0 {
            da -= PI;
        }
        assert!(
            da.abs() < 0.05,
            "angle {angle}: fitted {}",
            e.major_axis_rad
        );
        // The correction maps a point on the major axis at a = R√q to radius R.
        let a = 18.68 * ratio.sqrt();
        let (sa, ca) = angle.sin_cos();
        let k = (32.4 + a * ca, 31.8 + a * sa);
        let (u, v) = e.circular_offset(k);
        assert!(rel(u.hypot(v), 18.68).abs() < 0.003, "{}", u.hypot(v));
    }
}

#[test]
fn off_centre_and_cut_disks() {
    // Centre 10 px from a corner: only part of the edge is on the detector.
    let d = Disk::circle(64, (12.0, 50.5), 18.68, 0.8);
    let e = fit_disk_edge(&noisy(&d.render(), 1e5, 1024.0, 5), d.shape).unwrap();
    assert!(rel(e.radius_px, 18.68).abs() < 0.003, "{}", e.radius_px);
    assert!(!e.edge_complete);
    // Rectangular detector, disk off-centre.
    let d = Disk {
        shape: Shape2::new(48, 80),
        ..Disk::circle(0, (22.7, 51.2), 15.0, 1.0)
    };
    let e = fit_disk_edge(&d.render(), d.shape).unwrap();
    assert!(rel(e.radius_px, 15.0).abs() < 0.001, "{}", e.radius_px);
    assert!((e.center_px.0 - 22.7).abs() < 0.01 && (e.center_px.1 - 51.2).abs() < 0.01);
}

#[test]
fn bad_input_is_a_typed_error() {
    let s = Shape2::new(16, 16);
    let err = fit_disk_edge(&[0.0; 10], s).unwrap_err().to_string();
    assert!(err.contains("256 values"), "{err}");
    let err = fit_disk_edge(&[1.0; 256], s).unwrap_err().to_string();
    assert!(err.contains("flat"), "{err}");
    let mut v = vec![1.0; 256];
    v[17] = f64::NAN;
    let err = fit_disk_edge(&v, s).unwrap_err().to_string();
    assert!(err.contains("(1, 1)"), "{err}");
    let mut v = vec![0.0; 256];
    for k in [100, 101, 116, 117, 118, 119] {
        v[k] = 5.0;
    }
    let err = fit_disk_edge(&v, s).unwrap_err().to_string();
    assert!(err.contains("too small"), "{err}");
}

/// A point-sampled disk drawn `b×` finer (centre `c`, radius `r` in binned pixels; taper `τ`
/// fine pixels, 0 = hard) and summed over `b × b` blocks: a simulation's grid binned `b×`.
fn binned_point_sampled(n: usize, b: usize, c: (f64, f64), r: f64, taper: f64) -> Vec<f64> {
    let nf = n * b;
    // Fine pixel i sits at binned coordinate (i − (b − 1)/2) / b.
    let cf = (
        c.0 * b as f64 + 0.5 * (b - 1) as f64,
        c.1 * b as f64 + 0.5 * (b - 1) as f64,
    );
    let rf = r * b as f64;
    let mut out = vec![0.0; n * n];
    for i in 0..nf {
        for j in 0..nf {
            let rho = (i as f64 - cf.0).hypot(j as f64 - cf.1);
            let v = if taper > 0.0 {
                ((rf - rho) / taper + 0.5).clamp(0.0, 1.0).powi(2)
            } else {
                f64::from(u8::from(rho <= rf))
            };
            out[(i / b) * n + j / b] += (0.01 + v) / (b * b) as f64;
        }
    }
    out
}

#[test]
fn binned_point_sampled_tapers_and_hard_edges() {
    // abTEM's one-pixel taper binned 2x and 3x: the taper is 1/b pixel wide and each pixel
    // averages b x b point samples; the sub-grid taper finds the amplitude midpoint. The same
    // grid with a hard aperture must not be read as a taper.
    let s = Shape2::new(48, 48);
    for &b in &[2usize, 3] {
        for &r in &[9.34, 12.3] {
            let soft = binned_point_sampled(48, b, (23.6, 24.2), r, 1.0);
            let e = fit_within(&soft, s, r, 0.002, &format!("bin {b}, soft"));
            assert_eq!(e.edge_model, EdgeModel::AmplitudeTaper, "{e:?}");
            assert_eq!(e.taper_subsamples, b, "{e:?}");
            let hard = binned_point_sampled(48, b, (23.6, 24.2), r, 0.0);
            let e = fit_within(&hard, s, r, 0.005, &format!("bin {b}, hard"));
            assert!(
                e.model_weights.amplitude_taper < 0.05,
                "bin {b} R {r}: {e:?}"
            );
        }
    }
}
