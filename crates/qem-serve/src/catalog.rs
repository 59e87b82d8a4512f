//! The catalog: acquisitions addressed by id (never by path), loaded on first use and released
//! least-recently-used first when the resident total would pass the budget (docs/browse.md,
//! "Memory"). Each loaded acquisition carries a cache of what does not depend on a view's
//! geometry (sum/max DP, disk fit, CoM, DPC phase, the prepared SSB).

use crate::config::SharedDataset;
use crate::error::{ApiError, ApiResult};
use qem::detector::DiskFit;
use qem::{Dataset, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// Results of one acquisition that every view may reuse (data never changes once loaded).
#[derive(Debug, Default)]
pub(crate) struct AcqCache {
    pub sum_dp: OnceLock<Vec<u64>>,
    pub max_dp: OnceLock<Vec<u32>>,
    pub disk: OnceLock<DiskFit>,
    /// CoM `(row, col)` relative to the scan mean, detector pixels, as `f32`.
    pub com: OnceLock<(Vec<f32>, Vec<f32>)>,
    pub dpc_phase: OnceLock<Vec<f32>>,
    /// The prepared SSB (replaced by each `ssb/prepare`).
    pub ssb: Mutex<Option<Arc<qem::ssb::Ssb>>>,
}

/// `cell`'s value, computed by `f` the first time (two racing computations give the same value).
pub(crate) fn cached<T>(cell: &OnceLock<T>, f: impl FnOnce() -> ApiResult<T>) -> ApiResult<&T> {
    if let Some(v) = cell.get() {
        return Ok(v);
    }
    let v = f()?;
    let _ = cell.set(v);
    cell.get()
        .ok_or_else(|| ApiError::internal("a cache is empty after filling it"))
}

/// Where a loaded acquisition's data is.
#[derive(Debug, Clone)]
enum AcqData {
    Owned(Arc<Dataset>),
    Shared(Arc<dyn SharedDataset>),
}

/// A loaded acquisition as routes hold it (cheap to clone; keeps the data alive while a
/// request uses it even if the catalog releases it meanwhile).
#[derive(Debug, Clone)]
pub(crate) struct Acq {
    data: AcqData,
    pub cache: Arc<AcqCache>,
}

impl Acq {
    /// Run `f` with the dataset (a closed shared dataset is `closed`, 410).
    pub fn with<T>(&self, f: impl FnOnce(&Dataset) -> ApiResult<T>) -> ApiResult<T> {
        match &self.data {
            AcqData::Owned(ds) => f(ds),
            AcqData::Shared(h) => {
                let mut f = Some(f);
                let mut out = None;
                h.with_dataset(&mut |ds| {
                    if let Some(f) = f.take() {
                        out = Some(f(ds));
                    }
                })
                .map_err(|e| {
                    let msg = e.to_string();
                    if e.kind == qem::ErrorKind::InvalidArgument {
                        ApiError::closed(msg)
                    } else {
                        ApiError::from(e)
                    }
                })?;
                out.unwrap_or_else(|| Err(ApiError::internal("the shared dataset was not run")))
            }
        }
    }
}

/// One catalog entry.
#[derive(Debug)]
struct Entry {
    /// Absolute path (`None` for a shared dataset).
    path: Option<PathBuf>,
    /// Shown name.
    name: String,
    /// Path relative to the served root.
    rel: String,
    loaded: Option<Acq>,
    /// Bytes resident while loaded.
    nbytes: u64,
    /// LRU clock of the last use.
    last_used: u64,
    /// Never released (a caller's dataset).
    pinned: bool,
}

/// What is served.
#[derive(Debug)]
enum Root {
    Folder(PathBuf),
    File(PathBuf),
    Shared,
}

/// The catalog and the resident set.
#[derive(Debug)]
pub(crate) struct Catalog {
    root: Root,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    entries: BTreeMap<String, Entry>,
    clock: u64,
}

/// A stable id of a relative path: FNV-1a 64 as 16 hex digits.
fn id_of(rel: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in rel.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn lock_err() -> ApiError {
    ApiError::internal("the catalog lock was poisoned")
}

impl Catalog {
    /// A catalog of a file or a folder.
    pub fn of_path(path: &Path) -> Result<Catalog> {
        let canon = std::fs::canonicalize(path).map_err(|e| {
            let mut err = qem::Error::io("serve", path, &e);
            if e.kind() == std::io::ErrorKind::NotFound {
                err.kind = qem::ErrorKind::Source;
            }
            err
        })?;
        let root = if canon.is_dir() {
            Root::Folder(canon)
        } else {
            Root::File(canon)
        };
        let c = Catalog {
            root,
            state: Mutex::new(State::default()),
        };
        c.rescan()?;
        Ok(c)
    }

    /// A catalog of one shared dataset of `nbytes` resident bytes.
    pub fn of_shared(name: String, handle: Arc<dyn SharedDataset>, nbytes: u64) -> Catalog {
        let mut st = State::default();
        st.entries.insert(
            id_of(&name),
            Entry {
                path: None,
                rel: name.clone(),
                name,
                loaded: Some(Acq {
                    data: AcqData::Shared(handle),
                    cache: Arc::default(),
                }),
                nbytes,
                last_used: 0,
                pinned: true,
            },
        );
        Catalog {
            root: Root::Shared,
            state: Mutex::new(st),
        }
    }

    /// Re-read a folder (a file's or a shared dataset's catalog never changes). Entries that
    /// vanished are dropped unless loaded; master files whose real path leaves the folder (a
    /// link out) are not listed.
    pub fn rescan(&self) -> Result<()> {
        let found: Vec<(PathBuf, String)> = match &self.root {
            Root::Shared => return Ok(()),
            Root::File(p) => {
                let name = p
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                vec![(p.clone(), name)]
            }
            Root::Folder(root) => qem::discover(root)?
                .into_iter()
                .filter_map(|p| {
                    let real = std::fs::canonicalize(&p).ok()?;
                    if !real.starts_with(root) {
                        return None;
                    }
                    let rel = p.strip_prefix(root).ok()?.to_string_lossy().into_owned();
                    Some((p, rel))
                })
                .collect(),
        };
        let Ok(mut st) = self.state.lock() else {
            return Err(qem::Error::internal(
                "serve",
                "the catalog lock was poisoned",
            ));
        };
        let ids: Vec<String> = found.iter().map(|(_, rel)| id_of(rel)).collect();
        st.entries
            .retain(|id, e| e.loaded.is_some() || ids.contains(id));
        for ((path, rel), id) in found.into_iter().zip(ids) {
            st.entries.entry(id).or_insert_with(|| Entry {
                name: path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                path: Some(path),
                rel,
                loaded: None,
                nbytes: 0,
                last_used: 0,
                pinned: false,
            });
        }
        Ok(())
    }

    /// The loaded acquisition `id` (marked used), or its path to load; `None` when the catalog
    /// does not know `id` (callers rescan once, off the async threads, then answer 404).
    pub fn lookup(&self, id: &str) -> ApiResult<Option<Result<Acq, PathBuf>>> {
        let mut st = self.state.lock().map_err(|_| lock_err())?;
        st.clock += 1;
        let now = st.clock;
        let Some(e) = st.entries.get_mut(id) else {
            return Ok(None);
        };
        if let Some(a) = &e.loaded {
            e.last_used = now;
            return Ok(Some(Ok(a.clone())));
        }
        Ok(e.path.clone().map(Err))
    }

    /// Resident bytes of every loaded acquisition.
    pub fn resident(&self) -> u64 {
        self.state
            .lock()
            .map(|st| {
                st.entries
                    .values()
                    .filter(|e| e.loaded.is_some())
                    .map(|e| e.nbytes)
                    .sum()
            })
            .unwrap_or(0)
    }

    /// Release least-recently-used acquisitions (never pinned ones, never `keep`) until
    /// `incoming` more bytes fit `budget` (or nothing more can be released).
    pub fn make_room(&self, incoming: u64, budget: u64, keep: Option<&str>) -> ApiResult<()> {
        let mut st = self.state.lock().map_err(|_| lock_err())?;
        loop {
            let resident: u64 = st
                .entries
                .iter()
                .filter(|(id, e)| e.loaded.is_some() && Some(id.as_str()) != keep)
                .map(|(_, e)| e.nbytes)
                .sum();
            if resident.saturating_add(incoming) <= budget {
                return Ok(());
            }
            let victim = st
                .entries
                .iter()
                .filter(|(id, e)| e.loaded.is_some() && !e.pinned && Some(id.as_str()) != keep)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(id, _)| id.clone());
            let Some(v) = victim else { return Ok(()) };
            if let Some(e) = st.entries.get_mut(&v) {
                e.loaded = None;
                e.nbytes = 0;
            }
        }
    }

    /// Record `ds` as the loaded acquisition `id`; returns the handle routes use.
    pub fn insert_loaded(&self, id: &str, ds: Dataset) -> ApiResult<Acq> {
        let nbytes = ds.nbytes_resident();
        let acq = Acq {
            data: AcqData::Owned(Arc::new(ds)),
            cache: Arc::default(),
        };
        let mut st = self.state.lock().map_err(|_| lock_err())?;
        st.clock += 1;
        let now = st.clock;
        let e = st
            .entries
            .get_mut(id)
            .ok_or_else(|| ApiError::not_found(format!("no acquisition with id \"{id}\"")))?;
        if let Some(a) = &e.loaded {
            // Loaded meanwhile by another request: keep the first.
            return Ok(a.clone());
        }
        e.loaded = Some(acq.clone());
        e.nbytes = nbytes;
        e.last_used = now;
        Ok(acq)
    }

    /// The listing of docs/browse.md (`GET /acquisitions`; with `only`, that entry alone), each
    /// entry inspected when not loaded (reads files: call it off the async threads).
    pub fn listing(&self, only: Option<&str>) -> ApiResult<Vec<Value>> {
        let snapshot: Vec<(String, Value, Option<PathBuf>, Option<Acq>)> = {
            let st = self.state.lock().map_err(|_| lock_err())?;
            st.entries
                .iter()
                .filter(|(id, _)| only.is_none_or(|o| o == id.as_str()))
                .map(|(id, e)| {
                    let v = json!({"id": id, "name": e.name, "path": e.rel,
                        "loaded": e.loaded.is_some(), "nbytes_resident": e.nbytes, "ready": true,
                        "reason": null, "shape": null, "dtype": null, "representation": null});
                    (id.clone(), v, e.path.clone(), e.loaded.clone())
                })
                .collect()
        };
        let mut out = Vec::with_capacity(snapshot.len());
        for (_, mut v, path, loaded) in snapshot {
            if let Some(a) = &loaded {
                let facts = a.with(|ds| {
                    Ok((
                        ds.shape(),
                        ds.dtype().numpy_name(),
                        ds.representation().name(),
                    ))
                });
                match facts {
                    Ok((shape, dtype, rep)) => {
                        v["shape"] = json!(shape);
                        v["dtype"] = json!(dtype);
                        v["representation"] = json!(rep);
                    }
                    Err(e) => {
                        v["ready"] = json!(false);
                        v["reason"] = json!(e.message);
                    }
                }
            } else if let Some(p) = &path {
                inspect_into(p, &mut v);
            }
            out.push(v);
        }
        Ok(out)
    }
}

/// Readiness, shape and dtype of a not-loaded source.
fn inspect_into(p: &Path, v: &mut Value) {
    match qem::inspect(p, None) {
        Ok(ins) => {
            v["ready"] = json!(ins.verdict.ready);
            v["reason"] = json!(ins.verdict.reason);
            if let (Some(s), Some(d)) = (ins.scan_shape, ins.detector_shape) {
                v["shape"] = json!([s.rows, s.cols, d.rows, d.cols]);
            }
            v["dtype"] = json!(ins.dtype.map(|d| d.numpy_name()));
        }
        Err(e) => {
            v["ready"] = json!(false);
            v["reason"] = json!(e.to_string());
        }
    }
}
