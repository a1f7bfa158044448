"""`specserve ab` end to end on smollm2-135m: a plain and a speculative server, one
after the other, the same workload against each, then the comparison and its plots."""

from __future__ import annotations

import json
import os

from specserve import catalogue
from specserve.cli import build_parser, main


def test_ab_benches_both_servers_and_compares(prepared_cache, tmp_path, capsys):
    os.environ["SPECSERVE_CACHE"] = prepared_cache
    results = tmp_path / "ab"
    stale = results / "baseline" / "old_summary.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")  # a previous run's file must not mix in
    argv = [
        "ab",
        "smollm2-135m",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3}',
        "--test-case",
        "count,meaning",
        "--max-num-completed-requests",
        "2",
        "--mean-output-tokens",
        "24",
        "--stddev-output-tokens",
        "0",
        "--additional-sampling-params",
        '{"temperature": 0}',
        "--enable-prefix-caching",
        "--shared-prefix-tokens",
        "32",
        "--results-dir",
        str(results),
        "--json",
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert not stale.exists()
    for variant in ("baseline", "speculative"):
        summaries = sorted((results / variant).glob("*_summary.json"))
        assert [json.loads(p.read_text())["test_case"] for p in summaries] == ["count", "meaning"]
        for path in summaries:
            summary = json.loads(path.read_text())
            assert summary["variant"] == variant and summary["results_num_completed_requests"] == 2
            assert summary["results_number_errors"] == 0
            spec_rate = summary["results_spec_acceptance_rate"]
            assert (spec_rate is None) == (variant == "baseline")
            assert summary["results_prefix_cache_hit_rate"] > 0  # both servers were given the flag
    # At temperature 0 both servers generate the same tokens.
    outputs = {
        v: json.loads(next((results / v).glob("count_*_summary.json")).read_text())["results_number_output_tokens_mean"]
        for v in ("baseline", "speculative")
    }
    assert outputs["baseline"] == outputs["speculative"]
    comparison = results / "comparison"
    assert (comparison / "comparison.md").read_text().count("| Output throughput") == 2
    for plot in ("e2e_latency.png", "inter_token_latency.png", "ttft.png"):
        assert (comparison / plot).stat().st_size > 5000
    assert {str(comparison / "comparison.md")} <= set(report["files"])


def test_ab_without_a_model_serves_the_default_target():
    """ab's bench flags once set the model name to None over the positional's default,
    and the first server was started as `specserve serve None`."""
    assert build_parser().parse_args(["ab"]).model == catalogue.DEFAULT_TARGET
    assert build_parser().parse_args(["ab", "smollm2-135m"]).model == "smollm2-135m"


def test_ab_refuses_a_prefix_cache_of_no_space(capsys):
    assert main(["ab", "--enable-prefix-caching", "--prefix-cache-space", "0"]) == 2
    assert "--prefix-cache-space must be > 0 GiB, got 0.0" in capsys.readouterr().err


def test_a_server_that_cannot_start_is_a_one_line_error(tmp_path, capsys):
    assert main(["ab", "no-such-model", "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "specserve: error: the server exited during start-up: 'no-such-model' is neither a catalogue model" in err
    assert "Traceback" not in err
