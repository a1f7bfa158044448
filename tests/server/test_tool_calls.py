"""Tool calls read from chat answers: the `hermes` blocks as vLLM reads them, and the
whole-answer calls `qwen2_5_coder` also takes; a stream, cut anywhere, sends what the
whole answer's parse gives."""

from __future__ import annotations

import json

import pytest

from specserve.server.tool_calls import CALL_START, ForcedToolCalls, ToolCallParser

HERMES = ToolCallParser("hermes", frozenset({"get_weather", "add"}))
CODER = ToolCallParser("qwen2_5_coder", frozenset({"get_weather", "add"}))
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ADD = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


def calls_of(parsed) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parsed
    return content, [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize("parser", [HERMES, CODER])
@pytest.mark.parametrize(
    "answer, expected",
    [
        ("The weather is fine.", ("The weather is fine.", [])),
        (f"<tool_call>\n{PARIS}\n</tool_call>", (None, [("get_weather", {"city": "Paris"})])),
        (
            f"Let me check.\n<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>{ADD}</tool_call>",
            ("Let me check.\n", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
        ),
        (f"<tool_call>\n{PARIS}\n", (None, [("get_weather", {"city": "Paris"})])),  # cut before its end tag
        # A block that is not a call object: nothing is a call.
        (f"<tool_call>{PARIS}</tool_call><tool_call>not json</tool_call>", None),
        ('<tool_call>{"arguments": {}}</tool_call>', None),
        (f"<tool_call>\n{PARIS[:-5]}", None),  # its JSON cut short
    ],
)
def test_blocks_are_calls_as_vllms_hermes_parser_reads_them(parser, answer, expected):
    assert calls_of(parser.parse(answer)) == (expected or (answer, []))


@pytest.mark.parametrize(
    "answer, calls",
    [
        (PARIS, [("get_weather", {"city": "Paris"})]),
        (f"```json\n{PARIS}\n```", [("get_weather", {"city": "Paris"})]),
        (f"\n```\n{PARIS}\n```\n", [("get_weather", {"city": "Paris"})]),
        (f"[{PARIS}, {ADD}]", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
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
    "Text then <tool_call>broken</tool_call> and more text",
    f"```json\n{PARIS}\n```",
    f"\n{PARIS}",
    "```python\nprint('hi')\n```",
    '{"not": "a call"} said the model',
    "``",
    "",
]


@pytest.mark.parametrize("parser", [HERMES, CODER], ids=["hermes", "qwen2_5_coder"])
@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_a_stream_cut_anywhere_sends_the_whole_answers_content_and_calls(parser, answer, piece):
    stream = parser.stream()
    sent = [stream.add(answer[i : i + piece]) for i in range(0, len(answer), piece)]
    rest, calls = stream.finish()
    content, whole_calls = parser.parse(answer)
    assert "".join(sent) + rest == (content or "")
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    assert all(CALL_START not in text for text in sent) or not whole_calls


def test_a_stream_sends_text_before_a_call_as_it_comes_and_holds_the_call():
    stream = HERMES.stream()
    assert stream.add("Let me check the weather.") == "Let me check the weather."
    assert stream.add(" <tool") == ""  # what may begin a block is held, and blanks before it
    assert stream.add("_call>{") == ""
    assert stream.add(PARIS[1:] + "</tool_call>") == ""
    rest, (call,) = stream.finish()
    assert rest == " " and call.name == "get_weather"  # the blank belongs to the content before the call
    blank = HERMES.stream()
    assert blank.add("\n\n") == "" and blank.add(f"<tool_call>{PARIS}</tool_call>") == ""
    assert blank.finish()[0] == ""  # content None: no blank text sent before the call
    coder = CODER.stream()
    assert coder.add("```") == "" and coder.add("python\nx = 1") == "```python\nx = 1"  # a fence of code
    assert coder.add("\n```") == "\n```"


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
