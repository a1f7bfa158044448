/*
 * float32 weights x float32 activations: y[T, N] = x[T, K] @ W[N, K]^T + bias.
 *
 * Why our own kernel: oneDNN's float32 GEMM (PyTorch's fastest for a weight packed in
 * its format) streams one row of activations at 27-35 GB/s where the memory gives
 * 35-44, and 8 rows (the target verifying k = 7 drafts) cost it 1.6-2x one row: its
 * blocking is made for big matrices. Here each weight row is read once for up to 8
 * activation rows, three weight rows at a time (24 accumulators and the 3 weights fit
 * the 32 vector registers), and the weights 16 KB ahead are prefetched into L2: the
 * hardware prefetcher alone leaves the memory idle while the FMAs run. Measured on
 * the 1.5B target's layers (2 cores, taking turns with oneDNN; benchmarks/linear_kernels.py):
 * see benchmarks/README.md.
 *
 * The weights are PyTorch's own [N, K] rows, not a copy in another layout, so a head
 * tied to the embedding shares its memory.
 *
 * Every output is the same sequence of FMAs over k (lane k % 16, in order) and the same
 * final sum of the 16 lanes, whatever the number of rows, the row's slot or its
 * neighbours: the results are batch invariant, as the quantized kernel's are.
 */
#include <immintrin.h>
#include <stddef.h>

/* Two register tiles, 24 accumulators each: for up to 8 activation rows (decode steps,
 * verifications), 3 weight rows x all of them, so each weight is read from memory once;
 * for more (prompts), 6 weight rows x 4 activation rows, whose 6 + 4 loads per 24 FMAs
 * keep closer to the FMA peak (200 rows: 0.8x the time of 3 x 8). The tile changes
 * which outputs are computed together, never how one is computed. */
#define FEW_ROWS 8
#define FEW_WEIGHT_ROWS 3
#define MANY_WEIGHT_ROWS 6
#define MANY_TILE 4
#define MAX_WEIGHT_ROWS 6
#define MAX_TILE 8
/* Floats ahead of the k being read that are prefetched into L2 (16 KB): against none,
 * one row 1.2-1.5x faster and 8 rows 1.5-2x on the 1.5B target's layers; 2 KB and
 * 32 KB ahead, or into L1, measured slower at 8 rows. */
#define PREFETCH_AHEAD 4096

/* Weight rows 0 .. nr-1 (K floats apart) against activation rows 0 .. nt-1 (K floats
 * apart) -> out [nr][MAX_TILE]. nr and nt are constants after inlining, so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void rows_tile(const int nr, const int nt, const float *w, int K,
                                                           const float *x, float *out) {
    __m512 acc[MAX_WEIGHT_ROWS][MAX_TILE];
    for (int i = 0; i < nr; i++)
        for (int t = 0; t < nt; t++) acc[i][t] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[MAX_WEIGHT_ROWS];
        for (int i = 0; i < nr; i++) {
            _mm_prefetch((const char *)(w + (size_t)i * K + k + PREFETCH_AHEAD), _MM_HINT_T1);
            wv[i] = _mm512_loadu_ps(w + (size_t)i * K + k);
        }
        for (int t = 0; t < nt; t++) {
            const __m512 xv = _mm512_loadu_ps(x + (size_t)t * K + k);
            for (int i = 0; i < nr; i++) acc[i][t] = _mm512_fmadd_ps(wv[i], xv, acc[i][t]);
        }
    }
    if (k < K) { /* the last K % 16: masked loads give zeros, which add nothing (a
                  * masked load in the loop above measured 2x slower at 8 rows) */
        const __mmask16 lanes = (__mmask16)((1u << (K - k)) - 1);
        __m512 wv[MAX_WEIGHT_ROWS];
        for (int i = 0; i < nr; i++) wv[i] = _mm512_maskz_loadu_ps(lanes, w + (size_t)i * K + k);
        for (int t = 0; t < nt; t++) {
            const __m512 xv = _mm512_maskz_loadu_ps(lanes, x + (size_t)t * K + k);
            for (int i = 0; i < nr; i++) acc[i][t] = _mm512_fmadd_ps(wv[i], xv, acc[i][t]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int t = 0; t < nt; t++) out[i * MAX_TILE + t] = _mm512_reduce_add_ps(acc[i][t]);
}

#define TILE_CASE(NR, NT)                \
    case NT:                             \
        rows_tile(NR, NT, w, K, x, out); \
        break;
#define FEW_CASES(NR)                                                                                \
    switch (nt) {                                                                                    \
        TILE_CASE(NR, 1) TILE_CASE(NR, 2) TILE_CASE(NR, 3) TILE_CASE(NR, 4) TILE_CASE(NR, 5)         \
        TILE_CASE(NR, 6) TILE_CASE(NR, 7) TILE_CASE(NR, 8)                                           \
    }
#define MANY_CASES(NR) switch (nt) { TILE_CASE(NR, 1) TILE_CASE(NR, 2) TILE_CASE(NR, 3) TILE_CASE(NR, 4) }

/* nr <= FEW_WEIGHT_ROWS and nt <= FEW_ROWS, or nr <= MANY_WEIGHT_ROWS and nt <= MANY_TILE */
static void rows_tile_any(int many, int nr, int nt, const float *w, int K, const float *x, float *out) {
    if (!many) {
        if (nr == 3) FEW_CASES(3)
        else if (nr == 2) FEW_CASES(2)
        else FEW_CASES(1)
    } else switch (nr) {
        case 6: MANY_CASES(6) break;
        case 5: MANY_CASES(5) break;
        case 4: MANY_CASES(4) break;
        case 3: MANY_CASES(3) break;
        case 2: MANY_CASES(2) break;
        default: MANY_CASES(1) break;
    }
}

/* x [T, K], weights [N, K], bias [N] or NULL -> y [T, N], all float32 and contiguous. */
void float_matmul(const float *x, int T, int K, const float *weights, const float *bias, int N, float *y) {
    const int many = T > FEW_ROWS;
    const int step = many ? MANY_WEIGHT_ROWS : FEW_WEIGHT_ROWS, tile = many ? MANY_TILE : FEW_ROWS;
#pragma omp parallel for schedule(static)
    for (int first = 0; first < (N + step - 1) / step; first++) {
        const int n = first * step, nr = n + step <= N ? step : N - n;
        float out[MAX_WEIGHT_ROWS * MAX_TILE];
        for (int t0 = 0; t0 < T; t0 += tile) {
            const int nt = T - t0 < tile ? T - t0 : tile;
            rows_tile_any(many, nr, nt, weights + (size_t)n * K, K, x + (size_t)t0 * K, out);
            for (int i = 0; i < nr; i++) {
                const float b = bias ? bias[n + i] : 0.0f;
                for (int t = 0; t < nt; t++) y[(size_t)(t0 + t) * N + n + i] = out[i * MAX_TILE + t] + b;
            }
        }
    }
}
