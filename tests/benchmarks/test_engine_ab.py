"""benchmarks/engine_ab.py: two revisions of the engine taking turns, each in processes of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import engine_ab


def test_a_build_is_a_git_revision_or_the_worktree(tmp_path):
    assert engine_ab.build_tree("worktree", tmp_path) == engine_ab.REPO
    head = engine_ab.build_tree("HEAD", tmp_path)
    assert (head / "specserve" / "spec" / "adaptive.py").is_file() and head.is_relative_to(tmp_path)
    with pytest.raises(SystemExit, match="not a git revision"):
        engine_ab.build_tree("no-such-revision", tmp_path)


def test_modes_name_the_speculative_config():
    assert engine_ab.spec_config("plain", "d") is None
    assert engine_ab.spec_config("k=5", "d") == {"model": "d", "num_speculative_tokens": 5, "adaptive": False}
    assert engine_ab.spec_config("adaptive", "d") == {"model": "d", "num_speculative_tokens": 7}
    for bad in ("k=0", "k=x", "fast"):
        with pytest.raises(ValueError, match="plain, k=N or adaptive"):
            engine_ab.spec_config(bad, "d")


def run_of(speeds: dict[str, float], ttft: float = 0.5, tokens: str = "t") -> engine_ab.Run:
    return {
        ("plain", name): {"decode_tok_s": speed, "ttft_s": ttft, "tokens": tokens} for name, speed in speeds.items()
    }


def test_builds_take_turns_and_ratios_are_per_round():
    calls = []
    speeds = iter([10.0, 12.0, 24.0, 20.0])  # round 1: a then b; round 2: b then a (the machine twice as fast)

    def run(build):
        calls.append(build)
        return run_of({"count": next(speeds)}, tokens="same" if len(calls) < 4 else "moved")

    runs = engine_ab.take_turns(["a", "b"], rounds=2, run=run)
    assert calls == ["a", "b", "b", "a"]  # neither always follows the other
    [row] = engine_ab.summarize(runs["a"], runs["b"])
    assert row["speed"] == pytest.approx(1.2) and row["speed_range"] == pytest.approx((1.2, 1.2))
    assert row["a_tok_s"] == pytest.approx(15.0) and row["ttft"] == pytest.approx(1.0)
    assert not row["same_tokens"]  # a's second run gave other tokens


def test_the_table_gives_each_suites_geometric_mean(capsys):
    a = [run_of({"count": 10.0, "meaning": 10.0})]
    b = [run_of({"count": 20.0, "meaning": 5.0})]
    engine_ab.print_table(engine_ab.summarize(a, b), {"structured": ["count"], "open-ended": ["meaning"]})
    out = capsys.readouterr().out
    assert "| plain | count | 10.0 | 2.000 (2.000-2.000) | 1.000 | yes |" in out
    assert "plain, structured: b/a decode speed 2.000" in out and "plain, open-ended: b/a decode speed 0.500" in out


def test_a_whole_run_decodes_with_each_build_in_its_own_processes(prepared_cache):
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/engine_ab.py",
            "--a",
            "HEAD",
            "--b",
            "worktree",
            "--target",
            "smollm2-135m",
            "--draft",
            "smollm2-135m",
            "--quantization",
            "none",
            "--dtype",
            "float32",
            "--modes",
            "plain,k=3",
            "--suites",
            "structured",
            "--prompts",
            "count",
            "--max-tokens",
            "12",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=engine_ab.REPO,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr
    rows = [
        line for line in done.stdout.splitlines() if line.startswith("| plain | count") or line.startswith("| k=3 |")
    ]
    assert len(rows) == 2 and all(row.endswith("| yes |") for row in rows), done.stdout
    assert "k=3, structured: b/a decode speed" in done.stdout


def test_under_load_each_mode_serves_the_requests_a_few_at_a_time(prepared_cache):
    """--concurrency: one row per mode, the run's output throughput, tokens compared."""
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/engine_ab.py",
            "--a",
            "worktree",
            "--b",
            "worktree",
            "--target",
            "smollm2-135m",
            "--draft",
            "smollm2-135m",
            "--quantization",
            "none",
            "--dtype",
            "float32",
            "--modes",
            "plain,adaptive",
            "--suites",
            "structured",
            "--max-tokens",
            "12",
            "--rounds",
            "1",
            "--concurrency",
            "3",
            "--requests",
            "5",
        ],
        capture_output=True,
        text=True,
        cwd=engine_ab.REPO,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if "| 5 requests, 3 at a time |" in line]
    assert [row.split("|")[1].strip() for row in rows] == ["plain", "adaptive"], done.stdout
    assert all(row.endswith("| yes |") for row in rows)
    bad = subprocess.run(
        [sys.executable, "benchmarks/engine_ab.py", "--concurrency", "0"],
        capture_output=True,
        text=True,
        cwd=engine_ab.REPO,
        timeout=60,
    )
    assert bad.returncode == 2 and "--concurrency and --requests must be at least 1" in bad.stderr
