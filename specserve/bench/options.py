"""`specserve bench` flags (LLMPerf's token_benchmark_ray.py, plus vLLM's --request-rate
and --goodput) and their validation into one frozen `BenchOptions`.

Every bad value is refused here, before any network traffic, with a `ConfigError`
that names the fix; the test cases and the prompts file are resolved here too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from specserve.bench import emf, suites
from specserve.bench.client import ENDPOINTS
from specserve.bench.summary import GOODPUT_SLOS
from specserve.bench.workload import Lengths, Workload, builtin_workload, load_prompts_file
from specserve.errors import ConfigError

DEFAULT_TEST_CASES = "structured,open-ended"


@dataclass(frozen=True)
class BenchOptions:
    url: str  # the server root, without /v1
    api: str  # "chat" or "completions"
    api_key: str | None
    model: str | None  # None: the first the server lists
    tokenizer: str | None  # None: the model, when it is a catalogue name
    workloads: tuple[Workload, ...]
    lengths: Lengths
    num_concurrent_requests: int
    max_num_completed_requests: int
    request_rate: float  # requests/s; inf = all at once
    timeout_s: float  # per test case
    results_dir: Path
    additional_sampling_params: dict[str, Any]
    metadata: dict[str, str]
    goodput_slos_ms: dict[str, float] | None
    seed: int
    json: bool
    emf: emf.EmfSettings | None = None  # None: no EMF lines
    num_warmups: int = 1  # requests sent before the first test case, not measured


def add_bench_flags(parser: argparse.ArgumentParser, own_servers: bool = False) -> None:
    """The flags of `specserve bench`; `own_servers`: the command starts the servers it
    measures (`ab`), so where to reach them and what they serve are not flags."""
    if own_servers:  # the model name sent is the command's own model (its target)
        parser.set_defaults(url="http://localhost", api_key=None)
    else:
        parser.add_argument(
            "--url",
            default="http://localhost:8000",
            help="the server root; requests go to /v1/chat/completions or /v1/completions",
        )
        parser.add_argument(
            "--api-key",
            default=os.environ.get("OPENAI_API_KEY") or os.environ.get("SPECSERVE_API_KEY"),
            help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY or $SPECSERVE_API_KEY)",
        )
        parser.add_argument("--model", default=None, help="the model name to send (default: the first at /v1/models)")
    parser.add_argument(
        "--api",
        choices=sorted(ENDPOINTS),
        default="chat",
        help="chat: prompts as user messages (default); completions: raw prompts",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="catalogue name or folder with tokenizer.json, to count tokens "
        "(default: --model when it is a catalogue name)",
    )
    parser.add_argument(
        "--test-case",
        default=None,
        metavar="NAME[,NAME]",
        help=f"built-in test cases, each with its own summary: {', '.join(suites.known_test_cases())} "
        f"(default: {DEFAULT_TEST_CASES}, or none with --prompts-file)",
    )
    parser.add_argument(
        "--prompts-file",
        default=None,
        metavar="JSONL",
        help='one {"prompt": ...} or {"messages": [...]} per line, optional "max_tokens" and "name"; '
        '"suffix" beside "prompt" fills in the middle (--api completions)',
    )
    parser.add_argument("--mean-input-tokens", type=int, default=550, help="sonnet prompt length")
    parser.add_argument("--stddev-input-tokens", type=int, default=150)
    parser.add_argument("--mean-output-tokens", type=int, default=150, help="max_tokens of each request")
    parser.add_argument("--stddev-output-tokens", type=int, default=80)
    parser.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=0,
        metavar="N",
        help="start every prompt with the same N tokens of text (a long system prompt), "
        "to measure prefix caching (default 0: none)",
    )
    parser.add_argument("--num-concurrent-requests", type=int, default=1, help="most requests in flight")
    parser.add_argument("--max-num-completed-requests", type=int, default=10, help="requests per test case")
    parser.add_argument(
        "--num-warmups",
        type=int,
        default=1,
        help="requests sent one at a time before the first test case and not measured: a server's "
        "first requests pay its start-up (weights paged in, first allocations), not serving (0: none)",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals, requests/s (default inf: all at once, within the concurrency cap)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600,
        metavar="SECONDS",
        help="time limit of each test case; requests still running then count as errors",
    )
    parser.add_argument("--results-dir", default="results", help="where the JSON results go")
    parser.add_argument(
        "--additional-sampling-params",
        default="{}",
        metavar="JSON",
        help="merged into every request body, e.g. '{\"temperature\": 0}'",
    )
    parser.add_argument(
        "--metadata",
        default="",
        metavar="K=V[,K=V]",
        help="recorded in the summary; variant=NAME names the variant for `specserve compare`",
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs a good request meets, any of ttft:MS tpot:MS e2el:MS",
    )
    parser.add_argument("--seed", type=int, default=0, help="prompt choice, lengths and arrivals")
    parser.add_argument("--json", action="store_true", help="print each summary as one JSON object")
    emf.add_flags(parser)


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    for flag, value, least in (
        ("--mean-input-tokens", args.mean_input_tokens, 1),
        ("--stddev-input-tokens", args.stddev_input_tokens, 0),
        ("--mean-output-tokens", args.mean_output_tokens, 1),
        ("--stddev-output-tokens", args.stddev_output_tokens, 0),
        ("--shared-prefix-tokens", args.shared_prefix_tokens, 0),
        ("--num-concurrent-requests", args.num_concurrent_requests, 1),
        ("--max-num-completed-requests", args.max_num_completed_requests, 1),
        ("--num-warmups", args.num_warmups, 0),
    ):
        if value < least:
            raise ConfigError(f"{flag} must be >= {least}, got {value}")
    if not args.request_rate > 0:
        raise ConfigError(f"--request-rate must be > 0 requests/s (or inf), got {args.request_rate}")
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    return BenchOptions(
        url=_server_root(args.url),
        api=args.api,
        api_key=args.api_key or None,
        model=args.model,
        tokenizer=args.tokenizer,
        workloads=_workloads(args.test_case, args.prompts_file, args.api),
        lengths=Lengths(
            args.mean_input_tokens,
            args.stddev_input_tokens,
            args.mean_output_tokens,
            args.stddev_output_tokens,
            args.shared_prefix_tokens,
        ),
        num_concurrent_requests=args.num_concurrent_requests,
        max_num_completed_requests=args.max_num_completed_requests,
        request_rate=args.request_rate,
        timeout_s=args.timeout,
        results_dir=Path(args.results_dir),
        additional_sampling_params=_sampling_params(args.additional_sampling_params),
        metadata=_metadata(args.metadata),
        goodput_slos_ms=_goodput(args.goodput),
        seed=args.seed,
        json=args.json,
        emf=emf.settings_from_args(args),
        num_warmups=args.num_warmups,
    )


def _server_root(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--url must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def _workloads(test_cases: str | None, prompts_file: str | None, api: str) -> tuple[Workload, ...]:
    names = test_cases if test_cases is not None else ("" if prompts_file else DEFAULT_TEST_CASES)
    workloads = [builtin_workload(name.strip()) for name in names.split(",") if name.strip()]
    if prompts_file:
        workloads.append(load_prompts_file(prompts_file, api))
    if not workloads:
        raise ConfigError(f"--test-case names no test case; known: {', '.join(suites.known_test_cases())}")
    if len({w.name for w in workloads}) < len(workloads):
        raise ConfigError("a test case is named twice; each gets one summary, so name each once")
    return tuple(workloads)


def _sampling_params(text: str) -> dict[str, Any]:
    try:
        params = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--additional-sampling-params is not JSON ({e}); e.g. '{{\"temperature\": 0}}'") from None
    if not isinstance(params, dict):
        raise ConfigError(
            f"--additional-sampling-params must be a JSON object, e.g. '{{\"temperature\": 0}}'; got {text!r}"
        )
    return params


def _metadata(text: str) -> dict[str, str]:
    metadata = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--metadata takes KEY=VALUE pairs separated by commas, e.g. variant=spec; got {pair!r}")
        metadata[key.strip()] = value.strip()
    return metadata


def _goodput(pairs: list[str] | None) -> dict[str, float] | None:
    if pairs is None:
        return None
    slos = {}
    for pair in pairs:
        key, _, value = pair.partition(":")
        try:
            limit = float(value)
        except ValueError:
            limit = math.nan
        if key not in GOODPUT_SLOS or not (limit > 0 and math.isfinite(limit)):
            raise ConfigError(
                f"--goodput takes KEY:MILLISECONDS with KEY one of {', '.join(GOODPUT_SLOS)}, "
                f"e.g. --goodput ttft:500 tpot:50; got {pair!r}"
            )
        slos[key] = limit
    return slos


def comma_list(known: tuple[str, ...], flag: str) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, each one of `known` (else the error
    names the flag and the choices)."""

    def parse(value: str) -> list[str]:
        chosen = [v for v in value.split(",") if v]
        unknown = [v for v in chosen if v not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {flag} {unknown}; choose from {', '.join(known)}")
        return chosen

    return parse
