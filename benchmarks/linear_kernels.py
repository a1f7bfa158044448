"""float32 and bfloat16 linear layers on the CPU: our kernel against PyTorch's best, side by side.

PyTorch's best is oneDNN's packed layers for float32 (`PackedLinear`) and `F.linear` for
bfloat16 (oneDNN too, on the weights as they are). Two measurements, each taking turns
between the kernels in one process (the machines are shared and noisy: only the ratios
of one run compare):

- layers: every linear layer shape of the target, at 1, 2, 4, 8, 16, 64, 200 rows (a
  decode step, verifications of k drafts, a prompt), GB/s of weights and the ratio of
  our time to PyTorch's;
- steps: the real target's forward pass of 1 row (a plain decode step), of 8 rows
  attending one at a time (verifying k = 7 drafts) and of a 200-token prompt (scoring
  its last row, as the engine does), the layers swapped in place.

    .venv/bin/python benchmarks/linear_kernels.py                       # the default target, float32, both
    .venv/bin/python benchmarks/linear_kernels.py --dtype bfloat16 --only layers --rows 1,8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.catalogue import load_model  # noqa: E402
from specserve.model import native  # noqa: E402
from specserve.model.decoder import FloatLinear, PackedLinear, Segment, linear_of  # noqa: E402


def median_seconds(call, reps: int) -> float:
    call()  # warm: first-touch of pages, oneDNN's primitive cache
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def pytorchs(ours: FloatLinear) -> nn.Module:
    """PyTorch's fastest layer on the same weights: oneDNN's packed copy for float32
    (a second copy of the weights), `F.linear` on the very tensors for bfloat16."""
    plain = linear_of(ours.weight, ours.bias)
    return PackedLinear(plain) if ours.weight.dtype == torch.float32 else plain


def bench_layers(decoder, rows_list: list[int], rounds: int) -> None:
    shapes: dict[tuple[int, int], FloatLinear] = {}
    for module in decoder.modules():
        if isinstance(module, FloatLinear):
            shapes.setdefault(tuple(module.weight.shape), module)
    print(f"{'layer [out, in]':>18} {'rows':>5} {'ours GB/s':>10} {'PyTorch GB/s':>13} {'ours/PyTorch time':>18}")
    for shape, ours in shapes.items():
        theirs = pytorchs(ours)
        nbytes = ours.weight.numel() * ours.weight.element_size()
        for rows in rows_list:
            x = torch.randn(rows, shape[1], dtype=ours.weight.dtype)
            reps = max(3, int(0.2 / (nbytes / 30e9)))  # ~0.2 s of streaming a round
            ratios, ours_s, theirs_s = [], [], []
            with torch.inference_mode():
                for _ in range(rounds):
                    a = median_seconds(lambda: ours(x), reps)
                    b = median_seconds(lambda: theirs(x), reps)  # noqa: F821 (deleted after the rows)
                    ours_s.append(a), theirs_s.append(b), ratios.append(a / b)
            print(
                f"{str(list(shape)):>18} {rows:>5} {nbytes / statistics.median(ours_s) / 1e9:>10.1f} "
                f"{nbytes / statistics.median(theirs_s) / 1e9:>13.1f} {statistics.median(ratios):>12.2f} "
                f"({min(ratios):.2f}-{max(ratios):.2f})",
                flush=True,
            )
        del theirs


STEP_ROWS = {1: "a decode step (1 row)", 8: "verifying 7 drafts (8 rows)", 200: "a prompt (200 rows)"}


def bench_steps(decoder, rounds: int) -> None:
    ours = [
        (parent, name, child)
        for parent in decoder.modules()
        for name, child in parent.named_children()
        if isinstance(child, FloatLinear)
    ]
    theirs = [pytorchs(child) for _, _, child in ours]

    def use(kind: str) -> None:
        for (parent, name, child), other in zip(ours, theirs):
            setattr(parent, name, child if kind == "ours" else other)
        # a bfloat16 model on our kernels decodes every block in one C call (`Decoder.model_in_c`),
        # which holds pointers to our layers' weights: PyTorch's layers go without it
        if kind == "ours":
            vars(decoder).pop("model_in_c", None)
        else:
            decoder.model_in_c = lambda: None

    prompt = torch.randint(0, 1000, (100,), generator=torch.Generator().manual_seed(0))
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for kind in ("ours", "PyTorch"):
                use(kind)
                for rows in STEP_ROWS:
                    cache = decoder.new_cache()
                    decoder(prompt, [Segment(cache, len(prompt))])
                    new = torch.randint(0, 1000, (rows,))
                    scored = torch.arange(rows) if rows <= 8 else torch.tensor([rows - 1])  # a prompt: its last row
                    step = lambda: decoder(  # noqa: E731
                        new, [Segment(cache, rows, one_query_at_a_time=rows <= 8)], logits_rows=scored
                    )
                    # each call appends to the cache: 6 calls stay far from its end
                    times.setdefault((kind, rows), []).append(median_seconds(step, 5))
    use("ours")
    for rows, what in STEP_ROWS.items():
        ratios = [a / b for a, b in zip(times[("ours", rows)], times[("PyTorch", rows)])]
        print(
            f"{what}: ours {statistics.median(times[('ours', rows)]) * 1e3:.1f} ms, PyTorch "
            f"{statistics.median(times[('PyTorch', rows)]) * 1e3:.1f} ms, ours/PyTorch "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f} over {rounds} rounds)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalogue name or folder")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--only", choices=("layers", "steps"))
    parser.add_argument("--rows", default="1,2,4,8,16,64,200", help="activation rows per layer call")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if not FloatLinear.available(dtype) or (dtype == torch.float32 and not PackedLinear.available(dtype)):
        sys.exit(f"needs our kernels ({native.unavailable_reason() or 'available'}) and oneDNN in this PyTorch")
    decoder = load_model(args.target, dtype=dtype).decoder  # FloatLinear layers
    dot = ", vdpbf16ps" if dtype == torch.bfloat16 and native.has_bf16_dot() else ""
    print(f"{args.target}, {args.dtype}{dot}, {torch.get_num_threads()} threads")
    if args.only in (None, "layers"):
        bench_layers(decoder, [int(r) for r in args.rows.split(",")], args.rounds)
    if args.only in (None, "steps"):
        bench_steps(decoder, args.rounds)


if __name__ == "__main__":
    main()
