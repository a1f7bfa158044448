"""NgramProposer: longest n-gram first, most recent occurrence, ragged k, misses."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from specserve.errors import ConfigError
from specserve.sampling import SamplingParams
from specserve.spec.ngram import NgramIndex, NgramProposer


@dataclass
class Seq:
    token_ids: list[int]
    seq_id: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator = field(default_factory=torch.Generator)


def propose(proposer: NgramProposer, token_ids: list[int], k: int) -> list[int]:
    [draft] = proposer.propose([Seq(token_ids)], [k])
    assert draft.probs is None  # deterministic drafts
    assert draft.tokens.dtype == torch.int64 and draft.tokens.dim() == 1
    return draft.tokens.tolist()


def test_proposes_what_followed_the_suffix():
    assert propose(NgramProposer(1, 3), [1, 2, 3, 4, 5, 6, 1, 2, 3], k=3) == [4, 5, 6]


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # Suffix [7, 8, 9]: the 3-gram occurs at the start (followed by 1, 2); the 1-gram [9]
    # occurs more recently (followed by 5, 5), and the 2-gram [8, 9] too (followed by 4).
    tokens = [7, 8, 9, 1, 2, 0, 8, 9, 4, 0, 9, 5, 5, 7, 8, 9]
    assert propose(NgramProposer(1, 3), tokens, k=2) == [1, 2]
    assert propose(NgramProposer(1, 2), tokens, k=2) == [4, 0]  # 3-grams not tried
    assert propose(NgramProposer(1, 1), tokens, k=2) == [5, 5]


def test_most_recent_occurrence_of_the_ngram():
    tokens = [5, 6, 1, 5, 6, 2, 5, 6, 3, 0, 5, 6]
    assert propose(NgramProposer(2, 2), tokens, k=1) == [3]
    assert propose(NgramProposer(2, 2), tokens, k=4) == [3, 0, 5, 6]


def test_fewer_tokens_where_the_history_ends():
    # The most recent earlier [1, 2] is followed only by [1, 2] before the history ends.
    assert propose(NgramProposer(2, 2), [1, 2, 1, 2, 1, 2], k=5) == [1, 2]
    assert propose(NgramProposer(1, 1), [3, 3, 3], k=5) == [3]
    # The occurrence may overlap the suffix itself.
    assert propose(NgramProposer(2, 4), [9, 9, 9, 9, 9], k=3) == [9]


def test_respects_ragged_num_tokens_per_sequence():
    proposer = NgramProposer(1, 2)
    seqs = [Seq(list(range(10)) + [0, 1], seq_id=i) for i in range(4)]
    drafts = proposer.propose(seqs, [0, 1, 3, 20])
    assert [d.tokens.tolist() for d in drafts] == [[], [2], [2, 3, 4], [2, 3, 4, 5, 6, 7, 8, 9, 0, 1]]


def test_sequences_are_independent():
    proposer = NgramProposer(1, 2)
    drafts = proposer.propose([Seq([1, 2, 3, 1]), Seq([4, 5, 6]), Seq([8, 8])], [2, 2, 2])
    assert [d.tokens.tolist() for d in drafts] == [[2, 3], [], [8]]


@pytest.mark.parametrize("token_ids", [[], [4], [1, 2, 3, 4, 5]])
def test_empty_when_no_match_or_history_too_short(token_ids):
    assert propose(NgramProposer(1, 3), token_ids, k=4) == []


def test_prompt_lookup_min_is_honoured():
    tokens = [1, 2, 3, 9, 4, 5, 3]  # only the 1-gram [3] recurs
    assert propose(NgramProposer(1, 3), tokens, k=2) == [9, 4]
    assert propose(NgramProposer(2, 3), tokens, k=2) == []
    # Exactly min + 1 tokens is enough history for a min-gram match; min tokens is not.
    assert propose(NgramProposer(2, 2), [4, 4, 4], k=2) == [4]
    assert propose(NgramProposer(2, 2), [4, 4], k=2) == []
    assert propose(NgramProposer(3, 3), [4, 4, 4], k=2) == []


def test_matches_a_brute_force_reference():
    def reference(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
        for n in range(hi, lo - 1, -1):
            suffix = tokens[len(tokens) - n :] if n <= len(tokens) else None
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []

    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        length = int(torch.randint(0, 40, (), generator=generator))
        vocab = int(torch.randint(2, 6, (), generator=generator))
        tokens = torch.randint(0, vocab, (length,), generator=generator).tolist()
        lo = 1 + trial % 3
        hi = lo + trial % 4
        k = trial % 6
        expected = reference(tokens, lo, hi, k)
        assert propose(NgramProposer(lo, hi), tokens, k) == expected, (tokens, lo, hi, k)


def test_observe_and_free_are_harmless():
    proposer = NgramProposer(1, 2)
    seq = Seq([1, 2, 1])
    proposer.observe([seq], [1])
    proposer.free(seq.seq_id)
    assert propose(proposer, seq.token_ids, k=1) == [2]


@pytest.mark.parametrize("lo, hi", [(0, 2), (3, 2)])
def test_bad_sizes_are_refused(lo, hi):
    with pytest.raises(ConfigError):
        NgramProposer(lo, hi)


def test_a_sequences_index_grows_with_it_and_answers_as_a_fresh_one():
    """One sequence's tokens growing a few at a time (as steps append them): every lookup
    from its kept index is a fresh index's over the same tokens; a new list under the
    same id is indexed anew, and `free` forgets it."""
    generator = torch.Generator().manual_seed(1)
    proposer = NgramProposer(1, 3)
    seq = Seq(torch.randint(0, 4, (5,), generator=generator).tolist(), seq_id=7)
    for _ in range(60):
        grown = int(torch.randint(1, 4, (), generator=generator))
        seq.token_ids.extend(torch.randint(0, 4, (grown,), generator=generator).tolist())
        kept = proposer.propose_for(seq, 3).tokens.tolist()
        assert kept == NgramIndex(list(seq.token_ids), 1, 3).follows(3)
    assert proposer.indexes[7].indexed == len(seq.token_ids)
    other = Seq([9, 8, 9], seq_id=7)  # the same id, another text
    assert proposer.propose_for(other, 2).tokens.tolist() == [8, 9]
    proposer.free(7)
    assert 7 not in proposer.indexes
