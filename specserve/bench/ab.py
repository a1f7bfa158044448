"""`specserve ab`: a plain and a speculative deployment compared on one machine. Serve
the target plainly and with speculation on the same hardware and flags, run the same
benchmark workload against each, and compare.

Both servers are up at once and take turns, never serving at the same time: each test
case's requests go in `rounds` parts, each part to one server and then the other, the
order alternating by round (ABBA...), so a drift in the machine's pace (a CPU's memory
phase, a GPU's clocks) falls on both alike. With one round, or where the free memory
does not hold a second server beside the first, each server is started, benched and
stopped alone, one after the other.

Layout of `--results-dir` (default results/ab): `baseline/` and `speculative/` hold
`specserve bench` result files; `comparison/` holds comparison.md and the plots.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from specserve.bench import benchmark, compare, plots
from specserve.bench.local_server import ServerProcess
from specserve.bench.options import BenchOptions
from specserve.errors import ConfigError

VARIANTS = ("baseline", "speculative")
DEFAULT_ROUNDS = 4  # parts a test case's requests go in, where each keeps the concurrency busy
STARTUP_TIMEOUT_S = 1800  # a first start may prepare the models
# A second server's memory against the first's: the speculative server holds the same
# target and a draft (a float 0.5B draft beside a float 1.5B target: 1.3x).
SECOND_SERVER_SHARE = 1.5


def rounds_for(asked: int | None, num_requests: int, concurrency: int) -> int:
    """The rounds of a test case of num_requests: as asked, else DEFAULT_ROUNDS; never
    so many that a part holds fewer requests than the concurrency (its load would be lighter)."""
    most = max(1, num_requests // concurrency)
    if asked is None:
        return min(DEFAULT_ROUNDS, most)
    if asked < 1:
        raise ConfigError(f"--rounds must be >= 1, got {asked}")
    if asked > most:
        raise ConfigError(
            f"--rounds {asked} splits {num_requests} requests a test case into parts of fewer than "
            f"--num-concurrent-requests {concurrency}; lower --rounds to {most} or raise --max-num-completed-requests"
        )
    return asked


def start_server(target: str, serve_args: Sequence[str], variant: str) -> ServerProcess:
    print(f"[{variant}] starting specserve serve {target} {' '.join(serve_args)}", file=sys.stderr, flush=True)
    return ServerProcess(target, *serve_args, "--log-stats-interval", "0", startup_timeout_s=STARTUP_TIMEOUT_S)


def variant_options(
    options: BenchOptions, server: ServerProcess, target: str, variant: str, folder: Path
) -> BenchOptions:
    """options aimed at one of ab's own servers, its results in folder."""
    return dataclasses.replace(
        options,
        url=server.url,
        results_dir=folder,
        api_key=None,
        metadata={**options.metadata, "variant": variant},
        tokenizer=options.tokenizer or target,
    )


def report(variant: str, result: benchmark.BenchResult) -> None:
    print(f"[{variant}] {benchmark.describe(result)}", file=sys.stderr, flush=True)


def bench_alone(server: ServerProcess, target: str, options: BenchOptions, variant: str, folder: Path) -> None:
    """Bench one server into folder, every test case in full, and stop it."""
    try:
        for result in benchmark.run(variant_options(options, server, target, variant, folder)):
            report(variant, result)
    finally:
        server.stop()


def bench_in_turns(
    servers: dict[str, ServerProcess], target: str, options: BenchOptions, folders: dict[str, Path], rounds: int
) -> None:
    """Each test case's requests sent in `rounds` parts, each part to both servers in
    turn, the first of the two alternating by round."""
    aimed = {v: variant_options(options, servers[v], target, v, folders[v]) for v in VARIANTS}
    model, count_tokens, planned = benchmark.plan(aimed[VARIANTS[0]])
    for variant in VARIANTS[1:]:
        benchmark.check_server(aimed[variant])
    for variant in VARIANTS:
        if options.num_warmups:
            benchmark.warm_up(aimed[variant], planned[0][1][0], count_tokens)
    for workload, requests in planned:
        cases = {v: benchmark.TestCaseRun(aimed[v], workload, model, count_tokens) for v in VARIANTS}
        for r in range(rounds):
            part = requests[len(requests) * r // rounds : len(requests) * (r + 1) // rounds]
            for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                cases[variant].send(part)
        for variant in VARIANTS:
            report(variant, cases[variant].finish())


def room_for_another(server: ServerProcess) -> bool:
    """Whether this machine's free memory holds a second server beside `server`:
    SECOND_SERVER_SHARE of its resident memory (a speculative server holds the same
    target and a draft). True where Linux's /proc does not tell."""
    try:
        resident = _kib(Path(f"/proc/{server.process.pid}/status"), "VmRSS:")
        available = _kib(Path("/proc/meminfo"), "MemAvailable:")
    except (OSError, ValueError, StopIteration):
        return True
    return available >= SECOND_SERVER_SHARE * resident


def _kib(path: Path, key: str) -> int:
    line = next(line for line in path.read_text().splitlines() if line.startswith(key))
    return int(line.split()[1])


def write_comparison(
    results_dirs: Sequence[Path | str], output_dir: str | Path | None = None, names: list[str] | None = None
) -> tuple[str, list[Path]]:
    """compare's Markdown (also written to comparison.md) and the plots; the files written."""
    variants = compare.load_variants(list(results_dirs), names)
    folder = compare.prepare_output_dir(output_dir, results_dirs[0])
    markdown = compare.to_markdown(compare.build_comparison(variants))
    report = folder / compare.REPORT_NAME
    report.write_text(markdown)
    return markdown, [report, *plots.write_plots(variants, folder)]


def run_ab(
    target: str,
    speculative_config: str,
    serve_args: Sequence[str],
    options: BenchOptions,
    results_root: Path,
    rounds: int | None = None,
) -> list[Path]:
    """Bench the baseline and the speculative server (`rounds`: see `rounds_for`), in
    turns where the memory holds both, else one after the other; their result folders."""
    rounds = rounds_for(rounds, options.max_num_completed_requests, options.num_concurrent_requests)
    args = {"baseline": list(serve_args), "speculative": [*serve_args, "--speculative-config", speculative_config]}
    folders = {variant: results_root / variant for variant in VARIANTS}
    for folder in folders.values():
        for old in folder.glob("*.json"):  # a folder holds one run: stale files would mix in
            old.unlink()
    servers: dict[str, ServerProcess] = {}
    try:
        servers["baseline"] = start_server(target, args["baseline"], "baseline")
        if rounds > 1 and not room_for_another(servers["baseline"]):
            print(
                "[ab] the free memory does not hold both servers: each is benched alone, one after the other",
                file=sys.stderr,
                flush=True,
            )
            rounds = 1
        if rounds == 1:
            bench_alone(servers["baseline"], target, options, "baseline", folders["baseline"])
            servers["speculative"] = start_server(target, args["speculative"], "speculative")
            bench_alone(servers["speculative"], target, options, "speculative", folders["speculative"])
        else:
            servers["speculative"] = start_server(target, args["speculative"], "speculative")
            bench_in_turns(servers, target, options, folders, rounds)
    finally:
        for server in servers.values():
            server.stop()
    return [folders[variant] for variant in VARIANTS]
