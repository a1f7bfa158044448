"""Per-request figures from raw responses, and a test case's summary from them, under
LLMPerf's flattened keys (`results_ttft_s_quantiles_p50`, `results_ttft_s_mean`, ...).

Output tokens are the server's `usage.completion_tokens`, else the tokenizer's count
of the generated text (a thinking model's reasoning included): never the number of SSE
chunks, since a speculative server sends several tokens per chunk. Per request, TTFT
runs to the first non-empty chunk of content or reasoning (the whole request when none
came), inter-token latency is TPOT = (e2e - ttft) / (tokens - 1) (0 for a single token),
and chunk gaps are the times between such chunks. Failed requests keep their error and
`null` figures; distributions are over successful requests only (`chunk_gap_s` over all
their gaps). Quantiles interpolate linearly and stddev is the sample stddev (0 for one
value), as pandas gives LLMPerf.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from specserve.bench.client import StreamedResponse
from specserve.bench.workload import BenchRequest
from specserve.errors import ConfigError

QUANTILES = (25, 50, 75, 90, 95, 99)
REQUEST_METRICS = (
    "ttft_s",
    "inter_token_latency_s",
    "end_to_end_latency_s",
    "request_output_throughput_token_per_s",
    "number_input_tokens",
    "number_output_tokens",
)
GAP_METRIC = "chunk_gap_s"
GOODPUT_SLOS = {"ttft": "ttft_s", "tpot": "inter_token_latency_s", "e2el": "end_to_end_latency_s"}
# A server's count may include an end-of-sequence token that has no text.
TOKEN_COUNT_TOLERANCE = 1

CountTokens = Callable[[str], int]


def output_tokens(response: StreamedResponse, count_tokens: CountTokens | None) -> int:
    if response.completion_tokens is not None:
        return response.completion_tokens
    if count_tokens is None:
        raise ConfigError(
            "the server sends no usage, so output tokens must be counted with a tokenizer; "
            "pass --tokenizer (a catalogue name or a folder with tokenizer.json)"
        )
    return count_tokens(response.reasoning) + count_tokens(response.text)


def usage_disagrees(response: StreamedResponse, count_tokens: CountTokens | None) -> bool:
    """Both the server's usage and the tokenizer counted the output, and they differ (not
    asked of an answer with reasoning, whose tags and the blanks around them are not sent)."""
    if not response.ok or response.completion_tokens is None or count_tokens is None or response.reasoning:
        return False
    return abs(response.completion_tokens - count_tokens(response.text)) > TOKEN_COUNT_TOLERANCE


def request_record(
    request: BenchRequest,
    response: StreamedResponse,
    *,
    test_case: str,
    run_started_at: float,
    count_tokens: CountTokens | None,
) -> dict[str, Any]:
    """One entry of `<name>_individual_responses.json`."""
    record: dict[str, Any] = {
        "request_index": request.index,
        "test_case": test_case,
        "prompt_name": request.prompt_name,
        "start_time_s": response.started_at - run_started_at,
        "ttft_s": None,
        "inter_token_latency_s": None,
        "end_to_end_latency_s": None,
        "request_output_throughput_token_per_s": None,
        "number_input_tokens": None,
        "number_output_tokens": None,
        "number_total_tokens": None,
        "number_cached_tokens": None,
        "num_chunks": len(response.chunk_times_s),
        "chunk_gaps_s": [],
        "error_code": response.error_code,
        "error_msg": response.error_msg,
    }
    if not response.ok:
        return record
    e2e, times = response.end_to_end_s, response.chunk_times_s
    ttft = times[0] if times else e2e
    tokens = output_tokens(response, count_tokens)
    prompt_tokens = response.prompt_tokens if response.prompt_tokens is not None else request.num_input_tokens
    record.update(
        {
            "ttft_s": ttft,
            "inter_token_latency_s": (e2e - ttft) / (tokens - 1) if tokens > 1 else 0.0,
            "end_to_end_latency_s": e2e,
            "request_output_throughput_token_per_s": tokens / e2e if e2e > 0 else 0.0,
            "number_input_tokens": prompt_tokens,
            "number_output_tokens": tokens,
            "number_total_tokens": None if prompt_tokens is None else prompt_tokens + tokens,
            "number_cached_tokens": response.cached_prompt_tokens,
            "chunk_gaps_s": [later - earlier for earlier, later in zip(times, times[1:])],
        }
    )
    return record


def distribution(metric: str, values: list[float]) -> dict[str, float | None]:
    """results_{metric}_quantiles_p25 ... _p99, _mean, _min, _max, _stddev (None when empty)."""
    keys = [f"quantiles_p{q}" for q in QUANTILES] + ["mean", "min", "max", "stddev"]
    if not values:
        return {f"results_{metric}_{key}": None for key in keys}
    quantiles = np.quantile(np.asarray(values, dtype=float), [q / 100 for q in QUANTILES])
    figures = [
        *map(float, quantiles),
        statistics.fmean(values),
        min(values),
        max(values),
        statistics.stdev(values) if len(values) > 1 else 0.0,
    ]
    return {f"results_{metric}_{key}": value for key, value in zip(keys, figures)}


def error_kind(record: dict[str, Any]) -> str:
    """The HTTP status, else the first word of the message (timeout, connection error, ...)."""
    if record["error_code"] is not None:
        return str(record["error_code"])
    return record["error_msg"].split(":", 1)[0]


def good_requests(records: list[dict[str, Any]], slos_ms: dict[str, float]) -> int:
    """Successful requests within every SLO (ttft, tpot, e2el, in ms), as vLLM's goodput."""
    return sum(
        1
        for r in records
        if not r["error_msg"] and all(r[GOODPUT_SLOS[name]] * 1000 <= limit for name, limit in slos_ms.items())
    )


def summarise(
    records: list[dict[str, Any]], duration_s: float, goodput_slos_ms: dict[str, float] | None
) -> dict[str, Any]:
    """The `results_*` keys of a test case's summary (the /metrics ones excepted)."""
    ok = [r for r in records if not r["error_msg"]]
    results: dict[str, Any] = {}
    for metric in REQUEST_METRICS:
        results |= distribution(metric, [r[metric] for r in ok if r[metric] is not None])
    results |= distribution(GAP_METRIC, [gap for r in ok for gap in r["chunk_gaps_s"]])
    num_errors = len(records) - len(ok)
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    good = None if goodput_slos_ms is None else good_requests(records, goodput_slos_ms)
    return results | {
        "results_num_requests_started": len(records),
        "results_num_completed_requests": len(ok),
        "results_number_errors": num_errors,
        "results_error_rate": num_errors / len(records) if records else 0.0,
        "results_error_code_frequency": dict(Counter(error_kind(r) for r in records if r["error_msg"])),
        "results_mean_output_throughput_token_per_s": sum(r["number_output_tokens"] for r in ok) * per_s,
        "results_num_completed_requests_per_min": len(ok) * per_s * 60,
        "results_duration_s": duration_s,
        "results_goodput_requests_per_s": None if good is None else good * per_s,
        "results_goodput_fraction": None if good is None else (good / len(records) if records else 0.0),
        "results_prefix_cache_hit_rate": prefix_cache_hit_rate(ok),
    }


def prefix_cache_hit_rate(records: list[dict[str, Any]]) -> float | None:
    """Prompt tokens the server found in its prefix cache / prompt tokens, over the
    requests whose usage says (None when none does)."""
    told = [r for r in records if r["number_cached_tokens"] is not None and r["number_input_tokens"]]
    if not told:
        return None
    return sum(r["number_cached_tokens"] for r in told) / sum(r["number_input_tokens"] for r in told)
