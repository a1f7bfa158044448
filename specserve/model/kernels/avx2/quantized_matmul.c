/*
 * int4 or int8 weights x int8 activations on AVX2: y[T, N] = x[T, K] @ W[N, K]^T (+ bias).
 *
 * For x86-64 CPUs without AVX-512 VNNI, where ../quantized_matmul.c cannot run. There
 * PyTorch's int4 kernel is bound by its arithmetic, well below the memory's speed. This
 * is llama.cpp's AVX2 way: each activation row is quantized to int8 per group of 32,
 * and a group's 32 weights times its 32 int8 values take one `vpmaddubsw` (unsigned
 * times signed bytes, pairs summed to int16) and one `vpmaddwd` (to eight int32 lanes).
 *
 * int4: the levels quant.py stores, unchanged: byte i of a group holds input 2i in its
 * low nibble and input 2i + 1 in its high one, w = (level - 8) * s + z. So the
 * activations are quantized in that order: a group's 16 even inputs, then its 16 odd
 * ones. Each group's s and m = z - 8 s come as float32 ([N, G] each, see avx2.py). A
 * group's dot product: sum_i w_i x_i = s d sum_i l_i q_i + m d sum_i q_i, with
 * q_i = round(x_i / d) and d = max|x| / 127 over the group; the second terms of a row
 * are summed apart, eight groups at a time. Pairs of levels times values: at most
 * 15 * 127 * 2, no int16 saturates.
 *
 * int8: quant.py's weights w in [-127, 127] with one float32 scale s a row, w = level * s;
 * activations in their own order. |w| times q carrying w's sign: at most 127 * 127 * 2.
 *
 * Every output is computed by the same arithmetic in the same order whatever the
 * number of rows or the row's place among them: the results are batch invariant.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../bf16.h"

#define GROUP 32
#define TILE 4 /* activation rows that share one unpacked pair of weight groups */

/* x [T, K] bfloat16 -> q [T, K] int8 (even_first: each group's even inputs, then its
 * odd ones; else in order), d [T, G] = max|x| / 127 and a [T, G] = d * sum(q). */
static void quantize_rows(const uint16_t *x, int T, int K, int even_first, int8_t *q, float *d, float *a) {
    const int G = K / GROUP;
    for (int t = 0; t < T; t++) {
        for (int g = 0; g < G; g++) {
            const uint16_t *xg = x + (size_t)t * K + (size_t)g * GROUP;
            float values[GROUP], amax = 0.0f;
            for (int i = 0; i < GROUP; i++) {
                values[i] = from_bf16(xg[i]);
                amax = fmaxf(amax, fabsf(values[i]));
            }
            const float scale = amax / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
            int8_t *qg = q + (size_t)t * K + (size_t)g * GROUP;
            int sum = 0;
            for (int i = 0; i < GROUP; i++) {
                int level = (int)nearbyintf(values[i] * inverse); /* half to even */
                level = level > 127 ? 127 : (level < -127 ? -127 : level);
                qg[even_first ? (i & 1) * 16 + i / 2 : i] = (int8_t)level;
                sum += level;
            }
            d[(size_t)t * G + g] = scale;
            a[(size_t)t * G + g] = scale * (float)sum;
        }
    }
}

static inline float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum_g m[g] a[g] over G groups, eight lanes then the rest, in a fixed order. */
static inline float offset_sum(const float *m, const float *a, int G) {
    __m256 acc = _mm256_setzero_ps();
    int g = 0;
    for (; g + 8 <= G; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + g), _mm256_loadu_ps(a + g), acc);
    float sum = horizontal_sum(acc);
    for (; g < G; g++) sum = fmaf(m[g], a[g], sum);
    return sum;
}

/* s d sum_i l_i q_i of one group of one activation row, added into acc. */
static inline __m256 add_group(__m256 acc, __m256i levels, const int8_t *qg, float sd) {
    const __m256i values = _mm256_loadu_si256((const __m256i *)qg);
    const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(levels, values), _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(sd), acc);
}

/* Weight row n (levels w, s and m) against activation rows t0 .. t0 + nt - 1, groups
 * two at a time from one 32-byte load: even groups into acc[0], odd ones into acc[1].
 * Inlined for each constant nt, so that the sums stay in registers. */
static inline __attribute__((always_inline)) void int4_row_tile_of(const uint8_t *w, const float *s, const float *m, int G,
                                                              int K, const int8_t *q, const float *d,
                                                              const float *a, int t0, const int nt, float *out) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
    __m256 acc[2][TILE];
    for (int r = 0; r < nt; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    int g = 0;
    for (; g + 2 <= G; g += 2) {
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(w + (size_t)g * (GROUP / 2)));
        const __m256i even = _mm256_and_si256(packed, low_nibbles);                       /* groups g, g+1 */
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles); /* likewise */
        const __m256i first = _mm256_permute2x128_si256(even, odd, 0x20), second = _mm256_permute2x128_si256(even, odd, 0x31);
        for (int r = 0; r < nt; r++) {
            const size_t at = (size_t)(t0 + r) * G + g;
            const int8_t *qg = q + (size_t)(t0 + r) * K + (size_t)g * GROUP;
            acc[0][r] = add_group(acc[0][r], first, qg, s[g] * d[at]);
            acc[1][r] = add_group(acc[1][r], second, qg + GROUP, s[g + 1] * d[at + 1]);
        }
    }
    if (g < G) { /* an odd number of groups: the last one alone */
        const __m128i packed = _mm_loadu_si128((const __m128i *)(w + (size_t)g * (GROUP / 2)));
        const __m256i levels = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low_nibbles);
        for (int r = 0; r < nt; r++)
            acc[0][r] = add_group(acc[0][r], levels, q + (size_t)(t0 + r) * K + (size_t)g * GROUP,
                                  s[g] * d[(size_t)(t0 + r) * G + g]);
    }
    for (int r = 0; r < nt; r++)
        out[r] = horizontal_sum(_mm256_add_ps(acc[0][r], acc[1][r])) + offset_sum(m, a + (size_t)(t0 + r) * G, G);
}

/* int8 weight row n (w, its scale s) against activation rows t0 .. t0 + nt - 1: groups
 * alternately into acc[0] and acc[1]. */
static inline __attribute__((always_inline)) void int8_row_tile_of(const int8_t *w, float s, int G, int K,
                                                                   const int8_t *q, const float *d, int t0,
                                                                   const int nt, float *out) {
    __m256 acc[2][TILE];
    for (int r = 0; r < nt; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        const __m256i weights = _mm256_loadu_si256((const __m256i *)(w + (size_t)g * GROUP));
        const __m256i magnitudes = _mm256_sign_epi8(weights, weights);
        for (int r = 0; r < nt; r++) {
            const __m256i values = _mm256_loadu_si256((const __m256i *)(q + (size_t)(t0 + r) * K + (size_t)g * GROUP));
            const __m256i products = _mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(values, weights));
            const __m256i sums = _mm256_madd_epi16(products, _mm256_set1_epi16(1));
            acc[g & 1][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d[(size_t)(t0 + r) * G + g]),
                                            acc[g & 1][r]);
        }
    }
    for (int r = 0; r < nt; r++) out[r] = s * horizontal_sum(_mm256_add_ps(acc[0][r], acc[1][r]));
}

/* Weight row n (4 or 8 bits) against activation rows t0 .. t0 + nt - 1, nt a constant. */
static inline __attribute__((always_inline)) void row_tile_of(int bits, int n, const void *w, const float *s,
                                                              const float *m, int G, int K, const int8_t *q,
                                                              const float *d, const float *a, int t0, const int nt,
                                                              float *out) {
    if (bits == 4)
        int4_row_tile_of((const uint8_t *)w + (size_t)n * (K / 2), s + (size_t)n * G, m + (size_t)n * G, G, K, q, d,
                         a, t0, nt, out);
    else
        int8_row_tile_of((const int8_t *)w + (size_t)n * K, s[n], G, K, q, d, t0, nt, out);
}

/* Weight row n against activation rows t0 .. t0 + nt - 1, plus its bias: each tile
 * height its own code, so the accumulators of a short tile stay in registers. */
static inline void weight_row(int bits, int n, const void *w, const float *s, const float *m, const uint16_t *bias,
                              int G, int K, const int8_t *q, const float *d, const float *a, int t0, int nt,
                              float *out) {
    switch (nt) {
    case 1: row_tile_of(bits, n, w, s, m, G, K, q, d, a, t0, 1, out); break;
    case 2: row_tile_of(bits, n, w, s, m, G, K, q, d, a, t0, 2, out); break;
    case 3: row_tile_of(bits, n, w, s, m, G, K, q, d, a, t0, 3, out); break;
    default: row_tile_of(bits, n, w, s, m, G, K, q, d, a, t0, TILE, out); break;
    }
    const float b = bias ? from_bf16(bias[n]) : 0.0f;
    for (int r = 0; r < nt; r++) out[r] += b;
}

/* x [T, K] bfloat16 -> y [T, N] bfloat16, or (gated) [T, N/2] silu(gate) * up with the
 * gate's rows first, gate and up rounded to bfloat16 as a separate matmul would store
 * them and silu(gate) rounded too, as PyTorch's F.silu(gate) * up rounds. bits 4: w
 * [N, K/2] levels, s and m [N, G]; bits 8: w [N, K] int8, s [N], m unused. The
 * arguments are ../quantized_matmul.c's. Returns 0, or 1 where the activation buffers
 * could not be allocated. */
int quantized_matmul(int bits, int gated, const uint16_t *x, int T, int K, const void *w, const float *s,
                     const float *m, const uint16_t *bias, int N, uint16_t *y) {
    const int G = K / GROUP, outputs = gated ? N / 2 : N;
    int8_t *q = malloc((size_t)T * K);
    float *d = malloc(sizeof(float) * (size_t)T * G), *a = malloc(sizeof(float) * (size_t)T * G);
    if (!q || !d || !a) {
        free(q), free(d), free(a);
        return 1;
    }
    quantize_rows(x, T, K, bits == 4, q, d, a);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < outputs; n++) {
        for (int t0 = 0; t0 < T; t0 += TILE) {
            const int nt = T - t0 < TILE ? T - t0 : TILE;
            float out[TILE], up[TILE];
            weight_row(bits, n, w, s, m, bias, G, K, q, d, a, t0, nt, out);
            if (gated) {
                weight_row(bits, n + outputs, w, s, m, bias, G, K, q, d, a, t0, nt, up);
                for (int r = 0; r < nt; r++) {
                    const float gate = round_bf16(out[r]);
                    out[r] = round_bf16(gate / (1.0f + expf(-gate))) * round_bf16(up[r]);
                }
            }
            for (int r = 0; r < nt; r++) y[(size_t)(t0 + r) * outputs + n] = to_bf16(out[r]);
        }
    }
    free(q), free(d), free(a);
    return 0;
}
