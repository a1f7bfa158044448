"""Time to first token under Poisson load, plain against speculative, in one run.

Starts `specserve serve` for the plain target and for a speculative variant (the draft
at k = 7, adaptive, by default; or an EAGLE-3 or Medusa head: `--variant`; or the plain
target again with other serve flags: `--variant plain --variant-flags ...`; both stay
up, only one under load at a time), then for each request rate and prompt
length runs `specserve bench`'s sonnet workload against each in turn, round after
round. A round's two runs send the same prompts at the same arrival times (one seed),
and rounds alternate which server goes first, so a slow minute of a shared machine
falls on both. Prints, per rate and length, each variant's median over the rounds of
TTFT mean, p50, p90 and p99, inter-token latency p50, the gaps between a stream's chunks
(p99 and the longest: how long a request waits while the others' prompts are read),
end-to-end p50 and output throughput, and the variant/plain ratio of each (median, and
the range over rounds).

    .venv/bin/python benchmarks/ttft_under_load.py                        # int4 pair, 550 tokens, 0.1 and 0.2 req/s
    .venv/bin/python benchmarks/ttft_under_load.py --rates 0.05,0.1 --input-tokens 2000 --requests 16 --rounds 2
    .venv/bin/python benchmarks/ttft_under_load.py --variant adaptive-eagle3 --rates 0.2
    .venv/bin/python benchmarks/ttft_under_load.py --variant plain --variant-flags '--prefill-chunk-size 512'
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from specserve import catalogue
from specserve.bench import benchmark
from specserve.bench.local_server import ServerProcess
from specserve.bench.options import add_bench_flags, options_from_args
from specserve.bench.variants import DEFAULT_EAGLE_HEAD, DEFAULT_MEDUSA_HEAD, VARIANTS, speculative_config

FIGURES = {  # label: (summary key, scale)
    "TTFT mean s": ("results_ttft_s_mean", 1),
    "TTFT p50 s": ("results_ttft_s_quantiles_p50", 1),
    "TTFT p90 s": ("results_ttft_s_quantiles_p90", 1),
    "TTFT p99 s": ("results_ttft_s_quantiles_p99", 1),
    "ITL p50 ms": ("results_inter_token_latency_s_quantiles_p50", 1000),
    "gap p99 ms": ("results_chunk_gap_s_quantiles_p99", 1000),
    "gap max s": ("results_chunk_gap_s_max", 1),
    "E2E p50 s": ("results_end_to_end_latency_s_quantiles_p50", 1),
    "out tok/s": ("results_mean_output_throughput_token_per_s", 1),
}


def bench(server: ServerProcess, rate: float, input_tokens: int, args, seed: int, folder: Path) -> dict:
    flags = [
        "--url",
        server.url,
        "--api",
        "completions",
        "--tokenizer",
        args.target,
        "--test-case",
        "sonnet",
        "--mean-input-tokens",
        str(input_tokens),
        "--stddev-input-tokens",
        str(input_tokens // 10),
        "--mean-output-tokens",
        str(args.output_tokens),
        "--stddev-output-tokens",
        str(args.output_tokens // 6),
        "--num-concurrent-requests",
        str(args.concurrency),
        "--max-num-completed-requests",
        str(args.requests),
        "--request-rate",
        str(rate),
        "--seed",
        str(seed),
        "--timeout",
        "3600",
        "--results-dir",
        str(folder),
        "--additional-sampling-params",
        json.dumps({"temperature": 0, "ignore_eos": True}),
    ]
    parser = argparse.ArgumentParser()
    add_bench_flags(parser)
    (result,) = benchmark.run(options_from_args(parser.parse_args(flags)))
    summary = result.summary
    if summary["results_number_errors"]:
        raise RuntimeError(f"{summary['results_number_errors']} requests failed against {server.url}")
    return {label: summary[key] * scale for label, (key, scale) in FIGURES.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=catalogue.DEFAULT_TARGET)
    parser.add_argument("--draft", default=catalogue.DEFAULT_DRAFT)
    parser.add_argument(
        "--variant",
        default="adaptive",
        help=f"the other server: k=N (the draft at a fixed k) or one of {VARIANTS}",
    )
    parser.add_argument(
        "--variant-flags", default="", help="more `specserve serve` flags for the variant's server, as one string"
    )
    parser.add_argument("--eagle-head", default=DEFAULT_EAGLE_HEAD)
    parser.add_argument("--medusa-head", default=DEFAULT_MEDUSA_HEAD)
    parser.add_argument("--quantization", default="int4")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--rates", default="0.1,0.2", help="requests/s, comma-separated")
    parser.add_argument("--input-tokens", type=int, default=550)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16, help="most requests in flight (the client's cap)")
    parser.add_argument("--requests", type=int, default=24, help="requests per run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]

    if args.variant == "plain" and not args.variant_flags:
        raise SystemExit("--variant plain needs --variant-flags: else both servers are the same")
    try:
        spec = speculative_config(args.variant, 7, args.draft, args.eagle_head, args.medusa_head)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    variant_flags = shlex.split(args.variant_flags)
    if spec is not None:
        variant_flags += ["--speculative-config", json.dumps(spec)]
    common = [
        "--quantization",
        args.quantization,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-queue-len",
        "256",
        "--log-stats-interval",
        "0",
    ]
    servers = {"plain": ServerProcess(args.target, *common, startup_timeout_s=1800)}
    try:
        servers["variant"] = ServerProcess(args.target, *common, *variant_flags, startup_timeout_s=1800)
        for rate in rates:
            runs: dict[str, list[dict]] = {name: [] for name in servers}
            for round_ in range(args.rounds):
                order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
                for name in order:
                    with tempfile.TemporaryDirectory() as folder:
                        figures = bench(servers[name], rate, args.input_tokens, args, seed=round_, folder=Path(folder))
                    runs[name].append(figures)
                    print(
                        f"rate {rate} round {round_} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()),
                        file=sys.stderr,
                        flush=True,
                    )
            report(rate, args, runs)
    finally:
        for server in servers.values():
            server.stop()
    return 0


def report(rate: float, args, runs: dict[str, list[dict]]) -> None:
    print(
        f"\n{args.target}, {args.variant} ({args.draft} or the head, k=7) {args.variant_flags}, "
        f"{args.quantization}, --max-num-seqs {args.max_num_seqs}; "
        f"{rate} req/s Poisson, {args.input_tokens}-token prompts, {args.output_tokens} output tokens, "
        f"{args.requests} requests x {args.rounds} rounds; medians over rounds"
    )
    print(f"{'figure':<14}{'plain':>10}{'variant':>10}{'var/plain':>12}{'range':>16}")
    for label in FIGURES:
        plain = [run[label] for run in runs["plain"]]
        variant = [run[label] for run in runs["variant"]]
        ratios = [v / p for v, p in zip(variant, plain)]
        print(
            f"{label:<14}{statistics.median(plain):>10.2f}{statistics.median(variant):>10.2f}"
            f"{statistics.median(ratios):>11.3f}x{min(ratios):>8.3f}-{max(ratios):.3f}"
        )


if __name__ == "__main__":
    sys.exit(main())
