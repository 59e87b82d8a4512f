// The rANS counts codec on the GPU (qem_codec::rans, format v2, is the specification):
//
// * decode: one warp per stream, the model's tables in shared memory, fused with a reduction
//   through a functor (`rans_decode_stream<Op>`): each decoded value goes to `op.value(p, v, j)`
//   and never to global memory unless the functor writes it there;
// * encode: one warp per frame over a batch of dense u16 frames, words staged in a per-warp
//   scratch in encoder order and written reversed (decoder order) at an atomically allocated
//   arena offset;
// * fitting statistics over a dense sample: per-pixel sums, per-frame statistics, and the
//   [table set][context][symbol] histogram. The host finishes the fit with the CPU code, so
//   CPU and GPU models are identical for the same sample.
//
// Tables (built by the Rust wrapper, rans.rs `device_tables`):
// `tab[(set·C + ctx)·SP + s] = freq << 16 | cum` with the row stride SP = S | 1 (odd, so lanes
// reading one symbol in different classes, or different symbols in one class, hit different
// banks), and a coarse lookup `lut[(set·256 + (slot >> 4))·CPAD + ctx]` (u8, CPAD = 16 class
// columns) = the symbol whose range holds slot `16·(slot >> 4)`; its byte offset in the set's
// lookup is `(x & 0xff0) | ctx` from the state x (one LOP3). The decoder walks forward from
// that symbol to the one holding `slot`.
//
// Every read of a stream stays inside it: the header is checked against the stream length from
// the index, extra bits against their count, and the renormalisation words are read at an
// index clamped to the last word (a stream that needs more words than it has is caught from
// the warp's word count at the end). A corrupt stream sets an error record naming the frame
// and never reads or writes out of bounds; its results are not used.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu
#define RANS_L 65536u
#define PROB_BITS 12u
#define PROB_MASK 4095u
#define HDR_BYTES 144u
#define LUT_PER_ROW 256u
#define CPAD 16u           // class columns of a lut bucket (MAX_CONTEXTS)

// Error codes; the wrapper (rans.rs) maps them to messages.
#define R_OK 0u
#define R_INDEX 1u          // index entry outside the arena
#define R_LENGTH 2u         // stream length != the length its header implies
#define R_COUNTS 3u         // n_words > n or n_extra_bits > 15 n
#define R_SET 4u            // table_set >= T
#define R_RESERVED 5u       // reserved header word != 0
#define R_START_STATE 6u    // an initial state < L
#define R_PAD 7u            // pad word != 0
#define R_TAIL_BITS 8u      // unused high bits of the last extra word != 0
#define R_WORD_OVERRUN 9u   // a word needed past n_words
#define R_BIT_OVERRUN 10u   // extra bits needed past n_extra_bits
#define R_FINAL_STATE 11u   // a final state != L
#define R_WORDS_LEFT 12u    // words left unread
#define R_BITS_LEFT 13u     // extra bits left unread
#define R_SET_MISMATCH 14u  // the decoded frame's statistic maps to another table set
#define R_UNCODABLE 15u     // encode: a value whose symbol has frequency 0 in its context
#define R_OVERFLOW 16u      // encode: the arena was full (the host retries with more room)
#define R_VALUE 17u         // a decoded value above 65535 (a bucket with forged extra bits)

// err: [0] flag, [1] code, [2..4) frame (u64 lo, hi), [4] a, [5] b, [6] count of failing streams,
// [7] overflowing frames (encode).
__device__ __forceinline__ void rans_report(u32* err, u64 frame, u32 code, u32 a, u32 b) {
    atomicAdd(&err[6], 1u);
    if (atomicCAS(&err[0], 0u, 1u) == 0u) {
        err[1] = code;
        err[2] = (u32)frame;
        err[3] = (u32)(frame >> 32);
        err[4] = a;
        err[5] = b;
    }
}

__device__ __forceinline__ u32 lanemask_lt() {
    u32 m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}

__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Σ of v over lanes 0..=lane (every lane of the warp takes part).
__device__ __forceinline__ u32 warp_inclusive_sum(u32 v, u32 lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(FULL_MASK, v, o);
        if ((int)lane >= o) v += y;
    }
    return v;
}

__device__ __forceinline__ u32 symbol_of(u32 v, u32 K) {
    return v < K ? v : K + (31u - __clz(v - K + 1u));
}

// The model as the kernels see it (tab and lut point to shared memory once staged).
struct RansModel {
    const u8* __restrict__ ctx;   // frame_len context classes (global, read through L1)
    const u32* tab;               // T*C*SP packed entries (SP = S | 1)
    const u8* lut;                // T*256*CPAD coarse lookup
    const u64* __restrict__ thr;  // T-1 thresholds (global)
    // The context classes of ctx in decoder order (rans.rs `interleave4`): word g·32 + lane
    // holds, in byte j, the class of pixel (4g + j)·32 + lane (0 past the frame, and one zero
    // group past the last), so a lane reads the classes of four steps with one coalesced load.
    const u32* __restrict__ ctx4;
    u32 n, K, S, C, T, split;
    u32 split4;  // (128 − split)·0x01010101: byte j + this has bit 7 clear iff class j < split
                 // (classes < 16, so no byte carries); from the host, so no register holds it
    u32 sp;      // tab row stride, S | 1
    u32 sp4;     // 4·sp, the row stride in bytes
    u32 pad_;
};

__device__ __forceinline__ u32 table_set_of(const RansModel& m, u64 stat) {
    u32 s = 0;
    for (u32 i = 0; i + 1 < m.T; ++i) s += (u32)(__ldg(m.thr + i) <= stat);
    return s;
}

// Words of the staged tab (the lut follows at the next 4 KB boundary of the shared window;
// rans.rs `smem_tables` adds the 4 KB the alignment may need).
__device__ __forceinline__ u32 model_tab_words(const RansModel& m) { return m.T * m.C * m.sp; }

// Stage the tables of `m` (global) into dynamic shared memory: tab first (u32), then lut.
// Returns the model pointing at shared memory. Call from every thread of the block.
// WITH_LUT = false stages only tab (the encoder needs no lookup).
template <bool WITH_LUT = true>
__device__ RansModel stage_model(RansModel m, u32* smem) {
    const u32 tab_words = model_tab_words(m);
    for (u32 i = threadIdx.x; i < tab_words; i += blockDim.x) smem[i] = __ldg(m.tab + i);
    if (!WITH_LUT) {
        __syncthreads();
        m.tab = smem;
        return m;
    }
    // The lookup at a 4 KB boundary: a set's lookup is 4 KB, so every set's base has its low
    // 12 bits zero and the decoder forms an address with one LOP3 ((x & 0xff0) | base | class).
    const u32 after_tab = (u32)__cvta_generic_to_shared(smem + tab_words);
    u32* lut_s = smem + tab_words + ((((after_tab + 4095u) & ~4095u) - after_tab) >> 2);
    const u32 lut_words = (m.T * LUT_PER_ROW * CPAD) >> 2;
    const u32* lut_g = (const u32*)m.lut;
    for (u32 i = threadIdx.x; i < lut_words; i += blockDim.x) lut_s[i] = __ldg(lut_g + i);
    __syncthreads();
    m.tab = smem;
    m.lut = (const u8*)lut_s;
    return m;
}

// 32-bit shared-memory loads (the tables' addresses are computed once per stream; through a
// generic pointer the compiler rebuilt the shared window's base every step).
__device__ __forceinline__ u32 lds_u8(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}
__device__ __forceinline__ u32 lds_u32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

// Ask L2 for the line at p (the words of coming groups).
__device__ __forceinline__ void prefetch_l2(const u16* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
// A renormalisation word: read-only, and a miss brings the next 256 bytes of the stream into L2
// (the words are read front to back, a few per step).
__device__ __forceinline__ u32 ldg_u16_stream(const u16* p) {
    unsigned short v;
    asm("ld.global.nc.L2::256B.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

// (x & 0xff0) | lbc as one LOP3 (lbc = a set's 4 KB-aligned lookup base | the class, formed off
// the state's path; written out so the compiler cannot re-associate the class to the end).
__device__ __forceinline__ u32 bucket_addr(u32 x, u32 lbc) {
    u32 a;
    asm("lop3.b32 %0, %1, 0xff0, %2, 0xea;" : "=r"(a) : "r"(x), "r"(lbc));
    return a;
}

// What the steps of one stream share (constant per stream).
struct StreamCtx {
    const u16* __restrict__ w;   // renormalisation words (a safe address when n_words = 0)
    const u32* __restrict__ ex;  // extra bits
    u32 tb, lb;                  // shared addresses: this table set's tab and lut
    u32 sp4;                     // tab row stride in bytes (4·(S | 1), from the model)
    u32 n, K, split, n_words, n_bits, n_ex, lt;
    u32 wlim;                    // the last word a lane may read (clamp; see rans_decode_symbol)
};

// What the steps of one stream carry.
struct StreamState {
    u32 x;       // the lane's rANS state
    u32 base;    // words consumed by the warp (> n_words: a word was needed past the end)
    u32 bitpos;  // extra bits consumed by the warp (≤ 15·n < 2^32)
    u32 stat;    // the lane's statistic since the last flush (≤ STAT_FLUSH_GROUPS groups of 4
                 // values < 2^17, or the whole frame when n ≤ 2^16: < 2^31 either way)
    u32 bad;     // bit 1: bits past n_bits; bit 2: a value above 65535
    u32 win;     // the word at base + lane (clamped to the last): the warp's next 32 words
};

// The symbol of step t of a stream for one lane (pixel p = 32t + lane, context class c): the
// lookup, state update and renormalisation. TAIL = the step may hold pixels past the frame
// (only the last step when n is not a multiple of 32): a lane past the frame gets symbol 0 and
// changes nothing. Every lane of the warp calls it (the renormalisation is a warp vote).
//
// The renormalisation has no per-lane branch and no memory access on the state's path: lane i
// holds the word at base + i (`win`, a step's 32 possible words, loaded one step ahead at an
// index clamped to the stream's last word, so no read leaves the stream), and a lane that
// needs a word takes its own from the window with one shuffle. A stream that needs more words
// than it has is caught at the end (rans_close: the warp's count `base` passed n_words); the
// words read past the end were only ever the last word again, and the result of such a
// stream is never used.
template <bool TAIL>
__device__ __forceinline__ u32 rans_decode_symbol(StreamState& d, const StreamCtx& k, u32 p,
                                                  u32 c, u32 lane) {
    const bool act = !TAIL || p < k.n;
    u32 s = 0u;
    if (act) {
        // Off the state's path: the class's lookup column and table row.
        const u32 lbc = k.lb | c;
        const u32 cb = k.tb + c * k.sp4;
        // The symbol of the bucket's first slot, then its entry.
        s = lds_u8(bucket_addr(d.x, lbc));
        u32 ta = cb + (s << 2);
        u32 e = lds_u32(ta);
        const u32 slot = d.x & PROB_MASK;
        u32 r = slot - (e & 0xffffu);  // ≥ 0: the entry's range starts at or before slot
        // Terminates: a row's ranges tile [0, 4096) and slot < 4096.
        while (r >= (e >> 16)) {
            ta += 4u;
            ++s;
            e = lds_u32(ta);
            r = slot - (e & 0xffffu);
        }
        d.x = (e >> 16) * (d.x >> PROB_BITS) + r;
    }
    const bool need = act && d.x < RANS_L;
    const u32 mk = __ballot_sync(FULL_MASK, need);
    const u32 wv = __shfl_sync(FULL_MASK, d.win, __popc(mk & k.lt));
    if (need) d.x = (d.x << 16) | wv;
    d.base += __popc(mk);
    d.win = ldg_u16_stream(k.w + min(d.base + lane, k.wlim));
    return s;
}

// The value of symbol s of one step: s itself for a literal, else the bucket's extra bits,
// which come in raster order (step-major, lane-minor) and do not touch the rANS state, so a
// step's buckets may be read after later steps' symbols. Every lane calls it for the step; a
// lane past the frame (act = false) has none.
__device__ __forceinline__ u32 rans_bucket_value(StreamState& d, const StreamCtx& k, u32 s,
                                                 bool act, u32 lane) {
    u32 v = s;
    const bool bk = act && s >= k.K;
    if (__any_sync(FULL_MASK, bk)) {
        const u32 nb = bk ? s - k.K : 0u;
        const u32 incl = warp_inclusive_sum(nb, lane);
        const u32 tot = __shfl_sync(FULL_MASK, incl, 31);
        if (bk) {
            const u32 off = d.bitpos + incl - nb;
            if (off + nb > k.n_bits) {
                d.bad |= 2u;
            } else {
                const u32 wi = off >> 5;
                const u32 lo = __ldg(k.ex + wi);
                const u32 hi = wi + 1u < k.n_ex ? __ldg(k.ex + wi + 1u) : 0u;
                const u32 e = __funnelshift_r(lo, hi, off & 31u) & ((1u << nb) - 1u);
                v = k.K - 1u + (1u << nb) + e;
                if (v > 65535u) d.bad |= 4u;  // the codec codes u16 values only
            }
        }
        d.bitpos += tot;
    }
    return v;
}

// The value of step t (rans_decode_symbol, then its bucket bits) and the statistic.
template <bool TAIL>
__device__ __forceinline__ u32 rans_symbol(StreamState& d, const StreamCtx& k, u32 p, u32 c,
                                           u32 lane) {
    const bool act = !TAIL || p < k.n;
    const u32 v = rans_bucket_value(d, k, rans_decode_symbol<TAIL>(d, k, p, c, lane), act, lane);
    if (act && c < k.split) d.stat += v;
    return v;
}

// One stream being decoded by a warp: its constants, its lane state and its statistic.
struct RansStream {
    StreamCtx k;
    StreamState d;
    u64 stat;  // the lane's statistic, flushed from d.stat every STAT_FLUSH_GROUPS groups
    u32 set;   // the header's table set
    __device__ __forceinline__ void flush_stat() {
        stat += d.stat;
        d.stat = 0u;
    }
};

// Check the header of stream `st` (`len` bytes from the index) against the model and set up
// `s` for its first step; every lane returns the same code (R_OK or the first check failed).
__device__ __forceinline__ u32 rans_open(const u8* __restrict__ st, u64 len, const RansModel& m,
                                         u32 lane, RansStream& s, u32& a, u32& b) {
    if (len < HDR_BYTES) {
        a = HDR_BYTES;
        b = (u32)len;
        return R_LENGTH;
    }
    const u32* h = (const u32*)st;
    const u32 n_words = __ldg(h), n_bits = __ldg(h + 1), set = __ldg(h + 2), resv = __ldg(h + 3);
    const u32 n = m.n;
    if (n_words > n || (u64)n_bits > 15ull * n) {
        a = n_words;
        b = n_bits;
        return R_COUNTS;
    }
    const u32 word_bytes = 4u * ((n_words + 1u) >> 1);
    const u32 n_ex = (n_bits + 31u) >> 5;
    const u64 want = (u64)HDR_BYTES + word_bytes + 4ull * n_ex;
    if (len != want) {
        a = (u32)want;
        b = (u32)len;
        return R_LENGTH;
    }
    if (set >= m.T) {
        a = m.T;
        b = set;
        return R_SET;
    }
    if (resv != 0u) {
        a = 0u;
        b = resv;
        return R_RESERVED;
    }
    StreamState& d = s.d;
    d.x = __ldg(h + 4 + lane);
    {
        const u32 lo = __ballot_sync(FULL_MASK, d.x < RANS_L);
        if (lo) {
            a = __ffs(lo) - 1u;
            b = __shfl_sync(FULL_MASK, d.x, __ffs(lo) - 1u);
            return R_START_STATE;
        }
    }
    StreamCtx& k = s.k;
    k.w = (const u16*)(st + HDR_BYTES);
    k.ex = (const u32*)(st + HDR_BYTES + word_bytes);
    if ((n_words & 1u) && __ldg(k.w + n_words) != 0u) {
        a = 0u;
        b = __ldg(k.w + n_words);
        return R_PAD;
    }
    // Without words every clamped read goes to the last half of state[31] (in the stream).
    if (n_words == 0u) k.w = (const u16*)(st + HDR_BYTES - 2u);
    k.wlim = n_words == 0u ? 0u : n_words - 1u;
    if ((n_bits & 31u) && (__ldg(k.ex + n_ex - 1u) >> (n_bits & 31u)) != 0u) {
        a = n_bits;
        b = __ldg(k.ex + n_ex - 1u);
        return R_TAIL_BITS;
    }
    k.sp4 = m.sp4;
    k.tb = (u32)__cvta_generic_to_shared(m.tab) + set * m.C * k.sp4;
    k.lb = (u32)__cvta_generic_to_shared(m.lut) + set * LUT_PER_ROW * CPAD;
    k.n = n;
    k.K = m.K;
    k.split = m.split;
    k.n_words = n_words;
    k.n_bits = n_bits;
    k.n_ex = n_ex;
    k.lt = lanemask_lt();
    d.base = 0u;
    d.win = ldg_u16_stream(k.w + min(lane, k.wlim));
    d.bitpos = 0u;
    d.stat = 0u;
    d.bad = 0u;
    s.stat = 0u;
    s.set = set;
    return R_OK;
}

// The checks after the last step of `s`: every word and extra bit read and none past the end,
// every final state = L, and (T > 1) the frame statistic maps to the header's table set.
__device__ __forceinline__ u32 rans_close(const RansStream& s, const RansModel& m, u32& a, u32& b) {
    const StreamState& d = s.d;
    const StreamCtx& k = s.k;
    if (d.base > k.n_words) {
        a = k.n_words;
        b = d.base;
        return R_WORD_OVERRUN;
    }
    if (__any_sync(FULL_MASK, d.bad & 2u)) {
        a = k.n_bits;
        b = d.bitpos;
        return R_BIT_OVERRUN;
    }
    if (__any_sync(FULL_MASK, d.bad & 4u)) {
        a = 65535u;
        b = 0u;
        return R_VALUE;
    }
    {
        const u32 bad = __ballot_sync(FULL_MASK, d.x != RANS_L);
        if (bad) {
            a = __ffs(bad) - 1u;
            b = __shfl_sync(FULL_MASK, d.x, __ffs(bad) - 1u);
            return R_FINAL_STATE;
        }
    }
    if (d.base != k.n_words) {
        a = k.n_words;
        b = d.base;
        return R_WORDS_LEFT;
    }
    if (d.bitpos != k.n_bits) {
        a = k.n_bits;
        b = d.bitpos;
        return R_BITS_LEFT;
    }
    if (m.T > 1u) {
        const u64 total = warp_sum_u64(s.stat);
        const u32 want_set = table_set_of(m, total);
        if (want_set != s.set) {
            a = want_set;
            b = s.set;
            return R_SET_MISMATCH;
        }
    }
    return R_OK;
}

// Groups between flushes of a lane's u32 statistic: 4·2^12 values of < 2^17 stay below 2^31.
#define STAT_FLUSH_GROUPS 4096u

// One full group g of four steps (classes cw): the four symbols, their bucket bits, the
// statistic, and the values to the functor.
template <class Op>
__device__ __forceinline__ void rans_group(RansStream& s, const RansModel& m, u32 lane, Op& op,
                                           u32 g, u32 cw) {
    op.group(g);
    // The words of the coming groups into L2, 1 KB ahead (a group reads ~16–64 bytes of them).
    prefetch_l2(s.k.w + min(s.d.base + 512u, s.k.wlim));
    // The four symbols first, then (one vote for the group) their bucket bits in step order:
    // most groups hold no bucket symbol and skip three votes.
    u32 sym[4];
#pragma unroll
    for (u32 j = 0; j < 4u; ++j) {
        const u32 p = (((g << 2) + j) << 5) + lane;
        sym[j] = rans_decode_symbol<false>(s.d, s.k, p, __byte_perm(cw, 0u, 0x4440u + j), lane);
    }
    const u32 top = max(max(sym[0], sym[1]), max(sym[2], sym[3]));
    if (__any_sync(FULL_MASK, top >= s.k.K)) {
#pragma unroll
        for (u32 j = 0; j < 4u; ++j) sym[j] = rans_bucket_value(s.d, s.k, sym[j], true, lane);
    }
    // The statistic: byte j of `fl` is 1 when step j's class is below split; two values per
    // dp2a (a value above 65535 is garbled here, but fails the stream).
    const u32 fl = ~((cw + m.split4) >> 7) & 0x01010101u;
    const u32 q01 = sym[0] | (sym[1] << 16), q23 = sym[2] | (sym[3] << 16);
    s.d.stat += __dp2a_hi(q23, fl, __dp2a_lo(q01, fl, 0u));
#pragma unroll
    for (u32 j = 0; j < 4u; ++j) {
        const u32 p = (((g << 2) + j) << 5) + lane;
        op.value_full(p, sym[j], j);
    }
}

// Every step of an opened stream. The functor gets `op.fetch(m, g, lane)` one group ahead of
// group g (returning the group's class word, ctx4's by default; a functor with words of its own
// per group may load them along: they arrive a group early), `op.group(g)` before the steps
// 4g..4g+3, `op.value_full(p, v, j)` for every pixel p of the full
// groups (by the lane holding it; j = the step's place in its group, a compile-time constant
// there, so a functor may keep a group's four values in registers) and `op.value(p, v, j)` for
// the pixels of the partial tail (j not constant), and `op.finish()` after the last step.
// `Op::kSmallFrames`: the host guarantees n ≤ 2^16, so a lane's u32 statistic (≤ 2048 values
// of < 2^17) needs no flush inside the frame.
template <class Op>
__device__ __forceinline__ void rans_run(RansStream& s, const RansModel& m, u32 lane, Op& op) {
    const u32 n = m.n;
    const u32 steps = (n + 31u) >> 5;
    // Groups of four steps in which every lane holds a pixel, then the rest.
    const u32 full_groups = (n >> 5) >> 2;
    // The classes of the next group are loaded one group ahead (ctx4 has a zero group past
    // the last, rans.rs `interleave4`, so g + 1 ≤ full_groups is always inside it).
    u32 cw_next = op.fetch(m, 0u, lane);
    if (Op::kSmallFrames) {
#pragma unroll 2
        for (u32 g = 0; g < full_groups; ++g) {
            const u32 cw = cw_next;
            cw_next = op.fetch(m, g + 1u, lane);
            rans_group(s, m, lane, op, g, cw);
        }
    } else {
        for (u32 g0 = 0; g0 < full_groups; g0 += STAT_FLUSH_GROUPS) {
            const u32 g1 = min(full_groups, g0 + STAT_FLUSH_GROUPS);
            for (u32 g = g0; g < g1; ++g) {
                const u32 cw = cw_next;
                cw_next = op.fetch(m, g + 1u, lane);
                rans_group(s, m, lane, op, g, cw);
            }
            s.flush_stat();
        }
    }
    // The tail starts at a group boundary (group full_groups, fetched last).
    for (u32 t = full_groups << 2; t < steps; ++t) {
        const u32 g = t >> 2, j = t & 3u;
        if (j == 0u) {
            op.fetch(m, g + 1u, lane);
            op.group(g);
        }
        const u32 cw = __ldg(m.ctx4 + (g << 5) + lane);
        const u32 p = (t << 5) + lane;
        const u32 v = rans_symbol<true>(s.d, s.k, p, (cw >> (8u * j)) & 0xffu, lane);
        if (p < n) op.value(p, v, j);
    }
    s.flush_stat();
    op.finish();
}

// Decode one stream with the whole warp (open, every step, close); every lane returns the same
// code. `a`/`b` carry detail for the error record.
template <class Op>
__device__ u32 rans_decode_stream(const u8* __restrict__ st, u64 len, const RansModel& m,
                                  u32 lane, Op& op, u32& a, u32& b) {
    RansStream s;
    const u32 code = rans_open(st, len, m, lane, s, a, b);
    if (code != R_OK) return code;
    rans_run(s, m, lane, op);
    return rans_close(s, m, a, b);
}

// Index entry i (16 bytes): u64 offset, u32 length, u32 tag.
__device__ __forceinline__ bool stream_at(const u8* arena, u64 arena_len, const u32* index, u64 i,
                                          const u8*& st, u64& len) {
    const u32* e = index + 4 * i;
    const u64 off = (u64)__ldg(e) | ((u64)__ldg(e + 1) << 32);
    len = __ldg(e + 2);
    st = arena + off;
    return off <= arena_len && len <= arena_len - off && (off & 15ull) == 0ull;
}

// ---- Functors (reductions fused with decode)

// The class word of group g (rans_run's `op.fetch` for functors without words of their own).
#define RANS_DEFAULT_FETCH                                                                       \
    __device__ __forceinline__ u32 fetch(const RansModel& m, u32 g, u32 lane) {                  \
        return __ldg(m.ctx4 + (g << 5) + lane);                                                  \
    }

// Write the frame as u16 to out[local * n + p].
struct DenseOut {
    static constexpr bool kSmallFrames = false;
    RANS_DEFAULT_FETCH
    u16* out;
    __device__ __forceinline__ void group(u32) {}
    __device__ __forceinline__ void value(u32 p, u32 v, u32) { out[p] = (u16)v; }
    __device__ __forceinline__ void value_full(u32 p, u32 v, u32 j) { value(p, v, j); }
    __device__ __forceinline__ void finish() {}
};

// Per-frame total count (exact, u64), the smallest fused reduction; the products issue adds the
// virtual detectors, moments and diffraction sums on the same template.
struct FrameSum {
    static constexpr bool kSmallFrames = false;
    RANS_DEFAULT_FETCH
    u64 acc;
    u32 part;  // since the last group: ≤ 4 values of < 2^17
    __device__ __forceinline__ void group(u32) {
        acc += part;
        part = 0u;
    }
    __device__ __forceinline__ void value(u32, u32 v, u32) { part += v; }
    __device__ __forceinline__ void value_full(u32 p, u32 v, u32 j) { value(p, v, j); }
    __device__ __forceinline__ void finish() { group(0u); }
};

// Streams [first, first + count) of the index, warps over streams. The decode kernels run
// 16-warp CTAs (rans.rs DECODE_WARPS) and ask for 3 of them per SM (40 registers): the decode
// is issue-bound and 48 warps keep the schedulers busier than 40, and three CTAs' tables
// (52 KB each with C16 K64 T4) fit the shared memory where six 8-warp CTAs' would not.
#define QEM_RANS_WARP_LOOP(body)                                                                 \
    const u32 lane = threadIdx.x & 31u;                                                         \
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);                                        \
    for (u64 k = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); k < count;            \
         k += warps) {                                                                           \
        const u64 i = first + k;                                                                 \
        const u8* st;                                                                            \
        u64 len;                                                                                 \
        u32 a = 0u, b = 0u, code;                                                                \
        if (!stream_at(arena, arena_len, index, i, st, len)) {                                   \
            code = R_INDEX;                                                                      \
        } else {                                                                                 \
            body                                                                                 \
        }                                                                                        \
        if (code != R_OK && lane == 0u) rans_report(err, i, code, a, b);                         \
    }

// Decode streams [first, first + count) to dense u16 frames out[(i - first) * n + p].
extern "C" __global__ void __launch_bounds__(512, 3) qem_rans_decode_dense(const u8* __restrict__ arena, u64 arena_len,
                                                 const u32* __restrict__ index, u64 first,
                                                 u64 count, RansModel m, u16* __restrict__ out,
                                                 u32* err) {
    extern __shared__ __align__(16) u32 smem_d[];
    m = stage_model(m, smem_d);
    QEM_RANS_WARP_LOOP({
        DenseOut op{out + k * (u64)m.n};
        code = rans_decode_stream(st, len, m, lane, op, a, b);
    })
}

__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Per-frame position-weighted hash Σ v_p · splitmix64(p) (wrapping): equal frames give equal
// hashes, and any changed pixel changes it unless the differences cancel modulo 2^64. Lets a
// check compare every decoded frame with the CPU's without moving frames.
struct FrameHash {
    static constexpr bool kSmallFrames = false;
    RANS_DEFAULT_FETCH
    u64 acc;
    __device__ __forceinline__ void group(u32) {}
    __device__ __forceinline__ void value(u32 p, u32 v, u32) { acc += (u64)v * splitmix64(p); }
    __device__ __forceinline__ void value_full(u32 p, u32 v, u32 j) { value(p, v, j); }
    __device__ __forceinline__ void finish() {}
};

// One u64 per stream from a per-lane accumulating functor (u64::MAX for a failed stream).
template <class Op>
__device__ __forceinline__ void frame_reduce(const u8* __restrict__ arena, u64 arena_len,
                                             const u32* __restrict__ index, u64 first, u64 count,
                                             RansModel m, u64* __restrict__ out, u32* err,
                                             u32* smem) {
    m = stage_model(m, smem);
    QEM_RANS_WARP_LOOP({
        Op op{};  // every field zero
        code = rans_decode_stream(st, len, m, lane, op, a, b);
        const u64 t = warp_sum_u64(op.acc);
        if (lane == 0u) out[k] = code == R_OK ? t : ~0ull;
    })
}

// Per-frame sums of streams [first, first + count) to sums[k].
extern "C" __global__ void __launch_bounds__(512, 3) qem_rans_frame_sums(const u8* __restrict__ arena, u64 arena_len,
                                               const u32* __restrict__ index, u64 first,
                                               u64 count, RansModel m, u64* __restrict__ sums,
                                               u32* err) {
    extern __shared__ __align__(16) u32 smem_s[];
    frame_reduce<FrameSum>(arena, arena_len, index, first, count, m, sums, err, smem_s);
}

// Per-frame hashes (FrameHash) of streams [first, first + count) to hashes[k].
extern "C" __global__ void __launch_bounds__(512, 3) qem_rans_frame_hashes(const u8* __restrict__ arena, u64 arena_len,
                                                 const u32* __restrict__ index, u64 first,
                                                 u64 count, RansModel m,
                                                 u64* __restrict__ hashes, u32* err) {
    extern __shared__ __align__(16) u32 smem_s[];
    frame_reduce<FrameHash>(arena, arena_len, index, first, count, m, hashes, err, smem_s);
}

// ---- Encoder

// q = ⌊x / f⌋ for the encoder's x < f·2^20 (so x/f < 2^20) and 1 ≤ f ≤ 4096, with no table:
// the f32 estimate x·(1/f), with x rounded to nearest, 1/f from the hardware's approximate
// reciprocal (rcp.approx: within 1 ulp, relative 2^-23) and the product rounded to nearest, has
// a relative error below 2^-22, so an absolute error below 2^20·2^-22 = 1/4 < 1, and its
// truncation is q − 1, q or q + 1; one exact remainder check corrects it. The estimate's
// remainder x − q·f lies in [−f, 2f), far inside ±2^31, so the 32-bit wrapping difference read
// as signed is exact even where q·f passes 2^32 (f = 4096): no 64-bit product and compare
// (ptxas: 17 → 15 instructions for the division and the state update, which it folds into
// q·(4096 − f) + x + cu). The host test `float_division_is_exact_where_the_encoder_uses_it`
// replays this arithmetic with 1/f rounded to nearest and one ulp either side. (The correctly rounded
// reciprocal, `__frcp_rn`, costs a refinement and a special-case branch per step for nothing
// the correction does not already cover; an earlier version read a u64 reciprocal per table
// entry from shared memory: with C16 K64 T4 tables that was 41 KB per CTA and cut the encoder to
// 2 CTAs per SM.)
__device__ __forceinline__ float rcp_approx(float v) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}
__device__ __forceinline__ u32 div_freq(u32 x, u32 f) {
    u32 q = __float2uint_rz(__fmul_rn(__uint2float_rn(x), rcp_approx((float)f)));
    const int r = (int)(x - q * f);
    if (r < 0) {
        q -= 1u;
    } else if (r >= (int)f) {
        q += 1u;
    }
    return q;
}

// Encode n_frames dense frames (u16, frame stride m.n) with one warp per frame. Frame k goes to
// index entry `dst[k]` (or `dst_base + k` when dst is null; u32 max = skip). Bad pixels
// (bad[p] != 0, when bad is not null) are coded as 0. Per-warp scratch: `sw`, n u16 words, for
// `scratch_warps` warps (the grid must not have more).
//
// Per frame: (1) the frame statistic → table set; (2) rANS from the last step to the first,
// words stored in encoder order in the warp's scratch, extra-bit count and codability summed
// on the way; (3) the stream's place from the arena cursor; (4) header, states and the words
// reversed (decoder order); (5) the extra bits in raster order, packed through a small shared
// window straight into the stream.
template <bool FAST>
__device__ __forceinline__ void encode_frames(const u16* __restrict__ frames, u64 n_frames,
                                              const u32* __restrict__ dst, u64 dst_base,
                                              const u8* __restrict__ bad, RansModel m,
                                              u8* __restrict__ arena, u64 capacity, u64* cursor,
                                              u32* __restrict__ index, u16* __restrict__ sw,
                                              u64 scratch_warps, u32* err, u32* smem_e) {
    const u32 warps_per_block = blockDim.x >> 5;
    const u32 steps = (m.n + 31u) >> 5;
    const u32 map_words = (steps + 31u) >> 5;  // one bit per step: "has a bucket symbol"
    u32* win_all = smem_e + model_tab_words(m);
    u32* map_all = win_all + warps_per_block * 20u;
    m = stage_model<false>(m, smem_e);  // syncs the block; tab only
    const u32 lane = threadIdx.x & 31u;
    const u32 wib = threadIdx.x >> 5;
    u32* win = win_all + wib * 20u;  // bit staging window of this warp
    u32* bmap = map_all + wib * map_words;
    const u64 gw = (u64)blockIdx.x * warps_per_block + wib;
    if (gw >= scratch_warps) return;
    u16* my_w = sw + gw * (u64)m.n;
    const u64 warps = (u64)gridDim.x * warps_per_block;
    const u32 n = m.n;
    const u32 lt = lanemask_lt();
    // 16-byte loads for the statistic when frames allow it.
    const bool vec8 = (n & 7u) == 0u && ((u64)frames & 15ull) == 0ull && ((u64)m.ctx & 7ull) == 0ull;
    for (u64 k = gw; k < n_frames; k += warps) {
        const u64 fi = dst ? (u64)__ldg(dst + k) : dst_base + k;
        if (dst && fi == 0xffffffffull) continue;
        const u16* __restrict__ fr = frames + k * (u64)n;
        // 1. The frame statistic and its table set.
        u32 set = 0u;
        if (m.T > 1u) {
            u64 stat = 0u;
            if (vec8 && !bad) {
                const uint4* f8 = (const uint4*)fr;
                const uint2* c8 = (const uint2*)m.ctx;
                // Eight pixels a load: one byte per pixel that is 1 where its class is below
                // the split (split4, as in the decoder), then the kept values summed by four
                // dp2a (16-bit value × 8-bit flag; ≤ 8 · 65535 per group, so u32 is exact).
                for (u32 g = lane; g < (n >> 3); g += 32u) {
                    const uint4 v = __ldg(f8 + g);
                    const uint2 c = __ldg(c8 + g);
                    const u32 k0 = ~((c.x + m.split4) >> 7) & 0x01010101u;
                    const u32 k1 = ~((c.y + m.split4) >> 7) & 0x01010101u;
                    u32 t = __dp2a_lo(v.x, k0, 0u);
                    t = __dp2a_hi(v.y, k0, t);
                    t = __dp2a_lo(v.z, k1, t);
                    t = __dp2a_hi(v.w, k1, t);
                    stat += t;
                }
            } else {
                for (u32 p = lane; p < n; p += 32u) {
                    const u32 v = (bad && __ldg(bad + p)) ? 0u : (u32)__ldg(fr + p);
                    if (__ldg(m.ctx + p) < m.split) stat += v;
                }
            }
            set = table_set_of(m, warp_sum_u64(stat));
        }
        const u32 row0 = set * m.C;
        const u32 sp = m.sp;
        // The staged table's 32-bit shared address (a generic pointer costs an address
        // conversion per load, as in the decoder).
        const u32 tab_s = (u32)__cvta_generic_to_shared(m.tab);
        // 2. rANS, steps last to first (loads of the next step issued before this one's math).
        u32 x = RANS_L;
        u32 cnt = 0u;
        u32 nbits = 0u;
        bool uncodable = false;
        u32 bad_p = 0u, bad_v = 0u;
        u32 tt = steps - 1u;
        u32 p = (tt << 5) + lane;
        u32 v_next = 0u, c_next = 0u;
        if (FAST || p < n) {
            v_next = (!FAST && bad && __ldg(bad + p)) ? 0u : (u32)__ldg(fr + p);
            c_next = __ldg(m.ctx + p);
        }
        u32 bword = 0u;  // the bucket map's bits of the steps so far
        while (true) {
            const bool act = FAST || p < n;
            const u32 v = v_next, c = c_next;
            if (tt > 0u) {
                const u32 pn = p - 32u;  // always < n
                v_next = (!FAST && bad && __ldg(bad + pn)) ? 0u : (u32)__ldg(fr + pn);
                c_next = __ldg(m.ctx + pn);
            }
            u32 f = 1u, cu = 0u;
            bool emit = false;
            bool bk_any = false;
            if (act) {
                const u32 s = symbol_of(v, m.K);
                const u32 ei = (row0 + c) * sp + s;
                const u32 e = lds_u32(tab_s + 4u * ei);
                f = e >> 16;
                cu = e & 0xffffu;
                if (s >= m.K) {
                    nbits += s - m.K;
                    bk_any = true;
                }
                if (f == 0u) {
                    if (!uncodable) {
                        uncodable = true;
                        bad_p = p;
                        bad_v = v;
                    }
                    f = 1u;  // keep the arithmetic defined; the frame is reported, not stored
                }
                // x ≥ f·2^20, in 32 bits (f·2^20 is a multiple of 2^20; f = 4096 would not fit).
                emit = (x >> 20) >= f;
            }
            // The step's map bit is shifted into a register (steps run from the last down, so
            // after step tt's word is complete, step tt's bit sits at tt & 31) and the word is
            // stored once, at its lowest step; 32 more shifts clear it for the next word.
            bword = (bword << 1) | (__any_sync(FULL_MASK, bk_any) ? 1u : 0u);
            if ((tt & 31u) == 0u && lane == 0u) bmap[tt >> 5] = bword;
            const u32 mk = __ballot_sync(FULL_MASK, emit);
            if (emit) {
                my_w[cnt + __popc(mk) - 1u - __popc(mk & lt)] = (u16)(x & 0xffffu);
                x >>= 16;
            }
            cnt += __popc(mk);
            if (act) {
                const u32 q = div_freq(x, f);
                x = q * 4096u + (x - q * f) + cu;
            }
            if (tt == 0u) break;
            --tt;
            p -= 32u;
        }
        const u32 unc = __ballot_sync(FULL_MASK, uncodable);
        if (unc) {
            const u32 l = __ffs(unc) - 1u;
            const u32 pp = __shfl_sync(FULL_MASK, bad_p, l);
            const u32 vv = __shfl_sync(FULL_MASK, bad_v, l);
            if (lane == 0u) rans_report(err, fi, R_UNCODABLE, pp, vv);
            continue;
        }
        for (int o = 16; o > 0; o >>= 1) nbits += __shfl_xor_sync(FULL_MASK, nbits, o);
        __syncwarp();
        // 3. Place the stream.
        const u32 n_ex = (nbits + 31u) >> 5;
        const u32 word_bytes = 4u * ((cnt + 1u) >> 1);
        const u64 len = (u64)HDR_BYTES + word_bytes + 4ull * n_ex;
        u64 off = 0u;
        if (lane == 0u) off = atomicAdd((unsigned long long*)cursor, (len + 15ull) & ~15ull);
        off = __shfl_sync(FULL_MASK, off, 0);
        u32* ie = index + 4ull * fi;
        if (off + len > capacity) {
            if (lane == 0u) {
                ie[0] = 0xffffffffu;
                ie[1] = 0xffffffffu;
                ie[2] = (u32)len;
                ie[3] = 0u;
                atomicAdd(&err[7], 1u);
            }
            continue;
        }
        // 4. Header, states, words in decoder order.
        u8* st = arena + off;
        u32* h = (u32*)st;
        if (lane == 0u) {
            h[0] = cnt;
            h[1] = nbits;
            h[2] = set;
            h[3] = 0u;
        }
        h[4 + lane] = x;
        u16* wo = (u16*)(st + HDR_BYTES);
        for (u32 i = lane; i < cnt; i += 32u) wo[i] = my_w[cnt - 1u - i];
        if ((cnt & 1u) && lane == 0u) wo[cnt] = 0u;
        // 5. Extra bits, raster order, through the window into the stream.
        if (nbits > 0u) {
            u32* xo = (u32*)(st + HDR_BYTES + word_bytes);
            u64 bitpos = 0u;
            if (lane < 20u) win[lane] = 0u;
            __syncwarp();
            __syncwarp();
            for (u32 t = 0; t < steps; ++t) {
                if (((bmap[t >> 5] >> (t & 31u)) & 1u) == 0u) continue;  // no bucket symbol
                const u32 q = (t << 5) + lane;
                u32 v = 0u, s = 0u;
                if (FAST || q < n) {
                    v = (!FAST && bad && __ldg(bad + q)) ? 0u : (u32)__ldg(fr + q);
                    s = symbol_of(v, m.K);
                }
                const bool bk = (FAST || q < n) && s >= m.K;
                if (!__any_sync(FULL_MASK, bk)) continue;
                const u32 nb = bk ? s - m.K : 0u;
                const u32 incl = warp_inclusive_sum(nb, lane);
                const u32 tot = __shfl_sync(FULL_MASK, incl, 31);
                const u32 o0 = (u32)(bitpos & 31u) + incl - nb;
                if (bk && nb > 0u) {
                    const u32 e = v - m.K + 1u - (1u << nb);
                    atomicOr(&win[o0 >> 5], e << (o0 & 31u));
                    if ((o0 & 31u) + nb > 32u) atomicOr(&win[(o0 >> 5) + 1u], e >> (32u - (o0 & 31u)));
                }
                __syncwarp();
                const u32 full = ((u32)(bitpos & 31u) + tot) >> 5;
                const u32 wbase = (u32)(bitpos >> 5);
                const u32 carry = win[full];
                if (lane < full) xo[wbase + lane] = win[lane];
                __syncwarp();
                if (lane < 20u) win[lane] = lane == 0u ? carry : 0u;
                __syncwarp();
                bitpos += tot;
            }
            if ((bitpos & 31u) && lane == 0u) xo[bitpos >> 5] = win[0];
            __syncwarp();
        }
        if (lane == 0u) {
            ie[0] = (u32)off;
            ie[1] = (u32)(off >> 32);
            ie[2] = (u32)len;
            ie[3] = 1u;
        }
    }
}

// The kernel: frames of whole steps (n a multiple of 32) with no bad-pixel list, every frame of
// the encoded load (it zeroes bad pixels before the encode), take `encode_frames<true>`, whose
// step has no lane-active test and no bad-pixel load or branch; others the general form.
extern "C" __global__ void qem_rans_encode(const u16* __restrict__ frames, u64 n_frames,
                                           const u32* __restrict__ dst, u64 dst_base,
                                           const u8* __restrict__ bad, RansModel m,
                                           u8* __restrict__ arena, u64 capacity, u64* cursor,
                                           u32* __restrict__ index, u16* __restrict__ sw,
                                           u64 scratch_warps, u32* err) {
    extern __shared__ __align__(16) u32 smem_e[];
    if (bad == nullptr && (m.n & 31u) == 0u) {
        encode_frames<true>(frames, n_frames, dst, dst_base, bad, m, arena, capacity, cursor,
                            index, sw, scratch_warps, err, smem_e);
    } else {
        encode_frames<false>(frames, n_frames, dst, dst_base, bad, m, arena, capacity, cursor,
                             index, sw, scratch_warps, err, smem_e);
    }
}

// ---- Fitting statistics over a dense sample (frames already masked)

// sums[p] += Σ_k frames[k][p]; grid.y splits the frames.
extern "C" __global__ void qem_rans_pixel_sums(const u16* __restrict__ frames, u64 n_frames, u32 n,
                                               u64* __restrict__ sums) {
    const u32 p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= n) return;
    u64 acc = 0u;
    for (u64 k = blockIdx.y; k < n_frames; k += gridDim.y) acc += __ldg(frames + k * n + p);
    atomicAdd((unsigned long long*)(sums + p), (unsigned long long)acc);
}

// stats[k] = Σ_{p : ctx[p] < split} frames[k][p]; one warp per frame.
extern "C" __global__ void qem_rans_frame_stats(const u16* __restrict__ frames, u64 n_frames, u32 n,
                                                const u8* __restrict__ ctx, u32 split,
                                                u64* __restrict__ stats) {
    const u32 lane = threadIdx.x & 31u;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 k = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); k < n_frames;
         k += warps) {
        u64 acc = 0u;
        for (u32 p = lane; p < n; p += 32u)
            if (__ldg(ctx + p) < split) acc += __ldg(frames + k * n + p);
        acc = warp_sum_u64(acc);
        if (lane == 0u) stats[k] = acc;
    }
}

// hist[(set[k]·C + ctx[p])·S + symbol(frames[k][p])] += 1 over all k, p; block-local u32
// counters in shared memory (rows = T·C·S entries), merged with 64-bit atomics.
extern "C" __global__ void qem_rans_histogram(const u16* __restrict__ frames, u64 n_frames, u32 n,
                                              const u8* __restrict__ ctx,
                                              const u8* __restrict__ frame_set, u32 K, u32 S,
                                              u32 C, u32 entries, u64* __restrict__ hist) {
    extern __shared__ __align__(16) u32 smem_h[];
    for (u32 i = threadIdx.x; i < entries; i += blockDim.x) smem_h[i] = 0u;
    __syncthreads();
    const u64 total = n_frames * (u64)n;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 q = (u64)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += stride) {
        const u64 k = q / n;
        const u32 p = (u32)(q - k * n);
        const u32 s = symbol_of(__ldg(frames + q), K);
        const u32 e = ((u32)__ldg(frame_set + k) * C + __ldg(ctx + p)) * S + s;
        atomicAdd(&smem_h[e], 1u);
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < entries; i += blockDim.x)
        if (smem_h[i]) atomicAdd((unsigned long long*)(hist + i), (unsigned long long)smem_h[i]);
}
