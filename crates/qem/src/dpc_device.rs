//! The centre of mass and `dpc.run` written once for both targets (`qem::dpc::device`, a child
//! of [`crate::dpc`] so that it shares the private calibration rule): [`center_of_mass_in`] on
//! the host is [`super::center_of_mass`], on the card [`center_of_mass_on_device`], whose arrays
//! stay in GPU memory (`DeviceVec`s, CUDA datasets only) and hold the host form's values bit for
//! bit (the same moments, the same `f64` operations in the same order: `Target::com`).
//! [`run_in`] is everything of `dpc.run` after the reduction, over [`Stages`]: on the host for
//! CPU datasets and merged moments (`run_on_moments`), on the card for CUDA datasets
//! ([`run_on_card`]), where only scalars cross to the host until the one download at the end.

use super::{Calibration, CenterOfMass, DpcParams, DpcResult, EdgeMode};
use crate::dataset::Dataset;
use crate::detector::target::{Device, Host, Target};
use crate::detector::{moments_in, products_on_device, DetectorParams, DeviceVec};
use crate::result::ResultProvenance;
use qem_core::{Error, Result, Shape2};
use qem_cpu::dpc as cpu;
use qem_cuda::dpc as card;
use serde_json::json;
use std::time::Instant;

/// [`super::center_of_mass`] with `com_row` and `com_col` left on the device (`f64`
/// [`DeviceVec`]s, row-major `[R_r, R_c]`); the unit, zero frames and provenance are the host
/// result's, the provenance adding `"result_device": "cuda:N"`. A CPU dataset is an
/// `InvalidArgument` error naming its backend.
pub fn center_of_mass_on_device(ds: &Dataset, centered: bool) -> Result<CenterOfMass<DeviceVec>> {
    center_of_mass_in::<Device>(ds, centered)
}

/// The centre of mass with its arrays on target `T`: one moments pass, `T::com` with the
/// detector sampling (mrad) when the metadata gives it, the provenance.
pub(super) fn center_of_mass_in<T: Target>(
    ds: &Dataset,
    centered: bool,
) -> Result<CenterOfMass<T::Field>> {
    const OP: &str = "dpc center_of_mass";
    let t0 = Instant::now();
    let m = moments_in::<T>(ds).map_err(|e| e.with_op(OP))?;
    let t_reduce = t0.elapsed().as_secs_f64();
    let cal = Calibration::of(ds);
    let (com_row, com_col, zero_frames) =
        T::com(&m, centered, cal.det_mrad).map_err(|e| e.with_op(OP))?;
    let mut provenance = ResultProvenance::new(
        ds,
        "dpc.center_of_mass",
        json!({
            "centered": centered,
            "unit": cal.unit(),
            "origin": "detector pixel (0, 0)",
            "zero_frames": zero_frames,
            "det_bin": ds.provenance().det_bin,
            "calibration": cal.json(),
        }),
    );
    T::mark(&mut provenance, ds);
    provenance.stage("reduce (moments)", t_reduce);
    provenance.stage("total (wall)", t0.elapsed().as_secs_f64());
    Ok(CenterOfMass {
        com_row,
        com_col,
        scan_shape: ds.scan_shape(),
        centered,
        zero_frames,
        unit: cal.unit().to_string(),
        provenance,
    })
}

/// The stages of `dpc.run` after the reduction, for arrays on target `T`: on the host
/// (`qem_cpu::dpc`, the reference) or on the card (`qem_cuda::dpc`, the same operations in the
/// same order, so equal bit for bit except the transforms). The scalar decisions made from
/// their sums are the host's in both cases.
pub(super) trait Stages: Target {
    /// The ADF image the sign criterion reads (`u64` per scan position).
    type Adf: ?Sized;
    /// Where the stages run, for the provenance (`"stages_on"`).
    const WHERE: &'static str;
    /// The curl moments of `(a, b)` and of the transposed field (`shape` ≥ 3 × 3).
    fn curl_pair(a: &Self::Field, b: &Self::Field, shape: Shape2) -> Result<CurlPair>;
    /// `(dpc_row, dpc_col)` = `align(a, b, theta, transpose)` and the gradient
    /// `(dpc_row · scale.0, dpc_col · scale.1)`.
    fn align(
        a: &Self::Field,
        b: &Self::Field,
        theta: f64,
        transpose: bool,
        scale: (f64, f64),
    ) -> Result<[Self::Field; 4]>;
    /// The iDPC phase of the gradient (`ds` picks the host form's FFT engine).
    fn integrate(
        ds: &Dataset,
        g: (&Self::Field, &Self::Field),
        shape: Shape2,
        edge: EdgeMode,
    ) -> Result<Self::Field>;
    /// The sign rule's decision for `phase` (and the ADF image).
    fn sign(phase: &Self::Field, adf: Option<&Self::Adf>) -> Result<cpu::SignDecision>;
    /// Negate in place.
    fn negate(v: &mut Self::Field) -> Result<()>;
    /// Host memory for the five results of `n` values, made ready on a helper thread while the
    /// stages run (`None` where the stages make host arrays themselves).
    fn host_memory(n: usize) -> Option<std::thread::JoinHandle<[Vec<f64>; 5]>>;
    /// The five result arrays on the host (in `memory` when given).
    fn to_host(v: [Self::Field; 5], memory: Option<[Vec<f64>; 5]>) -> Result<[Vec<f64>; 5]>;
}

/// The curl moments of a field and of the transposed field.
type CurlPair = (cpu::CurlMoments, cpu::CurlMoments);

impl Stages for Host {
    type Adf = [u64];
    const WHERE: &'static str = "host (the integration on the dataset's engine)";
    fn curl_pair(a: &Vec<f64>, b: &Vec<f64>, shape: Shape2) -> Result<CurlPair> {
        cpu::CurlMoments::pair_of(a, b, shape)
    }
    fn align(
        a: &Vec<f64>,
        b: &Vec<f64>,
        theta: f64,
        transpose: bool,
        (kr, kc): (f64, f64),
    ) -> Result<[Vec<f64>; 4]> {
        let (dpc_row, dpc_col) = cpu::align(a, b, theta, transpose);
        let g_row: Vec<f64> = dpc_row.iter().map(|v| v * kr).collect();
        let g_col: Vec<f64> = dpc_col.iter().map(|v| v * kc).collect();
        Ok([dpc_row, dpc_col, g_row, g_col])
    }
    fn integrate(
        ds: &Dataset,
        (g_row, g_col): (&Vec<f64>, &Vec<f64>),
        shape: Shape2,
        edge: EdgeMode,
    ) -> Result<Vec<f64>> {
        super::integrate_on(ds.backend(), g_row, g_col, shape, edge)
    }
    fn sign(phase: &Vec<f64>, adf: Option<&[u64]>) -> Result<cpu::SignDecision> {
        let adf: Option<Vec<f64>> = adf.map(|a| a.iter().map(|&v| v as f64).collect());
        Ok(cpu::resolve_sign(phase, adf.as_deref()))
    }
    fn negate(v: &mut Vec<f64>) -> Result<()> {
        v.iter_mut().for_each(|x| *x = -*x);
        Ok(())
    }
    fn host_memory(_: usize) -> Option<std::thread::JoinHandle<[Vec<f64>; 5]>> {
        None
    }
    fn to_host(v: [Vec<f64>; 5], _: Option<[Vec<f64>; 5]>) -> Result<[Vec<f64>; 5]> {
        Ok(v)
    }
}

impl Stages for Device {
    type Adf = DeviceVec;
    const WHERE: &'static str = "cuda";
    fn curl_pair(a: &DeviceVec, b: &DeviceVec, shape: Shape2) -> Result<CurlPair> {
        let rows = card::curl_row_sums(a, b, shape.rows, shape.cols)?;
        Ok(cpu::CurlMoments::pair_from_rows(&rows, shape))
    }
    fn align(
        a: &DeviceVec,
        b: &DeviceVec,
        theta: f64,
        transpose: bool,
        scale: (f64, f64),
    ) -> Result<[DeviceVec; 4]> {
        let al = card::align(a, b, theta, transpose, scale)?;
        Ok([al.dpc_row, al.dpc_col, al.g_row, al.g_col])
    }
    fn integrate(
        _: &Dataset,
        (g_row, g_col): (&DeviceVec, &DeviceVec),
        shape: Shape2,
        edge: EdgeMode,
    ) -> Result<DeviceVec> {
        let mirror = edge == EdgeMode::Mirror;
        card::integrate(g_row, g_col, shape.rows, shape.cols, mirror)
    }
    /// The sums on the card; Pearson's r and the skewness from them by `qem_cpu::dpc`.
    fn sign(phase: &DeviceVec, adf: Option<&DeviceVec>) -> Result<cpu::SignDecision> {
        let n = phase.len();
        // Below 2 values neither statistic exists (and there is nothing to sum).
        let sums = if n >= 2 {
            card::sign_sums(phase, adf)?
        } else {
            [0.0; 4]
        };
        let (r, s) = cpu::sign_statistics_from(n, adf.is_some(), sums);
        Ok(cpu::decide_sign(r, s))
    }
    fn negate(v: &mut DeviceVec) -> Result<()> {
        card::negate(v)
    }
    /// The vectors written through (`resize` writes every value), so their pages are mapped
    /// before the download: a copy into fresh pages pays a page fault per 4 KiB, ~10× the copy.
    fn host_memory(n: usize) -> Option<std::thread::JoinHandle<[Vec<f64>; 5]>> {
        std::thread::Builder::new()
            .name("qem-dpc-host-memory".into())
            .spawn(move || {
                std::array::from_fn(|_| {
                    let mut v = Vec::with_capacity(n);
                    v.resize(n, 0.0);
                    v
                })
            })
            .ok()
    }
    fn to_host(v: [DeviceVec; 5], memory: Option<[Vec<f64>; 5]>) -> Result<[Vec<f64>; 5]> {
        let mut out = memory.unwrap_or_else(|| std::array::from_fn(|i| vec![0.0; v[i].len()]));
        let [a, b, c, d, e] = &v;
        card::download_f64_into(&[a, b, c, d, e], &mut out)?;
        Ok(out)
    }
}

/// `dpc.run` of a CUDA dataset with every stage on the card: one pass for the ADF image and
/// the moments left in GPU memory, then [`run_in`] on the device arrays (one download at the
/// end: CoM, aligned field, phase).
pub(super) fn run_on_card(ds: &Dataset, p: &DpcParams) -> Result<DpcResult> {
    let t0 = Instant::now();
    let prods = products_on_device(ds, &super::DPC_PRODUCTS, &DetectorParams::default())
        .map_err(|e| e.with_op(super::DPC_OP))?;
    let t_reduce = t0.elapsed().as_secs_f64();
    let moments = prods
        .moments
        .as_ref()
        .ok_or_else(|| Error::internal(super::DPC_OP, "the reduction returned no moments"))?;
    let (adf, adf_json) = match prods.images.first() {
        Some(im) => (Some(&im.image), Some(super::adf_info(im))),
        None => (None, None),
    };
    let r = run_in::<Device>(ds, moments, adf, adf_json, ds.scan_shape(), p)?;
    Ok(super::with_reduce_stages(
        r,
        t0,
        t_reduce,
        &prods.provenance.timings,
    ))
}

/// Everything of `dpc.run` after the reduction, on target `T`: the CoM, the rotation and
/// transpose (least curl, or as given), the aligned field, the integration, the sign and the
/// provenance. `moments` and `adf` cover `scan_shape` (checked by the callers).
pub(super) fn run_in<T: Stages>(
    ds: &Dataset,
    moments: &T::Moments,
    adf: Option<&T::Adf>,
    adf_json: Option<serde_json::Value>,
    shape: Shape2,
    p: &DpcParams,
) -> Result<DpcResult> {
    let t0 = Instant::now();
    let memory = T::host_memory(shape.len());
    let cal = Calibration::of(ds);
    // The centre of mass as `center_of_mass` computes it (centred, then in mrad when calibrated).
    let (com_row, com_col, zero_frames) = T::com(moments, true, cal.det_mrad)?;
    let t_com = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let pair = if shape.rows >= 3 && shape.cols >= 3 {
        Some(T::curl_pair(&com_row, &com_col, shape)?)
    } else {
        None
    };
    let rot = rotation(pair, shape, p);
    let [mut dpc_row, mut dpc_col, g_row, g_col] = T::align(
        &com_row,
        &com_col,
        rot.theta,
        rot.transpose,
        cal.phase_scale().0,
    )?;
    let t_rotation = t1.elapsed().as_secs_f64();

    let t2 = Instant::now();
    let phase_unit = cal.phase_scale().1;
    let mut phase = T::integrate(ds, (&g_row, &g_col), shape, p.edge)?;
    drop((g_row, g_col));
    let t_integrate = t2.elapsed().as_secs_f64();

    // The 180° ambiguity.
    let t3 = Instant::now();
    let decision = T::sign(&phase, adf)?;
    let (flip, criterion, confident) = if !rot.determined {
        (false, "none".to_string(), false)
    } else if p.rotation_deg.is_some() {
        (
            false,
            "explicit_rotation".to_string(),
            decision.confident && !decision.flip,
        )
    } else {
        (
            decision.flip,
            decision.criterion.name().to_string(),
            decision.confident,
        )
    };
    let mut rotation_deg = p.rotation_deg.unwrap_or(rot.theta.to_degrees());
    if flip {
        for v in [&mut phase, &mut dpc_row, &mut dpc_col] {
            T::negate(v)?;
        }
        rotation_deg = (rotation_deg + 180.0).rem_euclid(360.0);
    }
    let t_sign = t3.elapsed().as_secs_f64();
    let t4 = Instant::now();
    // A helper thread that failed leaves the download to fresh vectors.
    let memory = memory.and_then(|h| h.join().ok());
    let [com_row, com_col, dpc_row, dpc_col, phase] =
        T::to_host([com_row, com_col, dpc_row, dpc_col, phase], memory)?;
    let t_download = t4.elapsed().as_secs_f64();

    let mut provenance = ResultProvenance::new(
        ds,
        "dpc.run",
        json!({
            "rotation_deg": rotation_deg,
            "transpose": rot.transpose,
            "rotation_deg_requested": p.rotation_deg,
            "transpose_requested": p.transpose,
            "rotation": rot.json,
            "rotation_convention": "g_r = cosθ·a − sinθ·b, g_c = sinθ·a + cosθ·b, (a, b) = (μ_r, μ_c), or (μ_c, μ_r) when transposed",
            "curl_score": rot.curl_score,
            "edge": p.edge.name(),
            "integration": "phi_hat = -i (nu . g_hat) / (2 pi |nu|^2), DC = 0, nu in cycles per scan step",
            "sign": {
                "criterion": criterion,
                "flipped": flip,
                "confident": confident,
                "adf_correlation_before_flip": decision.adf_correlation,
                "skewness_before_flip": decision.skewness,
                "min_adf_correlation": super::SIGN_MIN_ADF_CORRELATION,
                "min_skewness": super::SIGN_MIN_SKEWNESS,
            },
            "adf": adf_json,
            "unit": cal.unit(),
            "phase_unit": phase_unit,
            "calibration": cal.json(),
            "det_bin": ds.provenance().det_bin,
            "zero_frames": zero_frames,
            "stages_on": T::WHERE,
        }),
    );
    provenance.stage("centre of mass from the moments", t_com);
    provenance.stage("rotation", t_rotation);
    provenance.stage("integrate", t_integrate);
    provenance.stage("sign criterion", t_sign);
    provenance.stage("download", t_download);
    provenance.stage("total (wall)", t0.elapsed().as_secs_f64());
    Ok(DpcResult {
        com_row,
        com_col,
        dpc_row,
        dpc_col,
        phase,
        scan_shape: shape,
        rotation_deg,
        transpose: rot.transpose,
        sign_confidence: decision.confidence,
        sign_criterion: criterion,
        confident,
        curl_score: rot.curl_score,
        zero_frames,
        unit: cal.unit().to_string(),
        phase_unit,
        provenance,
    })
}

/// The rotation `dpc.run` applies and how it was reached.
struct Rotation {
    theta: f64,
    transpose: bool,
    determined: bool,
    curl_score: f64,
    json: serde_json::Value,
}

/// The rotation: as given (`p.rotation_deg`, its curl score reported), or the least-curl fit
/// from the curl moments (`None` for a scan smaller than 3 × 3).
fn rotation(pair: Option<CurlPair>, shape: Shape2, p: &DpcParams) -> Rotation {
    match p.rotation_deg {
        Some(deg) => {
            let transpose = p.transpose.unwrap_or(false);
            let theta = deg.to_radians();
            // `pair_of(a, b).1` is `of(b, a)`: the transposed field's moments.
            let curl_score = pair.map_or(0.0, |(normal, transposed)| {
                let m = if transpose { transposed } else { normal };
                if m.total() > 0.0 {
                    m.score(theta) / m.total()
                } else {
                    0.0
                }
            });
            Rotation {
                theta,
                transpose,
                determined: true,
                curl_score,
                json: json!({ "method": "explicit rotation_deg", "transpose_given": p.transpose }),
            }
        }
        None => {
            let fit = cpu::fit_rotation_from(pair, shape, p.transpose);
            let candidates: Vec<serde_json::Value> = fit
                .candidates
                .iter()
                .map(|c| {
                    json!({
                        "transpose": c.transpose,
                        "rotation_deg_mod_180": c.rotation_rad.to_degrees(),
                        "mean_sq_curl": c.score,
                        "curl2": c.moments.curl2,
                        "div2": c.moments.div2,
                        "curl_div": c.moments.curl_div,
                        "method": c.method,
                    })
                })
                .collect();
            Rotation {
                theta: fit.rotation_rad,
                transpose: fit.transpose,
                determined: fit.determined,
                curl_score: fit.curl_score,
                json: json!({
                    "method": fit.method,
                    "determined": fit.determined,
                    "grid_step_deg": cpu::ROTATION_GRID_STEP_DEG,
                    "candidates": candidates,
                }),
            }
        }
    }
}
