//! Acquisition metadata as read from a source (Dectris master, plain HDF5, `.qem`, array).

use crate::dtype::DType;
use crate::geometry::Shape2;

/// Where the scan shape came from (recorded, since Dectris files do not store it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScanShapeOrigin {
    /// Passed by the caller.
    Argument,
    /// A `scan_shape` attribute or dataset in the file.
    Attribute,
    /// `(ntrigger, nimages)` of a line-triggered series (`exts`/`ints` with `nimages > 1`).
    TriggerRules,
    /// The square root of a perfect-square frame count.
    PerfectSquare,
    /// The leading axes of a 4-D dataset or array.
    ArrayShape,
}

/// How bad pixels are treated.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MaskPolicy {
    /// Whether bad pixels were set to 0 in the loaded data.
    pub applied: bool,
    /// The rule that marks a pixel bad.
    pub rule: String,
    /// Number of pixels the mask marks bad.
    pub bad_pixels: usize,
}

impl MaskPolicy {
    /// The Dectris rule: a pixel is bad when any of the low 16 bits of `pixel_mask` is set; bad
    /// pixels read 0 before any narrowing or binning.
    pub const DECTRIS_RULE: &'static str =
        "pixel_mask & 0x0000FFFF != 0 -> 0 before narrowing and binning";
}

/// Metadata of an acquisition. Fields that the source does not carry are `None`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Metadata {
    /// Detector frame shape `(k_r, k_c)` of the source.
    pub detector_shape: Option<Shape2>,
    /// Source element type.
    pub dtype: Option<DType>,
    /// Number of frames present in the source.
    pub n_frames: Option<u64>,
    /// Scan shape, once resolved.
    pub scan_shape: Option<Shape2>,
    /// Where the scan shape came from.
    pub scan_shape_origin: Option<ScanShapeOrigin>,
    /// Detector pixel size `(row, col)` in metres.
    pub pixel_size_m: Option<(f64, f64)>,
    /// Exposure per frame in seconds.
    pub count_time_s: Option<f64>,
    /// Frame period in seconds.
    pub frame_time_s: Option<f64>,
    /// Counts above this are invalid.
    pub saturation_value: Option<u64>,
    /// Bits per stored pixel.
    pub bit_depth_image: Option<u32>,
    /// Beam energy in eV, when recorded.
    pub energy_ev: Option<f64>,
    /// Electron wavelength in Å, when recorded.
    pub wavelength_a: Option<f64>,
    /// Detector description string.
    pub detector_description: Option<String>,
    /// Detector distance (camera length) in metres.
    pub detector_distance_m: Option<f64>,
    /// Beam centre `(row, col)` in detector pixels.
    pub beam_center_px: Option<(f64, f64)>,
    /// Convergence semi-angle in mrad (non-standard `stem` group or user).
    pub semiangle_mrad: Option<f64>,
    /// Scan step `(row, col)` in Å (non-standard `stem` group or user).
    pub scan_step_a: Option<(f64, f64)>,
    /// Detector angular sampling `(row, col)` in mrad per pixel.
    pub angular_sampling_mrad: Option<(f64, f64)>,
    /// Trigger mode (`ints`, `inte`, `exts`, `exte`).
    pub trigger_mode: Option<String>,
    /// `detectorSpecific/nimages`.
    pub nimages: Option<u64>,
    /// `detectorSpecific/ntrigger`.
    pub ntrigger: Option<u64>,
    /// Whether the detector already replaced masked pixels in the frames.
    pub pixel_mask_applied: Option<bool>,
    /// Number of bad pixels in the mask (low-16-bit rule).
    pub bad_pixel_count: Option<usize>,
    /// Any other scalar values read from the source, by HDF5 path.
    pub extra: std::collections::BTreeMap<String, serde_json::Value>,
}

impl Metadata {
    /// The metadata of the data a load produced from a source described by `self`: the scan
    /// shape and frame count of the loaded scan region, and every detector quantity on the
    /// loaded detector grid — the detector region's origin moved to 0 and `det_bin × det_bin`
    /// source pixels per loaded pixel. A loaded pixel `j` covers source pixels
    /// `[o + j·b, o + (j+1)·b)`, whose centre is `o + j·b + (b − 1)/2`, so a source coordinate
    /// `x` (pixel centres at integers, DESIGN's convention) is `(x − o − (b − 1)/2) / b` on the
    /// loaded grid: the beam centre moves so; the angular sampling and pixel size scale by `b`.
    /// Values the source did not give stay `None`; `extra` keeps the source's raw values.
    pub fn for_loaded_grid(
        &self,
        scan: Shape2,
        detector: Shape2,
        detector_region: Option<crate::geometry::Region>,
        det_bin: usize,
    ) -> Metadata {
        let b = det_bin.max(1) as f64;
        let (o_r, o_c) =
            detector_region.map_or((0.0, 0.0), |r| (r.row_start as f64, r.col_start as f64));
        let to_grid = |x: f64, o: f64| (x - o - (b - 1.0) / 2.0) / b;
        Metadata {
            detector_shape: self.detector_shape.map(|_| detector),
            n_frames: self.n_frames.map(|_| scan.len() as u64),
            scan_shape: Some(scan),
            pixel_size_m: self.pixel_size_m.map(|(r, c)| (r * b, c * b)),
            beam_center_px: self
                .beam_center_px
                .map(|(r, c)| (to_grid(r, o_r), to_grid(c, o_c))),
            angular_sampling_mrad: self.angular_sampling_mrad.map(|(r, c)| (r * b, c * b)),
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Region;

    #[test]
    fn loaded_grid_moves_the_centre_and_scales_the_sampling() {
        let src = Metadata {
            detector_shape: Some(Shape2::new(192, 192)),
            n_frames: Some(512 * 512),
            scan_shape: Some(Shape2::new(512, 512)),
            pixel_size_m: Some((75e-6, 75e-6)),
            beam_center_px: Some((95.5, 96.0)),
            angular_sampling_mrad: Some((0.25, 0.25)),
            semiangle_mrad: Some(20.0),
            ..Metadata::default()
        };
        // det_bin 2 over the whole detector: loaded pixel j covers source pixels 2j and 2j + 1
        // (centre 2j + 0.5), so 95.5 (between loaded 47 and 48) -> 47.5, 96.0 -> 47.75.
        let m = src.for_loaded_grid(Shape2::new(16, 16), Shape2::new(96, 96), None, 2);
        assert_eq!(m.detector_shape, Some(Shape2::new(96, 96)));
        assert_eq!(m.scan_shape, Some(Shape2::new(16, 16)));
        assert_eq!(m.n_frames, Some(256));
        assert_eq!(m.beam_center_px, Some((47.5, 47.75)));
        assert_eq!(m.angular_sampling_mrad, Some((0.5, 0.5)));
        assert_eq!(m.pixel_size_m, Some((150e-6, 150e-6)));
        assert_eq!(m.semiangle_mrad, Some(20.0));
        // A detector region moves the origin; bin 1 keeps the sampling.
        let r = Region::new(10, 110, 20, 120);
        let m = src.for_loaded_grid(Shape2::new(512, 512), Shape2::new(100, 100), Some(r), 1);
        assert_eq!(m.beam_center_px, Some((85.5, 76.0)));
        assert_eq!(m.angular_sampling_mrad, Some((0.25, 0.25)));
        // Nothing invented where the source said nothing.
        let m = Metadata::default().for_loaded_grid(Shape2::new(2, 2), Shape2::new(8, 8), None, 2);
        assert_eq!(m.beam_center_px, None);
        assert_eq!(m.angular_sampling_mrad, None);
        assert_eq!(m.detector_shape, None);
    }
}
