//! Generic raw binary files: frames of a given element type one after another, with optional
//! bytes before the first frame (`file_header_bytes`) and around each frame
//! (`frame_header_bytes`, `frame_footer_bytes`). The caller describes the layout; the file's
//! size must then match it exactly.

use super::ArrayFile;
use crate::{OpenOptions, Source, SourceKind};
use qem_core::{Error, Result};
use std::path::Path;

const OP: &str = "open";

/// How a raw binary file is laid out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawLayout {
    /// `(N, k_r, k_c)` or `(R, C, k_r, k_c)`.
    pub shape: Vec<u64>,
    /// NumPy type string or name: `uint8`, `<u2`/`uint16`, `>u2`, `<u4`, `<f4`/`float32`, ...
    pub dtype: String,
    /// Bytes before the first frame.
    pub file_header_bytes: u64,
    /// Bytes before each frame's pixels.
    pub frame_header_bytes: u64,
    /// Bytes after each frame's pixels.
    pub frame_footer_bytes: u64,
}

/// Open a raw binary file described by `opts.raw`.
pub(crate) fn open(path: &Path, opts: &OpenOptions) -> Result<Source> {
    let layout = opts.raw.as_ref().ok_or_else(|| {
        Error::invalid(OP, "a raw binary file needs its layout: shape= and dtype=")
            .with_file(path)
            .with_expected(
                "shape=(N, k_r, k_c) or (R, C, k_r, k_c), dtype=\"<u2\" (and header sizes)",
            )
            .with_found("no layout")
    })?;
    let array = ArrayFile::new(
        &layout.dtype,
        &layout.shape,
        path,
        "shape",
        qem_core::ErrorKind::InvalidArgument,
    )?;
    let (n_frames, stored) = (array.n_frames, array.frame_bytes);
    let stride = stored
        .checked_add(layout.frame_header_bytes)
        .and_then(|s| s.checked_add(layout.frame_footer_bytes))
        .ok_or_else(|| Error::invalid(OP, "frame stride overflows").with_file(path))?;
    let expected = n_frames
        .checked_mul(stride)
        .and_then(|b| b.checked_add(layout.file_header_bytes));
    let size = crate::guard::check_regular_file(OP, path, "raw file")?.len();
    if expected != Some(size) {
        let whole = size.saturating_sub(layout.file_header_bytes) / stride.max(1);
        let mut e = Error::source(
            OP,
            if expected.is_some_and(|x| size < x) {
                "the file is shorter than the layout says (truncated, or a wrong shape/dtype)"
            } else {
                "the file size does not match the layout (wrong shape, dtype or header sizes?)"
            },
        )
        .with_file(path)
        .with_expected(format!(
            "{} bytes = {} + {n_frames} x ({} + {stored} + {})",
            expected.map_or("more than 2^64".to_string(), |x| x.to_string()),
            layout.file_header_bytes,
            layout.frame_header_bytes,
            layout.frame_footer_bytes
        ))
        .with_found(format!("{size} bytes ({whole} whole frames)"));
        if expected.is_some_and(|x| size < x) {
            e = e.with_frame(whole);
        }
        return Err(e);
    }
    array.build(
        path,
        opts,
        SourceKind::RawBinary,
        (layout.file_header_bytes + layout.frame_header_bytes, stride),
        (
            "raw_layout",
            serde_json::json!({
                "dtype": layout.dtype, "shape": layout.shape,
                "file_header_bytes": layout.file_header_bytes,
                "frame_header_bytes": layout.frame_header_bytes,
                "frame_footer_bytes": layout.frame_footer_bytes,
            }),
        ),
    )
}
