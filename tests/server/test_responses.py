"""OpenAI's Responses API (`POST /v1/responses`, server/responses.py) through the whole
app, in process, on the scripted target of test_server_tools.py: a response holds the
answer the chat endpoint gives the same conversation, whole and as OpenAI's typed events,
each checked against the `openai` package's own models."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.responses.response_item_list import ResponseItemList
from pydantic import TypeAdapter

from specserve.server.protocol import APIError
from specserve.server.responses import ResponsesRequest, ResponseStore, StoredResponse
from tests.server.test_server_tools import SCRIPTS, scripted_tokenizer, serving

EVENT = TypeAdapter(ResponseStreamEvent)
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


async def post(requests: list[tuple[str, dict]], parser: str | None = "hermes") -> list[httpx.Response]:
    """Each (path, body) sent in turn to one server whose target answers the hermes script."""
    async with serving(scripted_tokenizer(SCRIPTS["hermes"]), tool_call_parser=parser) as client:
        return [await client.post(path, json=body) for path, body in requests]


def events(response: httpx.Response) -> list:
    """A stream's events, each read by the openai package's model of its type."""
    assert response.headers["content-type"].startswith("text/event-stream")
    read = []
    for block in response.text.strip().split("\n\n"):
        kind, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}"
        read.append(EVENT.validate_python(payload))
    assert [e.sequence_number for e in read] == list(range(len(read)))
    return read


def test_a_response_holds_the_chat_answer_whole_and_streamed():
    ask = {"temperature": 0, "max_output_tokens": 20, "top_logprobs": 1, "include": ["reasoning.encrypted_content"]}
    chat, whole, stream = asyncio.run(
        post(
            [
                (
                    "/v1/chat/completions",
                    {
                        "messages": [{"role": "user", "content": "weather"}],
                        "temperature": 0,
                        "max_tokens": 20,
                        "logprobs": True,
                        "top_logprobs": 1,
                    },
                ),
                ("/v1/responses", {"input": "weather", **ask}),
                (
                    "/v1/responses",
                    {
                        "input": [{"role": "user", "content": [{"type": "input_text", "text": "weather"}]}],
                        "stream": True,
                        **ask,
                    },
                ),
            ],
        )
    )
    answer = chat.json()["choices"][0]
    response = Response.model_validate(whole.json())
    assert response.status == "completed" and response.output_text == answer["message"]["content"]
    assert [lp.token for lp in response.output[0].content[0].logprobs] == [
        lp["token"] for lp in answer["logprobs"]["content"]
    ]
    assert response.usage.input_tokens == chat.json()["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == chat.json()["usage"]["completion_tokens"]

    sent = events(stream)
    assert [e.type for e in sent[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert sent[0].response.status == "in_progress"
    deltas = [e for e in sent if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == response.output_text
    assert sum(len(e.logprobs) for e in deltas) == len(answer["logprobs"]["content"])
    assert [e.type for e in sent[-4:]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert sent[-4].text == response.output_text and sent[-1].response.output_text == response.output_text
    assert sent[-1].response.usage == response.usage


def test_a_call_comes_back_as_a_function_call_item_whole_and_streamed():
    ask = {"input": "weather", "temperature": 0, "max_output_tokens": 20, "tools": TOOLS}
    whole, stream = asyncio.run(post([("/v1/responses", ask), ("/v1/responses", {**ask, "stream": True})]))
    (call,) = Response.model_validate(whole.json()).output
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call",
        "get_weather",
        {"city": "Paris"},
        "completed",
    )
    sent = events(stream)
    deltas = [e for e in sent if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) >= 2  # the arguments as they are written
    assert [e.type for e in sent] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *[e.type for e in deltas],
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert sent[2].item.name == "get_weather" and sent[2].item.status == "in_progress"
    assert "".join(e.delta for e in deltas) == sent[-3].arguments and json.loads(sent[-3].arguments) == {
        "city": "Paris"
    }
    (done,) = sent[-1].response.output
    assert done.call_id == sent[2].item.call_id and done.arguments == sent[-3].arguments


def test_a_conversation_with_calls_and_their_outputs_reads_as_the_chat_one():
    """instructions, a call the model made, and its output, against the same chat turns:
    the same prompt (its token count) and the same answer."""
    items = [
        {"role": "user", "content": "weather"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    request = ResponsesRequest.model_validate({"input": items, "instructions": "be brief"})
    assert request.instruction_turns() + request.input_turns == messages
    chat, response = asyncio.run(
        post(
            [
                (
                    "/v1/chat/completions",
                    {"messages": messages, "tools": CHAT_TOOLS, "temperature": 0, "max_tokens": 5},
                ),
                (
                    "/v1/responses",
                    {
                        "input": items,
                        "instructions": "be brief",
                        "tools": TOOLS,
                        "temperature": 0,
                        "max_output_tokens": 5,
                    },
                ),
            ]
        )
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["input_tokens"] == chat.json()["usage"]["prompt_tokens"]
    answered, message = Response.model_validate(response.json()), chat.json()["choices"][0]["message"]
    assert answered.output_text == (message["content"] or "")
    calls = [(item.name, item.arguments) for item in answered.output if item.type == "function_call"]
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]


def test_a_response_cut_by_max_output_tokens_is_incomplete():
    ask = {"input": "weather", "temperature": 0, "max_output_tokens": 3}
    whole, stream = asyncio.run(post([("/v1/responses", ask), ("/v1/responses", {**ask, "stream": True})]))
    response = Response.model_validate(whole.json())
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    last = events(stream)[-1]
    assert last.type == "response.incomplete" and last.response.output_text == response.output_text


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"background": True, "store": False}, "background"),
        ({"input": []}, "input"),
        ({"input": ["weather"]}, "input[0]"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]},
            "input[0].arguments",
        ),
        ({"metadata": {"a": 1}}, "metadata.a"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "critic", "content": "hm"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
        ({"input": [{"type": "reasoning", "summary": "hm"}, "weather"]}, "input[0].summary"),
        ({"input": [{"type": "reasoning", "content": [{"type": "reasoning_text"}]}]}, "input[0].content"),
        ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"truncation": "middle"}, "truncation"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ],
)
def test_what_cannot_be_served_is_refused_naming_its_field(fields, param):
    (response,) = asyncio.run(post([("/v1/responses", {"input": "weather", **fields})]))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_text_format_and_tool_choice_become_the_chat_requests():
    request = ResponsesRequest.model_validate(
        {
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
            "tools": TOOLS,
            "tool_choice": {"type": "function", "name": "get_weather"},
            "truncation": "auto",
            "max_output_tokens": 7,
        }
    )
    chat = request.chat_request()
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True},
    }
    assert chat.forced_tool() == "get_weather" and chat.tools[0].function.name == "get_weather"
    assert chat.truncate_prompt_tokens == -1 and chat.requested_max_tokens() == 7
    with pytest.raises(APIError):
        ResponsesRequest.model_validate({"input": "x", "background": True, "stream": True}).chat_request()


async def conversation(steps: list) -> list[httpx.Response]:
    """Each step a (method, path, body) or a function of the responses so far giving one,
    sent in turn to one server (`serving`)."""
    sent: list[httpx.Response] = []
    async with serving(scripted_tokenizer(SCRIPTS["hermes"]), tool_call_parser="hermes") as client:
        for step in steps:
            method, path, body = step(sent) if callable(step) else step
            sent.append(await client.request(method, path, json=body))
    return sent


def test_previous_response_id_continues_the_conversation_kept_on_the_server():
    """Three responses chained by previous_response_id (a call, its output, a question)
    read the prompt of the whole conversation as a chat: each earlier turn, the earlier
    instructions left out; GET returns a kept response, DELETE forgets it."""
    ask = {"temperature": 0, "max_output_tokens": 20, "tools": TOOLS}
    first = ("POST", "/v1/responses", {"input": "weather", "instructions": "be brief", **ask})

    def second(sent):
        call = sent[0].json()["output"][0]
        output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
        return "POST", "/v1/responses", {"input": [output], "previous_response_id": sent[0].json()["id"], **ask}

    def third(sent):
        return "POST", "/v1/responses", {"input": "thanks", "previous_response_id": sent[1].json()["id"], **ask}

    def chat(sent):
        call = sent[0].json()["output"][0]
        messages = [
            {"role": "user", "content": "weather"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call["call_id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": call["arguments"]},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call["call_id"], "content": "sunny"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": sent[1].json()["output"][0]["call_id"],
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "user", "content": "thanks"},
        ]
        return (
            "POST",
            "/v1/chat/completions",
            {"messages": messages, "tools": CHAT_TOOLS, "temperature": 0, "max_tokens": 20},
        )

    def get_first(sent):
        return "GET", f"/v1/responses/{sent[0].json()['id']}", None

    def delete_first(sent):
        return "DELETE", f"/v1/responses/{sent[0].json()['id']}", None

    def after_delete(sent):
        return "POST", "/v1/responses", {"input": "again", "previous_response_id": sent[2].json()["id"], **ask}

    sent = asyncio.run(conversation([first, second, third, chat, get_first, delete_first, get_first, after_delete]))
    assert [r.status_code for r in sent] == [200, 200, 200, 200, 200, 200, 404, 400], [r.text for r in sent]
    responses = [Response.model_validate(r.json()) for r in sent[:3]]
    assert responses[2].previous_response_id == responses[1].id and responses[0].store
    assert responses[2].usage.input_tokens == sent[3].json()["usage"]["prompt_tokens"]
    assert sent[4].json() == sent[0].json()
    assert sent[5].json() == {"id": responses[0].id, "object": "response", "deleted": True}
    assert sent[6].json()["error"]["type"] == "not_found_error"
    assert sent[7].json()["error"]["param"] == "previous_response_id"  # its chain lost a link


def test_a_kept_responses_input_items_are_listed_in_pages():
    """GET /v1/responses/{id}/input_items: the input as items with ids (a message's text
    one part, given ids kept), the newest first or in order, `limit` a page, `after` the
    next; an unknown response is a 404, a bad limit, order or cursor a 400 naming it."""
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "wea"}, {"type": "input_text", "text": "ther"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny", "id": "fco_given"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    ask = {"input": items, "instructions": "be brief", "temperature": 0, "max_output_tokens": 5}

    def listing(query):
        return lambda sent: ("GET", f"/v1/responses/{sent[0].json()['id']}/input_items{query}", None)

    def after_second(sent):
        return listing(f"?order=asc&limit=2&after={sent[2].json()['data'][1]['id']}")(sent)

    queries = ["", "?order=asc&limit=2", "?limit=0", "?order=up", "?after=nothing"]
    steps = [("POST", "/v1/responses", ask), *map(listing, queries), after_second]
    steps.append(("GET", "/v1/responses/resp_unknown/input_items", None))
    sent = asyncio.run(conversation(steps))
    assert [r.status_code for r in sent] == [200, 200, 200, 400, 400, 400, 200, 404], [r.text for r in sent]
    newest_first, first_two, next_two = (ResponseItemList.model_validate(sent[i].json()) for i in (1, 2, 6))
    listed = [*first_two.data, *next_two.data]
    assert [item.id for item in listed] == [item.id for item in reversed(newest_first.data)]
    assert [item.type for item in listed] == ["message", "function_call", "function_call_output", "message"]
    assert listed[0].content[0].text == "weather" and listed[0].role == "user" and listed[2].id == "fco_given"
    assert listed[1].arguments == '{"city": "Paris"}' and listed[3].content[0].text == "It is sunny."
    assert first_two.has_more and not next_two.has_more and not newest_first.has_more
    assert (first_two.first_id, first_two.last_id) == (listed[0].id, listed[1].id)
    assert [sent[i].json()["error"]["param"] for i in (3, 4, 5)] == ["limit", "order", "after"]


def test_a_streamed_response_is_kept_and_store_false_is_not():
    ask = {"input": "weather", "temperature": 0, "max_output_tokens": 20}

    def completed_id(response: httpx.Response) -> str:
        return events(response)[-1].response.id

    sent = asyncio.run(
        conversation(
            [
                ("POST", "/v1/responses", {**ask, "stream": True}),
                ("POST", "/v1/responses", {**ask, "store": False}),
                lambda sent: ("GET", f"/v1/responses/{completed_id(sent[0])}", None),
                lambda sent: ("GET", f"/v1/responses/{sent[1].json()['id']}", None),
            ]
        )
    )
    assert sent[1].json()["store"] is False
    last = json.loads(sent[0].text.strip().split("\n\n")[-1].split("\ndata: ")[1])
    assert last["type"] == "response.completed" and sent[2].json() == last["response"]
    assert Response.model_validate(sent[2].json()).output_text == Response.model_validate(sent[1].json()).output_text
    assert sent[3].status_code == 404


def stored(response_id: str, previous: str | None, text: str) -> StoredResponse:
    turns = [{"role": "user", "content": text}, {"role": "assistant", "content": text}]
    return StoredResponse(previous, turns, {"id": response_id}, input_items=[])


def test_the_store_keeps_the_most_recent_within_its_count_and_characters():
    store = ResponseStore(size=3, chars=100)
    for i in range(4):
        store.put(stored(f"r{i}", f"r{i - 1}" if i else None, "x" * 10))  # 30 characters each
    with pytest.raises(APIError):
        store.get("r0")  # the fourth pushed out the first
    store.get("r1")  # read: now the most recent
    store.put(stored("big", None, "x" * 20))  # 60: over 100 characters with the others
    assert [store.get(i)["id"] for i in ("r1", "big")] and store._chars <= 100
    with pytest.raises(APIError) as lost:
        store.conversation("r3")  # r2, up its chain, went
    assert lost.value.status == 400 and lost.value.param == "previous_response_id"
    store.delete("big")
    assert store._chars == 30
    store.put(stored("huge", None, "x" * 60))  # more than the store holds: not kept, the rest kept
    with pytest.raises(APIError):
        store.get("huge")
    assert store.get("r1") and store._chars == 30
    store.delete("r1")
    assert store._chars == 0 and not store._kept


def test_a_kept_response_leaves_its_logprobs_out():
    ask = {"input": "weather", "temperature": 0, "max_output_tokens": 5, "top_logprobs": 2}
    sent = asyncio.run(
        conversation(
            [("POST", "/v1/responses", ask), lambda sent: ("GET", f"/v1/responses/{sent[0].json()['id']}", None)]
        )
    )
    made, kept = (Response.model_validate(r.json()) for r in sent)
    assert len(made.output[0].content[0].logprobs) == 5 and kept.output[0].content[0].logprobs == []
    assert kept.output_text == made.output_text and kept.usage == made.usage


def test_a_named_tool_choice_streams_its_arguments_and_an_empty_answer_is_one_empty_message():
    named = {"input": "weather", "temperature": 0, "max_output_tokens": 30, "tools": TOOLS}
    named["tool_choice"] = {"type": "function", "name": "get_weather"}
    # The scripted words spell no "[": a required list of calls can only stop at once.
    required = {**named, "tool_choice": "required"}
    sent = asyncio.run(
        post([("/v1/responses", body) for ask in (named, required) for body in (ask, {**ask, "stream": True})])
    )
    (call,) = Response.model_validate(sent[0].json()).output
    streamed = events(sent[1])
    deltas = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert call.type == "function_call" and call.name == "get_weather" and len(deltas) > 1
    assert "".join(deltas) == streamed[-1].response.output[0].arguments == call.arguments
    for response in (Response.model_validate(sent[2].json()), events(sent[3])[-1].response):
        assert [(item.type, item.content[0].text) for item in response.output] == [("message", "")]


def test_a_response_holding_a_call_back_keeps_its_connection_alive(monkeypatch):
    monkeypatch.setattr("specserve.server.app.KEEP_ALIVE_S", 0.0)
    (stream,) = asyncio.run(post([("/v1/responses", {"input": "weather", "tools": TOOLS, "stream": True})]))
    blocks = stream.text.strip().split("\n\n")
    assert blocks.count(": keep-alive") >= 3
    kept_alive = httpx.Response(200, headers=stream.headers, text="\n\n".join(b for b in blocks if b[0] != ":"))
    assert [e.type for e in events(kept_alive)][-1] == "response.completed"


def test_a_background_response_runs_on_its_own_and_is_read_or_cancelled():
    ask = {"input": "weather", "temperature": 0, "max_output_tokens": 20}

    async def scenario() -> dict[str, dict]:
        async with serving(scripted_tokenizer(SCRIPTS["hermes"]), tool_call_parser="hermes") as client:

            async def ended(response_id: str) -> dict:
                while (kept := (await client.get(f"/v1/responses/{response_id}")).json())["status"] == "in_progress":
                    await asyncio.sleep(0.01)
                return kept

            seen = {"foreground": (await client.post("/v1/responses", json=ask)).json()}
            started = (await client.post("/v1/responses", json={**ask, "background": True})).json()
            seen["started"], seen["done"] = started, await ended(started["id"])
            long = {**ask, "max_output_tokens": 200, "ignore_eos": True, "background": True}
            running = (await client.post("/v1/responses", json=long)).json()
            seen["cancelled"] = (await client.post(f"/v1/responses/{running['id']}/cancel")).json()
            seen["after"] = (
                await client.post("/v1/responses", json={**ask, "previous_response_id": running["id"]})
            ).json()
            foreground_id = seen["foreground"]["id"]
            seen["not background"] = (await client.post(f"/v1/responses/{foreground_id}/cancel")).json()
            seen["again"] = (await client.post(f"/v1/responses/{started['id']}/cancel")).json()
            return seen

    seen = asyncio.run(scenario())
    assert seen["started"]["status"] == "in_progress" and seen["started"]["background"] is True
    done = Response.model_validate(seen["done"])
    assert done.status == "completed" and done.output_text == Response.model_validate(seen["foreground"]).output_text
    assert seen["cancelled"]["status"] == "cancelled" and seen["cancelled"]["output"] == []
    assert (
        seen["after"]["error"]["param"] == "previous_response_id" and "cancelled" in seen["after"]["error"]["message"]
    )
    assert seen["not background"]["error"]["param"] == "response_id"
    assert seen["again"]["status"] == "completed"  # one already ended comes back as it is


@pytest.mark.parametrize("fields, words", [({"stream": True}, "not streamed here"), ({"store": False}, "needs store")])
def test_a_background_response_that_cannot_be_kept_or_polled_is_refused(fields, words):
    (refused,) = asyncio.run(post([("/v1/responses", {"input": "weather", "background": True, **fields})]))
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "background" and words in error["message"]
