"""Serving throughput with and without speculation, side by side in one run.

Starts `specserve serve` for the plain target, then for the target with its draft at
a fixed k, then with adaptive speculation (k per request and step, falling with the
batch), and at each concurrency level keeps that many streaming chat requests in flight over
the structured and open-ended prompts (temperature 0, so both variants generate the
same tokens). Output tokens come from the server's `usage`, never from counting SSE
chunks; requests go through `specserve bench`'s streaming client. Prints output
throughput, TTFT, inter-token latency and acceptance, with the speculative/plain ratio
per level.

    .venv/bin/python benchmarks/serve_throughput.py                       # default pair, k=7
    .venv/bin/python benchmarks/serve_throughput.py --concurrency 1,4,8 --max-tokens 128 --quantization int4
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


def measure(variant: str, serve_args: list[str], args, prompts: list[str]) -> list[dict]:
    print(f"starting {variant} server ...", file=sys.stderr, flush=True)
    server = ServerProcess(
        args.target,
        "--max-num-seqs",
        str(max(args.levels)),
        "--log-stats-interval",
        "0",
        *serve_args,
        startup_timeout_s=600,
    )
    rows = []
    try:
        asyncio.run(run_level(server.url, prompts[:1], 1, 1, 8))  # warm-up
        for level in args.levels:
            before = httpx.get(server.url + "/metrics").text
            num_requests = max(len(prompts), args.requests_per_level * level)  # every prompt at least once
            row = asyncio.run(run_level(server.url, prompts, level, num_requests, args.max_tokens))
            spec = spec_figures(before, httpx.get(server.url + "/metrics").text)
            row.update(
                variant=variant,
                acceptance_rate=spec["results_spec_acceptance_rate"],
                mean_acceptance_length=spec["results_spec_mean_acceptance_length"],
            )
            rows.append(row)
            print(f"  {variant} c={level}: {row['output_tokens_per_s']:.2f} tok/s", file=sys.stderr, flush=True)
    finally:
        server.stop()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=catalogue.DEFAULT_TARGET)
    parser.add_argument("--draft", default=catalogue.DEFAULT_DRAFT)
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--requests-per-level", type=int, default=2, help="requests per concurrent slot")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--suites", default="structured,open-ended")
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS, help="both servers' weights")
    parser.add_argument("--device", default="auto", help="the servers' --device: auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--draft-quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="the draft's own weight format (default: --quantization's)",
    )
    parser.add_argument(
        "--fused", action="store_true", help='both speculative servers with "fused": true (needs a quantized draft)'
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.levels = [int(c) for c in args.concurrency.split(",")]
    prompts = list(prompts_of(args.suites).values())

    draft = {"model": args.draft, "num_speculative_tokens": args.k}
    if args.draft_quantization is not None:
        draft["quantization"] = args.draft_quantization
    if args.fused:
        draft["fused"] = True
    fixed = json.dumps(draft | {"adaptive": False})
    adaptive = json.dumps(draft)
    common = ["--quantization", args.quantization, "--device", args.device]
    rows = (
        measure("plain", common, args, prompts)
        + measure(f"draft k={args.k}", [*common, "--speculative-config", fixed], args, prompts)
        + measure("adaptive", [*common, "--speculative-config", adaptive], args, prompts)
    )
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    plain = {r["concurrency"]: r for r in rows if r["variant"] == "plain"}
    draft_format = args.draft_quantization or args.quantization
    print(
        f"\n{args.target} (draft {args.draft}, {draft_format}), {args.quantization} weights, "
        f"{args.max_tokens} max tokens, "
        f"suites {args.suites}, temperature 0\n"
    )
    print(
        f"{'variant':<12}{'conc':>5}{'reqs':>6}{'out tok':>9}{'tok/s':>9}{'x plain':>9}"
        f"{'ttft p50 s':>12}{'itl p50 ms':>12}{'accept':>8}{'mean len':>9}"
    )
    for r in rows:
        ratio = r["output_tokens_per_s"] / plain[r["concurrency"]]["output_tokens_per_s"]
        rate, length = r["acceptance_rate"], r["mean_acceptance_length"]
        print(
            f"{r['variant']:<12}{r['concurrency']:>5}{r['requests']:>6}{r['output_tokens']:>9}"
            f"{r['output_tokens_per_s']:>9.2f}{ratio:>8.2f}x{r['ttft_s_p50']:>12.2f}{r['itl_s_p50'] * 1000:>12.0f}"
            f"{'' if rate is None else f'{rate:.0%}':>8}{'' if length is None else f'{length:.2f}':>9}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
