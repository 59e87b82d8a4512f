//! Bright-field and annular dark-field images from a dense dataset, for the demo.
//!
//! TEMPORARY: a later issue moves these products into the engine (`qem` / `qem-cpu`); delete
//! this module then. The definitions are SCIENCE.md's: mean DP = u64 sum / N (f64, returned as
//! f32); BF disk from the mean DP (threshold mean + population std, strict `>`, unweighted
//! centroid, equal-area radius; an empty set gives centre `(k_r/2, k_c/2)` and radius
//! `min(k_r, k_c)/4`); a pixel belongs to an annulus when `lo² ≤ |k − c|² ≤ hi²` in f64;
//! BF = `[0, r]`, ADF = `[r, 2r]`; images are u64 sums.

use qem::{DenseArray, Shape2};

/// The fitted BF disk.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DiskFit {
    /// Centre `(row, col)`, detector pixels.
    pub center_px: (f64, f64),
    /// Equal-area radius, detector pixels.
    pub radius_px: f64,
    /// The threshold `mean + std` of the mean DP.
    pub threshold: f64,
    /// Pixels above the threshold.
    pub n_pixels: usize,
}

/// Call a generic function on the dataset's slice, whatever its dtype.
macro_rules! dispatch {
    ($data:expr, $f:ident($($arg:expr),*)) => {
        match $data {
            DenseArray::U8(v) => $f(v, $($arg),*),
            DenseArray::U16(v) => $f(v, $($arg),*),
            DenseArray::U32(v) => $f(v, $($arg),*),
        }
    };
}

fn sum_dp<T: Copy + Into<u64>>(v: &[T], frame_len: usize) -> Vec<u64> {
    let mut sum = vec![0u64; frame_len];
    for frame in v.chunks_exact(frame_len) {
        for (s, &x) in sum.iter_mut().zip(frame) {
            *s += x.into();
        }
    }
    sum
}

fn masked_sums<T: Copy + Into<u64>>(v: &[T], mask: &[bool]) -> Vec<u64> {
    v.chunks_exact(mask.len())
        .map(|frame| {
            frame
                .iter()
                .zip(mask)
                .filter(|(_, &m)| m)
                .map(|(&x, _)| x.into())
                .sum()
        })
        .collect()
}

/// Mean diffraction pattern: exact u64 sum over frames, divided by the frame count in f64.
pub fn mean_dp(data: &DenseArray, frame_len: usize) -> Vec<f32> {
    let frame_len = frame_len.max(1);
    let sum = dispatch!(data, sum_dp(frame_len));
    let n = (data.len() / frame_len).max(1) as f64;
    sum.iter().map(|&s| (s as f64 / n) as f32).collect()
}

/// The BF disk of a mean diffraction pattern.
pub fn fit_bf_disk(mean: &[f32], det: Shape2) -> DiskFit {
    let n = mean.len().max(1) as f64;
    let mu = mean.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = mean.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / n;
    let t = mu + var.sqrt();
    let (mut count, mut sr, mut sc) = (0usize, 0.0, 0.0);
    for (k, &v) in mean.iter().enumerate() {
        if v as f64 > t {
            count += 1;
            sr += (k / det.cols) as f64;
            sc += (k % det.cols) as f64;
        }
    }
    if count == 0 {
        return DiskFit {
            center_px: ((det.rows / 2) as f64, (det.cols / 2) as f64),
            radius_px: det.rows.min(det.cols) as f64 / 4.0,
            threshold: t,
            n_pixels: 0,
        };
    }
    DiskFit {
        center_px: (sr / count as f64, sc / count as f64),
        radius_px: (count as f64 / std::f64::consts::PI).sqrt(),
        threshold: t,
        n_pixels: count,
    }
}

/// Annulus mask `lo² ≤ |k − c|² ≤ hi²` (both bounds inclusive, f64).
pub fn annulus(det: Shape2, center: (f64, f64), lo: f64, hi: f64) -> Vec<bool> {
    (0..det.len())
        .map(|k| {
            let dr = (k / det.cols) as f64 - center.0;
            let dc = (k % det.cols) as f64 - center.1;
            let d2 = dr * dr + dc * dc;
            lo * lo <= d2 && d2 <= hi * hi
        })
        .collect()
}

/// Virtual image: per frame, the u64 sum of the pixels in `mask` (one entry per pixel).
pub fn virtual_image(data: &DenseArray, mask: &[bool]) -> Vec<u64> {
    if mask.is_empty() {
        return Vec::new();
    }
    dispatch!(data, masked_sums(mask))
}

/// BF and ADF images with the disk they were made from.
#[derive(Debug, Clone)]
pub struct BfAdf {
    /// The fitted disk.
    pub disk: DiskFit,
    /// BF `[0, r]`, one value per scan position.
    pub bf: Vec<u64>,
    /// ADF `[r, 2r]`.
    pub adf: Vec<u64>,
    /// Pixels in the BF and ADF masks.
    pub mask_pixels: (usize, usize),
}

/// Fit the disk on the mean DP and make the BF and ADF images.
pub fn bf_adf(data: &DenseArray, det: Shape2) -> BfAdf {
    let mean = mean_dp(data, det.len());
    let disk = fit_bf_disk(&mean, det);
    let r = disk.radius_px;
    let bf_mask = annulus(det, disk.center_px, 0.0, r);
    let adf_mask = annulus(det, disk.center_px, r, 2.0 * r);
    let count = |m: &[bool]| m.iter().filter(|&&b| b).count();
    BfAdf {
        disk,
        bf: virtual_image(data, &bf_mask),
        adf: virtual_image(data, &adf_mask),
        mask_pixels: (count(&bf_mask), count(&adf_mask)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_recovers_a_disk_and_masks_are_inclusive() {
        let det = Shape2::new(33, 40);
        let c = (15.0, 21.0);
        let mut frame = vec![0u16; det.len()];
        for (k, v) in frame.iter_mut().enumerate() {
            let d2 = ((k / det.cols) as f64 - c.0).powi(2) + ((k % det.cols) as f64 - c.1).powi(2);
            *v = if d2 <= 64.0 { 100 } else { 1 };
        }
        let data = DenseArray::U16([frame.clone(), frame].concat());
        let out = bf_adf(&data, det);
        assert_eq!(out.disk.center_px, c);
        assert!(
            (out.disk.radius_px - 8.0).abs() < 0.2,
            "{}",
            out.disk.radius_px
        );
        assert_eq!(out.bf.len(), 2);
        assert_eq!(out.bf[0], out.bf[1]);
        // A pixel at distance exactly 3 belongs to [0, 3] and [3, 6].
        let a = annulus(det, (0.0, 0.0), 0.0, 3.0);
        let b = annulus(det, (0.0, 0.0), 3.0, 6.0);
        assert!(a[3] && b[3] && a[3 * det.cols] && b[3 * det.cols]);
    }

    #[test]
    fn flat_pattern_falls_back_to_the_detector_centre() {
        let det = Shape2::new(8, 12);
        let fit = fit_bf_disk(&vec![1.0; det.len()], det);
        assert_eq!(fit.center_px, (4.0, 6.0));
        assert_eq!(fit.radius_px, 2.0);
        assert_eq!(fit.n_pixels, 0);
    }
}
