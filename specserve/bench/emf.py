"""`specserve bench --emf`: each request's figures as one CloudWatch Embedded Metric
Format (EMF) line, so a CloudWatch agent (or any shipper that hands log lines to
CloudWatch Logs as they are) turns them into metrics without credentials in our code.

One JSON object per request, on one line:

    {"_aws": {"Timestamp": <ms since the epoch, when the request was sent>,
              "CloudWatchMetrics": [{"Namespace": "specserve",
                                     "Dimensions": [["Variant", "TestCase"]],
                                     "Metrics": [{"Name": "TimeToFirstToken", "Unit": "Milliseconds"}, ...]}]},
     "Variant": "speculative", "TestCase": "structured",
     "TimeToFirstToken": 41.2, ..., "Errors": 0,
     "model": ..., "request_index": ..., "prompt_name": ..., "error_code": ..., "error_msg": ...}

Against a speculative server, each test case also writes one line of its speculation
figures, read from the server's /metrics over the run (the summary's
`results_spec_acceptance_rate` and `results_spec_mean_acceptance_length`): metrics
`AcceptanceRate` and `MeanAcceptanceLength`, the same dimensions, stamped at the run's
start.

Invariants (the format's rules): every declared metric has a number at the root, every
dimension a non-empty string; a failed request declares only `Errors` (1), since it
has no latencies. The dimension values are `--metadata variant=...` and the test case,
so `--emf` needs a variant. The other root members are properties, searchable in Logs
Insights but not metrics.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.errors import ConfigError

DEFAULT_NAMESPACE = "specserve"
DIMENSIONS = ("Variant", "TestCase")
# (EMF name, unit, the request record's key, scale to the unit)
METRICS = (
    ("TimeToFirstToken", "Milliseconds", "ttft_s", 1000.0),
    ("InterTokenLatency", "Milliseconds", "inter_token_latency_s", 1000.0),
    ("EndToEndLatency", "Milliseconds", "end_to_end_latency_s", 1000.0),
    ("InputTokens", "Count", "number_input_tokens", 1.0),
    ("OutputTokens", "Count", "number_output_tokens", 1.0),
    ("OutputThroughput", "Count/Second", "request_output_throughput_token_per_s", 1.0),
)
ERRORS = ("Errors", "Count")
# (EMF name, unit, the summary's key): one line per test case, where the server speculates
SPEC_METRICS = (
    ("AcceptanceRate", "None", "results_spec_acceptance_rate"),
    ("MeanAcceptanceLength", "Count", "results_spec_mean_acceptance_length"),
)
PROPERTIES = ("request_index", "prompt_name", "error_code", "error_msg")
# CloudWatch: 1-255 characters of these, at least one not a space, not under AWS/.
_NAMESPACE = re.compile(r"[0-9A-Za-z.\-_/#: ]{1,255}")
MAX_DIMENSION_VALUE = 1024


@dataclass(frozen=True)
class EmfSettings:
    namespace: str
    path: Path | None  # None: stdout


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--emf",
        action="store_true",
        help="also write each request's figures as CloudWatch Embedded Metric Format JSON lines "
        "(dimensions Variant, from --metadata variant=NAME, and TestCase)",
    )
    parser.add_argument(
        "--emf-namespace",
        default=DEFAULT_NAMESPACE,
        help=f"the CloudWatch namespace of the EMF metrics (default {DEFAULT_NAMESPACE})",
    )
    parser.add_argument(
        "--emf-file",
        default=None,
        metavar="PATH",
        help="append the EMF lines to this file instead of stdout (implies --emf)",
    )


def settings_from_args(args: argparse.Namespace) -> EmfSettings | None:
    if not (args.emf or args.emf_file):
        return None
    namespace = args.emf_namespace
    if not _NAMESPACE.fullmatch(namespace) or not namespace.strip() or namespace.startswith("AWS/"):
        raise ConfigError(
            f"--emf-namespace must be 1-255 letters, digits or . - _ / # : and spaces, "
            f"not starting with AWS/; got {namespace!r}"
        )
    return EmfSettings(namespace, Path(args.emf_file) if args.emf_file else None)


def check_variant(metadata: dict[str, str]) -> None:
    """Refuse, before any request, a run whose lines would lack the Variant dimension."""
    _dimension_value("Variant", metadata.get("variant", ""), "pass --metadata variant=NAME")


def _dimension_value(key: str, value: str, fix: str) -> str:
    if not value.strip() or len(value) > MAX_DIMENSION_VALUE:
        raise ConfigError(f"--emf needs a {key} dimension of 1-{MAX_DIMENSION_VALUE} characters; {fix} (got {value!r})")
    return value


def _line(
    values: dict[str, tuple[str, float]], *, namespace: str, variant: str, test_case: str, timestamp_ms: int
) -> dict[str, Any]:
    """An EMF object declaring `values` (name: (unit, value)) under the two dimensions."""
    return {
        "_aws": {
            "Timestamp": timestamp_ms,
            "CloudWatchMetrics": [
                {
                    "Namespace": namespace,
                    "Dimensions": [list(DIMENSIONS)],
                    "Metrics": [{"Name": name, "Unit": unit} for name, (unit, _) in values.items()],
                }
            ],
        },
        "Variant": variant,
        "TestCase": test_case,
        **{name: value for name, (_, value) in values.items()},
    }


def request_line(
    record: dict[str, Any], *, namespace: str, variant: str, test_case: str, model: str, timestamp_ms: int
) -> dict[str, Any]:
    """One request record of `specserve bench` as an EMF object."""
    failed = bool(record["error_msg"])
    values = (
        {}
        if failed
        else {name: (unit, record[key] * scale) for name, unit, key, scale in METRICS if record[key] is not None}
    )
    values[ERRORS[0]] = (ERRORS[1], int(failed))
    line = _line(values, namespace=namespace, variant=variant, test_case=test_case, timestamp_ms=timestamp_ms)
    return {**line, "model": model, **{key: record[key] for key in PROPERTIES}}


def speculation_line(
    summary: dict[str, Any], *, namespace: str, variant: str, test_case: str, timestamp_ms: int
) -> dict[str, Any] | None:
    """A test case's acceptance figures as an EMF object; None where the server did not
    speculate (or drafted nothing)."""
    values = {name: (unit, summary[key]) for name, unit, key in SPEC_METRICS if summary.get(key) is not None}
    if not values:
        return None
    line = _line(values, namespace=namespace, variant=variant, test_case=test_case, timestamp_ms=timestamp_ms)
    return {**line, "model": summary["model"]}


def emit(settings: EmfSettings, records: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """Write one test case's records as EMF lines; timestamps from the run's start (summary
    "timestamp", seconds) plus each request's offset."""
    variant = _dimension_value("Variant", summary["metadata"].get("variant", ""), "pass --metadata variant=NAME")
    test_case = _dimension_value("TestCase", summary["test_case"], "name the test case")
    lines = [
        json.dumps(
            request_line(
                record,
                namespace=settings.namespace,
                variant=variant,
                test_case=test_case,
                model=summary["model"],
                timestamp_ms=round((summary["timestamp"] + record["start_time_s"]) * 1000),
            )
        )
        + "\n"
        for record in records
    ]
    speculation = speculation_line(
        summary,
        namespace=settings.namespace,
        variant=variant,
        test_case=test_case,
        timestamp_ms=round(summary["timestamp"] * 1000),
    )
    if speculation is not None:
        lines.append(json.dumps(speculation) + "\n")
    if settings.path is None:
        sys.stdout.writelines(lines)
        sys.stdout.flush()
        return
    settings.path.parent.mkdir(parents=True, exist_ok=True)
    with open(settings.path, "a") as out:
        out.writelines(lines)
