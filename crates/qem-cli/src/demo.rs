//! `quantem-gpu demo`: simulate → write Dectris files → load → detector products, DPC phase,
//! an SSB aberration fit and a report.
//!
//! Runs anywhere (`--backend auto` falls back to the CPU) in a few seconds. The acquisition is
//! `qem_sim::SimParams::default()`; a few detector pixels are marked bad in the `pixel_mask` and
//! read 65535 in the data (as on an ARINA), so the load's masking is exercised. The products
//! are the `products` command's (one reduction pass: BF, ABF, ADF, HAADF, DF, sum/mean/max DP,
//! CoM) and the DPC phase the `dpc` command's, written into the same folder with the same
//! file names; the SSB fit is the `ssb --fit` command's, on a 2×2-binned load (to keep it
//! about a second), written under `ssb/`. The report adds how each image correlates with the
//! simulated projected potential and the fitted aberrations against the simulated probe's.

use crate::args::DemoArgs;
use crate::dpc_cmd::write_dpc;
use crate::image::correlation;
use crate::output::write_json;
use crate::products_cmd::{disk_json, write_products};
use crate::progress::TermProgress;
use crate::ssb_cmd::{write_ssb, SsbJob};
use anyhow::Context;
use qem::detector::{DetectorKind, DetectorParams, Product};
use qem::dpc::DpcParams;
use qem::ssb::{FitParams, SsbParams};
use qem::{DenseArray, LoadParams, SourceArg};
use serde_json::json;
use std::time::Instant;

/// Bad pixels of the demo detector (qem_sim::demo, which writes the files).
const BAD_PIXELS: [(usize, usize, u32); 3] = qem_sim::demo::DEMO_BAD_PIXELS;

/// Detector binning of the SSB step: 2×2 takes the 776 BF pixels to 193, so the fit stays
/// about a second on two cores (the loaded dataset itself stays unbinned; report.json says so).
const SSB_DET_BIN: usize = 2;

pub fn run(a: &DemoArgs, command_line: &str) -> anyhow::Result<()> {
    // An explicit backend that cannot run fails before any work (exit 4).
    qem::resolve_backend(a.backend)?;
    std::fs::create_dir_all(&a.out)
        .map_err(|e| qem::Error::io("create output folder", &a.out, &e))?;

    // 1. Simulate.
    let params = qem_sim::SimParams::default();
    let t = Instant::now();
    let sim = qem_sim::simulate(&params).context("simulating the demo acquisition")?;
    let t_simulate = t.elapsed().as_secs_f64();
    let cal = sim.calibration;
    let (scan, det) = (params.scan_shape, params.detector_shape);
    let frame_len = det.len();

    // 2. Write Dectris-style files, bad pixels at 65535 like real ARINA data.
    let t = Instant::now();
    let (written, pixel_mask) =
        qem_sim::demo::write_simulated(&a.out, &sim).context("writing the demo acquisition")?;
    let t_write = t.elapsed().as_secs_f64();
    let file_bytes = written.file_bytes();

    // 3. Load.
    let load_params = LoadParams {
        backend: a.backend,
        progress: TermProgress::for_stderr(),
        ..Default::default()
    };
    let t = Instant::now();
    let ds = qem::load(SourceArg::Path(written.master.clone()), &load_params)
        .with_context(|| format!("loading {}", written.master.display()))?;
    let t_load = t.elapsed().as_secs_f64();
    // A host copy on any backend (the CUDA engine keeps its data on the GPU).
    let host = ds.to_host()?;
    let data = &host;
    // Self-check: the loaded counts are the simulated ones, bad pixels zeroed by the mask.
    let loaded_equals_simulated = match data {
        DenseArray::U16(v) => {
            v.len() == sim.counts.len()
                && v.chunks_exact(frame_len)
                    .zip(sim.counts.chunks_exact(frame_len))
                    .all(|(got, want)| {
                        got.iter()
                            .zip(want)
                            .zip(&pixel_mask)
                            .all(|((&g, &w), &m)| g == if m != 0 { 0 } else { w })
                    })
        }
        _ => false,
    };

    // 4. Detector products, one reduction pass (plus the disk fit's sum-DP pass).
    let which = [
        Product::Det(DetectorKind::Bf),
        Product::Det(DetectorKind::Abf),
        Product::Det(DetectorKind::Adf),
        Product::Det(DetectorKind::Haadf),
        Product::Det(DetectorKind::Df),
        Product::SumDp,
        Product::MeanDp,
        Product::MaxDp,
        Product::Com,
    ];
    let t = Instant::now();
    let (prod, mut products_record, mut files) =
        write_products(&ds, &which, &DetectorParams::default(), &a.out)?;
    let t_products = t.elapsed().as_secs_f64();
    let disk = prod
        .disk
        .ok_or_else(|| anyhow::anyhow!("the products came back without the BF disk"))?;

    // 5. DPC: rotation (the simulation has none), sign, iDPC phase.
    let t = Instant::now();
    let (dpc, mut dpc_record, dpc_files) = write_dpc(&ds, &DpcParams::default(), &a.out)?;
    let t_dpc = t.elapsed().as_secs_f64();
    files.extend(dpc_files);

    // 5b. SSB: fit C10, C12, φ12 on a 2×2-binned load of the same files (module docs) with a
    // small budget in a box around the demo's probe, and compare with the simulated truth.
    let t = Instant::now();
    let ssb_ds = qem::load(
        SourceArg::Path(written.master.clone()),
        &LoadParams {
            backend: a.backend,
            det_bin: SSB_DET_BIN,
            ..Default::default()
        },
    )
    .with_context(|| format!("loading {} binned for SSB", written.master.display()))?;
    let ssb_params = SsbParams {
        voltage_kv: params.voltage_kv,
        semiangle_mrad: params.semiangle_mrad,
        scan_step_a: (params.scan_step_a, params.scan_step_a),
        ..Default::default()
    };
    let fit = FitParams {
        seed: 0,
        ranges: [
            ("C10".to_string(), (0.0, 100.0)),
            ("C12".to_string(), (0.0, 50.0)),
        ]
        .into_iter()
        .collect(),
        global_evals: 16,
        local_max_iter: 25,
        local_starts: 1,
        ..FitParams::default()
    };
    let (ssb, mut ssb_record, ssb_files) =
        write_ssb(&ssb_ds, &ssb_params, &SsbJob::Fit(fit), &a.out.join("ssb"))?;
    let t_ssb = t.elapsed().as_secs_f64();
    files.extend(ssb_files.into_iter().map(|f| format!("ssb/{f}")));
    let ab_true = params.aberrations;
    let fitted = ssb.aberrations;
    let rel = |got: f64, want: f64| (got - want) / want;
    ssb_record["det_bin"] = json!(SSB_DET_BIN);
    ssb_record["true_aberrations"] = json!({
        "C10": {"value": ab_true.c10_a, "unit": "Å"},
        "C12": {"value": ab_true.c12_a, "unit": "Å"},
        "phi12": {"value": ab_true.phi12_rad, "unit": "rad"},
    });
    ssb_record["fit_error"] = json!({
        "C10_rel": rel(fitted.c10, ab_true.c10_a),
        "C12_rel": rel(fitted.c12, ab_true.c12_a),
        "phi12_rad": fitted.phi12 - ab_true.phi12_rad,
    });
    let ssb_json = a.out.join("ssb").join("ssb.json");
    write_json(&ssb_json, &ssb_record, "write report")?;
    files.push("ssb/ssb.json".into());
    // The report holds the provenance once (under "load"); ssb/ssb.json keeps the fit's.
    if let Some(o) = ssb_record.as_object_mut() {
        o.remove("provenance");
    }

    // 6. How the images follow the specimen.
    let t = Instant::now();
    let truth: Vec<f64> = sim.projected_potential.iter().map(|&v| v as f64).collect();
    let mut images = serde_json::Map::new();
    let mut summaries = Vec::new();
    for im in &prod.images {
        let name = im.kind.name();
        let img: Vec<f64> = im.image.iter().map(|&v| v as f64).collect();
        let corr = correlation(&img, &truth);
        let mut entry = products_record["products"][name].clone();
        entry["file"] = json!(format!("{name}.png"));
        entry["correlation_with_projected_potential"] = json!(corr);
        summaries.push((
            name,
            entry["stats"]["mean"].as_f64(),
            entry["stats"]["std"].as_f64(),
            corr,
        ));
        images.insert(name.into(), entry);
    }
    let phase_corr = correlation(&dpc.phase, &truth);
    let ssb_corr = correlation(&ssb.phase, &truth);
    ssb_record["correlation_with_projected_potential"] = json!(ssb_corr);
    ssb_record["weak_phase_correlation_with_projected_potential"] =
        json!(correlation(&ssb.weak_phase, &truth));
    dpc_record["correlation_with_projected_potential"] = json!(phase_corr);
    dpc_record["expected_rotation_deg"] = json!(0.0);
    dpc_record["expected_transpose"] = json!(false);
    // The report holds the provenance once (under "load"); drop the copies.
    if let Some(o) = dpc_record.as_object_mut() {
        o.remove("provenance");
    }
    if let Some(o) = products_record.as_object_mut() {
        o.remove("provenance");
    }
    let t_images = t.elapsed().as_secs_f64();

    let ab = params.aberrations;
    let mut disk_fit = disk_json(&disk);
    disk_fit["expected_center_px"] = json!([cal.beam_center_px.0, cal.beam_center_px.1]);
    disk_fit["expected_radius_px"] = json!(cal.bf_radius_px);
    let report = json!({
        "command": command_line,
        "package_version": env!("CARGO_PKG_VERSION"),
        "git_revision": qem::GIT_REVISION,
        "simulation": {
            "model": "single-slice projection approximation (qem-sim): t = exp(i sigma V_proj), \
                      probe A exp(-i chi), Poisson counts; positive C10 = overfocus",
            "crystal": params.crystal.describe(),
            "params": params,
            "calibration": cal,
        },
        "files": {
            "out_dir": a.out,
            "master": written.master,
            "data_files": written.data_files,
            "file_bytes": file_bytes,
            "raw_bytes": written.raw_bytes,
            "compressed_chunk_bytes": written.compressed_bytes,
            "compression_ratio": written.raw_bytes as f64 / written.compressed_bytes.max(1) as f64,
            "bad_pixels": BAD_PIXELS.iter().map(|&(r, c, bits)| json!({"row": r, "col": c, "pixel_mask": bits, "value": u16::MAX})).collect::<Vec<_>>(),
        },
        "load": {
            "requested_backend": format!("{:?}", a.backend).to_lowercase(),
            "backend": ds.backend().name(),
            "device": ds.device(),
            "shape": ds.shape(),
            "dtype": ds.dtype(),
            "loaded_equals_simulated": loaded_equals_simulated,
            "provenance": ds.provenance(),
        },
        "timings_s": {
            "simulate": t_simulate,
            "write": t_write,
            "load": t_load,
            "products": t_products,
            "dpc": t_dpc,
            "ssb": t_ssb,
            "images": t_images,
        },
        "disk_fit": disk_fit,
        "images": images,
        "products": products_record,
        "dpc": dpc_record,
        "ssb": ssb_record,
        "output_files": files,
    });
    let report_path = a.out.join("report.json");
    let text = write_json(&report_path, &report, "write report")?;

    if a.json {
        return crate::print_out(&text);
    }
    let mb = |b: u64| b as f64 / 1e6;
    let mut s = format!("quantem-gpu demo -> {}\n", a.out.display());
    s.push_str(&format!(
        "  specimen   {}\n  scan       {} positions at {} Å; detector {} px at {:.3} mrad/px\n",
        params.crystal.describe(),
        scan,
        params.scan_step_a,
        det,
        cal.angular_sampling_mrad
    ));
    s.push_str(&format!(
        "  probe      {} kV (λ = {:.5} Å), α = {} mrad; C10 = {} Å (overfocus > 0), C12 = {} Å at {:.1}°, C30 = {} Å\n",
        params.voltage_kv,
        cal.wavelength_a,
        params.semiangle_mrad,
        ab.c10_a,
        ab.c12_a,
        ab.phi12_rad.to_degrees(),
        ab.c30_a
    ));
    s.push_str(&format!(
        "  dose       {} e-/frame (Poisson, seed {}); {} bad pixels stored as 65535 and masked\n",
        params.dose_e_per_frame,
        params.seed,
        BAD_PIXELS.len()
    ));
    s.push_str(&format!(
        "  files      {} + {} shard(s): {:.1} MB raw -> {:.1} MB on disk ({:.1}x bitshuffle-LZ4)\n",
        written
            .master
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        written.data_files.len(),
        mb(written.raw_bytes),
        mb(file_bytes),
        written.raw_bytes as f64 / written.compressed_bytes.max(1) as f64
    ));
    s.push_str(&format!(
        "  loaded     {} ({}), {:?} {}; equals the simulation: {}\n",
        ds.backend().name(),
        ds.device(),
        ds.shape(),
        ds.dtype(),
        if loaded_equals_simulated { "yes" } else { "NO" }
    ));
    s.push_str(&format!(
        "  BF disk    centre ({:.2}, {:.2}) px, radius {:.2} px (expected ({}, {}), {:.2})\n",
        disk.center_px.0,
        disk.center_px.1,
        disk.radius_px,
        cal.beam_center_px.0,
        cal.beam_center_px.1,
        cal.bf_radius_px
    ));
    for (name, mean, std, corr) in &summaries {
        s.push_str(&format!(
            "  {:<10} {}.png: mean {:.0}, std {:.0} counts; correlation with V_proj {:+.2}\n",
            name.to_uppercase(),
            name,
            mean.unwrap_or(f64::NAN),
            std.unwrap_or(f64::NAN),
            corr
        ));
    }
    s.push_str(&format!(
        "  DPC        phase.png: rotation {:.2}° (expected 0), transpose {}, sign by {} ({:.2}, {}); correlation with V_proj {:+.2}\n",
        dpc.rotation_deg,
        dpc.transpose,
        dpc.sign_criterion,
        dpc.sign_confidence,
        if dpc.confident { "confident" } else { "not confident" },
        phase_corr
    ));
    s.push_str(&format!(
        "  SSB        ssb/phase.png ({}x{} binned): fitted C10 = {:.1} Å (true {}), C12 = {:.1} Å (true {}), φ12 = {:.1}° (true {:.1}°); {} evaluations; correlation with V_proj {:+.2}\n",
        SSB_DET_BIN,
        SSB_DET_BIN,
        fitted.c10,
        ab_true.c10_a,
        fitted.c12,
        ab_true.c12_a,
        fitted.phi12.to_degrees(),
        ab_true.phi12_rad.to_degrees(),
        ssb_record["fit"]["evaluations"],
        ssb_corr
    ));
    s.push_str(&format!(
        "  outputs    {} PNG/NPY files (sum_dp, mean_dp, max_dp, com_row, com_col, phase, ...)\n",
        files.len()
    ));
    s.push_str(&format!(
        "  timings    simulate {t_simulate:.2} s, write {t_write:.2} s, load {t_load:.2} s, products {t_products:.3} s, dpc {t_dpc:.3} s, ssb {t_ssb:.2} s\n"
    ));
    s.push_str(&format!("  report     {}\n", report_path.display()));
    crate::print_out(&s)
}
