"""The verifier: greedy equivalence, edge cases, and a statistical test of losslessness.

The statistical test runs speculative decoding end to end on a tiny bigram "model"
(the next token's logits depend on the previous token), so the target row the verifier
sees after an accepted draft is the right conditional. It compares the emitted tokens'
distribution, the first token alone and the first k+1 jointly, with the target's by a
chi-square goodness-of-fit test; the same check must reject deliberately wrong verifiers,
which shows it has the power to catch the bugs it is there for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from specserve.penalties import apply_penalties
from specserve.sampling import (
    SEED_MAX,
    SEED_MIN,
    TOP_K_DIRECT,
    InvalidSamplingValue,
    SamplingParams,
    draw_on_device,
    keyed_uniform,
    keyed_uniforms,
    kth_largest,
    logits_to_probs,
    probs_on_device,
    sample,
    seed_key,
    top_p_kept,
)
from specserve.spec.proposer import Draft
from specserve.spec.verify import (
    PAD_TOKEN,
    Verdict,
    common_prefix_length,
    rejection_sample,
    verdict_from_argmax,
    verify,
    verify_batch,
    verify_keyed,
)
from tests.chi_square import chi_square_p_value

VOCAB = 6
START_TOKEN = 0
NUM_SAMPLES = 40_000
# Pass when the chi-square p-value exceeds this; the runs are seeded, so a pass or fail
# repeats, and a correct verifier fails about once in 10^4 seeds.
MIN_P_VALUE = 1e-4

# Next-token logits after token c are the base rolled by c: token (c + j) % V gets base[j].
TARGET_BASE = torch.tensor([3.0, 2.0, 1.2, 0.5, -0.5, -2.0])
# Most mass where the target has little, including tokens the target's top-k removes.
ADVERSARIAL_BASE = torch.tensor([-1.0, 0.0, 1.5, 0.8, 2.5, 3.0])


def bigram_table(base: torch.Tensor) -> torch.Tensor:
    """base [V] -> logits [V, V]; row c holds the logits of the token after token c."""
    return torch.stack([base.roll(c) for c in range(len(base))])


TARGET_TABLE = bigram_table(TARGET_BASE)  # [V, V]
ADVERSARIAL_TABLE = bigram_table(ADVERSARIAL_BASE)  # [V, V]
_NOISE = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(7))
NEAR_TABLE = TARGET_TABLE + 0.8 * _NOISE  # [V, V]


@dataclass(frozen=True)
class Scenario:
    name: str
    params: SamplingParams
    k: int
    draft_table: torch.Tensor | None  # [V, V] draft logits; None: deterministic draft
    draft_shift: int = 0  # deterministic draft: after token c it proposes (c + shift) % V

    def __str__(self) -> str:
        return self.name


ADVERSARIAL_TOP_K = Scenario("adversarial draft, top-k", SamplingParams(top_k=4), 2, ADVERSARIAL_TABLE)
ADVERSARIAL_TOP_P = Scenario(
    "adversarial draft, temperature and top-p",
    SamplingParams(temperature=1.5, top_p=0.9),
    3,
    ADVERSARIAL_TABLE,
)
NEAR_DRAFT = Scenario("draft near the target", SamplingParams(top_k=5, top_p=0.95), 2, NEAR_TABLE)
ADVERSARIAL_MIN_P = Scenario(
    "adversarial draft, temperature and min-p", SamplingParams(temperature=1.2, min_p=0.1), 3, ADVERSARIAL_TABLE
)
EQUAL_DRAFT = Scenario("draft equals target", SamplingParams(temperature=0.9, top_k=5), 2, TARGET_TABLE)
# base[3] = 0.5: the target gives the proposed token about 5%.
DETERMINISTIC_UNLIKELY = Scenario("deterministic draft, unlikely token", SamplingParams(), 2, None, draft_shift=3)
# top_k=3 removes base[4]: the target never emits the proposed token.
DETERMINISTIC_IMPOSSIBLE = Scenario(
    "deterministic draft, token outside top-k",
    SamplingParams(temperature=1.3, top_k=3),
    2,
    None,
    draft_shift=4,
)
SCENARIOS = [
    ADVERSARIAL_TOP_K,
    ADVERSARIAL_TOP_P,
    ADVERSARIAL_MIN_P,
    NEAR_DRAFT,
    EQUAL_DRAFT,
    DETERMINISTIC_UNLIKELY,
    DETERMINISTIC_IMPOSSIBLE,
]

# (target_logits [B, k+1, V], draft_tokens [B, k], draft_probs [B, k, V] | None, params,
#  generator) -> (tokens [B, k+1], num_accepted [B]): the shape of `verify_batch`.
Verifier = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: a second thread only adds wake-ups, which cost
    milliseconds per op when the machine is busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def draw_drafts(
    scenario: Scenario, previous: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """previous [B] -> draft_tokens [B, k], draft_probs [B, k, V] or None, drafted one
    token at a time the way a draft model does, through the same transform as the target."""
    tokens, probs = [], []
    for _ in range(scenario.k):
        if scenario.draft_table is None:
            previous = (previous + scenario.draft_shift) % VOCAB
        else:
            row_probs = logits_to_probs(scenario.draft_table[previous], scenario.params)  # [B, V]
            previous = sample(row_probs, generator)
            probs.append(row_probs)
        tokens.append(previous)
    draft_probs = torch.stack(probs, dim=1) if probs else None
    return torch.stack(tokens, dim=1), draft_probs


def speculative_decode(
    verifier: Verifier, scenario: Scenario, num_samples: int, length: int, seed: int
) -> torch.Tensor:
    """Decode num_samples independent sequences from START_TOKEN until each has at least
    `length` tokens -> their first `length` tokens [num_samples, length]."""
    generator = torch.Generator().manual_seed(seed)
    emitted = torch.full((num_samples, length), PAD_TOKEN)  # [N, length]
    num_emitted = torch.zeros(num_samples, dtype=torch.int64)  # [N]
    last_token = torch.full((num_samples,), START_TOKEN)  # [N]
    while (num_emitted < length).any():
        active = (num_emitted < length).nonzero().squeeze(1)  # [A]
        draft_tokens, draft_probs = draw_drafts(scenario, last_token[active], generator)  # [A, k]
        # Row i predicts the token after draft[:i], so it follows the i-th token of history.
        history = torch.cat([last_token[active, None], draft_tokens], dim=1)  # [A, k+1]
        tokens, num_accepted = verifier(
            TARGET_TABLE[history], draft_tokens, draft_probs, scenario.params, generator
        )  # [A, k+1], [A]
        for position in range(scenario.k + 1):
            slot = num_emitted[active] + position  # [A]
            keep = (position <= num_accepted) & (slot < length)
            emitted[active[keep], slot[keep]] = tokens[keep, position]
        num_emitted[active] += num_accepted + 1
        last_token[active] = tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return emitted


def target_joint_probs(params: SamplingParams, length: int) -> torch.Tensor:
    """The target's probability of each token string -> [V] * length, float64."""
    next_probs = logits_to_probs(TARGET_TABLE, params).double()  # [V, V]: row c = after c
    joint = next_probs[START_TOKEN]  # [V]
    for _ in range(length - 1):
        joint = joint.unsqueeze(-1) * next_probs  # [..., V, V]: the last axis follows the one before
    return joint


def goodness_of_fit(verifier: Verifier, scenario: Scenario, num_samples: int = NUM_SAMPLES, seed: int = 0) -> float:
    """The smaller p-value of the first token's distribution and the first k+1 tokens'
    joint distribution against the target's."""
    length = scenario.k + 1  # covers every draft position and the bonus token
    samples = speculative_decode(verifier, scenario, num_samples, length, seed)
    first = chi_square_p_value(samples[:, :1], target_joint_probs(scenario.params, 1))
    joint = chi_square_p_value(samples, target_joint_probs(scenario.params, length))
    return min(first, joint)


# -- wrong verifiers: each must fail the same check ---------------------------------------


def _target_probs(target_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    batch, rows, vocab = target_logits.shape
    return logits_to_probs(target_logits.reshape(-1, vocab), params).view(batch, rows, vocab)


def _resample_recovered(target_logits, draft_tokens, draft_probs, params, generator, drop_rejected_token: bool):
    """Run the real verifier, then redraw each recovered token from target_probs, with
    or without the rejected token."""
    target_probs = _target_probs(target_logits, params)
    tokens, num_accepted = rejection_sample(target_probs, draft_tokens, draft_probs, generator)
    rejected = (num_accepted < draft_tokens.shape[1]).nonzero().squeeze(1)  # [R]
    at = num_accepted[rejected]  # [R]
    rows = target_probs[rejected, at].clone()  # [R, V]
    if drop_rejected_token:
        rows[torch.arange(len(rejected)), draft_tokens[rejected, at]] = 0
    tokens[rejected, at] = torch.multinomial(rows, 1, generator=generator).squeeze(1)
    return tokens, num_accepted


def recovers_from_target(target_logits, draft_tokens, draft_probs, params, generator):
    """Bug: the recovered token comes from target_probs instead of the residual."""
    return _resample_recovered(target_logits, draft_tokens, draft_probs, params, generator, False)


def recovers_without_the_rejected_token(target_logits, draft_tokens, draft_probs, params, generator):
    """Bug: the recovered token comes from target_probs with the rejected token removed
    (right for a one-hot draft only) instead of max(0, target_probs - draft_probs)."""
    return _resample_recovered(target_logits, draft_tokens, draft_probs, params, generator, True)


def swaps_target_and_draft(target_logits, draft_tokens, draft_probs, params, generator):
    """Bug: target_probs and draft_probs trade places (accept with min(1, draft/target))."""
    target_probs = _target_probs(target_logits, params)
    k = draft_tokens.shape[1]
    swapped_target = torch.cat([draft_probs, target_probs[:, k:]], dim=1)
    return rejection_sample(swapped_target, draft_tokens, target_probs[:, :k], generator)


def accepts_what_the_target_allows(target_logits, draft_tokens, draft_probs, params, generator):
    """Bug: a draft is accepted whenever the target gives it any probability."""
    no_draft_mass = torch.zeros_like(draft_probs)  # u * 0 < target_probs: accept unless 0
    return rejection_sample(_target_probs(target_logits, params), draft_tokens, no_draft_mass, generator)


def judges_with_the_next_row(target_logits, draft_tokens, draft_probs, params, generator):
    """Bug: off by one, draft i is judged by the row after it (row i+1)."""
    target_probs = _target_probs(target_logits, params).roll(-1, dims=1)
    return rejection_sample(target_probs, draft_tokens, draft_probs, generator)


def bonus_from_the_row_before(target_logits, draft_tokens, draft_probs, params, generator):
    """Bug: the bonus token comes from row k-1, the row that judged the last draft."""
    target_probs = _target_probs(target_logits, params)
    target_probs = torch.cat([target_probs[:, :-1], target_probs[:, -2:-1]], dim=1)
    return rejection_sample(target_probs, draft_tokens, draft_probs, generator)


def verifies_as_deterministic(target_logits, draft_tokens, draft_probs, params, generator):
    """Not a bug: verifying a sampled draft as one-hot (probs=None) stays lossless, since
    the one-hot test is lossless for any way of choosing the token; it accepts less."""
    return verify_batch(target_logits, draft_tokens, None, params, generator)


def verify_each_row(target_logits, draft_tokens, draft_probs, params, generator):
    """The single-sequence contract, `verify`, called once per row."""
    tokens = torch.full((draft_tokens.shape[0], draft_tokens.shape[1] + 1), PAD_TOKEN)
    num_accepted = torch.empty(draft_tokens.shape[0], dtype=torch.int64)
    for row in range(draft_tokens.shape[0]):
        draft = Draft(draft_tokens[row], None if draft_probs is None else draft_probs[row])
        verdict = verify(target_logits[row], draft, params, generator)
        tokens[row, : len(verdict.tokens)] = torch.tensor(verdict.tokens)
        num_accepted[row] = verdict.num_accepted
    return tokens, num_accepted


# -- the statistical test -------------------------------------------------------------


def acceptance_probability(scenario: Scenario) -> torch.Tensor:
    """[V]: the chance the first draft is accepted after each context token."""
    target_probs = logits_to_probs(TARGET_TABLE, scenario.params)  # [V, V]
    if scenario.draft_table is None:
        contexts = torch.arange(VOCAB)
        return target_probs[contexts, (contexts + scenario.draft_shift) % VOCAB]
    draft_probs = logits_to_probs(scenario.draft_table, scenario.params)  # [V, V]
    return torch.minimum(target_probs, draft_probs).sum(dim=1)


@pytest.mark.parametrize(
    "scenario, low, high",
    [
        (ADVERSARIAL_TOP_K, 0.1, 0.5),
        (ADVERSARIAL_TOP_P, 0.1, 0.5),
        (NEAR_DRAFT, 0.5, 0.99),
        (EQUAL_DRAFT, 1 - 1e-6, 1 + 1e-6),
        (DETERMINISTIC_UNLIKELY, 0.01, 0.1),
        (DETERMINISTIC_IMPOSSIBLE, 0, 0),
    ],
    ids=lambda x: str(x) if isinstance(x, Scenario) else "",
)
def test_scenarios_are_what_their_names_say(scenario, low, high):
    """Degenerate scenarios (no overlap, no rejection) would let wrong verifiers pass."""
    acceptance = acceptance_probability(scenario)  # [V]
    assert ((acceptance >= low) & (acceptance <= high)).all(), acceptance
    if scenario in (ADVERSARIAL_TOP_K, ADVERSARIAL_TOP_P):
        target_probs = logits_to_probs(TARGET_TABLE, scenario.params)  # [V, V]
        draft_probs = logits_to_probs(scenario.draft_table, scenario.params)  # [V, V]
        mass_the_target_never_emits = (draft_probs * (target_probs == 0)).sum(dim=1)  # [V]
        assert (mass_the_target_never_emits > 0.5).all()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=str)
def test_emitted_tokens_follow_the_target_distribution(scenario):
    assert goodness_of_fit(verify_batch, scenario) > MIN_P_VALUE


@pytest.mark.parametrize("scenario", [ADVERSARIAL_TOP_K, NEAR_DRAFT], ids=str)
def test_sampled_draft_verified_as_deterministic_follows_the_target_distribution(scenario):
    assert goodness_of_fit(verifies_as_deterministic, scenario) > MIN_P_VALUE


@pytest.mark.parametrize("scenario", [ADVERSARIAL_TOP_K, DETERMINISTIC_UNLIKELY], ids=str)
def test_single_sequence_verify_follows_the_target_distribution(scenario):
    # One `verify` call per row is slow: fewer samples, the same check.
    assert goodness_of_fit(verify_each_row, scenario, num_samples=3_000, seed=1) > MIN_P_VALUE


@pytest.mark.parametrize(
    "wrong_verifier, scenario",
    [
        (recovers_from_target, ADVERSARIAL_TOP_K),
        (recovers_from_target, NEAR_DRAFT),
        (recovers_from_target, DETERMINISTIC_UNLIKELY),
        (swaps_target_and_draft, ADVERSARIAL_TOP_K),
        (swaps_target_and_draft, ADVERSARIAL_TOP_P),
        (swaps_target_and_draft, NEAR_DRAFT),
        (accepts_what_the_target_allows, ADVERSARIAL_TOP_K),
        (accepts_what_the_target_allows, NEAR_DRAFT),
        (judges_with_the_next_row, NEAR_DRAFT),
        (judges_with_the_next_row, ADVERSARIAL_TOP_P),
        (recovers_without_the_rejected_token, ADVERSARIAL_TOP_K),
        (recovers_without_the_rejected_token, NEAR_DRAFT),
        # Only the joint distribution sees this one: the bonus is never the first token.
        (bonus_from_the_row_before, NEAR_DRAFT),
        (bonus_from_the_row_before, EQUAL_DRAFT),
    ],
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_the_check_rejects_wrong_verifiers(wrong_verifier, scenario):
    assert goodness_of_fit(wrong_verifier, scenario) < MIN_P_VALUE


def test_chi_square_p_value_is_right_on_known_counts():
    # 2 cells, 50/50 expected, 60/40 observed: statistic 4 with 1 degree of freedom,
    # p = erfc(sqrt(2)) ~ 0.0455.
    samples = torch.tensor([0] * 60 + [1] * 40).unsqueeze(1)
    expected = torch.tensor([0.5, 0.5, 0, 0, 0, 0], dtype=torch.float64)
    assert chi_square_p_value(samples, expected) == pytest.approx(0.0455, abs=1e-4)
    assert chi_square_p_value(torch.tensor([[2]]), expected) == 0.0


# -- acceptance -----------------------------------------------------------------------


def one_step(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    num_samples: int,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same step repeated on num_samples sequences: [k+1, V] logits for all."""
    batch_logits = target_logits.expand(num_samples, *target_logits.shape)
    generator = torch.Generator().manual_seed(seed)
    return verify_batch(batch_logits, draft_tokens, draft_probs, params, generator)


def test_mean_accepted_is_the_overlap_of_the_distributions():
    params = SamplingParams(temperature=0.8, top_k=5)
    target_logits = TARGET_TABLE[:2]  # [2, V]: k = 1
    draft_row = logits_to_probs(ADVERSARIAL_TABLE[:1], params)  # [1, V]
    overlap = float(torch.minimum(logits_to_probs(target_logits[:1], params), draft_row).sum())
    num_samples = 40_000
    draft_tokens = torch.multinomial(
        draft_row.expand(num_samples, -1), 1, replacement=True, generator=torch.Generator().manual_seed(3)
    )  # [N, 1]
    draft_probs = draft_row.expand(num_samples, 1, -1)  # [N, 1, V]
    _, num_accepted = one_step(target_logits, draft_tokens, draft_probs, params, num_samples, seed=4)
    standard_error = (overlap * (1 - overlap) / num_samples) ** 0.5
    assert abs(num_accepted.double().mean().item() - overlap) < 5 * standard_error


def test_deterministic_draft_is_accepted_with_the_target_probability():
    params = SamplingParams(top_p=0.9)
    target_logits = TARGET_TABLE[:2]  # [2, V]: k = 1
    drafted = 2
    target_at_draft = float(logits_to_probs(target_logits[:1], params)[0, drafted])
    num_samples = 40_000
    draft_tokens = torch.full((num_samples, 1), drafted)
    tokens, num_accepted = one_step(target_logits, draft_tokens, None, params, num_samples, seed=5)
    standard_error = (target_at_draft * (1 - target_at_draft) / num_samples) ** 0.5
    assert abs(num_accepted.double().mean().item() - target_at_draft) < 5 * standard_error
    # The residual of a one-hot draft excludes the rejected token.
    assert (tokens[num_accepted == 0, 0] != drafted).all()


def test_draft_equal_to_target_is_always_accepted():
    params = SamplingParams(temperature=0.7, top_p=0.9)
    target_logits = TARGET_TABLE[[0, 1, 2]]  # [3, V]: k = 2
    target_probs = logits_to_probs(target_logits, params)  # [3, V]
    num_samples = 5_000
    generator = torch.Generator().manual_seed(6)
    draft_tokens = torch.stack(
        [torch.multinomial(row, num_samples, replacement=True, generator=generator) for row in target_probs[:2]],
        dim=1,
    )  # [N, 2]
    draft_probs = target_probs[:2].expand(num_samples, 2, -1)
    tokens, num_accepted = one_step(target_logits, draft_tokens, draft_probs, params, num_samples, seed=7)
    assert (num_accepted == 2).all()
    assert torch.equal(tokens[:, :2], draft_tokens)


def test_a_token_the_target_never_emits_is_always_rejected():
    params = SamplingParams(top_k=2)
    target_logits = TARGET_TABLE[:2]  # [2, V]: the target keeps only tokens 0 and 1 first
    num_samples = 2_000
    for draft_probs in (None, torch.full((num_samples, 1, VOCAB), 1 / VOCAB)):
        draft_tokens = torch.full((num_samples, 1), 4)
        tokens, num_accepted = one_step(target_logits, draft_tokens, draft_probs, params, num_samples, seed=8)
        assert (num_accepted == 0).all()
        assert set(tokens[:, 0].tolist()) == {0, 1}
        assert (tokens[:, 1] == PAD_TOKEN).all()


# -- edge cases -----------------------------------------------------------------------


def test_draft_without_mass_on_its_token_is_judged_by_the_target_alone():
    """A draft cannot sample a token it gives probability 0; if it claims to, accept it
    exactly when the target allows it, and never divide by zero."""
    target_probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]).expand(200, 2, 3)
    draft_probs = torch.tensor([[[0.0, 0.0, 1.0]]]).expand(200, 1, 3)
    generator = torch.Generator().manual_seed(9)
    drafted_first = torch.zeros(200, 1, dtype=torch.int64)
    tokens, num_accepted = rejection_sample(target_probs, drafted_first, draft_probs, generator)
    assert (num_accepted == 1).all() and (tokens[:, 0] == 0).all()
    drafted_impossible = torch.full((200, 1), 2)
    tokens, num_accepted = rejection_sample(target_probs, drafted_impossible, draft_probs, generator)
    assert (num_accepted == 0).all() and set(tokens[:, 0].tolist()) <= {0, 1}


def test_negligible_residual_falls_back_to_the_target():
    """With the draft at or above the target everywhere (here unnormalized, as rounding
    can leave it), the residual is zero: sample the target row instead of failing."""
    target_probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]).expand(4_000, 2, 4)
    draft_probs = torch.tensor([[[1.0, 0.5, 0.1, 0.0]]]).expand(4_000, 1, 4)
    generator = torch.Generator().manual_seed(10)
    drafted_first = torch.zeros(4_000, 1, dtype=torch.int64)
    tokens, num_accepted = rejection_sample(target_probs, drafted_first, draft_probs, generator)
    recovered = tokens[num_accepted == 0, 0]
    assert 1_500 < len(recovered) < 2_500  # accepted with probability 0.5 / 1.0
    assert set(recovered.tolist()) == {0, 1}


def test_k_zero_is_plain_sampling_with_the_same_draw():
    params = SamplingParams(temperature=0.8, top_p=0.9)
    target_logits = TARGET_TABLE[3:4]  # [1, V]
    for seed in range(20):
        verdict = verify(target_logits, Draft.empty(), params, torch.Generator().manual_seed(seed))
        expected = sample(logits_to_probs(target_logits, params), torch.Generator().manual_seed(seed))
        assert verdict == Verdict(tokens=expected.tolist(), num_accepted=0)


def test_same_seed_same_verdicts():
    params = SamplingParams(temperature=1.1, top_k=5)
    target_logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(11))  # [k+1, V]
    draft_logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(12))  # [k, V]
    draft_probs = logits_to_probs(draft_logits, params)
    draft = Draft(sample(draft_probs, torch.Generator().manual_seed(13)), draft_probs)

    def run(seed: int) -> list[Verdict]:
        generator = torch.Generator().manual_seed(seed)
        return [verify(target_logits, draft, params, generator) for _ in range(50)]

    assert run(0) == run(0)
    assert run(0) != run(1)


@pytest.mark.parametrize("target_shape, probs_shape", [((3, 6), (2, 6)), ((4, 6), (3, 5)), ((6,), None)])
def test_mismatched_shapes_are_refused(target_shape, probs_shape):
    draft_tokens = torch.zeros(3, dtype=torch.int64)
    draft = Draft(draft_tokens, None if probs_shape is None else torch.full(probs_shape, 0.2))
    with pytest.raises(ValueError):
        verify(torch.zeros(target_shape), draft, SamplingParams(), torch.Generator())


# -- greedy ---------------------------------------------------------------------------


GREEDY = SamplingParams(temperature=0.0)
GREEDY_ARGMAX = [3, 1, 4, 2]


def greedy_logits() -> torch.Tensor:
    """[4, 8] logits whose rows' argmax are GREEDY_ARGMAX."""
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(14))
    logits[torch.arange(4), GREEDY_ARGMAX] = 10.0
    return logits


def verify_greedily(draft_tokens: list[int]) -> Verdict:
    logits = greedy_logits()[: len(draft_tokens) + 1]  # [k+1, 8]
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    verdict = verify(logits, Draft(torch.tensor(draft_tokens, dtype=torch.int64)), GREEDY, generator)
    assert torch.equal(generator.get_state(), state)  # greedy draws nothing
    return verdict


def test_greedy_all_accepted_adds_the_bonus_argmax():
    assert verify_greedily([3, 1, 4]) == Verdict(tokens=[3, 1, 4, 2], num_accepted=3)


@pytest.mark.parametrize(
    "draft_tokens, expected",
    [
        ([0, 1, 4], Verdict([3], 0)),
        ([3, 0, 4], Verdict([3, 1], 1)),
        ([3, 1, 5], Verdict([3, 1, 4], 2)),
    ],
)
def test_greedy_stops_at_the_first_mismatch_with_the_recovered_argmax(draft_tokens, expected):
    assert verify_greedily(draft_tokens) == expected


def test_greedy_with_nothing_drafted_is_the_argmax():
    assert verify_greedily([]) == Verdict(tokens=[3], num_accepted=0)


def test_greedy_ignores_draft_probs_and_emits_only_target_argmax():
    logits = greedy_logits()
    draft_probs = torch.full((3, 8), 1 / 8)
    verdict = verify(logits, Draft(torch.tensor([3, 1, 7]), draft_probs), GREEDY, torch.Generator())
    assert verdict == Verdict(tokens=[3, 1, 4], num_accepted=2)


def test_greedy_batch_matches_single_sequences():
    generator = torch.Generator().manual_seed(15)
    target_logits = torch.randn(64, 4, 5, generator=generator)  # [B, k+1, V]
    # Drafts that agree with the argmax for a random number of leading positions.
    draft_tokens = target_logits[:, :3].argmax(dim=-1)  # [B, 3]
    flip = torch.rand(64, 3, generator=generator) < 0.3
    draft_tokens = torch.where(flip, (draft_tokens + 1) % 5, draft_tokens)
    tokens, num_accepted = verify_batch(target_logits, draft_tokens, None, GREEDY, generator)
    for row in range(64):
        verdict = verify(target_logits[row], Draft(draft_tokens[row]), GREEDY, generator)
        assert verdict.num_accepted == num_accepted[row]
        assert tokens[row].tolist() == verdict.tokens + [PAD_TOKEN] * (3 - verdict.num_accepted)
        target_argmax = target_logits[row].argmax(dim=-1)  # [k+1]
        assert verdict.tokens == target_argmax[: verdict.num_accepted + 1].tolist()


def test_verdict_from_argmax_accepts_the_drafts_up_to_the_first_difference():
    assert verdict_from_argmax([5, 6, 7], [5, 6, 9, 1]) == Verdict(tokens=[5, 6, 9], num_accepted=2)
    assert verdict_from_argmax([5, 6, 7], [5, 6, 7, 1]) == Verdict(tokens=[5, 6, 7, 1], num_accepted=3)
    assert verdict_from_argmax([], [4]) == Verdict(tokens=[4], num_accepted=0)


def test_common_prefix_length_stops_at_the_shorter_sequence():
    assert common_prefix_length([1, 2, 3], [1, 2]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([1, 2, 3], [0, 2, 3]) == 0
    assert common_prefix_length([], [1]) == 0


# ----- parameters at the edge of float32 -----


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-4),
        SamplingParams(temperature=1.0, top_p=1e-300),
        SamplingParams(temperature=0.7, top_p=1e-40, top_k=3),
        SamplingParams(temperature=1e30),
    ],
)
def test_any_valid_parameters_give_finite_probabilities(params):
    logits = torch.randn(4, 50) * 30
    logits[1, 7] = logits[1, 8] = logits[1].max() + 5  # a tie at the top
    probs = logits_to_probs(logits, params)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(4))
    top = probs.gather(-1, logits.argmax(-1, keepdim=True))  # [4, 1]: the most likely token keeps its mass
    assert (top > 0).all() and (top == probs.amax(-1, keepdim=True)).all()


def test_temperatures_below_the_greedy_threshold_are_greedy():
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-3).greedy


@pytest.mark.parametrize("penalty", [1e-300, 1e300, 0.0])
def test_repetition_penalties_that_float32_cannot_hold_are_refused(penalty):
    with pytest.raises(InvalidSamplingValue, match="repetition_penalty"):
        SamplingParams(repetition_penalty=penalty)


def test_the_smallest_repetition_penalty_still_gives_finite_probabilities():
    params = SamplingParams(temperature=1.0, repetition_penalty=torch.finfo(torch.float32).tiny)
    logits = torch.randn(2, 40) * 10
    penalised = apply_penalties(logits, params, [1, 2, 3], [4, 5], [6])
    assert torch.isfinite(penalised).all()
    assert torch.isfinite(logits_to_probs(penalised, params)).all()


def test_sample_draws_each_id_as_often_as_its_probability():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.0, 0.05])  # [V], zeros between and at the end
    rows = (probs * 3).expand(4000, -1)  # [N, V]: unnormalised rows draw alike
    drawn = sample(rows, torch.Generator().manual_seed(0))  # [N]
    assert chi_square_p_value(drawn.unsqueeze(1), probs) > 1e-3


def test_sample_never_draws_an_id_without_mass_when_the_uniform_reaches_the_total(monkeypatch):
    # A uniform of exactly 1 (a bound some generators include) lands on the last id with mass.
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=kw["dtype"]))
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    assert sample(probs, torch.Generator()).tolist() == [1, 2]


def test_keyed_uniforms_are_uniform_and_independent_across_positions_and_seeds():
    """Over 400 consecutive seeds x 50 positions: each draw uniform (20 bins), and pairs
    of draws at neighbouring positions, and of neighbouring seeds, independent (10 x 10)."""
    seeds, positions = torch.arange(400), torch.arange(50)
    keys = torch.tensor([seed_key(int(seed)) for seed in seeds])
    draws = keyed_uniforms(keys[:, None].expand(-1, 50).reshape(-1), positions.repeat(400)).view(400, 50)
    assert draws.dtype == torch.float32 and 0 <= draws.min() and draws.max() < 1
    assert [keyed_uniform(int(keys[7]), p) for p in range(50)] == draws[7].tolist()  # the host's alike
    flat = (draws.flatten() * 20).long()[:, None]
    assert chi_square_p_value(flat, torch.full((20,), 1 / 20)) > 1e-3
    uniform_pairs = torch.full((10, 10), 1 / 100)
    for first, second in ((draws[:, :-1], draws[:, 1:]), (draws[:-1], draws[1:])):
        pairs = torch.stack([(first.flatten() * 10).long(), (second.flatten() * 10).long()], dim=1)
        assert chi_square_p_value(pairs, uniform_pairs) > 1e-3


def test_seed_key_takes_every_seed_the_params_take():
    assert seed_key(-1) == seed_key(2**64 - 1) and seed_key(0) != seed_key(2**32) != seed_key(1)
    assert all(0 <= seed_key(seed) < 2**32 for seed in (SEED_MIN, SEED_MAX, 0, 7))


def test_verify_keyed_keeps_the_drafts_equal_to_the_targets_own_draws():
    """Each row's own token is the target's draw with that row's uniform; the drafts up
    to the first that differs are kept, then that row's own token."""
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)) * 3  # [k+1, V]
    uniforms = torch.tensor([0.1, 0.5, 0.9, 0.3])
    own = sample(logits_to_probs(logits, params), uniforms=uniforms).tolist()
    for drafts, kept in ((own[:3], 3), (own[:1] + [(own[1] + 1) % 6, own[2]], 1), ([(own[0] + 1) % 6] * 3, 0)):
        verdict = verify_keyed(logits, Draft.of(drafts), params, uniforms)
        assert verdict.num_accepted == kept and verdict.tokens == own[: kept + 1]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_draws_on_device_come_from_the_softmax_at_each_rows_temperature(temperature):
    """The race a multi-step chain samples with: each id as often as logits_to_probs gives
    it at the row's temperature, an id at -inf never, rows at temperature 0 beside them."""
    logits = torch.tensor([2.0, -1.0, 0.5, float("-inf"), 1.5, -30.0])  # [V]
    rows = logits.expand(6000, -1)  # [N, V]
    temperatures = torch.tensor([temperature, 0.0]).repeat(3000)  # [N]: every other row greedy
    torch.manual_seed(0)
    drawn = draw_on_device(probs_on_device(rows, temperatures))  # [N]
    expected = logits_to_probs(logits[None], SamplingParams(temperature=temperature))[0]
    sampled = drawn[temperatures > 0]
    assert chi_square_p_value(sampled.unsqueeze(1), expected) > 1e-3
    assert not (drawn == 3).any()


@pytest.mark.parametrize(
    "fields",
    [
        dict(temperature=0.7, top_k=2),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=1.5, top_k=4, top_p=0.9),
        dict(temperature=0.8, top_k=6, top_p=0.999),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=1.3, min_p=0.1, top_k=5, top_p=0.9),
    ],
)
def test_probs_on_device_cut_as_logits_to_probs_does(fields):
    """Min-p, top-k then top-p on the device, row by row (a greedy row and an uncut one
    beside), keep and weigh the ids logits_to_probs does: a tie at the k-th logit stays.
    Cutting only the rows that cut (one repeated) gives the same."""
    logits = torch.tensor([2.0, -1.0, 0.5, 0.5, 1.5, -3.0, 0.5])  # [V]: ties at 0.5
    params = SamplingParams(**fields)
    n = 6000
    rows = logits.expand(n, -1)  # [N, V]
    kinds = torch.arange(n) % 3  # 0: this row's params, 1: greedy, 2: the temperature alone
    temperatures = torch.where(kinds == 1, 0.0, params.temperature)
    top_ks = torch.where(kinds == 0, params.top_k, 0)
    top_ps = torch.where(kinds == 0, params.top_p, 1.0)
    min_ps = torch.where(kinds == 0, params.min_p, 0.0)
    probs = probs_on_device(rows, temperatures, top_ks, top_ps, min_ps=min_ps)  # [N, V]
    cut_rows = torch.cat([torch.nonzero(kinds == 0)[:, 0], torch.tensor([3])])  # [N / 3 + 1]
    assert torch.equal(probs_on_device(rows, temperatures, top_ks, top_ps, cut_rows, min_ps), probs)
    torch.manual_seed(0)
    drawn = draw_on_device(probs)  # [N]
    expected = logits_to_probs(logits[None], params)[0]
    uncut = logits_to_probs(logits[None], SamplingParams(temperature=params.temperature))[0]
    torch.testing.assert_close(probs[0], expected)  # what a proposer's chain hands to rejection sampling
    torch.testing.assert_close(probs[2], uncut)
    assert chi_square_p_value(drawn[kinds == 0].unsqueeze(1), expected) > 1e-3
    assert chi_square_p_value(drawn[kinds == 2].unsqueeze(1), uncut) > 1e-3


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_keeps_the_ids_at_least_min_p_times_as_likely_as_the_likeliest(min_p):
    logits = torch.tensor([[2.0, 1.0, -0.5, 2.0, 0.3, -4.0]])
    params = SamplingParams(temperature=0.8, min_p=min_p)
    uncut = logits_to_probs(logits, SamplingParams(temperature=0.8))[0]
    kept = uncut >= min_p * uncut.max()
    probs = logits_to_probs(logits, params)[0]
    assert torch.equal(probs > 0, kept)  # 1.0 keeps the two tied likeliest
    torch.testing.assert_close(probs, torch.where(kept, uncut, 0.0) / uncut[kept].sum())


@pytest.mark.parametrize("row", [[0.0, 0.0, 0.0], [0.5, float("nan"), 0.5]])
def test_sample_refuses_a_row_without_mass(row):
    with pytest.raises(ValueError, match="no mass"):
        sample(torch.tensor([row]), torch.Generator())


@pytest.mark.parametrize("scale", [30.0, 3.0, 0.1])  # the nucleus: a few ids, hundreds, most of them
@pytest.mark.parametrize("top_p", [0.3, 0.9])
def test_top_p_keeps_the_likeliest_ids_that_cover_it(scale, top_p):
    probs = (torch.randn(3, 5000, generator=torch.Generator().manual_seed(0)) * scale).softmax(-1)  # [n, V]
    kept = top_p_kept(probs, top_p)
    least_kept = probs.where(kept, torch.inf).amin(-1)
    assert (least_kept >= probs.where(~kept, -torch.inf).amax(-1)).all()
    mass = (probs * kept).sum(-1)
    assert (mass >= top_p - 1e-5).all() and (mass - least_kept < top_p + 1e-5).all()


def sorted_top_p_kept(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """top_p_kept's definition, by a sort of every id: the reference."""
    values, ids = probs.sort(dim=-1, descending=True, stable=True)
    kept = values.cumsum(dim=-1) - values < top_p
    kept[:, 0] = True
    return torch.zeros_like(kept).scatter_(-1, ids, kept)


@pytest.mark.parametrize("top_p", [0.25, 0.5, 0.9, 0.95, 0.999])
def test_top_p_keeps_what_a_sort_of_every_id_keeps(top_p):
    """Peaked rows (the candidates) and flat ones (buckets of probability, ties within and
    across them) keep what the sorted definition keeps. Probabilities in multiples of
    2^-20 make every sum exact, so no rounding tells the two apart."""
    g = torch.Generator().manual_seed(1)
    vocab = 5000
    rows = []
    for scale in (30.0, 3.0, 1.0, 0.1, 0.0):  # from a few ids to all of them, equal
        weights = (torch.randn(vocab, generator=g) * scale).softmax(-1)
        counts = (weights * 2**20).floor()
        counts[int(counts.argmax())] += 2**20 - counts.sum()  # the row sums to 1 exactly
        rows.append(counts / 2**20)
    probs = torch.stack(rows)  # [5, V]
    assert torch.equal(top_p_kept(probs, top_p), sorted_top_p_kept(probs, top_p))


def test_a_large_top_k_finds_the_kth_largest_logit_as_topk_does():
    """Past TOP_K_DIRECT the k-th largest is found by buckets of the logits' bits: the
    same value as topk's, ties (bfloat16 logits) and -inf (min-p's cut) among them."""
    g = torch.Generator().manual_seed(2)
    for scale in (0.1, 2.0, 30.0):
        logits = (torch.randn(3, 20000, generator=g) * scale).to(torch.bfloat16).float()
        logits = logits - logits.amax(dim=-1, keepdim=True)  # [n, V], the likeliest at 0
        logits[0, :3000] = float("-inf")
        for k in (TOP_K_DIRECT + 1, 5000, 17500, 19999):
            assert torch.equal(kth_largest(logits, k), logits.topk(k, dim=-1).values[:, -1:]), (scale, k)


@pytest.mark.parametrize("vocab", [3, 5000])  # a sort of every id; the candidates
def test_top_p_breaks_ties_towards_the_lower_id(vocab):
    probs = torch.zeros(1, vocab)
    probs[0, :3] = torch.tensor([0.3, 0.3, 0.4])
    assert top_p_kept(probs, 0.5)[0, :3].tolist() == [True, False, True]
