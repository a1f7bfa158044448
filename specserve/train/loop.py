"""The training loop: AdamW, linear warm-up then cosine decay, gradient clipping, bfloat16
autocast (on a CPU with bfloat16 instructions its matmuls run ~4x float32's; a GPU's tensor
cores' format), checkpoints, and the held-out measurement.

The head, its optimizer and the draft vocabulary live on the loop's device; the data stays
in host memory (a GPU's worth of answers outgrows the GPU's) and each batch is copied over.

Reproducible from the seed: the head's initial weights come from the seeded global RNG
(run.py), and epoch e visits the training windows in a permutation seeded by (seed, e),
so the data position is just (epoch, index). A checkpoint holds the head's weights, the
optimizer's state, the step, the planned number of steps, the data position, the global
RNG state and the seconds trained, written under a temporary name and renamed: resuming
from it continues the run that wrote it, step for step.

With no step count given, the plan (where the cosine decay ends) is as many steps as the
time left allows at the pace measured so far, made after `PLAN_AFTER_STEPS` steps and made
again after every step: one step's time misleads (batches differ in length, and other
work on a shared machine comes and goes), so a plan from the second step alone once
promised 442 steps where 60 fitted.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Protocol

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.errors import ConfigError
from specserve.model.device import CPU
from specserve.train.features import FeatureSet, FeatureSpec
from specserve.train.objective import Batch, DraftVocab, Figures

PLAN_AFTER_STEPS = 2  # the first step pays for warming up: the pace is measured from the second on
FINAL_LR_FRACTION = 0.1


class HeadMethod(Protocol):
    """One way of drafting from the target's features (train/eagle.py, train/medusa.py)."""

    name: str  # vLLM's method name
    num_steps: int  # tokens ahead the head is trained to guess; agreement is reported per step

    def feature_spec(self, target: ModelConfig) -> FeatureSpec: ...

    def new_head(
        self, target: ModelConfig, embed_tokens: nn.Module, vocab: DraftVocab, lm_head_rows: torch.Tensor
    ) -> nn.Module: ...

    def objective(self, head: nn.Module, batch: Batch, vocab: DraftVocab) -> Figures: ...


@dataclass(frozen=True)
class LoopSettings:
    steps: int | None  # None: as many as the time allows
    batch_tokens: int = 1024  # positions per step (whole windows; at least one)
    window: int = 512  # longest run of positions a row of the batch holds
    lr: float = 5e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    # Uniform noise on the training batches' features, in units of each position's mean
    # |feature| (EAGLE's augmentation: a drafting head reads its own, inexact features).
    feature_noise: float = 0.0
    checkpoint_seconds: float = 120.0
    seed: int = 0


@dataclass
class Position:
    step: int = 0
    total_steps: int | None = None
    epoch: int = 0
    index: int = 0  # next window of the epoch's permutation
    seconds: float = 0.0  # spent training, over every run that resumed this one


@dataclass(frozen=True)
class Agreement:
    """Held-out top-1 agreement with the target, per step."""

    correct: list[int]
    counted: list[int]
    loss: float

    @property
    def rates(self) -> list[float]:
        return [c / n if n else 0.0 for c, n in zip(self.correct, self.counted)]


def with_noise(features: torch.Tensor, scale: float) -> torch.Tensor:
    """features [B, T, F] plus uniform noise in +-scale x each position's mean |feature|,
    drawn from the global generator (checkpointed, so a resumed run draws the same)."""
    size = features.float().abs().mean(dim=-1, keepdim=True)  # [B, T, 1]
    noise = (torch.rand(features.shape) * 2 - 1) * (scale * size)  # [B, T, F]
    return (features.float() + noise).to(features.dtype)


class Trainer:
    def __init__(
        self,
        method: HeadMethod,
        head: nn.Module,
        data: FeatureSet,
        vocab: DraftVocab,
        settings: LoopSettings,
        checkpoint_path: Path,
        device: torch.device = CPU,
    ):
        self.device = device
        self.method, self.head, self.data, self.vocab = method, head.to(device), data, vocab.to(device)
        self.settings = settings
        self.checkpoint_path = checkpoint_path
        self.windows = data.windows(held_out=False, length=settings.window)
        if not self.windows:
            raise ConfigError("no training text: every sample is held out or too short")
        self.optimizer = torch.optim.AdamW(
            [p for p in head.parameters() if p.requires_grad],
            lr=settings.lr,
            betas=(0.9, 0.95),
            weight_decay=settings.weight_decay,
        )
        self.position = Position(total_steps=settings.steps)
        if checkpoint_path.is_file():
            self.restore()

    # -- data --

    def permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.windows), generator=generator).tolist()

    def next_batch(self) -> Batch:
        position, picked, tokens = self.position, [], 0
        order = self.permutation(position.epoch)
        while True:
            if position.index == len(order):
                position.epoch, position.index = position.epoch + 1, 0
                order = self.permutation(position.epoch)
            start, end = self.windows[order[position.index]]
            if picked and tokens + end - start > self.settings.batch_tokens:
                return self.data.batch(picked)
            picked.append((start, end))
            tokens += end - start
            position.index += 1

    # -- steps --

    def learning_rate(self, step: int) -> float:
        settings, total = self.settings, self.position.total_steps
        if total is None:
            return settings.lr * min(1.0, (step + 1) / settings.warmup_steps)
        warmup = min(1.0, (step + 1) / min(settings.warmup_steps, max(1, total // 10)))  # short runs warm up less
        progress = min(1.0, step / max(total - 1, 1))
        decay = FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))
        return settings.lr * warmup * decay

    def train_step(self) -> Figures:
        self.head.train()
        batch = self.next_batch()
        if self.settings.feature_noise > 0:
            batch = replace(batch, features=with_noise(batch.features, self.settings.feature_noise))
        batch = batch.to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.position.step)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            figures = self.method.objective(self.head, batch, self.vocab)
        self.optimizer.zero_grad(set_to_none=True)
        figures.loss.backward()
        nn.utils.clip_grad_norm_(self.head.parameters(), self.settings.grad_clip)
        self.optimizer.step()
        self.position.step += 1
        return figures

    def run(self, deadline: float, on_step: Callable[[Figures], None] = lambda figures: None) -> None:
        """Train until the planned steps are done or the deadline (`time.monotonic()`)
        passes, checkpointing every `checkpoint_seconds` and when stopped."""
        position = self.position
        last_checkpoint = time.monotonic()
        paced = []  # seconds of this run's steps after its first
        try:
            while position.total_steps is None or position.step < position.total_steps:
                started = time.monotonic()
                if started >= deadline:
                    break
                on_step(self.train_step())
                now = time.monotonic()
                position.seconds += now - started
                paced.append(now - started)
                if self.settings.steps is None and len(paced) >= PLAN_AFTER_STEPS:
                    pace = sum(paced[1:]) / len(paced[1:])
                    position.total_steps = position.step + int((deadline - now) / pace)
                if now - last_checkpoint >= self.settings.checkpoint_seconds:
                    self.save()
                    last_checkpoint = now
        finally:
            self.save()

    # -- checkpoints --

    def save(self) -> None:
        state = {
            "head": self.head.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "position": asdict(self.position),
            "rng": torch.get_rng_state(),
        }
        partial = self.checkpoint_path.with_suffix(".partial")
        torch.save(state, partial)
        partial.rename(self.checkpoint_path)

    def restore(self) -> None:
        # Read to the host: load_state_dict copies each tensor to the head's device.
        state = torch.load(self.checkpoint_path, map_location="cpu", weights_only=True)
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.position = Position(**state["position"])
        torch.set_rng_state(state["rng"])

    # -- measurement --

    @torch.no_grad()
    def evaluate(self, held_out: bool = True, method: HeadMethod | None = None) -> Agreement:
        """Top-1 agreement with the target per step over one split's windows, by the
        training method or by `method` (an EAGLE head measured over more unrolled steps)."""
        method = method or self.method
        self.head.eval()
        correct, counted, loss, batches = [0] * method.num_steps, [0] * method.num_steps, 0.0, 0
        windows = self.data.windows(held_out=held_out, length=self.settings.window)
        per_batch = max(1, self.settings.batch_tokens // self.settings.window)
        for i in range(0, len(windows), per_batch):
            batch = self.data.batch(windows[i : i + per_batch]).to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                figures = method.objective(self.head, batch, self.vocab)
            correct = [a + b for a, b in zip(correct, figures.correct)]
            counted = [a + b for a, b in zip(counted, figures.counted)]
            loss += figures.loss.item()
            batches += 1
        return Agreement(correct, counted, loss / max(batches, 1))
