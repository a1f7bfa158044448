"""Structured outputs: an answer held to a regex, a JSON schema, any JSON object, or one
of a list of choices (vLLM's `guided_*`, OpenAI's `response_format`).

Each kind becomes a regex (json_schema.py), the regex a DFA (regex.py), and the DFA a
`Guide` over the target's vocabulary (guide.py), which the engine reads as one more
logits processor (specserve/penalties.py), on the target's rows and the proposers'
guesses alike, so speculation stays lossless under it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from specserve.structured.guide import Guide, GuideVocabulary
from specserve.structured.json_schema import WHITESPACE, json_object_regex, schema_to_regex
from specserve.structured.regex import compile_regex
from specserve.tokenizer import Tokenizer

KINDS = ("json", "regex", "choice", "json_object")


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
        what = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "json_object": "JSON object"}
        return what[self.kind]


class GuideCache:
    """Guides compiled for one tokenizer, the most recent `size` kept: requests that send
    the same schema (an application's, every time) compile it once."""

    def __init__(self, tokenizer: Tokenizer, size: int = 64):
        self.tokenizer, self.size = tokenizer, size
        self._guides: OrderedDict[StructuredOutput, Guide] = OrderedDict()
        self._lock = threading.Lock()

    def guide(self, wanted: StructuredOutput) -> Guide:
        """The compiled guide (ConfigError for a pattern or schema it cannot serve)."""
        with self._lock:
            if wanted in self._guides:
                self._guides.move_to_end(wanted)
                return self._guides[wanted]
        vocabulary = GuideVocabulary.of(self.tokenizer, self.tokenizer.vocab_size)
        guide = Guide(compile_regex(wanted.regex()), vocabulary, wanted.describe())
        with self._lock:
            self._guides[wanted] = guide
            while len(self._guides) > self.size:
                self._guides.popitem(last=False)
        return guide
