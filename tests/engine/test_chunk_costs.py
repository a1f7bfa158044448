"""A prompt chunk priced by where it lies (engine/chunk_costs.py), and the engine's
chunks beside decoding sequences."""

from __future__ import annotations

import math

import pytest

from specserve.engine.chunk_costs import MIN_HORIZON_SHARE, ChunkCosts, arithmetic_horizon
from specserve.engine.engine import Engine
from specserve.sampling import SamplingParams
from tests.conftest import tiny_config
from tests.engine.test_engine import random_decoder

EOS = 95
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("horizon", [100.0, 288.0, 6087.0, 1e9, math.inf])
@pytest.mark.parametrize("budget", [1, 2, 16, 64, 512])
def test_a_whole_chunk_at_the_start_is_the_budget_and_deeper_ones_are_shorter(horizon, budget):
    allowance = ChunkCosts.cost(0, budget, horizon)
    assert ChunkCosts.chunk_length(0, allowance, horizon) == budget
    lengths = [ChunkCosts.chunk_length(start, allowance, horizon) for start in (0, 100, 1000, 10_000, 100_000)]
    assert lengths == sorted(lengths, reverse=True) and lengths[-1] >= 1
    for start, n in zip((0, 100, 1000, 10_000, 100_000), lengths):
        # The longest chunk the allowance pays for: one token more costs more than it.
        assert n == 1 or ChunkCosts.cost(start, n, horizon) <= allowance * (1 + 1e-9)
        assert ChunkCosts.cost(start, n + 1, horizon) > allowance * (1 + 1e-9)


def test_a_chunk_at_the_horizon_is_about_half_as_long():
    """At position C a token costs twice what one at position 0 does."""
    horizon = 6000.0
    assert ChunkCosts.chunk_length(6000, ChunkCosts.cost(0, 64, horizon), horizon) in (31, 32)


def _observe_chunks(costs: ChunkCosts, starts: range, seconds_per_token) -> None:
    for start in starts:
        costs.observe(64, start + 31.5, 64 * seconds_per_token(start + 31.5))


def test_the_horizon_is_fitted_once_the_positions_read_have_spread():
    costs = ChunkCosts(prior_horizon=15_000.0)
    base, slope = 7e-3, 1.15e-6  # seconds a chunk token at position 0, and per position: C = 6087

    def linear(p):
        return base + slope * p

    _observe_chunks(costs, range(0, 64 * 8, 64), linear)  # a few chunks near the start: too little spread
    assert costs.horizon == 15_000.0
    _observe_chunks(costs, range(64 * 8, 64 * 120, 64), linear)
    assert costs.horizon == pytest.approx(base / slope, rel=1e-6)


@pytest.mark.parametrize("noise", [0.0, 0.001, -0.001])
def test_where_positions_cost_nothing_chunks_are_whole(noise):
    """Timings that do not grow with the position (a tiny model's, in noise) price a
    chunk at most a token short, wherever it lies."""
    costs = ChunkCosts(prior_horizon=288.0)
    _observe_chunks(costs, range(0, 64 * 120, 64), lambda p: 0.01 + (noise if int(p) % 128 < 64 else 0.0))
    allowance = ChunkCosts.cost(0, 64, costs.horizon)
    assert ChunkCosts.chunk_length(7000, allowance, costs.horizon) >= 63


@pytest.mark.parametrize("base", [1e-3, 0.0, -5e-3])
def test_a_fit_of_dear_attention_is_held_to_a_share_of_the_arithmetic_horizon(base):
    """C = 100 fitted, or a base at or below 0 (fitted far from position 0): the floor."""
    costs = ChunkCosts(prior_horizon=15_000.0)
    _observe_chunks(costs, range(6000, 6000 + 64 * 120, 64), lambda p: base + 1e-5 * p)
    assert costs.horizon == MIN_HORIZON_SHARE * 15_000.0


def test_the_arithmetic_horizon_of_a_qwen2_5_1_5b():
    """Per token and layer: q, k, v and o (1536 x 2048 + 1536 x 1536) and the MLP (3 x
    1536 x 8960) against QK and PV over 12 heads of 128 (3072 a position)."""
    config = tiny_config("qwen2", hidden_size=1536, intermediate_size=8960, num_heads=12, num_kv_heads=2, head_dim=128)
    assert arithmetic_horizon(config) == pytest.approx((1536 * 2048 + 1536 * 1536 + 3 * 1536 * 8960) / 3072)


def _chunks_read(engine: Engine, seq, steps: int) -> list[int]:
    lengths = []
    for _ in range(steps):
        before = seq.cache.length
        engine.step()
        lengths.append(seq.cache.length - before)
    return lengths


def test_beside_a_decoding_sequence_a_long_prompts_chunks_shorten_as_it_goes():
    """The tiny model's horizon is 288 positions by arithmetic, and a 150-token prompt's
    chunks spread too little to fit another: each chunk is what that horizon prices, so
    the decoding sequence's steps stay near the first chunk's; read alone, the same
    prompt takes whole chunks. Every output equals its solo run."""
    target = random_decoder("qwen2", seed=1)
    horizon = arithmetic_horizon(target.config)
    long_prompt = [3 + i % 90 for i in range(150)]
    solo = Engine(target, eos_token_ids=[EOS]).generate(long_prompt, GREEDY).output_ids

    alone = Engine(target, eos_token_ids=[EOS], prefill_chunk_size=16)
    seq = alone.add_request(long_prompt, GREEDY)
    assert _chunks_read(alone, seq, 4) == [16] * 4

    engine = Engine(target, eos_token_ids=[EOS], prefill_chunk_size=16)
    running = engine.add_request([5, 9, 13], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.step()
    late = engine.add_request(long_prompt, GREEDY)
    lengths = _chunks_read(engine, late, 8)
    expected, start = [], 0
    for _ in range(8):
        expected.append(ChunkCosts.chunk_length(start, ChunkCosts.cost(0, 16, horizon), horizon))
        start += expected[-1]
    assert lengths == expected and expected[0] == 16 and expected[-1] <= 12
    assert running.num_output_tokens == 1 + 8  # a token every step beside the chunks
    while engine.has_unfinished():
        engine.step()
    assert late.output_ids == solo
    assert running.output_ids == Engine(target, eos_token_ids=[EOS]).generate([5, 9, 13], running.params).output_ids
