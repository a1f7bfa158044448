"""AsyncEngine's thread: one request's failure is its own, and no request waits forever.

Runs in process on a tiny random target and a word-level tokenizer of its vocabulary,
so each failure is injected exactly where it is meant to happen.
"""

from __future__ import annotations

import asyncio

import pytest
import tokenizers
import torch

from specserve.engine.engine import Engine
from specserve.engine.text_output import TextOutput
from specserve.model.decoder import Decoder
from specserve.sampling import SamplingParams
from specserve.server.async_engine import AsyncEngine, EngineStepError, ShuttingDownError
from specserve.server.metrics import ServerMetrics
from specserve.tokenizer import Tokenizer
from tests.conftest import tiny_config

VOCAB = 96
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
HEALTHY, FAILING = [5, 9, 13], [7, 7, 7]


def word_tokenizer() -> Tokenizer:
    words = {f"w{i}": i for i in range(VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, bos_token_id=None, declared_eos_ids=[95], add_bos=False, chat_template=None)


def make_engine() -> AsyncEngine:
    torch.manual_seed(0)
    engine = Engine(Decoder(tiny_config("llama", vocab_size=VOCAB)).eval(), eos_token_ids=[95])
    return AsyncEngine(engine, word_tokenizer(), ServerMetrics("tiny"))


async def collect(async_engine: AsyncEngine, prompt: list[int]) -> tuple[str, int] | Exception:
    """The request's text and number of tokens, or the exception it ended with."""
    text, num_tokens = "", 0
    try:
        async for output in async_engine.generate(prompt, GREEDY):
            text, num_tokens = text + output.text, num_tokens + output.num_new_tokens
    except Exception as error:
        return error
    return text, num_tokens


def test_a_request_whose_output_fails_fails_alone(monkeypatch):
    """An output that cannot be made (here: its text raises) fails that request with
    EngineStepError; the request beside it gets all its tokens, and the engine serves on."""
    real_add = TextOutput.add

    def add(self, new_ids, finished):
        if getattr(self, "failing", False):
            raise UnicodeError("a broken tokenizer")
        return real_add(self, new_ids, finished)

    real_init = TextOutput.__init__

    def init(self, tokenizer, prompt_ids, *args, **kwargs):
        real_init(self, tokenizer, prompt_ids, *args, **kwargs)
        self.failing = list(prompt_ids) == FAILING

    monkeypatch.setattr(TextOutput, "add", add)
    monkeypatch.setattr(TextOutput, "__init__", init)
    async_engine = make_engine()
    async_engine.start()

    async def scenario():
        both = await asyncio.gather(collect(async_engine, HEALTHY), collect(async_engine, FAILING))
        return both, await collect(async_engine, HEALTHY)

    (healthy, failing), after = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert isinstance(failing, EngineStepError)
    assert healthy == after and healthy[1] == GREEDY.max_tokens  # as it runs alone
    assert async_engine.alive and not async_engine.engine.running
    async_engine.stop()


def test_a_step_that_fails_after_a_request_left_the_batch_answers_it_too(monkeypatch):
    """A step that fails after a request finished in it (here: freeing its caches raises,
    as a prefix's copy may on a full GPU) answers that request with EngineStepError too,
    though it is no longer running: none waits forever, and the engine serves on."""
    async_engine = make_engine()
    engine = async_engine.engine
    real_free = engine._free_caches

    def free(seq):
        real_free(seq)
        if seq.token_ids[: len(FAILING)] == FAILING:
            raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(engine, "_free_caches", free)
    async_engine.start()

    async def scenario():
        return await collect(async_engine, FAILING), await collect(async_engine, HEALTHY)

    failing, after = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert isinstance(failing, EngineStepError)
    assert after[1] == GREEDY.max_tokens and async_engine.alive and not engine.running
    async_engine.stop()


def test_a_loop_that_fails_answers_every_request_and_refuses_new_ones(monkeypatch):
    """A bug of the loop's own ends the thread: the requests running, waiting and not yet
    read all get EngineStepError at once (none hangs), and new ones ShuttingDownError."""
    async_engine = make_engine()
    async_engine.engine.max_num_seqs = 1  # the second request waits in the engine's queue
    steps = 0
    real_step = async_engine.engine.step

    def step():
        nonlocal steps
        steps += 1
        if steps == 3:
            async_engine.metrics.set_queue = None  # the loop's next bookkeeping raises TypeError
        return real_step()

    monkeypatch.setattr(async_engine.engine, "step", step)
    async_engine.start()

    async def scenario():
        answers = await asyncio.gather(*(collect(async_engine, HEALTHY) for _ in range(3)))
        return answers, await collect(async_engine, HEALTHY)

    answers, late = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert all(isinstance(answer, EngineStepError) for answer in answers)
    assert isinstance(late, ShuttingDownError)
    assert not async_engine.alive and async_engine.num_unfinished == 0


def test_stop_answers_the_requests_queued_behind_it():
    """Requests still in the inbox when `stop` is read, before it or after it, are
    answered ShuttingDownError: none waits on a loop that has ended."""
    async_engine = make_engine()

    async def scenario():
        first = asyncio.ensure_future(collect(async_engine, HEALTHY))
        await asyncio.sleep(0)  # its "add" is in the inbox
        async_engine._commands.put("stop")
        async_engine._stopping = False  # a request sent as stop is read
        second = asyncio.ensure_future(collect(async_engine, HEALTHY))
        await asyncio.sleep(0)
        async_engine.start()
        return await asyncio.gather(first, second)

    async_engine._running = True  # generate() checks `alive` before the thread starts
    first, second = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert isinstance(first, ShuttingDownError) and isinstance(second, ShuttingDownError)
    with pytest.raises(ShuttingDownError):
        async_engine._commands.put("add")
