//! File formats besides Dectris/plain HDF5: recognising a file by its content, and one module
//! per format that turns it into the same [`Source`] (files, shapes, chunk records, metadata)
//! the CPU and CUDA engines read. docs/formats.md has a section per format.
//!
//! * [`npy`]: NumPy `.npy` (read in place with positional reads, never loaded whole);
//! * [`raw`]: a generic raw binary described by a [`RawLayout`];
//! * [`mib`]: Quantum Detectors Merlin `.mib` (+ `.hdr`);
//! * [`empad`]: EMPAD `.raw` + `.xml`;
//! * [`dm`]: Gatan Digital Micrograph `.dm4`/`.dm3`;
//! * [`host`]: the host-side decoding these (and compressed HDF5) need.
//!
//! HDF5 files (Dectris masters, plain datasets, hyperspy `.hspy`, py4DSTEM/emdfile `.h5`/`.emd`)
//! go through `open.rs`.

pub mod dm;
pub mod empad;
pub(crate) mod host;
pub mod mib;
pub(crate) mod mib_raw;
pub mod npy;
pub mod raw;

pub use host::HostDecode;
pub use raw::RawLayout;

use crate::meta::MasterInfo;
use crate::{guard, ChunkCodec, ChunkRecord, MissingFrames, OpenOptions, Source, SourceKind};
use qem_core::{DType, Error, FileIdentity, Metadata, Result, Shape2};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

const OP: &str = "open";

/// A file format [`Source::open`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// HDF5: Dectris master, plain 3-D/4-D dataset, hyperspy `.hspy`, py4DSTEM/emdfile.
    Hdf5,
    /// A `.qem` container (loaded by the façade, not by this crate).
    Qem,
    /// NumPy `.npy`.
    Npy,
    /// Generic raw binary ([`RawLayout`]).
    Raw,
    /// Quantum Detectors Merlin `.mib` (or its `.hdr`).
    Mib,
    /// EMPAD `.raw` (or its `.xml`).
    Empad,
    /// Gatan `.dm4`/`.dm3`.
    Dm,
}

/// The names `format=` accepts, as listed in errors.
pub const SUPPORTED: &str = "hdf5 (Dectris *_master.h5, plain HDF5, hyperspy .hspy, \
     py4DSTEM/emdfile .h5/.emd), qem (.qem), npy (.npy), raw (raw binary: needs shape and raw_dtype), \
     mib (Merlin .mib/.hdr: U08/U16/U32 frames, R64 raw 1/6/12/24-bit), empad (EMPAD .raw + .xml), \
     dm4 (Gatan .dm4/.dm3 3-D/4-D stacks: uint8/16/32, float32)";

impl Format {
    /// The name `format=` takes.
    pub fn name(self) -> &'static str {
        match self {
            Format::Hdf5 => "hdf5",
            Format::Qem => "qem",
            Format::Npy => "npy",
            Format::Raw => "raw",
            Format::Mib => "mib",
            Format::Empad => "empad",
            Format::Dm => "dm4",
        }
    }
}

impl FromStr for Format {
    type Err = Error;
    fn from_str(s: &str) -> Result<Format> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "hdf5" | "h5" | "hspy" | "emd" | "dectris" | "py4dstem" | "emdfile" => Format::Hdf5,
            "qem" => Format::Qem,
            "npy" | "numpy" => Format::Npy,
            "raw" | "binary" => Format::Raw,
            "mib" | "merlin" => Format::Mib,
            "empad" => Format::Empad,
            "dm4" | "dm3" | "dm" | "gatan" => Format::Dm,
            other => {
                return Err(
                    Error::invalid("parse format", format!("unknown format \"{other}\""))
                        .with_expected(SUPPORTED)
                        .with_found(other.to_string()),
                )
            }
        })
    }
}

/// Consent to read float32 frames as counts, with the divisor: a frame value `v` becomes the
/// count `round(v / scale)` (half away from zero), values that round below zero read 0 (their
/// number is recorded), and NaN, infinities and counts above `u32::MAX` are decode errors.
#[derive(Debug, Clone, Copy)]
pub struct FloatScale(pub f64);

impl PartialEq for FloatScale {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}
impl Eq for FloatScale {}

/// The caller's float scale, or the error that says how to give it.
pub(crate) fn require_float_scale(path: &Path, opts: &OpenOptions) -> Result<f64> {
    match opts.float_scale {
        Some(FloatScale(s)) if s.is_finite() && s > 0.0 => Ok(s),
        Some(FloatScale(s)) => Err(
            Error::invalid(OP, "float_scale must be finite and positive")
                .with_file(path)
                .with_expected("float_scale > 0")
                .with_found(s.to_string()),
        ),
        None => Err(Error::invalid(
            OP,
            "the frames are floating point (float32 or float64); counts are integers, so pass \
             float_scale (e.g. 1.0: counts = round(value / float_scale), negatives read 0; \
             docs/formats.md \"Float32 counts\")",
        )
        .with_file(path)
        .with_expected("float_scale for a float source")
        .with_found("float frames, no float_scale")),
    }
}

/// Recognise `path` by its first bytes (and, for EMPAD and Merlin headers, its name).
pub fn detect(path: &Path) -> Result<Format> {
    let f = guard::open_regular(OP, path, "source file")?;
    let mut head = [0u8; 16];
    let n = guard::read_up_to(&f, &mut head).map_err(|e| Error::io(OP, path, &e))?;
    let head = &head[..n];
    const HDF5: &[u8] = b"\x89HDF\r\n\x1a\n";
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase())
        .unwrap_or_default();
    if head.starts_with(HDF5) || hdf5_after_userblock(&f) {
        return Ok(Format::Hdf5);
    }
    if head.starts_with(b"QEM4DSTM") {
        return Ok(Format::Qem);
    }
    if head.starts_with(b"\x93NUMPY") {
        return Ok(Format::Npy);
    }
    if head.starts_with(b"MQ1,") || (ext == "hdr" && head.starts_with(b"HDR")) {
        return Ok(Format::Mib);
    }
    if head.len() >= 4
        && matches!(
            u32::from_be_bytes([head[0], head[1], head[2], head[3]]),
            3 | 4
        )
        && matches!(ext.as_str(), "dm4" | "dm3")
    {
        return Ok(Format::Dm);
    }
    if ext == "xml" && empad::is_empad_xml(path) {
        return Ok(Format::Empad);
    }
    if ext == "raw" && empad::xml_for_raw(path).is_some() {
        return Ok(Format::Empad);
    }
    let shown: Vec<String> = head.iter().take(8).map(|b| format!("{b:02x}")).collect();
    Err(Error::source(OP, "unrecognised file format")
        .with_file(path)
        .with_expected(format!(
            "one of: {SUPPORTED}; pass format= to choose (a generic raw file needs format=\"raw\")"
        ))
        .with_found(format!("first bytes {}", shown.join(" "))))
}

/// HDF5 allows a user block of 512·2^k bytes before the signature.
fn hdf5_after_userblock(f: &std::fs::File) -> bool {
    use std::os::unix::fs::FileExt;
    let mut at = 512u64;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    while at + 8 <= len && at <= 1 << 20 {
        let mut sig = [0u8; 8];
        if f.read_exact_at(&mut sig, at).is_ok() && &sig == b"\x89HDF\r\n\x1a\n" {
            return true;
        }
        at *= 2;
    }
    false
}

/// A Dectris data shard (`<prefix>_data_NNNNNN.h5`) is not an acquisition: its master has the
/// metadata, the scan shape and the other shards. Refuse it, naming the master.
pub(crate) fn check_not_dectris_shard(path: &Path) -> Result<()> {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return Ok(());
    };
    let Some(stem) = name
        .strip_suffix(".h5")
        .or_else(|| name.strip_suffix(".hdf5"))
    else {
        return Ok(());
    };
    let Some(pos) = stem.rfind("_data_") else {
        return Ok(());
    };
    let digits = &stem[pos + 6..];
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Ok(());
    }
    let master = guard::folder_of(path).join(format!("{}_master.h5", &stem[..pos]));
    let exists = master.is_file();
    Err(Error::source(
        OP,
        format!(
            "this is a Dectris data shard; open the *_master.h5 ({}{})",
            master.display(),
            if exists {
                ""
            } else {
                ", not found next to the shard"
            }
        ),
    )
    .with_file(path)
    .with_expected("the acquisition's *_master.h5")
    .with_found("a data shard (<prefix>_data_NNNNNN.h5)"))
}

/// Open `path` as `format` (not HDF5).
pub(crate) fn open(format: Format, path: &Path, opts: &OpenOptions) -> Result<Source> {
    match format {
        Format::Npy => npy::open(path, opts),
        Format::Raw => raw::open(path, opts),
        Format::Mib => mib::open(path, opts),
        Format::Empad => empad::open(path, opts),
        Format::Dm => dm::open(path, opts),
        Format::Qem => {
            Err(Error::invalid(OP, "a .qem file is read by qem::load, not qem_io").with_file(path))
        }
        Format::Hdf5 => Err(Error::internal(OP, "HDF5 is opened by open.rs").with_file(path)),
    }
}

/// Frames stored one after another at a fixed stride in one file.
#[derive(Debug, Clone)]
pub(crate) struct Strided {
    /// Byte offset of frame 0's pixels.
    pub first: u64,
    /// Bytes from one frame's pixels to the next frame's.
    pub stride: u64,
    /// Stored bytes of one frame's pixels.
    pub stored_frame_bytes: u64,
    /// Frames.
    pub n_frames: u64,
}

/// What a format module found; [`build`] makes the [`Source`].
pub(crate) struct Found {
    pub kind: SourceKind,
    pub data_file: PathBuf,
    /// Files read besides `data_file` (headers), for provenance.
    pub side_files: Vec<PathBuf>,
    pub dtype: DType,
    pub detector: Shape2,
    pub frames: Strided,
    /// Scan shape from the array's shape (4-D `.npy`, raw `shape=`).
    pub array_scan: Option<Shape2>,
    /// Scan shape recorded in a header.
    pub recorded_scan: Option<Shape2>,
    pub elem: host::ElemConv,
    pub metadata: Metadata,
}

/// A file that is one C-order array of frames (`.npy`, raw binary).
pub(crate) struct ArrayFile {
    pub dtype: DType,
    pub elem: host::ElemConv,
    /// Frames in the array.
    pub n_frames: u64,
    /// Scan shape of a 4-D array.
    pub array_scan: Option<Shape2>,
    pub detector: Shape2,
    /// Bytes of one frame's pixels.
    pub frame_bytes: u64,
}

impl ArrayFile {
    /// The array of NumPy element type `typestr` and `shape` (`(N, k_r, k_c)` or
    /// `(R, C, k_r, k_c)`); an unusable shape is a `kind` error naming `what`.
    pub fn new(
        typestr: &str,
        shape: &[u64],
        path: &Path,
        what: &str,
        kind: qem_core::ErrorKind,
    ) -> Result<ArrayFile> {
        let (dtype, elem, es) = elem_from_typestr(typestr, path)?;
        let (n_frames, array_scan, detector) = split_shape(shape, path, what, kind)?;
        Ok(ArrayFile {
            dtype,
            elem,
            n_frames,
            array_scan,
            detector,
            frame_bytes: (detector.len() as u64).saturating_mul(es as u64),
        })
    }

    /// The [`Source`] of the array in `path` itself: frames from byte `first`, `stride` bytes
    /// apart; `layout` is the metadata entry (key, value) recording how the file is laid out.
    pub fn build(
        self,
        path: &Path,
        opts: &OpenOptions,
        kind: SourceKind,
        (first, stride): (u64, u64),
        layout: (&str, serde_json::Value),
    ) -> Result<Source> {
        let mut metadata = Metadata::default();
        metadata.extra.insert(layout.0.into(), layout.1);
        build(
            path,
            opts,
            Found {
                kind,
                data_file: path.to_path_buf(),
                side_files: Vec::new(),
                dtype: self.dtype,
                detector: self.detector,
                frames: Strided {
                    first,
                    stride,
                    stored_frame_bytes: self.frame_bytes,
                    n_frames: self.n_frames,
                },
                array_scan: self.array_scan,
                recorded_scan: None,
                elem: self.elem,
                metadata,
            },
        )
    }
}

/// Check the extent, resolve the scan shape and build the [`Source`] with one record per frame.
pub(crate) fn build(path: &Path, opts: &OpenOptions, found: Found) -> Result<Source> {
    let Found {
        kind,
        data_file,
        side_files,
        dtype,
        detector,
        frames,
        array_scan,
        recorded_scan,
        mut elem,
        mut metadata,
    } = found;
    let file_size = guard::check_regular_file(OP, &data_file, "data file")?.len();
    let last_end = frames
        .n_frames
        .checked_sub(1)
        .map(|k| {
            k.checked_mul(frames.stride)
                .and_then(|o| o.checked_add(frames.first))
                .and_then(|o| o.checked_add(frames.stored_frame_bytes))
        })
        .unwrap_or(Some(frames.first));
    match last_end {
        Some(end) if end <= file_size => {}
        _ => {
            let whole = file_size
                .saturating_sub(frames.first)
                .saturating_add(frames.stride - frames.stored_frame_bytes.min(frames.stride))
                / frames.stride.max(1);
            return Err(
                Error::source(OP, "the file is shorter than its frames (truncated?)")
                    .with_file(&data_file)
                    .with_frame(whole.min(frames.n_frames))
                    .with_expected(format!(
                        "{} frames: at least {} bytes",
                        frames.n_frames,
                        last_end.map_or("more than 2^64".to_string(), |e| e.to_string())
                    ))
                    .with_found(format!("{file_size} bytes ({whole} whole frames)")),
            );
        }
    }
    match elem {
        host::ElemConv::Float32 { big_endian, .. } => {
            elem = host::ElemConv::Float32 {
                scale: require_float_scale(path, opts)?,
                big_endian,
            };
        }
        host::ElemConv::Float64 { big_endian, .. } => {
            elem = host::ElemConv::Float64 {
                scale: require_float_scale(path, opts)?,
                big_endian,
            };
        }
        _ => {}
    }
    if let Some(s) = opts.scan_shape {
        s.try_len(qem_core::ErrorKind::InvalidArgument, OP, "given scan_shape")
            .map_err(|e| e.with_file(path))?;
    }
    let explicit = match (opts.scan_shape, array_scan) {
        (Some(s), Some(a)) if s.len() != a.len() => {
            return Err(
                Error::source(OP, "scan_shape does not match the array's scan axes")
                    .with_file(path)
                    .with_expected(format!("{} positions ({a})", a.len()))
                    .with_found(format!("{} positions ({s})", s.len())),
            )
        }
        (s, _) => s,
    };
    let (scan_shape, origin) = crate::open::resolve_scan_shape(
        path,
        frames.n_frames,
        explicit,
        array_scan,
        recorded_scan,
        &MasterInfo::default(),
    )?;
    let frame_bytes = detector.len().saturating_mul(dtype.size());
    let host = (elem != host::ElemConv::Same).then(|| {
        Arc::new(HostDecode::new(
            Vec::new(),
            None,
            elem,
            frames.stored_frame_bytes as usize,
            frame_bytes,
        ))
    });
    let chunks: Vec<ChunkRecord> = (0..frames.n_frames)
        .map(|i| ChunkRecord {
            file: 0,
            offset: frames.first + i * frames.stride,
            size: frames.stored_frame_bytes,
            filter_mask: 0,
            first_frame: i,
            frames_in_chunk: 1,
            valid_frames: 1,
        })
        .collect();
    let mut files = vec![FileIdentity::of(&data_file)?];
    for f in &side_files {
        files.push(FileIdentity::of(f)?);
    }
    let handles = vec![guard::open_regular(OP, &data_file, "data file")?];
    metadata.detector_shape = Some(detector);
    metadata.dtype = Some(dtype);
    metadata.n_frames = Some(frames.n_frames);
    metadata.scan_shape = Some(scan_shape);
    metadata.scan_shape_origin = Some(origin);
    if let Some(h) = &host {
        metadata.extra.insert(
            "host_decode".into(),
            serde_json::Value::String(h.describe()),
        );
    }
    Ok(Source {
        kind,
        path: path.to_path_buf(),
        files,
        dataset_path: String::new(),
        dtype,
        detector_shape: detector,
        n_frames: frames.n_frames,
        scan_shape,
        metadata,
        pixel_mask: None,
        codec: ChunkCodec::Raw,
        chunks,
        missing_frames: MissingFrames::default(),
        index_from_cache: false,
        handles,
        host,
    })
}

/// Element type of a stored array from a NumPy type string (`"<u2"`, `"uint16"`, `">f4"`...):
/// the source dtype and the conversion.
pub(crate) fn elem_from_typestr(s: &str, path: &Path) -> Result<(DType, host::ElemConv, usize)> {
    let canon = match s.trim() {
        "uint8" | "u8" => "|u1",
        "uint16" | "u16" => "<u2",
        "uint32" | "u32" => "<u4",
        "float32" | "f32" => "<f4",
        other => other,
    };
    let canon = if canon.len() == 2 {
        format!("<{canon}")
    } else {
        canon.to_string()
    };
    let ts: npyz::TypeStr = canon.parse().map_err(|e| {
        Error::invalid(OP, format!("cannot parse the element type: {e}"))
            .with_file(path)
            .with_expected(
                "uint8, uint16, uint32 or float32 (numpy type strings like <u2, >u2, <f4)",
            )
            .with_found(s.to_string())
    })?;
    let big = ts.endianness() == npyz::Endianness::Big;
    let size = ts.size_field() as usize;
    let (dtype, elem) = match (ts.type_char(), size) {
        (npyz::TypeChar::Uint, 1) => (DType::U8, host::ElemConv::Same),
        (npyz::TypeChar::Uint, 2 | 4) => (
            if size == 2 { DType::U16 } else { DType::U32 },
            if big {
                host::ElemConv::Swap(size)
            } else {
                host::ElemConv::Same
            },
        ),
        (npyz::TypeChar::Float, 4) => (
            DType::U32,
            host::ElemConv::Float32 {
                scale: 1.0,
                big_endian: big,
            },
        ),
        _ => {
            return Err(Error::source(OP, "unsupported element type")
                .with_file(path)
                .with_expected("uint8, uint16, uint32 or float32")
                .with_found(s.to_string()))
        }
    };
    Ok((dtype, elem, size))
}

/// Split a 3-D `(N, k_r, k_c)` or 4-D `(R, C, k_r, k_c)` shape.
pub(crate) fn split_shape(
    shape: &[u64],
    path: &Path,
    what: &str,
    kind: qem_core::ErrorKind,
) -> Result<(u64, Option<Shape2>, Shape2)> {
    let us = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    let (n, scan, det) = match *shape {
        [n, r, c] => (n, None, Shape2::new(us(r), us(c))),
        [a, b, r, c] => (
            a.saturating_mul(b),
            Some(Shape2::new(us(a), us(b))),
            Shape2::new(us(r), us(c)),
        ),
        _ => {
            return Err(Error::new(
                kind,
                OP,
                format!("{what} has the wrong number of dimensions"),
            )
            .with_file(path)
            .with_expected("(N, k_r, k_c) or (R, C, k_r, k_c)")
            .with_found(format!("{shape:?}")))
        }
    };
    if det.is_empty() || n == 0 {
        return Err(Error::new(kind, OP, format!("{what} is empty"))
            .with_file(path)
            .with_expected("frames > 0, k_r > 0, k_c > 0")
            .with_found(format!("{shape:?}")));
    }
    Ok((n, scan, det))
}
