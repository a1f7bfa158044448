"""A draft that guesses only the first token ids while a sequence's text keeps to them
(`"draft_vocab_size"`, `Decoder.add_common_head`): its common head scores exactly
those ids as the whole head does, each sequence by its own text, and the output stays
the target's (the sampled case is in test_engine.py, the fused one in test_fused.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.config import DEFAULT_DRAFT_VOCAB_SIZE, SpecConfig
from specserve.engine.engine import Engine
from specserve.errors import ConfigError
from specserve.model import native
from specserve.model.decoder import FloatLinear, PackedLinear, Segment, first_rows
from specserve.model.quant import QuantizedLinear, quantize_int4, quantize_int8
from specserve.sampling import SamplingParams
from specserve.spec.draft_model import DraftModelProposer
from tests.engine.test_engine import EOS, GREEDY, PROMPTS, perturbed, plain_tokens, random_decoder
from tests.model.test_native import needs_kernel
from tests.spec.test_fused import View


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
    cases += [
        pytest.param(lambda: quantized_layer(8), torch.bfloat16, id="int8", marks=needs_kernel),
        pytest.param(lambda: quantized_layer(4), torch.bfloat16, id="int4", marks=needs_kernel),
    ]
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


def test_a_common_head_scores_its_rows_as_the_whole_head_does_and_mixed_calls_too():
    draft = random_decoder("qwen2", seed=1)
    tokens = torch.tensor([5, 60, 7, 90])
    whole = draft(tokens, [Segment(draft.new_cache(), 4)])  # [4, 96]
    draft.add_common_head(48)
    assert draft(tokens, [Segment(draft.new_cache(), 4)]).shape == (4, 96)  # no row marked: every id
    common = draft(tokens, [Segment(draft.new_cache(), 4)], common=[True] * 4)  # [4, 48]
    # (float32 GEMMs of 2 and 4 rows round differently: see RowBlockedLinear)
    torch.testing.assert_close(common, whole[:, :48], atol=1e-5, rtol=0)
    mixed = draft(tokens, [Segment(draft.new_cache(), 4)], common=[True, False, True, False])  # [4, 96]
    torch.testing.assert_close(mixed[1::2], whole[1::2], atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed[0::2, :48], whole[0::2, :48], atol=1e-5, rtol=0)
    assert torch.isneginf(mixed[0::2, 48:]).all()


def test_a_common_head_moves_with_its_decoder():
    """`.to()` cuts the common head again from the moved lm_head (a draft moved to a GPU
    after add_common_head once kept a CPU head)."""
    draft = random_decoder("qwen2", seed=1)
    draft.add_common_head(48)
    draft.to(torch.float64)
    num_common, head = draft.common
    assert num_common == 48 and head.weight.dtype == torch.float64
    assert head.weight.data_ptr() == draft.lm_head.weight.data_ptr()  # a view of the moved head, no copy
    tokens = torch.tensor([5, 60, 7])
    whole = draft(tokens, [Segment(draft.new_cache(), 3)])
    common = draft(tokens, [Segment(draft.new_cache(), 3)], common=[True] * 3)
    torch.testing.assert_close(common, whole[:, :48])


def test_greedy_output_stays_the_targets_when_the_draft_guesses_half_the_ids():
    target = random_decoder("qwen2", seed=1)
    draft = perturbed(target, 0.3, seed=2)
    draft.add_common_head(48)
    engine = Engine(target, eos_token_ids=[EOS], proposer=DraftModelProposer(draft), num_speculative_tokens=5)
    for prompt in PROMPTS:
        assert engine.generate(prompt, GREEDY).output_ids == plain_tokens(target, prompt)
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafting, and rejections rolled back


def test_each_sequence_guesses_over_the_common_ids_while_its_recent_text_keeps_to_them():
    draft = random_decoder("llama", seed=4)
    draft.add_common_head(48)
    proposer = DraftModelProposer(draft, special_ids=frozenset({95}))
    low, high = list(range(10, 40)), list(range(50, 80))
    assert proposer.keeps_to_common(View(0, low))
    assert not proposer.keeps_to_common(View(0, high))
    assert proposer.keeps_to_common(View(0, low + [60, 95, 95, 95]))  # 1 of 31 text tokens past: 10% allowed
    assert not proposer.keeps_to_common(View(0, low[:20] + [60, 61, 62]))
    assert proposer.keeps_to_common(View(0, [60] * 10 + low * 3))  # only the last COMMON_WINDOW count
    # A sequence whose text lies past the common ids may be guessed any id, beside one
    # that keeps to them, in one batch; each one's guesses are what it drafts alone.
    together = proposer.propose([View(1, high), View(2, low)], [6, 6])
    alone = [
        DraftModelProposer(draft, special_ids=frozenset({95})).propose([View(i, t)], [6])[0]
        for i, t in ((1, high), (2, low))
    ]
    assert [d.tokens.tolist() for d in together] == [d.tokens.tolist() for d in alone]
    assert max(together[1].tokens.tolist()) < 48
    assert max(together[0].tokens.tolist()) >= 48  # this draft's argmax lies past the common ids


def test_without_a_common_head_no_sequence_keeps_to_one():
    assert not DraftModelProposer(random_decoder("llama", seed=4)).keeps_to_common(View(0, [1, 2, 3]))


@pytest.mark.parametrize(
    "raw,words",
    [
        ({"method": "ngram", "num_speculative_tokens": 3, "draft_vocab_size": 100}, 'applies to "draft_model" only'),
        ({"model": "m", "num_speculative_tokens": 3, "draft_vocab_size": 0}, "integer >= 1, got 0"),
        ({"model": "m", "num_speculative_tokens": 3, "draft_vocab_size": "65536"}, "integer >= 1, got '65536'"),
    ],
)
def test_bad_draft_vocab_sizes_are_refused(raw, words):
    with pytest.raises(ConfigError, match=words):
        SpecConfig.parse(raw)


def test_a_draft_model_has_common_ids_by_default_and_null_turns_them_off():
    assert SpecConfig.parse({"model": "m", "num_speculative_tokens": 3}).draft_vocab_size == DEFAULT_DRAFT_VOCAB_SIZE
    assert (
        SpecConfig.parse({"model": "m", "num_speculative_tokens": 3, "draft_vocab_size": None}).draft_vocab_size is None
    )
    assert SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 3}).draft_vocab_size is None
    assert (
        SpecConfig.parse({"model": "m", "num_speculative_tokens": 3, "draft_vocab_size": 1000}).draft_vocab_size == 1000
    )


def test_common_ids_at_or_past_the_vocabulary_mean_every_id():
    draft = random_decoder("llama", seed=1)
    for size in (96, 97, 65536):
        draft.add_common_head(size)
        assert draft.common is None
    with pytest.raises(ConfigError, match="draft_vocab_size must be >= 1, got 0"):
        draft.add_common_head(0)


def test_asking_for_the_same_common_ids_again_keeps_the_head():
    draft = random_decoder("llama", seed=1)
    draft.add_common_head(48)
    head = draft.common[1]
    draft.add_common_head(48)
    assert draft.common[1] is head
    draft.add_common_head(40)
    assert draft.common[0] == 40 and draft.common[1] is not head


def test_sampled_guesses_come_from_the_scored_ids_and_give_the_rest_no_mass():
    draft = random_decoder("llama", seed=4)
    draft.add_common_head(48)
    params = SamplingParams(max_tokens=8, temperature=1.5)
    for prompt, past in ((list(PROMPTS[3]), False), (list(range(50, 80)), True)):
        view = View(0, prompt, params, torch.Generator().manual_seed(3))
        (guess,) = DraftModelProposer(draft).propose([view], [6])
        assert guess.num_tokens == 6 and guess.probs.shape == (6, 96)
        torch.testing.assert_close(guess.probs.sum(dim=1), torch.ones(6))
        if not past:  # a text that keeps to the common ids: guesses among them alone
            assert max(guess.tokens.tolist()) < 48 and not guess.probs[:, 48:].any()
        else:
            assert guess.probs[:, 48:].any()


def test_a_proposer_says_how_it_drafts():
    draft = random_decoder("llama", seed=4)
    assert DraftModelProposer(draft).describe() == "the draft drafts step by step"
    draft.add_common_head(48)
    assert DraftModelProposer(draft).describe() == (
        "the draft drafts step by step, guessing ids below 48 while a text keeps to them"
    )
