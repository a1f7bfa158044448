"""The `logprobs` field of OpenAI responses, from the engine's `TokenLogprob`s.

Completions use the legacy shape: `tokens`, `token_logprobs`, `top_logprobs` (per
token, a {token: logprob} dict of the n most likely tokens plus the chosen one, so up
to n + 1 entries, as OpenAI and vLLM return it) and `text_offset` (where each token's
text starts in the choice's text). Chat uses `{"content": [{"token", "logprob",
"bytes", "top_logprobs": [...n]}], "refusal": null}`.

A token's text is its bytes read as UTF-8 (a byte-level token holding part of a
character shows U+FFFD there; `bytes` has the exact bytes). Every generated token is
listed, as vLLM lists them: a stop token, and tokens past a stop string, included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specserve.logprobs import TokenLogprob
from specserve.tokenizer import Tokenizer


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def completion_logprobs(entries: Sequence[TokenLogprob], tokenizer: Tokenizer, text_offset: int = 0) -> dict[str, Any]:
    """The legacy `logprobs` object of these tokens, the first at text_offset."""
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(text_offset)
        tokens.append(_text(tokenizer, entry.token_id))
        text_offset += len(tokens[-1])
    top = [
        {**{_text(tokenizer, i): lp for i, lp in entry.top}, token: entry.logprob}
        for token, entry in zip(tokens, entries)
    ]
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


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
