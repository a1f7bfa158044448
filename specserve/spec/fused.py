"""Fused speculation: a greedy request's k draft steps, and the target's verification of
them, in one call into our C kernels (`"fused": true` in the speculative config).

Unfused, every draft step is a trip through Python: build the step's tensors, run the
draft's blocks (one C call for a quantized draft), its norm and head, an argmax, decide
whether to go on. On the 0.5B int4 draft that trip costs ~1 ms of a ~16 ms step, and
verification adds its own. kernels/speculate.c runs the same kernels in the same order
with nothing between them, so the drafts and the target's tokens are bitwise the
unfused path's, and greedy output stays the target's own.

What runs fused: greedy requests with a quantized draft (the C code runs only our
int4/int8 kernels). The target's verification joins the call when the target is
quantized too; otherwise the drafts come back and the target verifies them in its
usual PyTorch forward. Sampled requests take the unfused path: rejection sampling needs
the draft's probabilities, which the C code does not produce.

A greedy request whose rows are masked (allowed ids, min_tokens, bad words, a guide) or
that asks for logprobs still runs fused: its drafts are the raw argmaxes, as a graphed
chain guesses, and the call hands back its verified rows' logits (bfloat16, as the
target's head writes them), which the engine masks and reads as the unfused path does.
The drafts are only guesses, so the verdict stays the masked target's own.
"""

from __future__ import annotations

from typing import Sequence

from specserve.config import DEFAULT_PREFILL_CHUNK_SIZE
from specserve.errors import ConfigError
from specserve.model import native
from specserve.model.decoder import Decoder
from specserve.model.kv_cache import KVCache
from specserve.spec.draft_model import DraftModelProposer
from specserve.spec.proposer import Draft, SequenceView


class FusedDraftProposer(DraftModelProposer):
    """A `DraftModelProposer` whose greedy drafting runs in one C call per step, and
    which can also verify (`speculate`) when the target runs in C."""

    fuses = True

    def __init__(
        self,
        draft: Decoder,
        target: Decoder,
        confidence_threshold: float = 0.0,
        catch_up_chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE,
        special_ids: frozenset[int] = frozenset(),
    ):
        super().__init__(draft, confidence_threshold, catch_up_chunk_size, special_ids)
        if draft.model_in_c() is None:
            reason = native.unavailable_reason() or "the draft is not quantized"
            raise ConfigError(
                '"fused": true runs the draft in our C kernels, which take a quantized draft '
                '("quantization": "int4" or "int8") on an x86-64 CPU with AVX-512 VNNI and a C '
                f'compiler; here {reason}. Drop "fused" or quantize the draft'
            )
        self.target = target
        self.target_in_c = target.model_in_c()
        self.last_seconds = (0.0, 0.0)  # the last call's drafting and verifying time

    @property
    def verifies(self) -> bool:
        """Whether `speculate` can run the target's verification in the same call."""
        return self.target_in_c is not None

    def propose(
        self, seqs: Sequence[SequenceView], num_tokens: Sequence[int], least_chances: Sequence[float] | None = None
    ) -> list[Draft]:
        """Greedy sequences draft in C (their C chain stops at an unsure guess and knows no
        least_chances); sampled and penalised ones as `DraftModelProposer` drafts."""
        num_tokens = self.catch_up_prompts(seqs, num_tokens)
        in_c = [
            i
            for i, (s, k) in enumerate(zip(seqs, num_tokens))
            if k > 0 and s.params.greedy and not s.params.processes_logits
        ]  # C guesses from the raw logits
        drafts = self._draft(seqs, [0 if i in in_c else k for i, k in enumerate(num_tokens)])
        done = self._run([seqs[i] for i in in_c], [num_tokens[i] for i in in_c], None)
        for i, job in zip(in_c, done):
            drafts[i] = Draft.of(job.drafted)
        return drafts

    def speculate(
        self,
        seqs: Sequence[SequenceView],
        num_tokens: Sequence[int],
        target_caches: Sequence[KVCache],
        wants_logits: Sequence[bool],
    ) -> list[native.GreedySpeculation]:
        """Draft up to num_tokens[i] tokens for each greedy sequence and verify them with
        the target, whose cache for seqs[i] is target_caches[i] (holding every token but
        the newest). Returns each sequence's drafts, the target's argmax of every row and,
        where wants_logits[i], the rows' logits (for a host that masks them or reads their
        logprobs); each target cache then holds the newest token and every draft (the
        caller rolls back the rejected)."""
        assert self.verifies and all(s.params.greedy for s in seqs)
        num_tokens = self.catch_up_prompts(seqs, num_tokens)
        return self._run(seqs, num_tokens, target_caches, wants_logits)

    def _run(
        self,
        seqs: Sequence[SequenceView],
        num_tokens: Sequence[int],
        target_caches: Sequence[KVCache] | None,
        wants_logits: Sequence[bool] | None = None,
    ) -> list[native.GreedySpeculation]:
        """The C call for seqs (after `catch_up_prompts`); counts what the draft reads."""
        if not seqs:
            return []
        jobs = []
        wants_logits = wants_logits or [False] * len(seqs)
        draft_end = target_end = 0  # the furthest position each model reads, plus one
        for i, (seq, k) in enumerate(zip(seqs, num_tokens)):
            cache = self._cache(seq)
            unseen = self.unseen(seq) if k else []
            # The draft reads its unseen tokens and all guesses but the last.
            draft_end = max(draft_end, cache.length + len(unseen) + k - 1)
            cache.reserve(cache.length + len(unseen) + k - 1)
            target = None
            if target_caches is not None:
                target_cache = target_caches[i]
                target_end = max(target_end, target_cache.length + k + 1)
                target_cache.reserve(target_cache.length + k + 1)
                target = (target_cache.keys, target_cache.values, target_cache.length)
            draft_cache = (cache.keys, cache.values, cache.length)
            jobs.append(native.GreedySpeculation(draft_cache, target, unseen, seq.token_ids[-1], k, wants_logits[i]))
        target = None
        if target_caches is not None:
            target = (self.target_in_c, self.target.rope_table(target_end))
        # One call per draft head: sequences whose text keeps to the common ids guess
        # over those alone (as in DraftModelProposer, so the drafts stay the unfused ones).
        by_head: dict[bool, list[native.GreedySpeculation]] = {}
        for seq, job in zip(seqs, jobs):
            by_head.setdefault(self.keeps_to_common(seq), []).append(job)
        seconds = [
            native.speculate_greedy(
                self.draft.model_in_c(common),
                self.draft.rope_table(draft_end),
                target,
                group,
                self.confidence_threshold,
            )
            for common, group in by_head.items()
        ]
        self.last_seconds = (sum(s[0] for s in seconds), sum(s[1] for s in seconds))  # drafting, verifying
        for i, (seq, job) in enumerate(zip(seqs, jobs)):
            if job.drafted:
                self._cache(seq).length += len(job.unseen) + len(job.drafted) - 1
            if target_caches is not None:
                target_caches[i].length += len(job.drafted) + 1
        self._count_read([len(job.unseen) for job in jobs])
        return jobs
