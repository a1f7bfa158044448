"""What speculation could gain here if every guess were accepted, from measured steps.

The roofline's ceiling (`peers.py`, specserve/bench/roofline.py) prices a step from the
memory bandwidth and the arithmetic peak; this measures the steps themselves. One engine
with the draft, its confidence stop off and no lookups, drafts exactly k tokens every
step whatever it guessed, so a step's time is what k draft positions and a verification
of k + 1 rows cost on this machine, in this minute, through the code that serves. With
the same engine's plain step P (k = 0), a step that accepted every draft would emit
k + 1 tokens in that time:

    speed at full acceptance (x plain) = (k + 1) * P / step(k)

and a step must emit step(k) / P tokens on average (`break-even`) to pay at all. No
acceptance rate can take speculation past these figures with this pair on this machine;
a target such as 3x plain is out of reach wherever the best of them is below it.

The settings take turns in every round (the order alternating), each decoding the
prompt afresh; a step's time is the median of a run's steps (the first, which also
reads the prompt into the draft, and those cut short by max_tokens left out), and the
ratios are per round, so the machine's swings in speed move both sides alike: quote
the medians of the rounds.

    .venv/bin/python benchmarks/full_acceptance.py                      # int4 pair, k = 1..15
    .venv/bin/python benchmarks/full_acceptance.py --ks 3,7,11 --rounds 3 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specserve.bench.suites import prompts_of  # noqa: E402
from specserve.config import SpecConfig  # noqa: E402
from specserve.errors import SpecserveError  # noqa: E402
from specserve.generate import build_engine, encode_prompt  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.spec.fused import FusedDraftProposer  # noqa: E402

DEFAULT_KS = "1,3,5,7,9,11,15"


def step_costs(engine, prompt_ids: list[int], k: int, max_tokens: int) -> dict[str, float]:
    """Median seconds of a decode step drafting exactly k (0: plain), and of its
    drafting and verifying parts where the step runs fused."""
    engine.num_speculative_tokens = k
    seq = engine.add_request(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    steps, parts = [], []
    fused = isinstance(engine.proposer, FusedDraftProposer)
    while not seq.finished:
        prefilled, full_draft = seq.prefilled, seq.remaining_tokens > k + 1
        started = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - started
        if prefilled and full_draft:
            steps.append(seconds)
            if fused and k:
                parts.append(engine.proposer.last_seconds)
    steps, parts = steps[1:], parts[1:]  # the first decode step also reads the prompt into the draft
    if not steps:
        raise SpecserveError(f"--max-tokens {max_tokens} leaves no whole step of k = {k}; raise it")
    costs = {"step_s": statistics.median(steps)}
    if parts:
        costs["drafting_s"] = statistics.median(d for d, _ in parts)
        costs["verifying_s"] = statistics.median(v for _, v in parts)
    return costs


def measure(engine, prompt_ids: list[int], ks: list[int], rounds: int, max_tokens: int) -> list[dict]:
    """One row per k: the medians over rounds of its step costs and of its speed at full
    acceptance against the same round's plain step."""
    settings = [0, *ks]
    runs: dict[int, list[dict]] = {k: [] for k in settings}
    for r in range(rounds):
        for k in settings if r % 2 == 0 else reversed(settings):
            runs[k].append(step_costs(engine, prompt_ids, k, max_tokens))
    plain = [run["step_s"] for run in runs[0]]
    rows = []
    for k in settings:
        row = {"k": k, **{key: statistics.median(run[key] for run in runs[k]) for key in runs[k][0]}}
        if k:
            speeds = [(k + 1) * p / run["step_s"] for p, run in zip(plain, runs[k])]
            row["full_acceptance_speedup"] = statistics.median(speeds)
            row["speedup_range"] = (min(speeds), max(speeds))
            row["break_even_tokens"] = statistics.median(run["step_s"] / p for p, run in zip(plain, runs[k]))
        rows.append(row)
    return rows


def print_table(rows: list[dict], target: float) -> None:
    plain = rows[0]["step_s"]
    print(f"plain step {plain * 1e3:.1f} ms\n")
    print("| k | step ms | drafting ms | verifying ms | at full acceptance, x plain | break-even tokens a step |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in rows[1:]:
        low, high = row["speedup_range"]
        parts = (f"{row['drafting_s'] * 1e3:.1f} | {row['verifying_s'] * 1e3:.1f}" if "drafting_s" in row else "- | -")
        print(f"| {row['k']} | {row['step_s'] * 1e3:.1f} | {parts} | "
              f"{row['full_acceptance_speedup']:.2f} ({low:.2f}-{high:.2f}) | {row['break_even_tokens']:.2f} |")
    best = max(rows[1:], key=lambda row: row["full_acceptance_speedup"])
    print(f"\nBest: k = {best['k']}, {best['full_acceptance_speedup']:.2f}x plain with every draft accepted.")
    if best["full_acceptance_speedup"] < target:
        needed = (best["k"] + 1) * plain / target  # the step that would give the target at that k
        print(f"{target:g}x would need a step of k = {best['k']} to take {needed * 1e3:.1f} ms, "
              f"not {best['step_s'] * 1e3:.1f}: out of reach at any acceptance.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalogue name or folder")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="catalogue name or folder")
    parser.add_argument("--quantization", default="int4", choices=("none", "int8", "int4"))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--ks", default=DEFAULT_KS, help=f"drafts per step, comma-separated (default {DEFAULT_KS})")
    parser.add_argument("--prompt", default="code", help="a suite prompt's name (what it says does not matter: "
                        "every step drafts k whatever is accepted)")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens each run decodes (default 96)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every setting taking turns (default 5)")
    parser.add_argument("--target-speedup", type=float, default=3.0, help="the speedup to test against (default 3)")
    parser.add_argument("--json", action="store_true", help="one JSON object per k instead of the table")
    args = parser.parse_args(argv)
    try:
        ks = sorted({int(k) for k in args.ks.split(",")})
    except ValueError:
        parser.error(f"--ks takes whole numbers separated by commas, got {args.ks!r}")
    if not ks or ks[0] < 1:
        parser.error(f"--ks must be >= 1, got {args.ks!r}")
    prompts = prompts_of("structured,open-ended")
    if args.prompt not in prompts:
        parser.error(f"--prompt must be one of {', '.join(prompts)}, got {args.prompt!r}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    spec = {"model": args.draft, "num_speculative_tokens": max(ks), "adaptive": False,
            "draft_confidence_threshold": 0.0, "prompt_lookup_first": None}
    try:
        engine, tokenizer = build_engine(args.target, SpecConfig.parse(spec), getattr(torch, args.dtype),
                                         quantization=args.quantization, max_num_seqs=1)
        rows = measure(engine, encode_prompt(tokenizer, chat=prompts[args.prompt]), ks, args.rounds, args.max_tokens)
    except SpecserveError as e:
        print(f"full_acceptance.py: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"{args.target} with {args.draft}, {args.quantization}/{args.dtype}, {torch.get_num_threads()} threads, "
              f"prompt {args.prompt!r}, medians of {args.rounds} rounds taking turns")
        print_table(rows, args.target_speedup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
