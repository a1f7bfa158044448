"""What one request costs the requests beside it: greedy requests decode beside a
neighbour of each kind in turn, and their speed is reported against their speed beside a
greedy neighbour.

The greedy requests (the open-ended prompts) and the neighbour (`code`, sampling at 0.8
unless greedy) run in one engine of `--max-num-seqs` = greedy + 1, the same for every
kind: the kinds take turns round after round, so the machine's phase moves them alike.
Timed from the step after every prompt has been read until the last greedy request
finishes; the neighbour asks for more tokens than they do, so it runs throughout.

    .venv/bin/python benchmarks/neighbours.py                     # int4 pair, adaptive k
    .venv/bin/python benchmarks/neighbours.py --draft qwen2.5-coder-1.5b-eagle3   # a head
    .venv/bin/python benchmarks/neighbours.py --draft '' --device cuda   # plain, CUDA graphs
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specserve.bench.suites import SONNETS_PATH, SUITES
from specserve.bench.tune import proposer_config
from specserve.config import SpecConfig
from specserve.engine.build import build_engine, encode_prompt
from specserve.model.device import resolve_device
from specserve.sampling import SamplingParams
from specserve.spec.prediction import PredictedText
from specserve.structured.guide import GuideCache
from specserve.structured.outputs import StructuredOutput
from specserve.tokenizer import Tokenizer

NEIGHBOUR_TEMPERATURE = 0.8
# Each kind of neighbour: its sampling fields (greedy: the reference every ratio is to).
KINDS: dict[str, dict] = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": NEIGHBOUR_TEMPERATURE},
    "seeded": {"temperature": NEIGHBOUR_TEMPERATURE, "seed": 1},
    "penalised": {"temperature": NEIGHBOUR_TEMPERATURE, "repetition_penalty": 1.1, "frequency_penalty": 0.2},
    "logprobs": {"temperature": NEIGHBOUR_TEMPERATURE, "logprobs": 5},
    "cut": {"temperature": NEIGHBOUR_TEMPERATURE, "top_k": 50, "top_p": 0.9, "min_p": 0.05},
    "flat": {"temperature": 2.0, "top_p": 0.95},  # OpenAI's hottest: a nucleus of thousands of ids
    # At the API's bounds (server/protocol.py): 1024 biased ids, and 1024 stop ids (given
    # by `params_of`, from the vocabulary's rare end, so that the neighbour runs on).
    "biased": {"temperature": NEIGHBOUR_TEMPERATURE, "logit_bias": tuple((i, 2.0) for i in range(1000, 2024))},
    "stop-ids": {"temperature": NEIGHBOUR_TEMPERATURE, "min_tokens": 8},
    # vLLM's allowed_token_ids, half the vocabulary (given by `params_of`): every row a mask.
    "allowed": {"temperature": NEIGHBOUR_TEMPERATURE},
    # OpenAI's JSON mode (a guide, given by `params_of`): each row a mask of the JSON state.
    "guided": {"temperature": NEIGHBOUR_TEMPERATURE},
    # OpenAI's predicted outputs, a prediction its answer does not follow (given by
    # `params_of`: sonnets): its drafts are what the answer's last tokens match in it.
    "mispredicted": {"temperature": NEIGHBOUR_TEMPERATURE},
}
PREDICTION_CHARACTERS = 4000  # of the sonnets: ~1,000 tokens
STOP_IDS = 1024


def params_of(kind: str, tokenizer: Tokenizer, vocab_size: int) -> dict:
    """A neighbour's sampling fields: KINDS's, the ids of "stop-ids" and "allowed", the
    guide of "guided" and the prediction of "mispredicted"."""
    if kind == "guided":
        return KINDS[kind] | {"guide": GuideCache(tokenizer).guide(StructuredOutput("json_object"))}
    if kind == "allowed":
        return KINDS[kind] | {"allowed_token_ids": tuple(range(0, vocab_size, 2))}
    if kind == "mispredicted":
        sonnets = SONNETS_PATH.read_text()[:PREDICTION_CHARACTERS]
        return KINDS[kind] | {"prediction": PredictedText(tokenizer.encode(sonnets, add_special_tokens=False))}
    if kind != "stop-ids":
        return KINDS[kind]
    # Byte-pair merges are numbered as learnt, so the last ones before the special tokens are the rarest.
    return KINDS[kind] | {"stop_token_ids": tuple(range(vocab_size - 2 * STOP_IDS, vocab_size - STOP_IDS))}


def greedy_speed(engine, prompts: list[list[int]], neighbour: list[int], fields: dict, tokens: int) -> float:
    """Output tokens a second of the greedy requests beside one neighbour sampling with `fields`."""
    greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(prompt, greedy) for prompt in prompts]
    other = engine.add_request(neighbour, SamplingParams(max_tokens=4 * tokens, ignore_eos=True, **fields))
    while not all(s.prefilled for s in [*seqs, other]):
        engine.step()
    done = sum(s.num_output_tokens for s in seqs)
    started = time.perf_counter()
    while not all(s.finished for s in seqs):
        engine.step()
    if engine.target.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    if other.finished:  # the rest of the window ran without it
        print(f"warning: the neighbour {fields} stopped ({other.finish_reason}) before the greedy requests finished")
    engine.finish(other.seq_id)
    return (sum(s.num_output_tokens for s in seqs) - done) / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument(
        "--draft",
        default="qwen2.5-coder-0.5b",
        help="the proposer under adaptive k: a draft model, ngram, or a head (NAME or METHOD:FOLDER); '' for none",
    )
    parser.add_argument("--quantization", default="int4", choices=("none", "int8", "int4"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--greedy", type=int, default=3, help="greedy requests (open-ended prompts, cycled)")
    parser.add_argument("--tokens", type=int, default=96, help="each greedy request's output")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json-out", default=None, help="write the rows to this file too")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or "greedy" not in kinds:
        parser.error(f"--kinds takes {', '.join(KINDS)}, greedy among them; got {args.kinds!r}")

    device = resolve_device(args.device)
    spec = SpecConfig.parse(proposer_config(args.draft)) if args.draft else None  # adaptive k
    dtype = torch.bfloat16 if args.quantization != "none" or device.type == "cuda" else torch.float32
    engine, tokenizer = build_engine(
        args.target, spec, dtype=dtype, quantization=args.quantization, device=device, max_num_seqs=args.greedy + 1
    )
    open_ended = list(SUITES["open-ended"].values())
    prompts = [encode_prompt(tokenizer, chat=open_ended[i % len(open_ended)]) for i in range(args.greedy)]
    neighbour = encode_prompt(tokenizer, chat=SUITES["structured"]["code"])
    fields = {kind: params_of(kind, tokenizer, engine.target.config.vocab_size) for kind in kinds}
    greedy_speed(engine, prompts, neighbour, fields["greedy"], min(args.tokens, 16))  # warm-up
    speeds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            speeds[kind].append(greedy_speed(engine, prompts, neighbour, fields[kind], args.tokens))

    print(f"{args.greedy} greedy requests beside one neighbour, {args.tokens} tokens, {args.rounds} rounds")
    print(f"{'neighbour':<10} {'greedy tok/s (median)':>22} {'vs greedy neighbour':>20} {'range':>14}")
    rows = []
    for kind in kinds:
        ratios = [s / g for s, g in zip(speeds[kind], speeds["greedy"])]  # round by round
        median, ratio = statistics.median(speeds[kind]), statistics.median(ratios)
        print(f"{kind:<10} {median:>22.1f} {ratio:>19.2f}x {min(ratios):>6.2f}-{max(ratios):.2f}x")
        rows.append({"kind": kind, "tokens_per_s": median, "ratio": ratio, "ratios": ratios})
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
