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
