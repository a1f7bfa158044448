"""One HTTP request's choices (server/fanout.py) over a stand-in engine: merged
outputs, refusals that close every choice, and each sample's seed."""

from __future__ import annotations

import asyncio

import pytest

from specserve.errors import ConfigError
from specserve.sampling import SEED_MAX, SamplingParams
from specserve.server.async_engine import QueueFullError, RequestOutput
from specserve.server.fanout import Fanout, sample_params


class StandInEngine:
    """generate() yields `steps` outputs per request, or refuses the request whose
    prompt is [refused]; records which requests were closed before their end."""

    def __init__(self, steps: int = 3, refused: int | None = None):
        self.steps, self.refused = steps, refused
        self.closed_early: list[int] = []

    async def generate(self, prompt_ids, params, stop=(), arrival_time=None, per_token=False):
        if prompt_ids == [self.refused]:
            raise QueueFullError("full", retry_after_s=1)
        done = False
        try:
            for step in range(self.steps):
                await asyncio.sleep(0.001 * (1 + prompt_ids[0] % 3))  # the choices interleave
                done = step == self.steps - 1
                yield RequestOutput(text=f"{prompt_ids[0]}.{step} ", num_new_tokens=1, finished=done)
        finally:
            if not done:
                self.closed_early.append(prompt_ids[0])


def requests(*prompts: int) -> list[tuple[list[int], SamplingParams]]:
    return [([p], SamplingParams()) for p in prompts]


def test_choices_run_to_their_end_each_in_order():
    engine = StandInEngine()

    async def run():
        return await Fanout(engine, requests(0, 1, 2), (), 0.0).collect()

    results = asyncio.run(run())
    assert ["".join(r.text) for r in results] == ["0.0 0.1 0.2 ", "1.0 1.1 1.2 ", "2.0 2.1 2.2 "]
    assert all(r.last.finished for r in results) and not engine.closed_early


@pytest.mark.parametrize("streamed", [False, True])
def test_a_refused_choice_closes_the_others(streamed):
    engine = StandInEngine(steps=50, refused=1)

    async def run() -> None:
        choices = Fanout(engine, requests(0, 1, 2), (), 0.0)
        await (choices.start() if streamed else choices.collect())

    with pytest.raises(QueueFullError):
        asyncio.run(run())
    assert sorted(engine.closed_early) == [0, 2]


def test_a_stream_starts_with_every_choices_first_output_and_closes_on_demand():
    engine = StandInEngine(steps=50)

    async def run() -> list[tuple[int, str]]:
        choices = Fanout(engine, requests(0, 1), (), 0.0)
        await choices.start()
        seen = [(choice, out.text) async for choice, out in _take(choices, 4)]
        await choices.aclose()
        return seen

    seen = asyncio.run(run())
    assert {text for _, text in seen[:2]} == {"0.0 ", "1.0 "}  # the first outputs, buffered by start
    assert sorted(engine.closed_early) == [0, 1]


async def _take(choices: Fanout, n: int):
    for _ in range(n):
        yield await anext(choices)


def test_sample_j_draws_with_seed_plus_j():
    params = SamplingParams(seed=5, temperature=1.0)
    assert [sample_params(params, j).seed for j in range(3)] == [5, 6, 7]
    assert sample_params(SamplingParams(), 2).seed is None
    with pytest.raises(ConfigError, match="seed"):
        sample_params(SamplingParams(seed=SEED_MAX), 1)
