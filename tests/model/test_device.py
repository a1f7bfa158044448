"""Devices: every tensor a step makes goes on the models' device, the CPU-only options
are refused by name elsewhere, and where a CUDA GPU is present the engine runs there
losslessly (the CUDA cases here and in test_engine.py are skipped without one)."""

from __future__ import annotations

import copy

import pytest
import torch

from specserve.bench.quality import perplexity
from specserve.cli import main
from specserve.engine.engine import Engine
from specserve.errors import ConfigError
from specserve.model import native
from specserve.model.decoder import Decoder, Segment
from specserve.model.device import check_device_format, default_dtype, resolve_device
from specserve.model.footprint import weight_bytes_per_token
from specserve.sampling import SamplingParams
from specserve.spec.adaptive import AdaptiveSpecLength
from specserve.spec.draft_model import DraftModelProposer
from specserve.spec.ngram import NgramProposer
from tests.conftest import DEVICES, tiny_config
from tests.engine.test_engine import EOS, PROMPTS, perturbed, random_decoder

REQUESTS = [
    (PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
    (PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)),
    (PROMPTS[3], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
    (PROMPTS[2], SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=8, ignore_eos=True)),
]


def run_batch(target, make_proposer, adaptive: bool) -> list[list[int]]:
    proposer = make_proposer()
    engine = Engine(
        target,
        eos_token_ids=[EOS],
        proposer=proposer,
        num_speculative_tokens=3,
        adaptive=AdaptiveSpecLength(5, prior_draft_cost_ratio=0.1) if adaptive else None,
        prefill_chunk_size=8,
        # Whole chunks: the 12-token requests still have tokens to draft once the 30-token
        # prompt is read (the tiny model's chunks priced by position take a step more).
        price_chunks=False,
    )
    seqs = [engine.add_request(prompt, params) for prompt, params in REQUESTS]
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize(
    "proposer_kind,adaptive,static",
    [
        ("none", False, False),
        ("draft", False, False),
        ("draft", True, False),
        ("ngram", False, False),
        ("draft", True, True),
    ],
)
def test_nothing_a_step_makes_lands_on_the_default_device(monkeypatch, proposer_kind, adaptive, static):
    """Under `torch.device("meta")`, a tensor made without naming its device is a meta
    tensor: it has no data, and the first op that mixes it with the models' tensors (or
    reads it) fails. On a GPU that tensor would sit on the CPU and fail the same way, so
    a batch of greedy and sampled requests, prompts read in chunks, drafting, rejection
    and rollback run this way here must give exactly what they give normally; `static`:
    on the steps CUDA graphs capture (model/graphs.py)."""
    monkeypatch.setattr(native, "library", lambda: None)  # our C kernels are CPU-only: out of this
    target = random_decoder("qwen3", seed=1)
    draft = perturbed(target, 0.3, seed=2)
    if static:
        for model in (target, draft):
            model.use_cuda_graphs(num_slots=len(REQUESTS), capacity=64)
    make_proposer = {
        "none": lambda: None,
        "draft": lambda: DraftModelProposer(draft, confidence_threshold=0.3, catch_up_chunk_size=8),
        "ngram": lambda: NgramProposer(1, 3),
    }[proposer_kind]
    expected = run_batch(target, make_proposer, adaptive)
    with torch.device("meta"):
        assert run_batch(target, make_proposer, adaptive) == expected
    assert not static or (target.static.steps and draft.static.steps)


def test_perplexity_makes_its_tensors_on_the_models_device(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    target = random_decoder("llama", seed=3)
    ids = list(range(1, 90)) * 2
    expected = perplexity(target, ids, chunk=64)
    with torch.device("meta"):
        assert perplexity(target, ids, chunk=64) == expected


def test_device_names_resolve_or_are_refused():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")
    with pytest.raises(ConfigError, match="not supported"):
        resolve_device("mps")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA GPU here.*--device cpu"):
            resolve_device("cuda")


def test_cpu_only_options_are_refused_on_a_gpu_by_name():
    gpu = torch.device("cuda")  # a device name needs no GPU to exist
    with pytest.raises(ConfigError, match="--quantization int4 runs on our CPU kernels only.*--device cpu"):
        check_device_format(gpu, "int4", batch_invariant=False)
    with pytest.raises(ConfigError, match="--batch-invariant.*--device cpu"):
        check_device_format(gpu, "none", batch_invariant=True)
    check_device_format(gpu, "none", batch_invariant=False)
    check_device_format(torch.device("cpu"), "int4", batch_invariant=True)


def test_auto_dtype_is_bfloat16_on_a_gpu_and_with_quantized_kernels():
    assert default_dtype(torch.device("cpu"), "none") == torch.float32
    assert default_dtype(torch.device("cpu"), "int4") == torch.bfloat16
    assert default_dtype(torch.device("cuda"), "none") == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a machine without CUDA")
def test_cli_refuses_cuda_without_a_gpu_before_loading(capsys):
    assert main(["generate", "--model", "no-such-model", "--device", "cuda", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specserve: error: --device cuda: PyTorch sees no CUDA GPU") and "Traceback" not in err


@pytest.mark.parametrize("device", DEVICES)
def test_logits_on_the_device_match_the_cpu(device):
    cpu_model = random_decoder("qwen2", seed=5)
    model = copy.deepcopy(cpu_model).to(device)
    ids = PROMPTS[3]
    expected = cpu_model(torch.tensor(ids), [Segment(cpu_model.new_cache(), len(ids))])  # [n, V]
    cache = model.new_cache()
    got = model(torch.tensor(ids, device=device), [Segment(cache, len(ids))])
    assert got.device.type == device and cache.keys.device.type == device
    torch.testing.assert_close(got.cpu(), expected, atol=1e-3, rtol=1e-3)


def test_each_request_draws_from_a_generator_on_the_models_device(monkeypatch):
    """A CPU generator cannot drive sampling on a GPU: the engine makes each request's
    on the target's device (a real CUDA run is in test_engine.py, where a GPU is)."""
    made_on = []
    make = SamplingParams.make_generator
    monkeypatch.setattr(
        SamplingParams, "make_generator", lambda self, device: made_on.append(device) or make(self, device)
    )
    target = random_decoder("llama", seed=3)
    Engine(target, eos_token_ids=[EOS]).add_request(PROMPTS[0], SamplingParams(temperature=1.0, seed=1))
    assert made_on == [target.device]


def test_cuda_attention_leaves_out_cudnn_and_every_forward_asks_for_its_devices_kernels(monkeypatch):
    """cuDNN's SDPA plans anew for each key length, which a decode step changes every
    step (see decoder.CUDA_ATTENTION_BACKENDS): a CUDA forward allows every kernel but it."""
    from specserve.model import decoder

    with decoder.attention_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    cudnn_before = torch.backends.cuda.cudnn_sdp_enabled()
    with decoder.attention_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn_before

    asked_for = []
    choose = decoder.attention_backends
    monkeypatch.setattr(decoder, "attention_backends", lambda device: asked_for.append(device) or choose(device))
    monkeypatch.setattr(native, "library", lambda: None)  # the Python path, where SDPA is called
    model = random_decoder("qwen2", seed=5)
    model(torch.tensor(PROMPTS[3]), [Segment(model.new_cache(), len(PROMPTS[3]))])
    assert asked_for == [model.device]


def test_a_drafts_prior_cost_follows_bytes_on_the_cpu_and_layers_on_a_gpu():
    """Off the CPU our steps are bound by kernel launches, so a narrow draft of many
    layers is no cheap draft there (the meta device stands in for a GPU)."""
    from specserve.spec.cost import prior_cost_ratio

    target = Decoder(tiny_config("qwen2", num_layers=4, hidden_size=128, intermediate_size=256))
    draft = Decoder(tiny_config("qwen2", num_layers=3))
    by_bytes = prior_cost_ratio(DraftModelProposer(draft), target)
    assert by_bytes < 0.5
    assert prior_cost_ratio(DraftModelProposer(draft.to("meta")), target.to("meta")) == 0.75
    assert prior_cost_ratio(NgramProposer(1, 3), target) == 0.0
    # A common head (Decoder.add_common_head) reads only its rows on most text.
    target, draft = Decoder(target.config), Decoder(draft.config)  # on the CPU again
    draft.add_common_head(draft.config.vocab_size // 2)
    head_bytes = weight_bytes_per_token(draft.lm_head)
    cut = prior_cost_ratio(DraftModelProposer(draft), target)
    assert cut == pytest.approx(by_bytes - head_bytes / 2 / weight_bytes_per_token(target))
