"""Our int4 and int8 kernel for AVX2 CPUs (specserve/model/kernels/avx2/): it computes
int8 activations times the stored weights, every row is bitwise the same however many rows
share the call, and a `QuantizedLinear` takes it where `native`'s kernels cannot run.
On a CPU with AVX-512 VNNI, `native` is hidden so that these run too."""

from __future__ import annotations

import pytest
import torch

from specserve.model import avx2, native
from specserve.model.quant import silu_and_mul
from tests.model.test_native import layer_and_weight, quantize_activations

pytestmark = pytest.mark.skipif(
    avx2.unavailable_reason() is not None, reason=f"the AVX2 kernel cannot run here: {avx2.unavailable_reason()}"
)


@pytest.fixture(autouse=True)
def without_native(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "out_features, in_features, rows",
    # an odd number of groups (3), one group, long rows; rows of whole tiles and not
    [(40, 96, 11), (24, 32, 4), (16, 1536, 1), (33, 8960, 5)],
)
def test_kernel_computes_int8_activations_times_the_stored_weights(bits, out_features, in_features, rows):
    layer, weight, bias = layer_and_weight(bits, out_features, in_features, bias=True)
    assert layer.avx2 and not layer.native
    x = torch.randn(rows, in_features).bfloat16()
    expected = quantize_activations(x) @ weight.t() + bias
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    # Only float32 accumulation and the final bfloat16 rounding stand between them.
    assert torch.allclose(got.double(), expected, rtol=2**-7, atol=1e-3 * expected.abs().max())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("in_features, rows", [(96, 9), (1536, 13), (8960, 6)])
def test_every_row_is_the_same_whatever_shares_the_call(bits, in_features, rows):
    layer, _, _ = layer_and_weight(bits, 20, in_features, bias=True, seed=3)
    x = torch.randn(rows, in_features).bfloat16()
    together = layer(x)
    for start in range(rows):
        alone = layer(x[start : start + 1])
        assert torch.equal(alone, together[start : start + 1]), start
    assert torch.equal(layer(x[2:7]), together[2:7])


@pytest.mark.parametrize("bits", [4, 8])
def test_a_cut_layer_and_pytorchs_kernel_agree_with_it(monkeypatch, bits):
    layer, weight, bias = layer_and_weight(bits, 48, 256, bias=False, seed=7)
    x = torch.randn(5, 256).bfloat16()
    whole = layer(x)
    assert torch.equal(layer.first_rows(30)(x), whole[:, :30])
    monkeypatch.setattr(avx2, "library", lambda: None)
    pytorchs, _, _ = layer_and_weight(bits, 48, 256, bias=False, seed=7)
    assert not pytorchs.avx2
    # One layer's weights through both kernels: close, not equal (int8 activations).
    assert torch.allclose(whole.double(), pytorchs(x).double(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_gated_call_is_silu_of_the_gate_times_up(bits):
    layer, _, _ = layer_and_weight(bits, 64, 96, bias=True, seed=11)  # 32 gate rows, then 32 up rows
    x = torch.randn(6, 96).bfloat16()
    gated = layer.silu_and_mul(x)
    assert gated.shape == (6, 32) and gated.dtype == torch.bfloat16
    # The same roundings as PyTorch's silu of the stored gate times up, up to expf's last bit.
    torch.testing.assert_close(gated, silu_and_mul(layer(x)), rtol=2**-7, atol=1e-3)
    assert torch.equal(layer.silu_and_mul(x[2:3]), gated[2:3])
