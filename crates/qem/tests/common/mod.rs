//! Set-up shared by the `qem` integration tests: acquisitions written by our Dectris writer from
//! data generated here, and independent naive references (mask, regions and u64 bin sums,
//! statistics) written here, not by the engine. Each test file uses the part it needs.
#![allow(dead_code)]

use qem::{load, DType, Dataset, DenseArray, LoadParams, Region, Shape2, SourceArg};
use qem_io::writer::{write_acquisition, WriteParams};
use std::path::{Path, PathBuf};

/// A deterministic 64-bit hash of `(frame, pixel)` (splitmix-style), the source of the
/// pseudo-random test counts.
pub fn mix(frame: u64, pixel: usize) -> u64 {
    let mut x = frame
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((pixel as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9));
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 29)
}

/// Sparse counts from `x = mix(..)`: with `r = x % 1000`, 0 for `r ≤ 600`, `r % 7` up to 950,
/// `r` itself up to `plain_max`, and `rare(x)` above.
pub fn sparse_count(x: u64, plain_max: u32, rare: impl FnOnce(u64) -> u32) -> u32 {
    let r = (x % 1000) as u32;
    if r <= 600 {
        0
    } else if r <= 950 {
        r % 7
    } else if r <= plain_max {
        r
    } else {
        rare(x)
    }
}

/// The writer's parameters for `scan × det` frames of `dtype` at `dir/scan`; every other field
/// keeps the writer's default (one frame a chunk, bitshuffle-LZ4 shards, no mask).
pub fn write_params(dir: &Path, scan: Shape2, det: Shape2, dtype: DType) -> WriteParams {
    WriteParams {
        prefix: dir.join("scan"),
        scan_shape: scan,
        detector_shape: det,
        dtype,
        ..WriteParams::default()
    }
}

/// Writes `data` (row-major frames; each value cast to `params.dtype`, little-endian) and
/// returns the master file.
pub fn write_data(params: &WriteParams, data: &[u32]) -> PathBuf {
    let frame_len = params.detector_shape.len();
    let dtype = params.dtype;
    let written = write_acquisition(params, |f, out: &mut [u8]| {
        let frame = &data[f as usize * frame_len..(f as usize + 1) * frame_len];
        match dtype {
            DType::U8 => out.iter_mut().zip(frame).for_each(|(o, v)| *o = *v as u8),
            DType::U16 => {
                for (o, v) in out.chunks_exact_mut(2).zip(frame) {
                    o.copy_from_slice(&(*v as u16).to_le_bytes());
                }
            }
            DType::U32 => {
                for (o, v) in out.chunks_exact_mut(4).zip(frame) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    })
    .expect("write acquisition");
    written.master
}

/// A shape as `(rows, cols)`.
pub type Dims = (usize, usize);

/// An acquisition written by our writer, with what generated it.
pub struct Written {
    pub master: PathBuf,
    pub data: Vec<u32>,
    pub scan: Shape2,
    pub det: Shape2,
    pub mask: Vec<u32>,
}

/// Writes `scan × det` frames of `value(frame, pixel)` as `dtype` into `dir` (8 frames a shard)
/// with a pixel mask holding two bad pixels (a gap and an over-responding one) and one
/// virtual-pixel tag (bit 31 only: not bad).
pub fn write(
    dir: &Path,
    scan: Dims,
    det: Dims,
    dtype: DType,
    value: impl Fn(u64, usize) -> u32,
) -> Written {
    let (scan, det) = (Shape2::new(scan.0, scan.1), Shape2::new(det.0, det.1));
    let frame_len = det.len();
    let data: Vec<u32> = (0..scan.len() as u64)
        .flat_map(|f| (0..frame_len).map(move |p| (f, p)))
        .map(|(f, p)| value(f, p))
        .collect();
    let mut mask = vec![0u32; frame_len];
    mask[frame_len / 3] = 1; // gap: bad
    mask[frame_len / 2] = 1 << 31; // virtual-pixel tag only: not bad
    mask[frame_len - 1] = 8; // over-responding: bad
    let params = WriteParams {
        frames_per_file: 8,
        pixel_mask: Some(mask.clone()),
        ..write_params(dir, scan, det, dtype)
    };
    let master = write_data(&params, &data);
    Written {
        master,
        data,
        scan,
        det,
        mask,
    }
}

/// Naive reference: mask (low 16 bits) → regions → bin (u64 sums, partial edges kept).
pub fn reference(w: &Written, scan_region: Region, det_region: Region, bin: usize) -> Vec<u64> {
    let rs = det_region.shape();
    let (orows, ocols) = (rs.rows.div_ceil(bin), rs.cols.div_ceil(bin));
    let mut out = Vec::new();
    for r in scan_region.row_start..scan_region.row_stop {
        for c in scan_region.col_start..scan_region.col_stop {
            let f = r * w.scan.cols + c;
            let mut frame = vec![0u64; orows * ocols];
            for i in det_region.row_start..det_region.row_stop {
                for j in det_region.col_start..det_region.col_stop {
                    let p = i * w.det.cols + j;
                    if w.mask[p] & 0xFFFF != 0 {
                        continue;
                    }
                    let o = ((i - det_region.row_start) / bin) * ocols
                        + (j - det_region.col_start) / bin;
                    frame[o] += w.data[f * w.det.len() + p] as u64;
                }
            }
            out.extend(frame);
        }
    }
    out
}

/// The whole acquisition through the naive reference, unbinned.
pub fn reference_full(w: &Written) -> Vec<u64> {
    reference(w, w.scan.full(), w.det.full(), 1)
}

pub fn as_u64(a: &DenseArray) -> Vec<u64> {
    (0..a.len()).map(|i| a.get(i).unwrap_or(u64::MAX)).collect()
}

/// Loads the file at `path` with `params`.
pub fn load_path(path: &Path, params: &LoadParams) -> Result<Dataset, qem::Error> {
    load(SourceArg::Path(path.to_path_buf()), params)
}

/// Scan region, detector region and bin cases for a 6 × 5 scan of 15 × 13 frames: a partial
/// scan, binning with partial edge blocks, both regions at once, one scan column.
pub const REGION_CASES: [(Region, Region, usize); 4] = [
    (Region::new(1, 4, 2, 5), Region::new(0, 15, 0, 13), 1),
    (Region::new(0, 6, 0, 5), Region::new(0, 15, 0, 13), 2),
    (Region::new(2, 3, 0, 5), Region::new(3, 14, 1, 12), 4),
    (Region::new(0, 6, 4, 5), Region::new(2, 9, 0, 13), 3),
];

/// Loads `scan × det` frames held in `data` with `params`.
pub fn load_array(data: DenseArray, scan: Shape2, det: Shape2, params: &LoadParams) -> Dataset {
    try_load_array(data, scan, det, params).expect("load array")
}

/// [`load_array`], its error returned (an engine that is not present answers
/// `BackendUnavailable`).
pub fn try_load_array(
    data: DenseArray,
    scan: Shape2,
    det: Shape2,
    params: &LoadParams,
) -> qem::Result<Dataset> {
    let shape = vec![scan.rows, scan.cols, det.rows, det.cols];
    load(SourceArg::Array { data, shape }, params)
}

/// u16 counts of `scan × det` frames: a bright disk of radius 4 around the detector's centre
/// pixel `(k_r / 2, k_c / 2)`, a sparse halo, and a few values near the top of the u16 range
/// (so u32 shared sums and u64 results are exercised). A detector of rows ≠ columns and an
/// odd size makes partial bitshuffle blocks.
pub fn disk_counts(scan: Shape2, det: Shape2) -> Vec<u16> {
    let (ci, cj) = ((det.rows / 2) as f64, (det.cols / 2) as f64);
    let mut v = Vec::with_capacity(scan.len() * det.len());
    for f in 0..scan.len() as u64 {
        for p in 0..det.len() as u64 {
            let x = (f * 2_654_435_761 + p * 40_503 + 17) % 1009;
            let (i, j) = ((p / det.cols as u64) as f64, (p % det.cols as u64) as f64);
            let inside = (i - ci).powi(2) + (j - cj).powi(2) <= 16.0;
            v.push(match x {
                _ if inside => 200 + (x % 50) as u16,
                0..=3 => 60_000 + x as u16,
                4..=200 => (x % 5) as u16,
                _ => 0,
            });
        }
    }
    v
}

pub fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// Pearson correlation coefficient: the centred dot product over the centred norms.
pub fn pearson(a: &[f64], b: &[f64]) -> f64 {
    let centred = |v: &[f64]| -> Vec<f64> {
        let m = mean(v);
        v.iter().map(|x| x - m).collect()
    };
    let dot = |u: &[f64], v: &[f64]| -> f64 { u.iter().zip(v).map(|(x, y)| x * y).sum() };
    let (da, db) = (centred(a), centred(b));
    dot(&da, &db) / (dot(&da, &da) * dot(&db, &db)).sqrt()
}

/// Relative L2 error `‖got − want‖ / ‖want‖` (the lengths must agree).
pub fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got.iter().zip(want).map(|(a, b)| (a - b).powi(2)).sum();
    let den: f64 = want.iter().map(|b| b * b).sum();
    (num / den).sqrt()
}
