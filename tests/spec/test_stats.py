"""SpecStats: counters, derived rates, per-position growth, merging and the dict view."""

from __future__ import annotations

import pytest

from specserve.spec.stats import SpecStats


def test_fresh_stats_have_no_rates():
    stats = SpecStats()
    assert stats.acceptance_rate is None
    assert stats.mean_acceptance_length is None
    assert stats.to_dict() == {
        "num_drafts": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "acceptance_rate": None,
        "mean_acceptance_length": None,
        "accepted_per_position": [],
    }


def test_step_without_drafts_counts_nowhere():
    stats = SpecStats()
    stats.record(num_drafted=0, num_accepted=0)
    assert stats == SpecStats()
    assert stats.acceptance_rate is None and stats.mean_acceptance_length is None


def test_counts_and_derived_rates():
    stats = SpecStats()
    stats.record(num_drafted=4, num_accepted=4)  # all accepted: 5 tokens emitted
    stats.record(num_drafted=4, num_accepted=1)
    stats.record(num_drafted=2, num_accepted=0)
    stats.record(num_drafted=0, num_accepted=0)  # an n-gram miss: not a draft
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 10, 5)
    assert stats.acceptance_rate == pytest.approx(5 / 10)
    assert stats.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    assert stats.accepted_per_position == [2, 1, 1, 1]


def test_per_position_grows_to_longest_draft_even_when_rejected():
    stats = SpecStats()
    stats.record(num_drafted=2, num_accepted=1)
    assert stats.accepted_per_position == [1, 0]
    stats.record(num_drafted=6, num_accepted=0)
    assert stats.accepted_per_position == [1, 0, 0, 0, 0, 0]
    stats.record(num_drafted=3, num_accepted=3)
    assert stats.accepted_per_position == [2, 1, 1, 0, 0, 0]
    # Position i can be accepted at most as often as position i-1.
    assert all(a >= b for a, b in zip(stats.accepted_per_position, stats.accepted_per_position[1:]))


def test_nothing_accepted_gives_zero_rate_and_length_one():
    stats = SpecStats()
    stats.record(num_drafted=3, num_accepted=0)
    assert stats.acceptance_rate == 0.0
    assert stats.mean_acceptance_length == 1.0


@pytest.mark.parametrize("num_drafted, num_accepted", [(2, 3), (2, -1), (-1, 0)])
def test_impossible_counts_are_refused(num_drafted, num_accepted):
    with pytest.raises(ValueError):
        SpecStats().record(num_drafted=num_drafted, num_accepted=num_accepted)


def test_merge_and_add_equal_recording_everything_in_one():
    steps_a = [(3, 2), (3, 3), (0, 0)]
    steps_b = [(5, 1), (1, 0)]
    a, b, together = SpecStats(), SpecStats(), SpecStats()
    for drafted, accepted in steps_a:
        a.record(drafted, accepted)
        together.record(drafted, accepted)
    for drafted, accepted in steps_b:
        b.record(drafted, accepted)
        together.record(drafted, accepted)

    total = a + b
    assert total == together
    assert total.to_dict() == together.to_dict()
    assert a.accepted_per_position == [2, 2, 1]  # `+` left its operands alone
    assert b.accepted_per_position == [1, 0, 0, 0, 0]

    a.merge(b)
    assert a == together
    assert b + SpecStats() == b


def test_to_dict_reports_rates_and_copies_positions():
    stats = SpecStats()
    stats.record(num_drafted=2, num_accepted=1)
    report = stats.to_dict()
    assert report == {
        "num_drafts": 1,
        "num_draft_tokens": 2,
        "num_accepted_tokens": 1,
        "acceptance_rate": 0.5,
        "mean_acceptance_length": 2.0,
        "accepted_per_position": [1, 0],
    }
    report["accepted_per_position"].append(7)
    assert stats.accepted_per_position == [1, 0]
