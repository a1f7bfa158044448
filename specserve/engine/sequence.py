"""One request's state as it moves through the engine.

Invariant: once the sequence has its first output token, its target `cache` holds
exactly `len(token_ids) - 1` positions between steps (`prefilled`); the newest token is
the next step's input. A step may therefore feed several tokens at once (a chunk of the
prompt, or the newest token plus k drafted ones) and a rejection is undone by moving the
cache's end pointer. Before that, and after a preemption (engine.py) until it has read
its tokens again, the cache holds the chunks fed so far.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from specserve.logprobs import TokenLogprob
from specserve.model.kv_cache import KVCache
from specserve.penalties import distinct_ids
from specserve.sampling import SamplingParams, keyed_uniform, seed_key
from specserve.spec.prediction import PredictionDrafts
from specserve.spec.stats import SpecStats


@dataclass(eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt, then every output token so far
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator
    cache: KVCache
    stop_token_ids: frozenset[int]  # EOS ids and the request's own stop ids
    spec: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" once finished
    failure: Exception | None = None  # what ended it, with finish reason "error"
    lookup_accepted: int | None = None  # of its last lookup-first draft (engine.py), None before one
    # A lookup draft being compared with the tokens that follow it: (where it starts in
    # token_ids, its tokens); see Engine._compare_lookups.
    lookup_pending: tuple[int, list[int]] | None = None
    prediction: PredictionDrafts | None = None  # where params.prediction is given: its drafts' state
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache, not prefilled
    num_preemptions: int = 0  # times it gave its caches up for others (engine.py)
    # Its turn among the prompts being read: the prompt tokens the engine had read when it
    # joined, plus those it must read (Engine._reading_order); lower reads first.
    read_turn: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, if params.logprobs is set
    # One per prompt token from the second, in order, as the prompt is read, if params.prompt_logprobs is set.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    priority: int = 0  # lower runs first, under the engine's "priority" scheduling policy
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if self.params.prediction is not None:
            self.prediction = PredictionDrafts(self.params.prediction)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @functools.cached_property
    def prompt_distinct_ids(self) -> torch.Tensor:  # [U] int64
        """The prompt's distinct ids, what its penalties read (`penalties.distinct_ids`)."""
        return distinct_ids(self.token_ids[: self.num_prompt_tokens])

    @functools.cached_property
    def _prompt_hash(self) -> int:
        return hash(tuple(self.token_ids[: self.num_prompt_tokens]))

    def same_prompt_as(self, other: Sequence) -> bool:
        """Whether other's prompt is this one's (a request's n choices share theirs)."""
        n = self.num_prompt_tokens
        return (
            other.num_prompt_tokens == n
            and other._prompt_hash == self._prompt_hash
            and other.token_ids[:n] == self.token_ids[:n]
        )

    def take_prompt_logprobs(self, other: Sequence) -> None:
        """Those of other's prompt logprobs (the same prompt's, as many alternatives) that
        this sequence has not read yet: a request's choices read their prompt once."""
        if other.params.prompt_logprobs == self.params.prompt_logprobs is not None:
            self.prompt_logprobs.extend(other.prompt_logprobs[len(self.prompt_logprobs) :])

    @functools.cached_property
    def _key(self) -> int:
        return seed_key(self.params.seed)

    def keyed_uniforms(self, start: int, count: int, device: torch.device) -> torch.Tensor:
        """A seeded request's draws [count] float32 for its tokens at indices start,
        start + 1, ... of token_ids (sampling.keyed_uniforms), made on the host."""
        draws = [keyed_uniform(self._key, position) for position in range(start, start + count)]
        return torch.tensor(draws, dtype=torch.float32, device=device)

    def prompt_rows_to_score(self, start: int, count: int) -> range:
        """The positions among [start, start + count) whose rows give prompt logprobs
        not yet held: position p's row scores prompt token p + 1."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs)), min(start + count, self.num_prompt_tokens - 1))

    @property
    def scored_prompt_end(self) -> int | None:
        """How many leading positions a cache may be given without being read (the
        prefix cache's, another sequence's): all of them, or, while prompt logprobs are
        owed, those whose rows were read already."""
        if self.params.prompt_logprobs is None or len(self.prompt_logprobs) == self.num_prompt_tokens - 1:
            return None
        return len(self.prompt_logprobs)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilled(self) -> bool:
        """The first token was sampled and the cache holds every token before the newest
        (not so for a preempted sequence until it has read its tokens again)."""
        return len(self.token_ids) > self.num_prompt_tokens and self.cache.length == len(self.token_ids) - 1

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - self.num_output_tokens

    def append(self, new_tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """Append a step's tokens (and their logprobs, one each) up to a stop token or
        max_tokens; return those kept."""
        kept: list[int] = []
        for token in new_tokens[: self.remaining_tokens]:
            kept.append(token)
            if token in self.stop_token_ids:
                self.finish_reason = "stop"
                break
        self.token_ids.extend(kept)
        if logprobs is not None:
            self.logprobs.extend(logprobs[: len(kept)])
        now = time.perf_counter()
        if self.first_token_time is None and kept:
            self.first_token_time = now
        if self.finish_reason is None and self.remaining_tokens == 0:
            self.finish_reason = "length"
        if self.finished:
            self.finish_time = now
        return kept

    def finish(self, reason: str) -> None:
        """End the sequence from outside (a stop string, an abort), unless it ended already."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finish_time = time.perf_counter()

    def fail(self, error: Exception) -> None:
        """End the sequence because its own step failed; its batch goes on."""
        self.failure = error
        self.finish("error")

    def timings(self) -> dict[str, float | None]:
        """TTFT, time per output token after the first, and end-to-end latency (s)."""
        end = self.finish_time or time.perf_counter()
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        tpot = None
        if ttft is not None and self.num_output_tokens > 1:
            tpot = (end - self.first_token_time) / (self.num_output_tokens - 1)
        return {"ttft_s": ttft, "tpot_s": tpot, "e2e_s": end - self.arrival_time}
