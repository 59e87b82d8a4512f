//! DLPack export of a dataset's dense array (`Dataset.__dlpack__`, `__dlpack_device__`): a
//! zero-copy view for `torch.from_dlpack`, `cupy.from_dlpack`, `jax.dlpack` and, for CPU
//! datasets, `numpy.from_dlpack`.
//!
//! The DLPack C ABI (v0.8, the "dltensor" capsule every consumer accepts) is four small
//! `repr(C)` structs and a capsule, written here by hand: the crate that wraps it for PyO3
//! (dlpark) follows older PyO3 releases than this workspace's, and the export needs our own
//! lifetime rule anyway. That rule: each exported tensor holds a lease on the dataset
//! ([`ExportLease`]); `close()` is deferred while any lease is alive, so a tensor never outlives
//! the memory it views. The lease ends when the consumer deletes the tensor (its deleter) or
//! when a capsule nobody consumed is garbage-collected.

use crate::dataset::{closed_error, PyDataset, Shared};
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use qem::{DType, DenseArray, Representation};
use std::ffi::{c_void, CStr};
use std::sync::Arc;

/// `DLDeviceType` values used here.
const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
/// `DLDataTypeCode::kDLUInt`.
const DL_UINT: u8 = 1;
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

/// One export: the managed tensor first (its address is the export's address), then the shape
/// it points into and the lease.
#[repr(C)]
struct Export {
    managed: DlManagedTensor,
    shape: [i64; 4],
    _lease: ExportLease,
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
    let export = ds.with(|d| -> PyResult<Box<Export>> {
        if d.is_closed() {
            return Err(closed_error("__dlpack__"));
        }
        let v = view(d)?;
        if let Some(asked) = dl_device {
            if asked != v.device {
                return Err(buffer_error(
                    "the dataset lives on another device than the one asked for",
                    &format!("dl_device={:?}", v.device),
                    &format!("dl_device={asked:?}"),
                ));
            }
        }
        if v.device.0 == DL_CPU && stream.is_some_and(|s| !s.is_none()) {
            return Err(buffer_error(
                "a stream was given for a CPU dataset",
                "stream=None",
                "a stream",
            ));
        }
        // CUDA: every load synchronizes its stream before returning and later calls only
        // read the array, so it is complete for any consumer stream; nothing to wait for.
        let bits = (v.dtype.size() * 8) as u8;
        let mut e = Box::new(Export {
            managed: DlManagedTensor {
                dl_tensor: DlTensor {
                    data: v.ptr as *mut c_void,
                    device: DlDevice {
                        device_type: v.device.0,
                        device_id: v.device.1,
                    },
                    ndim: 4,
                    dtype: DlDataType {
                        code: DL_UINT,
                        bits,
                        lanes: 1,
                    },
                    shape: std::ptr::null_mut(),
                    strides: std::ptr::null_mut(),
                    byte_offset: 0,
                },
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_export),
            },
            shape: v.shape.map(|n| n as i64),
            _lease: ExportLease::new(Arc::clone(&shared)),
        });
        e.managed.dl_tensor.shape = e.shape.as_mut_ptr();
        Ok(e)
    })?;
    let raw = Box::into_raw(export);
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
