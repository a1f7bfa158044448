"""What adaptive k costs the host a step, by batch size: no model, the policy alone.

Every step a batch drafts brings news (its acceptance), so the next step's k is priced
again: `choose` weighs each horizon's ks for the whole batch (`AdaptiveSpecLength.best`),
then `record` takes each sequence's outcome. On a GPU that host time adds to a step of a
few milliseconds; on a CPU to one of tens. The costs are a fixed synthetic machine (a
plain step of 2 ms, 2% more a verified row, a draft position a tenth of a step) and the
acceptance a seeded coin at `--rate` a position, so most steps draft (fewer as the batch
grows, its verified rows dearer): the figure is the price of the drafting steps' choices.

    .venv/bin/python benchmarks/adaptive_host.py
    .venv/bin/python benchmarks/adaptive_host.py --batches 1,8,32,64 --steps 400
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.spec.adaptive import AdaptiveSpecLength  # noqa: E402


def priced(max_k: int, batch: int) -> AdaptiveSpecLength:
    """A controller whose every row count a step of `batch` sequences may verify is measured."""
    adaptive = AdaptiveSpecLength(max_k, prior_draft_cost_ratio=0.1)
    for _ in range(3):
        for rows in range(batch, batch * (max_k + 1) + 1):
            adaptive.observe_target(rows, 0.002 * (1 + 0.02 * (rows - 1)))
        for positions in (1, 3, 7):
            adaptive.observe_draft(positions, 0.0002 * (1 + positions))
    return adaptive


def host_seconds(batch: int, max_k: int, rate: float, steps: int, seed: int) -> tuple[float, float, float]:
    """Median seconds a step of `choose`, and of the batch's `record`s; mean k chosen."""
    adaptive = priced(max_k, batch)
    rng = random.Random(seed)
    ids = list(range(batch))
    choosing, recording, ks_chosen = [], [], []
    for _ in range(steps):
        started = time.perf_counter()
        ks = adaptive.choose(ids)
        choosing.append(time.perf_counter() - started)
        accepted = []
        for k in ks:
            n = 0
            while n < k and rng.random() < rate:
                n += 1
            accepted.append(n)
        started = time.perf_counter()
        for seq_id, k, n in zip(ids, ks, accepted):
            adaptive.record(seq_id, k, n)
        recording.append(time.perf_counter() - started)
        ks_chosen.extend(ks)
    return statistics.median(choosing), statistics.median(recording), statistics.fmean(ks_chosen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=lambda v: [int(b) for b in v.split(",")], default=[1, 8, 32])
    parser.add_argument("--max-k", type=int, default=15, help="max_speculative_tokens")
    parser.add_argument("--rate", type=float, default=0.8, help="each position's chance to be accepted")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"max_k {args.max_k}, acceptance {args.rate} a position, medians of {args.steps} drafting steps")
    print("| batch | choose (µs a step) | record (µs a step) | mean k |")
    print("|---:|---:|---:|---:|")
    for batch in args.batches:
        choosing, recording, mean_k = host_seconds(batch, args.max_k, args.rate, args.steps, args.seed)
        print(f"| {batch} | {choosing * 1e6:.0f} | {recording * 1e6:.0f} | {mean_k:.1f} |")


if __name__ == "__main__":
    main()
