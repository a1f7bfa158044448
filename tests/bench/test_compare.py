"""`specserve compare` on recorded result folders: table figures, percent changes, n/a,
the report and plots written, and every refusal as one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from matplotlib.image import imread

from specserve.bench import compare, plots
from specserve.cli import main

METRICS = (
    "ttft_s",
    "inter_token_latency_s",
    "end_to_end_latency_s",
    "request_output_throughput_token_per_s",
    "number_input_tokens",
    "number_output_tokens",
    "chunk_gap_s",
)
QUANTILES = ("p25", "p50", "p75", "p90", "p95", "p99")
NUM_REQUESTS = 12


def summary(
    test_case: str,
    variant: str | None,
    *,
    ttft_ms: float,
    itl_ms: float,
    e2e_s: float,
    throughput: float,
    acceptance: tuple[float, float] | None,
) -> dict:
    """A summary with every key `specserve bench` writes; quantiles spread around the given p50."""
    figures = {
        "ttft_s": ttft_ms / 1000,
        "inter_token_latency_s": itl_ms / 1000,
        "end_to_end_latency_s": e2e_s,
        "request_output_throughput_token_per_s": throughput / 4,
        "number_input_tokens": 30,
        "number_output_tokens": 128,
        "chunk_gap_s": itl_ms / 1000 * 2,
    }
    data = {
        "name": f"{variant or 'plain'}_{test_case}",
        "model": "qwen2.5-coder-1.5b",
        "test_case": test_case,
        "variant": variant,
        "url": "http://127.0.0.1:8000",
        "mean_input_tokens": 30,
        "stddev_input_tokens": 0,
        "mean_output_tokens": 128,
        "stddev_output_tokens": 0,
        "num_concurrent_requests": 4,
        "request_rate": None,
        "additional_sampling_params": {"temperature": 0},
        "metadata": {},
        "timestamp": 1760000000,
        "version": "2023-08-31",
    }
    for metric, p50 in figures.items():
        for quantile, factor in zip(QUANTILES, (0.9, 1.0, 1.1, 1.3, 1.4, 1.5)):
            data[f"results_{metric}_quantiles_{quantile}"] = p50 * factor
        data |= {
            f"results_{metric}_mean": p50 * 1.05,
            f"results_{metric}_min": p50 * 0.8,
            f"results_{metric}_max": p50 * 1.6,
            f"results_{metric}_stddev": p50 * 0.1,
        }
    data |= {
        "results_num_requests_started": NUM_REQUESTS,
        "results_num_completed_requests": NUM_REQUESTS - 1,
        "results_number_errors": 1,
        "results_error_rate": 1 / NUM_REQUESTS,
        "results_error_code_frequency": {"500": 1},
        "results_mean_output_throughput_token_per_s": throughput,
        "results_num_completed_requests_per_min": 60.0,
        "results_duration_s": 11.0,
        "results_goodput_requests_per_s": None,
        "results_goodput_fraction": None,
    }
    spec = dict.fromkeys(
        (
            "num_drafts",
            "num_draft_tokens",
            "num_accepted_tokens",
            "acceptance_rate",
            "mean_acceptance_length",
            "accepted_per_position",
        )
    )
    if acceptance is not None:
        spec = {
            "num_drafts": 100,
            "num_draft_tokens": 700,
            "num_accepted_tokens": round(700 * acceptance[0]),
            "acceptance_rate": acceptance[0],
            "mean_acceptance_length": acceptance[1],
            "accepted_per_position": [90, 80, 70, 60, 50, 40, 30],
        }
        data["results_prefix_cache_hit_rate"] = 0.5  # (a baseline without the key: a file older than it)
    return data | {f"results_spec_{key}": value for key, value in spec.items()}


def responses(test_case: str, *, ttft_ms: float, itl_ms: float) -> list[dict]:
    """NUM_REQUESTS records in start order; request 5 failed."""
    records = []
    for i in range(NUM_REQUESTS):
        failed = i == 5
        ttft, itl = ttft_ms / 1000 * (1 + 0.02 * i), itl_ms / 1000 * (1 + 0.05 * (i % 3))
        e2e = ttft + 127 * itl
        records.append(
            {
                "request_index": i,
                "test_case": test_case,
                "prompt_name": test_case,
                "start_time_s": 0.5 * i,
                "ttft_s": None if failed else ttft,
                "inter_token_latency_s": None if failed else itl,
                "end_to_end_latency_s": None if failed else e2e,
                "request_output_throughput_token_per_s": None if failed else 128 / e2e,
                "number_input_tokens": 30,
                "number_output_tokens": 0 if failed else 128,
                "number_total_tokens": 30 if failed else 158,
                "num_chunks": 0 if failed else 40,
                "chunk_gaps_s": [] if failed else [itl * 3] * 39,
                "error_code": 500 if failed else None,
                "error_msg": "internal error" if failed else "",
            }
        )
    return records


def write_results(folder: Path, variant: str | None, test_cases: dict[str, dict]) -> Path:
    """A result folder as `specserve bench --results-dir folder` writes it; test_cases: name -> figures."""
    folder.mkdir(parents=True)
    for test_case, figures in test_cases.items():
        name = f"{variant or 'plain'}_{test_case}"
        (folder / f"{name}_summary.json").write_text(json.dumps(summary(test_case, variant, **figures)))
        (folder / f"{name}_individual_responses.json").write_text(
            json.dumps(responses(test_case, ttft_ms=figures["ttft_ms"], itl_ms=figures["itl_ms"]))
        )
    return folder


PLAIN = {"ttft_ms": 120.0, "itl_ms": 45.0, "e2e_s": 6.0, "throughput": 100.0, "acceptance": None}
SPEC = {"ttft_ms": 120.0, "itl_ms": 15.0, "e2e_s": 2.0, "throughput": 200.0, "acceptance": (0.6, 5.2)}


@pytest.fixture
def plain_and_spec(tmp_path) -> tuple[Path, Path]:
    # the baseline ran count and meaning; the speculative server ran count and code
    plain = write_results(tmp_path / "runs" / "plain", None, {"count": PLAIN, "meaning": PLAIN})
    spec = write_results(
        tmp_path / "runs" / "spec", "spec-k7", {"count": SPEC, "code": SPEC | {"e2e_s": 3.0, "throughput": 90.0}}
    )
    return plain, spec


def table(markdown: str, test_case: str) -> dict[str, list[str]]:
    """The Markdown table under `## test_case`: metric label -> its other cells; "metric" -> the header."""
    section = markdown.split(f"## {test_case}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("| ").split(" | ") for line in section.splitlines() if line.startswith("| ")]
    return {row[0]: row[1:] for row in rows}


def test_table_figures_and_percent_changes(plain_and_spec):
    variants = compare.load_variants(list(plain_and_spec))
    assert [v.name for v in variants] == ["plain", "spec-k7"]  # null variant: the folder's name
    count = table(compare.to_markdown(compare.build_comparison(variants)), "count")
    assert count["metric"] == ["plain", "spec-k7", "spec-k7 vs plain"]
    assert count["Output throughput (tok/s)"] == ["100.0", "200.0", "+100.0% (better)"]
    assert count["Inter-token latency p50 (ms)"] == ["45.0", "15.0", "-66.7% (better)"]
    assert count["Inter-token latency p99 (ms)"] == ["67.5", "22.5", "-66.7% (better)"]
    assert count["End-to-end latency p50 (s)"] == ["6.000", "2.000", "-66.7% (better)"]
    assert count["End-to-end latency p99 (s)"] == ["9.000", "3.000", "-66.7% (better)"]
    assert count["TTFT p50 (ms)"] == ["120.0", "120.0", "0.0%"]
    assert count["Mean output tokens"] == ["134.4", "134.4", "0.0%"]
    assert count["Completed requests"] == ["11", "11", "0.0%"]
    assert count["Errors"] == ["1", "1", "0.0%"]
    assert count["Acceptance rate"] == ["n/a", "0.600", "n/a"]
    assert count["Mean acceptance length"] == ["n/a", "5.20", "n/a"]
    assert count["Prefix cache hit rate"] == ["n/a", "0.500", "n/a"]


def test_worse_figures_and_missing_test_cases(plain_and_spec):
    markdown = compare.to_markdown(compare.build_comparison(compare.load_variants(list(plain_and_spec))))
    assert [line[3:] for line in markdown.splitlines() if line.startswith("## ")] == ["count", "meaning", "code"]
    meaning = table(markdown, "meaning")  # only the baseline ran it
    assert meaning["Output throughput (tok/s)"] == ["100.0", "n/a", "n/a"]
    assert all(cells[1:] == ["n/a", "n/a"] for label, cells in meaning.items() if label != "metric")
    code = table(markdown, "code")  # only the speculative server ran it
    assert code["Output throughput (tok/s)"] == ["n/a", "90.0", "n/a"]
    assert code["Acceptance rate"] == ["n/a", "0.600", "n/a"]


def test_change_words_follow_the_metric_direction():
    throughput, latency, count = (
        next(m for m in compare.METRICS if m.label.startswith(prefix))
        for prefix in ("Output throughput", "TTFT", "Completed")
    )
    assert compare.format_change(compare.change_pct(90.0, 100.0), throughput) == "-10.0% (worse)"
    assert compare.format_change(compare.change_pct(135.0, 100.0), latency) == "+35.0% (worse)"
    assert compare.format_change(compare.change_pct(65.0, 100.0), latency) == "-35.0% (better)"
    assert compare.format_change(compare.change_pct(12.0, 10.0), count) == "+20.0%"
    assert compare.change_pct(3.0, 0.0) is None and compare.change_pct(None, 1.0) is None


def test_cli_writes_report_and_plots_beside_the_baseline(plain_and_spec, capsys):
    assert main(["compare", *map(str, plain_and_spec)]) == 0
    out = capsys.readouterr().out
    output_dir = plain_and_spec[0].parent / "comparison"
    assert (output_dir / "comparison.md").read_text() == out
    assert "| Output throughput (tok/s) | 100.0 | 200.0 | +100.0% (better) |" in out
    for name in ("e2e_latency.png", "inter_token_latency.png", "ttft.png"):
        path = output_dir / name
        assert path.stat().st_size > 10_000
        height, width, channels = imread(path).shape
        assert width > 1000 and height > 300 and channels == 4  # three panels side by side


def test_plots_leave_a_gap_for_failed_requests(plain_and_spec):
    variants = compare.load_variants(list(plain_and_spec))
    ttft = next(plot for plot in plots.PLOTS if plot.key == "ttft_s")
    points = plots.per_request_points(variants[0], "count", ttft)
    assert [x for x, _ in points] == list(range(NUM_REQUESTS))
    assert [x for x, y in points if math.isnan(y)] == [5]
    assert points[0] == (0, pytest.approx(120.0))  # in milliseconds
    assert plots.per_request_points(variants[0], "code", ttft) == []


def test_three_variants_with_names_and_json(plain_and_spec, tmp_path, capsys):
    ngram = write_results(
        tmp_path / "runs" / "ngram", "ngram-k5", {"count": PLAIN | {"throughput": 150.0, "acceptance": (0.4, 3.0)}}
    )
    output_dir = tmp_path / "out"
    folders = [*map(str, plain_and_spec), str(ngram)]
    assert main(["compare", *folders, "--names", "base,draft,ngram", "--output-dir", str(output_dir)]) == 0
    count = table(capsys.readouterr().out, "count")
    assert count["metric"] == ["base", "draft", "ngram", "draft vs base", "ngram vs base"]
    assert count["Output throughput (tok/s)"] == ["100.0", "200.0", "150.0", "+100.0% (better)", "+50.0% (better)"]
    assert sorted(p.name for p in output_dir.iterdir()) == [
        "comparison.md",
        "e2e_latency.png",
        "inter_token_latency.png",
        "ttft.png",
    ]

    assert main(["compare", *folders, "--output-dir", str(output_dir), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["baseline"] == "plain"
    assert [v["name"] for v in result["variants"]] == ["plain", "spec-k7", "ngram-k5"]
    throughput = next(row for row in result["test_cases"]["count"] if row["metric"].startswith("Output throughput"))
    assert throughput["values"] == {"plain": 100.0, "spec-k7": 200.0, "ngram-k5": 150.0}
    assert throughput["change_pct"] == {"spec-k7": 100.0, "ngram-k5": 50.0}
    acceptance = next(row for row in result["test_cases"]["code"] if row["metric"] == "Acceptance rate")
    assert acceptance["values"] == {"plain": None, "spec-k7": 0.6, "ngram-k5": None}
    assert len(result["files"]) == 4


def break_summary(folder: Path, text: str) -> str:
    path = next(folder.glob("*_summary.json"))
    path.write_text(text)
    return path.name


def drop_key(folder: Path, key: str) -> str:
    path = next(folder.glob("*_summary.json"))
    data = json.loads(path.read_text())
    del data[key]
    return break_summary(folder, json.dumps(data))


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing folder", "does not exist"),
        ("empty folder", "holds no *_summary.json"),
        ("one folder", "at least two result folders"),
        ("bad json", "cannot be read as JSON"),
        ("missing key", "'results_ttft_s_quantiles_p50' is missing"),
        ("not a number", "'results_spec_acceptance_rate' is missing or not a number"),
        ("no responses", "_individual_responses.json is missing"),
        ("mixed variants", "mixes the results of several variants (ngram-k5, spec-k7)"),
        ("same names", "are both called 'plain'"),
        ("too few names", "--names gives 1 names for 2 result folders"),
    ],
)
def test_cli_refusals_are_one_line(plain_and_spec, tmp_path, capsys, case, expected):
    plain, spec = map(str, plain_and_spec)
    argv, file_named = ["compare", plain, spec], None
    if case == "missing folder":
        argv[2] = str(tmp_path / "nowhere")
    elif case == "empty folder":
        (tmp_path / "empty").mkdir()
        argv[2] = str(tmp_path / "empty")
    elif case == "one folder":
        argv = ["compare", plain]
    elif case == "bad json":
        file_named = break_summary(plain_and_spec[1], '{"name": "spec_count", ')
    elif case == "missing key":
        file_named = drop_key(plain_and_spec[1], "results_ttft_s_quantiles_p50")
    elif case == "not a number":
        path = next(plain_and_spec[1].glob("*_summary.json"))
        file_named = break_summary(
            plain_and_spec[1],
            path.read_text().replace('"results_spec_acceptance_rate": 0.6', '"results_spec_acceptance_rate": "60%"'),
        )
    elif case == "no responses":
        next(plain_and_spec[1].glob("*_individual_responses.json")).unlink()
    elif case == "mixed variants":
        write_results(tmp_path / "ngram", "ngram-k5", {"repeat": PLAIN})
        for path in (tmp_path / "ngram").iterdir():
            path.rename(plain_and_spec[1] / path.name)
    elif case == "same names":
        argv += ["--names", "plain,plain"]
    elif case == "too few names":
        argv += ["--names", "plain"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("specserve: error: ") and captured.err.count("\n") == 1
    assert expected in captured.err
    if file_named is not None:
        assert file_named in captured.err
    assert not (plain_and_spec[0].parent / "comparison").exists()  # nothing written on refusal
