// The element-wise steps that finish two device results on the card (device_forms.rs): the mean
// DP from the exact sum DP, and the centre of mass from the exact moments. Each does the host
// form's f64 operations in the host form's order (qem::detector::mean_dp,
// qem_cpu::dpc::com_from_moments and the calibration factor of qem::dpc::center_of_mass), with
// the rounding spelled out by intrinsics, so the two forms agree bit for bit. No product here
// is added to anything, so no fused multiply-add can form.

typedef unsigned long long u64;

// mean[i] = (float)((double)sum[i] / n_frames), both roundings to nearest.
extern "C" __global__ void qem_mean_dp(const u64* __restrict__ sum, float* __restrict__ mean,
                                       u64 n, double n_frames) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        mean[i] = __double2float_rn(__ddiv_rn(__ull2double_rn(sum[i]), n_frames));
    }
}

// CoM of every frame: row[i] = m_row[i] / s[i], col[i] = m_col[i] / s[i]; 0 where s[i] = 0.
extern "C" __global__ void qem_com_divide(const u64* __restrict__ s, const u64* __restrict__ m_row,
                                          const u64* __restrict__ m_col, double* __restrict__ row,
                                          double* __restrict__ col, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        const u64 si = s[i];
        if (si == 0ull) {
            row[i] = 0.0;
            col[i] = 0.0;
        } else {
            const double d = __ull2double_rn(si);
            row[i] = __ddiv_rn(__ull2double_rn(m_row[i]), d);
            col[i] = __ddiv_rn(__ull2double_rn(m_col[i]), d);
        }
    }
}

// Block j sums chunk j (`chunk` frames): row and col added in frame order from 0.0 (the CPU's
// ordered sums) into parts[2j], parts[2j + 1], and the chunk's frames with s = 0 into
// zeros[j]. The caller adds the chunk sums in chunk order. The values are staged in shared
// memory a tile at a time (coalesced loads by all threads) and thread 0 adds them in order: a
// thread reading its chunk serially from global memory waited on every load (~2 ms for the
// 512² scan on an H100).
#define COM_TILE 1024
extern "C" __global__ void qem_com_chunk_sums(const u64* __restrict__ s,
                                              const double* __restrict__ row,
                                              const double* __restrict__ col, u64 n, u64 chunk,
                                              u64 n_chunks, double* __restrict__ parts,
                                              u64* __restrict__ zeros) {
    __shared__ double tr[COM_TILE], tc[COM_TILE];
    __shared__ unsigned int tile_zeros;
    const u64 j = blockIdx.x;
    if (j >= n_chunks) {
        return;
    }
    if (threadIdx.x == 0) {
        tile_zeros = 0u;
    }
    __syncthreads();
    const u64 lo = j * chunk;
    const u64 hi = lo + chunk < n ? lo + chunk : n;
    double sr = 0.0, sc = 0.0;
    unsigned int z = 0u;
    for (u64 base = lo; base < hi; base += COM_TILE) {
        const unsigned int m = (unsigned int)(hi - base < COM_TILE ? hi - base : COM_TILE);
        for (unsigned int i = threadIdx.x; i < m; i += blockDim.x) {
            tr[i] = row[base + i];
            tc[i] = col[base + i];
            z += s[base + i] == 0ull ? 1u : 0u;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (unsigned int i = 0; i < m; ++i) {
                sr = __dadd_rn(sr, tr[i]);
                sc = __dadd_rn(sc, tc[i]);
            }
        }
        __syncthreads();
    }
    atomicAdd(&tile_zeros, z);
    __syncthreads();
    if (threadIdx.x == 0) {
        parts[2 * j] = sr;
        parts[2 * j + 1] = sc;
        zeros[j] = tile_zeros;
    }
}

// The centring and the calibration, each where asked, in that order: x = x - mean, then
// x = x * factor (per component).
extern "C" __global__ void qem_com_finish(double* __restrict__ row, double* __restrict__ col,
                                          u64 n, int center, double mean_r, double mean_c,
                                          int scale, double f_r, double f_c) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        double r = row[i], c = col[i];
        if (center) {
            r = __dsub_rn(r, mean_r);
            c = __dsub_rn(c, mean_c);
        }
        if (scale) {
            r = __dmul_rn(r, f_r);
            c = __dmul_rn(c, f_c);
        }
        row[i] = r;
        col[i] = c;
    }
}

// y[i] = x[i] * f: one factor applied after the engine's pass (a calibration the user set).
extern "C" __global__ void qem_scale_f64(const double* __restrict__ x, double* __restrict__ y,
                                         u64 n, double f) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        y[i] = __dmul_rn(x[i], f);
    }
}
