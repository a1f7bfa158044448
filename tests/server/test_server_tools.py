"""Tool calls through the whole server, in process: a target that answers a scripted
call (a greedy target mapping each token to the next word of the script) behind the real
app, read by each parser, whole and streamed, and given back in the next turn.

The scripted words make the answer `<tool_call>{"name": "get_weather", "arguments":
{"city": "Paris"}}</tool_call>` (hermes), or the bare object (qwen2_5_coder).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import tokenizers

from specserve.engine.engine import Engine
from specserve.server.app import ApiSettings, build_app
from specserve.server.async_engine import AsyncEngine
from specserve.server.metrics import ServerMetrics
from specserve.tokenizer import Tokenizer
from tests.head_models import permutation_target

TARGET, PERM = permutation_target()
ASK = "go"  # the template's last word: the answer follows it
SCRIPTS = {
    "hermes": ["<tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}', "</tool_call>"],
    "qwen2_5_coder": ['{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}'],
}
TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}{% if tools %}tools {% endif %}go"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def scripted_tokenizer(script: list[str], ask: str = ASK, others: tuple[str, ...] = ()) -> Tokenizer:
    """Words for every id, the script's along the target's chain from `ask`'s id, then
    EOS; `others` off the chain."""
    vocab = len(PERM)
    words = {i: f"w{i}" for i in range(vocab)}
    start = 3
    words[start] = ask
    token = start
    for word in script:
        token = int(PERM[token])
        words[token] = word
    eos = int(PERM[token])
    words[eos] = "<eos>"
    free = (i for i in range(1, vocab) if words[i].startswith("w"))  # w0 stays: the unknown word
    for word, i in zip(others, free):
        words[i] = word
    assert len(set(words.values())) == vocab, "the script's chain came round to a word twice"
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in words.items()}, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, bos_token_id=None, declared_eos_ids=[eos], add_bos=False, chat_template=TEMPLATE)


@contextlib.asynccontextmanager
async def serving(tokenizer: Tokenizer, root_path: str = "", **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A client of a fresh server in process: the real app (ApiSettings "tiny" of 256
    positions, and `settings`) over the permutation target, as `tokenizer` reads it."""
    engine = AsyncEngine(Engine(TARGET, eos_token_ids=tokenizer.eos_token_ids), tokenizer, ServerMetrics("tiny"))
    app = build_app(engine, tokenizer, ApiSettings("tiny", max_model_len=256, **settings))
    engine.start()
    try:
        transport = httpx.ASGITransport(app=app, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client
    finally:
        engine.stop()


async def chat(parser: str | None, bodies: list[dict], completions: list[dict] = ()) -> list[httpx.Response]:
    """Each chat body, then each completions body, sent to a fresh server whose target
    answers parser's script."""
    async with serving(scripted_tokenizer(SCRIPTS[parser or "hermes"]), tool_call_parser=parser) as client:
        sent = [await client.post("/v1/chat/completions", json=body) for body in bodies]
        return sent + [await client.post("/v1/completions", json=body) for body in completions]


def body(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "weather"}], "temperature": 0, "max_tokens": 20, **fields}


def streamed(response: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


@pytest.mark.parametrize("parser", ["hermes", "qwen2_5_coder"])
def test_a_scripted_call_comes_back_as_tool_calls_whole_and_streamed(parser):
    whole, stream = asyncio.run(chat(parser, [body(tools=TOOLS), body(tools=TOOLS, stream=True)]))
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", {"city": "Paris"})
    chunks = streamed(stream)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == ""  # the call's text is never sent as content
    # The name first, once written, then the arguments as the script's words come.
    head, *pieces = [entry for d in deltas for entry in d.get("tool_calls", [])]
    assert head["index"] == 0 and head["type"] == "function" and head["function"]["name"] == "get_weather"
    assert len(pieces) >= 1 and all(p["index"] == 0 and set(p["function"]) == {"arguments"} for p in pieces)
    arguments = head["function"]["arguments"] + "".join(p["function"]["arguments"] for p in pieces)
    assert arguments == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_tools_or_with_tool_choice_none_the_call_stays_text():
    plain, none = asyncio.run(chat("hermes", [body(), body(tools=TOOLS, tool_choice="none")]))
    for response in (plain, none):
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert "get_weather" in choice["message"]["content"]


def test_auto_tool_choice_needs_the_servers_flags():
    (refused,) = asyncio.run(chat(None, [body(tools=TOOLS)]))
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "tool_choice" and "--enable-auto-tool-choice" in error["message"]


def test_the_call_and_its_result_are_given_back_in_the_next_turn():
    """The tool turn reaches the template: its content is in the prompt the target reads."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [
        {"role": "user", "content": "weather"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    first, second = asyncio.run(chat("hermes", [body(tools=TOOLS), body(tools=TOOLS, messages=turns)]))
    assert first.status_code == second.status_code == 200
    # "user weather assistant  tool sunny tools go": 3 more words than the first turn's prompt.
    assert second.json()["usage"]["prompt_tokens"] == first.json()["usage"]["prompt_tokens"] + 3


def test_a_stream_holding_a_call_back_keeps_its_connection_alive(monkeypatch):
    """Past KEEP_ALIVE_S without an event (here at once), an SSE comment goes out, which
    clients skip: the call still arrives, as without them."""
    monkeypatch.setattr("specserve.server.app.KEEP_ALIVE_S", 0.0)
    (stream,) = asyncio.run(chat("hermes", [body(tools=TOOLS, stream=True)]))
    blocks = stream.text.strip().split("\n\n")
    assert blocks.count(": keep-alive") >= 3 and all(b.startswith(("data: ", ": ")) for b in blocks)
    entries = [c for chunk in streamed(stream) for c in chunk["choices"][0]["delta"].get("tool_calls", [])]
    assert json.loads("".join(e["function"].get("arguments", "") for e in entries)) == {"city": "Paris"}
