//! Strict LZ4 *block* codec (no frame format).
//!
//! [`decompress_block_exact`] is written by hand so that every rule of the block format is
//! checked in one visible place (docs/formats.md §4.2); the GPU kernel mirrors this loop. It is
//! safe Rust: short literal runs and short matches are copied 16 bytes at a time ("wild copies",
//! only when the whole 16 bytes fit in the buffers), long ones with `copy_from_slice` /
//! `copy_within`, and overlapping matches by repeated doubling of the already decoded pattern.
//!
//! What it accepts: exactly the LZ4 block grammar, with every match inside the bytes already
//! decoded *in this block* (no dictionary) and the output filled to the last byte. It does not
//! enforce the encoder-side end-of-block conventions (last 5 bytes literal, last match 12 bytes
//! before the end): they are guarantees for unchecked decoders, not needed for correctness here.
//! A block whose last sequence carries a match (no final literal-only sequence) is rejected.
//!
//! [`compress_block`] is `lz4_flex`'s block compressor; any valid LZ4 stream decodes the same.

use crate::error::Lz4Fault;
use crate::CodecError;

/// Largest LZ4 block that input of `n` bytes can compress to (`LZ4_compressBound`).
pub const fn compress_bound(n: usize) -> usize {
    n + n / 255 + 16
}

/// Compress `input` as one LZ4 block (no frame, no size prefix).
pub fn compress_block(input: &[u8]) -> Vec<u8> {
    lz4_flex::block::compress(input)
}

#[inline(always)]
fn fail(position: usize, reason: Lz4Fault) -> CodecError {
    CodecError::Lz4 {
        block: None,
        position,
        reason,
    }
}

/// Read the extension bytes of a length whose 4-bit code was 15, starting at `*ip`.
///
/// Fails when the input ends first, or as soon as the length passes `limit` (so a run of
/// 0xFF bytes can neither overflow nor run long).
#[inline(always)]
fn read_length_extension(
    input: &[u8],
    ip: &mut usize,
    mut len: usize,
    limit: usize,
    token_pos: usize,
) -> Result<usize, CodecError> {
    loop {
        let Some(&b) = input.get(*ip) else {
            return Err(fail(*ip, Lz4Fault::TruncatedLength));
        };
        *ip += 1;
        len += b as usize;
        if len > limit {
            return Err(fail(token_pos, Lz4Fault::LengthOverflow));
        }
        if b != 255 {
            return Ok(len);
        }
    }
}

/// Copy 8 bytes inside `buf` from `src` to `dst` (`src + 8 <= dst` or `dst + 8 <= src`).
#[inline(always)]
fn copy8_within(buf: &mut [u8], src: usize, dst: usize) {
    let mut tmp = [0u8; 8];
    tmp.copy_from_slice(&buf[src..src + 8]);
    buf[dst..dst + 8].copy_from_slice(&tmp);
}

/// Append the match `out[op - offset .. op - offset + len]` at `op` (`1 <= offset <= op`,
/// `op + len <= out.len()`, checked by the caller). Bytes past `op + len` may be overwritten
/// with garbage; the caller's later writes cover them.
#[inline(always)]
fn copy_match(out: &mut [u8], op: usize, offset: usize, len: usize) {
    let src = op - offset;
    if offset >= 8 && len <= 32 && op + 32 <= out.len() {
        // Short match: at most 4 fixed 8-byte copies. Each step reads bytes strictly before
        // the bytes it writes, all already final, so this is also right when they overlap.
        let mut i = 0;
        while i < len {
            copy8_within(out, src + i, op + i);
            i += 8;
        }
    } else if offset == 1 {
        let b = out[src];
        if len <= 16 && op + 16 <= out.len() {
            out[op..op + 16].fill(b); // fixed size: two stores, no memset call
        } else {
            out[op..op + len].fill(b);
        }
    } else if offset >= len {
        out.copy_within(src..src + len, op);
    } else if len <= 32 {
        // Short overlapping match with offset 2..7: a byte loop beats the copy calls.
        for i in 0..len {
            out[op + i] = out[src + i];
        }
    } else {
        // Overlap: the output is periodic with period `offset` from `src` on. Copy the pattern
        // written so far; the distance doubles each step and stays a multiple of `offset`.
        let end = op + len;
        let mut dst = op;
        while dst < end {
            let n = (dst - src).min(end - dst);
            out.copy_within(src..src + n, dst);
            dst += n;
        }
    }
}

/// Decode one LZ4 block into `out`, which must be filled exactly.
///
/// Rejects: empty input; a token, length-extension byte or offset cut off by the end of the
/// input; a length that grows past `out.len()`; a literal run past the input or the output;
/// offset 0; an offset reaching before the start of `out`; a match past the output; a block
/// that ends with a match; and input that ends before `out` is full. Errors are
/// [`CodecError::Lz4`] with `block: None` and the byte position in `input`.
///
/// On error the contents of `out` are unspecified.
pub fn decompress_block_exact(input: &[u8], out: &mut [u8]) -> Result<(), CodecError> {
    if input.is_empty() {
        return Err(fail(0, Lz4Fault::EmptyInput));
    }
    let in_len = input.len();
    let out_len = out.len();
    let mut ip = 0usize;
    let mut op = 0usize;
    // Invariant at the top of the loop: ip < in_len, op <= out_len.
    loop {
        let token_pos = ip;
        let token = input[ip];
        ip += 1;

        // Literals.
        let mut lit = (token >> 4) as usize;
        if lit == 15 {
            lit = read_length_extension(input, &mut ip, lit, out_len, token_pos)?;
        }
        let in_left = in_len - ip;
        if lit > in_left {
            return Err(fail(
                token_pos,
                Lz4Fault::LiteralsPastInput {
                    len: lit,
                    left: in_left,
                },
            ));
        }
        let room = out_len - op;
        if lit > room {
            return Err(fail(
                token_pos,
                Lz4Fault::LiteralsPastOutput { len: lit, room },
            ));
        }
        if lit <= 16 && in_left >= 16 && room >= 16 {
            // Wild copy: the extra bytes land inside `out` past `op + lit` and are overwritten
            // by later sequences (a successful decode writes every byte up to `out_len`).
            out[op..op + 16].copy_from_slice(&input[ip..ip + 16]);
        } else {
            out[op..op + lit].copy_from_slice(&input[ip..ip + lit]);
        }
        ip += lit;
        op += lit;
        if ip == in_len {
            break; // the last sequence: literals only
        }

        // Match.
        let off_pos = ip;
        if in_len - ip < 2 {
            return Err(fail(off_pos, Lz4Fault::TruncatedOffset));
        }
        let offset = u16::from_le_bytes([input[ip], input[ip + 1]]) as usize;
        ip += 2;
        if offset == 0 {
            return Err(fail(off_pos, Lz4Fault::MatchOffsetZero));
        }
        if offset > op {
            return Err(fail(
                off_pos,
                Lz4Fault::OffsetBeforeStart {
                    offset,
                    decoded: op,
                },
            ));
        }
        let mut mlen = (token & 15) as usize;
        if mlen == 15 {
            mlen = read_length_extension(input, &mut ip, mlen, out_len, token_pos)?;
        }
        mlen += 4;
        let room = out_len - op;
        if mlen > room {
            return Err(fail(
                token_pos,
                Lz4Fault::MatchPastOutput { len: mlen, room },
            ));
        }
        copy_match(out, op, offset, mlen);
        op += mlen;
        if ip == in_len {
            // The block ended on a match: the format requires a final literal-only sequence.
            return Err(fail(
                ip,
                Lz4Fault::ShortOutput {
                    decoded: op,
                    expected: out_len,
                },
            ));
        }
    }
    if op != out_len {
        return Err(fail(
            in_len,
            Lz4Fault::ShortOutput {
                decoded: op,
                expected: out_len,
            },
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(r: Result<(), CodecError>) -> Lz4Fault {
        match r {
            Err(CodecError::Lz4 { reason, .. }) => reason,
            other => panic!("expected an LZ4 error, got {other:?}"),
        }
    }

    /// docs/formats.md §4.3: the block of vector A.
    const VECTOR_A_BLOCK: [u8; 18] = [
        0x9e, 0xaa, 0xaa, 0xcc, 0xcc, 0xf0, 0xf0, 0x00, 0xff, 0x00, 0x01, 0x00, 0x50, 0, 0, 0, 0, 0,
    ];

    #[test]
    fn worked_example_of_vector_a() {
        let mut out = [0x55u8; 32];
        decompress_block_exact(&VECTOR_A_BLOCK, &mut out).unwrap();
        let mut want = [0u8; 32];
        want[..8].copy_from_slice(&[0xaa, 0xaa, 0xcc, 0xcc, 0xf0, 0xf0, 0x00, 0xff]);
        assert_eq!(out, want);
    }

    #[test]
    fn zero_block_of_vector_e() {
        // `1f 00 01 00 ff*32 07 50 00 00 00 00 00` decodes to 8192 zero bytes.
        let mut block = vec![0x1f, 0x00, 0x01, 0x00];
        block.extend([0xff; 32]);
        block.extend([0x07, 0x50, 0, 0, 0, 0, 0]);
        let mut out = vec![1u8; 8192];
        decompress_block_exact(&block, &mut out).unwrap();
        assert!(out.iter().all(|&b| b == 0));
        let mut short = vec![0u8; 8191];
        assert!(decompress_block_exact(&block, &mut short).is_err());
    }

    #[test]
    fn offset_zero_reports_position() {
        let mut block = VECTOR_A_BLOCK;
        block[10] = 0;
        let err = decompress_block_exact(&block, &mut [0u8; 32]).unwrap_err();
        assert_eq!(err.to_string(), "LZ4 match offset 0 at byte 10");
    }

    #[test]
    fn each_rule_has_its_reason() {
        assert_eq!(
            reason(decompress_block_exact(&[], &mut [])),
            Lz4Fault::EmptyInput
        );
        assert_eq!(
            reason(decompress_block_exact(&[0xf0], &mut [0u8; 15])),
            Lz4Fault::TruncatedLength
        );
        assert_eq!(
            reason(decompress_block_exact(&[0x10, 7, 1], &mut [0u8; 8])),
            Lz4Fault::TruncatedOffset
        );
        assert_eq!(
            reason(decompress_block_exact(&[0x30, 1, 2], &mut [0u8; 3])),
            Lz4Fault::LiteralsPastInput { len: 3, left: 2 }
        );
        assert_eq!(
            reason(decompress_block_exact(&[0x30, 1, 2, 3], &mut [0u8; 2])),
            Lz4Fault::LiteralsPastOutput { len: 3, room: 2 }
        );
        assert_eq!(
            reason(decompress_block_exact(
                &[0x10, 7, 2, 0, 0x00],
                &mut [0u8; 5]
            )),
            Lz4Fault::OffsetBeforeStart {
                offset: 2,
                decoded: 1
            }
        );
        assert_eq!(
            reason(decompress_block_exact(
                &[0x10, 7, 1, 0, 0x00],
                &mut [0u8; 4]
            )),
            Lz4Fault::MatchPastOutput { len: 4, room: 3 }
        );
        // Ends on a match, output full: still rejected (no final literal sequence).
        assert!(matches!(
            reason(decompress_block_exact(&[0x10, 7, 1, 0], &mut [0u8; 5])),
            Lz4Fault::ShortOutput { .. }
        ));
        // A long 0xFF run is stopped as soon as it passes the output size.
        let mut long = vec![0xf0];
        long.extend([0xff; 100]);
        assert_eq!(
            reason(decompress_block_exact(&long, &mut [0u8; 300])),
            Lz4Fault::LengthOverflow
        );
    }

    #[test]
    fn overlapping_matches_repeat_the_pattern() {
        for offset in 1..=12usize {
            for mlen in 4..=40usize {
                // `offset` literals 1..=offset, then a match of `mlen` at `offset`, then 5 literals.
                let lits: Vec<u8> = (1..=offset as u8).collect();
                let mut block = Vec::new();
                let ml_code = (mlen - 4).min(15) as u8;
                block.push(((offset as u8) << 4) | ml_code);
                block.extend(&lits);
                block.extend((offset as u16).to_le_bytes());
                if mlen - 4 >= 15 {
                    block.push((mlen - 4 - 15) as u8);
                }
                block.push(0x50);
                block.extend([9u8; 5]);
                let n = offset + mlen + 5;
                let mut out = vec![0u8; n];
                decompress_block_exact(&block, &mut out).unwrap();
                let mut want: Vec<u8> = lits.clone();
                for i in 0..mlen {
                    want.push(want[i]);
                }
                want.extend([9u8; 5]);
                assert_eq!(out, want, "offset {offset} len {mlen}");
            }
        }
    }

    #[test]
    fn compress_then_decompress() {
        let data: Vec<u8> = (0..5000u32).map(|i| (i * i % 251) as u8 & 0xf0).collect();
        let c = compress_block(&data);
        assert!(c.len() <= compress_bound(data.len()));
        let mut out = vec![0u8; data.len()];
        decompress_block_exact(&c, &mut out).unwrap();
        assert_eq!(out, data);
    }
}
