//! Quantum Detectors Merlin `.mib` files (Medipix3 readout): processed ("U") and raw ("R64")
//! pixel modes.
//!
//! Every frame is an ASCII header followed by its pixels. The header is comma-separated:
//! field 0 `MQ1`, 1 the frame's sequence number, 2 the header length in bytes (also the data
//! offset, e.g. 384 for one chip, 768 for a quad), 3 the number of chips, 4 the frame width
//! (columns), 5 the height (rows), 6 the pixel type: `U08`, `U16`, `U32` (big-endian unsigned
//! integers, the frame already assembled, quads included) or `R64` (raw counters packed in
//! 64-bit words, unpacked on the host by [`super::mib_raw`]; field 7 is the chip layout and the
//! header's last field the counter depth). An optional `<name>.hdr` acquisition header (text) sits next to
//! the file; it does not record the scan shape, so give `scan_shape` unless the scan is square.

use super::{build, host::ElemConv, mib_raw::RawMib, Found, Strided};
use crate::{guard, OpenOptions, Source, SourceKind};
use qem_core::{DType, Error, Metadata, Result, Shape2};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const OP: &str = "open";

/// The fields of one frame header that fix the layout.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Header {
    header_bytes: u64,
    chips: u32,
    cols: usize,
    rows: usize,
    pixel: String,
    /// Field 7, the chip layout (`1x1`, `2x2`, `2x2G`, `Nx1`); empty when absent.
    layout: String,
}

/// The header's last non-empty field: the counter depth in raw mode (the fields before it
/// include per-frame timestamps, so it is not part of [`Header`]'s comparison).
fn last_field(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .split(',')
        .rev()
        .map(|f| f.trim_matches(|c: char| c == '\0' || c.is_whitespace()))
        .find(|f| !f.is_empty())
        .unwrap_or("")
        .to_string()
}

fn parse_header(bytes: &[u8], path: &Path, at: u64) -> Result<(Header, u64)> {
    let text = String::from_utf8_lossy(bytes);
    let fields: Vec<&str> = text.split(',').map(str::trim).collect();
    let bad = |what: &str| {
        Error::source(OP, format!("Merlin frame header at byte {at}: {what}"))
            .with_file(path)
            .with_expected("MQ1,<seq>,<header bytes>,<chips>,<cols>,<rows>,<U08|U16|U32>,...")
            .with_found(text.chars().take(60).collect::<String>())
    };
    if fields.len() < 7 || fields[0] != "MQ1" {
        return Err(bad("not a frame header"));
    }
    let num = |i: usize, what: &str| -> Result<u64> {
        fields[i]
            .parse::<u64>()
            .map_err(|_| bad(&format!("{what} is not a number")))
    };
    let seq = num(1, "sequence number")?;
    let h = Header {
        header_bytes: num(2, "header length")?,
        chips: num(3, "chip count")? as u32,
        cols: num(4, "width")? as usize,
        rows: num(5, "height")? as usize,
        pixel: fields[6].to_string(),
        layout: fields.get(7).map_or(String::new(), |f| f.to_string()),
    };
    if h.header_bytes < 16 || h.header_bytes > 1 << 20 || h.cols == 0 || h.rows == 0 {
        return Err(bad("implausible header length or frame size"));
    }
    Ok((h, seq))
}

fn read_at(f: &std::fs::File, path: &Path, at: u64, n: usize) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; n];
    f.read_exact_at(&mut buf, at).map_err(|e| {
        Error::source(
            OP,
            format!("cannot read {n} bytes at {at}: {e} (truncated?)"),
        )
        .with_file(path)
    })?;
    Ok(buf)
}

/// The `.mib` next to a `.hdr` (same stem), or the path itself.
fn data_file(path: &Path) -> PathBuf {
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("hdr"))
    {
        let mib = path.with_extension("mib");
        if mib.is_file() {
            return mib;
        }
    }
    path.to_path_buf()
}

/// Open a Merlin `.mib` (or its `.hdr`).
pub(crate) fn open(path: &Path, opts: &OpenOptions) -> Result<Source> {
    let data = data_file(path);
    let f = guard::open_regular(OP, &data, "Merlin .mib file")?;
    let size = f.metadata().map(|m| m.len()).unwrap_or(0);
    let probe = read_at(&f, &data, 0, size.min(1024) as usize)?;
    let (h, _) = parse_header(&probe, &data, 0)?;
    let (dtype, es, raw) = match h.pixel.as_str() {
        "U08" => (DType::U8, 1, None),
        "U16" => (DType::U16, 2, None),
        "U32" => (DType::U32, 4, None),
        "R64" => {
            let last = last_field(&probe[..(h.header_bytes as usize).min(probe.len())]);
            let bits = last.parse::<u32>().map_err(|_| {
                Error::source(OP, "Merlin raw (R64) header without its counter depth")
                    .with_file(&data)
                    .with_expected("the counter depth (1, 6, 12 or 24) as the header's last field")
                    .with_found(last.clone())
            })?;
            let r = RawMib::new(bits, h.chips, &h.layout, h.rows, h.cols, &data)?;
            (r.dtype(), r.dtype().size(), Some(r))
        }
        other => {
            return Err(Error::source(OP, "unsupported Merlin pixel type")
                .with_file(&data)
                .with_expected("U08, U16, U32 or R64")
                .with_found(other.to_string()))
        }
    };
    let det = raw.map_or(Shape2::new(h.rows, h.cols), |r| Shape2::new(r.rows, r.cols));
    let frame_bytes = raw.map_or((h.rows * h.cols * es) as u64, |r| {
        r.stored_frame_bytes() as u64
    });
    let stride = h.header_bytes + frame_bytes;
    let n_frames = size / stride;
    if n_frames == 0 || size % stride != 0 {
        return Err(Error::source(
            OP,
            "the file is not a whole number of frames (truncated, or frames of another size)",
        )
        .with_file(&data)
        .with_frame(n_frames)
        .with_expected(format!(
            "a multiple of {stride} bytes ({} header + {frame_bytes} pixels)",
            h.header_bytes
        ))
        .with_found(format!("{size} bytes ({n_frames} whole frames)")));
    }
    // The last frame's header must agree with the first (catches files of mixed settings).
    let last_at = (n_frames - 1) * stride;
    let tail = read_at(&f, &data, last_at, h.header_bytes as usize)?;
    let (hl, seq_last) = parse_header(&tail, &data, last_at)?;
    if hl != h {
        return Err(
            Error::source(OP, "the last frame's header differs from the first's")
                .with_file(&data)
                .with_frame(n_frames - 1)
                .with_expected(format!("{h:?}"))
                .with_found(format!("{hl:?}")),
        );
    }
    let mut metadata = Metadata::default();
    metadata.extra.insert(
        "merlin".into(),
        serde_json::json!({"chips": h.chips, "pixel": h.pixel, "header_bytes": h.header_bytes,
                           "layout": h.layout, "last_sequence_number": seq_last,
                           "raw_counter_bits": raw.map(|r| r.bits)}),
    );
    metadata.bit_depth_image = Some(raw.map_or((es * 8) as u32, |r| r.bits));
    let hdr = data.with_extension("hdr");
    let side_files = if hdr.is_file() { vec![hdr] } else { Vec::new() };
    build(
        path,
        opts,
        Found {
            kind: SourceKind::MerlinMib,
            data_file: data,
            side_files,
            dtype,
            detector: det,
            frames: Strided {
                first: h.header_bytes,
                stride,
                stored_frame_bytes: frame_bytes,
                n_frames,
            },
            array_scan: None,
            recorded_scan: None,
            elem: match raw {
                Some(r) => ElemConv::MerlinRaw(r),
                None if es > 1 => ElemConv::Swap(es),
                None => ElemConv::Same,
            },
            metadata,
        },
    )
}
