//! Shapes and half-open regions, always `(row, col)`.

use crate::error::{Error, ErrorKind, Result};
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
    /// Number of elements, `rows·cols`, saturating at `usize::MAX`.
    ///
    /// A shape that came from a file or a caller must first pass [`Shape2::checked_len`] (or
    /// [`Shape2::try_len`]); after that `len` is exact. The saturation only keeps an unchecked
    /// product from wrapping to a small, plausible number (`64 × (2^58 + 1)` would wrap to 64).
    pub const fn len(&self) -> usize {
        self.rows.saturating_mul(self.cols)
    }
    /// `rows·cols`, or `None` when the product does not fit in `usize`.
    pub const fn checked_len(&self) -> Option<usize> {
        self.rows.checked_mul(self.cols)
    }
    /// `rows·cols` as a typed error of `kind` for operation `op` when it does not fit in
    /// `usize`; `what` names the shape (`"scan_shape"`, `"detector shape"`).
    pub fn try_len(&self, kind: ErrorKind, op: &str, what: &str) -> Result<usize> {
        self.checked_len().ok_or_else(|| {
            Error::new(
                kind,
                op,
                format!("{what} {self} overflows: rows x cols does not fit in 64 bits"),
            )
            .with_expected(format!("rows x cols <= {}", usize::MAX))
            .with_found(format!("{} x {}", self.rows, self.cols))
        })
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
    /// The extent of the region (an inverted region, which [`Region::validate`] rejects, has
    /// extent 0 instead of wrapping).
    pub const fn shape(&self) -> Shape2 {
        Shape2 {
            rows: self.row_stop.saturating_sub(self.row_start),
            cols: self.col_stop.saturating_sub(self.col_start),
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

/// The product of `factors`, or a typed error of `kind` for `op` naming `what` overflowed (each
/// factor is listed as `name = value` in the error's `found`).
///
/// Every size derived from a file or a caller (frames × frame bytes, region × bins, ...) goes
/// through this (or [`Shape2::try_len`]) before it sizes anything.
pub fn checked_product(
    kind: ErrorKind,
    op: &str,
    what: &str,
    factors: &[(&str, u64)],
) -> Result<u64> {
    let mut acc: u64 = 1;
    for &(_, f) in factors {
        match acc.checked_mul(f) {
            Some(v) => acc = v,
            None => {
                let list: Vec<String> = factors.iter().map(|(n, v)| format!("{n} = {v}")).collect();
                return Err(Error::new(
                    kind,
                    op,
                    format!("{what} overflows: the product does not fit in 64 bits"),
                )
                .with_expected(format!("a product <= {}", u64::MAX))
                .with_found(list.join(" x ")));
            }
        }
    }
    Ok(acc)
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
    fn shape_products_never_wrap() {
        // 64 x (2^58 + 1) = 2^64 + 64 would wrap to 64.
        let s = Shape2::new(64, (1usize << 58) + 1);
        assert_eq!(s.checked_len(), None);
        assert_eq!(s.len(), usize::MAX);
        let e = s
            .try_len(ErrorKind::Source, "open", "scan_shape")
            .err()
            .map(|e| (e.kind, e.to_string()));
        assert!(
            e.as_ref().is_some_and(|(k, m)| *k == ErrorKind::Source
                && m.contains("scan_shape")
                && m.contains("overflows")),
            "{e:?}"
        );
        assert_eq!(
            Shape2::new(3, 4).try_len(ErrorKind::Source, "o", "s").ok(),
            Some(12)
        );
        assert_eq!(Region::new(5, 2, 0, 1).shape(), Shape2::new(0, 1));
        let e = checked_product(
            ErrorKind::InvalidArgument,
            "load",
            "planned bytes",
            &[("frames", 1 << 40), ("frame bytes", 1 << 30)],
        );
        assert!(e.is_err_and(|e| e.to_string().contains("planned bytes overflows")));
        assert_eq!(
            checked_product(ErrorKind::Source, "o", "w", &[("a", 3), ("b", 5)]).ok(),
            Some(15)
        );
    }

    #[test]
    fn bin_extent_keeps_partial_edges() {
        assert_eq!(bin_extent(192, 2), 96);
        assert_eq!(bin_extent(99, 4), 25);
        assert_eq!(bin_extent(1, 8), 1);
    }
}
