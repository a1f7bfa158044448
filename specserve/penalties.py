"""Logit bias, repetition, frequency and presence penalties on the target's logits,
row by row.

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
(OpenAI's definitions). A request's logit bias (OpenAI's) is added before them, as
vLLM adds it; it reads no text, so every row gets the same, as do its allowed ids
(vLLM's allowed_token_ids: every other id gets no probability). Then vLLM's bad
words: a word's last id gets none where the output before the row ends with its other
ids. Last, a structured output's guide leaves only the ids that keep the text on its
pattern, row i's after the output and drafts[:i] (specserve/structured/guide.py).
Logprobs stay the raw ones (specserve/logprobs.py).

Proposers penalise their guesses the same way (spec/guesses.py, with the step's
earlier guesses counted), so they guess what the penalised target will choose; any
draft distribution would be lossless, this one is accepted more often (int4 pair,
`code`, repetition 1.15 and frequency 0.2, k = 7: acceptance 0.705 -> 0.87).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from specserve.sampling import FLOAT32_MAX, SamplingParams
from specserve.structured.guide import guided_rows


def distinct_ids(ids: Sequence[int]) -> torch.Tensor:
    """ids' distinct values [U] int64 on the CPU, ascending: all a penalty needs of a
    prompt (the repetition penalty asks only whether an id occurs in it). A sequence
    keeps its prompt's (`Sequence.prompt_distinct_ids`), so that a long prompt is not
    read again at every row a step penalises (32k ids: ~4 ms a call)."""
    return torch.unique(torch.tensor(list(ids), dtype=torch.int64))


def processed_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int] | torch.Tensor,  # a tensor: `distinct_ids` of the prompt
    output_ids: Sequence[int],
    drafts: Sequence[int],
    stop_ids: Collection[int],
) -> torch.Tensor:
    """logits [k+1, V] -> [k+1, V] float32 (a copy) as the request samples from them, row i
    scoring output token len(output_ids) + i: biased (`biased`), penalised
    (`apply_penalties`), every id but the allowed ones given no probability
    (`allowed_only`), on the rows before the min_tokens-th output token the stop
    ids (EOS and the request's own) given none, as vLLM's min_tokens does, and with a
    guide every id that would leave its pattern given none (a row that would keep
    none stays as it was)."""
    if params.logit_bias:
        logits = biased(logits, params.logit_bias)
    if params.penalized:
        out = apply_penalties(logits, params, prompt_ids, output_ids, drafts)
    else:
        out = logits.to(torch.float32, copy=not params.logit_bias)
    if params.allowed_token_ids:
        out = allowed_only(out, params.allowed_ids)
    early_rows = params.min_tokens - len(output_ids)
    if early_rows > 0:
        masked = [i for i in stop_ids if i < out.shape[-1]]
        out[:early_rows, masked] = float("-inf")
    if params.bad_words_ids:
        out = without_bad_words(out, params, output_ids, drafts)
    if params.guide is not None:
        on_pattern = guided_rows(params.guide, output_ids, drafts, stop_ids, out.shape[-1]).to(out.device)
        out = kept_where_any(out, out.masked_fill(~on_pattern, float("-inf")))
    return out


def without_bad_words(
    scores: torch.Tensor, params: SamplingParams, output_ids: Sequence[int], drafts: Sequence[int]
) -> torch.Tensor:
    """scores [k+1, V] with, on row i, the last id of every bad word whose other ids end
    output_ids + drafts[:i] given no probability (vLLM's bad_words; a row that would keep
    none stays as it was)."""
    text = [*output_ids, *drafts]
    end = len(output_ids)
    banned_rows, banned_ids = [], []
    for row in range(scores.shape[0]):
        for length, prefixes in params.bad_words_by_prefix.items():
            if length > end + row:
                continue
            for token in prefixes.get(tuple(text[end + row - length : end + row]), ()):
                if token < scores.shape[-1]:
                    banned_rows.append(row)
                    banned_ids.append(token)
    if not banned_rows:
        return scores
    masked = scores.clone()
    masked[banned_rows, banned_ids] = float("-inf")
    return kept_where_any(scores, masked)


def allowed_only(scores: torch.Tensor, allowed_ids: torch.Tensor) -> torch.Tensor:
    """scores [n, V] float32 -> [n, V] with every id but allowed_ids [A] given no
    probability. A row that would keep none (a proposer's narrower or widened head, where
    the allowed ids are not its own) is left as it is: its guesses go to the target,
    whose rows always keep some."""
    allowed = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)  # [V]
    allowed[allowed_ids[allowed_ids < scores.shape[-1]].to(scores.device)] = True
    return kept_where_any(scores, scores.masked_fill(~allowed, float("-inf")))


def kept_where_any(scores: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """masked [n, V], except its rows left with nothing but -inf, which stay scores' [n, V].
    One reduction a row and no read back, so it runs inside a CUDA graph too."""
    emptied = masked.amax(dim=-1, keepdim=True) == float("-inf")  # [n, 1]
    return torch.where(emptied, scores, masked)


def biased(logits: torch.Tensor, logit_bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """logits [n, V] -> float32 [n, V] (a copy) with each (id, bias) pair's bias added to
    that id's logit in every row; ids past V (a narrower head's) are left out."""
    width = logits.shape[-1]
    ids = torch.tensor([i for i, _ in logit_bias if i < width], dtype=torch.int64, device=logits.device)
    values = torch.tensor([b for i, b in logit_bias if i < width], dtype=torch.float32, device=logits.device)
    out = logits.to(torch.float32, copy=True)
    out[:, ids] += values
    return out


def apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int] | torch.Tensor,  # a tensor: `distinct_ids` of the prompt
    output_ids: Sequence[int],
    drafts: Sequence[int],
) -> torch.Tensor:
    """logits [k+1, V] -> penalised logits [k+1, V] float32 (a copy), row i conditioned
    on output_ids + drafts[:i] (k = len(drafts))."""
    rows = logits.shape[0]
    device = logits.device
    if not isinstance(prompt_ids, torch.Tensor):
        prompt_ids = distinct_ids(prompt_ids)
    # Only the ids in the text move, so the work is over those U ids, not the vocabulary
    # (the dense way took ~14 ms a step at 8 rows of 151936 ids on 2 cores).
    ids, in_prompt, emitted, draft_index = counted_text(prompt_ids, output_ids, drafts, device)
    counts = emitted.unsqueeze(0).repeat(rows, 1)  # [k+1, U]: output counts before each row
    if drafts:
        one_hot = torch.zeros(rows, len(ids), device=device)
        one_hot[torch.arange(1, rows, device=device), draft_index] = 1.0  # row i+1 saw draft i
        counts += one_hot.cumsum(dim=0)
    penalties = (params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
    out = logits.to(torch.float32, copy=True)  # the raw logits stay as they are, for logprobs
    out[:, ids] = penalised(logits[:, ids].float(), counts, in_prompt.unsqueeze(0), *penalties)
    return out


def counted_text(
    prompt_ids: torch.Tensor,  # [P] int64: `distinct_ids` of the prompt
    output_ids: Sequence[int],
    drafts: Sequence[int] = (),
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct ids of a text [U] int64, ascending; whether each is in the prompt
    [U] bool; how often the output holds each [U] float32; and each draft's index into
    the ids [len(drafts)]: all the penalties read of it."""
    generated = torch.tensor([*output_ids, *drafts], dtype=torch.int64, device="cpu")
    text = torch.cat([prompt_ids, generated]).to(device)
    ids, where = torch.unique(text, return_inverse=True)  # [U], [len(text)]: each token's index into ids
    num_prompt, num_output = len(prompt_ids), len(output_ids)
    emitted = torch.zeros(len(ids), device=device).index_add_(
        0, where[num_prompt : num_prompt + num_output], torch.ones(num_output, device=device)
    )  # [U]
    in_prompt = torch.zeros(len(ids), dtype=torch.bool, device=device)
    in_prompt[where[:num_prompt]] = True
    return ids, in_prompt, emitted, where[num_prompt + num_output :]


def penalised(
    scores: torch.Tensor,  # float32, any shape
    counts: torch.Tensor,  # float32, as scores: each id's count in the output before the row
    in_prompt: torch.Tensor,  # bool, broadcast to scores
    repetition: float | torch.Tensor,  # a number, or a tensor broadcast to scores (1: off)
    frequency: float | torch.Tensor,  # (0: off)
    presence: float | torch.Tensor,  # (0: off)
) -> torch.Tensor:
    """The penalties' arithmetic, element by element: `apply_penalties` over the ids of a
    text, and a multi-step chain over the whole vocabulary (model/graphs.py)."""
    seen = in_prompt | (counts > 0)
    scores = torch.where(seen, torch.where(scores > 0, scores / repetition, scores * repetition), scores)
    scores = scores - frequency * counts - presence * (counts > 0).float()
    # A logit divided by a tiny repetition penalty overflows: keep it finite, so the
    # sampler's shift by the row's largest logit never computes inf - inf.
    return scores.clamp(-FLOAT32_MAX, FLOAT32_MAX)
