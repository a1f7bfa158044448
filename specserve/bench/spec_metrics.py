"""Speculative-decoding figures of a test case from the server's Prometheus /metrics,
scraped before and after it: the counters' differences, then the acceptance rate
(accepted / drafted tokens), the mean acceptance length (1 + accepted / drafts) and the
per-position acceptance (accepted at position i / drafts), as vLLM derives them.

Our server's names (`specserve:spec_decode_*_total`) and vLLM's (`vllm:...`) are both
read, summed over every other label (e.g. `model_name`). The figures count all the
server did meanwhile, so they are exact only while nothing else talks to it. No
counters after the run (a server without them, or no /metrics) gives `None` figures.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("specserve:", "vllm:")
TOTALS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POSITION = "num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecCounters:
    totals: dict[str, float] = field(default_factory=dict)  # TOTALS name -> value
    accepted_per_position: dict[int, float] = field(default_factory=dict)


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The spec-decode counters in a /metrics exposition; None when it has none (or is not one)."""
    totals: dict[str, float] = defaultdict(float)
    per_position: dict[int, float] = defaultdict(float)
    found = False
    try:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except ValueError:
        return None
    for sample in samples:
        name = next((sample.name[len(p) :] for p in PREFIXES if sample.name.startswith(p)), "")
        if not (name.startswith("spec_decode_") and name.endswith("_total")):
            continue
        counter = name[len("spec_decode_") : -len("_total")]
        if counter == PER_POSITION and "position" in sample.labels:
            per_position[int(sample.labels["position"])] += sample.value
            found = True
        elif counter in TOTALS:
            totals[counter] += sample.value
            found = True
    return SpecCounters(dict(totals), dict(per_position)) if found else None


def spec_figures(before: str | None, after: str | None) -> dict[str, Any]:
    """The `results_spec_*` keys of a summary from /metrics texts before and after a run."""
    end = parse_spec_counters(after) if after is not None else None
    if end is None:
        return {
            "results_spec_num_drafts": None,
            "results_spec_num_draft_tokens": None,
            "results_spec_num_accepted_tokens": None,
            "results_spec_acceptance_rate": None,
            "results_spec_mean_acceptance_length": None,
            "results_spec_accepted_per_position": None,
        }
    start = (parse_spec_counters(before) if before is not None else None) or SpecCounters()

    def delta(name: str) -> int:
        return round(end.totals.get(name, 0.0) - start.totals.get(name, 0.0))

    drafts, draft_tokens, accepted = (delta(name) for name in TOTALS)
    positions = range(max(end.accepted_per_position, default=-1) + 1)
    return {
        "results_spec_num_drafts": drafts,
        "results_spec_num_draft_tokens": draft_tokens,
        "results_spec_num_accepted_tokens": accepted,
        "results_spec_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "results_spec_mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "results_spec_accepted_per_position": [
            (end.accepted_per_position.get(i, 0.0) - start.accepted_per_position.get(i, 0.0)) / drafts
            for i in positions
        ]
        if drafts
        else [],
    }
