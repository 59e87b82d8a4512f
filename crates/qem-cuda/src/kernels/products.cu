// One-pass detector reductions (qem_core::ReduceRequest; qem_cpu::products is the
// specification). Compiled after rans.cu in the same NVRTC program (products.rs concatenates
// the sources), so the ENCODED kernel reuses `rans_decode_stream<Op>`: each decoded value goes
// straight from the rANS state into the reductions and no dense frame exists in global memory.
//
// The module is specialised per request shape by defines (products.rs compiles each shape
// once; NVRTC's CUBIN cache keeps it on disk), so a value costs only the work asked for:
//   PROD_NBIN  0..8  binary masks, one bit per mask in `bits[p]`: exact sums
//   PROD_NWINT 0..2  integer-weighted masks `wint[j·n + p]` (u16 weights): exact u64 sums
//   PROD_NFLT  0..2  float masks `wflt[j·n + p]` (f64 weights): f64 sums
//   PROD_MOM   0/1   moments S = Σ v, m_row = Σ row·v, m_col = Σ col·v
//   PROD_SUM   0/1/2 sum DP: none / per CTA in shared u32, added to the u64 result at the
//                    CTA's end (a CTA sums at most 65536 frames of u16 values — the host sizes
//                    the grid — so a u32 cannot wrap) / global u64 atomics
//   PROD_MAX   0/1/2 max DP: none / per CTA in shared u32 / global atomics after a plain read
//                    (the result only grows: a stale read costs an atomic, never a wrong answer)
//   PROD_WIDE  0/1   1 for u32 values: lane sums in u64 (else u32, see ProdAcc)
//   PROD_ROWACC 0/1  moments summed per detector row in u32 and flushed to u64 when the lane's
//                    row changes (the host allows it for ≤ u16 values and k_c ≤ 1024: a lane then
//                    sees at most 40 values of a row — ⌈k_c/32⌉ one at a time, or 8 per 16-byte
//                    group with at most ⌈k_c/256⌉ + 1 groups — so Σ col·v < 40·1023·65535 < 2^32)
//   PROD_GROUP4 0/1  ENCODED: the binary masks and moments of each full group of four steps
//                    at once (ProdDecodeOp::group_done, two values per dp2a); the host sets it
//                    when there are no moments or kc ≥ 128 (≤ one row change per lane and group)
//   PROD_ROWFLAG 0/1 ENCODED with PROD_GROUP4 and moments: a group's rows from bits 6 and 7
//                    of its mask bytes (products.rs `row_flag_bits`: bit 7 = the pixel is one
//                    row below the lane's first pixel of the group, bit 6 of that first
//                    pixel = the next group starts one row below), not from a tracked column;
//                    the host sets it with at most 6 binary masks
//   PROD_WARPS       warps per CTA (launch bounds)
// Per-frame results go to slot k of each output (k = position in the visited list).
// Dense u16 frames are read as 16-byte groups of 8 pixels; with kc % 8 == 0 a group lies in one
// detector row and its binary masks and moments go two pixels per dp2a (ProdAcc::group8_u16).

#ifndef PROD_NBIN
#define PROD_NBIN 0
#endif
#ifndef PROD_NWINT
#define PROD_NWINT 0
#endif
#ifndef PROD_NFLT
#define PROD_NFLT 0
#endif
#ifndef PROD_MOM
#define PROD_MOM 0
#endif
#ifndef PROD_SUM
#define PROD_SUM 0
#endif
#ifndef PROD_MAX
#define PROD_MAX 0
#endif
#ifndef PROD_WIDE
#define PROD_WIDE 0
#endif
#ifndef PROD_ROWACC
#define PROD_ROWACC 0
#endif
#ifndef PROD_WARPS
#define PROD_WARPS 8
#endif
#ifndef PROD_GROUP4
#define PROD_GROUP4 0
#endif
#ifndef PROD_ROWFLAG
#define PROD_ROWFLAG 0
#endif

#define PROD_ARR(n) ((n) > 0 ? (n) : 1)

struct ProdArgs {
    const u8* __restrict__ bits;     // n bytes, bit j = binary mask j
    const u16* __restrict__ wint;    // PROD_NWINT × n weights
    const double* __restrict__ wflt; // PROD_NFLT × n weights
    const u64* __restrict__ frames;  // visited frame indices (null: first + k)
    u64* img_int;                    // (PROD_NBIN + PROD_NWINT) × count
    double* img_flt;                 // PROD_NFLT × count
    u64* mom;                        // 3 × count (S, m_row, m_col)
    u64* sum_dp;                     // n
    u32* max_dp;                     // n
    // ENCODED: per group g and lane, {ctx4 word, mask-bits word} (products.rs `class_bits4`):
    // the decoder's classes and the masks of the same four pixels in one 8-byte load.
    const uint2* __restrict__ cb4;
    u64 first, count;
    u32 n, kc;
    u32 kc_magic;  // ⌊2^32 / kc⌋ + 1 when kc % 8 == 0: row = umulhi(p, kc_magic) (products.rs)
    u32 pad1, pad2, pad3;
};

#if PROD_WIDE
typedef u64 acc_t;
#else
// A lane sees at most ⌈n/32⌉ ≤ 2048 pixels of a frame (n ≤ 2^16, checked by the host) and
// 2048 · 65535 < 2^32, so u32 lane sums of u8/u16 values are exact; fewer registers.
typedef u32 acc_t;
#endif

// The per-lane accumulators, fed one value at a time with the lane's pixel (row, col).
struct ProdAcc {
    acc_t bin[PROD_ARR(PROD_NBIN)];
    u64 wi[PROD_ARR(PROD_NWINT)];
    double fl[PROD_ARR(PROD_NFLT)];
    u64 s, mr, mc;
    // The dense 8-pixel groups' Σ v and Σ e·v (e = the pixel's place in its group), per lane
    // and frame: ≤ 256 groups (n ≤ 2^16) · 28 · 65535 < 2^32, folded into s and mc by store().
    u32 s32, c32;
    // The ENCODED full groups' moments (PROD_GROUP4), per lane: Σ v, Σ t·v (t = the step) and
    // Σ row·v; store() turns them into S, m_row and m_col with col = 32·t + lane − kc·row.
    u32 gs;
    u64 gt, gr;
#if PROD_ROWACC
    u32 rs, cs, cur;
#endif
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int j = 0; j < PROD_NBIN; ++j) bin[j] = 0;
#pragma unroll
        for (int j = 0; j < PROD_NWINT; ++j) wi[j] = 0ull;
#pragma unroll
        for (int j = 0; j < PROD_NFLT; ++j) fl[j] = 0.0;
        s = mr = mc = 0ull;
        s32 = c32 = 0u;
        gs = 0u;
        gt = gr = 0ull;
#if PROD_ROWACC
        rs = cs = 0u;
        cur = 0u;
#endif
    }
#if PROD_ROWACC
    __device__ __forceinline__ void flush_row() {
        s += rs;
        mr += (u64)cur * rs;
        mc += cs;
        rs = cs = 0u;
    }
#endif
    __device__ __forceinline__ void add(const ProdArgs& a, u32* ssum, u32* smax, u32 p, u32 row,
                                        u32 col, u32 v) {
        mom_value(row, col, v);
        add_rest(a, ssum, smax, p, v);
    }
    // The moments of one value.
    __device__ __forceinline__ void mom_value(u32 row, u32 col, u32 v) {
#if PROD_MOM
#if PROD_ROWACC
        if (row != cur) {
            flush_row();
            cur = row;
        }
        rs += v;
        cs += col * v;
#else
        s += v;
        mr += (u64)row * v;
        mc += (u64)col * v;
#endif
#endif
        (void)row;
        (void)col;
        (void)v;
    }
    // The binary masks and moments of one 16-byte group of 8 u16 pixels p0..p0+7 that lie in
    // one detector row starting at (row, col): each u32 word holds two pixels (low half
    // first) and `dp2a` multiplies both halves by two bytes and adds, so a mask's 8 terms are
    // four instructions (its bit of each pixel's mask byte `b8`, moved to bit 0 of a byte)
    // and the moments eight: Σ (col + e)·v_e = col·Σ v_e + Σ e·v_e.
    __device__ __forceinline__ void group8_u16(u32 row, u32 col, const uint4& q, uint2 b8) {
#if PROD_NBIN > 0
#pragma unroll
        for (int j = 0; j < PROD_NBIN; ++j) {
            const u32 lo = (b8.x >> j) & 0x01010101u, hi = (b8.y >> j) & 0x01010101u;
            u32 t = __dp2a_lo(q.x, lo, 0u);
            t = __dp2a_hi(q.y, lo, t);
            t = __dp2a_lo(q.z, hi, t);
            t = __dp2a_hi(q.w, hi, t);
            bin[j] += (acc_t)t;
        }
#endif
#if PROD_MOM
        u32 s8 = __dp2a_lo(q.x, 0x0101u, 0u);
        s8 = __dp2a_lo(q.y, 0x0101u, s8);
        s8 = __dp2a_lo(q.z, 0x0101u, s8);
        s8 = __dp2a_lo(q.w, 0x0101u, s8);
        c32 = __dp2a_lo(q.x, 0x0100u, c32);
        c32 = __dp2a_lo(q.y, 0x0302u, c32);
        c32 = __dp2a_lo(q.z, 0x0504u, c32);
        c32 = __dp2a_lo(q.w, 0x0706u, c32);
        s32 += s8;
        mr += (u64)row * s8;
        mc += (u64)col * s8;
#endif
        (void)row;
        (void)col;
        (void)q;
        (void)b8;
    }
    // Everything but the moments.
    __device__ __forceinline__ void add_rest(const ProdArgs& a, u32* ssum, u32* smax, u32 p,
                                             u32 v) {
#if PROD_NBIN > 0
        add_rest_b(a, ssum, smax, p, v, __ldg(a.bits + p));
#else
        add_rest_b(a, ssum, smax, p, v, 0u);
#endif
    }
    // `add_rest` with the pixel's mask bits `b` given.
    __device__ __forceinline__ void add_rest_b(const ProdArgs& a, u32* ssum, u32* smax, u32 p,
                                               u32 v, u32 b) {
#if PROD_NBIN > 0
#pragma unroll
        for (int j = 0; j < PROD_NBIN; ++j)
            if ((b >> j) & 1u) bin[j] += (acc_t)v;
#endif
        add_others(a, ssum, smax, p, v);
        (void)b;
    }
    // The weighted masks, sum DP and max DP of one value. SKIP0: no shared sum-DP atomic for
    // v = 0 (the dense path, bound by memory; the ENCODED one, bound by issue, adds the 0
    // rather than branch around it).
    // SUM = false leaves the sum DP to the caller (ProdDecodeOp::group_done).
    template <bool SKIP0 = true, bool SUM = true>
    __device__ __forceinline__ void add_others(const ProdArgs& a, u32* ssum, u32* smax, u32 p,
                                               u32 v) {
#pragma unroll
        for (int j = 0; j < PROD_NWINT; ++j) wi[j] += (u64)v * __ldg(a.wint + (u64)j * a.n + p);
#pragma unroll
        for (int j = 0; j < PROD_NFLT; ++j) fl[j] += (double)v * __ldg(a.wflt + (u64)j * a.n + p);
#if PROD_SUM == 1
        if (SUM && (!SKIP0 || v)) atomicAdd(ssum + p, v);
#elif PROD_SUM == 2
        if (v) atomicAdd((unsigned long long*)(a.sum_dp + p), (unsigned long long)v);
#endif
#if PROD_MAX == 1
        if (v) atomicMax(smax + p, v);
#elif PROD_MAX == 2
        if (v && v > *((volatile u32*)(a.max_dp + p))) atomicMax(a.max_dp + p, v);
#endif
        (void)ssum;
        (void)smax;
    }
    // Warp-reduce and store slot k (lane 0 writes).
    __device__ __forceinline__ void store(const ProdArgs& a, u64 k, u32 lane) {
#pragma unroll
        for (int j = 0; j < PROD_NBIN; ++j) {
            const u64 t = warp_sum_u64((u64)bin[j]);
            if (lane == 0u) a.img_int[(u64)j * a.count + k] = t;
        }
#pragma unroll
        for (int j = 0; j < PROD_NWINT; ++j) {
            const u64 t = warp_sum_u64(wi[j]);
            if (lane == 0u) a.img_int[(u64)(PROD_NBIN + j) * a.count + k] = t;
        }
#pragma unroll
        for (int j = 0; j < PROD_NFLT; ++j) {
            double t = fl[j];
            for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(FULL_MASK, t, o);
            if (lane == 0u) a.img_flt[(u64)j * a.count + k] = t;
        }
#if PROD_MOM
#if PROD_ROWACC
        flush_row();
#endif
        s += s32;
        mc += c32;
        s += gs;
        mr += gr;
        mc += 32ull * gt + (u64)lane * gs - (u64)a.kc * gr;
        const u64 ts = warp_sum_u64(s), tr = warp_sum_u64(mr), tc = warp_sum_u64(mc);
        if (lane == 0u) {
            a.mom[k] = ts;
            a.mom[a.count + k] = tr;
            a.mom[2ull * a.count + k] = tc;
        }
#endif
        (void)a;
        (void)k;
        (void)lane;
    }
};

// Shared accumulators at `base`: the sum DP first (PROD_SUM == 1), then the max DP.
// Returns the words they take.
__device__ __forceinline__ u32 prod_shared_init(const ProdArgs& a, u32* base, u32*& ssum,
                                                u32*& smax) {
    ssum = nullptr;
    smax = nullptr;
    u32 words = 0u;
#if PROD_SUM == 1
    ssum = base;
    words += a.n;
#endif
#if PROD_MAX == 1
    smax = base + words;
    words += a.n;
#endif
    for (u32 i = threadIdx.x; i < words; i += blockDim.x) base[i] = 0u;
    if (words) __syncthreads();
    return words;
}

__device__ __forceinline__ void prod_shared_flush(const ProdArgs& a, const u32* ssum,
                                                  const u32* smax) {
#if PROD_SUM == 1 || PROD_MAX == 1
    __syncthreads();
    for (u32 p = threadIdx.x; p < a.n; p += blockDim.x) {
#if PROD_SUM == 1
        if (ssum[p]) atomicAdd((unsigned long long*)(a.sum_dp + p), (unsigned long long)ssum[p]);
#endif
#if PROD_MAX == 1
        if (smax[p]) atomicMax(a.max_dp + p, smax[p]);
#endif
    }
#endif
    (void)a;
    (void)ssum;
    (void)smax;
}

// The functor `rans_decode_stream` calls for each decoded pixel p (p = 32·t + lane, ascending
// per lane, so (row, col) advance by 32 pixels per call). The mask bits come from `cb4`, one
// coalesced load per group of four steps.
struct ProdDecodeOp {
    // The host checks n ≤ 2^16 (qem_core::reduce::MAX_FRAME_PIXELS): rans_run needs no flush.
    static constexpr bool kSmallFrames = true;
    const ProdArgs* a;
    ProdAcc* acc;
    u32* ssum;
    u32* smax;
    u32 row, col;  // of the lane's next pixel (with PROD_GROUP4: of the group's first)
    u32 lane;
    u32 bw;        // the group's mask bits, byte j for step j
    u32 bw_next;   // the next group's, loaded one group ahead (cb4 has a zero group past
                   // the last, like ctx4)
    u32 g;         // the group
    u32 vv[4];     // the group's values, step j in vv[j] (registers: j is constant)
    u32 ssum_lane; // shared address of the lane's first pixel in the sum DP (PROD_SUM == 1)
    // rans_run's fetch of group gi, one group ahead: the class word and mask bits of group
    // gi in one load; the bits of the group before move to bw (group() comes after the fetch
    // of the next group).
    __device__ __forceinline__ u32 fetch(const RansModel& m, u32 gi, u32 ln) {
#if PROD_NBIN > 0 || PROD_ROWFLAG
        const uint2 q = __ldg(a->cb4 + (gi << 5) + ln);
        bw = bw_next;
        bw_next = q.y;
        return q.x;
#else
        return __ldg(m.ctx4 + (gi << 5) + ln);
#endif
    }
    __device__ __forceinline__ void group(u32 gi) { g = gi; }
    __device__ __forceinline__ void value_full(u32 p, u32 v, u32 j) {
#if PROD_GROUP4
        acc->template add_others<false, false>(*a, ssum, smax, p, v);
        vv[j] = v;
        if (j == 3u) group_done();
#else
        value(p, v, j);
#endif
    }
    // The binary masks and moments of the four values of group g (steps t = 4g + j, pixels
    // 32t + lane), two per dp2a (each u32 holds two values; the decoder's values are u16 — one
    // above 65535 fails the stream, and its results are not used).
    __device__ __forceinline__ void group_done() {
#if PROD_SUM == 1
        // The group's four shared sum-DP atomics from one address (pixels 128g + 32j + lane),
        // the steps as immediate offsets; zeros are added too (no branch on this issue-bound
        // path).
        const u32 sa = ssum_lane + (g << 9);
        asm volatile("red.shared.add.u32 [%0], %1;" ::"r"(sa), "r"(vv[0]));
        asm volatile("red.shared.add.u32 [%0+128], %1;" ::"r"(sa), "r"(vv[1]));
        asm volatile("red.shared.add.u32 [%0+256], %1;" ::"r"(sa), "r"(vv[2]));
        asm volatile("red.shared.add.u32 [%0+384], %1;" ::"r"(sa), "r"(vv[3]));
#endif
        const u32 q01 = vv[0] | (vv[1] << 16), q23 = vv[2] | (vv[3] << 16);
#if PROD_NBIN > 0
#pragma unroll
        for (int m = 0; m < PROD_NBIN; ++m) {
            const u32 mb = (bw >> m) & 0x01010101u;
            acc->bin[m] += (acc_t)__dp2a_hi(q23, mb, __dp2a_lo(q01, mb, 0u));
        }
#endif
#if PROD_MOM
        const u32 s4 = __dp2a_hi(q23, 0x01010000u, __dp2a_lo(q01, 0x00000101u, 0u));
        const u32 jv = __dp2a_hi(q23, 0x03020000u, __dp2a_lo(q01, 0x00000100u, 0u));
        acc->gs += s4;
        acc->gt += (u64)((g << 2) * s4 + jv);  // t ≤ 2047, so < 2^32
#if PROD_ROWFLAG
        // Byte j of dl is 1 when step j lies one row below the group's first pixel.
        const u32 dl = (bw >> 7) & 0x01010101u;
        const u32 ds = __dp2a_hi(q23, dl, __dp2a_lo(q01, dl, 0u));
        acc->gr += (u64)(row * s4 + ds);  // row ≤ 512, so < 2^32
        row += (bw >> 6) & 1u;
#else
        // With kc ≥ 128 the group's pixels lie in rows `row` and `row + 1`: steps j ≥ jb are in
        // the next row, jb = ⌈(kc − col)/32⌉ ≥ 1.
        const u32 jb = (a->kc - col + 31u) >> 5;
        const u32 dl = jb >= 4u ? 0u : 0x01010101u << (8u * jb);
        const u32 ds = __dp2a_hi(q23, dl, __dp2a_lo(q01, dl, 0u));
        acc->gr += (u64)(row * s4 + ds);  // row ≤ 512, so < 2^32
        col += 128u;
        const bool wrap = col >= a->kc;
        col -= wrap ? a->kc : 0u;
        row += (u32)wrap;
#endif
#endif
    }
    __device__ __forceinline__ void value(u32 p, u32 v, u32 j) {
#if PROD_ROWFLAG
        // Only the tail (< 4 steps) comes here; the full groups tracked no column.
        row = p / a->kc;
        col = p - row * a->kc;
#endif
        acc->mom_value(row, col, v);
        acc->add_rest_b(*a, ssum, smax, p, v, (bw >> (8u * j)) & 0xffu);
#if PROD_MOM
        col += 32u;
        while (col >= a->kc) {
            col -= a->kc;
            ++row;
        }
#endif
    }
    __device__ __forceinline__ void finish() {}
};

// ENCODED: at least 32 / PROD_WARPS CTAs per SM (≤ 64 registers: 32 warps), as the
// decode is latency-bound and wants the warps more than the registers.
extern "C" __global__ void __launch_bounds__(PROD_WARPS * 32, 32 / PROD_WARPS)
    qem_products_encoded(const u8* __restrict__ arena, u64 arena_len,
                         const u32* __restrict__ index, RansModel m, ProdArgs a, u32* err) {
    extern __shared__ __align__(16) u32 smem_p[];
    // The shared sums first (their address is then the window's own), the tables after them.
    u32 *ssum, *smax;
    const u32 shared_words = prod_shared_init(a, smem_p, ssum, smax);
    m = stage_model(m, smem_p + shared_words);
    const u32 lane = threadIdx.x & 31u;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 k = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); k < a.count;
         k += warps) {
        const u64 i = a.frames ? __ldg(a.frames + k) : a.first + k;
        const u8* st;
        u64 len;
        u32 ea = 0u, eb = 0u, code;
        ProdAcc acc;
        acc.zero();
        if (!stream_at(arena, arena_len, index, i, st, len)) {
            code = R_INDEX;
        } else {
            ProdDecodeOp op{&a, &acc, ssum, smax, lane / a.kc, lane % a.kc, lane, 0u};
#if PROD_SUM == 1
            op.ssum_lane = (u32)__cvta_generic_to_shared(ssum) + 4u * lane;
#endif
#if PROD_ROWACC
            acc.cur = op.row;
#endif
            code = rans_decode_stream(st, len, m, lane, op, ea, eb);
        }
        if (code != R_OK && lane == 0u) rans_report(err, i, code, ea, eb);
        acc.store(a, k, lane);
    }
    prod_shared_flush(a, ssum, smax);
}

// Dense frames of T, pixels [p_lo, p_hi) of each frame (the union of the masks' support when
// nothing else needs the whole frame; p_lo a multiple of 8). One warp per frame; u16 frames
// whose stride allows it are read with 16-byte loads, PROD_UNROLL of them in flight per lane.
#define PROD_UNROLL 4
template <class T>
__device__ __forceinline__ void products_dense(const T* __restrict__ data, const ProdArgs& a,
                                               u32 p_lo, u32 p_hi) {
    extern __shared__ __align__(16) u32 smem_q[];
    u32 *ssum, *smax;
    prod_shared_init(a, smem_q, ssum, smax);
    const u32 lane = threadIdx.x & 31u;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    const bool vec = sizeof(T) == 2 && (a.n & 7u) == 0u && ((u64)data & 15ull) == 0ull;
    for (u64 k = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); k < a.count;
         k += warps) {
        const u64 i = a.frames ? __ldg(a.frames + k) : a.first + k;
        const T* __restrict__ fr = data + i * (u64)a.n;
        ProdAcc acc;
        acc.zero();
        if (vec) {
            const uint4* f8 = (const uint4*)fr;
            const u32 g_lo = p_lo >> 3, g_hi = (p_hi + 7u) >> 3;
            // With kc % 8 == 0 no group straddles two detector rows (p0 is a multiple of 8),
            // so a group's masks and moments take the packed path (group8_u16).
#if PROD_MOM
            const bool packed = (a.kc & 7u) == 0u;
#else
            const bool packed = true;
#endif
#if PROD_ROWACC
            acc.cur = (g_lo + lane) * 8u / a.kc;
#endif
            for (u32 g0 = g_lo + lane; g0 < g_hi; g0 += 32u * PROD_UNROLL) {
                uint4 q[PROD_UNROLL];
#pragma unroll
                for (int u = 0; u < PROD_UNROLL; ++u) {
                    const u32 g = g0 + 32u * u;
                    q[u] = g < g_hi ? __ldcs(f8 + g) : make_uint4(0u, 0u, 0u, 0u);
                }
#pragma unroll
                for (int u = 0; u < PROD_UNROLL; ++u) {
                    const u32 g = g0 + 32u * u;
                    if (g >= g_hi) break;
                    const u32 p0 = g << 3;
                    // The group's eight mask bytes in one 8-byte load (p0 is a multiple of 8
                    // and the bits buffer is 8-aligned), not one load per value.
                    uint2 bw = make_uint2(0u, 0u);
#if PROD_NBIN > 0
                    bw = __ldg(reinterpret_cast<const uint2*>(a.bits) + g);
#endif
                    const u32 w[4] = {q[u].x, q[u].y, q[u].z, q[u].w};
                    u32 v8[8];
#pragma unroll
                    for (int e = 0; e < 8; ++e) v8[e] = (w[e >> 1] >> (16 * (e & 1))) & 0xffffu;
                    if (packed) {
                        u32 row = 0u, col = 0u;
#if PROD_MOM
                        row = __umulhi(p0, a.kc_magic);
                        col = p0 - row * a.kc;
#endif
                        acc.group8_u16(row, col, q[u], bw);
#if PROD_NWINT > 0 || PROD_NFLT > 0 || PROD_SUM > 0 || PROD_MAX > 0
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc.add_others(a, ssum, smax, p0 + e, v8[e]);
#endif
                        continue;
                    }
                    const u32 b8[2] = {bw.x, bw.y};
                    u32 row = p0 / a.kc;
                    u32 col = p0 - row * a.kc;
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        acc.mom_value(row, col, v8[e]);
                        acc.add_rest_b(a, ssum, smax, p0 + e, v8[e],
                                       (b8[e >> 2] >> (8 * (e & 3))) & 0xffu);
                        if (++col == a.kc) {
                            col = 0u;
                            ++row;
                        }
                    }
                }
            }
        } else {
            u32 p = p_lo + lane;
            u32 row = p / a.kc, col = p - row * a.kc;
#if PROD_ROWACC
            acc.cur = row;
#endif
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

extern "C" __global__ void __launch_bounds__(PROD_WARPS * 32)
    qem_products_dense_u8(const u8* __restrict__ data, ProdArgs a, u32 p_lo, u32 p_hi) {
    products_dense<u8>(data, a, p_lo, p_hi);
}

extern "C" __global__ void __launch_bounds__(PROD_WARPS * 32)
    qem_products_dense_u16(const u16* __restrict__ data, ProdArgs a, u32 p_lo, u32 p_hi) {
    products_dense<u16>(data, a, p_lo, p_hi);
}

extern "C" __global__ void __launch_bounds__(PROD_WARPS * 32)
    qem_products_dense_u32(const u32* __restrict__ data, ProdArgs a, u32 p_lo, u32 p_hi) {
    products_dense<u32>(data, a, p_lo, p_hi);
}
