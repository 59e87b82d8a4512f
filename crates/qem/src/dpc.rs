//! `qem::dpc`: centre of mass, DPC and iDPC phase of a [`Dataset`] (docs/science.md §5–7).
//!
//! Both operations get their integers from one detector reduction (exact `u64` moments, and
//! for [`run`] the ADF image in the same pass). The arithmetic on the scan grid is the CPU
//! reference in `qem_cpu::dpc`; for a CUDA dataset [`run`] does the same operations on the card
//! (`qem_cuda::dpc`: CoM, curl moments, alignment, cuFFT integration, sign sums), so the fields
//! stay in GPU memory until one download of the result, and equal the host's bit for bit
//! except the transforms.
//!
//! Units. CoM is in detector pixels of the loaded (possibly binned) grid, or in mrad when the
//! metadata gives the detector angular sampling (`Metadata::angular_sampling_mrad`, per loaded
//! pixel: the dataset's metadata describes the loaded grid, `Metadata::for_loaded_grid`). The phase is in radians when the angular
//! sampling, the electron wavelength (`Metadata::wavelength_a`, else from
//! `Metadata::energy_ev`) and the scan step (`Metadata::scan_step_a`) are all known: a
//! deflection θ (rad) is then a phase gradient `2π θ / λ` per Å. Otherwise the phase is the
//! plain inverse gradient of the aligned CoM field per scan step, in "CoM unit × scan step"
//! (e.g. `px·step`), and [`DpcResult::phase_unit`] says which.

use crate::backend::Backend;
use crate::dataset::Dataset;
use crate::detector::{self, DetectorKind, DetectorParams, Product};
use crate::result::ResultProvenance;
use qem_core::{Error, Moments, Result, Shape2, StageTiming};
use qem_cpu::dpc as cpu;
use serde_json::json;
use std::f64::consts::PI;
use std::time::Instant;

pub use qem_cpu::dpc::{EdgeMode, SIGN_MIN_ADF_CORRELATION, SIGN_MIN_SKEWNESS};

#[path = "dpc_device.rs"]
mod device;
pub use device::center_of_mass_on_device;

/// Centre of mass per scan position: host arrays, or `DeviceVec`s from
/// [`center_of_mass_on_device`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CenterOfMass<V = Vec<f64>> {
    /// `μ_r` per scan position, row-major `[R_r, R_c]`, in [`CenterOfMass::unit`].
    pub com_row: V,
    /// `μ_c` per scan position.
    pub com_col: V,
    /// Scan grid.
    pub scan_shape: Shape2,
    /// Whether the scan mean of each component was subtracted (zero frames included in it).
    pub centered: bool,
    /// Frames with no counts (`S = 0`): their CoM is 0 before centring.
    pub zero_frames: u64,
    /// `"px"` (detector pixels of the loaded grid, origin pixel (0, 0)) or `"mrad"`.
    pub unit: String,
    /// How it was computed.
    pub provenance: ResultProvenance,
}

/// CoM `(μ_r, μ_c, zero_frames)` from exact moments, in detector pixels: `μ = m / S` in f64,
/// `S = 0` → 0 (counted), scan mean removed when `centered`. `scan_shape` is the scan grid the
/// moments cover (one value per position, as [`detector::moments`] returns them); the
/// arithmetic does not need it beyond that.
pub fn com_from_moments(
    m: &Moments,
    scan_shape: Shape2,
    centered: bool,
) -> (Vec<f64>, Vec<f64>, u64) {
    debug_assert_eq!(m.sum.len(), scan_shape.len());
    let c = cpu::com_from_moments(m, centered);
    (c.com_row, c.com_col, c.zero_frames)
}

/// What the metadata says about units.
#[derive(Debug, Clone, Copy, Default)]
struct Calibration {
    /// Angular sampling of a loaded detector pixel, mrad (source sampling × `det_bin`).
    det_mrad: Option<(f64, f64)>,
    /// Electron wavelength, Å.
    wavelength_a: Option<f64>,
    /// Scan step, Å.
    scan_step_a: Option<(f64, f64)>,
}

fn positive(x: f64) -> Option<f64> {
    (x.is_finite() && x > 0.0).then_some(x)
}

fn positive_pair((a, b): (f64, f64)) -> Option<(f64, f64)> {
    Some((positive(a)?, positive(b)?))
}

impl Calibration {
    fn of(ds: &Dataset) -> Calibration {
        let md = ds.metadata();
        Calibration {
            // Per loaded pixel (Metadata::for_loaded_grid applied det_bin).
            det_mrad: md.angular_sampling_mrad.and_then(positive_pair),
            wavelength_a: md.wavelength_a.and_then(positive).or_else(|| {
                md.energy_ev
                    .and_then(positive)
                    .map(|ev| cpu::electron_wavelength_a(ev * 1e-3))
            }),
            scan_step_a: md.scan_step_a.and_then(positive_pair),
        }
    }

    /// CoM unit name.
    fn unit(&self) -> &'static str {
        if self.det_mrad.is_some() {
            "mrad"
        } else {
            "px"
        }
    }

    /// Factors turning the aligned field (in [`Calibration::unit`]) into a phase gradient per
    /// scan step, and the phase unit they give: `2π · 10⁻³ · step / λ` (rad) when fully
    /// calibrated, else 1.
    fn phase_scale(&self) -> ((f64, f64), String) {
        match (self.det_mrad, self.wavelength_a, self.scan_step_a) {
            (Some(_), Some(lam), Some((sr, sc))) => (
                (2.0 * PI * 1e-3 * sr / lam, 2.0 * PI * 1e-3 * sc / lam),
                "rad".to_string(),
            ),
            _ => ((1.0, 1.0), format!("{}·scan step", self.unit())),
        }
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "detector_angular_sampling_mrad": self.det_mrad.map(|(r, c)| [r, c]),
            "wavelength_a": self.wavelength_a,
            "scan_step_a": self.scan_step_a.map(|(r, c)| [r, c]),
        })
    }
}

/// Centre of mass of every frame (docs/science.md §5): exact `u64` moments over the whole
/// detector in one pass, `μ = m / S`, zero frames counted, centred by default; pixels, or mrad
/// when the metadata gives the detector angular sampling.
pub fn center_of_mass(ds: &Dataset, centered: bool) -> Result<CenterOfMass> {
    device::center_of_mass_in::<crate::detector::target::Host>(ds, centered)
}

/// Options of [`run`]. `Default`: rotation and transpose found from the data, periodic edges.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DpcParams {
    /// Rotation θ of the CoM field into the scan frame, degrees (`g = R(θ)·μ`). `None` = the
    /// angle of least curl, with its 180° ambiguity resolved by the sign criterion. An explicit
    /// angle is used as given (no sign flip; the result still reports what the criterion says).
    pub rotation_deg: Option<f64>,
    /// Exchange `(μ_r, μ_c)` before the rotation (a mirrored detector). `None` = found with the
    /// rotation, or `false` when `rotation_deg` is given.
    pub transpose: Option<bool>,
    /// Edge handling of the integration.
    pub edge: EdgeMode,
}

impl DpcParams {
    /// Check the parameters.
    pub fn validate(&self) -> Result<()> {
        if let Some(deg) = self.rotation_deg {
            if !deg.is_finite() {
                return Err(Error::invalid("dpc run", "rotation_deg is not finite")
                    .with_expected("a finite angle in degrees")
                    .with_found(deg.to_string()));
            }
        }
        Ok(())
    }
}

/// The result of [`run`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DpcResult {
    /// Centred CoM `μ_r` per scan position, in [`DpcResult::unit`].
    pub com_row: Vec<f64>,
    /// Centred CoM `μ_c`.
    pub com_col: Vec<f64>,
    /// The aligned field in the scan frame (row component), in [`DpcResult::unit`]: the CoM
    /// exchanged if [`DpcResult::transpose`], rotated by [`DpcResult::rotation_deg`].
    pub dpc_row: Vec<f64>,
    /// The aligned field, column component.
    pub dpc_col: Vec<f64>,
    /// iDPC phase (zero mean), in [`DpcResult::phase_unit`].
    pub phase: Vec<f64>,
    /// Scan grid.
    pub scan_shape: Shape2,
    /// Rotation used, degrees; found ones lie in `[0, 360)`.
    pub rotation_deg: f64,
    /// Whether the CoM components were exchanged before the rotation.
    pub transpose: bool,
    /// |statistic| of the criterion that fixed the 180° ambiguity: |Pearson r| of phase and
    /// ADF image for `"adf_correlation"`, |skewness| of the phase for `"phase_skewness"`.
    pub sign_confidence: f64,
    /// `"adf_correlation"`, `"phase_skewness"`, `"explicit_rotation"` (the given angle was kept;
    /// the statistic is the ADF criterion's, else the skewness's) or `"none"` (the rotation
    /// could not be determined: scan smaller than 3 × 3, or a field without direction).
    pub sign_criterion: String,
    /// Whether the sign is trustworthy: the statistic reached its threshold
    /// ([`SIGN_MIN_ADF_CORRELATION`], [`SIGN_MIN_SKEWNESS`]) and, for an explicit rotation, it
    /// agrees with the given orientation. Always false when the rotation was not determined.
    pub confident: bool,
    /// Mean squared interior curl of the aligned field over its `⟨curl² + div²⟩` (0 for a
    /// pure gradient, at most ½ after a search).
    pub curl_score: f64,
    /// Frames with no counts.
    pub zero_frames: u64,
    /// Unit of the CoM and aligned fields: `"px"` or `"mrad"`.
    pub unit: String,
    /// Unit of the phase: `"rad"` when calibrated, else e.g. `"px·scan step"`.
    pub phase_unit: String,
    /// How it was computed (rotation candidates, sign statistics, ADF detector, calibration).
    pub provenance: ResultProvenance,
}

/// Centre of mass, alignment and iDPC phase in one call.
///
/// One reduction pass gives the exact moments and the default ADF image (`[r, 2r]` around the
/// fitted BF disk). The CoM is centred and converted to mrad when calibrated; the rotation
/// θ ∈ `[0, π)` and transpose minimise the mean squared interior curl (closed form, grid
/// checked); the aligned field is integrated ([`integrate`]); then the sign is chosen so that
/// the phase correlates positively with the ADF image (atom columns: high ADF and positive
/// phase), falling back to positive skewness of the phase when the correlation is below
/// [`SIGN_MIN_ADF_CORRELATION`] — choosing the negative sign adds 180° to θ.
pub fn run(ds: &Dataset, p: &DpcParams) -> Result<DpcResult> {
    p.validate()?;
    if ds.backend() == Backend::Cuda {
        // Every stage on the card, one download at the end (`dpc_device.rs`).
        return device::run_on_card(ds, p);
    }
    let t0 = Instant::now();
    let prods = detector::products(ds, &DPC_PRODUCTS, &DetectorParams::default())
        .map_err(|e| e.with_op(DPC_OP))?;
    let t_reduce = t0.elapsed().as_secs_f64();
    let moments = prods
        .moments
        .as_ref()
        .ok_or_else(|| Error::internal(DPC_OP, "the reduction returned no moments"))?;
    let adf = prods.images.first().map(|im| AdfImage {
        image: &im.image,
        info: adf_info(im),
    });
    let r = run_on_moments(ds, moments, adf, ds.scan_shape(), p)?;
    Ok(with_reduce_stages(
        r,
        t0,
        t_reduce,
        &prods.provenance.timings,
    ))
}

/// The operation name of [`run`]'s errors.
const DPC_OP: &str = "dpc run";

/// The products of [`run`]'s one pass: the default ADF image and the moments.
const DPC_PRODUCTS: [Product; 2] = [Product::Det(DetectorKind::Adf), Product::Moments];

/// The provenance's description of the ADF image the sign criterion used.
fn adf_info<I>(im: &detector::DetectorImage<I>) -> serde_json::Value {
    json!({
        "inner_px": im.inner_px,
        "outer_px": im.outer_px,
        "mask_pixels": im.mask_pixels,
        "disk_center_px": [im.disk.center_px.0, im.disk.center_px.1],
        "disk_radius_px": im.disk.radius_px,
    })
}

/// `r` with the reduction's stages first (its wall time `t_reduce`, then the pass's own
/// `"reduce: "` stages from `reduce_timings`) and its total measured from `t0`.
fn with_reduce_stages(
    mut r: DpcResult,
    t0: Instant,
    t_reduce: f64,
    reduce_timings: &[StageTiming],
) -> DpcResult {
    let total = r.provenance.timings.pop();
    let mut stages = vec![StageTiming::new("reduce (adf + moments)", t_reduce)];
    stages.extend(
        reduce_timings
            .iter()
            .filter(|st| st.stage.starts_with("reduce: "))
            .cloned(),
    );
    stages.append(&mut r.provenance.timings);
    r.provenance.timings = stages;
    if total.is_some() {
        r.provenance
            .stage("total (wall)", t0.elapsed().as_secs_f64());
    }
    r
}

/// The ADF image [`run_on_moments`] resolves the 180° ambiguity with, and its description for
/// the provenance (bounds, mask pixels, disk).
#[derive(Debug, Clone)]
pub struct AdfImage<'a> {
    /// `u64` per scan position, row-major.
    pub image: &'a [u64],
    /// What the image is (recorded in the provenance under `"adf"`).
    pub info: serde_json::Value,
}

/// [`run`] on moments and an ADF image already reduced (e.g. merged from scan blocks computed
/// elsewhere, `quantem.gpu.distributed`): CoM, rotation, integration and sign exactly as
/// [`run`] does them. `ds` gives the calibration (its metadata), the engine the integration
/// runs on and the provenance; `scan_shape` is the grid the moments cover (it may be larger
/// than `ds`'s own scan when `ds` holds one block of it).
pub fn run_on_moments(
    ds: &Dataset,
    moments: &Moments,
    adf_image: Option<AdfImage<'_>>,
    scan_shape: Shape2,
    p: &DpcParams,
) -> Result<DpcResult> {
    const OP: &str = DPC_OP;
    p.validate()?;
    let n = scan_shape.len();
    for (name, v) in [
        ("sum", &moments.sum),
        ("m_row", &moments.m_row),
        ("m_col", &moments.m_col),
    ]
    .iter()
    .map(|(a, b)| (*a, b.len()))
    .chain(adf_image.iter().map(|a| ("adf", a.image.len())))
    {
        if v != n {
            return Err(
                Error::invalid(OP, format!("{name} does not cover the scan"))
                    .with_expected(format!(
                        "{n} values ({} x {})",
                        scan_shape.rows, scan_shape.cols
                    ))
                    .with_found(format!("{v} values")),
            );
        }
    }
    let (adf, adf_json) = match adf_image {
        Some(im) => (Some(im.image), Some(im.info)),
        None => (None, None),
    };
    device::run_in::<crate::detector::target::Host>(ds, moments, adf, adf_json, scan_shape, p)
}

/// The least-squares inverse gradient of `(g_row, g_col)` on `shape`:
/// `φ̂ = −i (ν·ĝ) / (2π |ν|²)`, `φ̂(0) = 0`, ν in cycles per scan step, periodic or mirrored
/// edges. The phase has zero mean and the unit of `g` times one scan step.
pub fn integrate(g_row: &[f64], g_col: &[f64], shape: Shape2, edge: EdgeMode) -> Result<Vec<f64>> {
    cpu::integrate(g_row, g_col, shape, edge)
}

/// [`integrate`] on a chosen engine: the CPU (rustfft) or CUDA (cuFFT, the same solver to
/// rounding; the mirror extension is built on the host either way).
pub fn integrate_on(
    backend: Backend,
    g_row: &[f64],
    g_col: &[f64],
    shape: Shape2,
    edge: EdgeMode,
) -> Result<Vec<f64>> {
    match backend {
        Backend::Cpu => cpu::integrate(g_row, g_col, shape, edge),
        Backend::Cuda => {
            cpu::integrate_with(g_row, g_col, shape, edge, qem_cuda::fft::integrate_periodic)
        }
    }
}
