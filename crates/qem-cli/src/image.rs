//! Statistics of scan images (the PNG writer with its scale bar is `output.rs`).

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
        p0_5: qem::stats::percentile_sorted(&sorted, 0.5),
        p99_5: qem::stats::percentile_sorted(&sorted, 99.5),
    }
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
}
