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
