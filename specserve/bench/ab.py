"""`specserve ab`: a plain and a speculative deployment compared on one machine. Serve
the target plainly, then with speculation, one after the other on the same hardware and
flags, run the same benchmark workload against each, and compare.

Layout of `--results-dir` (default results/ab): `baseline/` and `speculative/` hold
`specserve bench` result files; `comparison/` holds comparison.md and the plots.
The two servers never run at once, so neither measures the other's load.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from specserve.bench import benchmark, compare, plots
from specserve.bench.local_server import ServerProcess
from specserve.bench.options import BenchOptions

VARIANTS = ("baseline", "speculative")


def run_variant(
    target: str, serve_args: Sequence[str], options: BenchOptions, variant: str, results_dir: Path
) -> list[benchmark.BenchResult]:
    """Start `specserve serve target *serve_args`, bench it into results_dir, stop it."""
    print(f"[{variant}] starting specserve serve {target} {' '.join(serve_args)}", file=sys.stderr, flush=True)
    server = ServerProcess(target, *serve_args, "--log-stats-interval", "0", startup_timeout_s=1800)
    try:
        options = dataclasses.replace(
            options,
            url=server.url,
            results_dir=results_dir,
            api_key=None,
            metadata={**options.metadata, "variant": variant},
            tokenizer=options.tokenizer or target,
        )
        results = []
        for result in benchmark.run(options):
            print(f"[{variant}] {benchmark.describe(result)}", file=sys.stderr, flush=True)
            results.append(result)
        return results
    finally:
        server.stop()


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
    target: str, speculative_config: str, serve_args: Sequence[str], options: BenchOptions, results_root: Path
) -> list[Path]:
    """Bench the baseline and the speculative server; their result folders."""
    folders = []
    for variant, extra in zip(VARIANTS, ([], ["--speculative-config", speculative_config])):
        folder = results_root / variant
        for old in folder.glob("*.json"):  # a folder holds one run: stale files would mix in
            old.unlink()
        run_variant(target, [*serve_args, *extra], options, variant, folder)
        folders.append(folder)
    return folders
