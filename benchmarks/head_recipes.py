"""Training recipes for a head compared on one set of data: which recipe generalises best?

`specserve train-head` spends most of its budget making data (the target's answers and
features), which ties every recipe change to a fresh half hour and to data that differs
from run to run. This script makes the data once, as `train-head --max-minutes
DATA_MINUTES` would up to the end of its features phase, keeps it in the cache
(`head-recipes/TARGET-METHOD-MINUTES/`, reused by later runs), and then trains each recipe
from the same seed for the same number of steps, measuring held-out top-1 agreement per
unrolled step (and the training batches' top-1) every --eval-every steps. No figure here
is a speed: a fixed step count, not a time budget, so a loaded machine changes nothing
but how long it takes.

    .venv/bin/python benchmarks/head_recipes.py --steps 700 \\
        --recipes 'base;lr-low:lr=0.0005;vocab16k:draft_vocab_size=16384;text:text=1'

A recipe is `NAME:key=value,...` over the keys of `TrainHeadSettings` that shape the head
(draft_vocab_size, head_intermediate_size, ttt_length, num_heads) and of `LoopSettings`
(lr, weight_decay, batch_tokens, window, warmup_steps, grad_clip, feature_noise), and
`text=1` or `text=0` to train on the data's standard-library text or not (by default, as
`train-head` would: not since its `stdlib_tokens` became 0), and `answers=SHARE` to train
on that share of the training answers, the first ones made (as a shorter budget would have
made them; the held-out answers stay whole), so one data set tells what more answers buy,
and `feature_norm=1` or `=2` to bring EAGLE-3's three captured layers to one scale before
fc (1: each layer's feature divided by its median RMS over the data; 2: each position's
RMS-normalised), a transform of the data alone, held-out features included; and
`init_layer=0` to start EAGLE-3's layer at random (`=1`: from the target's last one, as
`train-head` does by default), `source_layer=L` to start it from the target's layer L
instead (negative: counted from the end), `embedding_half=S` to scale the embedding's
half of its qkv by S (0: the started layer reads the feature alone), `neurons=1` to
start its MLP from the target's neurons of the largest weight norms, not the first.
A folder made under older defaults is reused with the settings it was made with (its
run.json); the recipes start from today's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from specserve import catalogue
from specserve.train.eagle import start_from_target_layer
from specserve.train.features import FeatureSet
from specserve.train.run import (
    Clock,
    Run,
    TrainHeadSettings,
    check_same_run,
    float_tensor,
    load_target,
    make_method,
    new_trainer,
)

HEAD_KEYS = ("draft_vocab_size", "head_intermediate_size", "ttt_length", "num_heads")
LOOP_KEYS = ("lr", "weight_decay", "batch_tokens", "window", "warmup_steps", "grad_clip", "feature_noise")
DATA_KEYS = ("text", "answers", "feature_norm")
INIT_KEYS = ("init_layer", "source_layer", "embedding_half", "neurons")


def parse_recipes(text: str) -> dict[str, dict[str, float]]:
    recipes = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, assignments = part.partition(":")
        values = {}
        for assignment in filter(None, assignments.split(",")):
            key, _, value = assignment.partition("=")
            if key not in HEAD_KEYS + LOOP_KEYS + DATA_KEYS + INIT_KEYS:
                known = ", ".join(HEAD_KEYS + LOOP_KEYS + DATA_KEYS + INIT_KEYS)
                raise SystemExit(f"recipe {name!r}: unknown key {key!r}; keys: {known}")
            values[key] = float(value)
        if values.get("init_layer") == 0 and ("source_layer" in values or values.get("neurons")):
            raise SystemExit(
                f"recipe {name!r}: source_layer and neurons start the layer from the target's; drop init_layer=0"
            )
        recipes[name] = values
    return recipes


def data_settings(settings: TrainHeadSettings, work: Path) -> TrainHeadSettings:
    """The settings the folder's data was (or is being) made with: its run.json where it
    exists, else `settings`."""
    run_file = work / "run.json"
    if not run_file.is_file():
        return settings
    stored = json.loads(run_file.read_text())
    loop = dataclasses.replace(settings.loop, **stored.pop("loop"))
    return dataclasses.replace(settings, loop=loop, **stored)


def make_data(settings: TrainHeadSettings, work: Path) -> tuple[catalogue.LoadedModel, list[str]]:
    """The target, and the keys of the samples whose features are in work/features."""
    if settings.quantization != "none":
        catalogue.prepare_quantized(settings.target, settings.quantization)
    check_same_run(work, settings)
    target = load_target(settings)
    clock = Clock(settings.max_minutes, work / "minutes.json")
    run = Run(settings, work, clock)
    samples = run.samples(target)
    folder = work / "features"
    if "features" not in clock.minutes:  # read once: a fresh clock would read on into more text
        run.features(target, samples)
        clock.phase_done("features")
    return target, [key for key in samples if (folder / f"{key}.safetensors").is_file()]


def first_training_answers(keys: list[str], share: float, work: Path) -> list[str]:
    """`keys` less the training answers past the first `share` of them (in the order
    made); held-out samples and text all kept."""
    held_out = {key: sample["held_out"] for key, sample in json.loads((work / "data.json").read_text()).items()}
    training = [key for key in keys if key.startswith("answer-") and not held_out[key]]
    dropped = set(training[round(share * len(training)) :])
    return [key for key in keys if key not in dropped]


def normalise_features(data: FeatureSet, how: int, hidden: int) -> None:
    """EAGLE-3's three captured layers brought to one scale, in place: 1, each layer's
    feature divided by its median RMS over the data (a constant fc can absorb); 2, each
    position's feature of each layer RMS-normalised."""
    parts = data.features.unflatten(1, (-1, hidden))  # [N, layers, H], a view: written in place
    values = parts.float()
    rms = values.pow(2).mean(-1, keepdim=True).sqrt()  # [N, layers, 1]
    scale = rms.median(dim=0, keepdim=True).values if how == 1 else rms.clamp_min(1e-6)
    parts.copy_(values / scale)


def train_recipe(
    name: str,
    values: dict[str, float],
    settings: TrainHeadSettings,
    target: catalogue.LoadedModel,
    keys: list[str],
    work: Path,
    steps: int,
    eval_every: int,
    eval_steps: int | None = None,  # EAGLE: unrolled steps measured held out; None: the recipe's own
) -> list[dict]:
    head_values = {k: int(v) for k, v in values.items() if k in HEAD_KEYS}
    whole = ("batch_tokens", "window", "warmup_steps")
    loop_values = {k: (int(v) if k in whole else v) for k, v in values.items() if k in LOOP_KEYS}
    loop = dataclasses.replace(settings.loop, steps=steps, **loop_values)
    recipe = dataclasses.replace(settings, loop=loop, **head_values)
    from_target = "source_layer" in values or values.get("neurons")
    if "init_layer" in values or from_target:  # a start of its own below: new_trainer's would be read in vain
        recipe = dataclasses.replace(
            recipe, layer_start="target" if values.get("init_layer") and not from_target else "random"
        )
    if values.get("text", int(settings.stdlib_tokens > 0)) == 0:
        keys = [key for key in keys if key.startswith("answer-")]
    if values.get("answers", 1.0) < 1.0:
        keys = first_training_answers(keys, values["answers"], work)
    checkpoint = work / f"recipe-{name}.pt"
    checkpoint.unlink(missing_ok=True)
    data = FeatureSet.load(work / "features", keys)
    if values.get("feature_norm"):
        normalise_features(data, int(values["feature_norm"]), target.config.hidden_size)
    trainer = new_trainer(make_method(recipe), recipe, target, data, checkpoint)
    if from_target:
        folder = catalogue.resolve(settings.target)
        layer = int(values.get("source_layer", -1)) % target.config.num_layers
        strongest = bool(values.get("neurons"))
        start_from_target_layer(trainer.head, lambda name: float_tensor(folder, name), layer, strongest)
    if "embedding_half" in values:
        with torch.no_grad():
            trainer.head.layer.self_attn.qkv_proj.weight[:, : target.config.hidden_size] *= values["embedding_half"]
    measured = make_method(dataclasses.replace(recipe, ttt_length=eval_steps)) if eval_steps else None
    rows, correct, counted, started = [], [0], [0], time.monotonic()
    while trainer.position.step < steps:
        figures = trainer.train_step()
        correct[0] += figures.correct[0]
        counted[0] += figures.counted[0]
        if trainer.position.step % eval_every == 0 or trainer.position.step == steps:
            agreement = trainer.evaluate(held_out=True, method=measured)
            row = {
                "recipe": name,
                "step": trainer.position.step,
                "epochs": round(trainer.position.epoch + trainer.position.index / len(trainer.windows), 2),
                "held_out_top1": [round(r, 4) for r in agreement.rates],
                "train_top1": round(correct[0] / max(counted[0], 1), 4),  # first step, batches since the last row
                "minutes": round((time.monotonic() - started) / 60, 2),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
            correct, counted = [0], [0]
    checkpoint.unlink(missing_ok=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--method", default="eagle3", choices=("eagle3", "eagle", "medusa"))
    parser.add_argument("--data-minutes", type=float, default=30.0, help="the train-head budget whose data to make")
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--recipes", default="base")
    parser.add_argument(
        "--eval-steps",
        type=int,
        default=None,
        help="EAGLE: unrolled steps whose held-out agreement is measured, trained or not (default: each recipe's)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="a JSON-lines file for every row")
    args = parser.parse_args()
    recipes = parse_recipes(args.recipes)
    if args.eval_steps is not None and (args.method == "medusa" or args.eval_steps < 1):
        raise SystemExit("--eval-steps is an EAGLE head's count of unrolled steps, at least 1")
    settings = TrainHeadSettings(args.target, args.method, max_minutes=args.data_minutes, seed=args.seed)
    settings.check()
    settings = settings.resolved()
    work = catalogue.cache_root() / "head-recipes" / f"{settings.head_name}-{args.data_minutes:g}"
    target, keys = make_data(data_settings(settings, work), work)
    rows = []
    for name, values in recipes.items():
        rows += train_recipe(name, values, settings, target, keys, work, args.steps, args.eval_every, args.eval_steps)
        if args.out:
            args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print("| recipe | step | epochs | held-out top-1 per step | training top-1 |")
    print("|---|---:|---:|---|---:|")
    for row in rows:
        per_step = ", ".join(f"{r:.3f}" for r in row["held_out_top1"])
        print(f"| {row['recipe']} | {row['step']} | {row['epochs']} | {per_step} | {row['train_top1']:.3f} |")


if __name__ == "__main__":
    main()
