//! Merlin raw (`R64`) frames: the Medipix3 counters as the chips send them, unpacked on the host.
//!
//! A raw frame is rows of 64-bit words. Read big-endian, word `w` of a row holds lanes of the
//! counter depth's width — 64 lanes of 1 bit, 8 lanes of 8 bits (6-bit counters), 4 lanes of
//! 16 bits (12-bit counters) — and lane `j` (counted from the least significant end) is pixel
//! `w · lanes + j` of that row. A 24-bit frame is two 12-bit frames one after the other, the
//! first holding the high 12 bits: count = (first << 12) + second (for a quad, two whole 12-bit
//! quad frames). A quad (2×2 chips) stores each raw row as four chip rows side by side,
//! `[4 | 3 | 2 | 1]`: chips 1 and 2 are the top half of the assembled frame as stored, chips 3
//! and 4 the bottom half turned by 180° (raw row `y` is assembled row `2H − 1 − y`, columns
//! reversed). Chips in a row (`Nx1`) are refused: no source we could read gives their raw chip
//! order. docs/formats.md §7.8 has the layouts and how each was checked against LiberTEM's
//! reader.
//!
//! Written by hand: no maintained Rust crate reads Medipix raw words, and the unpacking is a
//! few shifts per word.

use qem_core::{DType, Error, Result};
use std::path::Path;

/// A raw frame's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawMib {
    /// Counter depth: 1, 6, 12 or 24.
    pub bits: u32,
    /// Four chips in a 2×2 layout (else one chip).
    pub quad: bool,
    /// Assembled frame rows.
    pub rows: usize,
    /// Assembled frame columns.
    pub cols: usize,
}

impl RawMib {
    /// The layout from the header's counter depth, chip count, layout field and the header's
    /// frame size (for a quad: the raw rows and the four chips' columns side by side; for
    /// 24-bit counters the header's width counts both 12-bit halves).
    pub(crate) fn new(
        bits: u32,
        chips: u32,
        layout: &str,
        header_rows: usize,
        header_cols: usize,
        path: &Path,
    ) -> Result<RawMib> {
        let refuse = |what: String| {
            Error::source("open", format!("Merlin raw (R64) frames: {what}")).with_file(path)
        };
        if !matches!(bits, 1 | 6 | 12 | 24) {
            return Err(refuse("unknown counter depth".into())
                .with_expected("1, 6, 12 or 24 (the header's last field)")
                .with_found(bits.to_string()));
        }
        if bits == 24 && header_cols % 2 != 0 {
            return Err(refuse("a 24-bit frame is two 12-bit halves".into())
                .with_expected("an even header width (it counts both halves)")
                .with_found(format!("{header_cols} columns")));
        }
        let cols = if bits == 24 {
            header_cols / 2
        } else {
            header_cols
        };
        let layout = layout.trim().trim_end_matches('G');
        let raw = match (chips, layout) {
            (1, _) => RawMib {
                bits,
                quad: false,
                rows: header_rows,
                cols,
            },
            (4, "2x2") if cols % 4 == 0 => RawMib {
                bits,
                quad: true,
                rows: header_rows * 2,
                cols: cols / 2,
            },
            (_, l) if l.ends_with("x1") => {
                return Err(refuse(
                    "chips in a row (Nx1) are not read: their raw chip order is not \
                     documented (LiberTEM 0.16 refuses them too); record in a processed mode \
                     (U08/U16/U32), which is read"
                        .into(),
                )
                .with_expected("one chip or a 2x2 quad (raw); any layout (processed)")
                .with_found(format!("{chips} chips, layout {layout}, {bits}-bit")))
            }
            _ => {
                return Err(refuse("this chip arrangement is not read".into())
                    .with_expected("one chip or a 2x2 quad, 1-, 6-, 12- or 24-bit")
                    .with_found(format!(
                        "{chips} chips, layout {layout}, {bits}-bit, {header_cols} columns"
                    )))
            }
        };
        // A chip row must be whole 64-bit words.
        let chip_cols = if raw.quad { raw.cols / 2 } else { raw.cols };
        if raw.rows == 0 || chip_cols == 0 || chip_cols % raw.lanes() != 0 {
            return Err(refuse("rows are not whole 64-bit words".into())
                .with_expected(format!("chip rows of a multiple of {} pixels", raw.lanes()))
                .with_found(format!("{chip_cols} pixels")));
        }
        Ok(raw)
    }

    /// Pixels per 64-bit word.
    fn lanes(self) -> usize {
        match self.bits {
            1 => 64,
            6 => 8,
            _ => 4,
        }
    }

    /// The element type the frames load as.
    pub(crate) fn dtype(self) -> DType {
        match self.bits {
            1 | 6 => DType::U8,
            12 => DType::U16,
            _ => DType::U32,
        }
    }

    /// Stored bytes of one frame.
    pub(crate) fn stored_frame_bytes(self) -> usize {
        let px = self.rows * self.cols;
        match self.bits {
            1 => px / 8,
            6 => px,
            12 => px * 2,
            _ => px * 4,
        }
    }

    /// Unpack one 12-bit-or-narrower raw frame (`src`, stored order): `put(i, count)` for each
    /// pixel `i` of the assembled frame (row-major).
    fn unpack(self, src: &[u8], mut put: impl FnMut(usize, u32)) {
        let lanes = self.lanes();
        let width = 64 / lanes;
        let mask = if width == 64 {
            u64::MAX
        } else {
            (1u64 << width) - 1
        };
        let (chips_per_row, chip_cols, raw_rows) = if self.quad {
            (4, self.cols / 2, self.rows / 2)
        } else {
            (1, self.cols, self.rows)
        };
        let chip_row_bytes = chip_cols / lanes * 8;
        for y in 0..raw_rows {
            for chip in 0..chips_per_row {
                let start = (y * chips_per_row + chip) * chip_row_bytes;
                let row = &src[start..start + chip_row_bytes];
                // Where this chip row goes: (assembled row, first column, reversed?).
                let (out_row, col0, reversed) = if !self.quad {
                    (y, 0, false)
                } else {
                    match chip {
                        3 => (y, 0, false),
                        2 => (y, chip_cols, false),
                        1 => (self.rows - 1 - y, 0, true),
                        _ => (self.rows - 1 - y, chip_cols, true),
                    }
                };
                let first = out_row * self.cols + col0;
                for (w, word) in row.chunks_exact(8).enumerate() {
                    let word = u64::from_be_bytes(word.try_into().unwrap_or([0; 8]));
                    for j in 0..lanes {
                        let px = w * lanes + j;
                        let at = if reversed { chip_cols - 1 - px } else { px };
                        put(first + at, ((word >> (j * width)) & mask) as u32);
                    }
                }
            }
        }
    }

    /// Stored bytes of whole frames → little-endian counts of [`RawMib::dtype`], written in
    /// place at the end of `out` (no per-frame buffers: this runs once per frame of a load).
    pub(crate) fn convert(self, part: &[u8], out: &mut Vec<u8>) {
        let stored = self.stored_frame_bytes();
        let frame_bytes = self.rows * self.cols * self.dtype().size();
        for frame in part.chunks_exact(stored.max(1)) {
            let start = out.len();
            out.resize(start + frame_bytes, 0);
            let dst = &mut out[start..];
            match self.bits {
                1 | 6 => self.unpack(frame, |i, c| dst[i] = c as u8),
                12 => self.unpack(frame, |i, c| {
                    dst[2 * i..2 * i + 2].copy_from_slice(&(c as u16).to_le_bytes())
                }),
                _ => {
                    // Two 12-bit frames: the first is the high 12 bits, the second is added.
                    let half = RawMib { bits: 12, ..self };
                    half.unpack(&frame[..stored / 2], |i, c| {
                        dst[4 * i..4 * i + 4].copy_from_slice(&(c << 12).to_le_bytes())
                    });
                    half.unpack(&frame[stored / 2..], |i, c| {
                        let at = &mut dst[4 * i..4 * i + 4];
                        let high = u32::from_le_bytes([at[0], at[1], at[2], at[3]]);
                        at.copy_from_slice(&(high + c).to_le_bytes());
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One single-chip row of `cols` pixels from `word`, as loaded bytes.
    fn one_row(bits: u32, cols: usize, word: [u8; 8]) -> Vec<u8> {
        let raw = RawMib {
            bits,
            quad: false,
            rows: 1,
            cols,
        };
        let mut out = Vec::new();
        raw.convert(&word, &mut out);
        out
    }

    /// One 1-bit word by hand: bytes `80 00 00 00 00 00 00 03` read big-endian have bits 0, 1
    /// and 63 set, so pixels 0, 1 and 63 of the row count 1.
    #[test]
    fn one_bit_word_by_hand() {
        let out = one_row(1, 64, [0x80, 0, 0, 0, 0, 0, 0, 0x03]);
        let ones: Vec<usize> = (0..64).filter(|&i| out[i] == 1).collect();
        assert_eq!(ones, vec![0, 1, 63]);
    }

    /// One 12-bit word by hand: lanes from the least significant end are pixels 0..4.
    #[test]
    fn twelve_bit_word_by_hand() {
        let out = one_row(12, 4, [0x0F, 0xFF, 0x00, 0x03, 0x00, 0x02, 0x00, 0x01]);
        assert_eq!(out, [1, 0, 2, 0, 3, 0, 0xFF, 0x0F]);
    }

    fn layout(bits: u32, chips: u32, field: &str, rows: usize, cols: usize) -> Result<RawMib> {
        RawMib::new(bits, chips, field, rows, cols, Path::new("x.mib"))
    }

    /// The header's frame size → the assembled frame: a 24-bit quad's header counts the four
    /// chips' columns of both 12-bit halves.
    #[test]
    fn quad_24_bit_from_the_header() {
        let q = layout(24, 4, "   2x2G", 256, 2048).unwrap();
        assert_eq!((q.quad, q.rows, q.cols), (true, 512, 512));
        assert_eq!(q.stored_frame_bytes(), 2 * (256 * 1024 * 2));
        assert_eq!(q.dtype(), DType::U32);
    }

    #[test]
    fn other_arrangements_are_refused_by_name() {
        for field in ["Nx1", "Nx1G", "4x1"] {
            let e = layout(12, 4, field, 256, 1024).unwrap_err();
            assert_eq!(e.kind, qem_core::ErrorKind::Source);
            assert!(e.to_string().contains("chips in a row (Nx1)"), "{e}");
        }
        let e = layout(12, 3, "2x2", 256, 768).unwrap_err();
        assert!(
            e.to_string().contains("chip arrangement is not read"),
            "{e}"
        );
        let e = layout(24, 1, "1x1", 256, 255).unwrap_err();
        assert!(e.to_string().contains("two 12-bit halves"), "{e}");
    }

    /// A 24-bit quad by hand: chips of 4 × 4 pixels (one 12-bit word a chip row), one frame
    /// whose assembled pixel (0, 0) (chip 1) is 0x123456 and pixel (7, 7) (chip 4, turned) is
    /// 0xABCDEF. Raw row 0 is `[4 | 3 | 2 | 1]`: chip 4's first word holds its assembled
    /// bottom-right pixel at the row's start turned, i.e. lane 0.
    #[test]
    fn quad_24_bit_by_hand() {
        let q = layout(24, 4, "2x2", 4, 32).unwrap();
        assert_eq!((q.rows, q.cols), (8, 8));
        let half = 4 * 4 * 8; // 4 raw rows × 4 chips × one 8-byte word
        let mut raw = vec![0u8; 2 * half];
        // Word for chip 4 (first in raw row 0), lane 0 → the last byte pair (least significant).
        raw[6..8].copy_from_slice(&0xABCu16.to_be_bytes());
        raw[half + 6..half + 8].copy_from_slice(&0xDEFu16.to_be_bytes());
        // Chip 1 is last in raw row 0: word 3, lane 0.
        raw[3 * 8 + 6..3 * 8 + 8].copy_from_slice(&0x123u16.to_be_bytes());
        raw[half + 3 * 8 + 6..half + 3 * 8 + 8].copy_from_slice(&0x456u16.to_be_bytes());
        let mut out = Vec::new();
        q.convert(&raw, &mut out);
        let px = |r: usize, c: usize| {
            let i = 4 * (r * 8 + c);
            u32::from_le_bytes([out[i], out[i + 1], out[i + 2], out[i + 3]])
        };
        assert_eq!(px(0, 0), 0x123456);
        assert_eq!(px(7, 7), 0xABCDEF);
        assert_eq!((0..64).filter(|&i| px(i / 8, i % 8) != 0).count(), 2);
    }
}
