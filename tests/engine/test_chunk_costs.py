"""A prompt chunk priced by where it lies (engine/chunk_costs.py), and the engine's
chunks beside decoding sequences."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from specserve.engine.chunk_costs import (
    MAX_ROW_SHARE_FACTOR,
    MIN_HORIZON_SHARE,
    ChunkCosts,
    arithmetic_horizon,
    lm_head_share,
)
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


# A reading step's seconds on the int4 default target on 2 CPU cores, about: a fixed
# 35 ms, 6.8 ms a row, 1.23 us a row's position (C = 5,528), 2.4 ms a row's LM head.
FIXED, PER_ROW, PER_POSITION, PER_LM_HEAD = 0.035, 6.8e-3, 1.23e-6, 2.4e-3


def _observe_chunks(costs: ChunkCosts, starts: range, seconds, sizes=(64, 40), owed=False) -> None:
    """Chunks from `starts`, their sizes taking turns, each beside one decoding row at 20
    (and each row computing the LM head where `owed`)."""
    for i, start in enumerate(starts):
        n = sizes[i % len(sizes)]
        rows, position_sum, lm_head_rows = n + 1, n * (start + (n - 1) / 2) + 20, rows_with_lm_head(n, owed)
        costs.observe(rows, position_sum, lm_head_rows, seconds(rows, position_sum, lm_head_rows))


def rows_with_lm_head(n: int, owed: bool) -> int:
    return n + 1 if owed else 1


def _linear(rows: float, position_sum: float, lm_head_rows: float = 1) -> float:
    return FIXED + PER_ROW * rows + PER_POSITION * position_sum + PER_LM_HEAD * lm_head_rows


def test_the_horizon_is_fitted_once_the_steps_positions_and_sizes_have_spread():
    costs = ChunkCosts(prior_horizon=15_000.0)
    _observe_chunks(costs, range(0, 64 * 8, 64), _linear)  # a few chunks near the start: too little spread
    assert costs.horizon == 15_000.0
    _observe_chunks(costs, range(64 * 8, 64 * 120, 64), _linear)
    # The step's fixed cost is its own term, not a share of each row's.
    assert costs.horizon == pytest.approx(PER_ROW / PER_POSITION, rel=1e-6)


def test_steps_of_one_size_keep_the_prior():
    """With every step of one size, a row's cost and the fixed cost cannot be told apart."""
    costs = ChunkCosts(prior_horizon=15_000.0)
    _observe_chunks(costs, range(0, 64 * 120, 64), _linear, sizes=(64,))
    assert costs.horizon == 15_000.0


def test_late_in_a_long_prompt_the_noisy_fit_holds_the_horizon():
    """A 24,000-token prompt read beside a stream as the engine reads it, each chunk
    priced by the horizon fitted so far, the steps timed with 5% noise: the horizon
    stays near the truth where a fit over the last ~30 steps fell to the floor, and the
    stream's step stays near a whole chunk's at the prompt's start."""
    rng = random.Random(0)
    costs = ChunkCosts(prior_horizon=15_200.0)
    allowance, start, late_steps = None, 0, []
    while start < 24_000:
        horizon = costs.horizon
        allowance = ChunkCosts.cost(0, 64, horizon)
        n = min(ChunkCosts.chunk_length(start, allowance, horizon), 24_000 - start)
        rows, position_sum = n + 1, n * (start + (n - 1) / 2) + 20
        seconds = _linear(rows, position_sum) * math.exp(rng.gauss(0, 0.05))
        costs.observe(rows, position_sum, 1, seconds)
        if start >= 16_000:
            late_steps.append(_linear(rows, position_sum))
        start += n
    assert costs.horizon == pytest.approx(PER_ROW / PER_POSITION, rel=0.15)
    first = _linear(65, 64 * 31.5 + 20)
    assert statistics.median(late_steps) == pytest.approx(first, rel=0.1)


@pytest.mark.parametrize("noise", [0.0, 0.001, -0.001])
def test_where_positions_cost_nothing_chunks_are_whole(noise):
    """Timings that do not grow with the position (a tiny model's, in noise) price a
    chunk at most a token short, wherever it lies."""
    costs = ChunkCosts(prior_horizon=288.0)

    def flat(rows, position_sum, lm_head_rows):
        return 0.01 + 1e-4 * rows + (noise if int(position_sum) % 3 else 0.0)

    _observe_chunks(costs, range(0, 64 * 120, 64), flat)
    allowance = ChunkCosts.cost(0, 64, costs.horizon)
    assert ChunkCosts.chunk_length(7000, allowance, costs.horizon) >= 63


@pytest.mark.parametrize("per_row", [1e-3, 0.0, -5e-3])
def test_a_fit_of_dear_attention_is_held_to_a_share_of_the_arithmetic_horizon(per_row):
    """C = 100 fitted, or rows at or below no cost (attention seemingly all): the floor."""
    costs = ChunkCosts(prior_horizon=15_000.0)
    _observe_chunks(costs, range(6000, 6000 + 64 * 120, 64), lambda r, s, h: 1.0 + per_row * r + 1e-5 * s)
    assert costs.horizon == MIN_HORIZON_SHARE * 15_000.0


def test_an_lm_head_rows_share_is_fitted_once_prompts_owing_logprobs_were_read():
    costs = ChunkCosts(prior_horizon=15_000.0, prior_row_share=0.18)
    _observe_chunks(costs, range(0, 64 * 60, 64), _linear)
    assert costs.row_share == 0.18  # every step computed one LM-head row: the prior's
    assert costs.horizon == pytest.approx(PER_ROW / PER_POSITION, rel=1e-6)
    _observe_chunks(costs, range(0, 64 * 60, 64), _linear, owed=True)
    assert costs.row_share == pytest.approx(PER_LM_HEAD / PER_ROW, rel=1e-6)
    assert costs.horizon == pytest.approx(PER_ROW / PER_POSITION, rel=1e-6)


@pytest.mark.parametrize("per_lm_head", [1.0, -1e-3])
def test_a_fitted_row_share_is_held_between_0_and_a_multiple_of_the_prior(per_lm_head):
    costs = ChunkCosts(prior_horizon=15_000.0, prior_row_share=0.18)
    seconds = lambda r, s, h: _linear(r, s) + per_lm_head * h  # noqa: E731
    _observe_chunks(costs, range(0, 64 * 60, 64), seconds)
    _observe_chunks(costs, range(0, 64 * 60, 64), seconds, owed=True)
    assert costs.row_share == (MAX_ROW_SHARE_FACTOR * 0.18 if per_lm_head > 0 else 0.0)


def test_where_every_row_computes_the_lm_head_its_share_keeps_the_prior():
    """A prompt owing logprobs read with no other reading steps in memory: its LM-head
    rows are its rows, and their costs cannot be told apart."""
    costs = ChunkCosts(prior_horizon=15_000.0, prior_row_share=0.18)
    _observe_chunks(costs, range(0, 64 * 60, 64), _linear, owed=True)
    assert costs.row_share == 0.18
    # A row and its LM head read as 1.18 rows: a row's cost is their cost over 1.18.
    assert costs.horizon == pytest.approx((PER_ROW + PER_LM_HEAD) / 1.18 / PER_POSITION, rel=1e-6)


@pytest.mark.parametrize("horizon", [6000.0, math.inf])
def test_a_chunk_whose_rows_compute_the_lm_head_is_shorter_by_their_share(horizon):
    allowance = ChunkCosts.cost(0, 64, horizon)
    assert ChunkCosts.chunk_length(0, allowance, horizon, row_share=0.0) == 64
    owed = ChunkCosts.chunk_length(0, allowance, horizon, row_share=0.25)
    assert owed in (51, 52)  # 64 / 1.25 tokens, each a row at position 0 and its LM head
    assert (
        ChunkCosts.cost(0, owed, horizon, 0.25) <= allowance * (1 + 1e-9) < ChunkCosts.cost(0, owed + 1, horizon, 0.25)
    )


# The layer shapes of a Qwen2.5 1.5B.
QWEN2_5_1_5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    num_layers=28,
    vocab_size=151_936,
)
QWEN2_5_1_5B_LAYER = 1536 * 2048 + 1536 * 1536 + 3 * 1536 * 8960  # multiply-adds a token in one layer


def test_the_arithmetic_horizon_of_a_qwen2_5_1_5b():
    """Per token and layer: q, k, v and o (1536 x 2048 + 1536 x 1536) and the MLP (3 x
    1536 x 8960) against QK and PV over 12 heads of 128 (3072 a position)."""
    config = tiny_config("qwen2", **QWEN2_5_1_5B)
    assert arithmetic_horizon(config) == pytest.approx(QWEN2_5_1_5B_LAYER / 3072)


def test_the_lm_head_share_of_a_qwen2_5_1_5b():
    """152k ids of 1536 against 28 layers of the arithmetic above."""
    config = tiny_config("qwen2", **QWEN2_5_1_5B)
    assert lm_head_share(config) == pytest.approx(1536 * 151_936 / (28 * QWEN2_5_1_5B_LAYER))
    assert 0.17 < lm_head_share(config) < 0.19


def _chunks_read(engine: Engine, seq, steps: int) -> list[int]:
    lengths = []
    for _ in range(steps):
        before = seq.cache.length
        engine.step()
        lengths.append(seq.cache.length - before)
    return lengths


def _read_beside_a_decoding_sequence(target, prompt: list[int], params: SamplingParams, steps: int):
    """A greedy sequence decoding, then `prompt` joining: (that sequence, the prompt's,
    the chunks the prompt's first `steps` steps read), both run to their end."""
    engine = Engine(target, eos_token_ids=[EOS], prefill_chunk_size=16)
    running = engine.add_request([5, 9, 13], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.step()
    late = engine.add_request(prompt, params)
    lengths = _chunks_read(engine, late, steps)
    assert running.num_output_tokens == 1 + steps  # a token every step beside the chunks
    while engine.has_unfinished():
        engine.step()
    return running, late, lengths


def _priced_chunks(chunk_size: int, horizon: float, steps: int, row_share: float = 0.0) -> list[int]:
    """The chunks a prompt read from position 0 takes, each priced against a whole chunk
    at position 0."""
    lengths, start = [], 0
    for _ in range(steps):
        allowance = ChunkCosts.cost(0, chunk_size, horizon)
        lengths.append(ChunkCosts.chunk_length(start, allowance, horizon, row_share))
        start += lengths[-1]
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

    running, late, lengths = _read_beside_a_decoding_sequence(target, long_prompt, GREEDY, 8)
    expected = _priced_chunks(16, horizon, 8)
    assert lengths == expected and expected[0] == 16 and expected[-1] <= 12
    assert late.output_ids == solo
    assert running.output_ids == Engine(target, eos_token_ids=[EOS]).generate([5, 9, 13], running.params).output_ids


def test_a_prompt_owing_logprobs_reads_chunks_shorter_by_its_lm_head_rows():
    """Beside a decoding sequence, a prompt that computes the LM head at every row
    (prompt_logprobs) reads chunks the allowance pays for at `lm_head_share` more a
    token; its prompt logprobs and output, and the decoding sequence's, are their solo
    runs'."""
    target = random_decoder("qwen2", seed=1)
    horizon, share = arithmetic_horizon(target.config), lm_head_share(target.config)
    long_prompt = [3 + i % 90 for i in range(100)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    solo = Engine(target, eos_token_ids=[EOS]).generate(long_prompt, params)

    running, late, lengths = _read_beside_a_decoding_sequence(target, long_prompt, params, 4)
    expected = _priced_chunks(16, horizon, 4, share)
    assert lengths == expected and expected[0] < 16
    assert late.output_ids == solo.output_ids and late.prompt_logprobs == solo.prompt_logprobs
    assert running.output_ids == Engine(target, eos_token_ids=[EOS]).generate([5, 9, 13], running.params).output_ids
