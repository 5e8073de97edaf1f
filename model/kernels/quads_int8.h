// int8 weights by int8 inputs on AVX512-VNNI (the "avx512-vnni" kind, model/kernels/cpu.py): the
// part of packed_linear.cpp for int8 panels in quads of k, included there (it uses that file's
// vectors, register-block sizes and thread split).
//
// A panel holds each weight plus 128, as an unsigned byte, in quads of k: p[N/32][K/4][32][4]
// (K padded with zero weights, stored as 128). Each input row is quantized on its own to int8
// with one scale, its largest magnitude / 127 (rounded to nearest even, on this row's values
// only), and the row's sum of those int8 values kept. _mm512_dpbusd_epi32 multiplies four unsigned
// weight bytes by four signed input bytes and adds the four products into an int32 lane: each
// output is one exact int32 chain over the quads. The chain holds sum (w + 128) q, so 128 times the
// row's sum is taken off, and the difference (exact) converted to float32, multiplied by the row's
// scale, then by the output's, then the bias added. The row's quantization, its chain and these
// three steps depend on the row and the weights alone: a row's bits do not depend on its batch,
// its register block or the thread count.
#if defined(__AVX512VNNI__)

struct quad_u8 { uint8_t w[4]; };  // weights k = 4 k4 .. 4 k4 + 3 of one column, each plus 128

typedef int32_t v16i __attribute__((vector_size(64)));  // sixteen int32 lanes
constexpr int QL = 16;  // int32 lanes: columns a vector of quads holds

// A row of inputs as int8, in quads: q (4 bytes per int32 word), the row's scale and sum of q
struct quantized {
    const int32_t *q;
    const float *scale;
    const int32_t *sum;
    int64_t ld;  // words from one row's quads to the next's
};

// MR rows x NP panels, over K4 quads of k; `cols` valid columns in the last panel
template <int MR, int NP>
inline void quad_block(quantized x, const quad_u8 *p, int64_t K4, const float *scale, const float *bias, float *y,
                       int64_t ldy, int64_t cols) {
    // GCC keeps an array of __m512i (eight int64 lanes) on the stack across the loop when the
    // instruction's lanes are int32: sixteen int32 lanes stay in registers
    v16i acc[MR][NP][2];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NP; j++)
            for (int v = 0; v < 2; v++) acc[i][j][v] = (v16i)_mm512_setzero_si512();
    const int64_t panel = K4 * NR;
    for (int64_t k = 0; k < K4; k++) {
        __m512i b[NP][2];
        for (int j = 0; j < NP; j++)
            for (int v = 0; v < 2; v++) b[j][v] = _mm512_loadu_si512(p + j * panel + k * NR + v * QL);
        for (int i = 0; i < MR; i++) {
            __m512i a = _mm512_set1_epi32(x.q[i * x.ld + k]);  // the row's quad at k, in every lane
            for (int j = 0; j < NP; j++)
                for (int v = 0; v < 2; v++) acc[i][j][v] = (v16i)_mm512_dpbusd_epi32((__m512i)acc[i][j][v], b[j][v], a);
        }
    }
    for (int j = 0; j < NP; j++) {
        int64_t c = j == NP - 1 ? cols : NR;
        for (int v = 0; v < 2; v++) {
            int n = (int)(c - v * QL < 0 ? 0 : c - v * QL > QL ? QL : c - v * QL);
            __m512 sv = load_first(scale + j * NR + v * QL, n);
            __m512 bv = bias ? load_first(bias + j * NR + v * QL, n) : zero();
            for (int i = 0; i < MR; i++) {
                __m512i exact = _mm512_sub_epi32((__m512i)acc[i][j][v], _mm512_set1_epi32(128 * x.sum[i]));
                __m512 out = mul(mul(_mm512_cvtepi32_ps(exact), splat(x.scale[i])), sv);
                store_first(y + i * ldy + j * NR + v * QL, bias ? add(out, bv) : out, n);
            }
        }
    }
}

template <int MR, int NP>
inline void quad_rows(quantized x, const quad_u8 *pj, int64_t K4, int64_t N, int64_t j0, int64_t j1,
                      const float *scale, const float *bias, float *y) {
    const int64_t panels = (N + NR - 1) / NR;
    int64_t j = j0;
    for (; j + NP <= j1; j += NP) {
        int64_t cols = j + NP == panels ? N - (panels - 1) * NR : NR;
        quad_block<MR, NP>(x, pj + (j - j0) * K4 * NR, K4, scale + j * NR, bias ? bias + j * NR : nullptr,
                           y + j * NR, N, cols);
    }
    for (; j < j1; j++) {
        int64_t cols = j + 1 == panels ? N - j * NR : NR;
        quad_block<MR, 1>(x, pj + (j - j0) * K4 * NR, K4, scale + j * NR, bias ? bias + j * NR : nullptr,
                          y + j * NR, N, cols);
    }
}

inline quantized rows_from(quantized x, int64_t i) { return {x.q + i * x.ld, x.scale + i, x.sum + i, x.ld}; }

// the blocks of packed_linear's row_blocks: 6 rows x 2 panels (24 int32 accumulators), fewer rows
// walking more panels at once
inline void quad_row_blocks(quantized x, int64_t M, const quad_u8 *pj, int64_t K4, int64_t N, int64_t j0,
                            int64_t j1, const float *scale, const float *bias, float *y) {
    int64_t i = 0;
    for (; i + 6 <= M; i += 6) quad_rows<6, 2>(rows_from(x, i), pj, K4, N, j0, j1, scale, bias, y + i * N);
    for (; i + 4 <= M; i += 4) quad_rows<4, 2>(rows_from(x, i), pj, K4, N, j0, j1, scale, bias, y + i * N);
    for (; i + 2 <= M; i += 2) quad_rows<2, 4>(rows_from(x, i), pj, K4, N, j0, j1, scale, bias, y + i * N);
    for (; i < M; i++) quad_rows<1, 8>(rows_from(x, i), pj, K4, N, j0, j1, scale, bias, y + i * N);
}

// row x (K floats) -> its int8 values in quads (q, zero-padded to whole vectors), scale and sum
inline void quantize_row(const float *x, int64_t K, int32_t *q, float *scale, int32_t *sum) {
    __m512 most = zero();
    for (int64_t k = 0; k < K; k += LANES)
        most = _mm512_max_ps(most, _mm512_abs_ps(load_first(x + k, (int)(K - k < LANES ? K - k : LANES))));
    const float amax = _mm512_reduce_max_ps(most);
    const float to_int = amax > 0 ? 127.0f / amax : 0.0f;  // a row of zeros: every q zero
    __m512i total = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += LANES) {
        __m512 v = mul(load_first(x + k, (int)(K - k < LANES ? K - k : LANES)), splat(to_int));
        __m512i qi = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(127)),
                                      _mm512_set1_epi32(-127));  // nearest even, kept to [-127, 127]
        total = _mm512_add_epi32(total, qi);
        _mm_storeu_si128((__m128i *)(q + k / 4), _mm512_cvtepi32_epi8(qi));
    }
    *scale = amax / 127.0f;
    *sum = _mm512_reduce_add_epi32(total);
}

// y = (x . W^T) * scale (+ b) over int8 panels in quads of k (scale: one per output, not null)
inline void quads_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const quad_u8 *p, int64_t N,
                         const float *scale, const float *bias, float *y) {
    const int64_t K4 = (K + 3) / 4, ld = (K + LANES - 1) / LANES * (LANES / 4);
    thread_local std::vector<int32_t> q, sums;
    thread_local std::vector<float> scales;
    if ((int64_t)q.size() < M * ld) q.resize(M * ld);
    if ((int64_t)sums.size() < M) sums.resize(M), scales.resize(M);
    for (int64_t i = 0; i < M; i++) quantize_row(x + i * ldx, K, q.data() + i * ld, &scales[i], &sums[i]);
    const quantized xq{q.data(), scales.data(), sums.data(), ld};
    const int64_t panels = (N + NR - 1) / NR, groups = (panels + GROUP - 1) / GROUP;
    const int64_t per_group = M * K4 * 4 * NR * GROUP, grain = per_group >= SPLIT ? 1 : (SPLIT + per_group - 1) / per_group;
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
        for (int64_t j0 = g0 * GROUP; j0 < g1 * GROUP && j0 < panels; j0 += GROUP) {
            const int64_t j1 = j0 + GROUP < panels ? j0 + GROUP : panels;
            quad_row_blocks(xq, M, p + j0 * K4 * NR, K4, N, j0, j1, scale, bias, y);
        }
    });
}

#endif
