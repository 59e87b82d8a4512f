//! The native side of `quantem.gpu.ssb`: a prepared [`qem::ssb::Ssb`] as a Python object.
//!
//! [`ssb_prepare`] reads the BF pixels' images and FFTs them; [`PySsb`]'s `reconstruct`,
//! `objective` and `fit` then work on what it holds. Every call that computes runs with the GIL
//! released (preparing reads every frame; a fit is hundreds of objective evaluations). Results
//! come back as dicts of numpy arrays and plain values; `python/quantem/gpu/ssb.py` builds the
//! documented result classes from them and checks the arguments users get wrong most often,
//! so the messages here are the engine's own for anything that gets past it.

use crate::convert::{grid, to_py};
use crate::dataset::{run_on_progress, PyDataset};
use crate::errors::{to_pyerr, IntoPyResult};
use crate::watch::run_watched;
use numpy::ndarray::Array2;
use numpy::IntoPyArray;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use qem::ssb::{
    Aberrations, FitParams, GStorage, Objective, Ssb, SsbFit, SsbParams, SsbResult,
    ABERRATION_NAMES,
};
use qem::{Error, Shape2};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Every objective the engine knows, the default first.
const OBJECTIVES: [Objective; 2] = [Objective::Coherence, Objective::PhaseVariance];

fn objective(name: &str) -> PyResult<Objective> {
    OBJECTIVES
        .iter()
        .copied()
        .find(|o| o.name() == name)
        .ok_or_else(|| {
            let known: Vec<&str> = OBJECTIVES.iter().map(|o| o.name()).collect();
            to_pyerr(
                Error::invalid("ssb", "unknown objective")
                    .with_expected(known.join(" or "))
                    .with_found(name.to_string()),
            )
        })
}

fn aberrations(map: BTreeMap<String, f64>) -> PyResult<Aberrations> {
    Aberrations::from_map(&map).py()
}

/// `v` (`n` row/col pairs, flat) as an `(n, 2)` array.
fn pairs<T>(v: Vec<T>, n: usize) -> PyResult<Array2<T>> {
    Array2::from_shape_vec((n, 2), v)
        .map_err(|e| to_pyerr(Error::internal("convert to numpy", format!("{e}"))))
}

fn result_dict<'py>(py: Python<'py>, r: SsbResult) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    let s = r.scan_shape;
    out.set_item("aberrations", to_py(py, &r.aberrations.to_map())?)?;
    out.set_item("provenance", to_py(py, &r.provenance)?)?;
    out.set_item("object_re", grid(py, r.object_re, s)?)?;
    out.set_item("object_im", grid(py, r.object_im, s)?)?;
    out.set_item("phase", grid(py, r.phase, s)?)?;
    out.set_item("amplitude", grid(py, r.amplitude, s)?)?;
    out.set_item("weak_phase", grid(py, r.weak_phase, s)?)?;
    Ok(out)
}

fn fit_dict<'py>(
    py: Python<'py>,
    f: SsbFit,
    fitted: &[String],
    objective: Objective,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("aberrations", to_py(py, &f.aberrations.to_map())?)?;
    out.set_item("fitted", PyList::new(py, fitted)?)?;
    out.set_item("loss", f.loss)?;
    out.set_item("evaluations", f.evaluations)?;
    out.set_item("objective", objective.name())?;
    out.set_item("loss_curve", f.loss_curve.into_pyarray(py))?;
    out.set_item("provenance", to_py(py, &f.provenance)?)?;
    out.set_item("result", result_dict(py, f.result)?)?;
    Ok(out)
}

/// A dataset prepared for SSB (`quantem.gpu.ssb.SSB` holds one).
#[pyclass(name = "SsbPrepared", module = "quantem.gpu.ssb", frozen)]
#[derive(Debug)]
pub struct PySsb {
    /// Shared with the worker thread of a running call (which may outlive a Ctrl-C).
    inner: Arc<Ssb>,
    /// The dataset's scan grid (what every result has).
    scan: Shape2,
}

/// The smallest scan a fit can learn from: with one row (or column) of positions the scan
/// spectrum has no frequency along it, so the aberrations along that axis are unconstrained;
/// with one position every objective is 0 and the fit would return its start point.
const MIN_FIT_SCAN: usize = 2;

impl PySsb {
    /// Refuse a fit (or objective) on a scan too small to constrain it.
    // The engine (`qem::ssb::Ssb::fit`) does not check this itself; the check sits here.
    fn check_fit_scan(&self, op: &str) -> PyResult<()> {
        if self.scan.rows < MIN_FIT_SCAN || self.scan.cols < MIN_FIT_SCAN {
            return Err(to_pyerr(
                Error::invalid(
                    op,
                    "an aberration fit needs a scan of at least 2 x 2 positions (the objective \
                     has no scan frequency to measure otherwise)",
                )
                .with_expected(format!("scan shape >= ({MIN_FIT_SCAN}, {MIN_FIT_SCAN})"))
                .with_found(format!("({}, {})", self.scan.rows, self.scan.cols)),
            ));
        }
        Ok(())
    }
}

#[pymethods]
impl PySsb {
    /// The prepared geometry as a dict: `n_bf`, `bf_pixels` (`(B, 2)` int64), `k_vectors`
    /// (`(B, 2)` Å⁻¹, after rotation), `bf_center_px`, `bf_radius_px`, `det_sampling_mrad`,
    /// `wavelength_a`, `scan_shape`, `params`, and the defaults of the fit.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = &self.inner;
        let p = s.params();
        let out = PyDict::new(py);
        let n = s.n_bf_pixels();
        out.set_item("n_bf", n)?;
        let px: Vec<i64> = s
            .bf_pixels
            .iter()
            .flat_map(|&(r, c)| [r as i64, c as i64])
            .collect();
        let kv: Vec<f64> = s.k_vectors().iter().flat_map(|&(r, c)| [r, c]).collect();
        out.set_item("bf_pixels", pairs(px, n)?.into_pyarray(py))?;
        out.set_item("k_vectors", pairs(kv, n)?.into_pyarray(py))?;
        out.set_item("bf_center_px", (s.disk.center_px.0, s.disk.center_px.1))?;
        out.set_item("bf_radius_px", s.disk.radius_px)?;
        out.set_item("det_sampling_mrad", s.det_sampling_mrad)?;
        out.set_item("wavelength_a", s.wavelength_a)?;
        out.set_item("scan_shape", (self.scan.rows, self.scan.cols))?;
        let params = PyDict::new(py);
        params.set_item("voltage_kv", p.voltage_kv)?;
        params.set_item("semiangle_mrad", p.semiangle_mrad)?;
        params.set_item("scan_step_a", (p.scan_step_a.0, p.scan_step_a.1))?;
        params.set_item("det_sampling_mrad", p.det_sampling_mrad)?;
        params.set_item("rotation_deg", p.rotation_deg)?;
        params.set_item("transpose", p.transpose)?;
        params.set_item("compat_2alpha", p.compat_2alpha)?;
        params.set_item("bf_threshold", p.bf_threshold)?;
        params.set_item("memory_budget", p.memory_budget)?;
        out.set_item("params", params)?;
        out.set_item("engine", s.engine_name())?;
        if let Some(st) = s.cuda_stats() {
            let c = PyDict::new(py);
            c.set_item("g_storage", st.storage.name())?;
            c.set_item("g_bytes", st.g_bytes)?;
            c.set_item("batch_pixels", st.batch_pixels)?;
            c.set_item("staged_pixels", st.staged_pixels)?;
            c.set_item("batches", st.batches)?;
            c.set_item("prepare_s", st.seconds)?;
            c.set_item("peak_bytes", s.cuda_peak_bytes())?;
            c.set_item("budget", st.budget)?;
            out.set_item("cuda", c)?;
        }
        let d = FitParams::default();
        let ranges = PyDict::new(py);
        for name in ABERRATION_NAMES {
            if let Some(r) = qem::ssb::default_range(name) {
                ranges.set_item(name, r)?;
            }
        }
        let fit = PyDict::new(py);
        fit.set_item("fit", PyList::new(py, &d.fit)?)?;
        fit.set_item("ranges", ranges)?;
        fit.set_item("global_evals", d.global_evals)?;
        fit.set_item("local_max_iter", d.local_max_iter)?;
        fit.set_item("local_starts", d.local_starts)?;
        out.set_item("fit_defaults", fit)?;
        Ok(out)
    }

    /// Names of the objectives, the default first.
    fn objectives(&self) -> Vec<&'static str> {
        OBJECTIVES.iter().map(|o| o.name()).collect()
    }

    /// The object at `aberrations` (`{name: value}`, Å / rad, missing = 0) as a dict.
    fn reconstruct<'py>(
        &self,
        py: Python<'py>,
        aberrations: BTreeMap<String, f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let ab = self::aberrations(aberrations)?;
        let s = Arc::clone(&self.inner);
        let r = run_watched(py, "ssb reconstruct", None, move |_| s.reconstruct(&ab))?;
        result_dict(py, r)
    }

    /// The loss `objective` at `aberrations`.
    fn objective(
        &self,
        py: Python<'_>,
        aberrations: BTreeMap<String, f64>,
        objective: &str,
    ) -> PyResult<f64> {
        let ab = self::aberrations(aberrations)?;
        let kind = self::objective(objective)?;
        self.check_fit_scan("ssb objective")?;
        let s = Arc::clone(&self.inner);
        run_watched(py, "ssb objective", None, move |_| s.objective(&ab, kind))
    }

    /// Fit: a dict (`aberrations`, `fitted`, `loss`, `evaluations`, `loss_curve`, `objective`,
    /// `result`, `provenance`). `None` budgets take the engine's defaults.
    #[pyo3(signature = (
        *, seed, fit, ranges = None, objective = "coherence", global_evals = None,
        local_max_iter = None, local_starts = None, start = BTreeMap::new(), progress = None,
        coarse = true
    ))]
    #[allow(clippy::too_many_arguments)]
    fn fit<'py>(
        &self,
        py: Python<'py>,
        seed: u64,
        fit: Vec<String>,
        ranges: Option<BTreeMap<String, (f64, f64)>>,
        objective: &str,
        global_evals: Option<usize>,
        local_max_iter: Option<usize>,
        local_starts: Option<usize>,
        start: BTreeMap<String, f64>,
        progress: Option<Py<PyAny>>,
        coarse: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let d = FitParams::default();
        let f = FitParams {
            seed,
            fit: fit.clone(),
            ranges: ranges.unwrap_or_default(),
            objective: self::objective(objective)?,
            global_evals: global_evals.unwrap_or(d.global_evals),
            local_max_iter: local_max_iter.unwrap_or(d.local_max_iter),
            local_starts: local_starts.unwrap_or(d.local_starts),
            start: self::aberrations(start)?,
            coarse,
        };
        self.check_fit_scan("ssb fit")?;
        let s = Arc::clone(&self.inner);
        let kind = f.objective;
        let watched = progress.is_some();
        let r = run_watched(py, "ssb fit", progress, move |w| {
            if !watched {
                return s.fit(&f);
            }
            // Objective evaluations, against an estimate the Nelder–Mead part may pass.
            w.set("ssb fit", 0, f.evaluation_estimate() as u64);
            let out = s.fit_with_progress(&f, &|done, total| {
                w.set("ssb fit", done as u64, total as u64)
            });
            qem::Progress::end(w.as_ref());
            out
        })?;
        fit_dict(py, r, &fit, kind)
    }
}

/// Prepare SSB on `dataset`; see `quantem.gpu.ssb.SSB` for the documented signature.
#[pyfunction]
#[pyo3(signature = (
    dataset, *, voltage_kv, semiangle_mrad, scan_step_a, det_sampling_mrad = None,
    rotation_deg = 0.0, transpose = false, compat_2alpha = false, bf_threshold = 0.0, memory_budget = None,
    g_storage = None, engine = "auto", progress = None
))]
#[allow(clippy::too_many_arguments)]
fn ssb_prepare(
    py: Python<'_>,
    dataset: PyRef<'_, PyDataset>,
    voltage_kv: f64,
    semiangle_mrad: f64,
    scan_step_a: (f64, f64),
    det_sampling_mrad: Option<f64>,
    rotation_deg: f64,
    transpose: bool,
    compat_2alpha: bool,
    bf_threshold: f64,
    memory_budget: Option<u64>,
    g_storage: Option<&str>,
    engine: &str,
    progress: Option<Py<PyAny>>,
) -> PyResult<PySsb> {
    let engine = engine.parse::<qem::BackendRequest>().py()?;
    let g_storage = match g_storage {
        None => None,
        Some("f32") => Some(GStorage::C32),
        Some("f16") => Some(GStorage::C16),
        Some("f12") => Some(GStorage::C12),
        Some(other) => {
            return Err(Error::invalid("ssb", "unknown g_storage")
                .with_expected("None, \"f32\", \"f16\" or \"f12\"")
                .with_found(other.to_string()))
            .py()
        }
    };
    let p = SsbParams {
        voltage_kv,
        semiangle_mrad,
        scan_step_a,
        det_sampling_mrad,
        rotation_deg,
        transpose,
        compat_2alpha,
        bf_threshold,
        memory_budget,
        g_storage,
        engine,
        ..SsbParams::default()
    };
    // With a callback, the mean-DP pass of the BF-disk fit (when not cached) reports frames.
    let inner = run_on_progress(py, &dataset, "ssb prepare", progress, move |ds, _| {
        Ssb::new(ds, &p)
    })?;
    Ok(PySsb {
        inner: Arc::new(inner),
        scan: dataset.with(|ds| ds.scan_shape()),
    })
}

/// Add the class and function to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySsb>()?;
    m.add_function(wrap_pyfunction!(ssb_prepare, m)?)?;
    Ok(())
}
