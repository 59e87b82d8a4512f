//! EMPAD (Electron Microscope Pixel Array Detector) acquisitions: an `.xml` description and a
//! `.raw` file of little-endian float32 frames, 128 columns by 130 rows each, of which the first
//! 128 rows are the detector and the last 2 rows a footer (1,024 bytes) that is skipped.
//!
//! The XML's root holds `<raw_file filename="..."/>` (resolved in the XML's folder) and the scan
//! as `<pix_x>`/`<pix_y>` (columns/rows); without them, a raw name `scan_x<C>_y<R>.raw` gives it.
//! The frames are float32, so loading needs `float_scale` (docs/formats.md, "Float32 counts").

use super::{build, host::ElemConv, Found, Strided};
use crate::{guard, OpenOptions, Source, SourceKind};
use qem_core::{DType, Error, Metadata, Result, Shape2};
use std::path::{Path, PathBuf};

const OP: &str = "open";
const COLS: usize = 128;
const ROWS: usize = 128;
const RAW_ROWS: usize = 130;

/// The raw file and scan shape an EMPAD XML names.
struct Described {
    raw: PathBuf,
    scan: Option<Shape2>,
}

fn read_xml(path: &Path) -> Result<String> {
    guard::check_regular_file(OP, path, "EMPAD .xml")?;
    let meta = std::fs::metadata(path).map_err(|e| Error::io(OP, path, &e))?;
    if meta.len() > 64 << 20 {
        return Err(Error::source(OP, "EMPAD .xml is implausibly large").with_file(path));
    }
    std::fs::read_to_string(path).map_err(|e| Error::io(OP, path, &e))
}

fn describe(xml_path: &Path) -> Result<Described> {
    let text = read_xml(xml_path)?;
    let doc = roxmltree::Document::parse(&text).map_err(|e| {
        Error::source(OP, format!("EMPAD .xml is not well-formed XML: {e}")).with_file(xml_path)
    })?;
    let root = doc.root_element();
    let child = |name: &str| root.children().find(|n| n.has_tag_name(name));
    let raw_name = child("raw_file")
        .and_then(|n| n.attribute("filename"))
        .ok_or_else(|| {
            Error::source(OP, "EMPAD .xml names no raw file")
                .with_file(xml_path)
                .with_expected("<raw_file filename=\"...\"/> under the root element")
                .with_found("none")
        })?;
    let base = Path::new(raw_name)
        .file_name()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(raw_name));
    let raw = guard::folder_of(xml_path).join(base);
    let num = |name: &str| {
        child(name)
            .and_then(|n| n.text())
            .and_then(|t| t.trim().parse::<usize>().ok())
    };
    let scan = match (num("pix_y"), num("pix_x")) {
        (Some(r), Some(c)) => Some(Shape2::new(r, c)),
        _ => scan_from_name(&raw),
    };
    Ok(Described { raw, scan })
}

/// `scan_x<C>_y<R>.raw` → `(R, C)`.
fn scan_from_name(raw: &Path) -> Option<Shape2> {
    let stem = raw.file_stem()?.to_str()?;
    let rest = stem.strip_prefix("scan_x")?;
    let (c, r) = rest.split_once("_y")?;
    Some(Shape2::new(r.parse().ok()?, c.parse().ok()?))
}

/// True when `path` is an EMPAD description (a root with a `raw_file` child).
pub(crate) fn is_empad_xml(path: &Path) -> bool {
    describe(path).is_ok()
}

/// The EMPAD `.xml` in the same folder that names `raw` (the first, in name order).
pub(crate) fn xml_for_raw(raw: &Path) -> Option<PathBuf> {
    let name = raw.file_name()?;
    let mut xmls: Vec<PathBuf> = std::fs::read_dir(guard::folder_of(raw))
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("xml")))
        .take(64)
        .collect();
    xmls.sort();
    xmls.into_iter()
        .find(|x| describe(x).is_ok_and(|d| d.raw.file_name() == Some(name)))
}

/// Open an EMPAD acquisition from its `.xml` or its `.raw`.
pub(crate) fn open(path: &Path, opts: &OpenOptions) -> Result<Source> {
    let is_xml = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("xml"));
    let xml = if is_xml {
        path.to_path_buf()
    } else {
        xml_for_raw(path).ok_or_else(|| {
            Error::source(OP, "no EMPAD .xml next to the .raw names it")
                .with_file(path)
                .with_expected(
                    "an .xml in the same folder with <raw_file filename=\"<this file>\"/>",
                )
                .with_found("none")
        })?
    };
    let d = describe(&xml)?;
    let stored = (ROWS * COLS * 4) as u64;
    let stride = (RAW_ROWS * COLS * 4) as u64;
    let size = guard::check_regular_file(OP, &d.raw, "EMPAD .raw")?.len();
    let n_frames = match d.scan.or(opts.scan_shape) {
        Some(s) => s.len() as u64,
        None => size / stride,
    };
    if size != n_frames * stride {
        return Err(Error::source(
            OP,
            "the EMPAD .raw does not hold the frames the scan needs (truncated?)",
        )
        .with_file(&d.raw)
        .with_frame((size / stride).min(n_frames))
        .with_expected(format!(
            "{} bytes = {n_frames} frames x {stride}",
            n_frames * stride
        ))
        .with_found(format!("{size} bytes ({} whole frames)", size / stride)));
    }
    let mut metadata = Metadata::default();
    metadata.extra.insert(
        "empad".into(),
        serde_json::json!({"xml": xml.display().to_string(), "footer_rows": RAW_ROWS - ROWS}),
    );
    build(
        path,
        opts,
        Found {
            kind: SourceKind::Empad,
            data_file: d.raw.clone(),
            side_files: vec![xml],
            dtype: DType::U32,
            detector: Shape2::new(ROWS, COLS),
            frames: Strided {
                first: 0,
                stride,
                stored_frame_bytes: stored,
                n_frames,
            },
            array_scan: None,
            recorded_scan: d.scan,
            elem: ElemConv::Float32 {
                scale: 1.0,
                big_endian: false,
            },
            metadata,
        },
    )
}
