"""Fused speculation (spec/fused.py, kernels/speculate.c): the draft's steps and the
target's verification in one C call give bitwise the drafts and caches of the unfused
path, and the engine's greedy output stays the target's own."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.errors import ConfigError
from specserve.model.decoder import Decoder
from specserve.model.quant import load_quantized_state, quantized_state
from specserve.sampling import SamplingParams
from specserve.spec.draft_model import DraftModelProposer
from specserve.spec.fused import FusedDraftProposer
from tests.engine.test_engine import EOS, GREEDY, PROMPTS, log_lookups, perturbed, plain_tokens, random_decoder
from tests.model.test_native import needs_kernel, on_bfloat16_kernel
from tests.spec.test_adaptive import FreeCosts
from tests.structured.test_guided_engine import PATTERNS, guide_of


def quantized(model: Decoder, quantization: str = "int4") -> Decoder:
    with torch.device("meta"):
        q = Decoder(model.config)
    load_quantized_state(q, quantized_state(model, quantization))
    q.inv_freq = model.inv_freq
    return q.eval()


@pytest.fixture(scope="module")
def float_target() -> Decoder:
    return random_decoder("qwen3", seed=1)


@pytest.fixture(scope="module")
def target(float_target) -> Decoder:
    return quantized(float_target)


@pytest.fixture(scope="module")
def draft(float_target) -> Decoder:
    return quantized(perturbed(float_target, 0.3, seed=2))


@dataclass
class View:  # a SequenceView
    seq_id: int
    token_ids: list[int]
    params: SamplingParams = GREEDY
    generator: torch.Generator | None = None
    num_prompt_tokens: int = -1  # the tokens it starts with

    def __post_init__(self):
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)


@needs_kernel
@pytest.mark.parametrize("threshold,head_size", [(0.0, None), (0.3, None), (0.5, 48)])
def test_fused_drafts_and_draft_caches_are_bitwise_the_unfused(target, float_target, draft, threshold, head_size):
    if head_size is not None:  # a draft whose common head scores the first 48 of 96 token ids
        draft = quantized(perturbed(float_target, 0.3, seed=2))
        draft.add_common_head(head_size)
    unfused, fused = DraftModelProposer(draft, threshold), FusedDraftProposer(draft, target, threshold)
    # Sequence 0's text keeps to ids below 48, sequence 1's does not: with a common
    # head, one C call guesses over the common ids and another over every id.
    views = {name: [View(0, list(PROMPTS[1])), View(1, list(range(40, 80)))] for name in ("unfused", "fused")}
    lengths = []
    for step in range(6):
        wanted = [5, 3] if step % 3 else [0, 4]  # one sequence sits out a step, then catches up 3 tokens
        drafts = {
            name: proposer.propose(views[name], wanted) for name, proposer in (("unfused", unfused), ("fused", fused))
        }
        assert [d.tokens.tolist() for d in drafts["fused"]] == [d.tokens.tolist() for d in drafts["unfused"]]
        assert fused.last_catch_up == unfused.last_catch_up
        assert all(t < (head_size or 96) for t in drafts["fused"][0].tokens.tolist())
        lengths += [d.num_tokens for d in drafts["fused"]]
        for name, proposer in (("unfused", unfused), ("fused", fused)):
            for view, d in zip(views[name], drafts[name]):
                view.token_ids += d.tokens[:2].tolist() + [step]  # two accepted, then the target's token
            proposer.observe(views[name], [2, 2])
    if threshold == 0:
        assert lengths == [0, 4, 5, 3, 5, 3] * 2
    else:  # the draft's doubts stopped some drafts early
        assert sum(lengths) < 40
    for seq_id, cache in unfused.caches.items():
        theirs = fused.caches[seq_id]
        assert theirs.length == cache.length
        assert torch.equal(theirs.keys[:, :, : cache.length], cache.keys[:, :, : cache.length])
        assert torch.equal(theirs.values[:, :, : cache.length], cache.values[:, :, : cache.length])


@needs_kernel
@pytest.mark.parametrize(
    "adaptive, lookup_first",
    [(False, None), (True, None), (True, 1)],
    ids=["fixed-k", "adaptive", "adaptive-lookup-first"],
)
def test_fused_engine_output_is_the_targets_own(target, draft, adaptive, lookup_first, monkeypatch):
    """A ragged batch decoded with drafting and verification in one call per step (and,
    with lookup first, some sequences drafted by lookup in the same steps' forwards)."""
    proposer = FusedDraftProposer(draft, target)
    assert proposer.verifies
    calls = []
    speculate = proposer.speculate
    monkeypatch.setattr(proposer, "speculate", lambda *args: calls.append(1) or speculate(*args))
    # Timed honestly, a draft as large as its target never pays and adaptive would only
    # decode plainly: with free costs its k follows acceptance, and rollbacks happen.
    engine = Engine(
        target,
        eos_token_ids=[EOS],
        proposer=proposer,
        num_speculative_tokens=4,
        adaptive=FreeCosts(8, prior_draft_cost_ratio=0.3) if adaptive else None,
        lookup_first=lookup_first,
    )
    lookups = log_lookups(engine)
    lengths = [24, 9, 17, 30]
    seqs = [
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        for p, n in zip(PROMPTS, lengths)
    ]
    while engine.has_unfinished():
        engine.step()
    for seq, prompt, n in zip(seqs, PROMPTS, lengths):
        assert seq.output_ids == plain_tokens(
            target, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        )
    assert calls and bool(lookups) == bool(lookup_first)
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # rollbacks were exercised
    assert not proposer.caches and not engine.running


class NeverDrafts(FreeCosts):
    """Adaptive that decodes plainly: k = 0 for every sequence, no probes."""

    def choose(self, seq_ids, backlogs=None, remaining=None, others=0, spreads=None):
        return [0] * len(seq_ids)


@needs_kernel
def test_a_batch_that_drafts_nothing_takes_one_forward_a_step(target, draft, monkeypatch):
    """With nothing drafted, the fused call would only run the target, and a prompt
    being read (or a lookup's draft) would take a second forward in the same step,
    reading the target's weights twice: the whole batch goes in one forward instead."""
    proposer = FusedDraftProposer(draft, target)
    monkeypatch.setattr(proposer, "speculate", lambda *args: pytest.fail("a fused call that drafts nothing"))
    engine = Engine(
        target,
        eos_token_ids=[EOS],
        proposer=proposer,
        num_speculative_tokens=4,
        adaptive=NeverDrafts(8, prior_draft_cost_ratio=0.3),
    )
    forwards = []
    forward = engine._forward_and_verify
    monkeypatch.setattr(engine, "_forward_and_verify", lambda work: forwards.append(len(work)) or forward(work))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = engine.add_request(PROMPTS[0], params)
    engine.step()  # its prompt
    second = engine.add_request(PROMPTS[1], params)
    while engine.has_unfinished():
        engine.step()
    assert forwards[1] == 2  # the first one's decode step beside the second's prompt, in one forward
    assert first.output_ids == plain_tokens(target, PROMPTS[0], params)
    assert second.output_ids == plain_tokens(target, PROMPTS[1], params)


@needs_kernel
def test_fused_engine_output_is_a_bfloat16_targets_own(float_target, draft):
    """A bfloat16 target on our float kernel joins the call too."""
    target = on_bfloat16_kernel(float_target)
    proposer = FusedDraftProposer(draft, target)
    assert proposer.verifies
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=4)
    lengths = [24, 9, 17, 30]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    while engine.has_unfinished():
        engine.step()
    for seq, prompt, sp in zip(seqs, PROMPTS, params):
        assert seq.output_ids == plain_tokens(target, prompt, sp)
    assert engine.spec_stats.num_accepted_tokens > 0


@needs_kernel
def test_fused_drafting_in_front_of_a_float_target(float_target, draft):
    """A float32 target cannot join the call: the drafts come back and the target's own
    forward verifies them."""
    proposer = FusedDraftProposer(draft, float_target)
    assert not proposer.verifies
    engine = Engine(float_target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=4)
    for prompt in PROMPTS:
        assert engine.generate(prompt, GREEDY).output_ids == plain_tokens(float_target, prompt)
    assert engine.spec_stats.num_draft_tokens > 0


@needs_kernel
def test_sampled_requests_beside_fused_ones_take_the_unfused_path(target, draft):
    """A seeded sampled request gives what it gives without fusion, beside greedy
    requests that decode fused before and after it."""
    sampled = SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)

    def run(proposer) -> list[int]:
        engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3)
        greedy = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
        seq = engine.add_request(PROMPTS[2], sampled)
        while engine.has_unfinished():
            engine.step()
        assert [s.output_ids for s in greedy] == [plain_tokens(target, p) for p in PROMPTS[:2]]
        return seq.output_ids

    assert run(FusedDraftProposer(draft, target)) == run(DraftModelProposer(draft))


def spy_on_fused_calls(proposer: FusedDraftProposer, monkeypatch) -> list[list[int]]:
    """The sequence ids of each fused call the proposer makes from now on."""
    calls: list[list[int]] = []
    speculate = proposer.speculate
    monkeypatch.setattr(
        proposer, "speculate", lambda seqs, *a: calls.append([s.seq_id for s in seqs]) or speculate(seqs, *a)
    )
    return calls


@needs_kernel
@pytest.mark.parametrize(
    "options",
    [{"repetition_penalty": 1.3, "frequency_penalty": 0.5}, {"logit_bias": ((3, 5.0), (17, -2.0))}],
    ids=["penalties", "logit-bias"],
)
def test_penalised_greedy_requests_take_the_unfused_path(target, draft, options, monkeypatch):
    """The C draft guesses from the raw logits, which penalties and biases move: such a
    request is verified in the forward, and gives plain decoding's tokens. While it
    decodes, the fusable request beside it goes in the same forward (a fused call beside
    it would read the target's weights twice a step), and fused after."""
    proposer = FusedDraftProposer(draft, target)
    calls = spy_on_fused_calls(proposer, monkeypatch)
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3)
    penalised = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, **options)
    fused_seq = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    seq = engine.add_request(PROMPTS[1], penalised)
    finished_before = []
    while engine.has_unfinished():
        calls_before = len(calls)
        engine.step()
        finished_before += [seq.finished] * (len(calls) - calls_before)
    assert calls and all(ids == [fused_seq.seq_id] for ids in calls) and all(finished_before)
    assert seq.output_ids == plain_tokens(target, PROMPTS[1], penalised)
    assert seq.spec.num_draft_tokens > 0


# Masks on PROMPTS[1]'s request, from its free answer `ids`, so that each one bites.
MASKED_OPTIONS = {
    "logprobs": lambda ids: {"logprobs": 2},
    "allowed-ids": lambda ids: {"allowed_token_ids": tuple(range(0, 96, 3))},
    "min-tokens": lambda ids: {"min_tokens": 15, "stop_token_ids": (ids[2], ids[5])},
    "bad-words": lambda ids: {"bad_words_ids": ((ids[0],), (ids[3], ids[4]), (ids[8], ids[9]))},
    "guide": lambda ids: {"guide": guide_of(PATTERNS["digits"]), "ignore_eos": False},
}


@needs_kernel
@pytest.mark.parametrize("kind", list(MASKED_OPTIONS))
def test_masked_greedy_requests_run_fused_as_the_masked_target(target, draft, kind, monkeypatch):
    """A greedy request whose rows are masked, or that asks for logprobs, runs in the
    fused call beside a free one: the call hands back its rows' logits, and its tokens
    and logprobs are plain decoding's bit for bit (our int4 kernels compute a verified
    row as a plain step), however often its raw-argmax drafts break the mask."""
    free = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    free_answer = plain_tokens(target, PROMPTS[1], free)
    options = {"ignore_eos": True} | MASKED_OPTIONS[kind](free_answer)
    masked = SamplingParams(max_tokens=30, temperature=0.0, **options)
    proposer = FusedDraftProposer(draft, target)
    calls = spy_on_fused_calls(proposer, monkeypatch)
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3)
    seqs = [engine.add_request(PROMPTS[0], free), engine.add_request(PROMPTS[1], masked)]
    unfused_steps = []
    forward = engine._forward_and_verify
    monkeypatch.setattr(engine, "_forward_and_verify", lambda work: unfused_steps.append(len(work)) or forward(work))
    while engine.has_unfinished():
        engine.step()
    plain = [Engine(target, eos_token_ids=[EOS]).generate(PROMPTS[i], p) for i, p in enumerate((free, masked))]
    assert [s.output_ids for s in seqs] == [p.output_ids for p in plain]
    assert [s.logprobs for s in seqs] == [p.logprobs for p in plain]
    assert (plain[1].output_ids == free_answer) == (kind == "logprobs")  # each mask bites
    assert [seqs[1].seq_id in ids for ids in calls].count(True) >= 3
    assert not any(unfused_steps[1:-1])  # every step between the prompts' and the last (k = 0) is fused
    assert seqs[1].spec.num_accepted_tokens > 0


def test_fused_needs_a_draft_in_c(float_target):
    with pytest.raises(ConfigError, match="quantize the draft"):
        FusedDraftProposer(float_target, float_target)
