"""benchmarks/kernel_ab.py: two builds of our kernels taking turns in one process."""

from __future__ import annotations

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
    assert kernel_ab.same_bits(a, a.clone())  # a NaN is the same bits as itself
    assert not kernel_ab.same_bits(a, torch.tensor([1.0, float("nan"), -0.0], dtype=dtype))
    assert not kernel_ab.same_bits(a, torch.tensor([1.0 + 2**-7, float("nan"), 0.0], dtype=dtype))
    assert not kernel_ab.same_bits(a, a[:2])


@needs_kernel
def test_two_builds_take_turns_on_the_same_layers_and_agree(tmp_path, capsys):
    torch.manual_seed(0)
    gate_up = nn.Linear(64, 2 * 96, bias=False)
    layers = [
        (QuantizedLinear.from_state(quantize_int4(nn.Linear(64, 64).weight.detach()), None), False),
        (FloatLinear(gate_up.to(torch.bfloat16)), True),  # called gated, as the decoder does
    ]
    libraries = {name: kernel_ab.build_library(native.KERNELS, tmp_path / f"{name}.so") for name in ("a", "b")}
    library = native.library
    result = kernel_ab.compare(libraries, layers, rows=3, rounds=2, dtype=torch.bfloat16)
    assert native.library is library  # put back
    assert set(result) == {"a", "b"}
    for seconds, ratios in result.values():
        assert seconds > 0 and len(ratios) == 2 and all(r > 0 for r in ratios)
    assert result["a"][1] == [1.0, 1.0]
    assert "differ" not in capsys.readouterr().out  # the same sources give the same bits
