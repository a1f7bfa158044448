"""Prometheus metrics of a running server, named and meant as vLLM's under our prefix,
and the periodic log line of throughput and acceptance.

Counters only grow (rates are the dashboard's job, e.g. acceptance rate =
rate(accepted) / rate(draft tokens)). Inter-token latency is observed once per token:
a step that emits n tokens after a gap of g seconds observes g / n n times, so a
speculative server's figure is comparable with a plain one's (and with LLMPerf's).
Every series carries the `model_name` label. Each server owns its registry.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specserve.spec.stats import SpecStats

PREFIX = "specserve:"
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISH_REASONS = ("stop", "length", "abort")

log = logging.getLogger("specserve")


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self._running = Gauge(
            PREFIX + "num_requests_running", "Requests in the running batch.", labels, registry=self.registry
        ).labels(model_name)
        self._waiting = Gauge(
            PREFIX + "num_requests_waiting", "Requests waiting to join the batch.", labels, registry=self.registry
        ).labels(model_name)
        self._preemptions = counter(
            "num_preemptions", "Requests preempted for KV cache space (recomputed when they rejoin)."
        ).labels(model_name)
        self._preemptions_seen = 0
        self._kv_usage = Gauge(
            PREFIX + "kv_cache_usage_perc",
            "Share of the KV cache space the running requests take (0 without a bound).",
            labels,
            registry=self.registry,
        ).labels(model_name)
        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens (prefix-cached ones included).").labels(
            model_name
        )
        # As vLLM counts them (hit rate = hits / queries), with --enable-prefix-caching.
        self._prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.").labels(
            model_name
        )
        self._prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.").labels(model_name)
        self._generation_tokens = counter("generation_tokens", "Tokens generated.").labels(model_name)
        self._success = counter("request_success", "Finished requests by finish reason.", ("finished_reason",))
        self._success_by_reason = {r: self._success.labels(model_name, r) for r in FINISH_REASONS}
        self._ttft = histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS).labels(
            model_name
        )
        self._itl = histogram("inter_token_latency_seconds", "Time between output tokens.", LATENCY_BUCKETS).labels(
            model_name
        )
        self._e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_BUCKETS).labels(
            model_name
        )
        self._prompt_len = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", tuple(2.0**i for i in range(16))
        ).labels(model_name)
        self._output_len = histogram(
            "request_generation_tokens", "Generated tokens per request.", tuple(2.0**i for i in range(16))
        ).labels(model_name)
        self._num_drafts = counter("spec_decode_num_drafts", "Speculative steps that drafted tokens.").labels(
            model_name
        )
        self._num_draft_tokens = counter("spec_decode_num_draft_tokens", "Drafted tokens.").labels(model_name)
        self._num_accepted = counter("spec_decode_num_accepted_tokens", "Accepted drafted tokens.").labels(model_name)
        self._accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted drafted tokens by draft position.", ("position",)
        )
        self._model_name = model_name

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def set_queue(self, running: int, waiting: int) -> None:
        self._running.set(running)
        self._waiting.set(waiting)

    def kv_cache(self, num_preemptions: int, usage: float) -> None:
        """The engine's preemptions so far, and the share of its KV cache space in use."""
        self._preemptions.inc(num_preemptions - self._preemptions_seen)
        self._preemptions_seen = num_preemptions
        self._kv_usage.set(usage)

    def first_token(self, ttft_s: float, num_prompt_tokens: int, num_cached_tokens: int | None = None) -> None:
        """num_cached_tokens: of the prompt, found in the prefix cache (None: no prefix caching)."""
        self._ttft.observe(ttft_s)
        self._prompt_tokens.inc(num_prompt_tokens)
        if num_cached_tokens is not None:
            self._prefix_queries.inc(num_prompt_tokens)
            self._prefix_hits.inc(num_cached_tokens)

    def tokens(self, num_tokens: int, gap_s: float | None) -> None:
        """A step's tokens for one request; gap_s since its previous tokens (None: first)."""
        self._generation_tokens.inc(num_tokens)
        if gap_s is not None and num_tokens:
            for _ in range(num_tokens):
                self._itl.observe(gap_s / num_tokens)

    def finished(self, reason: str, e2e_s: float, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self._success_by_reason.get(reason, self._success.labels(self._model_name, reason)).inc()
        self._e2e.observe(e2e_s)
        self._prompt_len.observe(num_prompt_tokens)
        self._output_len.observe(num_output_tokens)

    def speculation(self, delta: SpecStats) -> None:
        if not delta.num_drafts:
            return
        self._num_drafts.inc(delta.num_drafts)
        self._num_draft_tokens.inc(delta.num_draft_tokens)
        self._num_accepted.inc(delta.num_accepted_tokens)
        for position, count in enumerate(delta.accepted_per_position):
            self._accepted_per_pos.labels(self._model_name, str(position)).inc(count)


class StatLogger:
    """Logs throughput, the queue and acceptance every `interval_s`, like vLLM's
    periodic lines; silent while nothing happens."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._last = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._spec = SpecStats()

    def count(self, prompt_tokens: int, generation_tokens: int, spec: SpecStats | None) -> None:
        self._prompt_tokens += prompt_tokens
        self._generation_tokens += generation_tokens
        if spec is not None:
            self._spec.merge(spec)

    def maybe_log(self, running: int, waiting: int) -> None:
        now = time.monotonic()
        elapsed = now - self._last
        if self.interval_s <= 0 or elapsed < self.interval_s:
            return
        if self._prompt_tokens or self._generation_tokens or running or waiting:
            log.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs",
                self._prompt_tokens / elapsed,
                self._generation_tokens / elapsed,
                running,
                waiting,
            )
        spec = self._spec
        if spec.num_drafts:
            per_position = ", ".join(f"{n / spec.num_drafts:.3f}" for n in spec.accepted_per_position)
            log.info(
                "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, Drafted: %d tokens, "
                "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                spec.mean_acceptance_length,
                spec.num_accepted_tokens,
                spec.num_draft_tokens,
                per_position,
                100 * spec.acceptance_rate,
            )
        self._last, self._prompt_tokens, self._generation_tokens, self._spec = now, 0, 0, SpecStats()
