//! `qem-bench`: measurement for quantem.gpu, in one place.
//!
//! The engines (`qem-cpu`, `qem-cuda`) depend only on the vocabulary, codec and IO crates; what
//! compares one engine with the other, generates test data or times a stage lives here, so no
//! engine has to depend on the other or on the simulator, and the user's command line
//! (`qem-cli`) holds no benchmark. It may depend on every crate of the workspace except
//! `qem-py`; it uses `qem-cli` only for the conventions every command shares
//! (`qem_cli::shared`: exit codes, the quoted command line, printing). Nothing depends on it.
//!
//! * `src/main.rs` and [`cli`]: the `qem-bench` command: `qem-bench load` (time loading an
//!   acquisition on the CPU against h5py, or an existing one on any backend with `--cpu-check`
//!   and `--cupy`) and `qem-bench generate-reference DIR` (the 512² × 192² reference
//!   acquisition); [`machine`] stamps their records.
//! * `src/bin/`: the GPU check binaries, each the CPU engine against the CUDA engine case by
//!   case, with timings, written as JSON (`bench/device.sh` runs them):
//!   `qem-cuda-check` (bitshuffle/LZ4 kernel), `qem-cuda-load-check` (dense load),
//!   `qem-cuda-products-check` (detector products, iDPC), `qem-cuda-rans-check` (rANS codec,
//!   ENCODED load, `.qem` round trip); and `serve-latency`, the browse service's round trips
//!   over loopback (views and a coalescing drag), which runs on the CPU as well.
//! * `examples/`: benchmark and study programs: `cuda_products_bench`, `ssb_cuda_bench`,
//!   `ssb_validation`, `load_time` (through the `qem` façade), `plan_time` (the CUDA load
//!   plan), `decode_speed`, `pair_study`, `rans_ratio` (codec studies).
//! * [`timing`]: the warm-up-then-median timing, and the xorshift64* numbers, the binaries and
//!   programs share.
//!
//! Benchmarks print a table and write JSON; none asserts a time.

pub mod cli;
pub mod machine;
pub mod timing;

use std::path::Path;

/// The CUDA device of a check binary, printed as `device: ...`; where there is none, says why
/// and exits 4.
pub fn cuda_device_or_exit() -> qem_cuda::DeviceInfo {
    match qem_cuda::engine_info() {
        Ok(info) => {
            println!("device: {}", info.summary());
            info
        }
        Err(er) => {
            eprintln!("CUDA unavailable: {er}");
            std::process::exit(4)
        }
    }
}

/// The end of a check binary: writes the record `run` returned as pretty JSON to `out/name`,
/// prints `ALL PASS` or `SOME FAILED` and the path, and exits 0 when every case passed, else 1.
/// A run that failed as a whole prints its error and exits 1.
pub fn finish_check<E: std::fmt::Display>(
    out: &Path,
    name: &str,
    run: Result<(serde_json::Value, bool), E>,
) -> ! {
    match run {
        Ok((v, ok)) => {
            let _ = std::fs::create_dir_all(out);
            let p = out.join(name);
            if let Err(er) =
                std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap_or_default())
            {
                eprintln!("cannot write {}: {er}", p.display());
            }
            println!(
                "{} -> {}",
                if ok { "ALL PASS" } else { "SOME FAILED" },
                p.display()
            );
            std::process::exit(if ok { 0 } else { 1 })
        }
        Err(er) => {
            eprintln!("error: {er}");
            std::process::exit(1)
        }
    }
}

/// Load parameters for a whole acquisition as it is stored (full scan, whole detector, no
/// bin, u16, the source's bad pixels masked): what the check binaries load the reference with.
pub fn whole_u16_load<'a>(
    src: &qem_io::Source,
    bad_mask: Option<&'a [bool]>,
) -> qem_core::Result<qem_cuda::GpuLoadParams<'a>> {
    Ok(qem_cuda::GpuLoadParams {
        scan_region: src.scan_shape.full(),
        detector: qem_core::DetectorPlan::new(src.detector_shape, None, 1)?,
        result_dtype: qem_core::DType::U16,
        saturate: false,
        bad_mask,
        memory_budget: None,
        options: qem_cuda::PipelineOptions::default(),
        progress: None,
    })
}

/// `on` / `off` of a check tool's switch argument (`None` for anything else).
pub fn on_off(v: &str) -> Option<bool> {
    match v {
        "on" => Some(true),
        "off" => Some(false),
        _ => None,
    }
}
