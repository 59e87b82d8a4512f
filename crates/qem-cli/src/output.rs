//! Files the `products`, `dpc` and `demo` commands write: NumPy `.npy` arrays (format v1.0)
//! and grey-level PNGs with a vertical scale bar.
//!
//! The NPY writer is the small subset of the format (`numpy.lib.format`, version 1.0) that
//! these arrays need: little-endian unsigned integers and floats, C order, any shape. The
//! header is padded to a multiple of 64 bytes, as NumPy writes it, so `np.load` memory-maps it.

use crate::image::{stats, ImageStats};
use anyhow::Context;
use qem::Shape2;
use std::path::Path;

/// Write `value` to `path` as pretty JSON and a newline (`what` says what the file is, for the
/// error); returns the text written.
pub fn write_json(path: &Path, value: &serde_json::Value, what: &str) -> anyhow::Result<String> {
    let text = format!("{}\n", serde_json::to_string_pretty(value)?);
    std::fs::write(path, &text).map_err(|e| qem::Error::io(what, path, &e))?;
    Ok(text)
}

/// An element type the NPY writer knows.
pub trait NpyElem: Copy + npyz::AutoSerialize {
    /// NumPy's `descr` string (`"<u8"`, `"<f4"`, ...).
    const DESCR: &'static str;
}

macro_rules! npy_elem {
    ($t:ty, $descr:expr) => {
        impl NpyElem for $t {
            const DESCR: &'static str = $descr;
        }
    };
}

npy_elem!(u8, "|u1");
npy_elem!(u16, "<u2");
npy_elem!(u32, "<u4");
npy_elem!(u64, "<u8");
npy_elem!(f32, "<f4");
npy_elem!(f64, "<f8");

/// The bytes of an NPY file holding `data` with `shape` (C order), written by the `npyz` crate.
pub fn npy_bytes<T: NpyElem>(data: &[T], shape: &[usize]) -> anyhow::Result<Vec<u8>> {
    let n: usize = shape.iter().product();
    anyhow::ensure!(
        n == data.len(),
        "npy: shape {shape:?} holds {n} values but {} were given",
        data.len()
    );
    use npyz::WriterBuilder;
    let dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    let mut out = Vec::with_capacity(128 + std::mem::size_of_val(data));
    let mut w = npyz::WriteOptions::<T>::new()
        .default_dtype()
        .shape(&dims)
        .writer(&mut out)
        .begin_nd()
        .context("npy header")?;
    w.extend(data.iter().copied()).context("npy data")?;
    w.finish().context("npy data")?;
    Ok(out)
}

/// Write `data` with `shape` as an NPY file.
pub fn write_npy<T: NpyElem>(path: &Path, data: &[T], shape: &[usize]) -> anyhow::Result<()> {
    let bytes = npy_bytes(data, shape)?;
    std::fs::write(path, bytes)
        .map_err(|e| qem::Error::io("write array", path, &e))
        .with_context(|| format!("cannot write {}", path.display()))
}

/// How an image was mapped to grey levels, for the JSON next to it.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Display {
    /// Value shown black (bottom of the bar), in the displayed scale.
    pub lo: f64,
    /// Value shown white (top of the bar), in the displayed scale.
    pub hi: f64,
    /// `"linear"` or `"log1p"` (`ln(1 + v)` of the values).
    pub scale: &'static str,
    /// Nearest-neighbour upscaling factor of the image.
    pub upscale: usize,
}

/// Width of the scale bar and of the gap before it, output pixels.
const BAR_WIDTH: usize = 16;
const BAR_GAP: usize = 8;

/// Write `img` (`shape`, row-major) as an 8-bit grey PNG with a vertical scale bar on its
/// right (white = `hi` at the top, black = `lo` at the bottom): linear between the 0.5 and
/// 99.5 percentiles of the values (of `ln(1 + v)` when `log`), upscaled so that the short side
/// is at least 256 pixels. Returns the statistics of the raw values and the display mapping.
pub fn write_png_with_bar(
    path: &Path,
    img: &[f64],
    shape: Shape2,
    log: bool,
) -> anyhow::Result<(ImageStats, Display)> {
    anyhow::ensure!(
        img.len() == shape.len() && !img.is_empty(),
        "image of {} values does not fit {shape}",
        img.len()
    );
    let raw_stats = stats(img);
    let shown: Vec<f64> = if log {
        img.iter().map(|&v| v.max(0.0).ln_1p()).collect()
    } else {
        img.to_vec()
    };
    let st = stats(&shown);
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
    let (h, w_img) = (shape.rows * scale, shape.cols * scale);
    let w = w_img + BAR_GAP + BAR_WIDTH;
    let mut pixels = vec![0u8; h * w];
    for r in 0..h {
        let line = &mut pixels[r * w..(r + 1) * w];
        for (c, px) in line[..w_img].iter_mut().enumerate() {
            *px = to_u8(shown[(r / scale) * shape.cols + c / scale]);
        }
        // The gap stays black; the bar runs from white (top) to black (bottom).
        let level = if h > 1 {
            255.0 * (1.0 - r as f64 / (h - 1) as f64)
        } else {
            128.0
        };
        line[w_img + BAR_GAP..].fill(level.round() as u8);
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
    Ok((
        raw_stats,
        Display {
            lo,
            hi,
            scale: if log { "log1p" } else { "linear" },
            upscale: scale,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_header_is_padded_and_parsable() {
        let b = npy_bytes(&[1u64, 2, 3, 4, 5, 6], &[2, 3]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&b[..6], b"\x93NUMPY");
        let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
        assert_eq!((10 + hl) % 16, 0, "the data starts aligned");
        let header = std::str::from_utf8(&b[10..10 + hl]).unwrap_or_else(|e| panic!("{e}"));
        let compact: String = header.chars().filter(|c| !c.is_whitespace()).collect();
        // A trailing comma in the shape tuple is valid Python (npyz writes `(2, 3, )`).
        let compact = compact.replace(",)", ")");
        for part in ["'descr':'<u8'", "'fortran_order':False", "'shape':(2,3)"] {
            assert!(compact.contains(part), "{part} in {header:?}");
        }
        assert!(header.ends_with('\n'));
        assert_eq!(b.len(), 10 + hl + 48);
        assert_eq!(&b[10 + hl..10 + hl + 8], &1u64.to_le_bytes());
        assert_eq!(&b[b.len() - 8..], &6u64.to_le_bytes());
        let one = npy_bytes(&[1.5f32], &[1]).unwrap_or_else(|e| panic!("{e}"));
        let hl = u16::from_le_bytes([one[8], one[9]]) as usize;
        let h: String = std::str::from_utf8(&one[10..10 + hl])
            .unwrap_or_else(|e| panic!("{e}"))
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        assert!(
            h.contains("'shape':(1,") && h.contains("'descr':'<f4'"),
            "{h}"
        );
        assert!(npy_bytes(&[1.0f64; 3], &[2, 2]).is_err());
    }

    #[test]
    fn png_has_the_bar_on_the_right() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let p = dir.path().join("x.png");
        let img: Vec<f64> = (0..12).map(f64::from).collect();
        let (st, d) = write_png_with_bar(&p, &img, Shape2::new(3, 4), false)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(st.max, 11.0);
        assert_eq!(d.upscale, 86);
        let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{e}"));
        let be =
            |i: usize| u32::from_be_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        assert_eq!(be(16) as usize, 4 * 86 + BAR_GAP + BAR_WIDTH);
        assert_eq!(be(20) as usize, 3 * 86);
        assert!(write_png_with_bar(&p, &img, Shape2::new(2, 2), false).is_err());
        // The short side reaches 256 pixels: 40 * 7 = 280.
        let img: Vec<f64> = (0..48 * 40).map(|i| f64::from(i % 7)).collect();
        let (_, d) = write_png_with_bar(&p, &img, Shape2::new(48, 40), true)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((d.upscale, d.scale), (7, "log1p"));
    }
}
