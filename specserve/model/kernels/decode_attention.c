/*
 * Attention for decoding and verification: each new token's query and key are made
 * (the optional per-head RMSNorm of qk_norm models, then RoPE), its key and value go
 * into the cache, and it attends on its own to the cached keys up to its position, in
 * float32, for float32 or bfloat16 caches.
 *
 * Why: decoding and verifying drafts must compute a token's attention exactly as
 * decoding it alone would, so the engine attends one query at a time. Through SDPA that
 * is one call per token per layer (verifying 8 drafts at 2000 positions: ~2.5 ms a
 * layer), and RoPE and the cache writes are a dozen more small PyTorch ops a layer.
 * Here every (token, head) pair is one task, computed in a fixed order whatever else is
 * in the call, so a batch of them gives each token's solo result.
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

/* Scores of keys j .. j+3 against one (pre-scaled) query: four independent chains. */
static inline void four_scores(const __m512 *query, int chunks, const void *keys, size_t offset, int D, int bf16,
                               float *s) {
    __m512 dot[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int c = 0; c < chunks; c++)
        for (int u = 0; u < 4; u++)
            dot[u] = _mm512_fmadd_ps(query[c], load16(keys, offset + (size_t)u * D + 16 * c, bf16), dot[u]);
    for (int u = 0; u < 4; u++) s[u] = _mm512_reduce_add_ps(dot[u]);
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

/* qkv [n, row] with row >= (heads + 2 kv_heads) D: each new token's queries, keys and
 * values side by side, before RoPE; cos and rotated_sin [n, D] (see decoder.apply_rope);
 * q_norm and k_norm [D] or NULL; keys and values [kv_heads, capacity, D], with room for
 * positions start .. start + n - 1, which this writes; out [n, heads, D]. Query i sees
 * positions 0 .. start + i. D is a multiple of 16 and at most 256. bf16 says whether
 * all tensors are bfloat16 (else float32). Returns 0, or -1 when out of memory. */
int decode_attention(const void *qkv, int row, const void *cos, const void *rotated_sin, const void *q_norm,
                     const void *k_norm, float eps, void *keys, void *values, int n, int heads, int kv_heads,
                     int D, int capacity, int start, int bf16, void *out) {
    const int group = heads / kv_heads, chunks = D / 16, stride = (start + n + 15) / 16 * 16;
    const float scale = 1.0f / sqrtf((float)D);
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
#pragma omp parallel for schedule(dynamic) if (n * heads >= 4)
    for (int task = 0; task < n * heads; task++) {
        const int i = task / heads, h = task % heads, length = start + i + 1;
        const size_t kv_offset = (size_t)(h / group) * capacity * D;
        float *s = scores + (size_t)task * stride;
        float rotated[256];
        rotate_head((const char *)qkv + ((size_t)i * row + (size_t)h * D) * width, q_norm, eps,
                    (const char *)cos + (size_t)i * D * width, (const char *)rotated_sin + (size_t)i * D * width, D,
                    bf16, rotated);
        __m512 query[16];
        for (int c = 0; c < chunks; c++) query[c] = _mm512_mul_ps(_mm512_loadu_ps(rotated + 16 * c), _mm512_set1_ps(scale));
        int j = 0;
        for (; j + 4 <= length; j += 4) four_scores(query, chunks, keys, kv_offset + (size_t)j * D, D, bf16, s + j);
        for (; j < length; j++) { /* the last few: (q / sqrt(D)) . k_j */
            __m512 dot = _mm512_setzero_ps();
            for (int c = 0; c < chunks; c++)
                dot = _mm512_fmadd_ps(query[c], load16(keys, kv_offset + (size_t)j * D + 16 * c, bf16), dot);
            s[j] = _mm512_reduce_add_ps(dot);
        }
        for (j = length; j < (length + 15) / 16 * 16; j++) s[j] = -INFINITY; /* pad the last vector */
        __m512 running_max = _mm512_set1_ps(-INFINITY);
        for (j = 0; j < length; j += 16) running_max = _mm512_max_ps(running_max, _mm512_load_ps(s + j));
        const __m512 max_score = _mm512_set1_ps(_mm512_reduce_max_ps(running_max));
        __m512 totals = _mm512_setzero_ps();
        for (j = 0; j < length; j += 16) { /* softmax numerators, in place */
            const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(s + j), max_score));
            _mm512_store_ps(s + j, p);
            totals = _mm512_add_ps(totals, p);
        }
        const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(totals));
        __m512 acc[16];
        for (int c = 0; c < chunks; c++) acc[c] = _mm512_setzero_ps();
        for (j = 0; j < length; j++) { /* weights times values, normalised at the end */
            const __m512 weight = _mm512_set1_ps(s[j]);
            for (int c = 0; c < chunks; c++)
                acc[c] = _mm512_fmadd_ps(weight, load16(values, kv_offset + (size_t)j * D + 16 * c, bf16), acc[c]);
        }
        for (int c = 0; c < chunks; c++) {
            float lanes[16];
            _mm512_storeu_ps(lanes, _mm512_mul_ps(acc[c], inverse));
            for (int e = 0; e < 16; e++) store(out, (size_t)task * D + 16 * c + e, lanes[e], bf16);
        }
    }
    free(scores);
    return 0;
}
