"""DraftChains' guesses: a greedy sequence drops its first guess, and drafts nothing, where
its proposer gives it less than the least probability asked (adaptive k's price of a
row); later guesses are never dropped, nor a sampled sequence's (dropping a drawn token
for its own probability would bias the verifier's output). And the price: what a row
costs, through what first guesses of each probability earned."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.sampling import SamplingParams
from specserve.spec.adaptive import MIN_SPEEDUP, AdaptiveSpecLength, FirstGuesses
from specserve.spec.guesses import DraftChains, Guesser

VOCAB = 4
GREEDY, SAMPLED = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)


@dataclass
class View:
    seq_id: int
    params: SamplingParams
    token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    num_prompt_tokens: int = 2
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))


def logits_of(probs: list[list[float]]) -> torch.Tensor:  # [R, VOCAB]
    return torch.tensor(probs).log()


def test_a_greedy_first_guess_below_its_least_probability_is_dropped_and_no_other_guess_is():
    seqs = [View(0, GREEDY), View(1, GREEDY), View(2, SAMPLED), View(3, GREEDY)]
    chains = DraftChains(seqs, [3, 3, 3, 3], Guesser(VOCAB), least_chances=[0.6, 0.45, 0.6, 0.0])
    even, sure = [0.5, 0.3, 0.1, 0.1], [0.9, 0.05, 0.03, 0.02]
    chains.add([0, 1, 2, 3], logits_of([even, even, even, even]))  # 0.5 < 0.6: the first is dropped
    chains.add([1, 2, 3], logits_of([[0.1, 0.3, 0.3, 0.3], even, sure]))  # a later guess: never dropped
    drafts = chains.drafts()
    assert [(d.num_tokens, d.dropped) for d in drafts] == [(0, 1), (2, 0), (2, 0), (2, 0)]
    assert drafts[0].first_confidence == drafts[1].first_confidence == 0.5  # the greedy argmax's probability
    assert chains.active() == [1, 2, 3]  # the dropped one drafts no further


def test_without_least_chances_a_first_guess_is_drafted_however_unsure():
    chains = DraftChains([View(0, GREEDY)], [2], Guesser(VOCAB))
    chains.add([0], logits_of([[0.3, 0.25, 0.25, 0.2]]))
    assert (chains.drafts()[0].num_tokens, chains.drafts()[0].dropped) == (1, 0)


def test_the_least_probability_follows_what_first_guesses_earned():
    guesses = FirstGuesses()
    assert guesses.least_probability(0.0) == 0.0
    assert guesses.least_probability(0.22) == 0.2  # unverified bins read as their probability
    assert guesses.least_probability(0.99) == 1.0  # no bin earns that: nothing is worth a row
    for _ in range(100):  # guesses of 0.15 accepted half the time, of 0.25 never
        guesses.record(0.15, accepted=True)
        guesses.record(0.15, accepted=False)
        guesses.record(0.25, accepted=False)
    assert abs(guesses.rate(1) - 0.5) < 0.02 and guesses.rate(2) < 0.02
    assert guesses.least_probability(0.22) == 0.3  # from 0.3 up every bin still earns its prior


def test_the_least_chance_prices_a_drafted_row_at_plain_decodings_tokens_a_second():
    adaptive = AdaptiveSpecLength(7, prior_draft_cost_ratio=0.1)
    for _ in range(50):  # a row a sixth of a one-row forward: 10 ms + 2 ms a row
        for rows in range(1, 9):
            adaptive.observe_target(rows, 0.010 + 0.002 * rows)
    assert adaptive.least_chances(1, 1, [0]) == [0.0]  # nothing drafted
    for probability in (0.45, 0.55):  # first guesses of 0.4-0.6 always accepted
        for _ in range(50):
            adaptive.observe_first_guess(0, probability, accepted=True)
    assert MIN_SPEEDUP * 0.002 / 0.012 < 0.2
    assert adaptive.least_chances(1, 4, [0]) == [0.2]  # bins from 0.2 earn at least a row's 0.17
    # Eight sequences: a row's seconds weigh against eight tokens a plain step (0.63).
    assert 0.6 < MIN_SPEEDUP * 8 * 0.002 / 0.026 < 0.65
    assert adaptive.least_chances(8, 16, [0]) == [0.4]  # bins of 0.4-0.6 measured; 0.35 (prior) is too little


def test_a_sequences_first_guesses_set_its_own_least_chance_alone():
    """A proposer sure and wrong on one answer (its first guesses of 0.8-1.0 never
    accepted) stops drafting such guesses there, and another sequence's guesses are
    judged by what its own earned; a freed sequence's record goes with it."""
    adaptive = AdaptiveSpecLength(7, prior_draft_cost_ratio=0.1)
    for _ in range(50):
        for rows in range(1, 9):
            adaptive.observe_target(rows, 0.010 + 0.002 * rows)
    for _ in range(200):
        adaptive.observe_first_guess(1, 0.9, accepted=False)
        adaptive.observe_first_guess(2, 0.9, accepted=True)
    assert adaptive.least_chances(1, 4, [1]) == [1.0]  # no first guess of its is worth its row
    assert adaptive.least_chances(1, 4, [2, 3]) == [0.2, 0.2]  # the prior's
    adaptive.free(1)
    assert adaptive.least_chances(1, 4, [1]) == [0.2]
