//! `qem-cli`: the `quantem-gpu` command line of quantem.gpu.
//!
//! [`run`] parses the arguments, runs one subcommand and returns the exit code, so that the
//! binary (`src/main.rs`) and the Python package's console entry point are the very same
//! command. This is the only crate that knows `anyhow`, terminal progress bars and printing;
//! everything it computes comes from the `qem` façade (and `qem-sim`/`qem-io`'s writer for the
//! demo, `generate-reference` and benchmarks). Nothing depends on it.
//!
//! GPU evidence: `quantem-gpu generate-reference DIR` writes the reference acquisition, and
//! `quantem-gpu bench load --backend cuda --source DIR/scan_master.h5 --cpu-check --cupy` times
//! and checks the CUDA load against the CPU engine and h5py + CuPy (JSON under `bench/results/`).
//!
//! Exit codes: 0 ok, 2 usage, 3 bad input or source, 4 backend unavailable, 5 memory budget
//! exceeded, 1 anything else (an internal error). Library errors map through
//! [`qem::ErrorKind::exit_code`].

mod args;
mod bench;
mod bench_source;
mod convert;
mod demo;
mod device;
mod dpc_cmd;
mod engine;
mod generate;
mod image;
mod inspect;
mod machine;
mod output;
mod products_cmd;
mod progress;
mod serve_cmd;
mod ssb_cmd;

use clap::Parser;
use std::ffi::OsString;
use std::io::Write;

/// Run `quantem-gpu` with `args` (`args[0]` is the program name) and return the exit code.
///
/// Errors are printed to stderr as `error: <message>`; results go to stdout.
pub fn run(args: Vec<OsString>) -> i32 {
    let cli = match args::Cli::try_parse_from(args.iter()) {
        Ok(cli) => cli,
        Err(e) => {
            // Help and --version exit 0, usage errors 2 (clap's own codes).
            let _ = e.print();
            return e.exit_code();
        }
    };
    let command_line = command_line(&args);
    let result = match cli.command {
        args::Command::Device(a) => device::run(&a),
        args::Command::Inspect(a) => inspect::run(&a),
        args::Command::Convert(a) => convert::run(&a, &command_line),
        args::Command::Products(a) => products_cmd::run(&a, &command_line),
        args::Command::Dpc(a) => dpc_cmd::run(&a, &command_line),
        args::Command::Ssb(a) => ssb_cmd::run(&a, &command_line),
        args::Command::Demo(a) => demo::run(&a, &command_line),
        args::Command::Serve(a) => serve_cmd::run(&a),
        args::Command::GenerateReference(a) => generate::run(&a, &command_line),
        args::Command::Bench(args::BenchCommand::Load(a)) => bench::run_load(&a, &command_line),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            exit_code(&e)
        }
    }
}

/// The exit code of an error: the kind of the first `qem::Error` in its chain, else 1.
fn exit_code(err: &anyhow::Error) -> i32 {
    err.chain()
        .find_map(|e| e.downcast_ref::<qem::Error>())
        .map(|e| e.kind.exit_code())
        .unwrap_or(1)
}

/// The command line as a shell would need it typed (for reports).
fn command_line(args: &[OsString]) -> String {
    args.iter()
        .map(|a| {
            let s = a.to_string_lossy();
            let plain = !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
            if plain {
                s.into_owned()
            } else {
                format!("'{}'", s.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Print `text` to stdout (a closed pipe is not an error worth a panic).
fn print_out(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_line_quotes_what_needs_it() {
        let args: Vec<OsString> = ["quantem-gpu", "demo", "--out", "a b", "it's"]
            .iter()
            .map(OsString::from)
            .collect();
        assert_eq!(
            command_line(&args),
            r"quantem-gpu demo --out 'a b' 'it'\''s'"
        );
    }

    #[test]
    fn exit_codes_follow_the_error_kind() {
        let e = anyhow::Error::new(qem::Error::source("load", "missing shard"))
            .context("loading the demo");
        assert_eq!(exit_code(&e), 3);
        let e = anyhow::Error::new(qem::Error::memory_budget("load", 10, 5));
        assert_eq!(exit_code(&e), 5);
        assert_eq!(exit_code(&anyhow::anyhow!("plain")), 1);
    }
}
