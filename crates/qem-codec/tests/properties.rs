//! Property tests: encode→decode round trips, hostile input never panics and never decodes to
//! the wrong size, and our LZ4 decoder agrees with lz4_flex.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use proptest::prelude::*;
use qem_codec::{bslz4, lz4, CodecError};

/// Bytes with a tunable amount of structure: values masked to few bits, with runs, so both
/// literal-heavy and match-heavy LZ4 streams occur.
fn data(max_len: usize) -> impl Strategy<Value = Vec<u8>> {
    (
        prop::collection::vec((any::<u8>(), 1usize..40), 0..max_len / 8),
        any::<u8>(),
    )
        .prop_map(move |(runs, mask)| {
            let mut v = Vec::new();
            for (b, n) in runs {
                v.extend(std::iter::repeat_n(b & mask, n % 3 * n / 2 + 1));
            }
            v.truncate(max_len);
            v
        })
}

fn elem_size() -> impl Strategy<Value = usize> {
    prop_oneof![Just(1usize), Just(2), Just(4)]
}

fn block_elems() -> impl Strategy<Value = usize> {
    prop_oneof![Just(0usize), (1usize..80).prop_map(|k| k * 8)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn bslz4_round_trip(s in elem_size(), raw in data(12_000), block in block_elems()) {
        // Any element count, including N mod 8 != 0 (raw tail) and partial last blocks.
        let len = raw.len() / s * s;
        let raw = &raw[..len];
        let chunk = bslz4::encode_chunk(raw, s, block).unwrap();
        let layout = bslz4::parse_chunk(&chunk, s, len).unwrap();
        let block_elems = if block == 0 { bslz4::default_block_elems(s) } else { block };
        prop_assert_eq!(layout.block_bytes, block_elems * s);
        prop_assert_eq!(layout.tail_len, (len / s) % 8 * s);
        let mut out = vec![0xEEu8; len];
        bslz4::decode_chunk(&chunk, s, &mut out).unwrap();
        prop_assert_eq!(&out[..], raw);
        // Any other output size is refused.
        prop_assert!(bslz4::decode_chunk(&chunk, s, &mut vec![0u8; len + s]).is_err());
        if len >= s {
            prop_assert!(bslz4::decode_chunk(&chunk, s, &mut vec![0u8; len - s]).is_err());
        }
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400), s in elem_size()) {
        let mut decoder = bslz4::Decoder::new();
        for n in [0usize, 8, 40, 64, 1000] {
            let mut out = vec![0u8; n * s];
            if decoder.decode(&bytes, s, &mut out).is_ok() {
                // Ok only when the header promised exactly this size.
                let total = u64::from_be_bytes(bytes[..8].try_into().unwrap());
                prop_assert_eq!(total, (n * s) as u64);
            }
        }
        let mut out = vec![0u8; 300];
        let _ = lz4::decompress_block_exact(&bytes, &mut out);
        let _ = qem_codec::lz4_filter::decode_chunk(&bytes, &mut out);
    }

    #[test]
    fn random_chunk_with_valid_header_never_panics(
        body in prop::collection::vec(any::<u8>(), 0..300),
        s in elem_size(),
        n in 0usize..200,
        block_elems in 0usize..40,
    ) {
        // A plausible header so the walk reaches the blocks and the LZ4 decoder.
        let mut chunk = ((n * s) as u64).to_be_bytes().to_vec();
        chunk.extend(((block_elems * s) as u32).to_be_bytes());
        chunk.extend(&body);
        let mut out = vec![0u8; n * s];
        let _ = bslz4::decode_chunk(&chunk, s, &mut out);
    }

    #[test]
    fn mutated_chunks_never_panic(
        s in elem_size(),
        raw in data(3000),
        block in block_elems(),
        flips in prop::collection::vec((any::<usize>(), 0u32..8), 1..4),
        field in (any::<usize>(), any::<u32>()),
    ) {
        let len = raw.len() / s * s;
        let raw = &raw[..len];
        let chunk = bslz4::encode_chunk(raw, s, block).unwrap();
        let mut out = vec![0u8; len];

        // Any truncation and any extra byte are always rejected.
        for cut in [1usize, 2, 5, chunk.len() / 2] {
            if cut <= chunk.len() {
                prop_assert!(bslz4::decode_chunk(&chunk[..chunk.len() - cut], s, &mut out).is_err());
            }
        }
        let mut longer = chunk.clone();
        longer.push(0);
        prop_assert!(bslz4::decode_chunk(&longer, s, &mut out).is_err());

        // Bit flips: no panic; if still accepted, the framing is intact.
        let mut flipped = chunk.clone();
        for (pos, bit) in &flips {
            let i = pos % flipped.len();
            flipped[i] ^= 1 << bit;
        }
        if bslz4::decode_chunk(&flipped, s, &mut out).is_ok() {
            prop_assert!(bslz4::parse_chunk(&flipped, s, len).is_ok());
        }

        // A random value in a random length prefix (or in the header's block size).
        let layout = bslz4::parse_chunk(&chunk, s, len).unwrap();
        let mut fields: Vec<usize> = layout.blocks.iter().map(|b| b.payload_offset - 4).collect();
        fields.push(8);
        let at = fields[field.0 % fields.len()];
        let mut bad = chunk.clone();
        bad[at..at + 4].copy_from_slice(&field.1.to_be_bytes());
        let _ = bslz4::decode_chunk(&bad, s, &mut out);
    }

    #[test]
    fn lz4_matches_lz4_flex(raw in data(20_000)) {
        let c = lz4_flex::block::compress(&raw);
        prop_assert_eq!(lz4::compress_block(&raw), c.clone());
        prop_assert!(c.len() <= lz4::compress_bound(raw.len()));
        let mut out = vec![0u8; raw.len()];
        lz4::decompress_block_exact(&c, &mut out).unwrap();
        prop_assert_eq!(&out, &raw);
        // Exact size only.
        let r = lz4::decompress_block_exact(&c, &mut vec![0u8; raw.len() + 1]);
        let is_lz4 = matches!(r, Err(CodecError::Lz4 { .. }));
        prop_assert!(is_lz4, "{:?}", r);
        if !raw.is_empty() {
            prop_assert!(lz4::decompress_block_exact(&c, &mut vec![0u8; raw.len() - 1]).is_err());
        }
    }

    #[test]
    fn what_we_accept_lz4_flex_decodes_the_same(
        bytes in prop::collection::vec(any::<u8>(), 1..64),
        n in 0usize..200,
    ) {
        let mut ours = vec![0u8; n];
        if lz4::decompress_block_exact(&bytes, &mut ours).is_ok() {
            let mut theirs = vec![0u8; n];
            let got = lz4_flex::block::decompress_into(&bytes, &mut theirs);
            prop_assert_eq!(got.ok(), Some(n));
            prop_assert_eq!(theirs, ours);
        }
    }
}
