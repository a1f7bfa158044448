"""What a request's answer must follow, and its automaton: a module without torch, so
that a worker process compiles schemas away from the server's threads (guide.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from specserve.structured.json_schema import (
    CALL_ARRAY,
    CALL_OBJECT,
    WHITESPACE,
    json_object_levels,
    json_object_regex,
    schema_levels,
    schema_to_regex,
)
from specserve.structured.regex import DFA, compile_regex, mask_classes

# Each kind of structure, as error messages name it.
KINDS = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "json_object": "JSON object"}


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's answer must be: `kind` one of KINDS, `spec` the schema (JSON
    text), the regex, or the choices (a tuple); None for json_object."""

    kind: str
    spec: Any = None
    whitespace: str | None = None  # JSON's: a regex of what may go between its tokens; None: WHITESPACE

    def regex(self) -> str:
        whitespace = WHITESPACE if self.whitespace is None else self.whitespace
        if self.kind == "json":
            return schema_to_regex(json.loads(self.spec), whitespace)
        if self.kind == "json_object":
            return json_object_regex(whitespace)
        if self.kind == "choice":
            return "|".join(f"(?:{re.escape(choice)})" for choice in self.spec)
        return self.spec

    def describe(self) -> str:
        return KINDS[self.kind]


def automaton(wanted: StructuredOutput, reach: int) -> tuple[DFA, np.ndarray]:
    """`wanted`'s DFA and its states' mask classes for tokens of at most `reach`
    characters (ConfigError for a pattern or schema it cannot serve)."""
    dfa = compile_regex(wanted.regex())
    return dfa, mask_classes(dfa, reach)


def nested_levels(wanted: StructuredOutput) -> tuple[list[DFA], dict[int, str]] | None:
    """The DFAs of the levels of what may nest without a bound (structured/nested.py), and
    each called level's call character: JSON mode's, a recursive schema's; None for
    what is one regex (`automaton`)."""
    whitespace = WHITESPACE if wanted.whitespace is None else wanted.whitespace
    if wanted.kind == "json_object":
        levels, calls = json_object_levels(whitespace), {1: CALL_OBJECT, 2: CALL_ARRAY}
    elif wanted.kind == "json":
        recursive = schema_levels(json.loads(wanted.spec), whitespace)
        if recursive is None:
            return None
        levels, calls = recursive
    else:
        return None
    return [compile_regex(level) for level in levels], calls


def compiled(wanted: StructuredOutput, reach: int) -> tuple[list[DFA], dict[int, str]] | tuple[DFA, np.ndarray]:
    """What a guide is built from: `nested_levels`, or else `automaton`."""
    return nested_levels(wanted) or automaton(wanted, reach)
