/*
 * Every transformer block of a quantized (int4/int8) or bfloat16 model for tokens that
 * attend one at a time: decoding and verifying drafts. One call runs what Block.forward
 * in decoder.py runs through PyTorch, with the same kernels in the same order:
 *
 *   h += o_proj(attention(rope(qkv_proj(rms_norm(h)))))
 *   h += down_proj(silu(gate) * up of gate_up_proj(rms_norm(h)))
 *
 * each residual sum rounded to bfloat16 as PyTorch's add rounds it, so the result is
 * bitwise the Python loop's. Why: that loop costs ~100 us a block in Python and small
 * PyTorch ops, 3-4 ms of a 1.5B model's ~40 ms decode step.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"

int apply_linear(const struct quantized_linear *layer, int gated, const uint16_t *x, int T, uint16_t *y) {
    if (layer->bits == 16)
        return bf16_matmul(bf16_dot_available(), gated, x, T, layer->in_features, (const uint16_t *)layer->weights,
                           layer->bias, layer->out_features, y);
    return quantized_matmul(layer->bits, gated, x, T, layer->in_features, layer->weights, layer->scale, layer->zero,
                            layer->bias, layer->out_features, y);
}

static void add_rounded(uint16_t *h, const uint16_t *delta, size_t count) {
    for (size_t i = 0; i < count; i++) h[i] = to_bf16(from_bf16(h[i]) + from_bf16(delta[i]));
}

/* h [T, hidden] bfloat16, updated in place through every block of m; cos and
 * rotated_sin the RoPE tables (see kernels.h); segments cover the T rows in order.
 * Returns 0, or -1 when out of memory. */
int decode_blocks(const struct model *m, const uint16_t *cos, const uint16_t *rotated_sin, uint16_t *h, int T,
                  const struct segment *segments, int num_segments) {
    const int hidden = m->hidden, heads = m->heads, kv_heads = m->kv_heads, D = m->D;
    const int qkv_width = (heads + 2 * kv_heads) * D, widest = qkv_width > m->intermediate ? qkv_width : m->intermediate;
    uint16_t *x = malloc(sizeof(uint16_t) * (size_t)T * hidden);   /* a norm's output, then a projection's */
    uint16_t *wide = malloc(sizeof(uint16_t) * (size_t)T * widest); /* qkv, then the MLP's activation */
    uint16_t *attended = malloc(sizeof(uint16_t) * (size_t)T * heads * D);
    int status = x && wide && attended ? 0 : -1;
    for (int layer = 0; layer < m->num_layers && status == 0; layer++) {
        const struct block *b = m->blocks + layer;
        rms_norm(h, b->input_norm, T, hidden, m->eps, x);
        status |= apply_linear(&b->qkv, 0, x, T, wide);
        for (int s = 0, row = 0; s < num_segments; row += segments[s].n, s++) {
            const struct segment *seg = segments + s;
            const size_t layer_offset = (size_t)layer * kv_heads * seg->capacity * D;
            status |= decode_attention(wide + (size_t)row * qkv_width, qkv_width, cos + (size_t)seg->start * D,
                                       rotated_sin + (size_t)seg->start * D, b->q_norm, b->k_norm, m->eps,
                                       seg->keys + layer_offset, seg->values + layer_offset, seg->n, heads, kv_heads,
                                       D, seg->capacity, seg->start, 1, attended + (size_t)row * heads * D);
        }
        status |= apply_linear(&b->o, 0, attended, T, x);
        add_rounded(h, x, (size_t)T * hidden);
        rms_norm(h, b->post_attention_norm, T, hidden, m->eps, x);
        status |= apply_linear(&b->gate_up, 1, x, T, wide);
        status |= apply_linear(&b->down, 0, wide, T, x);
        add_rounded(h, x, (size_t)T * hidden);
    }
    free(x), free(wide), free(attended);
    return status;
}
