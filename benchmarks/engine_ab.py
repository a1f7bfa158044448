"""Two revisions of the whole engine taking turns, each in processes of its own: is a
change to the policy, the scheduler or the kernels faster where users see it?

The end-to-end counterpart of kernel_ab.py. Each round runs every build once, in a
fresh process (the order alternating by round), that imports that revision's
`specserve` package, builds one engine per mode, and decodes every prompt (after an
8-token warm-up of it) as `specserve generate` would; a round gives each build's
decode speed and TTFT per mode and prompt, and the ratio b/a of the two. The medians of
those per-round ratios, with their range, are what to quote: the machines are shared,
and their memory's speed moves by 30-70% from minute to minute.

Every build must produce the same tokens as the other (greedy decoding): the script
says so where they differ, which for a speed change is a bug. With --temperature the
requests sample, seeded, so each build's text is the same every round; the two builds'
differ only where the change draws its random numbers otherwise (a change to the sampler).

A build is a git revision, extracted into a scratch folder, or `worktree` (this
checkout). Where the two revisions' kernel sources differ, each build's kernels are
compiled once into the scratch folder and loaded from there, so the processes do not
recompile over each other's cache.

    .venv/bin/python benchmarks/engine_ab.py                               # HEAD vs the working tree
    .venv/bin/python benchmarks/engine_ab.py --a HEAD~1 --b HEAD --rounds 5 --modes k=7,adaptive
    .venv/bin/python benchmarks/engine_ab.py --prompts count,meaning --max-tokens 128
    .venv/bin/python benchmarks/engine_ab.py --modes plain --temperature 0.8 --top-p 0.95
    .venv/bin/python benchmarks/engine_ab.py --concurrency 8 --requests 28 --max-tokens 128 --modes plain,adaptive

With --concurrency C, each mode's engine serves --requests R instead (the prompts in
turn, all queued at once, C at a time: continuous batching as a server under that load
runs it, without HTTP), and its row gives the output throughput of the whole run
(output tokens over its seconds) and the median time to first token.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODES = "plain,k=7,adaptive"


def build_tree(build: str, into: Path) -> Path:
    """The folder whose `specserve` package is `build`: this checkout for `worktree`,
    else the git revision's package extracted under `into`."""
    if build == "worktree":
        return REPO
    archive = subprocess.run(["git", "-C", str(REPO), "archive", build, "specserve"], capture_output=True, check=False)
    if archive.returncode != 0:
        sys.exit(f"engine_ab: {build!r} is not a git revision here: {archive.stderr.decode().strip()}")
    tree = into / build.replace("/", "_")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.11.4
        tar.extractall(tree, **safe)
    return tree


def spec_config(mode: str, draft: str) -> dict | None:
    """A mode's `--speculative-config`: plain (None), k=N (the draft, N fixed), adaptive
    (from k = 7, or 3 for a head). `draft`: a draft model, or METHOD:HEAD (eagle3:NAME)."""
    if mode == "plain":
        return None
    method, _, head = draft.rpartition(":")
    proposer = {"method": method, "model": head} if method else {"model": draft}
    if mode == "adaptive":
        return {**proposer, "num_speculative_tokens": 3 if method else 7}
    if mode.startswith("k=") and mode[2:].isdigit() and int(mode[2:]) > 0:
        return {**proposer, "num_speculative_tokens": int(mode[2:]), "adaptive": False}
    raise ValueError(f"unknown mode {mode!r}: plain, k=N or adaptive")


def worker(args: argparse.Namespace) -> None:
    """One measuring process, run with its build's tree first on sys.path: prints one JSON
    line per mode and prompt {mode, prompt, decode_tok_s, ttft_s, tokens}."""
    import torch

    from specserve.bench.suites import prompts_of
    from specserve.config import SpecConfig
    from specserve.engine.build import build_engine, encode_prompt, run_one
    from specserve.model import native
    from specserve.sampling import SamplingParams

    if args.library:  # this build's own kernels (see main)
        lib = native.load_library(Path(args.library))
        native.library = lambda: lib
    prompts = prompts_of(args.suites)
    dtype = getattr(torch, args.dtype)
    names = args.prompts.split(",") if args.prompts else list(prompts)
    for mode in args.modes.split(","):
        engine, tokenizer = build_engine(
            args.target,
            SpecConfig.parse(spec_config(mode, args.draft)),
            dtype,
            quantization=args.quantization,
            max_num_seqs=args.concurrency,
        )
        if args.concurrency > 1:
            serve_requests(engine, [encode_prompt(tokenizer, chat=prompts[name]) for name in names], mode, args)
            del engine
            continue
        for name in names:
            ids = encode_prompt(tokenizer, chat=prompts[name])
            run_one(engine, tokenizer, ids, SamplingParams(max_tokens=8, temperature=0.0))
            result = run_one(engine, tokenizer, ids, sampling(args, SamplingParams))
            tokens = result["token_ids"]
            decode_s = result["e2e_s"] - result["ttft_s"]
            print(
                json.dumps(
                    {
                        "mode": mode,
                        "prompt": name,
                        "ttft_s": result["ttft_s"],
                        "decode_tok_s": (len(tokens) - 1) / decode_s if decode_s > 0 else math.inf,
                        "tokens": hashlib.sha256(repr(tokens).encode()).hexdigest()[:16],
                    }
                ),
                flush=True,
            )
        del engine


def sampling(args: argparse.Namespace, params_class):
    """The measured requests' SamplingParams (the worker's build's class): greedy by
    default; with --temperature, seeded, so a build samples the same text every round."""
    return params_class(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=0)


def serve_requests(engine, prompt_ids: list[list[int]], mode: str, args: argparse.Namespace) -> None:
    """--concurrency: args.requests requests (the prompts in turn) queued at once, the
    engine running args.concurrency at a time; prints the mode's one line, its output
    throughput as decode_tok_s."""
    from specserve.sampling import SamplingParams

    for ids in prompt_ids[:2]:  # warm-up
        engine.add_request(ids, SamplingParams(max_tokens=8, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    params = sampling(args, SamplingParams)
    seqs = [engine.add_request(prompt_ids[i % len(prompt_ids)], params) for i in range(args.requests)]
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - started
    tokens = [seq.output_ids for seq in seqs]
    print(
        json.dumps(
            {
                "mode": mode,
                "prompt": f"{args.requests} requests, {args.concurrency} at a time",
                "decode_tok_s": sum(map(len, tokens)) / seconds,
                "ttft_s": statistics.median(seq.timings()["ttft_s"] for seq in seqs),
                "tokens": hashlib.sha256(repr(tokens).encode()).hexdigest()[:16],
            }
        ),
        flush=True,
    )


Run = dict[tuple[str, str], dict]  # (mode, prompt) -> a worker's line


def run_worker(command: list[str], tree: Path) -> Run:
    done = subprocess.run(
        command, capture_output=True, text=True, check=False, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}
    )
    if done.returncode != 0:
        sys.exit(f"engine_ab: a measuring process failed:\n{done.stderr[-3000:]}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {(line["mode"], line["prompt"]): line for line in lines}


def take_turns(builds: list[str], rounds: int, run) -> dict[str, list[Run]]:
    """Each build's runs, one per round, the order reversed every other round so that
    neither build always follows the other. run(build) -> Run."""
    runs: dict[str, list[Run]] = {build: [] for build in builds}
    for round_number in range(rounds):
        for build in builds if round_number % 2 == 0 else builds[::-1]:
            runs[build].append(run(build))
    return runs


def summarize(a: list[Run], b: list[Run]) -> list[dict]:
    """Per mode and prompt: the medians of the rounds' ratios b/a of decode speed and of
    TTFT, their ranges, a's median decode speed, and whether every run gave the same tokens."""
    rows = []
    for key in a[0]:
        speed = [rb[key]["decode_tok_s"] / ra[key]["decode_tok_s"] for ra, rb in zip(a, b)]
        ttft = [rb[key]["ttft_s"] / ra[key]["ttft_s"] for ra, rb in zip(a, b)]
        rows.append(
            {
                "mode": key[0],
                "prompt": key[1],
                "a_tok_s": statistics.median(r[key]["decode_tok_s"] for r in a),
                "speed": statistics.median(speed),
                "speed_range": (min(speed), max(speed)),
                "ttft": statistics.median(ttft),
                "same_tokens": len({r[key]["tokens"] for r in a + b}) == 1,
            }
        )
    return rows


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def print_table(rows: list[dict], suites: dict[str, list[str]]) -> None:
    print("| mode | prompt | a tok/s | b/a decode speed (range) | b/a TTFT | same tokens |")
    print("|---|---|---:|---|---:|---|")
    for row in rows:
        low, high = row["speed_range"]
        print(
            f"| {row['mode']} | {row['prompt']} | {row['a_tok_s']:.1f} | {row['speed']:.3f} ({low:.3f}-{high:.3f}) "
            f"| {row['ttft']:.3f} | {'yes' if row['same_tokens'] else 'NO'} |"
        )
    for mode in dict.fromkeys(row["mode"] for row in rows):
        for suite, names in suites.items():
            speeds = [row["speed"] for row in rows if row["mode"] == mode and row["prompt"] in names]
            if speeds:
                print(f"{mode}, {suite}: b/a decode speed {geomean(speeds):.3f} (geometric mean of the medians)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="HEAD", help="git revision (default HEAD)")
    parser.add_argument("--b", default="worktree", help="git revision, or worktree (the default)")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="a draft model, or METHOD:HEAD (eagle3:NAME)")
    parser.add_argument("--quantization", default="int4", choices=("none", "int8", "int4"))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--modes", default=DEFAULT_MODES, help=f"comma-separated: plain, k=N, adaptive ({DEFAULT_MODES})"
    )
    parser.add_argument("--suites", default="structured,open-ended")
    parser.add_argument("--prompts", default=None, help="comma-separated prompt names of the suites (default: all)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="of the measured requests (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="of the measured requests")
    parser.add_argument("--rounds", type=int, default=3, help="processes per build, taking turns")
    parser.add_argument(
        "--concurrency", type=int, default=1, help="above 1: serve --requests requests, this many at a time, per mode"
    )
    parser.add_argument("--requests", type=int, default=28, help="with --concurrency: requests per mode")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--library", default=None, help=argparse.SUPPRESS)  # a worker's own kernels
    args = parser.parse_args()
    for mode in args.modes.split(","):
        try:
            spec_config(mode, args.draft)
        except ValueError as error:
            parser.error(str(error))
    if args.concurrency < 1 or args.requests < 1:
        parser.error("--concurrency and --requests must be at least 1")
    if args.worker:
        worker(args)
        return
    from specserve.bench.suites import prompts_of
    from specserve.model import native

    suites = {suite: list(prompts_of(suite)) for suite in args.suites.split(",")}
    scratch = Path(tempfile.mkdtemp(prefix="engine-ab-"))
    try:
        builds = {"a": args.a, "b": args.b}
        trees = {key: build_tree(build, scratch / key) for key, build in builds.items()}
        sources = {key: sorted((tree / "specserve/model/kernels").glob("*.[ch]")) for key, tree in trees.items()}
        differ = [p.read_bytes() for p in sources["a"]] != [p.read_bytes() for p in sources["b"]]
        commands = {}
        for key in builds:
            commands[key] = [sys.executable, str(Path(__file__).resolve()), "--worker", *sys.argv[1:]]
            if differ and native.unavailable_reason() is None:
                library = scratch / f"{key}.so"
                native.compile_kernels(library, [p for p in sources[key] if p.suffix == ".c"])
                commands[key] += ["--library", str(library)]
        print(
            f"a: {args.a}, b: {args.b}; {args.target} ({args.quantization}) with {args.draft}; "
            f"{args.rounds} rounds of a process per build taking turns, {args.max_tokens} tokens"
            + (f", {args.requests} requests {args.concurrency} at a time" if args.concurrency > 1 else "")
            + ("; each build's own kernels" if differ else "; the same kernel sources")
        )
        runs = take_turns(list(builds), args.rounds, lambda key: run_worker(commands[key], trees[key]))
        print_table(summarize(runs["a"], runs["b"]), suites)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
