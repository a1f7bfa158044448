"""SuffixProposer: drafts voted by the places a sequence's last tokens occurred before, in
its own text and in earlier answers; the bounds of vLLM's suffix_decoding_* keys; the
answers kept, shared or not, and dropped oldest first."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from specserve.sampling import SamplingParams
from specserve.spec import suffix
from specserve.spec.suffix import OFFSET_BITS, SuffixIndex, SuffixProposer, best_draft


@dataclass
class Seq:
    token_ids: list[int]
    num_prompt_tokens: int = 0
    seq_id: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator = field(default_factory=torch.Generator)


def draft_from(documents: list[list[int]], pattern: list[int], k: int = 10, **bounds) -> tuple[list[int], list[float]]:
    index = SuffixIndex()
    for doc_id, tokens in enumerate(documents):
        index.add(doc_id, tokens)
    settings = dict(max_depth=24, max_spec_factor=1.0, min_token_prob=0.1) | bounds
    return best_draft(index.matches(pattern, settings["max_depth"]), k, **settings)


def test_the_draft_follows_the_most_common_continuation_with_its_share():
    documents = [[1, 2, 3, 5], [1, 2, 3, 5], [1, 2, 3, 6], [1, 2, 4, 7]]
    draft, chances = draft_from(documents, [9, 1, 2], k=2)
    assert draft == [3, 5]
    assert chances == pytest.approx([0.75, 0.75 * 2 / 3])


def test_a_longer_match_is_read_where_its_votes_are_surer():
    # After [8, 1, 2] the answer was always 4; after [1, 2] alone it was mostly 3.
    documents = [[0, 1, 2, 3]] * 3 + [[8, 1, 2, 4, 4, 4]]
    assert draft_from(documents, [8, 1, 2], k=3)[0] == [4, 4, 4]
    assert draft_from(documents, [0, 1, 2], k=3)[0] == [3]  # the history ends after one token


def test_min_token_prob_stops_where_the_chance_falls_below_it():
    documents = [[1, 2, 3, 4, 5]] * 2 + [[1, 2, 3, 4, 6]] * 2 + [[1, 2, 3, 7, 7]]
    assert draft_from(documents, [1, 2, 3], min_token_prob=0.5)[0] == [4]  # then 0.8 * 0.5 = 0.4
    assert draft_from(documents, [1, 2, 3], min_token_prob=0.3)[0] == [4, 6]  # a tie goes to the latest


def test_the_spec_factor_and_the_depth_bound_the_draft():
    documents = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    assert draft_from(documents, [1, 2, 3])[0] == [4, 5, 6]  # factor 1: three tokens after three
    assert draft_from(documents, [1, 2, 3], max_spec_factor=2.0)[0] == [4, 5, 6, 7, 8, 9]
    assert draft_from(documents, [1, 2, 3], k=2, max_spec_factor=2.0)[0] == [4, 5]
    # The depth bounds match and draft together: 3 + 3, or 2 + 2 with the match cut.
    assert draft_from(documents, [1, 2, 3], max_depth=6)[0] == [4, 5, 6]
    assert draft_from(documents, [1, 2, 3], max_depth=5)[0] == [4, 5]


def test_a_sequence_drafts_from_its_own_text_as_it_grows():
    proposer = SuffixProposer()
    tokens = [5, 6, 7, 8, 9, 5, 6]
    seq = Seq(tokens, num_prompt_tokens=5)
    [draft] = proposer.propose([seq], [3])
    assert draft.probs is None and draft.tokens.tolist() == [7, 8]  # two tokens after a match of two
    tokens += [7, 8]
    [draft] = proposer.propose([seq], [3])
    assert draft.tokens.tolist() == [9, 5, 6]
    assert proposer.propose([seq], [0])[0].num_tokens == 0


def test_a_finished_answer_drafts_for_the_next_request_from_its_first_token():
    proposer = SuffixProposer()
    first = Seq([40, 41, 42, 90, 91, 10, 11, 12, 13, 14, 15], num_prompt_tokens=5, seq_id=1)
    proposer.finished(first)
    proposer.free(1)
    # Another prompt with the same last tokens (a chat template's), answered afresh.
    second = Seq([50, 51, 90, 91], num_prompt_tokens=4, seq_id=2)
    [draft] = proposer.propose([second], [8])
    assert draft.tokens.tolist() == [10, 11]
    second.token_ids += [10, 11, 12]
    assert proposer.propose([second], [8])[0].tokens.tolist() == [13, 14, 15]


def test_no_answers_are_shared_where_none_are_kept_and_a_preempted_one_is_not_kept():
    answer = [40, 90, 91, 10, 11, 12, 13]
    isolated = SuffixProposer(max_cached_requests=0)
    isolated.finished(Seq(list(answer), num_prompt_tokens=3, seq_id=1))
    assert isolated.propose([Seq([7, 90, 91, 10, 11], num_prompt_tokens=3, seq_id=2)], [4])[0].num_tokens == 0
    shared = SuffixProposer()
    shared.propose([Seq(list(answer), num_prompt_tokens=3, seq_id=1)], [4])
    shared.free(1)  # preempted: its tokens will come again
    assert not shared.shared.documents and not shared.own


def test_the_oldest_answers_are_dropped_with_their_places():
    proposer = SuffixProposer(max_cached_requests=3)
    for i in range(200):
        proposer.finished(Seq([1, 2, 100 + i, 100 + i], num_prompt_tokens=2, seq_id=i))
    assert sorted(proposer.shared.documents) == [197, 198, 199] and proposer.shared.num_tokens == 6
    shared = proposer.shared
    live = {shared.position[slot - shared.slot_base] >> OFFSET_BITS for slot in shared.latest.values()}
    assert live == {197, 198, 199} and len(shared.position) < 4 * 3 * 3  # the dead front shed
    # The three kept answers vote a third each; a tie goes to the latest.
    assert proposer.propose([Seq([1, 2], num_prompt_tokens=2, seq_id=500)], [2])[0].tokens.tolist() == [299, 299]


def test_the_kept_answers_are_bounded_in_tokens_too(monkeypatch):
    monkeypatch.setattr(suffix, "MAX_CACHED_TOKENS", 10)
    proposer = SuffixProposer()
    for i in range(5):
        proposer.finished(Seq([1, 2] + [100 + i] * 4, num_prompt_tokens=2, seq_id=i))
    assert sorted(proposer.shared.documents) == [3, 4] and proposer.shared.num_tokens == 8
    proposer.finished(Seq([1, 2] + [7] * 11, num_prompt_tokens=2, seq_id=5))  # longer than the bound alone
    assert not proposer.shared.documents and not proposer.shared.latest and proposer.shared.num_tokens == 0


def test_a_greedy_sequence_drops_a_first_token_less_likely_than_its_row_asks():
    proposer = SuffixProposer()
    for i, answer in enumerate([[10, 11], [10, 11], [12, 13]]):
        proposer.finished(Seq([1, 2, *answer], num_prompt_tokens=2, seq_id=i))
    greedy, sampled = (
        Seq([1, 2], num_prompt_tokens=2, seq_id=9 + t, params=SamplingParams(temperature=t)) for t in (0, 1)
    )
    [kept] = proposer.propose([greedy], [2], least_chances=[0.6])
    assert kept.tokens.tolist() == [10, 11] and kept.first_confidence == pytest.approx(2 / 3)
    [dropped, drawn] = proposer.propose([greedy, sampled], [2, 2], least_chances=[0.7, 0.7])
    assert dropped.num_tokens == 0 and dropped.dropped == 1 and dropped.first_confidence == pytest.approx(2 / 3)
    assert drawn.tokens.tolist() == [10, 11]  # a sampled request's drafts are kept whatever their chance


def test_a_lookup_first_indexes_only_the_keys_its_least_match_reads():
    assert suffix.keys_for(1, (1, 2, 4, 8)) == (1, 2, 4, 8)
    assert suffix.keys_for(3, (1, 2, 4, 8)) == (2, 4, 8)
    assert suffix.keys_for(1, (2, 4, 8)) == (2, 4, 8)
    lookup = SuffixProposer(min_match=4)
    assert lookup.own_keys == (4, 8) and lookup.shared.key_lengths == (4, 8)
    tokens = [1, 2, 3, 4, 5, 6, 9, 2, 3, 4, 5]
    seq = Seq(tokens, num_prompt_tokens=len(tokens))
    [draft] = lookup.propose([seq], [3])
    assert draft.tokens.tolist() == [6, 9, 2] and draft.first_confidence == 1.0
    tokens[-4:] = [8, 3, 4, 5]  # a match of three tokens drafts nothing
    assert lookup.propose([Seq(tokens, num_prompt_tokens=len(tokens), seq_id=1)], [3])[0].num_tokens == 0
