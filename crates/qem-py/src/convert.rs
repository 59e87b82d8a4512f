//! Conversions between Python objects and the library's types.

use crate::errors::to_pyerr;
use numpy::ndarray::{ArrayD, IxDyn};
use numpy::{IntoPyArray, PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use qem::{DenseArray, Error, Region, Shape2};

/// A JSON value as plain Python objects (dict, list, str, int, float, bool, None).
pub fn json_to_py<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use serde_json::Value;
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any(),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                u.into_pyobject(py)?.into_any()
            } else if let Some(i) = n.as_i64() {
                i.into_pyobject(py)?.into_any()
            } else {
                n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any()
            }
        }
        Value::String(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(json_to_py(py, item)?)?;
            }
            list.into_any()
        }
        Value::Object(map) => {
            let dict = PyDict::new(py);
            for (k, item) in map {
                dict.set_item(k, json_to_py(py, item)?)?;
            }
            dict.into_any()
        }
    })
}

/// Any serialisable value as plain Python objects.
pub fn to_py<'py, T: serde::Serialize>(py: Python<'py>, value: &T) -> PyResult<Bound<'py, PyAny>> {
    let v = serde_json::to_value(value)
        .map_err(|e| to_pyerr(Error::internal("convert to Python", e.to_string())))?;
    json_to_py(py, &v)
}

/// `v` as a numpy array of `shape` (no copy of the data).
pub fn array<T: numpy::Element>(py: Python<'_>, v: Vec<T>, shape: &[usize]) -> PyResult<Py<PyAny>> {
    let arr = ArrayD::from_shape_vec(IxDyn(shape), v).map_err(|e| {
        to_pyerr(Error::internal(
            "convert to numpy",
            format!("shape {shape:?} does not fit the data: {e}"),
        ))
    })?;
    Ok(arr.into_pyarray(py).into_any().unbind())
}

/// `v` as a numpy array of the 2-D shape `s` (no copy of the data).
pub fn grid<T: numpy::Element>(py: Python<'_>, v: Vec<T>, s: Shape2) -> PyResult<Py<PyAny>> {
    array(py, v, &[s.rows, s.cols])
}

/// A dense array as a numpy array of `shape`, without copying the data.
pub fn dense_to_numpy(py: Python<'_>, a: DenseArray, shape: &[usize]) -> PyResult<Py<PyAny>> {
    match a {
        DenseArray::U8(v) => array(py, v, shape),
        DenseArray::U16(v) => array(py, v, shape),
        DenseArray::U32(v) => array(py, v, shape),
    }
}

fn copy_array<T: numpy::Element + Copy>(a: &Bound<'_, PyArrayDyn<T>>) -> PyResult<Vec<T>> {
    let ro = a.try_readonly()?;
    // C-contiguous arrays copy in one go; any other layout (Fortran order included, which
    // `as_slice` would hand back in memory order) is gathered in logical (C) order.
    if ro.is_c_contiguous() {
        if let Ok(s) = ro.as_slice() {
            return Ok(s.to_vec());
        }
    }
    Ok(ro.as_array().iter().copied().collect())
}

/// A numpy array of u8/u16/u32 with 3 or 4 dimensions as a [`qem::SourceArg::Array`] (a copy).
pub fn numpy_to_source(obj: &Bound<'_, PyAny>) -> PyResult<qem::SourceArg> {
    let shape: Vec<usize>;
    let data = if let Ok(a) = obj.cast::<PyArrayDyn<u8>>() {
        shape = a.shape().to_vec();
        DenseArray::U8(copy_array(a)?)
    } else if let Ok(a) = obj.cast::<PyArrayDyn<u16>>() {
        shape = a.shape().to_vec();
        DenseArray::U16(copy_array(a)?)
    } else if let Ok(a) = obj.cast::<PyArrayDyn<u32>>() {
        shape = a.shape().to_vec();
        DenseArray::U32(copy_array(a)?)
    } else {
        let found = obj
            .getattr("dtype")
            .and_then(|d| d.str())
            .map(|s| s.to_string())
            .unwrap_or_else(|_| "an object that is not a numpy array".to_string());
        return Err(to_pyerr(
            Error::invalid(
                "load",
                "a numpy source must hold unsigned detector counts (convert with .astype)",
            )
            .with_expected("dtype uint8, uint16 or uint32 (native byte order)")
            .with_found(found),
        ));
    };
    if shape.len() != 3 && shape.len() != 4 {
        return Err(to_pyerr(
            Error::invalid(
                "load",
                "a numpy source must be (R_r, R_c, k_r, k_c) or (N, k_r, k_c)",
            )
            .with_expected("3 or 4 dimensions")
            .with_found(format!("{} dimensions {shape:?}", shape.len())),
        ));
    }
    Ok(qem::SourceArg::Array { data, shape })
}

fn non_negative(what: &str, values: &[i64]) -> PyResult<Vec<usize>> {
    values
        .iter()
        .map(|&v| {
            usize::try_from(v).map_err(|_| {
                to_pyerr(
                    Error::invalid("load", format!("{what} must not be negative"))
                        .with_expected("integers >= 0")
                        .with_found(format!("{values:?}")),
                )
            })
        })
        .collect()
}

/// `(rows, cols)` → [`Shape2`].
pub fn shape2(what: &str, v: Option<Vec<i64>>) -> PyResult<Option<Shape2>> {
    let Some(v) = v else { return Ok(None) };
    if v.len() != 2 {
        return Err(to_pyerr(
            Error::invalid("load", format!("{what} must be (rows, cols)"))
                .with_expected("2 integers")
                .with_found(format!("{v:?}")),
        ));
    }
    let u = non_negative(what, &v)?;
    Ok(Some(Shape2::new(u[0], u[1])))
}

/// `(row_start, row_stop, col_start, col_stop)` → [`Region`].
pub fn region(what: &str, v: Option<Vec<i64>>) -> PyResult<Option<Region>> {
    let Some(v) = v else { return Ok(None) };
    if v.len() != 4 {
        return Err(to_pyerr(
            Error::invalid(
                "load",
                format!("{what} must be (row_start, row_stop, col_start, col_stop)"),
            )
            .with_expected("4 integers (half-open)")
            .with_found(format!("{v:?}")),
        ));
    }
    let u = non_negative(what, &v)?;
    Ok(Some(Region::new(u[0], u[1], u[2], u[3])))
}
