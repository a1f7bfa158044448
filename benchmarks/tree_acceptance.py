"""What a tree of an EAGLE head's guesses would accept, against its chain, at temperature 0.

A chain drafts one guess a position; a tree (EAGLE-2, SpecInfer) drafts the head's top
few at each position, so the target's token is found more often, at the price of more
verified rows. Whether that pays depends on what a row costs (a fifth of a plain step
on our CPU kernels, a few hundredths on a GPU at small batch) and on how often the
head's second or fourth guess is the target's. This measures the second: the target
decodes each suite prompt greedily, then, at every output position, the head walks a
static tree (`--trees`: the branching at each depth, `4,1,1` being the top 4 guesses
at depth 1, each followed by a chain of 2) along the target's own tokens, exactly as a
greedy verifier would accept it. It reports each tree's mean acceptance length (tokens
a step: the accepted guesses plus the target's own), its node count (the rows it adds
to a verification), and how often the target's first token is among the head's top k.

No figure here is a speed, and no drafting code of the engine runs: the head is stepped
directly, so this needs no tree support in the engine.

    .venv/bin/python benchmarks/tree_acceptance.py                      # the catalogue's EAGLE-3 head
    .venv/bin/python benchmarks/tree_acceptance.py --trees 1,1,1,1,1 --trees 2,2,1 --max-tokens 64
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specserve.bench.suites import SUITES  # noqa: E402
from specserve.config import SpecConfig  # noqa: E402
from specserve.engine.build import build_engine, encode_prompt, run_one  # noqa: E402
from specserve.model.decoder import Segment  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.spec.heads.eagle import EagleHead  # noqa: E402

DEFAULT_TREES = ("1,1,1", "2,1,1", "4,1,1", "8,1,1", "2,2,1", "4,2,1,1")
TOP_KS = (1, 2, 4, 8)


def parse_tree(text: str) -> tuple[int, ...]:
    branching = tuple(int(b) for b in text.split(","))
    if not branching or min(branching) < 1:
        raise argparse.ArgumentTypeError(f"a tree is branching factors >= 1 by depth, e.g. 4,1,1; got {text!r}")
    return branching


def nodes(tree: tuple[int, ...]) -> int:
    """Guesses the tree drafts: the rows it adds to a verification."""
    return sum(math.prod(tree[: d + 1]) for d in range(len(tree)))


@torch.inference_mode()
def walk(head: EagleHead, cache, hidden: torch.Tensor, wanted: list[int], tree: tuple[int, ...]) -> int:
    """How many of `wanted` (the target's next tokens) a greedy verifier accepts from the
    tree drafted after `hidden` [1, H]: at each depth the target's token must be among the
    head's top tree[d] guesses under the path accepted so far. Feeds the accepted path
    into `cache` (the caller truncates it)."""
    accepted = 0
    for depth, width in enumerate(tree):
        if depth >= len(wanted):
            break
        top = head.to_target_ids(head.draft_logits(hidden).topk(width, dim=-1).indices[0]).tolist()
        if wanted[depth] not in top:
            break
        accepted += 1
        if depth + 1 < len(tree):
            hidden = head(torch.tensor([wanted[depth]], device=head.device), hidden, [Segment(cache, 1)])
    return accepted


@torch.inference_mode()
def measure(proposer, target, prompt_ids: list[int], output: list[int], trees: list[tuple[int, ...]]) -> dict:
    """Per tree, the accepted guesses at each output position; and the rank of the target's
    first token among the head's guesses (len(draft vocabulary) where it has none)."""
    head: EagleHead = proposer.head
    ids = prompt_ids + output
    fed = len(ids) - 1
    capture = proposer.features.new_capture()
    target(torch.tensor(ids[:-1]), [Segment(target.new_cache(), fed)], torch.tensor([fed - 1]), capture=capture)
    features = capture.layer_inputs if capture.layers else capture.final_hidden  # [fed, F]
    pairs = len(ids) - 2  # pair p: (the target's feature of p, token p + 1)
    cache = head.new_cache()
    read = head(torch.tensor(ids[1:-1]), head.project_target_features(features[:pairs]), [Segment(cache, pairs)])
    first = len(prompt_ids)
    accepted = {tree: [] for tree in trees}
    ranks = []
    for i in range(len(output)):
        at = first + i - 1  # the chain for output i starts after pair at - 1; its first fed pair is at
        hidden = read[at - 1 : at]  # [1, H]
        order = head.to_target_ids(head.draft_logits(hidden).argsort(dim=-1, descending=True)[0])
        where = (order == output[i]).nonzero()
        ranks.append(int(where[0, 0]) if len(where) else len(order))
        for tree in trees:
            cache.truncate(at)
            accepted[tree].append(walk(head, cache, hidden, output[i:], tree))
        if at < pairs:  # the walks overwrote pair `at`, which the next position reads: read it again
            cache.truncate(at)
            head(
                torch.tensor(ids[at + 1 : at + 2]),
                head.project_target_features(features[at : at + 1]),
                [Segment(cache, 1)],
            )
    return {"accepted": accepted, "ranks": ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--head", default="eagle3:qwen2.5-coder-1.5b-eagle3", help="METHOD:NAME of an EAGLE head")
    parser.add_argument("--quantization", default="int4")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--trees", type=parse_tree, action="append", help="branching by depth (repeatable)")
    args = parser.parse_args()
    trees = args.trees or [parse_tree(t) for t in DEFAULT_TREES]
    method, _, name = args.head.partition(":")
    if method not in ("eagle3", "eagle"):
        raise SystemExit(f"--head takes an EAGLE head as METHOD:NAME (eagle3 or eagle), got {args.head!r}")
    spec = SpecConfig.parse({"method": method, "model": name, "num_speculative_tokens": 3})
    dtype = torch.bfloat16 if args.quantization != "none" else torch.float32
    engine, tokenizer = build_engine(args.target, spec, dtype, quantization=args.quantization)
    by_suite: dict[str, dict] = {}
    for suite, prompts in SUITES.items():
        totals = by_suite.setdefault(suite, {"accepted": {tree: [] for tree in trees}, "ranks": []})
        for prompt_name, text in prompts.items():
            prompt_ids = encode_prompt(tokenizer, chat=text)
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
            output = run_one(engine, tokenizer, prompt_ids, params)["token_ids"]
            found = measure(engine.proposer, engine.target, prompt_ids, output, trees)
            for tree in trees:
                totals["accepted"][tree] += found["accepted"][tree]
            totals["ranks"] += found["ranks"]
            print(f"{prompt_name}: {len(output)} tokens", file=sys.stderr)
    print(f"{args.head} on {args.target} ({args.quantization}), {args.max_tokens} tokens a prompt, temperature 0")
    print(
        "| suite | "
        + " | ".join(f"top-{k}" for k in TOP_KS)
        + " | "
        + " | ".join(f"{','.join(map(str, t))} ({nodes(t)})" for t in trees)
        + " |"
    )
    print("|---|" + "---:|" * (len(TOP_KS) + len(trees)))
    for suite, totals in by_suite.items():
        ranks = totals["ranks"]
        coverage = [sum(r < k for r in ranks) / len(ranks) for k in TOP_KS]
        lengths = [1 + sum(a) / len(a) for a in totals["accepted"].values()]
        print(
            f"| {suite} | "
            + " | ".join(f"{c:.3f}" for c in coverage)
            + " | "
            + " | ".join(f"{length:.2f}" for length in lengths)
            + " |"
        )


if __name__ == "__main__":
    main()
