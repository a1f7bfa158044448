/* bfloat16 <-> float32 for the kernels: a bfloat16 is a float32's upper 16 bits. */
#ifndef SPECSERVE_BF16_H
#define SPECSERVE_BF16_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline float from_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as PyTorch does */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* x rounded to bfloat16, as a float32: what a PyTorch op on bfloat16 tensors stores. */
static inline float round_bf16(float x) { return from_bf16(to_bf16(x)); }

#ifdef __AVX512F__ /* avx2/ includes the scalar conversions alone */
/* 16 bfloat16 values -> 16 float32 lanes */
static inline __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
#endif

#endif
