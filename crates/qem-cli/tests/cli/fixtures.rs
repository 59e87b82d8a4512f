//! Shared fixtures of the products, dpc, ssb and hostile tests: `.npy` readers, generated
//! acquisitions (`write_acq`, the disk acquisition) and the naive disk/ring references.

use std::path::Path;

/// The shape, descr and data bytes of a `.npy` file (NPY v1.0, as our writer makes them).
pub(crate) fn read_npy(path: &Path) -> (Vec<usize>, String, Vec<u8>) {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&b[..8], b"\x93NUMPY\x01\x00", "{}", path.display());
    let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
    assert_eq!((10 + hl) % 64, 0, "header padding of {}", path.display());
    let header = std::str::from_utf8(&b[10..10 + hl]).unwrap();
    assert!(header.contains("'fortran_order': False"), "{header}");
    let descr = header.split("'descr': '").nth(1).unwrap();
    let descr = descr[..descr.find('\'').unwrap()].to_string();
    let dims = header.split("'shape': (").nth(1).unwrap();
    let dims = &dims[..dims.find(')').unwrap()];
    let shape: Vec<usize> = dims
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    (shape, descr, b[10 + hl..].to_vec())
}

pub(crate) fn npy_shape(path: &Path) -> Vec<usize> {
    read_npy(path).0
}

pub(crate) fn npy_u64(path: &Path) -> (Vec<usize>, Vec<u64>) {
    let (shape, descr, data) = read_npy(path);
    assert_eq!(descr, "<u8", "{}", path.display());
    let v = data
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (shape, v)
}

pub(crate) fn npy_f64(path: &Path) -> (Vec<usize>, Vec<f64>) {
    let (shape, descr, data) = read_npy(path);
    let v = match descr.as_str() {
        "<f8" => data
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        "<f4" => data
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
            .collect(),
        other => panic!("{}: descr {other}", path.display()),
    };
    (shape, v)
}

/// Write a Dectris acquisition of u16 `frames` (`scan.len()` frames of `det.len()` pixels).
pub(crate) fn write_acq(
    dir: &Path,
    scan: (usize, usize),
    det: (usize, usize),
    frames: &[u16],
) -> String {
    use qem_io::writer::{self, WriteCompression, WriteLayout, WriteParams};
    let det_len = det.0 * det.1;
    assert_eq!(frames.len(), scan.0 * scan.1 * det_len);
    let params = WriteParams {
        prefix: dir.join("acq"),
        scan_shape: qem::Shape2::new(scan.0, scan.1),
        detector_shape: qem::Shape2::new(det.0, det.1),
        dtype: qem::DType::U16,
        frames_per_file: 16,
        frames_per_chunk: 1,
        block_elems: 0,
        compression: WriteCompression::Bslz4,
        layout: WriteLayout::Shards,
        pixel_mask: None,
        calibration: writer::Calibration::default(),
        skip_frames: Vec::new(),
        write_scan_shape: true,
    };
    let written = writer::write_acquisition(&params, |n, buf| {
        let f = &frames[n as usize * det_len..(n as usize + 1) * det_len];
        for (dst, v) in buf.chunks_exact_mut(2).zip(f) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
    })
    .unwrap();
    written.master.to_str().unwrap().to_string()
}

pub(crate) const P_SCAN: (usize, usize) = (5, 7);
pub(crate) const P_DET: (usize, usize) = (11, 13);

/// Frames with a bright disk of radius 3 around (5.2, 6.4), deterministic "noise", a few
/// all-zero frames.
/// [`disk_frames`] written (`P_SCAN`, `P_DET`) in a new temporary directory: the directory,
/// the frames and the master file.
pub(crate) fn disk_acquisition() -> (tempfile::TempDir, Vec<u16>, String) {
    let dir = tempfile::tempdir().unwrap();
    let frames = disk_frames();
    let master = write_acq(dir.path(), P_SCAN, P_DET, &frames);
    (dir, frames, master)
}

pub(crate) fn disk_frames() -> Vec<u16> {
    let (n, k) = (P_SCAN.0 * P_SCAN.1, P_DET.0 * P_DET.1);
    let mut v = Vec::with_capacity(n * k);
    for f in 0..n {
        for p in 0..k {
            let (i, j) = ((p / P_DET.1) as f64, (p % P_DET.1) as f64);
            let inside = (i - 5.2).powi(2) + (j - 6.4).powi(2) <= 9.0;
            let noise = ((f * 31 + p * 17) % 7) as u16;
            v.push(if f == 3 || f == 20 {
                0
            } else if inside {
                900 + 10 * noise + f as u16
            } else {
                noise
            });
        }
    }
    v
}

/// The BF disk of the naive mean DP (f32 values, statistics in f64, docs/science.md §3).
pub(crate) fn naive_disk(frames: &[u16], n: usize, det: (usize, usize)) -> ((f64, f64), f64) {
    let k = det.0 * det.1;
    let mut sum = vec![0u64; k];
    for f in 0..n {
        for p in 0..k {
            sum[p] += u64::from(frames[f * k + p]);
        }
    }
    let mean: Vec<f64> = sum
        .iter()
        .map(|&s| f64::from((s as f64 / n as f64) as f32))
        .collect();
    let mu = mean.iter().sum::<f64>() / k as f64;
    let sd = (mean.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / k as f64).sqrt();
    let (mut c, mut sr, mut sc) = (0usize, 0.0, 0.0);
    for (p, &v) in mean.iter().enumerate() {
        if v > mu + sd {
            c += 1;
            sr += (p / det.1) as f64;
            sc += (p % det.1) as f64;
        }
    }
    (
        (sr / c as f64, sc / c as f64),
        (c as f64 / std::f64::consts::PI).sqrt(),
    )
}

pub(crate) fn naive_ring(
    frames: &[u16],
    n: usize,
    det: (usize, usize),
    c: (f64, f64),
    lo: f64,
    hi: f64,
) -> Vec<u64> {
    let k = det.0 * det.1;
    (0..n)
        .map(|f| {
            let mut s = 0u64;
            for p in 0..k {
                let (dr, dc) = ((p / det.1) as f64 - c.0, (p % det.1) as f64 - c.1);
                let d2 = dr * dr + dc * dc;
                if lo * lo <= d2 && d2 <= hi * hi {
                    s += u64::from(frames[f * k + p]);
                }
            }
            s
        })
        .collect()
}
