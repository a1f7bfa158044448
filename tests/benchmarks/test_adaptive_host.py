"""benchmarks/adaptive_host.py: the host's time adaptive k takes a drafting step."""

from __future__ import annotations

import sys

from benchmarks import adaptive_host


def test_the_steps_it_times_draft_and_fewer_as_the_batch_grows():
    _, _, alone = adaptive_host.host_seconds(batch=1, max_k=7, rate=0.8, steps=30, seed=0)
    _, _, crowded = adaptive_host.host_seconds(batch=64, max_k=7, rate=0.8, steps=30, seed=0)
    assert alone > 2 and crowded < alone


def test_it_prints_a_row_a_batch(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["adaptive_host.py", "--batches", "1,4", "--steps", "5"])
    adaptive_host.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "batch" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "4"]
