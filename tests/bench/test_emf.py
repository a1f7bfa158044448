"""`specserve bench --emf`: every line checked against the CloudWatch Embedded Metric
Format's rules (the `_aws` block, `CloudWatchMetrics`, dimensions, units, target
members) and against the request records it was made from; through the CLI against
the fake OpenAI server of test_bench (several tokens per chunk, failures on schedule).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import pytest

from specserve.bench import emf
from tests.bench.test_bench import bench, fake_url, results  # noqa: F401  (fake_url: the fixture)

# CloudWatch's StandardUnit values, the only ones a metric's "Unit" may take.
UNITS = {
    "Seconds",
    "Microseconds",
    "Milliseconds",
    "Bytes",
    "Kilobytes",
    "Megabytes",
    "Gigabytes",
    "Terabytes",
    "Bits",
    "Kilobits",
    "Megabits",
    "Gigabits",
    "Terabits",
    "Percent",
    "Count",
    "Bytes/Second",
    "Kilobytes/Second",
    "Megabytes/Second",
    "Gigabytes/Second",
    "Terabytes/Second",
    "Bits/Second",
    "Kilobits/Second",
    "Megabits/Second",
    "Gigabits/Second",
    "Terabits/Second",
    "Count/Second",
    "None",
}
LATENCIES = {
    "TimeToFirstToken": "ttft_s",
    "InterTokenLatency": "inter_token_latency_s",
    "EndToEndLatency": "end_to_end_latency_s",
}


def check_emf(line: str) -> dict[str, Any]:
    """One EMF log line, checked against the specification's rules; the object."""
    assert line.startswith("{") and "\n" not in line.strip()
    root = json.loads(line)
    aws = root["_aws"]
    assert isinstance(aws["Timestamp"], int) and not isinstance(aws["Timestamp"], bool)
    assert 1_500_000_000_000 < aws["Timestamp"] < 4_000_000_000_000  # milliseconds, not seconds
    assert isinstance(aws["CloudWatchMetrics"], list) and aws["CloudWatchMetrics"]
    for directive in aws["CloudWatchMetrics"]:
        assert set(directive) == {"Namespace", "Dimensions", "Metrics"}
        namespace = directive["Namespace"]
        assert isinstance(namespace, str) and 1 <= len(namespace) <= 255 and namespace.strip()
        assert isinstance(directive["Dimensions"], list)
        for dimension_set in directive["Dimensions"]:
            assert isinstance(dimension_set, list) and len(dimension_set) <= 30
            for key in dimension_set:
                value = root[key]  # every dimension has a target member ...
                assert isinstance(value, str) and value.strip() and len(value) <= 1024  # ... that is a string
        metrics = directive["Metrics"]
        assert isinstance(metrics, list) and 1 <= len(metrics) <= 100
        names = [m["Name"] for m in metrics]
        assert len(names) == len(set(names))
        for metric in metrics:
            assert set(metric) <= {"Name", "Unit", "StorageResolution"}
            assert isinstance(metric["Name"], str) and 1 <= len(metric["Name"]) <= 255
            assert metric.get("Unit", "None") in UNITS
            value = root[metric["Name"]]  # every metric has a target member, a number (or up to 100)
            values = value if isinstance(value, list) else [value]
            assert 1 <= len(values) <= 100
            assert all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)
            assert metric["Name"] not in {k for s in directive["Dimensions"] for k in s}
    return root


def declared(root: dict[str, Any]) -> dict[str, str]:
    (directive,) = root["_aws"]["CloudWatchMetrics"]
    return {m["Name"]: m["Unit"] for m in directive["Metrics"]}


def test_a_successful_and_a_failed_record():
    ok = {
        "request_index": 0,
        "prompt_name": "count",
        "start_time_s": 0.0,
        "ttft_s": 0.05,
        "inter_token_latency_s": 0.02,
        "end_to_end_latency_s": 0.27,
        "request_output_throughput_token_per_s": 44.4,
        "number_input_tokens": 7,
        "number_output_tokens": 12,
        "error_code": None,
        "error_msg": "",
    }
    failed = {
        **ok,
        **{
            key: None
            for key in (
                "ttft_s",
                "inter_token_latency_s",
                "end_to_end_latency_s",
                "request_output_throughput_token_per_s",
                "number_input_tokens",
                "number_output_tokens",
            )
        },
        "error_code": 429,
        "error_msg": "HTTP 429: busy",
    }
    line = emf.request_line(
        ok,
        namespace="specserve",
        variant="speculative",
        test_case="structured",
        model="m",
        timestamp_ms=1_700_000_000_000,
    )
    root = check_emf(json.dumps(line))
    assert root["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["Variant", "TestCase"]]
    assert (root["Variant"], root["TestCase"], root["_aws"]["Timestamp"]) == (
        "speculative",
        "structured",
        1_700_000_000_000,
    )
    assert declared(root) == {
        "TimeToFirstToken": "Milliseconds",
        "InterTokenLatency": "Milliseconds",
        "EndToEndLatency": "Milliseconds",
        "InputTokens": "Count",
        "OutputTokens": "Count",
        "OutputThroughput": "Count/Second",
        "Errors": "Count",
    }
    assert root["TimeToFirstToken"] == pytest.approx(50) and root["EndToEndLatency"] == pytest.approx(270)
    assert (root["OutputTokens"], root["InputTokens"], root["Errors"]) == (12, 7, 0)
    root = check_emf(
        json.dumps(
            emf.request_line(
                failed,
                namespace="specserve",
                variant="baseline",
                test_case="structured",
                model="m",
                timestamp_ms=1_700_000_000_000,
            )
        )
    )
    assert declared(root) == {"Errors": "Count"} and root["Errors"] == 1
    assert (root["error_code"], root["error_msg"]) == (429, "HTTP 429: busy")  # properties, not metrics


def test_a_speculating_test_case_adds_one_line_of_its_acceptance():
    summary = {"model": "m", "results_spec_acceptance_rate": 0.75, "results_spec_mean_acceptance_length": 3.1}
    root = check_emf(
        json.dumps(
            emf.speculation_line(
                summary, namespace="specserve", variant="eagle", test_case="structured", timestamp_ms=1_700_000_000_000
            )
        )
    )
    assert declared(root) == {"AcceptanceRate": "None", "MeanAcceptanceLength": "Count"}
    assert (root["AcceptanceRate"], root["MeanAcceptanceLength"], root["Variant"]) == (0.75, 3.1, "eagle")
    plain = {"model": "m", "results_spec_acceptance_rate": None, "results_spec_mean_acceptance_length": None}
    assert (
        emf.speculation_line(plain, namespace="specserve", variant="baseline", test_case="structured", timestamp_ms=0)
        is None
    )


def emf_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("{") and '"_aws"' in line]


def test_each_request_becomes_one_line_with_its_figures(fake_url, tmp_path):
    emf_file = tmp_path / "emf" / "lines.jsonl"
    before_ms = time.time() * 1000
    assert (
        bench(
            "--url",
            fake_url,
            "--model",
            "fake-flaky",
            "--test-case",
            "count,meaning",
            "--mean-output-tokens",
            "6",
            "--stddev-output-tokens",
            "0",
            "--max-num-completed-requests",
            "5",
            "--results-dir",
            str(tmp_path),
            "--metadata",
            "variant=speculative,run=1",
            "--emf-file",
            str(emf_file),
        )
        == 0
    )
    after_ms = time.time() * 1000
    roots = [check_emf(line) for line in emf_file.read_text().splitlines()]
    records = [r for case in ("count", "meaning") for r in results(tmp_path, case, "fake-flaky", mean_output=6)[1]]
    assert len(roots) == len(records) == 10
    assert any(r["error_msg"] for r in records) and not all(r["error_msg"] for r in records)
    for root, record in zip(roots, records):
        assert root["_aws"]["CloudWatchMetrics"][0]["Namespace"] == "specserve"
        assert (root["Variant"], root["TestCase"]) == ("speculative", record["test_case"])
        assert before_ms - 1000 <= root["_aws"]["Timestamp"] <= after_ms
        assert root["request_index"] == record["request_index"] and root["model"] == "fake-flaky"
        if record["error_msg"]:
            assert declared(root) == {"Errors": "Count"} and root["Errors"] == 1
            continue
        assert root["Errors"] == 0 and declared(root)["TimeToFirstToken"] == "Milliseconds"
        for name, key in LATENCIES.items():
            assert root[name] == pytest.approx(record[key] * 1000)
        assert root["OutputTokens"] == record["number_output_tokens"] == 6
        assert root["OutputThroughput"] == pytest.approx(record["request_output_throughput_token_per_s"])
    # A second run appends, as a log does.
    assert (
        bench(
            "--url",
            fake_url,
            "--model",
            "fake-usage",
            "--test-case",
            "count",
            "--max-num-completed-requests",
            "2",
            "--results-dir",
            str(tmp_path),
            "--metadata",
            "variant=baseline",
            "--emf-file",
            str(emf_file),
        )
        == 0
    )
    assert len(emf_file.read_text().splitlines()) == 12


def test_to_stdout_with_a_namespace_of_ones_own(fake_url, tmp_path, capsys):
    assert (
        bench(
            "--url",
            fake_url,
            "--model",
            "fake-usage",
            "--test-case",
            "count",
            "--max-num-completed-requests",
            "3",
            "--mean-output-tokens",
            "4",
            "--results-dir",
            str(tmp_path),
            "--metadata",
            "variant=baseline",
            "--emf",
            "--emf-namespace",
            "LLM/specserve bench",
        )
        == 0
    )
    out = capsys.readouterr().out
    roots = [check_emf(line) for line in emf_lines(out)]
    assert len(roots) == 3 and "count: 3/3 requests ok" in out
    assert {r["_aws"]["CloudWatchMetrics"][0]["Namespace"] for r in roots} == {"LLM/specserve bench"}
    assert {(r["Variant"], r["TestCase"]) for r in roots} == {("baseline", "count")}


def test_without_emf_nothing_is_written(fake_url, tmp_path, capsys):
    assert (
        bench(
            "--url",
            fake_url,
            "--model",
            "fake-usage",
            "--test-case",
            "count",
            "--max-num-completed-requests",
            "1",
            "--results-dir",
            str(tmp_path),
            "--metadata",
            "variant=baseline",
        )
        == 0
    )
    assert emf_lines(capsys.readouterr().out) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["--emf"], "--emf needs a Variant dimension"),
        (["--emf", "--metadata", "variant= "], "--emf needs a Variant dimension"),
        (["--emf", "--metadata", "variant=x", "--emf-namespace", "AWS/EC2"], "--emf-namespace must be"),
        (["--emf", "--metadata", "variant=x", "--emf-namespace", "bad|name"], "--emf-namespace must be"),
        (["--emf", "--metadata", "variant=x", "--emf-namespace", " "], "--emf-namespace must be"),
    ],
)
def test_bad_emf_settings_are_refused_before_any_request(fake_url, tmp_path, capsys, args, message):
    assert (
        bench(
            "--url",
            fake_url,
            "--model",
            "fake-usage",
            "--test-case",
            "count",
            "--results-dir",
            str(tmp_path / "results"),
            *args,
        )
        == 2
    )
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results").exists()
