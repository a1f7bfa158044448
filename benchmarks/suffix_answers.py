"""Requests of one kind answered one after another: what drafting from earlier answers
(suffix decoding) gains over plain decoding, a lookup of the request's own text and a
draft model.

Each mode has an engine of its own over one loaded target, kept for the whole run, so a
suffix engine's cache grows with the answers it gave, as a server's does. The modes take
turns request by request (the order alternating), so the machine's swings in speed fall
on all of them; every request is asked once, greedily, and every mode must give plain
decoding's tokens. Per mode: decode tokens a second over all requests (after each first
token) against plain's, TTFT's median against plain's, and tokens per verified step.

    .venv/bin/python benchmarks/suffix_answers.py --prompts-file benchmarks/data/extraction_prompts.jsonl
    .venv/bin/python benchmarks/suffix_answers.py --prompts-file benchmarks/data/sql_instructions.jsonl \\
        --requests 30 --modes plain,ngram,suffix --max-tokens 256

A mode is one of MODES' names, or NAME=JSON of a `--speculative-config`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from specserve.catalogue import LoadedModel, load_model
from specserve.engine.build import engine_for_spec, run_one
from specserve.sampling import SamplingParams

MODES = {
    "plain": None,
    "ngram": '{"method": "ngram", "num_speculative_tokens": 5}',
    "suffix": '{"method": "suffix"}',
    "suffix-own": '{"method": "suffix", "suffix_decoding_max_cached_requests": 0}',
    "draft": '{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 7}',
    "draft-answers": '{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 7, "lookup_answers": true}',
    "eagle3": '{"method": "eagle3", "model": "qwen2.5-coder-1.5b-eagle3", "num_speculative_tokens": 3}',
    "eagle3-answers": '{"method": "eagle3", "model": "qwen2.5-coder-1.5b-eagle3", "num_speculative_tokens": 3, '
    '"lookup_answers": true}',
}


def split_modes(text: str) -> list[str]:
    """text split at its commas outside JSON's braces and brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "{[") - (char in "}]")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return items + [text[start:]]


def parse_modes(text: str) -> dict[str, str | None]:
    modes: dict[str, str | None] = {}
    for item in split_modes(text):
        name, _, spec = item.partition("=")
        if not spec and name not in MODES:
            raise SystemExit(f"unknown mode {name!r}: give one of {sorted(MODES)} or NAME=JSON")
        modes[name] = spec or MODES[name]
    if "plain" not in modes:
        raise SystemExit("--modes needs plain: every ratio is against it")
    return modes


def read_prompts(path: Path, target: LoadedModel, requests: int | None) -> list[tuple[str, list[int], int | None]]:
    """(name, prompt ids, max_tokens or None) of each line: chat `messages` or a user `prompt`."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines()):
        record = json.loads(line)
        messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
        ids = target.tokenizer.encode_chat(messages)
        prompts.append((record.get("name", f"line {number + 1}"), ids, record.get("max_tokens")))
    return prompts[:requests]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts-file", type=Path, required=True, help="JSONL: messages or prompt, name, max_tokens")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--quantization", default="int4", choices=("none", "int8", "int4"))
    parser.add_argument("--modes", default="plain,ngram,suffix,suffix-own")
    parser.add_argument("--requests", type=int, default=None, help="the first N lines (default: all)")
    parser.add_argument("--max-tokens", type=int, default=128, help="where a line gives none")
    args = parser.parse_args(argv)

    modes = parse_modes(args.modes)
    dtype = torch.bfloat16 if args.quantization != "none" else torch.float32
    target = load_model(args.target, dtype, args.quantization)
    engines = {name: engine_for_spec(target, spec, args.quantization) for name, spec in modes.items()}
    prompts = read_prompts(args.prompts_file, target, args.requests)
    decode_tokens = dict.fromkeys(modes, 0)
    decode_s = dict.fromkeys(modes, 0.0)
    ttfts: dict[str, list[float]] = {name: [] for name in modes}
    mismatches = []
    for number, (name, ids, max_tokens) in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens or args.max_tokens, temperature=0.0)
        order = list(modes) if number % 2 == 0 else list(reversed(modes))
        outputs = {}
        for mode in order:
            out = run_one(engines[mode], target.tokenizer, ids, params)
            outputs[mode] = out["token_ids"]
            decode_tokens[mode] += out["num_output_tokens"] - 1
            decode_s[mode] += out["e2e_s"] - out["ttft_s"]
            ttfts[mode].append(out["ttft_s"])
        mismatches += [(name, mode) for mode, tokens in outputs.items() if tokens != outputs["plain"]]
        print(f"{number + 1}/{len(prompts)} {name}", file=sys.stderr, flush=True)

    plain_rate = decode_tokens["plain"] / decode_s["plain"]
    plain_ttft = statistics.median(ttfts["plain"])
    print(f"{len(prompts)} requests of {args.prompts_file.name}, {args.target} {args.quantization}, greedy\n")
    print("| mode | decode tok/s | against plain | TTFT p50 against plain | tokens a step |")
    print("|---|---:|---:|---:|---:|")
    for mode in modes:
        rate = decode_tokens[mode] / decode_s[mode]
        stats = engines[mode].spec_stats
        per_step = f"{stats.mean_acceptance_length:.2f}" if stats.num_drafts else "-"
        ttft = statistics.median(ttfts[mode]) / plain_ttft
        print(f"| {mode} | {rate:.1f} | {rate / plain_rate:.2f}x | {ttft:.2f}x | {per_step} |")
    if mismatches:
        print(f"\nNOT plain decoding's tokens: {mismatches}")
        return 1
    print("\nEvery mode gave plain decoding's tokens.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
