// Mamba's selective scan over a sequence, float32, AVX-512 or AVX2 + FMA: the prefill's recurrence
// (model/ops/selective_scan.py) in one pass over the tokens, per token and channel
//     dA = exp(delta A),  h = dA h + (delta x) B,  y = C . h + D x
// without ever holding a (b, l, e, n) tensor.
//
// One vector holds LANES neighbouring channels of one batch row, and the n state values of those
// channels stay in n registers (n = 16, Mamba's d_state, is compiled as its own case so that they
// can) while the block walks the tokens; y sums C_s h_s over s as one FMA chain per channel, with
// no horizontal sums. Blocks are independent, so they are split between torch's threads
// (at::parallel_for). A channel's arithmetic is the same operations in the same order whichever
// lane, block, thread or batch it falls in (a short last block only masks its loads and stores),
// so neither the thread count nor the rows beside a row change its bits.
//
// exp is ours: exp(x) = 2^k p(r), k = round(x / ln 2), r = x - k ln 2 (ln 2 in two parts, FMA),
// p a degree-6 polynomial fitted for relative error on |r| <= ln(2)/2 with p(0) = p'(0) = 1
// (its own error 4e-9, far below float32's half-ulp 6e-8); 2^k applied exactly (scalef with
// AVX-512, two exact power-of-two factors with AVX2), so results below FLT_MIN round once, as a
// correctly rounded exp's would. Inputs are clamped to [-104, 89], where exp is 0 below and
// infinite above in float32; NaN stays NaN.
//
// Entry points: linstream_selective_scan (contiguous float32 arrays, for ctypes) and
// linstream_scan_exp (the exp alone, for its test); model/kernels/selective_scan.py loads them.
#include <immintrin.h>
#include <stdint.h>

#include <ATen/Parallel.h>

namespace {

#if defined(__AVX512F__)
using vec = __m512;
constexpr int LANES = 16;
inline vec zero() { return _mm512_setzero_ps(); }
inline vec splat(float a) { return _mm512_set1_ps(a); }
inline vec load(const float *p) { return _mm512_loadu_ps(p); }
inline void store(float *p, vec v) { _mm512_storeu_ps(p, v); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec max(vec a, vec b) { return _mm512_max_ps(a, b); }  // b when either is NaN
inline vec min(vec a, vec b) { return _mm512_min_ps(a, b); }
inline vec round(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec scale2(vec p, vec k) { return _mm512_scalef_ps(p, k); }  // p 2^k, one rounding
inline __mmask16 first(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }
inline vec load_first(const float *p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }
inline void store_first(float *p, vec v, int n) { _mm512_mask_storeu_ps(p, first(n), v); }
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
constexpr int LANES = 8;
inline vec zero() { return _mm256_setzero_ps(); }
inline vec splat(float a) { return _mm256_set1_ps(a); }
inline vec load(const float *p) { return _mm256_loadu_ps(p); }
inline void store(float *p, vec v) { _mm256_storeu_ps(p, v); }
inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec max(vec a, vec b) { return _mm256_max_ps(a, b); }  // b when either is NaN
inline vec min(vec a, vec b) { return _mm256_min_ps(a, b); }
inline vec round(vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec pow2(__m256i k) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23)); }
inline vec scale2(vec p, vec k) {  // p 2^k for k in [-150, 129]: both halves of k are normal powers, the first product exact
    __m256i ki = _mm256_cvtps_epi32(k), k1 = _mm256_srai_epi32(ki, 1);
    return mul(mul(p, pow2(k1)), pow2(_mm256_sub_epi32(ki, k1)));
}
inline __m256i first(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
inline vec load_first(const float *p, int n) { return n >= 8 ? load(p) : _mm256_maskload_ps(p, first(n)); }
inline void store_first(float *p, vec v, int n) {
    if (n >= 8) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, first(n), v);
}
#else
#error "selective_scan needs AVX-512 (-mavx512f) or AVX2 with FMA (-mavx2 -mfma)"
#endif

inline vec exp(vec x) {
    x = min(splat(89.0f), max(splat(-104.0f), x));  // x last: a NaN passes through both
    const vec k = round(mul(x, splat(1.44269504f)));  // x / ln 2
    vec r = fma(k, splat(-0.693145752f), x);  // ln 2's leading 16 bits: k times them is exact
    r = fma(k, splat(-1.42860677e-06f), r);  // and the rest of ln 2
    vec p = splat(0x1.6a2438p-10f);
    p = fma(p, r, splat(0x1.1239cep-7f));
    p = fma(p, r, splat(0x1.5558f2p-5f));
    p = fma(p, r, splat(0x1.555492p-3f));
    p = fma(p, r, splat(0x1.fffffcp-2f));
    p = fma(p, r, splat(1.0f));
    p = fma(p, r, splat(1.0f));
    return scale2(p, k);
}

constexpr int MAX_N = 64;  // the state sizes a block's stack buffers hold (Mamba's is 16)

// One block: channels c0..c0+m-1 of batch row `row`, every token. NF > 0: n is NF at compile time,
// so the state stays in registers; NF = 0: n is a runtime value and the state lives in `hs`.
template <int NF>
void block(const float *x, const float *delta, const float *A, const float *B, const float *C, const float *D,
           const float *h0, float *y, float *h, int64_t row, int64_t c0, int m, int64_t l, int64_t e, int64_t n_) {
    const int n = NF ? NF : (int)n_;
    alignas(64) float at[MAX_N * LANES], hs[MAX_N * LANES];  // A and h transposed: [s][lane]
    for (int i = 0; i < n * LANES; i++) at[i] = hs[i] = 0.0f;  // a short block's idle lanes: zeros
    for (int i = 0; i < m; i++)
        for (int s = 0; s < n; s++) {
            at[s * LANES + i] = A[(c0 + i) * n + s];
            hs[s * LANES + i] = h0 ? h0[(row * e + c0 + i) * n + s] : 0.0f;
        }
    vec hv[NF ? NF : 1];
    if (NF)
        for (int s = 0; s < n; s++) hv[s] = load(hs + s * LANES);
    const vec dv = load_first(D + c0, m);
    const int64_t base = row * l * e + c0;
    for (int64_t t = 0; t < l; t++) {
        const vec dt = load_first(delta + base + t * e, m), xv = load_first(x + base + t * e, m);
        const vec dx = mul(dt, xv);
        const float *bt = B + (row * l + t) * n, *ct = C + (row * l + t) * n;
        vec acc = zero();
#pragma GCC unroll 16
        for (int s = 0; s < n; s++) {
            const vec dA = exp(mul(dt, load(at + s * LANES)));
            vec hn = NF ? hv[NF ? s : 0] : load(hs + s * LANES);
            hn = fma(dA, hn, mul(dx, splat(bt[s])));
            if (NF) hv[NF ? s : 0] = hn;
            else store(hs + s * LANES, hn);
            acc = fma(splat(ct[s]), hn, acc);
        }
        store_first(y + base + t * e, add(acc, mul(dv, xv)), m);
    }
    if (NF)
        for (int s = 0; s < n; s++) store(hs + s * LANES, hv[s]);
    for (int i = 0; i < m; i++)
        for (int s = 0; s < n; s++) h[(row * e + c0 + i) * n + s] = hs[s * LANES + i];
}

}  // namespace

extern "C" {

// x, delta (b, l, e); A (e, n); B, C (b, l, n); D (e); h0 (b, e, n) or null (zeros) -> y (b, l, e),
// h (b, e, n) the state after the last token (h may be h0: each block reads its part before it
// writes it). Every array dense, row-major, float32; n <= 64.
void linstream_selective_scan(const float *x, const float *delta, const float *A, const float *B, const float *C,
                              const float *D, const float *h0, float *y, float *h, int64_t b, int64_t l, int64_t e,
                              int64_t n) {
    const int64_t blocks = (e + LANES - 1) / LANES;
    // a block's work is l * n vectors; keep at least ~64k of them on a thread before splitting
    const int64_t grain = l * n >= 65536 ? 1 : 65536 / (l * n + 1) + 1;
    at::parallel_for(0, b * blocks, grain, [&](int64_t j0, int64_t j1) {
        for (int64_t j = j0; j < j1; j++) {
            const int64_t row = j / blocks, c0 = (j % blocks) * LANES;
            const int m = (int)(e - c0 < LANES ? e - c0 : LANES);
            if (n == 16) block<16>(x, delta, A, B, C, D, h0, y, h, row, c0, m, l, e, n);
            else block<0>(x, delta, A, B, C, D, h0, y, h, row, c0, m, l, e, n);
        }
    });
}

// y[i] = exp(x[i]) as the scan computes it, for i < count
void linstream_scan_exp(const float *x, float *y, int64_t count) {
    alignas(64) float buf[LANES];
    for (int64_t i = 0; i < count; i += LANES) {
        const int m = (int)(count - i < LANES ? count - i : LANES);
        for (int j = 0; j < LANES; j++) buf[j] = j < m ? x[i + j] : 0.0f;
        store(buf, exp(load(buf)));
        for (int j = 0; j < m; j++) y[i + j] = buf[j];
    }
}

}  // extern "C"
