"""A small draft model that shares the target's tokenizer proposes k tokens.

The draft keeps its own KV cache per sequence. It never tracks which of its guesses
were accepted: before drafting it simply feeds every token of the sequence it has not
yet seen (the whole prompt the first time; afterwards the last accepted draft and the
recovered or bonus token), so no bonus-token special case exists. `observe` rolls its
cache back to the longest prefix that still agrees with the sequence.

Drafting for a batch is batched: one forward for everyone's catch-up tokens, then one
single-token forward per further draft position for the sequences that want more (with
CUDA graphs, for greedy requests, all of those positions in one graph: TokenChain).
A long catch-up (a new sequence's prompt) goes in chunks, one per step, with no drafts
for that sequence until it is done. spec/fused.py runs the same steps in one C call.

With a `prefix_cache` (the draft's own, model/prefix_cache.py) a sequence's draft cache
starts from the longest stored prefix of its tokens, and is stored when it is freed.
Other sequences' draft caches are sources too, looked at before each chunk of a long
catch-up, and a chunk that another sequence reads in the same call waits a call to be
copied, as the engine does for the target. Without one, a request's n choices (the same
prompt) still read it once: a choice copies the prompt, to the token, from the sibling
that read furthest, and waits a call where a sibling reads its chunk.

With a common head (`Decoder.add_common_head`, `"draft_vocab_size"`) a sequence's
guesses score only the common token ids while its recent text keeps to them
(`keeps_to_common`), and every id otherwise: each row by its own sequence's text, so
no sequence's drafts depend on its neighbours.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specserve.config import DEFAULT_PREFILL_CHUNK_SIZE
from specserve.model.decoder import Decoder, Segment
from specserve.model.kv_cache import KVCache
from specserve.model.prefix_cache import ChunkReads, PrefixCache, copy_prefix, release_into
from specserve.spec.guesses import DraftChains, Guesser
from specserve.spec.proposer import Draft, SequenceView

# A sequence drafts over the common ids while at most this share of its last
# COMMON_WINDOW tokens (special tokens aside) lie past them. Such a token is a guess the
# draft cannot make, so it costs about what an unaccepted guess does, while the common
# head makes every position cheaper: the cut pays while fewer than ~1 in 5 tokens lie
# past it (benchmarks/EXPERIMENTS.md, "The draft guesses over its common ids while the
# text keeps to them"); the suites' English and code have 0-3%, a Chinese answer ~78%.
COMMON_WINDOW, COMMON_MAX_SHARE = 64, 0.1


class DraftModelProposer:
    features = None  # reads tokens only
    fuses = False  # FusedDraftProposer drafts greedy requests in C

    def __init__(
        self,
        draft: Decoder,
        confidence_threshold: float = 0.0,
        catch_up_chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE,
        special_ids: frozenset[int] = frozenset(),
    ):
        self.draft = draft
        self.special_ids = special_ids  # not counted by keeps_to_common: chat markup is in every prompt
        self.catch_up_chunk_size = catch_up_chunk_size
        # Stop drafting a sequence after a guess the draft itself gives less than
        # confidence_threshold (guesses.py): on open-ended text later guesses cost more
        # than they save.
        self.guesser = Guesser(draft.config.vocab_size, confidence_threshold)
        self.caches: dict[int, KVCache] = {}
        self.prefix_cache: PrefixCache | None = None  # the draft's own, if any (see above)
        self._token_ids: dict[int, list[int]] = {}  # each cache's sequence's tokens (the live list), to store it
        self._prompt_lengths: dict[int, int] = {}  # each cache's sequence's prompt length, to find its siblings
        self.last_catch_up = self.last_tokens_read = 0  # see Proposer
        self._in_c = draft.model_in_c() is not None

    @property
    def confidence_threshold(self) -> float:
        return self.guesser.confidence_threshold

    def _cache(self, seq: SequenceView) -> KVCache:
        if seq.seq_id not in self.caches:
            self.caches[seq.seq_id] = self.draft.new_cache()
            self._token_ids[seq.seq_id] = seq.token_ids
            self._prompt_lengths[seq.seq_id] = seq.num_prompt_tokens
            if self.prefix_cache is not None:
                self.prefix_cache.count_query(len(seq.token_ids))
            self._load_prefix(seq)
        return self.caches[seq.seq_id]

    def _load_prefix(self, seq: SequenceView) -> None:
        """Extend seq's draft cache with what others read: from the prefix cache (in whole
        blocks) and, to the token, from the sibling that read the most of its prompt."""
        cache = self.caches[seq.seq_id]
        limit = len(seq.token_ids) - 1  # all but the newest token: a draft starts from its logits
        if self.prefix_cache is not None:
            self.prefix_cache.load(seq.token_ids, cache, limit, self._live(seq))
        sibling = max(self._siblings(seq), key=lambda i: self.caches[i].length, default=None)
        if sibling is not None:
            source = self.caches[sibling]
            copy_prefix(source, cache, min(limit, source.length, seq.num_prompt_tokens))

    def _siblings(self, seq: SequenceView) -> list[int]:
        """The ids of the other sequences with seq's prompt (its request's other choices)
        that the draft has a cache for."""
        n = seq.num_prompt_tokens
        prompt = seq.token_ids[:n]
        return [
            i
            for i, length in self._prompt_lengths.items()
            if i != seq.seq_id and length == n and self._token_ids[i][:n] == prompt
        ]

    def _live(self, seq: SequenceView) -> list[tuple[list[int], KVCache]]:
        """The other sequences' draft caches, as prefix cache sources (none without a prefix cache)."""
        if self.prefix_cache is None:
            return []
        return [(self._token_ids[i], cache) for i, cache in self.caches.items() if i != seq.seq_id]

    def backlog(self, seq: SequenceView) -> int:
        cache = self.caches.get(seq.seq_id)
        if cache is not None:
            return len(seq.token_ids) - cache.length
        limit = len(seq.token_ids) - 1
        if self.prefix_cache is not None:
            cached = self.prefix_cache.cached_length(seq.token_ids, limit, self._live(seq))
        else:
            lengths = [self.caches[i].length for i in self._siblings(seq)]
            cached = min(max(lengths, default=0), limit, seq.num_prompt_tokens)
        return len(seq.token_ids) - cached

    def unseen(self, seq: SequenceView) -> list[int]:
        """The tokens of `seq` this draft has not read yet."""
        return seq.token_ids[self._cache(seq).length :]

    def catch_up_prompts(self, seqs: Sequence[SequenceView], num_tokens: Sequence[int]) -> list[int]:
        """Where a sequence that wants drafts has more unseen tokens than a chunk (a
        sequence new to the draft has its whole prompt unseen), read one chunk of them
        and draft nothing for it this step: returns num_tokens with those set to 0. So the
        batch never waits for a long draft prefill (a sequence may copy from, or wait for,
        other sequences' caches: see above). A choice whose sibling reads their prompt in
        this call, in a chunk or as it drafts, waits a call to copy it, however short.

        Every proposing call starts here, so this also starts the call's count of tokens
        read (last_catch_up, last_tokens_read), which the drafting after it adds to."""
        long: dict[int, list[int]] = {}  # the chunk each sequence catching up reads now
        waiting: set[int] = set()  # catching up, but its chunk is read by another one now
        reads = ChunkReads()
        prompt_ends: dict[int, int] = {}  # where each sequence reading its prompt now will be
        for i, seq in enumerate(seqs):
            if num_tokens[i] == 0:
                continue
            new = seq.seq_id not in self.caches  # a new cache looks for its prefix as it is made
            if not (self._catching_up(seq) or self._reads_prompt(seq)):
                continue
            if not new:
                self._load_prefix(seq)  # what another sequence read since this one started reading
                if not (self._catching_up(seq) or self._reads_prompt(seq)):
                    continue
            start = self._cache(seq).length
            end = min(start + self.catch_up_chunk_size, len(seq.token_ids))
            # It waits a call where it can copy then what another reads now: its prompt
            # from a sibling (to the token), or from the prefix cache's sources.
            sibling_ends = [prompt_ends[j] for j in self._siblings(seq) if j in prompt_ends]
            copies_later = max(sibling_ends, default=0) > start
            if copies_later or not reads.claim(seq.token_ids, start, end, self.prefix_cache is not None):
                waiting.add(i)
                continue
            if self._reads_prompt(seq):
                prompt_ends[seq.seq_id] = end
            if self._catching_up(seq):
                long[i] = seq.token_ids[start:end]
            # else it reads its few unseen tokens as it drafts
        if long:
            self._catch_up(long, seqs)
        self.last_catch_up = self.last_tokens_read = 0
        self._count_read([len(chunk) for chunk in long.values()])
        return [0 if i in long or i in waiting else k for i, k in enumerate(num_tokens)]

    def _catching_up(self, seq: SequenceView) -> bool:
        """Whether seq has more unseen tokens than a call drafts after (a chunk)."""
        return len(self.unseen(seq)) > self.catch_up_chunk_size

    def _reads_prompt(self, seq: SequenceView) -> bool:
        """Whether seq has yet to read some of its prompt (which its siblings, its
        request's other choices, may copy)."""
        return self._cache(seq).length < seq.num_prompt_tokens

    def _count_read(self, lengths: list[int]) -> None:
        """Add the tokens each sequence read before drafting to this call's count."""
        self.last_catch_up = max([self.last_catch_up, *lengths])
        self.last_tokens_read += sum(lengths)

    def describe(self) -> str:
        """How this proposer drafts, for the server's start-up line."""
        how = "in one C call per step (fused)" if self.fuses else "step by step"
        if self.draft.common is not None:
            how += f", guessing ids below {self.draft.common[0]} while a text keeps to them"
        return f"the draft drafts {how}"

    def keeps_to_common(self, seq: SequenceView) -> bool:
        """Whether seq's recent text keeps to the draft's common ids (see COMMON_MAX_SHARE);
        False where the draft has no common head."""
        if self.draft.common is None:
            return False
        num_common = self.draft.common[0]
        recent = seq.token_ids[-COMMON_WINDOW:]
        past = sum(1 for t in recent if t >= num_common and t not in self.special_ids)
        return past <= COMMON_MAX_SHARE * len(recent)

    def propose(
        self, seqs: Sequence[SequenceView], num_tokens: Sequence[int], least_chances: Sequence[float] | None = None
    ) -> list[Draft]:
        return self._draft(seqs, self.catch_up_prompts(seqs, num_tokens), least_chances)

    def _draft(
        self, seqs: Sequence[SequenceView], num_tokens: Sequence[int], least_chances: Sequence[float] | None = None
    ) -> list[Draft]:
        """Draft through PyTorch (after `catch_up_prompts`)."""
        chains = DraftChains(seqs, num_tokens, self.guesser, least_chances)
        # The first forward feeds each sequence's unseen tokens, later ones its newest guess.
        inputs = {i: self.unseen(seqs[i]) for i in chains.active()}
        common = {i: self.keeps_to_common(seqs[i]) for i in inputs}
        self._count_read([len(tokens) for tokens in inputs.values()])
        while inputs:
            order = list(inputs)
            # A quantized draft reads its few unseen tokens one query at a time: that is
            # one C call for all its blocks (and bitwise what the fused path computes).
            segments = [Segment(self._cache(seqs[i]), len(inputs[i]), one_query_at_a_time=self._in_c) for i in order]
            device = self.draft.device
            flat = torch.tensor([t for i in order for t in inputs[i]], dtype=torch.int64, device=device)
            last_rows = torch.tensor([len(inputs[i]) for i in order], device=device).cumsum(0) - 1
            chains.add(order, self.draft(flat, segments, last_rows, [common[i] for i in order]))  # [len(order), width]
            # The newest guess is fed only if another one is wanted after it.
            inputs = {i: [chains.newest(i)] for i in chains.active()}
            if inputs and self.draft.static is not None:  # the rest of the chains in one graph
                caches = [self._cache(seqs[i]) for i in inputs]
                taken = chains.draft_on_the_device(self.draft.static, list(inputs), caches)
                if taken is not None:
                    for cache, fed in zip(caches, taken):
                        cache.length += fed  # the newest guess and each kept but the last
                    break
        return chains.drafts()

    def _catch_up(self, chunks: dict[int, list[int]], seqs: Sequence[SequenceView]) -> None:
        """Feed each sequence's chunk of unseen tokens into its draft cache."""
        segments = [Segment(self._cache(seqs[i]), len(chunk)) for i, chunk in chunks.items()]
        device = self.draft.device
        flat = torch.tensor([t for chunk in chunks.values() for t in chunk], dtype=torch.int64, device=device)
        self.draft(flat, segments, torch.empty(0, dtype=torch.int64, device=device))  # no logits wanted

    def observe(self, seqs: Sequence[SequenceView], num_accepted: Sequence[int]) -> None:
        for seq in seqs:
            cache = self.caches.get(seq.seq_id)
            if cache is not None:
                # Positions past the accepted prefix hold rejected guesses.
                cache.truncate(min(cache.length, len(seq.token_ids) - 1))

    def finished(self, seq: SequenceView) -> None:
        pass

    def free(self, seq_id: int) -> None:
        cache = self.caches.pop(seq_id, None)
        token_ids = self._token_ids.pop(seq_id, None)
        self._prompt_lengths.pop(seq_id, None)
        if cache is not None:
            release_into(self.prefix_cache, token_ids, cache)
