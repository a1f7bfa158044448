"""A regular expression compiled to a deterministic automaton over character classes.

Structured outputs walk every token of the vocabulary through the automaton of the
request's pattern (guide.py), so the automaton must be a table, not Python's
backtracking `re`: `compile_regex` parses the pattern, builds Thompson's NFA, splits
the characters into the classes the pattern cannot tell apart, and determinises by
subset construction. A match is always a full match (as `re.fullmatch`).

The dialect is Python's for what it shares with every engine: literals and escapes
(`\\n`, `\\t`, `\\xHH`, `\\uHHHH`, `\\d`, `\\w`, `\\s` and their negations, escaped
punctuation), `.` (any character but a newline), classes `[...]` and `[^...]` with
ranges, groups `(...)` and `(?:...)`, `|`, and the quantifiers `*`, `+`, `?`, `{n}`,
`{n,}`, `{,m}`, `{n,m}` (as Python reads them; a lazy `?` after one is read and changes nothing a full match
accepts). `^` at the start and `$` at the end are read as the full match already says.
Anything else (lookarounds, backreferences, flags, anchors elsewhere) is a
ConfigError naming it.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import numpy as np

from specserve.errors import ConfigError

MAX_UNICODE = 0x10FFFF
MAX_REPEAT = 1000  # {n,m} past this is refused: it is copied n or m times into the NFA
MAX_NFA_STATES = 200_000
MAX_DFA_STATES = 20_000
MASK_CLASSES_BUDGET_S = 0.3  # `mask_classes` past this gives every state its own mask

Interval = tuple[int, int]  # [first, last] code points, inclusive


def merged_intervals(intervals: list[Interval]) -> tuple[Interval, ...]:
    """Sorted, merged, non-overlapping intervals."""
    merged: list[list[int]] = []
    for first, last in sorted(intervals):
        if merged and first <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    return tuple((a, b) for a, b in merged)


def _complement(intervals: tuple[Interval, ...]) -> tuple[Interval, ...]:
    out, start = [], 0
    for first, last in intervals:
        if first > start:
            out.append((start, first - 1))
        start = last + 1
    if start <= MAX_UNICODE:
        out.append((start, MAX_UNICODE))
    return tuple(out)


def escaped_char(code: int, in_class: bool = False) -> str:
    """One character as this dialect reads it literally, outside a class or inside one."""
    char = chr(code)
    if char in ("\\]^-[" if in_class else "\\.^$*+?{}[]()|"):
        return "\\" + char
    if 0x20 <= code < 0x7F or (code >= 0x80 and char.isprintable()):
        return char
    return f"\\x{code:02x}" if code < 0x80 else f"\\u{code:04x}" if code <= 0xFFFF else char


def escaped(text: str) -> str:
    """`text` as a regex that matches it alone."""
    return "".join(escaped_char(ord(c)) for c in text)


DIGITS = merged_intervals([(ord("0"), ord("9"))])
WORD = merged_intervals([(ord("0"), ord("9")), (ord("A"), ord("Z")), (ord("a"), ord("z")), (ord("_"), ord("_"))])
SPACE = merged_intervals([(ord(c), ord(c)) for c in " \t\n\r\f\v"])
NOT_NEWLINE = _complement(((10, 10),))
SHORTHANDS = {
    "d": DIGITS,
    "w": WORD,
    "s": SPACE,
    "D": _complement(DIGITS),
    "W": _complement(WORD),
    "S": _complement(SPACE),
}
CONTROL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}


# -- the syntax tree: ("chars", intervals) | ("concat", [nodes]) | ("alt", [nodes]) | ("repeat", node, min, max|None)


class _Parser:
    def __init__(self, pattern: str):
        self.pattern, self.at = pattern, 0

    def fail(self, what: str) -> ConfigError:
        return ConfigError(f"regex {self.pattern!r}: {what} at position {self.at}")

    def peek(self) -> str | None:
        return self.pattern[self.at] if self.at < len(self.pattern) else None

    def take(self) -> str:
        if self.at >= len(self.pattern):
            raise self.fail("the pattern ends too soon")
        char = self.pattern[self.at]
        self.at += 1
        return char

    def parse(self) -> tuple:
        if self.peek() == "^":
            self.at += 1
        node = self.alternation()
        if self.at < len(self.pattern):
            raise self.fail(f"unexpected {self.pattern[self.at]!r}")
        return node

    def alternation(self) -> tuple:
        branches = [self.concatenation()]
        while self.peek() == "|":
            self.at += 1
            branches.append(self.concatenation())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def concatenation(self) -> tuple:
        items = []
        while self.peek() not in (None, "|", ")"):
            if self.peek() == "$" and self.at == len(self.pattern) - 1:
                self.at += 1
                break
            items.append(self.quantified(self.atom()))
        return items[0] if len(items) == 1 else ("concat", items)

    def quantified(self, node: tuple) -> tuple:
        while True:
            char = self.peek()
            if char in ("*", "+", "?"):
                self.at += 1
                bounds = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
            elif char == "{" and self._bounds_ahead():
                bounds = self._bounds()
            else:
                return node
            if self.peek() == "?":  # lazy: the same full matches
                self.at += 1
            node = ("repeat", node, *bounds)

    def _bounds_ahead(self) -> bool:
        end = self.pattern.find("}", self.at)
        inside = self.pattern[self.at + 1 : end] if end > 0 else ""
        parts = inside.split(",")
        if len(parts) == 1:
            return parts[0].isdigit()
        return len(parts) == 2 and all(p == "" or p.isdigit() for p in parts)

    def _bounds(self) -> tuple[int, int | None]:
        end = self.pattern.index("}", self.at)
        parts = self.pattern[self.at + 1 : end].split(",")
        self.at = end + 1
        low = int(parts[0] or 0)
        high = low if len(parts) == 1 else (int(parts[1]) if parts[1] else None)
        if high is not None and high < low:
            raise self.fail(f"the repeat {{{low},{high}}} has its bounds the wrong way round")
        if max(low, high or 0) > MAX_REPEAT:
            raise self.fail(f"a repeat bound past {MAX_REPEAT}")
        return low, high

    def atom(self) -> tuple:
        char = self.take()
        if char == "(":
            if self.peek() == "?":
                if self.pattern.startswith("?:", self.at):
                    self.at += 2
                else:
                    raise self.fail("lookarounds, named groups and flags are not supported")
            node = self.alternation()
            if self.peek() != ")":
                raise self.fail("a group is not closed")
            self.at += 1
            return node
        if char == "[":
            return ("chars", self.char_class())
        if char == ".":
            return ("chars", NOT_NEWLINE)
        if char == "\\":
            return ("chars", self.escape(in_class=False))
        if char in "*+?{":
            if char == "{":  # a brace that is no repeat is a literal, as in Python
                return ("chars", ((ord(char), ord(char)),))
            raise self.fail(f"{char!r} repeats nothing")
        if char in "^$":
            raise self.fail(f"the anchor {char!r} is supported only at the pattern's ends")
        return ("chars", ((ord(char), ord(char)),))

    def escape(self, in_class: bool) -> tuple[Interval, ...]:
        char = self.take()
        if char in SHORTHANDS:
            return SHORTHANDS[char]
        if char in CONTROL_ESCAPES:
            code = ord(CONTROL_ESCAPES[char])
            return ((code, code),)
        if char in "xu":
            digits = 2 if char == "x" else 4
            text = self.pattern[self.at : self.at + digits]
            if len(text) != digits or any(c not in "0123456789abcdefABCDEF" for c in text):
                raise self.fail(f"\\{char} needs {digits} hex digits")
            self.at += digits
            code = int(text, 16)
            return ((code, code),)
        if char == "b" and in_class:
            return ((8, 8),)
        if char.isalnum():
            raise self.fail(f"the escape \\{char} is not supported")
        return ((ord(char), ord(char)),)

    def char_class(self) -> tuple[Interval, ...]:
        negated = self.peek() == "^"
        if negated:
            self.at += 1
        intervals: list[Interval] = []
        first = True
        while True:
            char = self.take()
            if char == "]" and not first:
                break
            first = False
            low = self.escape(in_class=True) if char == "\\" else ((ord(char), ord(char)),)
            if self.peek() == "-" and self.pattern[self.at + 1 : self.at + 2] not in ("]", ""):
                self.at += 1
                high_char = self.take()
                high = self.escape(in_class=True) if high_char == "\\" else ((ord(high_char), ord(high_char)),)
                if len(low) != 1 or len(high) != 1 or low[0][0] != low[0][1] or high[0][0] != high[0][1]:
                    raise self.fail("a class range must run between single characters")
                if high[0][0] < low[0][0]:
                    raise self.fail("a class range runs backwards")
                intervals.append((low[0][0], high[0][0]))
            else:
                intervals.extend(low)
        normal = merged_intervals(intervals)
        return _complement(normal) if negated else normal


# -- Thompson's NFA


class _NFA:
    def __init__(self) -> None:
        self.epsilon: list[list[int]] = []
        self.edges: list[list[tuple[tuple[Interval, ...], int]]] = []
        self._closures: dict[int, frozenset[int]] = {}

    def state(self) -> int:
        if len(self.edges) >= MAX_NFA_STATES:
            raise ConfigError("the pattern is too large for structured outputs")
        self.epsilon.append([])
        self.edges.append([])
        return len(self.edges) - 1

    def build(self, node: tuple, start: int) -> int:
        """Wire `node` from `start`; returns its end state."""
        kind = node[0]
        if kind == "chars":
            end = self.state()
            self.edges[start].append((node[1], end))
            return end
        if kind == "concat":
            for item in node[1]:
                start = self.build(item, start)
            return start
        if kind == "alt":
            end = self.state()
            for branch in node[1]:
                entry = self.state()
                self.epsilon[start].append(entry)
                self.epsilon[self.build(branch, entry)].append(end)
            return end
        _, inner, low, high = node
        for _ in range(low):
            start = self.build(inner, start)
        if high is None:  # a loop: start -> inner -> start, start -> end
            entry = self.state()
            self.epsilon[start].append(entry)
            self.epsilon[self.build(inner, entry)].append(start)
            end = self.state()
            self.epsilon[start].append(end)
            return end
        end = self.state()
        for _ in range(high - low):
            self.epsilon[start].append(end)
            start = self.build(inner, start)
        self.epsilon[start].append(end)
        return end

    def closure(self, states: set[int] | frozenset[int]) -> frozenset[int]:
        """The states reachable from `states` by epsilon edges (each state's own closure
        computed once: subset construction asks for the same ones again and again)."""
        if len(states) == 1:
            return self._closure_of(next(iter(states)))
        return frozenset().union(*map(self._closure_of, states))

    def _closure_of(self, state: int) -> frozenset[int]:
        found = self._closures.get(state)
        if found is None:
            seen, stack = {state}, [state]
            while stack:
                for nxt in self.epsilon[stack.pop()]:
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
            found = self._closures[state] = frozenset(seen)
        return found


@dataclass(frozen=True)
class DFA:
    """A full-match automaton: state 0 starts; `dead` (the last state) accepts nothing,
    and every class leads it to itself. A character's class is the number of
    `boundaries` at or below its code point, minus one."""

    transitions: np.ndarray  # [states + 1, classes] int32: the next state; row `dead` is all `dead`
    accepting: np.ndarray  # [states + 1] bool
    boundaries: np.ndarray  # [classes] int64, ascending, starting at 0: each class's first code point

    @property
    def dead(self) -> int:
        return len(self.accepting) - 1

    def char_classes(self, codepoints: np.ndarray) -> np.ndarray:
        """[n] code points -> [n] int32 class indices."""
        return (np.searchsorted(self.boundaries, codepoints, side="right") - 1).astype(np.int32)

    def walk(self, state: int, text: str) -> int:
        """The state after `text` from `state` (`dead` where it cannot be read)."""
        for char in text:
            if state == self.dead:
                break
            state = int(self.transitions[state, bisect.bisect_right(self.boundaries, ord(char)) - 1])
        return state

    def live(self) -> np.ndarray:
        """[states + 1] bool: the states from which some text reaches an accepting one."""
        live = self.accepting.copy()
        while True:
            grown = live | live[self.transitions].any(axis=1)
            if (grown == live).all():
                return live
            live = grown

    def matches(self, text: str) -> bool:
        return bool(self.accepting[self.walk(0, text)])


def compile_regex(pattern: str) -> DFA:
    """The pattern's full-match DFA, with states from which no match can follow merged
    into `dead`, so a walk stops at the first character that rules a match out."""
    tree = _Parser(pattern).parse()
    nfa = _NFA()
    start = nfa.state()
    final = nfa.build(tree, start)
    # Classes: the code points between consecutive interval edges behave alike.
    cuts = {0}
    for edges in nfa.edges:
        for intervals, _ in edges:
            for first, last in intervals:
                cuts.add(first)
                if last < MAX_UNICODE:
                    cuts.add(last + 1)
    boundaries = np.array(sorted(cuts), dtype=np.int64)
    edge_classes = [
        [(_classes_of(intervals, boundaries), target) for intervals, target in edges] for edges in nfa.edges
    ]
    num_classes = len(boundaries)
    sets = [nfa.closure({start})]
    index = {sets[0]: 0}
    rows: list[list[int]] = []
    todo = 0
    while todo < len(sets):
        current = sets[todo]
        todo += 1
        targets: dict[int, set[int]] = {}
        for state in current:
            for classes, target in edge_classes[state]:
                for c in classes:
                    targets.setdefault(c, set()).add(target)
        row = [-1] * num_classes
        for c, states in targets.items():
            closed = nfa.closure(states)
            if closed not in index:
                if len(sets) >= MAX_DFA_STATES:
                    raise ConfigError("the pattern is too large for structured outputs")
                index[closed] = len(sets)
                sets.append(closed)
            row[c] = index[closed]
        rows.append(row)
    dead = len(sets)
    transitions = np.array([[dead if t < 0 else t for t in row] for row in rows] + [[dead] * num_classes])
    accepting = np.array([final in s for s in sets] + [False])
    dfa = DFA(transitions.astype(np.int32), accepting, boundaries)
    live = dfa.live()
    transitions = np.where(live[dfa.transitions], dfa.transitions, dead).astype(np.int32)
    transitions[~live] = dead
    return DFA(transitions, accepting, boundaries)


def _classes_of(intervals: tuple[Interval, ...], boundaries: np.ndarray) -> list[int]:
    """The class indices an edge's intervals cover (each interval starts and ends on a cut)."""
    covered: list[int] = []
    for first, last in intervals:
        low = int(np.searchsorted(boundaries, first, side="right")) - 1
        high = int(np.searchsorted(boundaries, last, side="right")) - 1
        covered.extend(range(low, high + 1))
    return covered


def mask_classes(dfa: DFA, reach: int, budget_s: float = MASK_CLASSES_BUDGET_S) -> np.ndarray:
    """[states + 1] int64: states numbered alike where every text of at most `reach`
    characters leaves them both live or both dead, so that every token (no longer than
    `reach`) is allowed after both or neither: Moore's partition refinement, `reach`
    rounds at most. A bounded repeat's states far from its end share one mask (a string
    of maxLength 1,000: 8,004 states, 766 masks; JSON mode: 7,410 states, 457).

    Each round's signatures are hashed to 64 bits (one sort, not a sort of rows) and the
    new classes checked exactly against them, with the exact sort where a hash merged two.
    Past `budget_s` of CPU time (long chains of states refine a round at a time) every state is its
    own class: always exact, and no mask is shared."""
    transitions = dfa.transitions.astype(np.int64)  # [S, C]
    weights = np.random.default_rng(0).integers(1, 2**63, size=transitions.shape[1] + 1, dtype=np.uint64)
    classes = dfa.live().astype(np.int64)
    count = len(np.unique(classes))
    started = time.process_time()  # its own CPU: a busy server slows it, not its budget
    for _ in range(reach):
        if time.process_time() - started > budget_s:
            return np.arange(len(classes), dtype=np.int64)
        rows = np.concatenate([classes[:, None], classes[transitions]], axis=1)  # [S, C + 1]: each state's signature
        with np.errstate(over="ignore"):
            hashed = (rows.astype(np.uint64) * weights).sum(axis=1, dtype=np.uint64)
        _, first, refined = np.unique(hashed, return_index=True, return_inverse=True)
        if not (rows == rows[first[refined.ravel()]]).all():  # a collision: sort the rows themselves
            _, refined = np.unique(rows, axis=0, return_inverse=True)
        refined = refined.ravel().astype(np.int64)
        if refined.max() + 1 == count:
            break
        classes, count = refined, int(refined.max()) + 1
    return classes
