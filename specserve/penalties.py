"""Repetition, frequency and presence penalties on the target's logits, row by row.

A penalty makes a token's logit depend on the text before it, so under speculation
the row that scores the token after the i-th draft is penalised as if the drafts
before it had been emitted already: the output tokens so far plus drafts[:i]. With
each row so conditioned, the verifier's target distribution at every row is the one
plain sampling with penalties would draw from, and speculation stays lossless (the
greedy argmax is the penalised argmax).

As vLLM applies them (and in its order): the repetition penalty (Keskar et al. 2019;
1 = off) divides a positive logit and multiplies a negative one, for every token that
occurs in the prompt or the output; then the frequency penalty is subtracted once per
occurrence in the output, and the presence penalty once for any occurrence there
(OpenAI's definitions). Logprobs stay the raw ones (specserve/logprobs.py).

The draft proposes from its own unpenalised logits: any draft distribution is lossless,
so penalties only cost acceptance, which adaptive k sees.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.sampling import SamplingParams


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int], drafts: Sequence[int]) -> torch.Tensor:
    """logits [k+1, V] -> penalised logits [k+1, V] float32, row i conditioned on
    output_ids + drafts[:i] (k = len(drafts))."""
    rows, vocab = logits.shape
    device = logits.device
    # Output counts for every row: the emitted tokens, then each row one draft more.
    emitted = torch.bincount(torch.tensor(list(output_ids), dtype=torch.int64, device=device), minlength=vocab)  # [V]
    counts = emitted.unsqueeze(0).repeat(rows, 1).float()  # [k+1, V]
    if drafts:
        draft_ids = torch.tensor(list(drafts), dtype=torch.int64, device=device)  # [k]
        one_hot = torch.zeros(rows, vocab, device=device)
        one_hot[torch.arange(1, rows, device=device), draft_ids] = 1.0  # row i+1 has seen draft i
        counts += one_hot.cumsum(dim=0)
    logits = logits.float()
    if params.repetition_penalty != 1.0:
        in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        in_prompt[torch.tensor(list(prompt_ids), dtype=torch.int64, device=device)] = True
        seen = in_prompt.unsqueeze(0) | (counts > 0)  # [k+1, V]
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
