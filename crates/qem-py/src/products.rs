//! The native functions behind `quantem.gpu.detector` and `quantem.gpu.dpc`.
//!
//! Each one converts its arguments into [`qem::detector`] / [`qem::dpc`] parameters, runs the
//! façade call with the GIL released (a pass over every frame can take seconds on a large
//! scan), and returns numpy arrays of the documented shapes and plain dicts; the Python modules
//! build the result classes from those. Shapes of masks and gradient fields are checked here,
//! so that the error names the expected and the found shape rather than a flat length.

use crate::convert::{dense_to_numpy, grid, to_py};
use crate::dataset::{run_on, run_on_progress, PyDataset};
use crate::device_array::PyDeviceArray;
use crate::errors::{to_pyerr, IntoPyResult};
use numpy::{PyReadonlyArray2, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use qem::detector::{
    self, DetectorImage, DetectorKind, DetectorMask, DetectorParams, DeviceMoments, DeviceVec,
    DiskFit, Product, ScanRoi, Unit, VirtualImage,
};
use qem::dpc::{self, CenterOfMass, DpcParams, DpcResult, EdgeMode};
use qem::{Error, Region, Shape2};

/// The largest integer mask weight the engines accept (`qem_core::reduce::MAX_INT_WEIGHT`,
/// which the façade re-checks): checked here too so that a value that does not even fit the
/// engine's `u32` weights is reported as it was given.
const MAX_INT_WEIGHT: u32 = 65535;

fn shape_text(shape: &[usize]) -> String {
    let parts: Vec<String> = shape.iter().map(|n| n.to_string()).collect();
    if parts.len() == 1 {
        format!("({},)", parts[0])
    } else {
        format!("({})", parts.join(", "))
    }
}

fn non_negative(op: &str, what: &str, v: i64) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| {
        to_pyerr(
            Error::invalid(op, format!("{what} must not be negative"))
                .with_expected("integers >= 0")
                .with_found(v.to_string()),
        )
    })
}

fn positions(op: &str, p: Vec<(i64, i64)>) -> PyResult<Vec<(usize, usize)>> {
    p.into_iter()
        .map(|(r, c)| {
            Ok((
                non_negative(op, "a scan row", r)?,
                non_negative(op, "a scan column", c)?,
            ))
        })
        .collect()
}

/// The dict `detector.fit_disk` returns (also the merged fit of `distributed.fit_disk`).
pub(crate) fn disk_dict<'py>(py: Python<'py>, d: &DiskFit) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("center_px", (d.center_px.0, d.center_px.1))?;
    out.set_item("radius_px", d.radius_px)?;
    out.set_item("threshold", d.threshold)?;
    out.set_item("n_pixels", d.n_pixels)?;
    out.set_item("fitted", d.fitted)?;
    Ok(out)
}

fn image_dict<'py>(py: Python<'py>, im: DetectorImage) -> PyResult<Bound<'py, PyDict>> {
    let image = grid(py, im.image.clone(), im.scan_shape)?;
    image_fields(py, im, image)
}

/// [`image_dict`] of an image left on the device (`image` a `DeviceArray`).
fn device_image_dict<'py>(
    py: Python<'py>,
    im: DetectorImage<DeviceVec>,
) -> PyResult<Bound<'py, PyDict>> {
    let s = im.scan_shape;
    let image = PyDeviceArray::wrap(py, im.image.clone(), &[s.rows, s.cols])?;
    image_fields(py, im, image)
}

/// The dict of a detector image whose `image` is already converted.
fn image_fields<'py, I>(
    py: Python<'py>,
    im: DetectorImage<I>,
    image: Py<PyAny>,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("kind", im.kind.name())?;
    out.set_item("inner_px", im.inner_px)?;
    // Python's float("inf") for DF; a None would read as "no bound given".
    out.set_item("outer_px", im.outer_px)?;
    out.set_item("disk", disk_dict(py, &im.disk)?)?;
    out.set_item("mask_pixels", im.mask_pixels)?;
    out.set_item("provenance", to_py(py, &im.provenance)?)?;
    out.set_item("image", image)?;
    Ok(out)
}

fn moments_dict<'py>(
    py: Python<'py>,
    m: qem::detector::Moments,
    scan: Shape2,
) -> PyResult<Bound<'py, PyDict>> {
    moments_fields(py, [m.sum, m.m_row, m.m_col], |v| grid(py, v, scan))
}

/// The moments left on the device, as a dict of `DeviceArray`s.
fn device_moments_dict<'py>(
    py: Python<'py>,
    m: DeviceMoments,
    scan: Shape2,
) -> PyResult<Bound<'py, PyDict>> {
    let s = [scan.rows, scan.cols];
    moments_fields(py, [m.sum, m.m_row, m.m_col], |v| {
        PyDeviceArray::wrap(py, v, &s)
    })
}

/// The dict `sum`, `m_row`, `m_col` of the three moment arrays, each converted by `array`.
fn moments_fields<'py, V>(
    py: Python<'py>,
    [sum, m_row, m_col]: [V; 3],
    array: impl Fn(V) -> PyResult<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("sum", array(sum)?)?;
    out.set_item("m_row", array(m_row)?)?;
    out.set_item("m_col", array(m_col)?)?;
    Ok(out)
}

fn com_dict<'py>(py: Python<'py>, c: CenterOfMass) -> PyResult<Bound<'py, PyDict>> {
    let s = c.scan_shape;
    com_fields(py, c, |v| grid(py, v, s))
}

/// [`com_dict`] of a centre of mass left on the device: `DeviceArray`s.
fn device_com_dict<'py>(
    py: Python<'py>,
    c: CenterOfMass<DeviceVec>,
) -> PyResult<Bound<'py, PyDict>> {
    let s = [c.scan_shape.rows, c.scan_shape.cols];
    com_fields(py, c, |v| PyDeviceArray::wrap(py, v, &s))
}

/// The dict of a centre of mass, each array converted by `array`.
fn com_fields<'py, V>(
    py: Python<'py>,
    c: CenterOfMass<V>,
    array: impl Fn(V) -> PyResult<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("zero_frames", c.zero_frames)?;
    out.set_item("centered", c.centered)?;
    out.set_item("unit", &c.unit)?;
    out.set_item("provenance", to_py(py, &c.provenance)?)?;
    out.set_item("com_row", array(c.com_row)?)?;
    out.set_item("com_col", array(c.com_col)?)?;
    Ok(out)
}

/// The detector geometry `detector._geometry` checks and passes as one dict: the fields of
/// [`DetectorParams`], `center` as a `(row, col)` sequence and `unit` as its name.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct Geometry {
    inner: Option<f64>,
    outer: Option<f64>,
    center: Option<Vec<f64>>,
    radius: Option<f64>,
    unit: String,
    semiangle_mrad: Option<f64>,
    det_sampling_mrad: Option<f64>,
}

impl Geometry {
    fn params(self) -> PyResult<DetectorParams> {
        let center = match self.center.as_deref() {
            None => None,
            Some(&[r, c]) => Some((r, c)),
            Some(other) => {
                return Err(to_pyerr(
                    Error::invalid("detector", "center is a detector position")
                        .with_expected("(row, col)")
                        .with_found(format!("{other:?}")),
                ))
            }
        };
        Ok(DetectorParams {
            inner: self.inner,
            outer: self.outer,
            center,
            radius: self.radius,
            unit: self.unit.parse::<Unit>().py()?,
            semiangle_mrad: self.semiangle_mrad,
            det_sampling_mrad: self.det_sampling_mrad,
        })
    }
}

/// A reduction over every frame to one detector pattern, as a `(k_r, k_c)` array.
fn detector_pattern<T: numpy::Element + Send + 'static>(
    py: Python<'_>,
    dataset: PyRef<'_, PyDataset>,
    op: &str,
    reduce: fn(&qem::Dataset) -> qem::Result<Vec<T>>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Py<PyAny>> {
    let v = run_on_progress(py, &dataset, op, progress, move |ds, _| reduce(ds))?;
    grid(py, v, dataset.with(|ds| ds.detector_shape()))
}

/// A `#[pyfunction]` over [`detector_pattern`]: the whole-scan pattern reductions differ only
/// in their name, operation and engine call. With a second engine call, the one that leaves
/// the pattern on the device, the function takes `device_result` too
/// ([`detector_pattern_or_device`]).
macro_rules! detector_pattern_fn {
    ($(#[$doc:meta])* $name:ident, $op:literal, $reduce:path) => {
        $(#[$doc])*
        #[pyfunction]
        #[pyo3(signature = (dataset, progress = None))]
        fn $name(
            py: Python<'_>,
            dataset: PyRef<'_, PyDataset>,
            progress: Option<Py<PyAny>>,
        ) -> PyResult<Py<PyAny>> {
            detector_pattern(py, dataset, $op, $reduce, progress)
        }
    };
    ($(#[$doc:meta])* $name:ident, $op:literal, $reduce:path, $on_device:path) => {
        $(#[$doc])*
        #[pyfunction]
        #[pyo3(signature = (dataset, progress = None, device_result = false))]
        fn $name(
            py: Python<'_>,
            dataset: PyRef<'_, PyDataset>,
            progress: Option<Py<PyAny>>,
            device_result: bool,
        ) -> PyResult<Py<PyAny>> {
            let (reduce, on_device) = ($reduce, $on_device);
            detector_pattern_or_device(py, dataset, $op, (reduce, on_device), progress, device_result)
        }
    };
}

/// A façade call giving one detector pattern.
type PatternFn<T> = fn(&qem::Dataset) -> qem::Result<T>;

/// [`detector_pattern`] with `device_result`: the pattern left on the device (a
/// `DeviceArray`) by `on_device` instead.
fn detector_pattern_or_device<T: numpy::Element + Send + 'static>(
    py: Python<'_>,
    dataset: PyRef<'_, PyDataset>,
    op: &str,
    (reduce, on_device): (PatternFn<Vec<T>>, PatternFn<DeviceVec>),
    progress: Option<Py<PyAny>>,
    device_result: bool,
) -> PyResult<Py<PyAny>> {
    if !device_result {
        return detector_pattern(py, dataset, op, reduce, progress);
    }
    let v = run_on_progress(py, &dataset, op, progress, move |ds, _| on_device(ds))?;
    let det = dataset.with(|ds| ds.detector_shape());
    PyDeviceArray::wrap(py, v, &[det.rows, det.cols])
}

detector_pattern_fn!(
    /// Exact `u64` sum of every frame, `(k_r, k_c)` (a `DeviceArray` with `device_result`).
    detector_sum_dp,
    "detector.sum_dp",
    detector::sum_dp,
    detector::sum_dp_on_device
);

detector_pattern_fn!(
    /// Mean DP, `f32` `(k_r, k_c)` (a `DeviceArray` with `device_result`).
    detector_mean_dp,
    "detector.mean_dp",
    detector::mean_dp,
    detector::mean_dp_on_device
);

detector_pattern_fn!(
    /// Max DP, `u32` `(k_r, k_c)` (a `DeviceArray` with `device_result`).
    detector_max_dp,
    "detector.max_dp",
    detector::max_dp,
    detector::max_dp_on_device
);

/// The BF disk fitted from the mean DP, as a dict.
#[pyfunction]
fn detector_fit_disk<'py>(
    py: Python<'py>,
    dataset: PyRef<'py, PyDataset>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = run_on(py, &dataset, "detector.fit_disk", |ds, _| {
        detector::fit_disk(ds)
    })?;
    disk_dict(py, &d)
}

/// Frames at `positions` `[(row, col), ...]`, `(n, k_r, k_c)` in the dataset's dtype.
#[pyfunction]
fn detector_frames(
    py: Python<'_>,
    dataset: PyRef<'_, PyDataset>,
    positions: Vec<(i64, i64)>,
) -> PyResult<Py<PyAny>> {
    let pos = self::positions("detector frames", positions)?;
    let n = pos.len();
    let a = run_on(py, &dataset, "detector.frames", move |ds, _| {
        detector::frames(ds, &pos)
    })?;
    let det = dataset.with(|ds| ds.detector_shape());
    dense_to_numpy(py, a, &[n, det.rows, det.cols])
}

/// Sum and max DP over a scan ROI: dict `sum` (`u64`), `max` (`u32`), `n_frames`,
/// `provenance`. Exactly one of `rect`, `circle` (`[row, col, radius]`), `positions`.
#[pyfunction]
#[pyo3(signature = (dataset, *, rect = None, circle = None, positions = None))]
fn detector_roi_dp<'py>(
    py: Python<'py>,
    dataset: PyRef<'py, PyDataset>,
    rect: Option<Vec<i64>>,
    circle: Option<Vec<f64>>,
    positions: Option<Vec<(i64, i64)>>,
) -> PyResult<Bound<'py, PyDict>> {
    const OP: &str = "detector.roi_dp";
    let roi = match (rect, circle, positions) {
        (Some(r), None, None) => {
            let [a, b, c, d] = r.as_slice() else {
                return Err(to_pyerr(
                    Error::invalid(OP, "rect is a half-open scan region")
                        .with_expected("(row_start, row_stop, col_start, col_stop)")
                        .with_found(format!("{r:?}")),
                ));
            };
            ScanRoi::Rect(Region::new(
                non_negative(OP, "rect", *a)?,
                non_negative(OP, "rect", *b)?,
                non_negative(OP, "rect", *c)?,
                non_negative(OP, "rect", *d)?,
            ))
        }
        (None, Some(c), None) => {
            let [r0, c0, radius] = c.as_slice() else {
                return Err(to_pyerr(
                    Error::invalid(OP, "circle is a disk of scan positions")
                        .with_expected("(center_row, center_col, radius)")
                        .with_found(format!("{c:?}")),
                ));
            };
            ScanRoi::Circle {
                center: (*r0, *c0),
                radius: *radius,
            }
        }
        (None, None, Some(p)) => ScanRoi::Positions(self::positions(OP, p)?),
        _ => {
            return Err(to_pyerr(
                Error::invalid(OP, "give exactly one scan region")
                    .with_expected("one of rect=, circle=, positions="),
            ))
        }
    };
    let r = run_on(py, &dataset, OP, move |ds, _| detector::roi_dp(ds, &roi))?;
    let det = dataset.with(|ds| ds.detector_shape());
    let out = PyDict::new(py);
    out.set_item("n_frames", r.n_frames)?;
    out.set_item("provenance", to_py(py, &r.provenance)?)?;
    out.set_item("sum", grid(py, r.sum, det)?)?;
    out.set_item("max", grid(py, r.max, det)?)?;
    Ok(out)
}

/// The weights of a `(k_r, k_c)` mask array: `uint64`/`int64` → integer weights (checked
/// `0..=65535`), `float64` → float weights.
fn mask_weights(mask: &Bound<'_, PyAny>, det: Shape2) -> PyResult<DetectorMask> {
    const OP: &str = "detector virtual_image";
    let untyped = mask.cast::<PyUntypedArray>().map_err(|_| {
        to_pyerr(
            Error::invalid(OP, "the mask must be a numpy array")
                .with_expected(format!(
                    "an array of shape {}",
                    shape_text(&[det.rows, det.cols])
                ))
                .with_found("another object"),
        )
    })?;
    let shape = untyped.shape().to_vec();
    if shape != [det.rows, det.cols] {
        return Err(to_pyerr(
            Error::invalid(OP, "the mask does not match the detector")
                .with_expected(format!("shape {}", shape_text(&[det.rows, det.cols])))
                .with_found(format!("shape {}", shape_text(&shape))),
        ));
    }
    let too_large = |p: usize, v: String| {
        to_pyerr(
            Error::invalid(
                OP,
                format!("integer mask weight at pixel {p} is out of range"),
            )
            .with_expected(format!(
                "0..={} (use a float mask for other weights)",
                MAX_INT_WEIGHT
            ))
            .with_found(v),
        )
    };
    if let Ok(a) = mask.extract::<PyReadonlyArray2<'_, u64>>() {
        let a = a.as_array();
        let mut w = Vec::with_capacity(det.len());
        for (p, &v) in a.iter().enumerate() {
            if v > u64::from(MAX_INT_WEIGHT) {
                return Err(too_large(p, v.to_string()));
            }
            w.push(v as u32);
        }
        return Ok(DetectorMask::Int(w));
    }
    if let Ok(a) = mask.extract::<PyReadonlyArray2<'_, i64>>() {
        let a = a.as_array();
        let mut w = Vec::with_capacity(det.len());
        for (p, &v) in a.iter().enumerate() {
            if !(0..=i64::from(MAX_INT_WEIGHT)).contains(&v) {
                return Err(too_large(p, v.to_string()));
            }
            w.push(v as u32);
        }
        return Ok(DetectorMask::Int(w));
    }
    if let Ok(a) = mask.extract::<PyReadonlyArray2<'_, f64>>() {
        return Ok(DetectorMask::Float(a.as_array().iter().copied().collect()));
    }
    let found = mask
        .getattr("dtype")
        .and_then(|d| d.str())
        .map(|s| s.to_string())
        .unwrap_or_default();
    Err(to_pyerr(
        Error::invalid(OP, "unsupported mask dtype")
            .with_expected("bool, integer (as uint64/int64) or float64 weights")
            .with_found(found),
    ))
}

/// The façade call of a Python function with a host and a device form, run on `dataset` with
/// the GIL released and `progress` reported: `host`, or `device` when `device_result` is set,
/// given `args`; each result is turned into Python by the function beside its call.
fn host_or_device<'py, A, H, D, R>(
    py: Python<'py>,
    dataset: &PyDataset,
    (op, progress): (&str, Option<Py<PyAny>>),
    (device_result, args): (bool, A),
    host: (FacadeFn<A, H>, impl FnOnce(H) -> PyResult<R>),
    device: (FacadeFn<A, D>, impl FnOnce(D) -> PyResult<R>),
) -> PyResult<R>
where
    A: Send + 'static,
    H: Send + 'static,
    D: Send + 'static,
{
    if device_result {
        let (call, convert) = device;
        return convert(run_on_progress(py, dataset, op, progress, move |ds, _| {
            call(ds, &args)
        })?);
    }
    let (call, convert) = host;
    convert(run_on_progress(py, dataset, op, progress, move |ds, _| {
        call(ds, &args)
    })?)
}

/// A façade call on a dataset with its arguments.
type FacadeFn<A, T> = fn(&qem::Dataset, &A) -> qem::Result<T>;

/// Virtual image of `mask` (`(k_r, k_c)`; `uint64`/`int64` exact, `float64` float), `(R_r, R_c)`.
#[pyfunction]
#[pyo3(signature = (dataset, mask, progress = None, device_result = false))]
fn detector_virtual_image(
    py: Python<'_>,
    dataset: PyRef<'_, PyDataset>,
    mask: &Bound<'_, PyAny>,
    progress: Option<Py<PyAny>>,
    device_result: bool,
) -> PyResult<Py<PyAny>> {
    let (det, scan) = dataset.with(|ds| (ds.detector_shape(), ds.scan_shape()));
    let m = mask_weights(mask, det)?;
    host_or_device(
        py,
        &dataset,
        ("detector.virtual_image", progress),
        (device_result, m),
        (
            |ds, m| detector::virtual_image(ds, m),
            |img| match img {
                VirtualImage::U64(v) => grid(py, v, scan),
                VirtualImage::F64(v) => grid(py, v, scan),
            },
        ),
        (
            |ds, m| detector::virtual_image_on_device(ds, m),
            |v| PyDeviceArray::wrap(py, v, &[scan.rows, scan.cols]),
        ),
    )
}

/// One named detector image as a dict (`kind`, `image`, `inner_px`, `outer_px`, `disk`,
/// `mask_pixels`, `provenance`); `geometry` as for [`Geometry`].
#[pyfunction]
#[pyo3(signature = (dataset, kind, geometry, progress = None, device_result = false))]
fn detector_image<'py>(
    py: Python<'py>,
    dataset: PyRef<'py, PyDataset>,
    kind: &str,
    geometry: Geometry,
    progress: Option<Py<PyAny>>,
    device_result: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let kind = kind.parse::<DetectorKind>().py()?;
    let p = geometry.params()?;
    let op = format!("detector.{}", kind.name());
    host_or_device(
        py,
        &dataset,
        (&op, progress),
        (device_result, (kind, p)),
        (
            |ds, (kind, p)| detector::detector_image(ds, *kind, p),
            |im| image_dict(py, im),
        ),
        (
            |ds, (kind, p)| detector::detector_image_on_device(ds, *kind, p),
            |im| device_image_dict(py, im),
        ),
    )
}

/// Exact per-frame moments: dict `sum`, `m_row`, `m_col` (`u64` `(R_r, R_c)`).
#[pyfunction]
#[pyo3(signature = (dataset, progress = None, device_result = false))]
fn detector_moments<'py>(
    py: Python<'py>,
    dataset: PyRef<'py, PyDataset>,
    progress: Option<Py<PyAny>>,
    device_result: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let scan = dataset.with(|ds| ds.scan_shape());
    host_or_device(
        py,
        &dataset,
        ("detector.moments", progress),
        (device_result, ()),
        (|ds, _| detector::moments(ds), |m| moments_dict(py, m, scan)),
        (
            |ds, _| detector::moments_on_device(ds),
            |m| device_moments_dict(py, m, scan),
        ),
    )
}

/// Several products in one pass: dict `images` (list of image dicts), `sum_dp`, `mean_dp`,
/// `max_dp`, `moments`, `com`, `disk` (each `None` unless asked), `provenance`; `geometry` as
/// for [`Geometry`]. With `device_result` the arrays are `DeviceArray`s.
#[pyfunction]
#[pyo3(signature = (dataset, names, geometry, progress = None, device_result = false))]
fn detector_products<'py>(
    py: Python<'py>,
    dataset: PyRef<'py, PyDataset>,
    names: Vec<String>,
    geometry: Geometry,
    progress: Option<Py<PyAny>>,
    device_result: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let which = names
        .iter()
        .map(|n| n.parse::<Product>())
        .collect::<qem::Result<Vec<_>>>()
        .py()?;
    let p = geometry.params()?;
    let (scan, det) = dataset.with(|ds| (ds.scan_shape(), ds.detector_shape()));
    host_or_device(
        py,
        &dataset,
        ("detector.products", progress),
        (device_result, (which, p)),
        (
            |ds, (which, p)| detector::products(ds, which, p),
            |r| products_dict(py, r, scan, det),
        ),
        (
            |ds, (which, p)| detector::products_on_device(ds, which, p),
            |r| device_products_dict(py, r, scan, det),
        ),
    )
}

/// The dict of [`detector_products`].
fn products_dict(
    py: Python<'_>,
    r: detector::Products,
    scan: Shape2,
    det: Shape2,
) -> PyResult<Bound<'_, PyDict>> {
    let out = products_fields(py, &r.provenance, r.disk.as_ref(), r.images, image_dict)?;
    out.set_item("sum_dp", r.sum_dp.map(|v| grid(py, v, det)).transpose()?)?;
    out.set_item("mean_dp", r.mean_dp.map(|v| grid(py, v, det)).transpose()?)?;
    out.set_item("max_dp", r.max_dp.map(|v| grid(py, v, det)).transpose()?)?;
    out.set_item(
        "moments",
        r.moments.map(|m| moments_dict(py, m, scan)).transpose()?,
    )?;
    out.set_item("com", r.com.map(|c| com_dict(py, c)).transpose()?)?;
    Ok(out)
}

/// The dict of [`detector_products`] with `device_result`: `DeviceArray`s for the arrays.
fn device_products_dict(
    py: Python<'_>,
    r: detector::DeviceProducts,
    scan: Shape2,
    det: Shape2,
) -> PyResult<Bound<'_, PyDict>> {
    let pattern = |v: DeviceVec| PyDeviceArray::wrap(py, v, &[det.rows, det.cols]);
    let out = products_fields(
        py,
        &r.provenance,
        r.disk.as_ref(),
        r.images,
        device_image_dict,
    )?;
    out.set_item("sum_dp", r.sum_dp.map(pattern).transpose()?)?;
    out.set_item("mean_dp", r.mean_dp.map(pattern).transpose()?)?;
    out.set_item("max_dp", r.max_dp.map(pattern).transpose()?)?;
    let moments = r.moments.map(|m| device_moments_dict(py, m, scan));
    out.set_item("moments", moments.transpose()?)?;
    out.set_item("com", r.com.map(|c| device_com_dict(py, c)).transpose()?)?;
    Ok(out)
}

/// A products dict with its `provenance`, `disk` and `images` (each converted by `image`): the
/// fields whose form does not depend on where the arrays are.
fn products_fields<'py, I>(
    py: Python<'py>,
    provenance: &qem::ResultProvenance,
    disk: Option<&DiskFit>,
    images: Vec<I>,
    image: fn(Python<'py>, I) -> PyResult<Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("provenance", to_py(py, provenance)?)?;
    out.set_item("disk", disk.map(|d| disk_dict(py, d)).transpose()?)?;
    let list = PyList::empty(py);
    for im in images {
        list.append(image(py, im)?)?;
    }
    out.set_item("images", list)?;
    Ok(out)
}

/// Centre of mass as a dict (`com_row`, `com_col` `f64` `(R_r, R_c)`, `DeviceArray`s with
/// `device_result`; `zero_frames`, `centered`, `unit`, `provenance`).
#[pyfunction]
#[pyo3(signature = (dataset, centered = true, progress = None, device_result = false))]
fn dpc_center_of_mass<'py>(
    py: Python<'py>,
    dataset: PyRef<'py, PyDataset>,
    centered: bool,
    progress: Option<Py<PyAny>>,
    device_result: bool,
) -> PyResult<Bound<'py, PyDict>> {
    host_or_device(
        py,
        &dataset,
        ("dpc.center_of_mass", progress),
        (device_result, centered),
        (|ds, c| dpc::center_of_mass(ds, *c), |r| com_dict(py, r)),
        (
            |ds, c| dpc::center_of_mass_on_device(ds, *c),
            |r| device_com_dict(py, r),
        ),
    )
}

/// A DPC result as the dict the Python layer wraps (also the merged result of the distributed
/// path).
pub(crate) fn dpc_dict<'py>(py: Python<'py>, r: DpcResult) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    let s = r.scan_shape;
    out.set_item("rotation_deg", r.rotation_deg)?;
    out.set_item("transpose", r.transpose)?;
    out.set_item("sign_confidence", r.sign_confidence)?;
    out.set_item("sign_criterion", &r.sign_criterion)?;
    out.set_item("confident", r.confident)?;
    out.set_item("curl_score", r.curl_score)?;
    out.set_item("zero_frames", r.zero_frames)?;
    out.set_item("unit", &r.unit)?;
    out.set_item("phase_unit", &r.phase_unit)?;
    out.set_item("provenance", to_py(py, &r.provenance)?)?;
    out.set_item("com_row", grid(py, r.com_row, s)?)?;
    out.set_item("com_col", grid(py, r.com_col, s)?)?;
    out.set_item("dpc_row", grid(py, r.dpc_row, s)?)?;
    out.set_item("dpc_col", grid(py, r.dpc_col, s)?)?;
    out.set_item("phase", grid(py, r.phase, s)?)?;
    Ok(out)
}

/// DPC: CoM, rotation/transpose, sign, aligned field and phase, as a dict.
#[pyfunction]
#[pyo3(signature = (
    dataset, *, rotation_deg = None, transpose = None, edge = "periodic", progress = None
))]
fn dpc_run<'py>(
    py: Python<'py>,
    dataset: PyRef<'py, PyDataset>,
    rotation_deg: Option<f64>,
    transpose: Option<bool>,
    edge: &str,
    progress: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let p = DpcParams {
        rotation_deg,
        transpose,
        edge: edge.parse::<EdgeMode>().py()?,
    };
    let r = run_on_progress(py, &dataset, "dpc.run", progress, move |ds, _| {
        dpc::run(ds, &p)
    })?;
    dpc_dict(py, r)
}

/// The least-squares inverse gradient of a 2-D field `(g_row, g_col)` (`float64`, same shape).
#[pyfunction]
#[pyo3(signature = (g_row, g_col, edge = "periodic"))]
fn dpc_integrate(
    py: Python<'_>,
    g_row: &Bound<'_, PyAny>,
    g_col: &Bound<'_, PyAny>,
    edge: &str,
) -> PyResult<Py<PyAny>> {
    const OP: &str = "dpc.integrate";
    let field = |a: &Bound<'_, PyAny>| -> PyResult<(Vec<f64>, Vec<usize>)> {
        let arr = a.extract::<PyReadonlyArray2<'_, f64>>().map_err(|_| {
            let found = a
                .cast::<PyUntypedArray>()
                .map(|u| format!("{} array of shape {}", u.dtype(), shape_text(u.shape())))
                .unwrap_or_else(|_| "another object".to_string());
            to_pyerr(
                Error::invalid(OP, "a gradient component must be a 2-D float64 array")
                    .with_expected("float64 (R_r, R_c)")
                    .with_found(found),
            )
        })?;
        let shape = arr.shape().to_vec();
        Ok((arr.as_array().iter().copied().collect(), shape))
    };
    let (gr, sr) = field(g_row)?;
    let (gc, sc) = field(g_col)?;
    if sr != sc {
        return Err(to_pyerr(
            Error::invalid(OP, "g_row and g_col differ in shape")
                .with_expected(format!("both {}", shape_text(&sr)))
                .with_found(shape_text(&sc)),
        ));
    }
    let shape = Shape2::new(sr[0], sr[1]);
    let edge = edge.parse::<EdgeMode>().py()?;
    let phase = py.detach(|| dpc::integrate(&gr, &gc, shape, edge)).py()?;
    grid(py, phase, shape)
}

/// Add the functions to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(detector_sum_dp, m)?)?;
    m.add_function(wrap_pyfunction!(detector_mean_dp, m)?)?;
    m.add_function(wrap_pyfunction!(detector_max_dp, m)?)?;
    m.add_function(wrap_pyfunction!(detector_fit_disk, m)?)?;
    m.add_function(wrap_pyfunction!(detector_frames, m)?)?;
    m.add_function(wrap_pyfunction!(detector_roi_dp, m)?)?;
    m.add_function(wrap_pyfunction!(detector_virtual_image, m)?)?;
    m.add_function(wrap_pyfunction!(detector_image, m)?)?;
    m.add_function(wrap_pyfunction!(detector_moments, m)?)?;
    m.add_function(wrap_pyfunction!(detector_products, m)?)?;
    m.add_function(wrap_pyfunction!(dpc_center_of_mass, m)?)?;
    m.add_function(wrap_pyfunction!(dpc_run, m)?)?;
    m.add_function(wrap_pyfunction!(dpc_integrate, m)?)?;
    Ok(())
}
