"""N-gram (prompt lookup) proposer: guess that the text repeats what followed its suffix.

For each sequence, the longest suffix of n tokens (prompt_lookup_max down to
prompt_lookup_min) that also occurs earlier in the sequence wins; the draft is the
tokens that followed its most recent earlier occurrence, at most the requested number
and fewer where the history ends. No match gives an empty draft.

Invariants: drafts are deterministic (`Draft.probs is None`, one-hot for the verifier);
the proposer keeps no per-sequence state, so `observe` and `free` have nothing to do.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from specserve.errors import ConfigError
from specserve.spec.proposer import Draft, SequenceView


class NgramProposer:
    features = None  # reads tokens only

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if prompt_lookup_min < 1 or prompt_lookup_max < prompt_lookup_min:
            raise ConfigError(
                "n-gram sizes need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{prompt_lookup_min} and {prompt_lookup_max}"
            )
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.last_catch_up = self.last_tokens_read = 0  # a lookup reads nothing ahead of time

    def backlog(self, seq: SequenceView) -> int:
        return 0

    def propose(
        self, seqs: Sequence[SequenceView], num_tokens: Sequence[int], least_chances: Sequence[float] | None = None
    ) -> list[Draft]:
        """A lookup has no probabilities: least_chances does not apply."""
        return [self.propose_one(seq.token_ids, k) for seq, k in zip(seqs, num_tokens, strict=True)]

    def propose_one(self, token_ids: Sequence[int], num_tokens: int) -> Draft:
        """Draft up to num_tokens tokens after token_ids."""
        length = len(token_ids)
        if num_tokens <= 0 or length <= self.prompt_lookup_min:
            return Draft.empty()
        tokens = np.fromiter(token_ids, dtype=np.int64, count=length)  # [L]
        match_len = _suffix_match_lengths(tokens, self.prompt_lookup_max)  # [L]
        longest = int(match_len.max())
        if longest < self.prompt_lookup_min:
            return Draft.empty()
        # The most recent occurrence of the longest matching suffix ends at `end`, and
        # the token at `end` is what followed it.
        end = length - 1 - int(np.argmax(match_len[::-1] == longest))
        return Draft(torch.from_numpy(tokens[end : end + num_tokens].copy()))

    def observe(self, seqs: Sequence[SequenceView], num_accepted: Sequence[int]) -> None:
        pass

    def free(self, seq_id: int) -> None:
        pass


def _suffix_match_lengths(tokens: np.ndarray, max_len: int) -> np.ndarray:
    """tokens [L] -> [L]: entry e is the largest n <= max_len with tokens[e-n:e] equal to
    the last n tokens. Entry L-1 is the last candidate: an occurrence must be followed by
    at least one token, so the suffix itself (ending at L) is never a candidate."""
    length = len(tokens)
    match_len = np.zeros(length, dtype=np.int64)  # [L]
    still_matching = np.ones(length, dtype=bool)  # [L]
    for n in range(1, min(max_len, length - 1) + 1):
        # Window ending at e extends to n tokens if tokens[e-n] equals the suffix's.
        still_matching[:n] = False
        still_matching[n:] &= tokens[: length - n] == tokens[length - n]
        if not still_matching.any():
            break
        match_len += still_matching
    return match_len
