//! Metadata of a Dectris master (or any HDF5 file with the same groups), tolerant of stored
//! types, with units converted to those named in [`qem_core::Metadata`].

use crate::h5::{self, h5err, Value};
use crate::open::shape_from_ints;
use qem_core::{Error, Metadata, Result, Shape2};
use std::path::Path;

const DET: &str = "/entry/instrument/detector";
const DS: &str = "/entry/instrument/detector/detectorSpecific";
const STEM: &str = "/entry/instrument/stem";
const BEAM: &str = "/entry/instrument/beam";

/// What the master says besides the frames.
#[derive(Debug, Clone, Default)]
pub(crate) struct MasterInfo {
    pub metadata: Metadata,
    /// `x/y_pixels_in_detector` as `(rows, cols)`.
    pub detector_pixels: Option<Shape2>,
    pub pixel_mask: Option<Vec<u32>>,
    pub pixel_mask_shape: Option<Shape2>,
    /// A `scan_shape` attribute (`/entry/data`, root) or `/entry/instrument/stem/scan_shape`.
    pub scan_shape_recorded: Option<Shape2>,
}

fn value(file: &hdf5::File, path: &str) -> Option<Value> {
    if !h5::path_exists(file, path) {
        return None;
    }
    h5::dataset_value(file, path)
}

/// Factor converting a length in `units` to metres (`None` = unknown unit).
fn length_factor_m(units: Option<&str>) -> Option<f64> {
    Some(match units.unwrap_or("m") {
        "m" | "meter" | "meters" | "metre" | "metres" => 1.0,
        "mm" | "millimeter" | "millimetre" => 1e-3,
        "um" | "µm" | "μm" | "micron" | "microns" | "micrometer" | "micrometre" => 1e-6,
        "nm" | "nanometer" | "nanometre" => 1e-9,
        "a" | "å" | "angstrom" | "angstroms" | "ang" => 1e-10,
        _ => return None,
    })
}

fn time_factor_s(units: Option<&str>) -> Option<f64> {
    Some(match units.unwrap_or("s") {
        "s" | "sec" | "second" | "seconds" => 1.0,
        "ms" => 1e-3,
        "us" | "µs" | "μs" => 1e-6,
        "ns" => 1e-9,
        _ => return None,
    })
}

fn energy_factor_ev(units: Option<&str>) -> Option<f64> {
    Some(match units.unwrap_or("ev") {
        "ev" => 1.0,
        "kev" => 1e3,
        _ => return None,
    })
}

fn angle_factor_mrad(units: Option<&str>) -> Option<f64> {
    Some(match units.unwrap_or("mrad") {
        "mrad" => 1.0,
        "rad" => 1e3,
        "urad" | "µrad" | "μrad" => 1e-3,
        "deg" | "degree" | "degrees" => std::f64::consts::PI / 180.0 * 1e3,
        _ => return None,
    })
}

/// Read a scalar at `path`, converted with `factor(units)`.
fn scalar(file: &hdf5::File, path: &str, factor: fn(Option<&str>) -> Option<f64>) -> Option<f64> {
    let v = value(file, path)?.f64()?;
    let units = h5::units_of(file, path);
    Some(v * factor(units.as_deref())?)
}

/// Read a `(row, col)` pair (or a scalar used for both) at `path`, converted.
fn pair(
    file: &hdf5::File,
    path: &str,
    factor: fn(Option<&str>) -> Option<f64>,
) -> Option<(f64, f64)> {
    let (a, b) = value(file, path)?.f64_pair()?;
    let f = factor(h5::units_of(file, path).as_deref())?;
    Some((a * f, b * f))
}

/// Read every metadata field we know, the pixel mask and a recorded scan shape.
pub(crate) fn read_master(file: &hdf5::File, path: &Path) -> Result<MasterInfo> {
    let mut m = Metadata::default();
    let d = |name: &str| format!("{DET}/{name}");
    let s = |name: &str| format!("{DS}/{name}");

    let x_px = value(file, &s("x_pixels_in_detector")).and_then(|v| v.u64());
    let y_px = value(file, &s("y_pixels_in_detector")).and_then(|v| v.u64());
    let detector_pixels = match (y_px, x_px) {
        (Some(r), Some(c)) => Some(Shape2::new(r as usize, c as usize)),
        _ => None,
    };
    let px_x = scalar(file, &d("x_pixel_size"), length_factor_m);
    let px_y = scalar(file, &d("y_pixel_size"), length_factor_m);
    m.pixel_size_m = match (px_y, px_x) {
        (Some(r), Some(c)) => Some((r, c)),
        (Some(v), None) | (None, Some(v)) => Some((v, v)),
        _ => None,
    };
    m.count_time_s = scalar(file, &d("count_time"), time_factor_s);
    m.frame_time_s = scalar(file, &d("frame_time"), time_factor_s);
    m.saturation_value = value(file, &d("saturation_value")).and_then(|v| {
        v.u64()
            .or_else(|| v.f64().filter(|x| *x >= 0.0).map(|x| x as u64))
    });
    m.bit_depth_image = value(file, &d("bit_depth_image"))
        .and_then(|v| v.u64())
        .and_then(|v| u32::try_from(v).ok());
    m.detector_description = value(file, &d("description")).and_then(|v| v.string());
    m.detector_distance_m = scalar(file, &d("detector_distance"), length_factor_m);
    let bc_col = value(file, &d("beam_center_x")).and_then(|v| v.f64());
    let bc_row = value(file, &d("beam_center_y")).and_then(|v| v.f64());
    m.beam_center_px = match (bc_row, bc_col) {
        (Some(r), Some(c)) => Some((r, c)),
        _ => None,
    };
    m.trigger_mode = value(file, &s("trigger_mode")).and_then(|v| v.string());
    m.nimages = value(file, &s("nimages")).and_then(|v| v.u64());
    m.ntrigger = value(file, &s("ntrigger")).and_then(|v| v.u64());
    m.pixel_mask_applied = value(file, &d("pixel_mask_applied")).and_then(|v| match v {
        Value::Str(s) => match s.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" => Some(true),
            "false" | "0" | "no" => Some(false),
            _ => None,
        },
        other => other.f64().map(|x| x != 0.0),
    });
    let wl_path = format!("{BEAM}/incident_wavelength");
    m.wavelength_a = scalar(file, &wl_path, length_factor_m).map(|v| v / 1e-10);
    m.energy_ev = scalar(file, &format!("{STEM}/energy"), energy_factor_ev);
    m.semiangle_mrad = scalar(
        file,
        &format!("{STEM}/convergence_semiangle"),
        angle_factor_mrad,
    );
    m.scan_step_a = pair(file, &format!("{STEM}/scan_step"), length_factor_m)
        .map(|(a, b)| (a / 1e-10, b / 1e-10));
    m.angular_sampling_mrad = pair(
        file,
        &format!("{STEM}/detector_angular_sampling"),
        angle_factor_mrad,
    );

    // Other small datasets of the metadata groups, by path.
    for group in [DET, DS, BEAM, STEM] {
        collect_extra(file, group, &mut m.extra);
    }

    // The pixel mask, read through HDF5 (our 32008 decoder is registered).
    let mut pixel_mask = None;
    let mut pixel_mask_shape = None;
    for p in [s("pixel_mask"), d("pixel_mask")] {
        if !h5::path_exists(file, &p) {
            continue;
        }
        let ds = file
            .dataset(&p)
            .map_err(|e| h5err("read pixel_mask", path, &format!("cannot open {p}"), e))?;
        let shape = ds.shape();
        let data = ds.read_raw::<u32>().map_err(|e| {
            h5err(
                "read pixel_mask",
                path,
                &format!("cannot read {p} (compressed with an unsupported filter?)"),
                e,
            )
        })?;
        if let [r, c] = shape.as_slice() {
            pixel_mask_shape = Some(Shape2::new(*r, *c));
        }
        pixel_mask = Some(data);
        break;
    }

    // A recorded scan shape.
    let mut scan_shape_recorded = None;
    let data_group_attr = if h5::path_exists(file, "/entry/data") {
        file.group("/entry/data")
            .ok()
            .and_then(|g| h5::attr_value(&g, "scan_shape"))
    } else {
        None
    };
    let candidates = [
        ("/entry/data scan_shape attribute", data_group_attr),
        (
            "root scan_shape attribute",
            h5::attr_value(file, "scan_shape"),
        ),
        (
            "/entry/instrument/stem/scan_shape",
            value(file, &format!("{STEM}/scan_shape")),
        ),
    ];
    for (what, v) in candidates {
        if let Some(v) = v {
            let ints = v.ints().ok_or_else(|| {
                Error::source("open", format!("{what} is not integral"))
                    .with_file(path)
                    .with_expected("two positive integers")
                    .with_found(format!("{v:?}"))
            })?;
            scan_shape_recorded = Some(shape_from_ints(&ints, path, what)?);
            break;
        }
    }

    Ok(MasterInfo {
        metadata: m,
        detector_pixels,
        pixel_mask,
        pixel_mask_shape,
        scan_shape_recorded,
    })
}

/// Known fields are read into typed slots; everything else small goes into `extra`.
fn collect_extra(
    file: &hdf5::File,
    group: &str,
    extra: &mut std::collections::BTreeMap<String, serde_json::Value>,
) {
    if !h5::path_exists(file, group) {
        return;
    }
    let Ok(g) = file.group(group) else { return };
    let Ok(names) = g.member_names() else { return };
    for name in names {
        if name == "pixel_mask" || name == "flatfield" {
            continue;
        }
        let Ok(ds) = g.dataset(&name) else { continue };
        if ds.size() > 16 {
            continue;
        }
        if let Some(v) = h5::read_value(&ds, 16) {
            extra.insert(format!("{group}/{name}"), v.to_json());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_factors() {
        assert_eq!(length_factor_m(None), Some(1.0));
        assert_eq!(length_factor_m(Some("um")), Some(1e-6));
        assert_eq!(length_factor_m(Some("angstrom")), Some(1e-10));
        assert_eq!(length_factor_m(Some("furlong")), None);
        assert_eq!(time_factor_s(Some("ms")), Some(1e-3));
        assert_eq!(energy_factor_ev(Some("kev")), Some(1e3));
        assert_eq!(angle_factor_mrad(Some("rad")), Some(1e3));
    }
}
