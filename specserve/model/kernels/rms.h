/* What RMSNorm divides by, shared by rms_norm.c and the qk_norm of decode_attention.c so
 * that both compute a row the same way. */
#ifndef SPECSERVE_RMS_H
#define SPECSERVE_RMS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "bf16.h"

/* Element `index` of a float32 or bfloat16 array, as float32. */
static inline float element(const void *p, size_t index, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[index]) : ((const float *)p)[index];
}

/* 1 / sqrt(mean(x^2) + eps) of row [D]: squares summed in 16 fixed lanes, then the
 * lanes in order, so the result does not depend on anything but the row. */
static inline float rms_inverse(const void *row, int D, int bf16, float eps) {
    float lanes[16] = {0};
    int i = 0;
    for (; i + 16 <= D; i += 16)
        for (int j = 0; j < 16; j++) {
            const float v = element(row, i + j, bf16);
            lanes[j] += v * v;
        }
    for (; i < D; i++) {
        const float v = element(row, i, bf16);
        lanes[i % 16] += v * v;
    }
    float sum = 0.0f;
    for (int j = 0; j < 16; j++) sum += lanes[j];
    return 1.0f / sqrtf(sum / (float)D + eps);
}

/* One normalised element, as RMSNorm in decoder.py computes it: weight * (x * scale),
 * the product x * scale and the result rounded to bfloat16 where the model is. */
static inline float rms_normed(float x, float scale, float weight, int bf16) {
    return bf16 ? round_bf16(weight * round_bf16(x * scale)) : weight * (x * scale);
}

#endif
