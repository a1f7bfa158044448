"""What a request's answer must follow, and its automaton: a module without torch, so
that a worker process compiles schemas away from the server's threads (guide.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from specserve.structured.grammar import grammar_regex
from specserve.structured.json_schema import (
    CALL_ARRAY,
    CALL_OBJECT,
    WHITESPACE,
    json_object_levels,
    schema_levels,
)
from specserve.structured.regex import DFA, compile_regex, mask_classes

# Each kind of structure, as error messages name it.
KINDS = {
    "json": "JSON schema",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
    "json_object": "JSON object",
}


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's answer must be: `kind` one of KINDS, `spec` the schema (JSON
    text), the regex, the choices (a tuple), or the grammar (GBNF); None for json_object."""

    kind: str
    spec: Any = None
    whitespace: str | None = None  # JSON's: a regex of what may go between its tokens; None: WHITESPACE

    def levels(self) -> tuple[list[str], dict[int, str]]:
        """The regexes of its levels and the call character of each level called
        (structured/nested.py): JSON mode's, a schema's that refers to itself or holds an
        open value (`json_schema.schema_levels`); for what nests with a bound, its one
        regex and no calls."""
        whitespace = WHITESPACE if self.whitespace is None else self.whitespace
        if self.kind == "json":
            return schema_levels(json.loads(self.spec), whitespace)
        if self.kind == "json_object":
            return list(json_object_levels(whitespace)), {1: CALL_OBJECT, 2: CALL_ARRAY}
        if self.kind == "choice":
            return ["|".join(f"(?:{re.escape(choice)})" for choice in self.spec)], {}
        if self.kind == "grammar":
            return [grammar_regex(self.spec)], {}
        return [self.spec], {}

    def describe(self) -> str:
        return KINDS[self.kind]


class Nested(NamedTuple):
    """What a pushdown guide is built from (structured/nested.py)."""

    levels: list[DFA]
    calls: dict[int, str]  # each called level's call character


def compiled(wanted: StructuredOutput, reach: int) -> Nested | tuple[DFA, np.ndarray]:
    """What `wanted`'s guide is built from (ConfigError for a pattern or schema it cannot
    serve): its levels where it nests without a bound, else its DFA and the states' mask
    classes for tokens of at most `reach` characters."""
    regexes, calls = wanted.levels()
    if calls:
        return Nested([compile_regex(regex) for regex in regexes], calls)
    dfa = compile_regex(regexes[0])
    return dfa, mask_classes(dfa, reach)
