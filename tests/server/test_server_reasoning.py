"""A thinking model's answers through the whole server, in process (`--reasoning-parser`,
server/reasoning.py), and the chat template's request fields (`chat_template_kwargs`,
`continue_final_message`), on the scripted target of test_server_tools.py: the target
thinks in a `<think>` block, then answers or calls a tool."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai.types.responses import Response

from tests.server.test_responses import events
from tests.server.test_server_tools import TEMPLATE, TOOLS, body, scripted_tokenizer, serving, streamed

THOUGHT = ["<think>", "the", "user", "asks.", "</think>"]
ANSWER = ["It", "is", "sunny."]
JSON_ANSWER = ['{"city":', '"Paris"}']
CALL = ["<tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}', "</tool_call>"]
# Qwen3's switch, as its template reads it: thinking off writes an empty block into the prompt.
THINKING_TEMPLATE = TEMPLATE + "{% if enable_thinking == false %} </think>{% endif %}"
# A template that writes each turn's reasoning given back, as Qwen3's does for the question being answered.
GIVEN_BACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
    "{% if m['reasoning_content'] is defined %}{{ m['reasoning_content'] }} {% endif %}{% endfor %}go"
)


async def post(
    requests: list[tuple[str, dict]],
    script: list[str],
    parser: str | None = "qwen3",
    template: str = THINKING_TEMPLATE,
    tool_call_parser: str | None = None,
    default_kwargs: dict | None = None,
) -> list[httpx.Response]:
    """Each (path, body) sent in turn to one server whose target answers `script`; a
    body may be a function of the responses before it."""
    tokenizer = scripted_tokenizer(script)
    tokenizer.use_chat_template(template)
    settings = dict(
        reasoning_parser=parser, tool_call_parser=tool_call_parser, default_chat_template_kwargs=default_kwargs or {}
    )
    async with serving(tokenizer, **settings) as client:
        sent: list[httpx.Response] = []
        for path, body in requests:
            sent.append(await client.post(path, json=body(sent) if callable(body) else body))
        return sent


def chats(*bodies: dict) -> list[tuple[str, dict]]:
    return [("/v1/chat/completions", b) for b in bodies]


def joined(chunks: list[dict], field: str) -> str:
    return "".join(c["choices"][0]["delta"].get(field) or "" for c in chunks if c["choices"])


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_the_reasoning_comes_apart_from_the_answer_whole_and_streamed(parser):
    whole, stream = asyncio.run(post(chats(body(), body(stream=True)), THOUGHT + ANSWER, parser))
    choice = whole.json()["choices"][0]
    message = choice["message"]
    assert message["reasoning"] == message["reasoning_content"] == "the user asks."
    assert message["content"] == "It is sunny." and choice["finish_reason"] == "stop"
    chunks = streamed(stream)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert joined(chunks, "reasoning") == joined(chunks, "reasoning_content") == "the user asks."
    assert joined(chunks, "content") == "It is sunny."
    assert "<think>" not in stream.text and "</think>" not in stream.text


def test_a_call_after_the_reasoning_is_read_from_the_content():
    whole, stream = asyncio.run(
        post(chats(body(tools=TOOLS), body(tools=TOOLS, stream=True)), THOUGHT + CALL, tool_call_parser="hermes")
    )
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning"] == "the user asks."
    (call,) = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    chunks = streamed(stream)
    assert joined(chunks, "reasoning") == "the user asks." and joined(chunks, "content") == ""
    head, *pieces = [c for chunk in chunks for c in chunk["choices"][0]["delta"].get("tool_calls", [])]
    assert head["function"]["name"] == call["function"]["name"]
    arguments = "".join(entry["function"].get("arguments", "") for entry in (head, *pieces))
    assert arguments == call["function"]["arguments"]


def test_a_structure_holds_from_the_reasoning_s_end_on():
    """JSON mode and a forced call: the block is free text, the JSON starts after `</think>`."""
    forced = {"type": "function", "function": {"name": "get_weather"}}
    json_mode = {"response_format": {"type": "json_object"}}
    whole, stream, called = asyncio.run(
        post(
            chats(body(**json_mode), body(**json_mode, stream=True), body(tools=TOOLS, tool_choice=forced)),
            THOUGHT + JSON_ANSWER,
        )
    )
    message = whole.json()["choices"][0]["message"]
    assert message["reasoning"] == "the user asks." and json.loads(message["content"]) == {"city": "Paris"}
    chunks = streamed(stream)
    assert joined(chunks, "reasoning") == "the user asks." and joined(chunks, "content") == message["content"]
    message = called.json()["choices"][0]["message"]
    (call,) = message["tool_calls"]
    assert message["reasoning"] == "the user asks." and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_an_answer_cut_off_while_it_thinks_is_all_reasoning():
    whole, stream = asyncio.run(post(chats(body(max_tokens=3), body(max_tokens=3, stream=True)), THOUGHT + ANSWER))
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["reasoning"] == "the user" and choice["message"]["content"] is None
    assert joined(streamed(stream), "reasoning") == "the user"


def test_include_reasoning_false_leaves_it_out_and_no_parser_leaves_the_text_whole():
    (left_out,) = asyncio.run(post(chats(body(include_reasoning=False)), THOUGHT + ANSWER))
    (unread,) = asyncio.run(post(chats(body()), THOUGHT + ANSWER, parser=None))
    message = left_out.json()["choices"][0]["message"]
    assert message["content"] == "It is sunny." and "reasoning" not in message
    message = unread.json()["choices"][0]["message"]
    assert message["content"].strip() == "<think> the user asks. </think> It is sunny." and "reasoning" not in message


def test_a_template_that_opens_the_block_starts_the_answer_in_it():
    """The prompt ends with `<think>`: the target goes on from there, writing no tag of its own."""
    (whole,) = asyncio.run(post(chats(body()), THOUGHT + ANSWER, template=TEMPLATE + " <think>"))
    message = whole.json()["choices"][0]["message"]
    assert message["reasoning"] == "the user asks." and message["content"] == "It is sunny."


def test_chat_template_kwargs_reach_the_template():
    """enable_thinking false puts the empty block in the prompt: the target answers without thinking."""
    (off,) = asyncio.run(post(chats(body(chat_template_kwargs={"enable_thinking": False})), THOUGHT + ANSWER))
    choice = off.json()["choices"][0]
    assert choice["message"]["content"].strip() == "It is sunny." and choice["message"]["reasoning"] is None


def test_the_servers_default_template_kwargs_give_way_to_the_requests():
    on = body(chat_template_kwargs={"enable_thinking": True})
    off, thinks = asyncio.run(post(chats(body(), on), THOUGHT + ANSWER, default_kwargs={"enable_thinking": False}))
    assert off.json()["choices"][0]["message"]["reasoning"] is None
    assert thinks.json()["choices"][0]["message"]["reasoning"] == "the user asks."


def test_continue_final_message_goes_on_with_the_last_message():
    turns = [{"role": "user", "content": "weather"}, {"role": "assistant", "content": "It is"}]
    fields = {"messages": turns, "continue_final_message": True, "add_generation_prompt": False}
    tokenize = {"messages": turns, "continue_final_message": True, "return_token_strs": True}
    whole, tokens = asyncio.run(post([*chats(body(**fields)), ("/tokenize", tokenize)], ANSWER, parser=None))
    assert whole.json()["choices"][0]["message"]["content"].strip() == "sunny."
    assert tokens.json()["token_strs"][-2:] == ["It", "is"]  # no "go": no new turn opened


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"messages": [], "continue_final_message": True, "add_generation_prompt": False}, "messages"),
        ({"include_reasoning": "yes"}, "include_reasoning"),
        (
            {
                "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}],
                "continue_final_message": True,
                "add_generation_prompt": False,
            },
            "messages",
        ),
    ],
)
def test_what_the_template_cannot_take_is_refused_naming_its_field(fields, param):
    refused, tokenize = asyncio.run(
        post([*chats(body(**fields)), ("/tokenize", {"messages": body()["messages"], **fields})], ANSWER)
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    if param != "include_reasoning":
        assert tokenize.status_code == 400 and tokenize.json()["error"]["param"] == param


def test_a_response_holds_the_reasoning_as_an_item_whole_and_streamed():
    ask = {"input": "weather", "temperature": 0, "max_output_tokens": 20}
    whole, stream, cut, cut_stream = asyncio.run(
        post(
            [
                ("/v1/responses", ask),
                ("/v1/responses", {**ask, "stream": True}),
                ("/v1/responses", {**ask, "max_output_tokens": 3}),
                ("/v1/responses", {**ask, "max_output_tokens": 3, "stream": True}),
            ],
            THOUGHT + ANSWER,
        )
    )
    response = Response.model_validate(whole.json())
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == ["the user asks."]
    assert message.type == "message" and response.output_text == "It is sunny."
    sent = events(stream)
    assert "".join(e.delta for e in sent if e.type == "response.reasoning_text.delta") == "the user asks."
    assert "".join(e.delta for e in sent if e.type == "response.output_text.delta") == "It is sunny."
    (done,) = [e for e in sent if e.type == "response.reasoning_text.done"]
    assert done.text == "the user asks." and done.output_index == 0
    final = sent[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content == reasoning.content and final.output_text == "It is sunny."
    cut_off = Response.model_validate(cut.json())
    assert cut_off.status == "incomplete" and [item.type for item in cut_off.output] == ["reasoning"]
    assert [item.type for item in events(cut_stream)[-1].response.output] == ["reasoning"]


def test_reasoning_given_back_reaches_the_template():
    """An assistant turn's `reasoning` or `reasoning_content` (chat), a reasoning item
    before its calls (Responses), and a kept response's reasoning (previous_response_id)."""
    turns = [{"role": "user", "content": "weather"}, {"role": "assistant", "content": "sunny"}]
    with_reasoning = [turns[0], {**turns[1], "reasoning": "one two three"}, {"role": "user", "content": "and?"}]
    older_name = [turns[0], {**turns[1], "reasoning_content": "one two three"}, {"role": "user", "content": "and?"}]
    plain = [*turns, {"role": "user", "content": "and?"}]
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    thought = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "one two three"}]}
    sent = asyncio.run(
        post(
            [
                *[("/tokenize", {"messages": m}) for m in (plain, with_reasoning, older_name)],
                (
                    "/v1/responses",
                    {"input": [{"role": "user", "content": "weather"}, call, output], "max_output_tokens": 1},
                ),
                (
                    "/v1/responses",
                    {"input": [{"role": "user", "content": "weather"}, thought, call, output], "max_output_tokens": 1},
                ),
            ],
            ANSWER,
            parser=None,
            template=GIVEN_BACK_TEMPLATE,
        )
    )
    counts = [r.json()["count"] for r in sent[:3]] + [r.json()["usage"]["input_tokens"] for r in sent[3:]]
    assert counts[1] == counts[2] == counts[0] + 3 and counts[4] == counts[3] + 3

    def next_turn(sent):
        return {"input": "and?", "previous_response_id": sent[-1].json()["id"], "max_output_tokens": 1}

    def unthought_turn(sent):
        return {
            "input": [
                {"role": "user", "content": "weather"},
                {"role": "assistant", "content": "It is sunny."},
                {"role": "user", "content": "and?"},
            ],
            "max_output_tokens": 1,
        }

    kept = {"input": "weather", "max_output_tokens": 20, "temperature": 0}
    steps = [("/v1/responses", kept), ("/v1/responses", next_turn), ("/v1/responses", unthought_turn)]
    first, second, unthought = asyncio.run(post(steps, THOUGHT + ANSWER, template=GIVEN_BACK_TEMPLATE))
    assert [item["type"] for item in first.json()["output"]] == ["reasoning", "message"]
    # "the user asks." came back with the kept turn: 3 words more than the same turns without it.
    assert second.json()["usage"]["input_tokens"] == unthought.json()["usage"]["input_tokens"] + 3


def test_usage_counts_the_reasoning_tokens_whole_streamed_and_in_responses():
    """OpenAI's `completion_tokens_details.reasoning_tokens`: the tokens up to `</think>`
    (5 of THOUGHT's), all of an answer cut off inside the block, none without a block;
    the Responses API's `output_tokens_details`; no field without a parser."""
    usage_every_chunk = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    ask = {"input": "weather", "temperature": 0, "max_output_tokens": 20}
    whole, stream, two, cut, off, response, response_stream = asyncio.run(
        post(
            [
                *chats(
                    body(),
                    body(**usage_every_chunk),
                    body(n=2, temperature=0),
                    body(max_tokens=3),
                    body(chat_template_kwargs={"enable_thinking": False}),
                ),
                ("/v1/responses", ask),
                ("/v1/responses", {**ask, "stream": True}),
            ],
            THOUGHT + ANSWER,
        )
    )
    usage = whole.json()["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 5} and usage["completion_tokens"] > 5
    chunks = streamed(stream)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage
    counts = [c["usage"]["completion_tokens_details"]["reasoning_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(
        c["usage"]["completion_tokens_details"]["reasoning_tokens"] <= c["usage"]["completion_tokens"] for c in chunks
    )
    assert two.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 10}
    assert cut.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    assert off.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert Response.model_validate(response.json()).usage.output_tokens_details.reasoning_tokens == 5
    assert events(response_stream)[-1].response.usage.output_tokens_details.reasoning_tokens == 5
    (unread,) = asyncio.run(post(chats(body()), THOUGHT + ANSWER, parser=None))
    assert "completion_tokens_details" not in unread.json()["usage"]
