"""Training text for heads, self-distilled: the target's own answers to bundled instructions,
and teacher-forced standard-library source.

- `instructions.jsonl` (beside this file): {"kind", "prompt"} lines written for training
  heads; none is a benchmark prompt (bench/suites.py), which a test keeps true. A user's
  own file (`--instructions`; prompts, conversations or plain prompts, instructions.py)
  takes their place: a head for that workload.
- Answers: the target answers the instructions in a seeded order (through its chat
  template, a plain prompt without) at a sampling temperature (SpecForge regenerates its data at 0.8), batched by
  the Engine, in rounds: every instruction once, then again with other seeds, as far as
  the budget goes. Round r of instruction i is seeded `seed + r * len(instructions) + i`,
  so its answer is the same whatever ran beside it and whenever it ran. Each finished
  answer is appended to a JSON-lines file at once: a run stopped by its budget or
  interrupted resumes with the answers it has.
- Written instructions: once every bundled instruction's rounds are asked, the target
  writes new instructions, Self-Instruct style: shown three bundled instructions of one
  kind (never a held-out one, nor a plain prompt), it writes one more of that kind, and answers it.
  Attempt j's examples and seeds derive from `seed` and j alone. A written instruction
  that runs past `WRITE_TOKENS`, repeats one already known or overlaps a benchmark
  prompt (bench/suites.py) is dropped. Written instructions are trained on, never held
  out, so the held-out measurement reads the bundled ones whatever the budget.
- Standard-library text: the running Python's standard-library .py files, cut into
  pieces; free to read, and code is what the default target writes.

A `Sample` is token ids and the first position whose token is trained: the answer's
first token (the prompt is context only), 0 for plain text. Every `HOLDOUT_EVERY`-th
instruction of the seeded order is held out to measure the head, every round of its
answers, never trained on.
"""

from __future__ import annotations

import json
import logging
import random
import re
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from specserve.bench.suites import SUITES
from specserve.config import DEFAULT_PREFILL_CHUNK_SIZE
from specserve.engine.engine import Engine
from specserve.model.decoder import Decoder
from specserve.sampling import SamplingParams
from specserve.tokenizer import Tokenizer
from specserve.train.instructions import Instruction, load_instructions

if TYPE_CHECKING:
    from specserve.train.features import AnswerRecorder

log = logging.getLogger("specserve")

HOLDOUT_EVERY = 10  # instructions 0, 10, 20, ... of the seeded order
WRITE_TOKENS = 128  # a written instruction longer than this is dropped
WRITE_EXAMPLES = 3  # bundled instructions shown to the target as it writes one
WRITE_TEMPERATURE = 1.0  # the variety Self-Instruct and Magpie sample their instructions at


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
    written: int | None = 0  # instructions the target is asked to write after the rounds; None: no limit
    instructions: str | None = None  # a user's file (`load_instructions`); None: the bundled ones


def benchmark_overlaps(instructions: list[Instruction]) -> int:
    """How many instructions hold a benchmark suite's prompt (or lie within one) in any of their texts."""
    return sum(any(overlaps_benchmark(t) for t in map(normalised, i.texts()) if t) for i in instructions)


def seeded_order(count: int, seed: int) -> list[int]:
    """A permutation of range(count): a budget that stops early still covers every kind."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()


def answer_key(index: int, round: int = 0) -> str:
    """The sample key (and features file name) of instruction `index`'s answer in a round."""
    return f"answer-{index:04d}" if round == 0 else f"answer-{index:04d}-{round}"


def written_key(attempt: int) -> str:
    """The sample key of the answer to the instruction written at `attempt`."""
    return f"written-{attempt:06d}"


def written_seed(seed: int, attempt: int) -> int:
    """The seed attempt j writes from; its answer's is the next. Past the seeds of any
    bundled instruction's rounds."""
    return seed + (1 << 24) + 2 * attempt


def record_key(record: dict) -> str:
    """The sample key of an answers.jsonl record."""
    if "written" in record:
        return written_key(record["written"])
    return answer_key(record["index"], record.get("round", 0))


def read_answers(answers_file: Path) -> dict[str, dict]:
    """Answers written so far, by sample key; a line cut short by a kill is dropped."""
    answers = {}
    if answers_file.is_file():
        for line in answers_file.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            answers[record_key(record)] = record
    return answers


def normalised(text: str) -> str:
    """Lower-case words and digits, one space apart: what two prompts share when they match."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


BENCHMARK_PROMPTS = tuple(normalised(prompt) for suite in SUITES.values() for prompt in suite.values())


def overlaps_benchmark(text: str) -> bool:
    """Whether a `normalised` prompt holds a benchmark prompt or lies within one."""
    return any(prompt in text or text in prompt for prompt in BENCHMARK_PROMPTS)


class InstructionWriter:
    """The target's written instructions: attempt j's prompt (examples of one kind, its
    kind the j-th in turn, drawn from `shown` by a generator seeded with seed and j), and
    which written texts are kept."""

    def __init__(
        self, tokenizer: Tokenizer, instructions: list[Instruction], shown: list[int], seed: int, limit: int | None
    ):
        self.tokenizer, self.seed, self.limit = tokenizer, seed, limit
        self.by_kind: dict[str, list[str]] = {}
        for i in sorted(shown):  # a plain prompt is no request to an assistant: never shown
            if instructions[i].templated:
                self.by_kind.setdefault(instructions[i].kind, []).append(instructions[i].prompt)
        self.kinds = sorted(k for k, prompts in self.by_kind.items() if len(prompts) >= WRITE_EXAMPLES)
        self.known = {normalised(i.prompt) for i in instructions}
        self.next_attempt = 0

    def remember(self, instruction: str) -> None:
        self.known.add(normalised(instruction))

    def take_attempt(self, done: dict[str, dict]) -> int | None:
        """The next attempt with no answer in `done`; None past the limit or with no kind to show."""
        while self.kinds and (self.limit is None or self.next_attempt < self.limit):
            attempt = self.next_attempt
            self.next_attempt += 1
            if written_key(attempt) not in done:
                return attempt
        return None

    def prompt_ids(self, attempt: int) -> list[int]:
        kind = self.kinds[attempt % len(self.kinds)]
        return self.tokenizer.encode_chat(
            writing_request(random.Random(f"{self.seed}-{attempt}").sample(self.by_kind[kind], WRITE_EXAMPLES))
        )

    def kept(self, output_ids: list[int], finish_reason: str) -> str | None:
        """The written instruction, cleaned, or None where it is dropped."""
        text = re.sub(r"^\s*(?:\d+[.)]|[-*])\s+", "", self.tokenizer.decode(output_ids).strip()).strip()
        if len(text) > 1 and text[0] == text[-1] and text[0] in "\"'`":
            text = text[1:-1].strip()
        key = normalised(text)
        if finish_reason != "stop" or not key or key in self.known or overlaps_benchmark(key):
            return None
        if len(self.tokenizer.encode(text, add_special_tokens=False)) > WRITE_TOKENS:
            return None
        self.known.add(key)
        return text


def writing_request(examples: list[str]) -> list[dict[str, str]]:
    """The messages asking the target for one more instruction like `examples`."""
    listed = "\n\n".join(f"{n}. {example}" for n, example in enumerate(examples, 1))
    return [
        {
            "role": "user",
            "content": f"Here are {len(examples)} requests that users sent to an AI assistant:\n\n{listed}\n\n"
            "Write one new request of the same kind on a different subject. Reply with the request alone.",
        }
    ]


def longest_sequence(tokenizer: Tokenizer, answer_tokens: int, instructions_file: str | None = None) -> int:
    """The most positions a sequence of `answer_instructions` holds: an instruction's
    prompt (bundled, the user's or written) and its answer, or a writing request and what
    it writes."""
    instructions = load_instructions(instructions_file)
    given = max(len(i.prompt_ids(tokenizer)) for i in instructions)
    written = len(Instruction("written", "").prompt_ids(tokenizer)) + WRITE_TOKENS
    longest = sorted((i.prompt for i in instructions if i.templated), key=len)[-WRITE_EXAMPLES:]
    writing = len(tokenizer.encode_chat(writing_request(longest))) + WRITE_EXAMPLES  # a token to join each
    return max(max(given, written) + answer_tokens, writing + WRITE_TOKENS)


def answer_instructions(
    target: Decoder,
    tokenizer: Tokenizer,
    settings: AnswerSettings,
    answers_file: Path,
    deadline: float,  # time.monotonic() by which to stop asking
    on_answer: Callable[[int], None] = lambda num_tokens: None,
    recorder: AnswerRecorder | None = None,
) -> tuple[list[Sample], AnswerStats]:
    """The target's answers (round by round, each in the seeded order, then to the
    instructions it writes), generating those not yet in `answers_file` until every one
    wanted is there or the deadline passes. With a `recorder`, each new answer's sample is
    saved (as its key) as it is written."""
    instructions = load_instructions(settings.instructions)
    order = seeded_order(len(instructions), settings.seed)[: settings.max_answers]
    held_out = {i: position % HOLDOUT_EVERY == 0 for position, i in enumerate(order)}
    wanted = [answer_key(i, r) for r in range(settings.rounds) for i in order]
    answers = read_answers(answers_file)
    shown = [i for i in range(len(instructions)) if not held_out.get(i)]  # as examples: any but held out
    writer = InstructionWriter(tokenizer, instructions, shown, settings.seed, settings.written)
    for record in answers.values():
        if "written" in record:
            writer.remember(record["instruction"])
    engine = Engine(
        target,
        eos_token_ids=tokenizer.eos_token_ids,
        max_num_seqs=settings.max_num_seqs,
        prefill_chunk_size=DEFAULT_PREFILL_CHUNK_SIZE,  # no client waits on a token: the fewest steps
        proposer=recorder,
    )
    top_k = None if recorder is None else recorder.top_k
    asked: dict[int, dict] = {}  # seq_id -> the record its answer starts, or {"attempt": j} writing one

    too_long: set[Instruction] = set()  # prompts that leave the target's context no room for an answer

    def ask(instruction: Instruction, seed: int, record: dict) -> None:
        prompt_ids = instruction.prompt_ids(tokenizer)
        room = engine.max_model_len - len(prompt_ids)  # a recorded prompt may come near the context's end
        if room < 1:
            too_long.add(instruction)
            return
        max_tokens = min(settings.max_tokens, room)
        params = SamplingParams(max_tokens, temperature=settings.temperature, seed=seed, logprobs=top_k)
        asked[engine.add_request(prompt_ids, params).seq_id] = record

    def ask_to_write(attempt: int) -> None:
        params = SamplingParams(WRITE_TOKENS, temperature=WRITE_TEMPERATURE, seed=written_seed(settings.seed, attempt))
        asked[engine.add_request(writer.prompt_ids(attempt), params).seq_id] = {"attempt": attempt}

    for r in range(settings.rounds):
        for i in order:
            if answer_key(i, r) not in answers:
                ask(instructions[i], settings.seed + r * len(instructions) + i, {"index": i, "round": r})
    answers_file.parent.mkdir(parents=True, exist_ok=True)
    stats = AnswerStats()
    started = time.monotonic()
    with open(answers_file, "a", encoding="utf-8") as out:
        while time.monotonic() < deadline:
            # Writing starts as the bundled instructions' queue runs short, and keeps the engine fed.
            while len(engine.waiting) < settings.max_num_seqs:
                attempt = writer.take_attempt(answers)
                if attempt is None:
                    break
                ask_to_write(attempt)
            if not engine.has_unfinished():
                break
            stats.steps += 1
            for seq in engine.step():
                if not (seq.finished and seq.finish_reason in ("stop", "length")):
                    continue
                record = asked.pop(seq.seq_id)
                if "attempt" in record:
                    if recorder is not None:
                        recorder.discard(seq.seq_id)
                    attempt = record["attempt"]
                    written = writer.kept(seq.output_ids, seq.finish_reason)
                    if written is not None:
                        answer = {"written": attempt, "instruction": written}
                        ask(Instruction("written", written), written_seed(settings.seed, attempt) + 1, answer)
                    continue
                key = record_key(record)
                if recorder is not None:  # before the answer's line: a resumed run reads it again if need be
                    recorder.save(seq, key, held_out.get(record.get("index"), False))
                record = record | {"prompt_ids": seq.token_ids[: seq.num_prompt_tokens], "answer_ids": seq.output_ids}
                out.write(json.dumps(record) + "\n")
                out.flush()
                answers[key] = record
                on_answer(seq.num_output_tokens)
    stats.seconds = time.monotonic() - started
    if too_long:
        log.warning(
            "%d instructions fill the target's context of %d tokens, with no room for an answer: not answered",
            len(too_long),
            engine.max_model_len,
        )
    for seq_id in list(engine.running) + [s.seq_id for s in engine.waiting]:
        engine.finish(seq_id)  # unfinished at the deadline: asked again by a resumed run
    written = sorted(key for key, record in answers.items() if "written" in record)
    stats.keys = [key for key in wanted if key in answers] + written
    samples = [
        Sample(
            answers[key]["prompt_ids"] + answers[key]["answer_ids"],
            len(answers[key]["prompt_ids"]),
            "written" not in answers[key] and held_out[answers[key]["index"]],
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
