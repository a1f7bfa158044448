"""What a head learns from: the target's features and next-token distributions, read off a
teacher-forced forward over each sample (`Decoder.forward` with a `Capture`).

Per position p of a sample: the token, the feature the head reads (EAGLE-3: the residual
stream entering three target layers [3H]; EAGLE-1 and Medusa: the last hidden state
after the final norm [H]), and the target's distribution of the token at p + 1 at
temperature 1, kept as its `top_k` likeliest ids and their probabilities (the rest of
the mass is dropped: a soft target over 150k ids per position would not fit in memory).

An answer's are recorded while the target generates it (`AnswerRecorder`): the engine
captures every forward's features for a proposer that drafts nothing, and the request's
logprobs are the same top-k distributions. These are a teacher-forced forward's numbers
up to the rounding of the kernels a decode step takes, so an answer costs its generation
alone, not a second forward.

Each sample's tensors go to one safetensors file named by the sample's key, written
under a temporary name and renamed: a stopped run resumes with the files it has.
Features are kept in bfloat16, the target's own activation format under int4.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specserve.engine.sequence import Sequence
from specserve.model.decoder import Capture, Decoder, Segment
from specserve.spec.features import FeatureRun, TargetFeatures
from specserve.spec.proposer import Draft, SequenceView
from specserve.train.data import Sample
from specserve.train.objective import Batch

FORWARD_CHUNK = 128  # positions per forward: bounds the [chunk, vocab] logits
# Prompt positions a sample keeps before its first trained one: a head trains on windows
# of LoopSettings.window (512) positions, so earlier ones would share no window with an
# answer, and a long prompt (a user's recorded traffic) would fill memory with them
# (9 KB a position of EAGLE-3 features on the default target).
PROMPT_CONTEXT = 256


@dataclass(frozen=True)
class FeatureSpec:
    """Which features a method's head reads."""

    layers: tuple[int, ...] = ()  # residual streams entering these target layers, concatenated
    final: bool = False  # the last hidden state after the final norm

    def capture(self) -> Capture:
        return Capture(layers=self.layers, final=self.final)


def sample_features(target: Decoder, sample: Sample, spec: FeatureSpec, top_k: int) -> dict[str, torch.Tensor]:
    """One sample's teacher-forced forward: token_ids [T], features [T, F] bfloat16,
    top_ids [T, k] int64 and top_probs [T, k] float32 (the distribution of token p + 1)."""
    ids = torch.tensor(sample.token_ids, dtype=torch.int64, device=target.device)  # [T]
    cache = target.new_cache()
    features, top_ids, top_probs = [], [], []
    for chunk in ids.split(FORWARD_CHUNK):
        capture = spec.capture()
        logits = target(chunk, [Segment(cache, len(chunk))], capture=capture)  # [n, vocab]
        features.append((capture.layer_inputs if spec.layers else capture.final_hidden).to(torch.bfloat16).cpu())
        probs, top = logits.float().softmax(dim=-1).topk(top_k, dim=-1)  # [n, k]
        top_ids.append(top.cpu())
        top_probs.append(probs.cpu())
    cache.release()
    return sample_tensors(ids, torch.cat(features), torch.cat(top_ids), torch.cat(top_probs), sample)


def sample_tensors(
    token_ids: torch.Tensor,  # [T] int64
    features: torch.Tensor,  # [T, F]
    top_ids: torch.Tensor,  # [T, k] int64
    top_probs: torch.Tensor,  # [T, k] float32
    sample: Sample,
) -> dict[str, torch.Tensor]:
    """What a sample's file holds (`FeatureSet.load` reads it), on the CPU, features in
    bfloat16: its positions from PROMPT_CONTEXT before the one that predicts its first
    trained token (the features were read with the whole text before them)."""
    start = max(0, sample.first_trained - 1 - PROMPT_CONTEXT)
    return {
        "token_ids": token_ids[start:].cpu(),
        "features": features[start:].to(torch.bfloat16).cpu(),
        "top_ids": top_ids[start:].cpu(),
        "top_probs": top_probs[start:].cpu(),
        "first_trained": torch.tensor([sample.first_trained - start]),
        "held_out": torch.tensor([sample.held_out]),
    }


def sample_path(folder: Path, key: str) -> Path:
    return folder / f"{key}.safetensors"


def save_sample(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Written under a temporary name and renamed: `path` exists only complete."""
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial))
    partial.rename(path)


class AnswerRecorder:
    """A proposer that drafts nothing (Proposer protocol, in an Engine with k = 0): it
    keeps each sequence's features as the target computes them, so that a finished answer
    with its logprobs (`top_k` of them a token) is a sample's file in `folder` (`save`)."""

    def __init__(self, spec: FeatureSpec, top_k: int, folder: Path):
        assert not (spec.layers and spec.final), "TargetFeatures reads one kind of feature"
        self.top_k = top_k
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.features = TargetFeatures(spec.layers)
        self.last_catch_up = self.last_tokens_read = 0
        self.freed: dict[int, FeatureRun] = {}  # runs of sequences the engine freed, until saved

    def backlog(self, seq: SequenceView) -> int:
        return 0

    def propose(
        self, seqs: list[SequenceView], num_tokens: list[int], least_chances: list[float] | None = None
    ) -> list[Draft]:
        return [Draft.of([]) for _ in seqs]

    def observe(self, seqs: list[SequenceView], num_accepted: list[int]) -> None:
        pass

    def finished(self, seq: SequenceView) -> None:
        pass

    def free(self, seq_id: int) -> None:
        run = self.features.runs.pop(seq_id, None)
        if run is not None:
            self.freed[seq_id] = run

    def discard(self, seq_id: int) -> None:
        """Forget a finished sequence that is no sample (a written instruction)."""
        self.freed.pop(seq_id, None)

    def save(self, seq: Sequence, key: str, held_out: bool) -> bool:
        """Write a finished answer's sample (as `sample_features` would) as `key`; False
        where its features do not cover every fed position (nothing written)."""
        run = self.freed.pop(seq.seq_id, None)
        fed = len(seq.token_ids) - 1  # the last token was never fed
        whole = run is not None and run.origin == run.start == 0 and run.end == fed
        if not whole or len(seq.logprobs) != seq.num_output_tokens:
            return False
        features = run.take(fed)  # [T - 1, F]
        top_ids = torch.zeros(len(seq.token_ids), self.top_k, dtype=torch.int64)  # [T, k]
        top_probs = torch.zeros(len(seq.token_ids), self.top_k)  # [T, k]
        # Output token j is predicted at position P - 1 + j; the prompt's other positions and
        # the last one are never trained (FeatureSet.trained), so they stay zero.
        first = seq.num_prompt_tokens - 1
        for j, logprob in enumerate(seq.logprobs):
            ids, values = zip(*logprob.top)
            top_ids[first + j] = torch.tensor(ids)
            top_probs[first + j] = torch.tensor(values).exp()
        tensors = sample_tensors(
            torch.tensor(seq.token_ids, dtype=torch.int64),
            torch.cat([features, features.new_zeros(1, features.shape[1])]),
            top_ids,
            top_probs,
            Sample(seq.token_ids, seq.num_prompt_tokens, held_out),
        )
        save_sample(tensors, sample_path(self.folder, key))
        return True


def compute_features(
    target: Decoder,
    samples: dict[str, Sample],  # by key
    spec: FeatureSpec,
    top_k: int,
    folder: Path,
    deadline: float,
    on_sample: Callable[[int], None] = lambda num_tokens: None,
) -> list[str]:
    """The keys whose features are in `folder`, computing the missing ones in order until
    the deadline (`time.monotonic()`) passes."""
    folder.mkdir(parents=True, exist_ok=True)
    done = []
    for key, sample in samples.items():
        path = sample_path(folder, key)
        if not path.is_file():
            if time.monotonic() >= deadline:
                break
            save_sample(sample_features(target, sample, spec, top_k), path)
            on_sample(len(sample.token_ids))
        done.append(key)
    return done


@dataclass
class FeatureSet:
    """Every position of the samples, flattened; windows cut them into training rows."""

    token_ids: torch.Tensor  # [N] int64
    features: torch.Tensor  # [N, F] bfloat16
    top_ids: torch.Tensor  # [N, k] int64: the target's likeliest ids for the next token
    top_probs: torch.Tensor  # [N, k] float32
    trained: torch.Tensor  # [N] bool: the token after p is trained (p + 1 in the sample's answer, not past its end)
    samples: list[tuple[int, int, bool]]  # (start, end, held_out) of each sample in the flat rows

    @classmethod
    def load(cls, folder: Path, keys: list[str]) -> FeatureSet:
        """The samples' files in order, read one at a time into tensors allocated once:
        the host holds the data and one sample, not the data twice (a GPU's answers can
        take tens of GB)."""
        paths = [str(sample_path(folder, key)) for key in keys]
        if not paths:
            raise ValueError("a feature set needs at least one sample")
        lengths = []
        for path in paths:
            with safe_open(path, framework="pt") as part:
                lengths.append(part.get_slice("token_ids").get_shape()[0])
        with safe_open(paths[0], framework="pt") as part:  # every sample's rows have one width
            shapes = {name: part.get_slice(name).get_shape()[1:] for name in ("features", "top_ids", "top_probs")}
        total = sum(lengths)
        data = cls(
            token_ids=torch.empty(total, dtype=torch.int64),
            features=torch.empty(total, *shapes["features"], dtype=torch.bfloat16),
            top_ids=torch.empty(total, *shapes["top_ids"], dtype=torch.int64),
            top_probs=torch.empty(total, *shapes["top_probs"], dtype=torch.float32),
            trained=torch.empty(total, dtype=torch.bool),
            samples=[],
        )
        start = 0
        for path, length in zip(paths, lengths):
            part = load_file(path)
            rows = slice(start, start + length)
            for name in ("token_ids", "features", "top_ids", "top_probs"):
                getattr(data, name)[rows] = part[name]
            positions = torch.arange(length)
            data.trained[rows] = (positions + 1 >= int(part["first_trained"])) & (positions + 1 < length)
            data.samples.append((start, start + length, bool(part["held_out"])))
            start += length
        return data

    def windows(self, held_out: bool, length: int) -> list[tuple[int, int]]:
        """[start, end) row ranges of at most `length` positions covering the samples of
        one split, each inside one sample."""
        return [
            (s, min(s + length, end))
            for start, end, out in self.samples
            if out == held_out
            for s in range(start, end, length)
            if min(s + length, end) - s > 1
        ]

    def num_trained(self, held_out: bool) -> int:
        return sum(int(self.trained[start:end].sum()) for start, end, out in self.samples if out == held_out)

    def token_counts(self, vocab_size: int) -> torch.Tensor:  # [vocab] int64
        """How often each id is a trained training token: what a draft vocabulary keeps."""
        rows = torch.cat([torch.arange(start, end) for start, end, out in self.samples if not out])
        next_tokens = self.token_ids[rows[self.trained[rows]] + 1]
        return torch.bincount(next_tokens, minlength=vocab_size)

    def batch(self, windows: list[tuple[int, int]]) -> Batch:
        """Windows [start, end) as one batch, padded on the right."""
        length = max(end - start for start, end in windows)

        def padded(x: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [B, length, ...]
            out = x.new_zeros(len(windows), length, *x.shape[1:])
            for row, (start, end) in enumerate(windows):
                out[row, : end - start] = x[start:end]
            return out

        return Batch(
            padded(self.token_ids),
            padded(self.features),
            padded(self.top_ids),
            padded(self.top_probs),
            padded(self.trained),
        )
