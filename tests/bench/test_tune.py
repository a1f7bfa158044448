"""`specserve tune`: the Leviathan prediction, a proposer's name as a speculative config,
the recommendation, and a real sweep on smollm2-135m (drafting for itself, and n-gram
lookup)."""

from __future__ import annotations

import json
import os

import pytest

from specserve.bench.tune import predicted_speedup, proposer_config, recommend
from specserve.cli import main
from specserve.config import SpecConfig
from specserve.model import native


def test_predicted_speedup_is_leviathans_formula():
    # alpha 0.5, k 3: (1 - 0.5^4) / 0.5 = 1.875 tokens per step; cost 3 * 0.1 + 1 = 1.3
    assert predicted_speedup(0.5, 3, 0.1) == pytest.approx(1.875 / 1.3)
    assert predicted_speedup(1.0, 7, 0.0) == 8  # every draft accepted, free drafts
    assert predicted_speedup(0.0, 5, 0.2) == pytest.approx(1 / 2)  # nothing accepted: pure cost
    assert predicted_speedup(None, 3, 0.1) is None and predicted_speedup(0.5, 0, 0.1) is None


def test_a_proposer_by_name_becomes_the_speculative_config_serve_takes():
    """As tune names them: a draft model, a lookup, a catalogue head or METHOD:FOLDER (a
    head drafts from k = 3 unless told, the others from 7); each parses as serve's flag."""
    cases = {
        "qwen2.5-coder-0.5b": {"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 7},
        "ngram": {"method": "ngram", "num_speculative_tokens": 7},
        "suffix": {"method": "suffix", "num_speculative_tokens": 7},
        "qwen2.5-coder-1.5b-eagle3": {
            "method": "eagle3",
            "model": "qwen2.5-coder-1.5b-eagle3",
            "num_speculative_tokens": 3,
        },
        "medusa:/heads/m": {"method": "medusa", "model": "/heads/m", "num_speculative_tokens": 3},
    }
    for name, config in cases.items():
        assert proposer_config(name) == config
        assert SpecConfig.parse(config).num_speculative_tokens == config["num_speculative_tokens"]
    assert proposer_config("eagle:/heads/e", 5)["num_speculative_tokens"] == 5


def test_recommend_takes_the_fastest_per_test_case_and_the_best_geometric_mean():
    rows = [
        {"test_case": "structured", "proposer": "plain", "k": 0, "speedup": 1.0},
        {"test_case": "open-ended", "proposer": "plain", "k": 0, "speedup": 1.0},
        {"test_case": "structured", "proposer": "d", "k": 7, "speedup": 2.5},
        {"test_case": "open-ended", "proposer": "d", "k": 7, "speedup": 0.5},
        {"test_case": "structured", "proposer": "d", "k": 3, "speedup": 1.8},
        {"test_case": "open-ended", "proposer": "d", "k": 3, "speedup": 0.9},
    ]
    best = recommend(rows)
    assert (best["structured"]["proposer"], best["structured"]["k"]) == ("d", 7)
    assert best["open-ended"]["proposer"] == "plain"
    # geometric means: plain 1.0, k=7 sqrt(1.25) = 1.118, k=3 sqrt(1.62) = 1.273
    assert (best["overall"]["proposer"], best["overall"]["k"]) == ("d", 3)


def test_tune_sweeps_drafts_and_k_on_real_weights(prepared_cache, tmp_path, capsys):
    os.environ["SPECSERVE_CACHE"] = prepared_cache
    argv = [
        "tune",
        "smollm2-135m",
        "--drafts",
        "smollm2-135m,ngram",
        "--k",
        "1,3",
        "--suites",
        "structured",
        "--max-tokens",
        "12",
        "--results-dir",
        str(tmp_path),
        "--json",
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    assert [(r["proposer"], r["k"]) for r in rows] == [
        ("plain", 0),
        ("smollm2-135m", 1),
        ("smollm2-135m", 3),
        ("ngram", 1),
        ("ngram", 3),
        ("smollm2-135m", "adaptive"),
        ("ngram", "adaptive"),
    ]
    assert rows[0]["speedup"] == 1.0 and rows[0]["acceptance_rate"] is None
    self_draft = rows[2]
    assert self_draft["acceptance_rate"] > 0.9  # the target drafting for itself is (nearly) always right
    assert self_draft["cost_ratio"] > 0  # timed: a position against a plain step, load-dependent
    assert self_draft["predicted_speedup"] == pytest.approx(
        predicted_speedup(self_draft["acceptance_rate"], self_draft["mean_draft_length"], self_draft["cost_ratio"])
    )
    assert 1 <= self_draft["mean_draft_length"] <= 3
    assert rows[3]["cost_ratio"] == 0.0
    # Whether adaptive drafts with the self-draft follows the timed costs; where it does,
    # its drafts are (nearly) always right.
    assert rows[5]["acceptance_rate"] is None or rows[5]["acceptance_rate"] > 0.9
    assert rows[6]["acceptance_rate"] > 0 and 0 < rows[6]["mean_draft_length"] <= 3  # n-gram drafts are free
    assert rows[6]["predicted_speedup"] is None  # the formula assumes one k every step
    assert set(report["recommended"]) == {"structured", "overall"}
    assert "Recommended:" in (tmp_path / "tune.md").read_text()
    if native.unavailable_reason() is None:  # the arithmetic peak needs our kernels
        ceiling = report["ceiling"]
        # the target drafting for itself costs a plain step a position: no k can pay
        assert ceiling["smollm2-135m"]["max_speedup"] <= 1.0 + 1e-9
        assert ceiling["smollm2-135m"]["draft_position_s"] == pytest.approx(ceiling["ngram"]["plain_step_s"])
        assert ceiling["ngram"]["draft_position_s"] == 0.0 and ceiling["ngram"]["max_speedup"] > 1.0
        assert "Ceiling on this machine" in (tmp_path / "tune.md").read_text()
    else:
        assert report["ceiling"] is None
    # The bound measured from the engine's steps (timed), the draft always drafting k. The
    # n-gram proposer has no steps to force.
    measured = report["full_acceptance"]
    assert set(measured) == {"smollm2-135m"}
    assert [row["k"] for row in measured["smollm2-135m"]["rows"]] == [0, 1, 3]
    assert measured["smollm2-135m"]["best_k"] in (1, 3)
    assert measured["smollm2-135m"]["max_speedup"] == max(
        row["full_acceptance_speedup"] for row in measured["smollm2-135m"]["rows"][1:]
    )
    assert "Measured with every draft accepted" in (tmp_path / "tune.md").read_text()
    assert json.loads((tmp_path / "tune.json").read_text())["rows"] == rows


def test_tune_sweeps_suffix_decoding_as_a_free_lookup(prepared_cache, tmp_path, capsys):
    """Suffix decoding's rows, its answers before teaching the ones after: no model to
    time (cost 0) and no steps to force (no measured bound)."""
    os.environ["SPECSERVE_CACHE"] = prepared_cache
    argv = ["tune", "smollm2-135m", "--drafts", "suffix", "--k", "1,3", "--suites", "structured"]
    assert main([*argv, "--max-tokens", "12", "--results-dir", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    assert [(r["proposer"], r["k"]) for r in rows] == [
        ("plain", 0),
        ("suffix", 1),
        ("suffix", 3),
        ("suffix", "adaptive"),
    ]
    assert all(r["cost_ratio"] == 0.0 for r in rows[1:])
    assert any(r["acceptance_rate"] for r in rows[1:])  # `repeat` and `count` repeat themselves
    assert report["full_acceptance"] == {}


def test_tune_sweeps_heads_within_their_reach(prepared_cache, tmp_path, capsys):
    from specserve import catalogue
    from specserve.config import ModelConfig
    from specserve.spec.heads.checkpoint import save_head
    from tests.head_models import NUM_MEDUSA_HEADS, random_head

    os.environ["SPECSERVE_CACHE"] = prepared_cache
    config = ModelConfig.from_hf(json.loads((catalogue.prepared_dir("smollm2-135m") / "config.json").read_text()))
    for method in ("eagle3", "medusa"):
        save_head(random_head(method, config, seed=3), tmp_path / method)
    eagle, medusa = f"eagle3:{tmp_path / 'eagle3'}", f"medusa:{tmp_path / 'medusa'}"
    too_deep = NUM_MEDUSA_HEADS + 2
    argv = ["tune", "smollm2-135m", "--drafts", f"{eagle},{medusa}", "--k", f"1,{too_deep}"]
    argv += ["--suites", "structured", "--max-tokens", "12", "--results-dir", str(tmp_path / "out"), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["proposer"], r["k"]) for r in report["rows"]] == [
        ("plain", 0),
        (eagle, 1),
        (eagle, too_deep),
        (medusa, 1),  # k past its heads is not swept
        (eagle, "adaptive"),
        (medusa, "adaptive"),
    ]
    assert all(r["cost_ratio"] > 0 for r in report["rows"][1:])  # timed: a position against a plain step
    measured = report["full_acceptance"]
    assert [row["k"] for row in measured[eagle]["rows"]] == [0, 1, too_deep]
    assert [row["k"] for row in measured[medusa]["rows"]] == [0, 1]
    if report["ceiling"] is not None:
        assert set(report["ceiling"]) == {eagle, medusa}


def test_tune_refuses_bad_flags_in_one_line(capsys):
    assert main(["tune", "smollm2-135m", "--k", "one"]) == 2
    assert "--k takes comma-separated integers" in capsys.readouterr().err
    assert main(["tune", "smollm2-135m", "--suites", "poetry"]) == 2
    assert "suites from" in capsys.readouterr().err
