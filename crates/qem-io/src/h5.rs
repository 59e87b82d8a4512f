//! Thin helpers over `hdf5-metno` and raw `hdf5-sys`: library start-up, our in-process
//! bitshuffle (32008) decoder, tolerant scalar readers, external links, filter pipelines and the
//! one-pass chunk index.
//!
//! Every raw call runs inside `hdf5::sync::sync`, which holds hdf5-metno's global re-entrant lock:
//! the static HDF5 build is not thread-safe.

use hdf5::types::TypeDescriptor;
use hdf5_sys::h5i::hid_t;
use qem_core::{Error, Result};
use std::ffi::{c_char, c_uint, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::Once;

/// HDF5 filter id of bitshuffle.
pub(crate) const BSHUF_ID: i32 = 32008;

static REGISTER: Once = Once::new();

/// Start HDF5 and register our bitshuffle/LZ4 decoder as filter 32008 (once per process).
pub(crate) fn init() {
    REGISTER.call_once(|| {
        hdf5::sync::sync(|| {
            let class = hdf5_sys::h5z::H5Z_class2_t {
                version: 1,
                id: BSHUF_ID,
                // HDF5 refuses to create a dataset with a registered filter whose encoder is
                // absent (H5Z__prelude_callback), even an optional one; so we claim an encoder
                // and refuse in the callback. A pipeline write then stores the chunk unfiltered
                // with its filter-mask bit set (the filter is optional), which readers handle.
                encoder_present: 1,
                decoder_present: 1,
                name: FILTER_NAME.as_ptr(),
                can_apply: None,
                set_local: None,
                filter: Some(bshuf_filter),
            };
            // SAFETY: H5open has no preconditions. H5Zregister copies the class struct; the name
            // points at a 'static C string and the callback is a 'static function.
            unsafe {
                hdf5_sys::h5::H5open();
                hdf5_sys::h5z::H5Zregister((&class as *const hdf5_sys::h5z::H5Z_class2_t).cast());
            }
        })
    });
}

static FILTER_NAME: &CStr = c"bitshuffle/LZ4 decoder (quantem.gpu qem-io)";

/// The filter callback HDF5 calls for each chunk of a 32008 dataset read through the pipeline.
/// Decode only: an encode request fails (returns 0); our writer never writes through the
/// pipeline (it uses `H5Dwrite_chunk`).
unsafe extern "C" fn bshuf_filter(
    flags: c_uint,
    cd_nelmts: usize,
    cd_values: *const c_uint,
    nbytes: usize,
    buf_size: *mut usize,
    buf: *mut *mut c_void,
) -> usize {
    if flags & hdf5_sys::h5z::H5Z_FLAG_REVERSE == 0 || buf.is_null() || buf_size.is_null() {
        return 0;
    }
    let cd: &[c_uint] = if cd_values.is_null() || cd_nelmts == 0 {
        &[]
    } else {
        // SAFETY: HDF5 passes cd_nelmts valid values at cd_values.
        unsafe { std::slice::from_raw_parts(cd_values, cd_nelmts) }
    };
    // SAFETY: HDF5 passes a valid buffer pointer holding at least nbytes bytes.
    let input_ptr = unsafe { *buf };
    if input_ptr.is_null() {
        return 0;
    }
    // SAFETY: see above; the slice lives until we free the input buffer at the end.
    let input: &[u8] = unsafe { std::slice::from_raw_parts(input_ptr.cast::<u8>(), nbytes) };
    let result = std::panic::catch_unwind(|| decode_for_filter(cd, input));
    let Ok(Some(out)) = result else {
        return 0;
    };
    let n = out.len();
    // SAFETY: H5allocate_memory returns a buffer HDF5 may free later, or null.
    let dst = unsafe { hdf5_sys::h5::H5allocate_memory(n.max(1), 0) };
    if dst.is_null() {
        return 0;
    }
    // SAFETY: dst has n bytes; out has n bytes; they do not overlap. The input buffer was
    // allocated by HDF5 and is ours to free once we replace it.
    unsafe {
        std::ptr::copy_nonoverlapping(out.as_ptr(), dst.cast::<u8>(), n);
        hdf5_sys::h5::H5free_memory(input_ptr);
        *buf = dst;
        *buf_size = n;
    }
    n
}

/// Decode one 32008 chunk; `None` on any problem (HDF5 then reports a filter failure).
fn decode_for_filter(cd: &[c_uint], input: &[u8]) -> Option<Vec<u8>> {
    // cd_values: [major, minor, elem_size, block, compressor(, level)]
    let elem_size = *cd.get(2)? as usize;
    if elem_size == 0 {
        return None;
    }
    match cd.get(4) {
        None | Some(2) => {}
        Some(_) => return None, // zstd or bitshuffle-only: not supported by our codec
    }
    let header: [u8; 8] = input.get(..8)?.try_into().ok()?;
    let total = u64::from_be_bytes(header);
    // HDF5 chunks are below 4 GiB; refuse absurd headers before allocating.
    if total > u32::MAX as u64 {
        return None;
    }
    let mut out = vec![0u8; total as usize];
    qem_codec::bslz4::decode_chunk(input, elem_size, &mut out).ok()?;
    Some(out)
}

/// Open `path` read-only without HDF5 file locking.
///
/// We never write to a source, and an `flock` held by someone else (a writer, or a child process
/// that inherited a writer's descriptor across `fork`) would otherwise make the open fail with
/// EAGAIN.
pub(crate) fn open_read(path: &Path) -> hdf5::Result<hdf5::File> {
    hdf5::File::with_options()
        .with_fapl(|p| p.file_locking(false))
        .open(path)
}

/// Create (truncate) `path` for writing, without HDF5 file locking (see [`open_read`]: a
/// process spawned while we write would otherwise inherit our lock).
pub(crate) fn create_write(path: &Path) -> hdf5::Result<hdf5::File> {
    hdf5::File::with_options()
        .with_fapl(|p| p.file_locking(false))
        .create(path)
}

/// Map an hdf5-metno error to a typed source error for `op` on `file`.
pub(crate) fn h5err(op: &str, file: &Path, what: &str, e: hdf5::Error) -> Error {
    Error::source(op, format!("{what}: HDF5 says: {e}")).with_file(file)
}

/// One filter of a dataset's pipeline: id and client data.
#[derive(Debug, Clone)]
pub(crate) struct FilterSpec {
    pub id: i32,
    pub cd_values: Vec<u32>,
    pub name: String,
}

/// Read the filter pipeline of a dataset from its creation property list (strict: errors are
/// reported, not swallowed as hdf5-metno's `filters()` does).
pub(crate) fn filter_pipeline(ds: &hdf5::Dataset) -> std::result::Result<Vec<FilterSpec>, String> {
    hdf5::sync::sync(|| {
        // SAFETY: ds.id() is a valid open dataset id; the returned plist is closed below.
        let dcpl = unsafe { hdf5_sys::h5d::H5Dget_create_plist(ds.id()) };
        if dcpl < 0 {
            return Err("cannot read the dataset creation property list".to_string());
        }
        // SAFETY: dcpl is a valid property list id.
        let n = unsafe { hdf5_sys::h5p::H5Pget_nfilters(dcpl) };
        let mut out = Vec::new();
        let mut err = None;
        for idx in 0..n.max(0) {
            let mut flags: c_uint = 0;
            let mut cd = [0 as c_uint; 32];
            let mut cd_n: usize = cd.len();
            let mut name = [0 as c_char; 256];
            let mut config: c_uint = 0;
            // SAFETY: all out-pointers point at live buffers of the sizes passed.
            let id = unsafe {
                hdf5_sys::h5p::H5Pget_filter2(
                    dcpl,
                    idx as c_uint,
                    &mut flags,
                    &mut cd_n,
                    cd.as_mut_ptr(),
                    name.len(),
                    name.as_mut_ptr(),
                    &mut config,
                )
            };
            if id < 0 {
                err = Some(format!("cannot read filter {idx} of the pipeline"));
                break;
            }
            // SAFETY: HDF5 NUL-terminates the name within the buffer we gave it.
            let name = unsafe { CStr::from_ptr(name.as_ptr()) }
                .to_string_lossy()
                .into_owned();
            out.push(FilterSpec {
                id,
                cd_values: cd[..cd_n.min(cd.len())].to_vec(),
                name,
            });
        }
        // SAFETY: dcpl is ours to close.
        unsafe { hdf5_sys::h5p::H5Pclose(dcpl) };
        match err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    })
}

/// File address of a contiguous dataset's data, `None` when no storage was allocated.
pub(crate) fn contiguous_offset(ds: &hdf5::Dataset) -> Option<u64> {
    ds.offset()
}

/// One chunk as enumerated by `H5Dchunk_iter`: logical offset in elements, filter mask, file
/// address and stored size.
#[derive(Debug, Clone)]
pub(crate) struct RawChunk {
    pub offset: Vec<u64>,
    pub filter_mask: u32,
    pub addr: u64,
    pub size: u64,
}

/// Enumerate every written chunk of `ds` in one pass (`H5Dchunk_iter`).
pub(crate) fn visit_chunks(ds: &hdf5::Dataset) -> hdf5::Result<Vec<RawChunk>> {
    let mut out = Vec::new();
    ds.chunks_visit(|c| {
        out.push(RawChunk {
            offset: c.offset.to_vec(),
            filter_mask: c.filter_mask,
            addr: c.addr,
            size: c.size,
        });
        0
    })?;
    Ok(out)
}

/// What kind of link `name` (a path relative to `group`) is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LinkKind {
    /// A hard link (or anything HDF5 resolves without leaving the file).
    Hard,
    /// A soft link and its target path.
    Soft(String),
    /// An external link: `(file name, object path)` as stored.
    External(String, String),
}

/// The kind of link `name` in `group` (the last component is not traversed; the ones before it
/// are), or `None` when it does not exist.
pub(crate) fn link_kind(group: &hdf5::Group, name: &str) -> Option<LinkKind> {
    let cname = CString::new(name).ok()?;
    hdf5::sync::sync(|| {
        let mut info = hdf5_sys::h5l::H5L_info2_t::default();
        // SAFETY: valid group id, NUL-terminated name and a live info struct.
        let rc = unsafe {
            hdf5_sys::h5l::H5Lget_info2(
                group.id(),
                cname.as_ptr(),
                &mut info,
                hdf5_sys::h5p::H5P_DEFAULT,
            )
        };
        if rc < 0 {
            return None;
        }
        let (soft, external) = (
            info.type_ == hdf5_sys::h5l::H5L_type_t::H5L_TYPE_SOFT,
            info.type_ == hdf5_sys::h5l::H5L_type_t::H5L_TYPE_EXTERNAL,
        );
        if !soft && !external {
            return Some(LinkKind::Hard);
        }
        let mut buf = vec![0u8; 65536];
        // SAFETY: buf has buf.len() writable bytes; HDF5 writes at most buf.len() - 1 of them.
        let rc = unsafe {
            hdf5_sys::h5l::H5Lget_val(
                group.id(),
                cname.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len() - 1,
                hdf5_sys::h5p::H5P_DEFAULT,
            )
        };
        if rc < 0 {
            // A link we cannot read is treated as an unreadable external one: never followed.
            return Some(LinkKind::External(String::new(), String::new()));
        }
        if soft {
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            return Some(LinkKind::Soft(
                String::from_utf8_lossy(&buf[..end]).into_owned(),
            ));
        }
        let mut flags: c_uint = 0;
        let mut fname: *const c_char = std::ptr::null();
        let mut opath: *const c_char = std::ptr::null();
        // SAFETY: buf is zero-padded so both strings are NUL-terminated inside it; the returned
        // pointers point into buf, which outlives their use here.
        let rc = unsafe {
            hdf5_sys::h5l::H5Lunpack_elink_val(
                buf.as_ptr().cast(),
                buf.len(),
                &mut flags,
                &mut fname,
                &mut opath,
            )
        };
        if rc < 0 || fname.is_null() || opath.is_null() {
            return Some(LinkKind::External(String::new(), String::new()));
        }
        // SAFETY: both pointers are NUL-terminated strings inside buf (checked by HDF5).
        let (f, o) = unsafe {
            (
                CStr::from_ptr(fname).to_string_lossy().into_owned(),
                CStr::from_ptr(opath).to_string_lossy().into_owned(),
            )
        };
        Some(LinkKind::External(f, o))
    })
}

/// The target `(file name, object path)` of an external link `name` in `group`, or `None` when
/// the link is not external (hard or soft links).
pub(crate) fn external_link_target(group: &hdf5::Group, name: &str) -> Option<(String, String)> {
    match link_kind(group, name)? {
        LinkKind::External(f, o) => Some((f, o)),
        _ => None,
    }
}

/// Check that HDF5 may traverse `path` under `g`: every external link on the way (soft links
/// followed) must satisfy the policy of [`crate::guard::resolve_external`] (a regular file in
/// the folder of the file holding `g`) and exist. `Ok(false)` when a component does not exist.
///
/// Every HDF5 path this crate opens passes through here first (directly, or through
/// [`path_exists`]), because HDF5 itself would open whatever an external link names — a FIFO
/// there blocks the process for ever.
pub(crate) fn check_path(g: &hdf5::Group, path: &str) -> Result<bool> {
    check_path_depth(g, path, 0)
}

fn check_path_depth(g: &hdf5::Group, path: &str, depth: usize) -> Result<bool> {
    // HDF5 itself gives up after 16 nested soft links.
    if depth > 16 {
        return Ok(false);
    }
    let holder = PathBuf::from(g.filename());
    let mut cur = String::new();
    for part in path.trim_matches('/').split('/') {
        if part.is_empty() || part == "." {
            continue;
        }
        let parent = cur.clone();
        if !cur.is_empty() || path.starts_with('/') {
            cur.push('/');
        }
        cur.push_str(part);
        match link_kind(g, &cur) {
            None => return Ok(false),
            Some(LinkKind::Hard) => {}
            Some(LinkKind::Soft(target)) => {
                let full = if target.starts_with('/') {
                    target
                } else {
                    format!("{parent}/{target}")
                };
                if !check_path_depth(g, &full, depth + 1)? {
                    return Ok(false);
                }
            }
            Some(LinkKind::External(file, _)) => {
                let dir = crate::guard::folder_of(&holder);
                let target = crate::guard::resolve_external("open", &holder, &dir, &cur, &file)?;
                // HDF5 would search other folders (HDF5_EXT_PREFIX, the working directory) for
                // a target missing here: never let it.
                if !target.is_file() {
                    return Err(Error::source(
                        "open",
                        format!(
                            "external link {cur} -> \"{file}\" is refused: the target is not \
                             in the acquisition's folder {}",
                            dir.display()
                        ),
                    )
                    .with_file(&holder)
                    .with_expected(format!("an existing file {}", target.display()))
                    .with_found("no such file"));
                }
            }
        }
    }
    Ok(!cur.is_empty())
}

/// A small value read from a dataset or attribute, tolerant of its stored type.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    Num(Vec<f64>),
    Int(Vec<i128>),
    Str(String),
}

impl Value {
    pub fn f64(&self) -> Option<f64> {
        match self {
            Value::Num(v) => v.first().copied(),
            Value::Int(v) => v.first().map(|&x| x as f64),
            Value::Str(s) => s.trim().parse().ok(),
        }
    }
    pub fn f64_pair(&self) -> Option<(f64, f64)> {
        match self {
            Value::Num(v) if v.len() >= 2 => Some((v[0], v[1])),
            Value::Num(v) if v.len() == 1 => Some((v[0], v[0])),
            Value::Int(v) if v.len() >= 2 => Some((v[0] as f64, v[1] as f64)),
            Value::Int(v) if v.len() == 1 => Some((v[0] as f64, v[0] as f64)),
            _ => None,
        }
    }
    pub fn u64(&self) -> Option<u64> {
        match self {
            Value::Int(v) => v.first().and_then(|&x| u64::try_from(x).ok()),
            Value::Num(v) => v
                .first()
                .filter(|x| x.fract() == 0.0 && **x >= 0.0 && **x < 1.8e19)
                .map(|&x| x as u64),
            Value::Str(s) => s.trim().parse().ok(),
        }
    }
    pub fn ints(&self) -> Option<Vec<i128>> {
        match self {
            Value::Int(v) => Some(v.clone()),
            Value::Num(v) => v
                .iter()
                .map(|x| (x.fract() == 0.0).then_some(*x as i128))
                .collect(),
            Value::Str(_) => None,
        }
    }
    pub fn string(&self) -> Option<String> {
        match self {
            Value::Str(s) => Some(s.clone()),
            _ => None,
        }
    }
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            Value::Str(s) => serde_json::Value::String(s.clone()),
            Value::Int(v) if v.len() == 1 => int_json(v[0]),
            Value::Int(v) => serde_json::Value::Array(v.iter().map(|&x| int_json(x)).collect()),
            Value::Num(v) if v.len() == 1 => float_json(v[0]),
            Value::Num(v) => serde_json::Value::Array(v.iter().map(|&x| float_json(x)).collect()),
        }
    }
}

fn int_json(x: i128) -> serde_json::Value {
    if let Ok(v) = i64::try_from(x) {
        serde_json::Value::from(v)
    } else if let Ok(v) = u64::try_from(x) {
        serde_json::Value::from(v)
    } else {
        serde_json::Value::from(x as f64)
    }
}

fn float_json(x: f64) -> serde_json::Value {
    serde_json::Number::from_f64(x)
        .map(serde_json::Value::Number)
        .unwrap_or(serde_json::Value::Null)
}

/// Anything with a type and a raw read: datasets and attributes.
pub(crate) trait Readable {
    fn descriptor(&self) -> Option<TypeDescriptor>;
    fn n_elements(&self) -> usize;
    fn read_f64(&self) -> Option<Vec<f64>>;
    fn read_i64(&self) -> Option<Vec<i64>>;
    fn read_u64(&self) -> Option<Vec<u64>>;
    fn read_varlen_str(&self) -> Option<String>;
    fn read_fixed_str(&self, size: usize) -> Option<String>;
}

macro_rules! impl_readable {
    ($t:ty, $read_fn:path) => {
        impl Readable for $t {
            fn descriptor(&self) -> Option<TypeDescriptor> {
                self.dtype().ok()?.to_descriptor().ok()
            }
            fn n_elements(&self) -> usize {
                self.size()
            }
            fn read_f64(&self) -> Option<Vec<f64>> {
                self.read_raw::<f64>().ok()
            }
            fn read_i64(&self) -> Option<Vec<i64>> {
                self.read_raw::<i64>().ok()
            }
            fn read_u64(&self) -> Option<Vec<u64>> {
                self.read_raw::<u64>().ok()
            }
            fn read_varlen_str(&self) -> Option<String> {
                if let Ok(s) = self.read_scalar::<hdf5::types::VarLenUnicode>() {
                    return Some(s.as_str().to_string());
                }
                self.read_scalar::<hdf5::types::VarLenAscii>()
                    .ok()
                    .map(|s| s.as_str().to_string())
                    .or_else(|| {
                        self.read_raw::<hdf5::types::VarLenUnicode>()
                            .ok()
                            .and_then(|v| v.first().map(|s| s.as_str().to_string()))
                    })
            }
            fn read_fixed_str(&self, size: usize) -> Option<String> {
                let n = self.size().max(1);
                let dtype = self.dtype().ok()?;
                let mut buf = vec![0u8; size.checked_mul(n)?];
                let rc = hdf5::sync::sync(|| {
                    // SAFETY: buf holds n elements of the object's own fixed-size string type
                    // (size bytes each), which is the memory type passed; the ids are valid.
                    unsafe { $read_fn(self.id(), dtype.id(), buf.as_mut_ptr().cast::<c_void>()) }
                });
                if rc < 0 {
                    return None;
                }
                let first = &buf[..size];
                let end = first.iter().position(|&b| b == 0).unwrap_or(first.len());
                Some(
                    String::from_utf8_lossy(&first[..end])
                        .trim_end()
                        .to_string(),
                )
            }
        }
    };
}

unsafe fn dataset_read_all(id: hid_t, mem_type: hid_t, buf: *mut c_void) -> i32 {
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        hdf5_sys::h5d::H5Dread(
            id,
            mem_type,
            hdf5_sys::h5s::H5S_ALL,
            hdf5_sys::h5s::H5S_ALL,
            hdf5_sys::h5p::H5P_DEFAULT,
            buf,
        )
    }
}

unsafe fn attribute_read_all(id: hid_t, mem_type: hid_t, buf: *mut c_void) -> i32 {
    // SAFETY: forwarded from the caller's contract.
    unsafe { hdf5_sys::h5a::H5Aread(id, mem_type, buf) }
}

impl_readable!(hdf5::Dataset, dataset_read_all);
impl_readable!(hdf5::Attribute, attribute_read_all);

/// Read a small numeric or string value, whatever its stored type. `None` when absent, of an
/// unsupported type, or larger than `max_elems` elements.
pub(crate) fn read_value<R: Readable>(obj: &R, max_elems: usize) -> Option<Value> {
    let desc = obj.descriptor()?;
    let n = obj.n_elements();
    match desc {
        TypeDescriptor::Integer(_) | TypeDescriptor::Boolean | TypeDescriptor::Enum(_) => {
            if n > max_elems {
                return None;
            }
            obj.read_i64()
                .map(|v| Value::Int(v.into_iter().map(i128::from).collect()))
        }
        TypeDescriptor::Unsigned(_) => {
            if n > max_elems {
                return None;
            }
            obj.read_u64()
                .map(|v| Value::Int(v.into_iter().map(i128::from).collect()))
        }
        TypeDescriptor::Float(_) => {
            if n > max_elems {
                return None;
            }
            obj.read_f64().map(Value::Num)
        }
        TypeDescriptor::VarLenAscii | TypeDescriptor::VarLenUnicode => {
            obj.read_varlen_str().map(Value::Str)
        }
        TypeDescriptor::FixedAscii(size) | TypeDescriptor::FixedUnicode(size) => {
            obj.read_fixed_str(size).map(Value::Str)
        }
        _ => None,
    }
}

/// Read dataset `path` (relative to `base`) as a small value, if it exists (and may be
/// traversed, [`check_path`]).
pub(crate) fn dataset_value(base: &hdf5::Group, path: &str) -> Option<Value> {
    if !path_exists(base, path) {
        return None;
    }
    let ds = base.dataset(path).ok()?;
    read_value(&ds, 64)
}

/// Read attribute `name` of `loc` as a small value, if it exists.
pub(crate) fn attr_value(loc: &hdf5::Location, name: &str) -> Option<Value> {
    if !loc.attr_names().ok()?.iter().any(|n| n == name) {
        return None;
    }
    let a = loc.attr(name).ok()?;
    read_value(&a, 64)
}

/// The `units` attribute of dataset `path`, lower-cased.
pub(crate) fn units_of(base: &hdf5::Group, path: &str) -> Option<String> {
    if !path_exists(base, path) {
        return None;
    }
    let ds = base.dataset(path).ok()?;
    attr_value(&ds, "units")?
        .string()
        .map(|s| s.trim().to_ascii_lowercase())
}

/// True when `path` exists under `g` (every intermediate link must exist too) and may be
/// traversed: a path through an external link that [`check_path`] refuses reads as absent
/// (metadata reads skip it; the frame datasets call [`check_path`] to report the refusal).
pub(crate) fn path_exists(g: &hdf5::Group, path: &str) -> bool {
    check_path(g, path).unwrap_or(false)
}
