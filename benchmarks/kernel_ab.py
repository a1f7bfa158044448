"""Two builds of our CPU kernels taking turns, each in processes of its own: is a kernel
change faster?

On a shared machine the memory's speed moves by 30-70% from minute to minute, more
than most kernel changes are worth, so the builds take turns, round by round (the order
alternating), and each round gives a ratio: the ratios' median and range are what to
quote. A round runs each build in a fresh process that loads the model, runs every
linear layer in a forward's order (so that each layer's weights come from memory, as
in a decode step) `--passes` times per row count, and reports the median. Two builds
loaded into one process are not a fair comparison: the same sources built twice and
taking turns in one process measure several percent apart at 8 rows
(benchmarks/EXPERIMENTS.md, "kernel_ab.py: each build in processes of its own").

With `--forward` a process times whole forwards instead, as a verification runs them
(every block in one `decode_blocks` call where the model is on our kernels, then the
head, after 100 cached tokens): the path that serves, with its own buffers. The two
can disagree, because a layer's speed can depend on where its buffers sit
(benchmarks/EXPERIMENTS.md, "kernel_ab.py --forward: where the buffers sit").

The outputs must be identical bit for bit (a kernel change that moves a result is not
a speed change): each process reports a digest of its outputs, and the script says so
when two builds' digests differ.

A build is a git revision (its specserve/model/kernels/) or a folder holding the kernel
sources; the default compares HEAD with the working tree.

    .venv/bin/python benchmarks/kernel_ab.py                                   # int4 target, HEAD vs working tree
    .venv/bin/python benchmarks/kernel_ab.py --a 1fe63ee --b HEAD --rows 1,8 --rounds 8
    .venv/bin/python benchmarks/kernel_ab.py --quantization none --dtype bfloat16 --rows 1,4
    .venv/bin/python benchmarks/kernel_ab.py --forward --rows 1,8,16
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
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

from specserve.catalogue import load_model  # noqa: E402
from specserve.model import native  # noqa: E402
from specserve.model.decoder import FloatLinear, Segment  # noqa: E402
from specserve.model.footprint import weight_bytes_per_token  # noqa: E402
from specserve.model.quant import QuantizedLinear  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KERNELS_IN_REPO = "specserve/model/kernels"


def kernel_sources(build: str, into: Path) -> Path:
    """The folder of kernel sources for `build`: a folder as given, or a git revision's
    kernels extracted under `into`."""
    if build == "worktree":
        return native.KERNELS
    if Path(build).is_dir():
        return Path(build)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", build, KERNELS_IN_REPO], capture_output=True, check=False
    )
    if archive.returncode != 0:
        sys.exit(f"kernel_ab: {build!r} is neither a folder nor a git revision here: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.11.4
        tar.extractall(into / build.replace("/", "_"), **safe)
    return into / build.replace("/", "_") / KERNELS_IN_REPO


def build_library(sources: Path, target: Path) -> Path:
    """Compile `sources` (a folder of kernel sources) into the library `target`."""
    native.compile_kernels(target, sorted(sources.glob("*.c")))
    return target


def linear_layers(decoder) -> list[tuple[torch.nn.Module, bool]]:
    """Every linear layer on our kernels, in a forward's order, and whether the decoder
    calls it gated (a SwiGLU's gate and up projections in one: `silu_and_mul`)."""
    gate_up = decoder.config.intermediate_size * 2
    return [
        (module, module.weight.shape[0] == gate_up)
        for module in decoder.modules()
        if isinstance(module, (QuantizedLinear, FloatLinear))
    ]


def in_features(layer: torch.nn.Module) -> int:
    return layer.in_features if isinstance(layer, QuantizedLinear) else layer.weight.shape[1]


@contextlib.contextmanager
def kernels_of(lib):
    """Within it, the model's layers run on `lib` (they find the kernels through
    native.library); afterwards on what they ran on before."""
    library = native.library
    native.library = lambda: lib
    try:
        yield
    finally:
        native.library = library


def run_layers(layers, inputs) -> tuple[float, list[torch.Tensor]]:
    """Seconds to run every layer once, and the outputs."""
    started = time.perf_counter()
    outputs = [layer.silu_and_mul(x) if gated else layer(x) for (layer, gated), x in zip(layers, inputs)]
    return time.perf_counter() - started, outputs


def digest(outputs: list[torch.Tensor]) -> str:
    """A digest of the outputs' shapes and bits (a NaN matches itself, -0.0 not 0.0)."""
    h = hashlib.sha256()
    for output in outputs:
        h.update(repr(tuple(output.shape)).encode())
        h.update(output.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def measure(lib, layers, rows: list[int], passes: int, dtype: torch.dtype) -> dict[int, tuple[float, str]]:
    """Per row count: the median seconds of `passes` runs of every layer on `lib`, and
    the outputs' digest. The inputs are seeded, so every process feeds the same ones."""
    results = {}
    with kernels_of(lib):
        for count in rows:
            generator = torch.Generator().manual_seed(count)
            inputs = [torch.randn(count, in_features(layer), generator=generator).to(dtype) for layer, _ in layers]
            _, outputs = run_layers(layers, inputs)  # also a warm-up
            seconds = [run_layers(layers, inputs)[0] for _ in range(passes)]
            results[count] = (statistics.median(seconds), digest(outputs))
    return results


FORWARD_CONTEXT = 100  # tokens cached before a --forward measurement


def measure_forwards(lib, decoder, rows: list[int], passes: int) -> dict[int, tuple[float, str]]:
    """Per row count: the median seconds of `passes` forwards of `count` tokens attending
    one at a time (a verification's forward) on `lib`, after FORWARD_CONTEXT cached
    tokens, and the logits' digest."""
    with kernels_of(lib):
        cache = decoder.new_cache()
        ids = torch.arange(FORWARD_CONTEXT, dtype=torch.int64) * 7 % decoder.config.vocab_size  # [context]
        decoder(ids, [Segment(cache, FORWARD_CONTEXT)], torch.tensor([FORWARD_CONTEXT - 1]))
        results = {}
        for count in rows:
            seconds, logits = [], None
            for _ in range(passes + 1):  # the first is a warm-up
                started = time.perf_counter()
                logits = decoder(ids[:count], [Segment(cache, count, one_query_at_a_time=True)], torch.arange(count))
                seconds.append(time.perf_counter() - started)
                cache.truncate(FORWARD_CONTEXT)
            results[count] = (statistics.median(seconds[1:]), digest([logits]))
    return results


def worker_command(library: Path, args: argparse.Namespace) -> list[str]:
    """The command line of one process measuring `library` (see `worker`)."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        str(library),
        "--target",
        args.target,
        "--quantization",
        args.quantization,
        "--rows",
        args.rows,
        "--passes",
        str(args.passes),
    ]
    return command + (["--dtype", args.dtype] if args.dtype else []) + (["--forward"] if args.forward else [])


def run_worker(command: list[str]) -> dict[int, tuple[float, str]]:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"kernel_ab: a measuring process failed:\n{done.stderr[-2000:]}")
    return {
        int(rows): (seconds, digest) for rows, (seconds, digest) in json.loads(done.stdout.splitlines()[-1]).items()
    }


def compare(
    commands: dict[str, list[str]], rounds: int, run=run_worker
) -> dict[int, dict[str, tuple[float, list[float]]]]:
    """Per row count, per build: the median seconds over the rounds, and each round's
    ratio to the first build's. Each round runs every build's command once, in turn, the
    order reversed every other round so that neither build always follows the other."""
    names = list(commands)
    times: dict[str, list[dict[int, tuple[float, str]]]] = {name: [] for name in names}
    for round_number in range(rounds):
        for name in names if round_number % 2 == 0 else names[::-1]:
            times[name].append(run(commands[name]))
    first = names[0]
    results: dict[int, dict[str, tuple[float, list[float]]]] = {}
    for rows in times[first][0]:
        for name in names:
            if any(r[rows][1] != times[first][0][rows][1] for r in times[name]):
                print(f"  rows {rows}: {name}'s outputs differ from {first}'s")
            seconds = [r[rows][0] for r in times[name]]
            ratios = [mine / theirs for mine, theirs in zip(seconds, (r[rows][0] for r in times[first]))]
            results.setdefault(rows, {})[name] = (statistics.median(seconds), ratios)
    return results


def model_decoder(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.dtype]:
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.quantization != "none" else "float32"))
    return load_model(args.target, dtype=dtype, quantization=args.quantization).decoder, dtype


def worker(args: argparse.Namespace) -> None:
    """One measuring process: prints {rows: [median seconds, digest]} as JSON."""
    decoder, dtype = model_decoder(args)
    rows, lib = [int(r) for r in args.rows.split(",")], native.load_library(Path(args.worker))
    if args.forward:
        results = measure_forwards(lib, decoder, rows, args.passes)
    else:
        results = measure(lib, linear_layers(decoder), rows, args.passes, dtype)
    print(json.dumps({str(count): list(result) for count, result in results.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="HEAD", help="git revision or folder of kernel sources (default HEAD)")
    parser.add_argument("--b", default="worktree", help="git revision or folder (default: the working tree's)")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalogue name or folder")
    parser.add_argument("--quantization", default="int4", choices=("none", "int8", "int4"))
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="default: bfloat16 with --quantization, else float32",
    )
    parser.add_argument("--rows", default="1,8", help="activation rows per layer call, comma-separated")
    parser.add_argument("--rounds", type=int, default=6, help="processes per build, taking turns")
    parser.add_argument("--passes", type=int, default=5, help="runs of every layer per process (the median counts)")
    parser.add_argument(
        "--forward",
        action="store_true",
        help="time whole forwards as verification runs them, not the layers one by one",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a measuring process: its library
    args = parser.parse_args()
    if (reason := native.unavailable_reason()) is not None:
        sys.exit(f"kernel_ab: our kernels cannot run here ({reason})")
    if args.worker:
        worker(args)
        return
    decoder, dtype = model_decoder(args)  # prepares a quantized model once, before the processes need it
    layers = linear_layers(decoder)
    weight_bytes, num_layers = sum(weight_bytes_per_token(layer) for layer, _ in layers), len(layers)
    del decoder, layers  # the measuring processes load their own: a float32 target is 7 GB a process
    scratch = Path(tempfile.mkdtemp(prefix="kernel-ab-"))
    try:
        builds = {f"a:{args.a}": args.a, f"b:{args.b}": args.b}
        commands = {
            name: worker_command(build_library(kernel_sources(build, scratch), scratch / f"{key}.so"), args)
            for key, (name, build) in zip("ab", builds.items())
        }
        print(
            f"{args.target}, {args.quantization}/{str(dtype).removeprefix('torch.')}, {num_layers} layers, "
            f"{weight_bytes / 1e6:.0f} MB, {torch.get_num_threads()} threads, {args.rounds} rounds of a process "
            f"per build taking turns, {args.passes} passes each"
            + (f", whole forwards after {FORWARD_CONTEXT} cached tokens" if args.forward else ", layer by layer")
        )
        for rows, result in compare(commands, args.rounds).items():
            for name, (seconds, ratios) in result.items():
                print(
                    f"rows {rows:>3} {name:>24}: {seconds * 1e3:7.1f} ms ({weight_bytes / seconds / 1e9:5.1f} GB/s), "
                    f"x{min(ratios):.3f}-{max(ratios):.3f}, median x{statistics.median(ratios):.3f} the time of a"
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
