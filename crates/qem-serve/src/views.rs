//! Exact host-side view arithmetic: detector binning of frames and patterns (block sums and
//! block maxima, edge blocks holding fewer pixels), binned-detector masks expanded to the
//! original pixels, scan crops and scan binning (whole blocks only). Integers stay integers;
//! nothing here rounds.

use qem::Region;

/// Rows and columns of `(rows, cols)` binned by `b`, edge blocks kept: `⌈rows/b⌉ × ⌈cols/b⌉`.
pub(crate) fn binned_shape(rows: usize, cols: usize, b: usize) -> (usize, usize) {
    (rows.div_ceil(b), cols.div_ceil(b))
}

/// `fold` over the pixels of each `b × b` block of a `rows × cols` image (edge blocks partial),
/// each block starting from `init`.
fn bin_blocks<T: Copy, U: Copy>(
    src: &[T],
    rows: usize,
    cols: usize,
    b: usize,
    init: U,
    fold: impl Fn(U, T) -> U,
) -> Vec<U> {
    let (rb, cb) = binned_shape(rows, cols, b);
    let mut out = vec![init; rb * cb];
    for (i, row) in src.chunks_exact(cols.max(1)).take(rows).enumerate() {
        let o = &mut out[(i / b) * cb..(i / b + 1) * cb];
        for (j, &v) in row.iter().enumerate() {
            o[j / b] = fold(o[j / b], v);
        }
    }
    out
}

/// Block sums of a `rows × cols` image over `b × b` blocks (edge blocks partial), in `u64`.
pub(crate) fn bin_sum<T: Copy + Into<u64>>(
    src: &[T],
    rows: usize,
    cols: usize,
    b: usize,
) -> Vec<u64> {
    bin_blocks(src, rows, cols, b, 0u64, |acc, v| acc + v.into())
}

/// Block maxima of a `rows × cols` image over `b × b` blocks (edge blocks partial).
pub(crate) fn bin_max(src: &[u32], rows: usize, cols: usize, b: usize) -> Vec<u32> {
    bin_blocks(src, rows, cols, b, 0u32, u32::max)
}

/// A mask of the binned detector (`⌈rows/b⌉ × ⌈cols/b⌉`, non-zero = in) as 0/1 weights of the
/// original `rows × cols` pixels: a pixel is in when its block is.
pub(crate) fn expand_mask<T: Copy + Default + PartialEq>(
    binned: &[T],
    rows: usize,
    cols: usize,
    b: usize,
) -> Vec<u32> {
    let (_, cb) = binned_shape(rows, cols, b);
    let zero = T::default();
    let mut out = Vec::with_capacity(rows * cols);
    for i in 0..rows {
        for j in 0..cols {
            out.push(u32::from(binned[(i / b) * cb + j / b] != zero));
        }
    }
    out
}

/// `(rows, cols)` of a region.
pub(crate) fn region_shape(r: &Region) -> (usize, usize) {
    (r.row_stop - r.row_start, r.col_stop - r.col_start)
}

/// The `region` of a `rows × cols` scan image (already validated against it).
pub(crate) fn crop<T: Copy>(img: &[T], cols: usize, region: &Region) -> Vec<T> {
    let (rows, c) = region_shape(region);
    let mut out = Vec::with_capacity(rows * c);
    for r in region.row_start..region.row_stop {
        out.extend_from_slice(&img[r * cols + region.col_start..r * cols + region.col_stop]);
    }
    out
}

/// Sums (in `A`, of `widen(v)`) of whole `s × s` blocks of a `rows × cols` scan image; rows and
/// columns past the last whole block are dropped. Returns the sums and their shape.
fn whole_block_sums<T: Copy, A: Copy + Default + std::ops::AddAssign>(
    img: &[T],
    rows: usize,
    cols: usize,
    s: usize,
    widen: impl Fn(T) -> A,
) -> (Vec<A>, usize, usize) {
    let (rb, cb) = (rows / s, cols / s);
    let mut out = vec![A::default(); rb * cb];
    for i in 0..rb * s {
        for j in 0..cb * s {
            out[(i / s) * cb + j / s] += widen(img[i * cols + j]);
        }
    }
    (out, rb, cb)
}

/// Exact sums of whole `s × s` blocks of a `rows × cols` scan image; rows and columns past the
/// last whole block are dropped. Returns the image and its shape.
pub(crate) fn scan_bin_sum(
    img: &[u64],
    rows: usize,
    cols: usize,
    s: usize,
) -> (Vec<u64>, usize, usize) {
    whole_block_sums(img, rows, cols, s, |v| v)
}

/// Means of whole `s × s` blocks of a float scan image (sums in `f64`); the shape as
/// [`scan_bin_sum`].
pub(crate) fn scan_bin_mean(
    img: &[f32],
    rows: usize,
    cols: usize,
    s: usize,
) -> (Vec<f32>, usize, usize) {
    let (acc, rb, cb) = whole_block_sums(img, rows, cols, s, f64::from);
    let n = (s * s) as f64;
    (acc.into_iter().map(|v| (v / n) as f32).collect(), rb, cb)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bin_sum_keeps_partial_edge_blocks() {
        // 3 × 5 image of 1..=15, bin 2 → 2 × 3 blocks.
        let v: Vec<u32> = (1..=15).collect();
        let got = bin_sum(&v, 3, 5, 2);
        assert_eq!(
            got,
            vec![1 + 2 + 6 + 7, 3 + 4 + 8 + 9, 5 + 10, 11 + 12, 13 + 14, 15]
        );
        assert_eq!(bin_max(&v, 3, 5, 2), vec![7, 9, 10, 12, 14, 15]);
    }

    #[test]
    fn expand_and_scan_bin() {
        let m = expand_mask(&[1u8, 0, 0, 1], 3, 3, 2);
        assert_eq!(m, vec![1, 1, 0, 1, 1, 0, 0, 0, 1]);
        let img: Vec<u64> = (0..15).collect();
        let (s, r, c) = scan_bin_sum(&img, 3, 5, 2);
        assert_eq!((r, c), (1, 2));
        assert_eq!(s, vec![1 + 5 + 6, 2 + 3 + 7 + 8]);
    }
}
