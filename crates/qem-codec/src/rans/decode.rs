//! The stream decoders: [`decode_stream`] (into a frame) and [`decode_stream_with`] (a sink per
//! pixel, the CPU mirror of the GPU's fused decode → reduce), with every integrity check of the
//! v2 stream layout (`rans` module doc). Called by the CPU engine, the `.qem` loader's checks,
//! fuzz targets and tests.

use super::{
    table_set_of, CountsModel, RansError, RansFault, LANES, PROB_BITS, PROB_SCALE, STATE_LOWER,
    STREAM_HEADER_BYTES,
};

/// Decode one stream into `out` (the model's frame length). On error `out` holds partial,
/// unverified values and must be discarded.
pub fn decode_stream(model: &CountsModel, stream: &[u8], out: &mut [u16]) -> Result<(), RansError> {
    if out.len() != model.frame_len() {
        return Err(RansError::FrameLength {
            what: "decode output",
            expected: model.frame_len(),
            found: out.len(),
        });
    }
    decode_stream_with(model, stream, |p, v| {
        if let Some(o) = out.get_mut(p) {
            *o = v;
        }
    })
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    match b.get(at..at + 4) {
        Some(w) => u32::from_le_bytes([w[0], w[1], w[2], w[3]]),
        None => 0,
    }
}

/// Decode one stream, calling `sink(pixel_index, value)` once per pixel in raster order (the CPU
/// mirror of the GPU's fused decode → reduce). The stream's integrity is only confirmed when
/// this returns `Ok`: on `Err` everything passed to `sink` must be discarded.
pub fn decode_stream_with<F>(
    model: &CountsModel,
    stream: &[u8],
    mut sink: F,
) -> Result<(), RansError>
where
    F: FnMut(usize, u16),
{
    let n = model.frame_len();
    let size = |what, expected: u64, found: u64| RansError::StreamSize {
        what,
        expected,
        found,
    };
    if stream.len() < STREAM_HEADER_BYTES {
        return Err(size(
            "stream header bytes",
            STREAM_HEADER_BYTES as u64,
            stream.len() as u64,
        ));
    }
    let n_words = le_u32(stream, 0) as usize;
    let n_extra_bits = le_u32(stream, 4) as usize;
    let table_set = le_u32(stream, 8);
    let reserved = le_u32(stream, 12);
    if n_words > n {
        return Err(size(
            "n_words (at most one per pixel)",
            n as u64,
            n_words as u64,
        ));
    }
    if n_extra_bits as u64 > 15 * n as u64 {
        return Err(size(
            "n_extra_bits (at most 15 per pixel)",
            15 * n as u64,
            n_extra_bits as u64,
        ));
    }
    let words_off = STREAM_HEADER_BYTES;
    let extra_off = words_off + 4 * n_words.div_ceil(2);
    let n_extra = n_extra_bits.div_ceil(32);
    let total = extra_off + 4 * n_extra;
    if stream.len() != total {
        return Err(size("stream bytes", total as u64, stream.len() as u64));
    }
    let corrupt = |pixel, fault| RansError::Corrupt { pixel, fault };
    if table_set >= u32::from(model.table_sets) {
        return Err(corrupt(
            0,
            RansFault::TableSetOutOfRange {
                table_set,
                table_sets: model.table_sets,
            },
        ));
    }
    if reserved != 0 {
        return Err(corrupt(0, RansFault::NonZeroReserved { value: reserved }));
    }
    if n_words % 2 == 1 && (stream[total - 4 * n_extra - 2] | stream[total - 4 * n_extra - 1]) != 0
    {
        return Err(corrupt(0, RansFault::NonZeroPadding));
    }
    if n_extra_bits % 32 != 0 {
        let last = le_u32(stream, total - 4);
        if last >> (n_extra_bits % 32) != 0 {
            return Err(corrupt(0, RansFault::NonZeroPadding));
        }
    }
    let mut x = [0u32; LANES];
    for (j, xs) in x.iter_mut().enumerate() {
        *xs = le_u32(stream, 16 + 4 * j);
        if *xs < STATE_LOWER {
            return Err(corrupt(
                0,
                RansFault::StateOutOfRange {
                    lane: j,
                    state: *xs,
                },
            ));
        }
    }
    let words = &stream[words_off..words_off + 2 * n_words];
    let extra = &stream[extra_off..];
    let k = u32::from(model.literals);
    let s = model.symbols();
    let split = model.split;
    let row0 = table_set as usize * model.contexts as usize;
    let mask = PROB_SCALE - 1;
    let mut wpos = 0usize;
    let mut bitpos = 0usize;
    let mut stat = 0u64;
    for p in 0..n {
        let j = p % LANES;
        let c = model.ctx_map[p];
        let r = row0 + c as usize;
        let xs = x[j];
        let slot = xs & mask;
        let sym = model.lut[r * PROB_SCALE as usize + slot as usize] as usize;
        let idx = r * s + sym;
        let f = u32::from(model.freq[idx]);
        let cu = u32::from(model.cum[idx]);
        // f · (x >> 12) ≤ 4096 · (2^20 − 1) and slot − cu < f, so this stays below 2^32.
        let mut xn = f * (xs >> PROB_BITS) + slot - cu;
        if xn < STATE_LOWER {
            let Some(w) = words.get(2 * wpos..2 * wpos + 2) else {
                return Err(corrupt(p, RansFault::WordsExhausted));
            };
            xn = (xn << 16) | u32::from(u16::from_le_bytes([w[0], w[1]]));
            wpos += 1;
        }
        x[j] = xn;
        let value = if (sym as u32) < k {
            sym as u32
        } else {
            let nb = sym as u32 - k;
            if bitpos + nb as usize > n_extra_bits {
                return Err(corrupt(p, RansFault::ExtraBitsExhausted));
            }
            let e = read_bits(extra, bitpos, nb);
            bitpos += nb as usize;
            k - 1 + (1 << nb) + e
        };
        let Ok(v) = u16::try_from(value) else {
            return Err(corrupt(p, RansFault::ValueTooLarge { value }));
        };
        if c < split {
            stat += u64::from(v);
        }
        sink(p, v);
    }
    for (j, &xs) in x.iter().enumerate() {
        if xs != STATE_LOWER {
            return Err(corrupt(n, RansFault::FinalState { lane: j, state: xs }));
        }
    }
    if wpos != n_words {
        return Err(corrupt(
            n,
            RansFault::WordsLeft {
                used: wpos,
                total: n_words,
            },
        ));
    }
    if bitpos != n_extra_bits {
        return Err(corrupt(
            n,
            RansFault::ExtraBitsLeft {
                used: bitpos,
                total: n_extra_bits,
            },
        ));
    }
    let expected = table_set_of(&model.thresholds, stat);
    if u32::from(expected) != table_set {
        return Err(corrupt(
            n,
            RansFault::TableSetMismatch {
                stored: table_set,
                expected,
                statistic: stat,
            },
        ));
    }
    Ok(())
}

/// `nb ≤ 15` bits at bit position `bitpos` of the LSB-first u32 words in `extra` (missing bytes
/// read as 0; the caller has checked `bitpos + nb ≤ n_extra_bits`).
fn read_bits(extra: &[u8], bitpos: usize, nb: u32) -> u32 {
    let w = bitpos / 32;
    let lo = u64::from(le_u32(extra, 4 * w));
    let hi = u64::from(le_u32(extra, 4 * (w + 1)));
    let window = lo | (hi << 32);
    ((window >> (bitpos % 32)) & ((1u64 << nb) - 1)) as u32
}
