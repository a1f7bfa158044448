"""Each k's speed were every draft accepted, from measured steps.

An engine whose draft always drafts k (its confidence stop off, no lookups) spends on a
step what k draft positions and a verification of k + 1 rows cost, whatever it
guessed. With the same engine's plain step P (k = 0), a step that accepted every draft
would emit k + 1 tokens in that time:

    speed at full acceptance (x plain) = (k + 1) * P / step(k)

and a step must emit step(k) / P tokens on average (break-even) to pay at all. No
acceptance rate takes speculation past the best of these with that pair on that
machine: the bound the serving code reaches, where `roofline.ceiling` is the one the
bandwidth and the arithmetic peak allow. The settings take turns round by round (the
order alternating) and the ratios are per round, so the machine's swings in speed move
both sides alike. Used by `specserve tune` and benchmarks/full_acceptance.py.
"""

from __future__ import annotations

import statistics
import time

from specserve.config import SpecConfig
from specserve.engine.engine import Engine
from specserve.errors import SpecserveError
from specserve.sampling import SamplingParams
from specserve.spec.fused import FusedDraftProposer


def always_drafting(draft: str, k: int, method: str = "draft_model") -> SpecConfig:
    """The speculative config whose draft (a draft model, or an EAGLE or Medusa head)
    drafts k every step: fixed k, its confidence stop off, no lookups first (an engine
    measured here runs at most k; `step_costs` sets how many it drafts)."""
    return SpecConfig.parse(
        {
            "method": method,
            "model": draft,
            "num_speculative_tokens": k,
            "adaptive": False,
            "draft_confidence_threshold": 0.0,
            "prompt_lookup_first": None,
        }
    )


def step_costs(
    engine: Engine, prompt_ids: list[int], k: int, max_tokens: int, sampling: dict | None = None
) -> dict[str, float]:
    """Median seconds of a decode step drafting exactly k (0: plain), and of its
    drafting and verifying parts (the fused call's own timing, else the proposer's
    call against the rest of the step), for a request with SamplingParams' `sampling`
    fields (None: greedy)."""
    engine.num_speculative_tokens = k
    fields = {"temperature": 0.0} if sampling is None else sampling
    seq = engine.add_request(prompt_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **fields))
    steps, parts = [], []
    fused = isinstance(engine.proposer, FusedDraftProposer)
    proposing: list[float] = []  # seconds of the step's proposer calls (unfused)
    propose = engine.proposer.propose

    def timed_propose(seqs, num_tokens, least_chances=None):
        started = time.perf_counter()
        drafts = propose(seqs, num_tokens, least_chances)
        proposing.append(time.perf_counter() - started)
        return drafts

    engine.proposer.propose = timed_propose
    try:
        while not seq.finished:
            prefilled, full_draft = seq.prefilled, seq.remaining_tokens > k + 1
            proposing.clear()
            started = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - started
            if prefilled and full_draft:
                steps.append(seconds)
                if fused and k:
                    parts.append(engine.proposer.last_seconds)
                elif k:
                    parts.append((sum(proposing), seconds - sum(proposing)))
    finally:
        del engine.proposer.propose  # the class's own again
    steps, parts = steps[1:], parts[1:]  # the first decode step also reads the prompt into the draft
    if not steps:
        raise SpecserveError(f"{max_tokens} tokens leave no whole step of k = {k}; decode more (--max-tokens)")
    costs = {"step_s": statistics.median(steps)}
    if parts:
        costs["drafting_s"] = statistics.median(d for d, _ in parts)
        costs["verifying_s"] = statistics.median(v for _, v in parts)
    return costs


def measure(
    engine: Engine, prompt_ids: list[int], ks: list[int], rounds: int, max_tokens: int, sampling: dict | None = None
) -> list[dict]:
    """One row per k: the medians over rounds of its step costs and of its speed at full
    acceptance against the same round's plain step (a request sampling as `sampling`
    asks, or greedy)."""
    settings = [0, *ks]
    runs: dict[int, list[dict]] = {k: [] for k in settings}
    for r in range(rounds):
        for k in settings if r % 2 == 0 else reversed(settings):
            runs[k].append(step_costs(engine, prompt_ids, k, max_tokens, sampling))
    plain = [run["step_s"] for run in runs[0]]
    rows = []
    for k in settings:
        row = {"k": k, **{key: statistics.median(run[key] for run in runs[k]) for key in runs[k][0]}}
        if k:
            speeds = [(k + 1) * p / run["step_s"] for p, run in zip(plain, runs[k])]
            row["full_acceptance_speedup"] = statistics.median(speeds)
            row["speedup_range"] = (min(speeds), max(speeds))
            row["break_even_tokens"] = statistics.median(run["step_s"] / p for p, run in zip(plain, runs[k]))
        rows.append(row)
    return rows


def best(rows: list[dict]) -> dict:
    """The row of the k with the highest speed at full acceptance (of `measure`'s)."""
    return max(rows[1:], key=lambda row: row["full_acceptance_speedup"])
