"""Decode speed with and without speculation, side by side in one run.

For each prompt of the reference's structured and open-ended suites: our plain decode,
our speculative decode with the draft model (and n-gram lookup), and optionally the
`transformers` library's plain and assisted generation on the same weights. Prints
decode tokens/s, the ratio to our plain decode, acceptance figures, and whether each
mode's greedy tokens equal our plain tokens.

    .venv/bin/python benchmarks/generate_ab.py                      # default pair, ours only
    .venv/bin/python benchmarks/generate_ab.py --peers transformers  # plus the library
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from specserve import models
from specserve.bench.suites import SUITES, prompts_of
from specserve.config import SpecConfig
from specserve.generate import build_engine, encode_prompt, run_one
from specserve.sampling import SamplingParams
from specserve.tokenizer import Tokenizer

def our_modes(args) -> dict[str, SpecConfig | None]:
    modes: dict[str, SpecConfig | None] = {"plain": None}
    modes[f"draft k={args.k}"] = SpecConfig.parse({"model": args.draft, "num_speculative_tokens": args.k})
    if args.ngram:
        modes[f"ngram k={args.k}"] = SpecConfig.parse({"method": "ngram", "num_speculative_tokens": args.k})
    return modes


def run_ours(args, prompts: dict[str, str]) -> list[dict]:
    rows = []
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for mode, spec in our_modes(args).items():
        engine, tokenizer = build_engine(args.target, spec)
        for name, text in prompts.items():
            ids = encode_prompt(tokenizer, chat=text)
            run_one(engine, tokenizer, ids, SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
            result = run_one(engine, tokenizer, ids, params)
            rows.append({"system": "specserve", "mode": mode, "prompt": name, **result})
        del engine
    return rows


def run_transformers(args, prompts: dict[str, str]) -> list[dict]:
    from transformers import AutoModelForCausalLM

    target_dir, draft_dir = models.resolve(args.target), models.resolve(args.draft)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_dir(target_dir)
    rows = []
    for mode, assistant in (("plain", None), ("assisted", draft)):
        for name, text in prompts.items():
            ids = torch.tensor([encode_prompt(tokenizer, chat=text)])

            def timed(n: int) -> tuple[float, list[int]]:
                kwargs = {"assistant_model": assistant} if assistant is not None else {}
                start = time.perf_counter()
                with torch.no_grad():
                    out = target.generate(ids, max_new_tokens=n, do_sample=False,
                                          eos_token_id=list(tokenizer.eos_token_ids), **kwargs)
                return time.perf_counter() - start, out[0, ids.shape[1]:].tolist()

            first_s, _ = timed(1)
            total_s, tokens = timed(args.max_tokens)
            rows.append({
                "system": "transformers", "mode": mode, "prompt": name, "token_ids": tokens,
                "num_output_tokens": len(tokens), "ttft_s": first_s, "e2e_s": total_s,
                "decode_tokens_per_s": (len(tokens) - 1) / max(total_s - first_s, 1e-9),
                "spec": None,
            })
    return rows


def print_table(rows: list[dict]) -> None:
    plain = {r["prompt"]: r for r in rows if r["system"] == "specserve" and r["mode"] == "plain"}
    header = f"{'prompt':<9}{'system':<14}{'mode':<12}{'tokens':>7}{'ttft ms':>9}{'decode tok/s':>14}{'x ours plain':>14}{'accept':>8}{'mean len':>9}  same tokens"
    print(header)
    print("-" * len(header))
    for r in rows:
        base = plain[r["prompt"]]
        spec = r.get("spec") or {}
        rate, length = spec.get("acceptance_rate"), spec.get("mean_acceptance_length")
        same = r["token_ids"] == base["token_ids"]
        print(
            f"{r['prompt']:<9}{r['system']:<14}{r['mode']:<12}{r['num_output_tokens']:>7}"
            f"{r['ttft_s'] * 1000:>9.0f}{r['decode_tokens_per_s']:>14.2f}"
            f"{r['decode_tokens_per_s'] / base['decode_tokens_per_s']:>13.2f}x"
            f"{'' if rate is None else f'{rate:.0%}':>8}{'' if length is None else f'{length:.2f}':>9}"
            f"  {'yes' if same else 'NO'}"
        )
    print()
    for suite, prompts in SUITES.items():
        for system, mode in sorted({(r["system"], r["mode"]) for r in rows}):
            ratios = [
                r["decode_tokens_per_s"] / plain[r["prompt"]]["decode_tokens_per_s"]
                for r in rows if r["system"] == system and r["mode"] == mode and r["prompt"] in prompts
            ]
            if ratios:
                print(f"{suite:<11} {system:<13} {mode:<12} geometric-mean decode speed "
                      f"{statistics.geometric_mean(ratios):.2f}x ours plain")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=models.DEFAULT_TARGET)
    parser.add_argument("--draft", default=models.DEFAULT_DRAFT)
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--suites", default="structured,open-ended")
    parser.add_argument("--prompts", default=None, help="comma-separated prompt names to keep")
    parser.add_argument("--ngram", action="store_true", help="also run n-gram lookup")
    parser.add_argument("--peers", default="", help="'transformers' to add the library's generation")
    parser.add_argument("--json", action="store_true", help="one JSON object per row instead")
    args = parser.parse_args()

    prompts = prompts_of(args.suites)
    if args.prompts:
        prompts = {n: t for n, t in prompts.items() if n in args.prompts.split(",")}
    rows = run_ours(args, prompts)
    if "transformers" in args.peers:
        rows += run_transformers(args, prompts)
    if args.json:
        for r in rows:
            print(json.dumps({k: v for k, v in r.items() if k != "text"}))
    else:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
              f"target {args.target}, draft {args.draft}, {args.max_tokens} tokens, greedy\n")
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
