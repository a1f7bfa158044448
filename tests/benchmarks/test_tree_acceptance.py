"""benchmarks/tree_acceptance.py on a tiny permutation target: a tree accepts what a greedy
verifier of it would, a wider tree at least what a chain does, and the head's walks leave
its reading of the target's pairs as drafting has it."""

from __future__ import annotations

import pytest

from benchmarks.tree_acceptance import measure, nodes, parse_tree
from specserve.engine.engine import Engine
from tests.head_models import permutation_target, right_head
from tests.spec.test_head_proposers import EOS, GREEDY, proposer_of


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_wider_tree_accepts_at_least_the_chain_and_a_right_head_all_of_it(method):
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    trees = [(1, 1, 1), (4, 1, 1), (2, 2, 1)]
    exact, perm = permutation_target(noise=0.0)
    output = Engine(exact, eos_token_ids=[EOS]).generate(prompt, GREEDY).output_ids
    found = measure(proposer_of(right_head(method, exact, perm), exact), exact, prompt, output, trees)
    # From the second output on the right head's first guess is the target's (EAGLE-3's
    # reads its guess off the feature, which after a prompt's last token is not the chain's).
    assert found["ranks"][1:] == [0] * (len(output) - 1)
    for tree in trees:  # the whole depth, but where the answer ends first
        assert found["accepted"][tree][1:] == [min(3, len(output) - i) for i in range(1, len(output))]

    noisy, perm = permutation_target(noise=0.18)
    output = Engine(noisy, eos_token_ids=[EOS]).generate(prompt, GREEDY).output_ids
    found = measure(proposer_of(right_head(method, noisy, perm), noisy), noisy, prompt, output, trees)
    chain, wide = found["accepted"][(1, 1, 1)], found["accepted"][(4, 1, 1)]
    assert all(w >= c for w, c in zip(wide, chain)) and sum(chain) < 3 * len(output)
    # A first guess is accepted exactly where the target's token is the head's top one.
    assert [a > 0 for a in chain] == [r == 0 for r in found["ranks"]]


def test_a_tree_counts_its_nodes_and_refuses_a_zero_branch():
    assert nodes((1, 1, 1)) == 3 and nodes((4, 1, 1)) == 12 and nodes((4, 2, 1, 1)) == 28
    assert parse_tree("2,2,1") == (2, 2, 1)
    with pytest.raises(Exception, match="branching factors >= 1"):
        parse_tree("2,0")
