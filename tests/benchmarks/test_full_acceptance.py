"""benchmarks/full_acceptance.py: what each k would give with every draft accepted, measured."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import full_acceptance

TEST_PAIR = ["--target", "smollm2-135m", "--draft", "smollm2-135m", "--max-tokens", "20"]


def rows_of(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_each_k_is_priced_against_the_plain_step_of_its_round(prepared_cache, capsys):
    """int4 runs fused: each step is split into its drafting and verifying parts."""
    assert full_acceptance.main([*TEST_PAIR, "--quantization", "int4", "--ks", "3,1", "--rounds", "1", "--json"]) == 0
    plain, k1, k3 = rows_of(capsys.readouterr().out)
    assert (plain["k"], k1["k"], k3["k"]) == (0, 1, 3) and set(plain) == {"k", "step_s"}
    for row in (k1, k3):
        # one round: the median is that round's (k + 1) plain steps over the step's time
        assert row["full_acceptance_speedup"] == pytest.approx((row["k"] + 1) * plain["step_s"] / row["step_s"])
        assert row["break_even_tokens"] == pytest.approx(row["step_s"] / plain["step_s"])
        assert row["drafting_s"] > 0 and row["verifying_s"] > 0  # medians of their own: timed, unordered


def test_the_table_says_whether_the_target_speedup_is_in_reach(prepared_cache, capsys):
    args = [*TEST_PAIR, "--quantization", "none", "--dtype", "float32", "--ks", "2", "--rounds", "2"]
    assert full_acceptance.main([*args, "--target-speedup", "50"]) == 0
    out = capsys.readouterr().out
    assert "| 2 |" in out and "| - | - |" not in out  # unfused: the proposer's call against the rest
    assert "50x would need a step of k = 2" in out and "out of reach at any acceptance" in out
    assert full_acceptance.main([*args, "--target-speedup", "0.01"]) == 0
    assert "out of reach" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ks", "0,3"], "--ks must be >= 1"),
        (["--ks", "three"], "--ks takes whole numbers"),
        (["--prompt", "poem"], "--prompt must be one of"),
        (["--rounds", "0"], "--rounds must be >= 1"),
    ],
)
def test_bad_flags_are_refused_with_the_fix(flags, message, capsys):
    with pytest.raises(SystemExit):
        full_acceptance.main([*TEST_PAIR, *flags])
    assert message in capsys.readouterr().err


def test_too_few_tokens_for_a_whole_step_is_an_error_not_a_crash(prepared_cache, capsys):
    args = [
        *TEST_PAIR[:4],
        "--quantization",
        "none",
        "--dtype",
        "float32",
        "--ks",
        "8",
        "--rounds",
        "1",
        "--max-tokens",
        "9",
    ]
    assert full_acceptance.main(args) == 1
    assert "9 tokens leave no whole step of k = 8; decode more (--max-tokens)" in capsys.readouterr().err


def test_a_heads_draft_position_is_priced_in_plain_steps(prepared_cache, tmp_path, capsys):
    """--method eagle3 with a (random) head: every step drafts k whatever it guesses, and
    the table gives a draft position's cost in plain steps."""
    from specserve.catalogue import load_model
    from specserve.spec.heads.checkpoint import save_head
    from specserve.spec.heads.eagle import EagleConfig, EagleHead

    target = load_model("smollm2-135m").config
    torch.manual_seed(0)
    save_head(EagleHead(EagleConfig.for_target(target, version=3, draft_vocab_size=512)), tmp_path / "head")
    args = [
        "--target",
        "smollm2-135m",
        "--draft",
        str(tmp_path / "head"),
        "--method",
        "eagle3",
        "--quantization",
        "none",
        "--dtype",
        "float32",
        "--ks",
        "3",
        "--rounds",
        "1",
        "--max-tokens",
        "20",
    ]
    assert full_acceptance.main([*args, "--json"]) == 0
    plain, k3 = rows_of(capsys.readouterr().out)
    assert k3["drafting_s"] > 0 and k3["step_s"] > 0 and k3["full_acceptance_speedup"] > 0  # timed
    assert full_acceptance.main(args) == 0
    assert "eagle3" in capsys.readouterr().out
