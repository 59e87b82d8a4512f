//! Arbitrary bytes as a bitshuffle/LZ4 chunk (and as an LZ4-filter chunk): no input may panic,
//! and an accepted chunk must have promised exactly the output size.

#![no_main]

use libfuzzer_sys::fuzz_target;
use qem_codec::{bslz4, lz4_filter};

fuzz_target!(|data: &[u8]| {
    let mut decoder = bslz4::Decoder::new();
    // The first byte picks the output size among a few; the rest is the chunk. Also try the
    // whole input with the size its own header claims (capped), so the walk reaches the blocks.
    let sizes = [0usize, 16, 40, 88, 1000, 8192, 18432];
    let (pick, chunk) = data
        .split_first()
        .map_or((0, data), |(p, c)| (*p as usize, c));
    let claimed = chunk
        .get(..8)
        .map(|b| u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
        .filter(|&t| t <= 1 << 20)
        .map_or(0, |t| t as usize);
    for elem_size in [2usize, 4] {
        for len in [sizes[pick % sizes.len()] * elem_size, claimed] {
            let mut out = vec![0u8; len];
            if decoder.decode(chunk, elem_size, &mut out).is_ok() {
                assert_eq!(claimed, len);
            }
            let _ = bslz4::parse_chunk(chunk, elem_size, len);
            let _ = decoder.decode_or_copy(chunk, pick as u32, elem_size, &mut out);
        }
    }
    let mut out = vec![0u8; claimed];
    let _ = lz4_filter::decode_chunk(chunk, &mut out);
});
