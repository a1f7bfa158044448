"""Logprobs of emitted tokens: the target's own distribution at each position, with
speculation on or off, for accepted, recovered and bonus tokens alike. A prompt's
logprobs: the same for each prompt token after the first, read in chunks, beside other
requests, through the prefix cache and a preemption."""

from __future__ import annotations

import copy

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.errors import ConfigError
from specserve.logprobs import MAX_LOGPROBS, token_logprobs
from specserve.model.decoder import Decoder, Segment
from specserve.model.prefix_cache import BLOCK, PrefixCache
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


def engine_with(target: Decoder, proposer_kind: str, **options) -> Engine:
    if proposer_kind == "plain":
        return Engine(target, eos_token_ids=[EOS], **options)
    proposer = DraftModelProposer(perturbed(target, 0.3, seed=2)) if proposer_kind == "draft" else NgramProposer(1, 3)
    return Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=4, **options)


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


def check_prompt_logprobs(target: Decoder, seq, num_top: int) -> None:
    """seq's prompt logprobs are the target's at each prompt position, as one plain
    forward over the prompt computes them, with each token's rank among the logits."""
    prompt = seq.token_ids[: seq.num_prompt_tokens]
    logits = target(torch.tensor(prompt), [Segment(target.new_cache(), len(prompt))])[:-1].float()  # [P-1, V]
    expected = torch.log_softmax(logits, dim=-1)
    assert [e.token_id for e in seq.prompt_logprobs] == prompt[1:]
    for entry, row, raw in zip(seq.prompt_logprobs, expected, logits):
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        assert entry.rank == 1 + int((raw > raw[entry.token_id]).sum())
        top_values, top_ids = row.topk(num_top)
        assert [i for i, _ in entry.top] == top_ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)


@pytest.mark.parametrize("proposer_kind", ["plain", "draft", "ngram", "static"])
def test_prompt_logprobs_are_the_targets_at_every_prompt_position(target, proposer_kind):
    """Prompts read in chunks of 7 beside decoding requests: every prompt token after
    the first gets its logprob once, and no request's output changes. "static": the
    steps CUDA graphs capture, run eagerly, decoding in chains of 4."""
    if proposer_kind == "static":
        graphed = copy.deepcopy(target)
        graphed.use_cuda_graphs(num_slots=4, capacity=64)
        engine = engine_with(graphed, "plain", prefill_chunk_size=7, num_scheduler_steps=4)
    else:
        engine = engine_with(target, proposer_kind, prefill_chunk_size=7)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    asked = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=n) for n in (NUM_TOP, 0)]
    batch = [(PROMPTS[3], asked[0]), (PROMPTS[1], greedy), (PROMPTS[0], asked[1]), (PROMPTS[3][::-1], asked[0])]
    seqs = [engine.add_request(prompt, params) for prompt, params in batch]
    while engine.has_unfinished():
        engine.step()
    alone = engine_with(target, "plain")
    for seq, (prompt, params) in zip(seqs, batch):
        assert seq.output_ids == alone.generate(prompt, greedy).output_ids
        if params.prompt_logprobs is None:
            assert seq.prompt_logprobs == []
        else:
            check_prompt_logprobs(target, seq, params.prompt_logprobs)
    assert seqs[2].prompt_logprobs[0].top == ()


def test_a_one_token_prompt_has_no_prompt_logprobs(target):
    seq = engine_with(target, "plain").generate([77], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2))
    assert seq.prompt_logprobs == [] and seq.num_output_tokens == 3


def test_prompt_logprobs_read_every_row_where_the_prefix_cache_holds_the_prompt(target):
    """A prompt the prefix cache holds is read again for its logprobs; one that asks
    for none still loads it."""
    engine = engine_with(target, "plain", prefix_cache=PrefixCache(4096), prefill_chunk_size=16)
    prompt = list(range(10, 10 + 3 * BLOCK + 5))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = engine.generate(prompt, greedy)
    scored = engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1))
    again = engine.generate(prompt, greedy)
    assert scored.num_cached_tokens == 0
    check_prompt_logprobs(target, scored, 1)
    assert again.num_cached_tokens >= 3 * BLOCK
    assert first.output_ids == scored.output_ids == again.output_ids


@pytest.mark.parametrize("prompt_logprobs", [-1, MAX_LOGPROBS + 1])
def test_out_of_range_prompt_logprobs_are_refused(prompt_logprobs):
    with pytest.raises(ConfigError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=prompt_logprobs)


def test_token_logprobs_ranks_each_token_among_the_logits():
    logits = torch.tensor([[0.0, 1.0, 2.0, 2.0], [3.0, 0.0, 3.0, 5.0]])
    assert [e.rank for e in token_logprobs(logits, [0, 2], 1, ranked=True)] == [4, 2]
    assert token_logprobs(logits, [0], 1)[0].rank is None
