"""The verifier: which drafted tokens the target keeps, and the one token it adds.

Row i of the target's logits predicts the token after draft[:i]; with k drafted tokens
there are k+1 rows. A step emits the accepted drafts followed by one target token: the
recovered token at the first rejection, or the bonus token from row k when all k were
accepted. So every step emits 1..k+1 tokens and k = 0 is plain sampling.

Invariants:
- Greedy (temperature 0) emits exactly the target's argmax tokens and uses no randomness.
- Otherwise the emitted tokens are distributed exactly as if sampled from the target one
  at a time (lossless rejection sampling, Leviathan et al. 2023, Chen et al. 2023),
  provided the draft tokens were sampled from `draft_probs` and both distributions went
  through the same `logits_to_probs` transform. A deterministic draft (`probs=None`) is
  a one-hot distribution on its token.
- An unseeded request's randomness comes from its generator, drawn in a fixed order (k
  uniforms, then one draw). With k = 0 the draw is the one `sampling.sample` makes.
- A seeded request is verified by `verify_keyed`: each row's own token is the target's
  draw with the keyed uniform of its position (sampling.py), the drafts up to the first
  that differs are kept, then that row's own token. Every emitted token is the target's
  draw at its position, so the output is plain sampling's, token for token, whatever was
  drafted, however many rows were verified and whatever ran beside (up to the rounding
  of a verified row against a plain step's). A draft drawn with the same uniforms
  (spec/guesses.py) is accepted nearly as often as by rejection sampling
  (benchmarks/EXPERIMENTS.md, "Seeded requests verified by keyed draws").

Bonus and recovered tokens are one case: the draft has nothing at row k, so the
residual max(0, target_probs - draft_probs) there is target_probs itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specserve.sampling import SamplingParams, logits_to_probs, sample
from specserve.spec.proposer import Draft

# Fills the batched token matrix after each sequence's emitted tokens.
PAD_TOKEN = -1

# A rejection at row i happens with probability sum(max(0, draft_probs - target_probs)),
# which equals the residual's mass. Below this mass the residual is float32 rounding
# noise; sampling from target_probs instead changes the output distribution by at most
# this much in total variation.
NEGLIGIBLE_RESIDUAL_MASS = 1e-6


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # accepted drafts, then the recovered or bonus token: 1..k+1 tokens
    num_accepted: int  # how many drafted tokens were accepted (0..k)


def verify(target_logits: torch.Tensor, draft: Draft, params: SamplingParams, generator: torch.Generator) -> Verdict:
    """One sequence's step: target_logits [k+1, V], k = draft.num_tokens (may be 0)."""
    k = draft.num_tokens
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits must be [k+1, V] = [{k + 1}, V], got {list(target_logits.shape)}")
    draft_probs = None if draft.probs is None else draft.probs.unsqueeze(0)  # [1, k, V]
    draft_tokens = draft.tokens.to(target_logits.device).unsqueeze(0)  # [1, k]
    tokens, num_accepted = verify_batch(target_logits.unsqueeze(0), draft_tokens, draft_probs, params, generator)
    accepted = int(num_accepted[0])
    return Verdict(tokens=tokens[0, : accepted + 1].tolist(), num_accepted=accepted)


def verify_keyed(target_logits: torch.Tensor, draft: Draft, params: SamplingParams, uniforms: torch.Tensor) -> Verdict:
    """A seeded request's step: target_logits [k+1, V], uniforms [k+1] the keyed draws of
    the rows' positions (see the module's docstring)."""
    own = sample(logits_to_probs(target_logits, params), uniforms=uniforms).tolist()  # [k+1]
    return verdict_from_argmax(draft.tokens.tolist(), own)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share (at most the shorter's length)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def verdict_from_argmax(drafted: list[int], target_argmax: list[int]) -> Verdict:
    """Verification where the target's own token for each of the k+1 rows is known (its
    argmax, or a seeded request's keyed draw): the drafts up to the first that differs,
    then that row's own token."""
    accepted = common_prefix_length(drafted, target_argmax)
    return Verdict(tokens=target_argmax[: accepted + 1], num_accepted=accepted)


def verify_batch(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """B sequences with the same k and one generator (tests, benchmarks).

    target_logits [B, k+1, V], draft_tokens [B, k], draft_probs [B, k, V] or None.
    Returns tokens [B, k+1] (PAD_TOKEN after each row's emitted tokens) and
    num_accepted [B]. The engine calls `verify` per sequence: each request owns its
    generator.
    """
    if params.greedy:
        return greedy_verify(target_logits, draft_tokens)
    batch, rows, vocab = target_logits.shape
    target_probs = logits_to_probs(target_logits.reshape(batch * rows, vocab), params)
    return rejection_sample(target_probs.view(batch, rows, vocab), draft_tokens, draft_probs, generator)


def greedy_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the drafts that equal the target's argmax; emit the argmax after them.

    target_logits [B, k+1, V], draft_tokens [B, k] -> tokens [B, k+1], num_accepted [B].
    """
    target_argmax = target_logits.argmax(dim=-1)  # [B, k+1]
    k = draft_tokens.shape[1]
    matches = draft_tokens == target_argmax[:, :k]  # [B, k]
    num_accepted = matches.long().cumprod(dim=1).sum(dim=1)  # [B]
    # The accepted drafts are the argmax, so the emitted tokens are its first n+1.
    return _pad_after(target_argmax, num_accepted), num_accepted


def rejection_sample(
    target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling on probabilities.

    target_probs [B, k+1, V], draft_tokens [B, k], draft_probs [B, k, V] or None
    (deterministic drafts) -> tokens [B, k+1], num_accepted [B].
    """
    batch, rows, vocab = target_probs.shape
    k = rows - 1
    if draft_tokens.shape != (batch, k):
        raise ValueError(f"draft_tokens must be [B, k] = [{batch}, {k}], got {list(draft_tokens.shape)}")
    if draft_probs is not None and draft_probs.shape != (batch, k, vocab):
        raise ValueError(f"draft_probs must be [B, k, V] = [{batch}, {k}, {vocab}], got {list(draft_probs.shape)}")
    if k == 0:  # plain sampling: the draw the general path makes, without its [B, V] passes
        return sample(target_probs[:, 0], generator).unsqueeze(1), draft_tokens.new_zeros(batch)
    seq_index = torch.arange(batch, device=target_probs.device)  # [B]

    # Accept draft x at row i with probability min(1, target_probs / draft_probs), written
    # as u * draft < target: no division, and a draft that gave x no mass (which it could
    # not have sampled) is accepted exactly when the target allows x.
    target_at_draft = target_probs[:, :k].gather(2, draft_tokens.unsqueeze(2)).squeeze(2)  # [B, k]
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)  # [B, k]
    else:
        draft_at_draft = draft_probs.gather(2, draft_tokens.unsqueeze(2)).squeeze(2)  # [B, k]
        draft_at_draft = draft_at_draft.to(target_probs.dtype)
    uniforms = torch.rand(
        (batch, k), generator=generator, dtype=target_probs.dtype, device=target_probs.device
    )  # [B, k]
    accepted = uniforms * draft_at_draft < target_at_draft  # [B, k]
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]: drafts before the first rejection

    # The row each sequence samples its own token from: the first rejection, or row k.
    target_row = target_probs[seq_index, num_accepted]  # [B, V]
    draft_row = torch.zeros_like(target_row)  # [B, V]; zero at row k, so bonus = target
    rejected_seqs = (num_accepted < k).nonzero().squeeze(1)  # [R]
    rejected_at = num_accepted[rejected_seqs]  # [R]
    if draft_probs is None:
        draft_row[rejected_seqs, draft_tokens[rejected_seqs, rejected_at]] = 1.0
    else:
        draft_row[rejected_seqs] = draft_probs[rejected_seqs, rejected_at].to(target_probs.dtype)
    residual = (target_row - draft_row).clamp_min(0)  # [B, V]
    negligible = residual.sum(dim=1, keepdim=True) <= NEGLIGIBLE_RESIDUAL_MASS  # [B, 1]
    residual = torch.where(negligible, target_row, residual)
    recovered_or_bonus = sample(residual, generator).unsqueeze(1)  # [B, 1]

    drafts_then_own = torch.cat([draft_tokens, recovered_or_bonus], dim=1)  # [B, k+1]
    tokens = drafts_then_own.scatter(1, num_accepted.unsqueeze(1), recovered_or_bonus)
    return _pad_after(tokens, num_accepted), num_accepted


def _pad_after(tokens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """tokens [B, k+1]: keep each row's first num_accepted + 1, PAD_TOKEN the rest."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)  # [k+1]
    emitted = positions.unsqueeze(0) <= num_accepted.unsqueeze(1)  # [B, k+1]
    return tokens.masked_fill(~emitted, PAD_TOKEN)
