//! 8-bit grayscale PNG output of scan images.

use anyhow::Context;
use qem::Shape2;
use std::path::Path;

/// Summary statistics of an image, as written to reports.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ImageStats {
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
    /// Mean.
    pub mean: f64,
    /// Population standard deviation.
    pub std: f64,
    /// Lower display limit (0.5th percentile).
    pub p0_5: f64,
    /// Upper display limit (99.5th percentile).
    pub p99_5: f64,
}

/// Percentile `q` (0–100) of sorted values, linear interpolation between order statistics.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let pos = q / 100.0 * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// Statistics of `img`.
pub fn stats(img: &[f64]) -> ImageStats {
    let mut sorted: Vec<f64> = img.iter().copied().filter(|v| v.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len().max(1) as f64;
    let mean = sorted.iter().sum::<f64>() / n;
    let var = sorted.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    ImageStats {
        min: sorted.first().copied().unwrap_or(f64::NAN),
        max: sorted.last().copied().unwrap_or(f64::NAN),
        mean,
        std: var.sqrt(),
        p0_5: percentile(&sorted, 0.5),
        p99_5: percentile(&sorted, 99.5),
    }
}

/// Write `img` (`shape`, row-major) as an 8-bit grayscale PNG: linear between the 0.5 and 99.5
/// percentiles (equal limits give mid-grey), upscaled by an integer nearest-neighbour factor so
/// that the short side is at least 256 pixels. Returns the statistics and the factor.
pub fn write_png(path: &Path, img: &[f64], shape: Shape2) -> anyhow::Result<(ImageStats, usize)> {
    let st = stats(img);
    let (lo, hi) = (st.p0_5, st.p99_5);
    let to_u8 = |v: f64| -> u8 {
        if !v.is_finite() {
            return 0;
        }
        if hi > lo {
            ((v - lo) / (hi - lo) * 255.0).round().clamp(0.0, 255.0) as u8
        } else {
            128
        }
    };
    let short = shape.rows.min(shape.cols).max(1);
    let scale = 256usize.div_ceil(short).max(1);
    let (h, w) = (shape.rows * scale, shape.cols * scale);
    let mut pixels = Vec::with_capacity(h * w);
    for r in 0..h {
        for c in 0..w {
            pixels.push(to_u8(img[(r / scale) * shape.cols + c / scale]));
        }
    }
    let file = std::fs::File::create(path)
        .map_err(|e| qem::Error::io("write image", path, &e))
        .with_context(|| format!("cannot create {}", path.display()))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w as u32, h as u32);
    enc.set_color(png::ColorType::Grayscale);
    enc.set_depth(png::BitDepth::Eight);
    let mut writer = enc
        .write_header()
        .with_context(|| format!("cannot write {}", path.display()))?;
    writer
        .write_image_data(&pixels)
        .with_context(|| format!("cannot write {}", path.display()))?;
    writer
        .finish()
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok((st, scale))
}

/// Pearson correlation of two equally long images (NaN when either is constant).
pub fn correlation(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len().min(b.len()).max(1) as f64;
    let ma = a.iter().sum::<f64>() / n;
    let mb = b.iter().sum::<f64>() / n;
    let (mut sab, mut saa, mut sbb) = (0.0, 0.0, 0.0);
    for (x, y) in a.iter().zip(b) {
        sab += (x - ma) * (y - mb);
        saa += (x - ma).powi(2);
        sbb += (y - mb).powi(2);
    }
    sab / (saa * sbb).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_correlation() {
        let v: Vec<f64> = (0..=200).map(|i| i as f64).collect();
        let s = stats(&v);
        assert_eq!((s.min, s.max, s.mean), (0.0, 200.0, 100.0));
        assert!((s.p0_5 - 1.0).abs() < 1e-12 && (s.p99_5 - 199.0).abs() < 1e-12);
        let w: Vec<f64> = v.iter().map(|x| -2.0 * x + 1.0).collect();
        assert!((correlation(&v, &w) + 1.0).abs() < 1e-12);
    }

    #[test]
    fn png_is_upscaled_to_256() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let p = dir.path().join("x.png");
        let img: Vec<f64> = (0..48 * 40).map(|i| (i % 7) as f64).collect();
        let (_, scale) = write_png(&p, &img, Shape2::new(48, 40)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(scale, 7); // 40 * 7 = 280 >= 256
        let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&bytes[1..4], b"PNG");
    }
}
