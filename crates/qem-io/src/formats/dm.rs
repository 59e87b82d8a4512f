//! Placeholder.
use crate::{OpenOptions, Source};
use qem_core::{Error, Result};
use std::path::Path;

pub(crate) fn open(path: &Path, _opts: &OpenOptions) -> Result<Source> {
    Err(Error::source("open", "format not supported yet").with_file(path))
}
