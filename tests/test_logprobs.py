"""Logprobs of emitted tokens: the target's own distribution at each position, with
speculation on or off, for accepted, recovered and bonus tokens alike."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.errors import ConfigError
from specserve.logprobs import MAX_LOGPROBS, token_logprobs
from specserve.model.decoder import Decoder, Segment
from specserve.sampling import SamplingParams
from specserve.spec.draft_model import DraftModelProposer
from specserve.spec.ngram import NgramProposer
from tests.engine.test_engine import EOS, PROMPTS, perturbed, random_decoder

NUM_TOP = 3


@pytest.fixture(scope="module")
def target() -> Decoder:
    return random_decoder("qwen2", seed=1)


def teacher_forced_logprobs(target: Decoder, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: the target's log-softmax at each output position, from one
    plain forward over prompt and output."""
    tokens = prompt + output
    logits = target(torch.tensor(tokens), [Segment(target.new_cache(), len(tokens))])  # [T, V]
    return torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)


def engine_with(target: Decoder, proposer_kind: str) -> Engine:
    if proposer_kind == "plain":
        return Engine(target, eos_token_ids=[EOS])
    proposer = DraftModelProposer(perturbed(target, 0.3, seed=2)) if proposer_kind == "draft" else NgramProposer(1, 3)
    return Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=4)


def check_against_teacher_forcing(target: Decoder, prompt: list[int], seq) -> None:
    expected = teacher_forced_logprobs(target, prompt, seq.output_ids)
    assert [e.token_id for e in seq.logprobs] == seq.output_ids
    for entry, row in zip(seq.logprobs, expected):
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        top_values, top_ids = row.topk(NUM_TOP)
        assert [i for i, _ in entry.top] == top_ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)


@pytest.mark.parametrize("proposer_kind", ["plain", "draft", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_targets_distribution_at_every_position(target, proposer_kind, temperature):
    """Sampled with a draft, steps emit accepted, recovered and bonus tokens; each one's
    logprob must be the target's at its position, as one plain forward computes it."""
    engine = engine_with(target, proposer_kind)
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=7, ignore_eos=True, logprobs=NUM_TOP)
    seqs = [engine.add_request(p, params) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    for prompt, seq in zip(PROMPTS, seqs):
        assert len(seq.logprobs) == seq.num_output_tokens == 24
        check_against_teacher_forcing(target, prompt, seq)
    if proposer_kind == "draft":
        stats = engine.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepted and rejected drafts both seen


def test_greedy_logprobs_match_plain_decodings(target):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=NUM_TOP)
    plain = engine_with(target, "plain").generate(PROMPTS[1], params)
    drafted = engine_with(target, "draft").generate(PROMPTS[1], params)
    assert drafted.output_ids == plain.output_ids
    for ours, theirs in zip(drafted.logprobs, plain.logprobs):
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-5)
        assert [i for i, _ in ours.top] == [i for i, _ in theirs.top]


def test_logprobs_end_where_the_tokens_end(target):
    """A step's tokens past max_tokens or a stop token are dropped with their logprobs."""
    engine = engine_with(target, "draft")
    plain = engine_with(target, "plain").generate(
        PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    stop_at = plain.output_ids[5]
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_at,), logprobs=0)
    seq = engine.generate(PROMPTS[1], params)
    assert seq.output_ids == plain.output_ids[: plain.output_ids.index(stop_at) + 1]
    assert [e.token_id for e in seq.logprobs] == seq.output_ids
    assert all(e.top == () for e in seq.logprobs)
    shorter = engine.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1))
    assert len(shorter.logprobs) == 3


def test_requests_without_logprobs_get_none(target):
    seq = engine_with(target, "draft").generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0))
    assert seq.logprobs == []


@pytest.mark.parametrize("logprobs", [-1, MAX_LOGPROBS + 1])
def test_out_of_range_logprobs_are_refused(logprobs):
    with pytest.raises(ConfigError, match="logprobs"):
        SamplingParams(logprobs=logprobs)


def test_token_logprobs_reads_one_row_per_token():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0], [9.0, 9.0, 9.0]])  # the last row is not read
    entries = token_logprobs(logits, [1, 0], 2)
    expected = torch.log_softmax(logits, dim=-1)
    assert [e.token_id for e in entries] == [1, 0]
    assert entries[0].logprob == pytest.approx(expected[0, 1].item())
    assert [i for i, _ in entries[0].top] == [2, 1]
    assert [i for i, _ in entries[1].top] == [0, 1] or [i for i, _ in entries[1].top] == [0, 2]
    assert token_logprobs(logits, [2], 0)[0].top == ()
