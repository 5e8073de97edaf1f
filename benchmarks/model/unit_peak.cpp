// The arithmetic units' peak on one thread: a loop of dot-product instructions whose operands stay
// in registers, 24 independent accumulators (more than the instruction's latency times its
// throughput, so the loop waits on none of them). Nothing is loaded or stored inside the loop:
// what it measures is the instruction's issue rate, the bound no product can pass. The loop is
// written as assembly, registers named: compilers spill an array of accumulators to the stack.
#include <stdint.h>

// one round: the instruction on zmm0..zmm23, from the operands in zmm24 and zmm25
#define ONE(op, r) op " %%zmm25, %%zmm24, %%zmm" #r "\n\t"
#define ZERO(op, r) "vpxord %%zmm" #r ", %%zmm" #r ", %%zmm" #r "\n\t"
#define EACH(f, op)                                                                                      \
    f(op, 0) f(op, 1) f(op, 2) f(op, 3) f(op, 4) f(op, 5) f(op, 6) f(op, 7) f(op, 8) f(op, 9) f(op, 10)   \
    f(op, 11) f(op, 12) f(op, 13) f(op, 14) f(op, 15) f(op, 16) f(op, 17) f(op, 18) f(op, 19) f(op, 20)   \
    f(op, 21) f(op, 22) f(op, 23)
#define CLOBBERS                                                                                         \
    "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",     \
    "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22",   \
    "xmm23", "xmm24", "xmm25", "cc"
// `iters` rounds of 24 instructions `op` (the accumulators start from zero, the operands from
// small values, so neither float loop reaches infinities or denormals)
#define LOOP(op, iters)                                                                                  \
    asm volatile(EACH(ZERO, "")                                                                           \
                 "vpternlogd $0xff, %%zmm24, %%zmm24, %%zmm24\n\t"                                         \
                 "vpabsb %%zmm24, %%zmm24\n\t"                                                             \
                 "vpxord %%zmm25, %%zmm25, %%zmm25\n\t"                                                    \
                 "1:\n\t" EACH(ONE, op) "dec %0\n\t"                                                           \
                 "jnz 1b\n\t"                                                                              \
                 : "+r"(iters)                                                                            \
                 :                                                                                        \
                 : CLOBBERS)

extern "C" {

constexpr int64_t ACC = 24;

// _mm512_dpbf16_ps: 16 lanes x 2 bfloat16 products
void linstream_peak_dpbf16(int64_t iters) { LOOP("vdpbf16ps", iters); }

// _mm512_dpbusd_epi32: 16 lanes x 4 unsigned x signed int8 products
void linstream_peak_dpbusd(int64_t iters) { LOOP("vpdpbusd", iters); }

// _mm512_fmadd_ps: 16 float32 lanes, float32's peak for comparison
void linstream_peak_fma(int64_t iters) { LOOP("vfmadd231ps", iters); }

int64_t linstream_peak_accumulators(void) { return ACC; }
}
