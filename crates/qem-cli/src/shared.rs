//! What every quantem.gpu command line shares: exit codes, the command line a record quotes,
//! printing, JSON files and argument parsers. `quantem-gpu` uses it, and so does the
//! measurement command `qem-bench` (crate `qem-bench`), so that both exit, quote and print the
//! same way.

use std::ffi::OsString;
use std::io::Write;
use std::str::FromStr;

pub use crate::output::write_json;

/// The exit code of an error: the kind of the first `qem::Error` in its chain, else 1.
pub fn exit_code(err: &anyhow::Error) -> i32 {
    err.chain()
        .find_map(|e| e.downcast_ref::<qem::Error>())
        .map(|e| e.kind.exit_code())
        .unwrap_or(1)
}

/// Parse `args` (`args[0]` is the program name) as the command `C`, run `body` with it and the
/// quoted command line, and return the exit code: clap's own for help and `--version` (0) and
/// usage errors (2), else [`finish`]'s.
pub fn run_command<C: clap::Parser>(
    args: &[OsString],
    body: impl FnOnce(C, &str) -> anyhow::Result<()>,
) -> i32 {
    match C::try_parse_from(args.iter()) {
        Ok(cli) => finish(body(cli, &command_line(args))),
        Err(e) => {
            let _ = e.print();
            e.exit_code()
        }
    }
}

/// The exit code of a finished subcommand: 0, or the error printed to stderr as
/// `error: <message>` and its [`exit_code`].
pub fn finish(result: anyhow::Result<()>) -> i32 {
    match result {
        Ok(()) => 0,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            exit_code(&e)
        }
    }
}

/// The command line as a shell would need it typed (for reports).
pub fn command_line(args: &[OsString]) -> String {
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
pub fn print_out(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

/// A clap value parser for any type that parses from a string (backends, dtypes, units, ...):
/// the type's own error message on failure.
pub fn parse_value<T: FromStr>(s: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    s.parse::<T>().map_err(|e| e.to_string())
}

/// A validated `(rows, cols)` pair from a two-value option.
pub fn shape2(v: &[u64]) -> Option<qem::Shape2> {
    match v {
        [r, c] => Some(qem::Shape2::new(*r as usize, *c as usize)),
        _ => None,
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
