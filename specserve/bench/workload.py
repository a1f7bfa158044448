"""The requests of one test case, built before the timed loop as LLMPerf builds them:
which prompt each request sends, its `max_tokens`, and its prompt length counted with
the tokenizer when there is one.

Invariants: the same seed, test case and flags give the same requests, whatever other
test cases run beside it. Lengths are drawn from normal(mean, stddev) and drawn again
until they are at least 1 (LLMPerf's truncated normal). Prompts are sent in shuffled
rounds, so every prompt of a suite is sent equally often, give or take one. With
`--shared-prefix-tokens N`, every prompt of the run starts with the same N tokens of
sonnet lines (a long system prompt, a shared document), which is what prefix caching
is measured with.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.bench import suites
from specserve.errors import ConfigError
from specserve.tokenizer import Tokenizer

SONNET_INSTRUCTION = (
    "Randomly stream lines from the following text with {num_output_tokens} output tokens. "
    "Don't generate eos tokens:\n\n"
)


@dataclass(frozen=True)
class Prompt:
    name: str
    text: str | None = None  # a raw prompt, or under the chat API the one user message
    messages: tuple[dict[str, str], ...] | None = None
    max_tokens: int | None = None  # overrides the sampled output length
    suffix: str | None = None  # the completions API's: the text after the gap the answer fills


@dataclass(frozen=True)
class Workload:
    """A test case: a name and its prompts (none for `sonnet`: each request builds its own)."""

    name: str
    prompts: tuple[Prompt, ...]


@dataclass(frozen=True)
class Lengths:
    """Token-length distributions: input lengths shape only the sonnet prompt; the
    shared prefix goes before every prompt, on top of its own length."""

    mean_input_tokens: int
    stddev_input_tokens: int
    mean_output_tokens: int
    stddev_output_tokens: int
    shared_prefix_tokens: int = 0


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_name: str
    body: dict[str, Any]  # the JSON body, less the streaming fields the client adds
    num_input_tokens: int | None  # the prompt counted with the tokenizer; None without one


def builtin_workload(name: str) -> Workload:
    if name == suites.SONNET:
        return Workload(name, ())
    try:
        prompts = suites.prompts_for_test_case(name)
    except ValueError as e:
        raise ConfigError(f"{e}; or pass --prompts-file") from None
    return Workload(name, tuple(Prompt(prompt_name, text=text) for prompt_name, text in prompts.items()))


def load_prompts_file(path: str | Path, api: str) -> Workload:
    """A JSONL file of {"prompt": str} (and "suffix", the completions API's fill in the
    middle) or {"messages": [...]}, with optional "max_tokens" and "name"; the test case
    is named after the file."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read --prompts-file {path}: {e}") from None
    prompts = [_prompt_of_line(line, path, number, api) for number, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompts-file {path} holds no prompts; write one JSON object per line")
    return Workload(path.stem, tuple(prompts))


def _prompt_of_line(line: str, path: Path, number: int, api: str) -> Prompt:
    where = f"{path}:{number}"
    fix = 'each line must be {"prompt": "..."} or {"messages": [{"role": ..., "content": ...}]}'
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not JSON ({e}); {fix}") from None
    if not isinstance(entry, dict) or ("prompt" in entry) == ("messages" in entry):
        raise ConfigError(f"{where}: {fix}")
    max_tokens = entry.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ConfigError(f"{where}: max_tokens must be a positive integer, got {max_tokens!r}")
    name = str(entry.get("name", number))
    suffix = entry.get("suffix")
    if suffix is not None and not (isinstance(suffix, str) and "prompt" in entry):
        raise ConfigError(f'{where}: "suffix" must be a text beside "prompt" (the code after the gap)')
    if suffix is not None and api != "completions":
        raise ConfigError(f"{where} has a suffix, which only the completions API sends; pass --api completions")
    if "prompt" in entry:
        if not isinstance(entry["prompt"], str):
            raise ConfigError(f"{where}: {fix}")
        return Prompt(name, text=entry["prompt"], max_tokens=max_tokens, suffix=suffix)
    messages = entry["messages"]
    if not (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise ConfigError(f"{where}: {fix}")
    if api == "completions":
        raise ConfigError(f"{where} has messages, which the completions API cannot send; drop --api completions")
    return Prompt(name, messages=tuple(messages), max_tokens=max_tokens)


def sample_length(rng: random.Random, mean: int, stddev: int) -> int:
    """A token count from normal(mean, stddev), drawn again until it is at least 1."""
    while True:
        length = round(rng.gauss(mean, stddev))
        if length >= 1:
            return length


def build_requests(
    workload: Workload,
    num_requests: int,
    lengths: Lengths,
    *,
    api: str,
    model: str,
    sampling_params: dict[str, Any],
    tokenizer: Tokenizer | None,
    seed: int,
) -> list[BenchRequest]:
    rng = random.Random(f"{seed}:{workload.name}")
    if not workload.prompts and tokenizer is None:
        raise ConfigError(
            "the sonnet test case counts prompt tokens with a tokenizer; pass --tokenizer "
            "(a catalogue name or a folder with tokenizer.json)"
        )
    order = _prompt_order(workload.prompts, num_requests, rng)
    prefix = shared_prefix(lengths.shared_prefix_tokens, tokenizer, seed)
    requests = []
    for index in range(num_requests):
        num_output_tokens = sample_length(rng, lengths.mean_output_tokens, lengths.stddev_output_tokens)
        if workload.prompts:
            prompt = order[index]
        else:
            num_input_tokens = sample_length(rng, lengths.mean_input_tokens, lengths.stddev_input_tokens)
            prompt = Prompt(suites.SONNET, text=sonnet_prompt(rng, num_input_tokens, num_output_tokens, tokenizer))
        body = {
            "model": model,
            **_prompt_fields(prompt, api, prefix),
            "max_tokens": prompt.max_tokens or num_output_tokens,
            **sampling_params,
        }
        count = None if tokenizer is None else count_prompt_tokens(tokenizer, body)
        requests.append(BenchRequest(index, prompt.name, body, count))
    return requests


# A warm-up request's prompt: text no test case sends, so that it leaves no prefix of
# theirs in a server's cache.
WARMUP_INSTRUCTION = "Continue this poem for a few lines:\n\n"
WARMUP_LINES = 6
# And its length at most: enough to run every kind of step (a prompt, decoding, drafting).
WARMUP_MAX_TOKENS = 32


def warmup_request(first: BenchRequest, api: str) -> BenchRequest:
    """A request like a test case's first (its model and sampling parameters) with a
    prompt of its own and at most WARMUP_MAX_TOKENS tokens, to send before measuring."""
    text = WARMUP_INSTRUCTION + "".join(suites.sonnet_lines()[:WARMUP_LINES])
    fields = _prompt_fields(Prompt("warm-up", text=text), api)
    body = {**first.body, **fields, "max_tokens": min(first.body["max_tokens"], WARMUP_MAX_TOKENS)}
    return BenchRequest(-1, "warm-up", body, None)


def _prompt_order(prompts: tuple[Prompt, ...], num_requests: int, rng: random.Random) -> list[Prompt]:
    order: list[Prompt] = []
    while prompts and len(order) < num_requests:
        round_ = list(prompts)
        rng.shuffle(round_)
        order += round_
    return order[:num_requests]


def shared_prefix(num_tokens: int, tokenizer: Tokenizer | None, seed: int) -> str:
    """The text of `num_tokens` tokens every prompt starts with ('' for 0); one per seed,
    whatever the test case, so a server's cache may carry it from one test case to the next."""
    if num_tokens == 0:
        return ""
    if tokenizer is None:
        raise ConfigError(
            "--shared-prefix-tokens counts its tokens with a tokenizer; pass --tokenizer "
            "(a catalogue name or a folder with tokenizer.json)"
        )
    return sonnet_text(random.Random(f"{seed}:shared-prefix"), num_tokens, tokenizer)


def _prompt_fields(prompt: Prompt, api: str, prefix: str = "") -> dict[str, Any]:
    """The request's prompt (or messages), the shared prefix put before the first text."""
    if api == "completions":
        return {"prompt": prefix + prompt.text, **({"suffix": prompt.suffix} if prompt.suffix is not None else {})}
    messages = list(prompt.messages or ({"role": "user", "content": prompt.text},))
    messages[0] = {**messages[0], "content": prefix + messages[0]["content"]}
    return {"messages": messages}


def count_prompt_tokens(tokenizer: Tokenizer, body: dict[str, Any]) -> int:
    """The prompt's tokens as the server sees them: the chat template applied where there is one."""
    if "suffix" in body and tokenizer.fim_ids is not None:
        return len(tokenizer.encode_infill(body["prompt"], body["suffix"]))
    if "prompt" in body:
        return len(tokenizer.encode(body["prompt"]))
    if tokenizer.chat_template:
        return len(tokenizer.encode_chat(body["messages"]))
    return len(tokenizer.encode("\n".join(m["content"] for m in body["messages"])))


def _count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def sonnet_prompt(rng: random.Random, num_input_tokens: int, num_output_tokens: int, tokenizer: Tokenizer) -> str:
    """LLMPerf's prompt: the instruction, then sonnet lines until the text holds
    `num_input_tokens` tokens (never fewer than the instruction's own)."""
    prompt = SONNET_INSTRUCTION.format(num_output_tokens=num_output_tokens)
    return prompt + sonnet_text(rng, num_input_tokens - _count(tokenizer, prompt), tokenizer)


def sonnet_text(rng: random.Random, num_tokens: int, tokenizer: Tokenizer) -> str:
    """Shuffled sonnet lines until the text holds `num_tokens` tokens (none for <= 0); the
    last line is cut at a token boundary."""
    text, remaining = "", num_tokens
    lines = suites.sonnet_lines()
    rng.shuffle(lines)
    while remaining > 0:
        for line in lines:
            size = _count(tokenizer, line)
            if size > remaining:
                text += tokenizer.decode(tokenizer.encode(line, add_special_tokens=False)[:remaining])
                remaining = 0
                break
            text += line
            remaining -= size
    return text
