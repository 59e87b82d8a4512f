//! Summary statistics the tools print and record (benchmarks' p50/p90, image display limits).
//! One definition for all of them: numpy's default percentile (linear interpolation between
//! order statistics).

/// Percentile `q` (0–100) of `sorted` (ascending), interpolated linearly between the order
/// statistics around rank `q / 100 · (n − 1)`; NaN for no values.
pub fn percentile_sorted(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let pos = (q.clamp(0.0, 100.0) / 100.0) * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// Percentile `q` (0–100) of `values` in any order (NaNs sort last, as `f64::total_cmp` puts
/// positive NaNs); see [`percentile_sorted`].
pub fn percentile(values: &[f64], q: f64) -> f64 {
    let mut s = values.to_vec();
    s.sort_by(f64::total_cmp);
    percentile_sorted(&s, q)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_numpys_linear_percentile() {
        // numpy.percentile([3, 1, 4, 1, 5], q) for q = 0, 25, 50, 90, 100.
        let v = [3.0, 1.0, 4.0, 1.0, 5.0];
        let got: Vec<f64> = [0.0, 25.0, 50.0, 90.0, 100.0]
            .iter()
            .map(|&q| percentile(&v, q))
            .collect();
        assert_eq!(got, vec![1.0, 1.0, 3.0, 4.6, 5.0]);
        assert_eq!(percentile(&[2.0, 4.0], 50.0), 3.0);
        assert!(percentile(&[], 50.0).is_nan());
    }
}
