"""What a stream carries beside its text, through the whole app in process, on the
scripted target of test_server_tools.py: vLLM's continuous usage, every chunk with its
choice's usage so far."""

from __future__ import annotations

import asyncio

from tests.server.test_server_tools import TOOLS, body, chat, streamed


def test_continuous_usage_puts_each_choices_usage_so_far_on_every_chunk():
    options = {"include_usage": True, "continuous_usage_stats": True}
    continuous, final_only = asyncio.run(
        chat(
            None,
            [
                body(stream=True, n=2, stream_options=options),
                body(stream=True, stream_options={"include_usage": True}),
            ],
        )
    )
    chunks = streamed(continuous)
    *per_choice, total = chunks
    assert total["choices"] == [] and total["usage"]["completion_tokens"] == 2 * 8  # the script's 7 words and EOS
    for index in (0, 1):
        counts = [c["usage"]["completion_tokens"] for c in per_choice if c["choices"][0]["index"] == index]
        assert counts == sorted(counts) and counts[-1] == 8
    assert all(c["usage"]["prompt_tokens"] == total["usage"]["prompt_tokens"] for c in per_choice)
    assert all("usage" not in c for c in streamed(final_only)[:-1])


def test_return_token_ids_gives_the_prompts_and_the_answers_ids_whole_and_streamed():
    """Chat (with a tool call's text held back from the stream: its ids still come) and
    completions with two choices."""
    ids = {"return_token_ids": True}
    whole, stream, called, completed, completed_stream = asyncio.run(
        chat(
            "hermes",
            [
                body(**ids),
                body(stream=True, **ids),
                body(stream=True, tools=TOOLS, **ids),
            ],
            completions=[
                {"prompt": "go", "max_tokens": 20, "temperature": 0, "n": 2, **ids},
                {"prompt": "go", "max_tokens": 20, "temperature": 0, "stream": True, **ids},
            ],
        )
    )
    answer = whole.json()
    (choice,) = answer["choices"]
    assert len(choice["token_ids"]) == 8 and answer["prompt_token_ids"][-1] == 3  # ASK's id ends the prompt
    for streamed_response in (stream, called):  # the same answer to either prompt: the target reads only "go"
        chunks = streamed(streamed_response)
        assert chunks[0]["prompt_token_ids"][-1] == 3 and all("prompt_token_ids" not in c for c in chunks[1:])
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert streamed(stream)[0]["prompt_token_ids"] == answer["prompt_token_ids"]
    for c in completed.json()["choices"]:
        assert c["prompt_token_ids"] == [3] and c["token_ids"] == choice["token_ids"]
    pieces = [c["choices"][0] for c in streamed(completed_stream)]
    assert pieces[0]["prompt_token_ids"] == [3] and [t for p in pieces for t in p["token_ids"]] == choice["token_ids"]
