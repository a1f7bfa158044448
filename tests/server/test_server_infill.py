"""Fill in the middle (`suffix` on /v1/completions) through the whole app, in process:
a scripted target whose vocabulary has Qwen's FIM tokens answers the gap between a
prompt and its suffix, whole and streamed; a model without them, and the options a
suffix cannot go with, are refused naming the field."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from specserve.tokenizer import FIM_TOKENS
from tests.server.test_server_tools import scripted_tokenizer, serving, streamed

BEGIN, HOLE, END = FIM_TOKENS[0]
MIDDLE = ["a,", "b", "=", "b,", "a+b"]  # what the target writes after the middle's token


async def complete(bodies: list[dict], fim: bool = True) -> list[httpx.Response]:
    tokenizer = scripted_tokenizer(MIDDLE, ask=END, others=(BEGIN, HOLE)) if fim else scripted_tokenizer(MIDDLE)
    async with serving(tokenizer) as client:
        return [await client.post("/v1/completions", json=body) for body in bodies]


def infill(**fields) -> dict:
    return {"prompt": "for _ in n:", "suffix": "return a", "max_tokens": 20, "temperature": 0, **fields}


def test_the_gap_between_a_prompt_and_its_suffix_is_filled_whole_and_streamed():
    whole, stream, by_ids = asyncio.run(complete([infill(), infill(stream=True), infill(prompt=[40, 41, 42])]))
    choice = whole.json()["choices"][0]
    assert choice["text"].strip() == "a, b = b, a+b" and choice["finish_reason"] == "stop"
    # The prompt read: the prefix's token, "for _ in n:", the suffix's, "return a", the middle's.
    assert whole.json()["usage"]["prompt_tokens"] == 1 + 4 + 1 + 2 + 1
    assert "".join(c["choices"][0]["text"] for c in streamed(stream) if c["choices"]) == choice["text"]
    assert by_ids.json()["choices"][0]["text"] == choice["text"]
    assert by_ids.json()["usage"]["prompt_tokens"] == 1 + 3 + 1 + 2 + 1


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"echo": True}, "echo"),
        ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ({"prompt": [40, 10**6]}, "prompt"),
    ],
)
def test_what_a_suffix_cannot_go_with_is_refused_naming_it(fields, param):
    (refused,) = asyncio.run(complete([infill(**fields)]))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == param


def test_a_model_without_fim_tokens_refuses_a_suffix():
    (refused,) = asyncio.run(complete([infill()], fim=False))
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "suffix" and "no fill-in-the-middle tokens" in error["message"]
