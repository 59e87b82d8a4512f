// Bitshuffle/LZ4 (HDF5 filter 32008) batch decoder: one warp per work item.
//
// Work items 0..n_blocks are LZ4 blocks (one bitshuffle block each); items n_blocks.. are raw
// copies (the N mod 8 tail of a chunk, or a whole unfiltered chunk). Every item writes a
// status pair (code, position) and the first error of the launch also goes to `err`.
//
// Safety rules (docs/formats.md §4.2): every read of the payload is checked against the payload
// length, every shared-memory write against the block's output length (which the descriptor
// check bounds by the warp's shared buffer), every match source against the bytes already
// decoded. Control flow of the LZ4 loop is warp-uniform: all lanes read the same token.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu

// Error codes; the Rust wrapper (bslz4.rs) maps them back to qem_codec::Lz4Fault.
#define E_OK 0u
#define E_EMPTY 1u
#define E_TRUNC_LEN 2u
#define E_TRUNC_OFF 3u
#define E_LEN_OVERFLOW 4u
#define E_LIT_PAST_IN 5u
#define E_LIT_PAST_OUT 6u
#define E_OFF_ZERO 7u
#define E_OFF_BEFORE 8u
#define E_MATCH_PAST_OUT 9u
#define E_SHORT_OUT 10u
#define E_BAD_DESC 11u
#define E_BAD_COPY 12u

// err[0] flag, [1] code, [2] chunk, [3] block, [4] position, [5] a, [6] b, [7] error count.
__device__ __forceinline__ void report(u32* err, u32* status, u64 item, u32 code, u32 chunk,
                                       u32 block, u32 pos, u32 a, u32 b) {
    status[2 * item] = code;
    status[2 * item + 1] = pos;
    atomicAdd(&err[7], 1u);
    if (atomicCAS(&err[0], 0u, 1u) == 0u) {
        err[1] = code;
        err[2] = chunk;
        err[3] = block;
        err[4] = pos;
        err[5] = a;
        err[6] = b;
    }
}

struct Fault {
    u32 code, pos, a, b;
};

// Where the LZ4 parser reads a block's payload from. `GlobalBytes`: the payload in global memory
// (read through the read-only cache). `SharedBytes`: the payload staged in the warp's own
// shared buffer, at its end, with the output growing towards it (see `stage_payload`). The
// parser is one template over the two, so its checks, verdicts and positions are the same code.
struct GlobalBytes {
    const u8* __restrict__ p;
    static constexpr bool in_place = false;
    __device__ __forceinline__ u32 operator[](u32 i) const { return (u32)__ldg(p + i); }
};

struct SharedBytes {
    const u8* p;
    static constexpr bool in_place = true;
    __device__ __forceinline__ u32 operator[](u32 i) const { return (u32)p[i]; }
};

// Read the extension bytes of a length whose 4-bit code was 15, 32 bytes per step (one per
// lane). Mirrors qem_codec::lz4::read_length_extension: LengthOverflow (at the token) as soon
// as the running length passes `limit`, TruncatedLength (at the missing byte) when the input
// ends first.
template <class Src>
__device__ __forceinline__ bool read_ext(const Src in, u32 in_len, u32& ip, u32& len, u32 limit,
                                         u32 token_pos, u32 lane, Fault& f) {
    while (true) {
        const u32 p = ip + lane;
        const bool valid = p < in_len;
        const u32 byte = valid ? in[p] : 0u;
        const u32 stop = __ballot_sync(FULL_MASK, valid && byte != 255u);
        if (stop != 0u) {
            const u32 k = __ffs(stop) - 1u;
            const u32 last = __shfl_sync(FULL_MASK, byte, k);
            len += 255u * k + last;
            ip += k + 1u;
            if (len > limit) {
                f = {E_LEN_OVERFLOW, token_pos, 0u, 0u};
                return false;
            }
            return true;
        }
        const u32 nvalid = __popc(__ballot_sync(FULL_MASK, valid));  // a prefix of the lanes
        len += 255u * nvalid;
        if (len > limit) {
            f = {E_LEN_OVERFLOW, token_pos, 0u, 0u};
            return false;
        }
        if (nvalid < 32u) {
            f = {E_TRUNC_LEN, in_len, 0u, 0u};
            return false;
        }
        ip += 32u;
    }
}

// What `lz4_block` ended with: the block decoded, a fault (in `f`), or, parsing in place only,
// a write that would have reached payload bytes not yet read (the caller decodes the block
// again from global memory; nothing is reported).
#define LZ4_OK 0
#define LZ4_FAULT 1
#define LZ4_OVERTAKE 2

// Decode one LZ4 block of `in_len` bytes into `dst` (shared memory), which must be filled to
// exactly `out_len` bytes. The same checks, in the same order, as
// qem_codec::lz4::decompress_block_exact, so verdicts and positions agree with the CPU.
//
// In place (`Src::in_place`), the payload lies in the same buffer from byte `at` on: input
// byte i is dst[at + i]. Output byte o may be written only once the input bytes at or below it
// have been read, so every write must stay below `at + ip`, where ip is the first byte not yet
// read. Literals copy [ip, ip+lit) to [op, op+lit) in rounds of 32 (all lanes read, then all
// write); with op <= at + ip a round never writes a byte a later round reads. A match writes
// [op, op+mlen) after its offset and length bytes are read, so it needs op + mlen <= at + ip;
// it also keeps op <= at + ip for the next literals. A valid block whose output outruns its
// remaining input by more than the buffer's margin fails that test and is decoded from global.
template <class Src>
__device__ int lz4_block(const Src in, u32 in_len, u8* dst, u32 out_len, u32 at, u32 lane,
                         Fault& f) {
    if (in_len == 0u) {
        f = {E_EMPTY, 0u, 0u, 0u};
        return LZ4_FAULT;
    }
    u32 ip = 0u, op = 0u;
    // Invariant at the top of the loop: ip < in_len, op <= out_len (and op <= at + ip in place).
    while (true) {
        const u32 token_pos = ip;
        const u32 token = in[ip];
        ip += 1u;

        u32 lit = token >> 4;
        if (lit == 15u && !read_ext(in, in_len, ip, lit, out_len, token_pos, lane, f))
            return LZ4_FAULT;
        const u32 in_left = in_len - ip;
        if (lit > in_left) {
            f = {E_LIT_PAST_IN, token_pos, lit, in_left};
            return LZ4_FAULT;
        }
        u32 room = out_len - op;
        if (lit > room) {
            f = {E_LIT_PAST_OUT, token_pos, lit, room};
            return LZ4_FAULT;
        }
        if (Src::in_place) {
            if (op > at + ip) return LZ4_OVERTAKE;  // kept by the match test; checked anyway
            for (u32 i = 0u; i < lit; i += 32u) {
                const u32 j = i + lane;
                const u32 v = j < lit ? in[ip + j] : 0u;
                __syncwarp();  // the round's reads before its writes
                if (j < lit) dst[op + j] = (u8)v;
            }
        } else {
            for (u32 i = lane; i < lit; i += 32u) dst[op + i] = (u8)in[ip + i];
        }
        ip += lit;
        op += lit;
        if (ip == in_len) break;  // the last sequence: literals only

        const u32 off_pos = ip;
        if (in_len - ip < 2u) {
            f = {E_TRUNC_OFF, off_pos, 0u, 0u};
            return LZ4_FAULT;
        }
        const u32 offset = in[ip] | (in[ip + 1u] << 8);
        ip += 2u;
        if (offset == 0u) {
            f = {E_OFF_ZERO, off_pos, 0u, 0u};
            return LZ4_FAULT;
        }
        if (offset > op) {
            f = {E_OFF_BEFORE, off_pos, offset, op};
            return LZ4_FAULT;
        }
        u32 mlen = token & 15u;
        if (mlen == 15u && !read_ext(in, in_len, ip, mlen, out_len, token_pos, lane, f))
            return LZ4_FAULT;
        mlen += 4u;
        room = out_len - op;
        if (mlen > room) {
            f = {E_MATCH_PAST_OUT, token_pos, mlen, room};
            return LZ4_FAULT;
        }
        if (Src::in_place && op + mlen > at + ip) return LZ4_OVERTAKE;
        __syncwarp();  // literals written by other lanes are visible before the match reads
        const u32 src = op - offset;  // reads stay in [src, op): already decoded, in the buffer
        if (offset == 1u) {
            const u8 b = dst[src];
            for (u32 i = lane; i < mlen; i += 32u) dst[op + i] = b;
        } else if (offset >= 32u) {
            // Each round of 32 reads only bytes before the round's first write.
            for (u32 i = 0u; i < mlen; i += 32u) {
                const u32 j = i + lane;
                if (j < mlen) dst[op + j] = dst[src + j];
                __syncwarp();
            }
        } else {
            // Overlapping short period: out[op + i] = out[src + i % offset], source bytes only.
            u32 m = lane % offset;
            const u32 step = 32u % offset;
            for (u32 i = lane; i < mlen; i += 32u) {
                dst[op + i] = dst[src + m];
                m += step;
                if (m >= offset) m -= offset;
            }
        }
        __syncwarp();
        op += mlen;
        if (ip == in_len) {
            // The block ended on a match: the format requires a final literal-only sequence.
            f = {E_SHORT_OUT, ip, op, out_len};
            return LZ4_FAULT;
        }
    }
    if (op != out_len) {
        f = {E_SHORT_OUT, in_len, op, out_len};
        return LZ4_FAULT;
    }
    __syncwarp();
    return LZ4_OK;
}

// Copy a block's payload (global, any alignment) to the end of the warp's buffer in one
// coalesced pass of 32-bit words: the payload's first byte lands at the returned offset `at`,
// congruent to `poff` mod 4, with `at + plen <= cap`. Words that straddle the payload's ends
// are read byte by byte, so nothing outside [poff, poff + plen) of the input is read.
__device__ __forceinline__ u32 stage_payload(const u8* __restrict__ in, u64 poff, u32 plen,
                                             u8* buf, u32 cap, u32 lane) {
    const u32 shift = (u32)(poff & 3ull);
    const u32 at0 = (cap - plen - shift) & ~3u;
    const u8* base = in + (poff - shift);
    u32* dw = reinterpret_cast<u32*>(buf + at0);
    const u32 end = shift + plen;  // payload bytes lie in [shift, end) of the staged words
    const u32 n_words = (end + 3u) >> 2;
    for (u32 w = lane; w < n_words; w += 32u) {
        const u32 b0 = 4u * w;
        u32 v;
        if (b0 >= shift && b0 + 4u <= end) {
            v = __ldg(reinterpret_cast<const u32*>(base + b0));
        } else {
            v = 0u;
#pragma unroll
            for (u32 k = 0u; k < 4u; ++k) {
                const u32 b = b0 + k;
                if (b >= shift && b < end) v |= (u32)__ldg(base + b) << (8u * k);
            }
        }
        dw[w] = v;
    }
    __syncwarp();
    return at0 + shift;
}

// Decode one block into the warp's buffer: staged in place when `stage` is set and the payload
// fits the buffer, from global otherwise or when the in-place parse would overtake its input.
__device__ __forceinline__ int decode_block(const u8* __restrict__ in, u64 poff, u32 plen, u8* buf,
                                            u32 olen, u32 cap, u32 stage, u32 lane, Fault& f) {
    if (stage != 0u && plen > 0u && plen + 3u <= cap) {
        const u32 at = stage_payload(in, poff, plen, buf, cap, lane);
        const int r = lz4_block(SharedBytes{buf + at}, plen, buf, olen, at, lane, f);
        if (r != LZ4_OVERTAKE) return r;
        __syncwarp();
    }
    return lz4_block(GlobalBytes{in + poff}, plen, buf, olen, 0u, lane, f);
}

// In-register transpose of bit matrices: swap the off-diagonal s x s blocks of rows r, r+s.
#define SWAP_STEP(w, r, s, m)                                  \
    {                                                          \
        const u32 t = ((w[r] >> (s)) ^ w[(r) + (s)]) & (m);    \
        w[(r) + (s)] ^= t;                                     \
        w[r] ^= t << (s);                                      \
    }

template <int NROWS, int S, u32 M>
__device__ __forceinline__ void transpose_stage(u32 (&w)[NROWS]) {
#pragma unroll
    for (int r = 0; r < NROWS; ++r) {
        if ((r & S) == 0) SWAP_STEP(w, r, S, M);
    }
}

// Un-transpose one group of 32 elements held as ES*8 plane words (bit e of w[r] = bit r of
// element e) into 8*ES output words (little-endian elements, in order).
template <int ES>
__device__ __forceinline__ void group_untranspose(u32 (&w)[8 * ES], u32 (&o)[8 * ES]);

template <>
__device__ __forceinline__ void group_untranspose<1>(u32 (&w)[8], u32 (&o)[8]) {
    // Three stages transpose the four 8x8 byte matrices; then w[e] byte j = element 8j + e.
    transpose_stage<8, 4, 0x0F0F0F0Fu>(w);
    transpose_stage<8, 2, 0x33333333u>(w);
    transpose_stage<8, 1, 0x55555555u>(w);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int base = (k & 1) * 4;
        const u32 b = (u32)(k >> 1);
        const u32 sel = b | ((b + 4u) << 4);
        const u32 lo = __byte_perm(w[base], w[base + 1], sel);
        const u32 hi = __byte_perm(w[base + 2], w[base + 3], sel);
        o[k] = __byte_perm(lo, hi, 0x5410);
    }
}

template <>
__device__ __forceinline__ void group_untranspose<2>(u32 (&w)[16], u32 (&o)[16]) {
    // Both 16x16 halves at once; then w[e] = element e (low half) | element 16+e (high half).
    transpose_stage<16, 8, 0x00FF00FFu>(w);
    transpose_stage<16, 4, 0x0F0F0F0Fu>(w);
    transpose_stage<16, 2, 0x33333333u>(w);
    transpose_stage<16, 1, 0x55555555u>(w);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        o[k] = __byte_perm(w[2 * k], w[2 * k + 1], 0x5410);
        o[8 + k] = __byte_perm(w[2 * k], w[2 * k + 1], 0x7632);
    }
}

template <>
__device__ __forceinline__ void group_untranspose<4>(u32 (&w)[32], u32 (&o)[32]) {
    transpose_stage<32, 16, 0x0000FFFFu>(w);
    transpose_stage<32, 8, 0x00FF00FFu>(w);
    transpose_stage<32, 4, 0x0F0F0F0Fu>(w);
    transpose_stage<32, 2, 0x33333333u>(w);
    transpose_stage<32, 1, 0x55555555u>(w);
#pragma unroll
    for (int k = 0; k < 32; ++k) o[k] = w[k];
}

// Fast path: n elements with n % 32 == 0 (planes of n/8 bytes, a multiple of 4) and a 4-byte
// aligned destination. Lane g takes groups g, g+32, ...: its plane-word loads are consecutive
// across lanes (no bank conflicts); the transpose is in registers.
template <int ES>
__device__ __forceinline__ void untranspose_fast(const u8* planes, u32 n, u8* out, u32 lane) {
    const u32* pw = reinterpret_cast<const u32*>(planes);
    const u32 stride = n / 32u;  // plane length in words = number of groups
    const bool v16 = (reinterpret_cast<u64>(out) & 15ull) == 0ull;
    for (u32 g = lane; g < stride; g += 32u) {
        u32 w[8 * ES];
        u32 o[8 * ES];
#pragma unroll
        for (int r = 0; r < 8 * ES; ++r) w[r] = pw[r * stride + g];
        group_untranspose<ES>(w, o);
        u8* dst = out + (u64)g * (32u * ES);
        if (v16) {
            uint4* d4 = reinterpret_cast<uint4*>(dst);
#pragma unroll
            for (int k = 0; k < 2 * ES; ++k)
                d4[k] = make_uint4(o[4 * k], o[4 * k + 1], o[4 * k + 2], o[4 * k + 3]);
        } else {
            u32* d = reinterpret_cast<u32*>(dst);
#pragma unroll
            for (int k = 0; k < 8 * ES; ++k) d[k] = o[k];
        }
    }
}

// Byte-granular path: any n multiple of 8 (the last partial block), any destination alignment.
template <int ES>
__device__ __forceinline__ void untranspose_bytes(const u8* planes, u32 n, u8* out, u32 lane) {
    const u32 pb = n / 8u;
    for (u32 e = lane; e < n; e += 32u) {
        u32 v = 0u;
        const u8* p = planes + (e >> 3);
        const u32 sh = e & 7u;
#pragma unroll
        for (int r = 0; r < 8 * ES; ++r) v |= (((u32)p[r * pb] >> sh) & 1u) << r;
#pragma unroll
        for (int j = 0; j < ES; ++j) out[(u64)e * ES + j] = (u8)(v >> (8 * j));
    }
}

// Block descriptor: 8 u32 words (see bslz4.rs BlockDesc).
//   [0,1] payload offset in the input (lo, hi)   [2] payload bytes   [3] output bytes
//   [4,5] output byte offset (lo, hi)            [6] chunk index     [7] block index in chunk
// Copy descriptor: [0,1] source offset  [2,3] destination offset  [4] bytes  [5] chunk  [6,7] 0
template <int ES>
__device__ __forceinline__ void run(const u8* __restrict__ in, u64 in_len,
                                    const u32* __restrict__ blocks, u32 n_blocks,
                                    const u32* __restrict__ copies, u32 n_copies, u8* out,
                                    u64 out_len, u32* err, u32* status, u32 smem_per_warp,
                                    u32 stage) {
    extern __shared__ __align__(16) u8 smem[];
    const u32 lane = threadIdx.x & 31u;
    const u32 warp = threadIdx.x >> 5;
    const u32 warps_per_cta = blockDim.x >> 5;
    u8* buf = smem + (u64)warp * smem_per_warp;
    const u64 n_items = (u64)n_blocks + n_copies;
    const u64 stride = (u64)gridDim.x * warps_per_cta;
    for (u64 item = (u64)blockIdx.x * warps_per_cta + warp; item < n_items; item += stride) {
        if (item < n_blocks) {
            const uint4* d = reinterpret_cast<const uint4*>(blocks + 8 * item);
            const uint4 d0 = __ldg(d);
            const uint4 d1 = __ldg(d + 1);
            const u64 poff = (u64)d0.x | ((u64)d0.y << 32);
            const u32 plen = d0.z;
            const u32 olen = d0.w;
            const u64 ooff = (u64)d1.x | ((u64)d1.y << 32);
            const u32 chunk = d1.z;
            const u32 bidx = d1.w;
            const bool desc_ok = poff <= in_len && plen <= in_len - poff && ooff <= out_len &&
                                 olen <= out_len - ooff && olen <= smem_per_warp &&
                                 (ES == 0 || olen % (8u * (ES > 0 ? ES : 1)) == 0u);
            if (!desc_ok) {
                if (lane == 0u) report(err, status, item, E_BAD_DESC, chunk, bidx, 0u, olen, plen);
                continue;
            }
            Fault f;
            if (decode_block(in, poff, plen, buf, olen, smem_per_warp, stage, lane, f) != LZ4_OK) {
                if (lane == 0u) report(err, status, item, f.code, chunk, bidx, f.pos, f.a, f.b);
                __syncwarp();
                continue;
            }
            u8* dst = out + ooff;
            if (ES == 0) {
                for (u32 i = lane; i < olen; i += 32u) dst[i] = buf[i];
            } else {
                const u32 n = olen / (u32)(ES > 0 ? ES : 1);
                if (n % 32u == 0u && (reinterpret_cast<u64>(dst) & 3ull) == 0ull) {
                    untranspose_fast<(ES > 0 ? ES : 1)>(buf, n, dst, lane);
                } else {
                    untranspose_bytes<(ES > 0 ? ES : 1)>(buf, n, dst, lane);
                }
            }
            if (lane == 0u) {
                status[2 * item] = E_OK;
                status[2 * item + 1] = 0u;
            }
            __syncwarp();  // the buffer is reused by this warp's next item
        } else {
            const u64 c = item - n_blocks;
            const uint4* d = reinterpret_cast<const uint4*>(copies + 8 * c);
            const uint4 d0 = __ldg(d);
            const uint4 d1 = __ldg(d + 1);
            const u64 src = (u64)d0.x | ((u64)d0.y << 32);
            const u64 dsto = (u64)d0.z | ((u64)d0.w << 32);
            const u32 len = d1.x;
            const u32 chunk = d1.y;
            const bool ok =
                src <= in_len && len <= in_len - src && dsto <= out_len && len <= out_len - dsto;
            if (!ok) {
                if (lane == 0u) report(err, status, item, E_BAD_COPY, chunk, 0xffffffffu, 0u, len, 0u);
                continue;
            }
            for (u32 i = lane; i < len; i += 32u) out[dsto + i] = __ldg(in + src + i);
            if (lane == 0u) {
                status[2 * item] = E_OK;
                status[2 * item + 1] = 0u;
            }
        }
    }
}

#define QEM_KERNEL(name, ES)                                                                    \
    extern "C" __global__ void __launch_bounds__(QEM_MAX_THREADS)                              \
        name(const u8* __restrict__ in, u64 in_len, const u32* __restrict__ blocks, u32 n_blocks, \
             const u32* __restrict__ copies, u32 n_copies, u8* out, u64 out_len, u32* err,      \
             u32* status, u32 smem_per_warp, u32 stage) {                                       \
        run<ES>(in, in_len, blocks, n_blocks, copies, n_copies, out, out_len, err, status,      \
                smem_per_warp, stage);                                                          \
    }

#ifndef QEM_MAX_THREADS
#define QEM_MAX_THREADS 256
#endif

QEM_KERNEL(qem_bslz4_decode_u8, 1)
QEM_KERNEL(qem_bslz4_decode_u16, 2)
QEM_KERNEL(qem_bslz4_decode_u32, 4)
QEM_KERNEL(qem_lz4_decode_plain, 0)
