"""benchmarks/gpu_check.py on the CPU with tiny shapes: every section but the ones that
need a GPU or a tokenizer runs and fills its rows (the figures mean nothing here)."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_check
from tests.conftest import tiny_config


def test_the_check_fills_its_table_from_config_files_alone(tmp_path, capsys):
    for name, layers in (("target", 3), ("draft", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(tiny_config("qwen2", num_layers=layers).to_hf()))
    out = tmp_path / "check.json"
    args = ["--device", "cpu", "--models", str(tmp_path), "--target", "target", "--draft", "draft"]
    args += ["--sections", "plain,sampling,profile,ceiling,heads,adaptive,long,chunks", "--modes", "eager,graphs"]
    args += ["--batches", "1,2"]
    args += ["--adaptive-mode", "graphs", "--adaptive-k", "2", "--adaptive-max-k", "3"]
    args += ["--tokens", "6", "--batch-tokens", "4", "--contexts", "40", "--long-modes", "graphs"]
    args += ["--chunk-prompt-tokens", "150", "--capacity", "64"]
    args += ["--ks", "1,2", "--head-ks", "1,2", "--ceiling-tokens", "16", "--rounds", "1", "--draft-vocab", "48"]
    args += ["--ceiling-modes", "graphs", "--heads-mode", "graphs", "--sampled-ks", "2", "--json-out", str(out)]
    assert gpu_check.main(args) == 0
    rows = json.loads(out.read_text())
    assert not [r for r in rows if r["what"] == "failed"], rows
    fields = sorted({field for row in (*gpu_check.SAMPLED_ROWS, *gpu_check.SAMPLED_ALONE) for field in row})
    plain = {
        (r["mode"], r["batch"], tuple(r.get(field) for field in fields), r.get("alone")): r["tokens_per_s"]
        for r in rows
        if r["section"] == "plain"
    }
    greedy = {(m, b, (None,) * len(fields), None) for m in ("eager", "graphs") for b in (1, 2)}
    sampled = {(tuple(row.get(field) for field in fields), False) for row in gpu_check.SAMPLED_ROWS}
    sampled |= {(tuple(row.get(field) for field in fields), True) for row in gpu_check.SAMPLED_ALONE}
    assert set(plain) == greedy | {(m, 2, *row) for m in ("eager", "graphs") for row in sampled}
    assert min(plain.values()) > 0
    first_tokens = [r["first_tokens_s"] for r in rows if "first_tokens_s" in r]  # the greedy rows'
    assert len(first_tokens) == 4 and min(first_tokens) > 0
    for section in ("sampling", "profile"):  # a GPU's
        assert {r["what"] for r in rows if r["section"] == section} == {"skipped"}
    heads = [r for r in rows if r["section"] == "heads" and "k" in r]
    sampled_row = "temperature 0.8, top_p 0.95, seed 7 k = 2"  # a seeded request's guesses, in the chains
    assert {(r["what"].split(",")[1].split()[0], r["k"], r["what"].endswith(sampled_row)) for r in heads} == {
        (m, k, False) for m in ("eagle3", "medusa") for k in (1, 2)
    } | {("eagle3", 2, True)}
    ceiling = [r["what"] for r in rows if r["section"] == "ceiling" and "k" in r]
    assert len(ceiling) == 3 and ceiling[-1].endswith(sampled_row)
    adaptive = {(r["kind"], r["batch"]): r["ratio"] for r in rows if r["section"] == "adaptive"}
    assert set(adaptive) == {(p, b) for p in ("draft", "ngram", "eagle3") for b in (1, 2)}
    assert min(adaptive.values()) > 0
    chunks = [r for r in rows if r["section"] == "chunks"]
    for priced in (False, True):  # the stream's step by quarter of the prompt it read beside, the prompt's TTFT
        rows_of = [r for r in chunks if r["priced"] == priced]
        assert {r.get("low") for r in rows_of} <= {None, 0, 38, 76, 114} and {None, 0} <= {
            r.get("low") for r in rows_of
        }
        assert min(r.get("step_s", r.get("ttft_s")) for r in rows_of) > 0
    assert "| section | what | figure | note |" in capsys.readouterr().out


def test_an_unknown_section_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit:
        gpu_check.main(["--sections", "plain,bogus"])
    assert exit.value.code == 2
    assert "unknown section(s) ['bogus']" in capsys.readouterr().err


def test_the_train_section_reports_train_heads_rates(prepared_cache, tmp_path, monkeypatch):
    """Run as on a GPU, here on the CPU: a random checkpoint of the test model's shapes
    through `specserve train-head`, its training.json read into two rows."""
    from specserve import catalogue
    from specserve.model import native

    monkeypatch.setenv("SPECSERVE_CACHE", prepared_cache)
    folder = catalogue.prepare("smollm2-135m")
    native.library()  # compiled once, into the cache whose kernels the section shares
    out = tmp_path / "check.json"
    args = ["--device", "cpu", "--models", str(folder.parent), "--target", folder.name, "--draft", folder.name]
    args += ["--sections", "train", "--train-minutes", "1", "--train-args", "-q none --answer-tokens 16"]
    assert gpu_check.main([*args, "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["what"].split(",")[0] for r in rows if r["section"] == "train"] == ["answers", "eagle3 head"], rows
    assert min(r.get("answer_tokens_per_minute", r.get("steps_per_minute")) for r in rows[1:]) > 0
