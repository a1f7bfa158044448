"""Our C kernels (specserve/model/kernels/): the int4/int8 x int8 matmul, RMSNorm and
decode attention compute exactly the arithmetic they promise, every row is bitwise the
same however many rows share the call, and where they cannot run PyTorch takes over."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.model import native
from specserve.model.decoder import Capture, Decoder, RMSNorm, Segment
from specserve.model.kv_cache import KVCache
from specserve.model.quant import (
    QuantizedLinear,
    load_quantized_state,
    quantize_int4,
    quantize_int8,
    quantized_state,
    silu_and_mul,
)
from tests.conftest import tiny_config
from tests.model.test_decoder import reference_and_ours
from tests.model.test_quant import dequantize_int4, dequantize_int8

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
@pytest.mark.parametrize("in_features, rows", [(896, 13), (4608, 13), (1536, 24), (4640, 14), (8960, 5), (8960, 17)])
def test_every_row_is_the_same_whatever_shares_the_call(bits, in_features, rows):
    # int4 weight rows go in pairs for many rows (24 x 1536) or long ones (4608), one
    # at a time for a few short ones; long rows with 4-16 activation rows in chunks of
    # 64 groups (4640: two and 17 groups, the last super-block of one), over more units
    # than one pass takes (70 weight rows), one row alone and 17 rows whole: each output
    # the same either way
    layer, _, _ = layer_and_weight(bits, 70, in_features, bias=False, seed=3)
    x = torch.randn(rows, in_features).bfloat16()
    together = layer(x)
    for row in range(rows):
        assert torch.equal(layer(x[row : row + 1]), together[row : row + 1])
    for start, stop in ((2, 9), (5, 13)):  # another slot, other neighbours
        assert torch.equal(layer(x[start:stop]), together[start:stop])
    assert layer(x[:0]).shape == (0, 70)


# bfloat16 on vdpbf16ps where the CPU has it, and with the weights widened (any AVX-512 CPU)
FLOAT_KINDS = [
    pytest.param(torch.float32, None, id="float32"),
    pytest.param(torch.bfloat16, False, id="bfloat16-widened"),
    pytest.param(
        torch.bfloat16,
        True,
        id="bfloat16-dot",
        marks=pytest.mark.skipif(not native.has_bf16_dot(), reason="the CPU has no vdpbf16ps (avx512_bf16)"),
    ),
]


@needs_kernel
@pytest.mark.parametrize("dtype, dot", FLOAT_KINDS)
@pytest.mark.parametrize(
    "out_features, in_features, bias",
    # weight rows in threes with one or two left; K in 32s, 16s, and with a masked tail
    [(48, 512, True), (40, 96, False), (25, 1000, True), (7, 13, True)],
)
def test_float_kernel_is_the_float64_product(out_features, in_features, bias, dtype, dot):
    torch.manual_seed(5)
    linear = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    x = torch.randn(11, in_features, dtype=dtype)  # more rows than one tile
    weight, bias_ = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    got = native.float_matmul(x, weight, bias_, bf16_dot=dot)
    expected = x.double() @ weight.double().t()
    if bias:
        expected += bias_.double()
    assert got.dtype == dtype and got.shape == (11, out_features)
    # float32 sums, rounded once to the output type
    rtol = 1e-5 if dtype == torch.float32 else 2**-8
    assert torch.allclose(got.double(), expected, rtol=rtol, atol=1e-5)
    batched = native.float_matmul(x.view(1, 11, in_features), weight, None, bf16_dot=dot)  # [..., K] rows
    assert batched.shape == (1, 11, out_features)


@needs_kernel
@pytest.mark.parametrize("dtype, dot", FLOAT_KINDS)
@pytest.mark.parametrize("in_features, rows", [(1536, 13), (1000, 20)])
def test_float_kernel_rows_are_the_same_whatever_shares_the_call(in_features, rows, dtype, dot):
    torch.manual_seed(6)
    weight = torch.randn(41, in_features, dtype=dtype)
    x = torch.randn(rows, in_features, dtype=dtype)
    together = native.float_matmul(x, weight, None, bf16_dot=dot)
    for row in range(rows):
        assert torch.equal(native.float_matmul(x[row : row + 1], weight, None, bf16_dot=dot), together[row : row + 1])
    # another slot, other neighbours; 2 and 4 rows take one weight row at a time, 7-8 three
    for start, stop in ((3, 5), (7, 11), (2, 9), (5, 13)):
        assert torch.equal(native.float_matmul(x[start:stop], weight, None, bf16_dot=dot), together[start:stop])
    assert native.float_matmul(x[:0], weight, None, bf16_dot=dot).shape == (0, 41)


@needs_kernel
@pytest.mark.skipif(not native.has_bf16_dot(), reason="the CPU has no vdpbf16ps (avx512_bf16)")
@pytest.mark.parametrize("in_features", [1536, 1000, 13])
@pytest.mark.parametrize("gated", [False, True])
def test_bfloat16_dot_and_widened_weights_give_the_same_bits(in_features, gated):
    """vdpbf16ps and the widened weights add the same exact products in the same order
    (away from subnormal numbers, which vdpbf16ps takes as zeros)."""
    torch.manual_seed(7)
    weight, bias = torch.randn(38, in_features).bfloat16(), torch.randn(38).bfloat16()
    for rows in (1, 8, 9, 30):
        x = torch.randn(rows, in_features).bfloat16()
        assert torch.equal(
            native.float_matmul(x, weight, bias, gated=gated, bf16_dot=True),
            native.float_matmul(x, weight, bias, gated=gated, bf16_dot=False),
        )


@needs_kernel
@pytest.mark.parametrize(
    "dot",
    [
        False,
        pytest.param(
            True, marks=pytest.mark.skipif(not native.has_bf16_dot(), reason="the CPU has no vdpbf16ps (avx512_bf16)")
        ),
    ],
)
def test_gated_bfloat16_kernel_is_silu_of_the_gate_times_up(dot):
    """A bfloat16 SwiGLU gate/up projection in one call: silu(gate) * up from the
    ungated call's gate and up, and each row the same in any company."""
    torch.manual_seed(8)
    weight, bias = torch.randn(2 * 40, 512).bfloat16(), torch.randn(2 * 40).bfloat16()  # 40 outputs: 16 + 16 + 8
    x = torch.randn(9, 512).bfloat16()
    got = native.float_matmul(x, weight, bias, gated=True, bf16_dot=dot)
    expected = silu_and_mul(native.float_matmul(x, weight, bias, bf16_dot=dot))  # PyTorch's SiLU
    assert got.shape == (9, 40) and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), expected.float(), rtol=2**-7, atol=1e-6)
    for row in (0, 4, 8):
        assert torch.equal(
            native.float_matmul(x[row : row + 1], weight, bias, gated=True, bf16_dot=dot), got[row : row + 1]
        )


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_gated_kernel_is_silu_of_the_gate_times_up(bits):
    """A SwiGLU gate/up projection in one call: silu(gate) * up from the same matmul
    outputs PyTorch's ops would take, and each row the same in any company."""
    layer, _, _ = layer_and_weight(bits, 2 * 40, 512, bias=True, seed=4)  # 40 outputs: 16 + 16 + 8
    x = torch.randn(9, 512).bfloat16()
    got = layer.silu_and_mul(x)
    expected = silu_and_mul(layer(x))  # PyTorch's SiLU over the kernel's gate and up
    assert got.shape == (9, 40) and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), expected.float(), rtol=2**-7, atol=1e-6)
    for row in (0, 4, 8):
        assert torch.equal(layer.silu_and_mul(x[row : row + 1]), got[row : row + 1])


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


def decode_five_tokens(model: Decoder, ids: torch.Tensor) -> tuple[torch.Tensor, KVCache]:
    """Logits [5, V] and cache of the last 5 of 45 ids, fed one query at a time after a
    40-token prefill, as the engine verifies drafts."""
    cache = model.new_cache()
    model(ids[:40], [Segment(cache, 40)])
    return model(ids[40:], [Segment(cache, 5, one_query_at_a_time=True)]), cache


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_decode_attention_is_the_decoders_pytorch_attention(arch, dtype, monkeypatch):
    """RoPE (after qk_norm), cache writes and attention in one call: the keys and values
    it stores are bitwise PyTorch's (float32 qk_norm: the norm's sum in another order),
    its outputs agree, and a token gets bit for bit the same alone as among others."""
    config = tiny_config(arch, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=32, vocab_size=128)
    reference, _ = reference_and_ours(config)
    model = Decoder.from_hf_weights(config, dict(reference.state_dict()), dtype)
    model.make_batch_invariant()  # for the last check: linear layers that round a row the same in any company
    ids = torch.randint(0, 128, (45,), generator=torch.Generator().manual_seed(2))
    assert native.supports_decode_attention(torch.empty(5, 512, dtype=dtype), model.new_cache().keys[0])
    ours, our_cache = decode_five_tokens(model, ids)
    monkeypatch.setattr(native, "supports_decode_attention", lambda *_: False)
    theirs, their_cache = decode_five_tokens(model, ids)
    monkeypatch.undo()

    first_layer = slice(0, 1)  # later layers take inputs that went through attention
    if arch == "qwen3" and dtype == torch.float32:
        torch.testing.assert_close(our_cache.keys[first_layer, :, :45], their_cache.keys[first_layer, :, :45])
    else:
        assert torch.equal(our_cache.keys[first_layer, :, :45], their_cache.keys[first_layer, :, :45])
    assert torch.equal(our_cache.values[first_layer, :, :45], their_cache.values[first_layer, :, :45])
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)

    alone = model.new_cache()
    model(ids[:43], [Segment(alone, 43)])
    assert torch.equal(model(ids[43:44], [Segment(alone, 1)]), ours[3:4])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("group", [1, 2, 3, 5, 7])
def test_decode_attention_gives_each_token_its_solo_bits_in_any_group(group, dtype):
    """Several tokens attend in blocks of the query heads that share a kv head (up to 4
    per block), one token head by head: every token and head gets the same bits either way."""
    kv_heads, dim, start, n = 2, 32, 37, 5
    heads = group * kv_heads
    torch.manual_seed(group)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim).to(dtype)
    cos, rotated_sin = torch.randn(n, dim).to(dtype), torch.randn(n, dim).to(dtype)
    keys, values = torch.randn(kv_heads, start + n, dim).to(dtype), torch.randn(kv_heads, start + n, dim).to(dtype)
    solo_keys, solo_values = keys.clone(), values.clone()
    together = native.decode_attention(qkv, cos, rotated_sin, None, None, 1e-6, keys, values, start, heads)
    for i in range(n):
        alone = native.decode_attention(
            qkv[i : i + 1],
            cos[i : i + 1],
            rotated_sin[i : i + 1],
            None,
            None,
            1e-6,
            solo_keys,
            solo_values,
            start + i,
            heads,
        )
        assert torch.equal(alone, together[i : i + 1])
    assert torch.equal(solo_keys, keys) and torch.equal(solo_values, values)


def tiny_float_model(arch: str) -> Decoder:
    """A random float32 model, norms and biases perturbed (the init sets them to 1 and 0)."""
    torch.manual_seed(2)
    config = tiny_config(
        arch, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2, head_dim=32, vocab_size=128
    )
    float_model = Decoder(config).eval()
    with torch.no_grad():
        for name, p in float_model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return float_model


def quantized_tiny_model(arch: str, quantization: str) -> Decoder:
    """`tiny_float_model` in bfloat16 with int8 or int4 projections."""
    float_model = tiny_float_model(arch)
    with torch.device("meta"):
        model = Decoder(float_model.config)
    load_quantized_state(model, quantized_state(float_model, quantization))
    model.inv_freq = float_model.inv_freq
    return model


def on_bfloat16_kernel(float_model: Decoder) -> Decoder:
    """float_model's weights in bfloat16, its linear layers on our float kernel."""
    with torch.device("meta"):
        model = Decoder(float_model.config)
    model.load_state_dict({k: v.bfloat16() for k, v in float_model.state_dict().items()}, assign=True)
    model.inv_freq = float_model.inv_freq
    model.pack_linear_weights()
    return model.eval()


@needs_kernel
@pytest.mark.parametrize("quantization", ["int8", "int4", "bfloat16"])
def test_blocks_in_one_c_call_are_bitwise_the_python_loop(arch, quantization, monkeypatch):
    """Decoding, verifying 4 drafts, and a batch of two sequences through decode_blocks:
    the logits and caches of the Python loop over the same kernels, bit for bit."""
    model = (
        on_bfloat16_kernel(tiny_float_model(arch))
        if quantization == "bfloat16"
        else quantized_tiny_model(arch, quantization)
    )
    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(3))

    def decode() -> list[torch.Tensor]:
        a, b = model.new_cache(), model.new_cache()
        model(ids[:20], [Segment(a, 20)])  # prompts: the loop, both times
        model(ids[:7], [Segment(b, 7)])
        one = model(ids[20:21], [Segment(a, 1)])
        several = model(torch.cat([ids[21:25], ids[7:8]]), [Segment(a, 4, one_query_at_a_time=True), Segment(b, 1)])
        return [one, several, a.keys[:, :, :25], a.values[:, :, :25], b.keys[:, :, :8], b.values[:, :, :8]]

    calls = []
    run = native.ModelInC.run_blocks
    monkeypatch.setattr(
        native.ModelInC, "run_blocks", lambda self, *args, **kwargs: calls.append(1) or run(self, *args, **kwargs)
    )
    ours = decode()
    assert len(calls) == 2  # the two decoding steps went through C
    monkeypatch.setattr(model, "model_in_c", lambda: None)
    theirs = decode()
    for got, expected in zip(ours, theirs):
        assert torch.equal(got, expected)


@needs_kernel
@pytest.mark.parametrize("quantization", ["int8", "int4", "bfloat16"])
def test_a_prompt_computes_the_same_bits_whatever_its_chunks(arch, quantization):
    """A prompt read whole, in two chunks of any split, or a token at a time gives
    bitwise the same logits and cache: its queries attend one by one in C (SDPA over a
    chunk rounds by the chunk's length), so how the engine's steps cut a prompt, which
    depends on the other prompts read beside it, changes none of its tokens."""
    model = (
        on_bfloat16_kernel(tiny_float_model(arch))
        if quantization == "bfloat16"
        else quantized_tiny_model(arch, quantization)
    )
    ids = torch.randint(0, 128, (37,), generator=torch.Generator().manual_seed(4))

    def read(cuts: list[int]) -> tuple[torch.Tensor, KVCache]:
        cache, logits = model.new_cache(), []
        for start, end in zip([0, *cuts], [*cuts, len(ids)]):
            logits.append(model(ids[start:end], [Segment(cache, end - start)]))
        return torch.cat(logits), cache

    whole, whole_cache = read([])
    for cuts in ([20], [5, 29], list(range(1, 37))):
        logits, cache = read(cuts)
        assert torch.equal(logits, whole), cuts
        assert torch.equal(cache.keys[:, :, :37], whole_cache.keys[:, :, :37])
        assert torch.equal(cache.values[:, :, :37], whole_cache.values[:, :, :37])


@needs_kernel
def test_a_prompt_cut_by_the_prompts_beside_it_gets_the_same_logprobs(arch):
    """The engine's steps share one prompt budget, so a prompt read beside another is cut
    where the other ends: its output and logprobs are bitwise those it gets alone."""
    from specserve.engine.engine import Engine
    from specserve.sampling import SamplingParams

    model = quantized_tiny_model(arch, "int4")
    generator = torch.Generator().manual_seed(5)
    first, prompt, last = (torch.randint(0, 128, (n,), generator=generator).tolist() for n in (12, 37, 9))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)

    def answer(prompts: list[list[int]]) -> tuple[list[int], list]:
        engine = Engine(model, eos_token_ids=[], prefill_chunk_size=32, max_num_seqs=4)
        seqs = [engine.add_request(p, params) for p in prompts]  # first: 12 tokens, then 20 of the next
        while engine.has_unfinished():
            engine.step()
        seq = seqs[prompts.index(prompt)]
        return seq.output_ids, [(lp.logprob, lp.top) for lp in seq.logprobs]

    assert answer([first, prompt, last]) == answer([prompt])


@needs_kernel
def test_a_prompt_read_from_the_prefix_cache_gets_the_same_logprobs(arch):
    """A second turn finds the first turn's prompt and answer in the prefix cache, keys
    and values that a prompt chunk and decode steps made: its output and logprobs are
    bitwise those of reading the whole conversation itself."""
    from specserve.engine.engine import Engine
    from specserve.model.prefix_cache import PrefixCache
    from specserve.sampling import SamplingParams

    model = quantized_tiny_model(arch, "int4")
    generator = torch.Generator().manual_seed(6)
    question, follow_up = (torch.randint(0, 128, (n,), generator=generator).tolist() for n in (21, 7))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)
    engine = Engine(model, eos_token_ids=[], prefill_chunk_size=8, prefix_cache=PrefixCache(10_000))
    turn = question + engine.generate(question, params).output_ids + follow_up
    cached = engine.generate(turn, params)
    assert cached.num_cached_tokens >= 32  # two blocks, the second holding decoded tokens
    fresh = Engine(model, eos_token_ids=[], prefill_chunk_size=8).generate(turn, params)
    assert cached.output_ids == fresh.output_ids
    assert [(lp.logprob, lp.top) for lp in cached.logprobs] == [(lp.logprob, lp.top) for lp in fresh.logprobs]


def test_decode_attention_takes_head_sizes_in_steps_of_16():
    keys = torch.empty(2, 80, 24)
    assert not native.supports_decode_attention(torch.empty(1, 12 * 24), keys)
    assert not native.supports_decode_attention(torch.empty(1, 12 * 32, dtype=torch.float16), torch.empty(2, 80, 32))


@needs_kernel
@pytest.mark.parametrize("quantization", ["int4", "bfloat16"])
def test_features_captured_between_c_calls_are_bitwise_the_python_loops(quantization, monkeypatch):
    """A verification step whose features a draft head reads: the C path runs the blocks
    in runs split at the captured layers; features, logits and caches are the loop's."""
    model = (
        on_bfloat16_kernel(tiny_float_model("qwen2"))
        if quantization == "bfloat16"
        else quantized_tiny_model("qwen2", quantization)
    )
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(5))

    def verify_with_capture() -> list[torch.Tensor]:
        cache = model.new_cache()
        model(ids[:20], [Segment(cache, 20)])
        capture = Capture(layers=(1, 0), final=True)
        logits = model(ids[20:24], [Segment(cache, 4, one_query_at_a_time=True)], capture=capture)
        return [logits, capture.layer_inputs, capture.final_hidden, cache.keys[:, :, :24]]

    ours = verify_with_capture()
    monkeypatch.setattr(model, "model_in_c", lambda: None)
    theirs = verify_with_capture()
    assert ours[1].shape == (4, 2 * model.config.hidden_size)
    for got, expected in zip(ours, theirs):
        assert torch.equal(got, expected)
