"""Our decoder against transformers' reference on the same random weights, and the
invariants of the ragged batch and the position-indexed KV cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specserve.model import native
from specserve.model.decoder import Capture, Decoder, FloatLinear, PackedLinear, Segment
from tests.conftest import tiny_config


def reference_and_ours(config, seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    reference = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config.to_hf())).eval()
    with torch.no_grad():  # the reference initialises norms to 1; perturb them to test them
        for name, p in reference.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    ours = Decoder.from_hf_weights(config, dict(reference.state_dict()), dtype)
    return reference, ours


def prefill(model: Decoder, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache()
    return model(torch.tensor(ids), [Segment(cache, len(ids))])


PROMPT = [3, 17, 42, 5, 88, 61, 7, 7, 23, 90, 1, 54]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            }
        },
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ],
    ids=["untied", "tied", "llama3-rope", "linear-rope"],
)
def test_logits_match_transformers(arch, overrides):
    config = tiny_config(arch, **overrides)
    reference, ours = reference_and_ours(config)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]  # [T, V]
    torch.testing.assert_close(prefill(ours, PROMPT), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_hf_state_dict_gives_back_the_checkpoints_tensors(arch, tied):
    """Decoder.hf_state_dict undoes load_hf_state_dict's fusing: the reference's own
    names and values, a tied head left out."""
    reference, ours = reference_and_ours(tiny_config(arch, tie_word_embeddings=tied))
    expected = {k: v for k, v in reference.state_dict().items() if not (tied and k == "lm_head.weight")}
    got = ours.hf_state_dict()
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_captured_features_are_the_references_hidden_states(arch):
    """Capture.layers: the residual stream entering those layers (transformers'
    hidden_states[i]); Capture.final: the last one after the final norm."""
    config = tiny_config(arch, num_layers=3)
    reference, ours = reference_and_ours(config)
    with torch.no_grad():
        hidden = reference(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states  # N + 1 of [1, T, H]
    capture = Capture(layers=(2, 0), final=True)
    ours(torch.tensor(PROMPT), [Segment(ours.new_cache(), len(PROMPT))], capture=capture)
    expected = torch.cat([hidden[2][0], hidden[0][0]], dim=-1)  # [T, 2H], in the asked order
    torch.testing.assert_close(capture.layer_inputs, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(capture.final_hidden, hidden[3][0], rtol=1e-4, atol=1e-4)


def test_incremental_decode_equals_prefill(arch):
    _, model = reference_and_ours(tiny_config(arch))
    full = prefill(model, PROMPT)
    cache = model.new_cache()
    model(torch.tensor(PROMPT[:5]), [Segment(cache, 5)])
    rows = [model(torch.tensor([t]), [Segment(cache, 1)])[0] for t in PROMPT[5:]]
    torch.testing.assert_close(torch.stack(rows), full[5:], rtol=1e-4, atol=1e-4)
    assert cache.length == len(PROMPT)


def test_ragged_batch_equals_each_sequence_alone(arch):
    _, model = reference_and_ours(tiny_config(arch))
    a, b, c = PROMPT, [9, 8, 7], [60]
    caches = [model.new_cache() for _ in range(3)]
    model(torch.tensor(a[:4]), [Segment(caches[0], 4)])  # a mid-sequence, b and c fresh
    batch = torch.tensor(a[4:] + b + c)
    logits = model(batch, [Segment(caches[0], len(a) - 4), Segment(caches[1], 3), Segment(caches[2], 1)])
    torch.testing.assert_close(logits[: len(a) - 4], prefill(model, a)[4:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[len(a) - 4 : -1], prefill(model, b), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[-1:], prefill(model, c), rtol=1e-4, atol=1e-4)


def test_logits_rows_selects_rows():
    _, model = reference_and_ours(tiny_config("qwen2"))
    full = prefill(model, PROMPT)
    rows = torch.tensor([0, 5, len(PROMPT) - 1])
    picked = model(torch.tensor(PROMPT), [Segment(model.new_cache(), len(PROMPT))], rows)
    torch.testing.assert_close(picked, full[rows], rtol=1e-5, atol=1e-5)


def test_rollback_then_other_tokens_equals_fresh_sequence(arch):
    """Rejected drafts leave stale entries past the end pointer; they must not leak."""
    _, model = reference_and_ours(tiny_config(arch))
    cache = model.new_cache()
    model(torch.tensor(PROMPT), [Segment(cache, len(PROMPT))])
    cache.truncate(6)  # reject everything after the sixth token
    other = [11, 12, 13]
    logits = model(torch.tensor(other), [Segment(cache, 3)])
    torch.testing.assert_close(logits, prefill(model, PROMPT[:6] + other)[6:], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError):
        cache.truncate(100)


def test_cache_grows_past_initial_capacity():
    _, model = reference_and_ours(tiny_config("llama"))
    ids = [i % 90 for i in range(300)]
    cache = model.new_cache()
    for chunk in range(0, 300, 100):
        model(torch.tensor(ids[chunk : chunk + 100]), [Segment(cache, 100)])
    assert cache.length == 300 and cache.capacity >= 300
    torch.testing.assert_close(
        model(torch.tensor([5]), [Segment(cache, 1)]),
        prefill(model, ids + [5])[-1:],
        rtol=1e-4,
        atol=1e-4,
    )


def test_bfloat16_runs_and_roughly_agrees():
    reference, _ = reference_and_ours(tiny_config("qwen3"))
    model = Decoder.from_hf_weights(tiny_config("qwen3"), dict(reference.state_dict()), torch.bfloat16)
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(prefill(model, PROMPT), expected, rtol=0.1, atol=0.1)


@pytest.mark.parametrize(
    "kernel, dtype", [("ours", torch.float32), ("onednn", torch.float32), ("ours", torch.bfloat16)]
)
def test_swapped_linear_layers_give_the_same_logits(arch, kernel, dtype, monkeypatch):
    """The CPU layers (our kernel where it runs, else for float32 oneDNN's packed
    weights) compute what the plain layers compute."""
    if kernel == "onednn":
        monkeypatch.setattr(native, "library", lambda: None)
    kind = FloatLinear if kernel == "ours" else PackedLinear
    if not kind.available(dtype):
        pytest.skip(f"{kind.__name__} does not run here")
    reference, ours = reference_and_ours(tiny_config(arch, tie_word_embeddings=arch == "llama"), dtype=dtype)
    expected = prefill(ours, PROMPT)
    ours.pack_linear_weights()
    assert not any(isinstance(m, torch.nn.Linear) for m in ours.modules())
    assert any(isinstance(m, kind) for m in ours.modules())
    if kernel == "ours" and arch == "llama":  # tied: the head reads the table itself
        assert ours.lm_head.weight.data_ptr() == ours.embed_tokens.weight.data_ptr()
    # bfloat16: the same float32 sums in another order, each output rounded once
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(prefill(ours, PROMPT), expected, rtol=tolerance, atol=tolerance)
    cache = ours.new_cache()  # and one token at a time, as decoding feeds it
    ours(torch.tensor(PROMPT[:-1]), [Segment(cache, len(PROMPT) - 1)])
    torch.testing.assert_close(
        ours(torch.tensor(PROMPT[-1:]), [Segment(cache, 1)]), expected[-1:], rtol=tolerance, atol=tolerance
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verification_is_bitwise_plain_decoding_on_our_float_kernel(arch, dtype):
    """With our float32/bfloat16 kernel (rows independent) and attention query by query,
    the target verifying 8 tokens in one pass, beside another request, computes bitwise
    the logits of decoding them one at a time: no batch-invariant mode needed."""
    if not FloatLinear.available(dtype):
        pytest.skip("our kernels do not run here")
    config = tiny_config(
        arch, hidden_size=256, intermediate_size=1024, num_heads=8, num_kv_heads=2, head_dim=32, vocab_size=512
    )
    _, model = reference_and_ours(config, dtype=dtype)
    model.pack_linear_weights()
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))
    alone, verified, other = model.new_cache(), model.new_cache(), model.new_cache()
    model(ids[:32], [Segment(alone, 32)])
    one_at_a_time = torch.cat([model(ids[i : i + 1], [Segment(alone, 1)]) for i in range(32, 40)])  # [8, V]
    model(ids[:32], [Segment(verified, 32)])
    model(ids[:3], [Segment(other, 3)])
    batch = model(
        torch.cat([ids[32:40], ids[3:4]]), [Segment(verified, 8, one_query_at_a_time=True), Segment(other, 1)]
    )  # [9, V]
    assert torch.equal(batch[:8], one_at_a_time)
    assert torch.equal(verified.keys[:, :, :40], alone.keys[:, :, :40])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_batch_invariant_mode_computes_a_token_the_same_in_any_company(dtype):
    """Verification (8 tokens in one pass), a batch of two requests and a prompt in
    chunks give bitwise the logits and cache of one token at a time, alone. (Without
    the mode the float32 case fails here on oneDNN, which rounds 1 row and 8 rows
    differently, and the prompt's chunks fail on any kernel: several queries attend
    at once.)"""
    config = tiny_config(
        "qwen2", hidden_size=256, intermediate_size=1024, num_heads=8, num_kv_heads=2, head_dim=32, vocab_size=512
    )
    reference, _ = reference_and_ours(config)
    model = Decoder.from_hf_weights(config, dict(reference.state_dict()), dtype)
    model.pack_linear_weights()
    model.make_batch_invariant()
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))

    alone = model.new_cache()
    model(ids[:32], [Segment(alone, 32)])
    one_at_a_time = torch.cat([model(ids[i : i + 1], [Segment(alone, 1)]) for i in range(32, 40)])  # [8, V]

    verified = model.new_cache()
    for start in range(0, 32, 5):  # the prompt in chunks of 5
        model(ids[start : min(start + 5, 32)], [Segment(verified, min(5, 32 - start))])
    other = model.new_cache()
    model(ids[:3], [Segment(other, 3)])
    batch = model(torch.cat([ids[32:40], ids[3:4]]), [Segment(verified, 8), Segment(other, 1)])  # [9, V]

    assert torch.equal(batch[:8], one_at_a_time)
    assert torch.equal(verified.keys[:, :, :40], alone.keys[:, :, :40])
    assert torch.equal(verified.values[:, :, :40], alone.values[:, :, :40])
    assert torch.equal(batch[8:], prefill(model, ids[:4].tolist())[3:])  # the other request, as if alone
