"""Tool calls read from chat answers: the `hermes` blocks as vLLM reads them, and the
whole-answer calls `qwen2_5_coder` also takes; a stream, cut anywhere, sends what the
whole answer's parse gives, each call as it is written."""

from __future__ import annotations

import json
import random

import pytest

from specserve.server.tool_calls import CALL_END, CALL_START, ForcedToolCalls, ToolCallParser

HERMES = ToolCallParser("hermes", frozenset({"get_weather", "add"}))
CODER = ToolCallParser("qwen2_5_coder", frozenset({"get_weather", "add"}))
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ADD = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


def calls_of(parsed) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parsed
    return content, [(call.name, call.arguments) for call in calls]


PARIS_CALL = ("get_weather", '{"city": "Paris"}')
ADD_CALL = ("add", '{"a": 1, "b": 2}')


@pytest.mark.parametrize("parser", [HERMES, CODER])
@pytest.mark.parametrize(
    "answer, expected",
    [
        ("The weather is fine.", ("The weather is fine.", [])),
        (f"<tool_call>\n{PARIS}\n</tool_call>", (None, [PARIS_CALL])),
        (
            f"Let me check.\n<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>{ADD}</tool_call>",
            ("Let me check.\n", [PARIS_CALL, ADD_CALL]),
        ),
        (f"<tool_call>\n{PARIS}\n", (None, [PARIS_CALL])),  # cut before its end tag
        # The arguments as the model wrote them; a call written keys first is read whole.
        ('<tool_call>{"name":"add","arguments":{"a":1}}</tool_call>', (None, [("add", '{"a":1}')])),
        ('<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>', (None, [("add", '{"a": 1}')])),
        # Text after the first block is no part of the message: between blocks, or a block that is no call.
        (f"<tool_call>{PARIS}</tool_call> and <tool_call>not json</tool_call> so", (None, [PARIS_CALL])),
        # No block is a call: the whole answer is content.
        ("<tool_call>not json</tool_call>", None),
        ('<tool_call>{"arguments": {}}</tool_call>', None),
        ('<tool_call>{"name": "add", "argu', None),
        # Cut short inside its arguments: the call as far as it was written.
        (f"<tool_call>\n{PARIS[:-5]}", (None, [("get_weather", '{"city": "Par')])),
    ],
)
def test_blocks_are_calls_as_vllms_hermes_parser_reads_them(parser, answer, expected):
    assert calls_of(parser.parse(answer)) == (expected or (answer, []))


@pytest.mark.parametrize(
    "answer, calls",
    [
        (PARIS, [PARIS_CALL]),
        (f"```json\n{PARIS}\n```", [PARIS_CALL]),
        (f"\n```\n{PARIS}\n```\n", [PARIS_CALL]),
        (f"[{PARIS}, {ADD}]", [PARIS_CALL, ADD_CALL]),
        ('{"arguments": {"a": 1}, "name": "add"}', [("add", '{"a": 1}')]),  # read whole at the end
        ('{"name": "delete_everything", "arguments": {}}', []),  # not one of the request's tools
        (f"Here is the call: {PARIS}", []),  # not the whole answer
        ('```json\n{"city": "Paris"}\n```', []),  # JSON, but no call
    ],
)
def test_qwen2_5_coder_also_takes_an_answer_that_is_a_whole_call(answer, calls):
    assert calls_of(CODER.parse(answer)) == ((None, calls) if calls else (answer, []))
    assert HERMES.parse(answer) == (answer, [])  # vLLM's hermes takes blocks alone


ANSWERS = [
    "Plain text, no call at all, with a < sign and <tool_ but no call.",
    f"Let me check.\n<tool_call>\n{PARIS}\n</tool_call>",
    f"<tool_call>{PARIS}</tool_call><tool_call>{ADD}</tool_call>",
    f"<tool_call>{PARIS}</tool_call> then <tool_call>broken</tool_call>",
    '<tool_call>{"arguments": {"a": [1, "}"]}, "name": "add"}</tool_call><tool_call>{"name": "add", "arguments": {}}',
    "Text then <tool_call>broken</tool_call> and more text",
    f"```json\n{PARIS}\n```",
    f"\n[{PARIS},\n {ADD}]",
    '{"arguments": {}, "name": "add"}',
    f"\n{PARIS}",
    f"<tool_call>\n{PARIS[:-5]}",
    '<tool_call>{"name": "a</tool_call>b", "arguments": {}}',  # a head is read within its block
    "```python\nprint('hi')\n```",
    '{"not": "a call"} said the model',
    "``",
    "",
]


def streamed_calls(entries: list[dict]) -> list[tuple[str, str]]:
    """The calls a stream's tool_calls entries make, put together by index."""
    calls: dict[int, list[str]] = {}
    for entry in entries:
        if "id" in entry:
            assert entry["index"] not in calls and entry["index"] == len(calls), "a call begun twice, or out of order"
            calls[entry["index"]] = [entry["function"]["name"], ""]
        calls[entry["index"]][1] += entry["function"].get("arguments", "")
    return [tuple(call) for call in calls.values()]


def stream_pieces(parser: ToolCallParser, answer: str, piece: int) -> tuple[list[str], list[list[dict]], bool]:
    """Each step's content and entries, the answer sent `piece` characters a step; and calls_made."""
    stream = parser.stream()
    steps = [stream.step(answer[i : i + piece], i + piece >= len(answer)) for i in range(0, len(answer), piece)]
    if not answer:
        steps = [stream.step("", True)]
    return [content for content, _ in steps], [entries for _, entries in steps], stream.calls_made


@pytest.mark.parametrize("parser", [HERMES, CODER], ids=["hermes", "qwen2_5_coder"])
@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_a_stream_cut_anywhere_sends_the_whole_answers_content_and_calls(parser, answer, piece):
    contents, entries, calls_made = stream_pieces(parser, answer, piece)
    content, whole_calls = parser.parse(answer)
    assert "".join(contents) == (content or "")
    assert streamed_calls([e for step in entries for e in step]) == [(c.name, c.arguments) for c in whole_calls]
    assert all(CALL_START not in text for text in contents) or not whole_calls
    assert calls_made == (bool(whole_calls) and answer != f"<tool_call>\n{PARIS[:-5]}")  # a cut call is not made


@pytest.mark.parametrize("parser", [HERMES, CODER], ids=["hermes", "qwen2_5_coder"])
def test_a_call_is_streamed_as_it_is_written(parser):
    """Its name once the head is written, before its arguments end; then the arguments
    a piece a step; the next call's name when its head is written."""
    answer = f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>{ADD}</tool_call>"
    if parser is CODER:
        answer = f"[{PARIS},\n {ADD}]"
    _, entries, calls_made = stream_pieces(parser, answer, 1)
    named = [i for i, step in enumerate(entries) for e in step if "id" in e]
    argued = [i for i, step in enumerate(entries) for e in step if e["function"].get("arguments")]
    assert len(named) == 2 and calls_made
    assert answer[: named[0] + 1].endswith('"arguments": {')  # the first piece of the arguments comes with the name
    assert len([i for i in argued if named[0] <= i < named[1]]) == len(PARIS_CALL[1])  # one character a step
    assert answer[: named[1] + 1].endswith('"arguments": {')


def test_a_stream_sends_text_before_a_call_as_it_comes_and_holds_the_call():
    stream = HERMES.stream()
    assert stream.step("Let me check the weather.", False) == ("Let me check the weather.", [])
    assert stream.step(" <tool", False) == ("", [])  # what may begin a block is held, and blanks before it
    assert stream.step("_call>{", False) == ("", [])
    content, entries = stream.step(PARIS[1:] + "</tool_call>", True)
    assert content == " " and streamed_calls(entries) == [PARIS_CALL]  # the blank belongs to the content
    blank = HERMES.stream()
    assert blank.step("\n\n", False) == ("", [])
    content, entries = blank.step(f"<tool_call>{PARIS}</tool_call>", True)
    assert content == "" and streamed_calls(entries) == [PARIS_CALL]  # content None: no blank text sent
    coder = CODER.stream()
    assert coder.step("```", False) == ("", [])
    assert coder.step("python\nx = 1", False) == ("```python\nx = 1", [])  # a fence of code
    assert coder.step("\n```", True) == ("\n```", [])


REQUIRED_ANSWER = (
    '[\n  {"name": "paint", "arguments": {"color": "r\\"e}d", "sizes": [1, {"a": [2]}]}},\n'
    '  {"name": "ping", "arguments":   {}}\n]'
)


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_a_required_answer_streams_each_call_as_it_is_written(piece):
    """tool_choice "required": each call's name as soon as it is written, then its
    arguments piece by piece (braces and quotes inside strings read as text), which put
    together are the whole answer's calls, the arguments as the model wrote them."""
    stream = ForcedToolCalls("required").stream()
    entries = []
    for start in range(0, len(REQUIRED_ANSWER), piece):
        content, step_entries = stream.step(
            REQUIRED_ANSWER[start : start + piece], start + piece >= len(REQUIRED_ANSWER)
        )
        assert content == "" and len({e["index"] for e in step_entries}) == len(step_entries)
        entries += step_entries
    assert stream.calls_made
    calls: dict[int, dict] = {}
    for entry in entries:
        call = calls.setdefault(entry["index"], {"id": entry.get("id"), "name": entry["function"].get("name"), "a": ""})
        call["a"] += entry["function"].get("arguments", "")
    _, whole = ForcedToolCalls("required").parse(REQUIRED_ANSWER)
    assert [(c["name"], c["a"]) for c in calls.values()] == [(c.name, c.arguments) for c in whole]
    assert [json.loads(c.arguments) for c in whole] == [{"color": 'r"e}d', "sizes": [1, {"a": [2]}]}, {}]
    assert all(c["id"] for c in calls.values())
    if piece == 1:  # the first call's head comes before its arguments end
        first_args = [e for e in entries if e["index"] == 0 and e["function"].get("arguments")]
        assert len(first_args) > 10


def test_a_required_answer_cut_short_keeps_the_calls_sent_and_is_content_whole():
    cut = REQUIRED_ANSWER[:-5]  # inside the second call's arguments
    stream = ForcedToolCalls("required").stream()
    _, entries = stream.step(cut, finished=True)
    assert [e["function"].get("name") for e in entries] == ["paint", "ping"] and not stream.calls_made
    assert ForcedToolCalls("required").parse(cut) == (cut, [])


FRAGMENTS = [
    CALL_START,
    CALL_END,
    PARIS,
    ADD,
    PARIS[:17],
    PARIS[17:],
    '"',
    "{",
    "}",
    "[",
    "]",
    ",",
    " ",
    "\n",
    "```json\n",
    "```",
    "x",
    '\\"',
    '"name": ',
    '"arguments": ',
    '"add"',
    "<tool",
    "_call>",
]


@pytest.mark.parametrize("seed", range(4))
def test_random_answers_read_alike_whole_and_streamed(seed):
    """Answers strung from the pieces calls are made of, in any order, read in random
    steps: the stream's content and calls are the whole answer's, and nothing raises."""
    rng = random.Random(seed)
    for _ in range(300):
        answer = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 14)))
        for parser in (HERMES, CODER):
            stream, contents, entries, at = parser.stream(), [], [], 0
            while True:
                step = rng.randint(1, 6)
                content, step_entries = stream.step(answer[at : at + step], at + step >= len(answer))
                contents.append(content)
                entries += step_entries
                at += step
                if at >= len(answer):
                    break
            content, calls = parser.parse(answer)
            assert "".join(contents) == (content or ""), answer
            assert streamed_calls(entries) == [(c.name, c.arguments) for c in calls], answer
            assert content == answer or calls, answer  # no call: the whole answer is content
