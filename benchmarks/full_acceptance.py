"""What speculation could gain here if every guess were accepted, from measured steps.

The roofline's ceiling (`peers.py`, specserve/bench/roofline.py) prices a step from the
memory bandwidth and the arithmetic peak; this measures the steps themselves
(specserve/bench/measured_ceiling.py): one engine whose draft always drafts k, its
confidence stop off and no lookups, against its own plain step, the settings taking
turns. For each k: the step's time, its drafting and verifying parts (where it runs
fused), its speed were every draft accepted ((k + 1) plain steps over the step), and
the tokens a step must emit to break even. A target such as 3x plain is out of reach
at any acceptance wherever the best of them is below it; the table says so.

A step's time is the median of a run's steps (the first, which also reads the prompt
into the draft, and those cut short by max_tokens left out); quote the medians of the
rounds' ratios.

    .venv/bin/python benchmarks/full_acceptance.py                      # int4 pair, k = 1..15
    .venv/bin/python benchmarks/full_acceptance.py --ks 3,7,11 --rounds 3 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specserve.bench.measured_ceiling import always_drafting, best, measure  # noqa: E402
from specserve.bench.suites import prompts_of  # noqa: E402
from specserve.engine.build import build_engine, encode_prompt  # noqa: E402
from specserve.errors import SpecserveError  # noqa: E402

DEFAULT_KS = "1,3,5,7,9,11,15"


def print_table(rows: list[dict], target: float) -> None:
    plain = rows[0]["step_s"]
    print(f"plain step {plain * 1e3:.1f} ms\n")
    print(
        "| k | step ms | drafting ms | verifying ms | a draft position, x plain step "
        "| at full acceptance, x plain | break-even tokens a step |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows[1:]:
        low, high = row["speedup_range"]
        parts = "- | - | -"
        if "drafting_s" in row:
            per_position = row["drafting_s"] / row["k"] / plain
            parts = f"{row['drafting_s'] * 1e3:.1f} | {row['verifying_s'] * 1e3:.1f} | {per_position:.3f}"
        print(
            f"| {row['k']} | {row['step_s'] * 1e3:.1f} | {parts} | "
            f"{row['full_acceptance_speedup']:.2f} ({low:.2f}-{high:.2f}) | {row['break_even_tokens']:.2f} |"
        )
    top = best(rows)
    print(f"\nBest: k = {top['k']}, {top['full_acceptance_speedup']:.2f}x plain with every draft accepted.")
    if top["full_acceptance_speedup"] < target:
        needed = (top["k"] + 1) * plain / target  # the step that would give the target at that k
        print(
            f"{target:g}x would need a step of k = {top['k']} to take {needed * 1e3:.1f} ms, "
            f"not {top['step_s'] * 1e3:.1f}: out of reach at any acceptance."
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalogue name or folder")
    parser.add_argument(
        "--draft", default="qwen2.5-coder-0.5b", help="catalogue name or folder (a head's, with --method)"
    )
    parser.add_argument(
        "--method",
        default="draft_model",
        choices=("draft_model", "eagle", "eagle3", "medusa"),
        help="what --draft is: a draft model (default) or an EAGLE or Medusa head",
    )
    parser.add_argument("--quantization", default="int4", choices=("none", "int8", "int4"))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--ks", default=DEFAULT_KS, help=f"drafts per step, comma-separated (default {DEFAULT_KS})")
    parser.add_argument(
        "--prompt",
        default="code",
        help="a suite prompt's name (what it says does not matter: every step drafts k whatever is accepted)",
    )
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
    try:
        spec = always_drafting(args.draft, max(ks), args.method)
        engine, tokenizer = build_engine(
            args.target, spec, getattr(torch, args.dtype), quantization=args.quantization, max_num_seqs=1
        )
        rows = measure(engine, encode_prompt(tokenizer, chat=prompts[args.prompt]), ks, args.rounds, args.max_tokens)
    except SpecserveError as e:
        print(f"full_acceptance.py: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(
            f"{args.target} with {args.draft} ({args.method}), {args.quantization}/{args.dtype}, "
            f"{torch.get_num_threads()} threads, "
            f"prompt {args.prompt!r}, medians of {args.rounds} rounds taking turns"
        )
        print_table(rows, args.target_speedup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
