"""The bundled smollm2-135m through the whole stack: preparation into the artifacts
cache, logits parity with transformers' own GGUF reader, greedy equivalence of
speculation on and off for n-gram and draft-model proposers, and sane text."""

from __future__ import annotations

import pytest
import torch

from specserve import catalogue
from specserve.config import SpecConfig
from specserve.engine.build import build_engine, encode_prompt
from specserve.engine.engine import Engine
from specserve.model import checkpoint
from specserve.model.decoder import Decoder, Segment
from specserve.sampling import SamplingParams
from specserve.spec.draft_model import DraftModelProposer
from specserve.spec.factory import make_proposer
from specserve.spec.fused import FusedDraftProposer
from specserve.spec.ngram import NgramProposer
from tests.model.test_native import needs_kernel

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def smollm(prepared_cache):
    return catalogue.load_model(MODEL)


def test_prepared_folder_is_a_checkpoint_and_reloads(smollm, prepared_cache):
    folder = catalogue.prepared_dir(MODEL)
    assert catalogue.is_prepared(folder) and checkpoint.is_checkpoint_dir(folder)
    assert catalogue.resolve(MODEL) == folder  # prepared once: resolving again reuses it
    assert smollm.config.arch == "llama" and smollm.config.tie_word_embeddings
    assert smollm.config.num_layers == 30 and smollm.config.vocab_size == 49152


def test_logits_match_transformers_reading_the_gguf_itself(smollm):
    """transformers un-permutes llama.cpp's q/k rows with its own code: an independent check."""
    from transformers import AutoModelForCausalLM

    gguf = catalogue.CATALOGUE[MODEL].gguf_sources()[0]
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = smollm.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    ours = smollm.decoder(torch.tensor(ids), [Segment(smollm.decoder.new_cache(), len(ids))])
    torch.testing.assert_close(ours, expected, rtol=1e-3, atol=1e-3)


def first_layers(num_layers: int) -> Decoder:
    """A self-speculative draft: the target's first layers and its own head."""
    folder = catalogue.prepared_dir(MODEL)
    config = checkpoint.read_config(folder)
    config = config.__class__(**{**config.__dict__, "num_layers": num_layers})
    weights = {
        k: v
        for k, v in checkpoint.read_weights(folder).items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers
    }
    draft = Decoder.from_hf_weights(config, weights, torch.float32)
    draft.pack_linear_weights()
    return draft


PROMPTS = [
    "List the numbers from one to twenty, one per line.",
    "Repeat the following line exactly 5 times: the cat sat on the mat.",
    "Write a Python function that returns the sum of a list.",
    "I believe the meaning of life is",
]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


@pytest.fixture(scope="module")
def plain_outputs(smollm):
    engine = Engine(smollm.decoder, smollm.tokenizer.eos_token_ids)
    return {p: engine.generate(encode_prompt(smollm.tokenizer, chat=p), GREEDY).output_ids for p in PROMPTS}


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("proposer_kind", ["ngram", "draft"])
def test_greedy_equivalence_on_real_weights(smollm, plain_outputs, k, proposer_kind):
    proposer = NgramProposer(1, 4) if proposer_kind == "ngram" else DraftModelProposer(first_layers(12))
    engine = Engine(smollm.decoder, smollm.tokenizer.eos_token_ids, proposer, num_speculative_tokens=k)
    for prompt in PROMPTS:
        seq = engine.generate(encode_prompt(smollm.tokenizer, chat=prompt), GREEDY)
        assert seq.output_ids == plain_outputs[prompt], prompt
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both outcomes exercised


def test_catalogue_draft_through_the_factory(smollm, plain_outputs):
    """The path `--speculative-config '{"model": "smollm2-135m", ...}'` takes."""
    spec = SpecConfig.parse({"model": MODEL, "num_speculative_tokens": 5})
    proposer, _ = make_proposer(spec, smollm, torch.float32)
    engine = Engine(smollm.decoder, smollm.tokenizer.eos_token_ids, proposer, num_speculative_tokens=5)
    prompt = PROMPTS[0]
    seq = engine.generate(encode_prompt(smollm.tokenizer, chat=prompt), GREEDY)
    assert seq.output_ids == plain_outputs[prompt]
    assert seq.spec.acceptance_rate == 1.0  # the same model agrees with itself at temperature 0


def test_greedy_answer_makes_sense(prepared_cache):
    engine, tokenizer = build_engine(MODEL)
    ids = encode_prompt(tokenizer, chat="What is the capital of France?")
    seq = engine.generate(ids, SamplingParams(max_tokens=20, temperature=0.0))
    assert "Paris" in tokenizer.decode(seq.output_ids)


def test_bfloat16_speculation_matches_bfloat16_plain(prepared_cache):
    """--dtype bfloat16: speculation stays lossless with respect to the target as served."""
    target = catalogue.load_model(MODEL, torch.bfloat16)
    assert target.decoder.dtype == torch.bfloat16
    ids = encode_prompt(target.tokenizer, chat=PROMPTS[0])
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = Engine(target.decoder, target.tokenizer.eos_token_ids).generate(ids, params).output_ids
    engine = Engine(target.decoder, target.tokenizer.eos_token_ids, NgramProposer(1, 4), num_speculative_tokens=4)
    assert engine.generate(ids, params).output_ids == plain
    assert "1" in target.tokenizer.decode(plain)


@needs_kernel
def test_the_factory_fuses_a_draft_that_runs_in_our_kernels_unless_told_not_to(smollm, plain_outputs):
    """Fused drafting is the default wherever the draft runs in C (a quantized draft on
    our kernels); a float draft, or "fused": false, drafts through PyTorch."""

    def proposer(**keys):
        return make_proposer(
            SpecConfig.parse({"model": MODEL, "num_speculative_tokens": 3, **keys}), smollm, torch.float32
        )[0]

    fused = proposer(quantization="int8")
    assert isinstance(fused, FusedDraftProposer)
    assert type(proposer(quantization="int8", fused=False)) is DraftModelProposer
    assert type(proposer()) is DraftModelProposer  # a float32 draft has no C path
    engine = Engine(smollm.decoder, smollm.tokenizer.eos_token_ids, fused, num_speculative_tokens=3)
    prompt = PROMPTS[0]
    assert engine.generate(encode_prompt(smollm.tokenizer, chat=prompt), GREEDY).output_ids == plain_outputs[prompt]
    assert fused.describe().startswith("the draft drafts in one C call per step (fused)")
