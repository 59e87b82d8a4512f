//! Gatan Digital Micrograph `.dm4`/`.dm3`: recognised by `detect` (big-endian version 3 or 4
//! and the file name), not read yet. Opening one is a `Source` error that says so, so a user is
//! never handed another format's reading of it.

use crate::{OpenOptions, Source};
use qem_core::{Error, Result};
use std::path::Path;

pub(crate) fn open(path: &Path, _opts: &OpenOptions) -> Result<Source> {
    Err(Error::source(
        "open",
        "Gatan .dm4/.dm3 stacks are recognised but not read yet",
    )
    .with_file(path)
    .with_expected(format!(
        "one of the formats read today: {}",
        super::SUPPORTED
    ))
    .with_found("a Gatan Digital Micrograph file"))
}
