"""benchmarks/shared_prefix.py end to end on smollm2-135m: a server without and with
the prefix cache, the same shared-prefix workload against each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "shared_prefix.py"


def test_the_cache_finds_the_shared_prefix_only_when_on(prepared_cache):
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--target",
            "smollm2-135m",
            "--shared-prefix-tokens",
            "64",
            "--max-tokens",
            "4",
            "--concurrency",
            "2",
            "--requests",
            "4",
            "--rounds",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "SPECSERVE_CACHE": prepared_cache},
    )
    assert result.returncode == 0, result.stderr
    runs = {row["variant"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert runs["off"]["from cache"] is None  # no prefix cache: the server counts no hits (vLLM's usage)
    # Three of the four requests find at least the 64 shared tokens (the second copies
    # them from the first, which arrived with it), of ~100 prompt tokens each.
    assert runs["on"]["from cache"] > 0.4
    assert all(row["out tok/s"] > 0 and row["ttft mean s"] > 0 for row in runs.values())
