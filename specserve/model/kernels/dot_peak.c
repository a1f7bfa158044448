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

/* Multiply-adds per second on every OpenMP thread together, for at least `seconds`:
 * kind 0 int8 (vpdpbusd), kind 1 float32 (FMA), kind 2 bfloat16 (vdpbf16ps: only where
 * bf16_dot_available()). */
double dot_peak(int kind, double seconds) {
    double total = 0.0;
    const double started = now();
#pragma omp parallel reduction(+ : total)
    {
        volatile int sink;
        do {
            total += kind == 0 ? int8_rounds(&sink) : kind == 1 ? float_rounds(&sink) : bf16_rounds(&sink);
        } while (now() - started < seconds);
    }
    return total / (now() - started);
}
