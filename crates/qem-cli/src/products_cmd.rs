//! `quantem-gpu products PATH --out DIR`: detector products of a source in one pass.
//!
//! Loads the source, asks [`qem::detector::products`] for the requested products (one
//! reduction pass plus the cached disk fit), and writes per product a `.npy` array (exact
//! `u64` images and sums, `f32` mean DP, `u32` max DP, `f64` CoM) and a PNG with a grey-level
//! bar, then `products.json`: parameters, the disk fit, per-product files and statistics
//! (raw min/max/mean/std and the display limits of the bar), the provenance and timings.

use crate::args::{shape2, JobIo, ProductsArgs};
use crate::output::{write_npy, write_png_annotated, Display, Sampling};
use crate::print_out;
use crate::progress::TermProgress;
use anyhow::Context;
use qem::detector::{self, DetectorParams, DiskFit};
use qem::{Dataset, LoadParams, Shape2, SourceArg};
use serde_json::{json, Value};
use std::path::Path;
use std::time::Instant;

/// Load `path` for a compute command (an unusable explicit backend fails first, exit 4).
pub fn load_source(io: &JobIo) -> anyhow::Result<(Dataset, f64)> {
    let (path, backend) = (&io.path, io.backend);
    qem::resolve_backend(backend)?;
    let params = LoadParams {
        backend,
        scan_shape: io.scan_shape.as_deref().and_then(shape2),
        representation: io.representation,
        progress: TermProgress::for_stderr(),
        ..LoadParams::default()
    };
    let t = Instant::now();
    let ds = qem::load(SourceArg::Path(path.to_path_buf()), &params)
        .with_context(|| format!("cannot load {}", path.display()))?;
    Ok((ds, t.elapsed().as_secs_f64()))
}

/// Create the output folder.
pub fn make_out_dir(out: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(out)
        .map_err(|e| qem::Error::io("create output folder", out, &e))
        .with_context(|| format!("cannot create {}", out.display()))
}

/// What one written array looks like in the JSON.
pub struct Written {
    /// File names relative to the output folder.
    pub files: Vec<String>,
    /// The JSON entry.
    pub entry: Value,
}

/// Write `name.npy` (values as `T`) and `name.png` (with a colour bar, and a scale bar of
/// `sampling`) for a 2-D array; returns its JSON entry (files, shape, dtype, raw statistics,
/// display mapping).
pub fn write_array<T: crate::output::NpyElem>(
    out: &Path,
    name: &str,
    data: &[T],
    as_f64: &[f64],
    shape: Shape2,
    log: bool,
    sampling: Sampling<'_>,
) -> anyhow::Result<Written> {
    let npy = format!("{name}.npy");
    let png = format!("{name}.png");
    write_npy(&out.join(&npy), data, &[shape.rows, shape.cols])?;
    let (stats, display): (_, Display) =
        write_png_annotated(&out.join(&png), as_f64, shape, log, sampling)?;
    Ok(Written {
        files: vec![png.clone(), npy.clone()],
        entry: json!({
            "npy": npy,
            "png": png,
            "shape": [shape.rows, shape.cols],
            "dtype": dtype_name::<T>(),
            "stats": stats,
            "display": display,
        }),
    })
}

/// Stamp a command's JSON record with how it was made (command line, source, output folder,
/// load time, package version, git revision), write it as `out/name`, and return its text.
pub fn write_record(
    record: &mut Value,
    command_line: &str,
    io: &JobIo,
    t_load: f64,
    name: &str,
) -> anyhow::Result<String> {
    let (source, out) = (&io.path, &io.out);
    record["command"] = json!(command_line);
    record["source"] = json!(source);
    record["out_dir"] = json!(out);
    record["timings_s"]["load"] = json!(t_load);
    record["package_version"] = json!(env!("CARGO_PKG_VERSION"));
    record["git_revision"] = json!(qem::GIT_REVISION);
    let json_path = out.join(name);
    let text = format!("{}\n", serde_json::to_string_pretty(&record)?);
    std::fs::write(&json_path, &text)
        .map_err(|e| qem::Error::io("write report", &json_path, &e))
        .with_context(|| format!("cannot write {}", json_path.display()))?;
    Ok(text)
}

/// Write `name.npy` alone (an f64 2-D array that gets no picture); returns its JSON entry.
pub fn write_npy_only(
    out: &Path,
    name: &str,
    data: &[f64],
    shape: Shape2,
) -> anyhow::Result<Written> {
    let npy = format!("{name}.npy");
    write_npy(&out.join(&npy), data, &[shape.rows, shape.cols])?;
    Ok(Written {
        files: vec![npy.clone()],
        entry: json!({ "npy": npy, "shape": [shape.rows, shape.cols], "dtype": "float64",
                       "stats": crate::image::stats(data) }),
    })
}

/// Float images of one scan: `pictured` as `.npy` + PNG (linear grey), `npy_only` as `.npy`,
/// into `out` (created here, so that the folder appears only once there is something to put
/// in it); returns the files written, the record's `arrays` entries by name and the seconds
/// the writing took.
pub fn write_scan_arrays(
    out: &Path,
    scan: Shape2,
    step_a: Option<(f64, f64)>,
    pictured: &[(&str, &[f64])],
    npy_only: &[(&str, &[f64])],
) -> anyhow::Result<(Vec<String>, serde_json::Map<String, Value>, f64)> {
    let sampling = scan_sampling(step_a);
    make_out_dir(out)?;
    let t = Instant::now();
    let mut files = Vec::new();
    let mut arrays = serde_json::Map::new();
    for &(name, v) in pictured {
        let w = write_array(out, name, v, v, scan, false, sampling)?;
        files.extend(w.files);
        arrays.insert(name.into(), w.entry);
    }
    for &(name, v) in npy_only {
        let w = write_npy_only(out, name, v, scan)?;
        files.extend(w.files);
        arrays.insert(name.into(), w.entry);
    }
    Ok((files, arrays, t.elapsed().as_secs_f64()))
}

/// The scale bar of scan images: the column step in Å when known, else scan positions.
pub fn scan_sampling(step_a: Option<(f64, f64)>) -> Sampling<'static> {
    match step_a {
        Some((_, col)) if col.is_finite() && col > 0.0 => Sampling {
            size: col,
            unit: "Å",
        },
        _ => Sampling::PIXELS,
    }
}

/// The scale bar of detector images: mrad per pixel when known, else pixels.
fn detector_sampling(mrad: Option<f64>) -> Sampling<'static> {
    match mrad {
        Some(m) if m.is_finite() && m > 0.0 => Sampling {
            size: m,
            unit: "mrad",
        },
        _ => Sampling::PIXELS,
    }
}

fn dtype_name<T: crate::output::NpyElem>() -> &'static str {
    match T::DESCR {
        "|u1" => "uint8",
        "<u2" => "uint16",
        "<u4" => "uint32",
        "<u8" => "uint64",
        "<f4" => "float32",
        _ => "float64",
    }
}

fn to_f64<T: Copy + Into<f64>>(v: &[T]) -> Vec<f64> {
    v.iter().map(|&x| x.into()).collect()
}

fn u64_f64(v: &[u64]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// The summary's dataset line: shape, dtype, backend (device), representation.
pub fn dataset_line(ds: &qem::Dataset) -> String {
    format!(
        "{:?} {}, {} ({}), {}",
        ds.shape(),
        ds.dtype(),
        ds.backend().name(),
        ds.device(),
        ds.representation().name()
    )
}

/// What a command's JSON record says of its dataset.
pub fn dataset_json(ds: &qem::Dataset) -> Value {
    json!({
        "shape": ds.shape(),
        "dtype": ds.dtype(),
        "backend": ds.backend().name(),
        "device": ds.device(),
        "representation": ds.representation().name(),
    })
}

/// The disk as JSON.
pub fn disk_json(d: &DiskFit) -> Value {
    json!({
        "center_px": [d.center_px.0, d.center_px.1],
        "radius_px": d.radius_px,
        "threshold": d.threshold,
        "n_pixels": d.n_pixels,
        "fitted": d.fitted,
        "method": if d.fitted {
            "mean DP > mean + std (population), unweighted centroid, equal-area radius"
        } else {
            "given"
        },
    })
}

/// Write the products of `ds` into `out` (created after they are computed); returns them, the `products.json` record (without
/// the command and source) and the files written.
pub fn write_products(
    ds: &Dataset,
    which: &[detector::Product],
    params: &DetectorParams,
    out: &Path,
) -> anyhow::Result<(detector::Products, Value, Vec<String>)> {
    let t = Instant::now();
    let prods = detector::products(ds, which, params).context("computing the products")?;
    let t_compute = t.elapsed().as_secs_f64();
    // The folder appears only once there is something to put in it.
    make_out_dir(out)?;
    let t = Instant::now();
    let scan = ds.scan_shape();
    let det = ds.detector_shape();
    let scan_bar = scan_sampling(ds.metadata().scan_step_a);
    let det_bar = detector_sampling(
        params
            .det_sampling_mrad
            .or(ds.metadata().angular_sampling_mrad.map(|(_, c)| c)),
    );
    let mut files = Vec::new();
    let mut entries = serde_json::Map::new();
    for im in &prods.images {
        let name = im.kind.to_string();
        let w = write_array(
            out,
            &name,
            &im.image,
            &u64_f64(&im.image),
            scan,
            false,
            scan_bar,
        )?;
        let mut e = w.entry;
        e["inner_px"] = json!(im.inner_px);
        // JSON has no infinity: DF's open outer bound is null.
        e["outer_px"] = if im.outer_px.is_finite() {
            json!(im.outer_px)
        } else {
            Value::Null
        };
        e["mask_pixels"] = json!(im.mask_pixels);
        e["center_px"] = json!([im.disk.center_px.0, im.disk.center_px.1]);
        e["radius_px"] = json!(im.disk.radius_px);
        files.extend(w.files);
        entries.insert(name, e);
    }
    if let Some(v) = &prods.sum_dp {
        let w = write_array(out, "sum_dp", v, &u64_f64(v), det, true, det_bar)?;
        files.extend(w.files);
        entries.insert("sum_dp".into(), w.entry);
    }
    if let Some(v) = &prods.mean_dp {
        let w = write_array(out, "mean_dp", v, &to_f64(v), det, true, det_bar)?;
        files.extend(w.files);
        entries.insert("mean_dp".into(), w.entry);
    }
    if let Some(v) = &prods.max_dp {
        let w = write_array(out, "max_dp", v, &to_f64(v), det, true, det_bar)?;
        files.extend(w.files);
        entries.insert("max_dp".into(), w.entry);
    }
    if let Some(m) = &prods.moments {
        let mut e = serde_json::Map::new();
        for (name, v) in [
            ("moments_sum", &m.sum),
            ("moments_m_row", &m.m_row),
            ("moments_m_col", &m.m_col),
        ] {
            let w = write_array(out, name, v, &u64_f64(v), scan, false, scan_bar)?;
            files.extend(w.files);
            e.insert(name.into(), w.entry);
        }
        entries.insert("moments".into(), Value::Object(e));
    }
    if let Some(c) = &prods.com {
        let mut e = serde_json::Map::new();
        for (name, v) in [("com_row", &c.com_row), ("com_col", &c.com_col)] {
            let w = write_array(out, name, v, v, scan, false, scan_bar)?;
            files.extend(w.files);
            e.insert(name.into(), w.entry);
        }
        e.insert("unit".into(), json!(c.unit));
        e.insert("centered".into(), json!(c.centered));
        e.insert("zero_frames".into(), json!(c.zero_frames));
        entries.insert("com".into(), Value::Object(e));
    }
    let t_write = t.elapsed().as_secs_f64();
    let record = json!({
        "dataset": dataset_json(ds),
        "requested": which.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
        "params": {
            "inner": params.inner,
            "outer": params.outer,
            "center": params.center.map(|(r, c)| [r, c]),
            "radius": params.radius,
            "unit": params.unit.name(),
            "semiangle_mrad": params.semiangle_mrad,
            "det_sampling_mrad": params.det_sampling_mrad,
        },
        "disk": prods.disk.as_ref().map(disk_json),
        "products": entries,
        "timings_s": { "products": t_compute, "write": t_write },
        "provenance": prods.provenance,
    });
    Ok((prods, record, files))
}

/// A statistic for the summary: integers as they are, other values to 4 significant digits.
fn num(v: &Value) -> String {
    match v.as_f64() {
        Some(x) if x.fract() == 0.0 && x.abs() < 1e15 => format!("{x:.0}"),
        Some(x) => format!("{x:.4e}"),
        None => "-".into(),
    }
}

pub fn run(a: &ProductsArgs, command_line: &str) -> anyhow::Result<()> {
    let center = match a.center.as_deref() {
        None => None,
        Some([r, c]) => Some((*r, *c)),
        Some(_) => None,
    };
    let params = DetectorParams {
        inner: a.inner,
        outer: a.outer,
        center,
        radius: a.radius,
        unit: a.unit,
        semiangle_mrad: a.semiangle_mrad,
        det_sampling_mrad: a.det_sampling_mrad,
    };
    // Bad numbers fail before the load.
    params.validate()?;
    let (ds, t_load) = load_source(&a.io)?;
    let (_, mut record, files) = write_products(&ds, &a.products, &params, &a.io.out)?;
    let text = write_record(&mut record, command_line, &a.io, t_load, "products.json")?;
    if a.json {
        return print_out(&text);
    }
    let mut s = format!(
        "{} -> {}\n  dataset  {}\n",
        a.io.path.display(),
        a.io.out.display(),
        dataset_line(&ds),
    );
    if let Some(d) = record["disk"].as_object() {
        s.push_str(&format!(
            "  BF disk  centre ({:.2}, {:.2}) px, radius {:.2} px ({})\n",
            d["center_px"][0].as_f64().unwrap_or(f64::NAN),
            d["center_px"][1].as_f64().unwrap_or(f64::NAN),
            d["radius_px"].as_f64().unwrap_or(f64::NAN),
            if d["fitted"] == true {
                "fitted"
            } else {
                "given"
            }
        ));
    }
    if let Some(p) = record["products"].as_object() {
        // Entries with statistics are arrays; `moments` and `com` group several.
        let arrays = p.iter().flat_map(|(name, e)| {
            if e.get("stats").is_some() {
                vec![(name.as_str(), e)]
            } else {
                e.as_object()
                    .map(|o| {
                        o.iter()
                            .filter(|(_, v)| v.get("stats").is_some())
                            .map(|(n, v)| (n.as_str(), v))
                            .collect()
                    })
                    .unwrap_or_default()
            }
        });
        for (name, e) in arrays {
            let st = &e["stats"];
            s.push_str(&format!(
                "  {:<14}{}: min {}, max {}, mean {}\n",
                name,
                e["png"].as_str().unwrap_or(""),
                num(&st["min"]),
                num(&st["max"]),
                num(&st["mean"])
            ));
        }
    }
    s.push_str(&format!(
        "  {} files + products.json; load {:.2} s, products {:.3} s\n",
        files.len(),
        t_load,
        record["timings_s"]["products"].as_f64().unwrap_or(f64::NAN)
    ));
    print_out(&s)
}
