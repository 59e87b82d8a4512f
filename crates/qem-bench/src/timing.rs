//! What the check binaries and benchmark programs time with: one warm-up call, then timed
//! calls summarised by their median.

use std::time::Instant;

/// The median of `v` as the check binaries report it: for an even count the upper of the two
/// middle values (a time that was measured, not an average of two). `v` must not be empty.
pub fn p50(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[s.len() / 2]
}

/// Call `f` once to warm up, then `repeats` timed calls: (p50 seconds, every call's seconds,
/// the last call's result). `repeats` must be at least 1.
pub fn time_p50<T, E>(
    repeats: usize,
    mut f: impl FnMut() -> Result<T, E>,
) -> Result<(f64, Vec<f64>, T), E> {
    let mut last = f()?;
    let mut v = Vec::new();
    for _ in 0..repeats {
        let t = Instant::now();
        last = f()?;
        v.push(t.elapsed().as_secs_f64());
    }
    Ok((p50(&v), v, last))
}

/// xorshift64*: reproducible pseudo-random numbers for test data and mutations (not for
/// anything that needs statistical quality beyond that).
#[derive(Debug, Clone)]
pub struct XorShift64Star(pub u64);

impl XorShift64Star {
    /// The next 64-bit value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (0 when `n` is 0), by the remainder (slightly biased; fine for
    /// picking mutations).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// Uniform in [0, 1) from the top 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p50_takes_the_upper_middle() {
        assert_eq!(p50(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(p50(&[4.0, 1.0, 2.0, 3.0]), 3.0);
    }

    #[test]
    fn time_p50_warms_up_once() {
        let mut calls = 0;
        let (_, all, last) = time_p50(3, || -> Result<i32, ()> {
            calls += 1;
            Ok(calls)
        })
        .unwrap();
        assert_eq!((all.len(), last), (3, 4));
    }
}
