"""The Medusa proposer: head i guesses the token i + 1 places after the newest one, all
from one feature (spec/heads/medusa.py).

The feature is the target's last hidden state (after its final norm) at the row that
produced the newest token: the last verified row of the step's own target forward, so
drafting costs no target forward of its own. Draft position i takes head i's scores (a
chain of argmaxes, as vLLM's proposer takes them; sampled with the request's params,
each position from its own head's distribution, for temperature > 0, which keeps
rejection sampling lossless), and head i runs only for the chains still going there: a
dropped first guess costs one head, not k.
Guesses as guesses.py makes them, penalties included.

The heads keep no cache: of each sequence's features (`TargetFeatures`) only the newest
verified row is kept (`observe`), so rollback is cutting the run and nothing reads ahead.
k is at most the number of heads (config: SpecConfig.for_medusa_heads).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specserve.model.footprint import weight_bytes_per_token
from specserve.spec.features import TargetFeatures
from specserve.spec.guesses import DraftChains, Guesser
from specserve.spec.heads.medusa import MedusaHeads
from specserve.spec.proposer import Draft, SequenceView


class MedusaProposer:
    def __init__(self, heads: MedusaHeads, guesser: Guesser):
        self.heads = heads
        self.guesser = guesser
        self.features = TargetFeatures()  # the final hidden state
        self.last_catch_up = self.last_tokens_read = 0  # reads nothing ahead of drafting

    def bytes_per_position(self) -> int:
        """Weight bytes a draft position reads: one head's blocks and LM head."""
        return weight_bytes_per_token(self.heads.blocks[0]) + weight_bytes_per_token(self.heads.lm_head(0))

    def describe(self) -> str:
        """How this proposer drafts, for the server's start-up line."""
        return f"{self.heads.config.num_heads} Medusa heads guess from the target's last feature"

    def backlog(self, seq: SequenceView) -> int:
        return 0

    def propose(
        self, seqs: Sequence[SequenceView], num_tokens: Sequence[int], least_chances: Sequence[float] | None = None
    ) -> list[Draft]:
        chains = DraftChains(seqs, num_tokens, self.guesser, least_chances)
        order = chains.active()
        if not order:
            return chains.drafts()
        newest = torch.stack([self.features.runs[seqs[i].seq_id].newest() for i in order])  # [B, H]
        # Head by head, each for the chains still going: a first guess dropped, or a chain
        # that stops early, costs none of the heads after it.
        with torch.inference_mode():
            for position in range(max(num_tokens[i] for i in order)):
                going_on = chains.active()
                if not going_on:
                    break
                rows = newest[[order.index(i) for i in going_on]]  # [b, H]
                chains.add(going_on, self.heads.head_scores(rows, position), self.heads.target_ids)
        return chains.drafts()

    def observe(self, seqs: Sequence[SequenceView], num_accepted: Sequence[int]) -> None:
        for seq in seqs:  # only the newest verified row is read
            self.features.runs[seq.seq_id].keep_only(len(seq.token_ids) - 2)

    def finished(self, seq: SequenceView) -> None:
        pass

    def free(self, seq_id: int) -> None:
        self.features.free(seq_id)
