// y[M,N] = x[M,K] . w^T, w packed in panels of 32 columns: p[N/32][K][32]. Each output is one FMA
// chain over k = 0..K-1 from zero, whatever M and whatever the row block: rows are batch-invariant.
#include <immintrin.h>
#include <stddef.h>

#define NR 32

static inline void block(int mr, const float *x, int ldx, const float *p, int K, float *y, int ldy) {
    __m512 acc[12][2];
    for (int i = 0; i < mr; i++) { acc[i][0] = _mm512_setzero_ps(); acc[i][1] = _mm512_setzero_ps(); }
    for (int k = 0; k < K; k++) {
        __m512 b0 = _mm512_loadu_ps(p + (size_t)k * NR), b1 = _mm512_loadu_ps(p + (size_t)k * NR + 16);
        for (int i = 0; i < mr; i++) {
            __m512 a = _mm512_set1_ps(x[(size_t)i * ldx + k]);
            acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm512_storeu_ps(y + (size_t)i * ldy, acc[i][0]);
        _mm512_storeu_ps(y + (size_t)i * ldy + 16, acc[i][1]);
    }
}

#define BLOCK(MR) static void block##MR(const float *x, int ldx, const float *p, int K, float *y, int ldy) { block(MR, x, ldx, p, K, y, ldy); }
BLOCK(12) BLOCK(8) BLOCK(4) BLOCK(2) BLOCK(1)

void pack(const float *w, int N, int K, float *p) {  // w (N, K) row-major -> panels
    for (int j0 = 0; j0 < N; j0 += NR)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < NR; j++)
                p[(size_t)j0 * K + (size_t)k * NR + j] = w[(size_t)(j0 + j) * K + k];
}

void gemm(const float *x, int M, int K, const float *p, int N, float *y) {
    for (int j0 = 0; j0 < N; j0 += NR) {
        const float *pp = p + (size_t)j0 * K;
        int i = 0;
        for (; i + 12 <= M; i += 12) block12(x + (size_t)i * K, K, pp, K, y + (size_t)i * N + j0, N);
        for (; i + 8 <= M; i += 8) block8(x + (size_t)i * K, K, pp, K, y + (size_t)i * N + j0, N);
        for (; i + 4 <= M; i += 4) block4(x + (size_t)i * K, K, pp, K, y + (size_t)i * N + j0, N);
        for (; i + 2 <= M; i += 2) block2(x + (size_t)i * K, K, pp, K, y + (size_t)i * N + j0, N);
        for (; i < M; i++) block1(x + (size_t)i * K, K, pp, K, y + (size_t)i * N + j0, N);
    }
}
