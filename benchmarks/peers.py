"""Decode speed against the peers, side by side in one run, and the memory roofline.

For each prompt of the structured and open-ended suites (chat template, temperature 0,
the same token ids everywhere): specserve plain, with the draft model at a fixed k,
with adaptive speculation and with n-gram lookup; the `transformers` library's plain
and assisted generation on the same float32 weights; llama.cpp (llama-cpp-python) on
the GGUF file itself, plain and with its prompt-lookup decoding. Each of our modes and
each peer runs in a fresh process of its own, one after the other (this script starts
them and gathers their rows). Every system is timed the same way: TTFT is the time
to the first output token, the median of `--ttft-samples` requests for the prompt
(the timed one, and the same request stopped at its first token the other times: one
prefill of a short prompt varies by up to 30% on a shared machine, far more than the
few percent a TTFT comparison must tell); the decode rate counts the tokens after the
first over the time after the first. With `--rounds N` all of it runs N times in
turn, every other round in the reverse order, and each row gives its median round: on
a shared machine whose speed drifts over minutes, one system's rows are then not all
measured in a slow phase, nor always at the same point of a round.

Then the roofline: the weight bytes a decode step reads per model and format, the
memory bandwidth measured on the spot, and each measured plain decode as a share of
the limit they imply; on a CPU also the arithmetic peak measured on the spot, and the
ceiling of speculation it sets for each of our target formats (the most any k could
gain with every draft accepted, see `specserve.bench.roofline`). With `--dtype` or
`--quantization` other than float32, a quality section compares the format with
float32: perplexity on a fixed text and greedy agreement on the prompts.

    .venv/bin/python benchmarks/peers.py                           # default pair, every row
    .venv/bin/python benchmarks/peers.py --quantization int8 --peers transformers
    .venv/bin/python benchmarks/peers.py --modes plain,ngram --prompts count,meaning --json
    .venv/bin/python benchmarks/peers.py --quantization int4 --modes plain --peers llama.cpp --rounds 3
    .venv/bin/python benchmarks/peers.py --device cuda              # everything on a GPU, bfloat16

`--device` puts every system on the same device: ours and transformers in bfloat16 on a
GPU (float32 for transformers on a CPU, its fast path there), llama.cpp with every layer
offloaded when its build has CUDA (skipped with a message otherwise); the bandwidth is
then the GPU's.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from gguf import GGUFReader

from specserve import catalogue
from specserve.bench.gguf_file import gguf_file, gguf_format
from specserve.bench.options import comma_list
from specserve.bench.quality import common_prefix_length, fixed_text_ids, perplexity, prefix_agreement
from specserve.bench.roofline import (
    arithmetic_of,
    ceiling,
    gguf_weight_bytes_per_token,
    measure_dot_peaks,
    measure_read_bandwidth,
)
from specserve.bench.suites import SUITES, prompts_of
from specserve.bench.variants import DEFAULT_EAGLE_HEAD, DEFAULT_MEDUSA_HEAD, speculative_config
from specserve.cli import DTYPE_CHOICES, cuda_graphs_of, device_of, dtype_of
from specserve.config import DEFAULT_DRAFT_VOCAB_SIZE, DEFAULT_PROMPT_LOOKUP_FIRST, SpecConfig
from specserve.engine.build import build_engine, encode_prompt, run_one
from specserve.errors import SpecserveError
from specserve.model import huge_pages
from specserve.model.decoder import Decoder
from specserve.model.device import check_device_format
from specserve.model.footprint import multiply_adds_per_token, weight_bytes_per_token
from specserve.model.quant import QUANTIZATIONS, check_quantization
from specserve.sampling import SamplingParams
from specserve.spec.cost import draft_bytes_per_position
from specserve.spec.factory import draft_format
from specserve.spec.stats import SpecStats
from specserve.tokenizer import Tokenizer

HEAD_MODES = ("eagle3", "adaptive-eagle3", "medusa", "adaptive-medusa")  # a head on the target's features
OUR_MODES = (
    "plain",
    "draft",
    "adaptive",
    "ngram",
    "suffix",
    "draft-fused",
    "adaptive-fused",
    "draft-unfused",
    "adaptive-unfused",
    "plain-compiled",
    *HEAD_MODES,
)
# Asked for by name: draft and adaptive run as served, fused wherever the draft runs in
# our C kernels; the -fused modes insist on it (they need a quantized draft:
# --quantization or --draft-quantization), the -unfused ones turn it off; and
# plain-compiled spends a minute in torch.compile.
DEFAULT_MODES = ("plain", "draft", "adaptive", "ngram")
PEERS = ("transformers", "llama.cpp")
FLOAT32_PLAIN = "plain-float32"  # the reference the quality section compares against
WARM_UP_TOKENS = 2
SUITE_OF = {prompt: suite for suite, prompts in SUITES.items() for prompt in prompts}


# ---------------------------------------------------------------- rows, timed alike


def timed_row(
    system: str,
    mode: str,
    fmt: str,
    prompt: str,
    token_ids: list[int],
    ttft_s: float,
    e2e_s: float,
    spec: SpecStats | dict | None = None,
    k: int | None = None,
    num_first_tokens: int = 1,
    more_ttft_s: list[float] = (),
) -> dict:
    """One row; every system's decode rate is the tokens after the first arrival over the
    time after it. The first arrival is one token, except in transformers' assisted
    generation, whose first step already verifies drafts. The row's TTFT is the median
    of the timed request's (ttft_s) and more_ttft_s, the same request's first token
    timed again."""
    decode_s, decode_tokens = e2e_s - ttft_s, len(token_ids) - num_first_tokens
    spec = spec.to_dict() if isinstance(spec, SpecStats) else (spec or {})
    samples = [ttft_s, *more_ttft_s]
    return {
        "system": system,
        "mode": mode,
        "k": k,
        "format": fmt,
        "suite": SUITE_OF.get(prompt),
        "prompt": prompt,
        "num_output_tokens": len(token_ids),
        "ttft_s": statistics.median(samples),
        "ttft_samples_s": samples,
        "e2e_s": e2e_s,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 and decode_tokens > 0 else None,
        "acceptance_rate": spec.get("acceptance_rate"),
        "mean_acceptance_length": spec.get("mean_acceptance_length"),
        "token_ids": token_ids,
    }


def format_of(dtype: torch.dtype, quantization: str) -> str:
    name = str(dtype).removeprefix("torch.")
    return name if quantization == "none" else f"{quantization}/{name}"


@dataclasses.dataclass
class Report:
    fixed_text_ids: list[int]
    rows: list[dict] = dataclasses.field(default_factory=list)
    models: list[dict] = dataclasses.field(default_factory=list)  # roofline entries
    perplexities: dict[str, float] = dataclasses.field(default_factory=dict)  # format -> ppl

    def add_model(
        self,
        role: str,
        model: str,
        system: str,
        fmt: str,
        bytes_per_token: int,
        measured_mode: str | None,
        macs_per_token: int | None = None,
    ) -> None:
        """A model and format to put on the roofline; measured_mode: the rows of `system`
        whose decode rate is this model's plain decode (None: none is); macs_per_token:
        a row's multiply-adds (ours only: the ceiling of speculation)."""
        self.models.append(
            {
                "role": role,
                "model": model,
                "of_system": system,
                "format": fmt,
                "bytes_per_token": bytes_per_token,
                "measured_mode": measured_mode,
                "macs_per_token": macs_per_token,
            }
        )

    def add_perplexity(self, fmt: str, value: float) -> None:
        self.perplexities[fmt] = value

    def rows_of(self, system: str, mode: str) -> Iterator[dict]:
        return (r for r in self.rows if r["system"] == system and r["mode"] == mode)

    def keep_median_rounds(self) -> None:
        """Rows measured in several rounds -> one row each: the round with the median
        decode rate (its TTFT and end-to-end time with it), and how many rounds ran.
        Models and perplexities noted each round are kept once."""
        rounds: dict[tuple, list[dict]] = {}
        for r in self.rows:
            rounds.setdefault((r["system"], r["mode"], r["prompt"]), []).append(r)
        self.rows = []
        for same in rounds.values():
            ranked = sorted(same, key=lambda r: r["decode_tokens_per_s"] or 0.0)
            self.rows.append({**ranked[(len(ranked) - 1) // 2], "rounds": len(same)})
        self.models = list({tuple(m.items()): m for m in self.models}.values())


# ---------------------------------------------------------------- specserve


@dataclasses.dataclass(frozen=True)
class OurRun:
    mode: str
    spec: SpecConfig | None
    dtype: torch.dtype
    quantization: str
    compile: bool = False

    @property
    def format(self) -> str:
        return format_of(self.dtype, self.quantization)

    @property
    def fixed_k(self) -> int | None:
        """k of a fixed-k row; None for plain and adaptive rows."""
        return None if self.spec is None or self.spec.adaptive else self.spec.num_speculative_tokens


def our_spec(mode: str, args) -> SpecConfig | None:
    if mode in ("plain", "plain-compiled", FLOAT32_PLAIN):
        return None
    if mode in HEAD_MODES:
        heads = {"eagle_head": args.eagle_head, "medusa_head": args.medusa_head}
        return SpecConfig.parse(speculative_config(mode, args.k, **heads))
    if mode == "suffix":  # drafts as far as its matches reach (vLLM's default), not --k
        return SpecConfig.parse({"method": "suffix"})
    raw: dict[str, Any] = {"num_speculative_tokens": args.k}
    raw.update({"method": "ngram"} if mode == "ngram" else {"model": args.draft})
    if mode != "ngram" and args.draft_quantization:
        raw["quantization"] = args.draft_quantization
    if mode != "ngram":
        raw["draft_vocab_size"] = args.draft_vocab_size or None
        raw["prompt_lookup_first"] = args.prompt_lookup_first or None
    raw["adaptive"] = mode.startswith("adaptive")  # its k ranges up to the config's default maximum
    if mode.endswith("-fused"):
        raw["fused"] = True
    elif mode.endswith("-unfused"):
        raw["fused"] = False
    return SpecConfig.parse(raw)


def our_run(mode: str, args) -> OurRun:
    if mode == FLOAT32_PLAIN:
        return OurRun(FLOAT32_PLAIN, None, torch.float32, "none")
    return OurRun(mode, our_spec(mode, args), dtype_of(args), args.quantization, mode.endswith("-compiled"))


def units(args, peers: list[str], round_index: int) -> list[str]:
    """What a round runs, in order, each in a process of its own: our modes, then the
    peers; every other round the other way round, so that no mode always runs at the
    same point of a round, where the memory's speed drifts over minutes
    (benchmarks/EXPERIMENTS.md, "Rounds alternate their order")."""
    modes = list(args.modes)
    if quality_wanted(args) and round_index == 0:  # float32's tokens, for the quality section: once is enough
        modes.append(FLOAT32_PLAIN)
    order = [f"specserve:{mode}" for mode in modes] + peers
    return order if round_index % 2 == 0 else order[::-1]


def quality_wanted(args) -> bool:
    return (dtype_of(args) != torch.float32 or args.quantization != "none") and not args.no_quality


def run_ours(args, run: OurRun, prompt_ids: dict[str, list[int]], report: Report) -> None:
    engine, tokenizer = build_engine(
        args.target,
        run.spec,
        run.dtype,
        quantization=run.quantization,
        batch_invariant=args.batch_invariant,
        compile=True if run.compile else (False if args.enforce_eager else None),
        cuda_graphs=cuda_graphs_of(args),
        max_num_seqs=1,
        device=device_of(args),
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for name, ids in prompt_ids.items():  # the warm-up also compiles, with plain-compiled
        run_one(engine, tokenizer, ids, SamplingParams(max_tokens=WARM_UP_TOKENS, temperature=0.0))
        result = run_one(engine, tokenizer, ids, params)
        more_ttft_s = [our_first_token_s(engine, ids, params) for _ in range(args.ttft_samples - 1)]
        report.rows.append(
            timed_row(
                "specserve",
                run.mode,
                run.format,
                name,
                result["token_ids"],
                result["ttft_s"],
                result["e2e_s"],
                result["spec"],
                run.fixed_k,
                more_ttft_s=more_ttft_s,
            )
        )
    note_our_models(args, run, engine, report)
    if device_of(args).type == "cpu" and huge_pages.unavailable_reason() is None:
        placed, weights = anon_huge_pages_mb(), weight_bytes_per_token(engine.target) / 1e6
        for row in report.rows:  # this unit's, in a process of its own
            row.update(huge_pages_mb=placed, weights_mb=weights)


# A unit whose huge pages hold less than this share of its target's weights ran partly
# on 4 KB pages, ~9% slower to stream (specserve/model/huge_pages.py).
HUGE_PAGES_SHARE = 0.9


def anon_huge_pages_mb() -> float | None:
    """MB of this process's memory in transparent huge pages; None where Linux does not say."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1e3
    except OSError:
        pass
    return None


def short_of_huge_pages(rows: list[dict]) -> list[str]:
    """Our modes that ran, in some round, with their target's weights not all in huge
    pages (memory too fragmented to give them): their speed is not comparable with the
    other rows'."""
    least: dict[str, tuple[float, float]] = {}  # mode -> (fewest MB placed, its target's MB)
    for row in rows:
        placed, weights = row.get("huge_pages_mb"), row.get("weights_mb")
        if placed is not None and weights and placed < HUGE_PAGES_SHARE * weights:
            least[row["mode"]] = min((placed, weights), least.get(row["mode"], (placed, weights)))
    return [
        f"{mode}: in some round only {placed:.0f} MB of its target's {weights:.0f} MB of weights in huge pages, "
        "so its speed is not comparable (memory too fragmented; echo 1 > /proc/sys/vm/compact_memory may help)"
        for mode, (placed, weights) in least.items()
    ]


def our_first_token_s(engine, ids: list[int], params: SamplingParams) -> float:
    """TTFT of the request, stopped once its first token is out."""
    seq = engine.add_request(ids, params)
    while not seq.output_ids:
        engine.step()
    engine.finish(seq.seq_id)
    return seq.timings()["ttft_s"]


def note_our_models(args, run: OurRun, engine, report: Report) -> None:
    """Roofline entries (and, in the first round, perplexity) for the models this run has loaded."""
    if run.spec is None:
        report.add_model(
            "target",
            args.target,
            "specserve",
            run.format,
            weight_bytes_per_token(engine.target),
            run.mode,
            multiply_adds_per_token(engine.target.config, engine.target.head_size),
        )
        if quality_wanted(args) and args.first_round:
            report.add_perplexity(run.format, perplexity(engine.target, report.fixed_text_ids))
    draft = getattr(engine.proposer, "draft", None)  # the draft proposer's decoder
    if isinstance(draft, Decoder) and not any(m["role"] == "draft" for m in report.models):
        draft_format_name = format_of(*draft_format(run.spec.quantization, run.dtype, run.quantization))
        # what a position reads on most text: with the common head (spec/draft_model.py)
        report.add_model("draft", args.draft, "specserve", draft_format_name, draft_bytes_per_position(draft), None)


# ---------------------------------------------------------------- transformers


class FirstTokenClock:
    """A `transformers` streamer that notes when the first output tokens arrive, and
    how many: its first `put` is the prompt, its second the first generated token(s).
    With stop_there, it ends the generation there (by raising FirstTokenOut)."""

    def __init__(self, stop_there: bool = False) -> None:
        self.num_puts = 0
        self.first_token_time: float | None = None
        self.num_first_tokens = 0
        self.stop_there = stop_there

    def put(self, value: torch.Tensor) -> None:  # [1, n] or [n] token ids
        self.num_puts += 1
        if self.num_puts == 2:
            self.first_token_time = time.perf_counter()
            self.num_first_tokens = value.numel()
            if self.stop_there:
                raise FirstTokenOut

    def end(self) -> None:
        pass


class FirstTokenOut(Exception):
    """What a FirstTokenClock that stops there raises to end the generation."""


def run_transformers(args, prompt_ids: dict[str, list[int]], eos_ids: list[int], report: Report) -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()  # its deprecation notes are not results
    device = device_of(args)
    # float32 on a CPU (its fastest path there); on a GPU the dtype ours runs in.
    dtype = torch.float32 if device.type == "cpu" else dtype_of(args)
    fmt = format_of(dtype, "none")
    target, draft = (
        transformers.AutoModelForCausalLM.from_pretrained(catalogue.resolve(name), dtype=dtype).to(device).eval()
        for name in (args.target, args.draft)
    )
    report.add_model("target", args.target, "transformers", fmt, weight_bytes_per_token(target), "plain")
    for mode, assistant in (("plain", None), ("assisted", draft)):
        for name, ids in prompt_ids.items():
            transformers_greedy(target, assistant, ids, WARM_UP_TOKENS, eos_ids)
            tokens, ttft_s, e2e_s, num_first = transformers_greedy(target, assistant, ids, args.max_tokens, eos_ids)
            more_ttft_s = [
                transformers_first_token_s(target, assistant, ids, args.max_tokens, eos_ids)
                for _ in range(args.ttft_samples - 1)
            ]
            report.rows.append(
                timed_row(
                    "transformers",
                    mode,
                    fmt,
                    name,
                    tokens,
                    ttft_s,
                    e2e_s,
                    num_first_tokens=num_first,
                    more_ttft_s=more_ttft_s,
                )
            )


def transformers_greedy(
    target, assistant, ids: list[int], max_tokens: int, eos_ids: list[int], clock: FirstTokenClock | None = None
) -> tuple[list[int], float, float, int]:
    """(tokens, ttft_s, e2e_s, tokens in the first arrival) of one greedy `generate`."""
    clock = clock or FirstTokenClock()
    extra = {} if assistant is None else {"assistant_model": assistant}
    prompt = torch.tensor([ids], device=target.device)  # [1, prompt_len]
    start = time.perf_counter()
    with torch.no_grad():
        out = target.generate(
            prompt,
            max_new_tokens=max_tokens,
            do_sample=False,
            streamer=clock,
            eos_token_id=eos_ids,
            pad_token_id=eos_ids[0],
            **extra,
        )  # [1, prompt_len + n]
    end = time.perf_counter()
    return out[0, len(ids) :].tolist(), clock.first_token_time - start, end - start, clock.num_first_tokens


def transformers_first_token_s(target, assistant, ids: list[int], max_tokens: int, eos_ids: list[int]) -> float:
    """TTFT of the same `generate` (max_tokens shapes assisted generation's first step),
    stopped once its first tokens are out."""
    start = time.perf_counter()
    clock = FirstTokenClock(stop_there=True)
    try:
        transformers_greedy(target, assistant, ids, max_tokens, eos_ids, clock)
    except FirstTokenOut:
        pass
    return clock.first_token_time - start


# ---------------------------------------------------------------- llama.cpp


def run_llama_cpp(args, prompt_ids: dict[str, list[int]], eos_ids: list[int], gguf: Path, report: Report) -> None:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    class CountingPromptLookup(LlamaPromptLookupDecoding):
        """Prompt lookup that keeps its proposals, so acceptance is counted as ours is."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.proposals: list[tuple[int, list[int]]] = []  # (tokens seen, draft)

        def __call__(self, input_ids, /, **kwargs):
            draft = super().__call__(input_ids, **kwargs)
            self.proposals.append((len(input_ids), draft.tolist()))
            return draft

    reader = GGUFReader(gguf)  # reads the header (a second or two for a big vocabulary): once
    fmt = gguf_format(reader)
    report.add_model("target", args.target, "llama.cpp", fmt, gguf_weight_bytes_per_token(reader), "plain")
    lookup_max = SpecConfig.prompt_lookup_max  # the n-gram sizes our ngram row tries
    threads = torch.get_num_threads()
    gpu_layers = 0 if device_of(args).type == "cpu" else -1  # -1: every layer on the GPU
    n_ctx = max(len(ids) for ids in prompt_ids.values()) + args.max_tokens + args.k + 16
    for mode, k in (("plain", None), ("prompt-lookup", args.k)):
        lookup = CountingPromptLookup(max_ngram_size=lookup_max, num_pred_tokens=k) if k else None
        llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            n_gpu_layers=gpu_layers,
            draft_model=lookup,
            verbose=False,
        )
        for name, ids in prompt_ids.items():
            greedy_llama_cpp(llm, ids, WARM_UP_TOKENS, eos_ids)
            if lookup is not None:
                lookup.proposals.clear()
            tokens, ttft_s, e2e_s = greedy_llama_cpp(llm, ids, args.max_tokens, eos_ids)
            spec = lookup_stats(lookup.proposals, len(ids), tokens) if lookup is not None else None
            # its first token comes before any draft: stopping there is the same request's TTFT
            more_ttft_s = [greedy_llama_cpp(llm, ids, 1, eos_ids)[1] for _ in range(args.ttft_samples - 1)]
            report.rows.append(
                timed_row("llama.cpp", mode, fmt, name, tokens, ttft_s, e2e_s, spec, k, more_ttft_s=more_ttft_s)
            )
        llm.close()
        del llm
        gc.collect()


def greedy_llama_cpp(llm, ids: list[int], max_tokens: int, eos_ids: list[int]) -> tuple[list[int], float, float]:
    """(tokens, ttft_s, e2e_s) of one greedy generation from a cold context."""
    llm.reset()  # no reuse of the previous request's cache: every prompt is prefilled
    tokens: list[int] = []
    start = time.perf_counter()
    ttft_s = 0.0
    for token in llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
        if not tokens:
            ttft_s = time.perf_counter() - start
        tokens.append(int(token))
        if token in eos_ids or len(tokens) == max_tokens:
            break
    return tokens, ttft_s, time.perf_counter() - start


def lookup_stats(proposals: list[tuple[int, list[int]]], prompt_len: int, tokens: list[int]) -> SpecStats:
    """Acceptance of llama.cpp's drafts: at temperature 0 a draft keeps exactly its
    prefix that equals the tokens then generated."""
    stats = SpecStats()
    for seen, draft in proposals:
        emitted = seen - prompt_len  # output tokens before this draft
        if emitted < len(tokens):  # a draft made after the last kept token was never used
            stats.record(len(draft), common_prefix_length(draft, tokens[emitted:]))
    return stats


# ---------------------------------------------------------------- the report


def compare_with_plain(rows: list[dict]) -> None:
    """Each row's tokens and speed against our plain row of the same prompt."""
    plain = {r["prompt"]: r for r in rows if r["system"] == "specserve" and r["mode"] == "plain"}
    for r in rows:
        base = plain.get(r["prompt"])
        if base is None:
            continue
        r["same_tokens_as_plain"] = r["token_ids"] == base["token_ids"]
        r["common_prefix_with_plain"] = common_prefix_length(base["token_ids"], r["token_ids"])
        r["num_plain_tokens"] = len(base["token_ids"])
        r["agreement_with_plain"] = prefix_agreement(base["token_ids"], r["token_ids"])
        r["decode_ratio_to_plain"] = ratio(r["decode_tokens_per_s"], base["decode_tokens_per_s"])
        r["ttft_ratio_to_plain"] = ratio(r["ttft_s"], base["ttft_s"])


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def roofline_rows(report: Report, bandwidth: float, method: str) -> list[dict]:
    rows = []
    for entry in report.models:
        limit = bandwidth / entry["bytes_per_token"]
        rates = [
            r["decode_tokens_per_s"]
            for r in report.rows_of(entry["of_system"], entry["measured_mode"])
            if r["decode_tokens_per_s"]
        ]
        measured = statistics.mean(rates) if rates else None
        rows.append(
            {
                "system": "roofline",
                **entry,
                "bandwidth_bytes_per_s": bandwidth,
                "bandwidth_method": method,
                "limit_tokens_per_s": limit,
                "measured_decode_tokens_per_s": measured,
                "fraction_of_limit": measured / limit if measured else None,
            }
        )
    return rows


def ceiling_rows(report: Report, bandwidth: float, peaks: dict[str, float] | None) -> list[dict]:
    """For each of our target formats whose arithmetic was measured: the most speculation
    could gain with our draft and with free drafts (n-gram, lookup), every draft accepted."""
    if peaks is None:
        return []
    drafts = [
        (f"{m['model']} {m['format']}", m["bytes_per_token"])
        for m in report.models
        if m["role"] == "draft" and m["of_system"] == "specserve"
    ]
    rows = []
    for m in report.models:
        kind = arithmetic_of(m["format"])
        if m["role"] != "target" or m["of_system"] != "specserve" or kind is None or not m["macs_per_token"]:
            continue
        for draft, draft_bytes in [*drafts, ("free (n-gram, lookup first)", 0)]:
            rows.append(
                {
                    "system": "ceiling",
                    "target_format": m["format"],
                    "draft": draft,
                    "arithmetic": kind,
                    "peak_macs_per_s": peaks[kind],
                    **ceiling(m["bytes_per_token"], m["macs_per_token"], draft_bytes, bandwidth, peaks[kind]),
                }
            )
    return rows


def quality_rows(report: Report, fmt: str) -> list[dict]:
    float32 = report.perplexities["float32"]
    rows = [
        {
            "system": "quality",
            "mode": "perplexity",
            "format": f,
            "perplexity": value,
            "num_tokens": len(report.fixed_text_ids),
            "text": "sonnets.txt",
            "change_vs_float32": value / float32 - 1,
        }
        for f, value in report.perplexities.items()
    ]
    reference = {r["prompt"]: r["token_ids"] for r in report.rows_of("specserve", FLOAT32_PLAIN)}
    for r in report.rows_of("specserve", "plain"):
        ref = reference[r["prompt"]]
        rows.append(
            {
                "system": "quality",
                "mode": "greedy agreement",
                "format": fmt,
                "suite": r["suite"],
                "prompt": r["prompt"],
                "agreement": prefix_agreement(ref, r["token_ids"]),
                "common_prefix": common_prefix_length(ref, r["token_ids"]),
                "num_float32_tokens": len(ref),
                "same_tokens": r["token_ids"] == ref,
            }
        )
    return rows


# ---------------------------------------------------------------- printing


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'prompt':<10}{'system':<14}{'mode':<19}{'format':<15}{'tokens':>7}{'ttft ms':>9}"
        f"{'decode tok/s':>14}{'x ours plain':>14}{'accept':>8}{'mean len':>9}  same tokens"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        mode = r["mode"] + (f" k={r['k']}" if r["k"] else "")
        decode, x = r["decode_tokens_per_s"], r.get("decode_ratio_to_plain")
        rate, length = r["acceptance_rate"], r["mean_acceptance_length"]
        print(
            f"{r['prompt']:<10}{r['system']:<14}{mode:<19}{r['format']:<15}{r['num_output_tokens']:>7}"
            f"{r['ttft_s'] * 1000:>9.0f}{'' if decode is None else f'{decode:.2f}':>14}"
            f"{'' if x is None else f'{x:.2f}x':>14}"
            f"{'' if rate is None else f'{rate:.0%}':>8}{'' if length is None else f'{length:.2f}':>9}"
            f"  {same_tokens_text(r)}"
        )
    print()
    for suite in SUITES:
        for system, mode in dict.fromkeys((r["system"], r["mode"]) for r in rows):
            picked = [r for r in rows if (r["system"], r["mode"], r["suite"]) == (system, mode, suite)]
            decode = [r["decode_ratio_to_plain"] for r in picked if r.get("decode_ratio_to_plain")]
            ttft = [r["ttft_ratio_to_plain"] for r in picked if r.get("ttft_ratio_to_plain")]
            if decode and ttft:
                print(
                    f"{suite:<11} {system:<13} {mode:<14} geometric mean: decode "
                    f"{statistics.geometric_mean(decode):.2f}x, ttft {statistics.geometric_mean(ttft):.2f}x ours plain"
                )


def same_tokens_text(r: dict) -> str:
    """'yes', or how many of our plain tokens it reproduces before the first difference."""
    if "same_tokens_as_plain" not in r:
        return ""
    return "yes" if r["same_tokens_as_plain"] else f"{r['common_prefix_with_plain']}/{r['num_plain_tokens']}"


def print_roofline(rows: list[dict]) -> None:
    if not rows:
        return
    print(
        f"\nRoofline: memory bandwidth {rows[0]['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
        f"({rows[0]['bandwidth_method']}); limit = bandwidth / weight bytes read per token"
    )
    print(
        f"{'role':<8}{'model':<22}{'system':<14}{'format':<15}{'MB/token':>10}{'limit tok/s':>13}"
        f"{'measured':>10}{'of limit':>10}"
    )
    for r in rows:
        measured, share = r["measured_decode_tokens_per_s"], r["fraction_of_limit"]
        print(
            f"{r['role']:<8}{r['model']:<22}{r['of_system']:<14}{r['format']:<15}{r['bytes_per_token'] / 1e6:>10.1f}"
            f"{r['limit_tokens_per_s']:>13.1f}{'' if measured is None else f'{measured:.1f}':>10}"
            f"{'' if share is None else f'{share:.0%}':>10}"
        )


def print_ceiling(rows: list[dict], method: str) -> None:
    if not rows:
        return
    peaks = ", ".join(
        f"{kind} {peak / 1e9:.0f} GMAC/s"
        for kind, peak in dict.fromkeys((r["arithmetic"], r["peak_macs_per_s"]) for r in rows)
    )
    print(
        f"\nCeiling of speculation: arithmetic peak {peaks} ({method}). Every draft accepted, a plain step "
        "and a draft position at the memory limit, a verified row at the arithmetic peak:"
    )
    print(f"{'target':<15}{'plain step':>11}{'row':>9}  {'drafts':<34}{'position':>9}{'at most':>9}{'k':>4}")
    for r in rows:
        print(
            f"{r['target_format']:<15}{r['plain_step_s'] * 1e3:>8.1f} ms{r['verified_row_s'] * 1e3:>6.1f} ms  "
            f"{r['draft']:<34}{r['draft_position_s'] * 1e3:>6.1f} ms{r['max_speedup']:>8.2f}x{r['best_k']:>4}"
        )


def print_quality(rows: list[dict], fmt: str) -> None:
    if not rows:
        return
    print(f"\nQuality of {fmt} against float32")
    by_format = {r["format"]: r for r in rows if r["mode"] == "perplexity"}
    reference, chosen = by_format["float32"], by_format[fmt]
    print(
        f"  perplexity on the first {chosen['num_tokens']} tokens of {chosen['text']}: float32 "
        f"{reference['perplexity']:.3f}, {fmt} {chosen['perplexity']:.3f} ({chosen['change_vs_float32']:+.2%})"
    )
    for suite in SUITES:
        picked = [r for r in rows if r["mode"] == "greedy agreement" and r["suite"] == suite]
        if picked:
            each = ", ".join(f"{r['prompt']} {r['common_prefix']}/{r['num_float32_tokens']}" for r in picked)
            print(
                f"  greedy agreement, {suite}: mean {statistics.mean(r['agreement'] for r in picked):.0%} "
                f"of float32's tokens before the first difference ({each})"
            )


# ---------------------------------------------------------------- flags and main


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a decimal integer >= minimum (minimum >= 0)."""

    def parse(value: str) -> int:
        if not value.isdigit() or int(value) < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value!r}")
        return int(value)

    return parse


positive_int = int_at_least(1)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=catalogue.DEFAULT_TARGET, help="catalogue name, .gguf file or folder")
    parser.add_argument("--draft", default=catalogue.DEFAULT_DRAFT)
    parser.add_argument("--k", type=positive_int, default=7, help="tokens drafted per step (fixed-k rows)")
    parser.add_argument(
        "--eagle-head",
        default=DEFAULT_EAGLE_HEAD,
        help="the eagle3 rows' head: a trained head's name or a checkpoint folder",
    )
    parser.add_argument(
        "--medusa-head",
        default=DEFAULT_MEDUSA_HEAD,
        help="the medusa rows' heads: a trained head's name or a checkpoint folder",
    )
    parser.add_argument("--max-tokens", type=positive_int, default=256)
    parser.add_argument(
        "--device",
        default="auto",
        help="where every system runs: auto (a CUDA GPU where PyTorch sees one), cpu, cuda, cuda:N",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="our target and draft (auto as specserve's: float32 on the CPU, bfloat16 on a GPU or with --quantization)",
    )
    parser.add_argument(
        "--quantization", choices=QUANTIZATIONS, default="none", help="weight-only quantization of our target and draft"
    )
    parser.add_argument("--batch-invariant", action="store_true", help="our target's --batch-invariant")
    graphs = parser.add_mutually_exclusive_group()
    graphs.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="our rows on CUDA graphs, an error where they cannot run (the default on a GPU; --device cuda)",
    )
    graphs.add_argument(
        "--enforce-eager", action="store_true", help="our rows without CUDA graphs or torch.compile on a GPU"
    )
    parser.add_argument(
        "--draft-quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="our draft's own weight format (default: --quantization's)",
    )
    parser.add_argument(
        "--draft-vocab-size",
        type=int_at_least(0),
        default=DEFAULT_DRAFT_VOCAB_SIZE,
        help="our draft guesses only token ids below this while the text keeps to them (the "
        "speculative config's draft_vocab_size; 0: every id always)",
    )
    parser.add_argument(
        "--prompt-lookup-first",
        type=int,
        default=DEFAULT_PROMPT_LOOKUP_FIRST,
        help="our draft rows look the last this-many tokens up first (the speculative config's "
        "prompt_lookup_first; 0: always the draft model)",
    )
    parser.add_argument(
        "--modes",
        type=comma_list(OUR_MODES, "mode(s)"),
        default=list(DEFAULT_MODES),
        help=f"our rows, comma-separated, from {','.join(OUR_MODES)} ('' for none; default {','.join(DEFAULT_MODES)})",
    )
    parser.add_argument(
        "--peers",
        type=comma_list(PEERS, "peer(s)"),
        default=list(PEERS),
        help=f"comma-separated, from {','.join(PEERS)} ('' for none)",
    )
    parser.add_argument("--suites", default="structured,open-ended")
    parser.add_argument("--prompts", default=None, help="comma-separated prompt names to keep")
    parser.add_argument(
        "--ttft-samples",
        type=positive_int,
        default=5,
        help="each row's TTFT is the median of this many first tokens of its prompt",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="run everything this many times in turn; each row gives its median round",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per row instead of tables")
    parser.add_argument(
        "--no-quality",
        action="store_true",
        help="skip the quality section and the float32 run it needs (a shorter run)",
    )
    # What main() passes to the process it starts for each unit (see run_unit).
    parser.add_argument("--unit", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--first-round", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        check_quantization(args.quantization, dtype_of(args))
        check_device_format(device_of(args), args.quantization, args.batch_invariant)
    except SpecserveError as e:
        parser.error(str(e))
    if args.cuda_graphs and device_of(args).type != "cuda":
        parser.error("--cuda-graphs needs --device cuda (or auto on a GPU)")
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2: the decode rate counts tokens after the first")
    try:
        prompts = prompts_of(args.suites)
    except ValueError as e:
        parser.error(f"--suites: {e}")
    if args.prompts:
        wanted = args.prompts.split(",")
        unknown = [p for p in wanted if p not in prompts]
        if unknown:
            parser.error(f"--prompts: unknown {unknown} in suites {args.suites}; known: {', '.join(prompts)}")
        prompts = {n: t for n, t in prompts.items() if n in wanted}
    if quality_wanted(args) and "plain" not in args.modes:
        args.modes.insert(0, "plain")  # the quality section compares plain tokens
    return args, prompts


def run_unit(args, prompts: dict[str, str]) -> dict[str, Any]:
    """One unit (`specserve:MODE`, `transformers` or `llama.cpp`) in this process:
    its rows, roofline models and perplexities."""
    tokenizer = Tokenizer.from_dir(catalogue.resolve(args.target))
    prompt_ids = {name: encode_prompt(tokenizer, chat=text) for name, text in prompts.items()}
    eos_ids = list(tokenizer.eos_token_ids)
    report = Report(fixed_text_ids(tokenizer) if quality_wanted(args) else [])
    if args.unit.startswith("specserve:"):
        run_ours(args, our_run(args.unit.removeprefix("specserve:"), args), prompt_ids, report)
    elif args.unit == "transformers":
        run_transformers(args, prompt_ids, eos_ids, report)
    elif args.unit == "llama.cpp":
        run_llama_cpp(args, prompt_ids, eos_ids, gguf_file(args.target), report)
    else:
        raise SpecserveError(f"unknown unit {args.unit!r}")
    return {"rows": report.rows, "models": report.models, "perplexities": report.perplexities}


def run_in_child(argv: list[str], unit: str, first_round: bool, report: Report) -> None:
    """Run a unit in a fresh process and add what it measured to the report. Each
    unit starting from a fresh process keeps one unit's leftovers (freed models, the
    allocator's pools, a GPU's cache) out of the next one's figures
    (benchmarks/EXPERIMENTS.md, "Each peers.py unit in a process of its own")."""
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--unit", unit]
    result = subprocess.run(
        command + ["--first-round"] * first_round, stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL
    )  # its stderr (progress, skips, errors) goes to ours
    if result.returncode != 0:
        raise SpecserveError(f"{unit} failed (exit {result.returncode}; its error is above)")
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    report.rows += measured["rows"]
    report.models += measured["models"]
    report.perplexities.update(measured["perplexities"])


def skip(what: str, why: str) -> None:
    print(f"{what}: skipped, {why}", file=sys.stderr, flush=True)


def available_peers(args) -> list[str]:
    """The peers that can run here, with a message for each that cannot."""
    peers = []
    if "transformers" in args.peers:
        if importlib.util.find_spec("transformers") is None:
            skip("transformers", "the transformers package is not installed")
        else:
            peers.append("transformers")
    if "llama.cpp" in args.peers:
        try:
            import llama_cpp

            gguf_file(args.target)  # joined once, here, for the llama.cpp processes
            if device_of(args).type != "cpu" and not llama_cpp.llama_supports_gpu_offload():
                skip(
                    "llama.cpp",
                    f"this llama-cpp-python build runs on the CPU only, and --device is {args.device} "
                    '(build it with CMAKE_ARGS="-DGGML_CUDA=on" for a GPU row)',
                )
            else:
                peers.append("llama.cpp")
        except Exception as e:  # ImportError, or a native library that fails to load
            skip(
                "llama.cpp",
                f"{type(e).__name__}: {e}; it needs llama-cpp-python "
                "(build note in benchmarks/README.md) and a GGUF target",
            )
    return peers


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, prompts = parse_args(argv)
    try:
        if args.unit is not None:
            print(json.dumps(run_unit(args, prompts)))
            return 0
        peers = available_peers(args)
        # Measured before any model is loaded, while the memory is quiet.
        bandwidth, method = measure_read_bandwidth(device=device_of(args))
        peaks = measure_dot_peaks(device_of(args))
        tokenizer = Tokenizer.from_dir(catalogue.resolve(args.target))
        report = Report(fixed_text_ids(tokenizer) if quality_wanted(args) else [])
        for round_index in range(args.rounds):
            for unit in units(args, peers, round_index):
                run_in_child(argv, unit, round_index == 0, report)
    except SpecserveError as e:
        print(f"peers.py: error: {e}", file=sys.stderr)
        return 1
    for warning in short_of_huge_pages(report.rows):
        print(f"peers.py: warning: {warning}", file=sys.stderr)
    report.keep_median_rounds()
    compare_with_plain(report.rows)
    fmt = format_of(dtype_of(args), args.quantization)
    roofline = roofline_rows(report, bandwidth, method)
    ceilings = ceiling_rows(report, bandwidth, peaks and peaks[0])
    quality = quality_rows(report, fmt) if quality_wanted(args) else []
    if args.json:
        for row in [*report.rows, *roofline, *ceilings, *quality]:
            print(json.dumps(row))
    else:
        where = str(device_of(args))
        if device_of(args).type == "cpu":
            pages = huge_pages.unavailable_reason()
            placement = "huge pages" if pages is None else f"normal pages ({pages})"
            where = f"{torch.get_num_threads()} threads, our weights in {placement}"
        print(
            f"torch {torch.__version__}, {where}, target {args.target}, "
            f"draft {args.draft}{' ' + args.draft_quantization if args.draft_quantization else ''}, "
            f"{args.max_tokens} tokens, greedy, chat template, TTFT the median of {args.ttft_samples}"
            f"{f', median of {args.rounds} rounds' if args.rounds > 1 else ''}\n"
        )
        print_table(report.rows)
        print_roofline(roofline)
        print_ceiling(ceilings, peaks[1] if peaks else "")
        print_quality(quality, fmt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
