"""Predicted outputs: what a request's `prediction` (the text its answer is expected to
be) gains, on a plain engine and on speculative ones.

Each task is a code edit whose answer is mostly its file: the request asks for the
whole changed file in a fence, and its prediction is the file as it stands. Each mode
has one engine over one loaded target; every request is asked greedily without and
with its prediction, the two taking turns (the order alternating, round by round), and
must give the same tokens both ways. Per mode: decode tokens a second over all requests
(after each first token) without and with the prediction, their ratio, and the
predicted tokens the target accepted and rejected.

    .venv/bin/python benchmarks/predicted_outputs.py
    .venv/bin/python benchmarks/predicted_outputs.py --modes plain,draft,ngram --rounds 3
    .venv/bin/python benchmarks/predicted_outputs.py --modes plain,eagle3
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from specserve.catalogue import load_model
from specserve.engine.build import engine_for_spec, run_one
from specserve.sampling import SamplingParams
from specserve.spec.prediction import PredictedText

MODES = {
    "plain": None,
    "ngram": '{"method": "ngram", "num_speculative_tokens": 5}',
    "draft": '{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 7}',
    "eagle3": '{"method": "eagle3", "model": "qwen2.5-coder-1.5b-eagle3", "num_speculative_tokens": 3}',
}

STATS = '''import math


def compute(values):
    """Mean and standard deviation of a list of numbers."""
    if not values:
        raise ValueError("no values")
    mean = sum(values) / len(values)
    variance = sum((v - mean) ** 2 for v in values) / len(values)
    return mean, math.sqrt(variance)


def normalise(values):
    """Each value's distance from the mean, in standard deviations."""
    mean, std = compute(values)
    if std == 0:
        return [0.0 for _ in values]
    return [(v - mean) / std for v in values]
'''

INVENTORY = """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise ValueError(f"not enough {name}")
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())
"""

CONFIG = """const config = {
  host: "localhost",
  port: 8080,
  retries: 3,
  timeoutMs: 5000,
  logLevel: "info",
};

function connect(cfg) {
  console.log(`connecting to ${cfg.host}:${cfg.port}`);
  return { host: cfg.host, port: cfg.port, open: true };
}

module.exports = { config, connect };
"""

# (name, instruction, the file, its fence's language)
TASKS = [
    ("rename", "Rename the function `compute` to `summary` everywhere in this file.", STATS, "python"),
    ("guard", "Make `add` raise ValueError when count is not positive.", INVENTORY, "python"),
    ("port", "Change the port to 9090 and the log level to debug.", CONFIG, "javascript"),
]


def fenced(text: str, language: str) -> str:
    return f"```{language}\n{text}```"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--quantization", default="int4", choices=("none", "int8", "int4"))
    parser.add_argument("--modes", default="plain,draft", help=f"a comma-separated list of {sorted(MODES)}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=400)
    args = parser.parse_args(argv)

    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown modes {unknown}: give some of {sorted(MODES)}")
    dtype = torch.bfloat16 if args.quantization != "none" else torch.float32
    target = load_model(args.target, dtype, args.quantization)
    tokenizer = target.tokenizer
    engines = {mode: engine_for_spec(target, MODES[mode], args.quantization) for mode in modes}
    requests = []  # (name, prompt ids, the prediction)
    for name, instruction, text, language in TASKS:
        ask = f"{instruction} Answer with the whole file in a code block and nothing else.\n\n{fenced(text, language)}"
        prediction = PredictedText(tokenizer.encode(fenced(text, language), add_special_tokens=False))
        requests.append((name, tokenizer.encode_chat([{"role": "user", "content": ask}]), prediction))

    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    tokens = {(mode, p): 0 for mode in modes for p in (False, True)}
    seconds = {(mode, p): 0.0 for mode in modes for p in (False, True)}
    fates = {mode: [0, 0] for mode in modes}  # predicted tokens accepted, rejected
    differ = []
    for round_ in range(args.rounds):
        for number, (name, ids, prediction) in enumerate(requests):
            flip = (round_ + number) % 2 == 1
            for mode in reversed(modes) if flip else modes:
                outputs = {}
                for predicted in (True, False) if flip else (False, True):
                    params = dataclasses.replace(greedy, prediction=prediction) if predicted else greedy
                    out = run_one(engines[mode], tokenizer, ids, params)
                    outputs[predicted] = out["token_ids"]
                    tokens[mode, predicted] += out["num_output_tokens"] - 1
                    seconds[mode, predicted] += out["e2e_s"] - out["ttft_s"]
                    if predicted:
                        fates[mode][0] += out["prediction"]["accepted"]
                        fates[mode][1] += out["prediction"]["rejected"]
                if outputs[True] != outputs[False]:
                    differ.append((mode, name))
            print(f"round {round_ + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)

    print(f"{len(requests)} code edits x {args.rounds} rounds, {args.target} {args.quantization}, greedy\n")
    print("| mode | decode tok/s | with the prediction | ratio | predicted tokens accepted / rejected |")
    print("|---|---:|---:|---:|---:|")
    for mode in modes:
        without, with_ = (tokens[mode, p] / seconds[mode, p] for p in (False, True))
        accepted, rejected = fates[mode]
        print(f"| {mode} | {without:.1f} | {with_:.1f} | {with_ / without:.2f}x | {accepted} / {rejected} |")
    if differ:
        print(f"\nNOT the same tokens with the prediction: {differ}")
        return 1
    print("\nEvery answer was the same with and without its prediction.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
