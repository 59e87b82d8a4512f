//! Façade-level timing of the first products on a GPU-resident acquisition (issue 5 evidence):
//! `detector::products` (BF, ADF, sum DP, moments in one pass), `dpc::center_of_mass`,
//! `dpc::run` and `dpc::integrate_on(Cuda)`, on the ENCODED (CUDA default) and dense
//! representations, p50 of R calls after one warm-up; and a CPU-engine check of the same
//! products and DPC on a scan region (integers equal, rotation and phase compared).
//!
//! ```text
//! cargo run --release -p qem-bench --example cuda_products_bench -- MASTER OUT.json [R]
//! ```

use qem::detector::{self, DetectorParams, Product};
use qem::dpc::{self, DpcParams, EdgeMode};
use qem::{Backend, BackendRequest, Region, Representation};
use qem_bench::timing::time_p50;
use serde_json::{json, Value};
use std::time::Instant;

#[path = "shared/facade.rs"]
mod facade;
use facade::{load, rel_l2};

fn main() -> qem::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (master, out) = match (args.first(), args.get(1)) {
        (Some(m), Some(o)) => (m.clone(), o.clone()),
        _ => {
            eprintln!("usage: cuda_products_bench MASTER OUT.json [repeats]");
            std::process::exit(2)
        }
    };
    let r: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10);
    let which = [
        Product::Det(detector::DetectorKind::Bf),
        Product::Det(detector::DetectorKind::Adf),
        Product::SumDp,
        Product::Moments,
    ];
    let dp = DetectorParams::default();
    let mut rows = Vec::new();
    for rep in [Representation::Encoded, Representation::Dense] {
        let t = Instant::now();
        let ds = load(&master, BackendRequest::Cuda, None, 1, rep)?;
        let load_s = t.elapsed().as_secs_f64();
        // The disk fit is cached per dataset (one sum-DP pass on first use): time it apart.
        let t = Instant::now();
        let disk = detector::fit_disk(&ds)?;
        let disk_s = t.elapsed().as_secs_f64();
        let (prod_s, prod_all, prod) = time_p50(r, || detector::products(&ds, &which, &dp))?;
        let (com_s, _, _) = time_p50(r, || dpc::center_of_mass(&ds, true))?;
        let (run_s, run_all, res) = time_p50(r, || dpc::run(&ds, &DpcParams::default()))?;
        let shape = res.scan_shape;
        let (int_s, _, _) = time_p50(r, || {
            dpc::integrate_on(
                Backend::Cuda,
                &res.dpc_row,
                &res.dpc_col,
                shape,
                EdgeMode::Periodic,
            )
        })?;
        let t = Instant::now();
        let cpu_phase = dpc::integrate(&res.dpc_row, &res.dpc_col, shape, EdgeMode::Periodic)?;
        let cpu_int_s = t.elapsed().as_secs_f64();
        let gpu_phase = dpc::integrate_on(
            Backend::Cuda,
            &res.dpc_row,
            &res.dpc_col,
            shape,
            EdgeMode::Periodic,
        )?;
        println!(
            "{:<8} load {:.3} s | disk fit {:.1} ms | products(bf,adf,sum_dp,moments) p50 {:.2} ms | com {:.2} ms | dpc.run {:.2} ms (rotation {:.3} deg, transpose {}, sign {} {:.2}) | integrate cuda {:.2} ms vs cpu {:.2} ms (rel L2 {:.1e})",
            rep.name(), load_s, disk_s * 1e3, prod_s * 1e3, com_s * 1e3, run_s * 1e3, res.rotation_deg,
            res.transpose, res.sign_criterion, res.sign_confidence, int_s * 1e3, cpu_int_s * 1e3,
            rel_l2(&gpu_phase, &cpu_phase)
        );
        rows.push(json!({"representation": rep.name(), "load_s": load_s, "disk_fit_first_s": disk_s,
            "disk": disk, "products_p50_s": prod_s, "products_runs_s": prod_all,
            "products_stages": prod.provenance.timings, "center_of_mass_p50_s": com_s,
            "dpc_run_p50_s": run_s, "dpc_run_runs_s": run_all, "dpc_run_stages": res.provenance.timings,
            "rotation_deg": res.rotation_deg, "transpose": res.transpose,
            "sign_criterion": res.sign_criterion, "sign_confidence": res.sign_confidence,
            "integrate_cuda_p50_s": int_s, "integrate_cpu_single_s": cpu_int_s,
            "integrate_cuda_vs_cpu_rel_l2": rel_l2(&gpu_phase, &cpu_phase)}));
    }
    // The CPU engine on a scan region, against CUDA ENCODED on the same region.
    let region = Region::new(0, 96, 0, 128);
    let cpu = load(
        &master,
        BackendRequest::Cpu,
        Some(region),
        1,
        Representation::Dense,
    )?;
    let gpu = load(
        &master,
        BackendRequest::Cuda,
        Some(region),
        1,
        Representation::Encoded,
    )?;
    let pc = detector::products(&cpu, &which, &dp)?;
    let pg = detector::products(&gpu, &which, &dp)?;
    let images_equal = pc
        .images
        .iter()
        .zip(&pg.images)
        .all(|(a, b)| a.image == b.image);
    let ints_equal = images_equal && pc.sum_dp == pg.sum_dp && pc.moments == pg.moments;
    let dc = dpc::run(&cpu, &DpcParams::default())?;
    let dg = dpc::run(&gpu, &DpcParams::default())?;
    let check: Value = json!({"region": [0, 96, 0, 128], "integers_equal": ints_equal,
        "rotation_deg_cpu": dc.rotation_deg, "rotation_deg_cuda": dg.rotation_deg,
        "transpose_equal": dc.transpose == dg.transpose,
        "phase_rel_l2": rel_l2(&dg.phase, &dc.phase)});
    println!("CPU vs CUDA on {region:?}: {check}");
    let rec = json!({"tool": "qem example cuda_products_bench", "source": master, "repeats": r,
        "device": qem_cuda::describe(), "git_revision": qem::GIT_REVISION,
        "timing": "wall of the whole façade call, p50 after one warm-up",
        "rows": rows, "cpu_check": check,
        "pass": ints_equal && dc.transpose == dg.transpose && rel_l2(&dg.phase, &dc.phase) < 1e-9});
    std::fs::write(&out, serde_json::to_string_pretty(&rec).unwrap_or_default())
        .map_err(|e| qem::Error::io("write", std::path::Path::new(&out), &e))?;
    Ok(())
}
