"""What a stream carries beside its text, through the whole app in process, on the
scripted target of test_server_tools.py: vLLM's continuous usage, every chunk with its
choice's usage so far."""

from __future__ import annotations

import asyncio

from tests.server.test_server_tools import body, chat, streamed


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
