"""Serving throughput with and without speculation, side by side in one run.

Starts `specserve serve` once per variant (the plain target, the target with its draft
at a fixed k or adaptive, or with an EAGLE-3 or Medusa head), all of them up at once
and one under load at a time. At each concurrency level it keeps that many streaming
chat requests in flight over the structured and open-ended prompts (temperature 0, so
every variant generates the same tokens), variant after variant, round after round, the
order reversed every other round so that a slow minute of the machine falls on all of
them. Output tokens come from the server's `usage`, never from counting SSE chunks;
requests go through `specserve bench`'s streaming client. Prints, per variant and
level, the median over rounds of output throughput, TTFT p50 and inter-token latency
p50, the acceptance, and the ratio to plain (median of the rounds' ratios, and their
range).

    .venv/bin/python benchmarks/serve_throughput.py                       # default pair, float32
    .venv/bin/python benchmarks/serve_throughput.py --concurrency 2,4,8 --quantization int4 --rounds 3
    .venv/bin/python benchmarks/serve_throughput.py --quantization int4 --variants plain,adaptive,adaptive-eagle3
    .venv/bin/python benchmarks/serve_throughput.py --quantization int4 --fused      # drafting in one C call
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time

import httpx

from specserve import catalogue
from specserve.bench.client import ENDPOINTS, open_session, stream_request
from specserve.bench.local_server import ServerProcess
from specserve.bench.spec_metrics import spec_figures
from specserve.bench.suites import prompts_of
from specserve.bench.variants import DEFAULT_EAGLE_HEAD, DEFAULT_MEDUSA_HEAD, VARIANTS, speculative_config
from specserve.model.quant import QUANTIZATIONS


async def one_request(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    deadline = asyncio.get_running_loop().time() + 3600
    response = await stream_request(http, ENDPOINTS["chat"], body, deadline)
    if not response.ok:
        raise RuntimeError(f"a request failed: {response.error_msg}")
    tokens = response.completion_tokens
    ttft = response.chunk_times_s[0] if response.chunk_times_s else response.end_to_end_s
    return {
        "tokens": tokens,
        "ttft_s": ttft,
        "e2e_s": response.end_to_end_s,
        "itl_s": (response.end_to_end_s - ttft) / max(tokens - 1, 1),
    }


async def run_level(url: str, prompts: list[str], concurrency: int, num_requests: int, max_tokens: int) -> dict:
    queue = itertools.islice(itertools.cycle(prompts), num_requests)
    records: list[dict] = []

    async def worker(http: httpx.AsyncClient) -> None:
        for prompt in queue:  # workers share one iterator: each request is taken once
            records.append(await one_request(http, prompt, max_tokens))

    async with open_session(url, api_key=None, max_connections=concurrency) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "output_tokens": sum(r["tokens"] for r in records),
        "output_tokens_per_s": sum(r["tokens"] for r in records) / wall,
        "ttft_s_p50": statistics.median(r["ttft_s"] for r in records),
        "itl_s_p50": statistics.median(r["itl_s"] for r in records),
    }


PROMPT_FOR_WARM_UP = "Say hello."


def variant_config(variant: str, args) -> dict | None:
    draft_keys = {"quantization": args.draft_quantization, "fused": True if args.fused else None}
    return speculative_config(variant, args.k, args.draft, args.eagle_head, args.medusa_head, **draft_keys)


def start_server(variant: str, args) -> ServerProcess:
    print(f"starting {variant} server ...", file=sys.stderr, flush=True)
    flags = ["--quantization", args.quantization, "--device", args.device]
    config = variant_config(variant, args)
    if config is not None:
        flags += ["--speculative-config", json.dumps(config)]
    server = ServerProcess(
        args.target,
        "--max-num-seqs",
        str(max(args.levels)),
        "--log-stats-interval",
        "0",
        *flags,
        startup_timeout_s=1800,
    )
    asyncio.run(run_level(server.url, [PROMPT_FOR_WARM_UP], 1, 1, 8))
    return server


def measure(server: ServerProcess, level: int, args, prompts: list[str]) -> dict:
    """One run of a level against one server: its throughput, latencies and acceptance."""
    before = httpx.get(server.url + "/metrics").text
    num_requests = max(len(prompts), args.requests_per_level * level)  # every prompt at least once
    row = asyncio.run(run_level(server.url, prompts, level, num_requests, args.max_tokens))
    spec = spec_figures(before, httpx.get(server.url + "/metrics").text)
    row.update(
        acceptance_rate=spec["results_spec_acceptance_rate"],
        mean_acceptance_length=spec["results_spec_mean_acceptance_length"],
    )
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=catalogue.DEFAULT_TARGET)
    parser.add_argument("--draft", default=catalogue.DEFAULT_DRAFT)
    parser.add_argument("--eagle-head", default=DEFAULT_EAGLE_HEAD, help="the eagle3 variants'")
    parser.add_argument("--medusa-head", default=DEFAULT_MEDUSA_HEAD, help="the medusa variants'")
    parser.add_argument("--k", type=int, default=7, help="k of the draft and eagle3 variants")
    parser.add_argument(
        "--variants",
        default="plain,k=7,adaptive",
        help=f"comma-separated, plain first: plain, k=N (the draft at a fixed k), {', '.join(VARIANTS[1:])}",
    )
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--requests-per-level", type=int, default=2, help="requests per concurrent slot")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every level and variant, the order alternating")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--suites", default="structured,open-ended")
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS, help="every server's weights")
    parser.add_argument("--device", default="auto", help="the servers' --device: auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--draft-quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="the draft's own weight format (default: --quantization's)",
    )
    parser.add_argument(
        "--fused", action="store_true", help='the draft\'s servers with "fused": true (needs a quantized draft)'
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.levels = [int(c) for c in args.concurrency.split(",")]
    variants = args.variants.split(",")
    if variants[0] != "plain" or len(set(variants)) < len(variants):
        raise SystemExit("--variants must start with plain (the ratios' base) and name each variant once")
    for variant in variants:
        try:
            variant_config(variant, args)  # an unknown name fails before any server starts
        except ValueError as error:
            raise SystemExit(str(error)) from None
    prompts = list(prompts_of(args.suites).values())

    servers: dict[str, ServerProcess] = {}
    runs: dict[tuple[str, int], list[dict]] = {(v, level): [] for v in variants for level in args.levels}
    try:
        for variant in variants:
            servers[variant] = start_server(variant, args)
        for round_ in range(args.rounds):
            for level in args.levels:
                for variant in variants if round_ % 2 == 0 else variants[::-1]:
                    row = measure(servers[variant], level, args, prompts)
                    runs[variant, level].append(row)
                    print(
                        f"  round {round_} {variant} c={level}: {row['output_tokens_per_s']:.2f} tok/s",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        for server in servers.values():
            server.stop()
    if args.json:
        for (variant, level), rows in runs.items():
            for round_, row in enumerate(rows):
                print(json.dumps(row | {"variant": variant, "round": round_}))
        return 0
    report(args, variants, runs)
    return 0


def report(args, variants: list[str], runs: dict[tuple[str, int], list[dict]]) -> None:
    draft_format = args.draft_quantization or args.quantization
    print(
        f"\n{args.target} (draft {args.draft}, {draft_format}; heads {args.eagle_head}, {args.medusa_head}), "
        f"{args.quantization} weights, {args.max_tokens} max tokens, suites {args.suites}, temperature 0, "
        f"{args.rounds} rounds: medians over rounds\n"
    )
    print(
        f"{'variant':<17}{'conc':>5}{'reqs':>6}{'tok/s':>9}{'x plain':>9}{'range':>13}"
        f"{'ttft p50 s':>12}{'itl p50 ms':>12}{'accept':>8}{'mean len':>9}"
    )
    for level in args.levels:
        plain = runs["plain", level]
        for variant in variants:
            rows = runs[variant, level]
            ratios = [r["output_tokens_per_s"] / p["output_tokens_per_s"] for r, p in zip(rows, plain)]
            rate = median_or_none(r["acceptance_rate"] for r in rows)
            length = median_or_none(r["mean_acceptance_length"] for r in rows)
            print(
                f"{variant:<17}{level:>5}{rows[0]['requests']:>6}"
                f"{statistics.median(r['output_tokens_per_s'] for r in rows):>9.2f}"
                f"{statistics.median(ratios):>8.3f}x{min(ratios):>7.3f}-{max(ratios):.3f}"
                f"{statistics.median(r['ttft_s_p50'] for r in rows):>12.2f}"
                f"{statistics.median(r['itl_s_p50'] for r in rows) * 1000:>12.0f}"
                f"{'' if rate is None else f'{rate:.0%}':>8}{'' if length is None else f'{length:.2f}':>9}"
            )


def median_or_none(values) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


if __name__ == "__main__":
    sys.exit(main())
