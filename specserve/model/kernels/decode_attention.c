/*
 * Attention for decoding and verification: each new token attends on its own to the
 * cached keys up to its position, in float32, for float32 or bfloat16 caches.
 *
 * Why: decoding and verifying drafts must compute a token's attention exactly as
 * decoding it alone would, so the engine attends one query at a time. Through SDPA that
 * is one call per token per layer (verifying 8 drafts at 2000 positions: ~2.5 ms a
 * layer). Here every (token, head) pair is one task, computed in a fixed order whatever
 * else is in the call, so a batch of them gives each token's solo result.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

static inline __m512 load16(const void *p, size_t index, int bf16) {
    if (bf16) return widen_bf16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + index)));
    return _mm512_loadu_ps((const float *)p + index);
}

/* exp(x) for 16 lanes, x <= 0 here: 2^(x log2 e) split into 2^n 2^f, f in [-0.5, 0.5],
 * 2^f by its degree-6 Taylor series in f ln 2 (relative error < 2e-7), then scaled by
 * 2^n with vscalefps; -inf gives 0. */
static inline __m512 exp16(__m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
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

/* q [n, heads, D], out [n, heads, D]; keys and values [kv_heads, capacity, D]; query i
 * sees positions 0 .. start + i. D is a multiple of 16 and at most 256. bf16 says
 * whether all tensors are bfloat16 (else float32). Returns 0, or -1 when out of memory. */
int decode_attention(const void *q, const void *keys, const void *values, int n, int heads, int kv_heads,
                     int D, int capacity, int start, int bf16, void *out) {
    const int group = heads / kv_heads, chunks = D / 16, stride = (start + n + 15) / 16 * 16;
    const float scale = 1.0f / sqrtf((float)D);
    float *scores = aligned_alloc(64, sizeof(float) * (size_t)n * heads * stride);
    if (!scores) return -1;
#pragma omp parallel for schedule(dynamic) if (n * heads >= 4)
    for (int task = 0; task < n * heads; task++) {
        const int i = task / heads, h = task % heads, length = start + i + 1;
        const size_t kv_offset = (size_t)(h / group) * capacity * D;
        float *s = scores + (size_t)task * stride;
        __m512 query[16];
        for (int c = 0; c < chunks; c++) query[c] = _mm512_mul_ps(load16(q, (size_t)task * D + 16 * c, bf16), _mm512_set1_ps(scale));
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
            float row[16];
            _mm512_storeu_ps(row, _mm512_mul_ps(acc[c], inverse));
            for (int e = 0; e < 16; e++) {
                const size_t index = (size_t)task * D + 16 * c + e;
                if (bf16) ((uint16_t *)out)[index] = to_bf16(row[e]);
                else ((float *)out)[index] = row[e];
            }
        }
    }
    free(scores);
    return 0;
}
