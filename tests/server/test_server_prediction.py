"""OpenAI's predicted outputs through the whole server, in process: a target that
answers a scripted text (tests/server/test_server_tools.py) behind the real app. The
answer is the same with any prediction or none; the usage counts the predicted tokens
the target accepted and rejected; a malformed prediction is a 400."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.server.test_server_tools import scripted_tokenizer, serving

SCRIPT = ["def", "area(r):", "return", "3.14", "*", "r**2", "#", "the", "circle's", "area,", "in", "square", "units"]
ANSWER = " ".join(SCRIPT)


async def chats(bodies: list[dict]) -> list[httpx.Response]:
    async with serving(scripted_tokenizer(SCRIPT)) as client:
        return [await client.post("/v1/chat/completions", json=body) for body in bodies]


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "area"}], "temperature": 0, "max_tokens": 30, **fields}


def content(text) -> dict:
    return {"type": "content", "content": text}


def test_the_answer_is_the_same_with_any_prediction_and_the_usage_counts_it():
    edited = ANSWER.replace("3.14", "pi")
    parts = content([{"type": "text", "text": "def area(r): "}, {"type": "text", "text": ANSWER[13:]}])
    plain, exact, in_parts, wrong, empty = asyncio.run(
        chats(
            [
                chat(),
                chat(prediction=content(ANSWER)),
                chat(prediction=parts),
                chat(prediction=content(edited)),
                chat(prediction=content("")),
            ]
        )
    )
    answers = [r.json()["choices"][0]["message"]["content"] for r in (plain, exact, in_parts, wrong, empty)]
    assert answers == [answers[0]] * 5 and answers[0].split() == SCRIPT
    assert (
        "completion_tokens_details" not in plain.json()["usage"]
        and "completion_tokens_details" not in empty.json()["usage"]
    )
    for response in (exact, in_parts):
        details = response.json()["usage"]["completion_tokens_details"]
        assert details["rejected_prediction_tokens"] == 0 and details["accepted_prediction_tokens"] >= len(SCRIPT) // 2
    details = wrong.json()["usage"]["completion_tokens_details"]
    assert details["rejected_prediction_tokens"] > 0 and details["accepted_prediction_tokens"] > 0


def test_a_streams_usage_counts_the_prediction_too():
    (stream,) = asyncio.run(
        chats([chat(prediction=content(ANSWER), stream=True, stream_options={"include_usage": True})])
    )
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.split() == SCRIPT
    assert chunks[-1]["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] >= len(SCRIPT) // 2


def test_a_malformed_or_overlong_prediction_is_a_400():
    bad = [
        {"type": "text", "content": ANSWER},
        {"type": "content", "content": 5},
        {"type": "content", "content": [{"type": "image", "url": "x"}]},
        content(" ".join(["r"] * 300)),  # past the 256-token context
        content(" ".join(["r"] * 3000)),  # refused by its start
    ]
    for response in asyncio.run(chats([chat(prediction=p) for p in bad])):
        assert response.status_code == 400 and response.json()["error"]["param"] == "prediction", response.text
