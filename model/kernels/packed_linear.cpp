// y[M, N] = x[M, K] . W^T (+ b), float32, one thread, AVX-512: the compiled decode step's projections.
//
// W is packed once into panels of 32 output columns, p[N/32][K][32] (the last panel padded with
// zero columns), so a panel's k-th row is two vectors. Every output is one FMA chain over
// k = 0..K-1 starting from zero, then the bias added: whatever M is and whichever register block a
// row falls in, its bits are the same, so a session's text does not depend on the batch it shared.
// The blocks differ only in how many rows share a panel's loads (12, 8, 4, 2, 1) and how many
// panels a few rows walk at once (more independent chains where there is little reuse).
//
// Two entry points over the same code: linstream_packed_linear (raw pointers, for ctypes and the
// eager op) and aoti_torch_cpu_packed_linear, the C shim AOTInductor's generated step calls for
// torch.ops.linstream.packed_linear (model/kernels/__init__.py).
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

namespace {

constexpr int NR = 32;  // a panel's columns: two vectors

template <int MR, int NP>
inline void block(const float *x, int64_t ldx, const float *p, int64_t K, const float *bias, float *y, int64_t ldy,
                  int64_t cols) {
    // MR rows x NP panels; `cols` = valid columns in the last panel (32 unless it is the matrix's last)
    __m512 acc[MR][NP][2];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NP; j++) acc[i][j][0] = acc[i][j][1] = _mm512_setzero_ps();
    const int64_t panel = K * NR;
    for (int64_t k = 0; k < K; k++) {
        __m512 b[NP][2];
        for (int j = 0; j < NP; j++) {
            b[j][0] = _mm512_loadu_ps(p + j * panel + k * NR);
            b[j][1] = _mm512_loadu_ps(p + j * panel + k * NR + 16);
        }
        for (int i = 0; i < MR; i++) {
            __m512 a = _mm512_set1_ps(x[i * ldx + k]);
            for (int j = 0; j < NP; j++) {
                acc[i][j][0] = _mm512_fmadd_ps(a, b[j][0], acc[i][j][0]);
                acc[i][j][1] = _mm512_fmadd_ps(a, b[j][1], acc[i][j][1]);
            }
        }
    }
    for (int j = 0; j < NP; j++) {
        int64_t c = j == NP - 1 ? cols : NR;  // only the last panel of a call can be short
        __mmask16 m0 = c >= 16 ? 0xffff : (__mmask16)((1u << c) - 1);
        __mmask16 m1 = c <= 16 ? 0 : c >= 32 ? 0xffff : (__mmask16)((1u << (c - 16)) - 1);
        __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias + j * NR) : _mm512_setzero_ps();
        __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + j * NR + 16) : _mm512_setzero_ps();
        for (int i = 0; i < MR; i++) {
            __m512 v0 = acc[i][j][0], v1 = acc[i][j][1];
            if (bias) { v0 = _mm512_add_ps(v0, b0); v1 = _mm512_add_ps(v1, b1); }
            _mm512_mask_storeu_ps(y + i * ldy + j * NR, m0, v0);
            _mm512_mask_storeu_ps(y + i * ldy + j * NR + 16, m1, v1);
        }
    }
}

// rows x (MR of them) against panels j0..j1-1 of the weights, NP panels at a time, then one at a time
template <int MR, int NP>
inline void rows(const float *x, int64_t ldx, const float *p, int64_t K, int64_t N, int64_t j0, int64_t j1,
                 const float *bias, float *y) {
    const int64_t panels = (N + NR - 1) / NR;
    int64_t j = j0;
    for (; j + NP <= j1; j += NP) {
        int64_t cols = j + NP == panels ? N - (panels - 1) * NR : NR;
        block<MR, NP>(x, ldx, p + j * K * NR, K, bias ? bias + j * NR : nullptr, y + j * NR, N, cols);
    }
    for (; j < j1; j++) {
        int64_t cols = j + 1 == panels ? N - j * NR : NR;
        block<MR, 1>(x, ldx, p + j * K * NR, K, bias ? bias + j * NR : nullptr, y + j * NR, N, cols);
    }
}

constexpr int64_t GROUP = 8;  // panels whose weights (8 x K x 32 floats) stay in L2 while every row passes

}  // namespace

extern "C" {

// W (N, K) row-major -> p (ceil(N/32), K, 32), zero-padded
void linstream_pack(const float *w, int64_t N, int64_t K, float *p) {
    const int64_t panels = (N + NR - 1) / NR;
    for (int64_t q = 0; q < panels; q++)
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < NR; j++) {
                int64_t n = q * NR + j;
                p[(q * K + k) * NR + j] = n < N ? w[n * K + k] : 0.0f;
            }
}

void linstream_packed_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const float *p, int64_t N,
                             const float *bias, float *y) {
    // 12-row blocks share each panel's loads; fewer rows walk several panels at once instead
    const int64_t panels = (N + NR - 1) / NR;
    for (int64_t j0 = 0; j0 < panels; j0 += GROUP) {
        const int64_t j1 = j0 + GROUP < panels ? j0 + GROUP : panels;
        int64_t i = 0;
        for (; i + 12 <= M; i += 12) rows<12, 1>(x + i * ldx, ldx, p, K, N, j0, j1, bias, y + i * N);
        for (; i + 8 <= M; i += 8) rows<8, 1>(x + i * ldx, ldx, p, K, N, j0, j1, bias, y + i * N);
        for (; i + 4 <= M; i += 4) rows<4, 2>(x + i * ldx, ldx, p, K, N, j0, j1, bias, y + i * N);
        for (; i + 2 <= M; i += 2) rows<2, 4>(x + i * ldx, ldx, p, K, N, j0, j1, bias, y + i * N);
        for (; i < M; i++) rows<1, 8>(x + i * ldx, ldx, p, K, N, j0, j1, bias, y + i * N);
    }
}

// The C shim for torch.ops.linstream.packed_linear(x (M, K), packed, bias?, n) -> (M, n), as
// AOTInductor's generated code calls a custom op listed in aot_inductor.custom_ops_to_c_shims.
AOTITorchError aoti_torch_cpu_packed_linear(AtenTensorHandle x, AtenTensorHandle packed, AtenTensorHandle *bias,
                                            int64_t n, AtenTensorHandle *ret0) {
    int64_t *sizes, *strides;
    if (aoti_torch_get_sizes(x, &sizes) || aoti_torch_get_strides(x, &strides)) return 1;
    const int64_t M = sizes[0], K = sizes[1], ldx = strides[0];
    if (strides[1] != 1 && K > 1) return 1;  // the op's callers hand it dense rows (OwnLinear)
    void *xp, *pp, *bp = nullptr, *yp;
    if (aoti_torch_get_data_ptr(x, &xp) || aoti_torch_get_data_ptr(packed, &pp)) return 1;
    if (bias && *bias && aoti_torch_get_data_ptr(*bias, &bp)) return 1;
    const int64_t out_sizes[2] = {M, n}, out_strides[2] = {n, 1};
    if (aoti_torch_empty_strided(2, out_sizes, out_strides, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(), 0,
                                 ret0))
        return 1;
    if (aoti_torch_get_data_ptr(*ret0, &yp)) return 1;
    linstream_packed_linear((const float *)xp, M, K, ldx, (const float *)pp, n, (const float *)bp, (float *)yp);
    return 0;
}

}  // extern "C"
