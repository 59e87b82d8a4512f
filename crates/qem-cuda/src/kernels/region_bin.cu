// Frame transforms of the load pipeline (wrapper: src/transform.rs).
//
// qem_region_bin_<S>_<T>: decoded source frames (dtype S, frame-contiguous) -> result frames
// (dtype T), exactly as the CPU engine's FramePlan: bad pixels read 0, then the half-open
// detector region [r0, r1) x [c0, c1), then count-preserving binning by `bin` summing in u64
// over the pixels that exist (partial edge blocks kept), then the store: exact (a value above
// t_max records an overflow: result frame, pixel, value) or saturating (clipped values are
// counted). One thread per result pixel, grid-stride over (frame, pixel).
//
// qem_zero_pixels_<T>: zero the listed pixels of every result frame (mask of a pass-through
// load that decoded straight into the result).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// err: [0] flag, [1] result frame, [2] out row, [3] out col, [4] value lo, [5] value hi,
//      [6] overflow count, [7] unused
template <typename S, typename T>
__device__ __forceinline__ void region_bin(const S* __restrict__ src, u64 src_frame_elems,
                                           u32 src_cols, u32 r0, u32 r1, u32 c0, u32 c1,
                                           u32 bin, u32 out_rows, u32 out_cols,
                                           const u8* __restrict__ bad, u32 has_bad,
                                           const u32* __restrict__ dst_frame, u32 n_frames,
                                           T* __restrict__ dst, u64 t_max, u32 saturate,
                                           u32* err, unsigned long long* saturated) {
    const u64 per = (u64)out_rows * out_cols;
    const u64 total = per * n_frames;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const u32 j = (u32)(i / per);
        const u64 p = i - (u64)j * per;
        const u32 df = dst_frame[j];
        if (df == 0xffffffffu) continue;
        const u32 orow = (u32)(p / out_cols);
        const u32 ocol = (u32)(p - (u64)orow * out_cols);
        const S* f = src + (u64)j * src_frame_elems;
        const u32 rs = r0 + orow * bin;
        const u32 re = min(rs + bin, r1);
        const u32 cs = c0 + ocol * bin;
        const u32 ce = min(cs + bin, c1);
        u64 acc = 0;
        for (u32 r = rs; r < re; ++r) {
            const u64 base = (u64)r * src_cols;
            for (u32 c = cs; c < ce; ++c) {
                const u64 k = base + c;
                if (has_bad && bad[k]) continue;
                acc += (u64)f[k];
            }
        }
        T out;
        if (acc <= t_max) {
            out = (T)acc;
        } else if (saturate) {
            atomicAdd(saturated, 1ull);
            out = (T)t_max;
        } else {
            out = (T)t_max;
            atomicAdd(&err[6], 1u);
            if (atomicCAS(&err[0], 0u, 1u) == 0u) {
                err[1] = df;
                err[2] = orow;
                err[3] = ocol;
                err[4] = (u32)acc;
                err[5] = (u32)(acc >> 32);
            }
        }
        dst[(u64)df * per + p] = out;
    }
}

#define QEM_REGION_BIN(name, S, T)                                                             \
    extern "C" __global__ void name(const S* src, u64 src_frame_elems, u32 src_cols, u32 r0,   \
                                    u32 r1, u32 c0, u32 c1, u32 bin, u32 out_rows,             \
                                    u32 out_cols, const u8* bad, u32 has_bad,                  \
                                    const u32* dst_frame, u32 n_frames, T* dst, u64 t_max,     \
                                    u32 saturate, u32* err, unsigned long long* saturated) {   \
        region_bin<S, T>(src, src_frame_elems, src_cols, r0, r1, c0, c1, bin, out_rows,        \
                         out_cols, bad, has_bad, dst_frame, n_frames, dst, t_max, saturate,    \
                         err, saturated);                                                      \
    }

QEM_REGION_BIN(qem_region_bin_u8_u8, u8, u8)
QEM_REGION_BIN(qem_region_bin_u8_u16, u8, u16)
QEM_REGION_BIN(qem_region_bin_u8_u32, u8, u32)
QEM_REGION_BIN(qem_region_bin_u16_u8, u16, u8)
QEM_REGION_BIN(qem_region_bin_u16_u16, u16, u16)
QEM_REGION_BIN(qem_region_bin_u16_u32, u16, u32)
QEM_REGION_BIN(qem_region_bin_u32_u8, u32, u8)
QEM_REGION_BIN(qem_region_bin_u32_u16, u32, u16)
QEM_REGION_BIN(qem_region_bin_u32_u32, u32, u32)

#define QEM_ZERO_PIXELS(name, T)                                                               \
    extern "C" __global__ void name(T* dst, u64 n_frames, u64 frame_elems, const u32* idx,     \
                                    u32 n_idx) {                                               \
        const u64 total = n_frames * (u64)n_idx;                                               \
        const u64 stride = (u64)gridDim.x * blockDim.x;                                        \
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {     \
            const u64 f = i / n_idx;                                                           \
            const u32 k = (u32)(i - f * n_idx);                                                \
            dst[f * frame_elems + idx[k]] = (T)0;                                              \
        }                                                                                      \
    }

QEM_ZERO_PIXELS(qem_zero_pixels_u8, u8)
QEM_ZERO_PIXELS(qem_zero_pixels_u16, u16)
QEM_ZERO_PIXELS(qem_zero_pixels_u32, u32)

// sums[p] += Σ_f frames[f][p] over the batch's frames the map keeps (map[f] ≠ u32::MAX): an
// encoded load's sum DP, taken on the way from the frames it encodes (masked, transformed). A
// block takes 1024 pixels (four per thread: one 8-byte load per frame when frame_elems is a
// multiple of 4, else four 2-byte loads) over FRAME_SUM_SPAN frames (blockIdx.y), in u32 per
// thread (≤ FRAME_SUM_SPAN · 65535 < 2³²), then one 64-bit atomic add per pixel and block.
#define FRAME_SUM_SPAN 128u
extern "C" __global__ void __launch_bounds__(256)
qem_frame_sums_u16(const u16* __restrict__ frames, u64 n_frames, u64 frame_elems,
                   const u32* __restrict__ map, unsigned long long* __restrict__ sums) {
    const u64 f0 = (u64)blockIdx.y * FRAME_SUM_SPAN;
    const u64 f1 = min(n_frames, f0 + FRAME_SUM_SPAN);
    const u64 p = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 4u;
    if (p >= frame_elems) return;
    u32 a[4] = {0u, 0u, 0u, 0u};
    if (frame_elems % 4u == 0u) {
#pragma unroll 4
        for (u64 f = f0; f < f1; ++f) {
            if (__ldg(map + f) == 0xffffffffu) continue;
            const uint2 w = __ldcs(reinterpret_cast<const uint2*>(frames + f * frame_elems + p));
            a[0] += w.x & 0xffffu;
            a[1] += w.x >> 16;
            a[2] += w.y & 0xffffu;
            a[3] += w.y >> 16;
        }
    } else {
        for (u64 f = f0; f < f1; ++f) {
            if (__ldg(map + f) == 0xffffffffu) continue;
            const u16* row = frames + f * frame_elems;
#pragma unroll
            for (u32 k = 0; k < 4u; ++k) {
                if (p + k < frame_elems) a[k] += row[p + k];
            }
        }
    }
#pragma unroll
    for (u32 k = 0; k < 4u; ++k) {
        if (a[k] != 0u && p + k < frame_elems) atomicAdd(sums + p + k, (unsigned long long)a[k]);
    }
}
