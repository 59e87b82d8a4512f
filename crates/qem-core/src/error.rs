//! One error type for the whole library.
//!
//! Every error names the operation, and where they apply the file and frame, what was expected and
//! what was found. The [`ErrorKind`] groups errors into the categories the Python layer maps to its
//! exception hierarchy (`SourceError`, `DecodeError`, `BackendUnavailableError`, ...).

use std::fmt;
use std::path::{Path, PathBuf};

/// Result alias used across the workspace.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The category of an error; each maps to one Python exception class and one CLI exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The source is missing, malformed, inconsistent or incomplete (missing shard, unwritten
    /// chunk, frame-count mismatch, wrong scan shape).
    Source,
    /// Compressed bytes do not decode (corrupt LZ4, truncated chunk, bad header).
    Decode,
    /// A caller-supplied argument is invalid (region out of bounds, zero bin, unknown name).
    InvalidArgument,
    /// A value does not fit the requested dtype (u32 data narrowed to u16).
    Overflow,
    /// The requested backend cannot be used here (no driver, no device, wrong platform).
    BackendUnavailable,
    /// The plan needs more memory than the budget allows.
    MemoryBudget,
    /// The GPU context hit a sticky fault (an illegal address, a failed launch): everything
    /// resident on that device is lost and every later call on it fails with this kind, naming
    /// the first fault and the operation where it happened. The process must be restarted to
    /// use the device again; the CPU backend keeps working.
    DeviceLost,
    /// An operating-system I/O error (open, read, write).
    Io,
    /// A file written by this library fails its own integrity checks, or a broken invariant.
    Internal,
}

impl ErrorKind {
    /// Exit code used by the `quantem-gpu` command line for this kind of error.
    pub fn exit_code(self) -> i32 {
        match self {
            ErrorKind::InvalidArgument => 2,
            ErrorKind::Source | ErrorKind::Decode | ErrorKind::Overflow | ErrorKind::Io => 3,
            ErrorKind::BackendUnavailable | ErrorKind::DeviceLost => 4,
            ErrorKind::MemoryBudget => 5,
            ErrorKind::Internal => 1,
        }
    }
}

/// A typed error with its context.
///
/// Build one with a constructor named after its kind, then add context:
/// ```
/// use qem_core::Error;
/// let e = Error::decode("decode", "LZ4 match offset 0 at byte 88 of block 3")
///     .with_file("scan_data_000002.h5")
///     .with_frame(1045);
/// assert_eq!(
///     e.to_string(),
///     "decode frame 1045 of scan_data_000002.h5: LZ4 match offset 0 at byte 88 of block 3"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error(Box<ErrorDetails>);

/// The fields of an [`Error`] (reachable directly on the error through `Deref`: `err.kind`,
/// `err.frame`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorDetails {
    /// Category of the error.
    pub kind: ErrorKind,
    /// The operation that failed (`"load"`, `"decode"`, `"inspect"`, ...).
    pub op: String,
    /// The file the error applies to, if any.
    pub file: Option<PathBuf>,
    /// The global 0-based frame index the error applies to, if any.
    pub frame: Option<u64>,
    /// What was expected, if the error is a mismatch.
    pub expected: Option<String>,
    /// What was found, if the error is a mismatch.
    pub found: Option<String>,
    /// Human-readable description of what went wrong.
    pub detail: String,
}

impl Error {
    /// A new error of `kind` for operation `op`.
    pub fn new(kind: ErrorKind, op: impl Into<String>, detail: impl Into<String>) -> Self {
        Error(Box::new(ErrorDetails {
            kind,
            op: op.into(),
            file: None,
            frame: None,
            expected: None,
            found: None,
            detail: detail.into(),
        }))
    }
    /// A [`ErrorKind::Source`] error.
    pub fn source(op: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::new(ErrorKind::Source, op, detail)
    }
    /// A [`ErrorKind::Decode`] error.
    pub fn decode(op: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::new(ErrorKind::Decode, op, detail)
    }
    /// A [`ErrorKind::InvalidArgument`] error.
    pub fn invalid(op: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, op, detail)
    }
    /// A [`ErrorKind::Overflow`] error.
    pub fn overflow(op: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::new(ErrorKind::Overflow, op, detail)
    }
    /// A [`ErrorKind::BackendUnavailable`] error.
    pub fn backend_unavailable(backend: &str, reason: impl Into<String>) -> Self {
        Self::new(
            ErrorKind::BackendUnavailable,
            "resolve backend",
            format!("backend \"{backend}\" is unavailable: {}", reason.into()),
        )
    }
    /// A [`ErrorKind::MemoryBudget`] error stating requested and available bytes.
    pub fn memory_budget(op: impl Into<String>, requested: u64, available: u64) -> Self {
        Self::new(
            ErrorKind::MemoryBudget,
            op,
            format!("needs {requested} bytes but only {available} bytes are available"),
        )
        .with_expected(format!("<= {available} bytes"))
        .with_found(format!("{requested} bytes"))
    }
    /// A [`ErrorKind::Io`] error from an OS error on `path`.
    pub fn io(op: impl Into<String>, path: &Path, err: &std::io::Error) -> Self {
        Self::new(ErrorKind::Io, op, err.to_string()).with_file(path)
    }
    /// A [`ErrorKind::Internal`] error.
    pub fn internal(op: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, op, detail)
    }
    /// Attach the file the error applies to.
    pub fn with_file(mut self, file: impl AsRef<Path>) -> Self {
        self.0.file = Some(file.as_ref().to_path_buf());
        self
    }
    /// Attach the global frame index the error applies to.
    pub fn with_frame(mut self, frame: u64) -> Self {
        self.0.frame = Some(frame);
        self
    }
    /// Attach what was expected.
    pub fn with_expected(mut self, expected: impl Into<String>) -> Self {
        self.0.expected = Some(expected.into());
        self
    }
    /// Attach what was found.
    pub fn with_found(mut self, found: impl Into<String>) -> Self {
        self.0.found = Some(found.into());
        self
    }
    /// Replace the operation name (used when a lower layer's error surfaces in a higher op).
    pub fn with_op(mut self, op: impl Into<String>) -> Self {
        self.0.op = op.into();
        self
    }
}

impl std::ops::Deref for Error {
    type Target = ErrorDetails;
    fn deref(&self) -> &ErrorDetails {
        &self.0
    }
}

impl std::ops::DerefMut for Error {
    fn deref_mut(&mut self) -> &mut ErrorDetails {
        &mut self.0
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.op)?;
        if let Some(frame) = self.frame {
            write!(f, " frame {frame}")?;
        }
        if let Some(file) = &self.file {
            let sep = if self.frame.is_some() { " of" } else { "" };
            let name = file
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| file.display().to_string());
            write!(f, "{sep} {name}")?;
        }
        write!(f, ": {}", self.detail)?;
        match (&self.expected, &self.found) {
            (Some(e), Some(x)) => write!(f, " (expected {e}, found {x})"),
            (Some(e), None) => write!(f, " (expected {e})"),
            (None, Some(x)) => write!(f, " (found {x})"),
            (None, None) => Ok(()),
        }
    }
}

impl std::error::Error for Error {}

/// Parse `s` (any case) as the one of `all` whose `name` it is; otherwise an
/// [`ErrorKind::InvalidArgument`] error for `op`, `unknown {what} "{s}"`, expecting the names
/// (`"a, b or c"`) and finding `s`. The shared `FromStr` of the named option enums.
pub fn parse_choice<T: Copy>(
    op: &str,
    what: &str,
    s: &str,
    all: &[T],
    name: impl Fn(T) -> &'static str,
) -> Result<T> {
    let low = s.to_ascii_lowercase();
    if let Some(&t) = all.iter().find(|&&t| name(t) == low) {
        return Ok(t);
    }
    let names: Vec<&str> = all.iter().map(|&t| name(t)).collect();
    Err(unknown_choice(op, what, s, &names))
}

/// The [`ErrorKind::InvalidArgument`] error of `s`, which is none of the `names` of a `what`:
/// for `op`, `unknown {what} "{s}"`, expecting the names (`"a, b or c"`) and finding `s`.
pub fn unknown_choice(op: &str, what: &str, s: &str, names: &[&str]) -> Error {
    let expected = match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => names.join(""),
    };
    Error::invalid(op, format!("unknown {what} \"{s}\""))
        .with_expected(expected)
        .with_found(s.to_string())
}

/// Gives a fieldless option enum its lower-case `name()` (documented by the doc comment given
/// first) and a `FromStr` that reads, in any case, each name and the variant's aliases after
/// it (`Cuda => "cuda" | "gpu"`); anything else is an [`unknown_choice`] error for `op` and
/// `what` that quotes the input lower-cased and lists the names. From one list of variants and
/// names, so that what `name()` writes and what `from_str` reads back cannot drift apart.
///
/// ```
/// #[derive(Debug, Clone, Copy, PartialEq)]
/// enum Edge { Periodic, Mirror }
/// qem_core::named_choice! {
///     /// `"periodic"` or `"mirror"`.
///     Edge, "integrate", "edge mode", { Periodic => "periodic", Mirror => "mirror" | "reflect" }
/// }
/// assert_eq!("MIRROR".parse::<Edge>().unwrap(), Edge::Mirror);
/// assert_eq!("reflect".parse::<Edge>().unwrap(), Edge::Mirror);
/// assert_eq!(Edge::Periodic.name(), "periodic");
/// let e = "Wrap".parse::<Edge>().unwrap_err();
/// assert_eq!(e.expected.as_deref(), Some("periodic or mirror"));
/// assert_eq!(e.found.as_deref(), Some("wrap"));
/// ```
#[macro_export]
macro_rules! named_choice {
    (
        $(#[$name_doc:meta])*
        $ty:ident, $op:literal, $what:literal,
        { $($variant:ident => $name:literal $(| $alias:literal)*),+ $(,)? }
    ) => {
        impl $ty {
            $(#[$name_doc])*
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)+
                }
            }
        }

        impl ::std::str::FromStr for $ty {
            type Err = $crate::Error;
            fn from_str(s: &str) -> $crate::Result<Self> {
                // Lower-cased first: the error has always quoted the lower-cased input.
                let low = s.to_ascii_lowercase();
                match low.as_str() {
                    $($name $(| $alias)* => Ok($ty::$variant),)+
                    _ => Err($crate::error::unknown_choice($op, $what, &low, &[$($name),+])),
                }
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_op_frame_file_expected_found() {
        let e = Error::source("load", "frame count mismatch")
            .with_file("/data/scan_master.h5")
            .with_expected("262144 frames (512 x 512)")
            .with_found("262000 frames");
        assert_eq!(
            e.to_string(),
            "load scan_master.h5: frame count mismatch (expected 262144 frames (512 x 512), found 262000 frames)"
        );
        assert_eq!(e.kind.exit_code(), 3);
    }

    #[test]
    fn memory_budget_states_both_numbers() {
        let e = Error::memory_budget("load", 100, 40);
        let s = e.to_string();
        assert!(s.contains("100") && s.contains("40"), "{s}");
        assert_eq!(e.kind.exit_code(), 5);
    }

    #[test]
    fn parse_choice_matches_any_case_and_lists_the_names() {
        let all = [1u8, 2, 3];
        let name = |t: u8| ["one", "two", "three"][t as usize - 1];
        assert_eq!(parse_choice("op", "thing", "TWO", &all, name).unwrap(), 2);
        let e = parse_choice("op", "thing", "Four", &all, name).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert_eq!(e.expected.as_deref(), Some("one, two or three"));
        assert_eq!(e.found.as_deref(), Some("Four"));
        assert!(e.to_string().contains("unknown thing \"Four\""), "{e}");
    }
}
