//! Arbitrary bytes as one LZ4 block: no panic; whatever we accept, lz4_flex decodes the same.

#![no_main]

use libfuzzer_sys::fuzz_target;
use qem_codec::lz4;

fuzz_target!(|data: &[u8]| {
    // The first two bytes give the output size, the rest is the block.
    if data.len() < 2 {
        return;
    }
    let out_len = u16::from_le_bytes([data[0], data[1]]) as usize;
    let block = &data[2..];
    let mut out = vec![0u8; out_len];
    if lz4::decompress_block_exact(block, &mut out).is_ok() {
        let mut theirs = vec![0u8; out_len];
        let n = lz4_flex::block::decompress_into(block, &mut theirs);
        assert_eq!(n.ok(), Some(out_len));
        assert_eq!(theirs, out);
    }
});
