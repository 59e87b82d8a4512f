//! The in-place LZ4 parse of `bslz4_decode.cu` (`LaunchShape::stage_payload`), replayed on the
//! host: the payload is staged at the end of one buffer exactly as `stage_payload` places it,
//! parsed with the kernel's rule (literals in rounds of 32 that read before they write; a match
//! only when its last byte stays below the first unread payload byte), and the output compared
//! with the CPU decoder's. If the rule let a write reach an unread byte, the parse would read a
//! clobbered byte and the output would differ.
//!
//! The blocks are bitshuffled detector-like frames compressed by this crate's LZ4 (lz4_flex)
//! and by the reference bitshuffle/LZ4 library (the codec's test vectors).

use super::{warp_buffer_bytes, STAGE_MARGIN};
use qem_codec::{bitshuffle, bslz4, lz4};

/// A u16 bitshuffle block: 4,096 elements.
const BLOCK_BYTES: usize = 8192;

#[derive(Debug, PartialEq)]
enum InPlace {
    Decoded(Vec<u8>),
    /// A write would have reached the unread payload: the kernel decodes such a block again
    /// from global memory.
    Overtake,
}

/// Where `stage_payload` puts the payload's first byte: `cap − plen − shift` rounded down to 4,
/// plus the payload's offset mod 4 in the input (`shift`).
fn staged_at(cap: usize, plen: usize, shift: usize) -> usize {
    ((cap - plen - shift) & !3) + shift
}

fn ext_len(buf: &[u8], at: usize, ip: &mut usize, mut len: usize) -> usize {
    loop {
        let b = buf[at + *ip];
        *ip += 1;
        len += b as usize;
        if b != 255 {
            return len;
        }
    }
}

/// The kernel's in-place parse of a valid block (`payload` decodes to `olen` bytes) in a buffer
/// of `cap` bytes, the payload's input offset ≡ `shift` (mod 4).
fn parse_in_place(payload: &[u8], olen: usize, cap: usize, shift: usize) -> InPlace {
    let plen = payload.len();
    assert!(plen + 3 <= cap, "the kernel stages only payloads that fit");
    let at = staged_at(cap, plen, shift);
    assert!(at + plen <= cap);
    let mut buf = vec![0xA5u8; cap];
    buf[at..at + plen].copy_from_slice(payload);
    let (mut ip, mut op) = (0usize, 0usize);
    loop {
        let token = buf[at + ip] as usize;
        ip += 1;
        let mut lit = token >> 4;
        if lit == 15 {
            lit = ext_len(&buf, at, &mut ip, lit);
        }
        if op > at + ip {
            return InPlace::Overtake;
        }
        // Rounds of 32: the warp reads the round's source bytes, then writes them.
        for r in (0..lit).step_by(32) {
            let n = (lit - r).min(32);
            let round: Vec<u8> = buf[at + ip + r..at + ip + r + n].to_vec();
            buf[op + r..op + r + n].copy_from_slice(&round);
        }
        ip += lit;
        op += lit;
        if ip == plen {
            break;
        }
        let offset = buf[at + ip] as usize | (buf[at + ip + 1] as usize) << 8;
        ip += 2;
        let mut mlen = token & 15;
        if mlen == 15 {
            mlen = ext_len(&buf, at, &mut ip, mlen);
        }
        mlen += 4;
        if op + mlen > at + ip {
            return InPlace::Overtake;
        }
        for i in 0..mlen {
            buf[op + i] = buf[op - offset + i];
        }
        op += mlen;
    }
    assert_eq!(op, olen, "a valid block fills its output");
    buf.truncate(olen);
    InPlace::Decoded(buf)
}

/// A deterministic detector-like u16 frame of `n` pixels: a bright disk on a dim background at
/// `dose` counts per background pixel (xorshift noise; the counts' spread matters, not their law).
fn frame(n: usize, dose: f64, seed: u64) -> Vec<u16> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    let side = (n as f64).sqrt() as usize;
    (0..n)
        .map(|i| {
            let (r, c) = ((i / side.max(1)) as f64, (i % side.max(1)) as f64);
            let h = side as f64 / 2.0;
            let disk = (r - h).hypot(c - h) < side as f64 / 6.0;
            let mean = if disk { dose * 40.0 } else { dose };
            // mean ± its square root, uniform: the low bits vary as with shot noise.
            let v = mean + mean.sqrt() * (2.0 * next() - 1.0) * 1.7;
            v.round().clamp(0.0, 65_535.0) as u16
        })
        .collect()
}

/// Bitshuffle each full 8,192-byte block of `data` and compress it with this crate's LZ4.
fn blocks_of(data: &[u16]) -> Vec<(Vec<u8>, usize)> {
    let bytes: &[u8] = bytemuck::cast_slice(data);
    bytes
        .chunks_exact(BLOCK_BYTES)
        .map(|b| {
            let mut t = vec![0u8; BLOCK_BYTES];
            bitshuffle::transpose_block(b, 2, &mut t).expect("transpose");
            (lz4::compress_block(&t), BLOCK_BYTES)
        })
        .collect()
}

/// Blocks that stress the rule: frames at six doses, uniform noise (incompressible), zeros,
/// and zeros then noise (a compressible head, then a literal run whose tokens and length
/// bytes make the remaining input longer than the remaining output).
fn generated_blocks() -> Vec<(Vec<u8>, usize)> {
    let n = 192 * 192;
    let mut out = Vec::new();
    for (k, dose) in [0.01, 0.1, 1.0, 10.0, 100.0, 1000.0]
        .into_iter()
        .enumerate()
    {
        out.extend(blocks_of(&frame(n, dose, k as u64 + 1)));
    }
    let mut s = 0x1234_5678_9abc_def1u64;
    let noise: Vec<u16> = (0..4 * 4096)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u16
        })
        .collect();
    out.extend(blocks_of(&noise));
    out.extend(blocks_of(&vec![0u16; 4096]));
    for head in [64usize, 512, 2048, 4000] {
        let mut v = vec![0u16; 4096];
        v[head..].copy_from_slice(&noise[..4096 - head]);
        // Raw bytes, not bitshuffled: the tail stays incompressible byte by byte.
        out.push((lz4::compress_block(bytemuck::cast_slice(&v)), BLOCK_BYTES));
    }
    out
}

/// The reference library's blocks: every block of the codec's u16/u32 test vectors.
fn vector_blocks() -> Vec<(Vec<u8>, usize)> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../qem-codec/tests/vectors");
    let mut out = Vec::new();
    for (name, es) in [
        ("u16_192x192", 2),
        ("u16_256x256_sparse", 2),
        ("u16_100x99_tail", 2),
        ("B_poisson8x8_u16_default", 2),
        ("u32_64x64", 4),
    ] {
        let chunk = std::fs::read(format!("{dir}/{name}.chunk.bin")).expect("vector");
        let expected = std::fs::read(format!("{dir}/{name}.expected.bin")).expect("vector");
        let layout = bslz4::parse_chunk(&chunk, es, expected.len()).expect("valid vector");
        for b in &layout.blocks {
            let p = &chunk[b.payload_offset..b.payload_offset + b.payload_len];
            out.push((p.to_vec(), b.out_len));
        }
    }
    assert!(out.len() >= 8, "the vectors hold blocks");
    out
}

fn reference(payload: &[u8], olen: usize) -> Vec<u8> {
    let mut out = vec![0u8; olen];
    lz4::decompress_block_exact(payload, &mut out).expect("valid block");
    out
}

/// Count the blocks that overtake with `margin` bytes over the block size; panic on any
/// in-place output that differs from the CPU decoder's.
fn overtakes(blocks: &[(Vec<u8>, usize)], margin: usize) -> usize {
    let mut n = 0;
    for (i, (p, olen)) in blocks.iter().enumerate() {
        let cap = BLOCK_BYTES.max(*olen).div_ceil(16) * 16 + margin;
        if p.len() + 3 > cap {
            continue; // the kernel parses such a payload from global memory
        }
        for shift in 0..4 {
            match parse_in_place(p, *olen, cap, shift) {
                InPlace::Decoded(out) => {
                    assert!(
                        out == reference(p, *olen),
                        "block {i} shift {shift}: bytes differ"
                    )
                }
                InPlace::Overtake => n += 1,
            }
        }
    }
    n
}

#[test]
fn staged_blocks_decode_in_place_with_the_margin() {
    let mut blocks = generated_blocks();
    blocks.extend(vector_blocks());
    assert!(blocks.len() > 40);
    assert_eq!(overtakes(&blocks, STAGE_MARGIN), 0);
}

#[test]
fn without_the_margin_literal_tails_overtake() {
    // The test above can fail: with no margin the incompressible tails overtake.
    assert!(overtakes(&generated_blocks(), 0) > 0);
}

#[test]
fn an_overtaking_block_is_detected_not_misdecoded() {
    // 8,192 literals then nothing: plen = 8192 + 1 + 32 length bytes; in a buffer with no
    // margin the payload's start sits below the output's end, and the first round would
    // clobber unread literals if the rule did not stop it.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let data: Vec<u8> = (0..BLOCK_BYTES)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    let p = lz4::compress_block(&data);
    assert!(p.len() > BLOCK_BYTES, "incompressible");
    let cap = p.len() + 3;
    assert_eq!(
        parse_in_place(&p, BLOCK_BYTES, cap, 0),
        InPlace::Decoded(data.clone())
    );
    // A long match that ends within the last literals' length of the output, in a buffer of
    // exactly the block: its end reaches the unread final sequence, so it is refused.
    let mut v = vec![0u8; BLOCK_BYTES];
    v[..16].copy_from_slice(&data[..16]);
    let p = lz4::compress_block(&v);
    assert_eq!(
        parse_in_place(&p, BLOCK_BYTES, BLOCK_BYTES, 0),
        InPlace::Overtake
    );
    // With the margin the same block decodes in place.
    let cap = BLOCK_BYTES + STAGE_MARGIN;
    assert_eq!(parse_in_place(&p, BLOCK_BYTES, cap, 0), InPlace::Decoded(v));
}

#[test]
fn the_buffer_size_adds_the_margin_only_when_staging() {
    assert_eq!(warp_buffer_bytes(8192, false), Some(8192));
    assert_eq!(
        warp_buffer_bytes(8192, true),
        Some(8192 + STAGE_MARGIN as u32)
    );
    assert_eq!(warp_buffer_bytes(8190, false), Some(8192));
    assert_eq!(warp_buffer_bytes(0, false), Some(16));
    // One u16 block staged: 25 one-warp CTAs per SM fit 228 KiB (1 KiB reserved per CTA).
    let per_cta = warp_buffer_bytes(8192, true).unwrap() as usize + 1024;
    assert!(25 * per_cta <= 228 * 1024);
}
