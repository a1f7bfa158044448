"""GBNF grammars written out as regexes: each construct accepts what llama.cpp's and
xgrammar's readings accept and nothing else, and every mistake, or a grammar that is
not served (one that recurses, one too large written out), is a ConfigError naming it."""

from __future__ import annotations

import pytest

from specserve.errors import ConfigError
from specserve.structured.grammar import MAX_REGEX_CHARS, grammar_regex
from specserve.structured.regex import compile_regex

# vLLM's documentation's example of `guided_grammar`.
SQL = """
    root ::= select_statement
    select_statement ::= "SELECT " column " from " table " where " condition
    column ::= "col_1 " | "col_2 "
    table ::= "table_1 " | "table_2 "
    condition ::= column "= " number
    number ::= "1 " | "2 "
"""


def accepts(grammar: str, text: str) -> bool:
    return compile_regex(grammar_regex(grammar)).matches(text)


@pytest.mark.parametrize(
    "grammar, yes, no",
    [
        (SQL, ["SELECT col_1  from table_2  where col_2 = 1 "], ["SELECT col_3  from table_2  where col_2 = 1 ", ""]),
        # Escapes in literals and classes; a literal's regex syntax is text.
        (r'root ::= "a\n\t\"\\" "\x41\u00e9\U0001F600" ".*+?()[]{}|^$"', ['a\n\t"\\Aé😀.*+?()[]{}|^$'], ["a"]),
        ("root ::= 'single' \"double\"", ["singledouble"], ["single"]),
        # Classes: ranges, negation (a newline included), escaped brackets and dashes.
        (r"root ::= [a-c0-9_] [^x] [\]\-\\] [-z] [z-]", ["a\n]-z", "9y\\z-"], ["d\n]-z", "ax]-z"]),
        # Any character, a newline too.
        ("root ::= . .", ["\n\n", "ab"], ["a", "abc"]),
        # Repetition.
        ('root ::= "a"* "b"+ "c"? "d"{2} "e"{1,2} "f"{2,} "g"{,1}', ["bddeff", "aabcddeeffffg"], ["ddeff", "bdddeff"]),
        ('root ::= "ab"{2}', ["abab"], ["abb"]),  # a literal's repetition is the whole literal's
        # Groups, alternatives (an empty one), rules over several lines, comments.
        (
            """
            # a comment
            root ::= ("x" | "y" |) item  # after a rule
            item ::= "1" |
                     "2"
            """,
            ["x1", "2", "y2"],
            ["xy1", "3"],
        ),
        ('root ::= ws "[" ws "]"\nws ::= [ \\t\\n]*', ["[]", " [\n\t]"], ["[x]"]),
    ],
)
def test_a_grammar_accepts_its_language(grammar, yes, no):
    for text in yes:
        assert accepts(grammar, text), text
    for text in no:
        assert not accepts(grammar, text), text


@pytest.mark.parametrize(
    "grammar, says",
    [
        ('root ::= "(" root ")" | "x"', "'root' refers to itself (root -> root)"),
        ('root ::= a\na ::= b\nb ::= "[" a "]" | "x"', "'a' refers to itself (a -> b -> a)"),
        ('start: "a"', "Lark grammars are not read"),
        ('item ::= "a"', "no rule `root` (it defines item)"),
        ("root ::= item", "line 1, column 10: the rule 'item' is not defined"),
        ('root ::= "a"\nroot ::= "b"', "line 2, column 1: the rule 'root' is defined again"),
        ('root ::= ("a"', "a group is not closed"),
        ('root ::= "a")', "unexpected ')'"),
        ('root ::= "a', "a literal is not closed"),
        ('root ::= "a\nb"', "runs past its line's end"),
        ("root ::= [ab", "a character class is not closed"),
        ("root ::= []", "an empty character class"),
        ("root ::= [z-a]", "runs backwards"),
        (r'root ::= "\q"', r"unknown escape \q"),
        (r'root ::= "\x4"', r"\x takes 2 hex digits"),
        (r'root ::= "\uD800"', "is not a character"),
        ('root ::= "a"{3,1}', "allows fewer than it needs"),
        ('root ::= "a"{,}', "a repetition is"),
        ('root ::= * "a"', "follows nothing it could repeat"),
        ('root ::= "a" ; "b"', "line 1, column 14: unexpected ';'"),
        ('"a" ::= "b"', "expected a rule"),
        ("root ::=", "the rule 'root' is empty"),
    ],
)
def test_a_mistake_is_a_config_error_naming_it(grammar, says):
    with pytest.raises(ConfigError) as error:
        grammar_regex(grammar)
    assert says in str(error.value)


def test_a_grammar_past_the_regex_limit_is_refused():
    """Each rule names the next twice: written out, 2^20 copies of the last."""
    rules = [f"r{i} ::= r{i + 1} r{i + 1}" for i in range(20)] + ['r20 ::= "ab"']
    with pytest.raises(ConfigError, match=f"past the limit of {MAX_REGEX_CHARS:,}"):
        grammar_regex("root ::= r0\n" + "\n".join(rules))
