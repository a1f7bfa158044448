/* The SwiGLU activation of a fused gate/up projection, shared by quantized_matmul.c and
 * float_matmul.c so that every kernel rounds it the same way. */
#ifndef SPECSERVE_SWIGLU_H
#define SPECSERVE_SWIGLU_H

#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"
#include "exp16.h"

/* y[j] = silu(gate[j]) * up[j] for j < width (at most 16), with gate and up already
 * rounded to bfloat16, as a separate matmul would store them, and silu(gate) rounded
 * too, as PyTorch's F.silu(gate) * up rounds. */
static inline void silu_times_up(const float gate[16], const float up[16], int width, uint16_t *y) {
    const __m512 g = _mm512_loadu_ps(gate);
    float silu[16];
    _mm512_storeu_ps(silu, _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    for (int j = 0; j < width; j++) y[j] = to_bf16(round_bf16(silu[j]) * up[j]);
}

#endif
