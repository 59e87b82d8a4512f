//! `quantem-gpu inspect PATH`: can this source be loaded, and if not why.
//!
//! A source that is not ready is a successful inspection (exit 0, `ready: false` with the
//! reason); a failure of the inspection itself exits 3 with the reason: a missing file, a
//! symlink loop, something that is not a regular file (a directory, FIFO, device or socket), a
//! file that cannot be opened (permissions) or is not HDF5.

use crate::args::{shape2, InspectArgs};
use crate::print_out;
use anyhow::Context;

pub fn run(a: &InspectArgs) -> anyhow::Result<()> {
    let scan_shape = a.scan_shape.as_deref().and_then(shape2);
    let ins = qem::inspect(&a.path, scan_shape)
        .with_context(|| format!("cannot inspect {}", a.path.display()))?;
    if a.json {
        return print_out(&format!("{}\n", serde_json::to_string_pretty(&ins)?));
    }
    let opt = |v: Option<String>| v.unwrap_or_else(|| "unknown".into());
    let mut s = format!("{}\n", ins.path.display());
    if ins.verdict.ready {
        s.push_str("  ready: yes\n");
    } else {
        s.push_str(&format!(
            "  ready: NO: {}\n",
            opt(ins.verdict.reason.clone())
        ));
        if let Some(action) = &ins.verdict.action {
            s.push_str(&format!("  what to do: {action}\n"));
        }
    }
    s.push_str(&format!(
        "  kind: {}\n",
        opt(ins
            .source_kind
            .as_ref()
            .and_then(|k| serde_json::to_value(k).ok())
            .map(|v| v
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| v.to_string())))
    ));
    s.push_str(&format!(
        "  frames: {} present, {} expected; dtype {}; detector {}\n",
        opt(ins.actual_frames.map(|n| n.to_string())),
        opt(ins.expected_frames.map(|n| n.to_string())),
        opt(ins.dtype.map(|d| d.to_string())),
        opt(ins.detector_shape.map(|d| d.to_string())),
    ));
    s.push_str(&format!(
        "  scan shape: {}{}\n",
        opt(ins.scan_shape.map(|d| d.to_string())),
        ins.scan_shape_origin
            .and_then(|o| serde_json::to_value(o).ok())
            .and_then(|v| v.as_str().map(|o| format!(" (from {o})")))
            .unwrap_or_default()
    ));
    if !ins.shards.is_empty() || !ins.missing_shards.is_empty() {
        s.push_str(&format!(
            "  shards: {} ({} missing)\n",
            ins.shards.len(),
            ins.missing_shards.len()
        ));
    }
    if ins.unwritten.n_missing_frames > 0 {
        s.push_str(&format!(
            "  frames never written: {} (first: {:?})\n",
            ins.unwritten.n_missing_frames,
            &ins.unwritten.missing_frames[..ins.unwritten.missing_frames.len().min(10)]
        ));
    }
    if let Some(b) = ins.bad_pixels {
        s.push_str(&format!("  bad pixels (pixel_mask): {b}\n"));
    }
    if let Some(b) = ins.compressed_bytes {
        s.push_str(&format!("  stored chunk bytes: {b}\n"));
    }
    print_out(&s)
}
