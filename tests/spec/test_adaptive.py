"""Adaptive speculation: the cost fit, the choice of k, probing, and lossless output."""

from __future__ import annotations

import pytest
import torch

from specserve.config import SpecConfig
from specserve.engine.engine import Engine
from specserve.errors import ConfigError
from specserve.model.decoder import Decoder
from specserve.sampling import SamplingParams
from specserve.spec import adaptive as adaptive_module
from specserve.spec.adaptive import Acceptance, AdaptiveSpecLength, ForwardCosts, LinearFit
from specserve.spec.draft_model import DraftModelProposer
from specserve.spec.ngram import NgramProposer
from tests.conftest import tiny_config


def controller(fixed=1.0, per_row=0.02, draft_fixed=0.1, per_position=0.3, max_k=15) -> AdaptiveSpecLength:
    """A controller whose measured costs are exactly the given lines (seconds): every
    row count a sequence's step can verify measured, and two a batch's can."""
    ctl = AdaptiveSpecLength(max_k, prior_draft_cost_ratio=0.5)
    for _ in range(400):  # enough to wash the priors out
        for rows in (*range(1, max_k + 2), 64, 128):
            ctl.observe_target(rows, fixed + per_row * rows)
        for positions in (1, 3, 8):
            ctl.observe_draft(positions, draft_fixed + per_position * positions)
    return ctl


def test_linear_fit_finds_the_line_and_forgets_the_prior():
    fit = LinearFit(((1, 100.0), (2, 100.0)))
    for _ in range(300):
        for x in (1, 5, 9):
            fit.add(x, 2.0 + 0.5 * x)
    intercept, slope = fit.coefficients()
    assert intercept == pytest.approx(2.0, abs=1e-3) and slope == pytest.approx(0.5, abs=1e-3)
    # One x only: no slope can be told, the mean stays the answer.
    flat = LinearFit(((3, 1.0), (3, 1.0)))
    assert flat.coefficients() == (1.0, 0.0)


def test_a_step_no_k_was_chosen_for_is_not_counted():
    """The engine records every sequence's step, the prefill that gives a new sequence
    its first token included. That step is not counted: counted, it would leave the
    sequence not fresh at its first choice, and it would not probe at once."""
    ctl = controller(per_position=0.9)  # drafting does not pay at the prior
    ctl.record(5, 0, 0)  # its prefill step
    assert 5 not in ctl.sequences
    assert ctl.choose([5]) == [adaptive_module.PROBE_TOKENS]


def test_the_first_measured_step_sets_the_unit_by_the_prior_line_not_per_row():
    """A new engine's first step is often a probe verifying 3 rows. Its seconds over 3
    taken as a one-row forward's would make the prior a third too cheap, and verified
    rows nearly free, for the first dozens of steps (drafting that loses)."""
    ctl = AdaptiveSpecLength(15, prior_draft_cost_ratio=0.5)
    ctl.observe_target(3, 0.110)  # the prior line says 3 rows cost 1.1 one-row forwards
    assert ctl.plain_step(1) == pytest.approx(0.100, rel=0.02)
    assert ctl.draft_costs()[1] == pytest.approx(0.050, rel=0.02)  # half a one-row forward


def tiled_forward(rows: int) -> float:
    """Seconds of a target forward on our CPU kernels, which multiply up to 8 rows by
    each weight row they read: 9-16 rows take a second pass of arithmetic (22 ms
    plain, 36 ms for 8 rows, 52 for 9)."""
    return 0.020 + 0.002 * rows + 0.014 * ((rows + 7) // 8 - 1)


def drafts_seven_at(rate: float) -> bool:
    """Under tiled_forward and a draft of 1 + 6 ms a position, 7 is the best k."""

    def speedup(k: int) -> float:
        return (1 - rate ** (k + 1)) / (1 - rate) * tiled_forward(1) / (tiled_forward(k + 1) + 0.001 + 0.006 * k)

    return max(range(1, 16), key=speedup) == 7


def test_verification_is_priced_as_each_row_count_measured():
    """A line through the forwards prices k = 15 too cheap and k = 7 too dear; priced
    as each row count measured, a sequence that earns 0.98 a position drafts 7."""
    assert drafts_seven_at(0.98)
    ctl = AdaptiveSpecLength(15, prior_draft_cost_ratio=0.27)
    for _ in range(300):
        for rows in range(1, 17):
            ctl.observe_target(rows, tiled_forward(rows))
        for positions in (3, 7, 15):
            ctl.observe_draft(positions, 0.001 + 0.006 * positions)
    for rows in (1, 8, 9, 16):
        assert ctl.target_seconds(rows) == pytest.approx(tiled_forward(rows), rel=1e-6)
    assert ctl.best_k(steady(0.98), batch=1) == 7


def test_a_lookup_is_verified_as_far_as_its_rows_pay():
    """A lookup drafts for free, and only its verified rows cost. Alone, 7 rows cost
    under a step: a lookup right three tokens deep is verified about three deep (the rows
    past them earn little), one never measured in full. Among 8 sequences the 9th row starts
    a second pass of arithmetic (tiled_forward): only a lookup that is always right pays
    for it, and once it has, the next lookup's first row is cheap again (rows 9-16
    share the pass)."""
    ctl = AdaptiveSpecLength(15, prior_draft_cost_ratio=0.27)
    for _ in range(50):
        for rows in range(1, 25):
            ctl.observe_target(rows, tiled_forward(rows))
    for _ in range(30):
        ctl.record_lookup(1, 7, 7)  # always right
        ctl.record_lookup(2, 7, 3)  # right three tokens deep
    assert ctl.lookup_ks([1], [7], batch=1) == [7]
    assert ctl.lookup_ks([3], [7], batch=1) == [7]
    # Three deep: a fourth position, never reached, leans on the third's rate only by the
    # prior's fading weight (Acceptance), too little for what its row costs.
    assert ctl.lookup_ks([2], [7], batch=1) == [3]
    assert ctl.lookup_ks([2], [7], batch=8) == [0]
    assert ctl.lookup_ks([1, 2], [7, 7], batch=8) == [7, 1]
    assert ctl.lookup_ks([1], [4], batch=8) == [0]  # 4 rows do not pay for the second pass
    ctl.free(1)
    assert 1 not in ctl.lookups


def test_a_plain_step_never_measured_is_measured_once():
    """A sequence that drafts from its first step never runs a one-row forward, so its
    plain step would be priced from the deeper ones by the prior's slope (on our CPU
    kernels ~15% dear, which makes a weak draft look worth its rows). After
    PLAIN_MEASURED_AFTER target steps, one step decodes plainly, lookups included."""
    ctl = AdaptiveSpecLength(7, prior_draft_cost_ratio=0.04)
    for step in range(adaptive_module.PLAIN_MEASURED_AFTER):
        assert not ctl.measuring_plain(1)
        ctl.choose([1])
        ctl.observe_target(2, tiled_forward(2))  # every step drafted one token
        ctl.record(1, 1, 1)
    assert ctl.choose([1]) == [0] and ctl.lookup_ks([1], [5], batch=1) == [0]
    ctl.observe_target(1, tiled_forward(1))
    ctl.record(1, 0, 0)
    assert ctl.plain_step(1) == pytest.approx(tiled_forward(1))
    assert not ctl.measuring_plain(1) and not ctl.measuring_plain(2)  # both counts measured
    assert ctl.choose([1]) != [0]  # every guess was right: drafting goes on


def test_a_row_count_never_measured_is_priced_low_until_it_is():
    """What a new engine sees on a predictable prompt: a probe (4 rows), a longer draft
    (7 rows), then 16 rows. Priced on the chord from 7 to 16 rows, 8 rows would look
    dear, k = 7 would never be tried, and the policy would draft 15 a step where 7 is
    faster (benchmarks/EXPERIMENTS.md, "ForwardCosts: each row count priced as
    measured"). Priced below the chord, the counts it might gain by are tried, then
    priced as measured, and the policy settles on 7 within a few steps."""
    ctl = AdaptiveSpecLength(15, prior_draft_cost_ratio=0.27)
    for rows in (1, 4, 7, 16):
        ctl.observe_target(rows, tiled_forward(rows))
    for positions in (3, 6, 15):
        ctl.observe_draft(positions, 0.001 + 0.006 * positions)
    chord = tiled_forward(7) + (tiled_forward(16) - tiled_forward(7)) / 9
    assert tiled_forward(7) < ctl.target_seconds(8) <= tiled_forward(8) < chord
    tried = []
    for _ in range(12):  # choose, then measure what was chosen
        k = ctl.best_k(steady(0.98), batch=1)
        tried.append(k)
        ctl.observe_target(k + 1, tiled_forward(k + 1))
    assert tried[-4:] == [7] * 4 and len(set(tried)) <= 3, tried
    # Past the largest count measured (a batch's rows): the slope of the two largest.
    below, largest = sorted(ctl.target.shape)[-2:]
    slope = (tiled_forward(largest) - tiled_forward(below)) / (largest - below)
    assert ctl.target_seconds(largest + 8) == pytest.approx(tiled_forward(largest) + 8 * slope)


def test_a_change_in_the_machines_speed_reprices_every_row_count():
    """Plain steps alone measured while the machine runs at half speed: a verification
    of 8 rows, not measured meanwhile, is priced at half speed too."""
    ctl = AdaptiveSpecLength(15, prior_draft_cost_ratio=0.27)
    for _ in range(20):
        for rows in (1, 8):
            ctl.observe_target(rows, tiled_forward(rows))
    for _ in range(30):
        ctl.observe_target(1, 2 * tiled_forward(1))
    # Each count's own cost takes a little of the change (a few %) while the pace moves.
    assert ctl.target_seconds(8) == pytest.approx(2 * tiled_forward(8), rel=0.06)
    assert ctl.plain_step(1) == pytest.approx(2 * tiled_forward(1), rel=0.01)


def test_a_slow_phase_in_the_drafts_fit_fades_with_the_targets():
    """The machine slows to a third for a while, the draft timed meanwhile; then it is
    fast again, and the policy drafts nothing, so only the target is timed. Fitted in
    seconds, the draft would stay 3x dear for good and drafting would never resume; as
    a share of the target's step, it is cheap again as soon as the target is fast."""
    fixed, per_row, draft_fixed, per_position = 0.026, 0.0074, 0.0026, 0.0129  # the int4 pair
    ctl = controller(fixed, per_row, draft_fixed, per_position)
    three_positions = draft_fixed + 3 * per_position

    def predicted_three_positions() -> float:
        fixed_part, per_position_part = ctl.draft_costs()
        return fixed_part + 3 * per_position_part

    assert ctl.best_k(steady(0.8), batch=1) > 0
    for _ in range(100):  # slow: both models take 3x
        ctl.observe_draft(3, 3 * three_positions)
        ctl.observe_target(1, 3 * (fixed + per_row))
    assert predicted_three_positions() == pytest.approx(3 * three_positions, rel=0.25)
    for _ in range(100):  # fast again; plain steps only
        ctl.observe_target(1, fixed + per_row)
    assert predicted_three_positions() == pytest.approx(three_positions, rel=0.25)  # the unit lags a little
    assert ctl.best_k(steady(0.8), batch=1) > 0


def steady(rate: float, max_k: int = 15) -> Acceptance:
    """A sequence known to earn each position with `rate` given the one before."""
    known = Acceptance(max_k, prior_rate=rate, prior_weight=1e12)
    known.fresh = False  # known from its steps, at every depth
    known.asked[:] = known.drafted[:] = [1e12] * max_k
    return known


def test_a_steady_rate_gives_leviathans_formula():
    tokens, drafted = steady(0.5, max_k=5).curves()
    assert tokens == pytest.approx([(1 - 0.5 ** (k + 1)) / 0.5 for k in range(6)])
    assert drafted == [0, 1, 2, 3, 4, 5]
    assert steady(0.0, 5).curves()[0] == [1] * 6 and steady(1.0, 5).curves()[0] == [1, 2, 3, 4, 5, 6]


def test_k_grows_with_acceptance_and_falls_with_batch_size():
    ctl = controller()
    ks = [ctl.best_k(steady(rate), batch=1) for rate in (0.2, 0.6, 0.8, 0.95, 0.99)]
    assert ks[0] == 0  # speculation would lose: decode plainly
    assert ks == sorted(ks) and ks[-1] > 7  # very predictable text drafts beyond 7
    # Under load each verified row costs as much as the shared weight read saved.
    assert ctl.best_k(steady(0.8), batch=64) < ctl.best_k(steady(0.8), batch=1)
    # A free proposer (n-gram) with free verification drafts as long as it may.
    assert controller(per_row=0.0, draft_fixed=0.0, per_position=0.0).best_k(steady(0.9), 1) == 15


def test_k_walks_up_from_the_depths_a_sequence_has_tried():
    """A streak of full acceptance makes every deeper position look sure; k goes at most
    K_GROWTH past the deepest position asked for, and on from there as it is tried."""
    ctl = controller(per_row=0.0, draft_fixed=0.0, per_position=0.0)  # free: the estimate alone says 15
    seq = Acceptance(15)
    for asked in (3, 3 + adaptive_module.K_GROWTH):
        seq.chosen = asked
        seq.record(asked, asked)
        assert ctl.best_k(seq, 1) == asked + adaptive_module.K_GROWTH
    for _ in range(40):  # not asked that deep for long: it is forgotten
        seq.chosen = 2
        seq.record(2, 2)
    assert ctl.best_k(seq, 1) == 2 + adaptive_module.K_GROWTH


def test_the_chosen_k_maximises_the_predicted_speedup():
    ctl = controller()
    for rate in (0.5, 0.7, 0.9):
        k = ctl.best_k(steady(rate), 1)
        tokens, drafted = steady(rate).curves()
        speedups = [ctl.speedup(e, d, 1) for e, d in zip(tokens, drafted)]
        assert speedups[k] == max(speedups)


def test_a_sequence_does_not_draft_alone_where_the_batch_would_wait_for_it():
    """The draft's steps hold up the whole batch: a lone predictable sequence among
    seven that are not drafts on its own, but not in their company."""
    ctl = controller()
    assert ctl.batch_ks([steady(0.95)])[0] > 0
    assert ctl.batch_ks([steady(0.2)] * 7 + [steady(0.95)]) == [0] * 8
    together = ctl.batch_ks([steady(0.95)] * 8)
    assert len(set(together)) == 1 and together[0] > 0


def test_where_drafting_pays_the_batch_the_predictable_sequences_draft_most():
    ctl = controller(per_row=0.01, draft_fixed=0.01, per_position=0.02)
    ks = ctl.batch_ks([steady(0.95)] * 4 + [steady(0.1)] * 4)
    assert min(ks[:4]) > max(ks[4:])
    # That choice beats every batch drafting one k alike.
    curves = [a.curves() for a in [steady(0.95)] * 4 + [steady(0.1)] * 4]
    draft_fixed, per_position = ctl.draft_costs()

    def tokens_per_second(ks: list[int]) -> float:
        tokens = sum(E[k] for (E, _), k in zip(curves, ks))
        drafted = [D[k] for (_, D), k in zip(curves, ks)]
        return tokens / (
            ctl.target_seconds(8 + sum(drafted)) + draft_fixed * (max(drafted) > 0) + per_position * max(drafted)
        )

    assert all(tokens_per_second(ks) > tokens_per_second([k] * 8) for k in range(16))


def test_the_curves_predict_what_a_confident_draft_earns():
    """A draft that is unsure of its first guess on 2 steps in 5 (stops there, and the
    guess is rejected) and otherwise drafts 10 that are all accepted: one acceptance
    rate for every position would say 0.94 and expect 1 + 0.94 + ... tokens; the
    curves expect what happened, about 7 tokens a step from about 6.4 drafted."""
    acceptance = Acceptance(15, prior_weight=0.01)
    for _ in range(40):
        for drafted, accepted in ((1, 0), (10, 10), (10, 10), (1, 0), (10, 10)):
            acceptance.chosen = 15
            acceptance.record(drafted, accepted)
    tokens, drafted = acceptance.curves()
    assert tokens[15] == pytest.approx(7.0, rel=0.1) and drafted[15] == pytest.approx(6.4, rel=0.1)
    assert tokens[1] == pytest.approx(1.6, rel=0.1)  # the first position alone: 3 in 5


def test_a_sequence_that_stops_paying_decodes_plainly_and_probes_less_often():
    ctl = controller()
    assert ctl.choose([7]) == [ctl.best_k(Acceptance(15), 1)] and ctl.choose([7])[0] > 0  # the prior
    for _ in range(10):  # every draft rejected at once
        ctl.record(7, num_drafted=4, num_accepted=0)
    probes = []
    for step in range(600):
        (k,) = ctl.choose([7])
        if k:
            probes.append(step)
            ctl.record(7, k, 0)  # the probe fails too
        else:
            ctl.record(7, 0, 0)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    # The 10 drafting steps before were a short run: the first wait is already doubled.
    assert probes and probes[0] == 2 * adaptive_module.PROBE_INTERVAL
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # backing off
    assert max(gaps) <= adaptive_module.MAX_PROBE_INTERVAL + 1


def test_a_run_of_drafting_goes_on_at_a_lower_bar_than_one_starts():
    """Near break-even a noisy estimate would flap: a sequence already drafting goes on
    while the best k is predicted at CONTINUE_SPEEDUP, one decoding plainly starts
    only at MIN_SPEEDUP."""
    ctl = controller()

    def drafting_speed(rate: float) -> float:  # the best predicted speedup of any k > 0
        tokens, drafted = steady(rate).curves()
        return max(ctl.speedup(tokens[k], drafted[k], 1) for k in range(1, 16))

    near_even = next(rate for rate in (i / 200 for i in range(200)) if drafting_speed(rate) >= 1.0)
    assert adaptive_module.CONTINUE_SPEEDUP <= drafting_speed(near_even) < adaptive_module.MIN_SPEEDUP
    drafting, plain = steady(near_even), steady(near_even)
    drafting.drafting_steps = 5  # in a run of drafting
    plain.plain_steps = 1  # decoding plainly, not due a probe
    ctl.sequences.update({1: drafting, 2: plain})
    assert ctl.choose([1])[0] > 0
    assert ctl.choose([2]) == [0]
    # A batch goes on only when every one of its sequences is drafting.
    assert ctl.choose([1, 2]) == [0, 0]


def test_a_probe_that_pays_brings_drafting_back():
    ctl = controller()
    ctl.sequences[3] = Acceptance(ctl.max_k)  # a sequence k is chosen for
    for _ in range(10):
        ctl.record(3, 4, 0)
    for _ in range(2 * adaptive_module.PROBE_INTERVAL):  # after a short run of drafting
        assert ctl.choose([3]) == [0]
        ctl.record(3, 0, 0)
    for _ in range(6):  # probes, then longer drafts, all accepted
        (k,) = ctl.choose([3])
        assert k > 0
        ctl.record(3, k, k)
    assert ctl.choose([3])[0] > adaptive_module.PROBE_TOKENS


def test_under_load_fully_accepted_probes_back_off_too():
    """Under a batch of 8, where every verified row is dear, drafts accepted at 50% do
    not pay. A fully accepted probe makes the sequence draft again for a few steps;
    each such short run doubles the wait for the next probe, so probes get rare."""
    ctl = controller(per_row=0.3)
    batch = list(range(8))
    probes = []
    for step in range(1000):
        ks = ctl.choose(batch)
        for seq_id, k in zip(batch, ks):
            probing = ctl.sequences[seq_id].probing
            ctl.record(seq_id, k, k if probing else k // 2)
        if ks[0] and ctl.sequences[0].drafting_steps == 1:  # a run of drafting starts
            probes.append(step)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) > 2 and gaps == sorted(gaps) and gaps[-1] > adaptive_module.MAX_PROBE_INTERVAL


def test_in_a_batch_of_b_each_sequence_probes_b_times_less_often():
    ctl = controller(per_row=0.3)
    for seq_id in range(4):
        ctl.sequences[seq_id] = steady(0.2)  # drafting never pays
    first_probe = {}
    for step in range(200):
        for seq_id, k in enumerate(ctl.choose(list(range(4)))):
            first_probe.setdefault(seq_id, step) if k else None
            ctl.record(seq_id, k, 0)
    assert first_probe == {seq_id: 4 * adaptive_module.PROBE_INTERVAL for seq_id in range(4)}


def test_config_keys():
    spec = SpecConfig.parse({"model": "m", "num_speculative_tokens": 7})
    assert spec.adaptive and spec.max_speculative_tokens == spec.max_lookup_tokens == 15
    wide = SpecConfig.parse({"model": "m", "num_speculative_tokens": 20})
    assert wide.max_speculative_tokens == wide.max_lookup_tokens == 20
    # Medusa's heads bound its k where max_speculative_tokens is unstated, not its lookups'.
    assert SpecConfig.parse({"method": "medusa", "model": "h"}).max_lookup_tokens == 15
    assert SpecConfig.parse({"method": "medusa", "model": "h", "max_speculative_tokens": 2}).max_lookup_tokens == 2
    fixed = SpecConfig.parse({"model": "m", "num_speculative_tokens": 7, "adaptive": False})
    assert not fixed.adaptive and fixed.describe_k() == "k=7, looking up the last 4 tokens first"
    assert fixed.max_lookup_tokens is None  # k bounds every draft
    no_lookup = SpecConfig.parse({"model": "m", "num_speculative_tokens": 7, "prompt_lookup_first": None})
    assert no_lookup.describe_k() == "adaptive k in 0..15"
    for bad, message in (
        ({"adaptive": "yes"}, "adaptive must be true or false"),
        ({"max_speculative_tokens": 3}, ">= num_speculative_tokens"),
        ({"adaptive": False, "max_speculative_tokens": 9}, "applies to"),
    ):
        with pytest.raises(ConfigError, match=message):
            SpecConfig.parse({"model": "m", "num_speculative_tokens": 7, **bad})


class FreeCosts(AdaptiveSpecLength):
    """Ignores real timings: drafting and verifying are free, so k follows acceptance alone."""

    def __init__(self, max_k, prior_draft_cost_ratio):
        super().__init__(max_k, 0.0)
        self.target = ForwardCosts(prior_row_share=0.0)

    def observe_target(self, rows, seconds):
        super().observe_target(rows, 1.0)

    def observe_draft(self, positions, seconds):
        super().observe_draft(positions, 0.0)

    def observe_read(self, tokens, positions, seconds):
        super().observe_read(tokens, positions, 0.0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_adaptive_engine_keeps_the_target_output(arch, temperature):
    torch.manual_seed(3)
    config = tiny_config(arch)
    target, draft = Decoder(config).eval(), Decoder(config).eval()
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    params = SamplingParams(max_tokens=40, temperature=temperature, ignore_eos=True)
    plain = Engine(target, eos_token_ids=[0]).generate(prompt, params).output_ids
    for proposer in (NgramProposer(1, 3), DraftModelProposer(draft)):
        engine = Engine(target, eos_token_ids=[0], proposer=proposer, adaptive=FreeCosts(15, 0.5))
        seq = engine.generate(prompt, params)
        if temperature == 0:
            assert seq.output_ids == plain
        else:
            assert len(seq.output_ids) == 40
        assert seq.spec.num_drafts > 0
        assert not engine.adaptive.sequences  # freed with the sequence


def test_seeded_sampling_adapts_its_k_and_keeps_plain_samplings_tokens():
    """A seeded request's k is adaptive's choice (here past the fixed k, since drafting is
    free), and its tokens are plain sampling's with that seed, run after run."""
    torch.manual_seed(4)
    config = tiny_config("llama")
    target = Decoder(config).eval()
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    runs = []
    for _ in range(2):
        engine = Engine(
            target,
            eos_token_ids=[0],
            proposer=NgramProposer(1, 3),
            num_speculative_tokens=2,
            adaptive=FreeCosts(15, 0.5),
        )
        seq = engine.generate(prompt, params)
        assert len(seq.spec.accepted_per_position) > 2  # past the fixed k
        runs.append(seq.output_ids)
    assert runs[0] == runs[1] == Engine(target, eos_token_ids=[0]).generate(prompt, params).output_ids


def test_a_fully_accepted_probe_drafts_even_where_the_prior_would_not():
    ctl = controller(per_position=0.7)  # a draft so dear that acceptance 0.8 does not pay
    assert ctl.best_k(steady(0.8), 1) == 0 and ctl.best_k(steady(0.95), 1) > adaptive_module.PROBE_TOKENS
    (k,) = ctl.choose([1])  # a new sequence probes at once
    assert k == adaptive_module.PROBE_TOKENS
    ctl.record(1, k, k)
    assert ctl.choose([1])[0] > adaptive_module.PROBE_TOKENS


def test_a_proposer_that_stops_early_is_costed_by_what_it_drafts():
    """A sequence whose draft stops after two positions is priced at about two, not at k."""
    ctl = AdaptiveSpecLength(max_k=15, prior_draft_cost_ratio=0.3)
    for _ in range(20):  # asks for k, the proposer drafts 2 and both are accepted
        ctl.choose([1])
        ctl.record(1, 2, 2)
    state = ctl.sequences[1]
    assert state.chosen > 2
    # What the curves predict for k=15 is what happened: about 2 drafted, 3 emitted
    # (ignoring stops they would expect 16 tokens from 15 paid positions).
    tokens, drafted = state.curves()
    assert drafted[15] == pytest.approx(2.0, abs=0.2) and tokens[15] == pytest.approx(3.0, abs=0.2)


def test_drafting_costs_are_measured_on_steps_that_only_draft():
    """The first draft of a request reads the whole prompt, and one after plain steps
    reads every token decoded since: those calls teach the reading fit, not the
    drafting one."""
    torch.manual_seed(3)
    config = tiny_config("llama")
    target, draft = Decoder(config).eval(), Decoder(config).eval()
    measured, catch_ups, reads = [], [], []

    class Watched(FreeCosts):
        def observe_draft(self, positions, seconds):
            measured.append(engine.proposer.last_catch_up)
            super().observe_draft(positions, seconds)

        def observe_read(self, tokens, positions, seconds):
            reads.append(tokens)
            super().observe_read(tokens, positions, seconds)

    class Proposer(DraftModelProposer):
        def propose(self, seqs, num_tokens, least_chances=None):
            drafts = super().propose(seqs, num_tokens, least_chances)
            catch_ups.append(self.last_catch_up)
            return drafts

    engine = Engine(target, eos_token_ids=[0], proposer=Proposer(draft), adaptive=Watched(15, 0.5))
    # Greedy, so the run repeats: an unseeded sampled request may fall to a plain step,
    # whose catch-up afterwards is rightly a read.
    engine.generate([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert catch_ups[0] == 11 and max(catch_ups[1:]) <= 2  # the prompt and first token, then 1-2
    assert len(measured) == len(catch_ups) - 1 and max(measured) <= 2
    assert reads == [11]


def test_reading_a_prompt_into_the_draft_is_charged_to_drafting():
    """A sequence whose draft has not read its 300-token prompt drafts only if it has
    enough tokens left to earn that back."""
    ctl = controller()
    for _ in range(100):
        ctl.observe_read(300, 0, 10.0)  # a tenth of a plain step a token
    assert ctl.read_cost(2, 10) == 0.0  # the usual catch-up after a draft is drafting's
    assert ctl.read_cost(300, 100) == pytest.approx(10.0 / 100, rel=0.05)
    ctl.sequences[1] = steady(0.95)
    assert ctl.choose([1], backlogs=[2], remaining=[20])[0] > 0
    assert ctl.choose([1], backlogs=[300], remaining=[20]) == [0]
    assert ctl.choose([1], backlogs=[300], remaining=[5000])[0] > 0
    # Prompts still being prefilled are about to join the batch: counted, they make
    # drafting alone not pay.
    assert ctl.choose([1], backlogs=[2], remaining=[5000], others=7) == [0]


def test_a_probe_whose_reading_costs_more_than_drafting_could_gain_is_skipped():
    ctl = controller(per_row=0.3)
    for _ in range(100):
        ctl.observe_read(100, 0, 10.0)  # reading costs ~8 plain steps

    def probes(seq_id: int, remaining: int) -> list[int]:
        ctl.sequences[seq_id] = steady(0.2)  # drafting does not pay: only probes draft
        ks = []
        for _ in range(40):
            ks += ctl.choose([seq_id], backlogs=[20], remaining=[remaining])
            ctl.record(seq_id, ks[-1], 0)
        return ks

    assert any(probes(1, remaining=10**6)) and not any(probes(2, remaining=20))


def test_a_backlog_a_chain_left_must_pay_within_a_chain():
    """After a multi-step chain, drafting reads the chain's tokens first, and reads them
    again after every chain that follows a failed draft: spread over a chain's tokens
    (spreads), that read stops a draft that would pay it back over the whole answer. A
    probe's read is still spread over the answer, so probes go on."""
    ctl = controller(per_position=0.1)  # a head's cheap positions
    for _ in range(100):
        ctl.observe_read(8, 0, 0.5)  # 8 tokens read: half a plain step
    ctl.sequences[1] = steady(0.3)
    assert ctl.choose([1], backlogs=[8], remaining=[200], spreads=[8]) == [0]
    assert ctl.choose([1], backlogs=[8], remaining=[200])[0] > 0
    assert ctl.choose([1], backlogs=[8], remaining=[200], spreads=[200])[0] > 0

    ctl.sequences[2] = steady(0.3)
    ctl.sequences[2].probe_interval = 2
    ks = []
    for _ in range(8):
        ks += ctl.choose([2], backlogs=[8], remaining=[10**6], spreads=[8])
        ctl.record(2, ks[-1], 0)
    assert adaptive_module.PROBE_TOKENS in ks


def int4_pair_costs(per_position: float = 0.0184) -> AdaptiveSpecLength:
    """Costs measured on the int4 pair (seconds): drafting near break-even at the prior."""
    ctl = controller(fixed=0.037, per_row=0.0086, draft_fixed=0.0028, per_position=per_position)
    for _ in range(100):
        ctl.observe_read(64, 0, 64 * 0.0032)  # 3.2 ms a token read into the draft
    return ctl


def test_probes_go_on_while_the_backlog_of_plain_steps_grows():
    """A sequence that stopped drafting reads every token decoded since at its next
    probe, so the backlog only grows. Probes are valued by what drafting would gain
    after a fully accepted probe, not by the least gain worth drafting for: valued so,
    under the int4 pair's costs every probe would be skipped after ~25 plain tokens,
    and the sequence would never draft again."""
    ctl = int4_pair_costs()
    # Drafting does not pay: only probes draft, each fully accepted with chance 0.6^3.
    ctl.sequences[1] = steady(0.6)
    probed_at, backlog = [], 1
    for step in range(200):
        (k,) = ctl.choose([1], backlogs=[backlog], remaining=[200 - step])
        if k:
            probed_at.append(backlog)
            backlog = 1  # the probe read it
        ctl.record(1, k, 0)
        backlog += 1
    assert len(probed_at) >= 3 and max(probed_at) >= 60, probed_at


@pytest.mark.parametrize("seed", range(3))
def test_a_plain_choice_kept_until_news_is_the_choice_priced_anew(seed):
    """A batch that chose plain decoding keeps that choice, unpriced, until a
    measurement or a drafting step changes what it weighed: over random steps
    (drafting, plain, probes, backlogs growing, sequences leaving, costs measured) the
    ks are those of a controller that prices every step."""
    import random

    class PricedEveryStep(AdaptiveSpecLength):
        def _batch_ks(self, seq_ids, states, read_costs, others, floor):
            return self.batch_ks(states, read_costs, others, floor)

    rng = random.Random(seed)
    remembering, priced = int4_pair_costs(), int4_pair_costs()
    priced.__class__ = PricedEveryStep
    pricings = [0, 0]
    for i, ctl in enumerate((remembering, priced)):
        batch_ks = ctl.batch_ks
        ctl.batch_ks = lambda *a, _i=i, _f=batch_ks, **k: pricings.__setitem__(_i, pricings[_i] + 1) or _f(*a, **k)
    running, next_id, backlogs = [], 0, {}
    for step in range(600):
        while len(running) < rng.choice((1, 2, 4)):
            running.append(next_id)
            backlogs[next_id] = 1
            next_id += 1
        others = rng.choice((0, 0, 0, 1))
        remaining = [600 - step] * len(running)
        chosen = [
            ctl.choose(list(running), [backlogs[i] for i in running], remaining, others)
            for ctl in (remembering, priced)
        ]
        assert chosen[0] == chosen[1], step
        for seq_id, k in zip(running, chosen[0]):
            accepted = rng.randint(0, k) if rng.random() < 0.3 else 0
            dropped = int(k > 0 and rng.random() < 0.1)
            for ctl in (remembering, priced):
                ctl.record(seq_id, 0 if dropped else k, 0 if dropped else accepted, dropped)
            backlogs[seq_id] = 1 if k else backlogs[seq_id] + 1
        event = rng.random()
        for ctl in (remembering, priced):
            if event < 0.05:
                ctl.observe_target(len(running), 0.037 + 0.0086 * len(running) * (1 + step % 3))
            elif event < 0.08:
                ctl.observe_draft(3, 0.0028 + 0.0184 * 3 * (1 + step % 2))
        if rng.random() < 0.02:
            gone = running.pop(rng.randrange(len(running)))
            for ctl in (remembering, priced):
                ctl.free(gone)
    assert pricings[0] < 0.6 * pricings[1]  # the plain steps between news went unpriced


def test_a_new_prompt_probes_where_the_prior_says_drafting_does_not_pay():
    """A new code prompt under costs where the prior's 0.8 acceptance falls short: its
    first probe must read the prompt and, after 16 plain steps, those too; valued by the
    prior's own speedup it would never be worth it (no drafts at all at 0.99
    acceptance). After a fully accepted probe drafting would pay, and there is a fair
    chance of one."""
    ctl = int4_pair_costs(per_position=0.024)
    assert ctl.best([Acceptance(15)]) == (adaptive_module.MIN_SPEEDUP, [0])
    ks = []
    for step in range(40):
        backlog = 2 if any(ks) else 41 + step  # the prompt and every plain token, until a draft
        (k,) = ctl.choose([1], backlogs=[backlog], remaining=[128 - step])
        ks.append(k)
        ctl.record(1, k, k)  # every draft accepted
    assert ks[0] == adaptive_module.PROBE_TOKENS  # at once: waiting tells nothing about the text
    assert min(ks[2:]) > 7


def test_where_plain_decoding_chains_drafting_must_beat_the_chains_price():
    """Where the target decodes plainly in multi-step chains, a plain token costs the
    chain's share of a forward, and one drafting sequence makes the batch's step a single
    forward: a draft that pays against single steps does not against chains at 0.6 of
    them, nor does a lookup whose first token is right half the time. A batch size never
    chained takes the share of the nearest one that was."""
    ctl = controller()
    for matched in [1, 0] * 15:
        ctl.record_lookup(1, 7, matched)
    assert ctl.best_k(steady(0.8), batch=1) > 0 and ctl.lookup_ks([1], [7], batch=1) != [0]
    for _ in range(5):
        ctl.observe_chain(1, 8, 8 * 0.6 * ctl.target_seconds(1))
    assert ctl.plain_step(1) == pytest.approx(0.6 * ctl.target_seconds(1))
    assert ctl.best_k(steady(0.8), batch=1) == 0 and ctl.lookup_ks([1], [7], batch=1) == [0]
    assert ctl.best_k(steady(0.95), batch=1) > 0  # a draft that pays for the chain still drafts
    ctl.observe_chain(32, 8, 8 * 0.9 * ctl.target_seconds(32))
    assert [ctl.chains.share(b) for b in (2, 16, 64)] == pytest.approx([0.6, 0.9, 0.9])


def test_chains_before_a_measured_forward_are_not_priced_but_ask_for_one():
    """A chain before any measured forward cannot be priced, and where every step
    chains none would ever be: the next step decodes plainly to measure one, once."""
    ctl = AdaptiveSpecLength(7, prior_draft_cost_ratio=0.5)
    assert not ctl.measuring_plain(4)
    ctl.observe_chain(4, 8, 0.01)
    assert ctl.chains.share(4) == 1.0 and ctl.plain_step(4) == ctl.target_seconds(4)
    assert ctl.measuring_plain(4) and ctl.choose([1, 2, 3, 4]) == [0] * 4
    ctl.observe_target(4, 0.002)
    assert not ctl.measuring_plain(4)
    ctl.observe_chain(4, 8, 8 * 0.001)
    assert ctl.chains.share(4) == pytest.approx(0.5)


def test_a_proposer_whose_every_guess_is_dropped_stops_drafting():
    """A head no better than chance: its first guesses are too unsure to pay for their
    rows, so every drafting step drops them and verifies nothing, yet each costs a head
    step. The prior keeps such a sequence's estimate near break-even, so a run of these
    steps must not go on at the lower bar of a run that verifies (CONTINUE_SPEEDUP):
    it ends, and the sequence only probes."""
    ctl = controller(fixed=0.0173, per_row=0.0028, draft_fixed=0.0009, per_position=0.0005)
    drafting = 0
    for _ in range(256):
        (k,) = ctl.choose([1])
        if k:
            drafting += 1
            ctl.observe_draft(k, 0.0009 + 0.0005)  # the head ran for one position; the guess was dropped
        ctl.record(1, 0, 0, num_dropped=int(k > 0))
        ctl.observe_target(1, 0.0173 + 0.0028)
    assert drafting <= 16, drafting  # the first steps and the probes, of 256 (all 256 before)
