/*
 * Float weights x float activations: y[T, N] = x[T, K] @ W[N, K]^T + bias, with W,
 * bias, x and y either all float32 (`float_matmul`) or all bfloat16 (`bf16_matmul`:
 * exact products, float32 sums, each output rounded once to bfloat16, as PyTorch's
 * bfloat16 linear layers do).
 *
 * Why our own kernel: oneDNN's float32 GEMM (PyTorch's fastest for a weight packed in
 * its format) streams one row of activations at 27-35 GB/s where the memory gives
 * 35-44, and 8 rows (the target verifying k = 7 drafts) cost it 1.6-2x one row: its
 * blocking is made for big matrices; its bfloat16 GEMM streams 12-25 GB/s. Here each
 * weight row is read once for up to 8 activation rows, three weight rows at a time (24
 * accumulators and the 3 weights fit the 32 vector registers), and the weights 16 KB
 * ahead are prefetched into L2: the hardware prefetcher alone leaves the memory idle
 * while the FMAs run. Measured on the 1.5B target's layers (2 cores, taking turns with
 * oneDNN; benchmarks/linear_kernels.py): see benchmarks/README.md.
 *
 * The weights are PyTorch's own [N, K] rows, not a copy in another layout, so a head
 * tied to the embedding shares its memory.
 *
 * Every output is the same sequence of multiply-adds over k (float32: into lane k % 16,
 * in order; bfloat16: see rows_tile) and the same final sum of the 16 lanes, whatever
 * the number of rows, the row's slot or its neighbours: the results are batch
 * invariant, as the quantized kernel's are.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "swiglu.h"

/* Register tiles of 24 accumulators: for up to 8 activation rows (decode steps,
 * verifications), 3 weight rows x all of them (1 weight row for the fewest rows: see
 * ONE_WEIGHT_ROW_MAX_T), so each weight is read from memory once;
 * for more (prompts), 6 weight rows x 4 activation rows, whose 6 + 4 loads per 24 FMAs
 * keep closer to the FMA peak (200 rows: 0.8x the time of 3 x 8), and on vdpbf16ps 4 x
 * 6 (200 rows: 0.8-0.95x the time of 6 x 4). The tile changes which outputs are
 * computed together, never how one is computed. */
#define FEW_ROWS 8
#define FEW_WEIGHT_ROWS 3
/* Up to this many activation rows, one weight row at a time instead: the memory then
 * sees one sequential stream per thread, where three rows read side by side are three.
 * On a Zen 5 (2 cores, 45-77 GB/s; the 1.5B target's layers in a forward's order, two
 * builds taking turns in one process, outputs identical): float32 1 and 2 rows 0.91x
 * and 0.92x the time, 4 rows 1.07x; bfloat16 on vdpbf16ps 1-5 rows 0.69-0.91x, 6 rows
 * 0.96x, 8 rows 1.09x. (With the widened bfloat16 weights, more work a byte, as float32.) */
#define ONE_WEIGHT_ROW_MAX_T 2
#define DOT_ONE_WEIGHT_ROW_MAX_T 4
#define MANY_WEIGHT_ROWS 6
#define MANY_TILE 4
#define DOT_MANY_WEIGHT_ROWS 4
#define DOT_MANY_TILE 6
#define MAX_WEIGHT_ROWS 6
#define MAX_TILE 8
/* Bytes of weights ahead of the ones being read that are prefetched into L2: against
 * none, one float32 row 1.2-1.5x faster and 8 rows 1.5-2x on the 1.5B target's layers;
 * 2 KB and 32 KB ahead, or into L1, measured slower at 8 rows.
 * With more than 8 rows a group of weight rows is read in several passes, one per tile
 * of activation rows. Prefetching 16 KB ahead in each pass left the memory idle in all
 * but the first (the others ask again for lines already there), so the FMAs of the
 * later passes and the next group's reads took turns. There, where a group is bigger
 * than PREFETCH_AHEAD_BYTES, each pass asks instead for its share of the next group
 * (every passes-th line of it, from the pass-th): 9-32 rows of the 1.5B target's
 * layers 0.76-0.93x the time in float32, the bfloat16 down projection 0.62-0.83x; a
 * forward pass of 12-32 rows 0.82-0.87x (float32) and 0.8-0.93x (bfloat16). */
#define PREFETCH_AHEAD_BYTES 16384

/* How rows_tile reads weights and activations. */
enum kind {
    FLOAT32,    /* float32 weights and activations */
    BF16_WIDEN, /* bfloat16 weights widened in registers, float32 activations (see below) */
    BF16_DOT,   /* bfloat16 weights and activations, multiplied in pairs by vdpbf16ps */
};

/* 32 bfloat16 from p; in the tail, only those `lanes` marks (the rest read as zeros,
 * which add nothing: masked loads throughout measured 1.1-1.3x slower). */
static inline __attribute__((always_inline)) __m512i bf16_32(const uint16_t *p, int tail, __mmask32 lanes) {
    return tail ? _mm512_maskz_loadu_epi16(lanes, p) : _mm512_loadu_si512(p);
}

/* Whether this step of a pass prefetches: every step, or with spread every passes-th,
 * from the pass-th (wait counts down to it). */
static inline __attribute__((always_inline)) int prefetch_turn(const int spread, int *wait, int passes) {
    const int fetch = !spread || *wait == 0;
    *wait = *wait == 0 ? passes - 1 : *wait - 1;
    return fetch;
}

/* Weight rows 0 .. nr-1 (K elements apart) against activation rows 0 .. nt-1 (x_stride
 * elements apart) -> out [nr][MAX_TILE]. nr, nt and kind are constants after inlining,
 * so the accumulators stay in registers. Prefetches go `ahead` bytes past the weights
 * being read: on every step, or with spread on every passes-th from the pass-th.
 *
 * bfloat16 weights are read 32 at a time, each 32-bit lane holding two: element 2j + 1
 * and then element 2j are added to lane j. That is what vdpbf16ps does in one
 * instruction (twice the multiply-adds of an FMA; every product of two bfloat16 is
 * exact in float32, so its two roundings are an FMA's), and without it (BF16_WIDEN)
 * the odd element is the lane with its low 16 bits cleared and the even one the lane
 * shifted left 16 bits: one instruction per 16 weights (widening 16 costs two, and
 * measured 1.3x slower at 8 rows, where the FMAs are the limit). The activations then
 * come as float32 in the same order, each 32 as its 16 odd then its 16 even elements
 * (`bf16_matmul` lays them out so). Both give the same sums, bit for bit, except that
 * vdpbf16ps takes subnormal numbers as zeros. */
static inline __attribute__((always_inline)) void rows_tile(const int nr, const int nt, const enum kind kind,
                                                           const void *w, int K, const void *x, int x_stride,
                                                           const int spread, int ahead, int passes, int pass,
                                                           float *out) {
    __m512 acc[MAX_WEIGHT_ROWS][MAX_TILE];
    for (int i = 0; i < nr; i++)
        for (int t = 0; t < nt; t++) acc[i][t] = _mm512_setzero_ps();
    if (kind == BF16_DOT) {
        const uint16_t *w16 = w, *x16 = x;
        for (int k = 0, wait = pass; k < K; k += 32) {
            const int fetch = prefetch_turn(spread, &wait, passes);
            const int tail = K - k < 32; /* the last K % 32 */
            const __mmask32 lanes = tail ? (__mmask32)((1u << (K - k)) - 1) : ~(__mmask32)0;
            __m512i wv[MAX_WEIGHT_ROWS];
            for (int i = 0; i < nr; i++) {
                const uint16_t *at = w16 + (size_t)i * K + k;
                if (fetch) _mm_prefetch((const char *)at + ahead, _MM_HINT_T1);
                wv[i] = bf16_32(at, tail, lanes);
            }
            for (int t = 0; t < nt; t++) {
                const __m512bh xv = (__m512bh)bf16_32(x16 + (size_t)t * x_stride + k, tail, lanes);
                for (int i = 0; i < nr; i++) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], (__m512bh)wv[i], xv);
            }
        }
    } else if (kind == BF16_WIDEN) {
        const uint16_t *w16 = w;
        const float *x32 = x;
        const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
        for (int k = 0, wait = pass; k < K; k += 32) {
            const int fetch = prefetch_turn(spread, &wait, passes);
            /* the last K % 32: the activations are zero-padded to 32 */
            const int tail = K - k < 32;
            const __mmask32 lanes = tail ? (__mmask32)((1u << (K - k)) - 1) : ~(__mmask32)0;
            for (int half = 0; half < 2; half++) { /* the odd elements, then the even */
                __m512 wv[MAX_WEIGHT_ROWS];
                for (int i = 0; i < nr; i++) {
                    const uint16_t *at = w16 + (size_t)i * K + k;
                    if (half == 0 && fetch) _mm_prefetch((const char *)at + ahead, _MM_HINT_T1);
                    const __m512i pairs = bf16_32(at, tail, lanes);
                    wv[i] = _mm512_castsi512_ps(half == 0 ? _mm512_and_si512(pairs, high) : _mm512_slli_epi32(pairs, 16));
                }
                for (int t = 0; t < nt; t++) {
                    const __m512 xv = _mm512_loadu_ps(x32 + (size_t)t * x_stride + k + 16 * half);
                    for (int i = 0; i < nr; i++) acc[i][t] = _mm512_fmadd_ps(wv[i], xv, acc[i][t]);
                }
            }
        }
    } else {
        const float *w32 = w, *x32 = x;
        int k = 0;
        for (int wait = pass; k + 16 <= K; k += 16) {
            const int fetch = prefetch_turn(spread, &wait, passes);
            __m512 wv[MAX_WEIGHT_ROWS];
            for (int i = 0; i < nr; i++) {
                if (fetch) _mm_prefetch((const char *)(w32 + (size_t)i * K + k) + ahead, _MM_HINT_T1);
                wv[i] = _mm512_loadu_ps(w32 + (size_t)i * K + k);
            }
            for (int t = 0; t < nt; t++) {
                const __m512 xv = _mm512_loadu_ps(x32 + (size_t)t * x_stride + k);
                for (int i = 0; i < nr; i++) acc[i][t] = _mm512_fmadd_ps(wv[i], xv, acc[i][t]);
            }
        }
        if (k < K) { /* the last K % 16: masked loads give zeros, which add nothing (a
                      * masked load in the loop above measured 2x slower at 8 rows) */
            const __mmask16 lanes = (__mmask16)((1u << (K - k)) - 1);
            __m512 wv[MAX_WEIGHT_ROWS];
            for (int i = 0; i < nr; i++) wv[i] = _mm512_maskz_loadu_ps(lanes, w32 + (size_t)i * K + k);
            for (int t = 0; t < nt; t++) {
                const __m512 xv = _mm512_maskz_loadu_ps(lanes, x32 + (size_t)t * x_stride + k);
                for (int i = 0; i < nr; i++) acc[i][t] = _mm512_fmadd_ps(wv[i], xv, acc[i][t]);
            }
        }
    }
    for (int i = 0; i < nr; i++)
        for (int t = 0; t < nt; t++) out[i * MAX_TILE + t] = _mm512_reduce_add_ps(acc[i][t]);
}

/* A decode step or a verification (one pass: prefetch 16 KB ahead), or more rows (many
 * passes, over which `matmul` may spread the next group's prefetches). */
#define TILE_CASE(NR, NT, SPREAD)                                                         \
    case NT:                                                                              \
        rows_tile(NR, NT, kind, w, K, x, x_stride, SPREAD, ahead, passes, pass, out);   \
        break;
#define FEW_CASES(NR)                                                                                \
    switch (nt) {                                                                                    \
        TILE_CASE(NR, 1, 0) TILE_CASE(NR, 2, 0) TILE_CASE(NR, 3, 0) TILE_CASE(NR, 4, 0)              \
        TILE_CASE(NR, 5, 0) TILE_CASE(NR, 6, 0) TILE_CASE(NR, 7, 0) TILE_CASE(NR, 8, 0)              \
    }
#define MANY_CASES(NR) switch (nt) { TILE_CASE(NR, 1, 1) TILE_CASE(NR, 2, 1) TILE_CASE(NR, 3, 1) TILE_CASE(NR, 4, 1) }
#define DOT_MANY_CASES(NR)                                                                           \
    switch (nt) {                                                                                    \
        TILE_CASE(NR, 1, 1) TILE_CASE(NR, 2, 1) TILE_CASE(NR, 3, 1) TILE_CASE(NR, 4, 1)              \
        TILE_CASE(NR, 5, 1) TILE_CASE(NR, 6, 1)                                                      \
    }

/* nr and nt within the tile `matmul` picks for kind and many */
static inline __attribute__((always_inline)) void rows_tile_any(const enum kind kind, int many, int nr, int nt,
                                                               const void *w, int K, const void *x, int x_stride,
                                                               int ahead, int passes, int pass, float *out) {
    if (!many) {
        if (nr == 3) FEW_CASES(3)
        else if (nr == 2) FEW_CASES(2)
        else FEW_CASES(1)
    } else if (kind == BF16_DOT) switch (nr) {
        case 4: DOT_MANY_CASES(4) break;
        case 3: DOT_MANY_CASES(3) break;
        case 2: DOT_MANY_CASES(2) break;
        default: DOT_MANY_CASES(1) break;
    } else switch (nr) {
        case 6: MANY_CASES(6) break;
        case 5: MANY_CASES(5) break;
        case 4: MANY_CASES(4) break;
        case 3: MANY_CASES(3) break;
        case 2: MANY_CASES(2) break;
        default: MANY_CASES(1) break;
    }
}

/* x [T, x_stride] (K used) as `kind` reads it; weights [N, K], bias [N] or NULL, y [T, N]:
 * float32 or, for the bfloat16 kinds, bfloat16. All contiguous. */
static inline __attribute__((always_inline)) void matmul(const enum kind kind, const void *x, int x_stride, int T,
                                                        int K, const void *weights, const void *bias, int N,
                                                        void *y) {
    const int bf16 = kind != FLOAT32;
    const size_t x_width = kind == FLOAT32 || kind == BF16_WIDEN ? 4 : 2;
    const int many = T > FEW_ROWS;
    int step = FEW_WEIGHT_ROWS, tile = FEW_ROWS; /* weight rows x activation rows */
    if (T <= (kind == BF16_DOT ? DOT_ONE_WEIGHT_ROW_MAX_T : ONE_WEIGHT_ROW_MAX_T)) step = 1;
    if (many) {
        step = kind == BF16_DOT ? DOT_MANY_WEIGHT_ROWS : MANY_WEIGHT_ROWS;
        tile = kind == BF16_DOT ? DOT_MANY_TILE : MANY_TILE;
    }
    /* Several passes over groups bigger than the prefetch distance: each pass prefetches
     * its share of the next group, that far ahead. (Smaller groups, as bfloat16 rows of
     * 1536 in fours, measured 1.05-1.28x slower so at 12-16 rows: 16 KB ahead in every
     * pass reaches past the next group.) */
    const size_t group_bytes = (size_t)step * K * (bf16 ? 2 : 4);
    const int spread = many && group_bytes > PREFETCH_AHEAD_BYTES;
    const int passes = spread ? (T + tile - 1) / tile : 1;
    const int ahead = spread ? (int)group_bytes : PREFETCH_AHEAD_BYTES;
#pragma omp parallel for schedule(static)
    for (int first = 0; first < (N + step - 1) / step; first++) {
        const int n = first * step, nr = n + step <= N ? step : N - n;
        const char *w = (const char *)weights + (size_t)n * K * (bf16 ? 2 : 4);
        float out[MAX_WEIGHT_ROWS * MAX_TILE];
        for (int t0 = 0; t0 < T; t0 += tile) {
            const int nt = T - t0 < tile ? T - t0 : tile;
            rows_tile_any(kind, many, nr, nt, w, K, (const char *)x + (size_t)t0 * x_stride * x_width, x_stride,
                          ahead, passes, spread ? t0 / tile : 0, out);
            for (int i = 0; i < nr; i++) {
                const float *sums = out + i * MAX_TILE;
                const size_t at = (size_t)t0 * N + n + i;
                if (bf16) {
                    const float b = bias ? from_bf16(((const uint16_t *)bias)[n + i]) : 0.0f;
                    for (int t = 0; t < nt; t++) ((uint16_t *)y)[at + (size_t)t * N] = to_bf16(sums[t] + b);
                } else {
                    const float b = bias ? ((const float *)bias)[n + i] : 0.0f;
                    for (int t = 0; t < nt; t++) ((float *)y)[at + (size_t)t * N] = sums[t] + b;
                }
            }
        }
    }
}

/* x [T, K], weights [N, K], bias [N] or NULL -> y [T, N], all float32 and contiguous. */
void float_matmul(const float *x, int T, int K, const float *weights, const float *bias, int N, float *y) {
    matmul(FLOAT32, x, K, T, K, weights, bias, N, y);
}

/* Whether the CPU has vdpbf16ps (avx512_bf16). */
int bf16_dot_available(void) { return __builtin_cpu_supports("avx512bf16") != 0; }

/* x [T, K], weights [N, K], bias [N] or NULL -> y [T, N], all bfloat16, on vdpbf16ps
 * where `dot` says so, else with the weights widened. For the latter the activations
 * are widened to float32 once, in the order rows_tile reads them, each row zero-padded
 * to a multiple of 32 (a decode step's: a few KB). gated: the gate and up projections
 * of a SwiGLU MLP in one, W holding the gate's rows, then the up's; y [T, N/2] =
 * silu(gate) * up (swiglu.h). Returns 0, or -1 when out of memory. */
int bf16_matmul(int dot, int gated, const uint16_t *x, int T, int K, const uint16_t *weights, const uint16_t *bias,
                int N, uint16_t *y) {
    const int stride = (K + 31) / 32 * 32;
    float *wide = dot ? NULL : calloc((size_t)T * stride, sizeof(float));
    uint16_t *gate_up = gated ? malloc(sizeof(uint16_t) * (size_t)T * N) : NULL;
    if ((!dot && !wide) || (gated && !gate_up)) {
        free(wide), free(gate_up);
        return -1;
    }
    uint16_t *out = gated ? gate_up : y;
    if (dot) {
        matmul(BF16_DOT, x, K, T, K, weights, bias, N, out);
    } else {
        for (int t = 0; t < T; t++)
            for (int k = 0; k < K; k++) /* element k of its 32 goes to slot k/2 (odd k) or 16 + k/2 (even) */
                wide[(size_t)t * stride + k / 32 * 32 + (1 - k % 2) * 16 + (k % 32) / 2] = from_bf16(x[(size_t)t * K + k]);
        matmul(BF16_WIDEN, wide, stride, T, K, weights, bias, N, out);
    }
    if (gated) {
        const int half = N / 2;
#pragma omp parallel for schedule(static)
        for (int t = 0; t < T; t++)
            for (int n0 = 0; n0 < half; n0 += 16) {
                const int width = half - n0 < 16 ? half - n0 : 16;
                float gate[16] = {0}, up[16] = {0};
                for (int j = 0; j < width; j++) {
                    gate[j] = from_bf16(gate_up[(size_t)t * N + n0 + j]);
                    up[j] = from_bf16(gate_up[(size_t)t * N + half + n0 + j]);
                }
                silu_times_up(gate, up, width, y + (size_t)t * half + n0);
            }
    }
    free(wide), free(gate_up);
    return 0;
}
