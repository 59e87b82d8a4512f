//! Opening a source: locating the frame dataset(s), the one-pass chunk index, consistency checks
//! and scan-shape resolution.

use crate::formats::host::{BlockGeom, ElemConv, H5Filter};
use crate::guard;
use crate::h5::{self, h5err, RawChunk};
use crate::meta::{self, MasterInfo};
use crate::MissingFrames;
use crate::{ChunkCodec, ChunkRecord, OpenOptions, Source, SourceKind};
use hdf5::types::{IntSize, TypeDescriptor};
use qem_core::{
    checked_product, DType, Error, ErrorKind, FileIdentity, Result, ScanShapeOrigin, Shape2,
};
use std::path::{Path, PathBuf};

const OP: &str = "open";

/// One `/entry/data/data_NNNNNN` member of a master file.
#[derive(Debug, Clone)]
pub(crate) struct ShardLink {
    /// Link name (`data_000001`).
    pub name: String,
    /// The file holding the dataset: the shard (resolved against the master's directory) or the
    /// master itself for an internal dataset.
    pub file: PathBuf,
    /// Object path inside `file`.
    pub obj_path: String,
    /// True when the member is an internal dataset of the master.
    pub internal: bool,
}

/// Where the frames of a file live.
#[derive(Debug, Clone)]
pub(crate) enum Located {
    /// Shards of a Dectris master, sorted.
    Shards(Vec<ShardLink>),
    /// One dataset inside the named file.
    Inline(String),
}

/// Is `name` a Dectris shard member name (`data_` + digits)?
fn shard_number(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("data_")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The directory the master lives in (never the process working directory).
fn master_dir(path: &Path) -> PathBuf {
    guard::folder_of(path)
}

/// Check that HDF5 may open the frame dataset at `p` (no refused external link on the way,
/// see [`crate::guard`]) and that it exists.
fn check_dataset_path(file: &hdf5::File, path: &Path, p: &str) -> Result<()> {
    if h5::check_path(file, p).map_err(|e| e.with_file(path))? {
        Ok(())
    } else {
        Err(Error::source(OP, format!("no dataset at \"{p}\""))
            .with_file(path)
            .with_expected(format!("a 3-D or 4-D dataset at {p}"))
            .with_found("nothing"))
    }
}

/// Find the frame dataset(s) of `file`.
pub(crate) fn locate(file: &hdf5::File, path: &Path, opts: &OpenOptions) -> Result<Located> {
    if let Some(p) = &opts.dataset_path {
        check_dataset_path(file, path, p)?;
        return Ok(Located::Inline(p.clone()));
    }
    if h5::check_path(file, "/entry/data")? {
        if let Ok(group) = file.group("/entry/data") {
            let names = group
                .member_names()
                .map_err(|e| h5err(OP, path, "cannot list /entry/data", e))?;
            let mut numbered: Vec<(u64, String)> = names
                .into_iter()
                .filter_map(|n| shard_number(&n).map(|k| (k, n)))
                .collect();
            numbered.sort();
            if !numbered.is_empty() {
                let dir = master_dir(path);
                let mut links = Vec::with_capacity(numbered.len());
                for (_, name) in numbered {
                    match h5::external_link_target(&group, &name) {
                        Some((fname, obj)) => links.push(ShardLink {
                            file: guard::resolve_external(OP, path, &dir, &name, &fname)?,
                            obj_path: obj,
                            name,
                            internal: false,
                        }),
                        None => links.push(ShardLink {
                            file: path.to_path_buf(),
                            obj_path: format!("/entry/data/{name}"),
                            name,
                            internal: true,
                        }),
                    }
                }
                return Ok(Located::Shards(links));
            }
            if group.link_exists("data") {
                check_dataset_path(file, path, "/entry/data/data")?;
                return Ok(Located::Inline("/entry/data/data".to_string()));
            }
        }
    }
    // The single 3-D/4-D integer dataset of the file.
    let mut found = Vec::new();
    find_frame_datasets(file, "", &mut found, 0);
    match found.len() {
        1 => Ok(Located::Inline(found.remove(0))),
        0 => Err(Error::source(OP, "no frame dataset found")
            .with_file(path)
            .with_expected(
                "/entry/data/data_NNNNNN links, /entry/data/data, or one 3-D/4-D integer dataset",
            )
            .with_found("none")),
        _ => Err(Error::source(
            OP,
            format!(
                "several 3-D/4-D integer datasets ({}); pass dataset_path to choose one",
                found.join(", ")
            ),
        )
        .with_file(path)
        .with_expected("exactly one candidate dataset")
        .with_found(format!("{} candidates", found.len()))),
    }
}

/// Recursively collect 3-D/4-D integer datasets reachable through hard links.
fn find_frame_datasets(g: &hdf5::Group, prefix: &str, out: &mut Vec<String>, depth: usize) {
    if depth > 16 {
        return;
    }
    let mut members: Vec<String> = Vec::new();
    let _ = g.iter_visit_default(|name, info| {
        if info.link_type == hdf5::LinkType::Hard {
            members.push(name.to_string());
        }
        Ok(())
    });
    for name in members {
        let full = format!("{prefix}/{name}");
        if let Ok(ds) = g.dataset(&name) {
            let nd = ds.ndim();
            let int = matches!(
                ds.dtype().and_then(|t| t.to_descriptor()),
                Ok(TypeDescriptor::Unsigned(_))
                    | Ok(TypeDescriptor::Integer(_))
                    | Ok(TypeDescriptor::Float(hdf5::types::FloatSize::U4))
            );
            if int && (nd == 3 || nd == 4) {
                out.push(full);
            }
        } else if let Ok(sub) = g.group(&name) {
            find_frame_datasets(&sub, &full, out, depth + 1);
        }
    }
}

/// What one frame dataset (a shard or the inline dataset) holds.
#[derive(Debug, Clone)]
pub(crate) struct PartInfo {
    pub dtype: DType,
    pub detector_shape: Shape2,
    pub frames: u64,
    /// Leading dims of a 4-D dataset.
    pub array_scan: Option<Shape2>,
    pub codec: ChunkCodec,
    /// Chunks with `first_frame` relative to this part and `file` unset (0).
    pub chunks: Vec<ChunkRecord>,
    pub image_nr: (Option<i128>, Option<i128>),
    pub scan_attr: Option<Vec<i128>>,
    /// Host-side decoding the frames need (filters we decode ourselves, 4-D blocks of partial
    /// rows, big-endian or float32 elements); `codec` is then `Raw`.
    pub host: Option<HostSpec>,
}

/// What a part needs decoded on the host (becomes a [`crate::HostDecode`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HostSpec {
    pub filters: Vec<H5Filter>,
    pub block: Option<BlockGeom>,
    pub elem: ElemConv,
    pub stored_frame_bytes: usize,
}

impl HostSpec {
    pub(crate) fn build(&self, frame_bytes: usize) -> crate::HostDecode {
        crate::HostDecode::new(
            self.filters.clone(),
            self.block,
            self.elem,
            self.stored_frame_bytes,
            frame_bytes,
        )
    }
}

/// Describe one frame dataset: type, shape, codec and its complete chunk index.
pub(crate) fn describe(ds: &hdf5::Dataset, file: &Path, what: &str) -> Result<PartInfo> {
    let shape = ds.shape();
    let (frames, array_scan, det) = match shape.as_slice() {
        [n, r, c] => (*n as u64, None, Shape2::new(*r, *c)),
        [rr, cc, r, c] => {
            let scan = Shape2::new(*rr, *cc);
            let n = scan
                .try_len(ErrorKind::Source, OP, &format!("{what}: scan extent"))
                .map_err(|e| e.with_file(file))?;
            (n as u64, Some(scan), Shape2::new(*r, *c))
        }
        other => {
            return Err(
                Error::source(OP, format!("{what} has the wrong number of dimensions"))
                    .with_file(file)
                    .with_expected("(N, k_r, k_c) or (R, C, k_r, k_c)")
                    .with_found(format!("{other:?}")),
            )
        }
    };
    if det.is_empty() {
        return Err(
            Error::source(OP, format!("{what} has an empty detector frame"))
                .with_file(file)
                .with_expected("k_r, k_c > 0")
                .with_found(det.to_string()),
        );
    }
    let dtype_h5 = ds
        .dtype()
        .map_err(|e| h5err(OP, file, &format!("cannot read the type of {what}"), e))?;
    let desc = dtype_h5.to_descriptor().ok();
    let big = dtype_h5.byte_order() == hdf5::datatype::ByteOrder::BigEndian;
    let mut elem = ElemConv::Same;
    let dtype = match desc {
        Some(TypeDescriptor::Unsigned(IntSize::U1)) => DType::U8,
        Some(TypeDescriptor::Unsigned(IntSize::U2)) => DType::U16,
        Some(TypeDescriptor::Unsigned(IntSize::U4)) => DType::U32,
        Some(TypeDescriptor::Float(hdf5::types::FloatSize::U4)) => {
            // The scale is set by `open` (which refuses floats without the caller's consent).
            elem = ElemConv::Float32 {
                scale: 1.0,
                big_endian: big,
            };
            DType::U32
        }
        other => {
            return Err(
                Error::source(OP, format!("{what} has an unsupported element type"))
                    .with_file(file)
                    .with_expected("uint8, uint16, uint32 or float32")
                    .with_found(
                        other
                            .map(|d| d.to_string())
                            .unwrap_or_else(|| "an unknown type".into()),
                    ),
            )
        }
    };
    if dtype.size() > 1 && big && elem == ElemConv::Same {
        elem = ElemConv::Swap(dtype.size());
    }
    let frame_bytes = checked_product(
        ErrorKind::Source,
        OP,
        &format!("{what}: frame size in bytes"),
        &[
            ("k_r", det.rows as u64),
            ("k_c", det.cols as u64),
            ("bytes per element", dtype.size() as u64),
        ],
    )
    .map_err(|e| e.with_file(file))?;

    // Filters.
    let filters = h5::filter_pipeline(ds)
        .map_err(|e| Error::source(OP, format!("{what}: {e}")).with_file(file))?;
    let mut host_filters = Vec::new();
    let codec = match filters.as_slice() {
        [] => ChunkCodec::Raw,
        fs if fs
            .iter()
            .all(|f| H5Filter::from_id(f.id, &f.cd_values, dtype.size()).is_some()) =>
        {
            host_filters = fs
                .iter()
                .filter_map(|f| H5Filter::from_id(f.id, &f.cd_values, dtype.size()))
                .collect();
            ChunkCodec::Raw
        }
        [f] if f.id == h5::BSHUF_ID => {
            if let Some(&es) = f.cd_values.get(2) {
                if es as usize != dtype.size() {
                    return Err(Error::source(
                        OP,
                        format!("{what}: bitshuffle element size does not match the dtype"),
                    )
                    .with_file(file)
                    .with_expected(format!("{} bytes ({dtype})", dtype.size()))
                    .with_found(format!("{es} bytes")));
                }
            }
            match f.cd_values.get(4) {
                Some(2) => ChunkCodec::Bslz4,
                Some(3) => {
                    return Err(Error::source(
                        OP,
                        format!(
                        "{what}: bitshuffle with zstd (filter 32008, compressor 3) is unsupported"
                    ),
                    )
                    .with_file(file)
                    .with_expected("bitshuffle/LZ4 (cd_values[4] = 2)")
                    .with_found("bitshuffle/zstd (cd_values[4] = 3)"))
                }
                other => {
                    return Err(Error::source(
                        OP,
                        format!("{what}: bitshuffle filter 32008 with an unsupported compressor"),
                    )
                    .with_file(file)
                    .with_expected("bitshuffle/LZ4 (cd_values[4] = 2)")
                    .with_found(match other {
                        Some(c) => format!("cd_values[4] = {c}"),
                        None => format!("no compressor (cd_values {:?})", f.cd_values),
                    }))
                }
            }
        }
        fs => {
            let list: Vec<String> = fs
                .iter()
                .map(|f| format!("{} ({})", f.id, f.name))
                .collect();
            return Err(Error::source(
                OP,
                format!(
                    "{what}: unsupported HDF5 filter pipeline [{}]",
                    list.join(", ")
                ),
            )
            .with_file(file)
            .with_expected(
                "no filter, filter 32008 (bitshuffle/LZ4) alone, or deflate (1), shuffle (2), \
                 fletcher32 (3), lz4 (32004), zstd (32015), blosc (32001)",
            )
            .with_found(format!("filters {}", list.join(", "))));
        }
    };

    let file_size = std::fs::metadata(file).map(|m| m.len()).unwrap_or(u64::MAX);
    let mut chunks = Vec::new();
    let mut block = None;
    match ds.layout() {
        hdf5::dataset::Layout::Contiguous => {
            if codec != ChunkCodec::Raw {
                return Err(
                    Error::internal(OP, "a contiguous dataset cannot have filters").with_file(file),
                );
            }
            if let Some(base) = h5::contiguous_offset(ds) {
                // The whole extent must lie in the file before one record is made: the index
                // is then bounded by the file's size, never by what the header declares.
                let total = checked_product(
                    ErrorKind::Source,
                    OP,
                    &format!("{what}: contiguous data size"),
                    &[("frames", frames), ("frame bytes", frame_bytes)],
                )
                .map_err(|e| e.with_file(file))?;
                let end = base.checked_add(total);
                if end.is_none_or(|end| end > file_size) {
                    let first_past =
                        (file_size.saturating_sub(base) / frame_bytes.max(1)).min(frames);
                    return Err(Error::source(
                        OP,
                        format!("{what}: frame extends past the end of the file"),
                    )
                    .with_file(file)
                    .with_frame(first_past)
                    .with_expected(format!(
                        "{} bytes",
                        end.map_or_else(|| "more than 2^64".to_string(), |e| e.to_string())
                    ))
                    .with_found(format!("{file_size} bytes")));
                }
                for i in 0..frames {
                    let offset = base + i * frame_bytes;
                    chunks.push(ChunkRecord {
                        file: 0,
                        offset,
                        size: frame_bytes,
                        filter_mask: 0,
                        first_frame: i,
                        frames_in_chunk: 1,
                        valid_frames: 1,
                    });
                }
            }
        }
        hdf5::dataset::Layout::Chunked => {
            let cdims = ds.chunk().unwrap_or_default();
            let plan = chunk_plan(&shape, &cdims).map_err(|detail| {
                Error::source(
                    OP,
                    format!("{what}: unsupported chunk shape {cdims:?}: {detail}"),
                )
                .with_file(file)
                .with_expected(
                    "whole frames per chunk: (n, k_r, k_c), (1, n, k_r, k_c) or (m, C, k_r, k_c)",
                )
                .with_found(format!("chunks {cdims:?} of a dataset {shape:?}"))
            })?;
            let raw = h5::visit_chunks(ds).map_err(|e| {
                h5err(
                    OP,
                    file,
                    &format!("cannot enumerate the chunks of {what}"),
                    e,
                )
            })?;
            chunks.reserve(raw.len());
            if let PlanMode::Block = plan.mode {
                block = Some(BlockGeom {
                    rows: cdims[0] as u64,
                    cols: cdims[1] as u64,
                    scan_cols: shape[1] as u64,
                });
            }
            for rc in raw {
                let recs = plan.records(&rc).map_err(|detail| {
                    Error::source(OP, format!("{what}: chunk at {:?}: {detail}", rc.offset))
                        .with_file(file)
                })?;
                let Some(rec) = recs.first().copied() else {
                    continue;
                };
                let stored_raw = host_filters.is_empty()
                    && (codec == ChunkCodec::Raw || rec.filter_mask & 1 != 0);
                let stored_frames = match plan.mode {
                    PlanMode::Block => (cdims[0] * cdims[1]) as u64,
                    _ => rec.frames_in_chunk as u64,
                };
                let raw_size = stored_frames.saturating_mul(frame_bytes);
                if stored_raw && rec.size != raw_size {
                    return Err(Error::source(
                        OP,
                        format!("{what}: unfiltered chunk has the wrong size"),
                    )
                    .with_file(file)
                    .with_frame(rec.first_frame)
                    .with_expected(format!("{raw_size} bytes"))
                    .with_found(format!("{} bytes", rec.size)));
                }
                if rec.offset.saturating_add(rec.size) > file_size {
                    return Err(Error::source(
                        OP,
                        format!("{what}: chunk extends past the end of the file (truncated?)"),
                    )
                    .with_file(file)
                    .with_frame(rec.first_frame)
                    .with_expected(format!("at least {} bytes", rec.offset + rec.size))
                    .with_found(format!("{file_size} bytes")));
                }
                chunks.extend(recs);
            }
        }
        other => {
            return Err(
                Error::source(OP, format!("{what}: unsupported storage layout {other:?}"))
                    .with_file(file)
                    .with_expected("chunked or contiguous")
                    .with_found(format!("{other:?}")),
            )
        }
    }
    chunks.sort_by_key(|c| c.first_frame);

    let image_nr = (
        image_nr_attr(ds, "image_nr_low"),
        image_nr_attr(ds, "image_nr_high"),
    );
    let scan_attr = h5::attr_value(ds, "scan_shape").and_then(|v| v.ints());
    let host = (!host_filters.is_empty() || block.is_some() || elem != ElemConv::Same).then_some(
        HostSpec {
            filters: host_filters,
            block,
            elem,
            stored_frame_bytes: frame_bytes as usize,
        },
    );
    Ok(PartInfo {
        dtype,
        detector_shape: det,
        frames,
        array_scan,
        codec,
        chunks,
        image_nr,
        scan_attr,
        host,
    })
}

/// An `image_nr_low`/`image_nr_high` attribute as the integer it holds (negative values kept,
/// so they are reported as they are).
pub(crate) fn image_nr_attr(ds: &hdf5::Dataset, name: &str) -> Option<i128> {
    h5::attr_value(ds, name)
        .and_then(|v| v.ints())
        .and_then(|v| v.first().copied())
}

/// How chunk offsets map to flat frame ranges.
struct ChunkPlan {
    /// 3-D: frames per chunk along axis 0. 4-D: see `mode`.
    mode: PlanMode,
    /// Dataset extent.
    shape: Vec<usize>,
    cdims: Vec<usize>,
}

enum PlanMode {
    /// (n, k_r, k_c) chunks of an (N, k_r, k_c) dataset.
    Frames3,
    /// (1, n, k_r, k_c) chunks of an (R, C, k_r, k_c) dataset: part of one scan row.
    RowPart,
    /// (m, C, k_r, k_c) chunks: whole scan rows.
    Rows,
    /// (a, b, k_r, k_c) chunks with a > 1 and b < C: one record per scan row, decoded on the
    /// host (hyperspy's default chunking).
    Block,
}

fn chunk_plan(shape: &[usize], cdims: &[usize]) -> std::result::Result<ChunkPlan, String> {
    if cdims.len() != shape.len() || cdims.contains(&0) {
        return Err("chunk rank differs from the dataset rank".into());
    }
    let nd = shape.len();
    if cdims[nd - 2] != shape[nd - 2] || cdims[nd - 1] != shape[nd - 1] {
        return Err("a chunk must hold whole detector frames".into());
    }
    let mode = if nd == 3 {
        PlanMode::Frames3
    } else if cdims[0] == 1 {
        PlanMode::RowPart
    } else if cdims[1] >= shape[1] {
        PlanMode::Rows
    } else {
        PlanMode::Block
    };
    if cdims.iter().take(nd - 2).any(|&c| c > u32::MAX as usize)
        || (nd == 4 && cdims[0].saturating_mul(cdims[1]) > u32::MAX as usize)
    {
        return Err("chunk frame extent too large".into());
    }
    Ok(ChunkPlan {
        mode,
        shape: shape.to_vec(),
        cdims: cdims.to_vec(),
    })
}

impl ChunkPlan {
    /// The records of one stored chunk: one, or in `Block` mode one per scan row it holds.
    fn records(&self, rc: &RawChunk) -> std::result::Result<Vec<ChunkRecord>, String> {
        if !matches!(self.mode, PlanMode::Block) {
            return Ok(vec![self.record(rc)?]);
        }
        if rc.offset.len() != 4 || rc.offset[2] != 0 || rc.offset[3] != 0 {
            return Err("chunk does not start at detector pixel (0, 0)".into());
        }
        if rc.addr == u64::MAX {
            return Err("chunk has an undefined address".into());
        }
        let (r0, c0) = (rc.offset[0], rc.offset[1]);
        let (a, b) = (self.cdims[0] as u64, self.cdims[1] as u64);
        let (rows, cols) = (self.shape[0] as u64, self.shape[1] as u64);
        if r0 % a != 0 || c0 % b != 0 || r0 >= rows || c0 >= cols {
            return Err("chunk offset not on the chunk grid".into());
        }
        let valid = b.min(cols - c0) as u32;
        Ok((r0..(r0 + a).min(rows))
            .map(|r| ChunkRecord {
                file: 0,
                offset: rc.addr,
                size: rc.size,
                filter_mask: rc.filter_mask,
                first_frame: r * cols + c0,
                frames_in_chunk: valid,
                valid_frames: valid,
            })
            .collect())
    }

    fn record(&self, rc: &RawChunk) -> std::result::Result<ChunkRecord, String> {
        let nd = self.shape.len();
        if rc.offset.len() != nd {
            return Err("chunk offset has the wrong rank".into());
        }
        if rc.offset[nd - 2] != 0 || rc.offset[nd - 1] != 0 {
            return Err("chunk does not start at detector pixel (0, 0)".into());
        }
        if rc.addr == u64::MAX {
            return Err("chunk has an undefined address".into());
        }
        let (first, in_chunk, valid) = match self.mode {
            PlanMode::Frames3 => {
                let (o, c, n) = (rc.offset[0], self.cdims[0] as u64, self.shape[0] as u64);
                if o % c != 0 || o >= n {
                    return Err("chunk offset not on the chunk grid".into());
                }
                (o, c, c.min(n - o))
            }
            PlanMode::RowPart => {
                let (r, o) = (rc.offset[0], rc.offset[1]);
                let (c, cols, rows) = (
                    self.cdims[1] as u64,
                    self.shape[1] as u64,
                    self.shape[0] as u64,
                );
                if o % c != 0 || o >= cols || r >= rows {
                    return Err("chunk offset not on the chunk grid".into());
                }
                (r * cols + o, c, c.min(cols - o))
            }
            PlanMode::Block => return Err("a block chunk has several records".into()),
            PlanMode::Rows => {
                let (r, m) = (rc.offset[0], self.cdims[0] as u64);
                let (cols, rows) = (self.shape[1] as u64, self.shape[0] as u64);
                if r % m != 0 || rc.offset[1] != 0 || r >= rows {
                    return Err("chunk offset not on the chunk grid".into());
                }
                (r * cols, m * cols, m.min(rows - r) * cols)
            }
        };
        Ok(ChunkRecord {
            file: 0,
            offset: rc.addr,
            size: rc.size,
            filter_mask: rc.filter_mask,
            first_frame: first,
            frames_in_chunk: in_chunk as u32,
            valid_frames: valid as u32,
        })
    }
}

/// Open `path` with HDF5, as a typed error naming it. Only a regular file is opened
/// ([`guard::check_regular_file`]): a FIFO, device, socket, directory or symlink loop is refused
/// before HDF5 could block on it.
pub(crate) fn open_h5(path: &Path, what: &str) -> Result<hdf5::File> {
    guard::check_regular_file(OP, path, what)?;
    h5::open_read(path).map_err(|e| h5err(OP, path, &format!("cannot open {what} as HDF5"), e))
}

/// Everything [`Source::open`] and `inspect` learn from the frame datasets.
pub(crate) struct Scanned {
    pub kind: SourceKind,
    pub dataset_path: String,
    pub files: Vec<PathBuf>,
    pub parts: Vec<PartInfo>,
    pub chunks: Vec<ChunkRecord>,
    pub n_frames: u64,
    pub missing_frames: MissingFrames,
}

/// Describe every part and merge their chunk indices (first_frame global, file indices set).
pub(crate) fn scan_parts(file: &hdf5::File, path: &Path, located: &Located) -> Result<Scanned> {
    let mut files = vec![path.to_path_buf()];
    let mut parts = Vec::new();
    let (kind, dataset_path) = match located {
        Located::Inline(p) => {
            check_dataset_path(file, path, p)?;
            let ds = file
                .dataset(p)
                .map_err(|e| h5err(OP, path, &format!("cannot open dataset {p}"), e))?;
            let mut part = describe(&ds, path, p)?;
            if let (Some(_), Some(_)) = part.image_nr {
                check_image_nr(part.image_nr, 0, part.frames, path)?;
            }
            part.chunks.iter_mut().for_each(|c| c.file = 0);
            parts.push(part);
            (SourceKind::Hdf5Dataset, p.clone())
        }
        Located::Shards(links) => {
            for link in links {
                if !link.internal && std::fs::metadata(&link.file).is_err() {
                    // A loop or an unreadable path says so; only "not found" is a missing shard.
                    if let Err(e) = std::fs::metadata(&link.file) {
                        if e.kind() != std::io::ErrorKind::NotFound {
                            return Err(guard::stat_error(
                                OP,
                                &link.file,
                                &format!("shard {}", link.name),
                                &e,
                            ));
                        }
                    }
                    return Err(Error::source(
                        OP,
                        format!(
                            "missing shard: {} points at a file that does not exist",
                            link.name
                        ),
                    )
                    .with_file(&link.file)
                    .with_expected("an existing shard file next to the master")
                    .with_found("no such file"));
                }
            }
            let dsp = links
                .first()
                .map(|l| l.obj_path.clone())
                .unwrap_or_default();
            let mut cum = 0u64;
            for link in links {
                let holder_file = if link.internal {
                    path
                } else {
                    link.file.as_path()
                };
                let (ds, fidx) = if link.internal {
                    h5::check_path(file, &link.obj_path).map_err(|e| e.with_file(holder_file))?;
                    let ds = file.dataset(&link.obj_path).map_err(|e| {
                        h5err(OP, path, &format!("cannot open {}", link.obj_path), e)
                    })?;
                    (ds, 0u32)
                } else {
                    let f = open_h5(&link.file, "shard")?;
                    h5::check_path(&f, &link.obj_path).map_err(|e| e.with_file(holder_file))?;
                    let ds = f.dataset(&link.obj_path).map_err(|e| {
                        h5err(
                            OP,
                            &link.file,
                            &format!("shard has no dataset {}", link.obj_path),
                            e,
                        )
                    })?;
                    files.push(link.file.clone());
                    (ds, (files.len() - 1) as u32)
                };
                let fpath = if link.internal {
                    path
                } else {
                    link.file.as_path()
                };
                let mut part = describe(&ds, fpath, &link.name)?;
                if part.array_scan.is_some() {
                    return Err(Error::source(OP, format!("shard {} is 4-D", link.name))
                        .with_file(fpath)
                        .with_expected("(n, k_r, k_c)")
                        .with_found(format!("{} dims", 4)));
                }
                if let Some(first) = parts.first() {
                    let first: &PartInfo = first;
                    if part.dtype != first.dtype || part.detector_shape != first.detector_shape {
                        return Err(Error::source(
                            OP,
                            format!("shard {} differs from the first shard", link.name),
                        )
                        .with_file(fpath)
                        .with_expected(format!(
                            "{} frames of {}",
                            first.dtype, first.detector_shape
                        ))
                        .with_found(format!("{} frames of {}", part.dtype, part.detector_shape)));
                    }
                    if part.codec != first.codec || part.host != first.host {
                        return Err(Error::source(
                            OP,
                            format!("shard {} uses a different codec", link.name),
                        )
                        .with_file(fpath)
                        .with_expected(format!("{:?}", first.codec))
                        .with_found(format!("{:?}", part.codec)));
                    }
                }
                if part.image_nr.0.is_some() || part.image_nr.1.is_some() {
                    check_image_nr(part.image_nr, cum, part.frames, fpath)?;
                }
                for c in &mut part.chunks {
                    c.file = fidx;
                    c.first_frame += cum;
                }
                cum = cum.checked_add(part.frames).ok_or_else(|| {
                    Error::source(OP, "the shards' frame counts overflow 64 bits")
                        .with_file(fpath)
                        .with_expected(format!("<= {} frames in all", u64::MAX))
                        .with_found(format!("{cum} + {} frames", part.frames))
                })?;
                parts.push(part);
            }
            (SourceKind::DectrisMaster, dsp)
        }
    };
    let n_frames = parts.iter().try_fold(0u64, |a, p| a.checked_add(p.frames));
    let n_frames = n_frames.ok_or_else(|| {
        Error::source(OP, "the frame count overflows 64 bits")
            .with_file(path)
            .with_expected(format!("<= {} frames", u64::MAX))
    })?;
    let mut chunks: Vec<ChunkRecord> = parts
        .iter()
        .flat_map(|p| p.chunks.iter().copied())
        .collect();
    chunks.sort_by_key(|c| c.first_frame);
    // One sweep over the written chunks (sorted): overlaps are errors, gaps are the missing
    // frames, kept as ranges. Nothing here is sized by the declared frame count.
    let mut gaps = Vec::new();
    let mut next = 0u64;
    for c in &chunks {
        let end = c
            .first_frame
            .saturating_add(c.valid_frames as u64)
            .min(n_frames);
        if c.first_frame < next {
            return Err(Error::source(OP, "two chunks claim the same frame")
                .with_file(
                    files
                        .get(c.file as usize)
                        .map(PathBuf::as_path)
                        .unwrap_or(path),
                )
                .with_frame(c.first_frame));
        }
        gaps.push(next..c.first_frame.min(n_frames));
        next = next.max(end);
    }
    gaps.push(next..n_frames);
    let missing_frames = MissingFrames::from_sorted(gaps);
    Ok(Scanned {
        kind,
        dataset_path,
        files,
        parts,
        chunks,
        n_frames,
        missing_frames,
    })
}

/// Check `(image_nr_low, image_nr_high)` (1-based, inclusive; as stored, negative values
/// included) against the shard's place in the series; an absent one is reported as absent.
fn check_image_nr(
    (lo, hi): (Option<i128>, Option<i128>),
    cum: u64,
    frames: u64,
    file: &Path,
) -> Result<()> {
    let (elo, ehi) = (cum as i128 + 1, cum as i128 + frames as i128);
    if lo != Some(elo) || hi != Some(ehi) {
        let show = |v: Option<i128>| v.map_or_else(|| "absent".to_string(), |v| v.to_string());
        return Err(Error::source(
            OP,
            "image_nr_low/image_nr_high do not match the shard's position in the series",
        )
        .with_file(file)
        .with_expected(format!("image_nr {elo}..={ehi}"))
        .with_found(format!(
            "image_nr_low = {}, image_nr_high = {}",
            show(lo),
            show(hi)
        )));
    }
    Ok(())
}

/// Resolve the scan shape: argument > 4-D array shape > recorded `scan_shape` > trigger rules >
/// perfect square; then check it against the frames present.
pub(crate) fn resolve_scan_shape(
    path: &Path,
    n_frames: u64,
    explicit: Option<Shape2>,
    array_scan: Option<Shape2>,
    recorded: Option<Shape2>,
    info: &MasterInfo,
) -> Result<(Shape2, ScanShapeOrigin)> {
    let trigger = || {
        let mode = info
            .metadata
            .trigger_mode
            .as_deref()?
            .trim()
            .to_ascii_lowercase();
        let (ni, nt) = (info.metadata.nimages?, info.metadata.ntrigger?);
        ((mode == "exts" || mode == "ints") && ni > 1)
            .then(|| Shape2::new(nt as usize, ni as usize))
    };
    let square = || {
        let r = (n_frames as f64).sqrt().round() as u64;
        (r > 0 && r * r == n_frames).then(|| Shape2::new(r as usize, r as usize))
    };
    let (shape, origin) = if let Some(s) = explicit {
        (s, ScanShapeOrigin::Argument)
    } else if let Some(s) = array_scan {
        (s, ScanShapeOrigin::ArrayShape)
    } else if let Some(s) = recorded {
        (s, ScanShapeOrigin::Attribute)
    } else if let Some(s) = trigger() {
        (s, ScanShapeOrigin::TriggerRules)
    } else if let Some(s) = square() {
        (s, ScanShapeOrigin::PerfectSquare)
    } else {
        return Err(Error::source(
            OP,
            "the scan shape is not recorded and cannot be inferred; pass scan_shape=(rows, cols)",
        )
        .with_file(path)
        .with_expected("scan_shape with rows*cols == frames present")
        .with_found(format!("{n_frames} frames, not a perfect square")));
    };
    let kind = if origin == ScanShapeOrigin::Argument {
        ErrorKind::InvalidArgument
    } else {
        ErrorKind::Source
    };
    let what = match origin {
        ScanShapeOrigin::Argument => "given scan_shape",
        ScanShapeOrigin::ArrayShape => "array scan shape",
        ScanShapeOrigin::Attribute => "recorded scan_shape",
        ScanShapeOrigin::TriggerRules => "scan shape (ntrigger, nimages)",
        ScanShapeOrigin::PerfectSquare => "square scan shape",
    };
    shape
        .try_len(kind, OP, what)
        .map_err(|e| e.with_file(path))?;
    if shape.len() as u64 != n_frames || shape.is_empty() {
        let origin_s = match origin {
            ScanShapeOrigin::Argument => "given scan_shape",
            ScanShapeOrigin::ArrayShape => "array shape",
            ScanShapeOrigin::Attribute => "recorded scan_shape",
            ScanShapeOrigin::TriggerRules => "(ntrigger, nimages)",
            ScanShapeOrigin::PerfectSquare => "square",
        };
        return Err(Error::source(
            OP,
            format!("scan shape {shape} ({origin_s}) does not match the frames present"),
        )
        .with_file(path)
        .with_expected(format!("{} frames ({shape})", shape.len()))
        .with_found(format!("{n_frames} frames")));
    }
    Ok((shape, origin))
}

/// Shape2 from a recorded `[rows, cols]`.
pub(crate) fn shape_from_ints(v: &[i128], path: &Path, what: &str) -> Result<Shape2> {
    match v {
        [r, c] if *r > 0 && *c > 0 && *r <= usize::MAX as i128 && *c <= usize::MAX as i128 => {
            Ok(Shape2::new(*r as usize, *c as usize))
        }
        _ => Err(Error::source(OP, format!("{what} is malformed"))
            .with_file(path)
            .with_expected("two positive integers (rows, cols)")
            .with_found(format!("{v:?}"))),
    }
}

pub(crate) fn open(path: &Path, opts: &OpenOptions) -> Result<Source> {
    h5::init();
    let file = open_h5(path, "source file")?;
    let located = locate(&file, path, opts)?;
    let scanned = scan_parts(&file, path, &located)?;
    let info = meta::read_master(&file, path)?;
    let first = scanned.parts.first().ok_or_else(|| {
        Error::source(OP, "no frame datasets")
            .with_file(path)
            .with_expected("at least one shard")
    })?;
    let (dtype, det, codec) = (first.dtype, first.detector_shape, first.codec);
    let frame_bytes = det.len().saturating_mul(dtype.size());
    let host = match &first.host {
        None => None,
        Some(spec) => {
            let mut spec = spec.clone();
            if let ElemConv::Float32 { big_endian, .. } = spec.elem {
                spec.elem = ElemConv::Float32 {
                    scale: crate::formats::require_float_scale(path, opts)?,
                    big_endian,
                };
            }
            Some(std::sync::Arc::new(spec.build(frame_bytes)))
        }
    };
    if let Some(d) = info.detector_pixels {
        if d != det {
            return Err(
                Error::source(OP, "x/y_pixels_in_detector disagree with the frame data")
                    .with_file(path)
                    .with_expected(format!("{det} (data)"))
                    .with_found(format!("{d} (detectorSpecific)")),
            );
        }
    }
    if let Some(m) = &info.pixel_mask {
        if m.len() != det.len() || info.pixel_mask_shape != Some(det) {
            return Err(
                Error::source(OP, "pixel_mask shape differs from the detector shape")
                    .with_file(path)
                    .with_expected(det.to_string())
                    .with_found(
                        info.pixel_mask_shape
                            .map(|s| s.to_string())
                            .unwrap_or_else(|| format!("{} values", m.len())),
                    ),
            );
        }
    }
    let recorded = match (&first.scan_attr, &info.scan_shape_recorded) {
        (_, Some(s)) => Some(*s),
        (Some(v), None) if scanned.kind == SourceKind::Hdf5Dataset => {
            Some(shape_from_ints(v, path, "scan_shape attribute")?)
        }
        _ => None,
    };
    let array_scan = if scanned.kind == SourceKind::Hdf5Dataset {
        first.array_scan
    } else {
        None
    };
    if let Some(s) = opts.scan_shape {
        s.try_len(ErrorKind::InvalidArgument, OP, "given scan_shape")
            .map_err(|e| e.with_file(path))?;
    }
    if let (Some(s), Some(a)) = (opts.scan_shape, array_scan) {
        if s.len() != a.len() {
            return Err(
                Error::source(OP, "scan_shape does not match the 4-D dataset")
                    .with_file(path)
                    .with_expected(format!("{} positions ({a})", a.len()))
                    .with_found(format!("{} positions ({s})", s.len())),
            );
        }
    }
    let (scan_shape, origin) = resolve_scan_shape(
        path,
        scanned.n_frames,
        opts.scan_shape,
        array_scan,
        recorded,
        &info,
    )?;

    let mut identities = Vec::with_capacity(scanned.files.len());
    let mut handles = Vec::with_capacity(scanned.files.len());
    for f in &scanned.files {
        identities.push(FileIdentity::of(f)?);
        handles.push(guard::open_regular(OP, f, "source file")?);
    }
    drop(file);

    let mut metadata = info.metadata;
    metadata.detector_shape = Some(det);
    metadata.dtype = Some(dtype);
    metadata.n_frames = Some(scanned.n_frames);
    metadata.scan_shape = Some(scan_shape);
    metadata.scan_shape_origin = Some(origin);
    if let Some(m) = &info.pixel_mask {
        metadata.bad_pixel_count = Some(m.iter().filter(|&&v| v & 0xFFFF != 0).count());
    }
    Ok(Source {
        kind: scanned.kind,
        path: path.to_path_buf(),
        files: identities,
        dataset_path: scanned.dataset_path,
        dtype,
        detector_shape: det,
        n_frames: scanned.n_frames,
        scan_shape,
        metadata,
        pixel_mask: info.pixel_mask,
        codec,
        chunks: scanned.chunks,
        missing_frames: scanned.missing_frames,
        index_from_cache: false,
        handles,
        host,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(offset: &[u64]) -> RawChunk {
        RawChunk {
            offset: offset.to_vec(),
            filter_mask: 0,
            addr: 4096,
            size: 100,
        }
    }

    #[test]
    fn shard_names() {
        assert_eq!(shard_number("data_000012"), Some(12));
        assert_eq!(shard_number("data_"), None);
        assert_eq!(shard_number("data"), None);
        assert_eq!(shard_number("data_01x"), None);
    }

    #[test]
    fn chunk_plans_map_offsets_to_frame_ranges() {
        // 3-D, 3 frames per chunk, 8 frames: last chunk holds 2
        let p = chunk_plan(&[8, 4, 4], &[3, 4, 4]).unwrap_or_else(|e| panic!("{e}"));
        let r = p.record(&raw(&[6, 0, 0])).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (r.first_frame, r.frames_in_chunk, r.valid_frames),
            (6, 3, 2)
        );
        assert!(p.record(&raw(&[4, 0, 0])).is_err());
        // 4-D whole rows, 2 rows per chunk of a 5 x 3 scan
        let p = chunk_plan(&[5, 3, 4, 4], &[2, 3, 4, 4]).unwrap_or_else(|e| panic!("{e}"));
        let r = p
            .record(&raw(&[4, 0, 0, 0]))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (r.first_frame, r.frames_in_chunk, r.valid_frames),
            (12, 6, 3)
        );
        // unsupported: partial frames
        assert!(chunk_plan(&[8, 4, 4], &[1, 2, 4]).is_err());
        // several partial rows (hyperspy): one record per scan row, decoded on the host
        let p = chunk_plan(&[5, 3, 4, 4], &[2, 2, 4, 4]).unwrap_or_else(|e| panic!("{e}"));
        let r = p
            .records(&raw(&[4, 2, 0, 0]))
            .unwrap_or_else(|e| panic!("{e}"));
        let got: Vec<(u64, u32)> = r.iter().map(|c| (c.first_frame, c.valid_frames)).collect();
        assert_eq!(got, vec![(14, 1)]); // row 4 only (5 rows), column 2 only (3 columns)
        let r = p
            .records(&raw(&[2, 0, 0, 0]))
            .unwrap_or_else(|e| panic!("{e}"));
        let got: Vec<(u64, u32)> = r.iter().map(|c| (c.first_frame, c.valid_frames)).collect();
        assert_eq!(got, vec![(6, 2), (9, 2)]);
        assert!(p.records(&raw(&[1, 0, 0, 0])).is_err());
    }

    #[test]
    fn scan_shape_rules() {
        let mut info = MasterInfo::default();
        info.metadata.trigger_mode = Some("exts".into());
        info.metadata.nimages = Some(5);
        info.metadata.ntrigger = Some(7);
        let p = Path::new("x_master.h5");
        let r = resolve_scan_shape(p, 35, None, None, None, &info).ok();
        assert_eq!(r, Some((Shape2::new(7, 5), ScanShapeOrigin::TriggerRules)));
        // trigger rules that do not match the frames present are an error, not a fallback
        assert!(resolve_scan_shape(p, 36, None, None, None, &info).is_err());
        info.metadata.nimages = Some(1);
        let r = resolve_scan_shape(p, 36, None, None, None, &info).ok();
        assert_eq!(r, Some((Shape2::new(6, 6), ScanShapeOrigin::PerfectSquare)));
        let rec = Some(Shape2::new(4, 9));
        let r = resolve_scan_shape(p, 36, None, None, rec, &info).ok();
        assert_eq!(r, Some((Shape2::new(4, 9), ScanShapeOrigin::Attribute)));
        let arg = Some(Shape2::new(2, 18));
        let r = resolve_scan_shape(p, 36, arg, None, rec, &info).ok();
        assert_eq!(r, Some((Shape2::new(2, 18), ScanShapeOrigin::Argument)));
        assert!(resolve_scan_shape(p, 35, None, None, None, &MasterInfo::default()).is_err());
    }
}
