"""The bridge between the HTTP handlers (asyncio) and the engine (one thread).

The engine is not thread-safe and its steps are long, blocking computations, so its
loop runs on one thread of its own (`serve` gives it the main thread: PyTorch's CPU
kernels run about 15% faster there than on a second thread), apart from the event
loop: handlers send commands (add, abort) through a thread-safe queue, the engine
thread applies them between steps, runs `Engine.step()`, and posts each request's
`RequestOutput`s to that request's asyncio queue.

Invariants:
- Only the engine thread touches the engine, its sequences and the metrics' counters.
- A request leaves the engine when it finishes, when its handler stops listening
  (client gone: the handler's `finally` aborts it at once), or at shutdown.
- A request is admitted while fewer than `max_num_seqs + max_queue_len` are unfinished,
  and one more gets `QueueFullError` (HTTP 429) at once, so waiting requests never pile
  up unbounded. A request of n choices needs one free place, as a single one does, and
  may take the count past the bound by n - 1 (at most the bound itself: the API refuses
  larger ones), so that a steady stream of single requests cannot starve it.
- A request whose own verification fails (Engine.step isolates it), or whose own
  output cannot be made (its text, its stop strings, its abort), fails alone with
  `EngineStepError`; a failing step as a whole fails the requests of that batch. Either
  way the thread goes on serving the others, and the error carries no internals (the
  log has the traceback).
- No request waits forever: when the loop ends, at `stop` or on a bug of its own, every
  request it holds or has yet to read gets an error, and later ones are refused
  (`ShuttingDownError`) as /health turns 503.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from specserve.engine.engine import Engine
from specserve.engine.sequence import Sequence as EngineSequence
from specserve.engine.text_output import TextOutput
from specserve.errors import SpecserveError
from specserve.logprobs import TokenLogprob
from specserve.sampling import SamplingParams
from specserve.server.metrics import ServerMetrics, StatLogger
from specserve.spec.stats import SpecStats
from specserve.tokenizer import Tokenizer

log = logging.getLogger("specserve")

MAX_RETRY_AFTER_S = 30


class Place:
    """One unfinished request's place under the queue's bound; released once, however
    often `release` is called."""

    def __init__(self, engine: AsyncEngine):
        self.engine: AsyncEngine | None = engine

    def release(self) -> None:
        if self.engine is not None:
            self.engine.num_unfinished -= 1
            self.engine = None


class QueueFullError(SpecserveError):
    """Too many requests are waiting already; a slot is likely to free within
    `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ShuttingDownError(SpecserveError):
    """The server is stopping and takes no more work."""


class EngineStepError(Exception):
    """Generating a request failed on our side (a bug): it cannot go on."""

    def __init__(self) -> None:
        super().__init__("internal error while generating this request; the server log has the details")


@dataclass(frozen=True)
class RequestOutput:
    text: str  # new text since the previous output
    num_new_tokens: int
    finished: bool
    token_ids: tuple[int, ...] = ()  # the new tokens' ids
    finish_reason: str | None = None  # "stop" or "length" (or "abort" at shutdown)
    stop_reason: str | int | None = None  # the stop string or stop token id, if one ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # so far
    num_cached_tokens: int | None = None  # of the prompt, found in the prefix cache (None: no prefix caching)
    prediction: tuple[int, int] | None = None  # (accepted, rejected) predicted tokens so far, where it has a prediction
    spec: SpecStats | None = None  # the request's so far (a copy), None without speculation
    logprobs: tuple[TokenLogprob, ...] = ()  # of the new tokens, when the request asked for them
    # Of the prompt's tokens from the second (specserve/logprobs.py), on the request's
    # first output alone, when it asked for them; None otherwise.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    arrival_time: float
    outputs: asyncio.Queue  # of RequestOutput or Exception
    loop: asyncio.AbstractEventLoop
    priority: int = 0  # see Engine.add_request
    per_token: bool = False  # one RequestOutput per token (see AsyncEngine.generate)
    seq: EngineSequence | None = None
    text: TextOutput | None = None
    num_sent_tokens: int = 0
    last_token_time: float | None = None
    done: bool = False

    def post(self, item: RequestOutput | Exception) -> None:
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


@dataclass
class _Commands:
    """Thread-safe inbox of the engine thread; once closed, it takes no more requests."""

    inbox: queue.Queue = field(default_factory=queue.Queue)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False

    def put(self, kind: str, request: _Request | None = None) -> None:
        """Raise ShuttingDownError for an "add" after `close` (nobody would read it)."""
        with self._lock:
            if self._closed:
                if kind == "add":
                    raise ShuttingDownError("the server is shutting down; retry against another replica")
                return
            self.inbox.put((kind, request))

    def close(self) -> list[tuple[str, _Request | None]]:
        """Take no more commands; return those not yet read."""
        with self._lock:
            self._closed = True
            return self.drain(block=False)

    def drain(self, block: bool) -> list[tuple[str, _Request | None]]:
        items = []
        if block:  # wake now and then, so signal handlers run if this is the main thread
            try:
                items.append(self.inbox.get(timeout=0.5))
            except queue.Empty:
                return items
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                return items


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        metrics: ServerMetrics,
        max_queue_len: int = 64,
        log_interval_s: float = 10.0,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_unfinished = engine.max_num_seqs + max_queue_len
        self.num_unfinished = 0  # touched on the event loop only
        self._commands = _Commands()
        self._requests: dict[int, _Request] = {}  # by seq_id; engine thread only
        self._unread: list[tuple[str, _Request | None]] = []  # commands drained, not yet applied
        self._stat_logger = StatLogger(log_interval_s)
        self._spec_seen = engine.spec_stats.copy()
        self._finish_times: deque[float] = deque(maxlen=16)  # of the latest requests to leave
        self._thread: threading.Thread | None = None
        self._running = False
        self._stopping = False

    # ----- event-loop side -----

    def start(self) -> None:
        """Run the engine loop on a thread of its own (`run` runs it on the caller's)."""
        self._thread = threading.Thread(target=self.run, name="specserve-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._running

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: Sequence[str] = (),
        arrival_time: float | None = None,
        per_token: bool = False,
        priority: int = 0,
        place: Place | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Run one request; yield its outputs until the finished one: one per engine step
        (its several tokens under speculation), or with `per_token` one per token, in
        the same order and at the same moment. Stopping the iteration early (client
        gone) aborts the request in the engine. `place`: the one `take_places` gave it
        (a choice of a request admitted whole); else it takes one, or is refused."""
        self.check_request(prompt_ids, params)
        place = place or self.take_places(1)[0]
        try:
            request = _Request(
                prompt_ids=list(prompt_ids),
                params=params,
                stop=tuple(stop),
                per_token=per_token,
                arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
                priority=priority,
                outputs=asyncio.Queue(),
                loop=asyncio.get_running_loop(),
            )
            self._commands.put("add", request)
            try:
                while True:
                    item = await request.outputs.get()
                    if isinstance(item, Exception):
                        raise item
                    yield item
                    if item.finished:
                        return
            finally:
                if not request.done:
                    self._commands.put("abort", request)
        finally:
            place.release()

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise what `generate` would refuse this request with: ShuttingDownError, or
        ConfigError naming the fix (checked here, not on the engine thread)."""
        if self._stopping or not self.alive:
            raise ShuttingDownError("the server is shutting down; retry against another replica")
        self.engine.check_request(prompt_ids, params)

    def take_places(self, count: int) -> list[Place]:
        """Places for a request's `count` choices, taken at once (so that requests arriving
        together cannot all pass the check before any is counted); QueueFullError unless
        one place is free (see the invariants)."""
        self.check_room()
        self.num_unfinished += count
        return [Place(self) for _ in range(count)]

    def check_room(self) -> None:
        """Raise QueueFullError unless a place is free for a request (of any number of choices)."""
        if self.num_unfinished >= self.max_unfinished:
            retry_after_s = self.retry_after_s()
            raise QueueFullError(
                f"the server is at capacity ({self.engine.max_num_seqs} running and "
                f"{self.max_unfinished - self.engine.max_num_seqs} waiting); retry in {retry_after_s} s",
                retry_after_s,
            )

    def retry_after_s(self) -> int:
        """Whole seconds until a request is likely to finish and free a slot: the mean
        interval between the recent finishes (1 s before there are two)."""
        times = list(self._finish_times)
        if len(times) < 2:
            return 1
        interval = (times[-1] - times[0]) / (len(times) - 1)
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(interval)))

    @property
    def accepting(self) -> bool:
        return self.alive and not self._stopping

    def check_token_ids(self, ids: list[int]) -> None:
        """Raise ConfigError for ids outside the vocabulary (safe off the engine thread:
        it reads the model's config alone)."""
        self.engine.check_token_ids(ids)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Fail what is left and end the engine loop (at shutdown, after the grace time)."""
        self._stopping = True
        self._commands.put("stop")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def refuse_new_requests(self) -> None:
        self._stopping = True

    # ----- engine thread -----

    def run(self) -> None:
        """The engine loop: apply commands, step, post outputs; returns after `stop`, or
        after a bug of the loop's own (logged), failing every request it holds."""
        self._running = True
        error: Exception = ShuttingDownError("the server shut down before this request finished")
        try:
            self._loop()
        except Exception:
            log.exception("the engine loop failed; its requests are answered with an error")
            error = EngineStepError()
        finally:
            self._running = False
            for kind, request in self._unread + self._commands.close():
                if kind == "add":  # never reached the engine
                    request.done = True
                    request.post(error)
            self._fail(list(self._requests.values()), error)

    def _loop(self) -> None:
        while True:
            self._unread = self._commands.drain(block=not self.engine.has_unfinished())
            while self._unread:
                kind, request = self._unread.pop(0)
                if kind == "add":
                    self._add(request)
                elif kind == "abort":
                    self._abort(request)
                else:
                    return  # run() answers what is left, self._unread included
            if self.engine.has_unfinished():
                self._step()
            self.metrics.set_queue(len(self.engine.running), len(self.engine.waiting))
            self.metrics.kv_cache(self.engine.num_preemptions, self.engine.kv_cache_usage())
            self._stat_logger.maybe_log(len(self.engine.running), len(self.engine.waiting))

    def _add(self, request: _Request) -> None:
        try:
            seq = self.engine.add_request(request.prompt_ids, request.params, request.arrival_time, request.priority)
        except Exception as e:  # refused (SpecserveError) or a bug: either way only this request fails
            if not isinstance(e, SpecserveError):
                log.exception("adding a request failed")
            request.done = True
            request.post(e)
            return
        request.seq = seq
        params = request.params
        request.text = TextOutput(
            self.tokenizer,
            request.prompt_ids,
            request.stop,
            seq.stop_token_ids,
            params.skip_special_tokens,
            params.min_tokens,
            params.include_stop_str_in_output,
        )
        self._requests[seq.seq_id] = request

    def _abort(self, request: _Request) -> None:
        if request.seq is not None and self._requests.pop(request.seq.seq_id, None) is not None:
            self._end(request)

    def _step(self) -> None:
        try:
            advanced = self.engine.step()
        except Exception:  # a bug: fail this batch, keep serving the rest
            log.exception("engine step failed")
            # Those that left the engine in this step too: their outputs were never posted.
            batch = [r for r in self._requests.values() if r.seq.seq_id in self.engine.running or r.seq.finished]
            self._fail(batch, EngineStepError())
            return
        now = time.perf_counter()
        for seq in advanced:
            request = self._requests.get(seq.seq_id)
            if request is None:
                continue
            try:
                self._emit(request, now)
            except Exception:  # this request's own output (its text, a stop string): it alone fails
                log.exception("the output of request %d failed; the others go on", seq.seq_id)
                self._fail([request], EngineStepError())
        spec = self.engine.spec_stats
        delta = spec - self._spec_seen
        self._spec_seen = spec.copy()
        self.metrics.speculation(delta)
        self._stat_logger.count(0, 0, delta)

    def _emit(self, request: _Request, now: float) -> None:
        seq = request.seq
        if seq.failure is not None:  # its own step failed (Engine.step logged why)
            self._fail([request], EngineStepError())
            return
        num_sent = request.num_sent_tokens
        new_ids = seq.output_ids[num_sent:]
        request.num_sent_tokens = seq.num_output_tokens
        # One output per token for a client that counts events as tokens, else the step's.
        pieces = [slice(i, i + 1) for i in range(len(new_ids))] if request.per_token else []
        pieces = pieces or [slice(0, len(new_ids))]
        texts = []
        for i, piece in enumerate(pieces):
            texts.append(request.text.add(new_ids[piece], finished=seq.finished and piece.stop == len(new_ids)))
            if isinstance(request.text.stop_reason, str):  # a stop string ended the text: nothing after it
                # The ids up to the one that completed it are the output, as a token a step would end.
                pieces[i] = slice(piece.start, piece.start + request.text.ids_used)
                if seq.finished:  # in the step that also reached max_tokens: the text ended first (as vLLM says)
                    seq.finish_reason = "stop"
                else:
                    self.engine.finish(seq.seq_id, reason="stop")
                break
        num_cached_tokens = None if self.engine.prefix_cache is None else seq.num_cached_tokens
        first = request.last_token_time is None
        if first:
            self.metrics.first_token(now - request.arrival_time, seq.num_prompt_tokens, num_cached_tokens)
            self._stat_logger.count(seq.num_prompt_tokens, 0, None)
            gap = None
        else:
            gap = now - request.last_token_time
        request.last_token_time = now
        self.metrics.tokens(len(new_ids), gap)
        self._stat_logger.count(0, len(new_ids), None)
        if seq.finished:
            request.done = True
            self._requests.pop(seq.seq_id, None)
            self._record_finish(seq)
        spec = seq.spec.copy() if self.engine.proposer is not None else None
        prediction = None if seq.prediction is None else (seq.prediction.accepted, seq.prediction.rejected)
        for i, (piece, text) in enumerate(zip(pieces, texts)):
            last = i == len(texts) - 1
            request.post(
                RequestOutput(
                    text=text,
                    num_new_tokens=piece.stop - piece.start,
                    token_ids=tuple(new_ids[piece]),
                    finished=seq.finished and last,
                    finish_reason=seq.finish_reason if last else None,
                    stop_reason=request.text.stop_reason if last else None,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_output_tokens=num_sent + piece.stop,
                    num_cached_tokens=num_cached_tokens,
                    spec=spec,
                    prediction=prediction,
                    logprobs=tuple(seq.logprobs[num_sent:][piece]),
                    prompt_logprobs=tuple(seq.prompt_logprobs)
                    if first and i == 0 and seq.params.prompt_logprobs is not None
                    else None,
                )
            )

    def _record_finish(self, seq: EngineSequence) -> None:
        self._finish_times.append(time.perf_counter())
        self.metrics.finished(
            seq.finish_reason or "abort", seq.timings()["e2e_s"], seq.num_prompt_tokens, seq.num_output_tokens
        )

    def _fail(self, requests: list[_Request], error: Exception) -> None:
        """End these requests in the engine and answer each with `error`."""
        for request in requests:
            self._requests.pop(request.seq.seq_id, None)
            if not request.done:  # an output that failed mid-way may have ended it already
                self._end(request)
            request.done = True
            request.post(error)

    def _end(self, request: _Request) -> None:
        """Take a request's sequence out of the engine and count it as finished; a failure
        of the engine's cleanup is logged, and the others go on."""
        seq_id = request.seq.seq_id
        try:
            self.engine.finish(seq_id)  # it leaves the batch first, whatever fails after
        except Exception:
            log.exception("ending request %d failed", seq_id)
        self._record_finish(request.seq)
