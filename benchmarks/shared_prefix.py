"""Requests that share a long system prompt, with the prefix cache off and on, side by side.

Starts `specserve serve` without and with `--enable-prefix-caching`, in turn, `--rounds`
times, and benches each with `specserve bench --shared-prefix-tokens N`: every prompt
starts with the same N tokens of text, and the first `--concurrency` requests arrive
together (or at `--request-rate`). Prints per run the TTFT, the output throughput and
the share of prompt tokens the server found in its cache, then the medians per
variant and their on/off ratios.

    .venv/bin/python benchmarks/shared_prefix.py --quantization int4      # benchmarks/README.md's figures
    .venv/bin/python benchmarks/shared_prefix.py --quantization int4 \\
        --speculative-config '{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 7}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

from specserve import catalogue, cli
from specserve.bench import benchmark
from specserve.bench.local_server import ServerProcess
from specserve.bench.options import options_from_args
from specserve.model.quant import QUANTIZATIONS

FIGURES = {  # column -> summary key
    "ttft mean s": "results_ttft_s_mean",
    "ttft p50 s": "results_ttft_s_quantiles_p50",
    "ttft p90 s": "results_ttft_s_quantiles_p90",
    "out tok/s": "results_mean_output_throughput_token_per_s",
    "from cache": "results_prefix_cache_hit_rate",
    "run s": "results_duration_s",
}


def bench_once(args, caching: bool, results_dir: str) -> dict:
    """One server (cache off or on), one bench run against it: the test case's summary."""
    serve_args = [
        "--quantization",
        args.quantization,
        "--device",
        args.device,
        "--max-num-seqs",
        str(max(args.concurrency, 8)),
        "--log-stats-interval",
        "0",
    ]
    if args.speculative_config:
        serve_args += ["--speculative-config", args.speculative_config]
    if caching:
        serve_args.append("--enable-prefix-caching")
    server = ServerProcess(args.target, *serve_args, startup_timeout_s=600)
    try:
        options = options_from_args(
            cli.build_parser().parse_args(
                [
                    "bench",
                    "--url",
                    server.url,
                    "--tokenizer",
                    args.target,
                    "--test-case",
                    args.test_case,
                    "--shared-prefix-tokens",
                    str(args.shared_prefix_tokens),
                    "--mean-output-tokens",
                    str(args.max_tokens),
                    "--stddev-output-tokens",
                    "0",
                    "--num-concurrent-requests",
                    str(args.concurrency),
                    "--max-num-completed-requests",
                    str(args.requests),
                    "--request-rate",
                    args.request_rate,
                    "--additional-sampling-params",
                    '{"temperature": 0}',
                    "--results-dir",
                    results_dir,
                ]
            )
        )
        (result,) = benchmark.run(options)
        return result.summary
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=catalogue.DEFAULT_TARGET)
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    parser.add_argument("--device", default="auto", help="the servers' --device: auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--speculative-config", default=None, metavar="JSON", help="serve with speculation (both variants)"
    )
    parser.add_argument("--shared-prefix-tokens", type=int, default=1000)
    parser.add_argument("--test-case", default="structured", help="the prompts after the shared prefix")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--request-rate", default="inf", help="requests/s (default inf: the first ones together)")
    parser.add_argument("--rounds", type=int, default=2, help="off then on, this many times")
    parser.add_argument("--json", action="store_true", help="one JSON object per run")
    args = parser.parse_args()

    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for variant in runs:
                print(f"round {round_ + 1}: prefix cache {variant} ...", file=sys.stderr, flush=True)
                summary = bench_once(args, variant == "on", f"{scratch}/{variant}{round_}")
                runs[variant].append({column: summary[key] for column, key in FIGURES.items()})
                if args.json:
                    print(json.dumps({"variant": variant, "round": round_ + 1, **runs[variant][-1]}), flush=True)
    if args.json:
        return 0
    print(
        f"\n{args.target} ({args.quantization}{', speculative' if args.speculative_config else ''}): "
        f"{args.shared_prefix_tokens} shared prompt tokens, {args.requests} requests of {args.max_tokens} tokens, "
        f"{args.concurrency} at a time, rate {args.request_rate}\n"
    )
    print(f"{'variant':<10}" + "".join(f"{column:>13}" for column in FIGURES))
    for variant, rows in runs.items():
        for row in rows:
            print(f"{variant:<10}" + "".join(cell(row[c]) for c in FIGURES))
    medians = {v: {c: median_of(row[c] for row in rows) for c in FIGURES} for v, rows in runs.items()}
    print(
        f"{'on / off':<10}"
        + "".join(
            f"{medians['on'][c] / medians['off'][c]:>12.2f}x"
            if medians["off"][c] and medians["on"][c] is not None
            else f"{'-':>13}"
            for c in FIGURES
        )
    )
    return 0


def cell(value: float | None) -> str:
    """A figure, or '-' where there is none (the hit rate of a server without a prefix cache)."""
    return f"{'-':>13}" if value is None else f"{value:>13.2f}"


def median_of(values) -> float | None:
    values = list(values)
    return None if any(v is None for v in values) else statistics.median(values)


if __name__ == "__main__":
    sys.exit(main())
