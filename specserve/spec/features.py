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
from that position on (spec/eagle.py). A sequence that decodes plainly for n steps holds
n rows (EAGLE-3 reads 3 hidden sizes a row: on a Llama-3.1-8B target 24 KiB, a fifth of
its KV cache per position).

Each forward's capture is copied once (the static steps reuse their buffers) and every
sequence keeps a view of its rows in that copy: one copy a forward, not one a sequence,
which on a GPU is the host's time a step. A view keeps the whole copy alive, so a run
joins its views into rows of its own once it holds VIEWS_JOINED of them: a run in the
batch keeps the copies of at most its last VIEWS_JOINED - 1 forwards alive for its rows.
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


# A run joins its views of forwards' copies into rows of its own at this many (see above).
VIEWS_JOINED = 16


@dataclass
class FeatureRun:
    origin: int  # the first position of the run: the head's position 0
    start: int  # the first position not read yet
    chunks: list[torch.Tensor] = field(default_factory=list)  # rows of positions [start, end), in order: [n_i, F]
    length: int = 0  # rows in chunks
    views: int = 0  # how many of the last chunks are views of a forward's copy (fewer than VIEWS_JOINED)

    def __len__(self) -> int:
        return self.length

    @property
    def end(self) -> int:
        return self.start + self.length

    def append(self, rows: torch.Tensor) -> None:  # [n, F]: a view of a forward's copy
        """Add the rows of positions [end, end + n)."""
        if not rows.shape[0]:
            return
        self.chunks.append(rows)
        self.length += rows.shape[0]
        self.views += 1
        if self.views >= VIEWS_JOINED:
            self.chunks[-self.views :] = [torch.cat(self.chunks[-self.views :])]
            self.views = 0

    def take(self, n: int) -> torch.Tensor:  # [n, F]
        """Read the rows of positions [start, start + n)."""
        taken = self._pop_front(n) if n else [self.chunks[0][:0]]
        return torch.cat(taken) if len(taken) > 1 else taken[0]

    def _pop_front(self, n: int) -> list[torch.Tensor]:
        """Remove the rows of positions [start, start + n); returns them as pieces, in order."""
        assert n <= self.length, f"{n} rows asked of a run of {self.length}"
        taken, count = [], 0
        while count < n:
            is_view = self.views == len(self.chunks)  # views are the last chunks: the first is one if all are
            self.views -= is_view
            chunk = self.chunks.pop(0)
            taken.append(chunk[: n - count])
            if chunk.shape[0] > n - count:  # the rest stays, a view where the chunk was
                self.chunks.insert(0, chunk[n - count :])
                self.views += is_view
            count += taken[-1].shape[0]
        self.start, self.length = self.start + n, self.length - n
        return taken

    def truncate(self, end: int) -> None:
        """Forget the rows of positions from `end` on (drafts the target rejected)."""
        keep = end - self.start
        assert keep >= 0, f"position {end} was read already (the run reads from {self.start})"
        while self.length > keep:
            chunk, excess = self.chunks.pop(), self.length - keep
            if chunk.shape[0] > excess:  # its first rows stay, a view where the chunk was
                self.chunks.append(chunk[: chunk.shape[0] - excess])
            else:
                self.views = max(self.views - 1, 0)
            self.length -= min(excess, chunk.shape[0])

    def newest(self) -> torch.Tensor:  # [F]
        """The row of position end - 1."""
        return self.chunks[-1][-1]

    def keep_only(self, position: int) -> None:
        """Keep the row of `position` alone (a head that reads the newest verified row):
        one view, whatever chunks held the run."""
        index = position - self.start
        assert 0 <= index < self.length, f"position {position} is not in the run [{self.start}, {self.end})"
        for chunk in self.chunks:
            if index < chunk.shape[0]:
                self.chunks = [chunk[index : index + 1]]
                break
            index -= chunk.shape[0]
        self.start, self.length, self.views = position, 1, 1


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
        sizes = [f.num_rows for f in fed]
        for (seq_id, start, _), piece in zip(fed, rows[: sum(sizes)].clone().split(sizes)):
            run = self.runs.get(seq_id)
            if run is None or run.end != start:  # new, or after positions no forward computed
                run = self.runs[seq_id] = FeatureRun(origin=start, start=start)
            run.append(piece)

    def truncate(self, seq_id: int, end: int) -> None:
        run = self.runs.get(seq_id)
        if run is not None:
            run.truncate(end)

    def free(self, seq_id: int) -> None:
        self.runs.pop(seq_id, None)
