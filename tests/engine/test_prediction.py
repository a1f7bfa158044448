"""Predicted outputs in the engine: a request's prediction drafts for it in any engine,
plain or speculative, and its answer stays the target's own: the same tokens at
temperature 0 and for a seeded request, the target's distribution for an unseeded one
(chi-square); the drafts' fate is counted for OpenAI's usage fields."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.model.decoder import Decoder
from specserve.sampling import SamplingParams
from specserve.spec.adaptive import AdaptiveSpecLength
from specserve.spec.draft_model import DraftModelProposer
from specserve.spec.ngram import NgramProposer
from specserve.spec.prediction import WARY_AFTER, WARY_FIRST, PredictedText, PredictionDrafts
from tests.conftest import tiny_config
from tests.engine.test_engine import EOS, GREEDY, PROMPTS, perturbed, plain_tokens, random_decoder


@pytest.fixture(scope="module")
def target() -> Decoder:
    return random_decoder("qwen2", seed=1)


def predicted(params: SamplingParams, tokens: list[int]) -> SamplingParams:
    return dataclasses.replace(params, prediction=PredictedText(tokens))


def test_drafts_follow_the_answer_through_the_prediction():
    drafts = PredictionDrafts(PredictedText([1, 2, 3, 4, 5, 1, 2, 3, 9, 9]))
    assert drafts.draft([], 4) == [1, 2, 3, 4]  # before any answer: its start
    assert drafts.draft([1, 2, 3], 4) == [4, 5, 1, 2]
    assert drafts.draft([4, 5, 1, 2, 3], 4) == [9, 9]  # the repeated run read in order: its second occurrence
    assert drafts.draft([3, 9, 9], 4) == []  # the prediction's end
    edited = PredictionDrafts(PredictedText([10, 11, 12, 13, 14, 15, 16]))
    assert edited.draft([10, 11, 50, 51, 13], 3) == [14, 15, 16]  # past an edit, the next shared token resyncs
    assert edited.draft([60, 61], 3) == []  # nothing shared: nothing drafted


def test_a_wary_predictions_first_draft_is_short_until_one_is_judged():
    drafts = PredictionDrafts(PredictedText(list(range(1, 21))))
    assert drafts.draft([], 10, wary=True) == list(range(1, WARY_FIRST + 1))
    assert drafts.draft([], 10) == list(range(1, 11))  # where a policy prices the rows: as asked
    drafts.pending = WARY_FIRST
    drafts.settle(0, answer_length=1)  # judged, and rejected: k is the caller's again
    assert drafts.draft([5], 10, wary=True) == list(range(6, 16))


def test_a_wary_prediction_rejected_whole_repeatedly_drafts_from_three_matched_tokens():
    drafts = PredictionDrafts(PredictedText([1, 2, 3, 4, 5, 6, 7, 8]))
    for _ in range(WARY_AFTER):
        assert drafts.draft([9, 9, 5], 1, wary=True) == [6]  # one token matched
        drafts.pending = 1
        drafts.settle(0, answer_length=3)
    assert drafts.draft([9, 9, 5], 1, wary=True) == []
    assert drafts.draft([9, 9, 5], 1) == [6]  # where a policy prices the rows: any match
    assert drafts.draft([3, 4, 5], 2, wary=True) == [6, 7]
    drafts.pending = 2
    drafts.settle(1, answer_length=4)  # accepted: trusted again
    assert drafts.draft([9, 6], 1, wary=True) == [7]


def test_a_prediction_the_answer_does_not_follow_stops_drafting_in_a_plain_engine(target):
    """Each of the answer's tokens occurs in the prediction, but never three in a row as
    the answer has them: the first draft holds WARY_FIRST tokens, and after WARY_AFTER
    rejected drafts no more rows are verified, where every step drafted one before."""
    params = dataclasses.replace(GREEDY, max_tokens=48, ignore_eos=True)
    answer = plain_tokens(target, PROMPTS[1], params)
    generator = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    prediction = torch.cat([torch.randperm(vocab, generator=generator) for _ in range(2)]).tolist()
    seq = engines(target)["plain"].generate(PROMPTS[1], predicted(params, prediction))
    assert seq.output_ids == answer
    assert seq.prediction.accepted == 0 and seq.spec.num_drafts <= WARY_AFTER + 1  # of 48 steps
    assert seq.prediction.rejected <= WARY_FIRST + WARY_AFTER  # the start, then one token a miss


def engines(target: Decoder) -> dict[str, Engine]:
    return {
        "plain": Engine(target, eos_token_ids=[EOS]),
        "ngram, adaptive": Engine(
            target,
            eos_token_ids=[EOS],
            proposer=NgramProposer(1, 3),
            num_speculative_tokens=3,
            adaptive=AdaptiveSpecLength(15, 0.3),
        ),
    }


@pytest.mark.parametrize("kind", ["plain", "ngram, adaptive"])
def test_greedy_answers_are_the_targets_whatever_the_prediction(target, kind):
    """The exact answer, one with an edit, a wrong one and an empty one: each answer is
    the target's own; the exact prediction is drafted and accepted whole, in few steps."""
    engine = engines(target)[kind]
    for prompt in PROMPTS:
        answer = plain_tokens(target, prompt)
        edited = answer[:8] + [3, 4, 5] + answer[8:]
        for prediction in (answer, edited, list(reversed(answer)), []):
            seq = engine.add_request(prompt, predicted(GREEDY, prediction))
            steps = 0
            while engine.has_unfinished():
                engine.step()
                steps += 1
            assert seq.output_ids == answer
            if kind == "plain":  # every draft is the prediction's
                assert seq.prediction.accepted == seq.spec.num_accepted_tokens
                assert seq.prediction.accepted + seq.prediction.rejected == seq.spec.num_draft_tokens
            if prediction is answer:  # drafted from the first decode step on, never wrong
                assert seq.prediction.rejected == 0 and seq.prediction.accepted > len(answer) // 2 and steps <= 6
            if prediction is edited:
                assert 0 < seq.prediction.rejected and seq.prediction.accepted > len(answer) // 2


def test_a_short_edit_to_a_followed_prediction_decodes_plainly(target):
    """Where the answer leaves a prediction it has followed, the draft model would first
    read the prompt and all the prediction drafted, which comes back to be read after
    the edit: a short edit decodes plainly instead. Without a prediction the same
    engine drafts; the answers are the target's."""
    adaptive = AdaptiveSpecLength(7, 0.3)
    # Costs as a quiet machine measures them, so that the choice does not depend on this one.
    observe_draft, observe_target, observe_read = adaptive.observe_draft, adaptive.observe_target, adaptive.observe_read
    adaptive.observe_draft = lambda positions, seconds: observe_draft(positions, 3e-3 * positions)
    adaptive.observe_target = lambda rows, seconds: observe_target(rows, 1e-2 + 1e-3 * rows)
    adaptive.observe_read = lambda tokens, positions, seconds: observe_read(tokens, positions, 1e-3 * tokens)
    proposer = DraftModelProposer(perturbed(target, 0.05, seed=2))
    engine = Engine(target, eos_token_ids=[EOS], proposer=proposer, num_speculative_tokens=3, adaptive=adaptive)
    drafted_for, propose = [], proposer.propose
    proposer.propose = lambda seqs, ks, *rest: (
        drafted_for.extend(s.seq_id for s, k in zip(seqs, ks) if k),
        propose(seqs, ks, *rest),
    )[1]
    params = dataclasses.replace(GREEDY, max_tokens=96)
    prompt = PROMPTS[2]
    answer = plain_tokens(target, prompt, params)
    plain = engine.generate(prompt, params)  # learns the costs, and that the draft pays
    assert plain.output_ids == answer and plain.seq_id in drafted_for
    edit = answer[46:54]  # 8 tokens found nowhere else in the answer: nothing to draft from while it is written
    assert not set(edit) & set(answer[:46] + answer[54:])
    seq = engine.generate(prompt, predicted(params, answer[:46] + answer[54:]))
    assert seq.output_ids == answer and seq.prediction.accepted > len(answer) // 2
    assert seq.seq_id not in drafted_for


def test_a_seeded_request_gets_plain_samplings_tokens_with_a_prediction(target):
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    expected = plain_tokens(target, PROMPTS[1], params)
    for prediction in (expected, expected[:10] + [1, 2] + expected[10:], [7] * 30):
        engine = engines(target)["plain"]
        seq = engine.generate(PROMPTS[1], predicted(params, prediction))
        assert seq.output_ids == expected
        assert (seq.spec.num_draft_tokens > 0) == (7 not in prediction)  # 7 never comes: nothing to draft after


def test_a_prediction_drafts_beside_requests_without_one(target):
    """A batch of a predicted request and plain ones: each answer its own."""
    engine = engines(target)["plain"]
    answer = plain_tokens(target, PROMPTS[0])
    seqs = [engine.add_request(PROMPTS[0], predicted(GREEDY, answer))]
    seqs += [engine.add_request(prompt, GREEDY) for prompt in PROMPTS[1:]]
    while engine.has_unfinished():
        engine.step()
    assert [s.output_ids for s in seqs] == [plain_tokens(target, p) for p in PROMPTS]
    assert seqs[0].prediction.rejected == 0 and seqs[0].prediction.accepted > len(answer) // 2
    assert all(s.spec.num_drafts == 0 for s in seqs[1:])


@pytest.mark.parametrize("keyed", [True, False], ids=["seeded", "unseeded"])
def test_a_predicted_request_samples_the_target_distribution(keyed):
    """4-token outputs of a plain engine drafting from a fixed prediction, sometimes
    right, are distributed as the target's own sampling (chi-square over all 4^4)."""
    from tests.chi_square import chi_square_p_value, seeded_outputs, target_continuation_probs

    vocab, prompt = 4, [0, 1, 2]
    torch.manual_seed(3)
    target = Decoder(tiny_config("llama", vocab_size=vocab)).eval()
    params = dict(max_tokens=4, temperature=0.9, top_p=0.95, ignore_eos=True)
    expected = target_continuation_probs(target, prompt, SamplingParams(**params))
    engine = Engine(target, eos_token_ids=[EOS % vocab])
    samples = seeded_outputs(engine, prompt, {**params, "prediction": PredictedText([1, 3, 0, 2])}, keyed=keyed)
    stats = engine.spec_stats
    assert 0.1 < stats.acceptance_rate < 0.9  # a prediction often wrong, not always
    assert chi_square_p_value(samples, expected) > 1e-4
