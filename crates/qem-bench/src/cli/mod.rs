//! The `qem-bench` command: `load` (time and check loading an acquisition) and
//! `generate-reference` (write the reference acquisition). Exit codes, the quoted command line
//! and printing are `quantem-gpu`'s ([`qem_cli::shared`]).
//!
//! GPU evidence: `qem-bench generate-reference DIR` writes the reference acquisition, and
//! `qem-bench load --backend cuda --source DIR/scan_master.h5 --cpu-check --cupy` times and
//! checks the CUDA load against the CPU engine and h5py + CuPy (JSON under `bench/results/`).

mod args;
mod generate;
mod load;
mod load_source;

use qem_cli::shared;
use std::ffi::OsString;

/// Run `qem-bench` with `args` (`args[0]` is the program name) and return the exit code
/// (`quantem-gpu`'s: 0 ok, 2 usage, 3 bad input, 4 backend unavailable, 5 memory budget, 1
/// anything else, including a failed comparison).
pub fn run(args: Vec<OsString>) -> i32 {
    shared::run_command(&args, |cli: args::Cli, command_line| match cli.command {
        args::Command::Load(a) => load::run(&a, command_line),
        args::Command::GenerateReference(a) => generate::run(&a, command_line),
    })
}
