//! A writer of Dectris-style acquisitions (for tests, demos and benchmarks).
//!
//! It writes what an ARINA/EIGER produces — `<name>_master.h5` with metadata and
//! `/entry/data/data_NNNNNN` external links to `<name>_data_NNNNNN.h5` shards holding
//! `/entry/data/data` `(n, k_r, k_c)` — or one self-contained file ([`WriteLayout::Inline`]).
//! Chunks are encoded in parallel (rayon) with `qem_codec::bslz4::encode_chunk` and written
//! serially with `H5Dwrite_chunk` under hdf5's global lock; filter 32008 is declared OPTIONAL in
//! the dataset creation property list with hdf5plugin's `cd_values [0, 4, elem_size, block, 2]`,
//! so h5py + hdf5plugin read the files.
//!
//! The files also carry what Dectris files do not: a non-standard `/entry/instrument/stem` group
//! (energy, semi-angle, scan step, angular sampling and, when asked, `scan_shape`).

use crate::h5;
use hdf5::types::VarLenUnicode;
use hdf5_sys::h5i::hid_t;
use qem_core::{DType, Error, ErrorKind, Result, Shape2};
use rayon::prelude::*;
use std::path::{Path, PathBuf};

/// How chunk bytes are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WriteCompression {
    /// Bitshuffle + LZ4, HDF5 filter 32008 (what Dectris detectors write).
    #[default]
    Bslz4,
    /// Plain chunks, no filter.
    None,
}

/// Where the frames go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WriteLayout {
    /// A master file plus data shards of `frames_per_file` frames, linked externally.
    #[default]
    Shards,
    /// One file: the frames at `/entry/data/data` `(N, k_r, k_c)` inside the master itself.
    Inline,
}

/// Calibrations written to the master (detector group and the non-standard `stem` group).
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    /// Beam energy in eV (also gives `beam/incident_wavelength`).
    pub energy_ev: Option<f64>,
    /// Probe convergence semi-angle in mrad.
    pub semiangle_mrad: Option<f64>,
    /// Scan step `(row, col)` in Å.
    pub scan_step_a: Option<(f64, f64)>,
    /// Detector angular sampling `(row, col)` in mrad per pixel.
    pub angular_sampling_mrad: Option<(f64, f64)>,
    /// Detector pixel pitch in metres.
    pub pixel_size_m: f64,
    /// Exposure per frame in seconds.
    pub count_time_s: f64,
    /// Frame period in seconds.
    pub frame_time_s: f64,
    /// Counts above this are invalid; `None` writes `dtype max − 1`.
    pub saturation_value: Option<u64>,
}

impl Default for Calibration {
    fn default() -> Self {
        Calibration {
            energy_ev: None,
            semiangle_mrad: None,
            scan_step_a: None,
            angular_sampling_mrad: None,
            pixel_size_m: 75e-6,
            count_time_s: 1e-4,
            frame_time_s: 1e-4,
            saturation_value: None,
        }
    }
}

/// Parameters of [`write_acquisition`].
#[derive(Debug, Clone, PartialEq)]
pub struct WriteParams {
    /// Output prefix: `dir/name` gives `dir/name_master.h5` and `dir/name_data_000001.h5`, ...
    pub prefix: PathBuf,
    /// Scan shape; frames are written in row-major order `n = r·cols + c`.
    pub scan_shape: Shape2,
    /// Detector frame shape.
    pub detector_shape: Shape2,
    /// Element type.
    pub dtype: DType,
    /// Frames per data shard ([`WriteLayout::Shards`]).
    pub frames_per_file: u64,
    /// Frames per chunk (1 like Dectris; more to test multi-frame chunks; the last chunk of a
    /// shard may be partial).
    pub frames_per_chunk: u32,
    /// Bitshuffle block size in elements (multiple of 8); 0 = the default (8 KiB).
    pub block_elems: usize,
    /// Chunk compression.
    pub compression: WriteCompression,
    /// Shards or one inline dataset.
    pub layout: WriteLayout,
    /// `pixel_mask` (`k_r·k_c` values); `None` writes an all-zero mask.
    pub pixel_mask: Option<Vec<u32>>,
    /// Calibrations.
    pub calibration: Calibration,
    /// Frames whose chunks are not written (every chunk holding one of them is skipped), to
    /// make "unwritten chunk" test data.
    pub skip_frames: Vec<u64>,
    /// Record the scan shape: `stem/scan_shape` plus a line-triggered series
    /// (`trigger_mode = exts`, `ntrigger = rows`, `nimages = cols`). When false the master says
    /// `trigger_mode = ints`, `nimages = 1`, `ntrigger = N` (like the reference acquisition), so
    /// a reader must infer the shape.
    pub write_scan_shape: bool,
}

impl Default for WriteParams {
    fn default() -> Self {
        WriteParams {
            prefix: PathBuf::from("scan"),
            scan_shape: Shape2::new(1, 1),
            detector_shape: Shape2::new(1, 1),
            dtype: DType::U16,
            frames_per_file: 10_000,
            frames_per_chunk: 1,
            block_elems: 0,
            compression: WriteCompression::Bslz4,
            layout: WriteLayout::Shards,
            pixel_mask: None,
            calibration: Calibration::default(),
            skip_frames: Vec::new(),
            write_scan_shape: true,
        }
    }
}

/// What [`write_acquisition`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The master file.
    pub master: PathBuf,
    /// The data shards, in order (empty for [`WriteLayout::Inline`]).
    pub data_files: Vec<PathBuf>,
    /// Stored bytes of all chunks written.
    pub compressed_bytes: u64,
    /// Uncompressed bytes of all frames written.
    pub raw_bytes: u64,
}

impl Written {
    /// Bytes on disk of the master and the shards, as the file system reports them now (a
    /// file it cannot stat counts 0).
    pub fn file_bytes(&self) -> u64 {
        std::iter::once(&self.master)
            .chain(&self.data_files)
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.len())
            .sum()
    }
}

const OP: &str = "write acquisition";

fn werr(path: &Path, what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Io, OP, format!("{what}: {e}")).with_file(path)
}

/// Relativistic electron wavelength in Å for a beam energy in eV.
pub fn electron_wavelength_a(energy_ev: f64) -> f64 {
    const H: f64 = 6.626_070_15e-34;
    const M0: f64 = 9.109_383_701_5e-31;
    const E: f64 = 1.602_176_634e-19;
    const C: f64 = 299_792_458.0;
    let ej = energy_ev * E;
    H / (2.0 * M0 * ej * (1.0 + ej / (2.0 * M0 * C * C))).sqrt() * 1e10
}

fn validate(p: &WriteParams) -> Result<()> {
    let inv = |what: &str, exp: String, found: String| {
        Err(Error::invalid(OP, what.to_string())
            .with_expected(exp)
            .with_found(found))
    };
    if p.scan_shape.is_empty() || p.detector_shape.is_empty() {
        return inv(
            "empty scan or detector shape",
            "rows, cols > 0".into(),
            format!("scan {}, detector {}", p.scan_shape, p.detector_shape),
        );
    }
    for (what, shape) in [("scan", p.scan_shape), ("detector", p.detector_shape)] {
        shape.try_len(ErrorKind::InvalidArgument, OP, &format!("{what} shape"))?;
    }
    if p.frames_per_file == 0 || p.frames_per_chunk == 0 {
        return inv(
            "frames_per_file and frames_per_chunk must be positive",
            "> 0".into(),
            format!("{} and {}", p.frames_per_file, p.frames_per_chunk),
        );
    }
    if p.block_elems % 8 != 0 {
        return inv(
            "block_elems must be a multiple of 8",
            "multiple of 8".into(),
            p.block_elems.to_string(),
        );
    }
    let chunk_bytes =
        p.detector_shape.len() as u64 * p.dtype.size() as u64 * p.frames_per_chunk as u64;
    if chunk_bytes >= u32::MAX as u64 {
        return inv(
            "chunk too large for HDF5",
            "< 4 GiB per chunk".into(),
            format!("{chunk_bytes} bytes"),
        );
    }
    if let Some(m) = &p.pixel_mask {
        if m.len() != p.detector_shape.len() {
            return inv(
                "pixel_mask has the wrong length",
                format!("{} values", p.detector_shape.len()),
                format!("{} values", m.len()),
            );
        }
    }
    let n = p.scan_shape.len() as u64;
    if let Some(&f) = p.skip_frames.iter().find(|&&f| f >= n) {
        return inv(
            "skip_frames holds a frame outside the scan",
            format!("< {n}"),
            f.to_string(),
        );
    }
    Ok(())
}

/// Closes an HDF5 id on drop (under the library lock).
struct Hid(hid_t, unsafe extern "C" fn(hid_t) -> i32);

impl Drop for Hid {
    fn drop(&mut self) {
        if self.0 >= 0 {
            let (id, close) = (self.0, self.1);
            // SAFETY: the id was returned by the matching create call and is closed once.
            hdf5::sync::sync(|| unsafe {
                close(id);
            });
        }
    }
}

/// Create `name` in `group`: `(n, k_r, k_c)`, chunks `(fpc, k_r, k_c)`, fill value = dtype max,
/// filter 32008 (OPTIONAL) unless uncompressed. Returns the open dataset id.
fn create_frames_dataset(
    group: &hdf5::Group,
    name: &str,
    n: u64,
    p: &WriteParams,
    file: &Path,
) -> Result<Hid> {
    let det = p.detector_shape;
    let cname = std::ffi::CString::new(name).map_err(|e| werr(file, "dataset name", e))?;
    hdf5::sync::sync(|| {
        let dims = [n, det.rows as u64, det.cols as u64];
        let maxdims = [
            hdf5_sys::h5s::H5S_UNLIMITED,
            det.rows as u64,
            det.cols as u64,
        ];
        let cdims = [p.frames_per_chunk as u64, det.rows as u64, det.cols as u64];
        let es = p.dtype.size() as u32;
        let cd: [u32; 5] = [0, 4, es, p.block_elems as u32, 2];
        // SAFETY: H5open has been called (h5::init); every pointer below points at a live local
        // array of the length passed; ids are wrapped in Hid so they are closed on every path.
        unsafe {
            let ftype = match p.dtype {
                DType::U8 => *hdf5_sys::h5t::H5T_STD_U8LE,
                DType::U16 => *hdf5_sys::h5t::H5T_STD_U16LE,
                DType::U32 => *hdf5_sys::h5t::H5T_STD_U32LE,
            };
            let space = Hid(
                hdf5_sys::h5s::H5Screate_simple(3, dims.as_ptr(), maxdims.as_ptr()),
                hdf5_sys::h5s::H5Sclose,
            );
            let dcpl = Hid(
                hdf5_sys::h5p::H5Pcreate(*hdf5_sys::h5p::H5P_CLS_DATASET_CREATE),
                hdf5_sys::h5p::H5Pclose,
            );
            if space.0 < 0 || dcpl.0 < 0 {
                return Err(werr(
                    file,
                    "create dataspace/property list",
                    "HDF5 call failed",
                ));
            }
            let mut ok = hdf5_sys::h5p::H5Pset_chunk(dcpl.0, 3, cdims.as_ptr()) >= 0;
            if p.compression == WriteCompression::Bslz4 {
                ok &= hdf5_sys::h5p::H5Pset_filter(
                    dcpl.0,
                    h5::BSHUF_ID,
                    hdf5_sys::h5z::H5Z_FLAG_OPTIONAL,
                    cd.len(),
                    cd.as_ptr(),
                ) >= 0;
            }
            let fill: u32 = p.dtype.max_value() as u32;
            let fill_bytes = fill.to_le_bytes();
            ok &= hdf5_sys::h5p::H5Pset_fill_value(dcpl.0, ftype, fill_bytes.as_ptr().cast()) >= 0;
            ok &= hdf5_sys::h5p::H5Pset_fill_time(
                dcpl.0,
                hdf5_sys::h5d::H5D_fill_time_t::H5D_FILL_TIME_IFSET,
            ) >= 0;
            ok &= hdf5_sys::h5p::H5Pset_alloc_time(
                dcpl.0,
                hdf5_sys::h5d::H5D_alloc_time_t::H5D_ALLOC_TIME_INCR,
            ) >= 0;
            if !ok {
                return Err(werr(
                    file,
                    "set dataset creation properties",
                    "HDF5 call failed",
                ));
            }
            let ds = hdf5_sys::h5d::H5Dcreate2(
                group.id(),
                cname.as_ptr(),
                ftype,
                space.0,
                hdf5_sys::h5p::H5P_DEFAULT,
                dcpl.0,
                hdf5_sys::h5p::H5P_DEFAULT,
            );
            if ds < 0 {
                return Err(werr(
                    file,
                    &format!("create dataset {name}"),
                    "H5Dcreate2 failed",
                ));
            }
            Ok(Hid(ds, hdf5_sys::h5d::H5Dclose))
        }
    })
}

/// One chunk to produce: index in its dataset, first global frame, frames inside the dataset.
#[derive(Debug, Clone, Copy)]
struct Job {
    chunk: u64,
    first: u64,
    valid: u32,
}

/// Fill and encode one chunk.
fn make_chunk(
    p: &WriteParams,
    job: Job,
    frame: &(dyn Fn(u64, &mut [u8]) + Sync),
) -> Result<Vec<u8>> {
    let fb = p.detector_shape.len() * p.dtype.size();
    let mut raw = vec![0u8; fb * p.frames_per_chunk as usize];
    for i in 0..job.valid as usize {
        frame(job.first + i as u64, &mut raw[i * fb..(i + 1) * fb]);
    }
    match p.compression {
        WriteCompression::None => Ok(raw),
        WriteCompression::Bslz4 => {
            qem_codec::bslz4::encode_chunk(&raw, p.dtype.size(), p.block_elems).map_err(|e| {
                Error::internal(OP, format!("bitshuffle/LZ4 encode failed: {e}"))
                    .with_frame(job.first)
            })
        }
    }
}

/// What every dataset write shares.
struct Ctx<'a> {
    p: &'a WriteParams,
    skip: &'a std::collections::BTreeSet<u64>,
    frame: &'a (dyn Fn(u64, &mut [u8]) + Sync),
}

/// Encoded chunks of one batch, in job order.
type Encoded = Vec<Result<Vec<u8>>>;

/// Write frames `lo..hi` (global) as dataset `name` of `group`; returns stored and raw bytes.
fn write_frames(
    group: &hdf5::Group,
    name: &str,
    lo: u64,
    hi: u64,
    ctx: &Ctx<'_>,
    file: &Path,
) -> Result<(u64, u64)> {
    let (p, skip, frame) = (ctx.p, ctx.skip, ctx.frame);
    let n = hi - lo;
    let fpc = p.frames_per_chunk as u64;
    let fb = (p.detector_shape.len() * p.dtype.size()) as u64;
    let ds = create_frames_dataset(group, name, n, p, file)?;
    let jobs: Vec<Job> = (0..n.div_ceil(fpc))
        .map(|j| {
            let first = lo + j * fpc;
            let valid = fpc.min(hi - first) as u32;
            Job {
                chunk: j,
                first,
                valid,
            }
        })
        .filter(|job| {
            skip.range(job.first..job.first + job.valid as u64)
                .next()
                .is_none()
        })
        .collect();
    let per_batch = (256 / fpc).max(1) as usize;
    let batches: Vec<&[Job]> = jobs.chunks(per_batch).collect();
    let encode =
        |batch: &[Job]| -> Encoded { batch.par_iter().map(|&j| make_chunk(p, j, frame)).collect() };
    let write = |batch: &[Job], encoded: Encoded| -> Result<(u64, u64)> {
        let mut stored = 0u64;
        let mut raw = 0u64;
        for (job, bytes) in batch.iter().zip(encoded) {
            let bytes = bytes.map_err(|e| e.with_file(file))?;
            let offset = [job.chunk * fpc, 0u64, 0u64];
            let rc = hdf5::sync::sync(|| {
                // SAFETY: ds is an open dataset id; offset has rank 3 like the dataset; bytes is a
                // live buffer of bytes.len() bytes.
                unsafe {
                    hdf5_sys::h5d::H5Dwrite_chunk(
                        ds.0,
                        hdf5_sys::h5p::H5P_DEFAULT,
                        0,
                        offset.as_ptr(),
                        bytes.len(),
                        bytes.as_ptr().cast(),
                    )
                }
            });
            if rc < 0 {
                return Err(werr(
                    file,
                    "H5Dwrite_chunk failed",
                    format!("chunk {}", job.chunk),
                )
                .with_frame(job.first));
            }
            stored += bytes.len() as u64;
            raw += job.valid as u64 * fb;
        }
        Ok((stored, raw))
    };
    let mut totals = (0u64, 0u64);
    let mut pending: Option<(&[Job], Encoded)> = None;
    for batch in batches {
        let (written, encoded) = match pending.take() {
            Some((prev, enc)) => {
                let (w, e) = rayon::join(|| write(prev, enc), || encode(batch));
                (Some(w), e)
            }
            None => (None, encode(batch)),
        };
        if let Some(w) = written {
            let (s, r) = w?;
            totals.0 += s;
            totals.1 += r;
        }
        pending = Some((batch, encoded));
    }
    if let Some((prev, enc)) = pending {
        let (s, r) = write(prev, enc)?;
        totals.0 += s;
        totals.1 += r;
    }
    drop(ds);
    let dset = group
        .dataset(name)
        .map_err(|e| werr(file, "reopen dataset", e))?;
    put_attr_u64(&dset, "image_nr_low", lo + 1).map_err(|e| werr(file, "image_nr_low", e))?;
    put_attr_u64(&dset, "image_nr_high", hi).map_err(|e| werr(file, "image_nr_high", e))?;
    Ok(totals)
}

/// Write a self-contained HDF5 file holding one uncompressed `u16` dataset `/data` of extent
/// `dims` (3-D or 4-D), chunked by `chunk_dims`, of which only the chunks at the element
/// offsets `written` are stored (each filled with `value`).
///
/// Hostile-input test data: a file of a few kB can declare billions of frames (e.g.
/// `(31623, 31623, 64, 64)` with chunks `(1, 1, 64, 64)` and one chunk written), which a
/// reader must not size anything by.
pub fn write_sparse_dataset(
    path: &Path,
    dims: &[u64],
    chunk_dims: &[u64],
    written: &[Vec<u64>],
    value: u16,
) -> Result<()> {
    h5::init();
    let inv = |what: &str| Err(Error::invalid(OP, what.to_string()).with_file(path));
    if dims.len() != chunk_dims.len() || !(3..=4).contains(&dims.len()) {
        return inv("dims and chunk_dims must both have 3 or 4 entries");
    }
    let chunk_elems = chunk_dims
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .filter(|&n| n > 0 && n < (1 << 30));
    let Some(chunk_elems) = chunk_elems else {
        return inv("a chunk must hold between 1 and 2^30 elements");
    };
    let chunk: Vec<u8> = value.to_le_bytes().repeat(chunk_elems as usize);
    let f = h5::create_write(path).map_err(|e| werr(path, "create", e))?;
    let rank = dims.len() as i32;
    hdf5::sync::sync(|| {
        // SAFETY: raw HDF5 calls on ids created and closed here; `dims`, `chunk_dims`, each
        // offset and `chunk` outlive the calls that read them.
        unsafe {
            let space = hdf5_sys::h5s::H5Screate_simple(rank, dims.as_ptr(), std::ptr::null());
            if space < 0 {
                return Err(werr(path, "H5Screate_simple failed", format!("{dims:?}")));
            }
            let dcpl = hdf5_sys::h5p::H5Pcreate(*hdf5_sys::h5p::H5P_CLS_DATASET_CREATE);
            let ok = dcpl >= 0 && hdf5_sys::h5p::H5Pset_chunk(dcpl, rank, chunk_dims.as_ptr()) >= 0;
            let ds = if ok {
                hdf5_sys::h5d::H5Dcreate2(
                    f.id(),
                    c"data".as_ptr(),
                    *hdf5_sys::h5t::H5T_STD_U16LE,
                    space,
                    hdf5_sys::h5p::H5P_DEFAULT,
                    dcpl,
                    hdf5_sys::h5p::H5P_DEFAULT,
                )
            } else {
                -1
            };
            let mut result = Ok(());
            if ds < 0 {
                result = Err(werr(path, "H5Dcreate2 failed", format!("{dims:?}")));
            } else {
                for off in written {
                    if off.len() != dims.len()
                        || hdf5_sys::h5d::H5Dwrite_chunk(
                            ds,
                            hdf5_sys::h5p::H5P_DEFAULT,
                            0,
                            off.as_ptr(),
                            chunk.len(),
                            chunk.as_ptr().cast(),
                        ) < 0
                    {
                        result = Err(werr(path, "H5Dwrite_chunk failed", format!("{off:?}")));
                        break;
                    }
                }
                hdf5_sys::h5d::H5Dclose(ds);
            }
            if dcpl >= 0 {
                hdf5_sys::h5p::H5Pclose(dcpl);
            }
            hdf5_sys::h5s::H5Sclose(space);
            result
        }
    })
}

fn put_attr_u64(loc: &hdf5::Location, name: &str, v: u64) -> hdf5::Result<()> {
    loc.new_attr::<u64>()
        .shape(())
        .create(name)?
        .write_scalar(&v)
}

fn vlu(s: &str) -> hdf5::Result<VarLenUnicode> {
    s.parse::<VarLenUnicode>()
        .map_err(|e| hdf5::Error::from(e.to_string().as_str()))
}

fn put_attr_str(loc: &hdf5::Location, name: &str, v: &str) -> hdf5::Result<()> {
    loc.new_attr::<VarLenUnicode>()
        .shape(())
        .create(name)?
        .write_scalar(&vlu(v)?)
}

fn put_str(g: &hdf5::Group, name: &str, v: &str) -> hdf5::Result<()> {
    g.new_dataset::<VarLenUnicode>()
        .shape(())
        .create(name)?
        .write_scalar(&vlu(v)?)
}

fn put_num<T: hdf5::H5Type>(
    g: &hdf5::Group,
    name: &str,
    v: T,
    units: Option<&str>,
) -> hdf5::Result<()> {
    let ds = g.new_dataset::<T>().shape(()).create(name)?;
    ds.write_scalar(&v)?;
    if let Some(u) = units {
        put_attr_str(&ds, "units", u)?;
    }
    Ok(())
}

fn put_vec<T: hdf5::H5Type>(
    g: &hdf5::Group,
    name: &str,
    v: &[T],
    shape: &[usize],
    units: Option<&str>,
) -> hdf5::Result<()> {
    let ds = g.new_dataset::<T>().shape(shape).create(name)?;
    ds.write_raw(v)?;
    if let Some(u) = units {
        put_attr_str(&ds, "units", u)?;
    }
    Ok(())
}

fn group_nx(parent: &hdf5::Group, name: &str, class: &str) -> hdf5::Result<hdf5::Group> {
    let g = parent.create_group(name)?;
    put_attr_str(&g, "NX_class", class)?;
    Ok(g)
}

/// Metadata groups of the master, as `make_dectris.py` writes them.
fn write_metadata(entry: &hdf5::Group, p: &WriteParams) -> hdf5::Result<()> {
    let cal = &p.calibration;
    let (kr, kc) = (p.detector_shape.rows, p.detector_shape.cols);
    let n = p.scan_shape.len() as u64;
    put_str(entry, "definition", "NXmx")?;
    let inst = group_nx(entry, "instrument", "NXinstrument")?;
    let beam = group_nx(&inst, "beam", "NXbeam")?;
    if let Some(e) = cal.energy_ev {
        put_num(
            &beam,
            "incident_wavelength",
            electron_wavelength_a(e) as f32,
            Some("angstrom"),
        )?;
    }
    let det = group_nx(&inst, "detector", "NXdetector")?;
    put_str(
        &det,
        "description",
        "Dectris-style detector (written by quantem.gpu qem-io)",
    )?;
    put_str(&det, "sensor_material", "Si")?;
    put_num(&det, "x_pixel_size", cal.pixel_size_m as f32, Some("m"))?;
    put_num(&det, "y_pixel_size", cal.pixel_size_m as f32, Some("m"))?;
    put_num(
        &det,
        "beam_center_x",
        ((kc as f64 - 1.0) / 2.0) as f32,
        Some("pixel"),
    )?;
    put_num(
        &det,
        "beam_center_y",
        ((kr as f64 - 1.0) / 2.0) as f32,
        Some("pixel"),
    )?;
    put_num(&det, "count_time", cal.count_time_s as f32, Some("s"))?;
    put_num(&det, "frame_time", cal.frame_time_s as f32, Some("s"))?;
    put_num(&det, "bit_depth_image", (p.dtype.size() * 8) as u32, None)?;
    put_num(&det, "bit_depth_readout", 16u32, None)?;
    let sat = cal.saturation_value.unwrap_or(p.dtype.max_value() - 1);
    put_num(&det, "saturation_value", sat as u32, None)?;
    put_num(&det, "pixel_mask_applied", 0u32, None)?;
    put_num(&det, "countrate_correction_applied", 1u32, None)?;
    if let Some((a, _)) = cal.angular_sampling_mrad {
        if a > 0.0 {
            put_num(
                &det,
                "detector_distance",
                (cal.pixel_size_m / (a * 1e-3)) as f32,
                Some("m"),
            )?;
        }
    }
    let ds = det.create_group("detectorSpecific")?;
    let (nimages, ntrigger, mode) = if p.write_scan_shape {
        (p.scan_shape.cols as u64, p.scan_shape.rows as u64, "exts")
    } else {
        (1, n, "ints")
    };
    put_num(&ds, "nimages", nimages, None)?;
    put_num(&ds, "ntrigger", ntrigger, None)?;
    put_str(&ds, "trigger_mode", mode)?;
    put_num(&ds, "x_pixels_in_detector", kc as u32, None)?;
    put_num(&ds, "y_pixels_in_detector", kr as u32, None)?;
    put_num(&ds, "frame_count_time", cal.count_time_s as f32, Some("s"))?;
    put_str(
        &ds,
        "compression",
        if p.compression == WriteCompression::Bslz4 {
            "bslz4"
        } else {
            "none"
        },
    )?;
    put_num(
        &ds,
        "images_per_file",
        p.frames_per_file.min(n) as u32,
        None,
    )?;
    let zeros;
    let mask: &[u32] = match &p.pixel_mask {
        Some(m) => m,
        None => {
            zeros = vec![0u32; kr * kc];
            &zeros
        }
    };
    put_num(
        &ds,
        "number_of_excluded_pixels",
        mask.iter().filter(|&&v| v != 0).count() as u32,
        None,
    )?;
    put_vec(&ds, "pixel_mask", mask, &[kr, kc], None)?;

    let stem = group_nx(&inst, "stem", "NXcollection")?;
    put_attr_str(
        &stem,
        "note",
        "non-standard; written by quantem.gpu qem-io for test data",
    )?;
    if let Some(e) = cal.energy_ev {
        put_num(&stem, "energy", e, Some("eV"))?;
        put_num(
            &stem,
            "wavelength",
            electron_wavelength_a(e),
            Some("angstrom"),
        )?;
    }
    if let Some(a) = cal.semiangle_mrad {
        put_num(&stem, "convergence_semiangle", a, Some("mrad"))?;
    }
    if let Some((r, c)) = cal.scan_step_a {
        put_vec(&stem, "scan_step", &[r, c], &[2], Some("angstrom"))?;
    }
    if let Some((r, c)) = cal.angular_sampling_mrad {
        put_vec(
            &stem,
            "detector_angular_sampling",
            &[r, c],
            &[2],
            Some("mrad"),
        )?;
    }
    if p.write_scan_shape {
        let s = [p.scan_shape.rows as i64, p.scan_shape.cols as i64];
        put_vec(&stem, "scan_shape", &s, &[2], None)?;
    }
    Ok(())
}

/// Write an acquisition; `frame(n, buf)` fills frame `n`'s little-endian bytes
/// (`buf.len() == k_r·k_c·elem_size`). It is called from many threads.
pub fn write_acquisition(
    params: &WriteParams,
    frame: impl Fn(u64, &mut [u8]) + Sync,
) -> Result<Written> {
    validate(params)?;
    h5::init();
    let p = params;
    let dir = match p.prefix.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let base = p
        .prefix
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::invalid(OP, "prefix has no file name").with_file(&p.prefix))?
        .to_string();
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(OP, &dir, &e))?;
    let master = dir.join(format!("{base}_master.h5"));
    let n = p.scan_shape.len() as u64;
    let skip: std::collections::BTreeSet<u64> = p.skip_frames.iter().copied().collect();
    let frame: &(dyn Fn(u64, &mut [u8]) + Sync) = &frame;
    let ctx = Ctx {
        p,
        skip: &skip,
        frame,
    };

    let mut data_files = Vec::new();
    let mut totals = (0u64, 0u64);
    let mut shard_names = Vec::new();
    if p.layout == WriteLayout::Shards {
        let nfiles = n.div_ceil(p.frames_per_file);
        for k in 0..nfiles {
            let lo = k * p.frames_per_file;
            let hi = (lo + p.frames_per_file).min(n);
            let name = format!("{base}_data_{:06}.h5", k + 1);
            let path = dir.join(&name);
            let f = h5::create_write(&path).map_err(|e| werr(&path, "create shard", e))?;
            let data = (|| -> hdf5::Result<hdf5::Group> {
                let entry = group_nx(&f, "entry", "NXentry")?;
                group_nx(&entry, "data", "NXdata")
            })()
            .map_err(|e| werr(&path, "create groups", e))?;
            let (s, r) = write_frames(&data, "data", lo, hi, &ctx, &path)?;
            totals.0 += s;
            totals.1 += r;
            drop(data);
            f.close().map_err(|e| werr(&path, "close shard", e))?;
            data_files.push(path);
            shard_names.push(name);
        }
    }

    let f = h5::create_write(&master).map_err(|e| werr(&master, "create master", e))?;
    let entry = group_nx(&f, "entry", "NXentry").map_err(|e| werr(&master, "create /entry", e))?;
    let data =
        group_nx(&entry, "data", "NXdata").map_err(|e| werr(&master, "create /entry/data", e))?;
    for (k, name) in shard_names.iter().enumerate() {
        data.link_external(name, "/entry/data/data", &format!("data_{:06}", k + 1))
            .map_err(|e| werr(&master, "create external link", e))?;
    }
    if p.layout == WriteLayout::Inline {
        let (s, r) = write_frames(&data, "data", 0, n, &ctx, &master)?;
        totals.0 += s;
        totals.1 += r;
    }
    write_metadata(&entry, p).map_err(|e| werr(&master, "write metadata", e))?;
    drop((data, entry));
    f.close().map_err(|e| werr(&master, "close master", e))?;
    Ok(Written {
        master,
        data_files,
        compressed_bytes: totals.0,
        raw_bytes: totals.1,
    })
}
