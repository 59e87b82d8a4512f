//! Host-side geometry of the accumulate kernels: aperture radii, the scan-frequency pair lists,
//! padded half spectra, launch grids, and the f64 reference of the quadratic factorisation.

use super::*;

/// |v|² (Å⁻²) at and below which the soft aperture is 1, and at and above which it is 0, when δ
/// is the same in every direction (square pixels); `(−1, ∞)` otherwise (no shortcut). Shrunk and
/// grown by 1e-6 so that f32 rounding of |v|² cannot take a value across an edge.
pub(super) fn aperture_radii(o: &Optics) -> (f32, f32) {
    let (dr, dc) = o.dtheta_rad;
    if dr != dc {
        return (-1.0, f32::INFINITY);
    }
    let half = 0.5 * dr.abs();
    let inner = ((o.alpha_rad - half).max(0.0) / o.lambda_a).powi(2);
    let outer = ((o.alpha_rad + half) / o.lambda_a).powi(2);
    ((inner * (1.0 - 1e-6)) as f32, (outer * (1.0 + 1e-6)) as f32)
}

/// `SsbQuad`'s `inv_d` = 1/δ for the branch-free soft aperture `A(v) = sat((α − λ|v|)/δ + ½)`,
/// the CPU's formula, where δ is one constant (square pixels) and not 0; `None` elsewhere (the
/// kernel then takes `aperture_q`).
pub(super) fn aperture_soft(o: &Optics) -> Option<f32> {
    let (dr, dc) = o.dtheta_rad;
    let d = dr.abs();
    // The kernels' `aperture` takes a hard edge at δ² ≤ 1e-30 (f32).
    (dr == dc && (d * d) as f32 > 1e-30).then(|| (1.0 / d) as f32)
}

/// The half-spectrum indices the quadratic accumulate kernel leaves to its list blocks: pairs
/// whose mirror is not −ν (on the Nyquist lines), from ssb.cu `pair_of` on the same f32
/// frequencies (`take && two && !sym`).
pub(super) fn general_pairs(nr: usize, nc: usize, fr: &[f32], fc: &[f32]) -> Vec<u32> {
    (1..nr * (nc / 2 + 1))
        .filter(|&h| host_pair(h, nr, nc, fr, fc).is_some_and(|p| !p.simple))
        .map(|h| h as u32)
        .collect()
}

/// The pair a half-spectrum index stands for, as ssb.cu `pair_of` decides it.
pub(super) struct HostPair {
    /// Its full-plane index and its mirror's (when the mirror is another index); read by the
    /// test that checks the split covers the plane once.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(super) i1: usize,
    #[cfg_attr(not(test), allow(dead_code))]
    pub(super) i2: Option<usize>,
    /// The quadratic terms can take it: the mirror is −ν, or the index is its own mirror.
    pub(super) simple: bool,
}

/// ssb.cu `pair_of` for index `h` of the `nr × (nc/2 + 1)` half spectrum; `None` where the
/// mirror's thread takes the pair.
pub(super) fn host_pair(
    h: usize,
    nr: usize,
    nc: usize,
    fr: &[f32],
    fc: &[f32],
) -> Option<HostPair> {
    let half = nc / 2 + 1;
    let (r, c) = (h / half, h % half);
    let (rm, cm) = ((nr - r) % nr, (nc - c) % nc);
    let mut two = true;
    if cm < half {
        if rm == r && cm == c {
            two = false;
        } else if rm < r {
            return None;
        }
    }
    let sym = two && fr[rm] == -fr[r] && fc[cm] == -fc[c];
    Some(HostPair {
        i1: r * nc + c,
        i2: two.then_some(rm * nc + cm),
        simple: !two || sym,
    })
}

/// Values per pixel in G: the half spectrum padded to whole tiles of `G_TILE` (ssb.cu) = THREADS.
pub(super) fn padded_half(nh: u64) -> u64 {
    nh.div_ceil(u64::from(THREADS)) * u64::from(THREADS)
}

pub(super) fn grid_1d(items: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            items.div_ceil(u64::from(THREADS)).clamp(1, 4096) as u32,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn to_f32_pairs(v: &[(f64, f64)]) -> Vec<f32> {
    v.iter().flat_map(|&(a, b)| [a as f32, b as f32]).collect()
}
