//! The command-line grammar (clap derive).

use crate::shared::parse_value;
pub use crate::shared::shape2;
use clap::{Args, Parser, Subcommand};
use qem::detector::{Product, Unit};
use qem::dpc::EdgeMode;
use qem::{BackendRequest, Representation};
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
/// Each has a variant here and a module of its own.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the compute backends and whether each can run here.
    Device(DeviceArgs),
    /// Report whether a source can be loaded (shards, frames, scan shape) without decoding it.
    Inspect(InspectArgs),
    /// Load a source as ENCODED (rANS counts) and write it as a .qem file that reopens without
    /// re-encoding.
    Convert(ConvertArgs),
    /// Virtual-detector images, diffraction patterns, moments and centre of mass of a source in
    /// one pass: a PNG (with a grey-level bar) and a .npy per product, and products.json.
    Products(ProductsArgs),
    /// Centre of mass, rotation/transpose, and the integrated DPC phase (iDPC) of a source:
    /// PNGs and .npy arrays of com_row, com_col and phase, and dpc.json.
    Dpc(DpcArgs),
    /// Single-sideband ptychography (optionally fitting C10, C12, φ12, ...): phase and
    /// amplitude PNG + .npy, object_re/object_im .npy, and ssb.json with the loss curve.
    Ssb(SsbArgs),
    /// Simulate a small SrTiO3 acquisition, write it as Dectris files, load it, and write
    /// detector images, diffraction patterns and the DPC phase with a JSON report.
    Demo(DemoArgs),
    /// Serve a local web page and HTTP API onto an acquisition, a folder of acquisitions or the
    /// demo (docs/browse.md); prints the URL with its token and serves until Ctrl-C.
    Serve(ServeArgs),
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

/// `quantem-gpu convert`
#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// A Dectris master file, a plain HDF5 file or a .qem file.
    pub path: PathBuf,
    /// The .qem file to write (replaced atomically if it exists).
    pub out: PathBuf,
    /// Engine that encodes: auto (the CPU until the CUDA encoder is wired), cpu or cuda.
    #[arg(long, default_value = "auto", value_parser = parse_value::<BackendRequest>)]
    pub backend: BackendRequest,
    /// Scan shape (rows, columns) when the file does not say.
    #[arg(long, num_args = 2, value_names = ["R", "C"], value_parser = clap::value_parser!(u64).range(1..))]
    pub scan_shape: Option<Vec<u64>>,
    /// Print a JSON record instead of a summary.
    #[arg(long)]
    pub json: bool,
}

/// Products written by default by `quantem-gpu products`.
pub const DEFAULT_PRODUCTS: &str = "bf,abf,adf,haadf,df,sum_dp,mean_dp,max_dp,com";

/// The source and output flags of the commands that load one acquisition and write results
/// (`products`, `dpc`, `ssb`).
#[derive(Debug, Args)]
pub struct JobIo {
    /// A Dectris master file, a plain HDF5 file or a .qem file.
    pub path: PathBuf,
    /// Output folder (created if needed); existing files of the same names are replaced.
    #[arg(long)]
    pub out: PathBuf,
    /// Engine: auto (CUDA when usable, else CPU), cpu or cuda.
    #[arg(long, default_value = "auto", value_parser = parse_value::<BackendRequest>)]
    pub backend: BackendRequest,
    /// Scan shape (rows, columns) when the file does not say.
    #[arg(long, num_args = 2, value_names = ["R", "C"], value_parser = clap::value_parser!(u64).range(1..))]
    pub scan_shape: Option<Vec<u64>>,
    /// How the loaded counts are held: dense or encoded (default: the backend's).
    #[arg(long, value_parser = parse_value::<Representation>)]
    pub representation: Option<Representation>,
}

/// `quantem-gpu products`
#[derive(Debug, Args)]
pub struct ProductsArgs {
    #[command(flatten)]
    pub io: JobIo,
    /// Comma-separated products: bf, abf, adf, haadf, df, annular, sum_dp, mean_dp, max_dp,
    /// moments, com.
    #[arg(long, value_delimiter = ',', default_value = DEFAULT_PRODUCTS, value_parser = parse_product)]
    pub products: Vec<Product>,
    /// BF-disk centre (row, column) in detector pixels (default: fitted from the mean DP).
    #[arg(long, num_args = 2, value_names = ["ROW", "COL"], allow_negative_numbers = true)]
    pub center: Option<Vec<f64>>,
    /// BF-disk radius in detector pixels (default: fitted from the mean DP).
    #[arg(long)]
    pub radius: Option<f64>,
    /// Inner radius of the annular detectors in --unit (default: each detector's definition).
    #[arg(long)]
    pub inner: Option<f64>,
    /// Outer radius of the annular detectors in --unit.
    #[arg(long)]
    pub outer: Option<f64>,
    /// Unit of --inner and --outer: px or mrad.
    #[arg(long, default_value = "px", value_parser = parse_value::<Unit>)]
    pub unit: Unit,
    /// Convergence semi-angle, mrad (converts mrad with the disk radius when the detector
    /// sampling is not known).
    #[arg(long)]
    pub semiangle_mrad: Option<f64>,
    /// Detector angular sampling, mrad per (loaded) pixel.
    #[arg(long)]
    pub det_sampling_mrad: Option<f64>,
    /// Print products.json to stdout instead of a summary.
    #[arg(long)]
    pub json: bool,
}

/// `quantem-gpu dpc`
#[derive(Debug, Args)]
pub struct DpcArgs {
    #[command(flatten)]
    pub io: JobIo,
    /// Rotation of the CoM field into the scan frame, degrees (default: found by minimising
    /// the curl, its 180° ambiguity resolved by the sign criterion).
    #[arg(long, allow_negative_numbers = true)]
    pub rotation_deg: Option<f64>,
    /// Exchange the CoM components before the rotation: true or false (default: found with
    /// the rotation; false with --rotation-deg).
    #[arg(long)]
    pub transpose: Option<bool>,
    /// Edge handling of the integration: periodic or mirror.
    #[arg(long, default_value = "periodic", value_parser = parse_value::<EdgeMode>)]
    pub edge: EdgeMode,
    /// Print dpc.json to stdout instead of a summary.
    #[arg(long)]
    pub json: bool,
}

/// `quantem-gpu ssb`
#[derive(Debug, Args)]
pub struct SsbArgs {
    #[command(flatten)]
    pub io: JobIo,
    /// Accelerating voltage, kV.
    // Negative numbers parse so that validation names the bad value (exit 3), not clap.
    #[arg(long, allow_negative_numbers = true)]
    pub voltage_kv: f64,
    /// Probe-forming aperture semi-angle α, mrad.
    #[arg(long, allow_negative_numbers = true)]
    pub semiangle_mrad: f64,
    /// Scan step in Å: one value, or row and column steps.
    #[arg(long, num_args = 1..=2, value_names = ["STEP"], required = true,
          allow_negative_numbers = true)]
    pub scan_step_a: Vec<f64>,
    /// Detector angular sampling, mrad per (loaded) pixel (default: α / r_BF of the fitted
    /// BF disk).
    #[arg(long)]
    pub det_sampling_mrad: Option<f64>,
    /// With no --det-sampling-mrad: the anchor's 2α / r_BF instead (reproduces its numbers;
    /// not physical).
    #[arg(long)]
    pub compat_2alpha: bool,
    /// Scan–detector rotation, degrees (the value `quantem-gpu dpc` reports).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub rotation_deg: f64,
    /// Exchange the detector's row and column axes before the rotation (when `quantem-gpu dpc`
    /// reports transpose: true).
    #[arg(long)]
    pub transpose: bool,
    /// BF pixels need a mean intensity above this fraction of the maximum.
    #[arg(long, default_value_t = 0.0)]
    pub bf_threshold: f64,
    /// Bytes the prepared spectra may take (default: the host's available memory on the CPU,
    /// the free device memory on CUDA, besides the dataset).
    #[arg(long)]
    pub memory_budget: Option<u64>,
    /// Engine for the SSB itself: auto (the one holding the data), cpu, or cuda (also for data
    /// loaded with --backend cpu: the card then holds the spectra, never the acquisition).
    #[arg(long, default_value = "auto", value_parser = parse_value::<BackendRequest>)]
    pub engine: BackendRequest,
    /// Fit the aberrations (--fit-params) before reconstructing; the values given below are
    /// the start point and the fixed values of the others.
    #[arg(long)]
    pub fit: bool,
    /// Comma-separated coefficients to fit (of C10, C12, phi12, C21, phi21, C23, phi23, C30).
    #[arg(long, value_delimiter = ',', default_value = "C10,C12,phi12")]
    pub fit_params: Vec<String>,
    /// Loss to minimise: coherence (robust on strong or noisy data; the default) or
    /// phase_variance (the anchor's).
    #[arg(long, default_value = "coherence", value_parser = crate::ssb_cmd::parse_objective)]
    pub objective: qem::ssb::Objective,
    /// Seed of the global search.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Global search points (default 200).
    #[arg(long)]
    pub global_evals: Option<usize>,
    /// Nelder–Mead iterations per start (default 200).
    #[arg(long)]
    pub local_max_iter: Option<usize>,
    /// Evaluate every loss over all BF pixels (by default the global points and each start's
    /// first stage use a quarter of them, the last stage all).
    #[arg(long)]
    pub no_coarse: bool,
    #[command(flatten)]
    pub aberrations: AberrationArgs,
    /// Print ssb.json to stdout instead of a summary.
    #[arg(long)]
    pub json: bool,
}

/// Declares [`AberrationArgs`] (one optional flag per coefficient) and its [`given`] list
/// from one table, so that a flag and the coefficient name it sets cannot drift apart.
///
/// [`given`]: AberrationArgs::given
macro_rules! aberration_args {
    ($($(#[doc = $doc:literal])+ $field:ident => $name:literal,)+) => {
        /// The aberration flags of `quantem-gpu ssb` (Å / rad; unset = 0, or the fit's start).
        #[derive(Debug, Args)]
        pub struct AberrationArgs {
            $(
                $(#[doc = $doc])+
                #[arg(long, allow_negative_numbers = true)]
                pub $field: Option<f64>,
            )+
        }

        impl AberrationArgs {
            /// The coefficients given, by their names in [`qem::ssb::ABERRATION_NAMES`].
            pub fn given(&self) -> Vec<(&'static str, f64)> {
                [$(($name, self.$field)),+]
                    .into_iter()
                    .filter_map(|(name, v)| Some((name, v?)))
                    .collect()
            }
        }
    };
}

aberration_args! {
    /// Defocus C10, Å (positive = overfocus; abTEM's defocus is −C10).
    c10 => "C10",
    /// Two-fold astigmatism C12, Å.
    c12 => "C12",
    /// Angle of C12, rad.
    phi12 => "phi12",
    /// Axial coma C21, Å.
    c21 => "C21",
    /// Angle of C21, rad.
    phi21 => "phi21",
    /// Three-fold astigmatism C23, Å.
    c23 => "C23",
    /// Angle of C23, rad.
    phi23 => "phi23",
    /// Spherical aberration C30, Å.
    c30 => "C30",
}

/// `quantem-gpu demo`
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Output folder (created if needed).
    #[arg(long, default_value = "quantem-demo")]
    pub out: PathBuf,
    /// Engine: auto (CUDA when usable, else CPU), cpu or cuda.
    #[arg(long, default_value = "auto", value_parser = parse_value::<BackendRequest>)]
    pub backend: BackendRequest,
    /// Print the report JSON instead of a summary.
    #[arg(long)]
    pub json: bool,
}

/// `quantem-gpu serve`
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// A master file, a plain HDF5 or .qem file, or a folder (a catalog of every acquisition in
    /// it).
    #[arg(required_unless_present = "demo", conflicts_with = "demo")]
    pub path: Option<PathBuf>,
    /// Serve the built-in simulated acquisition (written to a temporary folder).
    #[arg(long)]
    pub demo: bool,
    /// Engine: auto (CUDA when usable, else CPU), cpu or cuda.
    #[arg(long, default_value = "auto", value_parser = parse_value::<BackendRequest>)]
    pub backend: BackendRequest,
    /// Address to bind; anything but a loopback address needs a token.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0 = any free port).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Use this token instead of a random one.
    #[arg(long, conflicts_with = "no_token")]
    pub token: Option<String>,
    /// No token (refused unless the host is a loopback address).
    #[arg(long)]
    pub no_token: bool,
    /// Bytes of acquisitions kept loaded (default: 80 % of the GPU's memory on CUDA, half of
    /// the machine's memory on the CPU).
    #[arg(long)]
    pub memory_budget: Option<u64>,
    /// encoded or dense (default: the backend's).
    #[arg(long, value_parser = parse_value::<Representation>)]
    pub representation: Option<Representation>,
    /// Open the page in the default browser.
    #[arg(long)]
    pub open: bool,
}

fn parse_product(s: &str) -> Result<Product, String> {
    parse_value(s.trim())
}
