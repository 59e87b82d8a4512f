// iDPC in Fourier space (qem_cpu::dpc::integrate is the specification): given the half
// spectra A = D2Z(g_row), B = D2Z(g_col) of a rows × cols field (cols/2 + 1 complex values per
// row), write φ̂ = −i (ν_r A + ν_c B) / (2π |ν|²) · scale into A, φ̂(0) = 0, with ν in cycles per
// scan step (ν_r = fftfreq(rows), ν_c = j / cols for the half spectrum's j). `scale` folds the
// 1/(rows·cols) of the unnormalised inverse transform.
//
// Nyquist lines (even sizes): the CPU solver takes the real part of a full complex inverse,
// which drops the part of φ̂ that is not Hermitian — there, the ν_r term on the Nyquist row and
// the ν_c term on the Nyquist column (ν = −1/2 on both sides of the pair). A complex-to-real
// transform assumes a Hermitian input instead, so those terms are dropped here explicitly (the
// denominator keeps the whole |ν|²); both solvers then compute the same phase.

typedef unsigned int u32;

extern "C" __global__ void qem_idpc_combine(double2* __restrict__ a, const double2* __restrict__ b,
                                            u32 rows, u32 cols, u32 half, double scale) {
    const unsigned long long total = (unsigned long long)rows * half;
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         k < total; k += (unsigned long long)gridDim.x * blockDim.x) {
        const u32 i = (u32)(k / half), j = (u32)(k % half);
        const double nr = (i < (rows + 1u) / 2u ? (double)i : (double)i - (double)rows) / rows;
        const double nc = (double)j / cols;
        const double d = nr * nr + nc * nc;
        const double nr_num = ((rows & 1u) == 0u && i == rows / 2u) ? 0.0 : nr;
        const double nc_num = ((cols & 1u) == 0u && j == cols / 2u) ? 0.0 : nc;
        double2 out;
        if (d == 0.0) {
            out.x = 0.0;
            out.y = 0.0;
        } else {
            const double2 x = a[k], y = b[k];
            const double re = x.x * nr_num + y.x * nc_num, im = x.y * nr_num + y.y * nc_num;
            // −i (re + i·im) = im − i·re
            const double f = scale / (6.283185307179586 * d);
            out.x = im * f;
            out.y = -re * f;
        }
        a[k] = out;
    }
}

// ---------------------------------------------------------------------------------------------
// The stages of dpc.run after the reduction, on the card (dpc.rs). Each does the CPU engine's
// f64 operations (qem_cpu::dpc) in the same order, the rounding spelled out by intrinsics so no
// fused multiply-add forms: the curl moments, the aligned field and the sign statistics equal
// the CPU's bit for bit; only the transforms (cuFFT against rustfft) differ by rounding.

typedef unsigned long long u64;

// Ordered sums (the CPU's serial order) without a serial read of global memory: a block
// stages a tile of per-index terms in shared memory (loads coalesced, terms computed by all
// threads: each term is rounded alone, so this is order-free), then thread 0 adds the tile's
// terms into its running sums in index order. One warp reading serially waited ~600 cycles per
// value (2 ms for 2 × 262,144 values, H100); from shared memory the adds follow one another.
#define QEM_TILE 512

// Every thread of the block calls it once the tile is written: thread 0 adds acc[q] += t[q][k]
// for k = 0 .. m − 1 in order, between two barriers (the tile is complete before, free after).
template <int K>
__device__ __forceinline__ void add_tile_in_order(double* acc, const double (*t)[QEM_TILE],
                                                  u32 m) {
    __syncthreads();
    if (threadIdx.x == 0) {
        for (u32 k = 0; k < m; ++k) {
#pragma unroll
            for (int q = 0; q < K; ++q) {
                acc[q] = __dadd_rn(acc[q], t[q][k]);
            }
        }
    }
    __syncthreads();
}

// Thread 0 writes its K sums to out[0 .. K).
template <int K>
__device__ __forceinline__ void store_sums(double* out, const double* acc) {
    if (threadIdx.x == 0) {
#pragma unroll
        for (int q = 0; q < K; ++q) {
            out[q] = acc[q];
        }
    }
}

// CurlMoments::pair_of: block t sums interior row r = t + 1 over k = 1 .. cols − 2, in order
// from 0.0 as the CPU does each row, into parts[6t .. 6t + 6] = (curl², div², curl·div) of the
// field and of the transposed field. The caller adds the rows in row order.
extern "C" __global__ void qem_dpc_curl_rows(const double* __restrict__ gr,
                                             const double* __restrict__ gc, u32 rows, u32 cols,
                                             double* __restrict__ parts) {
    __shared__ double terms[6][QEM_TILE];
    const u32 t = blockIdx.x;
    if (t + 2u >= rows) {
        return;
    }
    const u64 c = cols;
    const double* up_r = gr + (u64)t * c;
    const double* mid_r = up_r + c;
    const double* dn_r = mid_r + c;
    const double* up_c = gc + (u64)t * c;
    const double* mid_c = up_c + c;
    const double* dn_c = mid_c + c;
    double acc[6] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    for (u32 k0 = 1; k0 + 1u < cols; k0 += QEM_TILE) {
        const u32 m = min((u32)QEM_TILE, cols - 1u - k0);
        for (u32 i = threadIdx.x; i < m; i += blockDim.x) {
            const u32 k = k0 + i;
            const double d_r_gc = __dmul_rn(0.5, __dsub_rn(dn_c[k], up_c[k]));
            const double d_c_gr = __dmul_rn(0.5, __dsub_rn(mid_r[k + 1], mid_r[k - 1]));
            const double d_r_gr = __dmul_rn(0.5, __dsub_rn(dn_r[k], up_r[k]));
            const double d_c_gc = __dmul_rn(0.5, __dsub_rn(mid_c[k + 1], mid_c[k - 1]));
            const double curl = __dsub_rn(d_r_gc, d_c_gr), div = __dadd_rn(d_r_gr, d_c_gc);
            const double curl_t = __dsub_rn(d_r_gr, d_c_gc), div_t = __dadd_rn(d_r_gc, d_c_gr);
            terms[0][i] = __dmul_rn(curl, curl);
            terms[1][i] = __dmul_rn(div, div);
            terms[2][i] = __dmul_rn(curl, div);
            terms[3][i] = __dmul_rn(curl_t, curl_t);
            terms[4][i] = __dmul_rn(div_t, div_t);
            terms[5][i] = __dmul_rn(curl_t, div_t);
        }
        add_tile_in_order<6>(acc, terms, m);
    }
    store_sums<6>(parts + 6ull * t, acc);
}

// align, then the integration's scale: with (x, y) = (a[i], b[i]) (the caller passes the CoM
// components exchanged when transposed), d_r = cos·x − sin·y, d_c = sin·x + cos·y, and the
// gradient g = (d_r·k_r, d_c·k_c).
extern "C" __global__ void qem_dpc_align(const double* __restrict__ a,
                                         const double* __restrict__ b, u64 n, double cs,
                                         double sn, double kr, double kc, double* __restrict__ dr,
                                         double* __restrict__ dc, double* __restrict__ gr,
                                         double* __restrict__ gc) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        const double x = a[i], y = b[i];
        const double r = __dsub_rn(__dmul_rn(cs, x), __dmul_rn(sn, y));
        const double q = __dadd_rn(__dmul_rn(sn, x), __dmul_rn(cs, y));
        dr[i] = r;
        dc[i] = q;
        gr[i] = __dmul_rn(r, kr);
        gc[i] = __dmul_rn(q, kc);
    }
}

// The even extension of integrate_with(Mirror) to 2·rows × 2·cols: position (i, j) takes the
// field at the mirrored (si, sj), the row component negated in the row-mirrored half and the
// column component in the column-mirrored half.
extern "C" __global__ void qem_dpc_mirror(const double* __restrict__ gr,
                                          const double* __restrict__ gc, u32 rows, u32 cols,
                                          double* __restrict__ xr, double* __restrict__ xc) {
    const u64 er = 2ull * rows, ec = 2ull * cols, total = er * ec;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += (u64)gridDim.x * blockDim.x) {
        const u64 i = k / ec, j = k % ec;
        const bool fr = i >= rows, fc = j >= cols;
        const u64 src = (fr ? er - 1 - i : i) * cols + (fc ? ec - 1 - j : j);
        const double vr = gr[src], vc = gc[src];
        xr[k] = fr ? -vr : vr;
        xc[k] = fc ? -vc : vc;
    }
}

// The top-left rows × cols quarter of a rows × ec grid.
extern "C" __global__ void qem_dpc_crop(const double* __restrict__ ext, u32 rows, u32 cols,
                                        u32 ec, double* __restrict__ out) {
    const u64 total = (u64)rows * cols;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += (u64)gridDim.x * blockDim.x) {
        out[k] = ext[(k / cols) * ec + k % cols];
    }
}

// The CPU's ordered sums (qem_cpu::dpc::ordered_sums), first pass: block j sums chunk j
// (`chunk` values) of a (and of b as f64 when given) from 0.0 in index order into parts[2j],
// parts[2j + 1]. The caller adds the chunk sums in chunk order.
extern "C" __global__ void qem_dpc_chunk_sums(const double* __restrict__ a,
                                              const u64* __restrict__ b, u64 n, u64 chunk,
                                              u64 n_chunks, double* __restrict__ parts) {
    __shared__ double terms[2][QEM_TILE];
    const u64 j = blockIdx.x;
    if (j >= n_chunks) {
        return;
    }
    const u64 lo = j * chunk, hi = lo + chunk < n ? lo + chunk : n;
    double acc[2] = {0.0, 0.0};
    for (u64 base = lo; base < hi; base += QEM_TILE) {
        const u32 m = (u32)min((u64)QEM_TILE, hi - base);
        for (u32 i = threadIdx.x; i < m; i += blockDim.x) {
            terms[0][i] = a[base + i];
            terms[1][i] = b ? __ull2double_rn(b[base + i]) : 0.0;
        }
        add_tile_in_order<2>(acc, terms, m);
    }
    store_sums<2>(parts + 2 * j, acc);
}

// Second pass of the sign statistics (qem_cpu::dpc::sign_statistics): with dx = a − ma and
// dy = b − mb (0 without b), the chunk sums of dx·dy, dx², dy², dx²·dx into parts[4j ..].
extern "C" __global__ void qem_dpc_centred_sums(const double* __restrict__ a,
                                                const u64* __restrict__ b, u64 n, u64 chunk,
                                                u64 n_chunks, double ma, double mb,
                                                double* __restrict__ parts) {
    __shared__ double terms[4][QEM_TILE];
    const u64 j = blockIdx.x;
    if (j >= n_chunks) {
        return;
    }
    const u64 lo = j * chunk, hi = lo + chunk < n ? lo + chunk : n;
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    for (u64 base = lo; base < hi; base += QEM_TILE) {
        const u32 m = (u32)min((u64)QEM_TILE, hi - base);
        for (u32 i = threadIdx.x; i < m; i += blockDim.x) {
            const double dx = __dsub_rn(a[base + i], ma);
            const double dy = b ? __dsub_rn(__ull2double_rn(b[base + i]), mb) : 0.0;
            const double dx2 = __dmul_rn(dx, dx);
            terms[0][i] = __dmul_rn(dx, dy);
            terms[1][i] = dx2;
            terms[2][i] = __dmul_rn(dy, dy);
            terms[3][i] = __dmul_rn(dx2, dx);
        }
        add_tile_in_order<4>(acc, terms, m);
    }
    store_sums<4>(parts + 4 * j, acc);
}

// x[i] = sign · (x[i] − shift) for the n values of x: the phase's mean removed (sign 1) or a
// field negated (shift 0, sign −1; exact either way).
extern "C" __global__ void qem_dpc_shift(double* __restrict__ x, u64 n, double shift,
                                         int negate) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        const double v = __dsub_rn(x[i], shift);
        x[i] = negate ? -v : v;
    }
}
