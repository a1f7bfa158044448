"""The load of one test case: its requests sent in order, each when it arrives (a Poisson
process at `request_rate` per second; `inf`: all at once) and a slot is free (at most
`concurrency` in flight), until all are sent or the run's `timeout_s` runs out; a
progress bar on stderr counts finished requests.

Invariants: requests start in index order; every started request ends with a response
(a timeout error at the deadline), so nothing is left in flight; an exception from
`send` is a flaw of the set-up rather than of the server: it stops the run and is
raised.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tqdm import tqdm

from specserve.bench.client import StreamedResponse
from specserve.bench.workload import BenchRequest

# send(request, deadline in event-loop time) -> its response
Send = Callable[[BenchRequest, float], Awaitable[StreamedResponse]]


@dataclass(frozen=True)
class LoadResult:
    responses: list[StreamedResponse]  # in start order: responses[i] answers requests[i]
    started_at: float  # time.perf_counter() at the run's start
    duration_s: float  # until the last response ended


def arrival_offsets(num_requests: int, request_rate: float, rng: random.Random) -> list[float]:
    """When each request arrives, s after the start: the first at once, then exponential gaps."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


async def run_load(
    requests: list[BenchRequest],
    send: Send,
    *,
    concurrency: int,
    request_rate: float,
    timeout_s: float,
    seed: int,
    description: str,
) -> LoadResult:
    loop = asyncio.get_running_loop()
    started_at, start = time.perf_counter(), loop.time()
    deadline = start + timeout_s
    slots = asyncio.Semaphore(concurrency)
    tasks: list[asyncio.Task[StreamedResponse]] = []
    failures: list[Exception] = []
    progress = tqdm(total=len(requests), desc=description, unit="req", file=sys.stderr, dynamic_ncols=True)

    async def one(request: BenchRequest) -> StreamedResponse:
        try:
            return await send(request, deadline)
        except Exception as e:
            failures.append(e)
            raise
        finally:
            slots.release()
            progress.update()

    try:
        for request, offset in zip(
            requests, arrival_offsets(len(requests), request_rate, random.Random(f"{seed}:arrivals"))
        ):
            if start + offset >= deadline or failures:
                break
            await asyncio.sleep(max(0.0, start + offset - loop.time()))
            try:
                async with asyncio.timeout_at(deadline):
                    await slots.acquire()
            except TimeoutError:
                break
            tasks.append(asyncio.create_task(one(request)))
        responses = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        progress.close()
    return LoadResult(list(responses), started_at, time.perf_counter() - started_at)
