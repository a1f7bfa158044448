"""`specserve train-head`: from a target to a trained head in the cache, within a time budget.

Phases, each ending at a share of `max_minutes` counted from the start of the command:
loading the target; data (the target answers instructions, its features recorded as it
generates, until `DATA_END`); features (teacher-forced forwards over standard-library
text, and any answer not recorded, until `FEATURES_END`); training (until `TRAIN_END`);
then the held-out measurement and saving.

Where things live: `heads/NAME/` in the cache holds a finished head (config.json and
model.safetensors in the public layout, and training.json with its figures);
`heads/NAME.work/` an unfinished run: run.json (the settings that decide the result),
answers.jsonl, data.json (the samples, fixed when the data phase ends), features/,
checkpoint.pt and minutes.json. Invariant: `heads/NAME` exists only complete (a staging
folder is renamed into place, then the work folder removed), so the same command again
resumes an unfinished run where it stopped, or reports the finished head.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from specserve import catalogue
from specserve.engine.build import use_cuda_graphs
from specserve.engine.engine import DEFAULT_MAX_NUM_SEQS
from specserve.errors import ConfigError
from specserve.logprobs import MAX_LOGPROBS
from specserve.model.device import check_device_format, default_dtype, resolve_device
from specserve.spec.heads.checkpoint import save_head
from specserve.train.data import (
    AnswerSettings,
    Sample,
    answer_instructions,
    benchmark_overlaps,
    longest_sequence,
    stdlib_samples,
)
from specserve.train.eagle import EagleMethod, start_from_target_layer
from specserve.train.features import AnswerRecorder, FeatureSet, compute_features
from specserve.train.instructions import MIN_INSTRUCTIONS, read_instructions_file
from specserve.train.loop import HeadMethod, LoopSettings, Trainer
from specserve.train.medusa import MedusaMethod
from specserve.train.objective import DraftVocab, estimated_acceptance_length

log = logging.getLogger("specserve")

METHODS = ("eagle3", "eagle", "medusa")
LAYER_STARTS = ("target", "random")  # EAGLE-3's layer: from the target's last one, or at random
# Answers generated at once by default: the CPU's int4 kernels answer about as many tokens
# a second at 8 as at 16 or 32 (benchmarks/EXPERIMENTS.md, "Sixteen answers at once"); a
# GPU's step grows little with its rows (benchmarks/README.md, "Current results: GPU").
ANSWERS_AT_ONCE = {"cpu": DEFAULT_MAX_NUM_SEQS, "cuda": 128}
# Settings a resumed run may change: its budget, how many answers it makes at once (the
# answers made are kept; the batch changes how soon the rest come), and where its
# instructions file lies (their digest decides).
NOT_DECIDING = ("max_minutes", "force", "name", "max_num_seqs", "instructions")
# Where each phase must end, as shares of the budget. Answers (recorded as they are
# generated) are the text the head is measured on and drafts for; the features phase
# reads what a resumed run did not record, and any standard-library text asked for.
DATA_END, FEATURES_END, TRAIN_END = 0.55, 0.6, 0.95
MIN_ANSWERS = MIN_INSTRUCTIONS  # an answer of each: one held out to measure, one to train on


class BudgetTooSmall(ConfigError):
    """--max-minutes cannot produce a trained head; the message says how much might."""


@dataclass(frozen=True)
class TrainHeadSettings:
    target: str  # a catalogue name, a .gguf file or a checkpoint folder
    method: str = "eagle3"
    name: str | None = None  # None: TARGET-METHOD
    max_minutes: float = 30.0
    seed: int = 0
    device: str = "auto"  # auto (a CUDA GPU where PyTorch sees one, else the CPU), cpu, cuda or cuda:N
    # The target's weights while it answers and is read. auto: int4 on the CPU (its
    # fastest), none (bfloat16) on a GPU, where only unquantized weights run.
    quantization: str = "auto"
    dtype: str = "auto"  # auto, float32 or bfloat16
    max_answers: int | None = None  # instructions; None: every one, as far as the budget goes
    # A user's JSON-lines file of instructions to answer instead of the bundled ones
    # (instructions.py); resolved() adds its sha256, which a resumed run must share.
    instructions: str | None = None
    instructions_sha256: str | None = None
    answer_rounds: int = 3  # answers per instruction at most, each from its own seed
    # Instructions the target is asked to write, and answers, once the given ones' rounds
    # are asked; None: as many as the budget allows. A GPU answers the rounds in minutes.
    written_instructions: int | None = None
    answer_tokens: int = 256
    temperature: float = 0.8
    max_num_seqs: int | None = None  # answers at once; None: the device's (ANSWERS_AT_ONCE)
    # Standard-library text read after the answers, at most: none by default, since on the
    # same data and steps a head trained on the answers alone agreed more on held-out
    # answers ("Head recipes on one set of data").
    stdlib_tokens: int = 0
    top_k: int = MAX_LOGPROBS  # target probabilities kept per position (an answer's are its logprobs)
    # Sized for a CPU budget: benchmarks/EXPERIMENTS.md, "EAGLE-3 heads in 30 CPU minutes".
    draft_vocab_size: int = 8192
    ttt_length: int = 2  # EAGLE: unrolled steps
    num_heads: int = 3  # Medusa
    head_intermediate_size: int | None = 2048  # EAGLE: the head's MLP; None: the target's
    # EAGLE-3's layer starts as the target's last: on one data set, 3 points more held-out
    # top-1 than a random start ("The layer started from the target's last").
    layer_start: str = "target"
    # Same data, same steps: weight decay 0.1 a point up ("Head recipes on one set of data"),
    # lr 5e-4 for 1.5e-3 five points up for EAGLE-3 and two or three for Medusa ("The
    # learning rate of both heads").
    loop: LoopSettings = LoopSettings(steps=None, lr=5e-4, weight_decay=0.1)
    force: bool = False

    def check(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown head method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.name is not None and (not self.name or "/" in self.name or self.name.startswith(".")):
            raise ConfigError(f"--name must be a plain folder name (no '/', not starting with '.'), got {self.name!r}")
        if not self.max_minutes > 0:
            raise ConfigError(f"--max-minutes must be > 0, got {self.max_minutes}")
        if self.max_answers is not None and self.max_answers < MIN_ANSWERS:
            raise ConfigError(f"--max-answers must be >= {MIN_ANSWERS} (one held out to measure, one to train on)")
        positive = {
            "--answer-tokens": self.answer_tokens,
            "--max-num-seqs": 1 if self.max_num_seqs is None else self.max_num_seqs,
            "--answer-rounds": self.answer_rounds,
            "--top-k": self.top_k,
            "--draft-vocab-size": self.draft_vocab_size,
            "--ttt-length": self.ttt_length,
            "--num-heads": self.num_heads,
            "--batch-tokens": self.loop.batch_tokens,
            "--steps": self.loop.steps or 1,
        }
        for flag, value in positive.items():
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        if self.written_instructions is not None and self.written_instructions < 0:
            raise ConfigError(f"--written-instructions must be >= 0, got {self.written_instructions}")
        if self.top_k > MAX_LOGPROBS:
            raise ConfigError(
                f"--top-k must be <= {MAX_LOGPROBS} (the logprobs an answer is recorded with), got {self.top_k}"
            )
        if not 0 < self.temperature <= 2:
            raise ConfigError(f"--temperature must be in (0, 2], got {self.temperature}")
        if self.layer_start not in LAYER_STARTS:
            raise ConfigError(f"--layer-start must be one of {', '.join(LAYER_STARTS)}, got {self.layer_start!r}")

    def resolved(self) -> TrainHeadSettings:
        """These settings with `auto` and None made concrete for this machine: the device,
        the quantization and the answers at once (what a resumed run must share)."""
        device = resolve_device(self.device)
        quantization = self.quantization
        if quantization == "auto":
            quantization = "int4" if device.type == "cpu" else "none"
        check_device_format(device, quantization, batch_invariant=False)
        instructions, digest = self.instructions, None
        if instructions is not None:
            path = Path(instructions).expanduser().resolve()
            read = read_instructions_file(path)  # one that cannot serve fails here
            overlapping = benchmark_overlaps(read.instructions)
            if overlapping:
                log.warning(
                    "--instructions %s: %d instructions hold a benchmark suite's prompt; a head trained on "
                    "them overrates itself on those suites",
                    path,
                    overlapping,
                )
            if read.repeated:
                log.info(
                    "--instructions %s: %d lines repeat an instruction before them, read once", path, read.repeated
                )
            instructions, digest = str(path), read.sha256
        return dataclasses.replace(
            self,
            device=str(device),
            quantization=quantization,
            max_num_seqs=self.max_num_seqs or ANSWERS_AT_ONCE[device.type],
            instructions=instructions,
            instructions_sha256=digest,
        )

    @property
    def head_name(self) -> str:
        if self.name is not None:
            return self.name
        path = Path(self.target)
        return f"{path.stem if path.suffix == '.gguf' else path.name}-{self.method}"

    def deciding_result(self) -> dict:
        """The settings a resumed run must share (not `NOT_DECIDING`'s)."""
        deciding = {k: v for k, v in dataclasses.asdict(self).items() if k not in NOT_DECIDING}
        del deciding["loop"]["checkpoint_seconds"]
        return deciding


def make_method(settings: TrainHeadSettings) -> HeadMethod:
    if settings.method == "medusa":
        return MedusaMethod(settings.num_heads)
    return EagleMethod(3 if settings.method == "eagle3" else 1, settings.ttt_length, settings.head_intermediate_size)


class Clock:
    """The budget's deadlines, and the minutes each phase took (over resumed runs too)."""

    def __init__(self, max_minutes: float, minutes_file: Path):
        self.started = self.phase_started = time.monotonic()
        self.max_minutes = max_minutes
        self.minutes_file = minutes_file
        self.minutes = json.loads(minutes_file.read_text()) if minutes_file.is_file() else {}

    def at(self, share: float) -> float:
        return self.started + share * self.max_minutes * 60

    def elapsed_minutes(self) -> float:
        return (time.monotonic() - self.started) / 60

    def phase_done(self, phase: str) -> None:
        now = time.monotonic()
        self.minutes[phase] = self.minutes.get(phase, 0.0) + (now - self.phase_started) / 60
        self.phase_started = now
        self.minutes_file.write_text(json.dumps(self.minutes))

    def too_small(self, what: str, share: float, needed_share_minutes: float) -> BudgetTooSmall:
        """A refusal naming what did not fit, with the budget whose `share` would give
        the minutes measured so far plus `needed_share_minutes`."""
        needed = (self.elapsed_minutes() + needed_share_minutes) / share
        return BudgetTooSmall(
            f"--max-minutes {self.max_minutes:g} is too small: {what} (after {self.elapsed_minutes():.2f} minutes); "
            f"give it at least about {max(needed, 2 * self.max_minutes):.1f} minutes"
        )


def train_head(settings: TrainHeadSettings) -> Path:
    """Train (or resume training) the head and return its folder in the cache."""
    settings.check()
    settings = settings.resolved()
    name = settings.head_name
    folder = catalogue.heads_root() / name
    work = folder.with_name(f"{name}.work")
    with catalogue.locked(f"head-{name}"):
        if settings.force:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(folder, ignore_errors=True)
        if catalogue.is_head(folder):
            print(f"head {name!r} is trained already: {folder} (--force trains it again)", file=sys.stderr)
            return folder
        # Preparing the target (once; minutes for int4 weights) is no part of training: before the clock starts.
        catalogue.resolve(settings.target)
        if settings.quantization != "none":
            catalogue.prepare_quantized(settings.target, settings.quantization)
        check_same_run(work, settings)
        clock = Clock(settings.max_minutes, work / "minutes.json")
        report = Run(settings, work, clock).train(folder)
    print(summary(name, report), file=sys.stderr)
    return folder


def check_same_run(work: Path, settings: TrainHeadSettings) -> None:
    run_file = work / "run.json"
    wanted = json.loads(json.dumps(settings.deciding_result(), default=str))
    if run_file.is_file():
        started = {k: v for k, v in json.loads(run_file.read_text()).items() if k not in NOT_DECIDING}
        # A setting newer than the run: the run ran as that setting's default does (and on
        # the CPU, before there was a choice).
        defaults = TrainHeadSettings(settings.target, device=settings.device).resolved().deciding_result()
        defaults = json.loads(json.dumps(defaults, default=str)) | {"device": "cpu"}
        started = defaults | started | {"loop": defaults["loop"] | started.get("loop", {})}
        differing = sorted(k for k in wanted.keys() | started.keys() if wanted.get(k) != started.get(k))
        if differing:
            raise ConfigError(
                f"an unfinished run of head {settings.head_name!r} in {work} has other settings "
                f"({', '.join(differing)}); run it with its own settings to resume it, or add --force to start over"
            )
    else:
        work.mkdir(parents=True, exist_ok=True)
        run_file.write_text(json.dumps(wanted, indent=2))


class Run:
    def __init__(self, settings: TrainHeadSettings, work: Path, clock: Clock):
        self.settings, self.work, self.clock = settings, work, clock
        self.method = make_method(settings)

    def train(self, folder: Path) -> dict:
        settings, clock = self.settings, self.clock
        target = load_target(settings)
        clock.phase_done("load")
        samples = self.samples(target)
        clock.phase_done("data")
        data = self.features(target, samples)
        clock.phase_done("features")
        trainer = new_trainer(self.method, settings, target, data, self.work / "checkpoint.pt")
        self.run_training(trainer)
        clock.phase_done("train")
        agreement = trainer.evaluate(held_out=True)
        clock.phase_done("measure")
        report = self.report(data, trainer.vocab, trainer, agreement, samples)
        staging = folder.with_name(f"{folder.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        save_head(trainer.head, staging)
        (staging / "training.json").write_text(json.dumps(report, indent=2))
        staging.rename(folder)
        shutil.rmtree(self.work)
        return report

    def samples(self, target: catalogue.LoadedModel) -> dict[str, Sample]:
        """The samples by key: fixed in data.json once the data phase has ended."""
        data_file = self.work / "data.json"
        if data_file.is_file():
            return {key: Sample(**sample) for key, sample in json.loads(data_file.read_text()).items()}
        settings = self.settings
        answer_settings = AnswerSettings(
            settings.max_answers,
            settings.answer_tokens,
            settings.temperature,
            settings.max_num_seqs,
            settings.seed,
            settings.answer_rounds,
            settings.written_instructions,
            settings.instructions,
        )
        wanted = None  # answers at most, where they are bounded
        if settings.max_answers is not None and settings.written_instructions == 0:
            wanted = settings.max_answers * settings.answer_rounds
        with tqdm(desc="answers", total=wanted, unit=" answers") as bar:
            answered_tokens = []

            def on_answer(num_tokens: int) -> None:
                answered_tokens.append(num_tokens)
                bar.set_postfix(tokens=sum(answered_tokens))
                bar.update()

            recorder = AnswerRecorder(self.method.feature_spec(target.config), settings.top_k, self.work / "features")
            answers, stats = answer_instructions(
                target.decoder,
                target.tokenizer,
                answer_settings,
                self.work / "answers.jsonl",
                self.clock.at(DATA_END),
                on_answer,
                recorder,
            )
        if len(answers) < MIN_ANSWERS:
            seconds_per_answer = stats.seconds_per_step * settings.answer_tokens if stats.steps else None
            missing = (
                f"the target answered {len(answers)} of the {MIN_ANSWERS} instructions a run needs "
                f"in the {DATA_END:.0%} of it given to answers"
            )
            raise self.clock.too_small(missing, DATA_END, (seconds_per_answer or 60) / 60)
        samples = dict(zip(stats.keys, answers))
        stdlib = stdlib_samples(target.tokenizer, settings.stdlib_tokens, settings.loop.window, settings.seed)
        samples |= {f"stdlib-{i:04d}": sample for i, sample in enumerate(stdlib)}
        data_file.write_text(json.dumps({key: dataclasses.asdict(sample) for key, sample in samples.items()}))
        return samples

    def features(self, target: catalogue.LoadedModel, samples: dict[str, Sample]) -> FeatureSet:
        spec = self.method.feature_spec(target.config)
        folder = self.work / "features"
        with tqdm(desc="features", total=len(samples), unit=" samples") as bar:
            keys = compute_features(
                target.decoder,
                samples,
                spec,
                self.settings.top_k,
                folder,
                self.clock.at(FEATURES_END),
                on_sample=lambda num_tokens: bar.update(),
            )
        held_out = [samples[key].held_out for key in keys]
        if not any(held_out) or all(held_out):
            raise self.clock.too_small(
                "the target read too few samples for one to train on and one to measure", FEATURES_END, 0.5
            )
        return FeatureSet.load(folder, keys)

    def run_training(self, trainer: Trainer) -> None:
        position = trainer.position
        with tqdm(desc="training", total=position.total_steps, initial=position.step, unit=" steps") as bar:

            def on_step(figures) -> None:
                bar.total = position.total_steps
                bar.set_postfix(
                    loss=f"{figures.loss.item():.3f}", top1=f"{figures.correct[0] / max(figures.counted[0], 1):.2f}"
                )
                bar.update()

            trainer.run(self.clock.at(TRAIN_END), on_step)
        if position.step == 0:
            raise self.clock.too_small("no training step fitted in the budget", TRAIN_END, 0.5)

    def report(self, data: FeatureSet, vocab: DraftVocab, trainer: Trainer, agreement, samples) -> dict:
        settings, minutes = self.settings, self.clock.minutes
        answers = [s for key, s in samples.items() if not key.startswith("stdlib-")]
        answer_tokens = sum(len(s.token_ids) - s.first_trained for s in answers)
        held_out_rows = torch.cat([torch.arange(start, end) for start, end, out in data.samples if out])
        held_out_rows = held_out_rows[data.trained[held_out_rows]]
        coverage = float((vocab.row_of.cpu()[data.top_ids[held_out_rows, 0]] >= 0).float().mean())
        return {
            "target": settings.target,
            "method": settings.method,
            "seed": settings.seed,
            "device": settings.device,
            "quantization": settings.quantization,
            "held_out": {
                "top1_agreement_per_step": [round(r, 4) for r in agreement.rates],
                "positions": agreement.counted[0],
                # a chain of one draft per step, each accepted as often as it agreed
                "estimated_mean_acceptance_length": round(estimated_acceptance_length(agreement.rates), 3),
                "num_speculative_tokens": len(agreement.rates),
                "draft_vocab_coverage": round(coverage, 4),
                "loss": round(agreement.loss, 4),
            },
            "data": {
                # the user's file and its sha256, or the bundled instructions
                "instructions": settings.instructions or "bundled",
                **({"instructions_sha256": settings.instructions_sha256} if settings.instructions else {}),
                "answers": len(answers),
                "written_instructions": sum(key.startswith("written-") for key in samples),
                "answer_tokens": answer_tokens,
                "answers_per_minute": round(len(answers) / minutes["data"], 2) if minutes.get("data") else None,
                "answer_tokens_per_minute": round(answer_tokens / minutes["data"], 1) if minutes.get("data") else None,
                "stdlib_samples": len(samples) - len(answers),
                "positions": len(data.token_ids),
                "trained_positions": data.num_trained(held_out=False),
                "held_out_answers": sum(s.held_out for s in answers),
            },
            "training": {
                "steps": trainer.position.step,
                "planned_steps": trainer.position.total_steps,
                "epochs": round(trainer.position.epoch + trainer.position.index / len(trainer.windows), 2),
                "unrolled_steps" if settings.method != "medusa" else "heads": self.method.num_steps,
                "draft_vocab_size": len(vocab.target_ids),
                **({"layer_start": settings.layer_start} if settings.method == "eagle3" else {}),
                **{k: v for k, v in dataclasses.asdict(settings.loop).items() if k not in ("steps", "seed")},
            },
            "minutes": {phase: round(m, 2) for phase, m in minutes.items()},
            "max_minutes": settings.max_minutes,
        }


def new_trainer(
    method: HeadMethod, settings: TrainHeadSettings, target: catalogue.LoadedModel, data: FeatureSet, checkpoint: Path
) -> Trainer:
    """A new head for `target` (from the seeded RNG, over the data's most frequent ids,
    its LM head rows the target's, an EAGLE-3 layer as `settings.layer_start` says) and
    the Trainer of `settings.loop` for it, resuming from `checkpoint` where one exists."""
    vocab = DraftVocab.most_frequent(data.token_counts(target.config.vocab_size), settings.draft_vocab_size)
    torch.manual_seed(settings.seed)
    device = target.decoder.device
    folder = catalogue.resolve(settings.target)
    lm_head_rows = lm_head_weight(folder)[vocab.target_ids].to(device)
    head = method.new_head(target.config, target.decoder.embed_tokens, vocab, lm_head_rows)
    if settings.method == "eagle3" and settings.layer_start == "target":
        start_from_target_layer(head, lambda name: float_tensor(folder, name), target.config.num_layers - 1)
    loop = dataclasses.replace(settings.loop, seed=settings.seed)
    return Trainer(method, head, data, vocab, loop, checkpoint, device)


def load_target(settings: TrainHeadSettings) -> catalogue.LoadedModel:
    """The target on the settings' (resolved) device; on a GPU compiled where inductor
    works and stepped through CUDA graphs sized for the answers, as `serve` runs it."""
    device = resolve_device(settings.device)
    auto = settings.dtype == "auto"
    dtype = default_dtype(device, settings.quantization) if auto else getattr(torch, settings.dtype)
    compile = None if device.type == "cuda" else False
    target = catalogue.load_model(settings.target, dtype, settings.quantization, compile=compile, device=device)
    if device.type == "cuda":
        answers = longest_sequence(target.tokenizer, settings.answer_tokens, settings.instructions)
        positions = max(answers, settings.loop.window)  # an answer, or a piece of text
        use_cuda_graphs([target.decoder], settings.max_num_seqs, positions, asked=False)
    return target


def lm_head_weight(folder: Path) -> torch.Tensor:  # [vocab, H] float32
    """The target's LM head as its checkpoint holds it (the embedding where they are tied)."""
    return float_tensor(folder, "lm_head.weight", "model.embed_tokens.weight")


def float_tensor(folder: Path, *names: str) -> torch.Tensor:
    """The first of `names` the target's checkpoint holds, as float32: read from its float
    weights (any of its safetensors files), whatever format the target runs in."""
    for name in names:
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as weights:
                if name in weights.keys():
                    return weights.get_tensor(name).float()
    raise ConfigError(f"{folder} holds none of {', '.join(names)}")


def summary(name: str, report: dict) -> str:
    held_out = report["held_out"]
    per_step = " ".join(f"{r:.2f}" for r in held_out["top1_agreement_per_step"])
    minutes = ", ".join(f"{phase} {m:.1f}" for phase, m in report["minutes"].items())
    return (
        f"head {name!r}: held-out top-1 agreement per step {per_step}, estimated mean acceptance length "
        f"{held_out['estimated_mean_acceptance_length']:.2f} (draft vocabulary covers "
        f"{held_out['draft_vocab_coverage']:.0%} of the target's top-1); minutes: {minutes}"
    )
