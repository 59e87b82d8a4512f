//! Unit tests of the `.qem` container's CRC-32C (check value, incremental and bytewise
//! reference); the file-level tests are in `tests/qem_file.rs`.

use super::*;

/// CRC-32C's reflected polynomial (Castagnoli), for the bytewise reference below.
const CRC32C_POLY: u32 = 0x82F6_3B78;

#[test]
fn crc32c_check_value() {
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(crc32c(b""), 0);
    let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
    let mut h = Crc32c::new();
    for part in data.chunks(13) {
        h.update(part);
    }
    assert_eq!(h.finish(), crc32c(&data));
    // Bytewise reference.
    let mut c = !0u32;
    for &b in &data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ CRC32C_POLY
            } else {
                c >> 1
            };
        }
    }
    assert_eq!(!c, crc32c(&data));
}

#[test]
fn incremental_updates_agree_at_every_split() {
    let data: Vec<u8> = (0..4099u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    for start in 0..9 {
        for len in [0, 1, 7, 8, 9, 63, 64, 100, 4000] {
            let part = &data[start..start + len];
            let mut h = Crc32c::new();
            let (a, b) = part.split_at(len / 3);
            h.update(a);
            h.update(b);
            assert_eq!(h.finish(), crc32c(part), "start {start} len {len}");
        }
    }
}
