"""`specserve compare`: load `specserve bench` result folders and tabulate them side by side.

A result folder is one variant (a server configuration); it holds, per test case,
`<name>_summary.json` (LLMPerf's flattened keys plus ours) and
`<name>_individual_responses.json` (one record per request, in start order). The first
folder is the baseline. Per test case (the union over the folders) the table shows each
variant's figures and, for every other variant, the change against the baseline in
percent: (variant - baseline) / baseline, so -35.0% on a latency is better and +35.0% on
throughput is better; the words "better" / "worse" say which. A figure that is absent
(a test case a variant did not run, spec figures of a server without speculation, a
zero baseline) shows as n/a, never as 0.

Everything read is checked on load: a file that breaks the contract is refused with a
ConfigError naming it, so rendering never meets a surprise.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from specserve.errors import ConfigError

SUMMARY_SUFFIX = "_summary.json"
RESPONSES_SUFFIX = "_individual_responses.json"
REPORT_NAME = "comparison.md"
NOT_AVAILABLE = "n/a"


@dataclass(frozen=True)
class Metric:
    """One row of the table: a summary key shown in the unit of its label."""

    label: str
    key: str
    scale: float = 1.0
    digits: int = 1
    better: Literal["lower", "higher"] | None = None  # None: a count, neither better nor worse
    optional: bool = False  # a key newer than some result files: missing reads as n/a


METRICS = (
    Metric("TTFT p50 (ms)", "results_ttft_s_quantiles_p50", scale=1000, better="lower"),
    # TTFT under load is bimodal (prefills queue behind each other): the median alone flips.
    Metric("TTFT mean (ms)", "results_ttft_s_mean", scale=1000, better="lower"),
    Metric("TTFT p90 (ms)", "results_ttft_s_quantiles_p90", scale=1000, better="lower"),
    Metric("TTFT p99 (ms)", "results_ttft_s_quantiles_p99", scale=1000, better="lower"),
    Metric("End-to-end latency p50 (s)", "results_end_to_end_latency_s_quantiles_p50", digits=3, better="lower"),
    Metric("End-to-end latency p99 (s)", "results_end_to_end_latency_s_quantiles_p99", digits=3, better="lower"),
    Metric("Output throughput (tok/s)", "results_mean_output_throughput_token_per_s", better="higher"),
    Metric("Inter-token latency p50 (ms)", "results_inter_token_latency_s_quantiles_p50", scale=1000, better="lower"),
    Metric("Inter-token latency p99 (ms)", "results_inter_token_latency_s_quantiles_p99", scale=1000, better="lower"),
    Metric("Mean output tokens", "results_number_output_tokens_mean"),
    Metric("Completed requests", "results_num_completed_requests", digits=0),
    Metric("Errors", "results_number_errors", digits=0, better="lower"),
    Metric("Acceptance rate", "results_spec_acceptance_rate", digits=3, better="higher"),
    Metric("Mean acceptance length", "results_spec_mean_acceptance_length", digits=2, better="higher"),
    Metric("Prefix cache hit rate", "results_prefix_cache_hit_rate", digits=3, better="higher", optional=True),
)

# Per-request fields the plots read; each a number, or null for a failed request.
RESPONSE_METRICS = ("ttft_s", "inter_token_latency_s", "end_to_end_latency_s")


@dataclass(frozen=True)
class TestCaseResult:
    summary: dict[str, Any]
    responses: list[dict[str, Any]]  # in start order


@dataclass(frozen=True)
class Variant:
    name: str
    results_dir: Path
    test_cases: dict[str, TestCaseResult]


@dataclass(frozen=True)
class Row:
    metric: Metric
    values: list[float | None]  # one per variant, in the metric's unit
    changes_pct: list[float | None]  # one per non-baseline variant


@dataclass(frozen=True)
class Comparison:
    variants: list[Variant]  # [0] is the baseline
    tables: dict[str, list[Row]]  # by test case


def load_variants(results_dirs: list[str | Path], names: list[str] | None = None) -> list[Variant]:
    """One Variant per folder, named by `names`, else by its summaries' "variant", else by the folder."""
    if len(results_dirs) < 2:
        raise ConfigError("compare needs at least two result folders: the baseline first, then the others")
    if names is not None and len(names) != len(results_dirs):
        raise ConfigError(f"--names gives {len(names)} names for {len(results_dirs)} result folders; give one each")
    if names is not None and not all(names):
        raise ConfigError("--names has an empty name; give one non-empty name per folder, e.g. --names plain,spec")
    variants = [load_variant(Path(d), names[i] if names else None) for i, d in enumerate(results_dirs)]
    seen: dict[str, Path] = {}
    for variant in variants:
        if variant.name in seen:
            raise ConfigError(
                f"{seen[variant.name]} and {variant.results_dir} are both called {variant.name!r}; "
                "tell them apart with --names, e.g. --names plain,spec"
            )
        seen[variant.name] = variant.results_dir
    return variants


def load_variant(results_dir: Path, name: str | None = None) -> Variant:
    if not results_dir.is_dir():
        raise ConfigError(
            f"result folder {results_dir} does not exist; pass a folder written by `specserve bench --results-dir`"
        )
    summary_paths = sorted(results_dir.glob(f"*{SUMMARY_SUFFIX}"))
    if not summary_paths:
        raise ConfigError(
            f"{results_dir} holds no *{SUMMARY_SUFFIX}; pass a folder written by `specserve bench --results-dir`"
        )
    test_cases: dict[str, TestCaseResult] = {}
    file_of: dict[str, Path] = {}
    variant_names: set[str] = set()
    for summary_path in summary_paths:
        summary = read_summary(summary_path)
        test_case = summary["test_case"]
        if test_case in test_cases:
            raise ConfigError(
                f"{file_of[test_case]} and {summary_path} both hold test case {test_case!r}; "
                "keep one run per test case in a result folder"
            )
        responses_path = summary_path.with_name(summary_path.name.removesuffix(SUMMARY_SUFFIX) + RESPONSES_SUFFIX)
        test_cases[test_case] = TestCaseResult(summary, read_responses(responses_path))
        file_of[test_case] = summary_path
        if summary["variant"] is not None:
            variant_names.add(summary["variant"])
    if len(variant_names) > 1:
        raise ConfigError(
            f"{results_dir} mixes the results of several variants ({', '.join(sorted(variant_names))}); "
            "give each variant its own --results-dir"
        )
    if name is None:
        name = variant_names.pop() if variant_names else results_dir.resolve().name
    return Variant(name, results_dir, test_cases)


def read_summary(path: Path) -> dict[str, Any]:
    summary = read_json(path)
    if not isinstance(summary, dict):
        raise malformed(path, "it is not a JSON object")
    if not isinstance(summary.get("test_case"), str) or not summary["test_case"]:
        raise malformed(path, "'test_case' is missing or not a name")
    if "variant" not in summary or not isinstance(summary["variant"], str | None):
        raise malformed(path, "'variant' is missing or neither a name nor null")
    for metric in METRICS:
        if metric.optional and metric.key not in summary:
            continue
        if metric.key not in summary or not is_number_or_null(summary[metric.key]):
            raise malformed(path, f"{metric.key!r} is missing or not a number")
    return summary


def read_responses(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ConfigError(f"{path} is missing; `specserve bench` writes it beside its summary, so run it again")
    responses = read_json(path)
    if not isinstance(responses, list):
        raise malformed(path, "it is not a JSON list")
    for i, response in enumerate(responses):
        if not isinstance(response, dict) or not isinstance(response.get("request_index"), int):
            raise malformed(path, f"record {i} has no integer 'request_index'")
        for key in (*RESPONSE_METRICS, "error_code"):
            if key not in response or not is_number_or_null(response[key]):
                raise malformed(path, f"record {i}: {key!r} is missing or not a number")
    return responses


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise malformed(path, f"it cannot be read as JSON ({error})") from error


def malformed(path: Path, why: str) -> ConfigError:
    return ConfigError(f"{path} is not a `specserve bench` result: {why}; run the benchmark again to rewrite it")


def is_number_or_null(value: Any) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def test_cases_of(variants: list[Variant]) -> list[str]:
    """Every test case any variant ran, in the order first met."""
    return list(dict.fromkeys(test_case for variant in variants for test_case in variant.test_cases))


def metric_value(variant: Variant, test_case: str, metric: Metric) -> float | None:
    result = variant.test_cases.get(test_case)
    value = None if result is None else result.summary.get(metric.key)
    if value is None or not math.isfinite(value):
        return None
    return value * metric.scale


def change_pct(value: float | None, baseline: float | None) -> float | None:
    if value is None or baseline is None or baseline == 0:
        return None
    return (value - baseline) / baseline * 100


def build_comparison(variants: list[Variant]) -> Comparison:
    tables = {}
    for test_case in test_cases_of(variants):
        rows = []
        for metric in METRICS:
            values = [metric_value(variant, test_case, metric) for variant in variants]
            rows.append(Row(metric, values, [change_pct(value, values[0]) for value in values[1:]]))
        tables[test_case] = rows
    return Comparison(variants, tables)


def format_value(value: float | None, metric: Metric) -> str:
    return NOT_AVAILABLE if value is None else f"{value:.{metric.digits}f}"


def format_change(change: float | None, metric: Metric) -> str:
    if change is None:
        return NOT_AVAILABLE
    if round(change, 1) == 0:
        return "0.0%"
    text = f"{change:+.1f}%"
    if metric.better is None:
        return text
    improved = (change < 0) == (metric.better == "lower")
    return f"{text} ({'better' if improved else 'worse'})"


def to_markdown(comparison: Comparison) -> str:
    baseline, *others = comparison.variants
    lines = [
        "# specserve compare",
        "",
        "Variants: "
        + ", ".join(f"`{v.name}` ({v.results_dir})" for v in comparison.variants)
        + f". Baseline: `{baseline.name}`.",
        "Change = (variant - baseline) / baseline: a negative change is better for latencies and errors, "
        "a positive one for throughput and acceptance. n/a: not measured (no speculation, or a test case not run).",
    ]
    header = ["metric", *(v.name for v in comparison.variants), *(f"{v.name} vs {baseline.name}" for v in others)]
    for test_case, rows in comparison.tables.items():
        lines += ["", f"## {test_case}", "", table_line(header), "|:--|" + "--:|" * (len(header) - 1)]
        for row in rows:
            lines.append(
                table_line(
                    [
                        row.metric.label,
                        *(format_value(value, row.metric) for value in row.values),
                        *(format_change(change, row.metric) for change in row.changes_pct),
                    ]
                )
            )
    return "\n".join(lines) + "\n"


def table_line(cells: list[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def to_json(comparison: Comparison) -> dict[str, Any]:
    baseline, *others = comparison.variants
    return {
        "baseline": baseline.name,
        "variants": [{"name": v.name, "results_dir": str(v.results_dir)} for v in comparison.variants],
        "test_cases": {
            test_case: [
                {
                    "metric": row.metric.label,
                    "key": row.metric.key,
                    "better": row.metric.better,
                    "values": {v.name: value for v, value in zip(comparison.variants, row.values)},
                    "change_pct": {v.name: change for v, change in zip(others, row.changes_pct)},
                }
                for row in rows
            ]
            for test_case, rows in comparison.tables.items()
        },
    }


def prepare_output_dir(output_dir: str | Path | None, baseline_dir: str | Path) -> Path:
    """Create and return output_dir; by default `comparison/` beside the baseline's folder."""
    path = Path(output_dir) if output_dir is not None else Path(baseline_dir).resolve().parent / "comparison"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--output-dir {path} is a file; give a folder")
    path.mkdir(parents=True, exist_ok=True)
    return path
