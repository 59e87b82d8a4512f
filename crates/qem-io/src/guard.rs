//! What this crate agrees to open.
//!
//! A source is untrusted input: a master file or a link inside it can name a FIFO (an `open`
//! that never returns), a device (`/dev/zero`, endless bytes), a socket, a directory, a symlink
//! loop, or a file anywhere on the machine (`/etc/passwd`). Two rules hold for every file this
//! crate opens, the named one, each data shard and every file HDF5 would reach through an
//! external link:
//!
//! 1. **Regular files only.** The path is `stat`-ed first (symlinks followed) and anything that
//!    is not a regular file is refused with a typed error saying what it is; our own handles are
//!    opened with `O_NONBLOCK` and checked again with `fstat`, so a file swapped for a FIFO
//!    between the two calls still cannot block. A symlink loop is reported as one (`ELOOP`),
//!    not as "not found".
//! 2. **External links stay in the acquisition's folder** (see [`resolve_external`]): the
//!    target of an external link (a Dectris `data_NNNNNN` shard link, or any link on an HDF5
//!    path we traverse) is resolved against the folder of the file holding the link, and is
//!    refused when it is absolute, climbs out with `..`, or resolves (symlinks followed) to a
//!    file outside that folder. Setting the environment variable
//!    `QUANTEM_GPU_ALLOW_EXTERNAL_LINKS=1` lifts this rule (never rule 1), for acquisitions whose
//!    shards deliberately live elsewhere.

use qem_core::{Error, Result};
use std::fs::{File, Metadata};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

/// The environment variable that allows external links and shard paths outside the master's
/// folder (`1`); see the module documentation.
pub const ALLOW_EXTERNAL_LINKS_ENV: &str = "QUANTEM_GPU_ALLOW_EXTERNAL_LINKS";

#[cfg(any(target_os = "linux", target_os = "android"))]
const ELOOP: i32 = 40;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
const ELOOP: i32 = 62;

#[cfg(any(target_os = "linux", target_os = "android"))]
const O_NONBLOCK: i32 = 0o4000;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
const O_NONBLOCK: i32 = 0x0004;

fn external_links_allowed() -> bool {
    std::env::var_os(ALLOW_EXTERNAL_LINKS_ENV).is_some_and(|v| v != "0" && !v.is_empty())
}

/// What a non-regular file is, in words.
fn describe_type(md: &Metadata) -> &'static str {
    let ft = md.file_type();
    if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO (named pipe)"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_socket() {
        "a socket"
    } else {
        "not a file"
    }
}

/// The error for a failed `stat`/`open` of `path`: not found and symlink loops are
/// [`qem_core::ErrorKind::Source`] errors saying so, anything else (permission denied, ...) an
/// `Io` error.
pub(crate) fn stat_error(op: &str, path: &Path, what: &str, e: &std::io::Error) -> Error {
    if e.raw_os_error() == Some(ELOOP) {
        Error::source(
            op,
            format!("{what} is a symlink loop (too many levels of symbolic links)"),
        )
        .with_file(path)
        .with_expected("a path that resolves to a regular file")
        .with_found("a symlink loop (ELOOP)")
    } else if e.kind() == std::io::ErrorKind::NotFound {
        Error::source(op, format!("{what} not found"))
            .with_file(path)
            .with_expected("an existing file")
            .with_found("no such file")
    } else {
        Error::io(op, path, e).with_expected(format!("a readable {what}"))
    }
}

fn not_regular(op: &str, path: &Path, what: &str, md: &Metadata) -> Error {
    let kind = describe_type(md);
    Error::source(op, format!("{what} is not a regular file: it is {kind}"))
        .with_file(path)
        .with_expected("a regular file")
        .with_found(kind)
}

/// `stat` `path` (symlinks followed) and refuse anything but a regular file.
pub fn check_regular_file(op: &str, path: &Path, what: &str) -> Result<Metadata> {
    let md = std::fs::metadata(path).map_err(|e| stat_error(op, path, what, &e))?;
    if md.is_file() {
        Ok(md)
    } else {
        Err(not_regular(op, path, what, &md))
    }
}

/// Fill `buf` from the current position of `r`, retrying interrupted reads; fewer bytes only at
/// end of file. Returns how many were read: how a format is recognised by its first bytes.
pub fn read_up_to(mut r: impl std::io::Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Open `path` read-only as a regular file: checked before opening, opened with `O_NONBLOCK`
/// (an `open` of a FIFO swapped in meanwhile returns at once) and checked again on the handle.
pub fn open_regular(op: &str, path: &Path, what: &str) -> Result<File> {
    check_regular_file(op, path, what)?;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(O_NONBLOCK)
        .open(path)
        .map_err(|e| stat_error(op, path, what, &e))?;
    let md = f.metadata().map_err(|e| Error::io(op, path, &e))?;
    if !md.is_file() {
        return Err(not_regular(op, path, what, &md));
    }
    Ok(f)
}

/// The folder a file lives in, canonical when it can be (never the working directory's
/// meaning of a relative path).
pub(crate) fn folder_of(path: &Path) -> PathBuf {
    let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    abs.parent().map(Path::to_path_buf).unwrap_or_default()
}

/// Resolve the target file of external link `link` (stored file name `target`) of a file in
/// folder `dir`, enforcing the confinement policy.
///
/// **Policy** (enforced here, for every external link and shard path this crate follows):
/// * the target must be a relative path without `..` components, so it names a file inside
///   `dir`; an absolute target (`/etc/passwd`) or one that climbs out (`../x.h5`) is refused;
/// * if the target exists, its canonical path (symlinks followed) must lie inside `dir` too,
///   and it must be a regular file (never a FIFO, device, socket or directory);
/// * a target that does not exist is returned as `dir/target`, for the caller to report as a
///   missing shard;
/// * `QUANTEM_GPU_ALLOW_EXTERNAL_LINKS=1` lifts the folder rules (absolute targets are then
///   taken as they are, relative ones against `dir`), never the regular-file rule.
///
/// A refusal is a [`qem_core::ErrorKind::Source`] error naming the link, the target and the
/// rule.
pub(crate) fn resolve_external(
    op: &str,
    holder: &Path,
    dir: &Path,
    link: &str,
    target: &str,
) -> Result<PathBuf> {
    let allowed = external_links_allowed();
    let rel = Path::new(target);
    let refuse = |why: &str| {
        Error::source(
            op,
            format!(
                "external link {link} -> \"{target}\" is refused: it points outside the \
                 acquisition's folder {} ({why}). Rule: data shards and external links must stay \
                 in the folder of the file that links them; set {ALLOW_EXTERNAL_LINKS_ENV}=1 to \
                 allow other locations",
                dir.display()
            ),
        )
        .with_file(holder)
        .with_expected(format!("a file inside {}", dir.display()))
        .with_found(format!("\"{target}\""))
    };
    let lexically_inside = !target.is_empty()
        && rel
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    if !allowed && !lexically_inside {
        return Err(refuse(if rel.is_absolute() {
            "an absolute path"
        } else {
            "a path that climbs out with .."
        }));
    }
    let file = dir.join(rel);
    let md = match std::fs::metadata(&file) {
        Ok(md) => md,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(file),
        Err(e) => {
            let what = format!("target of external link {link} (\"{target}\")");
            return Err(stat_error(op, &file, &what, &e));
        }
    };
    if !md.is_file() {
        let kind = describe_type(&md);
        return Err(Error::source(
            op,
            format!(
                "external link {link} -> \"{target}\" is refused: the target is not a regular \
                 file (it is {kind})"
            ),
        )
        .with_file(holder)
        .with_expected("a regular file")
        .with_found(kind));
    }
    if !allowed {
        let canon = std::fs::canonicalize(&file).map_err(|e| Error::io(op, &file, &e))?;
        let cdir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        if !canon.starts_with(&cdir) {
            return Err(refuse(&format!(
                "it resolves to {} through a symbolic link",
                canon.display()
            )));
        }
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lexical_rules() {
        let dir = std::env::temp_dir();
        let ok = resolve_external("open", Path::new("m.h5"), &dir, "data_000001", "no_such.h5");
        assert_eq!(ok.ok(), Some(dir.join("no_such.h5")));
        for bad in ["/etc/passwd", "../x.h5", "a/../../x.h5", ""] {
            let e = resolve_external("open", Path::new("m.h5"), &dir, "data_000001", bad);
            assert!(
                e.as_ref().is_err_and(|e| e.to_string().contains("outside")),
                "{bad}: {e:?}"
            );
        }
    }
}
