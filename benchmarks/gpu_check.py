"""One check of a GPU machine, in one table: the CUDA tests, decode speed against the
memory roofline (eager, CUDA graphs, graphs with --compile), what on-device sampling's
pieces cost, long contexts, a stream's steps beside a long prompt read (chunks priced by
position and not), the ceiling
of speculation with every draft accepted (the draft model's, and EAGLE-3's and Medusa's
heads', for a greedy request and at `--sampled-ks` for a seeded sampling one), adaptive
k against plain decoding by batch size, transformers' static cache, a streamed chat
through `specserve serve` (plainly and with a random EAGLE-3 head), and what `specserve
train-head --device cuda` makes of a budget (answers and training steps a minute).

Speed does not depend on the weights' values, so every model here has random weights of
a catalogue model's shapes: only its config.json is read, and the served model's
tokenizer files. They come from the prepared catalogue folders, or from `--models DIR`
holding a folder per catalogue name with those files alone, which is all a GPU machine
without the weights needs. Acceptance needs the real weights (`specserve models export`
writes their GGUF files): not measured here.

    python benchmarks/gpu_check.py                                # every section
    python benchmarks/gpu_check.py --sections plain,ceiling --batches 1,8
    python benchmarks/gpu_check.py --models /tmp/shapes --json-out check.json

Each section runs on its own: one that fails prints its error in the table and the
others go on. Rates are decode tokens a second after each sequence's first token, every
sequence of a batch together; a setting's first run warms it up (captures its graphs)
and its second is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.long_prompt import band_medians, read_beside_a_stream  # noqa: E402
from specserve import catalogue  # noqa: E402
from specserve.bench.measured_ceiling import best, measure  # noqa: E402
from specserve.bench.options import comma_list  # noqa: E402
from specserve.bench.roofline import measure_read_bandwidth  # noqa: E402
from specserve.config import ModelConfig  # noqa: E402
from specserve.engine.engine import DEFAULT_NUM_SCHEDULER_STEPS, Engine  # noqa: E402
from specserve.logprobs import MAX_LOGPROBS, logprobs_on_device  # noqa: E402
from specserve.model import checkpoint  # noqa: E402
from specserve.model.decoder import Decoder, rope_inverse_frequencies  # noqa: E402
from specserve.model.footprint import weight_bytes_per_token  # noqa: E402
from specserve.model.graphs import capture_graph  # noqa: E402
from specserve.sampling import SamplingParams, draw_on_device, probs_on_device  # noqa: E402
from specserve.spec.adaptive import AdaptiveSpecLength  # noqa: E402
from specserve.spec.cost import prior_cost_ratio  # noqa: E402
from specserve.spec.draft_model import DraftModelProposer  # noqa: E402
from specserve.spec.eagle import EagleProposer  # noqa: E402
from specserve.spec.guesses import Guesser  # noqa: E402
from specserve.spec.heads.checkpoint import save_head  # noqa: E402
from specserve.spec.heads.eagle import EagleConfig, EagleHead  # noqa: E402
from specserve.spec.heads.medusa import MedusaConfig, MedusaHeads  # noqa: E402
from specserve.spec.medusa import MedusaProposer  # noqa: E402
from specserve.spec.ngram import NgramProposer  # noqa: E402

SECTIONS = (  # in order
    "tests",
    "plain",
    "sampling",
    "profile",
    "ceiling",
    "heads",
    "adaptive",
    "long",
    "chunks",
    "serve",
    "transformers",
    "train",
)
# gather: attention over a gathered copy, not in place; autotune: compiled with inductor's
# max-autotune (Triton GEMMs where they beat cuBLAS's, minutes of compiling); coordinate:
# compiled with inductor's coordinate-descent tuning, which also turns a one-row
# projection into a reduction fused with the norm before it; single: one
# token an engine step (--num-scheduler-steps 1), where plain greedy decoding otherwise
# decodes DEFAULT_NUM_SCHEDULER_STEPS in one graph
MODES = (
    "eager",
    "graphs",
    "graphs+compile",
    "graphs+compile+single",
    "graphs+gather",
    "graphs+compile+gather",
    "graphs+autotune",
    "graphs+coordinate",
)
CUDA_TESTS = [
    "tests/model/test_graphs.py",
    "tests/model/test_device.py",
    "tests/engine/test_engine.py",
    "tests/spec/test_draft_vocab.py",
    "tests/spec/test_head_proposers.py",
    "tests/train/test_train.py",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
PROMPT_TOKENS = 32
# The plain section's rows of its largest batch sampling at a temperature: every request
# with the temperature alone, with top-p, seeded, and penalised.
SAMPLED_TEMPERATURE = 0.8
SAMPLED_ROWS = ({}, {"top_p": 0.95}, {"seed": 7}, {"repetition_penalty": 1.1, "frequency_penalty": 0.2})
# And rows where one request alone samples (at the temperature, with top-p, penalised,
# asking for logprobs) beside greedy ones: what it costs them.
SAMPLED_ALONE = ({}, {"top_p": 0.95}, {"repetition_penalty": 1.1, "frequency_penalty": 0.2}, {"logprobs": 5})
# The request whose drafting the ceiling's sampled rows time: seeded, cut by top-p.
SAMPLED_GUESSES = {"temperature": SAMPLED_TEMPERATURE, "top_p": 0.95, "seed": 7}
DTYPE = torch.bfloat16


class Table:
    """The one table: section, what, figure, note; and the same rows as JSON."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, section: str, what: str, figure: str, note: str = "", **values) -> None:
        row = {"section": section, "what": what, "figure": figure, "note": note, **values}
        self.rows.append(row)
        print(f"[{section}] {what}: {figure} {note}", flush=True)

    def print(self) -> None:
        print("\n| section | what | figure | note |\n|---|---|---:|---|")
        for r in self.rows:
            print(f"| {r['section']} | {r['what']} | {r['figure']} | {r['note']} |")


def model_files(models: Path | None, name: str) -> Path:
    """The folder with `name`'s config.json (and tokenizer files)."""
    folder = (models / name) if models is not None else catalogue.prepared_dir(name)
    if not (folder / "config.json").is_file():
        raise SystemExit(
            f"gpu_check: no {folder / 'config.json'}; prepare {name} (`specserve models prepare {name}`) "
            "or pass --models DIR holding NAME/config.json"
        )
    return folder


def random_decoder(config: ModelConfig, device: torch.device, seed: int) -> Decoder:
    """A decoder of these shapes with random bfloat16 weights (std 0.02, norms 1), made
    on the device; the same seed gives the same weights."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Decoder(config)
    model.to(DTYPE).eval()
    model.inv_freq = rope_inverse_frequencies(config).to(device)  # float32, as a loaded model keeps it
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.02)
    return model


def compile_arguments(mode: str) -> dict | None:
    """`use_torch_compile`'s arguments in this mode; None: uncompiled."""
    flags = mode.split("+")
    if "autotune" in flags:
        return {"mode": "max-autotune-no-cudagraphs"}
    if "coordinate" in flags:
        return {"options": {"coordinate_descent_tuning": True}}
    return {} if "compile" in flags else None


def build(config: ModelConfig, device: torch.device, mode: str, slots: int, capacity: int, seed: int) -> Decoder:
    model = random_decoder(config, device, seed)
    flags = mode.split("+")
    compiled = compile_arguments(mode)
    if compiled is not None:
        model.use_torch_compile(**compiled)
    if "graphs" in flags:
        model.use_cuda_graphs(slots, capacity)
        model.static.in_place = model.static.in_place and "gather" not in flags
    return model


def scheduler_steps(mode: str) -> int:
    """The plain engine's num_scheduler_steps in this mode."""
    return 1 if "single" in mode.split("+") else DEFAULT_NUM_SCHEDULER_STEPS


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    """`batch` prompts of `length` token ids of [0, vocab), each its own."""
    return [[(97 * b + 31 * i + 7) % vocab for i in range(length)] for b in range(batch)]


def decode_rate(
    engine: Engine,
    batch: int,
    prompt_len: int,
    tokens: int,
    alone: bool = False,
    first_tokens: list[float] | None = None,
    **sampling: float | int,
) -> tuple[float, list[list[int]]]:
    """(decode tokens a second over the batch, each sequence's tokens): every sequence
    prefilled and given its first token (the seconds that took appended to
    `first_tokens`), then the rest timed to the end; `sampling`: SamplingParams' fields
    (none: greedy), of every sequence or, `alone`, of the first alone beside greedy ones."""
    greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    params = SamplingParams(
        max_tokens=tokens, temperature=sampling.pop("temperature", 0.0), ignore_eos=True, **sampling
    )
    seqs = [
        engine.add_request(p, greedy if alone and i else params)
        for i, p in enumerate(prompts(batch, prompt_len, engine.target.config.vocab_size))
    ]
    synchronize()
    arrived = time.perf_counter()
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    synchronize()
    if first_tokens is not None:
        first_tokens.append(time.perf_counter() - arrived)
    done = sum(s.num_output_tokens for s in seqs)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    synchronize()
    elapsed = time.perf_counter() - start
    return (sum(s.num_output_tokens for s in seqs) - done) / elapsed, [s.output_ids for s in seqs]


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_section(table: Table, section: str, fn, *args) -> None:
    started = time.perf_counter()
    try:
        fn(table, *args)
    except Exception as error:  # a broken section is a result: the others still run
        traceback.print_exc()
        table.add(section, "failed", type(error).__name__, str(error).splitlines()[0][:160] if str(error) else "")
    print(f"[{section}] {time.perf_counter() - started:.0f} s", flush=True)
    release_memory()


def release_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def section_tests(table: Table, args) -> None:
    import importlib.util

    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-k", args.tests_filter]
    if importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(args.tests_workers)]
    if importlib.util.find_spec("pytest_timeout") is not None:
        command += ["--timeout", str(int(args.tests_timeout / 2))]
    with tempfile.TemporaryFile("w+") as output:
        try:
            subprocess.run(
                command + args.test_files, stdout=output, stderr=subprocess.STDOUT, timeout=args.tests_timeout
            )
        finally:
            output.seek(0)
            text = output.read()
            print(text[-6000:], flush=True)
    lines = text.strip().splitlines()
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.MULTILINE)
    summary = lines[-1].strip("= ") if lines else "-"
    table.add("tests", f"pytest -k '{args.tests_filter}'", summary, "; ".join(failed)[:300])


def section_plain(table: Table, args, config: ModelConfig, device: torch.device, bandwidth: float) -> None:
    slots = max(args.batches)
    tokens_of = {b: args.tokens if b == 1 else args.batch_tokens for b in args.batches}
    reference: dict[int, list[list[int]]] = {}
    for mode in args.modes:
        loaded = time.perf_counter()
        model = build(config, device, mode, slots, args.capacity, seed=0)
        load_s = time.perf_counter() - loaded
        roofline = bandwidth / weight_bytes_per_token(model)
        for batch in args.batches:
            engine = Engine(model, eos_token_ids=[], max_num_seqs=batch, num_scheduler_steps=scheduler_steps(mode))
            decode_rate(engine, batch, PROMPT_TOKENS, tokens_of[batch])  # warm-up: captures this batch's graphs
            first_tokens: list[float] = []
            rate, outputs = decode_rate(engine, batch, PROMPT_TOKENS, tokens_of[batch], first_tokens=first_tokens)
            same = ""
            if mode == "eager":
                reference[batch] = outputs
            elif batch in reference:
                agree = sum(first_difference(a, b) for a, b in zip(outputs, reference[batch]))
                same = f"; tokens equal to eager's before the first difference: {agree}/{sum(map(len, outputs))}"
            share = f"{rate / roofline:.0%} of the {roofline:.0f} tok/s roofline" if batch == 1 else ""
            table.add(
                "plain",
                f"{mode}, batch {batch}",
                f"{rate:.0f} tok/s",
                f"{share}{same}; every first token after {first_tokens[0] * 1e3:.0f} ms; set-up {load_s:.0f} s",
                mode=mode,
                batch=batch,
                tokens_per_s=rate,
                roofline_tokens_per_s=roofline,
                first_tokens_s=first_tokens[0],
            )
        # Sampling requests, seeded or penalised too, decode in the same chains as greedy ones.
        batch = max(args.batches)
        engine = Engine(model, eos_token_ids=[], max_num_seqs=batch, num_scheduler_steps=scheduler_steps(mode))
        for fields, alone in [(fields, False) for fields in SAMPLED_ROWS] + [(f, True) for f in SAMPLED_ALONE]:
            sampling = dict(temperature=SAMPLED_TEMPERATURE, **fields)
            decode_rate(engine, batch, PROMPT_TOKENS, tokens_of[batch], alone, **sampling)
            rate, _ = decode_rate(engine, batch, PROMPT_TOKENS, tokens_of[batch], alone, **sampling)
            label = ", ".join(f"{name} {value:g}" for name, value in sampling.items())
            table.add(
                "plain",
                f"{mode}, batch {batch}, " + (f"one request {label}, the others greedy" if alone else label),
                f"{rate:.0f} tok/s",
                mode=mode,
                batch=batch,
                tokens_per_s=rate,
                alone=alone,
                **sampling,
            )
        del model, engine
        release_memory()


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def section_sampling(table: Table, args, config: ModelConfig, device: torch.device) -> None:
    """What a chain's sampling costs a position over the target's vocabulary, by rows
    (`--sampling-rows`: a batch, or a batch's positions): each piece captured in a graph
    and replayed, so the figures are the GPU's alone. The distribution at a temperature,
    cut by top-p on every row and on one row of them (`cut_rows`), the stable sort that
    cut is made of, the draws (the exponential race, a keyed row's inverse CDF), and the
    logprobs a chain computes for the rows that ask, every row and one."""
    if device.type != "cuda":
        table.add("sampling", "skipped", "-", "needs a GPU")
        return
    generator = torch.Generator(device=device).manual_seed(0)
    for rows in args.sampling_rows:
        logits = 4 * torch.randn(rows, config.vocab_size, device=device, generator=generator)  # [rows, V]
        temperatures = torch.full((rows,), SAMPLED_TEMPERATURE, device=device)
        top_ps = torch.full((rows,), 0.95, device=device)
        uniforms = torch.rand(rows, device=device, generator=generator)
        probs = logits.softmax(dim=-1)
        one_row = torch.zeros(1, dtype=torch.int64, device=device)
        pieces = {
            "the distribution at a temperature": lambda: probs_on_device(logits, temperatures),
            "cut by top-p 0.95, every row": lambda: probs_on_device(logits, temperatures, None, top_ps),
            "cut by top-p 0.95, one row": lambda: probs_on_device(logits, temperatures, None, top_ps, one_row),
            "a stable sort of every row": lambda: logits.sort(dim=-1, descending=True, stable=True).values,
            "a draw (the exponential race)": lambda: draw_on_device(probs),
            "a keyed draw (inverse CDF)": lambda: draw_on_device(probs, uniforms),
            f"logprobs (log-softmax, top {MAX_LOGPROBS}), every row": lambda: top_logprobs(logits),
            f"logprobs (log-softmax, top {MAX_LOGPROBS}), one row": lambda: top_logprobs(logits[one_row]),
        }
        for what, piece in pieces.items():
            us = replay_seconds(piece) * 1e6
            table.add("sampling", f"{rows} rows: {what}", f"{us:.0f} us", rows=rows, piece=what, us=us)
        release_memory()


def top_logprobs(logits: torch.Tensor) -> torch.Tensor:  # [n, V] -> [n, MAX_LOGPROBS]
    """The likeliest ids' logprobs, and each row's token's, as a chain computes them for a
    row that asks (TokenChain)."""
    first_ids = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    return logprobs_on_device(logits, first_ids, MAX_LOGPROBS)[1]


def replay_seconds(piece, replays: int = 50) -> float:
    """Seconds a replay of `piece` (returning a tensor) captured as a CUDA graph takes."""
    graph, _ = capture_graph(lambda: [piece()], torch.cuda.graph_pool_handle())
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


def section_profile(table: Table, args, config: ModelConfig, device: torch.device) -> None:
    """Where a graphed decode step's time goes, batch 1: the graph's replays alone
    against the engine's whole step (the rest is the host's), and the kernels of one
    static step run uncaptured (the same kernels a replay runs)."""
    if device.type != "cuda":
        table.add("profile", "skipped", "-", "needs a GPU")
        return
    model = build(config, device, args.profile_mode, 1, args.capacity, seed=0)
    engine = Engine(model, eos_token_ids=[], max_num_seqs=1, num_scheduler_steps=1)  # a replay a token
    decode_rate(engine, 1, PROMPT_TOKENS, args.tokens)  # warm-up: captures the graphs
    rate, _ = decode_rate(engine, 1, PROMPT_TOKENS, args.tokens)
    entries = model.static.captured.entries.items()
    (key, step), *_ = [(key, step) for (kind, key), (step, _) in entries if kind == "step" and key[:2] == (1, 1)]
    replays = 50
    synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        step.graph.replay()
    synchronize()
    replay_s = (time.perf_counter() - start) / replays
    table.add(
        "profile",
        f"{args.profile_mode}, batch 1: a replay alone",
        f"{replay_s * 1e3:.2f} ms",
        f"of the engine's {1e3 / rate:.2f} ms a token; bucket {key[2]}",
    )
    add_host_rows(table, engine, args)
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step.forward()
        synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.count]
    launches = sum(e.count for e in kernels) / 3
    busy = sum(e.device_time_total for e in kernels) / 3  # us
    table.add("profile", "kernels a step, uncaptured", f"{launches:.0f}", f"GPU busy {busy / 1e3:.2f} ms a step")
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[: args.profile_top]:
        table.add("profile", e.key[:70], f"{e.device_time_total / 3:.0f} us", f"{e.count / 3:.0f} launches a step")
    del model, engine
    release_memory()


def add_host_rows(table: Table, engine: Engine, args) -> None:
    """The host's Python functions around a batch-1 step, by their own time under
    cProfile (which slows Python, so shares count, not the absolute figures)."""
    import cProfile
    import pstats

    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(prompts(1, PROMPT_TOKENS, engine.target.config.vocab_size)[0], params)
    profiler = cProfile.Profile()
    steps = 0
    while engine.has_unfinished():
        profiler.enable()
        engine.step()
        profiler.disable()
        steps += 1
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, own s, cumulative s, callers)
    total = sum(own for _, _, own, _, _ in stats.values())
    table.add(
        "profile",
        "host: Python functions, own time a step",
        f"{total / steps * 1e6:.0f} us",
        f"{steps} steps under cProfile",
    )
    for (file, line, name), (calls, _, own, _, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[
        : args.profile_top
    ]:
        where = f"{Path(file).name}:{line} {name}" if line else name
        table.add("profile", f"host: {where}"[:70], f"{own / steps * 1e6:.0f} us", f"{calls / steps:.1f} calls a step")


def section_long(table: Table, args, config: ModelConfig, device: torch.device) -> None:
    capacity = max(args.contexts) + args.batch_tokens + 64
    for mode in args.long_modes:
        model = build(config, device, mode, 1, capacity, seed=0)
        for context in args.contexts:
            engine = Engine(
                model,
                eos_token_ids=[],
                max_num_seqs=1,
                prefill_chunk_size=1024,
                num_scheduler_steps=scheduler_steps(mode),
            )
            decode_rate(engine, 1, context, args.batch_tokens)
            rate, _ = decode_rate(engine, 1, context, args.batch_tokens)
            table.add("long", f"{mode}, batch 1, {context} positions", f"{rate:.0f} tok/s", mode=mode, context=context)
        del model
        release_memory()


def section_chunks(table: Table, args, config: ModelConfig, device: torch.device) -> None:
    """One greedy stream beside a long prompt being read, chunks priced by where they lie
    (the default) and whole (long_prompt.py's read, the device's default chunk): the
    stream's median step by quarter of the prompt, its time to first token, and the
    fitted horizon. Each engine reads it once to warm up (its graphs, its fit), then once
    measured."""
    tokens = args.chunk_prompt_tokens
    long_prompt = prompts(1, tokens, config.vocab_size)[0]
    stream_prompt = prompts(2, PROMPT_TOKENS, config.vocab_size)[1]
    quarter = -(-tokens // 4)
    for priced in (False, True):
        label = "priced" if priced else "whole chunks"
        model = build(config, device, args.long_modes[0], 2, tokens + args.capacity, seed=0)
        # The stream decodes until the prompt's first token: within a slot's positions.
        engine = Engine(
            model, eos_token_ids=[], max_num_seqs=2, max_model_len=tokens + args.capacity, price_chunks=priced
        )
        read_beside_a_stream(engine, stream_prompt, long_prompt)
        steps, ttft = read_beside_a_stream(engine, stream_prompt, long_prompt)
        for low, step in band_medians(steps, tokens, quarter).items():
            table.add(
                "chunks",
                f"{label}, the stream's step, positions {low}-{low + quarter}",
                f"{step * 1e3:.2f} ms",
                priced=priced,
                low=low,
                step_s=step,
            )
        horizon = "" if engine.chunk_costs is None else f"; horizon {engine.chunk_costs.horizon:.0f} positions"
        table.add(
            "chunks",
            f"{label}, the prompt's time to first token",
            f"{ttft:.3f} s",
            f"{len(steps)} steps{horizon}",
            priced=priced,
            ttft_s=ttft,
            steps=len(steps),
        )
        del engine, model
        release_memory()


def add_ceiling_rows(
    table: Table, section: str, label: str, engine: Engine, ks: list[int], args, sampling: dict | None = None
) -> None:
    """The engine's measured ceiling per k (every draft accepted: measured_ceiling.py),
    a draft position's share of a plain step, and the best k; for a greedy request, or
    one sampling as `sampling` asks."""
    ids = prompts(1, PROMPT_TOKENS, engine.target.config.vocab_size)[0]
    rows = measure(engine, ids, ks, rounds=args.rounds, max_tokens=args.ceiling_tokens, sampling=sampling)
    if sampling is not None:
        label += ", " + ", ".join(f"{name} {value:g}" for name, value in sampling.items())
    plain = rows[0]["step_s"]
    for row in rows[1:]:
        position = row["drafting_s"] / row["k"] / plain
        table.add(
            section,
            f"{label} k = {row['k']}",
            f"{row['full_acceptance_speedup']:.2f}x",
            f"step {row['step_s'] * 1e3:.2f} ms (plain {plain * 1e3:.2f}); a draft position {position:.3f} "
            f"of a plain step; break-even {row['break_even_tokens']:.2f} tokens",
            k=row["k"],
            full_acceptance_speedup=row["full_acceptance_speedup"],
            draft_position_share=position,
        )
    top = best(rows)
    table.add(section, f"{label}, best k", f"{top['full_acceptance_speedup']:.2f}x", f"k = {top['k']}")


def section_ceiling(table: Table, args, target_config: ModelConfig, draft_config: ModelConfig, device) -> None:
    for mode in args.ceiling_modes:
        target = build(target_config, device, mode, 1, args.capacity, seed=0)
        draft = build(draft_config, device, mode, 1, args.capacity, seed=1)
        proposer = DraftModelProposer(draft, confidence_threshold=0.0)
        engine = Engine(target, [], proposer=proposer, num_speculative_tokens=max(args.ks), max_num_seqs=1)
        add_ceiling_rows(table, "ceiling", f"{mode}, draft model", engine, args.ks, args)
        if args.sampled_ks:  # its chains draw a sampled request's guesses too
            add_ceiling_rows(table, "ceiling", f"{mode}, draft model", engine, args.sampled_ks, args, SAMPLED_GUESSES)
        del target, draft, engine, proposer
        release_memory()


def random_head(method: str, config: ModelConfig, device: torch.device, draft_vocab: int, medusa_heads: int):
    """A head of `method` for a target of these shapes, random bfloat16 weights (EAGLE-3
    over `draft_vocab` ids, as the catalogue's head)."""
    torch.manual_seed(3)
    with torch.device(device):
        if method == "medusa":
            head = MedusaHeads(MedusaConfig(medusa_heads, 1, config.hidden_size, config.vocab_size))
        else:
            head = EagleHead(EagleConfig.for_target(config, 3 if method == "eagle3" else 1, draft_vocab))
            if method == "eagle3":
                head.target_ids = torch.randperm(config.vocab_size)[:draft_vocab]
    return head.to(DTYPE).eval()


def section_heads(table: Table, args, config: ModelConfig, device: torch.device) -> None:
    """The ceiling of speculation with a head drafting: random heads of the catalogue's
    kinds on the target, every draft accepted (the steps cost what they cost whatever
    was guessed): the target graphed and compiled as `--heads-mode` says, and an EAGLE
    head's own steps with it, as build_engine runs them."""
    for method in args.head_methods:
        target = build(config, device, args.heads_mode, 1, args.capacity, seed=0)
        proposer = random_head_proposer(method, target, args.heads_mode, 1, args)
        engine = Engine(target, [], proposer=proposer, num_speculative_tokens=max(args.head_ks), max_num_seqs=1)
        add_ceiling_rows(table, "heads", f"{args.heads_mode}, {method}", engine, args.head_ks, args)
        if args.sampled_ks and method != "medusa":
            label = f"{args.heads_mode}, {method}"
            add_ceiling_rows(table, "heads", label, engine, args.sampled_ks, args, SAMPLED_GUESSES)
        del target, proposer, engine
        release_memory()


def random_head_proposer(method: str, target: Decoder, mode: str, slots: int, args) -> EagleProposer | MedusaProposer:
    """A random head's proposer on `target`, as build_engine runs it: an EAGLE head
    compiled and graphed as `mode` has the target."""
    config = target.config
    head = random_head(method, config, target.device, args.draft_vocab, max(args.head_ks))
    guesser = Guesser(config.vocab_size, confidence_threshold=0.0)
    if method == "medusa":
        return MedusaProposer(head, guesser)
    head.share_target(target.embed_tokens, target.lm_head)
    compiled = compile_arguments(mode)
    if compiled is not None:
        head.use_torch_compile(**compiled)
    if "graphs" in mode.split("+"):
        head.use_cuda_graphs(slots, args.capacity)
    return EagleProposer(head, guesser)


def section_adaptive(table: Table, args, config: ModelConfig, draft_config: ModelConfig, device) -> None:
    """Adaptive k against plain decoding on one target, by batch size, engines taking
    turns round by round: with random weights next to nothing is accepted, so adaptive
    should settle on plain decoding (at or above 0.98x) and its drafting, while it
    learns, is what it costs. Draft model, n-gram and an EAGLE-3 head by default
    (`--adaptive-proposers`: also an EAGLE-1 head and Medusa heads, one a `--head-ks`)."""
    slots = max(args.batches)
    target = build(config, device, args.adaptive_mode, slots, args.capacity, seed=0)
    draft = build(draft_config, device, args.adaptive_mode, slots, args.capacity, seed=1)
    for kind in args.adaptive_proposers:
        if kind == "draft":
            proposer = DraftModelProposer(draft)
        elif kind == "ngram":
            proposer = NgramProposer(1, 4)
        else:
            proposer = random_head_proposer(kind, target, args.adaptive_mode, slots, args)
        for batch in args.batches:
            tokens = args.tokens if batch == 1 else args.batch_tokens
            plain = Engine(target, eos_token_ids=[], max_num_seqs=batch)
            # Medusa drafts one token a head: k and its maximum are the head count.
            heads = proposer.heads.config.num_heads if kind == "medusa" else None
            adaptive = Engine(
                target,
                eos_token_ids=[],
                proposer=proposer,
                num_speculative_tokens=heads or args.adaptive_k,
                max_num_seqs=batch,
                adaptive=AdaptiveSpecLength(heads or args.adaptive_max_k, prior_cost_ratio(proposer, target)),
            )
            ratios = []
            for round_ in range(args.rounds + 1):  # round 0 warms both up (graphs, compiles)
                order = [plain, adaptive] if round_ % 2 else [adaptive, plain]
                rates = {id(e): decode_rate(e, batch, PROMPT_TOKENS, tokens)[0] for e in order}
                if round_:
                    ratios.append(rates[id(adaptive)] / rates[id(plain)])
            stats = adaptive.spec_stats
            table.add(
                "adaptive",
                f"{args.adaptive_mode}, {kind}, batch {batch}",
                f"{statistics.median(ratios):.2f}x",
                f"plain = 1 (rounds {', '.join(f'{r:.2f}' for r in ratios)}); drafted {stats.num_draft_tokens} "
                f"tokens, accepted {stats.num_accepted_tokens}",
                kind=kind,
                batch=batch,
                ratio=statistics.median(ratios),
            )
        del proposer


def section_transformers(table: Table, args, files: Path, device: torch.device) -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    hf_config = transformers.AutoConfig.from_pretrained(files)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=DTYPE).eval()
    ids = torch.tensor(prompts(1, PROMPT_TOKENS, hf_config.vocab_size), device=device)  # [1, prompt]

    def generate(tokens: int, **options) -> float:
        synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0, **options
            )
        synchronize()
        return time.perf_counter() - start

    for name, options in (("static cache", {"cache_implementation": "static"}), ("dynamic cache", {})):
        compiled = time.perf_counter()
        generate(args.tokens, **options)  # warm-up (the static cache compiles here)
        warm_s = time.perf_counter() - compiled
        first, whole = generate(1, **options), generate(args.tokens, **options)
        rate = (args.tokens - 1) / (whole - first)
        table.add(
            "transformers",
            f"{name}, batch 1",
            f"{rate:.0f} tok/s",
            f"transformers {transformers.__version__}; warm-up {warm_s:.0f} s",
            tokens_per_s=rate,
        )


def write_random_checkpoint(folder: Path, config: ModelConfig, files: Path, device: torch.device, seed: int) -> None:
    """A checkpoint folder of `random_decoder`'s weights with the tokenizer files of `files`."""
    model = random_decoder(config, device, seed)
    checkpoint.write_checkpoint(folder, config, {k: v.cpu() for k, v in model.hf_state_dict().items()})
    del model
    release_memory()
    for name in TOKENIZER_FILES:
        if (files / name).is_file():
            shutil.copy(files / name, folder / name)


def section_serve(table: Table, args, config: ModelConfig, files: Path, device: torch.device) -> None:
    """A random checkpoint of the draft's shapes (the smaller) with the target's
    tokenizer, served as a user would, plainly and with each of `--serve-heads` (a
    random head saved in its public layout, `--speculative-config`): one streamed chat
    request each."""
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-served-"))
    try:
        write_random_checkpoint(folder / "model", config, files, device, seed=2)
        for method in ["plain", *args.serve_heads]:
            options = []
            if method != "plain":
                head = random_head(method, config, torch.device("cpu"), args.draft_vocab, 3)
                save_head(head, folder / method)
                spec = {"method": method, "model": str(folder / method), "num_speculative_tokens": 3}
                options = ["--speculative-config", json.dumps(spec)]
            served = serve_one_chat(folder / "model", options, device, args.serve_timeout)
            table.add("serve", f"{method}: streamed chat, 64 tokens", *served)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def section_train(table: Table, args, config: ModelConfig, files: Path, device: torch.device) -> None:
    """`specserve train-head` on the GPU, as a user runs it, for `--train-minutes`: a random
    checkpoint of the target's shapes with its tokenizer (random weights seldom end an
    answer, so nearly every one is `--answer-tokens` long), with `--train-args`, into a
    cache of its own (sharing the compiled CPU kernels). Its training.json gives the rates:
    answered tokens and training steps a minute."""
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-train-"))
    try:
        write_random_checkpoint(folder / "model", config, files, device, seed=3)
        command = [sys.executable, "-m", "specserve.cli", "train-head", str(folder / "model"), "--device", str(device)]
        command += ["--max-minutes", f"{args.train_minutes:g}", "--name", "check", "--json", *args.train_args.split()]
        kernels = catalogue.cache_root() / "kernels"
        if kernels.is_dir():
            (folder / "cache").mkdir()
            (folder / "cache" / "kernels").symlink_to(kernels)
        env = os.environ | {"SPECSERVE_CACHE": str(folder / "cache")}
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.train_minutes * 60 + 300)
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"train-head exited {done.returncode}: {done.stderr[-800:]}")
        report = json.loads(done.stdout)
        data, training, minutes = report["data"], report["training"], report["minutes"]
        table.add(
            "train",
            f"answers, {report['quantization']} target, {args.train_minutes:g}-minute budget",
            f"{data['answer_tokens_per_minute']:.0f} tok/min",
            f"{data['answers']} answers, {data['answer_tokens']} tokens in {minutes['data']:.2f} min",
            answer_tokens_per_minute=data["answer_tokens_per_minute"],
        )
        table.add(
            "train",
            f"{report['method']} head, {training['batch_tokens']} positions a step",
            f"{training['steps'] / minutes['train']:.0f} steps/min",
            f"{training['steps']} steps in {minutes['train']:.2f} min; the command took {seconds:.0f} s "
            f"(load {minutes['load']:.2f} min)",
            steps_per_minute=training["steps"] / minutes["train"],
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def serve_one_chat(model: Path, options: list[str], device: torch.device, timeout: float) -> tuple[str, str]:
    """`specserve serve MODEL *options` started, one streamed chat request of 64 tokens
    answered, the server stopped: (ok or incomplete, what was seen)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "specserve.cli", "serve", str(model), "--device", str(device), *options]
    command += ["--port", str(port), "--host", "127.0.0.1", "--max-model-len", "2048"]
    started = time.perf_counter()
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        while time.perf_counter() - started < timeout:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited ({server.returncode}): {server.stdout.read()[-500:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            raise TimeoutError(f"no /health in {timeout} s")
        ready_s = time.perf_counter() - started
        body = {
            "model": str(model),
            "messages": [{"role": "user", "content": "Write a haiku about graphs."}],
            "max_tokens": 64,
            "stream": True,
            "ignore_eos": True,
        }
        chunks, done, first_s = 0, False, None
        sent = time.perf_counter()
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunks += 1
                    first_s = first_s or time.perf_counter() - sent
        total_s = time.perf_counter() - sent
        return (
            "ok" if done and chunks > 1 else "incomplete",
            f"{chunks} chunks, first after {1e3 * (first_s or 0):.0f} ms, all in {total_s:.2f} s; "
            f"server ready in {ready_s:.0f} s",
        )
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def int_list(value: str) -> list[int]:
    return [int(v) for v in value.split(",") if v]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=catalogue.DEFAULT_TARGET)
    parser.add_argument("--draft", default=catalogue.DEFAULT_DRAFT)
    parser.add_argument("--models", type=Path, default=None, help="a folder of NAME/config.json (+ tokenizer files)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sections", type=comma_list(SECTIONS, "section(s)"), default=list(SECTIONS))
    parser.add_argument(
        "--modes",
        type=comma_list(MODES, "mode(s)"),
        default=["eager", "graphs+compile", "graphs+compile+single"],
        help=f"plain decoding's settings, of {', '.join(MODES)}",
    )
    parser.add_argument(
        "--long-modes", type=comma_list(MODES, "mode(s)"), default=["eager", "graphs+compile", "graphs+compile+gather"]
    )
    parser.add_argument("--ceiling-modes", type=comma_list(MODES, "mode(s)"), default=["graphs+compile"])
    parser.add_argument(
        "--head-methods", type=comma_list(("eagle", "eagle3", "medusa"), "method(s)"), default=["eagle3", "medusa"]
    )
    parser.add_argument("--heads-mode", choices=MODES, default="graphs+compile")
    parser.add_argument("--adaptive-mode", choices=MODES, default="graphs+compile")
    parser.add_argument(
        "--adaptive-proposers",
        type=comma_list(("draft", "ngram", "eagle", "eagle3", "medusa"), "proposer(s)"),
        default=["draft", "ngram", "eagle3"],
    )
    parser.add_argument("--adaptive-k", type=int, default=7, help="num_speculative_tokens of the adaptive engines")
    parser.add_argument("--adaptive-max-k", type=int, default=15, help="their max_speculative_tokens")
    parser.add_argument("--head-ks", type=int_list, default=[1, 3, 5, 7])
    parser.add_argument("--draft-vocab", type=int, default=32768, help="an EAGLE-3 head's draft vocabulary")
    parser.add_argument("--batches", type=int_list, default=[1, 8, 32])
    parser.add_argument("--contexts", type=int_list, default=[4096, 16384], help="positions before decoding (long)")
    parser.add_argument(
        "--chunk-prompt-tokens", type=int, default=12000, help="the long prompt read beside a stream (chunks)"
    )
    parser.add_argument("--ks", type=int_list, default=[1, 3, 5, 7, 11, 15])
    parser.add_argument(
        "--sampled-ks", type=int_list, default=[7], help="the ceiling's and heads' ks timed for a sampling request"
    )
    parser.add_argument(
        "--sampling-rows", type=int_list, default=[1, 32, 256], help="rows the sampling section's pieces take"
    )
    parser.add_argument("--tokens", type=int, default=128, help="tokens a batch-1 run decodes")
    parser.add_argument("--train-minutes", type=float, default=3, help="train-head's budget in the train section")
    parser.add_argument(
        "--train-args",
        default="--answer-rounds 30",
        help="more train-head flags in the train section (default: answers not capped by the instructions' 3 rounds)",
    )
    parser.add_argument("--batch-tokens", type=int, default=64, help="tokens each sequence of a batch decodes")
    parser.add_argument("--ceiling-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the ceiling's settings")
    parser.add_argument("--capacity", type=int, default=1024, help="positions a cache slot holds")
    parser.add_argument("--profile-mode", choices=MODES, default="graphs+compile")
    parser.add_argument("--profile-top", type=int, default=12, help="kernels listed by GPU time")
    parser.add_argument("--test-files", type=lambda v: v.split(","), default=CUDA_TESTS, help="comma-separated")
    parser.add_argument("--tests-filter", default="cuda or slot_attention or in_place or store_keys")
    parser.add_argument("--tests-workers", type=int, default=6, help="pytest-xdist workers, where it is installed")
    parser.add_argument("--tests-timeout", type=float, default=240)
    parser.add_argument("--serve-timeout", type=float, default=180)
    parser.add_argument(
        "--serve-heads", type=comma_list(("eagle", "eagle3", "medusa"), "method(s)"), default=["eagle3"]
    )
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument(
        "--deadline", type=float, default=480, help="seconds after which sections not yet begun are skipped"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    target_files, draft_files = model_files(args.models, args.target), model_files(args.models, args.draft)
    target_config, draft_config = checkpoint.read_config(target_files), checkpoint.read_config(draft_files)
    table = Table()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    bandwidth, how = measure_read_bandwidth(device=device, gib=None if device.type == "cuda" else 0.25)
    table.add("machine", name, f"{bandwidth / 1e12:.2f} TB/s read", f"{how}; torch {torch.__version__}")
    sections = {
        "tests": (section_tests, args),
        "plain": (section_plain, args, target_config, device, bandwidth),
        "sampling": (section_sampling, args, target_config, device),
        "profile": (section_profile, args, target_config, device),
        "heads": (section_heads, args, target_config, device),
        "adaptive": (section_adaptive, args, target_config, draft_config, device),
        "long": (section_long, args, target_config, device),
        "chunks": (section_chunks, args, target_config, device),
        "ceiling": (section_ceiling, args, target_config, draft_config, device),
        "transformers": (section_transformers, args, target_files, device),
        "serve": (section_serve, args, draft_config, target_files, device),
        "train": (section_train, args, target_config, target_files, device),
    }
    started = time.perf_counter()
    for section in args.sections:
        if time.perf_counter() - started > args.deadline:
            table.add(section, "skipped", "-", f"past --deadline {args.deadline:g} s")
            continue
        fn, *rest = sections[section]
        run_section(table, section, fn, *rest)
        if args.json_out is not None:  # after every section: a run cut short keeps what it measured
            args.json_out.write_text(json.dumps(table.rows, indent=1))
    table.print()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
