"""One HTTP request's choices (server/fanout.py) over a stand-in engine: merged
outputs, refusals that close every choice, and each sample's seed; and over a real
AsyncEngine, refusals made before any choice reaches its engine."""

from __future__ import annotations

import asyncio

import pytest

from specserve.errors import ConfigError
from specserve.sampling import SEED_MAX, SamplingParams
from specserve.server.async_engine import Place, QueueFullError, RequestOutput
from specserve.server.fanout import Fanout, sample_params
from tests.server.test_async_engine import GREEDY, HEALTHY, make_engine


class StandInEngine:
    """generate() yields `steps` outputs per request, or refuses the request whose
    prompt is [refused]; records which requests were closed before their end."""

    def __init__(self, steps: int = 3, refused: int | None = None):
        self.steps, self.refused = steps, refused
        self.closed_early: list[int] = []

    def check_request(self, prompt_ids, params) -> None:
        pass

    def take_places(self, count: int) -> list:
        return [Place(None) for _ in range(count)]

    async def generate(self, prompt_ids, params, stop=(), arrival_time=None, per_token=False, priority=0, place=None):
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


def unstarted_engine():
    """An AsyncEngine that takes requests but whose loop does not run: its inbox shows
    every command sent to the engine."""
    async_engine = make_engine()
    async_engine._running = True
    return async_engine


def sent_commands(async_engine) -> list[str]:
    return [kind for kind, _ in async_engine._commands.drain(block=False)]


def test_a_choice_the_engine_refuses_refuses_the_request_before_any_choice_is_sent():
    """A prompt past the model's length among a batch's prompts: the request is refused
    at once, and no sibling reaches the engine (to take a slot or a step from others)."""
    async_engine = unstarted_engine()
    too_long = [1] * async_engine.engine.max_model_len

    async def run() -> None:
        await Fanout(async_engine, [(HEALTHY, GREEDY), (too_long, GREEDY), (HEALTHY, GREEDY)], (), 0.0).start()

    with pytest.raises(ConfigError, match="maximum model length"):
        asyncio.run(run())
    assert sent_commands(async_engine) == [] and async_engine.num_unfinished == 0


def test_a_request_of_choices_goes_in_whole_while_one_place_is_free():
    """With no place left, 429 for a request of two choices, nothing sent; with one
    left, both go in (the count passes the bound by one, as a single request's would not)."""
    async_engine = unstarted_engine()
    async_engine.num_unfinished = async_engine.max_unfinished

    async def start() -> None:
        await Fanout(async_engine, [(HEALTHY, GREEDY), (HEALTHY, GREEDY)], (), 0.0).start()

    with pytest.raises(QueueFullError):
        asyncio.run(start())
    assert sent_commands(async_engine) == [] and async_engine.num_unfinished == async_engine.max_unfinished

    async_engine.num_unfinished = async_engine.max_unfinished - 1

    async def admitted() -> int:
        choices = Fanout(async_engine, [(HEALTHY, GREEDY), (HEALTHY, GREEDY)], (), 0.0)
        await asyncio.sleep(0.01)  # each choice's request reaches the engine's commands
        counted = async_engine.num_unfinished
        await choices.aclose()
        return counted

    assert asyncio.run(admitted()) == async_engine.max_unfinished + 1
    assert sent_commands(async_engine).count("add") == 2
    assert async_engine.num_unfinished == async_engine.max_unfinished - 1  # their places given back


def test_requests_arriving_together_cannot_all_pass_the_bound():
    """Requests admitted in one turn of the event loop, before any choice's request has
    begun: each is counted as it is admitted, so the one past the bound gets 429."""
    async_engine = unstarted_engine()

    async def burst() -> list[Fanout]:
        admitted = []
        for _ in range(async_engine.max_unfinished):
            admitted.append(Fanout(async_engine, [(HEALTHY, GREEDY)], (), 0.0))
        with pytest.raises(QueueFullError):
            Fanout(async_engine, [(HEALTHY, GREEDY)], (), 0.0)
        for choices in admitted:
            await choices.aclose()  # cancelled before their requests began: places given back
        return admitted

    asyncio.run(burst())
    assert async_engine.num_unfinished == 0
