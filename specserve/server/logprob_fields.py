"""The `logprobs` field of OpenAI responses, from the engine's `TokenLogprob`s.

Completions use the legacy shape: `tokens`, `token_logprobs`, `top_logprobs` (per
token, a {token: logprob} dict of the n most likely tokens plus the chosen one, so up
to n + 1 entries, as OpenAI and vLLM return it) and `text_offset` (where each token's
text starts in the choice's text). Chat uses `{"content": [{"token", "logprob",
"bytes", "top_logprobs": [...n]}], "refusal": null}`. With echo, the legacy shape lists
the prompt's tokens first, the first of them with a null logprob and null alternatives
(no row predicts it), as OpenAI did.

vLLM's `prompt_logprobs`: per prompt token, null for the first, then {token id: {"logprob",
"rank", "decoded_token"}} of the token and its n likeliest alternatives.

A token's text is its bytes read as UTF-8 (a byte-level token holding part of a
character shows U+FFFD there; `bytes` has the exact bytes). Every generated token is
listed, as vLLM lists them: a stop token, and tokens past a stop string, included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from specserve.logprobs import TokenLogprob
from specserve.tokenizer import Tokenizer


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def completion_logprobs(
    entries: Sequence[TokenLogprob | int], tokenizer: Tokenizer, text_offset: int = 0
) -> dict[str, Any]:
    """The legacy `logprobs` object of these tokens, the first at text_offset; an int
    entry is a token with no logprob (a prompt's first)."""
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(text_offset)
        tokens.append(_text(tokenizer, entry if isinstance(entry, int) else entry.token_id))
        text_offset += len(tokens[-1])
    top = [
        None if isinstance(entry, int) else {**{_text(tokenizer, i): lp for i, lp in entry.top}, token: entry.logprob}
        for token, entry in zip(tokens, entries)
    ]
    return {
        "tokens": tokens,
        "token_logprobs": [None if isinstance(e, int) else e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def echoed_entries(
    prompt_ids: Sequence[int], prompt_logprobs: Sequence[TokenLogprob], num_top: int
) -> list[TokenLogprob | int]:
    """A prompt's tokens as `completion_logprobs` lists them under echo: the first
    unscored, the others with their num_top likeliest alternatives (the engine may have
    computed more for `prompt_logprobs`)."""
    return [prompt_ids[0], *(dataclasses.replace(e, top=e.top[:num_top]) for e in prompt_logprobs)]


def prompt_logprobs_field(
    entries: Sequence[TokenLogprob], tokenizer: Tokenizer, num_top: int
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` of a prompt whose later tokens have these entries: null
    for the first (no row predicts it), then each token with its rank and its num_top
    likeliest alternatives, ranked 1, 2, ..."""

    def ranked(token_id: int, logprob: float, rank: int | None) -> tuple[str, dict[str, Any]]:
        return str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": _text(tokenizer, token_id)}

    return [None] + [
        dict(
            [ranked(e.token_id, e.logprob, e.rank)]
            + [ranked(i, lp, rank) for rank, (i, lp) in enumerate(e.top[:num_top], start=1) if i != e.token_id]
        )
        for e in entries
    ]


def chat_logprobs(entries: Sequence[TokenLogprob], tokenizer: Tokenizer) -> dict[str, Any]:
    """The chat `logprobs` object of these tokens."""

    def described(token_id: int, logprob: float) -> dict[str, Any]:
        raw = tokenizer.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [
            {**described(e.token_id, e.logprob), "top_logprobs": [described(i, lp) for i, lp in e.top]} for e in entries
        ],
        "refusal": None,
    }
