"""The engine: one `step()` advances every running sequence by one verified step.

A step asks the proposer for each sequence's drafts (ragged k), then feeds the target,
in ONE forward pass over the whole batch, each sequence's unseen tokens (the prompt
on its first step, else its newest token) followed by its drafts, and scores the last
k+1 positions of each. The verifier turns those logits into 1..k+1 tokens per
sequence, the target cache is rolled back past rejected drafts, and the proposer is
told what was accepted.

A sequence's first step is its prefill and drafts nothing, so time to first token is
what it would be without speculation.
"""

from __future__ import annotations

import itertools
from typing import Sequence as Seq

import torch

from specserve.errors import ConfigError
from specserve.engine.sequence import Sequence
from specserve.model.decoder import Decoder, Segment
from specserve.sampling import SamplingParams
from specserve.spec.proposer import Draft, Proposer
from specserve.spec.stats import SpecStats
from specserve.spec.verify import verify


class Engine:
    def __init__(
        self,
        target: Decoder,
        eos_token_ids: Seq[int],
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 0,
        max_model_len: int | None = None,
    ):
        self.target = target
        self.eos_token_ids = frozenset(eos_token_ids)
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        self.max_model_len = max_model_len or target.config.max_position_embeddings
        self.running: dict[int, Sequence] = {}
        self.spec_stats = SpecStats()  # every sequence's drafts, for metrics
        self._next_id = itertools.count()

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        if not prompt_ids:
            raise ConfigError("the prompt is empty: give at least one token")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ConfigError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"is {total} tokens, more than the maximum model length {self.max_model_len}; "
                "shorten the prompt or lower max_tokens"
            )
        vocab = self.target.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"prompt token ids {bad[:3]} are outside the vocabulary [0, {vocab})")
        stops = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.eos_token_ids
        seq = Sequence(
            seq_id=next(self._next_id),
            token_ids=list(prompt_ids),
            num_prompt_tokens=len(prompt_ids),
            params=params,
            generator=params.make_generator(),
            cache=self.target.new_cache(),
            stop_token_ids=stops,
        )
        self.running[seq.seq_id] = seq
        return seq

    def abort(self, seq_id: int) -> None:
        self.running.pop(seq_id, None)
        if self.proposer is not None:
            self.proposer.free(seq_id)

    def _num_draft_tokens(self, seq: Sequence) -> int:
        if seq.cache.length == 0:  # prefill step: draft nothing, keep TTFT unchanged
            return 0
        # A step emits at most k + 1 tokens; drafting past max_tokens is wasted work.
        return max(0, min(self.num_speculative_tokens, seq.remaining_tokens - 1))

    def step(self) -> list[Sequence]:
        """Advance every running sequence by one step; return those that finished."""
        seqs = list(self.running.values())
        if not seqs:
            return []
        wanted = [self._num_draft_tokens(s) for s in seqs]
        drafts = [Draft.empty()] * len(seqs)
        if self.proposer is not None and any(wanted):
            drafts = self.proposer.propose(seqs, wanted)

        inputs = [s.token_ids[s.cache.length :] + d.tokens.tolist() for s, d in zip(seqs, drafts)]
        segments = [Segment(s.cache, len(tokens)) for s, tokens in zip(seqs, inputs)]
        ends = torch.tensor([len(tokens) for tokens in inputs]).cumsum(0)
        # Score the last k+1 positions of each sequence: its newest token and its drafts.
        rows = torch.cat([torch.arange(end - d.num_tokens - 1, end) for end, d in zip(ends, drafts)])
        flat = torch.tensor([t for tokens in inputs for t in tokens], dtype=torch.int64)
        logits = self.target(flat, segments, rows)  # [sum(k_i + 1), V]

        num_accepted = []
        for seq, draft, seq_logits in zip(seqs, drafts, logits.split([d.num_tokens + 1 for d in drafts])):
            verdict = verify(seq_logits, draft, seq.params, seq.generator)
            seq.append(verdict.tokens)
            seq.cache.truncate(min(seq.cache.length, len(seq.token_ids) - 1))
            if draft.num_tokens:
                seq.spec.record(draft.num_tokens, verdict.num_accepted)
                self.spec_stats.record(draft.num_tokens, verdict.num_accepted)
            num_accepted.append(verdict.num_accepted)
        if self.proposer is not None:
            self.proposer.observe(seqs, num_accepted)

        finished = [s for s in seqs if s.finished]
        for seq in finished:
            self.abort(seq.seq_id)
        return finished

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Run one request to completion on its own."""
        seq = self.add_request(prompt_ids, params)
        while not seq.finished:
            self.step()
        return seq
