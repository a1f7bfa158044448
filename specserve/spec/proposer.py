"""What a proposer is: the `Draft` it returns and the `Proposer` protocol.

A proposer sees sequences only through `SequenceView` (an id and every token so far),
so n-gram lookup, a draft model, and heads on the target's hidden states are
interchangeable. k is ragged: each sequence asks for its own number of tokens, and a
proposer may return fewer (an n-gram lookup that finds nothing returns none). A head
also reads the target's features: its `features` (spec/features.py) names them, and the
engine hands over those of every target forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from specserve.sampling import SamplingParams
from specserve.spec.features import TargetFeatures


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [k] int64 on the CPU (the engine reads them as ints), k may be 0
    probs: torch.Tensor | None = None  # [k, V] float32 on the models' device; None = deterministic (one-hot) draft
    # 1 where the proposer guessed a first token and dropped it, too unlikely to pay for
    # its row (`Proposer.propose`): drafting cost it, and adaptive k counts the step.
    dropped: int = 0
    first_confidence: float | None = None  # the proposer's probability of its first guess, where it knows it

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def of(
        tokens: list[int], probs: torch.Tensor | None = None, dropped: int = 0, first_confidence: float | None = None
    ) -> Draft:
        return Draft(torch.tensor(tokens, dtype=torch.int64, device="cpu"), probs, dropped, first_confidence)

    @staticmethod
    def empty() -> Draft:
        return Draft.of([])


class SequenceView(Protocol):
    seq_id: int
    token_ids: list[int]  # prompt + output so far; the last one is the next step's input
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator  # an unseeded request's own random stream, shared with the verifier
    stop_token_ids: frozenset[int]  # EOS ids and the request's own: none before params.min_tokens
    prompt_distinct_ids: torch.Tensor  # [U] int64: what penalties read of the prompt (penalties.distinct_ids)

    def keyed_uniforms(self, start: int, count: int, device: torch.device) -> torch.Tensor:
        """A seeded request's draws [count] for its tokens at indices start.. (sampling.py)."""
        ...


class Proposer(Protocol):
    # The target's features it drafts from, which every target forward captures and
    # hands over (spec/features.py); None for a proposer that reads tokens only.
    features: TargetFeatures | None
    # How many tokens of its sequences the last `propose` call had to read before it
    # could draft (the most over the sequences; 0 for a proposer with no state): a draft
    # model catches up 1-2 after a drafting step, and every token decoded since after
    # plain steps, which makes that call no measure of what drafting costs.
    last_catch_up: int
    # How many tokens the last `propose` call read before drafting, over all sequences.
    last_tokens_read: int

    def backlog(self, seq: SequenceView) -> int:
        """Tokens of `seq` the proposer must read before it can draft for it (a draft
        model's whole prompt, the first time)."""
        ...

    def propose(
        self, seqs: Sequence[SequenceView], num_tokens: Sequence[int], least_chances: Sequence[float] | None = None
    ) -> list[Draft]:
        """Draft up to num_tokens[i] tokens after seqs[i].token_ids. A proposer that
        knows its guesses' probabilities drops a greedy sequence's first guess, and
        drafts nothing for it, where it gives that guess less than least_chances[i]
        (`AdaptiveSpecLength.least_chances`)."""
        ...

    def observe(self, seqs: Sequence[SequenceView], num_accepted: Sequence[int]) -> None:
        """Learn how many drafted tokens were accepted (after seqs were updated)."""
        ...

    def finished(self, seq: SequenceView) -> None:
        """`seq` ended (not preempted), its tokens final; `free` follows."""
        ...

    def free(self, seq_id: int) -> None:
        """Forget a sequence that ended or gave its caches up (preempted)."""
        ...
