"""The EAGLE proposer (EAGLE-1/2 and EAGLE-3): a one-layer head drafts from the target's
features (spec/heads/eagle.py).

Per sequence it keeps the head's own KV cache and, in `features` (spec/features.py), the
target's features of the positions the head has not read. Drafting first reads, in one
head forward over every drafting sequence (a Segment each), the pairs (target feature of
position p, token at p + 1) of the positions not read yet (catch-up); the output of the
last pair guesses the next token. Each further draft position feeds the head's own output
feature and its guess back (a chain, as vLLM's proposer drafts). Guesses as guesses.py
makes them: greedy through the head's draft vocabulary, sampled from its distribution
with the request's params and generator, penalised as the target will be.

Invariant between calls: a sequence's head cache holds the pairs of positions
[origin, start) of its feature run, read with the target's features, and nothing else.
The chain's pairs come from the head's own features, so they are cut away once it has
guessed, and the positions the target then verified are read again with the target's
features, as vLLM does. Rollback after a rejection is therefore cutting the run
(`observe`) to the verified positions.

Adaptive k (Proposer.last_catch_up, backlog): re-reading the positions of accepted
guesses happens in the forward that makes the first guess, as a draft model feeds its
recovered or bonus token; what counts as catch-up is the positions the last chain did not
guess right, so after a drafting step a head catches up 1-2, as a draft model does, and
after plain steps every token decoded since. A long backlog (a new sequence's prompt) is
read a chunk per call, with no draft for that sequence until it is read.

Context the target did not compute: a prompt prefix the target loaded from its prefix
cache, or copied from a sibling choice (the same prompt), has no features, so the run
starts at the first position the target computed (its `origin`). The head then takes its
own cache of the positions before it from what read them: another sequence whose head
read the same tokens there (to the token), or the head's own `prefix_cache` of finished
sequences (the same blocks as the target's, keyed by pairs: a pair at p depends on the
tokens up to p + 1, `pair_keys`; a leaving sequence's head first reads the pairs its
last steps verified, READ_AS_IT_LEAVES at most, so that its blocks end where the
target's do), and reads on as if it had read them itself. Where a sequence that reads
them drafts in this call, it waits a call for them. Where neither holds them, it reads
from the origin, counting its positions from 0 (RoPE is relative, so that is the same
head), without the context: fewer accepted guesses, never a wrong output. Only a cache
whose positions are the sequence's (origin 0) is a source.

With CUDA graphs, the target's steps capture the features inside the graph
(model/graphs.py), and the head's own steps (catch-ups of up to MAX_READ_ROWS pairs) run
as graphs of their own (`EagleHead.use_cuda_graphs`), each head cache a slot of the
head's pool.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from specserve.config import DEFAULT_PREFILL_CHUNK_SIZE
from specserve.model.decoder import Segment
from specserve.model.footprint import weight_bytes_per_token
from specserve.model.kv_cache import KVCache
from specserve.model.prefix_cache import BLOCK, PrefixCache, copy_prefix, release_into
from specserve.spec.features import FeatureRun, TargetFeatures
from specserve.spec.guesses import DraftChains, Guesser
from specserve.spec.heads.eagle import EagleHead
from specserve.spec.proposer import Draft, SequenceView

log = logging.getLogger("specserve")

# The most pairs a leaving sequence's head reads to store its last block (see free).
READ_AS_IT_LEAVES = 2 * BLOCK


class EagleProposer:
    def __init__(self, head: EagleHead, guesser: Guesser, catch_up_chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE):
        """head: with the target's embedding (and EAGLE-1's LM head) shared (`share_target`)."""
        self.head = head
        self.guesser = guesser
        self.catch_up_chunk_size = catch_up_chunk_size
        self.features = TargetFeatures(head.config.feature_layers)  # EAGLE-1: the final hidden state
        self.caches: dict[int, KVCache] = {}
        self.prefix_cache: PrefixCache | None = None  # the head's own, where the target has one (see above)
        self._token_ids: dict[int, list[int]] = {}  # each cache's sequence's tokens (the live list)
        self.last_guesses: dict[int, int] = {}  # guesses of a sequence's draft in this step (see `observe`)
        self.regained: dict[int, int] = {}  # unread positions whose accepted guess the head made (catch-up)
        self.last_catch_up = self.last_tokens_read = 0  # see Proposer

    def bytes_per_position(self) -> int:
        """Weight bytes a draft position reads: the head's, and EAGLE-1's use of the target's LM head."""
        lent_head = self.head.target.lm_head if self.head.config.version == 1 else None
        return weight_bytes_per_token(self.head) + (0 if lent_head is None else weight_bytes_per_token(lent_head))

    def describe(self) -> str:
        """How this proposer drafts, for the server's start-up line."""
        return f"an EAGLE-{self.head.config.version} head drafts a chain on the target's features"

    def backlog(self, seq: SequenceView) -> int:
        return len(self.features.runs[seq.seq_id]) - self.regained.get(seq.seq_id, 0)

    def propose(
        self, seqs: Sequence[SequenceView], num_tokens: Sequence[int], least_chances: Sequence[float] | None = None
    ) -> list[Draft]:
        wanted = list(num_tokens)
        reads: dict[int, int] = {}  # sequence index -> pairs its catch-up reads
        waiting = self._take_context(seqs, num_tokens)
        for i, (seq, k) in enumerate(zip(seqs, num_tokens)):
            if i in waiting:
                wanted[i] = 0
            elif k > 0:
                unread = len(self.features.runs[seq.seq_id])
                reads[i] = min(unread, self.catch_up_chunk_size)
                if unread > self.catch_up_chunk_size:
                    wanted[i] = 0  # a long backlog: a chunk this call, drafts once it is read
        catch_ups = [max(reads[i] - self.regained.pop(seqs[i].seq_id, 0), 0) for i in reads]
        self.last_catch_up, self.last_tokens_read = max(catch_ups, default=0), sum(reads.values())
        if not reads:
            return [Draft.empty()] * len(seqs)
        # a row per sequence of `reads`
        last_hidden, last_logits = self._catch_up([(seqs[i].seq_id, seqs[i].token_ids, n) for i, n in reads.items()])
        read_ends = {i: self.caches[seqs[i].seq_id].length for i in reads}

        chains = DraftChains(seqs, wanted, self.guesser, least_chances)
        order = chains.active()
        row = {i: r for r, i in enumerate(reads)}
        picked = torch.tensor([row[i] for i in order], dtype=torch.int64, device=self.head.device)
        hidden, logits = last_hidden[picked], last_logits[picked]  # [len(order), H], [len(order), draft_vocab]
        while order:
            chains.add(order, logits, self.head.target_ids)
            going_on = chains.active()
            if not going_on:
                break
            row = {i: r for r, i in enumerate(order)}
            fed = hidden[[row[i] for i in going_on]]  # [len(going_on), H]: the features of their newest guesses
            caches = [self.caches[seqs[i].seq_id] for i in going_on]
            if (
                self.head.static is not None
                and chains.draft_on_the_device(self.head.static, going_on, caches, fed, self.head.target_ids)
                is not None
            ):
                break  # the rest of the chains in one graph
            hidden, logits = self.head.step(
                torch.tensor([chains.newest(i) for i in going_on], device=self.head.device),
                fed,
                [Segment(cache, 1) for cache in caches],
                logits_rows=torch.arange(len(going_on), device=self.head.device),
            )  # [len(going_on), H], [len(going_on), draft_vocab]
            order = going_on
        for i, end in read_ends.items():
            self.caches[seqs[i].seq_id].truncate(end)  # the chain's pairs: read with the head's own features
        drafts = chains.drafts()
        guessed = {i: drafts[i].num_tokens + drafts[i].dropped for i in reads}
        self.last_guesses = {seqs[i].seq_id: n for i, n in guessed.items() if n}
        return drafts

    def _take_context(self, seqs: Sequence[SequenceView], num_tokens: Sequence[int]) -> set[int]:
        """Give each drafting sequence new to the head whose run starts past position 0
        the head's cache of the positions before it, where another sequence's head cache
        or the prefix cache holds them (see above); returns the indices of those that
        wait a call for a sequence that reads them in it."""
        waiting = set()
        for i, seq in enumerate(seqs):
            run = self.features.runs[seq.seq_id]
            if not num_tokens[i] or seq.seq_id in self.caches or run.origin == 0:
                continue
            context = seq.token_ids[: run.origin + 1]  # what the pairs of positions [0, origin) read
            if self._load_context(seq, context):
                run.origin = 0  # its cache holds positions [0, start), as if it had read them
            elif any(
                num_tokens[j] and other is not seq and self._reads(other.seq_id, other.token_ids, context)
                for j, other in enumerate(seqs)
            ):
                waiting.add(i)
        return waiting

    def _reads(self, seq_id: int, token_ids: list[int], context: list[int]) -> bool:
        """Whether seq_id's head reads, or has read, the pairs that `context` makes, at their positions."""
        run = self.features.runs[seq_id]
        return run.origin == 0 and run.end >= len(context) - 1 and token_ids[: len(context)] == context

    def _load_context(self, seq: SequenceView, context: list[int]) -> bool:
        """Give seq a head cache of the len(context) - 1 pairs that `context` makes, from
        another sequence's cache or the prefix cache, where one holds them all."""
        length = len(context) - 1
        source = next(
            (
                self.caches[i]
                for i, token_ids in self._token_ids.items()
                if self.caches[i].length >= length and self._reads(i, token_ids, context)
            ),
            None,
        )
        if source is not None:
            copy_prefix(source, self._new_cache(seq.seq_id, seq.token_ids), length)
            return True
        if self.prefix_cache is None:
            return False
        pairs = pair_keys(context, self.head.config.layer.vocab_size)
        if self.prefix_cache.cached_length(pairs, length) < length:
            return False
        self.prefix_cache.load(pairs, self._new_cache(seq.seq_id, seq.token_ids), length)
        return True

    def _new_cache(self, seq_id: int, token_ids: list[int]) -> KVCache:
        cache = self.caches[seq_id] = self.head.new_cache()
        self._token_ids[seq_id] = token_ids
        return cache

    def _catch_up(
        self, reads: list[tuple[int, list[int], int]], logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Read each (seq_id, token_ids, n)'s next n pairs into its head cache, in one head
        forward; returns each one's last output [len(reads), H] and, where `logits`, its
        draft logits [len(reads), draft_vocab], in the order of `reads`."""
        segments, tokens, rows = [], [], []
        for seq_id, token_ids, n in reads:
            run = self.features.runs[seq_id]
            cache = self.caches[seq_id] if seq_id in self.caches else self._new_cache(seq_id, token_ids)
            cache.truncate(run.start - run.origin)  # 0 where the run started anew (features.py)
            start = run.start
            rows.append(run.take(n))  # [n, F]: positions [start, start + n)
            tokens.extend(token_ids[start + 1 : start + 1 + n])
            segments.append(Segment(cache, n))
        features = self.head.project_target_features(torch.cat(rows))  # [T, H]
        last_rows = torch.tensor([n for *_, n in reads], device=self.head.device).cumsum(0) - 1
        wanted = last_rows if logits else None
        out, draft_logits = self.head.step(torch.tensor(tokens, device=self.head.device), features, segments, wanted)
        return out[last_rows], draft_logits

    def observe(self, seqs: Sequence[SequenceView], num_accepted: Sequence[int]) -> None:
        for seq, accepted in zip(seqs, num_accepted):
            self.features.truncate(seq.seq_id, len(seq.token_ids) - 1)  # rejected drafts' rows
            guesses = self.last_guesses.pop(seq.seq_id, 0)
            if guesses:  # the chain fed its first guesses - 1: those accepted are re-read, not new
                self.regained[seq.seq_id] = min(accepted, guesses - 1)
        self.last_guesses.clear()  # a sequence that failed or left: nothing to count

    def finished(self, seq: SequenceView) -> None:
        pass

    def free(self, seq_id: int) -> None:
        run = self.features.runs.get(seq_id)
        # Stored where its positions are the sequence's; released (a pool slot) in any case.
        storing = self.prefix_cache is not None and seq_id in self.caches and run is not None and run.origin == 0
        try:
            if storing:
                self._read_to_a_block_end(seq_id, run)
        except Exception:
            log.exception("reading the rest of sequence %d's features failed; its head cache is kept as it is", seq_id)
        self.features.free(seq_id)
        cache, token_ids = self.caches.pop(seq_id, None), self._token_ids.pop(seq_id, None)
        if cache is not None:
            keys = pair_keys(token_ids, self.head.config.layer.vocab_size) if storing else []
            release_into(self.prefix_cache if storing else None, keys, cache)
        self.regained.pop(seq_id, None)
        self.last_guesses.pop(seq_id, None)

    def _read_to_a_block_end(self, seq_id: int, run: FeatureRun) -> None:
        """Read a leaving sequence's unread pairs up to the last whole block of the prefix
        cache, which its last steps verified and no draft has read, so that the prefix
        cache holds the positions the target's holds: where they are at most
        READ_AS_IT_LEAVES (a drafting sequence's), never a long backlog of plain steps,
        which would hold up its batch's step."""
        token_ids = self._token_ids[seq_id]
        run.truncate(min(run.end, len(token_ids) - 1))  # rows of a failed step's drafts
        n = run.end // BLOCK * BLOCK - run.start
        if 0 < n <= READ_AS_IT_LEAVES:
            self._catch_up([(seq_id, token_ids, n)], logits=False)


def pair_keys(token_ids: list[int], vocab_size: int) -> list[int]:
    """The head's pairs as the keys of its prefix cache: position p's pair reads the
    target's feature there (of tokens up to p) and token p + 1, so it is keyed by both."""
    return [a * vocab_size + b for a, b in zip(token_ids, token_ids[1:])]
