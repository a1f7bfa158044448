"""Structures that nest to any depth: a pushdown guide over one automaton a level.

JSON's text is regular only up to a fixed depth, so what may nest without a bound is read
here as a pushdown automaton: JSON mode (`response_format: json_object`) and a schema
that refers to itself (`json_schema.schema_levels`). Each level is a regex DFA: level 0
the document; for JSON mode an object and an array (`json_object_levels`), for a
schema each schema a `$ref` inside itself points to. In a level, a nested value that
enters another reads as that level's call character (a Unicode noncharacter, which no
token may then spell). A called level is an object or an array: it starts with an
opening bracket and ends with a closing one, after which it reads nothing.

A state is a configuration: the current level's state, and the stack of states to
return to (each a caller's state after the nested value). Reading `{` or `[` where the
current level cannot read it but can read a call whose level starts with it pushes the
return state and enters that level after the bracket; reaching a called level's end
pops back (with nothing open, that end is the document's). States are numbered as they
are met.

A token may open and close several levels, so a state's mask comes in two parts: the
tokens with no bracket, which stay in the current level, walked for every token at once
as `Guide` walks them; and the few thousand with one, walked with a small stack each
(numpy over those tokens), which reads the state's own stack where a token pops past its
pushes. So a mask depends on the current level's state and the top `max_pops` states of
the stack, and is kept for that pair.

`NestedGuide` answers as `Guide` does (`start`, `step`, `state_after`, `accepts`,
`allowed`, guide.py), with the same invariants.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.errors import ConfigError
from specserve.structured.regex import DFA

if TYPE_CHECKING:
    from specserve.structured.guide import GuideVocabulary

OPENERS = {"{": 1, "[": 2}  # the kind of level each opens: 1 object, 2 array
OPENING = {kind: char for char, kind in OPENERS.items()}
BRACKETS = "{}[]"
# Characters no JSON value starts with: where a level reads a call character as it reads
# these, it is a string's character there, not a call.
PLAIN = "aZ~#\u00e9"
# Deeper than this, no object or array opens (Python's json reads ~1,000 levels).
MAX_DEPTH = 128
# What a guide keeps (this one and guide.py's Guide): each state's mask as bits (151,936
# ids: 19 KB), and each (state, token) step taken (here, and each state met); past these
# it starts afresh.
MAX_CACHED_MASKS = 1024
MAX_CACHED_STEPS = 100_000
# And the masks it gave last, whole (152 KB each): a step's rows read them.
MAX_UNPACKED_MASKS = 16


def _single(dfa: DFA, char_class: int) -> str | None:
    """The one character of a DFA's class, or None where it holds several."""
    first = int(dfa.boundaries[char_class])
    last = int(dfa.boundaries[char_class + 1]) - 1 if char_class + 1 < len(dfa.boundaries) else None
    return chr(first) if last == first else None


def _calls(dfa: DFA, char: str, size: int) -> np.ndarray:
    """[size] each state's state after a call `char` (dfa.dead where none is made there)."""
    back = dfa.transitions[:size, dfa.char_classes(np.array([ord(char)]))[0]]
    for plain in dfa.char_classes(np.array([ord(c) for c in PLAIN])):
        back = np.where(dfa.transitions[:size, plain] == back, dfa.dead, back)
    return back


def _entries(dfa: DFA) -> dict[int, int]:
    """A called level's state after each opener it starts with ({kind: state}); ConfigError
    where it may start otherwise (it is no object or array)."""
    starts = [_single(dfa, int(c)) for c in np.flatnonzero(dfa.transitions[0] != dfa.dead)]
    if not starts or any(char not in OPENERS for char in starts):
        raise ConfigError("a schema that refers to itself must be an object or an array (with no other type)")
    return {OPENERS[char]: int(dfa.transitions[0, dfa.char_classes(np.array([ord(char)]))[0]]) for char in starts}


def _ends(dfa: DFA) -> np.ndarray:
    """[states] bool: a called level's final states, each reached by a closing bracket and
    followed by nothing; ConfigError where it may end otherwise."""
    live = dfa.transitions[:-1] != dfa.dead  # [n, classes]
    final = dfa.accepting[:-1] & ~live.any(axis=1)
    into_final = np.isin(dfa.transitions[:-1], np.flatnonzero(final)) & live
    closers = {_single(dfa, int(c)) for c in np.flatnonzero(into_final.any(axis=0))}
    if (dfa.accepting[:-1] & ~final).any() or not closers <= {"}", "]"}:
        raise ConfigError("a schema that refers to itself must be an object or an array (with no other type)")
    return final


class NestedGuide:
    """A pushdown guide over one vocabulary (see the module's docstring): built on any
    thread, then stepped and masked by the engine's thread alone."""

    def __init__(self, levels: Sequence[DFA], calls: dict[int, str], vocabulary: GuideVocabulary, description: str):
        """levels: the DFAs of the levels' regexes, level 0 the document's; calls: the call
        character of each level a nested value enters (`outputs.Nested`).
        ConfigError where a called level is not an object or an array, or where two
        calls could start at one place with the same bracket."""
        self.vocabulary, self.description = vocabulary, description
        sizes = [len(dfa.accepting) - 1 for dfa in levels]  # live states, each level's dead left out
        self.base = np.cumsum([0, *sizes])[:-1]
        self.dead = int(sum(sizes))  # the combined dead state
        # Joint character classes: code points that every level reads alike.
        alphabet = vocabulary.alphabet
        per_level = np.stack([dfa.char_classes(alphabet) for dfa in levels], axis=1)  # [A, levels]
        reps, joint = np.unique(per_level, axis=0, return_inverse=True)  # [J, levels], [A]
        joint = joint.reshape(-1)
        self._joint = {chr(int(cp)): int(j) for cp, j in zip(alphabet, joint)}
        # transitions[state, joint class] over the combined states.
        self.transitions = np.full((self.dead + 1, len(reps)), self.dead, dtype=np.int32)
        self.accepting = np.zeros(self.dead + 1, dtype=bool)
        self.closes = np.zeros(self.dead + 1, dtype=bool)  # a called level's end: pop
        # [state, opener kind]: where an opener enters a called level there, and the state it returns to.
        self.entries = np.full((self.dead + 1, 3), self.dead, dtype=np.int32)
        self.returns = np.full((self.dead + 1, 3), self.dead, dtype=np.int32)
        entries = {called: _entries(levels[called]) for called in calls}  # {kind: state} each
        for level, dfa in enumerate(levels):
            rows = slice(self.base[level], self.base[level] + sizes[level])
            table = dfa.transitions[: sizes[level]][:, reps[:, level]]  # [n, J]
            self.transitions[rows] = np.where(table == dfa.dead, self.dead, table + self.base[level])
            self.accepting[rows] = dfa.accepting[: sizes[level]]
            for called, char in calls.items():
                back = _calls(dfa, char, sizes[level])  # [n]: the state after the call, dfa.dead where none
                here = back != dfa.dead
                for kind, entry in entries[called].items():
                    opener = OPENING[kind]
                    reads_opener = dfa.transitions[: sizes[level], dfa.char_classes(np.array([ord(opener)]))[0]]
                    if (here & ((self.returns[rows, kind] != self.dead) | (reads_opener != dfa.dead))).any():
                        raise ConfigError(
                            f"a schema that refers to itself and another value may both start with {opener!r} at "
                            "one place; structured outputs cannot tell which is written"
                        )
                    self.returns[rows, kind] = np.where(here, back + self.base[level], self.returns[rows, kind])
                    self.entries[rows, kind] = np.where(here, entry + self.base[called], self.entries[rows, kind])
        for called in calls:
            dfa, rows = levels[called], slice(self.base[called], self.base[called] + sizes[called])
            self.closes[rows] = _ends(dfa)
        for char in calls.values():  # a call character in a token's text is no nested value
            if char in self._joint:
                self.transitions[:, self._joint[char]] = self.dead
        self._plain_columns = tuple(joint[column] for column in vocabulary.columns)
        self._lay_out_brackets(joint)
        self._configs: list[tuple[int, tuple[int, ...]]] = []
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}
        self._steps: dict[tuple[int, int], int] = {}
        self._masks: OrderedDict[tuple[int, tuple[int, ...]], np.ndarray] = OrderedDict()
        self._unpacked: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._forget_states()

    def _lay_out_brackets(self, joint: np.ndarray) -> None:
        """The tokens with a bracket, as padded arrays for `_walk_brackets`."""
        texts = self.vocabulary.texts
        ids = [i for i, text in enumerate(texts) if text and any(b in text for b in BRACKETS)]
        self._bracket_ids = np.array(ids, dtype=np.int64)
        longest = max((len(texts[i]) for i in ids), default=0)
        self._bracket_lengths = np.array([len(texts[i]) for i in ids], dtype=np.int64)
        self._bracket_classes = np.zeros((len(ids), longest), dtype=np.int32)
        self._bracket_openers = np.zeros((len(ids), longest), dtype=np.int8)
        for row, i in enumerate(ids):
            text = texts[i]
            self._bracket_classes[row, : len(text)] = [self._joint[c] for c in text]
            self._bracket_openers[row, : len(text)] = [OPENERS.get(c, 0) for c in text]
        self.max_pushes = max((sum(texts[i].count(c) for c in "{[") for i in ids), default=0)
        self.max_pops = max((sum(texts[i].count(c) for c in "}]") for i in ids), default=0)

    def _forget_states(self) -> None:
        self._configs.clear()
        self._ids.clear()
        self._steps.clear()
        self._intern(self.dead, ())  # 0: dead
        self._intern(0, ())  # 1: the start (level 0's state 0)

    def _intern(self, at: int, stack: tuple[int, ...]) -> int:
        key = (at, stack)
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._configs)
            self._configs.append(key)
        return found

    # -- states --

    @property
    def start(self) -> int:
        return 1

    def step(self, state: int, token_id: int) -> int:
        """The state after one more token; 0 (dead) where the token cannot follow."""
        key = (state, token_id)
        found = self._steps.get(key)
        if found is None:
            text = self.vocabulary.texts[token_id] if 0 <= token_id < self.vocabulary.width else None
            read = None if text is None or state == 0 else self._read(*self._configs[state], text)
            found = 0 if read is None else self._intern(*read)
            self._steps[key] = found
        return found

    def state_after(self, token_ids: Sequence[int], state: int | None = None) -> int:
        """The state after token_ids from `state` (None: the start; only from the start
        may the states met so far be forgotten, which renumbers them)."""
        if state is None:
            if len(self._steps) >= MAX_CACHED_STEPS or len(self._configs) >= MAX_CACHED_STEPS:
                self._forget_states()
            state = self.start
        for token_id in token_ids:
            if state == 0:
                break
            state = self.step(state, token_id)
        return state

    def accepts(self, state: int) -> bool:
        at, stack = self._configs[state]
        return state != 0 and not stack and bool(self.accepting[at])

    def _read(self, at: int, stack: tuple[int, ...], text: str) -> tuple[int, tuple[int, ...]] | None:
        """The configuration after `text`, or None where it cannot be read."""
        for char in text:
            following = int(self.transitions[at, self._joint[char]])
            kind = OPENERS.get(char, 0)
            if following == self.dead and kind:
                back = int(self.returns[at, kind])
                if back == self.dead or len(stack) >= MAX_DEPTH:
                    return None
                stack, following = (*stack, back), int(self.entries[at, kind])
            if following == self.dead:
                return None
            if self.closes[following] and stack:  # with none open, the document's own end
                stack, following = stack[:-1], stack[-1]
            at = following
        return at, stack

    # -- masks --

    def allowed(self, state: int, stop_ids: Collection[int]) -> torch.Tensor:
        """[width] bool, not to be written to: the ids allowed after `state`; in the dead
        state, the stop ids alone."""
        at, stack = self._configs[state]
        ends = state == 0 or self.accepts(state)
        tail = stack[-self.max_pops :] if self.max_pops else ()
        # Near MAX_DEPTH the mask depends on the stack's length too.
        length = len(stack) if len(stack) + self.max_pushes >= MAX_DEPTH else -1
        key = (at, tail, length, ends, tuple(sorted(stop_ids)))
        mask = self._unpacked.get(key)
        if mask is not None:
            self._unpacked.move_to_end(key)
            return mask
        if state == 0:
            mask = torch.zeros(self.vocabulary.width, dtype=torch.bool)
        else:
            mask = self._text_mask(at, tail, len(stack), length)
        if ends or not mask.any():
            mask[[i for i in stop_ids if i < self.vocabulary.width]] = True
        self._unpacked[key] = mask
        if len(self._unpacked) > MAX_UNPACKED_MASKS:
            self._unpacked.popitem(last=False)
        return mask

    def _text_mask(self, at: int, tail: tuple[int, ...], stack_length: int, length_key: int) -> torch.Tensor:
        """[width] bool (a new tensor): the ids whose text can be read from the level
        state `at`, `tail` the top of its stack of stack_length."""
        key = (at, tail, length_key)
        bits = self._masks.get(key)
        if bits is None:
            mask = self._walk_plain(at)
            mask[self._bracket_ids] = self._walk_brackets(at, tail, stack_length)
            bits = self._masks[key] = np.packbits(mask)
            if len(self._masks) > MAX_CACHED_MASKS:
                self._masks.popitem(last=False)
        else:
            self._masks.move_to_end(key)
        return torch.from_numpy(np.unpackbits(bits, count=self.vocabulary.width).view(np.bool_))

    def _walk_plain(self, at: int) -> np.ndarray:
        """[width] bool: the tokens whose text the current level reads from `at` (right
        for every token with no bracket)."""
        return self.vocabulary.reads(self.transitions, at, self._plain_columns, self.dead)

    def _walk_brackets(self, at: int, tail: tuple[int, ...], stack_length: int) -> np.ndarray:
        """[B] bool: which bracket tokens can be read from `at`, each with a stack of its
        own pushes above `tail` (the top of the state's stack of stack_length; a pop past
        the token's pushes takes tail's states, newest first)."""
        count = len(self._bracket_ids)
        current = np.full(count, at, dtype=np.int32)
        pushed = np.zeros((count, self.max_pushes + 1), dtype=np.int32)  # each token's own pushes
        depth = np.zeros(count, dtype=np.int64)  # how many it holds
        popped = np.zeros(count, dtype=np.int64)  # how many of tail it took
        below = np.array([self.dead, *tail], dtype=np.int32)  # below[len(tail) - p]: tail's p-th from the top
        for j in range(self._bracket_classes.shape[1]):
            rows = np.nonzero((self._bracket_lengths > j) & (current != self.dead))[0]
            if not len(rows):
                break
            state = current[rows]
            following = self.transitions[state, self._bracket_classes[rows, j]]
            kind = self._bracket_openers[rows, j]
            opening = (following == self.dead) & (kind > 0)
            if opening.any():
                opens = rows[opening]
                back = self.returns[state[opening], kind[opening]]
                room = (back != self.dead) & (stack_length - popped[opens] + depth[opens] < MAX_DEPTH)
                pushed[opens[room], depth[opens[room]]] = back[room]
                depth[opens[room]] += 1
                following[np.flatnonzero(opening)[room]] = self.entries[state[opening][room], kind[opening][room]]
            closing = self.closes[following]
            if closing.any():
                own = closing & (depth[rows] > 0)
                mine = rows[own]
                depth[mine] -= 1
                following[own] = pushed[mine, depth[mine]]
                theirs = closing & ~own & (stack_length - popped[rows] > 0)  # with none open, the document's end
                taken = rows[theirs]
                following[theirs] = below[np.maximum(len(tail) - popped[taken], 0)]
                popped[taken] += 1
            current[rows] = following
        return current != self.dead
