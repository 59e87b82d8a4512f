// Single-sideband ptychography on the GPU (qem_cpu::ssb is the specification; ssb.rs is the
// only caller). Layouts:
//   images  f32 [nb][N]        BF pixel j's image over the scan (N = nr·nc, row-major; gathered
//                              on the card, or uploaded as u32 counts and converted in place)
//   G       tiled              cuFFT R2C half spectrum of each image (h = r·half + c, half =
//                              nc/2 + 1) at g_at(b, B, h): runs of G_TILE values of one pixel,
//                              the runs of all B pixels for one tile of h after each other, so a
//                              block (its 256 threads = one tile of h) reads one contiguous
//                              region as it walks its pixels; stored as float2 (GS32), as two
//                              f16 bit patterns scaled by 1/gscale[b] (GS16: |G_b(ν)| ≤ G_b(0) =
//                              Σ counts, so gscale = G_b(0)/60000 keeps every value finite with 11
//                              significant bits), or as two 12-bit floats, the same f16 rounded to
//                              7 significant bits (GS12: 3 bytes a value; each tile of G_TILE
//                              values is 2·G_TILE bytes of u16 words, re's 12 bits and im's top 4,
//                              then G_TILE bytes of im's low 8 bits: both loads coalesce)
//   kb, pk  float2 [B]         k_b (Å⁻¹, rotated) and P(k_b) at the current aberrations
//   fr, fc  f32 [nr], [nc]     fftfreq of the scan (Å⁻¹)
// The other half of a real image's spectrum is its mirror: G[(nr−r)%nr][(nc−c)%nc] = G*[r][c]
// (an identity of the DFT's indices, also on Nyquist lines). One thread takes a half-spectrum
// index and its mirror, so each G value is read once for two frequencies; when the mirror's
// frequency is exactly −ν (everywhere but on Nyquist lines) the two probe values P(k_b ∓ ν) serve
// both terms. All arithmetic is f32 except the cross-thread sums, which are f64 in a fixed order
// (per-block partials summed by the host), so every result is deterministic.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

struct SsbOptics {
    float lambda;   // Å
    float alpha;    // rad
    float dr2;      // Δθ_row² (rad²)
    float dc2;      // Δθ_col²
};

// χ as a polynomial in (v_r, v_c) (ssb.rs folds the Krivanek coefficients and angles in):
// χ = a2 q² + b2c (x² − y²) + b2s 2xy + q² (d1c x + d1s y) + e3c x(x² − 3y²) + e3s y(3x² − y²)
//     + f4 q⁴,  q² = x² + y².
struct SsbAb {
    float a2, b2c, b2s, d1c, d1s, e3c, e3s, f4;
};

#define GAMMA_FLOOR_SQ 1e-16f

__device__ __forceinline__ float2 cmul(float2 a, float2 b) {
    return make_float2(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x);
}
__device__ __forceinline__ float2 cmulc(float2 a, float2 b) {  // a · conj(b)
    return make_float2(a.x * b.x + a.y * b.y, a.y * b.x - a.x * b.y);
}

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// The soft aperture A(v) of qem_cpu::ssb::Optics::aperture.
__device__ __forceinline__ float aperture(float x, float y, const SsbOptics& o) {
    const float q2 = x * x + y * y;
    if (q2 > 0.f) {
        const float a = o.lambda * (q2 * rsqrtf(q2));  // |v| to ~1e-7: edges move < 1e-5 px
        // δ² = (cos φ Δθ_r)² + (sin φ Δθ_c)²: a constant on a square-pixel detector.
        const float d2 = o.dr2 == o.dc2 ? o.dr2 : (x * x * o.dr2 + y * y * o.dc2) / q2;
        if (d2 <= 1e-30f) return a <= o.alpha ? 1.f : 0.f;
        return fminf(fmaxf((o.alpha - a) * rsqrtf(d2) + 0.5f, 0.f), 1.f);
    }
    return 1.f;
}

// exp(−i·x) with x reduced into [−π, π] first (2π split in two floats, Cody–Waite; the
// reduction adds ≤ 1e-7·|x/2π| rad), then the fast sincos (abs. error ≤ 4e-7 there).
__device__ __forceinline__ float2 expmi(float x) {
    const float t = rintf(x * 0.159154943f);
    float r = fmaf(-t, 6.28318548f, x);
    r = fmaf(-t, -1.74845553e-7f, r);
    float s, c;
    __sincosf(r, &s, &c);
    return make_float2(c, -s);
}

// P(v) = A(v) exp(−iχ(v)). χ reaches ~10² rad (its f32 value carries ~6e-8·|χ|).
__device__ __forceinline__ float2 probe(float x, float y, const SsbOptics& o, const SsbAb& ab) {
    const float amp = aperture(x, y, o);
    if (amp == 0.f) return make_float2(0.f, 0.f);
    const float q2 = x * x + y * y;
    const float chi = ab.a2 * q2 + ab.b2c * (x * x - y * y) + ab.b2s * (2.f * x * y) +
                      q2 * (ab.d1c * x + ab.d1s * y) + ab.e3c * (x * (x * x - 3.f * y * y)) +
                      ab.e3s * (y * (3.f * x * x - y * y)) + ab.f4 * q2 * q2;
    const float2 e = expmi(chi);
    return make_float2(amp * e.x, amp * e.y);
}

// The object's phase-only C = G Γ*/|Γ| (or G Γ* 10⁸ where |Γ|² ≤ 10⁻¹⁶), or the coherence
// loss's plain G Γ* when `matched`; adds |Γ|² to `den`.
__device__ __forceinline__ float2 correct(float2 g, float2 gam, bool matched, float& den) {
    const float n2 = gam.x * gam.x + gam.y * gam.y;
    den += n2;
    const float w = matched ? 1.f : (n2 > GAMMA_FLOOR_SQ ? rsqrtf(n2) : 1e8f);
    const float2 c = cmulc(g, gam);
    return make_float2(c.x * w, c.y * w);
}

// G's tile: the accumulate kernels' block size (ssb.rs THREADS), so that a block's h share one.
#define G_TILE 256u

// Where G_b(h) lies (module docs); the last tile is padded to G_TILE values per pixel.
__device__ __forceinline__ u64 g_at(u64 b, u64 nb, u64 h) {
    return (h / G_TILE) * nb * G_TILE + b * G_TILE + (h % G_TILE);
}

// G's storage (module docs; ssb.rs GStorage C32, C16, C12).
#define GS32 0
#define GS16 1
#define GS12 2

// Bytes of one pixel's run of G_TILE values: pixel b + 1's value lies this far past pixel b's.
template <int GS>
__device__ __forceinline__ u64 g_stride() {
    return (u64)G_TILE * (GS == GS32 ? 8u : GS == GS16 ? 4u : 3u);
}

// One thread's view of G at value index `off` = g_at(0, nb, h): the byte of pixel 0's value
// (GS12: its u16 word) and, for GS12, how far past that byte its low-bits byte lies.
struct GView {
    const unsigned char* p;
    u32 lo;
};

template <int GS>
__device__ __forceinline__ GView g_view(const void* g, u64 off) {
    const u64 lane = off % G_TILE;
    const u64 at = GS == GS32   ? off * 8u
                   : GS == GS16 ? off * 4u
                                : (off / G_TILE) * 3u * G_TILE + lane * 2u;
    return {reinterpret_cast<const unsigned char*>(g) + at, (u32)(2u * G_TILE - lane)};
}

// The value at `p` (a GView's byte, stepped by whole g_stride) times `scale` (GS32: 1).
template <int GS>
__device__ __forceinline__ float2 g_read(const unsigned char* p, u32 lo, float scale) {
    if (GS == GS32) return __ldcs(reinterpret_cast<const float2*>(p));
    if (GS == GS16) {
        const unsigned int w = __ldcs(reinterpret_cast<const unsigned int*>(p));
        return make_float2(h2f((u16)(w & 0xffffu)) * scale, h2f((u16)(w >> 16)) * scale);
    }
    const unsigned int w = __ldcs(reinterpret_cast<const unsigned short*>(p));
    const unsigned int l = __ldcs(p + lo);
    return make_float2(h2f((u16)(w & 0xfff0u)) * scale,
                       h2f((u16)(((w & 0xfu) << 12) | (l << 4))) * scale);
}

// G_b at the thread's h times `scale` (the pixel's gscale; GS32: 1), `off` = g_at(0, nb, h).
// G is read once per evaluation, so the loads are streaming (evict-first).
template <int GS>
__device__ __forceinline__ float2 load_g_off(const void* g, float scale, u64 off, u32 b) {
    const GView v = g_view<GS>(g, off);
    return g_read<GS>(v.p + (u64)b * g_stride<GS>(), v.lo, scale);
}

template <int GS>
__device__ __forceinline__ float2 load_g(const void* g, const float* gscale, u64 b, u64 nb, u64 h) {
    return load_g_off<GS>(g, GS != GS32 ? gscale[b] : 1.f, g_at(0, nb, h), (u32)b);
}

// Per-pixel tables of the block's slice of BF pixels, staged once in (dynamic) shared memory
// by the accumulate block: every thread reads the same entry at the same time (a broadcast,
// never evicted by G), and one barrier serves the whole slice. ssb.rs sizes the launch with
// ACC_TABLE_BYTES per pixel and keeps a slice within 48 KB with the block's 2 KB reduction.
#define ACC_TABLE_BYTES 28u
struct PixelTables {
    // k_b, A(k_b) and 1 where E continues from the previous pixel (same detector row and not
    // the slice's first pixel), 0 where it restarts: one 16-byte load per pixel.
    const float4* kq;
    const float2* pk;  // P(k_b) (general terms)
    const float* gs;   // gscale (GS16, GS12)
};

// The pair a half-spectrum index h = r·half + c stands for: its own full-plane index i1 and,
// when `two`, the mirror's i2 (frequency (fr[rm], fc[cm])). Mirrors inside the half spectrum
// (c = 0, or c = nc/2 for even nc) are taken by the smaller row only; self-mirrors are single.
struct Pair {
    u32 r, c, rm, cm;
    bool take, two, sym;
};

__device__ __forceinline__ Pair pair_of(u32 h, u32 nr, u32 nc, u32 half, const float* fr,
                                        const float* fc) {
    Pair p;
    p.r = h / half;
    p.c = h % half;
    p.rm = (nr - p.r) % nr;
    p.cm = (nc - p.c) % nc;
    p.take = true;
    p.two = true;
    if (p.cm < half) {
        if (p.rm == p.r && p.cm == p.c) {
            p.two = false;
        } else if (p.rm < p.r) {
            p.take = false;
        }
    }
    p.sym = p.two && fr[p.rm] == -fr[p.r] && fc[p.cm] == -fc[p.c];
    return p;
}

// What one thread sums over its BF pixels: S(ν), S(ν'), Σ |Γ|² at ν and ν', and Σ |G|² over
// both frequencies (the coherence loss's constant denominator).
struct Sums {
    float2 s1, s2;
    float d1, d2, power;
};

// One pixel's corrected terms for pair p (`correct`): c1 = C(ν), c2 = C(ν') when p.two (else 0);
// adds |Γ|² at ν to d1, at ν' to d2 unless p.sym, and |G|² (twice for a pair) to `power`. False
// (nothing written) when both are exactly 0: both probe values outside the aperture and the
// mirror sharing them. When ν' = −ν (p.sym), Γ(k, −ν) = P(k+ν)P*(k) − P(k)P*(k−ν) = −Γ(k, ν)*
// for any χ, and G(−ν) = G(ν)*, so C(−ν) = −C(ν)* and |Γ(−ν)| = |Γ(ν)|: the sums over pixels
// follow from ν's (`mirror_sums`).
__device__ __forceinline__ bool pair_terms(float2 gv, float2 k, float2 pkb, float vr, float vc,
                                           float vr2, float vc2, const Pair& p,
                                           const SsbOptics& o, const SsbAb& ab, bool matched,
                                           float2& c1, float2& c2, float& d1, float& d2,
                                           float& power) {
    power = fmaf(p.two ? 2.f : 1.f, gv.x * gv.x + gv.y * gv.y, power);
    const float2 pm = probe(k.x - vr, k.y - vc, o, ab);
    const float2 pp = probe(k.x + vr, k.y + vc, o, ab);
    const bool none = pm.x == 0.f && pm.y == 0.f && pp.x == 0.f && pp.y == 0.f;
    if (none && (!p.two || p.sym)) return false;
    const float2 g1 = make_float2(cmulc(pm, pkb).x - cmulc(pkb, pp).x,
                                  cmulc(pm, pkb).y - cmulc(pkb, pp).y);
    c1 = correct(gv, g1, matched, d1);
    if (p.sym) {
        c2 = make_float2(-c1.x, c1.y);
    } else if (p.two) {
        const float2 qm = probe(k.x - vr2, k.y - vc2, o, ab);
        const float2 qp = probe(k.x + vr2, k.y + vc2, o, ab);
        const float2 g2 = make_float2(cmulc(qm, pkb).x - cmulc(pkb, qp).x,
                                      cmulc(qm, pkb).y - cmulc(pkb, qp).y);
        c2 = correct(make_float2(gv.x, -gv.y), g2, matched, d2);
    } else {
        c2 = make_float2(0.f, 0.f);
    }
    return true;
}

// The general terms (any χ) for pair p of the chunk's pixels [c0, c0 + cn), added to t: probe
// values computed per pixel, the tables from shared memory.
template <int GS>
__device__ __forceinline__ void general_terms(Sums& t, const void* __restrict__ g, u32 c0, u32 cn,
                                              const PixelTables& tb, u32 nb, u32 h,
                                              const Pair& p, float vr, float vc, float vr2,
                                              float vc2, const SsbOptics& o, const SsbAb& ab,
                                              bool matched) {
    // Software pipelining: the next pixel's G is loaded while this one is computed.
    const u64 off = g_at(0, nb, h);
    float2 g_nx = load_g_off<GS>(g, tb.gs[0], off, c0);
    for (u32 j = 0; j < cn; ++j) {
        const float2 gv = g_nx;
        if (j + 1 < cn) g_nx = load_g_off<GS>(g, tb.gs[j + 1], off, c0 + j + 1);
        const float4 kq = tb.kq[j];
        const float2 k = make_float2(kq.x, kq.y), pkb = tb.pk[j];
        if (pkb.x == 0.f && pkb.y == 0.f) continue;  // zero-aperture pixel: Γ ≡ 0
        float2 c1, c2;
        if (!pair_terms(gv, k, pkb, vr, vc, vr2, vc2, p, o, ab, matched, c1, c2, t.d1, t.d2,
                        t.power)) {
            continue;
        }
        t.s1.x += c1.x;
        t.s1.y += c1.y;
        if (!p.sym) {
            t.s2.x += c2.x;
            t.s2.y += c2.y;
        }
    }
}

// The mirror's sums where ν' = −ν (`pair_terms`): S(−ν) = −S(ν)*, D(−ν) = D(ν); both kinds of
// terms sum only ν's.
__device__ __forceinline__ void mirror_sums(Sums& t) {
    t.s2 = make_float2(-t.s1.x, t.s1.y);
    t.d2 = t.d1;
}

// The same terms when χ is quadratic (only C10, C12, φ12: χ(v) = vᵀMv), with ν' = −ν. Then
// χ(k ∓ ν) = χ(k) ∓ 2kᵀMν + χ(ν), so with E = exp(2i kᵀMν) and U = exp(−iχ(ν)):
//   Γ(ν)  = A_k E  [A(k−ν) U − A(k+ν) U*] =: A_k E W1,
//   Γ(−ν) = A_k E* [A(k+ν) U − A(k−ν) U*] =: A_k E* W2,  W2 = −W1*  (A is real),
// and C = G Γ*/|Γ| = G E* W1*/|W1| (floor case: G A_k E* W1* 10⁸). χ(k) cancels; along a detector
// row k steps by d, so E is carried by one complex product per pixel (E ← E·exp(2i dᵀMν)),
// recomputed exactly at the start of each row (cont[b] = 0), which bounds the f32 drift to a
// row (≤ ~10⁻⁵ rad over 10² pixels). No sincos and no χ per pixel. The mirror's term is
// C_b(−ν) = −C_b(ν)* (see `general_terms`), so one term per pixel serves both frequencies.
struct SsbQuad {
    float m_rr, m_cc, m_rc;  // M: χ(v) = m_rr x² + m_cc y² + 2 m_rc x y
    float dx, dy;            // the column step of k along a detector row, Å⁻¹
    // |v|² ≤ rin2 → A(v) = 1, |v|² ≥ rout2 → A(v) = 0 (square pixels: δ is a constant);
    // −1 and +∞ on other detectors, where every value takes `aperture`.
    float rin2, rout2;
    // soft = 1 (square pixels, δ > 0): A(v) = sat((α − λ|v|)·inv_d + ½) with inv_d = 1/δ (λ, α
    // of SsbOptics) — `aperture`'s formula, without its branches.
    float inv_d;
    u32 soft;
};
static_assert(sizeof(SsbQuad) == 36, "SsbQuad must match ssb.rs QuadArg");

// 1/√x by the hardware approximation, denormals flushed (rsqrtf adds a range fixup for them;
// every argument here is ≥ 1e-30 or a squared norm of order 1).
__device__ __forceinline__ float rsqrt_ftz(float x) {
    float r;
    asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// The soft aperture of a square-pixel detector (SsbQuad::soft) with no branch: 1 deep inside,
// 0 outside, the linear edge of `aperture` in between.
__device__ __forceinline__ float aperture_soft(float x, float y, const SsbOptics& o,
                                              const SsbQuad& q) {
    const float q2 = fmaxf(fmaf(x, x, y * y), 1e-30f);
    return __saturatef(fmaf(o.alpha - o.lambda * (q2 * rsqrt_ftz(q2)), q.inv_d, 0.5f));
}

__device__ __forceinline__ float quad_form(const SsbQuad& q, float ax, float ay, float bx,
                                           float by) {
    return q.m_rr * ax * bx + q.m_cc * ay * by + q.m_rc * (ax * by + ay * bx);
}

// `aperture` with the inside and outside decided from |v|² alone (no sqrt) where δ allows.
__device__ __forceinline__ float aperture_q(float x, float y, const SsbOptics& o,
                                           const SsbQuad& q) {
    const float q2 = fmaf(x, x, y * y);
    if (q2 <= q.rin2) return 1.f;
    if (q2 >= q.rout2) return 0.f;
    return aperture(x, y, o);
}

// G loads issued ahead of their arithmetic: the loop body is short, and one load in flight per
// thread leaves it waiting on HBM (v5, measured slower than the general kernel).
#define QUAD_DEPTH 4

// What a thread carries along its pixels in the quadratic terms.
struct QuadState {
    float2 u, step, e, s;
    float d, power;
};

__device__ __forceinline__ QuadState quad_start(float vr, float vc, const SsbQuad& q) {
    QuadState st;
    st.u = expmi(quad_form(q, vr, vc, vr, vc));
    st.step = expmi(-2.f * quad_form(q, q.dx, q.dy, vr, vc));
    st.e = make_float2(1.f, 0.f);
    st.s = make_float2(0.f, 0.f);
    st.d = 0.f;
    st.power = 0.f;
    return st;
}

// One pixel's quadratic term (module docs of `quad_terms`). No branch on the apertures: where
// both are 0, W1 = 0 and the term is exactly ±0 (G is finite), so it adds nothing — and a
// warp's time is its slowest lane's anyway.
template <bool SOFT>
__device__ __forceinline__ void quad_pixel(QuadState& st, float2 gv, float4 kq, float vr,
                                           float vc, const SsbOptics& o, const SsbQuad& q,
                                           bool matched) {
    if (kq.w == 0.f) {
        st.e = expmi(-2.f * quad_form(q, kq.x, kq.y, vr, vc));
    } else {
        st.e = cmul(st.e, st.step);
    }
    const float a_k = kq.z;
    if (a_k == 0.f) return;  // zero-aperture pixel (the same for the whole warp): Γ ≡ 0
    float am, ap;
    if (SOFT) {
        am = aperture_soft(kq.x - vr, kq.y - vc, o, q);
        ap = aperture_soft(kq.x + vr, kq.y + vc, o, q);
    } else {
        am = aperture_q(kq.x - vr, kq.y - vc, o, q);
        ap = aperture_q(kq.x + vr, kq.y + vc, o, q);
    }
    // W1 = am U − ap U*; C1 = G · E* · W1* · f1 with |Γ|² = A_k² |W1|² (`correct`: f1 = A_k
    // when `matched`, else 1/|W1|)
    const float2 w1 = make_float2((am - ap) * st.u.x, (am + ap) * st.u.y);
    const float n1 = w1.x * w1.x + w1.y * w1.y;
    const float f1 =
        matched ? a_k : (n1 * a_k * a_k > GAMMA_FLOOR_SQ ? rsqrt_ftz(n1) : a_k * 1e8f);
    const float2 c1 = cmulc(cmulc(gv, st.e), w1);
    const float2 c = make_float2(c1.x * f1, c1.y * f1);
    st.s.x += c.x;
    st.s.y += c.y;
    st.d = fmaf(a_k * a_k, n1, st.d);
    st.power = fmaf(gv.x, gv.x, fmaf(gv.y, gv.y, st.power));
}

// The same terms as `general_terms` when χ is quadratic (only C10, C12, φ12: χ(v) = vᵀMv),
// with ν' = −ν. Then χ(k ∓ ν) = χ(k) ∓ 2kᵀMν + χ(ν), so with E = exp(2i kᵀMν) and
// U = exp(−iχ(ν)):
//   Γ(ν)  = A_k E  [A(k−ν) U − A(k+ν) U*] =: A_k E W1,
//   Γ(−ν) = A_k E* [A(k+ν) U − A(k−ν) U*] =: A_k E* W2,  W2 = −W1*  (A is real),
// and C = G Γ*/|Γ| = G E* W1*/|W1| (floor case: G A_k E* W1* 10⁸). χ(k) cancels; along a detector
// row k steps by d, so E is carried by one complex product per pixel (E ← E·exp(2i dᵀMν)),
// recomputed exactly where a row starts and at the slice's first pixel (kq.w = 0), which bounds
// the f32 drift to a row (≤ ~10⁻⁵ rad over 10² pixels). No sincos and no χ per pixel. The
// mirror's term is C_b(−ν) = −C_b(ν)* (see `pair_terms`), so one term per pixel serves both
// frequencies. G of the slice's pixels [c0, c0 + cn) at this thread's h: `off` = g_at(0, nb, h).
template <int GS, bool SOFT>
__device__ __forceinline__ void quad_terms(QuadState& st, const void* __restrict__ g, u32 c0,
                                           u32 cn, const PixelTables& tb, u64 off, float vr,
                                           float vc, const SsbOptics& o, const SsbQuad& q,
                                           bool matched) {
    // One pointer per thread, stepped a group of pixels at a time (constant offsets inside).
    const GView v = g_view<GS>(g, off);
    const unsigned char* gp = v.p + (u64)c0 * g_stride<GS>();
    // Pixel j + i of the current step: G's value i pixels past the pointer.
    auto gv = [&](u32 i, u32 j) {
        return g_read<GS>(gp + i * g_stride<GS>(), v.lo, GS != GS32 ? tb.gs[j + i] : 1.f);
    };
    u32 j = 0;
    for (; j + QUAD_DEPTH <= cn; j += QUAD_DEPTH) {
        float2 gq[QUAD_DEPTH];
#pragma unroll
        for (u32 i = 0; i < QUAD_DEPTH; ++i) gq[i] = gv(i, j);
#pragma unroll
        for (u32 i = 0; i < QUAD_DEPTH; ++i) {
            quad_pixel<SOFT>(st, gq[i], tb.kq[j + i], vr, vc, o, q, matched);
        }
        gp += QUAD_DEPTH * g_stride<GS>();
    }
    for (; j < cn; ++j) {
        quad_pixel<SOFT>(st, gv(0u, j), tb.kq[j], vr, vc, o, q, matched);
        gp += g_stride<GS>();
    }
}

// Σ_b C_b(ν) over BF pixels [b_lo, b_hi) of this launch's slice y = blockIdx.y (slices of
// `per_slice` pixels, within the first `nb_used` of G's `nb`: the fit's coarse loss takes the
// coarse sample at G's front), for every ν of the full plane: `s_part[y][i]`, and Σ_b |Γ_b(ν)|²
// into `d_part[y][i]`. `pow_part[y·gridDim.x + x]` gets the block's Σ_{b, ν≠0} |G_b(ν)|² over
// the pixels with A(k_b) > 0. The DC (i = 0) is not written: every C_b(0) is the same
// d = mean_b G_b(0), which the finishing kernel puts in, and the loss leaves it out.
// `matched` = 1: the coherence loss's terms G Γ*; 0: the object's phase-only G Γ*/|Γ|.
//
// QUAD: quad_terms wherever the mirror is −ν (or the index is its own mirror). The other pairs
// (on the Nyquist lines, ~1 in 257) need the general terms, ~3× the work of a quadratic one;
// mixed into the quadratic warps they made one warp of nearly every block 3× slower and the
// block waited for it (v10: 6.7 of 14.1 cycles per instruction at the barrier). So the first
// `gen_blocks` blocks take them, from the list `hlist` (n_list entries, ssb.rs
// `general_pairs`), and the quadratic blocks x ≥ gen_blocks skip them: every block does
// uniform work. Without QUAD every thread takes the general terms (gen_blocks = 0).
// Σ of `v` over the block's threads (a power of two, ≤ 256) by a fixed tree in `red`, so the
// per-block partial is the same on every launch; the result is valid in thread 0.
__device__ double block_sum(double* red, double v) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (u32 w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
        __syncthreads();
    }
    return red[0];
}

template <int GS, bool QUAD>
__device__ void accumulate(const void* __restrict__ g, const float* __restrict__ gscale, u32 nb,
                           u32 nb_used, u32 per_slice, const float2* __restrict__ kb,
                           const float2* __restrict__ pk, const float* __restrict__ ak,
                           const unsigned char* __restrict__ cont, const float* __restrict__ fr,
                           const float* __restrict__ fc, u32 nr, u32 nc, u32 half, SsbOptics o,
                           SsbAb ab, SsbQuad q, u32 matched_flag,
                           const u32* __restrict__ hlist, u32 n_list, u32 gen_blocks,
                           float2* __restrict__ s_part, float* __restrict__ d_part,
                           double* __restrict__ pow_part) {
    const bool matched = matched_flag != 0u;
    __shared__ double red[256];
    extern __shared__ __align__(16) unsigned char acc_smem[];
    const u64 nh = (u64)nr * half, n = (u64)nr * nc;
    const u32 b_lo = blockIdx.y * per_slice;
    const u32 b_hi = min(min(nb, nb_used), b_lo + per_slice);
    const bool list = QUAD && blockIdx.x < gen_blocks;
    u32 h;
    if (list) {
        const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
        h = i < n_list ? __ldg(hlist + i) : 0u;
    } else {
        h = (blockIdx.x - (QUAD ? gen_blocks : 0u)) * blockDim.x + threadIdx.x;
    }
    Pair p;
    bool active = h < nh && h != 0;
    float vr = 0.f, vc = 0.f, vr2 = 0.f, vc2 = 0.f;
    if (active) {
        p = pair_of(h, nr, nc, half, fr, fc);
        active = p.take;
        vr = fr[p.r];
        vc = fc[p.c];
        vr2 = fr[p.rm];
        vc2 = fc[p.cm];
    }
    const bool simple = active && (!p.two || p.sym);  // a pair the quadratic terms can take
    if (QUAD) active = active && (list ? !simple : simple);
    const bool quad = QUAD && !list && active;
    QuadState qs = quad_start(vr, vc, q);
    Sums t = {make_float2(0.f, 0.f), make_float2(0.f, 0.f), 0.f, 0.f, 0.f};
    // Every thread takes part in staging the slice's tables, active or not.
    const u32 cn = b_hi > b_lo ? b_hi - b_lo : 0u;
    float4* skq = reinterpret_cast<float4*>(acc_smem);
    float2* spk = reinterpret_cast<float2*>(skq + per_slice);
    float* sgs = reinterpret_cast<float*>(spk + per_slice);
    for (u32 j = threadIdx.x; j < cn; j += blockDim.x) {
        const u32 b = b_lo + j;
        const float2 k = kb[b];
        skq[j] = make_float4(k.x, k.y, ak[b], (j > 0u && cont[b]) ? 1.f : 0.f);
        spk[j] = pk[b];
        sgs[j] = GS != GS32 ? gscale[b] : 1.f;
    }
    __syncthreads();
    const PixelTables tb = {skq, spk, sgs};
    if (cn > 0) {
        if (quad) {
            const u64 off = g_at(0, nb, h);
            if (q.soft) {
                quad_terms<GS, true>(qs, g, b_lo, cn, tb, off, vr, vc, o, q, matched);
            } else {
                quad_terms<GS, false>(qs, g, b_lo, cn, tb, off, vr, vc, o, q, matched);
            }
        } else if (active) {
            general_terms<GS>(t, g, b_lo, cn, tb, nb, h, p, vr, vc, vr2, vc2, o, ab, matched);
        }
    }
    float power = 0.f;
    if (active) {
        if (quad) {
            t.s1 = qs.s;
            t.d1 = qs.d;
            t.power = p.two ? 2.f * qs.power : qs.power;
        }
        if (p.sym) mirror_sums(t);
        power = t.power;
        float2* out = s_part + (u64)blockIdx.y * n;
        float* dout = d_part + (u64)blockIdx.y * n;
        out[(u64)p.r * nc + p.c] = t.s1;
        dout[(u64)p.r * nc + p.c] = t.d1;
        if (p.two) {
            out[(u64)p.rm * nc + p.cm] = t.s2;
            dout[(u64)p.rm * nc + p.cm] = t.d2;
        }
    }
    const double block_power = block_sum(red, (double)power);
    if (threadIdx.x == 0) pow_part[(u64)blockIdx.y * gridDim.x + blockIdx.x] = block_power;
}

#define SSB_ACCUMULATE(NAME, GS, QUAD)                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        NAME(const void* g, const float* gscale, u32 nb, u32 nb_used, u32 per_slice,            \
             const float2* kb, const float2* pk, const float* ak, const unsigned char* cont,    \
             const float* fr, const float* fc, u32 nr, u32 nc, u32 half, SsbOptics o, SsbAb ab, \
             SsbQuad q, u32 matched, const u32* hlist, u32 n_list, u32 gen_blocks,              \
             float2* s_part, float* d_part, double* pow_part) {                                 \
        accumulate<GS, QUAD>(g, gscale, nb, nb_used, per_slice, kb, pk, ak, cont, fr, fc, nr,   \
                             nc, half, o, ab, q, matched, hlist, n_list, gen_blocks, s_part,    \
                             d_part, pow_part);                                                 \
    }
// The general and the quadratic kernel of each storage: qem_ssb_accumulate_g32, _g16, _g12 and
// qem_ssb_accumulate_quad_g32, _g16, _g12.
#define SSB_ACCUMULATE_BOTH(TAG, GS)                                                            \
    SSB_ACCUMULATE(qem_ssb_accumulate_##TAG, GS, false)                                        \
    SSB_ACCUMULATE(qem_ssb_accumulate_quad_##TAG, GS, true)
SSB_ACCUMULATE_BOTH(g32, GS32)
SSB_ACCUMULATE_BOTH(g16, GS16)
SSB_ACCUMULATE_BOTH(g12, GS12)

// s[i] (+)= Σ_y s_part[y][i] in slice order (`add` = 1 continues a sum over earlier batches).
extern "C" __global__ void __launch_bounds__(256)
qem_ssb_sum_slices(const float2* __restrict__ s_part, u32 slices, u64 n, u32 add,
                   float2* __restrict__ s) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        float2 acc = add ? s[i] : make_float2(0.f, 0.f);
        for (u32 y = 0; y < slices; ++y) {
            const float2 v = s_part[(u64)y * n + i];
            acc.x += v.x;
            acc.y += v.y;
        }
        s[i] = acc;
    }
}

// Σ of term(i) over i < n, each thread its grid-stride share in order, then the block's fixed
// tree (`block_sum`): the block's partial into part[blockIdx.x], the same on every launch.
template <typename Term>
__device__ __forceinline__ void grid_partial(u64 n, double* __restrict__ part, Term term) {
    __shared__ double red[256];
    double acc = 0.0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        acc += term(i);
    }
    const double block_acc = block_sum(red, acc);
    if (threadIdx.x == 0) part[blockIdx.x] = block_acc;
}

// The coherence loss's numerator: per-block Σ_{ν≠0} |S(ν)|² / D(ν) into part[blockIdx.x], with
// S = Σ_y s_part[y] and D = Σ_y d_part[y] summed in slice order (as `qem_ssb_sum_slices`); a
// frequency with D ≤ 10⁻¹² (no pixel transfers it) adds nothing (qem_cpu GAMMA_SUM_FLOOR).
extern "C" __global__ void __launch_bounds__(256)
qem_ssb_explained(const float2* __restrict__ s_part, const float* __restrict__ d_part, u32 slices,
                  u64 n, double* __restrict__ part) {
    grid_partial(n, part, [=](u64 i) -> double {
        if (i == 0) return 0.0;
        float2 sv = make_float2(0.f, 0.f);
        float dv = 0.f;
        for (u32 y = 0; y < slices; ++y) {
            const float2 v = s_part[(u64)y * n + i];
            sv.x += v.x;
            sv.y += v.y;
            dv += d_part[(u64)y * n + i];
        }
        return dv > 1e-12f ? ((double)sv.x * sv.x + (double)sv.y * sv.y) / (double)dv : 0.0;
    });
}

// The mean spectrum: s ← s / B with s[0] = dc, and per-block Σ_{ν≠0} |s|² (the coherence
// numerator over B²) into part[blockIdx.x].
extern "C" __global__ void __launch_bounds__(256)
qem_ssb_finish(float2* __restrict__ s, u64 n, float inv_b, float dc, double* __restrict__ part) {
    __shared__ double red[256];
    double acc = 0.0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        float2 v = s[i];
        if (i == 0) {
            v = make_float2(dc, 0.f);
        } else {
            v.x *= inv_b;
            v.y *= inv_b;
            acc += (double)v.x * v.x + (double)v.y * v.y;
        }
        s[i] = v;
    }
    const double block_acc = block_sum(red, acc);
    if (threadIdx.x == 0) part[blockIdx.x] = block_acc;
}

// The corrected spectra C_b(ν) of BF pixels [b0, b0 + gridDim.y) over the full plane, DC = dc,
// into out[j][i] (j = b − b0), for the per-pixel inverse FFTs of the phase-variance loss.
template <int GS>
__device__ void corrected(const void* __restrict__ g, const float* __restrict__ gscale, u32 b0,
                          u32 nb, const float2* __restrict__ kb, const float2* __restrict__ pk,
                          const float* __restrict__ fr, const float* __restrict__ fc, u32 nr,
                          u32 nc, u32 half, SsbOptics o, SsbAb ab, float dc,
                          float2* __restrict__ out) {
    const u64 nh = (u64)nr * half, n = (u64)nr * nc;
    const u32 b = b0 + blockIdx.y;
    float2* dst = out + (u64)blockIdx.y * n;
    const float2 pkb = pk[b];
    const bool zero = pkb.x == 0.f && pkb.y == 0.f;
    const float2 k = kb[b];
    float unused_d1 = 0.f, unused_d2 = 0.f, unused_power = 0.f;
    for (u64 h = (u64)blockIdx.x * blockDim.x + threadIdx.x; h < nh;
         h += (u64)gridDim.x * blockDim.x) {
        if (h == 0) {
            dst[0] = make_float2(dc, 0.f);
            continue;
        }
        const Pair p = pair_of((u32)h, nr, nc, half, fr, fc);
        if (!p.take) continue;
        float2 c1 = make_float2(0.f, 0.f), c2 = make_float2(0.f, 0.f);
        if (!zero) {
            const float vr = fr[p.r], vc = fc[p.c];
            const float2 gv = load_g<GS>(g, gscale, b, nb, h);
            if (!pair_terms(gv, k, pkb, vr, vc, fr[p.rm], fc[p.cm], p, o, ab, false, c1, c2,
                            unused_d1, unused_d2, unused_power)) {
                c1 = c2 = make_float2(0.f, 0.f);
            }
        }
        dst[(u64)p.r * nc + p.c] = c1;
        if (p.two) dst[(u64)p.rm * nc + p.cm] = c2;
    }
}

extern "C" __global__ void __launch_bounds__(256)
qem_ssb_corrected_g32(const void* g, const float* gscale, u32 b0, u32 nb, const float2* kb,
                      const float2* pk, const float* fr, const float* fc, u32 nr, u32 nc,
                      u32 half, SsbOptics o, SsbAb ab, float dc, float2* out) {
    corrected<GS32>(g, gscale, b0, nb, kb, pk, fr, fc, nr, nc, half, o, ab, dc, out);
}

extern "C" __global__ void __launch_bounds__(256)
qem_ssb_corrected_g16(const void* g, const float* gscale, u32 b0, u32 nb, const float2* kb,
                      const float2* pk, const float* fr, const float* fc, u32 nr, u32 nc,
                      u32 half, SsbOptics o, SsbAb ab, float dc, float2* out) {
    corrected<GS16>(g, gscale, b0, nb, kb, pk, fr, fc, nr, nc, half, o, ab, dc, out);
}

extern "C" __global__ void __launch_bounds__(256)
qem_ssb_corrected_g12(const void* g, const float* gscale, u32 b0, u32 nb, const float2* kb,
                      const float2* pk, const float* fr, const float* fc, u32 nr, u32 nc,
                      u32 half, SsbOptics o, SsbAb ab, float dc, float2* out) {
    corrected<GS12>(g, gscale, b0, nb, kb, pk, fr, fc, nr, nc, half, o, ab, dc, out);
}

// s1[R] (+)= Σ_j φ_j(R), s2[R] (+)= Σ_j φ_j(R)², φ_j = arg buf[j][R], over nb inverse FFTs.
extern "C" __global__ void __launch_bounds__(256)
qem_ssb_phase_accum(const float2* __restrict__ buf, u32 nb, u64 n, u32 add,
                    double* __restrict__ s1, double* __restrict__ s2) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        double a = add ? s1[i] : 0.0, q = add ? s2[i] : 0.0;
        for (u32 j = 0; j < nb; ++j) {
            const float2 v = buf[(u64)j * n + i];
            const double ph = (double)atan2f(v.y, v.x);
            a += ph;
            q += ph * ph;
        }
        s1[i] = a;
        s2[i] = q;
    }
}

// Per-block Σ_R [s2/B − (s1/B)²] into part[blockIdx.x].
extern "C" __global__ void __launch_bounds__(256)
qem_ssb_phase_var(const double* __restrict__ s1, const double* __restrict__ s2, u64 n,
                  double inv_b, double* __restrict__ part) {
    grid_partial(n, part, [=](u64 i) -> double {
        const double m = s1[i] * inv_b;
        return s2[i] * inv_b - m * m;
    });
}

// Images of BF pixels pix[0..np) from frames [0, nf) of a dense chunk (frame_len elements per
// frame) into out[j·n_out + f0 + f], as f32: a 32 × 32 tile (frames × pixels) through shared
// memory so both the reads (pixels of a frame) and the writes (frames of a pixel) coalesce.
template <typename T, typename O>
__device__ void gather(const T* __restrict__ data, u64 frame_len, u64 nf, u64 f0, u64 n_out,
                       const u32* __restrict__ pix, u32 np, O* __restrict__ out) {
    __shared__ float tile[32][33];
    const u64 ft = (u64)blockIdx.x * 32;
    const u32 pt = blockIdx.y * 32;
    const u32 tx = threadIdx.x, ty = threadIdx.y;
    for (u32 i = ty; i < 32; i += blockDim.y) {
        const u64 f = ft + i;
        const u32 j = pt + tx;
        float v = 0.f;
        if (f < nf && j < np) v = (float)data[f * frame_len + pix[j]];
        tile[i][tx] = v;
    }
    __syncthreads();
    for (u32 i = ty; i < 32; i += blockDim.y) {
        const u32 j = pt + i;
        const u64 f = ft + tx;
        if (f < nf && j < np) out[(u64)j * n_out + f0 + f] = (O)tile[tx][i];
    }
}

extern "C" __global__ void qem_ssb_gather_u8(const unsigned char* data, u64 frame_len, u64 nf,
                                             u64 f0, u64 n_out, const u32* pix, u32 np,
                                             float* out) {
    gather(data, frame_len, nf, f0, n_out, pix, np, out);
}
extern "C" __global__ void qem_ssb_gather_u16(const u16* data, u64 frame_len, u64 nf, u64 f0,
                                              u64 n_out, const u32* pix, u32 np, float* out) {
    gather(data, frame_len, nf, f0, n_out, pix, np, out);
}
// The ENCODED route's staging: decoded u16 frames into u16 images (exact through the f32 tile).
extern "C" __global__ void qem_ssb_gather_u16_to_u16(const u16* data, u64 frame_len, u64 nf,
                                                     u64 f0, u64 n_out, const u32* pix, u32 np,
                                                     u16* out) {
    gather(data, frame_len, nf, f0, n_out, pix, np, out);
}
extern "C" __global__ void qem_ssb_gather_u32(const u32* data, u64 frame_len, u64 nf, u64 f0,
                                              u64 n_out, const u32* pix, u32 np, float* out) {
    gather(data, frame_len, nf, f0, n_out, pix, np, out);
}

// An f16 bit pattern rounded to its top 12 bits (sign, exponent, 6 mantissa bits), to nearest
// with ties away from zero; the largest finite value stays finite (|G| ≤ 60000 anyway).
__device__ __forceinline__ u32 h_to_12(u16 h) {
    const u32 mag = min((u32)(h & 0x7fffu) + 8u, 0x7bffu) >> 4;
    return ((u32)(h >> 15) << 11) | mag;
}

// `v` (already divided by the pixel's gscale for GS16, GS12) into G's storage at value `at`.
template <int GS>
__device__ __forceinline__ void g_write(void* out, u64 at, float2 v) {
    if (GS == GS32) {
        reinterpret_cast<float2*>(out)[at] = v;
    } else if (GS == GS16) {
        reinterpret_cast<ushort2*>(out)[at] = make_ushort2(f2h(v.x), f2h(v.y));
    } else {
        const u32 re = h_to_12(f2h(v.x)), im = h_to_12(f2h(v.y));
        unsigned char* tile = reinterpret_cast<unsigned char*>(out) + (at / G_TILE) * 3u * G_TILE;
        reinterpret_cast<u16*>(tile)[at % G_TILE] = (u16)((re << 4) | (im >> 8));
        tile[2u * G_TILE + at % G_TILE] = (unsigned char)(im & 0xffu);
    }
}

// A batch of np half spectra in[j][h] (cuFFT's layout) into G's tiles for pixels p0 + j: as
// float2 (GS32), as f16(in / gscale[p0 + j]) (GS16), or as that f16 rounded to 12 bits (GS12).
template <int GS>
__device__ void store(const float2* __restrict__ in, u64 nh, u32 np, u32 p0, u32 nb,
                      const float* __restrict__ gscale, void* __restrict__ out) {
    const u64 total = nh * np;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        const u64 j = i / nh;
        float2 v = in[i];
        if (GS != GS32) {
            const float inv = 1.f / gscale[p0 + j];
            v = make_float2(v.x * inv, v.y * inv);
        }
        g_write<GS>(out, g_at(p0 + j, nb, i - j * nh), v);
    }
}

extern "C" __global__ void __launch_bounds__(256)
qem_ssb_store_g32(const float2* in, u64 nh, u32 np, u32 p0, u32 nb, float2* out) {
    store<GS32>(in, nh, np, p0, nb, nullptr, out);
}
extern "C" __global__ void __launch_bounds__(256)
qem_ssb_store_g16(const float2* in, u64 nh, u32 np, u32 p0, u32 nb, const float* gscale,
                  ushort2* out) {
    store<GS16>(in, nh, np, p0, nb, gscale, out);
}
extern "C" __global__ void __launch_bounds__(256)
qem_ssb_store_g12(const float2* in, u64 nh, u32 np, u32 p0, u32 nb, const float* gscale,
                  unsigned char* out) {
    store<GS12>(in, nh, np, p0, nb, gscale, out);
}

// Counts into the f32 images the R2C reads: staged u16 images out of place, images uploaded as
// u32 counts in place (`out` == `in`: each thread reads its value before writing the same 4
// bytes, so the pointers are not restrict).
template <typename T>
__device__ __forceinline__ void counts_to_f32(const T* in, u64 n, float* out) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        const float v = (float)in[i];
        out[i] = v;
    }
}
extern "C" __global__ void __launch_bounds__(256) qem_ssb_u32_to_f32(unsigned int* buf, u64 n) {
    counts_to_f32<unsigned int>(buf, n, reinterpret_cast<float*>(buf));
}
extern "C" __global__ void __launch_bounds__(256)
qem_ssb_u16_to_f32(const u16* in, u64 n, float* out) {
    counts_to_f32<u16>(in, n, out);
}

// pk[b] = P(k_b) at the current aberrations (the same f32 probe the kernels use).
extern "C" __global__ void qem_ssb_probe_table(const float2* __restrict__ kb, u32 nb, SsbOptics o,
                                               SsbAb ab, float2* __restrict__ pk) {
    for (u32 b = blockIdx.x * blockDim.x + threadIdx.x; b < nb; b += gridDim.x * blockDim.x) {
        const float2 k = kb[b];
        pk[b] = probe(k.x, k.y, o, ab);
    }
}
