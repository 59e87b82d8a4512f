//! NumPy `.npy` files: the header (parsed by `npyz`) gives the element type, shape and order;
//! frames are then read in place with positional reads, frame by frame, like a memory map
//! (the file is never loaded whole).
//!
//! Layout (NumPy's format spec, versions 1-3): magic `\x93NUMPY`, major and minor version
//! bytes, a little-endian header length (`u16` in v1, `u32` in v2/v3), the header text (a
//! Python dict with `descr`, `fortran_order`, `shape`), then the C-order array.

use super::{build, elem_from_typestr, split_shape, Found, Strided};
use crate::{guard, OpenOptions, Source, SourceKind};
use qem_core::{Error, Metadata, Result};
use std::io::Read;
use std::path::Path;

const OP: &str = "open";

/// Open a `.npy` file of shape `(N, k_r, k_c)` or `(R, C, k_r, k_c)`.
pub(crate) fn open(path: &Path, opts: &OpenOptions) -> Result<Source> {
    let mut f = guard::open_regular(OP, path, "npy file")?;
    let mut pre = [0u8; 12];
    let mut n = 0;
    while n < pre.len() {
        match f.read(&mut pre[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(OP, path, &e)),
        }
    }
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
    let f = guard::open_regular(OP, path, "npy file")?;
    let header = npyz::NpyHeader::from_reader(std::io::BufReader::new(f))
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
    let (dtype, elem, es) = elem_from_typestr(&ts.to_string(), path)?;
    let (n_frames, array_scan, det) = split_shape(
        header.shape(),
        path,
        "the array",
        qem_core::ErrorKind::Source,
    )?;
    let stored = (det.len() as u64).saturating_mul(es as u64);
    let mut metadata = Metadata::default();
    metadata.extra.insert(
        "npy_descr".into(),
        serde_json::Value::String(ts.to_string()),
    );
    build(
        path,
        opts,
        Found {
            kind: SourceKind::Npy,
            data_file: path.to_path_buf(),
            side_files: Vec::new(),
            dtype,
            detector: det,
            frames: Strided {
                first: data_offset,
                stride: stored,
                stored_frame_bytes: stored,
                n_frames,
            },
            array_scan,
            recorded_scan: None,
            elem,
            metadata,
        },
    )
}
