//! DLPack export of a dataset's dense array (`Dataset.__dlpack__`, `__dlpack_device__`) and of
//! a device result array (`DeviceArray.__dlpack__`, [`crate::device_array`]): a zero-copy view
//! for `torch.from_dlpack`, `cupy.from_dlpack`, `jax.dlpack` and, for CPU datasets,
//! `numpy.from_dlpack`.
//!
//! The DLPack C ABI (v0.8, the "dltensor" capsule every consumer accepts) is four small
//! `repr(C)` structs and a capsule, written here by hand: the crate that wraps it for PyO3
//! (dlpark) follows older PyO3 releases than this workspace's, and the export needs our own
//! lifetime rule anyway. That rule: each exported tensor holds a [`Lease`] on the memory it
//! views — on a dataset an [`ExportLease`] (`close()` is deferred while any is alive), on a
//! device result a clone of its [`DeviceVec`] (the allocation is freed with the last clone) — so
//! a tensor never outlives its memory. The lease ends when the consumer deletes the tensor (its
//! deleter) or when a capsule nobody consumed is garbage-collected.

use crate::dataset::{closed_error, PyDataset, Shared};
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use qem::detector::{DeviceVec, ResultDType};
use qem::{DType, DenseArray, Representation};
use std::ffi::{c_void, CStr};
use std::sync::Arc;

/// `DLDeviceType` values used here.
const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
/// `DLDataTypeCode::kDLUInt`.
const DL_UINT: u8 = 1;
/// `DLDataTypeCode::kDLFloat`.
const DL_FLOAT: u8 = 2;
/// The capsule name of an unconsumed legacy DLPack tensor (a consumer renames it on use).
const CAPSULE_NAME: &CStr = c"dltensor";

#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    /// Null: row-major and contiguous.
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// Keeps the dataset's memory alive while an exported tensor views it.
pub struct ExportLease {
    shared: Arc<Shared>,
}

impl ExportLease {
    /// Take a lease (the caller holds the dataset's read guard, so no close can slip in).
    fn new(shared: Arc<Shared>) -> ExportLease {
        shared.begin_export();
        ExportLease { shared }
    }
}

impl Drop for ExportLease {
    fn drop(&mut self) {
        self.shared.end_export();
    }
}

/// What keeps an export's memory alive until its tensor is deleted (held only for its `Drop`).
enum Lease {
    /// A dataset's dense array: its close is deferred.
    Dataset(#[allow(dead_code)] ExportLease),
    /// A device result: the allocation is freed with its last clone.
    Result(#[allow(dead_code)] DeviceVec),
}

/// One export: the managed tensor first (its address is the export's address), then the shape
/// it points into and the lease.
#[repr(C)]
struct Export {
    managed: DlManagedTensor,
    shape: [i64; 4],
    _lease: Lease,
}

/// The tensor's deleter: frees the export and ends its lease. Consumers may call it from any
/// thread, with or without the GIL; nothing here touches Python.
unsafe extern "C" fn delete_export(managed: *mut DlManagedTensor) {
    if !managed.is_null() {
        // SAFETY: `managed` is the first field of a `repr(C)` `Export` leaked by `export`, and
        // the DLPack contract calls the deleter once.
        drop(unsafe { Box::from_raw(managed.cast::<Export>()) });
    }
}

/// The capsule's destructor: a capsule still named "dltensor" was never consumed, so its tensor
/// is deleted here; a consumed one ("used_dltensor") belongs to its consumer.
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with a live capsule; IsValid sets no error.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE_NAME.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(capsule, CAPSULE_NAME.as_ptr());
            delete_export(p.cast::<DlManagedTensor>());
        }
    }
}

/// What a dataset can export: address, device, element type, shape.
struct View {
    ptr: u64,
    device: (i32, i32),
    dtype: DType,
    shape: [usize; 4],
}

fn buffer_error(what: &str, expected: &str, found: &str) -> PyErr {
    PyBufferError::new_err(format!(
        "__dlpack__: {what} (expected {expected}, found {found})"
    ))
}

/// `(device_type, device_id)` of the dataset, as `__dlpack_device__` answers.
pub fn device(ds: &PyDataset) -> (i32, i32) {
    ds.with(|d| match d.cuda_ordinal() {
        Some(k) => (DL_CUDA, k as i32),
        None => (DL_CPU, 0),
    })
}

/// The dense view of `d`, or the reason there is none.
fn view(d: &qem::Dataset) -> Result<View, PyErr> {
    if d.representation() == Representation::Encoded {
        return Err(buffer_error(
            "the dataset is held ENCODED (rANS): no dense array exists to view; load with representation=\"dense\", or use to_numpy() for a decoded copy",
            "representation dense",
            "representation encoded",
        ));
    }
    if let Some(v) = d.cuda_array() {
        return Ok(View {
            ptr: v.device_ptr,
            device: (DL_CUDA, v.device_ordinal as i32),
            dtype: v.dtype,
            shape: v.shape,
        });
    }
    let dense = d.dense().map_err(crate::errors::to_pyerr)?;
    let s = d.shape();
    Ok(View {
        ptr: match dense {
            DenseArray::U8(v) => v.as_ptr() as u64,
            DenseArray::U16(v) => v.as_ptr() as u64,
            DenseArray::U32(v) => v.as_ptr() as u64,
        },
        device: (DL_CPU, 0),
        dtype: d.dtype(),
        shape: [s[0], s[1], s[2], s[3]],
    })
}

/// `Dataset.__dlpack__`: a "dltensor" capsule viewing the dense array without a copy.
pub fn export<'py>(
    py: Python<'py>,
    ds: &PyDataset,
    stream: Option<&Bound<'py, PyAny>>,
    dl_device: Option<(i32, i32)>,
    copy: Option<bool>,
) -> PyResult<Bound<'py, PyAny>> {
    ds.check_open("__dlpack__")?;
    if copy == Some(true) {
        return Err(buffer_error(
            "copy=True asks for a copy; this export is a view (use to_numpy() for a host copy)",
            "copy=None or False",
            "copy=True",
        ));
    }
    let shared = ds.shared();
    let (v, lease) = ds.with(|d| -> PyResult<(View, ExportLease)> {
        if d.is_closed() {
            return Err(closed_error("__dlpack__"));
        }
        let v = view(d)?;
        check_device(v.device, dl_device)?;
        if v.device.0 == DL_CPU && stream.is_some_and(|s| !s.is_none()) {
            return Err(buffer_error(
                "a stream was given for a CPU dataset",
                "stream=None",
                "a stream",
            ));
        }
        // The lease is taken under the read guard, so no close can slip in before it.
        Ok((v, ExportLease::new(Arc::clone(&shared))))
    })?;
    // CUDA: every load synchronizes its stream before returning and later calls only
    // read the array, so it is complete for any consumer stream; nothing to wait for.
    into_capsule(
        py,
        Tensor {
            ptr: v.ptr,
            device: v.device,
            dtype: (DL_UINT, (v.dtype.size() * 8) as u8),
            shape: &v.shape,
        },
        Lease::Dataset(lease),
    )
}

/// A `dl_device` other than the memory's own is refused.
fn check_device(own: (i32, i32), asked: Option<(i32, i32)>) -> PyResult<()> {
    match asked {
        Some(a) if a != own => Err(buffer_error(
            "the array lives on another device than the one asked for",
            &format!("dl_device={own:?}"),
            &format!("dl_device={a:?}"),
        )),
        _ => Ok(()),
    }
}

/// What one capsule describes: address, device, `(type code, bits)`, shape (at most 4-D,
/// row-major, contiguous).
struct Tensor<'a> {
    ptr: u64,
    device: (i32, i32),
    dtype: (u8, u8),
    shape: &'a [usize],
}

/// A "dltensor" capsule of `t` holding `lease` until its tensor is deleted.
fn into_capsule<'py>(py: Python<'py>, t: Tensor<'_>, lease: Lease) -> PyResult<Bound<'py, PyAny>> {
    if t.shape.len() > 4 {
        return Err(buffer_error(
            "too many dimensions",
            "at most 4",
            &t.shape.len().to_string(),
        ));
    }
    let mut shape = [0i64; 4];
    for (d, &n) in shape.iter_mut().zip(t.shape) {
        *d = n as i64;
    }
    let mut e = Box::new(Export {
        managed: DlManagedTensor {
            dl_tensor: DlTensor {
                data: t.ptr as *mut c_void,
                device: DlDevice {
                    device_type: t.device.0,
                    device_id: t.device.1,
                },
                ndim: t.shape.len() as i32,
                dtype: DlDataType {
                    code: t.dtype.0,
                    bits: t.dtype.1,
                    lanes: 1,
                },
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_export),
        },
        shape,
        _lease: lease,
    });
    e.managed.dl_tensor.shape = e.shape.as_mut_ptr();
    let raw = Box::into_raw(e);
    // SAFETY: `raw` is a live `Export` whose first field is the managed tensor; the capsule
    // owns it until a consumer renames the capsule and takes over the deleter.
    unsafe {
        (*raw).managed.manager_ctx = raw.cast::<c_void>();
        let capsule = ffi::PyCapsule_New(
            raw.cast::<c_void>(),
            CAPSULE_NAME.as_ptr(),
            Some(capsule_destructor),
        );
        if capsule.is_null() {
            delete_export(raw.cast::<DlManagedTensor>());
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, capsule))
    }
}

/// `(device_type, device_id)` of a device result: `(2, ordinal)`.
pub fn result_device(v: &DeviceVec) -> (i32, i32) {
    (DL_CUDA, v.device_ordinal() as i32)
}

/// `DeviceArray.__dlpack__`: a "dltensor" capsule viewing the device result `v` (of `shape`)
/// without a copy; the capsule (then the consumer's tensor) holds a clone of `v`.
///
/// `stream`: the engine synchronized its stream before the result existed, so the values are
/// complete for every stream; any stream the consumer names (`None`, `-1`, `1`, `2` or a
/// `cudaStream_t`) has nothing to wait for.
pub fn export_result<'py>(
    py: Python<'py>,
    v: &DeviceVec,
    shape: &[usize],
    stream: Option<&Bound<'py, PyAny>>,
    dl_device: Option<(i32, i32)>,
    copy: Option<bool>,
) -> PyResult<Bound<'py, PyAny>> {
    if copy == Some(true) {
        return Err(buffer_error(
            "copy=True asks for a copy; this export is a view (use to_numpy() for a host copy)",
            "copy=None or False",
            "copy=True",
        ));
    }
    check_device(result_device(v), dl_device)?;
    if let Some(s) = stream.filter(|s| !s.is_none()) {
        if s.extract::<i64>().is_err() {
            return Err(buffer_error(
                "the stream is not a DLPack stream number",
                "stream=None or an integer (-1, 1, 2 or a cudaStream_t)",
                &s.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default(),
            ));
        }
    }
    let dtype = match v.dtype() {
        ResultDType::U32 => (DL_UINT, 32),
        ResultDType::U64 => (DL_UINT, 64),
        ResultDType::F64 => (DL_FLOAT, 64),
    };
    into_capsule(
        py,
        Tensor {
            ptr: v.device_ptr(),
            device: result_device(v),
            dtype,
            shape,
        },
        Lease::Result(v.clone()),
    )
}
