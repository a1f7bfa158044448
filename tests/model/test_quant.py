"""Weight-only int8/int4 quantization: the kernels compute what the stored levels say,
a quantized decoder stays close to the float one, and the cache is used once made."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve import catalogue
from specserve.config import SpecConfig
from specserve.engine.build import build_engine
from specserve.errors import ConfigError
from specserve.model.decoder import Decoder, Segment
from specserve.model.quant import (
    INT4_GROUP_SIZE,
    QUANTIZED_FORMAT_VERSION,
    QuantizedLinear,
    check_quantization,
    load_quantized_state,
    quantize_int4,
    quantize_int8,
    quantized_state,
)
from specserve.sampling import SamplingParams
from specserve.spec.factory import draft_format
from tests.conftest import tiny_config


def dequantize_int8(state):
    return state["qweight"].float() * state["scales"].float()[:, None]


def dequantize_int4(state, in_features):
    qweight = state["qweight"]
    levels = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).view(qweight.shape[0], -1).float()
    scale, zero = state["scales"].float().unbind(-1)  # [G, out] each
    scale = scale.t().repeat_interleave(INT4_GROUP_SIZE, dim=1)  # [out, in]
    zero = zero.t().repeat_interleave(INT4_GROUP_SIZE, dim=1)
    return (levels - 8) * scale + zero


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_kernel_computes_the_stored_weights(quantization):
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=True)
    state = (quantize_int8 if quantization == "int8" else quantize_int4)(linear.weight.detach())
    layer = QuantizedLinear.from_state(state, linear.bias)
    weight = dequantize_int8(state) if quantization == "int8" else dequantize_int4(state, 128)
    x = torch.randn(5, 128).bfloat16()
    expected = x.float() @ weight.t() + linear.bias.detach()
    assert torch.allclose(layer(x).float(), expected, atol=0.05, rtol=0.02)
    # ...and the stored weights are close to the float ones: a step is at most half a level.
    step = (
        (linear.weight.abs().max() / 127)
        if quantization == "int8"
        else (linear.weight.max() - linear.weight.min()) / 15
    )
    assert (weight - linear.weight.detach()).abs().max() <= step * 0.51 + 1e-2


def test_int4_recovers_an_affine_16_level_grid_exactly():
    # GGUF Q4_K blocks are scale * level - min with levels 0..15: groups of 32 of that
    # form come back unchanged (up to bfloat16 scales) when they use both ends.
    torch.manual_seed(1)
    levels = torch.randint(0, 16, (8, 64)).float()
    levels[:, ::INT4_GROUP_SIZE] = 0
    levels[:, 1::INT4_GROUP_SIZE] = 15
    weight = 0.25 * levels - 1.5
    back = dequantize_int4(quantize_int4(weight), 64)
    assert torch.allclose(back, weight, atol=1e-2)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_decoder_stays_close_to_the_float_one(quantization, arch):
    torch.manual_seed(2)
    config = tiny_config(arch, tie_word_embeddings=arch == "qwen2")
    float_model = Decoder(config).eval()
    state = quantized_state(float_model, quantization)
    with torch.device("meta"):
        quantized = Decoder(config)
    load_quantized_state(quantized, state)
    quantized.inv_freq = float_model.inv_freq
    assert quantized.dtype == torch.bfloat16
    assert all(isinstance(m, QuantizedLinear) for m in (quantized.lm_head, quantized.layers[0].mlp.down_proj))
    ids = torch.randint(0, config.vocab_size, (12,))
    a = float_model(ids, [Segment(float_model.new_cache(), 12)])
    b = quantized(ids, [Segment(quantized.new_cache(), 12)])
    assert b.dtype == torch.float32 and b.shape == a.shape
    cosine = nn.functional.cosine_similarity(a, b, dim=-1)
    assert cosine.min() > (0.99 if quantization == "int8" else 0.95)


def test_bad_combinations_name_the_fix():
    with pytest.raises(ConfigError, match="--dtype bfloat16"):
        check_quantization("int4", torch.float32)
    with pytest.raises(ConfigError, match="int8, int4"):
        check_quantization("int3", torch.bfloat16)


def test_real_model_is_quantized_once_and_generates_like_float(prepared_cache):
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompt = [1, 504, 3458, 282, 4649, 314]
    float_engine, _ = build_engine("smollm2-135m")
    float_tokens = float_engine.generate(prompt, params).output_ids
    current = catalogue._quantized_file(catalogue.resolve("smollm2-135m"), "int8")
    older = current.with_name(
        current.name.replace(f"-v{QUANTIZED_FORMAT_VERSION}.", f"-v{QUANTIZED_FORMAT_VERSION - 1}.")
    )
    older.parent.mkdir(parents=True, exist_ok=True)
    older.write_bytes(b"made by older code")
    engine, _ = build_engine("smollm2-135m", dtype=torch.bfloat16, quantization="int8")
    files = list((catalogue.cache_root() / "quantized").glob("smollm2-135m-*-int8-v*.safetensors"))
    assert files == [current]  # and the older format's file is gone
    stamp = files[0].stat().st_mtime_ns
    tokens = engine.generate(prompt, params).output_ids
    # bfloat16 activations and 8-bit weights may flip a late near-tie; the start agrees.
    assert tokens[:4] == float_tokens[:4]
    again, _ = build_engine("smollm2-135m", dtype=torch.bfloat16, quantization="int8")
    assert files[0].stat().st_mtime_ns == stamp  # reused, not made again
    assert again.generate(prompt, params).output_ids == tokens
    # Weights read back from the file feed the multi-row kernels too (a prompt's prefill).
    rows = torch.arange(100, 164)
    assert again.target(rows, [Segment(again.target.new_cache(), 64)]).isfinite().all()


def test_a_quantized_draft_in_front_of_a_float_target_changes_nothing(prepared_cache):
    """The draft's own `quantization` key: an int8 draft (bfloat16 activations) proposes
    for a float32 target, whose tokens stay exactly its plain ones."""
    params = SamplingParams(max_tokens=16, temperature=0.0)
    prompt = [1, 504, 3458, 282, 4649, 314]
    plain, _ = build_engine("smollm2-135m")
    spec = SpecConfig.parse(
        {"model": "smollm2-135m", "num_speculative_tokens": 4, "quantization": "int8", "adaptive": False}
    )
    engine, _ = build_engine("smollm2-135m", spec)
    assert engine.target.dtype == torch.float32
    assert engine.proposer.draft.dtype == torch.bfloat16
    assert any(isinstance(m, QuantizedLinear) for m in engine.proposer.draft.modules())
    seq = engine.generate(prompt, params)
    assert seq.output_ids == plain.generate(prompt, params).output_ids
    assert seq.spec.num_accepted_tokens > 0  # an int8 copy of the target is mostly right


def test_draft_format_follows_the_target_unless_the_draft_names_its_own():
    assert draft_format(None, torch.float32, "none") == (torch.float32, "none")
    assert draft_format(None, torch.bfloat16, "int4") == (torch.bfloat16, "int4")
    assert draft_format("int4", torch.float32, "none") == (torch.bfloat16, "int4")
    assert draft_format("none", torch.bfloat16, "int4") == (torch.bfloat16, "none")
