"""Read a GGUF file into a `ModelConfig` and Hugging Face-named float32 weights.

GGUF lists tensor shapes fastest axis first; `gguf.quants.dequantize` already returns
row-major arrays in the Hugging Face `[out, in]` layout. Files of architecture `llama`
store the rows of q and k permuted for llama.cpp's interleaved RoPE; we undo that here
so the decoder sees the rotate-half layout of Hugging Face checkpoints (qwen2 and qwen3
files are written unpermuted).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from specserve.config import ARCHITECTURES, ModelConfig
from specserve.errors import ModelLoadError
from specserve.model.gguf_header import read_gguf_header

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def open_gguf(path: str | Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises bare ValueErrors and struct errors
        raise ModelLoadError(f"{path} is not a readable GGUF file ({e}); is it complete?") from None


def config_from_header(fields: dict[str, Any], num_vocab_rows: int) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported; specserve runs {sorted(ARCHITECTURES)}")

    def key(name: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF header lacks '{arch}.{name}'")
        return value

    num_heads = key("attention.head_count")
    hidden = key("embedding_length")
    scaling_type = fields.get(f"{arch}.rope.scaling.type")
    rope_scaling = None
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ModelLoadError(f"GGUF rope scaling {scaling_type!r} is not supported (linear is)")
        rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    return ModelConfig(
        arch=arch,
        vocab_size=num_vocab_rows,
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=num_heads,
        num_kv_heads=key("attention.head_count_kv", num_heads),
        head_dim=key("attention.key_length", hidden // num_heads),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=key("context_length", 4096),
        tie_word_embeddings=False,  # decided by the tensors present, below
        rope_scaling=rope_scaling,
    )


def hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family decoder")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of q/k rows: [(h, d/2, 2), ...] -> [(h, 2, d/2), ...]."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    trailing = weight.shape[1:]
    return weight.reshape(num_heads, head_dim // 2, 2, *trailing).transpose(1, 2).reshape(rows, *trailing)


def dequantized_tensors(reader) -> Iterator[tuple[str, np.ndarray]]:
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # fastest axis last, as in torch
        array = dequantize(tensor.data, tensor.tensor_type)
        # A copy: F32 tensors come back as read-only views of the memory-mapped file.
        yield tensor.name, np.array(array, dtype=np.float32).reshape(shape)


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, Hugging Face-named float32 weights, header fields) of a GGUF file."""
    fields = read_gguf_header(path)
    reader = open_gguf(path)
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError(
            f"{path} carries per-frequency RoPE factors (Llama 3.1 style), which the GGUF "
            "loader does not read yet; load the Hugging Face checkpoint folder instead"
        )
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelLoadError(f"{path} has no token_embd.weight tensor")
    config = config_from_header(fields, num_vocab_rows=int(embed.shape[-1]))
    if "output.weight" not in names:
        config = ModelConfig(**{**config.__dict__, "tie_word_embeddings": True})
    weights: dict[str, torch.Tensor] = {}
    for name, array in dequantized_tensors(reader):
        weight = torch.from_numpy(array)
        if config.arch == "llama" and re.search(r"\.attn_[qk]\.(weight|bias)$", name):
            heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
            weight = unpermute_rope_rows(weight, heads)
        weights[hf_name(name)] = weight
    return config, weights, fields
