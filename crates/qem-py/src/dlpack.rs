//! DLPack export of a dataset's dense array (`Dataset.__dlpack__`, `__dlpack_device__`) and of
//! a device result array (`DeviceArray.__dlpack__`, [`crate::device_array`]): a zero-copy view
//! for `torch.from_dlpack`, `cupy.from_dlpack`, `jax.dlpack` and, for CPU datasets,
//! `numpy.from_dlpack`. Both classes hand their keywords to [`export`], which parses them
//! ([`Request`]), makes the tensor of the object ([`Source`]) and wraps it in the capsule the
//! consumer asked for.
//!
//! Two ABIs, chosen by the consumer's `max_version`:
//! * `max_version` of 1.0 or later: a `"dltensor_versioned"` capsule holding a
//!   `DLManagedTensorVersioned` of version 1.0 with its flags: READ_ONLY on a dataset's view
//!   (a dataset never changes after its load: the sum DP it caches, and every result computed
//!   from it, would silently go stale if a consumer wrote into it), none on a device result
//!   (the caller's own memory), IS_COPIED on a copy made for `copy=True`;
//! * otherwise (no `max_version`, or 0.x) the legacy `"dltensor"` capsule (`DLManagedTensor`,
//!   DLPack 0.8), which every consumer accepts and which carries no flags.
//!
//! The C ABI is six small `repr(C)` structs and two capsule names, written here by hand. The
//! crate that wraps it for PyO3 (dlpark 0.10, which does follow this workspace's PyO3) refuses
//! what this export needs: a legacy capsule of read-only data (older NumPy and PyTorch ask for
//! no `max_version`), `copy=True` (a host copy), and errors naming what was expected and found;
//! and the export needs our own lifetime rule anyway. That rule: each exported tensor holds a
//! [`Lease`] on the memory it views — on a dataset an [`ExportLease`] (`close()` is deferred
//! while any is alive), on a device result a clone of its [`DeviceVec`] (the allocation is
//! freed with the last clone), on a copy the copy itself — so a tensor never outlives its
//! memory. The lease ends when the consumer deletes the tensor (its deleter) or when a capsule
//! nobody consumed (still under its first name) is garbage-collected.

use crate::dataset::{closed_error, PyDataset, Shared};
use crate::errors::to_pyerr;
use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use qem::detector::{DeviceVec, HostVec, ResultDType};
use qem::{DType, DenseArray, Representation};
use std::any::Any;
use std::ffi::{c_void, CStr};
use std::sync::Arc;

/// `DLDeviceType` values used here.
const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
/// `DLDataTypeCode::kDLUInt`.
const DL_UINT: u8 = 1;
/// `DLDataTypeCode::kDLFloat`.
const DL_FLOAT: u8 = 2;
/// `DLPACK_FLAG_BITMASK_READ_ONLY`: the consumer must not write the data.
pub const FLAG_READ_ONLY: u64 = 1 << 0;
/// `DLPACK_FLAG_BITMASK_IS_COPIED`: the data is a copy the consumer owns alone.
pub const FLAG_IS_COPIED: u64 = 1 << 1;
/// The version a versioned capsule says it is (the structs below are DLPack 1.0's).
const VERSION: DlPackVersion = DlPackVersion { major: 1, minor: 0 };

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

/// DLPack 0.8's managed tensor (the `"dltensor"` capsule).
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

#[repr(C)]
struct DlPackVersion {
    major: u32,
    minor: u32,
}

/// DLPack 1.0's managed tensor (the `"dltensor_versioned"` capsule).
#[repr(C)]
struct DlManagedTensorVersioned {
    version: DlPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DlTensor,
}

/// The two managed-tensor structs: the capsule name and how to fill one.
trait Managed: Sized {
    /// The name of an unconsumed capsule (a consumer renames it `used_…` when it takes it).
    const NAME: &'static CStr;
    /// A managed tensor of `dl_tensor` whose deleter frees its [`Export`]; `flags` where the
    /// struct has them.
    fn new(dl_tensor: DlTensor, flags: u64) -> Self;
    fn dl_tensor(&mut self) -> &mut DlTensor;
    fn set_manager_ctx(&mut self, ctx: *mut c_void);
}

impl Managed for DlManagedTensor {
    const NAME: &'static CStr = c"dltensor";

    /// The legacy struct has no flags: they are dropped.
    fn new(dl_tensor: DlTensor, _flags: u64) -> Self {
        DlManagedTensor {
            dl_tensor,
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_export::<Self>),
        }
    }

    fn dl_tensor(&mut self) -> &mut DlTensor {
        &mut self.dl_tensor
    }

    fn set_manager_ctx(&mut self, ctx: *mut c_void) {
        self.manager_ctx = ctx;
    }
}

impl Managed for DlManagedTensorVersioned {
    const NAME: &'static CStr = c"dltensor_versioned";

    fn new(dl_tensor: DlTensor, flags: u64) -> Self {
        DlManagedTensorVersioned {
            version: VERSION,
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_export::<Self>),
            flags,
            dl_tensor,
        }
    }

    fn dl_tensor(&mut self) -> &mut DlTensor {
        &mut self.dl_tensor
    }

    fn set_manager_ctx(&mut self, ctx: *mut c_void) {
        self.manager_ctx = ctx;
    }
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
    /// A host copy made for `copy=True` (a [`DenseArray`] or a [`HostVec`]): the tensor owns it.
    Copy(#[allow(dead_code)] Box<dyn Any + Send>),
}

impl Lease {
    /// The versioned flags of a tensor this lease keeps: a dataset's view is READ_ONLY (a
    /// dataset never changes after its load), a device result's is writable (the caller's
    /// memory), a copy is IS_COPIED (the consumer's alone, writable).
    fn flags(&self) -> u64 {
        match self {
            Lease::Dataset(_) => FLAG_READ_ONLY,
            Lease::Result(_) => 0,
            Lease::Copy(_) => FLAG_IS_COPIED,
        }
    }
}

/// One export: the managed tensor first (its address is the export's address), then the shape
/// it points into and the lease.
#[repr(C)]
struct Export<M> {
    managed: M,
    shape: [i64; 4],
    _lease: Lease,
}

/// The tensor's deleter: frees the export and ends its lease. Consumers may call it from any
/// thread, with or without the GIL; nothing here touches Python.
unsafe extern "C" fn delete_export<M: Managed>(managed: *mut M) {
    if !managed.is_null() {
        // SAFETY: `managed` is the first field of a `repr(C)` `Export<M>` leaked by
        // `into_capsule::<M>`, and the DLPack contract calls the deleter once.
        drop(unsafe { Box::from_raw(managed.cast::<Export<M>>()) });
    }
}

/// The capsule's destructor: a capsule still under its first name was never consumed, so its
/// tensor is deleted here; a consumed one (`used_dltensor`, `used_dltensor_versioned`)
/// belongs to its consumer.
unsafe extern "C" fn capsule_destructor<M: Managed>(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with a live capsule; IsValid sets no error, and GetPointer
    // cannot fail once IsValid said the name matches.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, M::NAME.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(capsule, M::NAME.as_ptr());
            delete_export::<M>(p.cast::<M>());
        }
    }
}

fn buffer_error(what: &str, expected: &str, found: &str) -> PyErr {
    PyBufferError::new_err(format!(
        "__dlpack__: {what} (expected {expected}, found {found})"
    ))
}

/// The consumer's `stream`: absent/`None`, an integer, or another object (its type's name).
enum Stream {
    None,
    Int,
    Other(String),
}

/// The keywords of one `__dlpack__` call (the Python array API, 2023.12).
struct Request {
    stream: Stream,
    max_version: Option<(u32, u32)>,
    dl_device: Option<(i32, i32)>,
    copy: Option<bool>,
}

impl Request {
    /// The keywords as Python passed them; an unknown keyword or a value of the wrong type is
    /// a `TypeError` (what Python says of a bad call).
    fn parse(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Request> {
        let mut r = Request {
            stream: Stream::None,
            max_version: None,
            dl_device: None,
            copy: None,
        };
        let Some(kwargs) = kwargs else {
            return Ok(r);
        };
        let bad = |key: &str, want: &str, v: &Bound<'_, PyAny>| {
            let found = v
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default();
            PyTypeError::new_err(format!(
                "__dlpack__: {key} must be {want} (expected {want}, found {found})"
            ))
        };
        for (k, v) in kwargs.iter() {
            let key: String = k.extract()?;
            match key.as_str() {
                "stream" if v.is_none() => r.stream = Stream::None,
                "stream" if v.extract::<i64>().is_ok() => r.stream = Stream::Int,
                "stream" => {
                    let name = v.get_type().name().map(|n| n.to_string());
                    r.stream = Stream::Other(name.unwrap_or_default());
                }
                "max_version" => {
                    r.max_version = v
                        .extract()
                        .map_err(|_| bad(&key, "None or a (major, minor) tuple", &v))?;
                }
                "dl_device" => {
                    r.dl_device = v
                        .extract()
                        .map_err(|_| bad(&key, "None or a (device type, id) tuple", &v))?;
                }
                "copy" => r.copy = v.extract().map_err(|_| bad(&key, "None or a bool", &v))?,
                _ => {
                    return Err(PyTypeError::new_err(format!(
                        "__dlpack__() got an unexpected keyword argument '{key}'"
                    )))
                }
            }
        }
        Ok(r)
    }

    /// Whether the consumer takes the versioned ABI (a `max_version` of 1.0 or later).
    fn versioned(&self) -> bool {
        self.max_version
            .is_some_and(|(major, _)| major >= VERSION.major)
    }
}

/// What a `__dlpack__` method returns: the capsule.
pub type Capsule<'py> = PyResult<Bound<'py, PyAny>>;

/// What `__dlpack__` exports.
pub enum Source<'a> {
    /// A dataset's dense array (or, with `copy=True` on the CPU, a copy of its counts).
    Dataset(&'a PyDataset),
    /// A device result of this shape (or, with `copy=True, dl_device=(1, 0)`, a host copy).
    Result(&'a DeviceVec, &'a [usize]),
}

/// `__dlpack__(**kwargs)` of `source`: the capsule the consumer's `max_version` selects.
///
/// `kwargs`: the method's keywords (`signature = (**kw)`: one parser for both classes).
pub fn export<'py>(
    py: Python<'py>,
    source: Source<'_>,
    kwargs: Option<&Bound<'py, PyDict>>,
) -> Capsule<'py> {
    let req = Request::parse(kwargs)?;
    let out = match source {
        Source::Dataset(ds) => dataset_tensor(py, ds, &req)?,
        Source::Result(v, shape) => result_tensor(py, v, shape, &req)?,
    };
    if req.versioned() {
        into_capsule::<DlManagedTensorVersioned>(py, out)
    } else {
        into_capsule::<DlManagedTensor>(py, out)
    }
}

/// What one capsule describes: address, device, `(type code, bits)`, shape (at most 4-D,
/// row-major, contiguous) and what keeps the memory alive (which also sets the flags).
struct Tensor {
    /// Address of the first value (host or device).
    ptr: u64,
    /// `(device_type, device_id)`.
    device: (i32, i32),
    /// `(type code, bits)`.
    dtype: (u8, u8),
    shape: Vec<usize>,
    lease: Lease,
}

/// `(device_type, device_id)` of the dataset, as `__dlpack_device__` answers.
pub fn device(ds: &PyDataset) -> (i32, i32) {
    ds.with(|d| match d.cuda_ordinal() {
        Some(k) => (DL_CUDA, k as i32),
        None => (DL_CPU, 0),
    })
}

fn count_dtype(d: DType) -> (u8, u8) {
    (DL_UINT, (d.size() * 8) as u8)
}

/// The address of a host copy's first value.
fn dense_ptr(a: &DenseArray) -> u64 {
    match a {
        DenseArray::U8(v) => v.as_ptr() as u64,
        DenseArray::U16(v) => v.as_ptr() as u64,
        DenseArray::U32(v) => v.as_ptr() as u64,
    }
}

/// A dataset's tensor: a read-only view of the dense array, or with `copy=True` (CPU only) a
/// copy of the counts (decoded when the dataset is ENCODED).
fn dataset_tensor(py: Python<'_>, ds: &PyDataset, req: &Request) -> PyResult<Tensor> {
    ds.check_open("__dlpack__")?;
    let own = device(ds);
    check_device(own, req.dl_device, "")?;
    if own.0 == DL_CPU && !matches!(req.stream, Stream::None) {
        return Err(buffer_error(
            "a stream was given for a CPU dataset",
            "stream=None",
            "a stream",
        ));
    }
    if req.copy == Some(true) {
        return dataset_copy(py, ds, own);
    }
    let shared = ds.shared();
    ds.with(|d| -> PyResult<Tensor> {
        if d.is_closed() {
            return Err(closed_error("__dlpack__"));
        }
        if d.representation() == Representation::Encoded {
            return Err(buffer_error(
                "the dataset is held ENCODED (rANS): no dense array exists to view; load with representation=\"dense\", or use to_numpy() (or copy=True on the CPU) for a decoded copy",
                "representation dense",
                "representation encoded",
            ));
        }
        let s = d.shape();
        let (ptr, device) = match d.cuda_array() {
            Some(v) => (v.device_ptr, (DL_CUDA, v.device_ordinal as i32)),
            None => (dense_ptr(d.dense().map_err(to_pyerr)?), (DL_CPU, 0)),
        };
        // CUDA: every load synchronizes its stream before returning and later calls only
        // read the array, so it is complete for any consumer stream; nothing to wait for.
        // The lease is taken under the read guard, so no close can slip in before it.
        Ok(Tensor {
            ptr,
            device,
            dtype: count_dtype(d.dtype()),
            shape: s.to_vec(),
            lease: Lease::Dataset(ExportLease::new(Arc::clone(&shared))),
        })
    })
}

/// `copy=True` of a dataset: the counts copied (or decoded) to a new host array the tensor
/// owns (IS_COPIED, writable). A CUDA dataset is refused: the copy would be a whole download.
fn dataset_copy(py: Python<'_>, ds: &PyDataset, own: (i32, i32)) -> PyResult<Tensor> {
    if own.0 != DL_CPU {
        return Err(buffer_error(
            "copy=True of a CUDA dataset is not made here (it would download every frame): use to_numpy() for a host copy, or copy on the consumer's side (cupy.array, tensor.clone())",
            "copy=None or False (a view of the device array)",
            "copy=True",
        ));
    }
    let shared = ds.shared();
    let (counts, shape, dtype) = py
        .detach(move || {
            shared.read(|d| {
                if d.is_closed() {
                    return Err(qem::Error::invalid(
                        "__dlpack__",
                        "the dataset has been closed",
                    ));
                }
                Ok((d.to_host()?, d.shape(), d.dtype()))
            })
        })
        .map_err(to_pyerr)?;
    Ok(Tensor {
        ptr: dense_ptr(&counts),
        device: (DL_CPU, 0),
        dtype: count_dtype(dtype),
        shape: shape.to_vec(),
        lease: Lease::Copy(Box::new(counts)),
    })
}

/// A `dl_device` other than the memory's own is refused (`hint` says what would work).
fn check_device(own: (i32, i32), asked: Option<(i32, i32)>, hint: &str) -> PyResult<()> {
    match asked {
        Some(a) if a != own => Err(buffer_error(
            &format!("the array lives on another device than the one asked for{hint}"),
            &format!("dl_device={own:?}"),
            &format!("dl_device={a:?}"),
        )),
        _ => Ok(()),
    }
}

/// `(device_type, device_id)` of a device result: `(2, ordinal)`.
pub fn result_device(v: &DeviceVec) -> (i32, i32) {
    (DL_CUDA, v.device_ordinal() as i32)
}

fn result_dtype(d: ResultDType) -> (u8, u8) {
    match d {
        ResultDType::U32 => (DL_UINT, 32),
        ResultDType::U64 => (DL_UINT, 64),
        ResultDType::F64 => (DL_FLOAT, 64),
        ResultDType::F32 => (DL_FLOAT, 32),
    }
}

/// A device result's tensor: a writable view of the device memory, the tensor holding a clone
/// of `v`; or with `copy=True, dl_device=(1, 0)` a host copy (IS_COPIED).
///
/// `stream`: the engine synchronized its stream before the result existed, so the values are
/// complete for every stream; any stream the consumer names (`None`, `-1`, `1`, `2` or a
/// `cudaStream_t`) has nothing to wait for.
fn result_tensor(
    py: Python<'_>,
    v: &DeviceVec,
    shape: &[usize],
    req: &Request,
) -> PyResult<Tensor> {
    if let Stream::Other(name) = &req.stream {
        return Err(buffer_error(
            "the stream is not a DLPack stream number",
            "stream=None or an integer (-1, 1, 2 or a cudaStream_t)",
            name,
        ));
    }
    let host = Some((DL_CPU, 0));
    if req.copy == Some(true) {
        if req.dl_device != host {
            return Err(buffer_error(
                "copy=True makes a host copy only: ask for dl_device=(1, 0) (np.from_dlpack(a, device=\"cpu\", copy=True)), or copy on the consumer's side (cupy.array, tensor.clone())",
                "copy=None or False, or copy=True with dl_device=(1, 0)",
                &format!("copy=True, dl_device={:?}", req.dl_device),
            ));
        }
        let dev = v.clone();
        let values = py.detach(move || dev.to_host()).map_err(to_pyerr)?;
        let ptr = match &values {
            HostVec::U32(x) => x.as_ptr() as u64,
            HostVec::U64(x) => x.as_ptr() as u64,
            HostVec::F64(x) => x.as_ptr() as u64,
            HostVec::F32(x) => x.as_ptr() as u64,
        };
        return Ok(Tensor {
            ptr,
            device: (DL_CPU, 0),
            dtype: result_dtype(v.dtype()),
            shape: shape.to_vec(),
            lease: Lease::Copy(Box::new(values)),
        });
    }
    let hint = if req.dl_device == host {
        " (copy=True with dl_device=(1, 0) makes a host copy)"
    } else {
        ""
    };
    check_device(result_device(v), req.dl_device, hint)?;
    Ok(Tensor {
        ptr: v.device_ptr(),
        device: result_device(v),
        dtype: result_dtype(v.dtype()),
        shape: shape.to_vec(),
        lease: Lease::Result(v.clone()),
    })
}

/// A capsule of kind `M` (named `M::NAME`) holding `t`'s lease until its tensor is deleted.
fn into_capsule<'py, M: Managed>(py: Python<'py>, t: Tensor) -> PyResult<Bound<'py, PyAny>> {
    if t.shape.len() > 4 {
        return Err(buffer_error(
            "too many dimensions",
            "at most 4",
            &t.shape.len().to_string(),
        ));
    }
    let mut shape = [0i64; 4];
    for (d, &n) in shape.iter_mut().zip(&t.shape) {
        *d = n as i64;
    }
    let dl_tensor = DlTensor {
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
    };
    let mut e = Box::new(Export {
        managed: M::new(dl_tensor, t.lease.flags()),
        shape,
        _lease: t.lease,
    });
    // The box's contents do not move when it is leaked below.
    let shape_ptr = e.shape.as_mut_ptr();
    e.managed.dl_tensor().shape = shape_ptr;
    let raw = Box::into_raw(e);
    // SAFETY: `raw` is a live `Export<M>` whose first field is the managed tensor; the capsule
    // owns it until a consumer renames the capsule and takes over the deleter.
    unsafe {
        (*raw).managed.set_manager_ctx(raw.cast::<c_void>());
        let capsule = ffi::PyCapsule_New(
            raw.cast::<c_void>(),
            M::NAME.as_ptr(),
            Some(capsule_destructor::<M>),
        );
        if capsule.is_null() {
            delete_export::<M>(raw.cast::<M>());
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, capsule))
    }
}
