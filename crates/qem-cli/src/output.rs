//! Files the `products`, `dpc` and `demo` commands write: NumPy `.npy` arrays (format v1.0)
//! and grey-level PNGs with a colour bar (tick labels in the displayed values) on the right
//! and a scale bar (Å/nm, mrad or samples) in a strip below; the image's own pixels are
//! never drawn over.
//!
//! The NPY writer is the small subset of the format (`numpy.lib.format`, version 1.0) that
//! these arrays need: little-endian unsigned integers and floats, C order, any shape. The
//! header is padded to a multiple of 64 bytes, as NumPy writes it, so `np.load` memory-maps it.

use crate::image::{scale_bar, short_number, stats, ticks, Canvas, ImageStats, GLYPH_H};
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
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Display {
    /// Value shown black (bottom of the bar), in the displayed scale.
    pub lo: f64,
    /// Value shown white (top of the bar), in the displayed scale.
    pub hi: f64,
    /// `"linear"` or `"log1p"` (`ln(1 + v)` of the values).
    pub scale: &'static str,
    /// Nearest-neighbour upscaling factor of the image.
    pub upscale: usize,
    /// The scale bar drawn below the image.
    pub scale_bar: ScaleBar,
    /// Values of the colour bar's ticks (raw values: for `log1p`, before the logarithm).
    pub ticks: Vec<f64>,
}

/// The scale bar under a PNG.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ScaleBar {
    /// Length in `unit`.
    pub length: f64,
    /// `"Å"`, `"mrad"` or `"px"` (samples of the array, when the calibration is unknown).
    pub unit: String,
    /// Length in samples of the array (`length / step`, before upscaling).
    pub samples: f64,
    /// Length drawn, output pixels (`samples × upscale`, rounded).
    pub pixels: usize,
    /// The label drawn beside it.
    pub label: String,
}

/// The sampling of an image's axes, for its scale bar: `size` `unit` per sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling<'a> {
    /// Step between samples (both axes), in `unit`.
    pub size: f64,
    /// `"Å"`, `"mrad"` or `"px"`.
    pub unit: &'a str,
}

impl Sampling<'static> {
    /// No calibration: the bar counts samples.
    pub const PIXELS: Sampling<'static> = Sampling {
        size: 1.0,
        unit: "px",
    };
}

/// Width of the colour bar and of the gap before it, output pixels.
const BAR_WIDTH: usize = 16;
const BAR_GAP: usize = 8;
/// Tick marks, the gap before their labels, and the labels' zoom (font dots → pixels).
const TICK_LEN: usize = 4;
const LABEL_GAP: usize = 4;
const ZOOM: usize = 2;
/// Width right of the image: gap, bar, tick, gap, labels of `LABEL_CHARS`, margin.
pub const RIGHT_MARGIN: usize = BAR_GAP
    + BAR_WIDTH
    + TICK_LEN
    + LABEL_GAP
    + crate::image::LABEL_CHARS * (crate::image::GLYPH_W + 1) * ZOOM
    + 4;
/// Height of the strip below the image that holds the scale bar and its label.
pub const BOTTOM_STRIP: usize = 32;

/// Write `img` (`shape`, row-major) as an 8-bit grey PNG with a colour bar and pixel scale
/// bar: [`write_png_annotated`] with [`Sampling::PIXELS`].
#[cfg(test)]
pub fn write_png_with_bar(
    path: &Path,
    img: &[f64],
    shape: Shape2,
    log: bool,
) -> anyhow::Result<(ImageStats, Display)> {
    write_png_annotated(path, img, shape, log, Sampling::PIXELS)
}

/// Write `img` (`shape`, row-major) as an 8-bit grey PNG: the image upscaled so that its
/// short side is at least 256 pixels, grey linear between the 0.5 and 99.5 percentiles of the
/// values (of `ln(1 + v)` when `log`); on its right a colour bar (white = `hi` at the top,
/// black = `lo` at the bottom) with tick marks and labels in raw values; below it a strip
/// with a scale bar of `sampling`'s unit (1/2/5 × 10ⁿ, at most a fifth of the width). The
/// image's pixels are only the image. Returns the statistics of the raw values and the
/// display mapping.
pub fn write_png_annotated(
    path: &Path,
    img: &[f64],
    shape: Shape2,
    log: bool,
    sampling: Sampling<'_>,
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
    let (h_img, w_img) = (shape.rows * scale, shape.cols * scale);
    let mut canvas = Canvas::new(w_img + RIGHT_MARGIN, h_img + BOTTOM_STRIP);
    let w = canvas.w;
    for r in 0..h_img {
        let line = &mut canvas.px[r * w..(r + 1) * w];
        for (c, px) in line[..w_img].iter_mut().enumerate() {
            *px = to_u8(shown[(r / scale) * shape.cols + c / scale]);
        }
        // The gap stays black; the bar runs from white (top) to black (bottom).
        let level = if h_img > 1 {
            255.0 * (1.0 - r as f64 / (h_img - 1) as f64)
        } else {
            128.0
        };
        line[w_img + BAR_GAP..w_img + BAR_GAP + BAR_WIDTH].fill(level.round() as u8);
    }
    let ticks = draw_ticks(&mut canvas, w_img, h_img, lo, hi, log);
    let scale_bar = draw_scale_bar(&mut canvas, w_img, h_img, shape.cols, scale, sampling);
    let file = std::fs::File::create(path)
        .map_err(|e| qem::Error::io("write image", path, &e))
        .with_context(|| format!("cannot create {}", path.display()))?;
    let mut enc = png::Encoder::new(
        std::io::BufWriter::new(file),
        canvas.w as u32,
        canvas.h as u32,
    );
    enc.set_color(png::ColorType::Grayscale);
    enc.set_depth(png::BitDepth::Eight);
    let mut writer = enc
        .write_header()
        .with_context(|| format!("cannot write {}", path.display()))?;
    writer
        .write_image_data(&canvas.px)
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
            scale_bar,
            ticks,
        },
    ))
}

/// Tick marks and labels right of the colour bar (rows `0..h_img`, `lo` at the bottom);
/// returns the ticks' raw values. With `log` the bar is linear in `ln(1 + v)` and the ticks
/// are nice raw values mapped through it.
fn draw_ticks(c: &mut Canvas, w_img: usize, h_img: usize, lo: f64, hi: f64, log: bool) -> Vec<f64> {
    let raw: Vec<f64> = if log {
        ticks(lo.exp_m1(), hi.exp_m1())
            .into_iter()
            .filter(|v| *v >= 0.0)
            .collect()
    } else {
        ticks(lo, hi)
    };
    let x_tick = w_img + BAR_GAP + BAR_WIDTH;
    let text_h = GLYPH_H * ZOOM;
    let mut drawn = Vec::new();
    let mut last_y: Option<usize> = None;
    for &v in &raw {
        let shown = if log { v.ln_1p() } else { v };
        let f = (shown - lo) / (hi - lo);
        if !(0.0..=1.0).contains(&f) || h_img < 2 {
            continue;
        }
        let y = ((1.0 - f) * (h_img - 1) as f64).round() as usize;
        // Labels may not overlap: skip a tick too close to the last one drawn.
        if last_y.is_some_and(|ly: usize| ly.abs_diff(y) < text_h + 2) {
            continue;
        }
        c.fill(x_tick, y.saturating_sub(1), TICK_LEN, 2, 255);
        let ty = y.saturating_sub(text_h / 2).min(c.h - text_h);
        c.text(
            x_tick + TICK_LEN + LABEL_GAP,
            ty,
            &short_number(v),
            ZOOM,
            255,
        );
        last_y = Some(y);
        drawn.push(v);
    }
    drawn
}

/// The scale bar in the strip below the image (`cols` samples, each `upscale` pixels).
fn draw_scale_bar(
    c: &mut Canvas,
    w_img: usize,
    h_img: usize,
    cols: usize,
    upscale: usize,
    sampling: Sampling<'_>,
) -> ScaleBar {
    let (length, samples, label) = scale_bar(sampling.size, sampling.unit, cols)
        .or_else(|| scale_bar(1.0, "px", cols))
        .unwrap_or((1.0, 1.0, "1 px".into()));
    let unit = if sampling.size.is_finite() && sampling.size > 0.0 {
        sampling.unit
    } else {
        "px"
    };
    let len_px = ((samples * upscale as f64).round() as usize).clamp(1, w_img);
    let y = h_img + BOTTOM_STRIP / 2;
    c.fill(8, y - 2, len_px, 5, 255);
    let ty = y - GLYPH_H * ZOOM / 2;
    c.text(8 + len_px + 8, ty, &label, ZOOM, 255);
    ScaleBar {
        length,
        unit: unit.to_string(),
        samples,
        pixels: len_px,
        label,
    }
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

    fn read_png(p: &Path) -> (usize, usize, Vec<u8>) {
        let dec = png::Decoder::new(std::io::BufReader::new(
            std::fs::File::open(p).unwrap_or_else(|e| panic!("{e}")),
        ));
        let mut r = dec.read_info().unwrap_or_else(|e| panic!("{e}"));
        let mut buf = vec![0; r.output_buffer_size().unwrap_or_else(|| panic!("png size"))];
        let info = r.next_frame(&mut buf).unwrap_or_else(|e| panic!("{e}"));
        buf.truncate(info.buffer_size());
        (info.width as usize, info.height as usize, buf)
    }

    #[test]
    fn png_has_the_bars_beside_the_untouched_image() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let p = dir.path().join("x.png");
        let img: Vec<f64> = (0..12).map(f64::from).collect();
        let (st, d) = write_png_with_bar(&p, &img, Shape2::new(3, 4), false)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(st.max, 11.0);
        assert_eq!(d.upscale, 86);
        let (w, h, px) = read_png(&p);
        assert_eq!(w, 4 * 86 + RIGHT_MARGIN);
        assert_eq!(h, 3 * 86 + BOTTOM_STRIP);
        // The image region holds exactly the upscaled grey levels (nothing drawn over it).
        let (lo, hi) = (d.lo, d.hi);
        for r in 0..3 * 86 {
            for c in 0..4 * 86 {
                let v = img[(r / 86) * 4 + c / 86];
                let want = ((v - lo) / (hi - lo) * 255.0).round().clamp(0.0, 255.0) as u8;
                assert_eq!(px[r * w + c], want, "({r}, {c})");
            }
        }
        // The colour bar: white at the top, black at the bottom.
        let bar_x = 4 * 86 + BAR_GAP + 1;
        assert_eq!(px[bar_x], 255);
        assert_eq!(px[(3 * 86 - 1) * w + bar_x], 0);
        // Ticks at 2, 4, ..., 10 inside [0.055, 10.945] with labels (white pixels) right of it.
        assert_eq!(d.ticks, vec![2.0, 4.0, 6.0, 8.0, 10.0]);
        let label_x = 4 * 86 + BAR_GAP + BAR_WIDTH + TICK_LEN + LABEL_GAP;
        assert!((0..3 * 86).any(|r| px[r * w + label_x..(r + 1) * w].contains(&255)));
        // The scale bar: a fifth of 4 samples is 0.8, so one sample ("1 px") = 86 white
        // pixels in the strip's middle row, starting at x = 8.
        assert_eq!((d.scale_bar.samples, d.scale_bar.pixels), (1.0, 86));
        assert_eq!(d.scale_bar.label, "1 px");
        let y = 3 * 86 + BOTTOM_STRIP / 2;
        assert!(px[y * w + 8..y * w + 8 + 86].iter().all(|&v| v == 255));
        assert_eq!(px[y * w + 7], 0);
        assert_eq!(px[y * w + 8 + 86], 0);
        assert!(write_png_with_bar(&p, &img, Shape2::new(2, 2), false).is_err());
        // The short side reaches 256 pixels: 40 * 7 = 280.
        let img: Vec<f64> = (0..48 * 40).map(|i| f64::from(i % 7)).collect();
        let (_, d) = write_png_with_bar(&p, &img, Shape2::new(48, 40), true)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((d.upscale, d.scale), (7, "log1p"));
        // log1p ticks are raw values mapped through ln(1 + v).
        assert!(d
            .ticks
            .iter()
            .all(|&t| t.ln_1p() >= d.lo && t.ln_1p() <= d.hi));
    }

    #[test]
    fn scale_bar_in_angstrom_and_mrad() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let p = dir.path().join("x.png");
        let img: Vec<f64> = (0..64 * 64).map(|i| f64::from(i % 13)).collect();
        let s = Sampling {
            size: 0.25,
            unit: "Å",
        };
        let (_, d) = write_png_annotated(&p, &img, Shape2::new(64, 64), false, s)
            .unwrap_or_else(|e| panic!("{e}"));
        // A fifth of 16 Å is 3.2 Å: 2 Å = 8 samples = 32 pixels at 4x.
        assert_eq!(d.upscale, 4);
        assert_eq!((d.scale_bar.length, d.scale_bar.samples), (2.0, 8.0));
        assert_eq!(d.scale_bar.pixels, 32);
        assert_eq!(d.scale_bar.label, "2 Å");
        let (w, _, px) = read_png(&p);
        let y = 64 * 4 + BOTTOM_STRIP / 2;
        assert!(px[y * w + 8..y * w + 8 + 32].iter().all(|&v| v == 255));
        assert_eq!(px[y * w + 8 + 32], 0);
        let s = Sampling {
            size: 0.9,
            unit: "mrad",
        };
        let (_, d) = write_png_annotated(&p, &img, Shape2::new(64, 64), false, s)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(d.scale_bar.label, "10 mrad");
        // 10 / 0.9 = 11.1 samples, 44.4 pixels at 4x: 44 drawn.
        assert_eq!(d.scale_bar.pixels, 44);
        let (_, _, px) = read_png(&p);
        assert!(px[y * w + 8..y * w + 8 + 44].iter().all(|&v| v == 255));
        assert_eq!(px[y * w + 8 + 44], 0);
        let json = serde_json::to_value(&d).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(json["scale_bar"]["unit"], "mrad");
    }
}
