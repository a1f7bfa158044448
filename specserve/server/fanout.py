"""One HTTP request's several engine requests: each prompt of a completions batch
times `n` samples, their outputs merged into one stream of (choice index, output).

Invariants:
- A refusal of any of them (a full queue, a bad prompt) refuses the whole HTTP request:
  what can be checked at once is, before any choice reaches the engine (a request
  refused as a whole takes no room or step from others); `start` waits for every
  choice's first output, and on a later error closes them all.
- Closing (the client gone, an error) aborts every choice still running in the engine.
- Choice i is prompt i // n, sample i % n (OpenAI's and vLLM's order); with a seed,
  sample j is drawn with seed + j, so the samples differ and the request repeats.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from specserve.logprobs import TokenLogprob
from specserve.sampling import SamplingParams
from specserve.server.async_engine import AsyncEngine, RequestOutput


def sample_params(params: SamplingParams, sample: int) -> SamplingParams:
    """The parameters of a prompt's sample-th choice."""
    if params.seed is None or sample == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + sample)


@dataclass
class ChoiceResult:
    """A whole choice, for a response that is not streamed."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # where the request asked for them
    last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.last = out


class Fanout:
    """The merged outputs of several `AsyncEngine.generate` streams, one per choice."""

    def __init__(
        self,
        engine: AsyncEngine,
        requests: Sequence[tuple[list[int], SamplingParams]],
        stop: Sequence[str],
        arrival: float,
        per_token: bool = False,
        priority: int = 0,
    ):
        """Raise ShuttingDownError, ConfigError or QueueFullError (nothing started) where
        a choice would be refused, or no place is free in the queue; admitted, every
        choice goes in (AsyncEngine's invariants)."""
        for prompt_ids, params in requests:
            engine.check_request(prompt_ids, params)
        self._places = engine.take_places(len(requests))  # counted now: a burst cannot pass the bound
        self._queue: asyncio.Queue = asyncio.Queue()  # of (choice, RequestOutput or Exception)
        self._unfinished = len(requests)
        self._buffered: list[tuple[int, RequestOutput]] = []
        self._tasks = [
            asyncio.create_task(
                self._pump(i, engine.generate(prompt_ids, params, stop, arrival, per_token, priority, self._places[i]))
            )
            for i, (prompt_ids, params) in enumerate(requests)
        ]

    async def _pump(self, choice: int, outputs: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in outputs:
                self._queue.put_nowait((choice, out))
        except Exception as e:  # a refusal or a failed step: the merged stream raises it
            self._queue.put_nowait((choice, e))

    async def _next(self) -> tuple[int, RequestOutput]:
        choice, item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        if item.finished:
            self._unfinished -= 1
        return choice, item

    async def start(self) -> None:
        """Wait for every choice's first output; raise (all closed) if one is refused."""
        started: set[int] = set()
        try:
            while len(started) < len(self._tasks):
                choice, out = await self._next()
                started.add(choice)
                self._buffered.append((choice, out))
        except BaseException:
            await self.aclose()
            raise

    def __aiter__(self) -> Fanout:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if self._buffered:
            return self._buffered.pop(0)
        if self._unfinished == 0:
            raise StopAsyncIteration
        return await self._next()

    async def collect(self) -> list[ChoiceResult]:
        """Every choice run to its end (closed on an error, which is raised)."""
        results = [ChoiceResult() for _ in self._tasks]
        try:
            async for choice, out in self:
                results[choice].add(out)
        finally:
            await self.aclose()
        return results

    async def aclose(self) -> None:
        """Abort the choices still running (their streams' `finally` tells the engine)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for place in self._places:  # those of choices cancelled before their request began
            place.release()
