"""benchmarks/kernel_ab.py: two builds of our kernels taking turns, each in processes of its own."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from benchmarks import kernel_ab
from specserve.model import native
from specserve.model.decoder import FloatLinear
from specserve.model.quant import QuantizedLinear, quantize_int4

needs_kernel = pytest.mark.skipif(
    native.unavailable_reason() is not None,
    reason=f"the native kernel cannot run here: {native.unavailable_reason()}",
)


def test_a_build_is_a_folder_or_a_git_revision(tmp_path):
    assert kernel_ab.kernel_sources("worktree", tmp_path) == native.KERNELS
    assert kernel_ab.kernel_sources(str(tmp_path), tmp_path) == tmp_path
    head = kernel_ab.kernel_sources("HEAD", tmp_path)
    assert (head / "quantized_matmul.c").is_file() and head.is_relative_to(tmp_path)
    with pytest.raises(SystemExit, match="neither a folder nor a git revision"):
        kernel_ab.kernel_sources("no-such-revision", tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_are_compared_bit_for_bit(dtype):
    a = torch.tensor([1.0, float("nan"), 0.0], dtype=dtype)
    same = kernel_ab.digest([a])
    assert kernel_ab.digest([a.clone()]) == same  # a NaN is the same bits as itself
    assert kernel_ab.digest([torch.tensor([1.0, float("nan"), -0.0], dtype=dtype)]) != same
    assert kernel_ab.digest([torch.tensor([1.0 + 2**-7, float("nan"), 0.0], dtype=dtype)]) != same
    assert kernel_ab.digest([a[:2]]) != same
    assert kernel_ab.digest([a.view(3, 1)]) != same  # the same bits in another shape


@needs_kernel
def test_two_builds_of_the_same_sources_give_the_same_bits(tmp_path):
    torch.manual_seed(0)
    gate_up = nn.Linear(64, 2 * 96, bias=False)
    layers = [
        (QuantizedLinear.from_state(quantize_int4(nn.Linear(64, 64).weight.detach()), None), False),
        (FloatLinear(gate_up.to(torch.bfloat16)), True),  # called gated, as the decoder does
    ]
    library = native.library
    results = [
        kernel_ab.measure(
            native.load_library(kernel_ab.build_library(native.KERNELS, tmp_path / f"{name}.so")),
            layers,
            rows=[1, 3],
            passes=2,
            dtype=torch.bfloat16,
        )
        for name in "ab"
    ]
    assert native.library is library  # put back
    for count in (1, 3):
        assert results[0][count][0] > 0 and results[1][count][0] > 0
        assert results[0][count][1] == results[1][count][1]


def test_builds_take_turns_and_ratios_are_against_the_first(capsys):
    calls = []
    seconds = {"a": 2.0, "b": 3.0}

    def run(command):
        calls.append(command[0])
        return {8: (seconds[command[0]], "same" if command[0] == "a" or len(calls) < 4 else "moved")}

    result = kernel_ab.compare({"a": ["a"], "b": ["b"]}, rounds=3, run=run)
    assert calls == ["a", "b", "b", "a", "a", "b"]  # neither always follows the other
    assert result[8]["a"] == (2.0, [1.0, 1.0, 1.0])
    assert result[8]["b"] == (3.0, [1.5, 1.5, 1.5])
    assert "rows 8: b's outputs differ from a's" in capsys.readouterr().out


@needs_kernel
def test_a_whole_run_measures_each_build_in_its_own_processes(prepared_cache, tmp_path):
    import subprocess

    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/kernel_ab.py",
            "--a",
            "HEAD",
            "--b",
            "worktree",
            "--target",
            "smollm2-135m",
            "--quantization",
            "none",
            "--dtype",
            "bfloat16",
            "--rows",
            "1,2",
            "--rounds",
            "1",
            "--passes",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=kernel_ab.REPO,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("rows")]
    assert len(lines) == 4 and "differ" not in done.stdout  # rows 1 and 2, each build
    assert "median x1.000 the time of a" in lines[0]


@needs_kernel
def test_whole_forwards_run_through_decode_blocks_on_the_given_build(tmp_path, monkeypatch):
    from tests.model.test_native import quantized_tiny_model

    model = quantized_tiny_model("qwen2", "int4")
    calls = []
    run = native.ModelInC.run_blocks
    monkeypatch.setattr(
        native.ModelInC, "run_blocks", lambda self, *args, **kwargs: calls.append(1) or run(self, *args, **kwargs)
    )
    library = native.library
    results = [
        kernel_ab.measure_forwards(
            native.load_library(kernel_ab.build_library(native.KERNELS, tmp_path / f"{n}.so")),
            model,
            rows=[1, 3],
            passes=2,
        )
        for n in "ab"
    ]
    assert native.library is library  # put back
    assert len(calls) == 2 * 2 * 3  # builds x row counts x (warm-up + passes), every one in one C call
    for count in (1, 3):
        assert results[0][count][0] > 0 and results[0][count][1] == results[1][count][1]
    assert results[0][1][1] != results[0][3][1]  # the digest is of each row count's own logits
