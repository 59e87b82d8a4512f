//! `quantem-gpu dpc PATH --out DIR`: centre of mass, rotation/transpose and the iDPC phase.
//!
//! Runs [`qem::dpc::run`] (one reduction pass for the moments and the ADF image the sign
//! criterion uses) and writes `com_row`, `com_col`, `phase` (PNG with a grey-level bar and
//! `.npy`, `f64`), the aligned field `dpc_row`/`dpc_col` (`.npy`), and `dpc.json`: rotation,
//! transpose, the 180° sign criterion and its confidence, curl score, units, per-array
//! statistics, provenance and timings.

use crate::args::DpcArgs;
use crate::print_out;
use crate::products_cmd::{dataset_line, load_source, write_record, write_scan_arrays};
use anyhow::Context;
use qem::dpc::{self, DpcParams, DpcResult};
use qem::Dataset;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Instant;

/// Run DPC on `ds` and write its files into `out` (created after the computation); returns the result, the `dpc.json` record
/// (without the command and source) and the files written.
pub fn write_dpc(
    ds: &Dataset,
    params: &DpcParams,
    out: &Path,
) -> anyhow::Result<(DpcResult, Value, Vec<String>)> {
    let t = Instant::now();
    let res = dpc::run(ds, params).context("computing DPC")?;
    let t_compute = t.elapsed().as_secs_f64();
    let (files, arrays, t_write) = write_scan_arrays(
        out,
        res.scan_shape,
        ds.metadata().scan_step_a,
        &[
            ("com_row", &res.com_row),
            ("com_col", &res.com_col),
            ("phase", &res.phase),
        ],
        &[("dpc_row", &res.dpc_row), ("dpc_col", &res.dpc_col)],
    )?;
    let record = json!({
        "dataset": crate::products_cmd::dataset_json(ds),
        "params": {
            "rotation_deg": params.rotation_deg,
            "transpose": params.transpose,
            "edge": params.edge.name(),
        },
        "rotation_deg": res.rotation_deg,
        "transpose": res.transpose,
        "sign_criterion": res.sign_criterion,
        "sign_confidence": res.sign_confidence,
        "confident": res.confident,
        "curl_score": res.curl_score,
        "zero_frames": res.zero_frames,
        "unit": res.unit,
        "phase_unit": res.phase_unit,
        "arrays": arrays,
        "timings_s": { "dpc": t_compute, "write": t_write },
        "provenance": res.provenance,
    });
    Ok((res, record, files))
}

pub fn run(a: &DpcArgs, command_line: &str) -> anyhow::Result<()> {
    let params = DpcParams {
        rotation_deg: a.rotation_deg,
        transpose: a.transpose,
        edge: a.edge,
    };
    params.validate()?;
    let (ds, t_load) = load_source(&a.io)?;
    let (res, mut record, files) = write_dpc(&ds, &params, &a.io.out)?;
    let text = write_record(&mut record, command_line, &a.io, t_load, "dpc.json")?;
    if a.json {
        return print_out(&text);
    }
    let s = format!(
        "{} -> {}\n  dataset   {}\n  rotation  {:.2}° (transpose: {}), curl score {:.3e}\n  sign      {} = {:.3} ({})\n  phase     phase.png, in {}\n  {} files + dpc.json; load {:.2} s, dpc {:.3} s\n",
        a.io.path.display(),
        a.io.out.display(),
        dataset_line(&ds),
        res.rotation_deg,
        res.transpose,
        res.curl_score,
        res.sign_criterion,
        res.sign_confidence,
        if res.confident { "confident" } else { "NOT confident: the sign may be inverted" },
        res.phase_unit,
        files.len(),
        t_load,
        record["timings_s"]["dpc"].as_f64().unwrap_or(f64::NAN),
    );
    print_out(&s)
}
