"""A draft that guesses only the first token ids (`"draft_vocab_size"`,
`Decoder.limit_head`): its cut head scores exactly those ids as the whole head does,
and the output stays the target's (the sampled case is in test_engine.py, the fused
one in test_fused.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.config import SpecConfig
from specserve.engine.engine import Engine
from specserve.errors import ConfigError
from specserve.model import native
from specserve.model.decoder import FloatLinear, PackedLinear, Segment, first_rows
from specserve.model.quant import QuantizedLinear, quantize_int4, quantize_int8
from specserve.sampling import SamplingParams
from specserve.spec.draft_model import DraftModelProposer
from tests.test_engine import EOS, GREEDY, PROMPTS, perturbed, plain_tokens, random_decoder
from tests.test_fused import View
from tests.test_native import needs_kernel


def linear(out_features: int = 96, in_features: int = 64) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(in_features, out_features, bias=True).eval()


def quantized_layer(bits: int) -> QuantizedLinear:
    dense = linear()
    q = quantize_int8(dense.weight) if bits == 8 else quantize_int4(dense.weight)
    return QuantizedLinear(bits, q["qweight"], q["scales"], dense.bias.detach().to(torch.bfloat16))


def layers() -> list:
    cases = [pytest.param(lambda: linear(), torch.float32, id="float32")]
    if FloatLinear.available(torch.float32):
        cases.append(pytest.param(lambda: FloatLinear(linear()), torch.float32, id="float32-ours"))
        cases.append(pytest.param(lambda: FloatLinear(linear().bfloat16()), torch.bfloat16, id="bfloat16-ours"))
    if PackedLinear.available(torch.float32):
        cases.append(pytest.param(lambda: PackedLinear(linear()), torch.float32, id="onednn-packed"))
    cases += [pytest.param(lambda: quantized_layer(8), torch.bfloat16, id="int8", marks=needs_kernel),
              pytest.param(lambda: quantized_layer(4), torch.bfloat16, id="int4", marks=needs_kernel)]
    return cases


@pytest.mark.parametrize("make,dtype", layers())
def test_a_cut_layer_computes_its_first_outputs_as_the_whole_one_does(make, dtype):
    layer = make()
    x = torch.randn(5, 64).to(dtype)  # [T, in]
    with torch.no_grad():
        whole, cut = layer(x), first_rows(layer, 40)(x)  # [T, 96], [T, 40]
    assert cut.shape == (5, 40)
    torch.testing.assert_close(cut, whole[:, :40], atol=1e-6, rtol=0)


def test_int8_on_pytorchs_kernel_cuts_too(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    layer = quantized_layer(8)
    assert not layer.native
    x = torch.randn(3, 64).to(torch.bfloat16)
    torch.testing.assert_close(first_rows(layer, 40)(x), layer(x)[:, :40], atol=0, rtol=0)


def test_greedy_output_stays_the_targets_when_the_draft_guesses_half_the_ids():
    target = random_decoder("qwen2", seed=1)
    draft = perturbed(target, 0.3, seed=2)
    draft.limit_head(48)
    assert draft(torch.tensor([1, 2, 3]), [Segment(draft.new_cache(), 3)]).shape == (3, 48)
    engine = Engine(target, eos_token_ids=[EOS], proposer=DraftModelProposer(draft), num_speculative_tokens=5)
    for prompt in PROMPTS:
        assert engine.generate(prompt, GREEDY).output_ids == plain_tokens(target, prompt)
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafting, and rejections rolled back


@pytest.mark.parametrize("raw,words", [
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_vocab_size": 100}, 'applies to "draft_model" only'),
    ({"model": "m", "num_speculative_tokens": 3, "draft_vocab_size": 0}, "integer >= 1, got 0"),
    ({"model": "m", "num_speculative_tokens": 3, "draft_vocab_size": "65536"}, "integer >= 1, got '65536'"),
])
def test_bad_draft_vocab_sizes_are_refused(raw, words):
    with pytest.raises(ConfigError, match=words):
        SpecConfig.parse(raw)


def test_a_draft_vocab_size_past_the_vocabulary_is_refused():
    assert SpecConfig.parse({"model": "m", "num_speculative_tokens": 3, "draft_vocab_size": 65536}).draft_vocab_size == 65536
    with pytest.raises(ConfigError, match=r"draft_vocab_size must be in \[1, 96\], got 97"):
        random_decoder("llama", seed=1).limit_head(97)


def test_sampled_guesses_come_from_the_scored_ids_and_give_the_rest_no_mass():
    draft = random_decoder("llama", seed=4)
    draft.limit_head(48)
    params = SamplingParams(max_tokens=8, temperature=1.5, seed=3)
    view = View(0, list(PROMPTS[3]), params, params.make_generator())
    (guess,) = DraftModelProposer(draft).propose([view], [6])
    assert guess.num_tokens == 6 and max(guess.tokens.tolist()) < 48
    assert guess.probs.shape == (6, 96) and not guess.probs[:, 48:].any()
    torch.testing.assert_close(guess.probs.sum(dim=1), torch.ones(6))
