"""The Llama-family decoder (llama, qwen2, qwen3) over a ragged batch of sequences.

A forward pass takes the new tokens of several sequences flattened into one stream
[T] together with each sequence's `KVCache`. The projections and the MLP (nearly all
the arithmetic) run once over the whole stream; attention runs per sequence against
its own cache. That one shape serves a prompt's prefill, a decode step, the target's
verification of k drafted tokens, and any mix of them in one batch, with no padding.

Weights use the Hugging Face layout and names at load (`load_hf_state_dict`), fused
into one q/k/v and one gate/up matrix for fewer, larger matmuls. RoPE is the
rotate-half form of Hugging Face checkpoints (GGUF loaders undo llama.cpp's
interleaving before the weights get here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass
from functools import cached_property, partial
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from specserve.config import ModelConfig
from specserve.errors import ConfigError, ModelLoadError
from specserve.model import native
from specserve.model.kv_cache import KVCache
from specserve.model.quant import QuantizedLinear, silu_and_mul

if TYPE_CHECKING:
    from specserve.model.graphs import StaticDecode

log = logging.getLogger("specserve")


@dataclass
class Capture:
    """Asks a forward for the features heads draft from (EAGLE, Medusa), and receives
    them for every row of its stream: the residual stream entering each of `layers`
    (EAGLE-3 reads three), and the last hidden state after the final norm (what the LM
    head reads: EAGLE-1's feature and Medusa's input)."""

    layers: tuple[int, ...] = ()
    final: bool = False
    layer_inputs: torch.Tensor | None = None  # out: [T, len(layers) * hidden], in `layers` order
    final_hidden: torch.Tensor | None = None  # out: [T, hidden]

    def fill(self, features: list[torch.Tensor]) -> None:
        """Take a static step's features: the layer inputs where layers are asked for,
        then the final hidden state where it is."""
        features = list(features)
        if self.layers:
            self.layer_inputs = features.pop(0)
        if self.final:
            self.final_hidden = features.pop(0)


def in_asked_order(layers: tuple[int, ...], captured: list[torch.Tensor]) -> torch.Tensor:
    """captured: the residual stream entering each layer of sorted(set(layers)), each
    [T, hidden] -> [T, len(layers) * hidden] in `layers`' order (Capture.layer_inputs)."""
    distinct = sorted(set(layers))
    return torch.cat([captured[distinct.index(i)] for i in layers], dim=-1)


@dataclass(frozen=True)
class Segment:
    """One sequence's share of a batch: `num_tokens` new tokens appended to `cache`.

    `one_query_at_a_time`: attend with each new token separately, exactly as decoding
    them one per step would. Attention kernels round differently for one query and for
    several under a mask (SDPA's by the chunk's length), and in bfloat16 that flips
    near-ties. The int8 and int4 kernels and our float32/bfloat16 one (`FloatLinear`)
    compute a row the same whatever rows come with it, so a target on them verifying
    drafts this way computes bitwise what plain decoding computes; PyTorch's float32 and
    bfloat16 GEMMs do not (see `RowBlockedLinear` and `Decoder.make_batch_invariant`).
    Where our C attention runs (the CPU), every segment attends this way, prompt chunks
    too, at no cost against SDPA: a prompt's keys and logits are then the same bits
    however the steps cut it, and whichever request computed the keys a prefix cache
    hands out.
    """

    cache: KVCache
    num_tokens: int
    one_query_at_a_time: bool = False


class PackedLinear(nn.Module):
    """A float32 CPU linear layer whose weight is converted to oneDNN's format once.

    MKL's float32 GEMM repacks the weight on each call, so 2..16 rows (the target
    verifying k drafts) cost 2-3x one row in a memory-bound decode; oneDNN costs about
    the same for 1 to 16 rows, which is what makes verification nearly free.
    (bfloat16 already goes through oneDNN in `F.linear`.)
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        bias = linear.bias.detach() if linear.bias is not None else weight.new_zeros(weight.shape[0])
        self.register_buffer("weight", weight.to_mkldnn(), persistent=False)  # [out, in]
        self.register_buffer("bias", bias.to_mkldnn(), persistent=False)  # [out]

    @staticmethod
    def available(dtype: torch.dtype) -> bool:
        return (
            dtype == torch.float32 and torch.backends.mkldnn.is_available() and hasattr(torch._C._nn, "mkldnn_linear")
        )

    # torch.compile cannot trace oneDNN's tensors: under it, this call runs as it is.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self.weight, self.bias).to_dense()


class FloatLinear(nn.Module):
    """A float32 or bfloat16 CPU linear layer on our kernel (`native.float_matmul`),
    where it runs.

    Faster than oneDNN (float32) and PyTorch's `F.linear` (bfloat16) for a decode step
    and a verification's few rows, slower for long prompts (benchmarks/README.md,
    "linear_kernels.py"). Its rows are batch invariant, and it reads the layer's own
    weight, so a head tied to the embedding shares the table's memory (oneDNN's format
    is a copy).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        bias = linear.bias.detach().contiguous() if linear.bias is not None else None
        self.register_buffer("weight", linear.weight.detach().contiguous(), persistent=False)  # [out, in]
        self.register_buffer("bias", bias, persistent=False)  # [out] or None

    @staticmethod
    def available(dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.bfloat16) and native.library() is not None

    # ctypes is opaque to torch.compile: under it, this call runs as it is.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return native.float_matmul(x, self.weight, self.bias)

    @torch.compiler.disable
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """For a fused gate/up projection (the gate's rows first): silu(gate) * up,
        [T, in] -> [T, out / 2], in one kernel call in bfloat16 (as `decode_blocks`
        computes it); float32 through PyTorch's SiLU."""
        if self.weight.dtype == torch.bfloat16:
            return native.float_matmul(x, self.weight, self.bias, gated=True)
        return silu_and_mul(self(x))


def linear_of(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding these very tensors (weight [out, in], bias [out] or None):
    no copy, no initialisation."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def first_rows(layer: nn.Module, n: int) -> nn.Module:
    """`layer` computing only its outputs [0, n) (`Decoder.add_common_head`): views of its
    weights, or for oneDNN's packed format, which cannot be sliced, a packed copy of them."""
    if isinstance(layer, QuantizedLinear):
        return layer.first_rows(n)
    if isinstance(layer, PackedLinear):
        return PackedLinear(first_rows(linear_of(layer.weight.to_dense(), layer.bias.to_dense()), n))
    if isinstance(layer, (FloatLinear, nn.Linear)):
        rows = linear_of(layer.weight[:n], None if layer.bias is None else layer.bias[:n])  # [n, in], [n]: views
        return FloatLinear(rows) if isinstance(layer, FloatLinear) else rows
    raise ConfigError(f"a {type(layer).__name__} head cannot be cut to its first rows")


# Rows per GEMM call in batch-invariant mode.
ROW_BLOCK = 8


class RowBlockedLinear(nn.Module):
    """A linear layer whose output rows do not depend on the other rows of the call.

    float32 (oneDNN) and bfloat16 GEMMs choose their blocking by row count: a row computed
    alone differs in its last bits from the same row computed among 8, which flips
    near-ties between plain decoding (1 row), verification (k+1 rows) and batching.
    Among calls of exactly 8 rows, neither the other rows nor a row's slot matter
    (measured on every layer shape of the catalogue models), so every call here runs in
    blocks of ROW_BLOCK rows, the last one zero-padded. The int8/int4 kernels need no
    such help: their rows are already independent.
    """

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        rows = x.shape[0]
        padding = -rows % ROW_BLOCK
        if padding:
            x = torch.cat([x, x.new_zeros(padding, x.shape[1])])  # [T + padding, in]
        if x.shape[0] == ROW_BLOCK:  # a decode or verification step: one call, no concatenation
            return self.inner(x)[:rows]
        out = torch.cat([self.inner(block) for block in x.split(ROW_BLOCK)])  # [T + padding, out]
        return out[:rows]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 == self.weight.dtype and x.is_cpu and native.library() is not None:
            return native.rms_norm(x, self.weight, self.eps)  # the same arithmetic, one call
        # Normalise in float32 whatever the weight dtype, as the reference models do.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32 angular frequencies, with the config's scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.float()
    kind = scaling.get("rope_type") or scaling.get("type")
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return (inv_freq / factor).float()
    if kind == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, smooth between.
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > old_context / low_freq_factor, inv_freq / factor, inv_freq)
        mid = (wavelen >= old_context / high_freq_factor) & (wavelen <= old_context / low_freq_factor)
        return torch.where(mid, blended, scaled).float()
    raise ConfigError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")


def rope_rows(
    inv_freq: torch.Tensor,  # [head_dim // 2] float32 (rope_inverse_frequencies)
    positions: torch.Tensor,  # [T] int64
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, rotated_sin: [T, head_dim] in dtype
    """The cos and rotated_sin rows (see apply_rope) of these positions."""
    angles = positions.unsqueeze(1).float() * inv_freq  # [T, head_dim // 2]
    sin = angles.sin()
    return angles.cos().repeat(1, 2).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(
    x: torch.Tensor,  # [T, heads, head_dim]
    cos: torch.Tensor,  # [T, 1, head_dim]
    rotated_sin: torch.Tensor,  # [T, 1, head_dim]: (-sin, sin) over the two halves
) -> torch.Tensor:  # [T, heads, head_dim]
    """x cos + rotate_half(x) sin, with rotate_half(x) = (-x2, x1): rolling x gives
    (x2, x1) and rotated_sin carries the sign, so it is 4 ops instead of 7, bit for bit
    the same numbers."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * rotated_sin


def grouped_attention(
    q: torch.Tensor,  # [heads, n, head_dim]
    keys: torch.Tensor,  # [kv_heads, L, head_dim]
    values: torch.Tensor,  # [kv_heads, L, head_dim]
    mask: torch.Tensor | None = None,  # [n, L] bool, True = may attend; None = all
) -> torch.Tensor:  # [heads, n, head_dim]
    """One sequence's `batched_grouped_attention`. With a batch dimension, SDPA takes its
    fused CPU kernel; 3-d inputs take the math path (one bfloat16 query at 2000
    positions: 2.6 ms there, 0.3 ms fused)."""
    return batched_grouped_attention(q[None], keys[None], values[None], None if mask is None else mask[None])[0]


def grouped_mask(
    mask: torch.Tensor,  # [B, n, L] bool, True = may attend
    group: int,  # query heads per kv head
) -> torch.Tensor:  # [B, 1, group * n, L]: the mask of batched_grouped_attention's queries
    batch, n, length = mask.shape
    return mask[:, None, None].expand(batch, 1, group, n, length).reshape(batch, 1, group * n, length)


def batched_grouped_attention(
    q: torch.Tensor,  # [B, heads, n, head_dim]
    keys: torch.Tensor,  # [B, kv_heads, L, head_dim]
    values: torch.Tensor,  # [B, kv_heads, L, head_dim]
    mask: torch.Tensor | None = None,  # [B, n, L] bool, True = may attend; None = all
    grouped: torch.Tensor | None = None,  # the mask as grouped_mask gives it, in its place
) -> torch.Tensor:  # [B, heads, n, head_dim]
    """Grouped-query attention without copying the cache per query head.

    SDPA's enable_gqa takes its math path on CPU, which expands keys and values to every
    query head: one query against a 4000-position cache costs 12-30 ms per layer that
    way, 0.3-1 ms this way. Query heads h*g .. h*g+g-1 share kv head h (g = heads /
    kv_heads), so each kv head's g heads go in as g*n queries of one head.
    """
    batch, heads, n, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    if mask is not None:
        grouped = grouped_mask(mask, group)
    out = F.scaled_dot_product_attention(
        q.reshape(batch, kv_heads, group * n, head_dim), keys, values, attn_mask=grouped
    )  # [B, kv_heads, group * n, head_dim]
    # reshape, not view: CUDA's fused kernels may hand back a non-contiguous layout.
    return out.reshape(batch, heads, n, head_dim)


# SDPA's kernels that a CUDA decode step may use. Not cuDNN's: it builds an execution
# plan for each new key length, and a decode step's length grows by one every step, so
# on an H100 every attention call spent 2-3 ms of CPU time planning (profiled: 62-75% of
# a 0.5B model's step) against microseconds of GPU work.
CUDA_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA kernels allowed for a forward pass on `device` (the CPU's choice is kept)."""
    if device.type == "cuda":
        return sdpa_kernel(CUDA_ATTENTION_BACKENDS)
    return contextlib.nullcontext()


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        arch = config.architecture
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if arch.qk_norm else None

    def forward(
        self,
        qkv: torch.Tensor,  # [T, q_size + 2 * kv_size]: qkv_proj's output
        cos: torch.Tensor,  # [T, head_dim]
        rotated_sin: torch.Tensor,  # [T, head_dim], see apply_rope
        layer: int,
        segments: list[Segment],
    ) -> torch.Tensor:  # [T, q_size]: o_proj's input
        """Each segment's queries against its cache (its keys and values stored first)."""
        outputs = []  # per segment: [n, q_size]
        offset = 0
        for seg in segments:
            rows = slice(offset, offset + seg.num_tokens)
            outputs.append(self._attend(qkv[rows], cos[rows], rotated_sin[rows], seg, layer))
            offset += seg.num_tokens
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def _attend(
        self,
        qkv: torch.Tensor,  # [n, q_size + 2 * kv_size]: one segment's new tokens
        cos: torch.Tensor,  # [n, head_dim]
        rotated_sin: torch.Tensor,  # [n, head_dim]
        seg: Segment,
        layer: int,
    ) -> torch.Tensor:  # [n, q_size]
        """Store the segment's keys and values in its cache; attend with its queries."""
        n, start = seg.num_tokens, seg.cache.length
        end = start + n
        cache_k = seg.cache.keys[layer]  # [kv_heads, capacity, head_dim]
        cache_v = seg.cache.values[layer]
        one_at_a_time = n == 1 or seg.one_query_at_a_time
        q_norm = None if self.q_norm is None else self.q_norm.weight  # [head_dim] (qk_norm models)
        k_norm = None if self.k_norm is None else self.k_norm.weight
        if native.supports_decode_attention(qkv, cache_k) and all(
            w is None or w.dtype == qkv.dtype for w in (q_norm, k_norm)
        ):  # RoPE, cache writes and attention in one call, every query alone (prompt chunks too)
            eps = self.q_norm.eps if self.q_norm is not None else 0.0
            return native.decode_attention(
                qkv, cos, rotated_sin, q_norm, k_norm, eps, cache_k, cache_v, start, self.num_heads
            )

        q, k, v = self.rotated_qkv(qkv, cos, rotated_sin)  # [n, heads or kv_heads, head_dim]
        cache_k[:, start:end] = k.transpose(0, 1)
        cache_v[:, start:end] = v.transpose(0, 1)
        heads_first = q.transpose(0, 1)  # [heads, n, head_dim]
        # Query i sits at position start + i and sees keys 0..start + i.
        if one_at_a_time:
            per_query = [
                grouped_attention(heads_first[:, i : i + 1], cache_k[:, : start + i + 1], cache_v[:, : start + i + 1])
                for i in range(n)
            ]  # n x [heads, 1, head_dim]
            out = per_query[0] if n == 1 else torch.cat(per_query, dim=1)  # [heads, n, head_dim]
        else:
            mask = torch.ones(n, end, dtype=torch.bool, device=qkv.device).tril_(diagonal=start)
            out = grouped_attention(heads_first, cache_k[:, :end], cache_v[:, :end], mask)
        return out.transpose(0, 1).reshape(n, -1)

    def rotated_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, rotated_sin: torch.Tensor):
        """[n, q_size + 2 kv_size] -> q [n, heads, head_dim], k and v [n, kv_heads,
        head_dim], with qk_norm and RoPE applied to q and k."""
        q_size, kv_size, _ = self.qkv_sizes
        v = qkv[:, q_size + kv_size :].unflatten(-1, (self.num_kv_heads, self.head_dim))
        cos, rotated_sin = cos.unsqueeze(1), rotated_sin.unsqueeze(1)  # [n, 1, head_dim]
        if self.q_norm is None:  # queries and keys sit side by side: rotate them in one go
            qk = qkv[:, : q_size + kv_size].unflatten(-1, (-1, self.head_dim))  # [n, heads + kv_heads, head_dim]
            q, k = apply_rope(qk, cos, rotated_sin).split((self.num_heads, self.num_kv_heads), dim=1)
            return q, k, v
        q = self.q_norm(qkv[:, :q_size].unflatten(-1, (self.num_heads, self.head_dim)))
        k = self.k_norm(qkv[:, q_size : q_size + kv_size].unflatten(-1, (self.num_kv_heads, self.head_dim)))
        return apply_rope(q, cos, rotated_sin), apply_rope(k, cos, rotated_sin), v


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if isinstance(self.gate_up_proj, (QuantizedLinear, FloatLinear)):  # the activation inside our kernel
            return self.down_proj(self.gate_up_proj.silu_and_mul(x))
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h, cos, rotated_sin, layer, segments):  # h [T, hidden] -> [T, hidden]
        attended = self.self_attn(self.project_qkv(h), cos, rotated_sin, layer, segments)
        return self.finish(h, attended)

    # The two halves around attention hold every op that does not touch a cache: what
    # Decoder.use_torch_compile hands to torch.compile.
    def project_qkv(self, h: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, q_size + 2 kv_size]
        return self.self_attn.qkv_proj(self.input_layernorm(h))

    def project_rotated_qkv(self, h: torch.Tensor, cos: torch.Tensor, rotated_sin: torch.Tensor):
        """project_qkv, then Attention.rotated_qkv: what the static step (model/graphs.py)
        computes before the cache, in one piece for torch.compile to fuse."""
        attn = self.self_attn
        return attn.rotated_qkv(attn.qkv_proj(self.input_layernorm(h)), cos, rotated_sin)

    def finish(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:  # -> [T, hidden]
        h = h + self.self_attn.o_proj(attended)
        return h + self.mlp(self.post_attention_layernorm(h))


# Block methods that Decoder.use_torch_compile compiles.
COMPILED_BLOCK_PARTS = ("project_qkv", "project_rotated_qkv", "finish")


def compile_methods(
    parts: list[tuple[object, str]],
    warm_up: Callable[[], None],
    required: bool,
    mode: str | None,
    options: dict | None = None,
) -> bool:
    """Replace each (owner, method name) by its torch.compile (dynamic shapes; `mode`, or
    inductor's settings `options`, torch.compile's arguments, which take one of the two),
    then run `warm_up`, which calls them in every shape class, so that compiling (tens of
    seconds) happens now rather than in a request. Where inductor cannot build (no C++
    compiler, no Triton) the owners' own methods come back: an error naming the fix if
    `required`, else a warning. Returns whether they are compiled."""
    if mode is not None and options:
        raise ConfigError("torch.compile takes a mode or inductor options, not both")
    how = {"options": options} if options else {"mode": mode}
    for owner, name in parts:
        setattr(owner, name, torch.compile(getattr(owner, name), dynamic=True, **how))
    try:
        warm_up()
    except Exception as error:  # inductor fails in many ways (compiler, codegen): report any
        for owner, name in parts:
            del owner.__dict__[name]  # the class's own method again
        message = f"torch.compile does not work here ({type(error).__name__}: {str(error)[:300]})"
        if required:
            raise ConfigError(f"{message}; drop --compile") from None
        log.warning("%s; running uncompiled", message)
        return False
    return True


def _layer_runs(num_layers: int, capture: Capture | None) -> list[tuple[int, int]]:
    """[first, end) runs of layers that together cover them all, split where a
    captured layer begins."""
    starts = sorted({0, *(capture.layers if capture is not None else ())})
    return list(zip(starts, [*starts[1:], num_layers]))


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        self.head_size = config.vocab_size  # the token ids [0, head_size) lm_head scores
        # (common ids, the head's first rows) where `add_common_head` gave one: a plain
        # attribute, not a submodule, so its views of lm_head are not counted twice.
        self.common: tuple[int, nn.Module] | None = None
        self.batch_invariant = False
        self.compiled = False  # see use_torch_compile
        self._rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # see rope_table
        self.static: StaticDecode | None = None  # see use_cuda_graphs

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self) -> KVCache:
        """An empty cache: a slot of the pool once it is used, with `use_cuda_graphs`
        (hand it back with `KVCache.release`)."""
        return KVCache(self.config, self.dtype, self.device, pool=None if self.static is None else self.static.pool)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64 on self.device: every segment's new tokens, in segment order
        segments: list[Segment],
        logits_rows: torch.Tensor | None = None,  # [R] on self.device: rows of the stream to score; None = all
        common: list[bool] | None = None,  # [R]: rows that may score the common ids only (see `score`)
        capture: Capture | None = None,  # features to keep for draft heads, filled in place
    ) -> torch.Tensor:  # [R, width] float32 on self.device: logits of token ids [0, width)
        """Append the segments' tokens to their caches and return logits for chosen rows."""
        assert input_ids.shape[0] == sum(s.num_tokens for s in segments)
        if self.batch_invariant or self.on_avx2_kernel:
            segments = [dataclasses.replace(s, one_query_at_a_time=True) for s in segments]
        elif self.device.type != "cpu":
            # Query by query matches plain decoding's rounding on the CPU kernels; a GPU's
            # GEMMs round by row count anyway, and k+1 attention calls per layer would
            # cost more kernel launches than the whole rest of the step.
            segments = [dataclasses.replace(s, one_query_at_a_time=False) for s in segments]
        for seg in segments:
            seg.cache.reserve(seg.cache.length + seg.num_tokens)
        if self.static is not None and self.static.handles(segments):
            with attention_backends(self.device):
                logits, *features = self.static.run(input_ids, segments, capture, logits_rows=logits_rows)
            if capture is not None:
                capture.fill(features)
            for seg in segments:
                seg.cache.length += seg.num_tokens
            return logits  # [R, head_size], every id: the graph holds lm_head

        rope = self.rope_table(max((s.cache.length + s.num_tokens for s in segments), default=0))
        h = self.embed_tokens(input_ids)  # [T, hidden]
        in_c = self.model_in_c()
        if in_c is not None and all(
            (s.num_tokens == 1 or s.one_query_at_a_time) and s.cache.keys.is_contiguous() for s in segments
        ):  # the blocks in C calls (one, or one between captured layers): the same kernels and bits as below
            caches = [(s.cache.keys, s.cache.values, s.num_tokens, s.cache.length) for s in segments]
            captured = []
            for first, end in _layer_runs(self.config.num_layers, capture):
                if capture is not None and first in capture.layers:
                    captured.append(h.clone())
                in_c.run_blocks(h, rope, caches, layers=range(first, end))
        else:
            positions = torch.cat(
                [torch.arange(s.cache.length, s.cache.length + s.num_tokens, device=self.device) for s in segments]
            )  # [T]
            cos, rotated_sin = rope[0][positions], rope[1][positions]  # [T, head_dim]
            captured = []
            with attention_backends(self.device):
                for i, layer in enumerate(self.layers):
                    if capture is not None and i in capture.layers:
                        captured.append(h)
                    h = layer(h, cos, rotated_sin, i, segments)
        for seg in segments:
            seg.cache.length += seg.num_tokens
        if capture is not None:
            if captured:
                capture.layer_inputs = in_asked_order(capture.layers, captured)
            if capture.final:
                capture.final_hidden = self.norm(h)
        if logits_rows is not None:
            if logits_rows.numel() == 0:  # cache-filling only (a prompt chunk)
                return h.new_empty(0, self.head_size, dtype=torch.float32)
            h = h[logits_rows]  # [R, hidden]
        return self.score(h, common)

    def _apply(self, fn, recurse=True):
        """`.to(device or dtype)` and friends: the common head holds views of the old
        lm_head, not a submodule, so it is cut again from the moved one."""
        super()._apply(fn, recurse)
        if self.common is not None:
            self.common = (self.common[0], first_rows(self.lm_head, self.common[0]))
            self.__dict__.pop("_in_c_common", None)
        return self

    def score(self, h: torch.Tensor, common: list[bool] | None = None) -> torch.Tensor:
        """h [R, hidden] -> logits [R, width] float32 of token ids [0, width): every id,
        or, where the model has a common head and every row is `common`, the common ids
        only; rows of a mixed call that are common get -inf past the common ids (their
        logits otherwise as the common head computes them, bit for bit)."""
        if self.common is None or not common or not any(common):
            return self.score_every_id(h)  # [R, vocab]
        h = self.norm(h)
        num_common, head = self.common
        if all(common):
            return head(h).float()  # [R, num_common]
        rows = torch.tensor(common, device=h.device)  # [R] bool
        logits = torch.full((h.shape[0], self.head_size), float("-inf"), device=h.device)  # [R, vocab]
        logits[rows, :num_common] = head(h[rows]).float()
        logits[~rows] = self.lm_head(h[~rows]).float()
        return logits

    def score_every_id(self, h: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] float32
        return self.lm_head(self.norm(h)).float()

    def add_common_head(self, num_token_ids: int) -> None:
        """Let `score` score token ids [0, num_token_ids) alone, for the rows a caller
        marks `common`: for a draft model, whose guesses the target verifies, so any
        subset of the vocabulary keeps the output the target's (FR-Spec, Zhao et al.
        2025, drafts over the most frequent tokens). BPE vocabularies number tokens
        roughly by merge order, so the first ids are the common ones: on the 0.5B draft,
        ids below 65536 cover 97-100% of our suites' English and code output tokens and
        such a head reads 43% of the whole one's bytes, but 22% of a Chinese answer's
        (hence per row: spec/draft_model.py decides by each sequence's text). The cut
        rows are views of the weights, so a tied head costs no memory. At or past the
        vocabulary's size it does nothing; asked again for the same ids, it keeps the
        head it has (and its C description)."""
        if num_token_ids < 1:
            raise ConfigError(f"draft_vocab_size must be >= 1, got {num_token_ids}")
        if self.common is not None and self.common[0] == num_token_ids:
            return
        self.common = (
            (num_token_ids, first_rows(self.lm_head, num_token_ids)) if num_token_ids < self.head_size else None
        )
        self.__dict__.pop("_in_c_common", None)  # described with the old head

    def use_torch_compile(self, required: bool = True, mode: str | None = None, options: dict | None = None) -> bool:
        """Run the PyTorch parts that touch no cache through torch.compile (inductor):
        each block's norm and qkv projection (with RoPE, for the static step of CUDA
        graphs), its o_proj, residual adds and MLP, and the head. Inductor fuses the
        norms' and activations' small ops into one loop each; attention and the cache
        stay eager. The blocks share one compiled graph per shape class (one row,
        several rows). Parts already in our C kernels (a quantized model's decode
        steps) do not change.

        Every piece is compiled here, for both shape classes, so that compiling (tens of
        seconds) happens at load rather than in a request. Where inductor cannot build
        (no C++ compiler, no Triton) the model stays uncompiled: an error naming the fix
        if `required`, else a warning. Returns whether it is compiled. mode, options:
        torch.compile's (None: its default; see `compile_methods`)."""

        def warm_up() -> None:
            cache = self.new_cache()
            self(torch.zeros(3, dtype=torch.int64, device=self.device), [Segment(cache, 3)])  # several rows
            self(torch.zeros(1, dtype=torch.int64, device=self.device), [Segment(cache, 1)])  # one row
            cos, rotated_sin = self.rope_table(2)
            with torch.inference_mode():  # as a forward runs it
                for rows in (2, 1):
                    h = torch.zeros(rows, self.config.hidden_size, dtype=self.dtype, device=self.device)
                    self.layers[0].project_rotated_qkv(h, cos[:rows], rotated_sin[:rows])

        parts = [(block, name) for block in self.layers for name in COMPILED_BLOCK_PARTS]
        self.compiled = compile_methods(
            parts + [(self, "score_every_id")], warm_up, required, mode, options
        )  # common: eager
        return self.compiled

    def use_cuda_graphs(self, num_slots: int, capacity: int, captured_bytes: int | None = None) -> None:
        """Run decode steps and verifications as CUDA graphs (model/graphs.py): every
        cache made after this is a slot of one pool of `num_slots` caches of `capacity`
        positions, allocated now (build_engine checks first that the pools fit), and the
        captured steps hold at most `captured_bytes` (graphs.CapturedSteps; None: no
        bound). On a CPU the same static steps run eagerly (no graphs exist there; tests
        use this)."""
        if self.static is not None:
            raise ConfigError("CUDA graphs are on already")
        if num_slots < 1 or capacity < 1:
            raise ConfigError(f"a cache pool needs at least one slot and position, got {num_slots} and {capacity}")
        from specserve.model.graphs import StaticDecode, decoder_step  # graphs.py builds on this module

        self.static = StaticDecode(
            self.config,
            self.dtype,
            self.device,
            num_slots,
            capacity,
            self.rope_table(capacity),
            partial(decoder_step, self),
            captured_bytes=captured_bytes,
        )

    def rope_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and rotated_sin (see apply_rope) [>= length, head_dim] in the model's
        dtype, row p for position p: computed once and grown by doubling, rather than
        a dozen small ops every step."""
        table = self._rope
        if table is None or table[0] is not self.inv_freq or table[1].shape[0] < length:
            size = max(length, 256, 2 * table[1].shape[0] if table is not None and table[0] is self.inv_freq else 0)
            positions = torch.arange(size, device=self.inv_freq.device)  # [size]
            self._rope = table = (self.inv_freq, *rope_rows(self.inv_freq, positions, self.dtype))
        return table[1], table[2]

    def model_in_c(self, common: bool = False) -> native.ModelInC | None:
        """This model described for `native.decode_blocks` and `native.speculate_greedy`
        where all of it can run there (bfloat16, every projection and the head on our
        int4/int8 or bfloat16 kernels, a head size it takes), else None; decided once,
        after loading. common: with the common head (`add_common_head`) where there
        is one."""
        if not hasattr(self, "_in_c"):
            self._in_c = self._describe_in_c(self.lm_head, self.head_size)
        if not common or self.common is None or self._in_c is None:
            return self._in_c
        if not hasattr(self, "_in_c_common"):
            self._in_c_common = self._describe_in_c(self.common[1], self.common[0])
        return self._in_c_common

    def _describe_in_c(self, head: nn.Module, head_size: int) -> native.ModelInC | None:
        config = self.config
        if (
            self.dtype != torch.bfloat16
            or self.device.type != "cpu"
            or native.library() is None
            or config.head_dim % 16
            or config.head_dim > 256
        ):
            return None

        def on_our_kernels(layer: nn.Module) -> bool:  # int4/int8, or bfloat16 (decode_blocks takes no float32)
            return (isinstance(layer, QuantizedLinear) and layer.native) or (
                isinstance(layer, FloatLinear) and layer.weight.dtype == torch.bfloat16
            )

        blocks = []
        for block in self.layers:
            attn, mlp = block.self_attn, block.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            norms = [block.input_layernorm, block.post_attention_layernorm, attn.q_norm, attn.k_norm]
            if not all(on_our_kernels(p) for p in projections) or any(
                n is not None and n.weight.dtype != torch.bfloat16 for n in norms
            ):
                return None
            blocks.append(native.BlockWeights(*[None if n is None else n.weight for n in norms], *projections))
        if not (on_our_kernels(head) and self.norm.weight.dtype == torch.bfloat16):
            return None
        shape = native.ModelShape(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            head_size,
            config.rms_norm_eps,
        )
        return native.ModelInC(blocks, self.embed_tokens.weight, self.norm.weight, head, shape)

    def pack_linear_weights(self) -> None:
        """On the CPU in float32 or bfloat16, swap every linear layer for a `FloatLinear`
        where our kernels run, else in float32 for a `PackedLinear` (see there). The
        swapped model cannot be trained or reloaded: swap last."""
        if self.device.type != "cpu":
            return
        kind = next((k for k in (FloatLinear, PackedLinear) if k.available(self.dtype)), None)
        if kind is None:
            return
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, kind(child))

    @cached_property
    def on_avx2_kernel(self) -> bool:
        """Whether layers run on our AVX2 kernel (quant.py, avx2.py). Its rows are batch
        invariant, but its int8 activations turn SDPA's rounding of a prompt chunk into
        other tokens, so there every segment attends query by query, as `Segment` says
        our C attention does elsewhere (prompts then read about 3% slower)."""
        return any(isinstance(m, QuantizedLinear) and m.avx2 for m in self.modules())

    def make_batch_invariant(self) -> None:
        """Compute every token bitwise the same whatever else shares its forward pass:
        plain decoding, the target verifying k drafts, a batch of requests, a prompt in
        chunks of any size. Measured on the 1.5B target in bfloat16 on PyTorch's GEMM:
        plain decoding about 25% slower (every call pays for 8 rows), time to the first
        token about 2.5x (prefill in 8-row calls, attention query by query); float32
        8-row calls on oneDNN cost about 1.5x one row. Our float32/bfloat16 kernel's
        rows, like the quantized ones', are independent already and are left as they are."""
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, (nn.Linear, PackedLinear)):
                    setattr(module, name, RowBlockedLinear(child))
        self.batch_invariant = True

    @classmethod
    def from_hf_weights(cls, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> Decoder:
        """Build the decoder around Hugging Face-named weights, with no random init."""
        with torch.device("meta"):
            model = cls(config)
        model.load_hf_state_dict(weights, dtype)
        return model.eval()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under Hugging Face names (what load_hf_state_dict takes): q/k/v and
        gate/up split again, a tied head left out. Views of this model's own tensors."""
        weights = {}
        for name, tensor in self.state_dict().items():
            if name == "lm_head.weight":
                if not self.config.tie_word_embeddings:
                    weights[name] = tensor
                continue
            prefix, _, kind = name.rpartition(".")  # kind: weight or bias
            if prefix.endswith("self_attn.qkv_proj"):
                attn = prefix.removesuffix("qkv_proj")
                sizes = self.layers[0].self_attn.qkv_sizes
                for p, part in zip("qkv", tensor.split(sizes)):
                    weights[f"model.{attn}{p}_proj.{kind}"] = part
            elif prefix.endswith("mlp.gate_up_proj"):
                mlp = prefix.removesuffix("gate_up_proj")
                gate, up = tensor.chunk(2)
                weights[f"model.{mlp}gate_proj.{kind}"], weights[f"model.{mlp}up_proj.{kind}"] = gate, up
            else:
                weights[f"model.{name}"] = tensor
        return weights

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Take Hugging Face-named weights, checking every name and shape, fusing q/k/v
        and gate/up. Raises ModelLoadError naming what is missing, extra or misshapen."""
        own = self.state_dict()
        fused: dict[str, torch.Tensor] = {}
        consumed: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ModelLoadError(f"checkpoint has no tensor {name!r}")
            consumed.add(name)
            return weights[name]

        for i in range(self.config.num_layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            fused[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat([take(f"{attn}.{p}_proj.weight") for p in "qkv"])
            if self.config.architecture.attention_bias:
                fused[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat([take(f"{attn}.{p}_proj.bias") for p in "qkv"])
            fused[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
                [take(f"{mlp}.gate_proj.weight"), take(f"{mlp}.up_proj.weight")]
            )
        tied = self.config.tie_word_embeddings
        for name in own:
            if name in fused or (tied and name == "lm_head.weight"):
                continue
            fused[name] = take(name if name == "lm_head.weight" else f"model.{name}")
        # Tied checkpoints sometimes still carry a copy of the head: ignore it.
        extra = set(weights) - consumed - {"lm_head.weight"}
        if extra:
            raise ModelLoadError(f"checkpoint has unexpected tensors, e.g. {sorted(extra)[:3]}")
        for name, tensor in fused.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ModelLoadError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {tuple(own[name].shape)}"
                )
            fused[name] = tensor.to(dtype).contiguous()
        self.load_state_dict(fused, strict=not tied, assign=True)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight
        self.inv_freq = rope_inverse_frequencies(self.config)  # buffers are not in the state dict
