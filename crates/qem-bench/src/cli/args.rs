//! The `qem-bench` grammar (clap derive).

use clap::{Args, Parser, Subcommand};
use qem::{BackendRequest, DtypeRequest};
use qem_cli::shared::parse_value;
use std::path::PathBuf;

/// Measurement for quantem.gpu: load benchmarks and the reference acquisition; each prints a
/// table (or JSON) and writes a JSON record.
#[derive(Debug, Parser)]
#[command(name = "qem-bench", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands, each a module of its own.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Time loading a Dectris acquisition: a generated one on the CPU (with --h5py, also
    /// h5py), or an existing one (--source) on any backend, with --cpu-check and --cupy.
    Load(BenchLoadArgs),
    /// Write the reference benchmark acquisition (Dectris master + bitshuffle/LZ4 shards):
    /// by default 512x512 scan x 192x192 u16, 200,000 e-/frame (about 6x compression).
    GenerateReference(GenerateReferenceArgs),
}

/// `qem-bench generate-reference`
#[derive(Debug, Args)]
pub struct GenerateReferenceArgs {
    /// Output folder (created if needed); gets scan_master.h5, scan_data_NNNNNN.h5 and
    /// reference_acquisition.json. Existing files of those names are overwritten.
    pub outdir: PathBuf,
    /// Scan shape (rows, columns).
    #[arg(long, num_args = 2, value_names = ["R", "C"], default_values_t = [512u64, 512],
          value_parser = clap::value_parser!(u64).range(1..))]
    pub scan: Vec<u64>,
    /// Detector side K (square), or K_R K_C.
    #[arg(long, num_args = 1..=2, value_names = ["K"], default_values_t = [192u64],
          value_parser = clap::value_parser!(u64).range(1..))]
    pub detector: Vec<u64>,
    /// Expected electrons per frame.
    #[arg(long, default_value_t = 200_000.0)]
    pub dose: f64,
    /// Radius of the bright-field disk in pixels.
    #[arg(long, default_value_t = 30.0)]
    pub radius: f64,
    /// Frames per data shard.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub frames_per_file: u64,
    /// Element type of the frames: u16 or u32.
    #[arg(long, default_value = "u16")]
    pub dtype: String,
    /// Worker threads (0 = one per logical CPU).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Seed of the per-frame random streams.
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// Print the JSON summary instead of a summary line.
    #[arg(long)]
    pub json: bool,
}

/// `qem-bench load`
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
    /// Also time h5py + hdf5plugin reading the same file (runs `python3`; generated CPU
    /// benchmark only).
    #[arg(long)]
    pub h5py: bool,
    /// Print the JSON record instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Engine to time: cpu, cuda or auto. Anything but cpu needs --source.
    #[arg(long, default_value = "cpu", value_parser = parse_value::<BackendRequest>)]
    pub backend: BackendRequest,
    /// Load this existing acquisition (master .h5 or plain HDF5) instead of generating one
    /// (make one with `qem-bench generate-reference`).
    #[arg(long, value_name = "MASTER")]
    pub source: Option<PathBuf>,
    /// Scan shape of --source when the file does not say it.
    #[arg(long, num_args = 2, value_names = ["R", "C"],
          value_parser = clap::value_parser!(u64).range(1..))]
    pub scan_shape: Option<Vec<u64>>,
    /// Load only this half-open scan region (--source).
    #[arg(long, num_args = 4, value_names = ["R0", "R1", "C0", "C1"])]
    pub scan_region: Option<Vec<u64>>,
    /// Detector binning factor (--source).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub det_bin: u64,
    /// Result dtype (--source): native, u16, u32 or u8 (saturating).
    #[arg(long, default_value = "native", value_parser = parse_value::<DtypeRequest>)]
    pub dtype: DtypeRequest,
    /// Also load --source with the CPU engine and compare byte for byte (checksums of the whole
    /// array and ~1,000 sampled frames); a mismatch exits non-zero.
    #[arg(long)]
    pub cpu_check: bool,
    /// Also time what users do today (--source): h5py + hdf5plugin into NumPy, then
    /// `cupy.asarray` (runs `python3`; needs numpy, h5py, hdf5plugin, cupy), and compare
    /// its checksum with ours.
    #[arg(long)]
    pub cupy: bool,
}
