"""float32 linear layers on the CPU: our kernel against oneDNN's packed layers, side by side.

Two measurements, each taking turns between the kernels in one process (the machines
are shared and noisy: only the ratios of one run compare):

- layers: every linear layer shape of the target, at 1, 2, 4, 8, 16, 64, 200 rows (a
  decode step, verifications of k drafts, a prompt), GB/s of weights and the ratio of
  our time to oneDNN's;
- steps: the real target's forward pass of 1 row (a plain decode step), of 8 rows
  attending one at a time (verifying k = 7 drafts) and of 200 rows (a prompt), the
  layers swapped in place.

    .venv/bin/python benchmarks/linear_kernels.py                       # the default target, both
    .venv/bin/python benchmarks/linear_kernels.py --only layers --rows 1,8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.model import native  # noqa: E402
from specserve.model.decoder import FloatLinear, PackedLinear, Segment, linear_of  # noqa: E402
from specserve.models import load_model  # noqa: E402


def median_seconds(call, reps: int) -> float:
    call()  # warm: first-touch of pages, oneDNN's primitive cache
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench_layers(decoder, rows_list: list[int], rounds: int) -> None:
    shapes: dict[tuple[int, int], FloatLinear] = {}
    for module in decoder.modules():
        if isinstance(module, FloatLinear):
            shapes.setdefault(tuple(module.weight.shape), module)
    print(f"{'layer [out, in]':>18} {'rows':>5} {'ours GB/s':>10} {'oneDNN GB/s':>12} {'ours/oneDNN time':>17}")
    for shape, ours in shapes.items():
        packed = PackedLinear(linear_of(ours.weight, ours.bias))
        nbytes = ours.weight.numel() * 4
        for rows in rows_list:
            x = torch.randn(rows, shape[1])
            reps = max(3, int(0.2 / (nbytes / 30e9)))  # ~0.2 s of streaming a round
            ratios, ours_s, packed_s = [], [], []
            for _ in range(rounds):
                a = median_seconds(lambda: ours(x), reps)
                b = median_seconds(lambda: packed(x), reps)
                ours_s.append(a), packed_s.append(b), ratios.append(a / b)
            print(f"{str(list(shape)):>18} {rows:>5} {nbytes / statistics.median(ours_s) / 1e9:>10.1f} "
                  f"{nbytes / statistics.median(packed_s) / 1e9:>12.1f} {statistics.median(ratios):>11.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f})", flush=True)
        del packed


STEP_ROWS = {1: "a decode step (1 row)", 8: "verifying 7 drafts (8 rows)", 200: "a prompt (200 rows)"}


def bench_steps(decoder, rounds: int) -> None:
    ours = [(parent, name, child) for parent in decoder.modules() for name, child in parent.named_children()
            if isinstance(child, FloatLinear)]
    packed = [PackedLinear(linear_of(child.weight, child.bias)) for _, _, child in ours]  # a second copy of the weights

    def use(kind: str) -> None:
        for (parent, name, child), other in zip(ours, packed):
            setattr(parent, name, child if kind == "ours" else other)

    prompt = torch.randint(0, 1000, (100,), generator=torch.Generator().manual_seed(0))
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for kind in ("ours", "oneDNN"):
                use(kind)
                for rows in STEP_ROWS:
                    cache = decoder.new_cache()
                    decoder(prompt, [Segment(cache, len(prompt))])
                    new = torch.randint(0, 1000, (rows,))
                    step = lambda: decoder(new, [Segment(cache, rows, one_query_at_a_time=rows > 1)])  # noqa: E731
                    # each call appends to the cache: 6 calls stay far from its end
                    times.setdefault((kind, rows), []).append(median_seconds(step, 5))
    use("ours")
    for rows, what in STEP_ROWS.items():
        ratios = [a / b for a, b in zip(times[("ours", rows)], times[("oneDNN", rows)])]
        print(f"{what}: ours {statistics.median(times[('ours', rows)]) * 1e3:.1f} ms, oneDNN "
              f"{statistics.median(times[('oneDNN', rows)]) * 1e3:.1f} ms, ours/oneDNN "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f} over {rounds} rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalogue name or folder")
    parser.add_argument("--only", choices=("layers", "steps"))
    parser.add_argument("--rows", default="1,2,4,8,16,64,200", help="activation rows per layer call")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not FloatLinear.available(torch.float32) or not PackedLinear.available(torch.float32):
        sys.exit(f"needs our kernels ({native.unavailable_reason() or 'available'}) and oneDNN in this PyTorch")
    decoder = load_model(args.target).decoder  # float32: FloatLinear layers
    print(f"{args.target}, float32, {torch.get_num_threads()} threads")
    if args.only in (None, "layers"):
        bench_layers(decoder, [int(r) for r in args.rows.split(",")], args.rounds)
    if args.only in (None, "steps"):
        bench_steps(decoder, args.rounds)


if __name__ == "__main__":
    main()
