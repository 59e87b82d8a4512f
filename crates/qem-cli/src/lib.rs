//! `qem-cli`: the `quantem-gpu` command line of quantem.gpu.
//!
//! [`run`] parses the arguments, runs one subcommand and returns the exit code, so that the
//! binary (`src/main.rs`) and the Python package's console entry point are the very same
//! command. It is the user's command line only: everything it computes comes from the `qem`
//! façade (and `qem-sim`/`qem-io`'s writer for the demo). Measurement (`generate-reference`,
//! `bench load`) is the `qem-bench` command of crate `qem-bench`, which shares [`shared`]: exit
//! codes, the quoted command line, printing and argument parsers.
//!
//! Exit codes: 0 ok, 2 usage, 3 bad input or source, 4 backend unavailable, 5 memory budget
//! exceeded, 1 anything else (an internal error). Library errors map through
//! [`qem::ErrorKind::exit_code`].

mod args;
mod convert;
mod demo;
mod device;
mod dpc_cmd;
mod image;
mod inspect;
mod output;
mod products_cmd;
mod progress;
mod serve_cmd;
pub mod shared;
mod ssb_cmd;

use shared::print_out;
use std::ffi::OsString;

/// Run `quantem-gpu` with `args` (`args[0]` is the program name) and return the exit code.
///
/// Errors are printed to stderr as `error: <message>`; results go to stdout; help and usage
/// errors are clap's (exit 0 and 2).
pub fn run(args: Vec<OsString>) -> i32 {
    shared::run_command(&args, |cli: args::Cli, command_line| match cli.command {
        args::Command::Device(a) => device::run(&a),
        args::Command::Inspect(a) => inspect::run(&a),
        args::Command::Convert(a) => convert::run(&a, command_line),
        args::Command::Products(a) => products_cmd::run(&a, command_line),
        args::Command::Dpc(a) => dpc_cmd::run(&a, command_line),
        args::Command::Ssb(a) => ssb_cmd::run(&a, command_line),
        args::Command::Demo(a) => demo::run(&a, command_line),
        args::Command::Serve(a) => serve_cmd::run(&a),
    })
}
