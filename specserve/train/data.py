"""Training text for heads, self-distilled: the target's own answers to bundled instructions,
and teacher-forced standard-library source.

- `instructions.jsonl` (beside this file): {"kind", "prompt"} lines written for training
  heads; none is a benchmark prompt (bench/suites.py), which a test keeps true.
- Answers: the target answers the instructions in a seeded order through its chat
  template at a sampling temperature (SpecForge regenerates its data at 0.8), batched by
  the Engine, in rounds: every instruction once, then again with other seeds, as far as
  the budget goes. Round r of instruction i is seeded `seed + r * len(instructions) + i`,
  so its answer is the same whatever ran beside it and whenever it ran. Each finished
  answer is appended to a JSON-lines file at once: a run stopped by its budget or
  interrupted resumes with the answers it has.
- Standard-library text: the running Python's standard-library .py files, cut into
  pieces; free to read, and code is what the default target writes.

A `Sample` is token ids and the first position whose token is trained: the answer's
first token (the prompt is context only), 0 for plain text. Every `HOLDOUT_EVERY`-th
instruction of the seeded order is held out to measure the head, every round of its
answers, never trained on.
"""

from __future__ import annotations

import json
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from specserve.config import DEFAULT_PREFILL_CHUNK_SIZE
from specserve.engine.engine import Engine
from specserve.model.decoder import Decoder
from specserve.sampling import SamplingParams
from specserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from specserve.train.features import AnswerRecorder

INSTRUCTIONS_PATH = Path(__file__).with_name("instructions.jsonl")
HOLDOUT_EVERY = 10  # instructions 0, 10, 20, ... of the seeded order


@dataclass(frozen=True)
class Instruction:
    kind: str  # code, structured, explanation, chat, math, rewriting
    prompt: str


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]
    first_trained: int  # tokens before this position are context only
    held_out: bool = False


@dataclass
class AnswerStats:
    keys: list[str] = field(default_factory=list)  # the sample key of each answer returned
    steps: int = 0  # engine steps this run
    seconds: float = 0.0

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / max(self.steps, 1)


@dataclass(frozen=True)
class AnswerSettings:
    max_answers: int | None  # instructions; None: every one
    max_tokens: int  # per answer
    temperature: float
    max_num_seqs: int
    seed: int
    rounds: int = 1  # answers per instruction at most, each from its own seed


def load_instructions() -> list[Instruction]:
    lines = INSTRUCTIONS_PATH.read_text(encoding="utf-8").splitlines()
    return [Instruction(**json.loads(line)) for line in lines if line.strip()]


def chat(instruction: Instruction) -> list[dict[str, str]]:
    """The messages the target answers for an instruction."""
    return [{"role": "user", "content": instruction.prompt}]


def seeded_order(count: int, seed: int) -> list[int]:
    """A permutation of range(count): a budget that stops early still covers every kind."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()


def answer_key(index: int, round: int = 0) -> str:
    """The sample key (and features file name) of instruction `index`'s answer in a round."""
    return f"answer-{index:04d}" if round == 0 else f"answer-{index:04d}-{round}"


def read_answers(answers_file: Path) -> dict[str, dict]:
    """Answers written so far, by sample key; a line cut short by a kill is dropped."""
    answers = {}
    if answers_file.is_file():
        for line in answers_file.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            answers[answer_key(record["index"], record.get("round", 0))] = record
    return answers


def answer_instructions(
    target: Decoder,
    tokenizer: Tokenizer,
    settings: AnswerSettings,
    answers_file: Path,
    deadline: float,  # time.monotonic() by which to stop asking
    on_answer: Callable[[int], None] = lambda num_tokens: None,
    recorder: AnswerRecorder | None = None,
) -> tuple[list[Sample], AnswerStats]:
    """The target's answers (round by round, each in the seeded order), generating those
    not yet in `answers_file` until every one wanted is there or the deadline passes.
    With a `recorder`, each new answer's sample is saved (as `answer_key`) as it is
    written."""
    instructions = load_instructions()
    order = seeded_order(len(instructions), settings.seed)[: settings.max_answers]
    held_out = {i: position % HOLDOUT_EVERY == 0 for position, i in enumerate(order)}
    wanted = [(r, i) for r in range(settings.rounds) for i in order]
    answers = read_answers(answers_file)
    engine = Engine(
        target,
        eos_token_ids=tokenizer.eos_token_ids,
        max_num_seqs=settings.max_num_seqs,
        prefill_chunk_size=DEFAULT_PREFILL_CHUNK_SIZE,  # no client waits on a token: the fewest steps
        proposer=recorder,
    )
    asked = {}  # seq_id -> (round, instruction index)
    for r, i in wanted:
        if answer_key(i, r) not in answers:
            prompt_ids = tokenizer.encode_chat(chat(instructions[i]))
            params = SamplingParams(
                max_tokens=settings.max_tokens,
                temperature=settings.temperature,
                seed=settings.seed + r * len(instructions) + i,
                logprobs=None if recorder is None else recorder.top_k,
            )
            asked[engine.add_request(prompt_ids, params).seq_id] = (r, i)
    answers_file.parent.mkdir(parents=True, exist_ok=True)
    stats = AnswerStats()
    started = time.monotonic()
    with open(answers_file, "a", encoding="utf-8") as out:
        while engine.has_unfinished() and time.monotonic() < deadline:
            stats.steps += 1
            for seq in engine.step():
                if seq.finished and seq.finish_reason in ("stop", "length"):
                    r, i = asked[seq.seq_id]
                    key = answer_key(i, r)
                    if recorder is not None:  # before the answer's line: a resumed run reads it again if need be
                        recorder.save(seq, key, held_out[i])
                    record = {
                        "index": i,
                        "round": r,
                        "prompt_ids": seq.token_ids[: seq.num_prompt_tokens],
                        "answer_ids": seq.output_ids,
                    }
                    out.write(json.dumps(record) + "\n")
                    out.flush()
                    answers[key] = record
                    on_answer(seq.num_output_tokens)
    stats.seconds = time.monotonic() - started
    for seq_id in list(engine.running) + [s.seq_id for s in engine.waiting]:
        engine.finish(seq_id)  # unfinished at the deadline: asked again by a resumed run
    stats.keys = [answer_key(i, r) for r, i in wanted if answer_key(i, r) in answers]
    samples = [
        Sample(
            answers[key]["prompt_ids"] + answers[key]["answer_ids"],
            len(answers[key]["prompt_ids"]),
            held_out[answers[key]["index"]],
        )
        for key in stats.keys
    ]
    return samples, stats


STDLIB_SKIPPED = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo"}
STDLIB_PIECES_PER_FILE = 4  # pieces of one file at most: the text spans many modules


def stdlib_files() -> list[Path]:
    """The running Python's standard-library modules, tests and bundled apps left out, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(f for f in root.rglob("*.py") if not STDLIB_SKIPPED & set(f.relative_to(root).parts[:-1]))


def stdlib_samples(tokenizer: Tokenizer, num_tokens: int, sample_tokens: int, seed: int) -> list[Sample]:
    """About `num_tokens` tokens of standard-library source, in pieces of `sample_tokens`
    (at most `STDLIB_PIECES_PER_FILE` from the start of each file), from files in a seeded
    order (the same on every run of one Python)."""
    files = stdlib_files()
    samples: list[Sample] = []
    total = 0
    for i in seeded_order(len(files), seed):
        if total >= num_tokens:
            break
        try:
            text = files[i].read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        kept = min(num_tokens - total, STDLIB_PIECES_PER_FILE * sample_tokens)
        ids = tokenizer.encode(text, add_special_tokens=False)[:kept]
        for start in range(0, len(ids) - 1, sample_tokens):
            piece = ids[start : start + sample_tokens]
            if len(piece) > 1:
                samples.append(Sample(piece, 0))
                total += len(piece)
    return samples
