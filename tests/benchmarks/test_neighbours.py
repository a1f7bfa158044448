"""benchmarks/neighbours.py: greedy requests beside a neighbour of each kind."""

from __future__ import annotations

import json

import pytest

from benchmarks import neighbours


def test_every_kind_is_timed_against_the_greedy_neighbour_round_by_round(prepared_cache, tmp_path, capsys):
    out = tmp_path / "rows.json"
    args = ["--target", "smollm2-135m", "--draft", "smollm2-135m", "--quantization", "none"]
    args += ["--greedy", "2", "--tokens", "6", "--rounds", "2", "--json-out", str(out)]
    assert neighbours.main(args) == 0
    rows = {row["kind"]: row for row in json.loads(out.read_text())}
    assert list(rows) == list(neighbours.KINDS)
    assert rows["greedy"]["ratios"] == [1.0, 1.0] and all(row["tokens_per_s"] > 0 for row in rows.values())
    assert "vs greedy neighbour" in capsys.readouterr().out


@pytest.mark.parametrize("kinds", ["sampled", "greedy,fast"])
def test_kinds_must_be_known_and_hold_the_greedy_reference(kinds, capsys):
    with pytest.raises(SystemExit):
        neighbours.main(["--kinds", kinds])
    assert "--kinds takes" in capsys.readouterr().err
