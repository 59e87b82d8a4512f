//! Times the BF disk-edge fit (`qem_core::fit_disk_edge`, what SSB's default detector sampling
//! and `unit="mrad"` detectors run once per dataset) on the mean pattern of the reference
//! acquisition, rebuilt on the host: the logistic disk of `make_reference_acquisition.py`
//! (width 0.7 px) deflected by ±1.2 px over the scan, its halo, and the two bad pixels at
//! 65535. Prints one line per size and, with `--out FILE`, a JSON record. No GPU needed:
//! `cargo run --release -p qem-bench --example edge_fit_time [-- --out FILE]`.
use qem_core::{fit_disk_edge, Shape2};
use std::f64::consts::PI;
use std::time::Instant;

/// The mean of the reference generator's frames over one period of its lattice (`m × m`
/// scan points), normalised to `dose` counts per frame.
fn reference_mean(n: usize, radius: f64, m: usize, dose: f64) -> Vec<f64> {
    let mut v = vec![0.0; n * n];
    let c0 = n as f64 / 2.0;
    let mut lam = vec![0.0; n * n];
    for a in 0..m {
        for b in 0..m {
            let (i, j) = (a as f64 * 9.3 / m as f64, b as f64 * 9.3 / m as f64);
            let (si, ci) = (2.0 * PI * i / 9.3).sin_cos();
            let (sj, cj) = (2.0 * PI * j / 9.3).sin_cos();
            let ph = ci * cj;
            let (cy, cx) = (c0 + 1.2 * si * cj, c0 + 1.2 * ci * sj);
            let mut total = 0.0;
            for y in 0..n {
                for x in 0..n {
                    let d = (y as f64 - cy).hypot(x as f64 - cx);
                    let bf = 1.0 / (1.0 + ((d - radius) / 0.7).exp());
                    let halo = 0.15 * (-d / 22.0).exp() * (1.0 + 0.5 * ph);
                    lam[y * n + x] = bf * (0.85 + 0.15 * ph) + halo;
                    total += lam[y * n + x];
                }
            }
            for (acc, l) in v.iter_mut().zip(&lam) {
                *acc += l / total * dose / (m * m) as f64;
            }
        }
    }
    v[17 * n + 101] = 65535.0;
    v[150 * n + 3] = 65535.0;
    v
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let out = args
        .iter()
        .position(|a| a == "--out")
        .and_then(|i| args.get(i + 1));
    let mut rows = Vec::new();
    for (n, radius) in [(192usize, 30.0f64), (192, 53.0), (256, 100.0), (512, 120.0)] {
        let v = reference_mean(n, radius, 24, 200_000.0);
        let t = Instant::now();
        let e = fit_disk_edge(&v, Shape2::new(n, n))?;
        let s = t.elapsed().as_secs_f64();
        println!(
            "{n}² r {radius}: {s:.3} s, edge {:.5} ± {:.1e} px ({:?}, {} px in the band)",
            e.radius_px, e.radius_sigma_px, e.edge_model, e.n_pixels_fit
        );
        rows.push(serde_json::json!({
            "detector": n, "true_radius_px": radius, "seconds": s,
            "edge_radius_px": e.radius_px, "edge_sigma_px": e.radius_sigma_px,
            "edge_model": e.edge_model, "band_pixels": e.n_pixels_fit,
        }));
    }
    if let Some(path) = out {
        let rec = serde_json::json!({
            "what": "disk-edge fit on the reference acquisition's mean pattern (host rebuild)",
            "threads": rayon::current_num_threads(),
            "rows": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&rec)?)?;
    }
    Ok(())
}
