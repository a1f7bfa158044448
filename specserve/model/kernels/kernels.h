/* The kernels one C file calls from another (decode_blocks.c runs the others). */
#ifndef SPECSERVE_KERNELS_H
#define SPECSERVE_KERNELS_H

#include <stdint.h>

int quantized_matmul(int bits, int gated, const uint16_t *x, int T, int K, const uint8_t *weights,
                     const uint16_t *scale, const uint16_t *zero, const uint16_t *bias, int N, uint16_t *y);
void rms_norm(const uint16_t *x, const uint16_t *weight, int T, int D, float eps, uint16_t *out);
int decode_attention(const void *qkv, int row, const void *cos, const void *rotated_sin, const void *q_norm,
                     const void *k_norm, float eps, void *keys, void *values, int n, int heads, int kv_heads,
                     int D, int capacity, int start, int bf16, void *out);

#endif
