//! `qem::ssb`: single-sideband ptychography of a [`Dataset`] (docs/science.md §9).
//!
//! [`Ssb::new`] fits the BF disk from the mean DP (`detector::fit_disk`), selects the BF pixels
//! (anchor §8.2), gathers their images from the data and FFTs them (`G_b(ν)`, kept for every BF
//! pixel); [`Ssb::reconstruct`], [`Ssb::objective`] and [`Ssb::fit`] then work on that. The
//! math is the CPU reference `qem_cpu::ssb`, whatever engine holds the data.
//!
//! Engines: data held by the CPU engine is prepared by `qem_cpu::ssb` (dense read in place,
//! ENCODED decoded once frame by frame; G kept as complex f64, full plane). Data on the GPU
//! stays there: `qem_cuda::ssb::GpuSsb` gathers the BF pixels on the card (ENCODED decoded in
//! chunks, one pass per batch of BF pixels), keeps G as half spectra (complex f32, or f16 when
//! f32 does not fit the memory budget) and evaluates objects and losses there; only the object
//! or a few partial sums come back. `SsbParams::engine = Cuda` also takes data held by the CPU
//! engine: the BF pixels are gathered on the host and uploaded batch by batch, so the card holds
//! G and one batch but never the acquisition (SSB for a card too small for data and G
//! together). The fit's search is the same code on both (`qem_cpu::ssb::fit_with`).
//!
//! Units: aberrations in Å, angles in rad; `scan_step_a` in Å; `semiangle_mrad` and
//! `det_sampling_mrad` in mrad. The detector sampling follows the one calibration rule
//! ([`crate::calibration::detector_sampling`]): the argument, else the file's metadata, else
//! the physical `α / r_edge` with the sub-pixel BF disk edge (the disk edge is the aperture
//! edge); `compat_2alpha` gives the anchor's `2α / r_BF` with the anchor's threshold radius.

use crate::backend::BackendRequest;
use crate::dataset::Dataset;
use crate::detector;
use crate::result::ResultProvenance;
use qem_core::{Error, Result, Shape2};
use qem_cpu::ssb as cpu;
use rayon::prelude::*;
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Instant;

pub use qem_cpu::ssb::{
    chi, default_range, gamma, Aberrations, Fidelity, Objective, Optics, ABERRATION_NAMES,
    MIN_COARSE_PIXELS,
};
pub use qem_cuda::ssb::{GStorage, PrepareStats};

use crate::dataset::Storage;

/// Where the prepared data lives.
#[derive(Debug)]
enum Prep {
    /// `qem_cpu::ssb` (G as complex f64 on the host).
    Cpu(Box<cpu::Prepared>),
    /// On the card.
    Cuda(Box<qem_cuda::ssb::GpuSsb>),
}

/// Calibration and options of [`Ssb::new`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SsbParams {
    /// Accelerating voltage, kV.
    pub voltage_kv: f64,
    /// Probe-forming aperture semi-angle α, mrad.
    pub semiangle_mrad: f64,
    /// Scan step `(row, col)`, Å.
    pub scan_step_a: (f64, f64),
    /// Detector angular sampling, mrad per (loaded) detector pixel; `None` = `α / r_BF`.
    pub det_sampling_mrad: Option<f64>,
    /// Rotation of the detector frame into the scan frame, degrees (the `dpc.run` value).
    pub rotation_deg: f64,
    /// Exchange the detector's row and column axes before the rotation (the `dpc.run` value:
    /// a detector read out transposed relative to the scan).
    pub transpose: bool,
    /// With `det_sampling_mrad = None`: use the anchor's `2α / r_BF` instead (compat only).
    pub compat_2alpha: bool,
    /// BF candidates need `mean DP > bf_threshold·max(mean DP)` (0 = any positive pixel).
    pub bf_threshold: f64,
    /// Bytes the prepared data may take (`None` = the host's available memory on the CPU, the
    /// free device memory on CUDA). On CUDA it bounds what SSB allocates on the card besides
    /// the dataset itself.
    pub memory_budget: Option<u64>,
    /// CUDA only: force how G is stored (`None` = complex f32 when it fits, else f16).
    pub g_storage: Option<GStorage>,
    /// Which engine prepares and evaluates: `Auto` = the one that holds the data; `Cuda` also
    /// takes data held by the CPU engine (the BF pixels are gathered on the host and uploaded
    /// batch by batch, so the card holds G but never the acquisition); `Cpu` needs data on
    /// the host.
    pub engine: BackendRequest,
    /// Fewest BF pixels the fit's coarse sample may hold (`qem_cpu::ssb::coarse_first`);
    /// with fewer the fit has no coarse stage.
    pub coarse_min_pixels: usize,
}

impl Default for SsbParams {
    /// 300 kV, 20 mrad, 1 Å steps, physical detector sampling, no rotation.
    fn default() -> Self {
        SsbParams {
            voltage_kv: 300.0,
            semiangle_mrad: 20.0,
            scan_step_a: (1.0, 1.0),
            det_sampling_mrad: None,
            rotation_deg: 0.0,
            transpose: false,
            compat_2alpha: false,
            bf_threshold: 0.0,
            memory_budget: None,
            g_storage: None,
            engine: BackendRequest::Auto,
            coarse_min_pixels: cpu::MIN_COARSE_PIXELS,
        }
    }
}

fn must_be_positive(name: &str, v: f64) -> Result<()> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(
            Error::invalid("ssb params", format!("{name} must be positive"))
                .with_expected(format!("{name} > 0, finite"))
                .with_found(v.to_string()),
        )
    }
}

impl SsbParams {
    /// Check the parameters.
    pub fn validate(&self) -> Result<()> {
        must_be_positive("voltage_kv", self.voltage_kv)?;
        must_be_positive("semiangle_mrad", self.semiangle_mrad)?;
        must_be_positive("scan_step_a (row)", self.scan_step_a.0)?;
        must_be_positive("scan_step_a (col)", self.scan_step_a.1)?;
        if let Some(d) = self.det_sampling_mrad {
            must_be_positive("det_sampling_mrad", d)?;
        }
        if !self.rotation_deg.is_finite() {
            return Err(Error::invalid("ssb params", "rotation_deg is not finite")
                .with_expected("a finite angle in degrees")
                .with_found(self.rotation_deg.to_string()));
        }
        if !(0.0..1.0).contains(&self.bf_threshold) {
            return Err(
                Error::invalid("ssb params", "bf_threshold is a fraction of max(mean DP)")
                    .with_expected("0 <= bf_threshold < 1")
                    .with_found(self.bf_threshold.to_string()),
            );
        }
        Ok(())
    }
}

/// Prepared SSB: BF pixels, their k vectors and `G_b(ν)`.
#[derive(Debug)]
pub struct Ssb {
    prep: Prep,
    k: Vec<(f64, f64)>,
    scan: Shape2,
    params: SsbParams,
    /// BF pixels `(row, col)` on the detector: the fit's coarse sample first, then the other
    /// rows, each part in row-major order (`qem_cpu::ssb::coarse_first`).
    pub bf_pixels: Vec<(usize, usize)>,
    /// Size of the coarse sample at the front of `bf_pixels` (0: none, the fit has no coarse
    /// stage).
    coarse_used: usize,
    /// Fitted BF disk.
    pub disk: detector::DiskFit,
    /// Detector angular sampling used, mrad/px.
    pub det_sampling_mrad: f64,
    /// Where that sampling came from and its uncertainty (`None` with `compat_2alpha`).
    pub sampling: Option<crate::calibration::DetectorSampling>,
    /// Sampling and dose conditions of the data, with warnings ([`Diagnostics`]).
    pub diagnostics: Diagnostics,
    /// Electron wavelength, Å.
    pub wavelength_a: f64,
    provenance: ResultProvenance,
}

/// The conditions that decide whether an SSB reconstruction and its fit can be trusted.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Diagnostics {
    /// Scan step `(row, col)`, Å.
    pub scan_step_a: (f64, f64),
    /// The largest step that samples the SSB band `|ν| ≤ 2α/λ` (Nyquist): `λ / (4α)`, Å.
    pub nyquist_step_a: f64,
    /// `max(scan step) / nyquist_step_a` (> 1: the double-overlap band is aliased).
    pub step_over_nyquist: f64,
    /// BF pixels used.
    pub n_bf_pixels: usize,
    /// Mean counts per frame (sum DP over the number of frames).
    pub dose_per_frame: f64,
    /// Mean counts per BF pixel per frame.
    pub counts_per_bf_pixel: f64,
    /// What makes the result unreliable, in words (empty when nothing does).
    pub warnings: Vec<String>,
}

impl Diagnostics {
    /// As provenance JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

/// Thresholds of [`Diagnostics::warnings`]: fewer BF pixels than this and the probe is sampled
/// too coarsely for aberrations beyond defocus (a 5-px-radius disk).
const MIN_BF_PIXELS: usize = 80;
/// Fewer counts per BF pixel per frame than this and per-pixel images are shot-noise limited.
const MIN_COUNTS_PER_BF_PIXEL: f64 = 1.0;

fn diagnostics(ds: &Dataset, p: &SsbParams, lambda: f64, dtheta: f64, n_bf: usize) -> Diagnostics {
    let nyq = lambda / (4.0 * p.semiangle_mrad * 1e-3);
    let step = p.scan_step_a.0.max(p.scan_step_a.1);
    let frames = ds.scan_shape().len().max(1) as f64;
    let total: f64 = detector::sum_dp(ds)
        .map(|s| s.iter().map(|&v| v as f64).sum())
        .unwrap_or(f64::NAN);
    let dose = total / frames;
    let per_px = dose / n_bf.max(1) as f64;
    let mut warnings = Vec::new();
    if step > nyq {
        warnings.push(format!(
            "scan step {step:.4} Å exceeds the Nyquist step λ/(4α) = {nyq:.4} Å of the SSB band:              the double-overlap regions alias (the object and a fitted C10 lose accuracy)"
        ));
    }
    if n_bf < MIN_BF_PIXELS {
        warnings.push(format!(
            "only {n_bf} BF pixels (< {MIN_BF_PIXELS}): the probe's aberration phase is sampled              coarsely; fitted aberrations beyond C10 are unreliable"
        ));
    }
    if per_px < MIN_COUNTS_PER_BF_PIXEL {
        warnings.push(format!(
            "{per_px:.3} counts per BF pixel per frame (< {MIN_COUNTS_PER_BF_PIXEL}): shot-noise              limited; use the coherence objective and expect larger aberration errors"
        ));
    }
    let _ = dtheta;
    Diagnostics {
        scan_step_a: p.scan_step_a,
        nyquist_step_a: nyq,
        step_over_nyquist: step / nyq,
        n_bf_pixels: n_bf,
        dose_per_frame: dose,
        counts_per_bf_pixel: per_px,
        warnings,
    }
}

/// An SSB reconstruction.
#[derive(Debug, Clone, PartialEq)]
pub struct SsbResult {
    /// Re O(R), row-major over the scan (count-scaled, as the anchor).
    pub object_re: Vec<f64>,
    /// Im O(R).
    pub object_im: Vec<f64>,
    /// arg O(R), rad.
    pub phase: Vec<f64>,
    /// |O(R)|.
    pub amplitude: Vec<f64>,
    /// The first-order (weak-phase) phase `Im O(R) / mean_R Re O`, rad. With the double-overlap
    /// correction the object is `d + iψ(R)`: `Γ(k, −ν) = −Γ(k, ν)*` makes every corrected
    /// spectrum anti-Hermitian off the DC, so `Re O` is the constant `d` (up to the Nyquist
    /// lines of an even scan side, whose mirror is not −ν; they matter only when Nyquist lies
    /// inside 2α) and `phase = atan(ψ/d)`, which compresses strong features; `ψ/d` is the
    /// linear estimate SSB's weak-phase model defines (on the abTEM SrTiO3 data it correlates
    /// 0.003–0.03 better with the simulated phase than `phase`;
    /// bench/results/ssb_py4dstem_compare_*.json).
    pub weak_phase: Vec<f64>,
    /// Scan grid.
    pub scan_shape: Shape2,
    /// Aberrations used.
    pub aberrations: Aberrations,
    /// How it was computed.
    pub provenance: ResultProvenance,
}

/// Fit options of [`Ssb::fit`]. `Default`: seed 0, C10/C12/φ12 over their
/// [`default_range`]s, the coherence loss ([`Objective`]'s default), 200 global points, then
/// Nelder–Mead (at most 200 iterations each) from the 3 best distinct candidates — each to a
/// simplex of 1 % of the box, the best of them on to 1e-4 — start at 0.
#[derive(Debug, Clone, PartialEq)]
pub struct FitParams {
    /// Seed of the global search.
    pub seed: u64,
    /// Names of the fitted parameters (of [`ABERRATION_NAMES`]).
    pub fit: Vec<String>,
    /// Search ranges `(lo, hi)` overriding [`default_range`], by name.
    pub ranges: BTreeMap<String, (f64, f64)>,
    /// Loss.
    pub objective: Objective,
    /// Global search points besides the start point.
    pub global_evals: usize,
    /// Iterations of each local stage, at most: Nelder–Mead iterations per start, and designs
    /// of the coherence fit's quadratic-model last stage (which never takes more than 12).
    pub local_max_iter: usize,
    /// Nelder–Mead starts.
    pub local_starts: usize,
    /// Start point and the values of the parameters not fitted.
    pub start: Aberrations,
    /// Global points and each start's first Nelder–Mead stage on the coarse loss (about a
    /// quarter of the BF pixels, [`qem_cpu::ssb::coarse_first`]), the last stage on the full
    /// loss. Ignored (no coarse stage) when the disk is too small for a coarse sample.
    pub coarse: bool,
}

impl FitParams {
    /// About how many objective evaluations the fit makes: the start point and the global
    /// points, then for each Nelder–Mead start its simplex and about one evaluation per
    /// iteration, and the last stage: for the coherence about five designs of 2d + d(d−1)/2
    /// points and a Newton point each, else the best start continued (the progress total of
    /// [`Ssb::fit_with_progress`]).
    pub fn evaluation_estimate(&self) -> usize {
        let d = self.fit.len();
        let simplex = d + 1;
        let starts = self.local_starts.max(1);
        let last = if self.objective == Objective::Coherence {
            self.local_max_iter.min(5) * (2 * d + d * d.saturating_sub(1) / 2 + 1)
        } else {
            self.local_max_iter
        };
        1 + self.global_evals + starts * (simplex + self.local_max_iter) + last
    }
}

/// The fit's method in words, for its provenance (docs/science.md §9).
fn search_description(coarse: bool, objective: Objective) -> String {
    let first = if coarse {
        "scrambled Halton (seeded shift) + Nelder-Mead from best distinct starts, each to a 1 % simplex, on the coarse loss (the coarse sample of BF pixels); the starts compared on the full loss, the best on"
    } else {
        "scrambled Halton (seeded shift) + Nelder-Mead from best distinct starts, each to a 1 % simplex, the best on"
    };
    let last = match (objective, coarse) {
        (Objective::Coherence, _) => {
            "with Newton steps on quadratic models of the full loss (designs from 2 % of the box, shrinking 4x, to 5e-4)"
        }
        (_, true) => "to 1e-4 on the full loss from a fresh 2 % simplex",
        (_, false) => "to 1e-4, its simplex continued",
    };
    format!("{first} {last}")
}

impl Default for FitParams {
    fn default() -> Self {
        FitParams {
            seed: 0,
            fit: vec!["C10".into(), "C12".into(), "phi12".into()],
            ranges: BTreeMap::new(),
            objective: Objective::default(),
            global_evals: 200,
            local_max_iter: 200,
            local_starts: 3,
            coarse: true,
            start: Aberrations::default(),
        }
    }
}

/// What [`Ssb::fit`] found.
#[derive(Debug, Clone, PartialEq)]
pub struct SsbFit {
    /// Fitted aberrations (Å, rad; [`Aberrations::unit`]).
    pub aberrations: Aberrations,
    /// Loss at them.
    pub loss: f64,
    /// Objective evaluations.
    pub evaluations: usize,
    /// Loss of every evaluation, in order (global points first, then Nelder–Mead).
    pub loss_curve: Vec<f64>,
    /// Reconstruction at the fitted aberrations.
    pub result: SsbResult,
    /// How the fit was done.
    pub provenance: ResultProvenance,
}

/// The BF pixels' images `[B][N]` of a dataset the CPU engine holds (dense read in place,
/// ENCODED decoded once); data on the GPU is gathered there by `qem_cuda::ssb`.
fn gather(ds: &Dataset, pixels: &[usize]) -> Result<Vec<u32>> {
    let frame_len = ds.detector_shape().len();
    if let Some(enc) = ds.encoded() {
        return cpu::gather_encoded(enc, pixels);
    }
    cpu::gather_dense(ds.dense()?, frame_len, pixels)
}

/// The host route's images (`qem_cuda::ssb::HostImages`): dense data the CPU engine holds is
/// gathered a chunk of BF pixels at a time straight into the upload buffers; ENCODED data the
/// CPU engine holds is decoded once (every frame) and served from the gathered images.
enum HostImages<'a> {
    Dense {
        data: &'a qem_core::DenseArray,
        frame_len: usize,
        pixels: &'a [usize],
    },
    Gathered {
        images: Vec<u32>,
        n: usize,
    },
}

impl qem_cuda::ssb::HostImages for HostImages<'_> {
    fn fill(&self, p0: usize, np: usize, out: &mut [u32]) -> Result<()> {
        match self {
            HostImages::Dense {
                data,
                frame_len,
                pixels,
            } => {
                let part = pixels.get(p0..p0 + np).ok_or_else(|| {
                    Error::internal("ssb gather_pixels", "BF pixel range outside the list")
                })?;
                cpu::gather_dense_into(data, *frame_len, part, out)
            }
            HostImages::Gathered { images, n } => {
                let part = images.get(p0 * n..(p0 + np) * n).ok_or_else(|| {
                    Error::internal("ssb gather_pixels", "BF pixel range outside the images")
                })?;
                if part.len() != out.len() {
                    return Err(Error::internal("ssb gather_pixels", "upload buffer size"));
                }
                out.copy_from_slice(part);
                Ok(())
            }
        }
    }
}

/// `Im O / mean(Re O)` (see [`SsbResult::weak_phase`]); zeros when the mean is not positive
/// (no counts in the BF disk: no signal, no phase).
fn weak_phase(re: &[f64], im: &[f64]) -> Vec<f64> {
    let d = re.iter().sum::<f64>() / re.len().max(1) as f64;
    if d > 0.0 && d.is_finite() {
        im.iter().map(|v| v / d).collect()
    } else {
        vec![0.0; im.len()]
    }
}

impl Ssb {
    /// Prepare SSB on `ds` (see the module docs).
    pub fn new(ds: &Dataset, p: &SsbParams) -> Result<Ssb> {
        const OP: &str = "ssb prepare";
        p.validate()?;
        let t0 = Instant::now();
        let mean = detector::mean_dp(ds).map_err(|e| e.with_op(OP))?;
        let det = ds.detector_shape();
        let disk = detector::fit_disk_from_mean(&mean, det);
        let flat = cpu::select_bf(&mean, det, disk.center_px, disk.radius_px, p.bf_threshold);
        // The fit's coarse sample first (both engines sum their pixels in this order).
        let (flat, coarse_used) =
            cpu::coarse_first(&flat, det.cols, disk.center_px.0, p.coarse_min_pixels);
        if flat.is_empty() {
            return Err(Error::invalid(OP, "no bright-field pixel selected")
                .with_expected("a BF disk in the mean diffraction pattern")
                .with_found(format!("radius {:.2} px", disk.radius_px)));
        }
        let scan = ds.scan_shape();
        let data_on_gpu = matches!(ds.storage, Storage::CudaDense(_) | Storage::CudaEncoded(_));
        let on_gpu = match p.engine {
            BackendRequest::Auto => data_on_gpu,
            BackendRequest::Cuda => {
                if let Some(why) = crate::backend::cuda_unavailable_reason() {
                    return Err(Error::backend_unavailable("cuda", why).with_op(OP));
                }
                true
            }
            BackendRequest::Cpu if data_on_gpu => {
                return Err(
                    Error::invalid(OP, "engine 'cpu' needs the data on the host")
                        .with_expected("a dataset loaded with backend 'cpu'")
                        .with_found("a dataset on the CUDA engine"),
                );
            }
            BackendRequest::Cpu => false,
            BackendRequest::Mps => {
                return Err(Error::backend_unavailable(
                    "mps",
                    "Apple Metal is not supported by this build",
                )
                .with_op(OP));
            }
        };
        let image_bytes = (flat.len() * scan.len() * 4) as u64;
        let cpu_bytes = cpu::Prepared::bytes_for(flat.len(), scan) + image_bytes;
        if on_gpu && ds.encoded().is_some() && !data_on_gpu {
            // ENCODED host data: the BF images are gathered on the host first (dense host data
            // is gathered a chunk at a time into the upload buffers).
            crate::load::admit(image_bytes, None).map_err(|e| {
                e.with_op(format!(
                    "{OP} (images of {} BF pixels × {} scan positions on the host; bin the detector)",
                    flat.len(),
                    scan.len()
                ))
            })?;
        }
        if !on_gpu {
            crate::load::admit(cpu_bytes, p.memory_budget).map_err(|e| {
                e.with_op(format!(
                    "{OP} (G for {} BF pixels × {} scan positions; raise memory_budget or bin the detector)",
                    flat.len(),
                    scan.len()
                ))
            })?;
        }
        let lambda = qem_cpu::dpc::electron_wavelength_a(p.voltage_kv);
        let (dtheta, sampling) = if p.det_sampling_mrad.is_none() && p.compat_2alpha {
            (2.0 * p.semiangle_mrad / disk.radius_px, None)
        } else {
            // The one calibration rule: argument > metadata > α / r_edge (qem::calibration).
            let s = crate::calibration::detector_sampling(
                ds,
                p.det_sampling_mrad,
                Some(p.semiangle_mrad),
            )
            .map_err(|e| e.with_op(OP))?;
            (s.mrad_per_px, Some(s))
        };
        let diagnostics = diagnostics(ds, p, lambda, dtheta, flat.len());
        let t_fit = t0.elapsed().as_secs_f64();
        let dk = dtheta * 1e-3 / lambda;
        let k = cpu::pixel_k_vectors(
            &flat,
            det,
            disk.center_px,
            (dk, dk),
            p.rotation_deg,
            p.transpose,
        );
        let optics = Optics {
            lambda_a: lambda,
            alpha_rad: p.semiangle_mrad * 1e-3,
            dtheta_rad: (dtheta * 1e-3, dtheta * 1e-3),
        };
        let t1 = Instant::now();
        let (prep, stages, storage_name, bytes) = if on_gpu {
            let sum = detector::sum_dp(ds).map_err(|e| e.with_op(OP))?;
            let g0: Vec<f64> = flat.iter().map(|&i| sum[i] as f64).collect();
            let (nu_r, nu_c) = (
                cpu::fftfreq(scan.rows, p.scan_step_a.0),
                cpu::fftfreq(scan.cols, p.scan_step_a.1),
            );
            let setup = qem_cuda::ssb::Setup {
                pixels: &flat,
                k: &k,
                g0: &g0,
                scan,
                nu_r: &nu_r,
                nu_c: &nu_c,
                optics,
                budget: p.memory_budget,
                storage: p.g_storage,
            };
            let host_images = if data_on_gpu {
                None
            } else if ds.encoded().is_some() {
                Some(HostImages::Gathered {
                    images: gather(ds, &flat).map_err(|e| e.with_op("ssb gather_pixels"))?,
                    n: scan.len(),
                })
            } else {
                Some(HostImages::Dense {
                    data: ds.dense()?,
                    frame_len: det.len(),
                    pixels: &flat,
                })
            };
            let src = match (&ds.storage, &host_images) {
                (Storage::CudaDense(a), _) => qem_cuda::ssb::Source::Dense(a),
                (Storage::CudaEncoded(e), _) => qem_cuda::ssb::Source::Encoded(e),
                (_, Some(h)) => qem_cuda::ssb::Source::Host {
                    images: h,
                    frame: det,
                },
                (_, None) => return Err(Error::internal(OP, "host data without its images")),
            };
            let g = qem_cuda::ssb::GpuSsb::prepare(src, &setup)?;
            drop(host_images);
            let st = g.stats.clone();
            (
                Prep::Cuda(Box::new(g)),
                vec![(
                    if data_on_gpu {
                        "gather + FFT per BF pixel (CUDA)"
                    } else {
                        "gather on the host, upload + FFT per BF pixel (CUDA)"
                    },
                    t1.elapsed().as_secs_f64(),
                )],
                st.storage.name(),
                st.peak_bytes,
            )
        } else {
            let images = gather(ds, &flat).map_err(|e| e.with_op("ssb gather_pixels"))?;
            let t_gather = t1.elapsed().as_secs_f64();
            let t2 = Instant::now();
            let prepared = cpu::Prepared::new(&images, scan, p.scan_step_a, optics, k.clone())?;
            (
                Prep::Cpu(Box::new(prepared)),
                vec![
                    ("gather BF pixels", t_gather),
                    ("FFT per BF pixel", t2.elapsed().as_secs_f64()),
                ],
                "full plane, complex f64",
                cpu_bytes,
            )
        };
        let mut provenance = ResultProvenance::new(
            ds,
            "ssb",
            json!({
                "voltage_kv": p.voltage_kv,
                "wavelength_a": lambda,
                "semiangle_mrad": p.semiangle_mrad,
                "scan_step_a": [p.scan_step_a.0, p.scan_step_a.1],
                "det_sampling_mrad": dtheta,
                "det_sampling_source": match &sampling {
                    Some(s) => s.source.clone(),
                    None => "2*alpha/r_bf (anchor compat)".to_string(),
                },
                "det_sampling_sigma_mrad": sampling.as_ref().map(|s| s.sigma_mrad_per_px),
                "det_sampling_sigma_stat_mrad": sampling.as_ref().map(|s| s.sigma_stat_mrad_per_px),
                "bf_disk_edge": sampling
                    .as_ref()
                    .and_then(|s| s.edge.as_ref())
                    .map(crate::calibration::edge_json),
                "diagnostics": diagnostics.json(),
                "rotation_deg": p.rotation_deg,
                "transpose": p.transpose,
                "bf_threshold": p.bf_threshold,
                "bf_center_px": [disk.center_px.0, disk.center_px.1],
                "bf_radius_px": disk.radius_px,
                "n_bf_pixels": flat.len(),
                "coarse_sample": json!({
                    "pixels": coarse_used,
                    "rule": format!("whole detector rows r ≡ round(centre row) mod {}, first in pixel order (0: no coarse stage)", cpu::COARSE_ROW_STRIDE),
                }),
                "scan_shape": [scan.rows, scan.cols],
                "padding": "none",
                "engine": if on_gpu { "cuda" } else { "cpu" },
                "g_storage": storage_name,
                "prepared_bytes": bytes,
                "gamma": "P(k-nu)P*(k) - P(k)P*(k+nu)",
            }),
        );
        provenance.stage("mean DP + BF selection", t_fit);
        for (name, secs) in stages {
            provenance.stage(name, secs);
        }
        let bf_pixels = flat.iter().map(|&i| (i / det.cols, i % det.cols)).collect();
        Ok(Ssb {
            prep,
            k,
            scan,
            params: *p,
            bf_pixels,
            coarse_used,
            disk,
            det_sampling_mrad: dtheta,
            sampling,
            diagnostics,
            wavelength_a: lambda,
            provenance,
        })
    }

    /// Parameters it was prepared with.
    pub fn params(&self) -> &SsbParams {
        &self.params
    }

    /// Number of BF pixels.
    pub fn n_bf_pixels(&self) -> usize {
        self.k.len()
    }

    /// Size of the fit's coarse sample at the front of [`Ssb::bf_pixels`] (0: none).
    pub fn coarse_pixels(&self) -> usize {
        self.coarse_used
    }

    /// BF pixel reciprocal vectors (after rotation), Å⁻¹.
    pub fn k_vectors(&self) -> &[(f64, f64)] {
        &self.k
    }

    /// Benchmarks and tests: `false` makes the CUDA engine use its general accumulate kernel
    /// even where χ is quadratic (`true`, the default, lets it take the faster quadratic one).
    /// No effect on the CPU engine.
    #[doc(hidden)]
    pub fn set_cuda_quadratic_kernel(&self, on: bool) {
        if let Prep::Cuda(g) = &self.prep {
            g.set_quadratic_kernel(on);
        }
    }

    /// `"cpu"` or `"cuda"`: where G lives and the objects and losses are computed.
    pub fn engine_name(&self) -> &'static str {
        match self.prep {
            Prep::Cpu(_) => "cpu",
            Prep::Cuda(_) => "cuda",
        }
    }

    /// How the CUDA preparation went (`None` on the CPU).
    pub fn cuda_stats(&self) -> Option<&PrepareStats> {
        match &self.prep {
            Prep::Cpu(_) => None,
            Prep::Cuda(g) => Some(&g.stats),
        }
    }

    /// Peak device bytes the CUDA preparation and evaluations have allocated (`None` on the
    /// CPU).
    pub fn cuda_peak_bytes(&self) -> Option<u64> {
        match &self.prep {
            Prep::Cpu(_) => None,
            Prep::Cuda(g) => Some(g.peak_bytes()),
        }
    }

    /// Reconstruct the object with aberrations `ab`.
    pub fn reconstruct(&self, ab: &Aberrations) -> Result<SsbResult> {
        let t0 = Instant::now();
        let (re, im) = match &self.prep {
            Prep::Cpu(p) => {
                let o = p.object(ab);
                (
                    o.iter().map(|v| v.re).collect(),
                    o.iter().map(|v| v.im).collect(),
                )
            }
            Prep::Cuda(g) => g.object(ab)?,
        };
        let mut provenance = self.provenance.clone();
        provenance.operation = "ssb.reconstruct".into();
        if let Some(m) = provenance.params.as_object_mut() {
            m.insert("aberrations".into(), json!(ab.to_map()));
        }
        provenance.stage("correct + inverse FFT", t0.elapsed().as_secs_f64());
        // atan2/hypot of 2^18 values take milliseconds on one core: in parallel.
        let (phase, amplitude): (Vec<f64>, Vec<f64>) = re
            .par_iter()
            .zip(&im)
            .map(|(r, i): (&f64, &f64)| (i.atan2(*r), r.hypot(*i)))
            .unzip();
        let weak_phase = weak_phase(&re, &im);
        Ok(SsbResult {
            object_re: re,
            object_im: im,
            phase,
            amplitude,
            weak_phase,
            scan_shape: self.scan,
            aberrations: *ab,
            provenance,
        })
    }

    /// The loss `kind` at `ab` (lower is better).
    pub fn objective(&self, ab: &Aberrations, kind: Objective) -> Result<f64> {
        self.objective_at(ab, kind, cpu::Fidelity::Full)
    }

    /// The loss `kind` at `ab` over every BF pixel (`Full`) or the fit's coarse sample
    /// (`Coarse`; every pixel when there is none).
    pub fn objective_at(&self, ab: &Aberrations, kind: Objective, fid: Fidelity) -> Result<f64> {
        // The one place that decides which pixels a fidelity means.
        let used = match fid {
            Fidelity::Coarse if self.coarse_used > 0 => self.coarse_used,
            _ => self.n_bf_pixels(),
        };
        match &self.prep {
            Prep::Cpu(p) => Ok(p.objective_over(ab, kind, used)),
            Prep::Cuda(g) => match kind {
                Objective::Coherence => g.coherence_over(ab, used),
                Objective::PhaseVariance => g.phase_variance_over(ab, used),
            },
        }
    }

    /// Fit the aberrations (seeded global search, then Nelder–Mead; `qem_cpu::ssb::fit_with`).
    pub fn fit(&self, f: &FitParams) -> Result<SsbFit> {
        self.fit_with_progress(f, &|_, _| {})
    }

    /// [`Ssb::fit`], calling `progress(done, total)` after each batch of objective evaluations
    /// (the global points are one batch, then each Nelder–Mead step or quadratic design). `done`
    /// counts evaluations so far; `total` is [`FitParams::evaluation_estimate`], an estimate the
    /// local stages may pass or not reach (then `done + 1`, so it is never reached before the
    /// fit returns). The fit
    /// itself is the same as [`Ssb::fit`]'s: the same losses in the same order.
    pub fn fit_with_progress(
        &self,
        f: &FitParams,
        progress: &(dyn Fn(usize, usize) + Sync),
    ) -> Result<SsbFit> {
        const OP: &str = "ssb fit";
        let t0 = Instant::now();
        if f.fit.is_empty() {
            return Err(Error::invalid(OP, "no parameter to fit")
                .with_expected(ABERRATION_NAMES.join(", "))
                .with_found("an empty list"));
        }
        if let Some(bad) = f.ranges.keys().find(|k| !f.fit.contains(k)) {
            return Err(
                Error::invalid(OP, "a range is given for a parameter that is not fitted")
                    .with_expected(f.fit.join(", "))
                    .with_found(bad.clone()),
            );
        }
        let mut params = Vec::new();
        for name in &f.fit {
            if params.iter().any(|(n, _)| n == name) {
                return Err(Error::invalid(OP, "parameter listed twice").with_found(name.clone()));
            }
            let r = f
                .ranges
                .get(name)
                .copied()
                .or_else(|| default_range(name))
                .ok_or_else(|| {
                    Error::invalid(OP, "unknown aberration name")
                        .with_expected(ABERRATION_NAMES.join(", "))
                        .with_found(name.clone())
                })?;
            if !(r.0.is_finite() && r.1.is_finite() && r.0 < r.1) {
                return Err(Error::invalid(OP, format!("search range of {name}"))
                    .with_expected("finite lo < hi")
                    .with_found(format!("({}, {})", r.0, r.1)));
            }
            params.push((name.clone(), r));
        }
        if f.global_evals == 0 && f.local_max_iter == 0 {
            return Err(Error::invalid(OP, "no evaluation budget")
                .with_expected("global_evals > 0 or local_max_iter > 0")
                .with_found("0 and 0"));
        }
        let spec = cpu::FitSpec {
            seed: f.seed,
            params: params.clone(),
            objective: f.objective,
            global_evals: f.global_evals,
            local_max_iter: f.local_max_iter,
            local_starts: f.local_starts,
            start: f.start,
            coarse: f.coarse && self.coarse_used > 0,
        };
        let estimate = f.evaluation_estimate();
        let done = std::sync::atomic::AtomicUsize::new(0);
        let report = |n: usize| {
            let d = done.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n;
            // Never `done == total` before the fit returns: a bar would close there.
            progress(d, estimate.max(d + 1));
        };
        // One search on either engine: a batch's losses in parallel on the CPU, one after the
        // other on the GPU (one device, one queue), counted for the progress.
        let on_cpu = matches!(self.prep, Prep::Cpu(_));
        let out = cpu::fit_with(&spec, &|abs: &[Aberrations], fid| {
            let one = |ab: &Aberrations| self.objective_at(ab, spec.objective, fid);
            let losses = if on_cpu {
                abs.par_iter().map(one).collect::<Result<Vec<f64>>>()
            } else {
                abs.iter().map(one).collect::<Result<Vec<f64>>>()
            };
            report(abs.len());
            losses
        })?;
        let t_fit = t0.elapsed().as_secs_f64();
        let result = self.reconstruct(&out.aberrations)?;
        let mut provenance = self.provenance.clone();
        provenance.operation = "ssb.fit".into();
        if let Some(m) = provenance.params.as_object_mut() {
            m.insert(
                "fit".into(),
                json!({
                    "seed": f.seed,
                    "objective": f.objective.name(),
                    "search": search_description(spec.coarse, spec.objective),
                    "coarse": spec.coarse,
                    "coarse_pixels": if spec.coarse { self.coarse_used } else { 0 },
                    "coarse_evaluations": out.coarse_evaluations,
                    "ranges": params.iter().map(|(n, r)| (n.clone(), json!({"lo": r.0, "hi": r.1,
                        "unit": Aberrations::unit(n)}))).collect::<serde_json::Map<_, _>>(),
                    "global_evals": f.global_evals,
                    "local_max_iter": f.local_max_iter,
                    "local_starts": f.local_starts,
                    "start": f.start.to_map(),
                    "global_best_loss": out.global_best_loss,
                    "loss": out.loss,
                    "evaluations": out.evaluations,
                    "aberrations": out.aberrations.to_map(),
                }),
            );
        }
        provenance.stage("fit", t_fit);
        Ok(SsbFit {
            aberrations: out.aberrations,
            loss: out.loss,
            evaluations: out.evaluations,
            loss_curve: out.loss_curve,
            result,
            provenance,
        })
    }
}
