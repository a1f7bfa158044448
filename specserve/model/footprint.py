"""What a decode step reads: the bytes of weights per generated token.

Decoding one token at batch 1 reads every weight the step uses once: every linear
weight, the head included, with its bias and quantization scales; the norms; and one
row of the embedding table. A head tied to the embedding reads the whole table, so a
tied table counts once, as the head. The roofline of the benchmarks and the engine's
first guess of a draft's cost both start from this count.

Verifying k drafts runs k + 1 rows through the same weights: the bytes stay, the
arithmetic grows with the rows. `multiply_adds_per_token` counts that arithmetic.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.config import ModelConfig


def tensor_bytes(t: torch.Tensor) -> int:
    # Also right for oneDNN (mkldnn) tensors, whose numel and element_size are the
    # dense tensor's.
    return t.numel() * t.element_size()


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights one decode step of `model` reads (see the module docstring).

    Works on any module tree: our `Decoder` (nn.Linear, PackedLinear, quantized linear
    layers alike, whatever tensors they hold) and a `transformers` model.
    """
    counted: dict[int, int] = {}  # id(tensor) -> bytes, so a shared tensor counts once
    embeddings: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            embeddings.append(module.weight)
            continue
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            counted[id(t)] = tensor_bytes(t)
    for table in embeddings:
        if id(table) not in counted:  # untied: a lookup reads one row [hidden]
            counted[id(table)] = tensor_bytes(table[0])
    return sum(counted.values())


def multiply_adds_per_token(config: ModelConfig, head_size: int | None = None) -> int:
    """Multiply-adds of one row through a Llama-family decoder's linear layers (the
    attention and SwiGLU projections of every block, and the head over `head_size` token
    ids, all of them by default). Attention over the cache is left out, as the KV cache
    is left out of the bytes."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    block = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inter
    return config.num_layers * block + hidden * (config.vocab_size if head_size is None else head_size)
