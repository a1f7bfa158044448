"""Training EAGLE heads (EAGLE-3; EAGLE-1 with the same machinery): the head unrolled on its own
features over whole windows at once, EAGLE-3's "training-time test".

Unrolled step i, row t, is the chain that starts after the target's feature at position t
and has drafted i tokens: its pair is (the head's own output of step i - 1 at row t, or
the target's feature at step 0 ; the data's token at t + 1 + i), at position t + i, and it
guesses the token at t + 2 + i. Its query attends to what the head's cache would hold
when drafting: the step-0 keys of positions 0..t (pairs read from the target's features)
and its own chain's keys of steps 1..i (the diagonal of each later step). RoPE positions
are the ones drafting uses, so the trained head is the head that drafts.

- EAGLE-3: fc over the three captured layers, the layer, the head's norm and its LM head
  over the draft vocabulary (rows initialised from the target's); soft cross-entropy.
  Its layer starts from the target's last decoder layer where `start_from_target_layer`
  is applied (train-head's default): a layer that already reads such features.
- EAGLE-1: fc over [embedding ; final feature], and the target's LM head (frozen; its
  draft-vocabulary rows in training): SmoothL1 towards the target's next feature plus
  0.1 x the soft cross-entropy (EAGLE's weights), both over the unrolled steps.

The token embedding is the target's, frozen: never part of the head's parameters.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import ModelConfig
from specserve.model.decoder import linear_of, rope_rows
from specserve.spec.heads.eagle import EagleConfig, EagleHead, feature_layers_for
from specserve.train.features import FeatureSpec
from specserve.train.objective import STEP_WEIGHT_DECAY, Batch, DraftVocab, Figures, shifted, step_objective

EAGLE1_TOKEN_LOSS_WEIGHT = 0.1


class EagleMethod:
    def __init__(self, version: int, ttt_length: int, intermediate_size: int | None = None):
        self.version = version
        self.name = "eagle3" if version == 3 else "eagle"
        self.num_steps = ttt_length  # unrolled steps, each reported
        self.intermediate_size = intermediate_size  # the head's MLP; None: the target's

    def feature_spec(self, target: ModelConfig) -> FeatureSpec:
        return FeatureSpec(layers=feature_layers_for(target)) if self.version == 3 else FeatureSpec(final=True)

    def new_head(
        self, target: ModelConfig, embed_tokens: nn.Module, vocab: DraftVocab, lm_head_rows: torch.Tensor
    ) -> EagleHead:  # lm_head_rows [draft_vocab, H]: the target's
        config = EagleConfig.for_target(target, self.version, len(vocab.target_ids))
        if self.intermediate_size is not None:
            config = dataclasses.replace(
                config, layer=dataclasses.replace(config.layer, intermediate_size=self.intermediate_size)
            )
        head = EagleHead(config)
        frozen_rows = linear_of(lm_head_rows.float().clone(), None)  # EAGLE-1 scores with the target's head
        head.share_target(embed_tokens, frozen_rows)
        if self.version == 3:
            with torch.no_grad():
                head.lm_head.weight.copy_(lm_head_rows)
                head.target_ids.copy_(vocab.target_ids)
        return head

    def objective(self, head: EagleHead, batch: Batch, vocab: DraftVocab) -> Figures:
        hidden = unrolled(head, batch, self.num_steps)  # per step [B, T, H]
        if self.version == 3:
            return step_objective((head.lm_head(head.norm(h)) for h in hidden), batch, vocab)
        figures = step_objective((head.target.lm_head(h) for h in hidden), batch, vocab)
        feature_loss = sum(
            STEP_WEIGHT_DECAY**i * feature_error(h, shifted(batch.features, 1 + i), shifted(batch.trained, 1 + i))
            for i, h in enumerate(hidden)
        )
        figures.loss = feature_loss + EAGLE1_TOKEN_LOSS_WEIGHT * figures.loss
        return figures


@torch.no_grad()
def start_from_target_layer(
    head: EagleHead, read: Callable[[str], torch.Tensor], layer: int, strongest_neurons: bool = False
) -> None:
    """An EAGLE-3 head's layer set to the target's decoder layer `layer` (train-head: the
    last), `read(name)` giving the target's float weights by their Hugging Face names:
    the hidden half of qkv (the embedding's half keeps its random start) and o_proj, as
    many of the target's MLP neurons as the head's MLP holds (the first, or with
    `strongest_neurons` those of the largest weight norms), the norms (hidden_norm
    the layer's input norm, the head's norm the target's final one), and fc passing the
    last captured layer through. Biases the target's q/k/v carry are dropped: the head's
    Llama layer has none."""
    if head.config.version != 3:
        raise ValueError("only an EAGLE-3 head's layer starts from the target's")
    prefix = f"model.layers.{layer}."
    hidden = head.config.hidden_size
    attention, mlp = head.layer.self_attn, head.layer.mlp
    qkv = torch.cat([read(f"{prefix}self_attn.{p}_proj.weight") for p in "qkv"])  # [q + 2 kv, H]
    attention.qkv_proj.weight[:, hidden:].copy_(qkv)  # of [q + 2 kv, 2H]: [embedding ; feature]
    attention.o_proj.weight.copy_(read(prefix + "self_attn.o_proj.weight"))
    gate, up, down = (read(f"{prefix}mlp.{p}_proj.weight") for p in ("gate", "up", "down"))
    width = mlp.down_proj.in_features  # the head's neurons: gate rows [0, width), up rows [width, 2 width)
    neurons = min(width, down.shape[1])
    kept = torch.arange(neurons)  # [neurons] of the target's
    if strongest_neurons:
        strength = gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)  # [target's neurons]
        kept = strength.topk(neurons).indices.sort().values
    mlp.gate_up_proj.weight[:neurons].copy_(gate[kept])
    mlp.gate_up_proj.weight[width : width + neurons].copy_(up[kept])
    mlp.down_proj.weight[:, :neurons].copy_(down[:, kept])
    head.hidden_norm.weight.copy_(read(prefix + "input_layernorm.weight"))
    head.layer.post_attention_layernorm.weight.copy_(read(prefix + "post_attention_layernorm.weight"))
    head.norm.weight.copy_(read("model.norm.weight"))
    head.fc.weight.zero_()
    head.fc.weight[:, -hidden:].copy_(torch.eye(hidden))  # [H, 3H]: the last captured layer


def feature_error(predicted: torch.Tensor, wanted: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """SmoothL1 between [B, T, H] features over the chosen [B, T] rows."""
    return F.smooth_l1_loss(predicted[rows].float(), wanted[rows].float()) if rows.any() else predicted.sum() * 0


def unrolled(head: EagleHead, batch: Batch, num_steps: int) -> list[torch.Tensor]:  # per step [B, T, H]
    batch_size, length = batch.token_ids.shape
    attention = head.layer.self_attn
    features = batch.features.to(head.dtype)  # [B, T, F]
    hidden = head.fc(features) if head.config.version == 3 else features  # [B, T, H]
    keys, values, outputs = [], [], []  # per step: [B, kv_heads, T, head_dim]
    for i in range(num_steps):
        with torch.no_grad():  # the target's embedding stays as it is
            embeddings = head.target.embed_tokens(shifted(batch.token_ids, 1 + i)).to(head.dtype)  # [B, T, H]
        qkv, residual = head.attention_inputs(embeddings, hidden)  # [B, T, q_size + 2 kv_size], [B, T, H]
        positions = torch.arange(length, device=features.device) + i  # [T]
        cos, rotated_sin = rope_rows(head.inv_freq, positions, head.dtype)  # [T, head_dim]
        q, k, v = attention.rotated_qkv(qkv.flatten(0, 1), cos.repeat(batch_size, 1), rotated_sin.repeat(batch_size, 1))
        q, k, v = (x.unflatten(0, (batch_size, length)).transpose(1, 2) for x in (q, k, v))  # [B, heads, T, head_dim]
        keys.append(k)
        values.append(v)
        attended = chain_attention(q, keys, values)  # [B, T, heads * head_dim]
        hidden = head.layer.finish(residual, attended)  # [B, T, H]
        outputs.append(hidden)
    return outputs


def chain_attention(
    q: torch.Tensor,  # [B, heads, T, D]: step i's queries
    keys: list[torch.Tensor],  # steps 0..i, each [B, kv_heads, T, D]
    values: list[torch.Tensor],
) -> torch.Tensor:  # [B, T, heads * D]
    """Row t attends causally to step 0's keys and to its own row of every later step."""
    batch_size, heads, length, dim = q.shape
    kv_heads = keys[0].shape[1]
    grouped = q.unflatten(1, (kv_heads, heads // kv_heads))  # [B, kv_heads, group, T, D]
    scale = 1 / math.sqrt(dim)
    first = torch.einsum("bkgtd,bksd->bkgts", grouped, keys[0]) * scale  # [B, kv_heads, group, T, T]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    first = first.masked_fill(~causal, float("-inf"))
    own = [(grouped * k[:, :, None]).sum(-1, keepdim=True) * scale for k in keys[1:]]  # each [B, kv, group, T, 1]
    weights = torch.cat([first, *own], dim=-1).float().softmax(-1).to(q.dtype)  # [B, kv, group, T, T + i]
    out = torch.einsum("bkgts,bksd->bkgtd", weights[..., :length], values[0])  # [B, kv_heads, group, T, D]
    for j, v in enumerate(values[1:]):
        out = out + weights[..., length + j, None] * v[:, :, None]
    return out.flatten(1, 2).transpose(1, 2).flatten(2)  # [B, T, heads * D]
