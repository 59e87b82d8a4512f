// One-pass detector reductions (qem_core::ReduceRequest; qem_cpu::products is the
// specification). Compiled after rans.cu in the same NVRTC program (products.rs concatenates
// the sources), so the ENCODED kernel reuses `rans_decode_stream<Op>`: each decoded value goes
// straight from the rANS state into the reductions and no dense frame exists in global memory.
//
// Per frame (one warp):
//   * up to MAX_BIN binary masks, given as one bit per mask in `bits[p]` (u8 per pixel): exact
//     u64 sums of the pixels whose bit is set;
//   * up to MAX_WINT integer-weighted masks, `wint[j·n + p]` (u16 weights): exact u64 sums;
//   * up to MAX_FLT float masks, `wflt[j·n + p]` (f64 weights): f64 sums;
//   * moments S = Σ v, m_row = Σ row·v, m_col = Σ col·v (u64);
// and over all frames:
//   * the sum DP, accumulated per CTA in shared u32 (`SUM_SHARED`: a CTA sums at most 65537
//     frames of u16 values, checked by the host, so a u32 cannot wrap) and added to the u64
//     result once at the end, or straight into the u64 result with global atomics;
//   * the max DP, per CTA in shared u32 (`MAX_SHARED`) or with global atomics after a plain
//     read (the result only grows, so a stale read costs an atomic, never a wrong answer).
// Per-frame results go to slot k of each output (k = position in the visited list).

#define MAX_BIN 8
#define MAX_WINT 2
#define MAX_FLT 2
#define SUM_SHARED 1u
#define MAX_SHARED 2u

struct ProdArgs {
    const u8* __restrict__ bits;     // n bytes, bit j = binary mask j (null when n_bin = 0)
    const u16* __restrict__ wint;    // n_wint × n weights
    const double* __restrict__ wflt; // n_flt × n weights
    const u64* __restrict__ frames;  // visited frame indices (null: first + k)
    u64* img_int;                    // (n_bin + n_wint) × count
    double* img_flt;                 // n_flt × count
    u64* mom;                        // 3 × count (S, m_row, m_col), or null
    u64* sum_dp;                     // n, or null
    u32* max_dp;                     // n, or null
    u64 first, count;
    u32 n, kc, n_bin, n_wint, n_flt, flags;
};

// The per-lane accumulators, fed one value at a time; `row`/`col` of the lane's pixel are
// tracked incrementally by the caller. `A` holds the plain sums (binary masks, S): u32 for
// u8/u16 values — a lane sees at most ⌈n/32⌉ ≤ 2048 pixels (n ≤ 2^16, checked by the host), and
// 2048 · 65535 < 2^32 — saving registers, u64 for u32 values. Weighted sums and the moments
// are u64 per lane; every sum is widened to u64 before the warp reduction.
template <class A>
struct ProdAcc {
    A bin[MAX_BIN];
    u64 wi[MAX_WINT];
    double fl[MAX_FLT];
    A s;
    u64 mr, mc;
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int j = 0; j < MAX_BIN; ++j) bin[j] = 0;
#pragma unroll
        for (int j = 0; j < MAX_WINT; ++j) wi[j] = 0ull;
#pragma unroll
        for (int j = 0; j < MAX_FLT; ++j) fl[j] = 0.0;
        s = 0;
        mr = mc = 0ull;
    }
    __device__ __forceinline__ void add(const ProdArgs& a, u32* ssum, u32* smax, u32 p, u32 row,
                                        u32 col, u32 v) {
        if (a.n_bin) {
            const u32 b = __ldg(a.bits + p);
#pragma unroll
            for (int j = 0; j < MAX_BIN; ++j)
                if ((b >> j) & 1u) bin[j] += (A)v;
        }
#pragma unroll
        for (int j = 0; j < MAX_WINT; ++j)
            if ((u32)j < a.n_wint) wi[j] += (u64)v * __ldg(a.wint + (u64)j * a.n + p);
#pragma unroll
        for (int j = 0; j < MAX_FLT; ++j)
            if ((u32)j < a.n_flt) fl[j] += (double)v * __ldg(a.wflt + (u64)j * a.n + p);
        if (a.mom) {
            s += (A)v;
            mr += (u64)row * v;
            mc += (u64)col * v;
        }
        if (v) {
            if (ssum) {
                atomicAdd(ssum + p, v);
            } else if (a.sum_dp) {
                atomicAdd((unsigned long long*)(a.sum_dp + p), (unsigned long long)v);
            }
            if (smax) {
                atomicMax(smax + p, v);
            } else if (a.max_dp && v > *((volatile u32*)(a.max_dp + p))) {
                atomicMax(a.max_dp + p, v);
            }
        }
    }
    // Warp-reduce and store slot k (lane 0 writes).
    __device__ __forceinline__ void store(const ProdArgs& a, u64 k, u32 lane) {
#pragma unroll
        for (int j = 0; j < MAX_BIN; ++j) {
            if ((u32)j < a.n_bin) {
                const u64 t = warp_sum_u64((u64)bin[j]);
                if (lane == 0u) a.img_int[(u64)j * a.count + k] = t;
            }
        }
#pragma unroll
        for (int j = 0; j < MAX_WINT; ++j) {
            if ((u32)j < a.n_wint) {
                const u64 t = warp_sum_u64(wi[j]);
                if (lane == 0u) a.img_int[(u64)(a.n_bin + j) * a.count + k] = t;
            }
        }
#pragma unroll
        for (int j = 0; j < MAX_FLT; ++j) {
            if ((u32)j < a.n_flt) {
                double t = fl[j];
                for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(FULL_MASK, t, o);
                if (lane == 0u) a.img_flt[(u64)j * a.count + k] = t;
            }
        }
        if (a.mom) {
            const u64 ts = warp_sum_u64((u64)s), tr = warp_sum_u64(mr), tc = warp_sum_u64(mc);
            if (lane == 0u) {
                a.mom[k] = ts;
                a.mom[a.count + k] = tr;
                a.mom[2ull * a.count + k] = tc;
            }
        }
    }
};

// Shared accumulators after the model tables (ENCODED) or at the start (dense).
__device__ __forceinline__ void prod_shared_init(const ProdArgs& a, u32* base, u32*& ssum,
                                                 u32*& smax) {
    ssum = (a.flags & SUM_SHARED) ? base : nullptr;
    smax = (a.flags & MAX_SHARED) ? base + ((a.flags & SUM_SHARED) ? a.n : 0u) : nullptr;
    const u32 words = ((a.flags & SUM_SHARED) ? a.n : 0u) + ((a.flags & MAX_SHARED) ? a.n : 0u);
    for (u32 i = threadIdx.x; i < words; i += blockDim.x) base[i] = 0u;
    __syncthreads();
}

__device__ __forceinline__ void prod_shared_flush(const ProdArgs& a, const u32* ssum,
                                                  const u32* smax) {
    __syncthreads();
    for (u32 p = threadIdx.x; p < a.n; p += blockDim.x) {
        if (ssum && ssum[p]) atomicAdd((unsigned long long*)(a.sum_dp + p), (unsigned long long)ssum[p]);
        if (smax && smax[p]) atomicMax(a.max_dp + p, smax[p]);
    }
}

// The functor `rans_decode_stream` calls for each decoded pixel p (p = 32·t + lane, ascending
// per lane, so row/col advance by 32 pixels per call).
struct ProdDecodeOp {
    const ProdArgs* a;
    ProdAcc<u32>* acc;
    u32* ssum;
    u32* smax;
    u32 row, col;
    __device__ __forceinline__ void value(u32 p, u32 v) {
        acc->add(*a, ssum, smax, p, row, col, v);
        col += 32u;
        while (col >= a->kc) {
            col -= a->kc;
            ++row;
        }
    }
};

extern "C" __global__ void qem_products_encoded(const u8* __restrict__ arena, u64 arena_len,
                                                const u32* __restrict__ index, RansModel m,
                                                ProdArgs a, u32* err) {
    extern __shared__ __align__(16) u32 smem_p[];
    m = stage_model(m, smem_p);
    const u32 tab_words = m.T * m.C * m.S + ((m.T * m.C * LUT_PER_ROW) >> 2);
    u32 *ssum, *smax;
    prod_shared_init(a, smem_p + tab_words, ssum, smax);
    const u32 lane = threadIdx.x & 31u;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 k = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); k < a.count;
         k += warps) {
        const u64 i = a.frames ? __ldg(a.frames + k) : a.first + k;
        const u8* st;
        u64 len;
        u32 ea = 0u, eb = 0u, code;
        ProdAcc<u32> acc;
        acc.zero();
        if (!stream_at(arena, arena_len, index, i, st, len)) {
            code = R_INDEX;
        } else {
            ProdDecodeOp op{&a, &acc, ssum, smax, lane / a.kc, lane % a.kc};
            code = rans_decode_stream(st, len, m, lane, op, ea, eb);
        }
        if (code != R_OK && lane == 0u) rans_report(err, i, code, ea, eb);
        acc.store(a, k, lane);
    }
    prod_shared_flush(a, ssum, smax);
}

template <class T> struct AccOf { typedef u32 type; };
template <> struct AccOf<u32> { typedef u64 type; };

// Dense frames of T (u8, u16 or u32), frame stride n, pixels [p_lo, p_hi) of each frame (the
// union of the masks' support when nothing else needs the whole frame). One warp per frame.
template <class T>
__device__ __forceinline__ void products_dense(const T* __restrict__ data, ProdArgs& a,
                                               u32 p_lo, u32 p_hi) {
    extern __shared__ __align__(16) u32 smem_q[];
    u32 *ssum, *smax;
    prod_shared_init(a, smem_q, ssum, smax);
    const u32 lane = threadIdx.x & 31u;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 k = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); k < a.count;
         k += warps) {
        const u64 i = a.frames ? __ldg(a.frames + k) : a.first + k;
        const T* __restrict__ fr = data + i * (u64)a.n;
        ProdAcc<typename AccOf<T>::type> acc;
        acc.zero();
        if (sizeof(T) == 2 && (a.n & 7u) == 0u && (p_lo & 7u) == 0u && ((u64)data & 15ull) == 0ull) {
            // 16-byte loads of 8 pixels per lane.
            const uint4* f8 = (const uint4*)fr;
            const u32 g_hi = (p_hi + 7u) >> 3;
            for (u32 g = (p_lo >> 3) + lane; g < g_hi; g += 32u) {
                const uint4 q = __ldcs(f8 + g);
                const u32 w[4] = {q.x, q.y, q.z, q.w};
                const u32 p0 = g << 3;
                u32 row = p0 / a.kc, col = p0 - row * a.kc;
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const u32 v = (w[e >> 1] >> (16 * (e & 1))) & 0xffffu;
                    acc.add(a, ssum, smax, p0 + e, row, col, v);
                    if (++col == a.kc) {
                        col = 0u;
                        ++row;
                    }
                }
            }
        } else {
            u32 p = p_lo + lane;
            u32 row = p / a.kc, col = p - row * a.kc;
            for (; p < p_hi; p += 32u) {
                acc.add(a, ssum, smax, p, row, col, (u32)__ldcs(fr + p));
                col += 32u;
                while (col >= a.kc) {
                    col -= a.kc;
                    ++row;
                }
            }
        }
        acc.store(a, k, lane);
    }
    prod_shared_flush(a, ssum, smax);
}

extern "C" __global__ void qem_products_dense_u8(const u8* __restrict__ data, ProdArgs a,
                                                 u32 p_lo, u32 p_hi) {
    products_dense<u8>(data, a, p_lo, p_hi);
}

extern "C" __global__ void qem_products_dense_u16(const u16* __restrict__ data, ProdArgs a,
                                                  u32 p_lo, u32 p_hi) {
    products_dense<u16>(data, a, p_lo, p_hi);
}

extern "C" __global__ void qem_products_dense_u32(const u32* __restrict__ data, ProdArgs a,
                                                  u32 p_lo, u32 p_hi) {
    products_dense<u32>(data, a, p_lo, p_hi);
}
