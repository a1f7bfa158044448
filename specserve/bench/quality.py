"""Quality checks for a weight format: perplexity on a fixed text, greedy agreement.

A cheaper format (bfloat16, int8, int4) is only worth its speed if it still says what
the float32 model says. Two figures show it: the perplexity of a fixed text (the
sonnets of `specserve.bench.suites`, so every run scores the same tokens), and how
long the greedy output stays identical to float32's on the benchmark prompts.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from specserve.bench.suites import SONNETS_PATH
from specserve.model.decoder import Decoder, Segment
from specserve.spec.verify import common_prefix_length
from specserve.tokenizer import Tokenizer

FIXED_TEXT_TOKENS = 1024


def fixed_text_ids(tokenizer: Tokenizer, num_tokens: int = FIXED_TEXT_TOKENS) -> list[int]:
    """The first `num_tokens` tokens of the sonnets: the text perplexity is measured on."""
    return tokenizer.encode(SONNETS_PATH.read_text(encoding="utf-8"))[:num_tokens]


def perplexity(decoder: Decoder, token_ids: Sequence[int], chunk: int = 512) -> float:
    """exp(mean cross-entropy of each token given those before it), the first excepted.

    The text goes through in chunks of `chunk` tokens against one cache, so a long text
    never materialises [len, vocab] logits at once; the result equals one full forward.
    """
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    ids = torch.tensor(token_ids, dtype=torch.int64, device=decoder.device)  # [N]
    cache = decoder.new_cache()
    total_nll = 0.0
    for start in range(0, len(ids) - 1, chunk):
        inputs = ids[start : start + chunk]  # [n]
        targets = ids[start + 1 : start + 1 + chunk]  # [n] or [n - 1] at the text's end
        logits = decoder(inputs, [Segment(cache, len(inputs))], logits_rows=None)  # [n, vocab]
        total_nll += F.cross_entropy(logits[: len(targets)], targets, reduction="sum").item()
    return math.exp(total_nll / (len(ids) - 1))


def prefix_agreement(reference: Sequence[int], other: Sequence[int]) -> float:
    """The share of `reference` that `other` reproduces before their first difference.

    Greedy outputs part for good at their first different token (everything after
    depends on it), so the common prefix is the fair measure, not a per-position match.
    An empty reference is matched by anything: 1.0.
    """
    if not reference:
        return 1.0
    return common_prefix_length(reference, other) / len(reference)
