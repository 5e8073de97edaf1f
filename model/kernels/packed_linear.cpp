// y[M, N] = x[M, K] . W^T (+ b), float32, AVX-512 or AVX2 + FMA: the compiled decode step's
// projections.
//
// W is packed once into panels of 32 output columns, p[N/32][K][32] (the last panel padded with
// zero columns), so a panel's k-th row is two AVX-512 vectors or four AVX2 ones. Every output is
// one FMA chain over k = 0..K-1 starting from zero, then its scale and bias: whatever M is, whichever
// register block a row falls in and whichever of the two instruction sets runs it, its bits are
// the same, so a session's text does not depend on the batch it shared (nor on the CPU it moved to).
// The blocks differ only in how many rows share a panel's loads and how many panels a few rows walk
// at once (more independent chains where there is little reuse); AVX2's 16 registers hold
// smaller blocks than AVX-512's 32.
//
// The panels may also hold bfloat16 or float16 weights: each is widened exactly as it is loaded,
// so the result is float32 weights rounded to 16 bits multiplied the same way, with half the bytes
// to stream (what bounds a one-row step of a large model); or int8 weights, widened exactly, with
// one scale per output applied once its chain is done: a quarter of the bytes.
//
// Built with AVX512-BF16 (the "avx512-bf16" kind, model/kernels/cpu.py), bfloat16 and int8 weights
// may instead be packed in pairs of k, p[N/32][K/2][32][2] (K padded to even with zeros): the input
// row is rounded to bfloat16 (to nearest even) once per call, and each output is one chain of
// _mm512_dpbf16_ps over the pairs, two products per float32 lane per instruction; int8 weights are
// converted to bfloat16 (exactly: integers up to 256 are bfloat16 numbers), in registers, or once
// per group of panels where several blocks of rows read them, and scaled after the chain. Another numeric than the widening panels' (the input is rounded), so a process
// packs its weights one way; still one fixed chain per output, whatever the batch or thread count.
//
// Built with AVX512-VNNI too (the "avx512-vnni" kind), int8 weights are instead packed in quads of k
// and multiplied by the input row quantized to int8, an exact int32 chain per output
// (quads_int8.h, included below); its bfloat16 panels are the pairs above.
//
// Large products are split between torch's threads by groups of panels, i.e. by output columns:
// each output is still computed by one thread with the same chain, so the thread count changes no
// bits either.
//
// Entry points over the same code: linstream_packed_linear(_bf16, _f16, _int8, _pairs_bf16,
// _pairs_int8, _quads_int8) (raw pointers, for ctypes and the eager op) and aoti_torch_cpu_packed_linear, the
// C shim AOTInductor's generated step calls for torch.ops.linstream.packed_linear
// (model/kernels/__init__.py).
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include <atomic>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

namespace {

constexpr int NR = 32;  // a panel's columns

struct half { uint16_t bits; };  // a float16 weight (its own type: the loads below overload on it)

// One vector of LANES floats; `first(n)` loads or stores its first n lanes only (0 <= n <= LANES).
#if defined(__AVX512F__)
using vec = __m512;
constexpr int LANES = 16;
inline vec zero() { return _mm512_setzero_ps(); }
inline vec load(const float *p) { return _mm512_loadu_ps(p); }
inline vec load(const uint16_t *p) {  // 16 bfloat16 -> float32, exactly: the 16 bits become the top half
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
inline vec load(const int8_t *p) {  // 16 int8 -> float32, exactly
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
inline vec load(const half *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }  // exactly
inline vec splat(float a) { return _mm512_set1_ps(a); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
inline __mmask16 first(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }
inline vec load_first(const float *p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }
inline void store_first(float *p, vec v, int n) { _mm512_mask_storeu_ps(p, first(n), v); }
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
constexpr int LANES = 8;
inline vec zero() { return _mm256_setzero_ps(); }
inline vec load(const float *p) { return _mm256_loadu_ps(p); }
inline vec load(const uint16_t *p) {  // 8 bfloat16 -> float32, exactly
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
inline vec load(const int8_t *p) {  // 8 int8 -> float32, exactly
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
inline vec load(const half *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }  // exactly (F16C)
inline vec splat(float a) { return _mm256_set1_ps(a); }
inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
inline __m256i first(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
inline vec load_first(const float *p, int n) { return n >= 8 ? load(p) : _mm256_maskload_ps(p, first(n)); }
inline void store_first(float *p, vec v, int n) {
    if (n >= 8) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, first(n), v);
}
#else
#error "packed_linear needs AVX-512 (-mavx512f) or AVX2 with FMA and F16C (-mavx2 -mfma -mf16c)"
#endif

constexpr int NV = NR / LANES;  // vectors in a panel's row

// One step of an output's chain: acc + a * b, a being the row's value at k (broadcast)
inline vec bcast(const float *x) { return splat(*x); }
inline vec madd(vec acc, vec a, vec b) { return fma(a, b, acc); }

#if defined(__AVX512BF16__)
// Panels in pairs of k: element [k2][n] of a panel holds weights k = 2 k2 and 2 k2 + 1 of column n
struct pair_bf16 { uint16_t w[2]; };
struct pair_int8 { int8_t w[2]; };
inline __m512bh load(const pair_bf16 *p) { return (__m512bh)_mm512_loadu_si512(p); }  // 16 columns' pairs
inline __m512bh load(const pair_int8 *p) {  // 16 columns' pairs of int8 -> bfloat16, exactly
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));  // columns 0-7
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 8))));  // 8-15
    return _mm512_cvtne2ps_pbh(hi, lo);  // lo's 16 values first
}
// a row's pair (x[2 k2], x[2 k2 + 1]) as bfloat16, in every lane: acc + x0 w0 + x1 w1 per lane
inline __m512bh bcast(const uint32_t *x) { return (__m512bh)_mm512_set1_epi32((int)*x); }
inline vec madd(vec acc, __m512bh a, __m512bh b) { return _mm512_dpbf16_ps(acc, a, b); }
#endif

// K counts the panels' rows: k, or pairs of k (X the rows' bfloat16 pairs then)
template <int MR, int NP, typename X, typename W>
inline void block(const X *x, int64_t ldx, const W *p, int64_t K, const float *scale, const float *bias, float *y,
                  int64_t ldy, int64_t cols) {
    // MR rows x NP panels; `cols` = valid columns in the last panel (32 unless it is the matrix's last)
    vec acc[MR][NP][NV];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NP; j++)
            for (int v = 0; v < NV; v++) acc[i][j][v] = zero();
    const int64_t panel = K * NR;
    for (int64_t k = 0; k < K; k++) {
        decltype(load(p)) b[NP][NV];
        for (int j = 0; j < NP; j++)
            for (int v = 0; v < NV; v++) b[j][v] = load(p + j * panel + k * NR + v * LANES);
        for (int i = 0; i < MR; i++) {
            auto a = bcast(x + i * ldx + k);
            for (int j = 0; j < NP; j++)
                for (int v = 0; v < NV; v++) acc[i][j][v] = madd(acc[i][j][v], a, b[j][v]);
        }
    }
    for (int j = 0; j < NP; j++) {
        int64_t c = j == NP - 1 ? cols : NR;  // only the last panel of a call can be short
        for (int v = 0; v < NV; v++) {
            int n = (int)(c - v * LANES < 0 ? 0 : c - v * LANES > LANES ? LANES : c - v * LANES);
            vec sv = scale ? load_first(scale + j * NR + v * LANES, n) : zero();
            vec bv = bias ? load_first(bias + j * NR + v * LANES, n) : zero();
            for (int i = 0; i < MR; i++) {
                vec out = scale ? mul(acc[i][j][v], sv) : acc[i][j][v];
                store_first(y + i * ldy + j * NR + v * LANES, bias ? add(out, bv) : out, n);
            }
        }
    }
}

// rows x (MR of them) against panels j0..j1-1 of the weights (pj: panel j0), NP panels at a time,
// then one at a time
template <int MR, int NP, typename X, typename W>
inline void rows(const X *x, int64_t ldx, const W *pj, int64_t K, int64_t N, int64_t j0, int64_t j1,
                 const float *scale, const float *bias, float *y) {
    const int64_t panels = (N + NR - 1) / NR;
    int64_t j = j0;
    for (; j + NP <= j1; j += NP) {
        int64_t cols = j + NP == panels ? N - (panels - 1) * NR : NR;
        block<MR, NP>(x, ldx, pj + (j - j0) * K * NR, K, scale ? scale + j * NR : nullptr,
                      bias ? bias + j * NR : nullptr, y + j * NR, N, cols);
    }
    for (; j < j1; j++) {
        int64_t cols = j + 1 == panels ? N - j * NR : NR;
        block<MR, 1>(x, ldx, pj + (j - j0) * K * NR, K, scale ? scale + j * NR : nullptr,
                     bias ? bias + j * NR : nullptr, y + j * NR, N, cols);
    }
}

// all M rows against panels j0..j1-1 (pj: panel j0): the largest row blocks share each panel's
// loads; fewer rows walk several panels at once instead
template <typename X, typename W>
inline void row_blocks(const X *x, int64_t M, int64_t ldx, const W *pj, int64_t K, int64_t N, int64_t j0, int64_t j1,
                       const float *scale, const float *bias, float *y) {
    int64_t i = 0;
#if defined(__AVX512F__)  // 32 registers: up to 24 accumulators
    // 6 rows x 2 panels: 10 loads (4 of the panels', 6 broadcasts) per 24 multiply-adds, where 12
    // rows x 1 panel take 14 (and run slower)
    for (; i + 6 <= M; i += 6) rows<6, 2>(x + i * ldx, ldx, pj, K, N, j0, j1, scale, bias, y + i * N);
    for (; i + 4 <= M; i += 4) rows<4, 2>(x + i * ldx, ldx, pj, K, N, j0, j1, scale, bias, y + i * N);
    for (; i + 2 <= M; i += 2) rows<2, 4>(x + i * ldx, ldx, pj, K, N, j0, j1, scale, bias, y + i * N);
    for (; i < M; i++) rows<1, 8>(x + i * ldx, ldx, pj, K, N, j0, j1, scale, bias, y + i * N);
#else  // 16 registers: 12 accumulators, the panel's four vectors and the broadcast row value
    for (; i + 3 <= M; i += 3) rows<3, 1>(x + i * ldx, ldx, pj, K, N, j0, j1, scale, bias, y + i * N);
    for (; i + 2 <= M; i += 2) rows<2, 1>(x + i * ldx, ldx, pj, K, N, j0, j1, scale, bias, y + i * N);
    for (; i < M; i++) rows<1, 2>(x + i * ldx, ldx, pj, K, N, j0, j1, scale, bias, y + i * N);
#endif
}

#if defined(__AVX512BF16__)
// int8 pairs -> bfloat16 pairs, n of them (a multiple of 16)
inline void widen(const pair_int8 *p, int64_t n, pair_bf16 *out) {
    for (int64_t e = 0; e < n; e += 16) _mm512_storeu_si512(out + e, (__m512i)load(p + e));
}
#endif

constexpr int64_t GROUP = 8;  // panels whose weights (8 x K x 32 floats) stay in L2 while every row passes

// y = (x . W^T) * scale (+ b) over panels of float32, bfloat16, float16 or int8, each weight widened
// exactly as it is loaded (16 bits: the same FMA chains as float32 weights rounded to them, half the
// bytes to stream; int8: a quarter, one scale per output applied once the chain is done), or over
// panels in pairs of k (X: the rows' bfloat16 pairs, K: pairs). scale may be null (no scaling), as
// may bias.
constexpr int64_t SPLIT = 1 << 20;  // multiply-adds below which a product stays on one thread

template <typename X, typename W>
void packed_linear(const X *x, int64_t M, int64_t K, int64_t ldx, const W *p, int64_t N, const float *scale,
                   const float *bias, float *y) {
    const int64_t panels = (N + NR - 1) / NR, groups = (panels + GROUP - 1) / GROUP;
    const int64_t per_group = M * K * NR * GROUP, grain = per_group >= SPLIT ? 1 : (SPLIT + per_group - 1) / per_group;
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
        for (int64_t j0 = g0 * GROUP; j0 < g1 * GROUP && j0 < panels; j0 += GROUP) {
            const int64_t j1 = j0 + GROUP < panels ? j0 + GROUP : panels;
#if defined(__AVX512BF16__)
            // int8 pairs that several blocks of rows read: converted to bfloat16 once for all of them
            // rather than in registers once per block (the same values, so the same bits)
            if constexpr (std::is_same_v<W, pair_int8>)
                if (M > 12) {  // more than two blocks of rows (at two, converting in registers is as quick)
                    thread_local std::vector<pair_bf16> wide;
                    const int64_t n = (j1 - j0) * K * NR;
                    if ((int64_t)wide.size() < n) wide.resize(n);
                    widen(p + j0 * K * NR, n, wide.data());
                    row_blocks(x, M, ldx, (const pair_bf16 *)wide.data(), K, N, j0, j1, scale, bias, y);
                    continue;
                }
#endif
            row_blocks(x, M, ldx, p + j0 * K * NR, K, N, j0, j1, scale, bias, y);
        }
    });
}

#if defined(__AVX512BF16__)
// The same over panels in pairs of k: each row rounded to bfloat16 pairs first (to nearest even,
// zero-padded to an even width), on its own, so its pairs do not depend on the rows beside it
template <typename W>
void pairs_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const W *p, int64_t N, const float *scale,
                  const float *bias, float *y) {
    const int64_t K2 = (K + 1) / 2, ld = (K2 + 15) / 16 * 16;  // pairs, and a row's pairs rounded up to vectors
    thread_local std::vector<uint32_t> rounded;
    if ((int64_t)rounded.size() < M * ld) rounded.resize(M * ld);
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k += 32) {
            __m512 lo = load_first(x + i * ldx + k, (int)(K - k < 16 ? K - k : 16));
            __m512 hi = load_first(x + i * ldx + k + 16, (int)(K - k - 16 < 0 ? 0 : K - k - 16 < 16 ? K - k - 16 : 16));
            _mm512_storeu_si512(rounded.data() + i * ld + k / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    packed_linear(rounded.data(), M, K2, ld, p, N, scale, bias, y);
}
#endif

#include "quads_int8.h"  // int8 panels in quads of k, by int8 rows (AVX512-VNNI builds)

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
                             const float *scale, const float *bias, float *y) {
    packed_linear(x, M, K, ldx, p, N, scale, bias, y);
}

void linstream_packed_linear_bf16(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *p, int64_t N,
                                  const float *scale, const float *bias, float *y) {
    packed_linear(x, M, K, ldx, p, N, scale, bias, y);
}

void linstream_packed_linear_int8(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *p, int64_t N,
                                  const float *scale, const float *bias, float *y) {
    packed_linear(x, M, K, ldx, p, N, scale, bias, y);
}

void linstream_packed_linear_f16(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *p, int64_t N,
                                 const float *scale, const float *bias, float *y) {
    packed_linear(x, M, K, ldx, (const half *)p, N, scale, bias, y);
}

// Whether this build has the panels in pairs of k (the "avx512-bf16" kind)
int64_t linstream_has_pairs(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
// p: (ceil(N/32), ceil(K/2), 32, 2) bfloat16 or int8
void linstream_packed_linear_pairs_bf16(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *p,
                                        int64_t N, const float *scale, const float *bias, float *y) {
    pairs_linear(x, M, K, ldx, (const pair_bf16 *)p, N, scale, bias, y);
}

void linstream_packed_linear_pairs_int8(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *p,
                                        int64_t N, const float *scale, const float *bias, float *y) {
    pairs_linear(x, M, K, ldx, (const pair_int8 *)p, N, scale, bias, y);
}
#endif

// Whether this build has int8 panels in quads of k (the "avx512-vnni" kind)
int64_t linstream_has_quads(void) {
#if defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512VNNI__)
// p: (ceil(N/32), ceil(K/4), 32, 4) uint8, each weight plus 128; scale not null
void linstream_packed_linear_quads_int8(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *p,
                                        int64_t N, const float *scale, const float *bias, float *y) {
    quads_linear(x, M, K, ldx, (const quad_u8 *)p, N, scale, bias, y);
}
#endif

// The threads a product's split runs on: as many as torch's thread count when the library is built
// with OpenMP (at::parallel_for is serial without it), one chunk per thread here.
int64_t linstream_split_threads(void) {
    std::atomic<int64_t> most{0};
    at::parallel_for(0, 64, 1, [&](int64_t, int64_t) {
        int64_t t = at::get_thread_num() + 1, m = most.load();
        while (t > m && !most.compare_exchange_weak(m, t)) {
        }
    });
    return most.load();
}

// out[i] = a new handle to the tensor of in[i], for i < n: AOTInductor's run takes over the handles
// it is given, and a step library that takes its weights as inputs (model/compiled/aot.py) is
// handed them anew on every call, with this one call instead of one per weight.
int linstream_new_handles(AtenTensorHandle *in, int64_t n, AtenTensorHandle *out) {
    for (int64_t i = 0; i < n; i++)
        if (aoti_torch_new_tensor_handle(in[i], &out[i])) return 1;
    return 0;
}

// The C shim for torch.ops.linstream.packed_linear(x (M, K), packed, bias?, n, scale?) -> (M, n),
// as AOTInductor's generated code calls a custom op listed in aot_inductor.custom_ops_to_c_shims;
// `packed` is float32, bfloat16, float16 or int8 panels (ceil(n/32), K, 32), bfloat16 or int8
// panels in pairs of k (ceil(n/32), ceil(K/2), 32, 2), or int8 panels in quads of k held as uint8
// (ceil(n/32), ceil(K/4), 32, 4), in a build that has them.
AOTITorchError aoti_torch_cpu_packed_linear(AtenTensorHandle x, AtenTensorHandle packed, AtenTensorHandle *bias,
                                            int64_t n, AtenTensorHandle *scale, AtenTensorHandle *ret0) {
    int64_t *sizes, *strides;
    if (aoti_torch_get_sizes(x, &sizes) || aoti_torch_get_strides(x, &strides)) return 1;
    const int64_t M = sizes[0], K = sizes[1], ldx = strides[0];
    if (strides[1] != 1 && K > 1) return 1;  // the op's callers hand it dense rows (OwnLinear)
    int32_t dtype;
    int64_t dims;
    void *xp, *pp, *bp = nullptr, *sp = nullptr, *yp;
    if (aoti_torch_get_data_ptr(x, &xp) || aoti_torch_get_data_ptr(packed, &pp)) return 1;
    if (aoti_torch_get_dtype(packed, &dtype) || aoti_torch_get_dim(packed, &dims)) return 1;
#if !defined(__AVX512BF16__)
    if (dims == 4 && dtype != aoti_torch_dtype_uint8()) return 1;  // panels in pairs of k: not in this build
#endif
#if !defined(__AVX512VNNI__)
    if (dtype == aoti_torch_dtype_uint8()) return 1;  // panels in quads of k: not in this build
#endif
    if (bias && *bias && aoti_torch_get_data_ptr(*bias, &bp)) return 1;
    if (scale && *scale && aoti_torch_get_data_ptr(*scale, &sp)) return 1;
    const int64_t out_sizes[2] = {M, n}, out_strides[2] = {n, 1};
    if (aoti_torch_empty_strided(2, out_sizes, out_strides, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(), 0,
                                 ret0))
        return 1;
    if (aoti_torch_get_data_ptr(*ret0, &yp)) return 1;
    const float *xf = (const float *)xp, *sf = (const float *)sp, *bf = (const float *)bp;
#if defined(__AVX512VNNI__)
    if (dtype == aoti_torch_dtype_uint8()) {
        if (!sf) return 1;
        quads_linear(xf, M, K, ldx, (const quad_u8 *)pp, n, sf, bf, (float *)yp);
        return 0;
    }
#endif
#if defined(__AVX512BF16__)
    if (dims == 4 && dtype == aoti_torch_dtype_bfloat16())
        pairs_linear(xf, M, K, ldx, (const pair_bf16 *)pp, n, sf, bf, (float *)yp);
    else if (dims == 4)
        pairs_linear(xf, M, K, ldx, (const pair_int8 *)pp, n, sf, bf, (float *)yp);
    else
#endif
    if (dtype == aoti_torch_dtype_bfloat16())
        packed_linear(xf, M, K, ldx, (const uint16_t *)pp, n, sf, bf, (float *)yp);
    else if (dtype == aoti_torch_dtype_int8())
        packed_linear(xf, M, K, ldx, (const int8_t *)pp, n, sf, bf, (float *)yp);
    else if (dtype == aoti_torch_dtype_float16())
        packed_linear(xf, M, K, ldx, (const half *)pp, n, sf, bf, (float *)yp);
    else
        packed_linear(xf, M, K, ldx, (const float *)pp, n, sf, bf, (float *)yp);
    return 0;
}

}  // extern "C"
