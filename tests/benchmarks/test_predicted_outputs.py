"""benchmarks/predicted_outputs.py end to end on smollm2-135m: each code edit asked
without and with its file as the prediction, on a plain and an n-gram engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "predicted_outputs.py"


def run(cache: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--target", "smollm2-135m", *flags],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "SPECSERVE_CACHE": cache},
    )


def test_every_answer_is_the_same_with_its_prediction_and_the_prediction_drafts(prepared_cache):
    result = run(prepared_cache, "--modes", "plain,ngram", "--rounds", "1", "--max-tokens", "48")
    assert result.returncode == 0, result.stderr
    assert "Every answer was the same with and without its prediction." in result.stdout
    rows = {line.split(" | ")[0].strip("| "): line for line in result.stdout.splitlines() if line.startswith("| ")}
    assert {"plain", "ngram"} <= set(rows)
    accepted = int(rows["plain"].split(" | ")[-1].split(" / ")[0])
    assert accepted > 0  # the model writes some of the file back: the prediction drafts it


def test_a_mode_it_does_not_know_is_refused(prepared_cache):
    result = run(prepared_cache, "--modes", "plain,eagle9")
    assert result.returncode != 0 and "unknown modes ['eagle9']" in result.stderr
