//! Readiness checks ([`inspect`]) and master-file discovery ([`discover`]).

use crate::guard;
use crate::open::{self, Located};
use crate::{h5, MissingFrames, OpenOptions, Source, SourceKind};
use qem_core::{DType, Error, ErrorKind, Metadata, Result, ScanShapeOrigin, Shape2};
use std::path::{Path, PathBuf};

/// One shard of a Dectris master as seen by [`inspect`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ShardReport {
    /// The shard file (resolved against the master's directory).
    pub file: PathBuf,
    /// Whether the file exists.
    pub exists: bool,
    /// Frames in the shard's dataset, if it could be read.
    pub frames: Option<u64>,
    /// `image_nr_low` attribute (1-based, inclusive), if present, as stored (a negative value
    /// is shown as it is, not as 0 or absent).
    pub image_nr_low: Option<i64>,
    /// `image_nr_high` attribute (1-based, inclusive), if present, as stored.
    pub image_nr_high: Option<i64>,
    /// Stored bytes of the shard's chunks, if they could be enumerated.
    pub compressed_bytes: Option<u64>,
}

/// Whether a source can be loaded, and if not why and what to do.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Verdict {
    /// True when [`Source::open`] succeeds and every frame has a written chunk.
    pub ready: bool,
    /// Why the source is not ready.
    pub reason: Option<String>,
    /// What the user can do about it.
    pub action: Option<String>,
}

impl Verdict {
    /// Not ready: why, and what to do about it.
    fn not_ready(reason: String, action: impl Into<String>) -> Verdict {
        Verdict {
            ready: false,
            reason: Some(reason),
            action: Some(action.into()),
        }
    }
}

/// The frames of a source whose chunk was never written.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct UnwrittenFrames {
    /// The first [`UnwrittenFrames::LISTED`] of them.
    pub missing_frames: Vec<u64>,
    /// How many there are.
    pub n_missing_frames: u64,
}

impl UnwrittenFrames {
    /// How many frames the report lists at most.
    pub const LISTED: usize = 100;

    fn of(missing: &MissingFrames) -> UnwrittenFrames {
        UnwrittenFrames {
            missing_frames: missing.iter().take(Self::LISTED).collect(),
            n_missing_frames: missing.len(),
        }
    }
}

/// What [`inspect`] found: whether the source can be loaded, and if not why and what to do.
///
/// The verdict's and the unwritten frames' fields serialise at the top level (`ready`,
/// `reason`, `action`, ..., `missing_frames`, `n_missing_frames`, ...), in this order.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Inspection {
    /// Whether the source can be loaded, and if not why and what to do.
    #[serde(flatten)]
    pub verdict: Verdict,
    /// Kind of source, once recognised.
    pub source_kind: Option<SourceKind>,
    /// The path inspected.
    pub path: PathBuf,
    /// Element type of the frames.
    pub dtype: Option<DType>,
    /// Detector frame shape.
    pub detector_shape: Option<Shape2>,
    /// Frames the metadata announces (`nimages·ntrigger`), if it does.
    pub expected_frames: Option<u64>,
    /// Frames present in the data.
    pub actual_frames: Option<u64>,
    /// Resolved scan shape.
    pub scan_shape: Option<Shape2>,
    /// Where the scan shape came from.
    pub scan_shape_origin: Option<ScanShapeOrigin>,
    /// Every shard of a Dectris master.
    pub shards: Vec<ShardReport>,
    /// Shard files that do not exist.
    pub missing_shards: Vec<PathBuf>,
    /// Frames whose chunk was never written.
    #[serde(flatten)]
    pub unwritten: UnwrittenFrames,
    /// Metadata read from the master.
    pub metadata: Option<Metadata>,
    /// Pixels the pixel mask marks bad (low-16-bit rule).
    pub bad_pixels: Option<usize>,
    /// Stored bytes of all chunks.
    pub compressed_bytes: Option<u64>,
}

impl Inspection {
    fn empty(path: &Path) -> Inspection {
        Inspection {
            verdict: Verdict::default(),
            source_kind: None,
            path: path.to_path_buf(),
            dtype: None,
            detector_shape: None,
            expected_frames: None,
            actual_frames: None,
            scan_shape: None,
            scan_shape_origin: None,
            shards: Vec::new(),
            missing_shards: Vec::new(),
            unwritten: UnwrittenFrames::default(),
            metadata: None,
            bad_pixels: None,
            compressed_bytes: None,
        }
    }
}

/// Suggest what to do about an open error.
fn action_for(e: &Error) -> String {
    let d = e.detail.to_ascii_lowercase();
    if d.contains("scan shape") || d.contains("scan_shape") {
        "pass scan_shape=(rows, cols) with rows*cols equal to the frames present".into()
    } else if d.contains("missing shard") {
        "copy the missing shard files next to the master file".into()
    } else if d.contains("filter") || d.contains("zstd") || d.contains("compressor") {
        "convert the data to bitshuffle/LZ4 (filter 32008) or uncompressed".into()
    } else if d.contains("never written") {
        "load a scan region that excludes the missing frames".into()
    } else if d.contains("dataset") {
        "pass dataset_path naming the 3-D/4-D frame dataset".into()
    } else {
        "check the file; it may be incomplete or still being written".into()
    }
}

/// Inspect `path` without decoding any pixel: shards, frame counts, scan shape, metadata and
/// whether a load would succeed.
///
/// Problems with the source are reported in the returned [`Inspection`] (`ready = false`,
/// `reason`, `action`). The inspection itself fails, with a typed error, when `path` cannot be
/// read at all: it does not exist, is a symlink loop, is not a regular file (a directory, FIFO,
/// device or socket: refused before any open could block), cannot be opened (permissions), is a
/// `.qem` container, or is neither a recognised format nor HDF5. A recognised non-HDF5 file
/// (`.npy`, Merlin, EMPAD, ...) is reported from what opening it says.
pub fn inspect(path: &Path, scan_shape: Option<Shape2>) -> Result<Inspection> {
    // Opened (non-blocking, regular files only) to prove it readable, then closed.
    drop(guard::open_regular("inspect", path, "file")?);
    let opts = OpenOptions {
        dataset_path: None,
        scan_shape,
        ..OpenOptions::default()
    };
    // Other formats recognised by content (NumPy, Merlin, EMPAD, ...) have no shards to count:
    // the report is what opening them says. Unrecognised content goes on to the HDF5 path,
    // whose error says what HDF5 found.
    match crate::formats::detect(path) {
        Ok(crate::Format::Qem) => {
            return Err(Error::source(
                "inspect",
                "a .qem file is not an acquisition to inspect: io.load opens it and verifies its header and checksums",
            )
            .with_file(path)
            .with_expected("an acquisition (Dectris master, HDF5, .npy, .mib, EMPAD, raw)")
            .with_found("a .qem container"))
        }
        Ok(f) if f != crate::Format::Hdf5 => {
            let mut ins = Inspection::empty(path);
            report_open(&mut ins, path, &opts);
            return Ok(ins);
        }
        _ => {}
    }
    h5::init();
    if let Err(e) = h5::open_read(path) {
        return Err(Error::source(
            "inspect",
            format!("cannot open the file as HDF5: HDF5 says: {e}"),
        )
        .with_file(path)
        .with_expected(
            "an HDF5 file (a Dectris master or a plain HDF5 file with a 3-D/4-D dataset)",
        )
        .with_found("a file HDF5 cannot open"));
    }
    let mut ins = Inspection::empty(path);

    // Shard census first, so missing shards are listed even though open fails on them.
    if let Ok(file) = h5::open_read(path) {
        if let Ok(info) = crate::meta::read_master(&file, path) {
            ins.expected_frames = match (info.metadata.nimages, info.metadata.ntrigger) {
                (Some(a), Some(b)) => a.max(1).checked_mul(b.max(1)),
                (Some(a), None) => Some(a),
                (None, Some(b)) => Some(b),
                _ => None,
            };
            ins.metadata = Some(info.metadata);
        }
        if let Ok(Located::Shards(links)) = open::locate(&file, path, &opts) {
            ins.source_kind = Some(SourceKind::DectrisMaster);
            for link in links {
                let exists = link.internal || link.file.is_file();
                let mut rep = ShardReport {
                    file: link.file.clone(),
                    exists,
                    frames: None,
                    image_nr_low: None,
                    image_nr_high: None,
                    compressed_bytes: None,
                };
                if !exists {
                    ins.missing_shards.push(link.file.clone());
                } else {
                    // locate() vetted the link (regular file in the master's folder); the path
                    // inside the shard is vetted here before HDF5 traverses it.
                    let shard_file = if link.internal {
                        None
                    } else {
                        h5::open_read(&link.file).ok()
                    };
                    let holder = shard_file.as_ref().unwrap_or(&file);
                    let ds = match h5::check_path(holder, &link.obj_path) {
                        Ok(true) => holder.dataset(&link.obj_path).ok(),
                        _ => None,
                    };
                    if let Some(ds) = ds {
                        rep.frames = ds.shape().first().map(|&n| n as u64);
                        let attr = |name| {
                            open::image_nr_attr(&ds, name).map(|v| {
                                i64::try_from(v).unwrap_or(if v < 0 { i64::MIN } else { i64::MAX })
                            })
                        };
                        rep.image_nr_low = attr("image_nr_low");
                        rep.image_nr_high = attr("image_nr_high");
                        if let Ok(part) = open::describe(&ds, &link.file, &link.name) {
                            rep.compressed_bytes = Some(part.chunks.iter().map(|c| c.size).sum());
                        }
                    }
                }
                ins.shards.push(rep);
            }
            if ins.shards.iter().all(|s| s.frames.is_some()) {
                ins.actual_frames = ins
                    .shards
                    .iter()
                    .filter_map(|s| s.frames)
                    .try_fold(0u64, |a, n| a.checked_add(n));
            }
        }
    }

    report_open(&mut ins, path, &opts);
    Ok(ins)
}

/// What [`Source::open`] says of `path`, into `ins`: the source's description and readiness,
/// or why it cannot be opened and what to do.
fn report_open(ins: &mut Inspection, path: &Path, opts: &OpenOptions) {
    match Source::open(path, opts) {
        Ok(src) => {
            ins.source_kind = Some(src.kind);
            ins.dtype = Some(src.dtype);
            ins.detector_shape = Some(src.detector_shape);
            ins.actual_frames = Some(src.n_frames);
            ins.scan_shape = Some(src.scan_shape);
            ins.scan_shape_origin = src.metadata.scan_shape_origin;
            ins.unwritten = UnwrittenFrames::of(&src.missing_frames);
            ins.bad_pixels = src
                .bad_pixel_mask()
                .map(|m| m.iter().filter(|&&b| b).count());
            ins.compressed_bytes = Some(src.compressed_bytes());
            ins.metadata = Some(src.metadata.clone());
            ins.verdict = match src.missing_frames.first() {
                Some(first) => Verdict::not_ready(
                    format!(
                        "{} of {} frames were never written (first: {first})",
                        src.missing_frames.len(),
                        src.n_frames
                    ),
                    "load a scan region that excludes the missing frames",
                ),
                None => Verdict {
                    ready: true,
                    ..Verdict::default()
                },
            };
        }
        Err(e) => {
            let action = if ins.missing_shards.is_empty() {
                action_for(&e)
            } else {
                "copy the missing shard files next to the master file".into()
            };
            ins.verdict = Verdict::not_ready(e.to_string(), action);
        }
    }
}

/// All `*_master.h5` files under `folder` (recursively), as sorted absolute paths.
///
/// Symbolic links to directories are not followed (no cycles). A missing folder is a source
/// error naming it.
pub fn discover(folder: &Path) -> Result<Vec<PathBuf>> {
    let root = std::fs::canonicalize(folder).map_err(|e| {
        let mut err = Error::io("discover", folder, &e);
        if e.kind() == std::io::ErrorKind::NotFound {
            err.kind = ErrorKind::Source;
            err.detail = "folder not found".into();
            err = err
                .with_expected("an existing folder")
                .with_found("no such folder");
        }
        err
    })?;
    if !root.is_dir() {
        return Err(Error::source("discover", "not a folder")
            .with_file(folder)
            .with_expected("a folder")
            .with_found("a file"));
    }
    let mut out = Vec::new();
    let mut stack = vec![root];
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| Error::io("discover", &dir, &e))?;
        for entry in entries {
            let entry = entry.map_err(|e| Error::io("discover", &dir, &e))?;
            let p = entry.path();
            let ft = entry
                .file_type()
                .map_err(|e| Error::io("discover", &p, &e))?;
            if ft.is_dir() {
                stack.push(p);
            } else if p
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with("_master.h5"))
                && p.is_file()
            {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_serialises_flat_in_its_field_order() {
        let mut ins = Inspection::empty(Path::new("x_master.h5"));
        ins.verdict = Verdict::not_ready("why".into(), "do this");
        ins.unwritten = UnwrittenFrames::of(&MissingFrames::from_sorted([3..5, 200..300]));
        let text = serde_json::to_string(&ins).unwrap();
        let keys = [
            "ready",
            "reason",
            "action",
            "source_kind",
            "path",
            "dtype",
            "detector_shape",
            "expected_frames",
            "actual_frames",
            "scan_shape",
            "scan_shape_origin",
            "shards",
            "missing_shards",
            "missing_frames",
            "n_missing_frames",
            "metadata",
            "bad_pixels",
            "compressed_bytes",
        ];
        let at: Vec<usize> = keys
            .iter()
            .map(|k| text.find(&format!("\"{k}\":")).unwrap_or(usize::MAX))
            .collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{text}");
        assert!(
            !text.contains("verdict") && !text.contains("unwritten"),
            "{text}"
        );
        assert!(text.starts_with(r#"{"ready":false,"reason":"why","action":"do this","#));
    }

    #[test]
    fn unwritten_frames_list_the_first_hundred_and_count_all() {
        let u = UnwrittenFrames::of(&MissingFrames::from_sorted([3..5, 200..300]));
        assert_eq!(u.n_missing_frames, 102);
        assert_eq!(u.missing_frames.len(), UnwrittenFrames::LISTED);
        assert_eq!(&u.missing_frames[..3], &[3, 4, 200]);
        assert_eq!(u.missing_frames.last(), Some(&297));
    }
}
