"""Which tokens a structured output may take next: a pattern's DFA walked over the vocabulary.

A `Guide` holds a request's compiled pattern and the target's vocabulary spelled as
text (`GuideVocabulary`). The state after an output is the DFA's state after the
output's text; a token is allowed where its whole text leads to a live state, and the
stop ids (EOS, the request's own) where the state accepts. A state's mask is computed
once, for every token at once (numpy over the vocabulary's characters, 4 ms over
151,936 ids), and kept for every state of its mask class (`mask_classes`).

Invariants:
- Every token with an allowed id, appended to a text the pattern can still complete,
  leaves a text it can still complete; so a guided output that ends on a stop id
  matches the pattern in full (one cut by max_tokens is a prefix of a match).
- A token is text only if its bytes are whole UTF-8 on their own; a byte-level piece
  of a character, and every special token, is never allowed (a character the
  vocabulary spells only in pieces cannot be written, and JSON can escape it).
- Where a state allows no token and does not accept (the pattern needs a character
  no whole token spells), the stop ids are allowed, so the output ends rather than
  leaving the pattern.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import numpy as np
import torch

from specserve.errors import ConfigError
from specserve.structured.nested import MAX_CACHED_MASKS, MAX_CACHED_STEPS, MAX_UNPACKED_MASKS, NestedGuide
from specserve.structured.outputs import Nested, StructuredOutput, compiled
from specserve.structured.regex import DFA, mask_classes
from specserve.tokenizer import Tokenizer

T = TypeVar("T")


@dataclass(frozen=True)
class GuideVocabulary:
    """A vocabulary of `width` ids as text, laid out for walking every token at once:
    tokens sorted by length, longest first, so the tokens with a j-th character are
    the first `counts[j]` of `order`."""

    width: int
    texts: tuple[str | None, ...]  # [width]: each id's text; None: never allowed (special, partial, padding)
    order: np.ndarray  # [T] int64: the ids of the text tokens, longest first
    counts: np.ndarray  # [L] int64: how many tokens have a j-th character
    columns: tuple[np.ndarray, ...]  # L of [counts[j]] int32: the j-th character of each, as an index into `alphabet`
    alphabet: np.ndarray  # [A] int64: the distinct code points the vocabulary spells

    def reads(self, transitions: np.ndarray, start: int, columns: Sequence[np.ndarray], dead: int) -> np.ndarray:
        """[width] bool: the ids whose whole text an automaton reads from `start` to a
        state other than `dead` (transitions[state, class]; columns: `columns` as the
        automaton's classes). Every token at once, a character position at a time."""
        current = np.full(len(self.order), start, dtype=np.int32)  # each token's state so far
        for count, classes in zip(self.counts, columns):
            current[:count] = transitions[current[:count], classes]
        mask = np.zeros(self.width, dtype=bool)
        mask[self.order] = current != dead
        return mask

    @classmethod
    def of(cls, tokenizer: Tokenizer, width: int) -> GuideVocabulary:
        """The tokenizer's vocabulary over a model's `width` logits (ids past the tokenizer's are never allowed)."""
        return _vocabulary(tokenizer, width)

    @classmethod
    def from_texts(cls, texts: Sequence[str | None]) -> GuideVocabulary:
        """Each id's text (None or "": never allowed)."""
        texts = tuple(t or None for t in texts)
        ids = sorted((i for i, t in enumerate(texts) if t), key=lambda i: -len(texts[i]))
        alphabet = sorted({c for i in ids for c in texts[i]})
        position = {c: n for n, c in enumerate(alphabet)}
        lengths = np.array([len(texts[i]) for i in ids], dtype=np.int64)
        longest = int(lengths[0]) if ids else 0
        counts = np.array([(lengths > j).sum() for j in range(longest)], dtype=np.int64)
        columns = tuple(
            np.array([position[texts[i][j]] for i in ids[: counts[j]]], dtype=np.int32) for j in range(longest)
        )
        codepoints = np.array([ord(c) for c in alphabet], dtype=np.int64)
        return cls(len(texts), texts, np.array(ids, dtype=np.int64), counts, columns, codepoints)


@functools.cache
def _vocabulary(tokenizer: Tokenizer, width: int) -> GuideVocabulary:
    texts: list[str | None] = []
    for token_id in range(width):
        text = None
        if token_id < tokenizer.vocab_size and token_id not in tokenizer.special_ids:
            try:
                text = tokenizer.token_bytes(token_id).decode("utf-8")
            except UnicodeDecodeError:  # a piece of a character
                pass
        texts.append(text)
    return GuideVocabulary.from_texts(texts)


class Guide:
    """A compiled pattern over one vocabulary: the states an output passes through and
    the ids each state allows. Shared by every request with the same pattern: built on
    any thread, then stepped and masked by the engine's thread alone."""

    def __init__(
        self,
        dfa: DFA,
        vocabulary: GuideVocabulary,
        description: str,
        mask_class: np.ndarray | None = None,  # [states + 1]: `mask_classes(dfa, reach)`, reach >= the longest token
    ):
        if dfa.transitions[0].min() == dfa.dead and not dfa.accepting[0]:
            raise ConfigError(f"the {description} matches no text at all")
        self.dfa, self.vocabulary, self.description = dfa, vocabulary, description
        classes = dfa.char_classes(vocabulary.alphabet)  # [A]
        narrow = np.uint8 if len(dfa.boundaries) <= 256 else np.int32  # 1 MB a guide for Qwen's, not 4
        # L of [counts[j]]: each token's j-th character's class
        self._columns = tuple(classes[column].astype(narrow) for column in vocabulary.columns)
        # States whose masks are one (the same live futures within the longest token's reach).
        self._mask_class = mask_classes(dfa, len(vocabulary.counts)) if mask_class is None else mask_class
        self._masks: dict[int, np.ndarray] = {}  # mask class -> [ceil(width / 8)] uint8, the mask's bits
        self._unpacked: OrderedDict[tuple[int, bool, tuple[int, ...]], torch.Tensor] = OrderedDict()
        self._steps: dict[tuple[int, int], int] = {}

    # -- states --

    @property
    def start(self) -> int:
        return 0

    def step(self, state: int, token_id: int) -> int:
        """The state after one more token; `dead` where the token cannot follow (an id
        that is no text, or one whose text leaves the pattern)."""
        key = (state, token_id)
        found = self._steps.get(key)
        if found is None:
            text = self.vocabulary.texts[token_id] if 0 <= token_id < self.vocabulary.width else None
            found = self.dfa.dead if text is None else self.dfa.walk(state, text)
            if len(self._steps) >= MAX_CACHED_STEPS:
                self._steps.clear()
            self._steps[key] = found
        return found

    def state_after(self, token_ids: Sequence[int], state: int = 0) -> int:
        for token_id in token_ids:
            if state == self.dfa.dead:
                break
            state = self.step(state, token_id)
        return state

    def accepts(self, state: int) -> bool:
        return bool(self.dfa.accepting[state])

    # -- masks --

    def allowed(self, state: int, stop_ids: Collection[int]) -> torch.Tensor:
        """[width] bool, not to be written to: the ids allowed after `state`; in a dead
        state (an output that left the pattern, as a row past a rejected draft does),
        the stop ids alone."""
        ends = state == self.dfa.dead or self.accepts(state)
        key = (int(self._mask_class[state]), ends, tuple(sorted(stop_ids)))
        mask = self._unpacked.get(key)
        if mask is not None:
            self._unpacked.move_to_end(key)
            return mask
        mask = self._text_mask(state)
        if ends or not mask.any():
            stops = [i for i in stop_ids if i < self.vocabulary.width]
            mask[stops] = True
        self._unpacked[key] = mask
        if len(self._unpacked) > MAX_UNPACKED_MASKS:
            self._unpacked.popitem(last=False)
        return mask

    def _text_mask(self, state: int) -> torch.Tensor:
        """[width] bool (a new tensor): the ids whose text the pattern can read from `state`."""
        mask_class = int(self._mask_class[state])
        bits = self._masks.get(mask_class)
        if bits is None:
            bits = np.packbits(self._walk_every_token(state))
            if len(self._masks) >= MAX_CACHED_MASKS:
                self._masks.clear()
            self._masks[mask_class] = bits
        return torch.from_numpy(np.unpackbits(bits, count=self.vocabulary.width).view(np.bool_))

    def _walk_every_token(self, state: int) -> np.ndarray:
        """[width] bool: which ids' whole text the DFA reads from `state` to a live state."""
        if state == self.dfa.dead:
            return np.zeros(self.vocabulary.width, dtype=bool)
        return self.vocabulary.reads(self.dfa.transitions, state, self._columns, self.dfa.dead)


def guided_rows(
    guide: Guide, output_ids: Sequence[int], drafts: Sequence[int], stop_ids: Collection[int], width: int
) -> torch.Tensor:
    """[len(drafts) + 1, width] bool: row i allows what may follow output_ids + drafts[:i]
    (ids past the guide's vocabulary never; a narrower width cuts them off)."""
    state = guide.state_after(output_ids)
    rows = [guide.allowed(state, stop_ids)]
    for token_id in drafts:
        state = guide.step(state, token_id)
        rows.append(guide.allowed(state, stop_ids))
    allowed = torch.stack(rows)  # [k + 1, guide width]
    if allowed.shape[-1] < width:
        return torch.nn.functional.pad(allowed, (0, width - allowed.shape[-1]), value=False)
    return allowed[:, :width]


class GuideCache:
    """Guides compiled for one tokenizer, the most recent `size` kept: requests that send
    the same schema (an application's, every time) compile it once.

    With `isolated`, the automaton is built in a worker process at the lowest priority
    (one for the whole server, started at the first compile): building one is pure
    Python for up to a second or two, and on a thread of the server it held the GIL from
    the engine's thread and took a core from its kernels."""

    def __init__(self, tokenizer: Tokenizer, size: int = 64, isolated: bool = False):
        self.tokenizer, self.size, self.isolated = tokenizer, size, isolated
        self._guides: OrderedDict[StructuredOutput, Guide] = OrderedDict()
        self._lock = threading.Lock()

    def vocabulary(self) -> GuideVocabulary:
        return GuideVocabulary.of(self.tokenizer, self.tokenizer.vocab_size)

    def guide(self, wanted: StructuredOutput) -> Guide | NestedGuide:
        """The compiled guide (ConfigError for a pattern or schema it cannot serve)."""
        with self._lock:
            if wanted in self._guides:
                self._guides.move_to_end(wanted)
                return self._guides[wanted]
        vocabulary = self.vocabulary()
        compile = _compile_in_worker if self.isolated else _compile_here
        built = compile(compiled, wanted, len(vocabulary.counts))
        if isinstance(built, Nested):  # nested to any depth: a pushdown guide
            guide = NestedGuide(*built, vocabulary, wanted.describe())
        else:
            dfa, classes = built
            guide = Guide(dfa, vocabulary, wanted.describe(), classes)
        with self._lock:
            self._guides[wanted] = guide
            while len(self._guides) > self.size:
                self._guides.popitem(last=False)
        return guide


_worker: ProcessPoolExecutor | None = None
_worker_lock = threading.Lock()


def _compile_here(compile: Callable[..., T], *args: Any) -> T:
    return compile(*args)


def _compile_in_worker(compile: Callable[..., T], *args: Any) -> T:
    """`compile(*args)` (outputs.py's `compiled`) in the compiling
    process (spawned: it imports numpy and this package's torch-free modules, not the
    server's state); a worker that died is replaced, and the compile tried once more."""
    global _worker
    for attempt in range(2):
        with _worker_lock:
            if _worker is None:
                _worker = ProcessPoolExecutor(
                    max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=os.nice, initargs=(19,)
                )
            worker = _worker
        try:
            return worker.submit(compile, *args).result()
        except BrokenProcessPool:
            with _worker_lock:
                if _worker is worker:
                    _worker = None
            if attempt:
                raise ConfigError("compiling the structure failed: the compiling process died (out of memory?)")
    raise AssertionError("unreachable")
