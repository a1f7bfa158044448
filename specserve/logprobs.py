"""Log probabilities of emitted tokens, as the OpenAI API's `logprobs` returns them.

What a logprob is here: the log-softmax of the target's raw logits at the token's
position, before temperature, min-p, top-k and top-p (vLLM's default, "raw logprobs"),
so the figure describes the model, not the sampling settings. It comes from the very
rows the verifier reads: a step's row i scores the token after the sequence's newest
token and its first i drafts, and the step's i-th emitted token (accepted, recovered or
bonus alike) is the one that row predicts. So a request's logprobs are the target's own with
speculation on or off; on our CPU kernels, which compute a verified row exactly as a
plain step computes it, bit for bit.

Invariant: `Sequence.logprobs` holds one `TokenLogprob` per output token, in order.

A prompt's logprobs (vLLM's `prompt_logprobs`, the completions API's echo with logprobs)
are the same figure for each prompt token after the first, from the row of the token
before it, read as the prompt is prefilled; they also carry the token's rank.
`Sequence.prompt_logprobs` holds them in order, one per prompt token from the second.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The most alternatives a request may ask for at each position (vLLM's default
# --max-logprobs; OpenAI's chat API allows 20 too).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely ids and their logprobs, most likely first
    rank: int | None = None  # 1 + how many ids are likelier; set for a prompt's tokens alone


def logprobs_on_device(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [n, V] and token_ids [n] (row i's token) -> on the logits' device, each
    row's token's logprob [n], and its num_top likeliest ids' logprobs [n, num_top]
    and ids [n, num_top]: the one computation behind every logprob, a host step's
    (`token_logprobs`) and a chain's (model/graphs.py, inside its graph)."""
    logprobs = logits.float().log_softmax(dim=-1)  # [n, V]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [n]
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], logprobs[:, :0].long())
    return chosen, top_values, top_ids


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: int, ranked: bool = False
) -> list[TokenLogprob]:
    """logits [n, V] (row i predicts token_ids[i]; n >= len(token_ids)) -> one
    TokenLogprob per token, with its num_top most likely alternatives, and its rank
    where `ranked`."""
    logits = logits[: len(token_ids)]
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    chosen, top_values, top_ids = logprobs_on_device(logits, ids, num_top)
    # Likelier ids by the raw logits, whose order the log-softmax keeps: no second [n, V] pass.
    likelier = (logits > logits.gather(1, ids.unsqueeze(1))).sum(dim=-1) if ranked else None  # [n]
    # One copy to the host for the whole step, not a sync per token.
    chosen, top_values, top_ids = chosen.tolist(), top_values.tolist(), top_ids.long().tolist()
    ranks = [None] * len(token_ids) if likelier is None else [n + 1 for n in likelier.tolist()]
    return [
        TokenLogprob(token_id, value, tuple(zip(ids, values)), rank)
        for token_id, value, ids, values, rank in zip(token_ids, chosen, top_ids, top_values, ranks)
    ]
