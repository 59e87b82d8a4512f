//! Arbitrary bytes as a rANS counts-codec stream (format v2) against fixed small models, one
//! with a single table set and one with two, and as a serialised model: no input may panic, and
//! an accepted stream must re-encode to itself (which includes its stored table set).

#![no_main]

use libfuzzer_sys::fuzz_target;
use qem_codec::rans::{decode_stream, decode_stream_with, encode_stream, CountsModel};

/// 37 pixels (two steps, the second partial), K = 4, C = 2 (pixel p in class p mod 2),
/// `table_sets` = 1 or 2 (split 1: the statistic sums class 0; threshold 5).
fn model(table_sets: u8) -> Option<CountsModel> {
    let s = 4 + 16;
    let mut freq = vec![0u16; table_sets as usize * 2 * s];
    // Class 0: skewed literals and every bucket; class 1: only literals 0 and 1.
    let row0 = [
        2000u16, 900, 400, 200, 100, 96, 80, 64, 48, 40, 32, 32, 24, 20, 16, 12, 12, 8, 8, 4,
    ];
    for ts in 0..table_sets as usize {
        let r = ts * 2 * s;
        freq[r..r + s].copy_from_slice(&row0);
        if ts == 1 {
            freq.swap(r, r + 1); // set 1 favours value 1 in class 0
        }
        freq[r + s] = 4000;
        freq[r + s + 1] = 96;
    }
    let ctx = (0..37).map(|p| (p % 2) as u8).collect();
    if table_sets == 1 {
        CountsModel::new(4, 2, ctx, freq).ok()
    } else {
        CountsModel::from_parts(4, 2, table_sets, 1, ctx, vec![5], freq).ok()
    }
}

fuzz_target!(|data: &[u8]| {
    for t in [1u8, 2] {
        let Some(model) = model(t) else { return };
        let mut out = [0u16; 37];
        if decode_stream(&model, data, &mut out).is_ok() {
            // Every check passed: the stream must be exactly the encoding of what it decoded to.
            assert_eq!(encode_stream(&model, &out).ok().as_deref(), Some(data));
        }
        let mut calls = 0usize;
        let _ = decode_stream_with(&model, data, |p, _| {
            assert!(p < 37);
            calls += 1;
        });
        assert!(calls <= 37);
    }
    if let Ok(m) = CountsModel::from_bytes(data) {
        assert_eq!(m.to_bytes(), data);
    }
});
