//! `qem-io`: where acquisitions come from and where test acquisitions are written.
//!
//! * [`Source::open`] reads a Dectris ARINA/EIGER master file (external links to data shards) or a
//!   plain HDF5 file with an inline 3-D `(N, k_r, k_c)` or 4-D `(R, C, k_r, k_c)` dataset. It
//!   enumerates every chunk once with `H5Dchunk_iter`, resolves and validates the scan shape, reads
//!   the metadata and the pixel mask, and then closes all HDF5 handles: chunk bytes are read later
//!   with positional reads ([`Source::read_chunk`]) from many threads, outside HDF5's global lock.
//! * [`inspect`] says whether a source is ready to load without decoding any pixel.
//! * [`discover`] finds `*_master.h5` files under a folder.
//! * [`writer`] writes Dectris-style acquisitions (master + shards, bitshuffle/LZ4 via direct
//!   chunk writes) for tests, demos and benchmarks.
//!
//! Only this crate knows HDF5. It depends on `qem-core` (vocabulary, errors) and `qem-codec`
//! (bitshuffle/LZ4). The engines (`qem-cpu`, `qem-cuda`) and the façade `qem` may depend on it;
//! nothing below it does. Decoding pixels is not done here, except inside the HDF5 filter we
//! register so that small compressed datasets (a `pixel_mask`) read through HDF5.

mod cache;

/// Whether [`Source::open`] keeps opened sources' indexes in its in-process cache (on unless
/// `QUANTEM_GPU_NO_INDEX_CACHE=1`).
pub fn index_cache_enabled() -> bool {
    !cache::disabled()
}
pub mod formats;
mod guard;
mod h5;
mod inspect;
mod meta;
mod open;
pub mod writer;

pub use formats::{FloatScale, Format, HostDecode, RawLayout};
pub use guard::{check_regular_file, open_regular, read_up_to, ALLOW_EXTERNAL_LINKS_ENV};
pub use inspect::{discover, inspect, Inspection, ShardReport, UnwrittenFrames, Verdict};

use qem_core::{fnv1a64, DType, Error, FileIdentity, Metadata, Region, Result, Shape2, FNV_OFFSET};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Options of [`Source::open`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpenOptions {
    /// HDF5 path of the frame dataset in a self-contained file; `None` searches
    /// `/entry/data/data_NNNNNN` links, then `/entry/data/data`, then the single 3-D/4-D integer
    /// dataset of the file.
    pub dataset_path: Option<String>,
    /// Scan shape given by the caller; it wins over anything recorded in the file, and must
    /// still match the number of frames present.
    pub scan_shape: Option<Shape2>,
    /// The file format; `None` recognises it by content ([`formats::detect`]).
    pub format: Option<Format>,
    /// Layout of a generic raw binary file ([`Format::Raw`]; required for it).
    pub raw: Option<RawLayout>,
    /// Consent to read float32 frames as counts: `round(value / scale)`, negatives read as 0
    /// (docs/formats.md, "Float32 counts"). A float source without it is refused.
    pub float_scale: Option<FloatScale>,
}

/// What kind of file a [`Source`] was opened from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceKind {
    /// A Dectris master file whose `/entry/data/data_NNNNNN` members point at data shards.
    DectrisMaster,
    /// One self-contained HDF5 dataset (3-D or 4-D).
    Hdf5Dataset,
    /// A NumPy `.npy` file.
    Npy,
    /// A generic raw binary file described by [`RawLayout`].
    RawBinary,
    /// Quantum Detectors Merlin `.mib` frames.
    MerlinMib,
    /// An EMPAD `.raw` file (with its `.xml`).
    Empad,
    /// A Gatan Digital Micrograph `.dm4` (or `.dm3`) file.
    GatanDm,
}

impl SourceKind {
    /// The snake_case name used in provenance (`"dectris_master"`, `"hdf5_dataset"`).
    pub fn as_str(self) -> &'static str {
        match self {
            SourceKind::DectrisMaster => "dectris_master",
            SourceKind::Hdf5Dataset => "hdf5_dataset",
            SourceKind::Npy => "npy",
            SourceKind::RawBinary => "raw_binary",
            SourceKind::MerlinMib => "merlin_mib",
            SourceKind::Empad => "empad",
            SourceKind::GatanDm => "gatan_dm",
        }
    }
}

/// How the chunks of a source are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChunkCodec {
    /// HDF5 filter 32008, bitshuffle + LZ4 (decode with `qem_codec::bslz4::decode_chunk`).
    /// A chunk whose `filter_mask` bit 0 is set was stored unfiltered and is raw.
    Bslz4,
    /// No filter: chunk bytes are the little-endian frames themselves.
    Raw,
}

/// One stored chunk: where its bytes are and which frames it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ChunkRecord {
    /// Index into [`Source::files`] of the file holding the bytes.
    pub file: u32,
    /// Byte offset in that file.
    pub offset: u64,
    /// Stored (compressed) size in bytes.
    pub size: u64,
    /// HDF5 filter mask: bit `i` set means filter `i` of the pipeline was skipped for this chunk.
    pub filter_mask: u32,
    /// Global flat index of the chunk's first frame (`n = R_r·N_Rc + R_c`).
    pub first_frame: u64,
    /// Frames the chunk stores, as stored (edge chunks store a full chunk).
    pub frames_in_chunk: u32,
    /// Frames of the chunk that lie inside the dataset (the first `valid_frames` of it).
    pub valid_frames: u32,
}

impl ChunkRecord {
    /// True when the stored bytes are raw although the dataset's codec is [`ChunkCodec::Bslz4`]
    /// (the optional filter was skipped when the chunk was written).
    pub fn is_unfiltered(&self) -> bool {
        self.filter_mask & 1 != 0
    }
}

/// Frames whose chunk was never written, as sorted, disjoint, non-empty half-open ranges of
/// global frame indices: one entry per gap between written chunks, never one per frame, so a
/// file of a few kB that declares 10^9 frames and holds one costs two ranges, not 8 GB.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MissingFrames {
    ranges: Vec<Range<u64>>,
}

impl MissingFrames {
    /// From sorted, disjoint ranges (empty ones are dropped, touching ones merged).
    pub(crate) fn from_sorted(ranges: impl IntoIterator<Item = Range<u64>>) -> Self {
        let mut out: Vec<Range<u64>> = Vec::new();
        for r in ranges.into_iter().filter(|r| r.start < r.end) {
            match out.last_mut() {
                Some(last) if last.end >= r.start => last.end = last.end.max(r.end),
                _ => out.push(r),
            }
        }
        MissingFrames { ranges: out }
    }
    /// The gaps, sorted.
    pub fn ranges(&self) -> &[Range<u64>] {
        &self.ranges
    }
    /// Number of missing frames.
    pub fn len(&self) -> u64 {
        self.ranges.iter().map(|r| r.end - r.start).sum()
    }
    /// True when every frame has a written chunk.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }
    /// The first missing frame.
    pub fn first(&self) -> Option<u64> {
        self.ranges.first().map(|r| r.start)
    }
    /// True when `frame` is missing.
    pub fn contains(&self, frame: &u64) -> bool {
        let i = self.ranges.partition_point(|r| r.end <= *frame);
        self.ranges.get(i).is_some_and(|r| r.contains(frame))
    }
    /// The missing frames in order (lazily; take what you need).
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.ranges.iter().flat_map(|r| r.clone())
    }
    /// The first missing frame inside `region` of a scan with `scan_cols` columns (flat index
    /// `n = row·scan_cols + col`), in `O(gaps)`.
    pub fn first_in(&self, scan_cols: usize, region: Region) -> Option<u64> {
        let cols = scan_cols as u64;
        let (r0, r1) = (region.row_start as u64, region.row_stop as u64);
        let (c0, c1) = (region.col_start as u64, region.col_stop as u64);
        if cols == 0 || r0 >= r1 || c0 >= c1 || c1 > cols {
            return None;
        }
        for gap in &self.ranges {
            let a = gap.start.max(r0.saturating_mul(cols));
            let (row, col) = (a / cols, a % cols);
            let n = if col < c0 {
                row.checked_mul(cols)?.checked_add(c0)?
            } else if col >= c1 {
                (row + 1).checked_mul(cols)?.checked_add(c0)?
            } else {
                a
            };
            if n / cols >= r1 {
                // gaps are sorted: later ones start later still
                return None;
            }
            if n < gap.end {
                return Some(n);
            }
        }
        None
    }
}

impl PartialEq<Vec<u64>> for MissingFrames {
    fn eq(&self, other: &Vec<u64>) -> bool {
        self.len() == other.len() as u64 && self.iter().eq(other.iter().copied())
    }
}

/// An opened acquisition: its files, shapes, metadata and complete chunk index.
///
/// `Source` holds no HDF5 handle, only plain file handles, so it is `Send + Sync` and
/// [`Source::read_chunk`] may run on many threads at once.
#[derive(Debug)]
pub struct Source {
    /// What kind of file this is.
    pub kind: SourceKind,
    /// The file the caller named (master or plain HDF5).
    pub path: PathBuf,
    /// Every file read: `files[0]` is the named file, then the shards in order.
    pub files: Vec<FileIdentity>,
    /// HDF5 path of the frame dataset (in the named file, or in each shard).
    pub dataset_path: String,
    /// Element type of the frames.
    pub dtype: DType,
    /// Detector frame shape `(k_r, k_c)`.
    pub detector_shape: Shape2,
    /// Number of frames present (the extent of the dataset(s), including unwritten chunks).
    pub n_frames: u64,
    /// The resolved scan shape; `rows·cols == n_frames`.
    pub scan_shape: Shape2,
    /// Metadata read from the file (units converted to those named in [`Metadata`]).
    pub metadata: Metadata,
    /// The raw `pixel_mask` (`k_r·k_c` values, row-major), if the file has one.
    pub pixel_mask: Option<Vec<u32>>,
    /// How the chunks are stored.
    pub codec: ChunkCodec,
    /// Every written chunk, sorted by `first_frame`.
    pub chunks: Vec<ChunkRecord>,
    /// Frames whose chunk was never written (they would read as the HDF5 fill value), as
    /// ranges.
    pub missing_frames: MissingFrames,
    /// True when the index came from the in-process cache (every file's size and modification
    /// time were checked unchanged) instead of being read from HDF5 again.
    pub index_from_cache: bool,
    /// Open handles of `files`, same order.
    handles: Vec<std::fs::File>,
    /// Host-side decoding between the stored bytes and the frames, if any (then `codec` is
    /// [`ChunkCodec::Raw`] and [`Source::read_chunk`] returns decoded frames).
    host: Option<Arc<HostDecode>>,
}

impl Source {
    /// Open `path` (a Dectris master or a plain HDF5 file) and build the complete chunk index.
    ///
    /// Errors are [`qem_core::ErrorKind::Source`] errors naming the file (and the frame, where
    /// one applies), e.g. a missing shard, inconsistent shards, an unsupported filter or chunk
    /// shape, or a scan shape that does not match the frames present.
    ///
    /// A second open of the same files in one process reuses their index when no file has
    /// changed size or modification time (see the `cache` module; `index_from_cache` says so).
    pub fn open(path: &Path, opts: &OpenOptions) -> Result<Source> {
        let format = match opts.format {
            Some(f) => f,
            None => formats::detect(path)?,
        };
        if format != Format::Hdf5 {
            return formats::open(format, path, opts);
        }
        formats::check_not_dectris_shard(path)?;
        if let Some(source) = cache::lookup(path, opts)? {
            return Ok(source);
        }
        let source = open::open(path, opts)?;
        cache::store(path, opts, &source);
        Ok(source)
    }

    /// True when the chunk bytes in the files are not the frames the engines take (compressed
    /// by a filter we decode on the host, big-endian, float32, packed...): read them with
    /// [`Source::read_chunk`], which decodes; an engine that reads file bytes itself (CUDA)
    /// must not be given this source.
    pub fn needs_host_decode(&self) -> bool {
        self.host.is_some()
    }

    /// The host-side decoding of this source, if any.
    pub fn host_decode(&self) -> Option<&HostDecode> {
        self.host.as_deref()
    }

    /// A copy of this source's index with its own, newly opened file handles.
    fn reopen(&self) -> Result<Source> {
        let handles = self
            .files
            .iter()
            .map(|f| guard::open_regular("open", &f.path, "source file"))
            .collect::<Result<Vec<_>>>()?;
        Ok(Source {
            handles,
            ..self.index_only()
        })
    }

    /// A copy of this source's index holding no file handle (what the cache keeps).
    fn index_only(&self) -> Source {
        Source {
            kind: self.kind,
            path: self.path.clone(),
            files: self.files.clone(),
            dataset_path: self.dataset_path.clone(),
            dtype: self.dtype,
            detector_shape: self.detector_shape,
            n_frames: self.n_frames,
            scan_shape: self.scan_shape,
            metadata: self.metadata.clone(),
            pixel_mask: self.pixel_mask.clone(),
            codec: self.codec,
            chunks: self.chunks.clone(),
            missing_frames: self.missing_frames.clone(),
            index_from_cache: true,
            handles: Vec::new(),
            host: self.host.as_ref().map(|h| Arc::new(h.fresh())),
        }
    }

    /// Bytes of one frame: `k_r·k_c·elem_size` (checked to fit when the source was opened).
    pub fn frame_bytes(&self) -> usize {
        self.detector_shape.len().saturating_mul(self.dtype.size())
    }

    /// A [`qem_core::ErrorKind::Source`] error naming the first frame of `region` (of the scan
    /// grid) whose chunk was never written, if there is one.
    pub fn check_region_complete(&self, region: Region, op: &str) -> Result<()> {
        match self.missing_frames.first_in(self.scan_shape.cols, region) {
            None => Ok(()),
            Some(frame) => Err(Error::source(
                op,
                format!(
                    "the chunk holding this frame was never written ({} of {} frames missing); \
                     load a scan region that excludes the missing frames",
                    self.missing_frames.len(),
                    self.n_frames
                ),
            )
            .with_file(self.file_of_frame(frame))
            .with_frame(frame)
            .with_expected("a written chunk for every frame of the scan region")
            .with_found("no chunk")),
        }
    }

    /// The chunk holding global frame `frame`.
    ///
    /// Errors name the frame and its file when the frame is out of range or its chunk was never
    /// written.
    pub fn chunk_of_frame(&self, frame: u64) -> Result<&ChunkRecord> {
        if frame >= self.n_frames {
            return Err(Error::source("locate chunk", "frame index out of range")
                .with_file(&self.path)
                .with_frame(frame)
                .with_expected(format!("frame < {}", self.n_frames))
                .with_found(frame.to_string()));
        }
        // chunks are sorted by first_frame and do not overlap.
        let idx = self.chunks.partition_point(|c| c.first_frame <= frame);
        if idx > 0 {
            let c = &self.chunks[idx - 1];
            if frame < c.first_frame + c.valid_frames as u64 {
                return Ok(c);
            }
        }
        Err(Error::source(
            "locate chunk",
            "the chunk holding this frame was never written (it would read as the fill value)",
        )
        .with_file(self.file_of_frame(frame))
        .with_frame(frame)
        .with_expected("a written chunk")
        .with_found("no chunk"))
    }

    /// The file that holds (or would hold) `frame`: the shard whose frame range contains it.
    fn file_of_frame(&self, frame: u64) -> &Path {
        // chunks before/after give the file; fall back to the named file.
        let idx = self.chunks.partition_point(|c| c.first_frame <= frame);
        let rec = self
            .chunks
            .get(idx.saturating_sub(1))
            .or(self.chunks.get(idx));
        rec.and_then(|c| self.files.get(c.file as usize))
            .map(|f| f.path.as_path())
            .unwrap_or(&self.path)
    }

    /// Read the stored bytes of `rec` into `buf` (resized to `rec.size`) with a positional
    /// read. Thread-safe; takes no lock. A short read (truncated file) is a source error naming
    /// the file and the chunk's first frame.
    pub fn read_chunk(&self, rec: &ChunkRecord, buf: &mut Vec<u8>) -> Result<()> {
        match &self.host {
            None => self.read_stored(rec, buf),
            Some(host) => STORED.with(|cell| {
                let mut stored = cell.borrow_mut();
                self.read_stored(rec, &mut stored)?;
                let file_path = self
                    .files
                    .get(rec.file as usize)
                    .map(|f| f.path.as_path())
                    .unwrap_or(&self.path);
                host.decode(file_path, rec, &stored, buf)
            }),
        }
    }

    /// Read the stored bytes of `rec` as they are in the file.
    fn read_stored(&self, rec: &ChunkRecord, buf: &mut Vec<u8>) -> Result<()> {
        let file_path = self
            .files
            .get(rec.file as usize)
            .map(|f| f.path.as_path())
            .unwrap_or(&self.path);
        let handle = self.handles.get(rec.file as usize).ok_or_else(|| {
            Error::invalid(
                "read chunk",
                "chunk record names a file this source does not have",
            )
            .with_file(&self.path)
            .with_frame(rec.first_frame)
            .with_expected(format!("file index < {}", self.handles.len()))
            .with_found(rec.file.to_string())
        })?;
        let size = usize::try_from(rec.size).map_err(|_| {
            Error::source("read chunk", "chunk size does not fit in memory")
                .with_file(file_path)
                .with_frame(rec.first_frame)
        })?;
        buf.clear();
        buf.resize(size, 0);
        let mut done = 0usize;
        while done < size {
            match handle.read_at(&mut buf[done..], rec.offset + done as u64) {
                Ok(0) => {
                    return Err(Error::source(
                        "read chunk",
                        format!(
                            "short read at byte offset {} (file truncated?)",
                            rec.offset + done as u64
                        ),
                    )
                    .with_file(file_path)
                    .with_frame(rec.first_frame)
                    .with_expected(format!("{size} bytes"))
                    .with_found(format!("{done} bytes")));
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Error::io("read chunk", file_path, &e).with_frame(rec.first_frame))
                }
            }
        }
        Ok(())
    }

    /// The bad-pixel mask: `true` where `pixel_mask & 0xFFFF != 0` (the Dectris rule).
    pub fn bad_pixel_mask(&self) -> Option<Vec<bool>> {
        self.pixel_mask
            .as_ref()
            .map(|m| m.iter().map(|&v| v & 0xFFFF != 0).collect())
    }

    /// Hex FNV-1a 64 digest of the chunk index `(file, offset, size, filter_mask)`, in order.
    pub fn chunk_index_digest(&self) -> String {
        let mut h = FNV_OFFSET;
        for c in &self.chunks {
            h = fnv1a64(h, &c.file.to_le_bytes());
            h = fnv1a64(h, &c.offset.to_le_bytes());
            h = fnv1a64(h, &c.size.to_le_bytes());
            h = fnv1a64(h, &c.filter_mask.to_le_bytes());
        }
        format!("{h:016x}")
    }

    /// Total stored bytes of all chunks.
    pub fn compressed_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.size).sum()
    }
}

thread_local! {
    /// Stored bytes of the chunk being decoded on the host (one buffer per thread).
    static STORED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}
