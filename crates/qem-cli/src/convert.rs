//! `quantem-gpu convert PATH OUT.qem`: load a source as ENCODED and save it as a `.qem` file.
//!
//! `--backend auto` encodes on the CPU engine (the CUDA encoder is not wired yet); `--backend
//! cuda` asks the façade for it and reports its answer.

use crate::args::{shape2, ConvertArgs};
use crate::print_out;
use crate::progress::TermProgress;
use anyhow::Context;
use qem::{BackendRequest, LoadParams, Representation, SourceArg};
use std::time::Instant;

pub fn run(a: &ConvertArgs, command_line: &str) -> anyhow::Result<()> {
    let backend = match a.backend {
        // ENCODED is made by the CPU engine until the CUDA encoder is wired.
        BackendRequest::Auto => BackendRequest::Cpu,
        other => other,
    };
    let progress = TermProgress::for_stderr();
    let params = LoadParams {
        backend,
        scan_shape: a.scan_shape.as_deref().and_then(shape2),
        representation: Some(Representation::Encoded),
        progress: progress.clone(),
        ..LoadParams::default()
    };
    let t0 = Instant::now();
    let ds = qem::load(SourceArg::Path(a.path.clone()), &params)
        .with_context(|| format!("cannot load {} as ENCODED", a.path.display()))?;
    let load_s = t0.elapsed().as_secs_f64();
    let sink: &dyn qem::Progress = match &progress {
        Some(p) => p.as_ref(),
        None => &qem::NoProgress,
    };
    let summary = qem::save(&ds, &a.out, sink)
        .with_context(|| format!("cannot write {}", a.out.display()))?;
    let seconds = t0.elapsed().as_secs_f64();
    let p = ds.provenance();
    let source_bytes: u64 = p.files.iter().map(|f| f.size).sum();
    let source_compressed = p.codec.as_ref().and_then(|c| c.source_compressed_bytes);
    let dense_bytes = ds.nbytes_dense();
    let encoded_bytes = ds.nbytes_resident();
    let ratio = dense_bytes as f64 / encoded_bytes.max(1) as f64;
    let mb_s = dense_bytes as f64 / 1e6 / seconds.max(1e-9);
    if a.json {
        let record = serde_json::json!({
            "command": command_line,
            "source": a.path,
            "out": summary.path,
            "shape": ds.shape(),
            "dtype": ds.dtype(),
            "frames": summary.n_frames,
            "source_file_bytes": source_bytes,
            "source_compressed_bytes": source_compressed,
            "dense_bytes": dense_bytes,
            "encoded_bytes": encoded_bytes,
            "file_bytes": summary.file_bytes,
            "ratio_to_dense": ratio,
            "ratio_to_source": source_compressed.map(|s| s as f64 / encoded_bytes.max(1) as f64),
            "load_encode_seconds": load_s,
            "save_seconds": summary.seconds,
            "seconds": seconds,
            "dense_mb_per_s": mb_s,
            "backend": ds.backend().name(),
            "device": ds.device(),
            "codec": p.codec,
        });
        return print_out(&format!("{}\n", serde_json::to_string_pretty(&record)?));
    }
    let [r, c, kr, kc] = ds.shape();
    let mut s = format!(
        "{} -> {}\n  frames: {} ({r} x {c} scan, {kr} x {kc} {})\n",
        a.path.display(),
        summary.path.display(),
        summary.n_frames,
        ds.dtype()
    );
    s.push_str(&format!(
        "  source: {} bytes in {} file(s){}\n",
        source_bytes,
        p.files.len(),
        source_compressed
            .map(|b| format!(" ({b} bytes of compressed chunks)"))
            .unwrap_or_default()
    ));
    s.push_str(&format!(
        "  encoded: {encoded_bytes} bytes ({ratio:.2}x smaller than {dense_bytes} dense{}); file {} bytes\n",
        source_compressed
            .map(|b| format!(", {:.2}x smaller than the source's chunks", b as f64 / encoded_bytes.max(1) as f64))
            .unwrap_or_default(),
        summary.file_bytes
    ));
    s.push_str(&format!(
        "  time: {seconds:.2} s (load+encode {load_s:.2} s, save {:.2} s), {mb_s:.0} MB/s of dense data, backend {}\n",
        summary.seconds,
        ds.backend().name()
    ));
    print_out(&s)
}
