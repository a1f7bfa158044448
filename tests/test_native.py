"""Our C kernels (specserve/model/kernels/): the int4/int8 x int8 matmul and RMSNorm
compute exactly the arithmetic they promise, every row is bitwise the same however many
rows share the call, and where they cannot run PyTorch takes over."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.model import native
from specserve.model.decoder import RMSNorm, grouped_attention
from specserve.model.quant import QuantizedLinear, quantize_int4, quantize_int8
from tests.test_quant import dequantize_int4, dequantize_int8

needs_kernel = pytest.mark.skipif(
    native.unavailable_reason() is not None,
    reason=f"the native kernel cannot run here: {native.unavailable_reason()}",
)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies by: x [T, K] rounded to int8 per group of 32
    (scale max|x| / 127), as float64."""
    groups = x.float().view(x.shape[0], -1, 32)  # [T, G, 32]
    scale = groups.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    levels = (groups * inverse).round()  # half to even, as the kernel's conversion
    return (levels * scale).view_as(x).double()


def layer_and_weight(bits: int, out_features: int, in_features: int, bias: bool, seed: int = 0):
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    if bits == 4:
        state = quantize_int4(linear.weight.detach())
        weight = dequantize_int4(state, in_features)
    else:
        state = quantize_int8(linear.weight.detach())
        weight = dequantize_int8(state)
    layer = QuantizedLinear.from_state(state, linear.bias)
    bias_value = None if linear.bias is None else linear.bias.detach().bfloat16().double()
    return layer, weight.double(), bias_value


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "out_features, in_features",
    # whole super-blocks, 3 groups, 16 + 12 groups; int4 rows in pairs with an odd one left
    [(48, 512), (40, 96), (24, 896), (16, 1536), (25, 4608)],
)
def test_kernel_computes_int8_activations_times_the_stored_weights(bits, out_features, in_features):
    layer, weight, bias = layer_and_weight(bits, out_features, in_features, bias=True)
    assert layer.native
    x = torch.randn(11, in_features).bfloat16()  # more rows than one tile
    expected = quantize_activations(x) @ weight.t() + bias
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (11, out_features)
    # Only float32 accumulation and the final bfloat16 rounding stand between them.
    assert torch.allclose(got.double(), expected, rtol=2**-7, atol=1e-3 * expected.abs().max())


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("in_features", [896, 4608])
def test_every_row_is_the_same_whatever_shares_the_call(bits, in_features):
    layer, _, _ = layer_and_weight(bits, 40, in_features, bias=False, seed=3)
    x = torch.randn(13, in_features).bfloat16()
    together = layer(x)
    for row in range(13):
        assert torch.equal(layer(x[row : row + 1]), together[row : row + 1])
    for start, stop in ((2, 9), (5, 13)):  # another slot, other neighbours
        assert torch.equal(layer(x[start:stop]), together[start:stop])
    assert layer(x[:0]).shape == (0, 40)


@needs_kernel
def test_the_kernels_are_compiled_once_into_the_artifacts_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    (tmp_path / "kernels").mkdir()
    stale = tmp_path / "kernels" / "specserve-kernels-0000000000000000.so"  # from older sources
    stale.write_bytes(b"")
    native.library.cache_clear()
    try:
        assert native.library() is not None
        assert not stale.exists()
        [built] = (tmp_path / "kernels").glob("*.so")
        stamp = built.stat().st_mtime_ns
        native.library.cache_clear()
        assert native.library() is not None
        assert built.stat().st_mtime_ns == stamp  # loaded, not compiled again
    finally:
        native.library.cache_clear()


def test_without_the_kernel_pytorch_computes_the_same_layer(monkeypatch):
    layer, weight, bias = layer_and_weight(4, 32, 128, bias=True, seed=5)
    x = torch.randn(3, 128).bfloat16()
    ours = layer(x)
    monkeypatch.setenv("SPECSERVE_NATIVE_KERNELS", "0")
    native.library.cache_clear()
    try:
        assert native.unavailable_reason() == "SPECSERVE_NATIVE_KERNELS=0"
        fallback, _, _ = layer_and_weight(4, 32, 128, bias=True, seed=5)
        assert not fallback.native
        expected = x.double() @ weight.t() + bias
        assert torch.allclose(fallback(x).double(), expected, rtol=0.02, atol=0.05)
        # One layer's weights through both kernels: close, not equal (int8 activations).
        assert torch.allclose(ours.double(), fallback(x).double(), rtol=0.05, atol=0.05)
    finally:
        monkeypatch.delenv("SPECSERVE_NATIVE_KERNELS")
        native.library.cache_clear()


@needs_kernel
def test_rms_norm_is_the_float32_reference_row_by_row():
    torch.manual_seed(7)
    norm = RMSNorm(128, 1e-6)
    norm.weight.data = torch.randn(128).bfloat16()
    x = (torch.randn(5, 3, 256) * 4).bfloat16()[:, :, 64:192]  # [T, heads, head_dim], not contiguous
    got = norm(x)
    x32 = x.float()
    expected = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    # The sum of squares is added in another order: at most a bfloat16 rounding apart.
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), expected.float(), rtol=2**-7, atol=0)
    assert torch.equal(norm(x[2:3]), got[2:3])


@needs_kernel
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_decode_attention_is_each_token_attending_alone(dtype, tolerance):
    torch.manual_seed(8)
    keys = torch.randn(2, 80, 32).to(dtype)  # [kv_heads, capacity, head_dim], 6 query heads each
    values = torch.randn(2, 80, 32).to(dtype)
    q = torch.randn(5, 12, 32).to(dtype)  # 5 new tokens at positions 40..44
    assert native.supports_decode_attention(q, keys)
    got = native.decode_attention(q, keys, values, start=40)
    heads_first = q.transpose(0, 1)
    for i in range(5):
        expected = grouped_attention(heads_first[:, i : i + 1], keys[:, : 41 + i], values[:, : 41 + i])[:, 0]
        assert torch.allclose(got[i].float(), expected.float(), atol=tolerance, rtol=tolerance)
        # Alone, a token gets bit for bit what it got among the others.
        assert torch.equal(native.decode_attention(q[i : i + 1], keys, values, start=40 + i), got[i : i + 1])
    assert not native.supports_decode_attention(torch.randn(1, 12, 24), torch.randn(2, 80, 24))  # head size
