"""A feature run's rows across the chunks it keeps (spec/features.py): what it reads and
cuts is every position's own row, whichever forward's copy holds it, and a forward is
copied once for every sequence that fed it."""

import torch

from specserve.model.decoder import Capture
from specserve.spec.features import VIEWS_JOINED, FeatureRun, FedRows, TargetFeatures


def rows_of(start: int, n: int) -> torch.Tensor:  # [n, 2]: row p holds (p, -p)
    positions = torch.arange(start, start + n, dtype=torch.float32)
    return torch.stack([positions, -positions], dim=1)


def forward(features: TargetFeatures, fed: list[FedRows]) -> torch.Tensor:
    """A forward's capture of `fed`, in the buffer a static step would reuse; read by `features`."""
    buffer = torch.cat([rows_of(start, n) + 1000 * seq_id for seq_id, start, n in fed])
    features.read(Capture(layers=(), final=True, final_hidden=buffer), fed)
    return buffer


def test_runs_keep_their_rows_after_the_forwards_buffer_is_reused():
    features = TargetFeatures()
    for step in range(3):
        buffer = forward(features, [FedRows(1, 5 + step, 1), FedRows(2, 9 + step, 1)])
        buffer.fill_(float("nan"))  # the next replay overwrites it
    torch.testing.assert_close(features.runs[1].take(3), rows_of(5, 3) + 1000)
    torch.testing.assert_close(features.runs[2].take(3), rows_of(9, 3) + 2000)


def test_one_forward_is_one_copy_that_every_sequence_views():
    features = TargetFeatures()
    forward(features, [FedRows(1, 0, 4), FedRows(2, 0, 3)])
    first, second = features.runs[1].chunks[0], features.runs[2].chunks[0]
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()


def test_a_run_joins_its_views_into_rows_of_its_own():
    features = TargetFeatures()
    for step in range(VIEWS_JOINED - 1):
        forward(features, [FedRows(1, step, 1), FedRows(2, step, 1)])
    run = features.runs[1]
    assert run.views == len(run.chunks) == VIEWS_JOINED - 1
    forward(features, [FedRows(1, VIEWS_JOINED - 1, 1), FedRows(2, VIEWS_JOINED - 1, 1)])
    assert run.views == 0 and len(run.chunks) == 1
    assert run.chunks[0].untyped_storage().nbytes() == run.chunks[0].nbytes  # no forward's copy behind it
    torch.testing.assert_close(run.take(VIEWS_JOINED), rows_of(0, VIEWS_JOINED) + 1000)


def test_reads_and_cuts_across_chunks_keep_every_position_in_order():
    run = FeatureRun(origin=3, start=3)
    for start, n in ((3, 4), (7, 1), (8, 3), (11, 2)):  # positions [3, 13)
        run.append(rows_of(start, n))
    assert (len(run), run.end) == (10, 13)
    torch.testing.assert_close(run.take(5), rows_of(3, 5))  # across a chunk's middle
    run.truncate(10)  # across the middle of the third chunk, dropping the last
    assert (run.start, run.end) == (8, 10)
    torch.testing.assert_close(run.newest(), rows_of(9, 1)[0])
    assert run.take(0).shape == (0, 2)
    run.append(rows_of(10, 2))
    torch.testing.assert_close(run.take(4), rows_of(8, 4))
    assert len(run) == 0 and run.views == 0


def test_the_count_of_views_follows_reads_and_cuts():
    """views counts the last chunks (the views); reads from the front and cuts from the
    back keep it so, whatever kind of chunk they split."""
    run = FeatureRun(origin=0, start=0, chunks=[rows_of(0, 4)], length=4)  # rows of its own
    for start in (4, 6):
        run.append(rows_of(start, 2))
    assert run.views == 2
    run.take(5)  # all of the own chunk and half of the first view
    assert (len(run.chunks), run.views) == (2, 2)
    run.truncate(6)  # the last view goes
    assert (len(run.chunks), run.views) == (1, 1)
    for start in range(6, 6 + VIEWS_JOINED - 1):
        run.append(rows_of(start, 1))
    assert run.views == 0 and len(run.chunks) == 1
    torch.testing.assert_close(run.take(len(run)), rows_of(5, VIEWS_JOINED))


def test_keeping_the_newest_row_alone_takes_it_from_whichever_chunk_holds_it():
    run = FeatureRun(origin=0, start=0)
    for start, n in ((0, 3), (3, 4)):
        run.append(rows_of(start, n))
    run.keep_only(5)  # the newest verified: drafts past it were rejected
    assert (run.start, run.end, len(run.chunks)) == (5, 6, 1)
    torch.testing.assert_close(run.newest(), rows_of(5, 1)[0])
    run.append(rows_of(6, 2))
    run.keep_only(6)
    torch.testing.assert_close(run.take(1), rows_of(6, 1))
