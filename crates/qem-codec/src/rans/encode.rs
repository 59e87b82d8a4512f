//! The stream encoder: [`encode_stream`] codes one frame as one v2 stream (layout in the `rans`
//! module doc). The specification the GPU encoder matches byte for byte; called by the CPU
//! encode path and tests.

use super::{
    symbol_of, CountsModel, RansError, LANES, PROB_SCALE, RENORM_FACTOR, STATE_LOWER,
    STREAM_HEADER_BYTES,
};

/// Encode one frame as one stream (layout in the module doc), with the table set its
/// statistic maps to.
///
/// Fails when `frame.len()` is not the model's frame length, or a value's symbol has frequency
/// 0 in its pixel's row ([`RansError::Uncodable`], naming the first such pixel).
pub fn encode_stream(model: &CountsModel, frame: &[u16]) -> Result<Vec<u8>, RansError> {
    let n = model.frame_len();
    if frame.len() != n {
        return Err(RansError::FrameLength {
            what: "encode frame",
            expected: n,
            found: frame.len(),
        });
    }
    let k = u32::from(model.literals);
    let s = model.symbols();
    let table_set = model.table_set_for(frame);
    let row0 = table_set as usize * model.contexts as usize;
    // Pass 1 (raster order): symbols, and the extra bits packed LSB-first.
    let mut syms = vec![0u8; n];
    let mut extra: Vec<u32> = Vec::new();
    let mut acc: u64 = 0;
    let mut acc_bits: u32 = 0;
    let mut n_extra_bits: u64 = 0;
    for (p, &v) in frame.iter().enumerate() {
        let c = model.ctx_map[p];
        let code = symbol_of(v.into(), k).filter(|&(sym, _, _)| {
            (sym as usize) < s && model.freq[(row0 + c as usize) * s + sym as usize] > 0
        });
        let Some((sym, nb, e)) = code else {
            return Err(RansError::Uncodable {
                pixel: p,
                value: v.into(),
                symbol: symbol_of(v.into(), k).map_or(u32::MAX, |t| t.0),
                context: c,
            });
        };
        syms[p] = sym as u8;
        if nb > 0 {
            acc |= u64::from(e) << acc_bits;
            acc_bits += nb;
            n_extra_bits += u64::from(nb);
            if acc_bits >= 32 {
                extra.push(acc as u32);
                acc >>= 32;
                acc_bits -= 32;
            }
        }
    }
    if acc_bits > 0 {
        extra.push(acc as u32);
    }
    // Pass 2: rANS, steps last to first, lanes 31 down to 0.
    let mut x = [u64::from(STATE_LOWER); LANES];
    let mut words: Vec<u16> = Vec::with_capacity(n / 4);
    let steps = n.div_ceil(LANES);
    for t in (0..steps).rev() {
        for j in (0..LANES).rev() {
            let p = t * LANES + j;
            if p >= n {
                continue;
            }
            let idx = (row0 + model.ctx_map[p] as usize) * s + syms[p] as usize;
            let f = u64::from(model.freq[idx]);
            let cu = u64::from(model.cum[idx]);
            let mut xs = x[j];
            if xs >= RENORM_FACTOR * f {
                words.push((xs & 0xFFFF) as u16);
                xs >>= 16;
            }
            x[j] = (xs / f) * u64::from(PROB_SCALE) + (xs % f) + cu;
        }
    }
    words.reverse();

    let n_words = words.len();
    let mut out = Vec::with_capacity(STREAM_HEADER_BYTES + 2 * n_words + 2 + 4 * extra.len());
    out.extend_from_slice(&(n_words as u32).to_le_bytes());
    out.extend_from_slice(&(n_extra_bits as u32).to_le_bytes());
    out.extend_from_slice(&u32::from(table_set).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    for xs in x {
        out.extend_from_slice(&(xs as u32).to_le_bytes());
    }
    for w in &words {
        out.extend_from_slice(&w.to_le_bytes());
    }
    if n_words % 2 == 1 {
        out.extend_from_slice(&[0, 0]);
    }
    for e in &extra {
        out.extend_from_slice(&e.to_le_bytes());
    }
    Ok(out)
}
