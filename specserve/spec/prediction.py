"""Predicted outputs (OpenAI's `prediction`): drafts from the text a request expects.

A client that knows most of its answer beforehand (an editor asking for a change to a
file sends the file) sends it as the request's prediction. The answer stays the
target's own, token for token at temperature 0 and in distribution above it: the
prediction only proposes, a lookup whose drafts the target verifies like any other.

Which of its tokens are drafted: before the answer's first token, its start; after,
those that follow where the answer's last tokens (up to MAX_MATCH, the longest found)
occur in it, at the occurrence nearest after the last one drafted from, so that a
repeated line is read in order and, past an edit, drafting resumes at the next tokens
the answer and the prediction share.

Invariants: drafts are deterministic (one-hot for the verifier); `PredictedText` is
immutable once built (off the engine's thread; a request's choices share it), and each
sequence reads it through a `PredictionDrafts` of its own.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

MAX_MATCH = 6  # the longest run of the answer's last tokens looked up in the prediction


class PredictedText:
    """A prediction's token ids, with where every run of 1..MAX_MATCH of them ends."""

    def __init__(self, token_ids: Sequence[int]):
        self.token_ids = tuple(token_ids)
        # For n in 1..MAX_MATCH: each n-token run -> the positions just past its occurrences, ascending.
        self.ends: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(MAX_MATCH)]
        for end in range(1, len(self.token_ids) + 1):
            for n in range(1, min(MAX_MATCH, end) + 1):
                self.ends[n - 1].setdefault(self.token_ids[end - n : end], []).append(end)

    def __len__(self) -> int:
        return len(self.token_ids)

    def aligned(self, answer: Sequence[int], after: int) -> int | None:
        """Where in the prediction the answer's end lies: just past the longest run of
        its last tokens that the prediction holds, the occurrence nearest at or after
        `after` (else the last before it); 0 for an empty answer; None: no match."""
        if not answer:
            return 0
        for n in range(min(MAX_MATCH, len(answer)), 0, -1):
            ends = self.ends[n - 1].get(tuple(answer[-n:]))
            if ends:
                i = bisect.bisect_left(ends, after)
                return ends[i] if i < len(ends) else ends[-1]
        return None


@dataclass(eq=False)
class PredictionDrafts:
    """One sequence's reading of a prediction: where its answer was last aligned, and
    how many drafted tokens the target accepted and rejected (OpenAI's usage fields)."""

    text: PredictedText
    at: int = 0  # where the answer's end was last aligned in the prediction, plus what was accepted since
    pending: int = 0  # tokens of the step's draft taken from the prediction, to settle
    accepted: int = 0
    rejected: int = 0

    def draft(self, answer: Sequence[int], k: int) -> list[int]:
        """Up to k tokens the prediction expects after `answer` (the output so far)."""
        at = self.text.aligned(answer, self.at)
        if at is None or k <= 0:
            return []
        self.at = at
        return list(self.text.token_ids[at : at + k])

    def settle(self, accepted: int) -> None:
        """The step's verdict on its `pending` predicted tokens: `accepted` of them came next."""
        self.accepted += accepted
        self.rejected += self.pending - accepted
        self.pending = 0
        self.at += accepted  # the answer's end lies at least this far on: a repeated run is not read again
