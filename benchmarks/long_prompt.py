"""What a long prompt costs the streams decoding beside it, with each step's chunk priced
by where it lies (the engine's default) and without (`price_chunks=False`: whole chunks
wherever they lie).

One greedy stream decodes; a long prompt of sonnet text joins and is read in chunks
beside it. Each step's wall time is recorded against where its chunk began, until the
long prompt's first token. Both engines share the target's weights and take turns, the
order reversed every other round, so the machine's phase moves them alike. Prints, per
band of positions, the median step the stream waited through, and the long prompt's
time to first token, each as priced / unpriced. With `--prompt-logprobs` the long prompt
asks for its logprobs, after each engine has read it once without them.

    .venv/bin/python benchmarks/long_prompt.py                          # int4 target, 6,600 tokens
    .venv/bin/python benchmarks/long_prompt.py --prompt-tokens 12000 --band 4000
    .venv/bin/python benchmarks/long_prompt.py --prompt-tokens 2000 --band 1000 --prompt-logprobs 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specserve.bench.suites import SONNETS_PATH
from specserve.engine.build import build_engine
from specserve.engine.engine import Engine
from specserve.model.device import resolve_device
from specserve.sampling import SamplingParams

MODES = ("unpriced", "priced")


def sonnet_tokens(tokenizer, count: int) -> list[int]:
    """`count` tokens of the bundled sonnets, repeated as needed."""
    text = SONNETS_PATH.read_text()
    ids = tokenizer.encode(text)
    return (ids * (count // len(ids) + 1))[:count]


def read_beside_a_stream(
    engine: Engine, stream_prompt: list[int], long_prompt: list[int], prompt_logprobs: int | None = None
) -> tuple[list, float]:
    """[(chunk start, step seconds)] of the steps that read the long prompt (asking for
    `prompt_logprobs`) beside one greedy stream, and the long prompt's seconds to its
    first token."""
    room = engine.max_model_len - len(stream_prompt)  # the stream decodes until the long prompt's first token
    stream = engine.add_request(stream_prompt, SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True))
    while not stream.prefilled:
        engine.step()
    engine.step()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    long = engine.add_request(long_prompt, params)
    steps, joined = [], time.perf_counter()
    while not long.num_output_tokens:
        start, began = long.cache.length, time.perf_counter()
        engine.step()
        steps.append((start, time.perf_counter() - began))
    ttft = time.perf_counter() - joined
    engine.finish(stream.seq_id)
    while engine.has_unfinished():
        engine.step()
    return steps, ttft


def band_medians(steps: list[tuple[int, float]], length: int, band: int) -> dict[int, float]:
    """{band's first position: the median step seconds of the chunks that began in it},
    for the bands of `band` positions over a prompt of `length` that any chunk began in."""
    medians = {}
    for low in range(0, length, band):
        seconds = [s for start, s in steps if low <= start < low + band]
        if seconds:
            medians[low] = statistics.median(seconds)
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--quantization", default="int4", choices=("none", "int8", "int4"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-tokens", type=int, default=6600, help="the long prompt's length")
    parser.add_argument("--band", type=int, default=2000, help="positions a row of the table covers")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--prompt-logprobs", type=int, default=None, help="the long prompt asks for this many prompt logprobs a token"
    )
    args = parser.parse_args(argv)
    for flag in ("prompt_tokens", "band", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.prompt_logprobs is not None and not 0 <= args.prompt_logprobs <= 20:
        parser.error(f"--prompt-logprobs must be 0 to 20, got {args.prompt_logprobs}")

    device = resolve_device(args.device)
    dtype = torch.bfloat16 if args.quantization != "none" or device.type == "cuda" else torch.float32
    built, tokenizer = build_engine(args.target, None, dtype=dtype, quantization=args.quantization, device=device)
    engines = {
        mode: Engine(built.target, eos_token_ids=built.eos_token_ids, price_chunks=mode == "priced") for mode in MODES
    }
    long_prompt = sonnet_tokens(tokenizer, args.prompt_tokens)
    stream_prompt = tokenizer.encode("Write a long story about a lighthouse keeper.")
    if args.prompt_tokens + len(stream_prompt) + 1 > built.max_model_len:
        parser.error(f"--prompt-tokens {args.prompt_tokens} leaves no room in {args.target}'s {built.max_model_len}")

    if args.prompt_logprobs is not None:
        # As a server that has read other prompts: the fit has seen steps owing no
        # logprobs, to tell the LM head's rows from the rest (`ChunkCosts.row_share`).
        for engine in engines.values():
            read_beside_a_stream(engine, stream_prompt, long_prompt)
    steps: dict[str, list[tuple[int, float]]] = {mode: [] for mode in MODES}
    ttfts: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        for mode in MODES if round_ % 2 == 0 else reversed(MODES):
            round_steps, ttft = read_beside_a_stream(engines[mode], stream_prompt, long_prompt, args.prompt_logprobs)
            steps[mode] += round_steps
            ttfts[mode].append(ttft)

    asks = "" if args.prompt_logprobs is None else f" asking for {args.prompt_logprobs} prompt logprobs"
    print(
        f"one greedy stream beside a {args.prompt_tokens}-token prompt{asks}, {args.rounds} rounds, {args.target} "
        f"{args.quantization}; the stream's step, median ms, by where the chunk began"
    )
    print(f"{'positions':<14} " + " ".join(f"{m:>10}" for m in MODES) + f" {'ratio':>8}")
    bands = {m: band_medians(steps[m], args.prompt_tokens, args.band) for m in MODES}
    for low in range(0, args.prompt_tokens, args.band):
        medians = [bands[m].get(low, float("nan")) * 1e3 for m in MODES]
        print(
            f"{low:>6}-{low + args.band:<7} "
            + " ".join(f"{v:>10.0f}" for v in medians)
            + f" {medians[1] / medians[0]:>7.2f}x"
        )
    medians = [statistics.median(ttfts[m]) for m in MODES]
    print(f"{'prompt TTFT':<14} " + " ".join(f"{v:>9.1f}s" for v in medians) + f" {medians[1] / medians[0]:>7.2f}x")
    print(f"{'steps':<14} " + " ".join(f"{len(steps[m]) // args.rounds:>10}" for m in MODES))
    costs = engines["priced"].chunk_costs
    print(f"horizon: {costs.horizon:.0f} positions fitted, {costs.prior_horizon:.0f} by arithmetic")
    print(f"LM-head row: {costs.row_share:.2f} of a row fitted, {costs.prior_row_share:.2f} by arithmetic")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
