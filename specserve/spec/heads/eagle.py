"""The EAGLE head: one decoder layer that drafts from the target's features (EAGLE-1/2, EAGLE-3).

A head step reads pairs (feature of position p, token at position p + 1) and returns, for
each, a new feature (before any final norm) from which the head's logits guess the token
at p + 2; that feature, with the guessed token, is the next draft step's pair.

- EAGLE-1/2 (EAGLE-2 drafts a dynamic tree with the same heads): the target's feature is
  its last hidden state after its final norm, what its LM head reads. `fc` (2H -> H)
  mixes [embedding ; feature]; a Llama layer without input norm follows; the target's LM
  head scores the output as it is (no norm).
- EAGLE-3: the target's feature is the residual stream entering target layers
  `feature_layers` (vLLM's default: 2, N//2, N-3), concatenated [3H], which `fc` (3H -> H,
  no bias) projects once (`project_target_features`); the layer's q/k/v read
  [input_layernorm(embedding) ; hidden_norm(feature)] (2H) and its residual is the
  feature; then the head's own `norm` and `lm_head` over `draft_vocab_size` ids, row i
  being target id `target_ids[i]` (the checkpoint's d2t offsets added to i).

The token embedding (and EAGLE-1's LM head) are the target's, handed over by `share_target` and
never part of the head's weights. Attention numerics are the decoder's (model/decoder.py:
its Block, rotate-half RoPE, grouped-query attention, float32 RMSNorm).

Invariant: the head's `KVCache` (one layer) holds positions [0, length) of the pairs fed so
far. Rolling back is `cache.truncate`: drafted positions were computed from the head's own
features, so after verification they are truncated away and the accepted positions fed
again with the target's features (catch-up), as vLLM does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.errors import ConfigError
from specserve.model.decoder import (
    Block,
    RMSNorm,
    Segment,
    attention_backends,
    compile_methods,
    rope_inverse_frequencies,
    rope_rows,
)
from specserve.model.graphs import StaticDecode, StepInputs, StepKey, attend, step_rows
from specserve.model.kv_cache import KVCache
from specserve.model.quant import input_dtype
from specserve.spec.heads.vocab import to_target_ids, widen_to_target_vocab

EAGLE_VERSIONS = (1, 3)


def feature_layers_for(target: ModelConfig, named: Sequence[int] | None = None) -> tuple[int, ...]:
    """The target layers whose input an EAGLE-3 head reads: those its checkpoint names, else
    vLLM's choice (2, N//2, N-3). Refused where the target has no such layer."""
    layers = tuple(named or (2, target.num_layers // 2, target.num_layers - 3))
    if not all(0 <= i < target.num_layers for i in layers):
        reads = (
            f"the head reads the inputs of target layers {list(layers)}"
            if named
            else ("EAGLE-3 reads the inputs of target layers 2, N//2 and N-3")
        )
        raise ConfigError(f"{reads}; the target has {target.num_layers} layers")
    return layers


@dataclass(frozen=True)
class EagleConfig:
    version: int  # 1 (EAGLE-1/2) or 3
    layer: ModelConfig  # the head's one decoder layer: llama, num_layers 1, the target's vocab_size
    draft_vocab_size: int  # ids its logits cover: its own LM head's rows (EAGLE-3), the target's vocabulary (EAGLE-1)
    feature_layers: tuple[int, ...] = ()  # EAGLE-3: target layers whose input it reads; EAGLE-1: none
    fc_bias: bool = False  # EAGLE-1's fc carries a bias (SafeAILab's checkpoints do)
    norm_before_residual: bool = False  # EAGLE-3 variant: the residual is hidden_norm(feature)

    def __post_init__(self) -> None:
        if self.version not in EAGLE_VERSIONS:
            raise ConfigError(f"EAGLE version must be one of {EAGLE_VERSIONS}, got {self.version}")
        if self.layer.num_layers != 1:
            raise ConfigError(f"an EAGLE head has one decoder layer here, got {self.layer.num_layers}")
        if bool(self.feature_layers) != (self.version == 3):
            raise ConfigError(f"EAGLE-3 heads, and they alone, read target layers; got {self.feature_layers}")

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def target_feature_size(self) -> int:
        """Width of the target features the head reads: [3H] for EAGLE-3, [H] for EAGLE-1."""
        return len(self.feature_layers) * self.hidden_size if self.version == 3 else self.hidden_size

    @classmethod
    def for_target(cls, target: ModelConfig, version: int, draft_vocab_size: int | None = None) -> EagleConfig:
        """A new head's config: the target's attention and MLP shapes, in a Llama layer."""
        layer = dataclasses.replace(target, arch="llama", num_layers=1, tie_word_embeddings=False)
        if version == 1:  # no fc bias: vLLM's EAGLE-1 layer has none (and drops a checkpoint's)
            return cls(1, layer, target.vocab_size)
        return cls(version, layer, draft_vocab_size or target.vocab_size, feature_layers_for(target))


@dataclass(frozen=True)
class TargetWeights:
    """The target's modules a head reads without owning them."""

    embed_tokens: nn.Module  # ids [T] -> [T, H]
    lm_head: nn.Module  # [R, H] -> [R, vocab]


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        hidden, eps = config.hidden_size, config.layer.rms_norm_eps
        self.layer = Block(config.layer)
        attention = self.layer.self_attn
        if config.version == 3:
            self.fc = nn.Linear(config.target_feature_size, hidden, bias=False)
            attention.qkv_proj = nn.Linear(2 * hidden, sum(attention.qkv_sizes), bias=False)
            self.hidden_norm = RMSNorm(hidden, eps)
            self.norm = RMSNorm(hidden, eps)
            self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
            self.register_buffer("target_ids", torch.arange(config.draft_vocab_size))  # [draft_vocab] int64
        else:
            self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
            self.layer.input_layernorm = nn.Identity()  # fc's output enters attention as it is
            self.register_buffer("target_ids", None)
        self.register_buffer("inv_freq", rope_inverse_frequencies(config.layer), persistent=False)
        self.target: TargetWeights | None = None  # see share_target
        self.static: StaticDecode | None = None  # see use_cuda_graphs

    @property
    def dtype(self) -> torch.dtype:
        """Of its activations and cache (bfloat16 where its layers are quantized)."""
        return input_dtype(self.fc)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def share_target(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        """Read tokens through the target's embedding and (EAGLE-1) score with its LM head."""
        self.target = TargetWeights(embed_tokens, lm_head)

    def new_cache(self) -> KVCache:
        """An empty cache: a slot of the pool once it is used, with `use_cuda_graphs`
        (hand it back with `KVCache.release`)."""
        return KVCache(
            self.config.layer, self.dtype, self.device, pool=None if self.static is None else self.static.pool
        )

    def use_cuda_graphs(self, num_slots: int, capacity: int, captured_bytes: int | None = None) -> None:
        """Run head steps of a few pairs a sequence as CUDA graphs (model/graphs.py), as
        Decoder.use_cuda_graphs runs the target's (on a CPU the same static steps run
        eagerly: tests use this)."""
        if self.static is not None:
            raise ConfigError("CUDA graphs are on already")
        positions = torch.arange(capacity, device=self.device)  # [capacity]
        self.static = StaticDecode(
            self.config.layer,
            self.dtype,
            self.device,
            num_slots,
            capacity,
            rope_rows(self.inv_freq, positions, self.dtype),
            self.static_step,
            feature_size=self.config.hidden_size,
            captured_bytes=captured_bytes,
        )

    def static_step(self, static: StaticDecode, inputs: StepInputs, key: StepKey) -> list[torch.Tensor]:
        """`forward` with static shapes (model/graphs.py): every row's draft logits
        [B n, draft_vocab_size] float32 (with key.scored, the scored rows'), then its
        output feature [B n, H] (logits first, then features, as a decoder's static step)."""
        rows = step_rows(static, inputs, key.bucket)
        embeddings = self.target.embed_tokens(inputs.input_ids.flatten()).to(self.dtype)  # [B n, H]
        qkv, residual = self.attention_inputs(embeddings, inputs.features)
        q, k, v = self.layer.self_attn.rotated_qkv(qkv, rows.cos, rows.rotated_sin)
        hidden = self.layer.finish(residual, attend(static, 0, q, k, v, rows, inputs, key.bucket))  # [B n, H]
        return [self.draft_logits(hidden if inputs.scored is None else hidden[inputs.scored]), hidden]

    @torch.inference_mode()
    def project_target_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """The target's features [T, target_feature_size] -> the head's [T, H]: EAGLE-3's
        fc over the concatenated layer inputs; EAGLE-1 reads the target's feature as it is."""
        if self.config.version == 3:
            return self.fc(target_features.to(self.dtype))
        return target_features.to(self.dtype)

    def forward(
        self,
        token_ids: torch.Tensor,  # [T] int64: the token at position p + 1 of each pair, every segment's in order
        features: torch.Tensor,  # [T, H]: the feature of position p (project_target_features, or a head output)
        segments: list[Segment],  # per sequence: its pairs go at cache.length + i of its head cache
    ) -> torch.Tensor:  # [T, H]: each pair's output feature (before the final norm)
        return self.step(token_ids, features, segments)[0]

    @torch.inference_mode()
    def step(
        self,
        token_ids: torch.Tensor,  # [T] int64, as forward's
        features: torch.Tensor,  # [T, H], as forward's
        segments: list[Segment],
        logits_rows: torch.Tensor | None = None,  # [R]: rows whose draft logits are wanted; None: none
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [T, H] output features; [R, draft_vocab_size] float32
        """forward, and the draft logits of `logits_rows` (a captured decode step
        computes every row's in its graph; a read, and an eager step, those rows' alone)."""
        if self.target is None:
            raise RuntimeError("an EAGLE head needs the target's embedding first (share_target)")
        assert features.shape == (token_ids.shape[0], self.config.hidden_size), features.shape
        assert token_ids.shape[0] == sum(s.num_tokens for s in segments)
        for seg in segments:
            seg.cache.reserve(seg.cache.length + seg.num_tokens)
        if self.static is not None and self.static.handles(segments):
            with attention_backends(self.device):
                wanted = token_ids.new_empty(0) if logits_rows is None else logits_rows
                features = features.to(self.dtype)
                logits, hidden = self.static.run(token_ids, segments, features=features, logits_rows=wanted)
            for seg in segments:
                seg.cache.length += seg.num_tokens
            return hidden, None if logits_rows is None else logits
        hidden = self._eager_step(token_ids, features, segments)
        return hidden, None if logits_rows is None else self.draft_logits(hidden[logits_rows])

    def _eager_step(self, token_ids: torch.Tensor, features: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        positions = torch.cat(
            [torch.arange(s.cache.length, s.cache.length + s.num_tokens, device=self.device) for s in segments]
        )  # [T]
        cos, rotated_sin = rope_rows(self.inv_freq, positions, self.dtype)  # [T, head_dim]
        embeddings = self.target.embed_tokens(token_ids).to(self.dtype)  # [T, H]
        qkv, residual = self.attention_inputs(embeddings, features)
        with attention_backends(self.device):
            attended = self.layer.self_attn(qkv, cos, rotated_sin, 0, segments)  # [T, q_size]
        for seg in segments:
            seg.cache.length += seg.num_tokens
        return self.layer.finish(residual, attended)  # [T, H]

    def attention_inputs(
        self,
        embeddings: torch.Tensor,  # [..., H]: the pairs' tokens, embedded
        features: torch.Tensor,  # [..., H]: the pairs' features
    ) -> tuple[torch.Tensor, torch.Tensor]:  # qkv [..., q_size + 2 kv_size], the residual [..., H]
        """The layer's work before attention (outside inference mode: training runs it too)."""
        layer = self.layer
        if self.config.version == 3:
            normed = self.hidden_norm(features)  # [..., H]
            qkv = layer.self_attn.qkv_proj(torch.cat([layer.input_layernorm(embeddings), normed], dim=-1))
            return qkv, normed if self.config.norm_before_residual else features
        residual = self.fc(torch.cat([embeddings, features], dim=-1))  # [..., H]
        return layer.project_qkv(residual), residual

    def use_torch_compile(self, required: bool = True, mode: str | None = None, options: dict | None = None) -> bool:
        """Run the parts of a head step that touch no cache through torch.compile, as
        Decoder.use_torch_compile runs the target's: the layer's inputs and qkv with RoPE,
        its o_proj, residual and MLP, and the draft logits. Call after `share_target`
        (EAGLE-1 scores with the target's LM head). Returns whether it is compiled."""
        attention = self.layer.self_attn

        def warm_up() -> None:
            with torch.inference_mode():  # as a head step runs them
                for rows in (2, 1):
                    embeddings, features, attended = (
                        torch.zeros(rows, width, dtype=self.dtype, device=self.device)
                        for width in (self.config.hidden_size, self.config.hidden_size, attention.qkv_sizes[0])
                    )
                    qkv, residual = self.attention_inputs(embeddings, features)
                    cos, rotated_sin = rope_rows(self.inv_freq, torch.arange(rows, device=self.device), self.dtype)
                    attention.rotated_qkv(qkv, cos, rotated_sin)
                    self._draft_scores(self.layer.finish(residual, attended))

        parts = [
            (self, "attention_inputs"),
            (attention, "rotated_qkv"),
            (self.layer, "finish"),
            (self, "_draft_scores"),
        ]
        return compile_methods(parts, warm_up, required, mode, options)

    @torch.inference_mode()
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, draft_vocab_size] float32
        """Scores of the head's rows; `to_target_ids` names their target ids."""
        return self._draft_scores(hidden)

    def _draft_scores(self, hidden: torch.Tensor) -> torch.Tensor:  # draft_logits, outside inference mode
        if self.config.version == 3:
            return self.lm_head(self.norm(hidden)).float()
        if self.target is None:
            raise RuntimeError("an EAGLE-1 head needs the target's LM head first (share_target)")
        return self.target.lm_head(hidden.to(self.target.embed_tokens.weight.dtype)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Rows of `draft_logits` [...] -> target token ids [...]."""
        return to_target_ids(draft_ids, self.target_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, vocab] float32
        """Scores over the target's vocabulary, -inf at ids the head never guesses."""
        return widen_to_target_vocab(self.draft_logits(hidden), self.target_ids, self.config.layer.vocab_size)
