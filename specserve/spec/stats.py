"""Speculative-decoding counters, as vLLM's spec-decode metrics count them.

Counters only grow; rates are derived from them, so stats from several steps, engines
or runs combine by adding. A step that drafted nothing is not a draft and counts
nowhere. Mean acceptance length counts the recovered or bonus token (1 + accepted /
drafts); both rates are None until something was drafted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecStats:
    num_drafts: int = 0  # steps that drafted at least one token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: how many times draft position i was accepted; as long as the longest draft
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """Count one sequence's step: num_drafted tokens proposed, num_accepted kept."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"need 0 <= num_accepted <= num_drafted, got {num_accepted} and {num_drafted}")
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self._grow_positions(num_drafted)
        for position in range(num_accepted):  # acceptance stops at the first rejection
            self.accepted_per_position[position] += 1

    def merge(self, other: SpecStats) -> None:
        """Add other's counts into self."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self._grow_positions(len(other.accepted_per_position))
        for position, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[position] += count

    def __add__(self, other: SpecStats) -> SpecStats:
        total = SpecStats()
        total.merge(self)
        total.merge(other)
        return total

    def __sub__(self, earlier: SpecStats) -> SpecStats:
        """What was counted since `earlier`, a copy of self taken before."""
        positions = [
            count - (earlier.accepted_per_position[i] if i < len(earlier.accepted_per_position) else 0)
            for i, count in enumerate(self.accepted_per_position)
        ]
        return SpecStats(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            positions,
        )

    def copy(self) -> SpecStats:
        return SpecStats() + self

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens."""
        if self.num_draft_tokens == 0:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per draft: 1 + accepted / drafts."""
        if self.num_drafts == 0:
            return None
        return 1 + self.num_accepted_tokens / self.num_drafts

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "accepted_per_position": list(self.accepted_per_position),
        }

    def _grow_positions(self, num_positions: int) -> None:
        missing = num_positions - len(self.accepted_per_position)
        if missing > 0:
            self.accepted_per_position.extend([0] * missing)
