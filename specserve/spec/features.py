"""The target's features that a head proposer drafts from (EAGLE, Medusa), kept per sequence
until the head reads them.

The contract with the engine: a proposer that drafts from features has a `TargetFeatures`
(`Proposer.features`; None for one that reads tokens only). The engine captures
`new_capture()` in every target forward (prompt chunks, plain steps, verifications) and
hands the capture over with `read`, naming the rows each sequence fed. So a head sees
every position the target computed, whether or not it drafted in that step.

Each sequence's features form one `FeatureRun`: the rows of positions [start, end) not
read yet, after `origin`, where the run began. Invariant (kept by the proposer's
`observe`, which cuts the run to `len(token_ids) - 1` as the engine cuts the target's
cache): after each step a run holds verified positions only, so rows of rejected drafts
never reach a head.

Positions the target loaded from its prefix cache have no features (no forward computed
them): rows that do not continue a run (a gap) start a new run there, and the head reads
from that position on (spec/eagle.py). Rows are copies: a view would keep a whole
forward's capture alive for as long as one sequence waits to be read. A sequence that
decodes plainly for n steps holds n rows (EAGLE-3 reads 3 hidden sizes a row: on a
Llama-3.1-8B target 24 KiB, a fifth of its KV cache per position).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from specserve.model.decoder import Capture


class FedRows(NamedTuple):
    """The rows one sequence fed a target forward, in the order of its stream."""

    seq_id: int
    start: int  # position of its first row: its cache's length before the forward
    num_rows: int


@dataclass
class FeatureRun:
    origin: int  # the first position of the run: the head's position 0
    start: int  # the first position not read yet
    chunks: list[torch.Tensor] = field(default_factory=list)  # rows of positions [start, end), in order: [n_i, F]

    def __len__(self) -> int:
        return sum(chunk.shape[0] for chunk in self.chunks)

    @property
    def end(self) -> int:
        return self.start + len(self)

    def take(self, n: int) -> torch.Tensor:  # [n, F]
        """Read the rows of positions [start, start + n)."""
        rows = self._joined()
        self.chunks = [rows[n:]] if n < rows.shape[0] else []
        self.start += n
        return rows[:n]

    def truncate(self, end: int) -> None:
        """Forget the rows of positions from `end` on (drafts the target rejected)."""
        keep = end - self.start
        assert keep >= 0, f"position {end} was read already (the run reads from {self.start})"
        if keep < len(self):
            self.chunks = [self._joined()[:keep]] if keep else []

    def newest(self) -> torch.Tensor:  # [F]
        """The row of position end - 1."""
        return self.chunks[-1][-1]

    def forget_before(self, position: int) -> None:
        """Drop the rows of positions before `position` unread (for a head that reads the newest alone)."""
        if position > self.start:
            self.take(position - self.start)

    def _joined(self) -> torch.Tensor:  # [len(self), F]
        if len(self.chunks) > 1:
            self.chunks = [torch.cat(self.chunks)]
        return self.chunks[0]


class TargetFeatures:
    def __init__(self, layers: tuple[int, ...] = ()):
        """layers: the target layers whose inputs the head reads, concatenated (EAGLE-3);
        none: the last hidden state after the final norm (EAGLE-1, Medusa)."""
        self.layers = layers
        self.runs: dict[int, FeatureRun] = {}

    def new_capture(self) -> Capture:
        """What one target forward must capture."""
        return Capture(layers=self.layers, final=not self.layers)

    def read(self, capture: Capture, fed: Sequence[FedRows]) -> None:
        """Keep each sequence's rows of a forward that captured `new_capture()`; `fed` in
        the order of the forward's stream."""
        rows = capture.layer_inputs if self.layers else capture.final_hidden  # [T, F]
        first = 0
        for seq_id, start, num_rows in fed:
            run = self.runs.get(seq_id)
            if run is None or run.end != start:  # new, or after positions no forward computed
                run = self.runs[seq_id] = FeatureRun(origin=start, start=start)
            run.chunks.append(rows[first : first + num_rows].clone())
            first += num_rows

    def truncate(self, seq_id: int, end: int) -> None:
        run = self.runs.get(seq_id)
        if run is not None:
            run.truncate(end)

    def free(self, seq_id: int) -> None:
        self.runs.pop(seq_id, None)
