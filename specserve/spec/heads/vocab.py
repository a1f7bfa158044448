"""Heads that score a subset of the target's vocabulary, and the way back to target ids.

An EAGLE-3 head scores its `draft_vocab_size` most frequent ids (d2t), a Medusa head of
vLLM's layout the ids of its `token_map`: in both, row i of the head's LM head is target id
`target_ids[i]`. `target_ids` None means the head scores every target id, in order.
Invariant: `target_ids` holds distinct ids below the target's vocabulary size (checked at
load, layouts.py), so widening never writes one column twice.
"""

from __future__ import annotations

import torch


def to_target_ids(draft_ids: torch.Tensor, target_ids: torch.Tensor | None) -> torch.Tensor:
    """Ids of the head's rows [...] -> the target's ids [...]."""
    return draft_ids if target_ids is None else target_ids[draft_ids]


def widen_to_target_vocab(
    draft_logits: torch.Tensor,  # [..., width]: scores of the head's rows
    target_ids: torch.Tensor | None,  # [width] int64, or None: the rows are target ids 0..width-1
    vocab_size: int,
) -> torch.Tensor:  # [..., vocab_size] float32, -inf at the ids the head never guesses
    if target_ids is None:
        return draft_logits.float()
    logits = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"), dtype=torch.float32)
    logits[..., target_ids] = draft_logits.float()
    return logits
