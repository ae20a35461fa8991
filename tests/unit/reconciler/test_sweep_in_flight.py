"""A sweep task keeps ``BATCHES_IN_FLIGHT`` batches going at once (``reconciler.sweep._in_flight``):
never more, every batch it took up is waited for and counted, and once a batch has failed no
further batch is taken up."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from reconciler.sweep import BATCHES_IN_FLIGHT, SweepStats, _in_flight


class Batches:
    """``one`` for ``_in_flight``: counts each batch as marked, fails the batches told."""

    def __init__(self, failing: frozenset[int] = frozenset()) -> None:
        self.failing = failing
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.taken: list[int] = []

    def one(self, index: int, batch: list[int]) -> tuple[SweepStats, BaseException | None]:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.taken.append(index)
        part = SweepStats(marked=len(batch))
        with self.lock:
            self.running -= 1
        return part, RuntimeError(f"batch {index}") if index in self.failing else None


def test_every_batch_is_swept_and_counted_with_at_most_the_limit_in_flight() -> None:
    b = Batches()
    stats = SweepStats()
    assert _in_flight(b.one, ([i] * 3 for i in range(50)), stats) is None
    assert sorted(b.taken) == list(range(50))
    assert stats.marked == 150
    assert 1 <= b.most <= BATCHES_IN_FLIGHT


def test_a_failed_batch_stops_the_part_and_what_was_taken_up_is_counted() -> None:
    b = Batches(failing=frozenset({0}))
    stats = SweepStats()
    failure = _in_flight(b.one, ([i] * 2 for i in range(50)), stats)
    assert isinstance(failure, RuntimeError) and str(failure) == "batch 0"
    assert len(b.taken) < 50  # it stopped taking batches up
    assert stats.marked == 2 * len(b.taken)  # each batch taken up was waited for and counted
    assert b.most <= BATCHES_IN_FLIGHT


def test_a_failure_reading_the_batches_still_counts_the_batches_in_flight() -> None:
    b = Batches()
    stats = SweepStats()

    def rows() -> Iterator[list[int]]:
        yield [1]
        yield [2, 2]
        raise OSError("the mark part could not be read on")

    try:
        _in_flight(b.one, rows(), stats)
    except OSError:
        pass
    else:
        raise AssertionError("the read error must reach the part")
    assert stats.marked == 3 and sorted(b.taken) == [0, 1]
