//! In-process cache of opened sources' indexes.
//!
//! Opening a Dectris acquisition costs one HDF5 open and one chunk iteration per shard (0.11 s
//! for 27 shards and 262,144 chunks on an H200 host), paid again on every load of the same
//! files. The cache keeps the last few indexes (everything a [`Source`] holds but its file
//! handles) keyed by the named path and the open options, and serves one only when every file
//! it was built from still has the same size and modification time (each is stat-ed on every
//! open, ~28 `stat` calls for a 27-shard acquisition), so a file that changes — an acquisition
//! still being written, a shard replaced — is always re-indexed. Set
//! `QUANTEM_GPU_NO_INDEX_CACHE=1` to disable it.

use crate::{OpenOptions, Source};
use qem_core::{FileIdentity, Result};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// How many sources' indexes are kept.
const CAPACITY: usize = 8;

struct Entry {
    path: PathBuf,
    opts: OpenOptions,
    index: Source,
}

static CACHE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

pub(crate) fn disabled() -> bool {
    std::env::var_os("QUANTEM_GPU_NO_INDEX_CACHE").is_some_and(|v| v != "0" && !v.is_empty())
}

/// True when every file still has the identity recorded in the index.
fn unchanged(files: &[FileIdentity]) -> bool {
    files
        .iter()
        .all(|f| FileIdentity::of(&f.path).is_ok_and(|now| now == *f))
}

/// A fresh [`Source`] from a cached index of `path` opened with `opts`, if one is still valid.
pub(crate) fn lookup(path: &Path, opts: &OpenOptions) -> Result<Option<Source>> {
    if disabled() {
        return Ok(None);
    }
    let Ok(mut cache) = CACHE.lock() else {
        return Ok(None);
    };
    let Some(pos) = cache
        .iter()
        .position(|e| e.path.as_path() == path && e.opts == *opts)
    else {
        return Ok(None);
    };
    if !unchanged(&cache[pos].index.files) {
        cache.remove(pos);
        return Ok(None);
    }
    let source = cache[pos].index.reopen()?;
    // Most recently used last.
    let entry = cache.remove(pos);
    cache.push(entry);
    Ok(Some(source))
}

/// Remember the index of a freshly opened `source`.
pub(crate) fn store(path: &Path, opts: &OpenOptions, source: &Source) {
    if disabled() {
        return;
    }
    let index = source.index_only();
    if let Ok(mut cache) = CACHE.lock() {
        cache.retain(|e| !(e.path.as_path() == path && e.opts == *opts));
        if cache.len() >= CAPACITY {
            cache.remove(0);
        }
        cache.push(Entry {
            path: path.to_path_buf(),
            opts: opts.clone(),
            index,
        });
    }
}
