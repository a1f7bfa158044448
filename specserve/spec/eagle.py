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

Prefix caching: a prompt prefix loaded from the target's prefix cache has no features;
the sequence's run starts at the first position the target computed, and the head reads
from there, counting its positions from 0 (RoPE is relative, so that is the same head).
It misses the prefix's context: fewer accepted guesses, never a wrong output. With CUDA
graphs, the target's steps capture the features inside the graph (model/graphs.py), and
the head's own steps (catch-ups of up to MAX_READ_ROWS pairs) run as graphs of their own
(`EagleHead.use_cuda_graphs`), each head cache a slot of the head's pool.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specserve.config import DEFAULT_PREFILL_CHUNK_SIZE
from specserve.model.decoder import Segment
from specserve.model.footprint import weight_bytes_per_token
from specserve.model.kv_cache import KVCache
from specserve.spec.features import TargetFeatures
from specserve.spec.guesses import DraftChains, Guesser
from specserve.spec.heads.eagle import EagleHead
from specserve.spec.proposer import Draft, SequenceView


class EagleProposer:
    def __init__(self, head: EagleHead, guesser: Guesser, catch_up_chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE):
        """head: with the target's embedding (and EAGLE-1's LM head) shared (`share_target`)."""
        self.head = head
        self.guesser = guesser
        self.catch_up_chunk_size = catch_up_chunk_size
        self.features = TargetFeatures(head.config.feature_layers)  # EAGLE-1: the final hidden state
        self.caches: dict[int, KVCache] = {}
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
        for i, (seq, k) in enumerate(zip(seqs, num_tokens)):
            if k > 0:
                unread = len(self.features.runs[seq.seq_id])
                reads[i] = min(unread, self.catch_up_chunk_size)
                if unread > self.catch_up_chunk_size:
                    wanted[i] = 0  # a long backlog: a chunk this call, drafts once it is read
        catch_ups = [max(reads[i] - self.regained.pop(seqs[i].seq_id, 0), 0) for i in reads]
        self.last_catch_up, self.last_tokens_read = max(catch_ups, default=0), sum(reads.values())
        if not reads:
            return [Draft.empty()] * len(seqs)
        last_hidden, last_logits = self._catch_up(seqs, reads)  # a row per sequence of `reads`
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

    def _catch_up(self, seqs: Sequence[SequenceView], reads: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Read each sequence's next reads[i] pairs into its head cache, in one head forward;
        returns each one's last output [len(reads), H] and its draft logits
        [len(reads), draft_vocab], in the order of `reads`."""
        segments, tokens, rows = [], [], []
        for i, n in reads.items():
            seq = seqs[i]
            run = self.features.runs[seq.seq_id]
            if seq.seq_id not in self.caches:
                self.caches[seq.seq_id] = self.head.new_cache()
            cache = self.caches[seq.seq_id]
            cache.truncate(run.start - run.origin)  # 0 where the run started anew (features.py)
            start = run.start
            rows.append(run.take(n))  # [n, F]: positions [start, start + n)
            tokens.extend(seq.token_ids[start + 1 : start + 1 + n])
            segments.append(Segment(cache, n))
        features = self.head.project_target_features(torch.cat(rows))  # [T, H]
        last_rows = torch.tensor(list(reads.values()), device=self.head.device).cumsum(0) - 1
        out, logits = self.head.step(torch.tensor(tokens, device=self.head.device), features, segments, last_rows)
        return out[last_rows], logits

    def observe(self, seqs: Sequence[SequenceView], num_accepted: Sequence[int]) -> None:
        for seq, accepted in zip(seqs, num_accepted):
            self.features.truncate(seq.seq_id, len(seq.token_ids) - 1)  # rejected drafts' rows
            guesses = self.last_guesses.pop(seq.seq_id, 0)
            if guesses:  # the chain fed its first guesses - 1: those accepted are re-read, not new
                self.regained[seq.seq_id] = min(accepted, guesses - 1)
        self.last_guesses.clear()  # a sequence that failed or left: nothing to count

    def free(self, seq_id: int) -> None:
        self.features.free(seq_id)
        cache = self.caches.pop(seq_id, None)
        if cache is not None:
            cache.release()  # a pool slot, with CUDA graphs
        self.regained.pop(seq_id, None)
        self.last_guesses.pop(seq_id, None)
