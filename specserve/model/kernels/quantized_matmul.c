/*
 * int4 or int8 weights x int8 activations on AVX-512 VNNI: y[T, N] = x[T, K] @ W[N, K]^T.
 *
 * Why our own kernel: a decode step reads every weight once, so its time is the
 * weight bytes over the memory bandwidth. PyTorch's int4 and int8 CPU kernels
 * (bfloat16 activations) reach about half that limit and their cost grows with every
 * row, so verifying k drafts costs several plain steps. This kernel does what llama.cpp
 * does: it quantizes each row of activations to int8 per group of 32 and multiplies
 * unsigned weight levels by int8 values with `vpdpbusd` (64 byte products per
 * instruction). Each super-block of a weight row is unpacked once into registers and
 * used for up to TILE activation rows, so the weights are read from memory once per call.
 *
 * Every output is computed by the same instructions in the same order whatever the
 * number of rows, the row's slot or its neighbours: the results are batch invariant.
 *
 * Weights (as native.py lays them out): group g of a row has 32 levels; for
 * int4 0..15, with a scale s[g] and a zero z[g] (bfloat16), w = (level - 8) s + z; for
 * int8 0..255 with one scale per row, w = (level - 128) s.
 * Groups go in super-blocks of n = min(16, groups left) groups, one int32 lane each.
 * Element i of group g in a super-block is quad r = i / 4, byte p = i % 4; its level
 * sits in byte 16*g0 + (r % 4)*4n + (g - g0)*4 + p (g0: the super-block's first group),
 * low nibble for r < 4, high nibble for r >= 4 (int8: byte 32*g0 + r*4n + (g - g0)*4 + p),
 * and its int8 activation at byte 64r + (g - g0)*4 + p of that row's super-block of
 * activations (512 bytes, padded with zeros; see block_slot). So one load gives quad r
 * of every group, and `vpdpbusd` adds each group's products into its
 * own lane.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "swiglu.h"

#define GROUP 32
#define BLOCK_GROUPS 16 /* groups per super-block: one int32 lane each */

static inline __mmask64 byte_mask(int n) { return n == BLOCK_GROUPS ? ~0ULL : (1ULL << (4 * n)) - 1; }

static inline __m512 load_bf16(const uint16_t *p, __mmask16 lanes) {
    return widen_bf16(_mm256_maskz_loadu_epi16(lanes, p));
}

/* Activation rows that share one unpacked super-block of weights (8 rows: ~10% faster
 * than 4 on verification's 8 rows). The compiler keeps their accumulators in memory
 * and the levels of one or two weight rows (8 or 16) in registers. */
#define TILE 8

/* Groups rounded up to whole super-blocks. */
static inline int padded_groups(int G) { return (G + BLOCK_GROUPS - 1) / BLOCK_GROUPS * BLOCK_GROUPS; }

/* Where super-block b of activation row t sits in the buffers, in super-blocks (512
 * bytes of q, 16 floats of d and a): rows go in tiles of TILE, each tile's super-blocks
 * one after another, and within each, the tile's rows side by side. So the rows a
 * weight row is multiplied by are read as one stream, in the order they are used.
 * Row by row, 8 rows of the 1.5B target's down projection (8960 inputs) were 8 streams
 * 9 KB apart. With the two chains of rows_tile, on a Zen 5 (2 cores), every layer of
 * the 1.5B int4 target in a process of its own, builds alternating 4 times: 8 rows
 * 0.89x the time (0.80-1.01), 64 rows 0.88x (0.86-0.90), one row within the memory's
 * noise; outputs identical. (Two builds in one process, as benchmarks/kernel_ab.py
 * runs them, said 0.83-0.86x at 8 rows, but put one build against itself at 1.13x.) */
static inline size_t slot_in_tile(int b, int nt, int t) { return (size_t)b * nt + (size_t)t; }

static inline size_t block_slot(int t, int b, int T, int blocks) {
    const int t0 = t - t % TILE, nt = T - t0 < TILE ? T - t0 : TILE;
    return (size_t)t0 * blocks + slot_in_tile(b, nt, t - t0);
}

/* x [T, K] bfloat16 -> q int8 in super-blocks of 8 quads x 64 bytes (lane = group),
 * and per group d = max|x| / 127 and a = d * sum(q), float32, placed by block_slot.
 * Padding stays zero, so it adds nothing to a dot product. */
static void quantize_rows(const uint16_t *x, int T, int K, int8_t *q, float *d, float *a) {
    const int G = K / GROUP, Gp = padded_groups(G);
    memset(q, 0, (size_t)T * GROUP * Gp);
    memset(d, 0, sizeof(float) * (size_t)T * Gp);
    memset(a, 0, sizeof(float) * (size_t)T * Gp);
    for (int t = 0; t < T; t++) {
        for (int g = 0; g < G; g++) {
            const uint16_t *xg = x + (size_t)t * K + (size_t)g * GROUP;
            __m512 lo = load_bf16(xg, 0xffff), hi = load_bf16(xg + 16, 0xffff);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            float scale = amax / 127.0f;
            __m512 inverse = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
            __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse)); /* round half to even */
            __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
            int8_t levels[GROUP];
            _mm_storeu_si128((__m128i *)levels, _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(levels + 16), _mm512_cvtsepi32_epi8(qhi));
            int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
            const int g0 = g - g % BLOCK_GROUPS;
            const size_t at = block_slot(t, g0 / BLOCK_GROUPS, T, Gp / BLOCK_GROUPS);
            int8_t *block = q + at * GROUP * BLOCK_GROUPS + (size_t)(g - g0) * 4;
            for (int r = 0; r < 8; r++) memcpy(block + (size_t)r * 64, levels + 4 * r, 4);
            d[at * BLOCK_GROUPS + g - g0] = scale;
            a[at * BLOCK_GROUPS + g - g0] = scale * (float)sum;
        }
    }
}

/* Bytes of weights ahead of the super-block being read that are prefetched, with the
 * int4 scales and zeros as far ahead (they are streams of their own: 4 bytes a group
 * beside the levels' 16). The hardware prefetcher alone keeps one streamed row far
 * below the memory on some machines. On a Zen 4 (32-34 GB/s) the int8 head
 * [151936, 1536] with it against without: 8 rows (k = 7 verified) 1.31-1.42x faster,
 * 1-4 rows 0.96-1.03x. On a Zen 5 (77 GB/s, 2 cores, the 1.5B int4 target, its layers
 * in a forward's order so that each comes from memory): one row of the head 10.5-11.5
 * -> 3.1-5.7 ms (21 GB/s without); the int4 layers' scales and zeros prefetched too,
 * one row 22-24 -> 16-17 ms, 8 rows 51-56 -> 39-44 ms; a whole decode step 38 -> 25-27
 * ms, the 0.5B draft's 18.4 -> 8.9 ms. 4 KB or 8 KB ahead measured as 2 KB. */
#define PREFETCH_AHEAD 2048

/* Weight rows 0 .. nr-1 (nr = 1 or 2, the second pair_bytes and pair_scales after the
 * first) against the nt activation rows of one tile (q, d and a: the tile's first
 * super-block, the others placed as block_slot places them). Two weight rows share
 * each activation load. bits, nr and nt are constants after inlining (see TILE for what the compiler keeps in registers).
 * bits 4: levels 0..15, scale and zero per group: w = (level - 8) s + z.
 * bits 8: levels 0..255 (int8 weight + 128), one scale per row: w = (level - 128) s. */
static inline __attribute__((always_inline)) void rows_tile(
    const int bits, const int nr, const uint8_t *w, size_t pair_bytes, const uint16_t *scale,
    const uint16_t *zero, size_t pair_scales, int G, const int8_t *q, const float *d, const float *a,
    const int nt, float *out /* [nr][TILE] */) {
    const __m512i low_nibble = _mm512_set1_epi8(0x0f);
    __m512 acc[2][TILE];
    for (int i = 0; i < nr; i++)
        for (int t = 0; t < nt; t++) acc[i][t] = _mm512_setzero_ps();
    for (int g0 = 0, b = 0; g0 < G; g0 += BLOCK_GROUPS, b++) {
        const int n = G - g0 < BLOCK_GROUPS ? G - g0 : BLOCK_GROUPS;
        const __mmask64 bytes = byte_mask(n);
        const __mmask16 lanes = (__mmask16)((1u << n) - 1);
        __m512i levels[2][8]; /* quad r of each group's levels, as unsigned bytes */
        __m512 s[2], level0[2]; /* per group: the scale, and the value of level 0 */
        for (int i = 0; i < nr; i++) {
            if (bits == 4) {
                const uint8_t *wb = w + i * pair_bytes + (size_t)16 * g0;
                /* The levels 2 KB ahead (on a Zen 4: 10-20% faster than none), and the
                 * scales and zeros of the same groups: 2 bytes a group where levels take 16 */
                for (int p = 0; p < 4; p++) _mm_prefetch((const char *)(wb + PREFETCH_AHEAD + 64 * p), _MM_HINT_T0);
                _mm_prefetch((const char *)(scale + i * pair_scales + g0 + PREFETCH_AHEAD / 16), _MM_HINT_T0);
                _mm_prefetch((const char *)(zero + i * pair_scales + g0 + PREFETCH_AHEAD / 16), _MM_HINT_T0);
                for (int j = 0; j < 4; j++) {
                    __m512i packed = _mm512_maskz_loadu_epi8(bytes, wb + (size_t)j * 4 * n);
                    levels[i][j] = _mm512_and_si512(packed, low_nibble);
                    levels[i][j + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibble);
                }
                s[i] = load_bf16(scale + i * pair_scales + g0, lanes);
                level0[i] = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s[i], load_bf16(zero + i * pair_scales + g0, lanes));
            } else {
                const uint8_t *wb = w + i * pair_bytes + (size_t)32 * g0;
                for (int p = 0; p < 8; p++) _mm_prefetch((const char *)(wb + PREFETCH_AHEAD + 64 * p), _MM_HINT_T0);
                for (int r = 0; r < 8; r++) levels[i][r] = _mm512_maskz_loadu_epi8(bytes, wb + (size_t)r * 4 * n);
                s[i] = _mm512_set1_ps(from_bf16(scale[i * pair_scales]));
                level0[i] = _mm512_mul_ps(_mm512_set1_ps(-128.0f), s[i]);
            }
        }
        for (int t = 0; t < nt; t++) {
            const size_t at = slot_in_tile(b, nt, t); /* q, d and a start at the tile's first slot */
            const __m512i *qb = (const __m512i *)(q + at * GROUP * BLOCK_GROUPS);
            /* per group: sum of level * q, as two chains (quads 0-3 and 4-7) added at the
             * end: the same integers, half the latency. */
            __m512i dot[2][2];
            for (int i = 0; i < nr; i++) dot[i][0] = dot[i][1] = _mm512_setzero_si512();
            for (int r = 0; r < 8; r++) {
                __m512i qv = _mm512_load_si512(qb + r);
                /* Into a register: the compiler would fold the load into each row's
                 * vpdpbusd, two loads where one serves both. */
                if (nr == 2) __asm__("" : "+v"(qv));
                for (int i = 0; i < nr; i++) dot[i][r >= 4] = _mm512_dpbusd_epi32(dot[i][r >= 4], levels[i][r], qv);
            }
            for (int i = 0; i < nr; i++) dot[i][0] = _mm512_add_epi32(dot[i][0], dot[i][1]);
            const __m512 dv = _mm512_load_ps(d + at * BLOCK_GROUPS);
            const __m512 av = _mm512_load_ps(a + at * BLOCK_GROUPS);
            for (int i = 0; i < nr; i++) {
                /* sum (level s + level0) d q = s d dot + level0 d sum(q) */
                acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][0]), _mm512_mul_ps(s[i], dv), acc[i][t]);
                acc[i][t] = _mm512_fmadd_ps(av, level0[i], acc[i][t]);
            }
        }
    }
    for (int i = 0; i < nr; i++)
        for (int t = 0; t < nt; t++) out[i * TILE + t] = _mm512_reduce_add_ps(acc[i][t]);
}

#define ONE_ROW_CASE(NT)                                                                            \
    case NT:                                                                                        \
        if (bits == 4) rows_tile(4, 1, w, 0, scale, zero, 0, G, q, d, a, NT, out);                   \
        else rows_tile(8, 1, w, 0, scale, zero, 0, G, q, d, a, NT, out);                             \
        break;
#define ROW_PAIR_CASE(NT)                                                                           \
    case NT:                                                                                        \
        rows_tile(4, 2, w, pair_bytes, scale, zero, pair_scales, G, q, d, a, NT, out);              \
        break;

/* nt <= TILE; nr = 1, or int4 with nr = 2. */
static void rows_tile_any(int bits, int nr, const uint8_t *w, size_t pair_bytes, const uint16_t *scale,
                          const uint16_t *zero, size_t pair_scales, int G, const int8_t *q, const float *d,
                          const float *a, int nt, float *out) {
    if (nr == 2) switch (nt) {
            ROW_PAIR_CASE(1) ROW_PAIR_CASE(2) ROW_PAIR_CASE(3) ROW_PAIR_CASE(4)
            ROW_PAIR_CASE(5) ROW_PAIR_CASE(6) ROW_PAIR_CASE(7) ROW_PAIR_CASE(8)
        }
    else switch (nt) {
            ONE_ROW_CASE(1) ONE_ROW_CASE(2) ONE_ROW_CASE(3) ONE_ROW_CASE(4)
            ONE_ROW_CASE(5) ONE_ROW_CASE(6) ONE_ROW_CASE(7) ONE_ROW_CASE(8)
        }
}

/* Weight row n, and row `second` with it unless second < 0 (int4 only), against
 * activation rows t0 .. t0 + nt - 1 (nt <= TILE): out [2][TILE] float32, before bias. */
static inline void dot_tile(int bits, int n, int second, int t0, int nt, int K, const uint8_t *weights,
                            const uint16_t *scale, const uint16_t *zero, const int8_t *q, const float *d,
                            const float *a, float *out) {
    const int G = K / GROUP;
    const size_t tile = (size_t)t0 * (padded_groups(G) / BLOCK_GROUPS); /* the tile's first slot */
    const size_t row_bytes = (size_t)K * bits / 8, row_scales = bits == 4 ? (size_t)G : 1;
    const size_t apart = second < 0 ? 0 : (size_t)(second - n);
    rows_tile_any(bits, second < 0 ? 1 : 2, weights + n * row_bytes, apart * row_bytes, scale + n * row_scales,
                  zero ? zero + n * row_scales : NULL, apart * row_scales, G, q + tile * GROUP * BLOCK_GROUPS,
                  d + tile * BLOCK_GROUPS, a + tile * BLOCK_GROUPS, nt, out);
}

/* Whether two int4 weight rows share each activation load: with several activation
 * rows (see plain_rows). */
static inline int paired(int bits, int T) { return bits == 4 && T > 1; }

/* y [T, N] = x W^T + bias, each output rounded to bfloat16 once. */
static void plain_rows(int bits, int T, int K, const uint8_t *weights, const uint16_t *scale, const uint16_t *zero,
                       const uint16_t *bias, int N, const int8_t *q, const float *d, const float *a, uint16_t *y) {
    /* With several activation rows, two int4 weight rows share each activation load
     * (gated_rows pairs each gate row with its up row): one row alone needs one 64-byte
     * load per vpdpbusd, about what the L1 serves. Against one row at a time (the 1.5B
     * target's o, gate/up and down; 7 rounds taking turns): 2-16 rows 0.81-0.90x the
     * time, 200 rows 0.85-0.96x; the whole forward 0.96x at 8 rows, a 200-token prompt
     * 0.90-0.95x. (Pairs once took tiles of 4, their accumulators held in registers,
     * which spilled them: within L1 they lost 0-10%, and gate/up pairs 9-16%.) */
    const int step = paired(bits, T) ? 2 : 1;
#pragma omp parallel for schedule(static)
    for (int first = 0; first < (N + step - 1) / step; first++) {
        const int n = first * step, nr = n + step <= N ? step : N - n;
        float out[2 * TILE];
        for (int t0 = 0; t0 < T; t0 += TILE) {
            const int nt = T - t0 < TILE ? T - t0 : TILE;
            dot_tile(bits, n, nr == 2 ? n + 1 : -1, t0, nt, K, weights, scale, zero, q, d, a, out);
            for (int i = 0; i < nr; i++) {
                const float b = bias ? from_bf16(bias[n + i]) : 0.0f;
                for (int t = 0; t < nt; t++) y[(size_t)(t0 + t) * N + n + i] = to_bf16(out[i * TILE + t] + b);
            }
        }
    }
}

/* The gate and up projections of a SwiGLU MLP in one: W holds the gate's rows, then the
 * up's (N rows in all); y [T, N/2] = silu(gate) * up (see swiglu.h), 16 outputs at a
 * time through the vectorised exp. */
static void gated_rows(int bits, int T, int K, const uint8_t *weights, const uint16_t *scale, const uint16_t *zero,
                       const uint16_t *bias, int N, const int8_t *q, const float *d, const float *a, uint16_t *y) {
    const int half = N / 2;
#pragma omp parallel for schedule(static)
    for (int block = 0; block < (half + 15) / 16; block++) {
        const int n0 = 16 * block, width = half - n0 < 16 ? half - n0 : 16;
        for (int t0 = 0; t0 < T; t0 += TILE) {
            const int nt = T - t0 < TILE ? T - t0 : TILE;
            float gate[TILE][16] = {{0}}, up[TILE][16] = {{0}}, out[2 * TILE];
            for (int j = 0; j < width; j++) {
                const int n = n0 + j;  /* the gate's row; the up's is n + half */
                if (paired(bits, T)) {
                    dot_tile(bits, n, n + half, t0, nt, K, weights, scale, zero, q, d, a, out);
                } else {
                    dot_tile(bits, n, -1, t0, nt, K, weights, scale, zero, q, d, a, out);
                    dot_tile(bits, n + half, -1, t0, nt, K, weights, scale, zero, q, d, a, out + TILE);
                }
                for (int part = 0; part < 2; part++) {
                    const float b = bias ? from_bf16(bias[n + part * half]) : 0.0f;
                    for (int t = 0; t < nt; t++) (part ? up : gate)[t][j] = round_bf16(out[part * TILE + t] + b);
                }
            }
            for (int t = 0; t < nt; t++) silu_times_up(gate[t], up[t], width, y + (size_t)(t0 + t) * half + n0);
        }
    }
}

/* x [T, K] bf16 -> y [T, N] bf16 (gated: [T, N/2], see gated_rows), bias [N] bf16 or NULL.
 * bits 4: weights [N, K/2] uint8, scale and zero [N, K/32] bf16.
 * bits 8: weights [N, K] uint8, scale [N] bf16, zero unused.
 * Returns 0, or -1 when out of memory. */
int quantized_matmul(int bits, int gated, const uint16_t *x, int T, int K, const uint8_t *weights,
                     const uint16_t *scale, const uint16_t *zero, const uint16_t *bias, int N, uint16_t *y) {
    const int G = K / GROUP, Gp = padded_groups(G);
    int8_t *q = aligned_alloc(64, (size_t)T * GROUP * Gp);
    float *d = aligned_alloc(64, sizeof(float) * (size_t)T * Gp);
    float *a = aligned_alloc(64, sizeof(float) * (size_t)T * Gp);
    if (!q || !d || !a) {
        free(q), free(d), free(a);
        return -1;
    }
    quantize_rows(x, T, K, q, d, a);
    (gated ? gated_rows : plain_rows)(bits, T, K, weights, scale, zero, bias, N, q, d, a, y);
    free(q), free(d), free(a);
    return 0;
}
