"""Predicted outputs (OpenAI's `prediction`): drafts from the text a request expects.

A client that knows most of its answer beforehand (an editor asking for a change to a
file sends the file) sends it as the request's prediction. The answer stays the
target's own, token for token at temperature 0 and in distribution above it: the
prediction only proposes, a lookup whose drafts the target verifies like any other.

Which of its tokens are drafted: before the answer's first token, its start; after,
those that follow where the answer's last tokens (up to MAX_MATCH, the longest found)
occur in it, at the occurrence nearest after the last one drafted from, so that a
repeated line is read in order and, past an edit, drafting resumes at the next tokens
the answer and the prediction share. Where no policy prices the rows, a prediction's
first verified draft holds at most WARY_FIRST tokens, and one rejected whole
WARY_AFTER times in a row drafts only from WARY_MATCH matched tokens.

Invariants: drafts are deterministic (one-hot for the verifier); `PredictedText` is
immutable (a request's choices share it), and each sequence reads it through a
`PredictionDrafts` of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_MATCH = 6  # the longest run of the answer's last tokens looked up in the prediction
# Where no policy prices a draft's rows (an engine without adaptive k), a prediction
# whose last WARY_AFTER drafts were rejected whole drafts again only from a match of
# WARY_MATCH tokens: a prediction the answer does not follow would otherwise verify a
# row every step from one-token matches, which every request of the batch pays for
# (benchmarks/EXPERIMENTS.md, "A prediction the answer does not follow").
WARY_AFTER = 4
WARY_MATCH = 3
# And its first draft, before the target has judged any, holds WARY_FIRST tokens at most
# (the engine's 1 + 2a then grows k as drafts are accepted: 3, 7, 15), so that a wrong
# prediction's start costs its batch 3 rows, not 15.
WARY_FIRST = 3


class PredictedText:
    """A prediction's token ids, searched with numpy at each step rather than indexed
    up front: building a Python index of a long prediction holds the interpreter, which
    the engine's thread shares. A search is a pass over the ids for the answer's last
    token, then one over those matches per token before it (benchmarks/EXPERIMENTS.md,
    "A prediction searched, not indexed")."""

    def __init__(self, token_ids: Sequence[int]):
        self.ids = np.asarray(token_ids, dtype=np.int64)  # [P]

    def __len__(self) -> int:
        return len(self.ids)

    def aligned(self, answer: Sequence[int], after: int, least_match: int = 1) -> int | None:
        """Where in the prediction the answer's end lies: just past the longest run of
        its last tokens (up to MAX_MATCH) that the prediction holds, the occurrence
        nearest at or after `after` (else the last before it); 0 for an empty answer;
        None: no match, or none of least_match tokens (or of the whole answer, if shorter)."""
        if not answer:
            return 0
        ends = np.flatnonzero(self.ids == answer[-1]) + 1  # [M]: just past each match of its last token
        matched = 1
        for n in range(2, min(MAX_MATCH, len(answer)) + 1):
            starts = ends - n
            longer = ends[(starts >= 0) & (self.ids[np.maximum(starts, 0)] == answer[-n])]
            if not len(longer):
                break
            ends, matched = longer, n
        if not len(ends) or matched < min(least_match, len(answer)):
            return None
        i = int(np.searchsorted(ends, after))
        return int(ends[min(i, len(ends) - 1)])


@dataclass(eq=False)
class PredictionDrafts:
    """One sequence's reading of a prediction: where its answer was last aligned, and
    how many drafted tokens the target accepted and rejected (OpenAI's usage fields)."""

    text: PredictedText
    at: int = 0  # where the answer's end was last aligned in the prediction, plus what was accepted since
    pending: int = 0  # tokens of the step's draft taken from the prediction, to settle
    accepted: int = 0
    rejected: int = 0
    followed_at: int | None = None  # the answer's length after its last step that accepted predicted tokens
    misses: int = 0  # drafts in a row rejected whole

    def draft(self, answer: Sequence[int], k: int, wary: bool = False) -> list[int]:
        """Up to k tokens the prediction expects after `answer` (the output so far);
        wary (no policy prices the rows): WARY_FIRST tokens at most until a draft is
        judged, and after WARY_AFTER misses, only from a match of WARY_MATCH tokens."""
        if wary and not (self.accepted or self.rejected):
            k = min(k, WARY_FIRST)
        if k <= 0:
            return []
        least_match = WARY_MATCH if wary and self.misses >= WARY_AFTER else 1
        at = self.text.aligned(answer, self.at, least_match)
        if at is None:
            return []
        self.at = at
        return self.text.ids[at : at + k].tolist()

    def settle(self, accepted: int, answer_length: int) -> None:
        """The step's verdict on its `pending` predicted tokens: `accepted` of them came
        next, the answer now `answer_length` tokens long."""
        if accepted:
            self.followed_at = answer_length
        self.misses = 0 if accepted else self.misses + 1
        self.accepted += accepted
        self.rejected += self.pending - accepted
        self.pending = 0
        self.at += accepted  # the answer's end lies at least this far on: a repeated run is not read again
