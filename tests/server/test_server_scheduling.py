"""A request's `priority` through the app, in process, to an engine scheduling by
priority (`--scheduling-policy priority`): chat, completions and Responses requests
carry it to the engine, which admits the queued ones in its order."""

from __future__ import annotations

import asyncio

import httpx

from specserve.engine.engine import Engine
from specserve.server.app import ApiSettings, build_app
from specserve.server.async_engine import AsyncEngine
from specserve.server.metrics import ServerMetrics
from tests.server.test_responses import events
from tests.server.test_server_tools import SCRIPTS, TARGET, body, scripted_tokenizer, streamed


async def post_together(requests: list[tuple[str, dict]]) -> tuple[list[httpx.Response], list[int]]:
    """The requests sent at once to a one-slot server scheduling by priority, the first
    sent ahead of the rest; the responses, and the priorities in the order the engine
    admitted them."""
    tokenizer = scripted_tokenizer(SCRIPTS["hermes"])
    engine = Engine(TARGET, eos_token_ids=tokenizer.eos_token_ids, max_num_seqs=1, scheduling_policy="priority")
    admitted: list[int] = []
    add_request = engine.add_request

    def spy(prompt_ids, params, arrival_time=None, priority=0):
        admitted.append(priority)
        return add_request(prompt_ids, params, arrival_time, priority)

    engine.add_request = spy
    async_engine = AsyncEngine(engine, tokenizer, ServerMetrics("tiny"))
    app = build_app(async_engine, tokenizer, ApiSettings("tiny", max_model_len=256))
    async_engine.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            sent = [asyncio.create_task(client.post(path, json=b)) for path, b in requests]
            return list(await asyncio.gather(*sent)), admitted
    finally:
        async_engine.stop()


def test_each_api_carries_a_requests_priority_to_the_engine():
    replies, given = asyncio.run(
        post_together(
            [
                ("/v1/chat/completions", body(priority=-2)),
                ("/v1/completions", {"prompt": "go", "max_tokens": 4, "priority": 7}),
                ("/v1/responses", {"input": "weather", "max_output_tokens": 4, "priority": 3}),
            ]
        )
    )
    assert [r.status_code for r in replies] == [200, 200, 200]
    assert sorted(given) == [-2, 3, 7]


def test_a_stream_waiting_in_the_queue_answers_and_keeps_its_connection_alive(monkeypatch):
    """Past KEEP_ALIVE_S without starting (queued behind the one slot's request), a
    stream answers, with SSE comments until its first event; what follows is what the
    request gives whole."""
    monkeypatch.setattr("specserve.server.app.KEEP_ALIVE_S", 0.001)
    long = body(max_tokens=40, ignore_eos=True)
    ask = {"input": "weather", "max_output_tokens": 40, "temperature": 0}
    (whole, chat, whole_response, response), _ = asyncio.run(
        post_together(
            [
                ("/v1/chat/completions", long),
                ("/v1/chat/completions", {**long, "stream": True}),
                ("/v1/responses", ask),
                ("/v1/responses", {**ask, "stream": True}),
            ]
        )
    )
    blocks = chat.text.strip().split("\n\n")
    assert blocks[0] == ": keep-alive" and blocks[-1] == "data: [DONE]"
    chunks = streamed(chat)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole.json()["choices"][0]["message"]["content"]
    blocks = response.text.strip().split("\n\n")
    assert ": keep-alive" in blocks
    kept = httpx.Response(200, headers=response.headers, text="\n\n".join(b for b in blocks if b[0] != ":"))
    final = events(kept)[-1]
    assert (
        final.type == "response.completed"
        and final.response.output_text == whole_response.json()["output"][0]["content"][0]["text"]
    )
