//! Statistics of scan images and what the PNG writer (`output.rs`) draws beside them: nice
//! numbers for scale bars and colour-bar ticks, their labels, and a small bitmap font.

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

/// The largest 1, 2 or 5 × 10ⁿ that is at most `target` (`target` > 0, finite).
pub fn nice_floor(target: f64) -> f64 {
    let e = target.log10().floor();
    let base = 10f64.powf(e);
    for m in [5.0, 2.0, 1.0] {
        if m * base <= target * (1.0 + 1e-9) {
            return m * base;
        }
    }
    base / 2.0
}

/// A scale bar for an axis of `n` samples `scale` `unit` apart: the largest 1/2/5 × 10ⁿ that
/// spans at most a fifth of the axis (at most one sample when a sample is longer). Returns
/// the length in `unit`, its length in samples (`length / scale`, to be drawn as
/// `round(samples · zoom)` pixels) and the label (Å from 10 Å on written in nm). The Python
/// package's `quantem.gpu.results.nice_scale_bar` follows the same rule.
pub fn scale_bar(scale: f64, unit: &str, n: usize) -> Option<(f64, f64, String)> {
    if !(scale.is_finite() && scale > 0.0 && n > 0) {
        return None;
    }
    let target = (0.2 * n as f64 * scale).max(scale);
    let length = nice_floor(target);
    let label = if unit == "Å" && length >= 10.0 {
        format!("{} nm", short_number(length / 10.0))
    } else {
        format!("{} {unit}", short_number(length))
    };
    Some((length, length / scale, label))
}

/// Colour-bar ticks: multiples of a 1/2/5 × 10ⁿ step inside `[lo, hi]`, about four of them
/// (empty when the range is empty or not finite).
pub fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    if !(lo.is_finite() && hi.is_finite() && hi > lo) {
        return Vec::new();
    }
    let step = nice_floor((hi - lo) / 3.0);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    (first..=last)
        .map(|i| i as f64 * step)
        .map(|v| if v.abs() < step * 1e-9 { 0.0 } else { v })
        .collect()
}

/// A number in at most [`LABEL_CHARS`] characters: plain decimals from 1e-3 to below 1e5,
/// else `1.5e6`-style.
pub fn short_number(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let a = v.abs();
    let text = if (1e-3..1e5).contains(&a) {
        let mut t = format!("{v:.4}");
        if t.contains('.') {
            while t.ends_with('0') {
                t.pop();
            }
            if t.ends_with('.') {
                t.pop();
            }
        }
        t
    } else {
        let e = a.log10().floor() as i32;
        let m = v / 10f64.powi(e);
        let mut mt = format!("{m:.1}");
        if mt.ends_with(".0") {
            mt.truncate(mt.len() - 2);
        }
        format!("{mt}e{e}")
    };
    text.chars().take(LABEL_CHARS).collect()
}

/// Longest tick label, characters.
pub const LABEL_CHARS: usize = 7;

/// Glyph cell of the bitmap font: 5 × 7 dots, advanced by 6.
pub const GLYPH_W: usize = 5;
/// Height of a glyph, dots.
pub const GLYPH_H: usize = 7;

/// Rows of a 5 × 7 glyph (bit 4 = leftmost dot) for the characters labels use; `?` else.
fn glyph(c: char) -> [u8; GLYPH_H] {
    match c {
        '0' => [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E],
        '1' => [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E],
        '2' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F],
        '3' => [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E],
        '4' => [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02],
        '5' => [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E],
        '6' => [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E],
        '7' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E],
        '9' => [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C],
        '.' => [0, 0, 0, 0, 0, 0x0C, 0x0C],
        '-' => [0, 0, 0, 0x1F, 0, 0, 0],
        '+' => [0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0],
        'e' => [0, 0, 0x0E, 0x11, 0x1F, 0x10, 0x0E],
        'n' => [0, 0, 0x16, 0x19, 0x11, 0x11, 0x11],
        'm' => [0, 0, 0x1A, 0x15, 0x15, 0x11, 0x11],
        'r' => [0, 0, 0x16, 0x19, 0x10, 0x10, 0x10],
        'a' => [0, 0, 0x0E, 0x01, 0x0F, 0x11, 0x0F],
        'd' => [0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F],
        'p' => [0, 0, 0x1E, 0x11, 0x1E, 0x10, 0x10],
        'x' => [0, 0, 0x11, 0x0A, 0x04, 0x0A, 0x11],
        'c' => [0, 0, 0x0E, 0x10, 0x10, 0x11, 0x0E],
        'o' => [0, 0, 0x0E, 0x11, 0x11, 0x11, 0x0E],
        'u' => [0, 0, 0x11, 0x11, 0x11, 0x13, 0x0D],
        't' => [0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06],
        's' => [0, 0, 0x0E, 0x10, 0x0E, 0x01, 0x1E],
        'Å' => [0x04, 0x0A, 0x04, 0x0E, 0x11, 0x1F, 0x11],
        ' ' => [0; GLYPH_H],
        _ => [0x0E, 0x11, 0x01, 0x02, 0x04, 0, 0x04],
    }
}

/// An 8-bit grey canvas the annotations are drawn on.
pub struct Canvas {
    /// Width, pixels.
    pub w: usize,
    /// Height, pixels.
    pub h: usize,
    /// Row-major grey levels.
    pub px: Vec<u8>,
}

impl Canvas {
    /// A black canvas.
    pub fn new(w: usize, h: usize) -> Self {
        Canvas {
            w,
            h,
            px: vec![0; w * h],
        }
    }

    /// Fill the rectangle at `(x, y)` of `w × h` with `level` (clipped to the canvas).
    pub fn fill(&mut self, x: usize, y: usize, w: usize, h: usize, level: u8) {
        for r in y..(y + h).min(self.h) {
            let row = &mut self.px[r * self.w..(r + 1) * self.w];
            for p in row.iter_mut().take((x + w).min(self.w)).skip(x) {
                *p = level;
            }
        }
    }

    /// Draw `text` with its top-left corner at `(x, y)`, each font dot `zoom × zoom` pixels;
    /// returns the x after the last glyph.
    pub fn text(&mut self, x: usize, y: usize, text: &str, zoom: usize, level: u8) -> usize {
        let mut cx = x;
        for ch in text.chars() {
            for (r, bits) in glyph(ch).iter().enumerate() {
                for c in 0..GLYPH_W {
                    if bits & (0x10 >> c) != 0 {
                        self.fill(cx + c * zoom, y + r * zoom, zoom, zoom, level);
                    }
                }
            }
            cx += (GLYPH_W + 1) * zoom;
        }
        cx
    }
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
    fn nice_numbers_bars_and_ticks() {
        assert_eq!(nice_floor(7.3), 5.0);
        assert_eq!(nice_floor(0.031), 0.02);
        assert_eq!(nice_floor(100.0), 100.0);
        // 64 samples of 0.25 Å: a fifth is 3.2 Å -> 2 Å = 8 samples.
        assert_eq!(scale_bar(0.25, "Å", 64), Some((2.0, 8.0, "2 Å".into())));
        // 256 samples of 0.5 Å: 25.6 Å -> 20 Å written as 2 nm, 40 samples.
        assert_eq!(scale_bar(0.5, "Å", 256), Some((20.0, 40.0, "2 nm".into())));
        assert_eq!(scale_bar(1.0, "px", 48), Some((5.0, 5.0, "5 px".into())));
        // A sample longer than a fifth of the axis: 2 Å of a 3 Å step, two thirds of a sample.
        assert_eq!(scale_bar(3.0, "Å", 2), Some((2.0, 2.0 / 3.0, "2 Å".into())));
        assert_eq!(scale_bar(0.0, "px", 48), None);
        assert_eq!(ticks(0.0, 10.0), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(ticks(-0.3, 0.3), vec![-0.2, 0.0, 0.2]);
        assert!(ticks(1.0, 1.0).is_empty());
        assert_eq!(short_number(65535.0), "65535");
        assert_eq!(short_number(0.0025), "0.0025");
        assert_eq!(short_number(1.5e6), "1.5e6");
        assert_eq!(short_number(-2.0e-7), "-2e-7");
        assert_eq!(short_number(0.2 + 0.1), "0.3");
    }

    #[test]
    fn text_draws_its_dots_inside_the_advance() {
        let mut c = Canvas::new(40, 10);
        let end = c.text(1, 1, "1-", 1, 255);
        assert_eq!(end, 1 + 2 * (GLYPH_W + 1));
        // '1' has its stem at column 2 of the glyph: rows 1..=7 are lit there.
        for r in 1..8 {
            assert_eq!(c.px[r * 40 + 3], 255, "row {r}");
        }
        // '-' is the middle row only.
        assert_eq!(c.px[4 * 40 + 7..4 * 40 + 12], [255; 5]);
        assert_eq!(c.px[3 * 40 + 7..3 * 40 + 12], [0; 5]);
        assert!(c.px[..40].iter().all(|&p| p == 0), "row 0 untouched");
    }
}
