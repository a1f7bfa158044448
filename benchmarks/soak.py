"""A soak test of a speculative server: mixed, partly hostile traffic for a long time.

Starts `specserve serve` with a draft (or measures --url), then keeps --concurrency
clients busy (more than the batch, so requests queue and some are refused with 429)
for --minutes, each client drawing its next request from a fixed mix: streamed and
whole, greedy and sampled, n = 2 choices, clients that leave mid-stream or before a
whole answer, and bad inputs of every class the server must refuse with a 4xx. Every
request has a deadline (--hang-after): one that passes it counts as hung.

It reports requests served by kind, answers by status class, the failures that must
not happen (goal 0): a 5xx, an in-band stream error, a connection the server broke, a
bad input answered 2xx, a hung request; the server's RSS and open file descriptors
sampled through the run (goal: flat after the warm-up phase), and TTFT and
inter-token latency percentiles of the greedy streams, per phase.

    .venv/bin/python benchmarks/soak.py                                   # default pair, int4, 30 minutes
    .venv/bin/python benchmarks/soak.py --target smollm2-135m --draft smollm2-135m --quantization none --minutes 3
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specserve import catalogue
from specserve.bench.client import stream_request
from specserve.bench.local_server import ServerProcess
from specserve.bench.tune import proposer_config

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "List the planets of the solar system, one per line.",
    "def merge_sort(xs):",
    "Explain what a hash table is in two paragraphs.",
    "1, 1, 2, 3, 5, 8, 13,",
    "Translate 'good morning' into French, Spanish and German.",
]

# Bodies (or raw bytes) that must be refused with a 4xx, one per class of bad input.
BAD_INPUTS = [
    ("completions", b"{not json"),
    ("completions", {"prompt": "hi", "temperature": -1}),
    ("completions", {"prompt": "hi", "top_p": 0}),
    ("completions", {"prompt": [-1]}),
    ("completions", {"prompt": [2**70]}),
    ("completions", b'{"prompt": "Hi \\ud800"}'),
    ("completions", {"prompt": "hi", "stop": ["x"] * 100}),
    ("completions", {"prompt": "hi", "max_tokens": 10**9}),
    ("completions", {"prompt": "hi", "n": 0}),
    ("completions", {"prompt": "hi", "repetition_penalty": 1e-300}),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("chat/completions", {"messages": []}),
    ("completions", {"model": "no-such-model", "prompt": "hi"}),
]

# Extreme but valid sampling values, served like any request.
EDGE_SAMPLING = [{"temperature": 1e-40}, {"temperature": 1.0, "top_p": 1e-300}, {"temperature": 2.0, "top_k": 1}]

KINDS = {  # kind: weight in the mix
    "stream greedy": 5,
    "whole sampled": 3,
    "stream sampled n=2": 1,
    "edge sampling": 1,
    "leave mid-stream": 1,
    "leave before the answer": 1,
    "bad input": 2,
}


@dataclass
class Tally:
    kinds: collections.Counter = field(default_factory=collections.Counter)
    statuses: collections.Counter = field(default_factory=collections.Counter)
    failures: collections.Counter = field(default_factory=collections.Counter)  # must stay empty
    latencies: dict[int, list[tuple[float, float]]] = field(default_factory=lambda: collections.defaultdict(list))
    resources: list[tuple[float, int, int]] = field(default_factory=list)  # (minute, RSS MB, open fds)

    def status(self, kind: str, code: int) -> None:
        self.kinds[kind] += 1
        self.statuses[f"{code // 100}xx" if code != 429 else "429"] += 1
        if code >= 500:
            self.failures[f"HTTP {code} ({kind})"] += 1


async def one_request(
    http: httpx.AsyncClient, kind: str, rng: random.Random, tally: Tally, phase: int, hang_after_s: float
) -> float:
    """Send one request of `kind` and tally it; the seconds a 429 asked to wait, else 0."""
    prompt, max_tokens = rng.choice(PROMPTS), rng.randint(16, 128)
    deadline = asyncio.get_running_loop().time() + hang_after_s
    try:
        async with asyncio.timeout(hang_after_s):
            if kind in ("stream greedy", "stream sampled n=2"):
                body = {
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0 if kind == "stream greedy" else 0.8,
                }
                if kind != "stream greedy":
                    body["n"] = 2
                response = await stream_request(http, "/v1/completions", body, deadline)
                if response.error_code == 429:
                    tally.status(kind, 429)
                    return 1.0  # the stream's client sees no headers: a second, as Retry-After says at least
                elif not response.ok:
                    tally.kinds[kind] += 1
                    tally.failures[response.error_msg.split(":")[0] + f" ({kind})"] += 1
                else:
                    tally.status(kind, 200)
                    if kind == "stream greedy" and response.chunk_times_s and response.completion_tokens > 1:
                        ttft = response.chunk_times_s[0]
                        itl = (response.end_to_end_s - ttft) / (response.completion_tokens - 1)
                        tally.latencies[phase].append((ttft, itl))
            elif kind in ("whole sampled", "edge sampling"):
                extra = (
                    {"temperature": 0.8, "seed": rng.randint(0, 1000)}
                    if kind == "whole sampled"
                    else rng.choice(EDGE_SAMPLING)
                )
                reply = await http.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, **extra},
                )
                tally.status(kind, reply.status_code)
                if reply.status_code == 429:
                    return float(reply.headers["Retry-After"])
            elif kind == "leave mid-stream":
                async with http.stream(
                    "POST",
                    "/v1/completions",
                    json={"prompt": prompt, "max_tokens": 400, "stream": True, "ignore_eos": True},
                ) as reply:
                    tally.status(kind, reply.status_code)
                    async for line in reply.aiter_lines():
                        if line.startswith("data: {"):
                            break  # got something: leave
            elif kind == "leave before the answer":
                try:
                    async with asyncio.timeout(rng.uniform(0.2, 2.0)):
                        reply = await http.post(
                            "/v1/completions", json={"prompt": prompt, "max_tokens": 400, "ignore_eos": True}
                        )
                    tally.status(kind, reply.status_code)
                except TimeoutError:
                    tally.kinds[kind] += 1  # left, as meant
            else:  # a bad input
                route, body = rng.choice(BAD_INPUTS)
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                reply = await http.post(f"/v1/{route}", content=content, headers={"Content-Type": "application/json"})
                tally.status(kind, reply.status_code)
                if not 400 <= reply.status_code < 500:
                    tally.failures[f"bad input answered {reply.status_code}"] += 1
    except TimeoutError:
        tally.kinds[kind] += 1
        tally.failures[f"hung past {hang_after_s:.0f} s ({kind})"] += 1
    except httpx.HTTPError as e:
        tally.kinds[kind] += 1
        tally.failures[f"connection error {type(e).__name__} ({kind})"] += 1
    return 0.0


async def client(url: str, seed: int, tally: Tally, end: float, phase_s: float, hang_after_s: float) -> None:
    rng = random.Random(seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=None) as http:
        while time.monotonic() < end:
            phase = int((time.monotonic() - started) // phase_s)
            wait_s = await one_request(http, rng.choices(kinds, weights)[0], rng, tally, phase, hang_after_s)
            await asyncio.sleep(wait_s * rng.uniform(1, 1.5))  # as a polite client backs off after a 429


async def watch(pid: int, tally: Tally, end: float, every_s: float) -> None:
    started = time.monotonic()
    while time.monotonic() < end:
        rss_kb = next(
            int(line.split()[1])
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith("VmRSS:")
        )
        tally.resources.append(((time.monotonic() - started) / 60, rss_kb // 1024, len(os.listdir(f"/proc/{pid}/fd"))))
        await asyncio.sleep(every_s)


async def soak(url: str, pid: int, args) -> Tally:
    tally = Tally()
    end = time.monotonic() + args.minutes * 60
    phase_s = args.minutes * 60 / args.phases
    await asyncio.gather(
        watch(pid, tally, end, every_s=10),
        *(client(url, seed, tally, end, phase_s, args.hang_after) for seed in range(args.concurrency)),
    )
    return tally


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def report(tally: Tally, args) -> None:
    print(
        f"\nsoak: {args.minutes} min, {args.concurrency} clients against --max-num-seqs {args.max_num_seqs} "
        f"--max-queue-len {args.max_queue_len}"
    )
    print(f"requests by kind: {dict(tally.kinds)} (total {sum(tally.kinds.values())})")
    print(f"answers by status: {dict(tally.statuses)}")
    print(f"failures that must not happen: {dict(tally.failures) or 'none'}")
    print(
        f"\n{'phase':<7}{'streams':>8}{'TTFT p50 s':>12}{'TTFT p90 s':>12}{'TTFT p99 s':>12}{'ITL p50 ms':>12}"
        f"{'ITL p99 ms':>12}"
    )
    for phase in sorted(tally.latencies):
        ttfts, itls = zip(*tally.latencies[phase])
        print(
            f"{phase:<7}{len(ttfts):>8}{percentile(ttfts, 50):>12.2f}{percentile(ttfts, 90):>12.2f}"
            f"{percentile(ttfts, 99):>12.2f}{percentile(itls, 50) * 1000:>12.0f}{percentile(itls, 99) * 1000:>12.0f}"
        )
    print(f"\n{'minute':>7}{'RSS MB':>8}{'fds':>6}")
    for minute, rss, fds in tally.resources[:: max(1, len(tally.resources) // 12)] + tally.resources[-1:]:
        print(f"{minute:>7.1f}{rss:>8}{fds:>6}")
    warm = [r for r in tally.resources if r[0] >= args.minutes / args.phases]  # after the first phase
    if len(warm) > 1:
        print(
            f"RSS after the first phase: {warm[0][1]} -> {warm[-1][1]} MB "
            f"({(warm[-1][1] - warm[0][1]) / warm[0][1]:+.1%}); peak {max(r[1] for r in warm)} MB"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=catalogue.DEFAULT_TARGET)
    parser.add_argument(
        "--draft", default=catalogue.DEFAULT_DRAFT, help="a draft model, ngram, or a head (NAME or METHOD:FOLDER)"
    )
    parser.add_argument("--quantization", default="int4")
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--phases", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=12, help="clients, each one request at a time")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--max-queue-len", type=int, default=4)
    parser.add_argument("--hang-after", type=float, default=600, help="seconds after which a request counts as hung")
    parser.add_argument("--json", action="store_true", help="also print the tally as one JSON object")
    args = parser.parse_args()

    spec = json.dumps(proposer_config(args.draft))  # adaptive k
    server = ServerProcess(
        args.target,
        "--quantization",
        args.quantization,
        "--speculative-config",
        spec,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-queue-len",
        str(args.max_queue_len),
        "--max-model-len",
        "2048",
        "--log-stats-interval",
        "60",
        startup_timeout_s=1800,
    )
    try:
        tally = asyncio.run(soak(server.url, server.process.pid, args))
    finally:
        server.stop()
    report(tally, args)
    if args.json:
        print(
            json.dumps(
                {
                    "kinds": tally.kinds,
                    "statuses": tally.statuses,
                    "failures": tally.failures,
                    "resources": tally.resources,
                }
            )
        )
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
