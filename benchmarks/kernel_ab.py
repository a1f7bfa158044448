"""Two builds of our CPU kernels side by side in one process: is a kernel change faster?

On a shared machine the memory's speed moves by 30-70% from minute to minute, more
than most kernel changes are worth, and two processes run minutes apart measure the
neighbours. Here both builds are loaded into one process (ctypes) and take turns, round
by round, running every linear layer of a model in a forward's order (so that each
layer's weights come from memory, as in a decode step); each round gives a ratio, and
the ratios' median and range are what to quote. The outputs must be identical bit for
bit (a kernel change that moves a result is not a speed change); the script says so
when they are not.

A build is a git revision (its specserve/model/kernels/) or a folder holding the kernel
sources; the default compares HEAD with the working tree.

    .venv/bin/python benchmarks/kernel_ab.py                                   # int4 target, HEAD vs working tree
    .venv/bin/python benchmarks/kernel_ab.py --a 1fe63ee --b HEAD --rows 1,8 --rounds 8
    .venv/bin/python benchmarks/kernel_ab.py --quantization none --dtype bfloat16 --rows 1,4
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.model import native  # noqa: E402
from specserve.model.decoder import FloatLinear  # noqa: E402
from specserve.model.footprint import weight_bytes_per_token  # noqa: E402
from specserve.model.quant import QuantizedLinear  # noqa: E402
from specserve.models import load_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KERNELS_IN_REPO = "specserve/model/kernels"


def kernel_sources(build: str, into: Path) -> Path:
    """The folder of kernel sources for `build`: a folder as given, or a git revision's
    kernels extracted under `into`."""
    if build == "worktree":
        return native.KERNELS
    if Path(build).is_dir():
        return Path(build)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", build, KERNELS_IN_REPO],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        sys.exit(f"kernel_ab: {build!r} is neither a folder nor a git revision here: "
                 f"{archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.11.4
        tar.extractall(into / build.replace("/", "_"), **safe)
    return into / build.replace("/", "_") / KERNELS_IN_REPO


def build_library(sources: Path, target: Path):
    native.compile_kernels(target, sorted(sources.glob("*.c")))
    return native.load_library(target)


def linear_layers(decoder) -> list[tuple[torch.nn.Module, bool]]:
    """Every linear layer on our kernels, in a forward's order, and whether the decoder
    calls it gated (a SwiGLU's gate and up projections in one: `silu_and_mul`)."""
    gate_up = decoder.config.intermediate_size * 2
    return [(module, module.weight.shape[0] == gate_up) for module in decoder.modules()
            if isinstance(module, (QuantizedLinear, FloatLinear))]


def in_features(layer: torch.nn.Module) -> int:
    return layer.in_features if isinstance(layer, QuantizedLinear) else layer.weight.shape[1]


def run_layers(lib, layers, inputs) -> tuple[float, list[torch.Tensor]]:
    """Seconds to run every layer once on `lib`'s kernels, and the outputs."""
    native.library = lambda: lib  # the layers find the kernels through it
    started = time.perf_counter()
    outputs = [layer.silu_and_mul(x) if gated else layer(x) for (layer, gated), x in zip(layers, inputs)]
    return time.perf_counter() - started, outputs


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (a NaN equals itself, -0.0 does not equal 0.0)."""
    as_ints = {2: torch.int16, 4: torch.int32}
    return a.shape == b.shape and torch.equal(a.view(as_ints[a.element_size()]), b.view(as_ints[b.element_size()]))


def compare(libraries: dict, layers, rows: int, rounds: int, dtype: torch.dtype) -> dict:
    """Median seconds per build, and each build's per-round ratio to the first."""
    inputs = [torch.randn(rows, in_features(layer), dtype=dtype) for layer, _ in layers]
    library = native.library
    first = next(iter(libraries))
    times: dict[str, list[float]] = {name: [] for name in libraries}
    try:
        outputs = {name: run_layers(lib, layers, inputs)[1] for name, lib in libraries.items()}  # also a warm-up
        for name, theirs in outputs.items():
            if not all(map(same_bits, outputs[first], theirs)):
                print(f"  {name}: outputs differ from {first}'s")
        for _ in range(rounds):
            for name, lib in libraries.items():
                times[name].append(run_layers(lib, layers, inputs)[0])
    finally:
        native.library = library
    return {name: (statistics.median(seconds), [b / a for a, b in zip(times[first], seconds)])
            for name, seconds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="HEAD", help="git revision or folder of kernel sources (default HEAD)")
    parser.add_argument("--b", default="worktree", help="git revision or folder (default: the working tree's)")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalogue name or folder")
    parser.add_argument("--quantization", default="int4", choices=("none", "int8", "int4"))
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                        help="default: bfloat16 with --quantization, else float32")
    parser.add_argument("--rows", default="1,8", help="activation rows per layer call, comma-separated")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    if (reason := native.unavailable_reason()) is not None:
        sys.exit(f"kernel_ab: our kernels cannot run here ({reason})")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.quantization != "none" else "float32"))
    decoder = load_model(args.target, dtype=dtype, quantization=args.quantization).decoder
    layers = linear_layers(decoder)
    weight_bytes = sum(weight_bytes_per_token(layer) for layer, _ in layers)
    scratch = Path(tempfile.mkdtemp(prefix="kernel-ab-"))
    try:
        names = {"a": args.a, "b": args.b}
        libraries = {f"{key}:{build}": build_library(kernel_sources(build, scratch), scratch / f"{key}.so")
                     for key, build in names.items()}
        print(f"{args.target}, {args.quantization}/{str(dtype).removeprefix('torch.')}, {len(layers)} layers, "
              f"{weight_bytes / 1e6:.0f} MB, {torch.get_num_threads()} threads, {args.rounds} rounds taking turns")
        for rows in (int(r) for r in args.rows.split(",")):
            result = compare(libraries, layers, rows, args.rounds, dtype)
            for name, (seconds, ratios) in result.items():
                print(f"rows {rows:>3} {name:>24}: {seconds * 1e3:7.1f} ms ({weight_bytes / seconds / 1e9:5.1f} GB/s), "
                      f"x{min(ratios):.3f}-{max(ratios):.3f}, median x{statistics.median(ratios):.3f} the time of a")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
