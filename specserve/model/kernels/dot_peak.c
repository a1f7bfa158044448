/*
 * The CPU's arithmetic peak for the instructions our decode steps multiply with:
 * `vpdpbusd` (int8 x int8, 64 multiply-adds, what quantized_matmul.c spends its time
 * in), a float32 FMA (16 multiply-adds, what float_matmul.c does in float32) and
 * `vdpbf16ps` (bfloat16 pairs, 32 multiply-adds, float_matmul.c in bfloat16 where the
 * CPU has it). Why: a decode step
 * reads every weight once and is bound by memory, but verifying k drafts multiplies
 * every weight by k + 1 rows, and on a few cores that arithmetic, not memory, sets the
 * price of a verified row. The benchmarks' roofline puts this peak beside the bandwidth.
 *
 * Each thread runs 12 independent accumulator chains (enough to hide the instructions'
 * latency) on registers only, so nothing but the arithmetic units is measured.
 *
 * A fourth kind, int8 in groups, is the peak of quantized_matmul's own mix: each weight
 * row's 8 `vpdpbusd` against one activation row (a super-block of 512 multiply-adds,
 * one int32 lane per group of 32) end in a conversion to float, a multiply (the
 * weight's scale times the activation's) and two FMAs (into the sum, and the zero
 * point's term). Where the FMAs share their ports with `vpdpbusd` (a Zen 5: 12
 * `vpdpbusd` 6 cycles alone, 9 with 6 FMAs or 6 multiplies beside them; the
 * conversions and integer adds ride other ports), that is 11 issues where `vpdpbusd`
 * alone takes 8, and no schedule of those kernels beats 8/11 of the int8 peak. A
 * verified row's price is set by this peak, not vpdpbusd's alone.
 */
#include <immintrin.h>
#include <omp.h>
#include <time.h>

#define CHAINS 12
#define ROUNDS 1000000 /* per check of the clock: ~10 ms */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Multiply-adds done by one thread in ROUNDS rounds; sink keeps the results alive. */
static double int8_rounds(volatile int *sink) {
    __m512i acc[CHAINS];
    __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_epi32(i);
    for (long r = 0; r < ROUNDS; r++) {
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
        __asm__ volatile("" : "+v"(a)); /* a may change: the compiler cannot fold the rounds */
    }
    int sum = 0;
    for (int i = 0; i < CHAINS; i++) sum += _mm512_reduce_add_epi32(acc[i]);
    *sink = sum;
    return (double)ROUNDS * CHAINS * 64;
}

static double float_rounds(volatile int *sink) {
    __m512 acc[CHAINS];
    __m512 a = _mm512_set1_ps(0.5f), b = _mm512_set1_ps(0.25f);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_ps((float)i);
    for (long r = 0; r < ROUNDS; r++) {
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
        __asm__ volatile("" : "+v"(a));
    }
    float sum = 0.0f;
    for (int i = 0; i < CHAINS; i++) sum += _mm512_reduce_add_ps(acc[i]);
    *sink = (int)sum;
    return (double)ROUNDS * CHAINS * 16;
}

static double bf16_rounds(volatile int *sink) {
    __m512 acc[CHAINS];
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f00), b = (__m512bh)_mm512_set1_epi16(0x3e80); /* 0.5, 0.25 */
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_ps((float)i);
    for (long r = 0; r < ROUNDS; r++) {
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        __asm__ volatile("" : "+v"(a));
    }
    float sum = 0.0f;
    for (int i = 0; i < CHAINS; i++) sum += _mm512_reduce_add_ps(acc[i]);
    *sink = (int)sum;
    return (double)ROUNDS * CHAINS * 32;
}

/* quantized_matmul's inner step (rows_tile: two weight rows against one activation row
 * of a super-block) for GROUPED_TILES activation rows at a time, values in registers. */
#define GROUPED_TILES 3
static double grouped_rounds(volatile int *sink) {
    __m512i levels[2][8];
    __m512 acc[GROUPED_TILES][2];
    __m512i q[GROUPED_TILES]; /* each tile's activations: distinct, so no tile's sums are another's */
    __m512 s[2], level0[2], d[GROUPED_TILES], a[GROUPED_TILES]; /* per tile, as in the kernel */
    for (int i = 0; i < 2; i++) {
        for (int r = 0; r < 8; r++) levels[i][r] = _mm512_set1_epi8((char)(3 + 8 * i + r)); /* all distinct: no product is another's */
        s[i] = _mm512_set1_ps(0.5f + (float)i), level0[i] = _mm512_set1_ps(-4.0f - (float)i);
    }
    for (int t = 0; t < GROUPED_TILES; t++) {
        q[t] = _mm512_set1_epi8((char)(5 + t));
        d[t] = _mm512_set1_ps(0.01f * (float)(t + 1)), a[t] = _mm512_set1_ps(0.02f * (float)(t + 1));
        acc[t][0] = acc[t][1] = _mm512_set1_ps((float)t);
    }
    for (long round = 0; round < ROUNDS / 4; round++) {
        for (int t = 0; t < GROUPED_TILES; t++) {
            __m512i dot[2][4]; /* four chains a row, as rows_tile sums them */
            for (int i = 0; i < 2; i++) dot[i][0] = dot[i][1] = dot[i][2] = dot[i][3] = _mm512_setzero_si512();
            for (int r = 0; r < 8; r++)
                for (int i = 0; i < 2; i++) dot[i][r % 4] = _mm512_dpbusd_epi32(dot[i][r % 4], levels[i][r], q[t]);
            for (int i = 0; i < 2; i++) {
                const __m512i whole = _mm512_add_epi32(_mm512_add_epi32(dot[i][0], dot[i][1]),
                                                       _mm512_add_epi32(dot[i][2], dot[i][3]));
                const __m512 sum = _mm512_cvtepi32_ps(whole);
                acc[t][i] = _mm512_fmadd_ps(sum, _mm512_mul_ps(s[i], d[t]), acc[t][i]);
                acc[t][i] = _mm512_fmadd_ps(a[t], level0[i], acc[t][i]);
            }
        }
        for (int t = 0; t < GROUPED_TILES; t++) /* they may change: nothing is folded */
            __asm__ volatile("" : "+v"(q[t]), "+v"(d[t]), "+v"(a[t]));
    }
    float sum = 0.0f;
    for (int t = 0; t < GROUPED_TILES; t++) sum += _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]));
    *sink = (int)sum;
    return (double)(ROUNDS / 4) * GROUPED_TILES * 2 * 8 * 64;
}

/* Multiply-adds per second on every OpenMP thread together, for at least `seconds`:
 * kind 0 int8 (vpdpbusd), kind 1 float32 (FMA), kind 2 bfloat16 (vdpbf16ps: only where
 * bf16_dot_available()), kind 3 int8 in groups (vpdpbusd with quantized_matmul's
 * scaling, see above). */
double dot_peak(int kind, double seconds) {
    double total = 0.0;
    const double started = now();
#pragma omp parallel reduction(+ : total)
    {
        volatile int sink;
        do {
            total += kind == 0 ? int8_rounds(&sink) : kind == 1 ? float_rounds(&sink)
                     : kind == 2 ? bf16_rounds(&sink) : grouped_rounds(&sink);
        } while (now() - started < seconds);
    }
    return total / (now() - started);
}
