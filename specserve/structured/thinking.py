"""A structure that starts once a thinking model's reasoning ends (`--reasoning-parser`).

A guided answer of a thinking model (server/reasoning.py) may think first: its
`<think>` block is free text, and the structure (a `Guide` or `NestedGuide`, the
"inner" guide) holds from the first character after `</think>` on, as vLLM guides a
reasoning model's answer. `ThinkingFirst` wraps the inner guide with these phases:

- before the block (an answer the prompt did not start inside it): the first token
  either is `<think>` itself (Qwen3 writes it as one token), which opens the block, or
  begins the structure;
- in the block: any text, tracking how much of `</think>` its end has written; a token
  that completes `</think>` and writes more after it is not allowed, so the structure
  starts exactly at a token's start;
- after the block: the inner guide's states, as they are.

States: the inner guide's (ints >= 0, its dead state among them), BEFORE (-1), and
INSIDE - m (m = 0..7 characters of `</think>` written). The masks of the block depend on
the vocabulary alone (`BlockMasks`, one per vocabulary).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

import numpy as np
import torch

from specserve.structured.guide import GuideVocabulary
from specserve.structured.nested import MAX_CACHED_STEPS

THINK_START, THINK_END = "<think>", "</think>"  # a thinking model's block (server/reasoning.py)
BEFORE, INSIDE = -1, -2
_CLOSED, _PAST = len(THINK_END), len(THINK_END) + 1  # the tag just completed; text after it


class InnerGuide(Protocol):
    @property
    def start(self) -> int: ...
    def step(self, state: int, token_id: int) -> int: ...
    def state_after(self, token_ids: Sequence[int], state: int = ...) -> int: ...  # from the start by default
    def accepts(self, state: int) -> bool: ...
    def allowed(self, state: int, stop_ids: Collection[int]) -> torch.Tensor: ...


def _tag_step(written: int, char: str) -> int:
    """How much of THINK_END is written after one more character (its characters are all
    different, so a mismatch goes back to nothing, or to one where it is '<')."""
    if written >= _CLOSED:
        return _PAST
    if char == THINK_END[written]:
        return written + 1
    return 1 if char == THINK_END[0] else 0


class BlockMasks:
    """For one vocabulary: which tokens may come inside a think block, having written m
    characters of `</think>`, and what each such token leaves written."""

    def __init__(self, vocabulary: GuideVocabulary):
        self.vocabulary = vocabulary
        self.opening_ids = frozenset(i for i, text in enumerate(vocabulary.texts) if text == THINK_START)
        # [alphabet] -> its class: a character of THINK_END by position, or len(THINK_END) for any other.
        tag = {char: n for n, char in enumerate(THINK_END)}
        classes = np.array([tag.get(chr(int(cp)), len(THINK_END)) for cp in vocabulary.alphabet], dtype=np.int8)
        self._columns = tuple(classes[column] for column in vocabulary.columns)  # as GuideVocabulary.columns
        # [written 0.._PAST, class]: the table _tag_step makes.
        self._table = np.array(
            [
                [_tag_step(m, THINK_END[c] if c < len(THINK_END) else "\0") for c in range(len(THINK_END) + 1)]
                for m in range(_PAST + 1)
            ],
            dtype=np.int64,
        )
        self._masks: dict[int, torch.Tensor] = {}
        self._steps: dict[tuple[int, int], int] = {}

    def allowed(self, written: int) -> torch.Tensor:
        """[width] bool, not to be written to: the tokens allowed with `written` characters of the tag written."""
        mask = self._masks.get(written)
        if mask is None:
            allowed = self.vocabulary.reads(self._table, written, self._columns, _PAST)
            mask = self._masks[written] = torch.from_numpy(allowed)
        return mask

    def written_after(self, written: int, token_id: int) -> int:
        """How much of the tag is written after the token (_CLOSED: it ends the block
        exactly; _PAST: not allowed, or no text)."""
        key = (written, token_id)
        found = self._steps.get(key)
        if found is None:
            texts = self.vocabulary.texts
            text = texts[token_id] if 0 <= token_id < self.vocabulary.width else None
            found = _PAST
            if text is not None:
                found = written
                for char in text:
                    found = _tag_step(found, char)
            if len(self._steps) >= MAX_CACHED_STEPS:
                self._steps.clear()
            self._steps[key] = found
        return found


class ThinkingFirst:
    """`inner`'s structure after a think block (the module's docstring). `opened`: the
    answer starts inside the block (the prompt opened it, or the parser's model always
    thinks), so there is no BEFORE phase."""

    def __init__(self, inner: InnerGuide, block: BlockMasks, opened: bool):
        self.inner, self.block, self.opened = inner, block, opened
        self.dead = inner.step(inner.start, -1)  # the inner guide's dead state: no token reads from it
        self._before: dict[tuple[int, ...], torch.Tensor] = {}

    @property
    def start(self) -> int:
        return INSIDE if self.opened else BEFORE

    def step(self, state: int, token_id: int) -> int:
        if state >= 0:
            return self.inner.step(state, token_id)
        if state == BEFORE:
            if token_id in self.block.opening_ids:
                return INSIDE
            return self.inner.step(self.inner.start, token_id)
        written = self.block.written_after(INSIDE - state, token_id)
        if written == _CLOSED:
            return self.inner.start
        return self.dead if written == _PAST else INSIDE - written

    def state_after(self, token_ids: Sequence[int], state: int | None = None) -> int:
        """The state after token_ids from `state` (None: the start). The inner guide's
        part is read by its own state_after from its start, which may renumber its states."""
        state = self.start if state is None else state
        for n, token_id in enumerate(token_ids):
            if state == BEFORE and token_id not in self.block.opening_ids:
                state = self.inner.start  # the answer has no block: the structure from its first token
            if state == self.inner.start:
                return self.inner.state_after(token_ids[n:])
            if state >= 0:
                return self.inner.state_after(token_ids[n:], state)
            state = self.step(state, token_id)
        return state

    def accepts(self, state: int) -> bool:
        if state >= 0:
            return self.inner.accepts(state)
        return state == BEFORE and self.inner.accepts(self.inner.start)

    def allowed(self, state: int, stop_ids: Collection[int]) -> torch.Tensor:
        """[width] bool, not to be written to: the ids allowed after `state`."""
        if state >= 0:
            return self.inner.allowed(state, stop_ids)
        if state != BEFORE:
            return self.block.allowed(INSIDE - state)
        key = tuple(sorted(stop_ids))
        mask = self._before.get(key)
        if mask is None:
            mask = self.inner.allowed(self.inner.start, stop_ids).clone()
            mask[list(self.block.opening_ids)] = True
            self._before[key] = mask
        return mask
