"""The regex dialect compiled to a DFA: full matches agree with Python's `re.fullmatch`
(ASCII classes, as JSON Schema's ECMA-262 patterns read `\\w`, `\\d` and `\\s`) on
many strings, states that cannot reach a match are dead, and what the dialect
leaves out is refused by name."""

from __future__ import annotations

import random
import re

import pytest

from specserve.errors import ConfigError
from specserve.structured.regex import compile_regex

PATTERNS = [
    r"a|b",
    r"(ab|a)*c?",
    r"[0-9]{2,4}",
    r"x{3}",
    r"(a|b){0,3}c{2,}",
    r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?",
    r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"',
    r"(yes|no|maybe)",
    r"[^a-c]+d",
    r"\w+@\w+\.com|x",
    r"^[a-z]+$",
    r"\s*\{\s*\}\s*",
    r"[\]\-a]+",
    r"(a+?b)*",
    r"[.]\.+",
    r"a{,2}b{,}c{x}",  # {,m}: at most m; {,}: any number; {x}: the text
    r"\u00e9+\x41",
    r"(|a)b",
    r"[\d\s]+\D",
    r"[^\W\d]+",
]
ALPHABET = 'abcdxyz0129-+.eE"\\u/ @_{},]é\tA'


def strings(pattern: str, rng: random.Random, count: int) -> list[str]:
    """Random strings over ALPHABET and the pattern's own characters, short and long."""
    letters = ALPHABET + "".join(c for c in pattern if c.isprintable())
    return ["".join(rng.choice(letters) for _ in range(rng.randint(0, 10))) for _ in range(count)]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_full_matches_agree_with_python(pattern):
    dfa = compile_regex(pattern)
    rng = random.Random(pattern)
    samples = strings(pattern, rng, 4000)
    # And the matches Python finds in the samples' neighbourhoods, so both sides are tested.
    samples += [m.group(0) for s in samples for m in [re.search(pattern, s * 3, re.ASCII)] if m]
    matched = 0
    for text in samples:
        expected = re.fullmatch(pattern, text, re.ASCII) is not None
        assert dfa.matches(text) == expected, (pattern, text)
        matched += expected
    assert matched > 0


def test_states_that_cannot_reach_a_match_are_dead():
    dfa = compile_regex(r"ab(c|d)")
    assert dfa.walk(0, "x") == dfa.dead and dfa.walk(0, "ab") != dfa.dead
    assert dfa.walk(0, "abe") == dfa.dead and dfa.walk(0, "abcd") == dfa.dead
    live = dfa.live()
    assert live[: dfa.dead].all() and not live[dfa.dead]


@pytest.mark.parametrize(
    "pattern, says",
    [
        ("a(?=b)", "lookarounds"),
        ("(?P<x>a)", "lookarounds"),
        (r"(a)\1", "escape"),
        (r"\bword", "escape"),
        ("a^b", "anchor"),
        ("(a|b", "not closed"),
        ("a)", "unexpected"),
        ("*a", "repeats nothing"),
        ("[a", "ends too soon"),
        ("[z-a]", "backwards"),
        ("a{3,2}", "wrong way round"),
        ("a{5000}", "past 1000"),
        (r"\x4", "hex digits"),
    ],
)
def test_what_the_dialect_leaves_out_is_refused(pattern, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        compile_regex(pattern)


def test_a_pattern_too_large_is_refused():
    with pytest.raises(ConfigError, match="too large"):
        compile_regex("(" + "|".join(f"a{{{i}}}b" for i in range(1, 800)) + "){1000}")
