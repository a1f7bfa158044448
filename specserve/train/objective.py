"""What every head is trained against: the target's distribution over a draft vocabulary, step by step.

A training batch is windows of positions [B, T]. A head's step i (an EAGLE head unrolled
on its own features, or Medusa's head i) guesses, at row t, the token at t + 2 + i: the
target's distribution for it sits at position t + 1 + i (`shifted(x, 1 + i)`). Step
losses are soft cross-entropies against that distribution restricted to the draft
vocabulary and renormalised (SpecForge's recipe), over the rows whose token is trained
and whose target top-1 the draft vocabulary holds, weighted 0.8^i. Agreement, the
figure reported, is the head's top-1 equal to the target's over every trained row, the
rows the draft vocabulary cannot answer included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.nn.functional as F

STEP_WEIGHT_DECAY = 0.8  # step i's loss weighs 0.8^i (EAGLE-3's training-time test, Medusa's lambda)


@dataclass(frozen=True)
class DraftVocab:
    """The target ids a head scores: row i of its LM head is target id `target_ids[i]`."""

    target_ids: torch.Tensor  # [draft_vocab] int64, ascending
    row_of: torch.Tensor  # [vocab] int64: the row of a target id, -1 where the head has none

    @classmethod
    def most_frequent(cls, token_counts: torch.Tensor, size: int) -> DraftVocab:
        """The `size` ids counted most often (ties and unseen ids: lower ids first, which
        byte-pair vocabularies give to commoner tokens)."""
        vocab = token_counts.shape[0]
        size = min(size, vocab)
        target_ids = torch.sort(-token_counts, stable=True).indices[:size].sort().values  # [size]
        row_of = torch.full((vocab,), -1, dtype=torch.int64)
        row_of[target_ids] = torch.arange(size)
        return cls(target_ids, row_of)

    def to(self, device: torch.device) -> DraftVocab:
        return DraftVocab(self.target_ids.to(device), self.row_of.to(device))


@dataclass
class Batch:
    """Windows of the feature set, padded on the right to one length."""

    token_ids: torch.Tensor  # [B, T] int64
    features: torch.Tensor  # [B, T, F] bfloat16
    top_ids: torch.Tensor  # [B, T, k] int64: the target's likeliest ids for the token after each position
    top_probs: torch.Tensor  # [B, T, k] float32
    trained: torch.Tensor  # [B, T] bool: the token after the position is trained; False on padding

    def to(self, device: torch.device) -> Batch:
        return Batch(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


def shifted(x: torch.Tensor, by: int) -> torch.Tensor:
    """[B, T, ...] -> [B, T, ...] whose row t holds x's row t + by (zeros past the end)."""
    out = torch.zeros_like(x)
    out[:, : max(x.shape[1] - by, 0)] = x[:, by:]
    return out


@dataclass
class Figures:
    """A batch's weighted loss and, per step, the rows where the head's top-1 was the target's."""

    loss: torch.Tensor  # scalar
    correct: list[int] = field(default_factory=list)
    counted: list[int] = field(default_factory=list)


def step_objective(step_logits: Iterable[torch.Tensor], batch: Batch, vocab: DraftVocab) -> Figures:
    """step_logits: per step, [B, T, draft_vocab] scores of the head's rows."""
    terms, correct, counted = [], [], []
    for i, logits in enumerate(step_logits):
        top_ids, top_probs = shifted(batch.top_ids, 1 + i), shifted(batch.top_probs, 1 + i)  # [B, T, k]
        trained = shifted(batch.trained, 1 + i)  # [B, T]
        rows = vocab.row_of[top_ids]  # [B, T, k]
        probs = top_probs * (rows >= 0)
        answerable = trained & (rows[..., 0] >= 0) & (probs.sum(-1) > 0)  # [B, T]
        probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12)  # renormalised over the draft vocabulary
        log_probs = F.log_softmax(logits.float(), dim=-1)  # [B, T, draft_vocab]
        cross_entropy = -(probs * log_probs.gather(-1, rows.clamp_min(0))).sum(-1)  # [B, T]
        terms.append(STEP_WEIGHT_DECAY**i * cross_entropy[answerable].sum() / answerable.sum().clamp_min(1))
        guessed = vocab.target_ids[logits.argmax(-1)]  # [B, T] target ids
        correct.append(int((guessed == top_ids[..., 0])[trained].sum()))
        counted.append(int(trained.sum()))
    return Figures(torch.stack(terms).sum(), correct, counted)


def estimated_acceptance_length(agreement: list[float]) -> float:
    """Mean acceptance length (1 + accepted per step) of a chain drafting len(agreement)
    tokens, were step i accepted with probability agreement[i] once the ones before were:
    1 + a1 + a1 a2 + ..."""
    length, chained = 1.0, 1.0
    for a in agreement:
        chained *= a
        length += chained
    return length
