//! [`DetectorPlan`]: how one detector frame is cut and binned on its way into a dataset —
//! validated once (here) and handed to both engines, so the CPU and CUDA engines can never
//! disagree about a region or a bin factor.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::geometry::{bin_extent, Region, Shape2};

/// Geometry of one frame through a load: source detector, detector region, bin, output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DetectorPlan {
    /// Source detector shape.
    pub source: Shape2,
    /// Half-open detector region in source pixels (the whole detector when none was asked).
    pub region: Region,
    /// Count-preserving bin factor (≥ 1).
    pub bin: usize,
    /// Result frame shape: `⌈region / bin⌉` per axis (a partial last bin is kept).
    pub output: Shape2,
}

impl DetectorPlan {
    /// Validate `detector_region` (inside the detector, non-empty) and `bin` (≥ 1, at most the
    /// region's larger extent) and plan the output frame.
    pub fn new(
        source: Shape2,
        detector_region: Option<Region>,
        bin: usize,
    ) -> Result<DetectorPlan> {
        let region = detector_region.unwrap_or(source.full());
        region.validate(source, "detector_region")?;
        if bin == 0 {
            return Err(Error::invalid("load", "det_bin must be at least 1")
                .with_expected(">= 1")
                .with_found("0"));
        }
        let rs = region.shape();
        if bin > rs.rows.max(rs.cols) {
            return Err(Error::invalid(
                "load",
                format!("det_bin {bin} is larger than the detector extent {rs}"),
            )
            .with_expected(format!("<= {}", rs.rows.max(rs.cols)))
            .with_found(bin.to_string()));
        }
        Ok(DetectorPlan {
            source,
            region,
            bin,
            output: Shape2::new(bin_extent(rs.rows, bin), bin_extent(rs.cols, bin)),
        })
    }

    /// True when frames pass through unchanged (whole detector, no binning, same dtype).
    pub fn is_identity(&self, source: DType, result: DType) -> bool {
        self.bin == 1 && self.region.is_full(self.source) && source == result
    }

    /// Source pixels `[(row_start, row_stop), (col_start, col_stop)]` summed into result pixel
    /// `(orow, ocol)`.
    pub fn source_block(&self, orow: usize, ocol: usize) -> ((usize, usize), (usize, usize)) {
        let rs = self.region.row_start + orow * self.bin;
        let cs = self.region.col_start + ocol * self.bin;
        (
            (rs, (rs + self.bin).min(self.region.row_stop)),
            (cs, (cs + self.bin).min(self.region.col_stop)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn regions_and_bins_are_validated_with_typed_errors() {
        let det = Shape2::new(7, 5);
        for (region, bin) in [
            (None, 0),
            (None, 8),
            (Some(Region::new(0, 8, 0, 5)), 1),
            (Some(Region::new(3, 3, 0, 5)), 1),
        ] {
            let e = DetectorPlan::new(det, region, bin).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
        }
        let p = DetectorPlan::new(det, Some(Region::new(1, 7, 0, 5)), 4).unwrap();
        assert_eq!(p.output, Shape2::new(2, 2));
        assert_eq!(p.source_block(1, 1), ((5, 7), (4, 5)));
        assert!(!p.is_identity(DType::U16, DType::U16));
        assert!(DetectorPlan::new(det, None, 1)
            .unwrap()
            .is_identity(DType::U16, DType::U16));
    }
}
