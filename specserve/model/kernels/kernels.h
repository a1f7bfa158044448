/* What one C file calls from another, and the model description native.py lays out
 * (decode_blocks.c and speculate.c run the others). */
#ifndef SPECSERVE_KERNELS_H
#define SPECSERVE_KERNELS_H

#include <stdint.h>

int quantized_matmul(int bits, int gated, const uint16_t *x, int T, int K, const uint8_t *weights,
                     const uint16_t *scale, const uint16_t *zero, const uint16_t *bias, int N, uint16_t *y);
int bf16_matmul(int dot, int gated, const uint16_t *x, int T, int K, const uint16_t *weights, const uint16_t *bias,
                int N, uint16_t *y);
int bf16_dot_available(void);
void rms_norm(const uint16_t *x, const uint16_t *weight, int T, int D, float eps, uint16_t *out);
int decode_attention(const void *qkv, int row, const void *cos, const void *rotated_sin, const void *q_norm,
                     const void *k_norm, float eps, void *keys, void *values, int n, int heads, int kv_heads,
                     int D, int capacity, int start, int bf16, void *out);

struct quantized_linear { /* bias may be NULL; bits 16: bfloat16 weights [N, K], no scale or zero */
    const uint8_t *weights;
    const uint16_t *scale, *zero, *bias;
    int bits, in_features, out_features;
};

struct block {
    const uint16_t *input_norm, *post_attention_norm, *q_norm, *k_norm; /* [hidden] or [D]; qk norms may be NULL */
    struct quantized_linear qkv, o, gate_up, down;
};

/* A quantized (bfloat16 activations, int4/int8 weights) or bfloat16 model: its blocks, and what turns tokens into
 * hidden states and hidden states into logits. */
struct model {
    const struct block *blocks;
    int num_layers, hidden, heads, kv_heads, D, intermediate;
    int vocab;                  /* the head's rows: the token ids it scores (a draft's may be fewer) */
    float eps;
    const uint16_t *embed;      /* [every token id, hidden] */
    const uint16_t *final_norm; /* [hidden] */
    struct quantized_linear head;
};

struct segment { /* one sequence's new tokens: n rows of h, its cache from layer 0 */
    uint16_t *keys, *values; /* [layers, kv_heads, capacity, D] */
    int n, capacity, start;  /* start: positions already cached */
};

/* y = x W^T (+ bias) for x [T, in_features]; gated: silu(gate) * up (see quantized_matmul.c). */
int apply_linear(const struct quantized_linear *layer, int gated, const uint16_t *x, int T, uint16_t *y);

/* cos and rotated_sin: RoPE tables [positions, D] indexed by position (decoder.rope_table). */
int decode_blocks(const struct model *m, const uint16_t *cos, const uint16_t *rotated_sin, uint16_t *h, int T,
                  const struct segment *segments, int num_segments);

#endif
