"""Logit bias, repetition, frequency and presence penalties: the formula, plain decoding
with them, and speculation that stays lossless with them (greedy equivalence,
chi-square)."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.errors import ConfigError
from specserve.model.decoder import Decoder, Segment
from specserve.penalties import apply_penalties, distinct_ids, processed_logits
from specserve.sampling import SamplingParams, logits_to_probs
from specserve.spec.draft_model import DraftModelProposer
from specserve.spec.ngram import NgramProposer
from tests.chi_square import chi_square_p_value, seeded_outputs
from tests.conftest import tiny_config
from tests.engine.test_engine import EOS, PROMPTS, perturbed, random_decoder

PENALTIES = dict(presence_penalty=0.4, frequency_penalty=0.7, repetition_penalty=1.3)
# A bias that bans and one that lifts.
LOGIT_BIAS = dict(logit_bias=((1, -100.0), (3, 2.5)))


def reference_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], before: list[int]
) -> torch.Tensor:
    """One row [V], token by token: the definitions, with `before` the output so far
    (the logit bias first, as vLLM adds it; then every id but the allowed ones out)."""
    out = logits.clone().float()
    for token, bias in params.logit_bias:
        if token < out.shape[0]:
            out[token] += bias
    for token in range(out.shape[0]):
        count = before.count(token)
        if token in prompt or count:
            x = out[token]
            out[token] = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        out[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    if params.allowed_token_ids:
        out[[t for t in range(out.shape[0]) if t not in params.allowed_token_ids]] = float("-inf")
    for word in params.bad_words_ids:  # its last id out where the output ends with the rest
        if len(word) - 1 <= len(before) and tuple(before[len(before) - len(word) + 1 :]) == word[:-1]:
            out[word[-1]] = float("-inf")
    return out


def test_each_row_is_penalised_as_if_the_drafts_before_it_were_emitted():
    torch.manual_seed(0)
    params = SamplingParams(**PENALTIES)
    logits = torch.randn(4, 10) * 3  # [k+1, V], positive and negative logits
    raw = logits.clone()
    prompt, output, drafts = [1, 2], [3, 3, 4], [5, 3, 1]
    ours = apply_penalties(logits, params, prompt, output, drafts)
    for i in range(4):
        expected = reference_penalties(logits[i], params, prompt, output + drafts[:i])
        assert torch.allclose(ours[i], expected), i
    assert torch.equal(logits, raw)  # a copy: the raw logits still serve logprobs
    first = apply_penalties(logits[:1], params, prompt, [], [])  # a prompt's first token
    assert torch.allclose(first[0], reference_penalties(logits[0], params, prompt, []))


def test_the_logit_bias_is_added_to_every_row_before_the_penalties():
    torch.manual_seed(2)
    logits = torch.randn(3, 10) * 3
    raw = logits.clone()
    prompt, output, drafts = [1, 2], [3, 3], [5, 1]
    past_the_head = dict(logit_bias=((1, -100.0), (3, 2.5), (40, 7.0)))  # 40: a narrower head's logits lack it
    for fields in (past_the_head, past_the_head | PENALTIES):
        params = SamplingParams(**fields)
        assert params.processes_logits and params.penalized == ("repetition_penalty" in fields)
        ours = processed_logits(logits, params, prompt, output, drafts, stop_ids=())
        for i in range(3):
            assert torch.allclose(ours[i], reference_penalties(logits[i], params, prompt, output + drafts[:i])), i
    assert torch.equal(logits, raw)
    assert ours[:, 1].max() < raw[:, 1].min() - 90  # -100 bans the id whatever the penalties
    assert torch.equal(processed_logits(logits, SamplingParams(), prompt, output, drafts, ()), raw)


def test_a_logit_bias_is_kept_as_pairs_ids_ascending_a_later_pair_winning():
    assert SamplingParams(logit_bias={5: 1.0, 2: -3}).logit_bias == ((2, -3), (5, 1.0))
    assert SamplingParams(logit_bias=[(5, 1.0), (2, 2.0), (5, -1.0)]).logit_bias == ((2, 2.0), (5, -1.0))
    assert SamplingParams(logit_bias={5: 1.0}) == SamplingParams(logit_bias=((5, 1.0),))


def test_a_prompts_distinct_ids_penalise_as_the_prompt_itself():
    """What a sequence keeps of its prompt (its distinct ids) gives bit for bit the
    penalties the whole prompt gives, repeats and all."""
    torch.manual_seed(1)
    params = SamplingParams(**PENALTIES)
    logits = torch.randn(3, 10) * 3
    prompt = [7, 1, 7, 7, 2, 1, 9]
    whole = apply_penalties(logits, params, prompt, [3, 7], [9, 4])
    assert torch.equal(distinct_ids(prompt), torch.tensor([1, 2, 7, 9]))
    assert torch.equal(apply_penalties(logits, params, distinct_ids(prompt), [3, 7], [9, 4]), whole)


def test_no_penalty_leaves_the_logits_alone():
    logits = torch.randn(3, 10)
    assert torch.equal(apply_penalties(logits, SamplingParams(), [1], [2, 3], [4, 5]), logits)
    assert not SamplingParams().penalized and SamplingParams(repetition_penalty=1.1).penalized


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.1},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("inf")},
        {"logit_bias": ((3, 100.5),)},
        {"logit_bias": ((3, float("nan")),)},
        {"logit_bias": ((-1, 1.0),)},
        {"logit_bias": {2.5: 1.0}},
        {"logit_bias": (3, 4)},
    ],
)
def test_out_of_range_penalties_are_refused(fields):
    with pytest.raises(ConfigError, match=next(iter(fields))):
        SamplingParams(**fields)


@pytest.fixture(scope="module")
def target() -> Decoder:
    return random_decoder("qwen2", seed=1)


def penalised_greedy_by_hand(
    target: Decoder, prompt: list[int], params: SamplingParams, stop_ids: set[int] = frozenset()
) -> list[int]:
    """Greedy decoding one full forward per token, bias and penalties by the reference, and
    `stop_ids` out of reach before min_tokens tokens (the whole max_tokens: no stop)."""
    output: list[int] = []
    for _ in range(params.max_tokens):
        ids = prompt + output
        logits = target(torch.tensor(ids), [Segment(target.new_cache(), len(ids))])[-1]
        scores = reference_penalties(logits, params, prompt, output)
        if len(output) < params.min_tokens:
            scores[list(stop_ids)] = float("-inf")
        output.append(int(scores.argmax()))
    return output


@pytest.mark.parametrize("processing", ["penalties", "logit-bias", "allowed-ids", "bad-words"])
def test_plain_decoding_with_penalties_is_the_definition(target, processing):
    unprocessed = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS[:2]:
        raw = Engine(target, eos_token_ids=[EOS]).generate(prompt, unprocessed).output_ids
        processing_fields = {
            "penalties": PENALTIES,
            "logit-bias": banned_and_lifted(raw),
            "allowed-ids": allowed_but_the_first(raw),
            "bad-words": bad_words_of(raw),
        }[processing]
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, **processing_fields)
        ours = Engine(target, eos_token_ids=[EOS]).generate(prompt, params).output_ids
        assert ours == penalised_greedy_by_hand(target, prompt, params)
        assert ours != raw  # the processing does change this text
        if processing == "bad-words":
            assert ours[:2] == raw[:2] and ours[2] != raw[2]  # the pair (raw[1], raw[2]) is a bad word
        elif processing != "penalties":
            assert raw[0] not in ours
        if processing == "allowed-ids":
            assert set(ours) <= set(params.allowed_token_ids)


def allowed_but_the_first(text: list[int]) -> dict:
    """Allowed ids: every third id from 2 and the text's own, bar its first token."""
    return dict(allowed_token_ids=tuple({*range(2, 90, 3), *text} - {text[0]}))


def bad_words_of(text: list[int]) -> dict:
    """vLLM's bad words as ids: the text's second and third tokens as a pair, its
    fifth to seventh as a triple, and one id it never writes."""
    never = next(t for t in range(10, 90) if t not in text)
    return dict(bad_words_ids=((text[1], text[2]), tuple(text[4:7]), (never,)))


def banned_and_lifted(text: list[int]) -> dict:
    """A logit bias that bans the first token of an unprocessed greedy text and lifts a
    token it never writes a little: fields of SamplingParams."""
    lifted = next(t for t in range(10, 100) if t not in text)
    return dict(logit_bias=tuple(sorted([(text[0], -100.0), (lifted, 3.0)])))


@pytest.mark.parametrize(
    "processing", ["penalties", "penalties and logit bias", "penalties and allowed ids", "penalties and bad words"]
)
@pytest.mark.parametrize("proposer_kind", ["draft", "ngram", "draft, lookup first"])
def test_greedy_with_penalties_is_the_same_with_speculation(target, proposer_kind, processing):
    proposer = NgramProposer(1, 3) if proposer_kind == "ngram" else DraftModelProposer(perturbed(target, 0.3, seed=2))
    engine = Engine(
        target,
        eos_token_ids=[EOS],
        proposer=proposer,
        num_speculative_tokens=4,
        lookup_first=1 if "lookup" in proposer_kind else None,
    )
    raw = Engine(target, eos_token_ids=[EOS]).generate(PROMPTS[0], GREEDY_24).output_ids
    fields = PENALTIES | (banned_and_lifted(raw) if "bias" in processing else {})
    fields |= allowed_but_the_first(raw) if "allowed" in processing else {}
    if "bad words" in processing:  # the penalised text's own, so that the first prompt meets them
        penalised = Engine(target, eos_token_ids=[EOS]).generate(PROMPTS[0], dataclasses.replace(GREEDY_24, **fields))
        fields |= bad_words_of(penalised.output_ids)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **fields)
    seqs = [engine.add_request(p, params) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    plain = Engine(target, eos_token_ids=[EOS])
    for prompt, seq in zip(PROMPTS, seqs):
        assert seq.output_ids == plain.generate(prompt, params).output_ids
    if "bad words" in processing:
        assert seqs[0].output_ids[:2] == penalised.output_ids[:2]
        assert seqs[0].output_ids[2] != penalised.output_ids[2]
    stats = engine.spec_stats
    # A lookup repeats text, which the penalties push away from: drafted, all rejected here.
    assert stats.num_draft_tokens > 0 and (stats.num_accepted_tokens > 0 or proposer_kind == "ngram")


GREEDY_24 = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_a_draft_equal_to_the_target_guesses_the_penalised_tokens(target):
    """The draft penalises its guesses as the target will (its earlier guesses in the
    step counted), so a draft that is the target has every guess accepted."""
    engine = Engine(
        target, eos_token_ids=[EOS], proposer=DraftModelProposer(copy.deepcopy(target)), num_speculative_tokens=4
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **PENALTIES, **LOGIT_BIAS)
    seq = engine.generate(PROMPTS[1], params)
    assert seq.output_ids == Engine(target, eos_token_ids=[EOS]).generate(PROMPTS[1], params).output_ids
    assert engine.spec_stats.acceptance_rate == 1.0


@pytest.mark.parametrize(
    "min_tokens, bias, allowed, bad_words",
    [(0, True, (), ()), (4, False, (), ()), (0, False, (0, 1, 3), ()), (0, False, (), ((0, 1), (3, 3, 2)))],
    ids=[
        "penalties-and-logit-bias",
        "penalties-and-min-tokens",
        "penalties-and-allowed-ids",
        "penalties-and-bad-words",
    ],
)
def test_speculative_sampling_with_penalties_samples_the_penalised_target(min_tokens, bias, allowed, bad_words):
    """At temperature > 0 with every penalty on, 4-token outputs through a draft that is
    often wrong are distributed as sampling the penalised target one token at a time
    (chi-square over all 4^4 outputs); with min_tokens = max_tokens and a stop id, with
    that id masked too, and it never appears; with a logit bias, biased first, and the
    banned id never appears; with allowed ids, the one left out never appears; with bad
    words, no 0 is ever followed by 1."""
    vocab, length, prompt, stop = 4, 4, [0, 1, 2], 2
    torch.manual_seed(3)
    target = Decoder(tiny_config("llama", vocab_size=vocab)).eval()
    fields = dict(max_tokens=length, temperature=0.9, ignore_eos=True, **PENALTIES)
    if min_tokens:
        fields |= dict(min_tokens=min_tokens, stop_token_ids=(stop,))
    if bias:
        fields |= LOGIT_BIAS
    if allowed:
        fields |= dict(allowed_token_ids=allowed)
    if bad_words:
        fields |= dict(bad_words_ids=bad_words)
    params = SamplingParams(**fields)

    expected = torch.ones([vocab] * length, dtype=torch.float64)
    for cont in itertools.product(range(vocab), repeat=length):
        ids = prompt + list(cont)
        logits = target(torch.tensor(ids), [Segment(target.new_cache(), len(ids))])[len(prompt) - 1 : -1]
        for j, token in enumerate(cont):
            penalised = reference_penalties(logits[j], params, prompt, list(cont[:j]))
            if j < min_tokens:
                penalised[stop] = float("-inf")
            expected[cont] *= logits_to_probs(penalised.unsqueeze(0), params)[0, token]

    engine = Engine(
        target,
        eos_token_ids=[EOS % vocab],
        proposer=DraftModelProposer(perturbed(target, 1.5, seed=4)),
        num_speculative_tokens=3,
    )
    samples = seeded_outputs(engine, prompt, fields)
    assert not min_tokens or not (samples == stop).any()
    assert not bias or not (samples == 1).any()
    assert not allowed or not (samples == 2).any()
    pairs = torch.stack([samples[:, :-1], samples[:, 1:]], dim=-1)  # [N, length - 1, 2]
    assert not bad_words or not ((pairs[..., 0] == 0) & (pairs[..., 1] == 1)).any()
    assert 0.2 < engine.spec_stats.acceptance_rate < 0.95
    assert chi_square_p_value(samples, expected) > 1e-4


def test_min_tokens_gives_the_stop_ids_no_probability_on_the_rows_before_it():
    """Row i scores output token len(output) + i: with min_tokens 4 and 2 tokens out, rows
    0 and 1 lose the stop ids, row 2 keeps them; the raw logits stay as they were."""
    logits = torch.randn(4, 10)
    raw = logits.clone()
    params = SamplingParams(max_tokens=8, min_tokens=4)
    out = processed_logits(logits, params, [1, 2], [3, 4], [5, 6, 7], stop_ids={9, 2, 40})  # 40: past the head
    assert torch.equal(logits, raw)
    assert torch.isinf(out[:2, [2, 9]]).all() and (out[:2, [2, 9]] < 0).all()
    assert torch.equal(out[2:], raw[2:]) and torch.equal(out[:2, :2], raw[:2, :2])
    assert params.processes_logits and not params.penalized
    # With penalties on too, the same rows lose the same ids after the penalties.
    both = SamplingParams(max_tokens=8, min_tokens=4, **PENALTIES)
    penalised = apply_penalties(logits, both, [1, 2], [3, 4], [5, 6, 7])
    out = processed_logits(logits, both, [1, 2], [3, 4], [5, 6, 7], stop_ids={9})
    assert torch.equal(out[2:], penalised[2:]) and torch.isinf(out[:2, 9]).all()
    assert torch.equal(out[:, :9], penalised[:, :9])


@pytest.mark.parametrize("proposer_kind", ["none", "draft", "ngram"])
def test_min_tokens_holds_back_a_stop_token_and_speculation_keeps_the_output(target, proposer_kind):
    """A stop token the plain output meets early is held back until min_tokens: the output
    is the processed target's greedy text, with speculation too."""
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain_text = Engine(target, eos_token_ids=[EOS]).generate(PROMPTS[1], free).output_ids
    stop = plain_text[2]  # met at the third token
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,), min_tokens=10)
    plain = Engine(target, eos_token_ids=[EOS]).generate(PROMPTS[1], params).output_ids
    assert len(plain) >= 10 and stop not in plain[:10] and plain[:2] == plain_text[:2]
    assert plain == penalised_greedy_by_hand(target, PROMPTS[1], params, stop_ids={stop})[: len(plain)]
    engine = Engine(
        target, eos_token_ids=[EOS], proposer=proposer_of_kind(proposer_kind, target), num_speculative_tokens=4
    )
    assert engine.generate(PROMPTS[1], params).output_ids == plain


def proposer_of_kind(kind: str, target: Decoder) -> DraftModelProposer | NgramProposer | None:
    """None, a draft model that mostly agrees with `target`, or n-gram lookups."""
    if kind == "draft":
        return DraftModelProposer(perturbed(target, 0.3, seed=2))
    return NgramProposer(1, 3) if kind == "ngram" else None


def test_allowed_ids_the_engine_cannot_serve_are_refused(target):
    engine = Engine(target, eos_token_ids=[EOS])
    with pytest.raises(ConfigError, match="every allowed token id is a stop id"):
        engine.add_request(
            PROMPTS[0], SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=(EOS, 7), stop_token_ids=(7,))
        )
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4, allowed_token_ids=(3, target.config.vocab_size)))
    with pytest.raises(ConfigError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=(3, -1))
    engine.add_request(
        PROMPTS[0], SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=(EOS, 7))
    )  # 7 does not stop
