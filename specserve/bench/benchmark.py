"""`specserve bench`: each test case's requests against an OpenAI-compatible server, its
/metrics scraped before and after, and two files per test case in --results-dir:

- `<name>_summary.json`: one flat object: the run's settings ("name", "model",
  "test_case", "variant", "url", the length flags, "num_concurrent_requests",
  "request_rate", "additional_sampling_params", "metadata", "timestamp", "version",
  "parts": how many parts its requests were sent in, `specserve ab`'s rounds),
  then the `results_*` keys of `summary.summarise` and `spec_metrics.spec_figures`,
  and "results_num_token_count_disagreements" (requests whose usage and tokenizer
  count differ by more than one token; usage is kept);
- `<name>_individual_responses.json`: the per-request records, in start order;

with name = `{test_case}_{model}_{mean_input_tokens}_{mean_output_tokens}`, each run of
characters other than letters, digits, `.`, `_` and `-` replaced by `-`.
With --emf, each request's figures also go out as CloudWatch EMF lines (see emf.py).
`specserve compare` reads these files: their keys are a contract.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

import specserve
from specserve.bench import emf
from specserve.bench.client import ENDPOINTS, StreamedResponse, open_session, stream_request
from specserve.bench.options import BenchOptions
from specserve.bench.runner import LoadResult, run_load
from specserve.bench.spec_metrics import spec_figures
from specserve.bench.summary import CountTokens, output_tokens, request_record, summarise, usage_disagrees
from specserve.bench.workload import BenchRequest, Workload, build_requests, warmup_request
from specserve.errors import ConfigError
from specserve.tokenizer import Tokenizer


@dataclass(frozen=True)
class BenchResult:
    summary: dict[str, Any]
    summary_path: Path
    individual_responses_path: Path


def result_name(test_case: str, model: str, mean_input_tokens: int, mean_output_tokens: int) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{test_case}_{model}_{mean_input_tokens}_{mean_output_tokens}")


def run(options: BenchOptions) -> Iterator[BenchResult]:
    """Run the test cases one after another, yielding each one's result once written."""
    model, count_tokens, planned = plan(options)
    if options.num_warmups:
        warm_up(options, planned[0][1][0], count_tokens)
    for workload, requests in planned:
        yield run_test_case(options, workload, requests, model, count_tokens)


def plan(options: BenchOptions) -> tuple[str, CountTokens | None, list[tuple[Workload, list[BenchRequest]]]]:
    """The model to send, the token counter (None without a tokenizer) and each test
    case's requests, every prompt built before any is sent; the server checked first."""
    if options.emf is not None:
        emf.check_variant(options.metadata)
    model = check_server(options)
    tokenizer_name = options.tokenizer or (model if _is_catalogue_name(model) else None)
    tokenizer = load_tokenizer(tokenizer_name) if tokenizer_name else None
    count_tokens = None if tokenizer is None else (lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    planned = [
        (
            workload,
            build_requests(
                workload,
                options.max_num_completed_requests,
                options.lengths,
                api=options.api,
                model=model,
                sampling_params=options.additional_sampling_params,
                tokenizer=tokenizer,
                seed=options.seed,
            ),
        )
        for workload in options.workloads
    ]
    return model, count_tokens, planned


def check_server(options: BenchOptions) -> str:
    """Refuse an unreachable server or a refused key before any work; the model to send."""
    try:
        reply = httpx.get(f"{options.url}/v1/models", headers=_auth(options.api_key), timeout=30)
    except httpx.HTTPError as e:
        raise ConfigError(
            f"cannot reach the server at {options.url} ({type(e).__name__}: {e}); start it or pass --url"
        ) from None
    if reply.status_code in (401, 403):
        raise ConfigError(
            f"the server at {options.url} refused the API key (HTTP {reply.status_code}); "
            "pass --api-key or set OPENAI_API_KEY"
        )
    served = _served_models(reply)
    if options.model and served and options.model not in served:
        raise ConfigError(
            f"the server at {options.url} serves {', '.join(served)}, not {options.model!r}; "
            "pass one of those as --model"
        )
    if options.model:
        return options.model
    if not served:
        raise ConfigError(f"the server at {options.url} lists no model at /v1/models; pass --model")
    return served[0]


def _served_models(reply: httpx.Response) -> list[str]:
    """The model ids of a /v1/models reply; empty when it is not one."""
    try:
        return [str(model["id"]) for model in reply.json()["data"]] if reply.status_code == 200 else []
    except (ValueError, KeyError, TypeError):
        return []


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """A folder holding tokenizer.json, else whatever `specserve.catalogue.resolve` accepts."""
    from specserve import catalogue

    folder = Path(name_or_path).expanduser()
    if not (folder / "tokenizer.json").is_file():
        folder = catalogue.resolve(name_or_path)
    return Tokenizer.from_dir(folder)


def _is_catalogue_name(name: str) -> bool:
    from specserve import catalogue

    return name in catalogue.CATALOGUE


def run_test_case(
    options: BenchOptions,
    workload: Workload,
    requests: list[BenchRequest],
    model: str,
    count_tokens: CountTokens | None,
) -> BenchResult:
    case = TestCaseRun(options, workload, model, count_tokens)
    case.send(requests)
    return case.finish()


class TestCaseRun:
    """One test case against one server, its requests sent in one or more parts
    (`specserve ab` sends two servers' parts in turn), its result written by `finish`.

    Invariants: the server's metrics are scraped before the first part and after the
    last, so the server must serve nothing else between them; the duration is the
    parts' durations added, and each record's start_time_s counts from the first
    part's start along that serving time alone; the parts together share
    options.timeout_s."""

    def __init__(self, options: BenchOptions, workload: Workload, model: str, count_tokens: CountTokens | None):
        self.options, self.workload, self.model, self.count_tokens = options, workload, model, count_tokens
        self.metrics_before = scrape_metrics(options)
        self.timestamp = time.time()
        self.records: list[dict[str, Any]] = []
        self.responses: list[StreamedResponse] = []
        self.duration_s = 0.0
        self.parts = 0

    def send(self, requests: list[BenchRequest]) -> None:
        """Send one part's requests (those the time left allows) and keep their records."""
        time_left = self.options.timeout_s - self.duration_s
        if time_left <= 0:
            return
        self.parts += 1
        description = self.workload.name if self.parts == 1 else f"{self.workload.name} ({self.parts})"
        options = dataclasses.replace(self.options, timeout_s=time_left)
        load = asyncio.run(_drive(options, requests, self.count_tokens, description))
        self.records += [
            request_record(
                request,
                response,
                test_case=self.workload.name,
                run_started_at=load.started_at - self.duration_s,
                count_tokens=self.count_tokens,
            )
            for request, response in zip(requests, load.responses)
        ]
        self.responses += load.responses
        self.duration_s += load.duration_s

    def finish(self) -> BenchResult:
        """Write the summary and the per-request records; the result."""
        options, metrics_after = self.options, scrape_metrics(self.options)
        name = result_name(
            self.workload.name, self.model, options.lengths.mean_input_tokens, options.lengths.mean_output_tokens
        )
        summary = {
            "name": name,
            "model": self.model,
            "test_case": self.workload.name,
            "variant": options.metadata.get("variant"),
            "url": options.url,
            "mean_input_tokens": options.lengths.mean_input_tokens,
            "stddev_input_tokens": options.lengths.stddev_input_tokens,
            "mean_output_tokens": options.lengths.mean_output_tokens,
            "stddev_output_tokens": options.lengths.stddev_output_tokens,
            "shared_prefix_tokens": options.lengths.shared_prefix_tokens,
            "num_concurrent_requests": options.num_concurrent_requests,
            "request_rate": "inf" if math.isinf(options.request_rate) else options.request_rate,
            "num_warmups": options.num_warmups,
            "parts": self.parts,
            "additional_sampling_params": options.additional_sampling_params,
            "metadata": options.metadata,
            "timestamp": self.timestamp,
            "version": specserve.__version__,
            **summarise(self.records, self.duration_s, options.goodput_slos_ms),
            "results_num_token_count_disagreements": sum(usage_disagrees(r, self.count_tokens) for r in self.responses),
            **spec_figures(self.metrics_before, metrics_after),
        }
        options.results_dir.mkdir(parents=True, exist_ok=True)
        summary_path = options.results_dir / f"{name}_summary.json"
        individual_path = options.results_dir / f"{name}_individual_responses.json"
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        individual_path.write_text(json.dumps(self.records, indent=2) + "\n")
        if options.emf is not None:
            emf.emit(options.emf, self.records, summary)
        return BenchResult(summary, summary_path, individual_path)


async def _drive(
    options: BenchOptions, requests: list[BenchRequest], count_tokens: CountTokens | None, description: str
) -> LoadResult:
    async with open_session(options.url, options.api_key, options.num_concurrent_requests) as http:

        async def send(request: BenchRequest, deadline: float) -> StreamedResponse:
            response = await stream_request(http, ENDPOINTS[options.api], request.body, deadline)
            if response.ok:
                output_tokens(response, count_tokens)  # no usage and no tokenizer: stop the run now
            return response

        return await run_load(
            requests,
            send,
            concurrency=options.num_concurrent_requests,
            request_rate=options.request_rate,
            timeout_s=options.timeout_s,
            seed=options.seed,
            description=description,
        )


def warm_up(options: BenchOptions, first: BenchRequest, count_tokens: CountTokens | None) -> None:
    """Send options.num_warmups requests like `first` one at a time, their results
    dropped: a cold server's first request pays its start-up (the weights paged in from
    disk, first allocations; seconds on a CPU), which would otherwise land in the first
    test case's TTFT, more for a speculative server that also pages in its draft."""
    warmup = warmup_request(first, options.api)
    requests = [dataclasses.replace(warmup, index=i) for i in range(options.num_warmups)]
    asyncio.run(_drive(dataclasses.replace(options, num_concurrent_requests=1), requests, count_tokens, "warm-up"))


def scrape_metrics(options: BenchOptions) -> str | None:
    """The server's /metrics text, or None where it has none."""
    try:
        reply = httpx.get(f"{options.url}/metrics", headers=_auth(options.api_key), timeout=30)
    except httpx.HTTPError:
        return None
    return reply.text if reply.status_code == 200 else None


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def describe(result: BenchResult) -> str:
    """A few readable lines about one test case."""
    s = result.summary

    def ms(metric: str, q: str) -> str:
        value = s[f"results_{metric}_{q}"]
        return "-" if value is None else f"{value * 1000:.0f} ms"

    lines = [
        f"{s['test_case']}: {s['results_num_completed_requests']}/{s['results_num_requests_started']} requests ok "
        f"in {s['results_duration_s']:.1f} s against {s['model']} at {s['url']}",
        f"  ttft          p50 {ms('ttft_s', 'quantiles_p50')}, p99 {ms('ttft_s', 'quantiles_p99')}",
        f"  inter-token   p50 {ms('inter_token_latency_s', 'quantiles_p50')}, "
        f"p99 {ms('inter_token_latency_s', 'quantiles_p99')}",
        f"  end-to-end    p50 {ms('end_to_end_latency_s', 'quantiles_p50')}, "
        f"p99 {ms('end_to_end_latency_s', 'quantiles_p99')}",
        f"  output        {s['results_mean_output_throughput_token_per_s']:.1f} tok/s overall, "
        f"mean {s['results_number_output_tokens_mean'] or 0:.1f} tokens per request",
    ]
    if s["results_spec_acceptance_rate"] is not None:
        lines.append(
            f"  speculation   acceptance {s['results_spec_acceptance_rate']:.1%}, "
            f"mean acceptance length {s['results_spec_mean_acceptance_length']:.2f}"
        )
    hit_rate = s["results_prefix_cache_hit_rate"]
    if hit_rate is not None and (hit_rate > 0 or s["shared_prefix_tokens"]):
        lines.append(f"  prefix cache  {hit_rate:.1%} of prompt tokens found in the server's cache")
    if s["results_goodput_requests_per_s"] is not None:
        lines.append(
            f"  goodput       {s['results_goodput_requests_per_s']:.2f} req/s "
            f"({s['results_goodput_fraction']:.0%} of requests within the SLOs)"
        )
    if s["results_number_errors"]:
        lines.append(f"  errors        {s['results_number_errors']} ({s['results_error_code_frequency']})")
    if s["results_num_token_count_disagreements"]:
        lines.append(
            f"  warning       {s['results_num_token_count_disagreements']} requests: the server's usage "
            "and the tokenizer's count disagree (usage kept)"
        )
    lines.append(f"  -> {result.summary_path}")
    return "\n".join(lines)
