"""benchmarks/suffix_answers.py end to end on smollm2-135m: requests of one kind, each
mode over one loaded target, the suffix engine drafting from the answers before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "suffix_answers.py"


def run(prompts_file: Path, cache: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--target", "smollm2-135m", "--prompts-file", str(prompts_file), *flags],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "SPECSERVE_CACHE": cache},
    )


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "Count from one to ten in words.", "name": "count"}] * 2
    lines.append({"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8})
    path.write_text("\n".join(map(json.dumps, lines)) + "\n")
    return path


def test_every_mode_gives_plain_tokens_and_suffix_drafts_the_answer_before(prepared_cache, prompts_file):
    # A mode given as NAME=JSON keeps the commas inside its JSON.
    own = 'own={"method": "suffix", "suffix_decoding_max_cached_requests": 0, "num_speculative_tokens": 8}'
    result = run(prompts_file, prepared_cache, "--modes", f"plain,suffix,{own}", "--max-tokens", "24")
    assert result.returncode == 0, result.stderr
    rows = {line.split(" | ")[0].strip("| "): line for line in result.stdout.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"plain", "suffix", "own"}
    assert "Every mode gave plain decoding's tokens." in result.stdout
    # The second request repeats the first: its answer drafts from the first's.
    assert float(rows["suffix"].split(" | ")[-1].strip(" |")) > 2


def test_a_mode_it_does_not_know_is_refused(prepared_cache, prompts_file):
    result = run(prompts_file, prepared_cache, "--modes", "plain,eagle9")
    assert result.returncode != 0 and "unknown mode 'eagle9'" in result.stderr
