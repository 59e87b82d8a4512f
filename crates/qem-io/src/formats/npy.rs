//! NumPy `.npy` files: the header (parsed by `npyz`) gives the element type, shape and order;
//! frames are then read in place with positional reads, frame by frame, like a memory map
//! (the file is never loaded whole).
//!
//! Layout (NumPy's format spec, versions 1-3): magic `\x93NUMPY`, major and minor version
//! bytes, a little-endian header length (`u16` in v1, `u32` in v2/v3), the header text (a
//! Python dict with `descr`, `fortran_order`, `shape`), then the C-order array.

use super::ArrayFile;
use crate::{guard, OpenOptions, Source, SourceKind};
use qem_core::{Error, Result};
use std::path::Path;

const OP: &str = "open";

/// Longest header text accepted. NumPy refuses to read headers over 10,000 bytes unless told
/// to trust the file; ours only carry `descr`, `fortran_order` and `shape`.
const MAX_HEADER_BYTES: u64 = 65_536;

/// Deepest bracket nesting accepted. A plain array's header nests 2 (the dict and the shape
/// tuple); structured dtypes nest more but are refused later anyway.
const MAX_HEADER_DEPTH: usize = 6;

/// Deepest nesting of `(`, `[` and `{` in `text`, counting those inside quoted strings too: a
/// plain array's strings (`'<u2'`) hold none, and a scanner that skipped strings could be
/// misled by escaped quotes into missing brackets the parser does see.
fn bracket_depth(text: &[u8]) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    for &b in text {
        match b {
            b'(' | b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// Read `buf.len()` bytes from the start of `f` (fewer only at end of file).
fn read_at(mut f: &std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    use std::io::{Seek, SeekFrom};
    f.seek(SeekFrom::Start(0))?;
    guard::read_up_to(f, buf)
}

/// Open a `.npy` file of shape `(N, k_r, k_c)` or `(R, C, k_r, k_c)`.
pub(crate) fn open(path: &Path, opts: &OpenOptions) -> Result<Source> {
    let f = guard::open_regular(OP, path, "npy file")?;
    let mut pre = [0u8; 12];
    let n = read_at(&f, &mut pre).map_err(|e| Error::io(OP, path, &e))?;
    let bad = |msg: &str, found: String| {
        Error::source(OP, format!("not a valid .npy file: {msg}"))
            .with_file(path)
            .with_expected("NumPy format 1.0-3.0")
            .with_found(found)
    };
    if n < 10 || &pre[..6] != b"\x93NUMPY" {
        return Err(bad("bad magic or truncated preamble", format!("{n} bytes")));
    }
    let data_offset = match pre[6] {
        1 => 10 + u64::from(u16::from_le_bytes([pre[8], pre[9]])),
        2 | 3 if n >= 12 => 12 + u64::from(u32::from_le_bytes([pre[8], pre[9], pre[10], pre[11]])),
        v => return Err(bad("unknown version", format!("version {v}.{}", pre[7]))),
    };
    // The header text is read and screened here before `npyz` parses it: its Python-literal
    // parser backtracks exponentially on nested brackets (a 14-deep `{` takes 15 s, found by
    // the fuzzer), so a hostile header could hang `open`.
    let header_len = data_offset - if pre[6] == 1 { 10 } else { 12 };
    if header_len > MAX_HEADER_BYTES {
        return Err(bad(
            "the header is implausibly long",
            format!("{header_len} header bytes (at most {MAX_HEADER_BYTES} accepted; numpy writes under 10,000)"),
        ));
    }
    let mut head = vec![0u8; data_offset as usize];
    let got = read_at(&f, &mut head).map_err(|e| Error::io(OP, path, &e))?;
    if got < head.len() {
        return Err(bad(
            "truncated header",
            format!("{got} bytes, the header ends at byte {data_offset}"),
        ));
    }
    let depth = bracket_depth(&head[data_offset as usize - header_len as usize..]);
    if depth > MAX_HEADER_DEPTH {
        return Err(bad(
            "the header nests brackets too deeply",
            format!(
                "brackets nested {depth} deep (at most {MAX_HEADER_DEPTH}; a NumPy header nests 2)"
            ),
        ));
    }
    let header = npyz::NpyHeader::from_reader(std::io::Cursor::new(head))
        .map_err(|e| bad("cannot parse the header", e.to_string()))?;
    if header.order() == npyz::Order::Fortran {
        return Err(
            Error::source(OP, "Fortran-ordered .npy arrays are not supported")
                .with_file(path)
                .with_expected("fortran_order: False (C order, as numpy.save writes by default)")
                .with_found("fortran_order: True"),
        );
    }
    let ts = match header.dtype() {
        npyz::DType::Plain(ts) => ts,
        other => {
            return Err(
                Error::source(OP, "structured .npy arrays are not supported")
                    .with_file(path)
                    .with_expected("a plain element type")
                    .with_found(format!("{other:?}")),
            )
        }
    };
    let array = ArrayFile::new(
        &ts.to_string(),
        header.shape(),
        path,
        "the array",
        qem_core::ErrorKind::Source,
    )?;
    let stride = array.frame_bytes;
    array.build(
        path,
        opts,
        SourceKind::Npy,
        (data_offset, stride),
        ("npy_descr", serde_json::Value::String(ts.to_string())),
    )
}

#[cfg(test)]
mod tests {
    use super::bracket_depth;

    #[test]
    fn depth_counts_every_bracket() {
        let plain = b"{'descr': '<u2', 'fortran_order': False, 'shape': (4, 8, 8), }";
        assert_eq!(bracket_depth(plain), 2);
        // Inside strings too: an escaped quote must not hide brackets from the count.
        assert_eq!(bracket_depth(br"{'a\'': '[[[[((', 'shape': ()}"), 8);
        assert_eq!(bracket_depth(b"[[[[[[[[]]]]]]]]"), 8);
        assert_eq!(bracket_depth(b"))))(("), 2);
    }
}
