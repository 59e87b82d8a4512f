//! The command-line grammar (clap derive).

use clap::{Args, Parser, Subcommand};
use qem::{BackendRequest, Shape2};
use std::path::PathBuf;

/// quantem.gpu: load 4D-STEM acquisitions onto the GPU (or CPU) and compute images from them.
#[derive(Debug, Parser)]
#[command(name = "quantem-gpu", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
///
/// Later ones (DESIGN.md "CLI surface") get a variant here and a module of their own:
/// `convert PATH OUT.qem`, `products PATH --out DIR`, `dpc PATH --out DIR`,
/// `ssb PATH --out DIR` and (wave 2) `serve PATH`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the compute backends and whether each can run here.
    Device(DeviceArgs),
    /// Report whether a source can be loaded (shards, frames, scan shape) without decoding it.
    Inspect(InspectArgs),
    /// Simulate a small SrTiO3 acquisition, write it as Dectris files, load it, and write
    /// bright-field and annular dark-field images with a JSON report.
    Demo(DemoArgs),
    /// Benchmarks that print a table and write a JSON record.
    #[command(subcommand)]
    Bench(BenchCommand),
}

/// `quantem-gpu bench ...`
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Time loading a generated Dectris acquisition on the CPU (and, with --h5py, h5py).
    Load(BenchLoadArgs),
}

/// `quantem-gpu device`
#[derive(Debug, Args)]
pub struct DeviceArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `quantem-gpu inspect`
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// A Dectris master file or a plain HDF5 file.
    pub path: PathBuf,
    /// Scan shape (rows, columns) when the file does not say.
    #[arg(long, num_args = 2, value_names = ["R", "C"], value_parser = clap::value_parser!(u64).range(1..))]
    pub scan_shape: Option<Vec<u64>>,
    /// Print JSON instead of a summary.
    #[arg(long)]
    pub json: bool,
}

/// `quantem-gpu demo`
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Output folder (created if needed).
    #[arg(long, default_value = "quantem-demo")]
    pub out: PathBuf,
    /// Engine: auto (CUDA when usable, else CPU), cpu or cuda.
    #[arg(long, default_value = "auto", value_parser = parse_backend)]
    pub backend: BackendRequest,
    /// Print the report JSON instead of a summary.
    #[arg(long)]
    pub json: bool,
}

/// `quantem-gpu bench load`
#[derive(Debug, Args)]
pub struct BenchLoadArgs {
    /// Scan shape (rows, columns).
    #[arg(long, num_args = 2, value_names = ["R", "C"], default_values_t = [128u64, 128],
          value_parser = clap::value_parser!(u64).range(1..))]
    pub scan: Vec<u64>,
    /// Detector shape (rows, columns).
    #[arg(long, num_args = 2, value_names = ["K_R", "K_C"], default_values_t = [192u64, 192],
          value_parser = clap::value_parser!(u64).range(1..))]
    pub detector: Vec<u64>,
    /// Electrons per frame (the default gives ≈6x bitshuffle-LZ4 compression, like real ARINA
    /// data, on a 192 x 192 detector).
    #[arg(long, default_value_t = 120_000.0)]
    pub dose: f64,
    /// Folder for the JSON record.
    #[arg(long, default_value = "bench/results")]
    pub out: PathBuf,
    /// Timed loads (at least 5 are recommended for a p50).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeats: u32,
    /// Untimed loads before the timed ones, on both sides (the first load of a process pays the
    /// first touch of its result memory).
    #[arg(long, default_value_t = 1)]
    pub warmup: u32,
    /// Also time h5py + hdf5plugin reading the same file (runs `python3`).
    #[arg(long)]
    pub h5py: bool,
    /// Print the JSON record instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn parse_backend(s: &str) -> Result<BackendRequest, String> {
    s.parse::<BackendRequest>().map_err(|e| e.to_string())
}

/// A validated `(rows, cols)` pair from a two-value option.
pub fn shape2(v: &[u64]) -> Option<Shape2> {
    match v {
        [r, c] => Some(Shape2::new(*r as usize, *c as usize)),
        _ => None,
    }
}
