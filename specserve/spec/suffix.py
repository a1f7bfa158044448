"""Suffix decoding (vLLM's "suffix" method, after SuffixDecoding, arXiv 2411.04975): draft
what followed the sequence's latest tokens where they occurred before, in its own prompt
and output or in the answers the engine gave earlier requests.

Each place where a sequence's last tokens occurred before is a candidate; its match
length is how many of those tokens agree there, read backwards. For each match length
m the candidates that match at least m tokens vote, position by position, for the token
that comes next: the draft follows the most common one, each token's estimated
probability the product of its votes' shares so far, and stops where that falls below
`min_token_prob`, or after `max_spec_factor * m` tokens, or where m and the draft
together would pass `max_tree_depth`. The draft kept, over every m and both sources, is
the one expected to have the most tokens accepted (the sum of those probabilities):
long matches are surer, short ones seen more often.

`SuffixIndex` finds the candidates: for each of a few n-gram lengths, where each n-gram
occurred in its documents (the latest `CANDIDATES_PER_KEY` places are read). A sequence's
own index grows with its tokens; the shared index holds the answers of the latest
`max_cached_requests` finished sequences, `MAX_CACHED_TOKENS` at most (each with the end
of its prompt, so the next answer's first tokens match too), the oldest dropped first.

Invariants: drafts are deterministic (`Draft.probs is None`, one-hot for the verifier)
and read only tokens the target already emitted, so the output stays the target's; with
`max_cached_requests` 0 a request's drafts read its own text alone, so another request's
answer never changes how fast it decodes.
"""

from __future__ import annotations

from array import array
from collections import Counter
from typing import Iterator, Sequence, Union

from specserve.spec.proposer import Draft, SequenceView

# The n-gram lengths indexed: the shortest bounds the shortest match found, the longer
# ones find long matches that the latest places of a common short n-gram would miss.
SHARED_KEY_LENGTHS = (2, 4, 8)
OWN_KEY_LENGTHS = (1, 2, 4, 8)
# The latest places of an n-gram read as candidates (older ones are forgotten).
CANDIDATES_PER_KEY = 32
# The most answer tokens the shared index keeps, whatever max_cached_requests allows: at
# worst (every n-gram new) an indexed token takes about 0.4 KiB.
MAX_CACHED_TOKENS = 1_000_000
# A document's id is its positions' high bits.
OFFSET_BITS = 32

TokenList = Union[list[int], "array[int]"]  # a running sequence's own list, or a kept answer


def keys_for(min_match: int, lengths: tuple[int, ...]) -> tuple[int, ...]:
    """Those of `lengths` that find the matches of min_match tokens or more: the longest
    at most min_match (the shortest of all if none is), and every longer one."""
    shortest = max((n for n in lengths if n <= min_match), default=lengths[0])
    return tuple(n for n in lengths if n >= shortest)


class SuffixIndex:
    """Where each n-gram of `key_lengths` occurred in some token lists (documents), by
    the position of the token after it (position = document id << OFFSET_BITS | offset).

    Each occurrence is a slot, numbered in the order indexed; `latest` maps an n-gram's
    hash to its latest slot and each slot links to the one before with the same hash
    (a hash chain, as zlib's). The index holds plain ints in a dict and arrays, no
    object per n-gram, so however big it grows it adds nothing to the garbage
    collector's walks. Documents join with increasing ids and leave oldest first, so a
    leaving document's slots are the oldest: dropping one costs what adding it did."""

    def __init__(self, key_lengths: tuple[int, ...] = SHARED_KEY_LENGTHS) -> None:
        self.key_lengths = key_lengths
        self.documents: dict[int, TokenList] = {}  # by id, oldest first
        self.starts: dict[int, int] = {}  # a document's first position indexed as a continuation
        self.indexed: dict[int, int] = {}  # a document's tokens before this have their n-grams indexed
        self.latest: dict[int, int] = {}  # n-gram's hash -> its latest slot
        self.earlier = array("q")  # [slot - slot_base] -> the slot before with the same hash, or -1
        self.position = array("q")  # [slot - slot_base] -> the position it names
        self.slot_base = 0  # the slot at index 0 of the arrays
        self.first_live = 0  # slots before this belong to dropped documents
        self.doc_slots: dict[int, int] = {}  # a document's first slot
        self.num_tokens = 0  # in all documents

    def add(self, doc_id: int, tokens: TokenList, start: int = 0) -> None:
        """Index `tokens` (read by reference: a growing list is indexed as it grows, by
        `extend`) as document doc_id, the n-grams followed by tokens[start:] only."""
        self.documents[doc_id] = tokens
        self.starts[doc_id] = self.indexed[doc_id] = start
        self.doc_slots[doc_id] = self.slot_base + len(self.position)
        self.extend(doc_id)

    def extend(self, doc_id: int) -> None:
        """Index the n-grams of document doc_id followed by a token added since."""
        tokens, base = self.documents[doc_id], doc_id << OFFSET_BITS
        slot = self.slot_base + len(self.position)
        for key, end in self._keys(tokens, self.indexed[doc_id]):
            self.earlier.append(self.latest.get(key, -1))
            self.position.append(base | end)
            self.latest[key] = slot
            slot += 1
        self.num_tokens += len(tokens) - self.indexed[doc_id]
        self.indexed[doc_id] = len(tokens)

    def _keys(self, tokens: TokenList, start: int) -> Iterator[tuple[int, int]]:
        """(n-gram's hash, position of the token after it) for the tokens from start on."""
        for end in range(start, len(tokens)):
            for n in self.key_lengths:
                if end >= n:
                    yield hash(tuple(tokens[end - n : end])), end

    def drop_oldest(self) -> None:
        """Forget the oldest document: an n-gram whose latest slot was its has no live
        slot left; the arrays shed their dead front once it is half of them."""
        oldest = next(iter(self.documents))
        tokens = self.documents.pop(oldest)
        self.num_tokens -= self.indexed.pop(oldest) - self.starts[oldest]
        del self.doc_slots[oldest]
        self.first_live = next(iter(self.doc_slots.values()), self.slot_base + len(self.position))
        for key, _ in self._keys(tokens, self.starts.pop(oldest)):
            if self.latest.get(key, self.first_live) < self.first_live:
                del self.latest[key]
        dead = self.first_live - self.slot_base
        if dead > len(self.position) // 2:
            del self.earlier[:dead], self.position[:dead]
            self.slot_base = self.first_live

    def matches(self, pattern: list[int], max_match: int, min_match: int = 1) -> list[tuple[int, TokenList, int]]:
        """(match length, document, position of the token after the match) of the latest
        CANDIDATES_PER_KEY places of each of the pattern's last n-grams, each match at
        least min_match and at most max_match long."""
        found: dict[int, tuple[int, TokenList, int]] = {}
        for n in self.key_lengths:
            if len(pattern) < n:
                break
            slot = self.latest.get(hash(tuple(pattern[-n:])), -1)
            for _ in range(CANDIDATES_PER_KEY):
                if slot < self.first_live:
                    break
                position = self.position[slot - self.slot_base]
                slot = self.earlier[slot - self.slot_base]
                document = self.documents[position >> OFFSET_BITS]
                if position in found:
                    continue
                offset = position & ((1 << OFFSET_BITS) - 1)
                length = 0
                while length < max_match and length < offset and document[offset - 1 - length] == pattern[-1 - length]:
                    length += 1
                if length >= max(min_match, self.key_lengths[0]):  # shorter: too short, or a hash collision
                    found[position] = (length, document, offset)
        return list(found.values())


def best_draft(
    candidates: list[tuple[int, TokenList, int]],
    num_tokens: int,
    max_depth: int,
    max_spec_factor: float,
    min_token_prob: float,
) -> tuple[list[int], list[float]]:
    """The draft expected to have the most tokens accepted, over the match lengths the
    candidates give (see the module's docstring), and each of its tokens' estimated
    probability (their sum is that expectation)."""
    best: tuple[list[int], list[float]] = ([], [])
    if not candidates:
        return best
    # Where a longer match allows no longer draft, its shorter cut allows more (depth bound).
    balanced = int(max_depth / (1 + max_spec_factor))
    lengths = {min(m, max_depth - 1) for m, _, _ in candidates} | {min(m, balanced) for m, _, _ in candidates}
    for m in sorted(lengths, reverse=True):
        limit = min(num_tokens, int(max_spec_factor * m), max_depth - m)
        if limit <= 0:
            continue
        alive = [(document, offset) for length, document, offset in candidates if length >= m]
        draft: list[int] = []
        chances: list[float] = []
        chance = 1.0
        for depth in range(limit):
            votes = Counter(doc[offset + depth] for doc, offset in alive if offset + depth < len(doc))
            if not votes:
                break
            token, count = votes.most_common(1)[0]
            chance *= count / len(alive)
            if chance < min_token_prob:
                break
            draft.append(token)
            chances.append(chance)
            alive = [(doc, at) for doc, at in alive if at + depth < len(doc) and doc[at + depth] == token]
        if sum(chances) > sum(best[1]):
            best = (draft, chances)
    return best


class SuffixProposer:
    features = None  # reads tokens only

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        min_match: int = 1,
    ) -> None:
        self.max_tree_depth = max_tree_depth
        self.min_match = min_match  # shorter matches draft nothing (a lookup first's bar)
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.last_catch_up = self.last_tokens_read = 0  # a lookup reads nothing ahead of time
        self.own_keys = keys_for(min_match, OWN_KEY_LENGTHS)
        self.own: dict[int, SuffixIndex] = {}  # a running sequence's index of its own tokens
        self.shared = SuffixIndex(keys_for(min_match, SHARED_KEY_LENGTHS))  # finished sequences' answers
        self.next_doc_id = 0

    def backlog(self, seq: SequenceView) -> int:
        return 0

    def propose(
        self, seqs: Sequence[SequenceView], num_tokens: Sequence[int], least_chances: Sequence[float] | None = None
    ) -> list[Draft]:
        """A greedy sequence drafts nothing where its first token's estimated probability
        is below least_chances asks, as a head's first guess is dropped (spec/guesses.py)."""
        drafts = []
        for i, (seq, k) in enumerate(zip(seqs, num_tokens, strict=True)):
            draft = self.propose_for(seq, k)
            least = least_chances[i] if least_chances is not None and seq.params.greedy else 0.0
            if draft.num_tokens and draft.first_confidence < least:
                draft = Draft.of([], dropped=1, first_confidence=draft.first_confidence)
            drafts.append(draft)
        return drafts

    def propose_for(self, seq: SequenceView, num_tokens: int) -> Draft:
        """Up to num_tokens tokens after seq.token_ids, from its own text or earlier
        answers, with the first one's estimated probability."""
        if num_tokens <= 0:
            return Draft.empty()
        own = self.own.get(seq.seq_id)
        if own is None or own.documents[0] is not seq.token_ids or own.indexed[0] > len(seq.token_ids):
            own = self.own[seq.seq_id] = SuffixIndex(self.own_keys)
            own.add(0, seq.token_ids)
        else:
            own.extend(0)
        pattern = seq.token_ids[-self.max_tree_depth :]
        best: tuple[list[int], list[float]] = ([], [])
        for index in (own, self.shared):
            draft = best_draft(
                index.matches(pattern, self.max_tree_depth, self.min_match),
                num_tokens,
                self.max_tree_depth,
                self.max_spec_factor,
                self.min_token_prob,
            )
            if sum(draft[1]) > sum(best[1]):
                best = draft
        tokens, chances = best
        return Draft.of(tokens, first_confidence=chances[0] if chances else None)

    def observe(self, seqs: Sequence[SequenceView], num_accepted: Sequence[int]) -> None:
        pass

    def finished(self, seq: SequenceView) -> None:
        """Keep seq's answer, after the end of its prompt, for the requests that follow."""
        if self.max_cached_requests == 0 or len(seq.token_ids) == seq.num_prompt_tokens:
            return
        head = max(0, seq.num_prompt_tokens - self.max_tree_depth)
        tokens = array("i", seq.token_ids[head:])  # 4 bytes a token, where a list takes 36
        self.shared.add(self.next_doc_id, tokens, start=seq.num_prompt_tokens - head)
        self.next_doc_id += 1
        shared = self.shared
        while len(shared.documents) > self.max_cached_requests or shared.num_tokens > MAX_CACHED_TOKENS:
            shared.drop_oldest()

    def free(self, seq_id: int) -> None:
        self.own.pop(seq_id, None)
