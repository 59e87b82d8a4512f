//! Shapes and half-open regions, always `(row, col)`.

use crate::error::{Error, Result};
use std::fmt;

/// A 2-D extent: a scan grid (probe positions) or a detector frame (pixels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Shape2 {
    /// Number of rows.
    pub rows: usize,
    /// Number of columns.
    pub cols: usize,
}

impl Shape2 {
    /// A shape of `rows × cols`.
    pub const fn new(rows: usize, cols: usize) -> Self {
        Shape2 { rows, cols }
    }
    /// Number of elements, `rows·cols`.
    pub const fn len(&self) -> usize {
        self.rows * self.cols
    }
    /// True when the shape holds no element.
    pub const fn is_empty(&self) -> bool {
        self.rows == 0 || self.cols == 0
    }
    /// The region covering the whole shape.
    pub const fn full(&self) -> Region {
        Region {
            row_start: 0,
            row_stop: self.rows,
            col_start: 0,
            col_stop: self.cols,
        }
    }
}

impl fmt::Display for Shape2 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} x {}", self.rows, self.cols)
    }
}

/// A half-open rectangle `(row_start, row_stop, col_start, col_stop)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Region {
    /// First row (inclusive).
    pub row_start: usize,
    /// Last row (exclusive).
    pub row_stop: usize,
    /// First column (inclusive).
    pub col_start: usize,
    /// Last column (exclusive).
    pub col_stop: usize,
}

impl Region {
    /// The region `[row_start, row_stop) × [col_start, col_stop)`.
    pub const fn new(row_start: usize, row_stop: usize, col_start: usize, col_stop: usize) -> Self {
        Region {
            row_start,
            row_stop,
            col_start,
            col_stop,
        }
    }
    /// The extent of the region.
    pub const fn shape(&self) -> Shape2 {
        Shape2 {
            rows: self.row_stop - self.row_start,
            cols: self.col_stop - self.col_start,
        }
    }
    /// Check the region is non-empty and lies inside `within`; `what` names it in the error
    /// (`"scan_region"`, `"detector_region"`).
    pub fn validate(&self, within: Shape2, what: &str) -> Result<()> {
        let ok = self.row_start < self.row_stop
            && self.col_start < self.col_stop
            && self.row_stop <= within.rows
            && self.col_stop <= within.cols;
        if ok {
            Ok(())
        } else {
            Err(Error::invalid(
                "load",
                format!("{what} {self} is empty or outside the {within} grid"),
            )
            .with_expected(format!(
                "0 <= start < stop <= ({}, {})",
                within.rows, within.cols
            ))
            .with_found(self.to_string()))
        }
    }
    /// True when the region is the whole of `shape`.
    pub fn is_full(&self, shape: Shape2) -> bool {
        *self == shape.full()
    }
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "({}, {}, {}, {})",
            self.row_start, self.row_stop, self.col_start, self.col_stop
        )
    }
}

/// Output length of `n` pixels binned by `bin`: the ceiling, so incomplete edge blocks are kept
/// (summed over the pixels that exist).
pub const fn bin_extent(n: usize, bin: usize) -> usize {
    n.div_ceil(bin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_validation() {
        let s = Shape2::new(4, 6);
        assert!(Region::new(0, 4, 0, 6).validate(s, "scan_region").is_ok());
        assert!(Region::new(1, 1, 0, 6).validate(s, "scan_region").is_err());
        assert!(Region::new(0, 5, 0, 6).validate(s, "scan_region").is_err());
        assert!(Region::new(0, 4, 2, 7).validate(s, "scan_region").is_err());
        assert_eq!(Region::new(1, 3, 2, 5).shape(), Shape2::new(2, 3));
    }

    #[test]
    fn bin_extent_keeps_partial_edges() {
        assert_eq!(bin_extent(192, 2), 96);
        assert_eq!(bin_extent(99, 4), 25);
        assert_eq!(bin_extent(1, 8), 1);
    }
}
