"""Tool calls in a chat answer (`--enable-auto-tool-choice --tool-call-parser P`).

Qwen2.5's and Hermes' chat templates list the request's tools and teach the model to
answer a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block
a call. The parsers:

- `hermes`, as vLLM's reads them: an answer's content is its text before the first
  block (None where that is blank); each block holding a {"name", "arguments"} object
  becomes one of the message's `tool_calls`, its arguments the JSON text the model
  wrote, and text after the first block is no part of the message. Where no block is
  such an object, nothing is taken for a call: the whole answer is content.
- `qwen2_5_coder`: those blocks, and also an answer that is nothing but one such object
  (or a list of them) naming one of the request's tools, bare or in a ``` fence, as
  Qwen2.5-Coder writes its calls (llama.cpp's Hermes reader takes fenced calls too).

A stream sends content as it comes, holding back a tail that may begin a block (and,
for `qwen2_5_coder`, an answer that may be a whole call: one starting `{`, `[` or a
fence). It sends each call as OpenAI and vLLM stream one: its name as soon as the head
`{"name": ..., "arguments":` is written, then its arguments piece by piece. A call
written another way (its keys in another order) is sent whole once its block closes,
or at the answer's end; and where no call was read, the held text is sent as content
at the end. A whole answer is read by the same reader, so the two agree; an answer cut
short inside a call's arguments (max_tokens) keeps the call as written, and finishes
"length".
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "qwen2_5_coder")
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(CALL_START) + r"(.*?)(?:" + re.escape(CALL_END) + r"|\Z)", re.DOTALL)
_FENCED = re.compile(r"```[a-z]*\n(.*?)\n?```", re.DOTALL)
# How a whole-answer call may begin (qwen2_5_coder): what is held until the answer ends.
_WHOLE_STARTS = ("{", "[", "```json\n", "```\n")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def described(self) -> dict[str, Any]:
        """The call as a message's `tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_of(value: Any, names: Collection[str] | None = None) -> ToolCall | None:
    """A {"name", "arguments"} object as a call (its name among `names`, where given)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if names is not None and value["name"] not in names:
        return None
    return ToolCall(value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _whole_answer_calls(text: str, names: Collection[str]) -> list[ToolCall]:
    """The calls an answer is, where it is nothing but a call object or a list of them
    (bare or fenced), each naming one of `names`; else none."""
    text = text.strip()
    fenced = _FENCED.fullmatch(text)
    value = _json(fenced.group(1) if fenced else text)
    values = value if isinstance(value, list) else [value]
    calls = [_call_of(v, names) for v in values]
    return calls if calls and None not in calls else []


@dataclass(frozen=True)
class ToolCallParser:
    """How one request's answers are read: `parser` (TOOL_CALL_PARSERS) and its tools' names."""

    parser: str
    tool_names: frozenset[str]

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer's (content, calls), read as a stream reads it; (text, []) where it makes none."""
        reader = self.stream()
        content, _ = reader.step(text, finished=True)
        if not reader.calls:
            return text, []
        return (content if content.strip() else None), reader.calls

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """An answer's (content, calls) read all at once; (text, []) where it makes none:
        what decides an answer in which no call's head was read as it was written."""
        start = text.find(CALL_START)
        if start >= 0:
            calls = [_call_of(_json(block.strip())) for block in _BLOCK.findall(text, start)]
            if calls and None not in calls:
                content = text[:start]
                return (content if content.strip() else None), calls
            return text, []
        if self.parser == "qwen2_5_coder":
            calls = _whole_answer_calls(text, self.tool_names)
            if calls:
                return None, calls
        return text, []

    def stream(self) -> StreamedToolCalls:
        return StreamedToolCalls(parser=self)

    @property
    def finish_reason(self) -> str:
        """An answer's finish_reason where it made calls."""
        return "tool_calls"


@dataclass(frozen=True)
class ForcedToolCalls:
    """A forced tool_choice's answer, which a guide held to the calls' JSON (protocol.py,
    `tool_choice_schema`). For a named tool, the answer is its arguments: one call,
    whatever they hold (cut short by max_tokens too, as vLLM and OpenAI give them),
    streamed as they come, its finish_reason the answer's (OpenAI's "stop"). For
    "required", a list of {"name", "arguments"} calls finishing "tool_calls", each
    streamed as it comes (`StreamedCallList`), its arguments the text the model wrote;
    whole, one cut short of valid JSON is content."""

    tool: str  # a tool's name, or "required"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.tool != "required":
            return None, [ToolCall(self.tool, text)]
        value = _json(text)
        calls = [_call_of(v) for v in value] if isinstance(value, list) else []
        if not calls or None in calls:
            return text, []
        as_written = StreamedCallList()
        as_written.step(text, finished=True)
        return None, as_written.calls if len(as_written.calls) == len(calls) else calls

    def stream(self) -> StreamedCallList | StreamedArguments:
        if self.tool != "required":
            return StreamedArguments(self.tool)
        return StreamedCallList()

    @property
    def finish_reason(self) -> str | None:
        return None if self.tool != "required" else "tool_calls"


def may_begin(text: str, tag: str) -> int:
    """How many of text's last characters may begin `tag` (a stream holds them back)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class _ValueEnd:
    """Where a JSON object, array or string that text holds from some index ends, read
    as the text comes: the state of the brackets and strings read so far."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def scan(self, text: str, start: int) -> int | None:
        """The index past the value's end, reading text from start; None: not ended yet."""
        for i in range(start, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


@dataclass
class _CallsAsWritten:
    """Calls read from a growing answer and sent as they are written: each call's first
    entry (index, id, type, name) once its head is read up to its arguments, then the
    text of its arguments piece by piece, as the model writes it (whitespace before it
    left out), until the value ends. A subclass finds the heads (`_next_call`)."""

    text: str = ""
    read: int = 0  # characters of text taken: up to the next call's head, or into its arguments
    calls: list[ToolCall] = field(default_factory=list)  # those begun, their arguments as read so far
    value: _ValueEnd | None = None  # the arguments being read, or None between calls

    def _next_call(self, entries: dict[int, dict[str, Any]]) -> bool:
        """Begin the next call (`_begin`) where its head is written; False: not (yet)."""
        raise NotImplementedError

    def _begin(self, name: str, arguments_at: int, entries: dict[int, dict[str, Any]]) -> None:
        self.calls.append(ToolCall(name, ""))
        entries[len(self.calls) - 1] = self.calls[-1].described()
        self.read, self.value = arguments_at, _ValueEnd()

    def _add_whole(self, call: ToolCall, entries: dict[int, dict[str, Any]]) -> None:
        """A call read whole (not in the shape a head is read in), sent in one entry."""
        self.calls.append(call)
        entries[len(self.calls) - 1] = call.described()

    def _read_calls(self) -> list[dict[str, Any]]:
        """The entries of the calls written since the last read."""
        entries: dict[int, dict[str, Any]] = {}
        while True:
            if self.value is None and not self._next_call(entries):
                break
            call = self.calls[-1]
            if not call.arguments:  # whitespace before the arguments is no part of them
                while self.read < len(self.text) and self.text[self.read].isspace():
                    self.read += 1
            end = self.value.scan(self.text, self.read)
            piece = self.text[self.read : len(self.text) if end is None else end]
            if piece:
                self.calls[-1] = dataclasses.replace(call, arguments=call.arguments + piece)
                entry = entries.setdefault(len(self.calls) - 1, {"function": {}})
                entry["function"]["arguments"] = entry["function"].get("arguments", "") + piece
            if end is None:
                self.read = len(self.text)
                break
            self.read, self.value = end, None
        return [{"index": i, **entry} for i, entry in sorted(entries.items())]


def _name(head: re.Match) -> str:
    return json.loads(f'"{head.group(1)}"')


# A call object's head up to its arguments: its name (a JSON string), written first, and the key.
_JSON_STRING_BODY = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*'
_NAME_THEN_ARGUMENTS = r'\{\s*"name"\s*:\s*"(' + _JSON_STRING_BODY + r')"\s*,\s*"arguments"\s*:\s*'
# A hermes block's call, after its tag (its arguments an object, as the templates teach).
_BLOCK_HEAD = re.compile(r"\s*" + _NAME_THEN_ARGUMENTS + r"(?=\{)")
# A whole-answer call (qwen2_5_coder): bare or fenced, alone or first in a list; then the list's next.
_ANSWER_HEAD = re.compile(r"\s*(?:```[a-z]*\n\s*)?(?:\[\s*)?" + _NAME_THEN_ARGUMENTS + r"(?=\{)")
_NEXT_IN_LIST = re.compile(r"\s*\}\s*,\s*" + _NAME_THEN_ARGUMENTS + r"(?=\{)")


@dataclass
class StreamedToolCalls(_CallsAsWritten):
    """One choice's answer read as it comes: content sent as it comes, up to what may
    begin a call; then each call as it is written (`_CallsAsWritten`). A block whose
    head is not written so (its keys in another order) is read whole when it closes. A
    stream and a whole answer are read alike (`ToolCallParser.parse` runs this reader),
    so a stream, cut anywhere, sends what the whole answer's parse gives."""

    parser: ToolCallParser = field(kw_only=True)
    sent: int = 0  # characters of text sent as content
    held_from: int | None = None  # where calls may begin: no content is sent from there on
    whole_answer: bool = False  # reading the heads of an answer that is calls (qwen2_5_coder)
    calls_made: bool = False  # known at the end: whether the answer was calls, their arguments ended

    def step(self, new_text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """One streamed step: the content to send, and its delta's `tool_calls` entries."""
        self.text += new_text
        content = self._content() if self.held_from is None else ""
        entries = self._read_calls() if self.held_from is not None else []
        if not finished:
            return content, entries
        rest, last = self._finish()
        return content + rest, entries + last

    def _content(self) -> str:
        """The content to send now: up to where a call may begin, blanks before it held."""
        if self.parser.parser == "qwen2_5_coder" and self.sent == 0:
            answer = self.text.lstrip()
            if any(answer.startswith(s) for s in _WHOLE_STARTS):
                self.held_from, self.whole_answer = 0, True
                return ""
            if any(s.startswith(answer) for s in _WHOLE_STARTS):
                return ""  # blank, or a start that may still become one: decided by the next text
        start = self.text.find(CALL_START, self.sent)
        end = start if start >= 0 else len(self.text) - may_begin(self.text[self.sent :], CALL_START)
        if start >= 0:
            self.held_from = self.read = start
        end = max(self.sent, len(self.text[:end].rstrip()))  # blanks wait: before a call, they are no content
        content, self.sent = self.text[self.sent : end], end
        return content

    def _next_call(self, entries: dict[int, dict[str, Any]]) -> bool:
        if self.whole_answer:
            head = (_NEXT_IN_LIST if self.calls else _ANSWER_HEAD).match(self.text, self.read)
            name = None if head is None else _name(head)
            if name not in self.parser.tool_names:
                return False  # not (yet) a call's head: the answer's end decides
            self._begin(name, head.end(), entries)
            return True
        while (start := self.text.find(CALL_START, self.read)) >= 0:
            inside = start + len(CALL_START)
            end = self.text.find(CALL_END, inside)
            head = _BLOCK_HEAD.match(self.text, inside, len(self.text) if end < 0 else end)  # within the block
            if head is not None:
                self._begin(_name(head), head.end(), entries)
                return True
            if end < 0:
                return False  # the block may still show a head
            self._whole_block(self.text[inside:end], entries)
            self.read = end + len(CALL_END)
        return False

    def _whole_block(self, block: str, entries: dict[int, dict[str, Any]]) -> None:
        if (call := _call_of(_json(block.strip()))) is not None:
            self._add_whole(call, entries)

    def _finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the answer's end: the content not sent yet, and the last calls' entries.
        Where calls were read, the content is the text before the first (None if
        blank) and the text after each is no part of the message, as vLLM's hermes
        reader has it; where none was, the whole answer's parse decides (all content
        where a block is not a call)."""
        entries: dict[int, dict[str, Any]] = {}
        if self.held_from is not None and self.value is None and not self.whole_answer:
            if (start := self.text.find(CALL_START, self.read)) >= 0:  # a block with no end tag
                self._whole_block(self.text[start + len(CALL_START) :], entries)
        if self.calls:
            before = self.text[: self.held_from]
            rest = before[self.sent :] if before.strip() else ""
            self.calls_made = self.value is None
        else:
            content, calls = self.parser.whole(self.text)
            rest = (content or "")[self.sent :] if calls else self.text[self.sent :]
            for call in calls:
                self._add_whole(call, entries)
            self.calls_made = bool(calls)
        self.sent = len(self.text)
        return rest, [{"index": i, **entry} for i, entry in sorted(entries.items())]


@dataclass
class StreamedArguments:
    """A named forced call, streamed as OpenAI streams one: no content; the first
    delta's entry carries the call's id, type and name, and every step's text is the
    next piece of its arguments."""

    name: str
    call: ToolCall | None = None
    calls_made: bool = True

    def step(self, new_text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        if self.call is None:
            self.call = ToolCall(self.name, new_text)
            return "", [{"index": 0, **self.call.described()}]
        return "", [{"index": 0, "function": {"arguments": new_text}}] if new_text else []


# A call's head in a "required" answer, as the guide writes it: the list's opening
# bracket (or the previous call's closing brace and a comma) up to its arguments.
_CALL_HEAD = re.compile(r"\s*(?:\[|\}\s*,)\s*" + _NAME_THEN_ARGUMENTS)


@dataclass
class StreamedCallList(_CallsAsWritten):
    """A "required" answer streamed as OpenAI streams several calls, each as it is
    written (`_CallsAsWritten`). The answer finishes "tool_calls" where the whole is a
    list of calls; cut short (max_tokens), the calls begun stay as sent and it finishes
    as the answer did."""

    calls_made: bool = False

    def step(self, new_text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += new_text
        entries = self._read_calls()
        if finished:
            self.calls_made = bool(self.calls) and isinstance(_json(self.text), list)
        return "", entries

    def _next_call(self, entries: dict[int, dict[str, Any]]) -> bool:
        head = _CALL_HEAD.match(self.text, self.read)
        if head is not None:
            self._begin(_name(head), head.end(), entries)
        return head is not None
