/*
 * Attention for decoding, verification and prompt chunks: each new token's query and
 * key are made (the optional per-head RMSNorm of qk_norm models, then RoPE), its key
 * and value go into the cache, and it attends on its own to the cached keys up to its
 * position, in float32, for float32 or bfloat16 caches.
 *
 * Why: decoding and verifying drafts must compute a token's attention exactly as
 * decoding it alone would, so the engine attends one query at a time; and a prompt's
 * tokens the same bits however the engine's steps cut it into chunks. Through SDPA that
 * is one call per token per layer (verifying 8 drafts at 2000 positions: ~2.5 ms a
 * layer), and RoPE and the cache writes are a dozen more small PyTorch ops a layer.
 * Here every (token, head) pair is computed in a fixed order whatever else is in the
 * call, so a batch of them gives each token's solo result.
 *
 * The query heads that share a kv head (grouped-query attention: 6 of them on the 1.5B
 * target) are computed together, a block of up to HEADS_AT_ONCE per task, so each key
 * and value is loaded (and widened from bfloat16) once per block rather than once per
 * head: one head at a time, a decode step at 4096 positions spent more time in
 * attention than in the int4 target's matmuls. Each head's sums run in the same order
 * either way, so the bits are those of one head at a time.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp16.h"
#include "rms.h"

static inline __m512 load16(const void *p, size_t index, int bf16) {
    if (bf16) return widen_bf16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + index)));
    return _mm512_loadu_ps((const float *)p + index);
}

/* Round to the model's dtype: what PyTorch's elementwise ops store. */
static inline float stored(float x, int bf16) { return bf16 ? round_bf16(x) : x; }

/* One head of one new token, as decoder.py's PyTorch ops make it: RMSNorm over the head
 * when norm_weight is given (as rms_norm.c computes it), then RoPE, x cos +
 * rotate_half(x) sin = x cos + roll(x, D/2) rotated_sin, each product and the sum
 * rounded to the model's dtype. src, cos and rotated_sin [D] in the model's dtype,
 * dst [D] float32 holding model-dtype values. */
static void rotate_head(const void *src, const void *norm_weight, float eps, const void *cos,
                        const void *rotated_sin, int D, int bf16, float *dst) {
    float x[256];
    for (int e = 0; e < D; e++) x[e] = element(src, e, bf16);
    if (norm_weight) {
        const float scale = rms_inverse(src, D, bf16, eps);
        for (int e = 0; e < D; e++) x[e] = rms_normed(x[e], scale, element(norm_weight, e, bf16), bf16);
    }
    for (int e = 0; e < D; e++) {
        const float straight = stored(x[e] * element(cos, e, bf16), bf16);
        const float turned = stored(x[(e + D / 2) % D] * element(rotated_sin, e, bf16), bf16);
        dst[e] = stored(straight + turned, bf16);
    }
}

static inline void store(void *p, size_t index, float x, int bf16) {
    if (bf16) ((uint16_t *)p)[index] = to_bf16(x);
    else ((float *)p)[index] = x;
}

#define HEADS_AT_ONCE 4 /* query heads per task: 4 heads x 4 keys of score chains, and the 4 keys, in registers */

/* scores[g][j] = (q_g / sqrt(D)) . k_j for j < length and the NH query heads of one kv
 * head (queries [NH][256], scaled already). Each dot is FMAs over the chunks in order,
 * then its lanes' sum: the same whatever NH, four keys at a time for independent chains. */
static inline __attribute__((always_inline)) void block_scores(const int NH, const float *queries, int chunks,
                                                               const void *keys, size_t kv_offset, int D, int bf16,
                                                               int length, float *const *scores) {
    int j = 0;
    for (; j + 4 <= length; j += 4) {
        __m512 dot[HEADS_AT_ONCE][4];
        for (int g = 0; g < NH; g++)
            for (int u = 0; u < 4; u++) dot[g][u] = _mm512_setzero_ps();
        for (int c = 0; c < chunks; c++) {
            __m512 key[4];
            for (int u = 0; u < 4; u++) key[u] = load16(keys, kv_offset + (size_t)(j + u) * D + 16 * c, bf16);
            for (int g = 0; g < NH; g++) {
                const __m512 query = _mm512_load_ps(queries + 256 * g + 16 * c);
                for (int u = 0; u < 4; u++) dot[g][u] = _mm512_fmadd_ps(query, key[u], dot[g][u]);
            }
        }
        for (int g = 0; g < NH; g++)
            for (int u = 0; u < 4; u++) scores[g][j + u] = _mm512_reduce_add_ps(dot[g][u]);
    }
    for (; j < length; j++) /* the last few */
        for (int g = 0; g < NH; g++) {
            __m512 dot = _mm512_setzero_ps();
            for (int c = 0; c < chunks; c++)
                dot = _mm512_fmadd_ps(_mm512_load_ps(queries + 256 * g + 16 * c),
                                      load16(keys, kv_offset + (size_t)j * D + 16 * c, bf16), dot);
            scores[g][j] = _mm512_reduce_add_ps(dot);
        }
}

/* acc[g][16 c0 ..] = sum over j < length of weights[g][j] v_j, for NC chunks from c0 and
 * the NH heads of one kv head: each sum in the order of j, as one head alone sums it;
 * the NH x NC chains are independent. */
static inline __attribute__((always_inline)) void block_values(const int NH, const int NC, int c0, int length,
                                                               float *const *weights, const void *values,
                                                               size_t kv_offset, int D, int bf16, float *acc) {
    __m512 sum[HEADS_AT_ONCE][8];
    for (int g = 0; g < NH; g++)
        for (int c = 0; c < NC; c++) sum[g][c] = _mm512_setzero_ps();
    for (int j = 0; j < length; j++) {
        __m512 value[8];
        for (int c = 0; c < NC; c++) value[c] = load16(values, kv_offset + (size_t)j * D + 16 * (c0 + c), bf16);
        for (int g = 0; g < NH; g++) {
            const __m512 weight = _mm512_set1_ps(weights[g][j]);
            for (int c = 0; c < NC; c++) sum[g][c] = _mm512_fmadd_ps(weight, value[c], sum[g][c]);
        }
    }
    for (int g = 0; g < NH; g++)
        for (int c = 0; c < NC; c++) _mm512_store_ps(acc + 256 * g + 16 * (c0 + c), sum[g][c]);
}

/* block_values over every chunk, in passes of as many chunks as keep NH x NC >= 8
 * chains going (the FMA's latency hidden), fewer at the end. */
static inline __attribute__((always_inline)) void all_values(const int NH, int chunks, int length,
                                                             float *const *weights, const void *values,
                                                             size_t kv_offset, int D, int bf16, float *acc) {
    const int widest = NH == 1 ? 8 : NH == 2 ? 4 : 2;
    int c0 = 0;
    if (widest == 8)
        for (; chunks - c0 >= 8; c0 += 8) block_values(NH, 8, c0, length, weights, values, kv_offset, D, bf16, acc);
    if (widest >= 4)
        for (; chunks - c0 >= 4; c0 += 4) block_values(NH, 4, c0, length, weights, values, kv_offset, D, bf16, acc);
    for (; chunks - c0 >= 2; c0 += 2) block_values(NH, 2, c0, length, weights, values, kv_offset, D, bf16, acc);
    if (c0 < chunks) block_values(NH, 1, c0, length, weights, values, kv_offset, D, bf16, acc);
}

/* Softmax numerators of s[0 .. length) in place (the padding to 16 set to -inf);
 * returns 1 / their sum. */
static inline float softmax_numerators(float *s, int length) {
    for (int j = length; j < (length + 15) / 16 * 16; j++) s[j] = -INFINITY; /* pad the last vector */
    __m512 running_max = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < length; j += 16) running_max = _mm512_max_ps(running_max, _mm512_load_ps(s + j));
    const __m512 max_score = _mm512_set1_ps(_mm512_reduce_max_ps(running_max));
    __m512 totals = _mm512_setzero_ps();
    for (int j = 0; j < length; j += 16) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(s + j), max_score));
        _mm512_store_ps(s + j, p);
        totals = _mm512_add_ps(totals, p);
    }
    return 1.0f / _mm512_reduce_add_ps(totals);
}

/* Query heads h0 .. h0 + NH - 1 of token i (all of one kv head), NH <= HEADS_AT_ONCE:
 * scores (scaled queries . keys), softmax, weighted values, normalised into out. */
static inline __attribute__((always_inline)) void attend_block(
    const int NH, const void *qkv, int row, const void *cos, const void *rotated_sin, const void *q_norm, float eps,
    const void *keys, const void *values, int i, int h0, int heads, int group, int D, int capacity, int start,
    int bf16, float *scores, int stride, void *out) {
    const int chunks = D / 16, length = start + i + 1;
    const size_t width = bf16 ? 2 : 4, kv_offset = (size_t)(h0 / group) * capacity * D;
    const float scale = 1.0f / sqrtf((float)D);
    float queries[HEADS_AT_ONCE * 256] __attribute__((aligned(64)));
    float acc[HEADS_AT_ONCE * 256] __attribute__((aligned(64)));
    float *s[HEADS_AT_ONCE];
    for (int g = 0; g < NH; g++) {
        const int h = h0 + g;
        float rotated[256];
        rotate_head((const char *)qkv + ((size_t)i * row + (size_t)h * D) * width, q_norm, eps,
                    (const char *)cos + (size_t)i * D * width, (const char *)rotated_sin + (size_t)i * D * width, D,
                    bf16, rotated);
        for (int c = 0; c < chunks; c++)
            _mm512_store_ps(queries + 256 * g + 16 * c,
                            _mm512_mul_ps(_mm512_loadu_ps(rotated + 16 * c), _mm512_set1_ps(scale)));
        s[g] = scores + ((size_t)i * heads + h) * stride;
    }
    block_scores(NH, queries, chunks, keys, kv_offset, D, bf16, length, s);
    float inverse[HEADS_AT_ONCE];
    for (int g = 0; g < NH; g++) inverse[g] = softmax_numerators(s[g], length);
    all_values(NH, chunks, length, s, values, kv_offset, D, bf16, acc);
    for (int g = 0; g < NH; g++)
        for (int c = 0; c < chunks; c++) {
            float lanes[16];
            _mm512_storeu_ps(lanes, _mm512_mul_ps(_mm512_load_ps(acc + 256 * g + 16 * c), _mm512_set1_ps(inverse[g])));
            for (int e = 0; e < 16; e++) store(out, ((size_t)i * heads + h0 + g) * D + 16 * c + e, lanes[e], bf16);
        }
}

/* qkv [n, row] with row >= (heads + 2 kv_heads) D: each new token's queries, keys and
 * values side by side, before RoPE; cos and rotated_sin [n, D] (see decoder.apply_rope);
 * q_norm and k_norm [D] or NULL; keys and values [kv_heads, capacity, D], with room for
 * positions start .. start + n - 1, which this writes; out [n, heads, D]. Query i sees
 * positions 0 .. start + i. D is a multiple of 16 and at most 256. bf16 says whether
 * all tensors are bfloat16 (else float32). Returns 0, or -1 when out of memory. */
int decode_attention(const void *qkv, int row, const void *cos, const void *rotated_sin, const void *q_norm,
                     const void *k_norm, float eps, void *keys, void *values, int n, int heads, int kv_heads,
                     int D, int capacity, int start, int bf16, void *out) {
    const int group = heads / kv_heads, stride = (start + n + 15) / 16 * 16;
    const size_t width = bf16 ? 2 : 4;
    for (int i = 0; i < n; i++) /* the new keys (rotated) and values into the cache */
        for (int h = 0; h < kv_heads; h++) {
            const size_t token = (size_t)i * row, slot = ((size_t)h * capacity + start + i) * D;
            float k[256];
            rotate_head((const char *)qkv + (token + (size_t)(heads + h) * D) * width, k_norm, eps,
                        (const char *)cos + (size_t)i * D * width, (const char *)rotated_sin + (size_t)i * D * width,
                        D, bf16, k);
            for (int e = 0; e < D; e++) store(keys, slot + e, k[e], bf16);
            memcpy((char *)values + slot * width, (const char *)qkv + (token + (size_t)(heads + kv_heads + h) * D) * width,
                   D * width);
        }
    float *scores = aligned_alloc(64, sizeof(float) * (size_t)n * heads * stride);
    if (!scores) return -1;
    /* A task: one token's block of query heads within a kv head's group, the group split
     * into near-equal blocks of at most HEADS_AT_ONCE; for one token, one head a task
     * (blocks of 3 heads made a decode step's attention 1.18-1.34x slower on the 1.5B
     * target's shapes, 28 layers at 1024-4096 positions, where 8 tokens took 0.76-0.83x
     * the time of one head a task). The bits are the same either way. */
    const int blocks = n == 1 ? group : (group + HEADS_AT_ONCE - 1) / HEADS_AT_ONCE, tasks = n * kv_heads * blocks;
#pragma omp parallel for schedule(dynamic) if (tasks >= 2)
    for (int task = 0; task < tasks; task++) {
        const int i = task / (kv_heads * blocks), kv = task / blocks % kv_heads, b = task % blocks;
        const int first = b * group / blocks, last = (b + 1) * group / blocks; /* of the group's heads */
        const int h0 = kv * group + first;
#define ATTEND_BLOCK(NH)                                                                                  \
    attend_block(NH, qkv, row, cos, rotated_sin, q_norm, eps, keys, values, i, h0, heads, group, D, capacity, \
                 start, bf16, scores, stride, out)
        switch (last - first) {
            case 1: ATTEND_BLOCK(1); break;
            case 2: ATTEND_BLOCK(2); break;
            case 3: ATTEND_BLOCK(3); break;
            default: ATTEND_BLOCK(4); break;
        }
#undef ATTEND_BLOCK
    }
    free(scores);
    return 0;
}
