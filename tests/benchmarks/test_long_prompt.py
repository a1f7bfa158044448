"""benchmarks/long_prompt.py: a stream's steps beside a long prompt, chunks priced and not."""

from __future__ import annotations

import pytest

from benchmarks import long_prompt
from specserve.engine.build import build_engine
from specserve.engine.engine import Engine


def test_the_steps_that_read_a_long_prompt_are_timed_by_where_their_chunk_began(prepared_cache):
    built, tokenizer = build_engine("smollm2-135m", None)
    engine = Engine(built.target, eos_token_ids=built.eos_token_ids, prefill_chunk_size=16)
    prompt = long_prompt.sonnet_tokens(tokenizer, 100)
    assert len(prompt) == 100
    steps, ttft = long_prompt.read_beside_a_stream(engine, tokenizer.encode("Tell a story."), prompt)
    starts = [start for start, _ in steps]
    assert starts[0] == 0 and starts == sorted(set(starts)) and starts[-1] < 100
    assert len(steps) >= 100 // 16 + 1  # whole chunks at most, the last one scored
    assert all(seconds > 0 for _, seconds in steps) and ttft >= sum(seconds for _, seconds in steps)
    assert not engine.has_unfinished()


def test_both_engines_are_reported_band_by_band(prepared_cache, capsys):
    args = ["--target", "smollm2-135m", "--quantization", "none", "--prompt-tokens", "150", "--band", "75"]
    assert long_prompt.main([*args, "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "unpriced" in out and "priced" in out and "prompt TTFT" in out and "horizon:" in out and "LM-head" in out
    assert "     0-75 " in out and "    75-150 " in out


def test_the_long_prompt_may_ask_for_its_logprobs(prepared_cache, capsys):
    args = ["--target", "smollm2-135m", "--quantization", "none", "--prompt-tokens", "100", "--band", "50"]
    assert long_prompt.main([*args, "--rounds", "1", "--prompt-logprobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "100-token prompt asking for 1 prompt logprobs" in out and "prompt TTFT" in out


@pytest.mark.parametrize("count", ["-1", "21"])
def test_prompt_logprobs_are_0_to_20(count, capsys):
    with pytest.raises(SystemExit):
        long_prompt.main(["--prompt-logprobs", count])
    assert "--prompt-logprobs must be 0 to 20" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--prompt-tokens", "--band", "--rounds"])
def test_counts_must_be_positive(flag, capsys):
    with pytest.raises(SystemExit):
        long_prompt.main([flag, "0"])
    assert f"{flag} must be at least 1" in capsys.readouterr().err
