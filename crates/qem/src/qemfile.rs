//! `.qem` files: an ENCODED dataset saved ([`save`]) and reopened ([`read_qem`], or
//! [`crate::load`] of a `.qem` path) without re-encoding.
//!
//! The container (`qem_codec::qem_file`) holds four sections; this module fills them:
//!
//! * Metadata: JSON `{format: "quantem.gpu encoded counts", format_version: 1, shape:
//!   [R_r, R_c, k_r, k_c], dtype: "u8"|"u16", scan_shape: [R_r, R_c], detector_shape: [k_r, k_c],
//!   metadata: <Metadata>, provenance: <Provenance of the saved dataset, source files included>,
//!   codec: {name: "rans-counts v2", version: 2}}`;
//! * CodecTables: the counts model (`CountsModel::to_bytes`);
//! * StreamIndex / Streams: one rANS stream per frame, in frame order (tag 1 = one frame), the
//!   arena of [`qem_cpu::EncodedFrames`] byte for byte.
//!
//! A file is recognised by its magic, not its name. Every container error (truncated, bit
//! flipped, wrong version, wrong magic) becomes a typed error naming the file and the section;
//! the Streams checksum is verified on every [`crate::load`] (CRC-32C, a few GB/s; a flipped
//! extra bit would otherwise decode to a plausible wrong count).

use crate::backend::Backend;
use crate::dataset::{narrow, Dataset, Representation, Storage};
use crate::load::{finish, gpu_params, plan_load, Loaded, Request, SourceFacts};
use qem_codec::qem_file::{QemFile, QemFileError, QemWriter, MAGIC};
use qem_codec::rans::CountsModel;
use qem_core::{
    checked_product, fnv1a64, DType, DtypeRequest, Error, ErrorKind, FileIdentity, Metadata,
    Progress, Provenance, Result, Shape2, StageTiming, FNV_OFFSET,
};
use qem_cpu::EncodedFrames;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The `format` field of the Metadata section of a quantem.gpu `.qem` file.
pub const QEM_FORMAT_NAME: &str = "quantem.gpu encoded counts";
/// The `format_version` this build writes and reads.
pub const QEM_FORMAT_VERSION: u64 = 1;

/// A container error as a library error naming `path`: IO errors are `Io`, checksum mismatches
/// `Decode`, every other structural problem (truncated, wrong magic, wrong version, malformed
/// section) `Source`. The message names the section.
pub fn qem_file_error(op: &str, path: &Path, e: QemFileError) -> Error {
    let detail = e.to_string();
    let err = match &e {
        QemFileError::Io { path: p, .. } => {
            return Error::new(ErrorKind::Io, op, detail).with_file(p);
        }
        QemFileError::Checksum {
            expected, found, ..
        } => Error::decode(op, detail)
            .with_expected(format!("CRC-32C {expected:#010x}"))
            .with_found(format!("CRC-32C {found:#010x}")),
        QemFileError::Version { expected, found } => Error::source(op, detail)
            .with_expected(format!("format major version {expected} (header)"))
            .with_found(format!("major version {found}")),
        QemFileError::Truncated {
            needed, available, ..
        } => Error::source(op, detail)
            .with_expected(format!("at least {needed} bytes"))
            .with_found(format!("{available} bytes")),
        QemFileError::BadMagic { found } => Error::source(op, format!("header: {detail}"))
            .with_expected(String::from_utf8_lossy(&MAGIC).into_owned())
            .with_found(format!("{found:02x?}")),
        QemFileError::Write { .. } => Error::new(ErrorKind::Io, op, detail),
        _ => Error::source(op, detail),
    };
    err.with_file(path)
}

/// Whether `path` is a `.qem` file (by its magic). A file named `*.qem` without the magic is a
/// `Source` error; a file that cannot be opened is left to the HDF5 opener to report.
///
/// Anything that is not a regular file (a FIFO, device, directory, symlink loop) is "not a
/// `.qem` file" here without being opened (an `open` of a FIFO would block), and the HDF5
/// opener then refuses it with a typed error.
pub fn is_qem_file(path: &Path) -> Result<bool> {
    let Ok(f) = qem_io::open_regular("open", path, "file") else {
        return Ok(false);
    };
    let mut head = [0u8; 8];
    let got = qem_io::read_up_to(f, &mut head).map_err(|e| Error::io("open", path, &e))?;
    if got == head.len() && head == MAGIC {
        return Ok(true);
    }
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("qem"))
    {
        return Err(Error::source(
            "open .qem",
            "header: not a .qem file (wrong magic at byte 0)",
        )
        .with_file(path)
        .with_expected(String::from_utf8_lossy(&MAGIC).into_owned())
        .with_found(format!("{:02x?}", &head[..got])));
    }
    Ok(false)
}

/// What [`save`] wrote.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SaveSummary {
    /// The file written.
    pub path: PathBuf,
    /// Its length in bytes.
    pub file_bytes: u64,
    /// Frames (streams) stored.
    pub n_frames: u64,
    /// Bytes of the encoded form (streams + index + model).
    pub encoded_bytes: u64,
    /// Bytes of the same data dense.
    pub dense_bytes: u64,
    /// Seconds spent encoding (0 when the dataset was already ENCODED).
    pub encode_seconds: f64,
    /// Seconds of the whole save (encode + write + fsync + rename).
    pub seconds: f64,
}

/// Write `ds` as a `.qem` file at `path` (atomically: a temporary file renamed into place).
///
/// An ENCODED dataset is written as it is; a dense one (`u8`/`u16`) is encoded first with the
/// same model fitting as an ENCODED load. `u32` data is refused (ENCODED holds counts up to
/// 65535).
pub fn save(ds: &Dataset, path: &Path, progress: &dyn Progress) -> Result<SaveSummary> {
    let t0 = Instant::now();
    let op = "save .qem";
    let mut encode_seconds = 0.0;
    let mut fit_frames = 0;
    let owned: EncodedFrames;
    let frames: &EncodedFrames = match &ds.storage {
        Storage::CpuEncoded(e) => e,
        Storage::CudaEncoded(e) => {
            // The device streams, in frame order, as the host holder (no re-encode).
            let (index, streams) = e.to_host()?;
            owned =
                EncodedFrames::from_parts(e.model().clone(), ds.detector_shape, index, streams)?;
            &owned
        }
        Storage::Closed => return Err(Error::invalid(op, "the dataset has been closed")),
        Storage::CpuDense(_) | Storage::CudaDense(_) => {
            if ds.dtype == DType::U32 {
                return Err(crate::encode::u32_refusal(op).with_file(path));
            }
            let t = Instant::now();
            let (e, fit) = match &ds.storage {
                Storage::CpuDense(a) => {
                    crate::encode::encode_dense(a, ds.detector_shape, progress)?
                }
                _ => crate::encode::encode_dense(&ds.to_host()?, ds.detector_shape, progress)?,
            };
            owned = e;
            fit_frames = fit;
            encode_seconds = t.elapsed().as_secs_f64();
            &owned
        }
    };
    let dense_bytes = ds.nbytes_dense();
    let mut provenance = ds.provenance.clone();
    if provenance.codec.is_none() {
        provenance.codec = Some(crate::encode::codec_info(
            frames.model(),
            frames.nbytes(),
            fit_frames,
            dense_bytes,
            None,
        ));
    }
    provenance.representation = Some(Representation::Encoded.name().to_string());
    let [a, b, c, d] = ds.shape();
    let meta = serde_json::json!({
        "format": QEM_FORMAT_NAME,
        "format_version": QEM_FORMAT_VERSION,
        "shape": [a, b, c, d],
        "dtype": ds.dtype,
        "scan_shape": [a, b],
        "detector_shape": [c, d],
        "metadata": ds.metadata,
        // The metadata describes the saved (loaded) grid; files without this key hold the
        // source's metadata (before this key existed) and are converted on open.
        "metadata_grid": "loaded",
        "provenance": provenance,
        "codec": {"name": qem_cpu::CODEC_NAME, "version": qem_cpu::CODEC_VERSION},
    });
    let err = |e| qem_file_error(op, path, e);
    remove_stale_temporaries(path);
    let mut w = QemWriter::create(path).map_err(err)?;
    w.metadata(meta);
    w.codec_tables(frames.model().to_bytes());
    let n = frames.n_frames();
    progress.begin("save", n as u64);
    let step = (n / 200).max(1);
    let result = (|| -> Result<()> {
        for i in 0..n {
            w.stream_tagged(frames.stream(i)?, qem_cpu::STREAM_TAG_ONE_FRAME)
                .map_err(err)?;
            if (i + 1) % step == 0 {
                progress.advance(step as u64);
                if progress.cancelled() {
                    return Err(Error::invalid(op, "cancelled by the caller"));
                }
            }
        }
        progress.advance((n % step) as u64);
        Ok(())
    })();
    progress.end();
    result?; // dropping `w` removes the temporary file
    let written = w.finish().map_err(err)?;
    Ok(SaveSummary {
        path: written.path,
        file_bytes: written.file_bytes,
        n_frames: n as u64,
        encoded_bytes: frames.nbytes(),
        dense_bytes,
        encode_seconds,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Remove `<name>.tmp-<pid>-<n>` files next to `path` left by saves whose process is gone
/// (killed mid-way: the writer's own cleanup never ran). A temporary of a live process (this
/// one included: another thread may be saving) is left alone, so is anything whose name does
/// not parse; the file at `path` itself is never touched. Best effort: a failure to list or
/// remove is ignored (the save goes on; the next one tries again).
fn remove_stale_temporaries(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let prefix = format!("{name}.tmp-");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(rest) = file_name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let Some((pid, n)) = rest.split_once('-') else {
            continue;
        };
        let (Ok(pid), true) = (pid.parse::<u32>(), n.bytes().all(|b| b.is_ascii_digit())) else {
            continue;
        };
        let alive = pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists();
        let is_file = entry.file_type().is_ok_and(|t| t.is_file());
        if !alive && is_file {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Options of [`read_qem`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QemReadParams {
    /// Check the Streams section's CRC-32C at open (default true). Without it a corrupt stream
    /// is still caught by the rANS decoder's own checks when decoded, except flipped raw extra
    /// bits (they decode to another count), so leave it on unless the streams are checked
    /// elsewhere.
    pub verify_streams: bool,
}

impl Default for QemReadParams {
    fn default() -> Self {
        QemReadParams {
            verify_streams: true,
        }
    }
}

/// A validated `.qem` file: the host encoded frames and what the file says about them.
#[derive(Debug)]
pub struct QemContents {
    /// Every frame, index and arena as stored (no re-encode), model from the CodecTables.
    pub frames: EncodedFrames,
    /// Scan grid.
    pub scan_shape: Shape2,
    /// Detector frame shape.
    pub detector_shape: Shape2,
    /// Element type of the dataset (`u8` frames are stored as `u16` counts).
    pub dtype: DType,
    /// Metadata of the original source.
    pub metadata: Metadata,
    /// Provenance of the dataset that was saved (its source files, regions, bins, codec).
    pub provenance: Provenance,
    /// Identity of the `.qem` file.
    pub file: FileIdentity,
    /// Open and verify timings.
    pub timings: Vec<StageTiming>,
}

fn meta_error(path: &Path, what: &str, expected: &str, found: String) -> Error {
    Error::source("open .qem", format!("Metadata section: {what}"))
        .with_file(path)
        .with_expected(expected.to_string())
        .with_found(found)
}

fn shape_field(path: &Path, meta: &serde_json::Value, key: &str) -> Result<Shape2> {
    let v = &meta[key];
    match v
        .as_array()
        .map(|a| a.iter().map(|x| x.as_u64()).collect::<Vec<_>>())
    {
        Some(a) if a.len() == 2 && a.iter().all(|x| x.is_some_and(|n| n > 0)) => {
            let s = Shape2::new(a[0].unwrap_or(0) as usize, a[1].unwrap_or(0) as usize);
            s.try_len(
                ErrorKind::Source,
                "open .qem",
                &format!("Metadata section: {key}"),
            )
            .map_err(|e| e.with_file(path))?;
            Ok(s)
        }
        _ => Err(meta_error(
            path,
            key,
            "[rows, cols] of positive integers",
            v.to_string(),
        )),
    }
}

/// Open and validate a `.qem` file and rebuild its host [`EncodedFrames`] (for the CPU engine,
/// or to upload to a GPU as they are).
pub fn read_qem(path: &Path, params: &QemReadParams) -> Result<QemContents> {
    let op = "open .qem";
    let t = Instant::now();
    qem_io::check_regular_file(op, path, ".qem file")?;
    let mut f = QemFile::open_lazy(path).map_err(|e| qem_file_error(op, path, e))?;
    let mut timings = vec![StageTiming::new(
        "read .qem + check header, table, small sections",
        t.elapsed().as_secs_f64(),
    )];
    if params.verify_streams {
        let t = Instant::now();
        f.verify().map_err(|e| qem_file_error(op, path, e))?;
        timings.push(StageTiming::new(
            "verify Streams CRC-32C",
            t.elapsed().as_secs_f64(),
        ));
    }
    let meta = f.metadata();
    let format = meta["format"].as_str().unwrap_or("");
    if format != QEM_FORMAT_NAME {
        return Err(meta_error(
            path,
            "format",
            QEM_FORMAT_NAME,
            meta["format"].to_string(),
        ));
    }
    if meta["format_version"].as_u64() != Some(QEM_FORMAT_VERSION) {
        return Err(meta_error(
            path,
            "format_version",
            &QEM_FORMAT_VERSION.to_string(),
            meta["format_version"].to_string(),
        ));
    }
    let codec = meta["codec"]["name"].as_str().unwrap_or("");
    if codec != qem_cpu::CODEC_NAME {
        return Err(meta_error(
            path,
            "codec name",
            qem_cpu::CODEC_NAME,
            meta["codec"]["name"].to_string(),
        ));
    }
    let scan_shape = shape_field(path, meta, "scan_shape")?;
    let detector_shape = shape_field(path, meta, "detector_shape")?;
    // The dense size must exist as a number: it sizes a decode and the provenance.
    checked_product(
        ErrorKind::Source,
        op,
        "Metadata section: the dense size (scan x detector x 2 bytes)",
        &[
            ("scan positions", scan_shape.len() as u64),
            ("pixels per frame", detector_shape.len() as u64),
            ("bytes per count", 2),
        ],
    )
    .map_err(|e| e.with_file(path))?;
    let dtype: DType = serde_json::from_value(meta["dtype"].clone()).map_err(|_| {
        meta_error(
            path,
            "dtype",
            "\"u8\" or \"u16\"",
            meta["dtype"].to_string(),
        )
    })?;
    if dtype == DType::U32 {
        return Err(meta_error(
            path,
            "dtype",
            "\"u8\" or \"u16\"",
            "\"u32\"".into(),
        ));
    }
    let metadata: Metadata = serde_json::from_value(meta["metadata"].clone())
        .map_err(|e| meta_error(path, "metadata", "a metadata record", e.to_string()))?;
    let provenance: Provenance = serde_json::from_value(meta["provenance"].clone())
        .map_err(|e| meta_error(path, "provenance", "a provenance record", e.to_string()))?;
    let metadata = if meta["metadata_grid"] == "loaded" {
        metadata
    } else {
        metadata.for_loaded_grid(
            scan_shape,
            detector_shape,
            provenance.detector_region,
            provenance.det_bin,
        )
    };
    let model = CountsModel::from_bytes(f.codec_tables()).map_err(|e| {
        qem_cpu::rans_error(op, e)
            .with_file(path)
            .with_op("open .qem (CodecTables section)")
    })?;
    let n = f.n_streams();
    if n != scan_shape.len() {
        return Err(
            Error::source(op, "StreamIndex section: one stream per frame of the scan")
                .with_file(path)
                .with_expected(format!("{} streams ({scan_shape})", scan_shape.len()))
                .with_found(format!("{n} streams")),
        );
    }
    if model.frame_len() != detector_shape.len() {
        return Err(Error::source(
            op,
            "CodecTables section: the model's frame length does not match the detector shape",
        )
        .with_file(path)
        .with_expected(format!(
            "{} pixels ({detector_shape})",
            detector_shape.len()
        ))
        .with_found(format!("{} pixels", model.frame_len())));
    }
    let index = (0..n)
        .map(|i| f.stream_entry(i))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| qem_file_error(op, path, e))?;
    let t = Instant::now();
    let streams = f.streams_bytes().to_vec();
    drop(f);
    let frames = EncodedFrames::from_parts(model, detector_shape, index, streams)
        .map_err(|e| e.with_file(path).with_op("open .qem (StreamIndex section)"))?
        .with_origin(path);
    timings.push(StageTiming::new(
        "take streams + index",
        t.elapsed().as_secs_f64(),
    ));
    Ok(QemContents {
        frames,
        scan_shape,
        detector_shape,
        dtype,
        metadata,
        provenance,
        file: FileIdentity::of(path)?,
        timings,
    })
}

fn refuse(path: &Path, what: &str) -> Error {
    Error::invalid(
        "load",
        format!(
            "{what} cannot be applied to a .qem file (it holds an already loaded dataset); load it whole"
        ),
    )
    .with_file(path)
}

/// Load a `.qem` file: ENCODED on the CPU as stored, or decoded to a dense array.
pub(crate) fn load_qem(path: &Path, request: Request<'_>) -> Result<Dataset> {
    let t_total = Instant::now();
    // A saved .qem stays ENCODED on every backend unless the caller asks for DENSE (issue 21
    // item 7): decoding it is the caller's choice, not the CPU engine's default.
    let owned;
    let request = if request.params.representation.is_none() {
        let mut p = request.params.clone();
        p.representation = Some(Representation::Encoded);
        owned = p;
        Request {
            params: &owned,
            representation: Representation::Encoded,
            ..request
        }
    } else {
        request
    };
    if request.params.scan_region.is_some() {
        return Err(refuse(path, "scan_region"));
    }
    if request.params.detector_region.is_some() {
        return Err(refuse(path, "detector_region"));
    }
    if request.params.det_bin != 1 {
        return Err(refuse(path, "det_bin"));
    }
    if request.params.dtype != DtypeRequest::Native {
        return Err(refuse(path, "a dtype other than \"native\""));
    }
    let q = read_qem(path, &QemReadParams::default())?;
    if let Some(s) = request.params.scan_shape {
        if s != q.scan_shape {
            return Err(
                Error::invalid("load", "scan_shape does not match the .qem file's scan")
                    .with_file(path)
                    .with_expected(q.scan_shape.to_string())
                    .with_found(s.to_string()),
            );
        }
    }
    let planned = plan_load(
        q.dtype,
        q.scan_shape,
        q.detector_shape,
        None,
        request.params,
        request.backend,
        request.representation,
    )?;
    let mut timings = q.timings;
    let file_bytes = q.file.size;
    let digest = format!("{:016x}", fnv1a64(FNV_OFFSET, &q.frames.index_bytes()));
    let dense_bytes = (q.scan_shape.len() * q.detector_shape.len() * q.dtype.size()) as u64;
    // The encoded representations keep the codec record the file's writer made (its fit and
    // model), with the sizes of this load.
    let mut encoded_codec = crate::encode::codec_info(
        q.frames.model(),
        q.frames.nbytes(),
        0,
        dense_bytes,
        Some(file_bytes),
    );
    if let Some(orig) = &q.provenance.codec {
        encoded_codec.fit_frames = orig.fit_frames;
        encoded_codec.model = orig.model.clone();
    }
    let mut codec = None;
    let mut memory = None;
    let storage = match (request.backend, request.representation) {
        (Backend::Cpu, Representation::Encoded) => {
            if let Some(b) = request.params.memory_budget {
                if q.frames.nbytes() > b {
                    return Err(Error::memory_budget("load", q.frames.nbytes(), b).with_file(path));
                }
            }
            codec = Some(encoded_codec);
            Storage::CpuEncoded(q.frames)
        }
        (_, Representation::Dense) => {
            let t = Instant::now();
            request.progress.begin("decode", 1);
            let counts = q.frames.decode_all();
            request.progress.advance(1);
            request.progress.end();
            let dense = narrow(counts?, q.dtype);
            timings.push(StageTiming::new("decode (wall)", t.elapsed().as_secs_f64()));
            match request.backend {
                Backend::Cpu => Storage::CpuDense(dense),
                Backend::Cuda => {
                    let g = qem_cuda::load_array(
                        &dense,
                        q.scan_shape,
                        q.detector_shape,
                        &gpu_params(&planned, request.params, None, request.progress),
                    )?;
                    timings.extend(g.timings);
                    Storage::CudaDense(g.array)
                }
            }
        }
        (Backend::Cuda, Representation::Encoded) => {
            // Straight to the device: the file's streams and index as they are.
            let t = Instant::now();
            let eng = qem_cuda::engine()?;
            let counter = std::sync::Arc::new(qem_cuda::mem::MemCounter::default());
            let (free0, total) = eng.gpu.mem_info()?;
            let need = q.frames.nbytes();
            qem_cuda::load::admit(need, request.params.memory_budget, free0, 256 << 20)
                .map_err(|e| e.with_file(path))?;
            let d = qem_cuda::DeviceEncoded::upload(
                &eng.gpu,
                q.frames.model().clone(),
                q.frames.index(),
                q.frames.streams(),
                q.detector_shape,
                Some(&counter),
            )
            .map_err(|e| e.with_file(path))?;
            let (free1, _) = eng.gpu.mem_info()?;
            timings.push(StageTiming::new(
                "upload encoded streams to the GPU (wall)",
                t.elapsed().as_secs_f64(),
            ));
            memory = Some(qem_core::MemoryReport {
                planned_device_bytes: need,
                budget_bytes: request.params.memory_budget.unwrap_or(free0),
                process_peak_device_bytes: counter.peak(),
                card_used_before_bytes: total.saturating_sub(free0),
                card_used_peak_bytes: total.saturating_sub(free1),
                card_total_bytes: total,
            });
            codec = Some(encoded_codec);
            Storage::CudaEncoded(d)
        }
    };
    timings.push(StageTiming::new(
        "total (wall)",
        t_total.elapsed().as_secs_f64(),
    ));
    let facts = SourceFacts {
        kind: "qem",
        files: vec![q.file],
        dataset_path: None,
        chunk_index_digest: Some(digest),
        scan: q.scan_shape,
        detector: q.detector_shape,
        dtype: q.dtype,
        bad_pixels: 0,
        metadata: q.metadata,
    };
    let loaded = Loaded {
        storage,
        saturated: 0,
        memory,
        timings,
        codec,
        sum_dp: None,
    };
    let mut ds = finish(facts, &planned, request.params, request.backend, loaded);
    ds.provenance.mask_policy = q.provenance.mask_policy.clone();
    ds.provenance.converted_from = Some(Box::new(q.provenance));
    Ok(ds)
}
