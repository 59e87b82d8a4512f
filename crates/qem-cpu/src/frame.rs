//! One frame through the load plan: mask → detector region → binning → result dtype.
//!
//! The order is fixed and documented: bad pixels read 0 *before* any cropping, binning or
//! narrowing; binning sums in u64 over the pixels that exist (incomplete edge blocks are kept, so
//! the output extent is the ceiling); the u64 value is then stored in the result dtype, either
//! exactly (an overflow is an error naming the pixel) or, on an explicit `u8` request, saturated
//! at 255 with the number of clipped values counted.

use qem_core::{DType, DetectorPlan, Error, Region, Result, Shape2};

/// One source frame, row-major, in its source dtype.
#[derive(Debug, Clone, Copy)]
pub enum SrcFrame<'a> {
    /// 8-bit counts.
    U8(&'a [u8]),
    /// 16-bit counts.
    U16(&'a [u16]),
    /// 32-bit counts.
    U32(&'a [u32]),
}

impl SrcFrame<'_> {
    fn len(&self) -> usize {
        match self {
            SrcFrame::U8(s) => s.len(),
            SrcFrame::U16(s) => s.len(),
            SrcFrame::U32(s) => s.len(),
        }
    }
}

/// A value that does not fit the result dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PixelOverflow {
    /// Output pixel `(row, col)` in the result frame.
    pub pixel: (usize, usize),
    /// The value (after masking and binning).
    pub value: u64,
}

/// An element type results can be stored in.
pub trait OutElem: bytemuck::Pod + Send + Sync + Default + 'static {
    /// Largest value.
    const MAX: u64;
    /// Convert a value known to be `<= MAX`.
    fn from_u64(v: u64) -> Self;
}

impl OutElem for u8 {
    const MAX: u64 = u8::MAX as u64;
    fn from_u64(v: u64) -> Self {
        v as u8
    }
}
impl OutElem for u16 {
    const MAX: u64 = u16::MAX as u64;
    fn from_u64(v: u64) -> Self {
        v as u16
    }
}
impl OutElem for u32 {
    const MAX: u64 = u32::MAX as u64;
    fn from_u64(v: u64) -> Self {
        v as u32
    }
}

trait SrcElem: Copy + Send + Sync {
    const MAX: u64;
    fn get(self) -> u64;
}
impl SrcElem for u8 {
    const MAX: u64 = u8::MAX as u64;
    fn get(self) -> u64 {
        self as u64
    }
}
impl SrcElem for u16 {
    const MAX: u64 = u16::MAX as u64;
    fn get(self) -> u64 {
        self as u64
    }
}
impl SrcElem for u32 {
    const MAX: u64 = u32::MAX as u64;
    fn get(self) -> u64 {
        self as u64
    }
}

/// How a source frame becomes a result frame.
#[derive(Debug, Clone)]
pub struct FramePlan {
    source_detector: Shape2,
    region: Region,
    bin: usize,
    output: Shape2,
    result_dtype: DType,
    saturate: bool,
    /// Flat source indices of bad pixels, sorted.
    bad: Vec<usize>,
    /// `bad` as a lookup table (empty when there are no bad pixels).
    bad_lookup: Vec<bool>,
}

impl FramePlan {
    /// The detector geometry (source, region, bin, output), for an engine that transforms
    /// frames itself (CUDA).
    pub fn detector(&self) -> DetectorPlan {
        DetectorPlan {
            source: self.source_detector,
            region: self.region,
            bin: self.bin,
            output: self.output,
        }
    }

    /// Plan for frames of `source_detector` pixels.
    ///
    /// `detector_region` is half-open in source pixels (`None` = whole frame); `det_bin >= 1`;
    /// `saturate` clips to the result dtype instead of failing (only meaningful for u8);
    /// `bad_mask` (source-sized, true = bad) zeroes those pixels first.
    pub fn new(
        source_detector: Shape2,
        detector_region: Option<Region>,
        det_bin: usize,
        result_dtype: DType,
        saturate: bool,
        bad_mask: Option<&[bool]>,
    ) -> Result<FramePlan> {
        let geometry = DetectorPlan::new(source_detector, detector_region, det_bin)?;
        FramePlan::with_geometry(geometry, result_dtype, saturate, bad_mask)
    }

    /// Plan from a detector geometry already validated ([`DetectorPlan::new`], the one place
    /// regions and bins are checked for both engines).
    pub fn with_geometry(
        geometry: DetectorPlan,
        result_dtype: DType,
        saturate: bool,
        bad_mask: Option<&[bool]>,
    ) -> Result<FramePlan> {
        let DetectorPlan {
            source: source_detector,
            region,
            bin: det_bin,
            output,
        } = geometry;
        let (bad, bad_lookup) = match bad_mask {
            Some(m) => {
                if m.len() != source_detector.len() {
                    return Err(Error::internal(
                        "load",
                        format!(
                            "bad-pixel mask has {} entries for a {} detector",
                            m.len(),
                            source_detector
                        ),
                    ));
                }
                let bad: Vec<usize> = m
                    .iter()
                    .enumerate()
                    .filter_map(|(i, &b)| b.then_some(i))
                    .collect();
                let lookup = if bad.is_empty() {
                    Vec::new()
                } else {
                    m.to_vec()
                };
                (bad, lookup)
            }
            None => (Vec::new(), Vec::new()),
        };
        Ok(FramePlan {
            source_detector,
            region,
            bin: det_bin,
            output,
            result_dtype,
            saturate,
            bad,
            bad_lookup,
        })
    }

    /// Shape of one result frame.
    pub fn output_shape(&self) -> Shape2 {
        self.output
    }
    /// Elements in one result frame.
    pub fn output_len(&self) -> usize {
        self.output.len()
    }
    /// Result dtype.
    pub fn result_dtype(&self) -> DType {
        self.result_dtype
    }
    /// Number of bad pixels zeroed in every frame.
    pub fn bad_pixel_count(&self) -> usize {
        self.bad.len()
    }
    /// Elements of one source frame.
    pub fn source_len(&self) -> usize {
        self.source_detector.len()
    }

    /// True when a frame of `source` dtype passes through unchanged except for bad pixels
    /// (whole detector, no binning, same dtype): the engine can then decode straight into the
    /// result and call [`FramePlan::zero_bad_pixels`].
    pub fn is_passthrough(&self, source: DType) -> bool {
        self.bin == 1 && self.region.is_full(self.source_detector) && self.result_dtype == source
    }

    /// Zero the bad pixels of a result frame of a pass-through plan.
    pub fn zero_bad_pixels<T: OutElem>(&self, out: &mut [T]) {
        for &i in &self.bad {
            out[i] = T::default();
        }
    }

    /// Transform `src` into `out` (`out.len() == output_len()`); returns the number of values
    /// saturated (always 0 unless the plan saturates).
    pub fn apply<T: OutElem>(
        &self,
        src: SrcFrame<'_>,
        out: &mut [T],
    ) -> Result<u64, PixelOverflow> {
        debug_assert_eq!(src.len(), self.source_len());
        debug_assert_eq!(out.len(), self.output_len());
        match src {
            SrcFrame::U8(s) => self.apply_typed(s, out),
            SrcFrame::U16(s) => self.apply_typed(s, out),
            SrcFrame::U32(s) => self.apply_typed(s, out),
        }
    }

    fn store<T: OutElem>(
        &self,
        v: u64,
        pixel: (usize, usize),
        saturated: &mut u64,
    ) -> Result<T, PixelOverflow> {
        if v <= T::MAX {
            Ok(T::from_u64(v))
        } else if self.saturate {
            *saturated += 1;
            Ok(T::from_u64(T::MAX))
        } else {
            Err(PixelOverflow { pixel, value: v })
        }
    }

    fn apply_typed<S: SrcElem, T: OutElem>(
        &self,
        src: &[S],
        out: &mut [T],
    ) -> Result<u64, PixelOverflow> {
        let full = self.region.is_full(self.source_detector);
        let src_cols = self.source_detector.cols;
        let mut saturated = 0u64;
        if self.bin == 1 && full && T::MAX >= S::MAX {
            // Widening or same-type copy: no value can overflow; zero bad pixels afterwards.
            for (o, &s) in out.iter_mut().zip(src) {
                *o = T::from_u64(s.get());
            }
            for &i in &self.bad {
                out[i] = T::default();
            }
            return Ok(0);
        }
        if self.bin == 1 {
            let out_cols = self.output.cols;
            for (orow, out_row) in out.chunks_exact_mut(out_cols).enumerate() {
                let srow = self.region.row_start + orow;
                let base = srow * src_cols + self.region.col_start;
                for (ocol, o) in out_row.iter_mut().enumerate() {
                    let i = base + ocol;
                    let v = if !self.bad_lookup.is_empty() && self.bad_lookup[i] {
                        0
                    } else {
                        src[i].get()
                    };
                    *o = self.store(v, (orow, ocol), &mut saturated)?;
                }
            }
            return Ok(saturated);
        }
        let b = self.bin;
        let (r0, r1, c0, c1) = (
            self.region.row_start,
            self.region.row_stop,
            self.region.col_start,
            self.region.col_stop,
        );
        let mut acc = vec![0u64; self.output.cols];
        for orow in 0..self.output.rows {
            acc.iter_mut().for_each(|a| *a = 0);
            let rs = r0 + orow * b;
            let re = (rs + b).min(r1);
            for srow in rs..re {
                let row_base = srow * src_cols;
                for scol in c0..c1 {
                    let i = row_base + scol;
                    if !self.bad_lookup.is_empty() && self.bad_lookup[i] {
                        continue;
                    }
                    acc[(scol - c0) / b] += src[i].get();
                }
            }
            let out_row = &mut out[orow * self.output.cols..(orow + 1) * self.output.cols];
            for (ocol, (o, &v)) in out_row.iter_mut().zip(&acc).enumerate() {
                *o = self.store(v, (orow, ocol), &mut saturated)?;
            }
        }
        Ok(saturated)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(
        src: &[u32],
        det: Shape2,
        region: Region,
        bin: usize,
        bad: &[bool],
    ) -> (Shape2, Vec<u64>) {
        let rs = region.shape();
        let out = Shape2::new(rs.rows.div_ceil(bin), rs.cols.div_ceil(bin));
        let mut v = vec![0u64; out.len()];
        for r in region.row_start..region.row_stop {
            for c in region.col_start..region.col_stop {
                let i = r * det.cols + c;
                if !bad[i] {
                    let o =
                        ((r - region.row_start) / bin) * out.cols + (c - region.col_start) / bin;
                    v[o] += src[i] as u64;
                }
            }
        }
        (out, v)
    }

    #[test]
    fn binning_keeps_partial_edges_and_masks_first() {
        let det = Shape2::new(7, 5);
        let src: Vec<u32> = (0..35).map(|i| (i * 7919 % 1000) as u32).collect();
        let mut bad = vec![false; 35];
        bad[6] = true;
        bad[34] = true;
        for &(region, bin) in &[
            (Region::new(0, 7, 0, 5), 1),
            (Region::new(0, 7, 0, 5), 2),
            (Region::new(1, 6, 1, 5), 3),
            (Region::new(2, 3, 0, 5), 4),
        ] {
            let plan = FramePlan::new(det, Some(region), bin, DType::U32, false, Some(&bad))
                .expect("plan");
            let (shape, want) = naive(&src, det, region, bin, &bad);
            assert_eq!(plan.output_shape(), shape);
            let mut out = vec![0u32; plan.output_len()];
            plan.apply(SrcFrame::U32(&src), &mut out).expect("apply");
            let got: Vec<u64> = out.iter().map(|&x| x as u64).collect();
            assert_eq!(got, want, "region {region} bin {bin}");
        }
    }

    #[test]
    fn narrowing_fails_on_overflow_but_not_on_masked_sentinels() {
        let det = Shape2::new(2, 2);
        let src = [1u32, u32::MAX, 3, 4];
        let bad = [false, true, false, false];
        let plan = FramePlan::new(det, None, 1, DType::U16, false, Some(&bad)).expect("plan");
        let mut out = [0u16; 4];
        assert_eq!(plan.apply(SrcFrame::U32(&src), &mut out), Ok(0));
        assert_eq!(out, [1, 0, 3, 4]);
        let plan = FramePlan::new(det, None, 1, DType::U16, false, None).expect("plan");
        let err = plan.apply(SrcFrame::U32(&src), &mut out).err();
        assert_eq!(
            err,
            Some(PixelOverflow {
                pixel: (0, 1),
                value: u32::MAX as u64
            })
        );
    }

    #[test]
    fn u8_saturates_and_counts() {
        let det = Shape2::new(1, 4);
        let src = [10u16, 255, 256, 1000];
        let plan = FramePlan::new(det, None, 1, DType::U8, true, None).expect("plan");
        let mut out = [0u8; 4];
        assert_eq!(plan.apply(SrcFrame::U16(&src), &mut out), Ok(2));
        assert_eq!(out, [10, 255, 255, 255]);
    }

    #[test]
    fn invalid_plans_are_rejected() {
        let det = Shape2::new(4, 4);
        assert!(FramePlan::new(det, None, 0, DType::U16, false, None).is_err());
        assert!(FramePlan::new(
            det,
            Some(Region::new(0, 5, 0, 4)),
            1,
            DType::U16,
            false,
            None
        )
        .is_err());
        assert!(FramePlan::new(det, None, 5, DType::U16, false, None).is_err());
    }
}
