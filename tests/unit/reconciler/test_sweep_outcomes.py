"""The counts read back from a sweep's outcome rows are the counts its tasks keep.

When a task dies, the driver reports what the rows written so far say (``outcome_stats``): the
same numbers the task would have returned, so a stopped sweep's report does not depend on how
it stopped. (On the real stack: tests/integration/reconciler/test_sweep_stopped_report.py.)
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from core.deleter import Deleter
from reconciler.s3io import Namespace
from reconciler.sweep import (
    CHANGED_AFTER_MARK,
    CONFIRMED,
    FAILED,
    REFUSED,
    SKIPPED_CHANGED,
    SKIPPED_GUARD,
    SKIPPED_LIVE,
    STOPPED,
    SweepPlan,
    SweepStats,
    _sweep_batch,
    outcome_stats,
)

NS = Namespace("s3://bucket/repo/")
COUNTS = ("marked", "marked_bytes", "confirmed", "confirmed_bytes", "failed", "refused",
          "skipped_live", "skipped_guard", "skipped_changed", "skipped_retained")


class Store:
    """Answers each key as told: ``ok`` deleted, ``denied`` a per-key error (not retried)."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers

    def delete_objects(self, Bucket: str, Delete: dict[str, Any]) -> dict[str, Any]:
        keys = [o["Key"] for o in Delete["Objects"]]
        return {"Deleted": [{"Key": k} for k in keys if self.answers[k] == "ok"],
                "Errors": [{"Key": k, "Code": "AccessDenied", "Message": "no"}
                           for k in keys if self.answers[k] == "denied"]}


def _counts(stats: SweepStats) -> dict[str, int]:
    return {name: getattr(stats, name) for name in COUNTS}


@given(st.lists(st.tuples(st.sampled_from(["ok", "denied", "reserved"]),
                          st.integers(0, 10**9)), max_size=60))
def test_the_rows_of_a_batch_count_as_the_task_counted(keys):
    batch, answers = [], {}
    for i, (answer, size) in enumerate(keys):
        rel = f"_hardelete/k{i}" if answer == "reserved" else f"data/s/k{i}"
        batch.append((rel, "leaked", size, None))
        answers[NS.key(rel)] = answer
    rows: list[tuple[Any, ...]] = []

    def record(rel: str, cat: str, size: int, outcome: str, error: str | None = None) -> None:
        rows.append((rel, size, outcome, error))

    stats = SweepStats()
    if batch:
        _sweep_batch(Deleter(Store(answers)), None, SweepPlan("repo", "lease", NS, 0), batch,
                     stats, record)
    back = outcome_stats(rows)
    assert _counts(back) == _counts(stats)
    assert back.samples == stats.samples
    assert back.confirmed == sum(a == "ok" for a, _ in keys)


def test_every_outcome_is_counted_as_the_sweep_counts_it():
    rows = [("a", 1, CONFIRMED, None), ("b", 2, FAILED, "AccessDenied: no"),
            ("c", 4, REFUSED, None), ("d", 8, SKIPPED_LIVE, "staged"),
            ("e", 16, SKIPPED_GUARD, "held"), ("f", 32, SKIPPED_CHANGED, CHANGED_AFTER_MARK),
            ("g", 64, SKIPPED_CHANGED, None), ("h", 128, SKIPPED_GUARD, STOPPED),
            ("i", 256, "outcome of a newer version", None)]
    s = outcome_stats(rows)
    assert (s.marked, s.marked_bytes) == (9, 511)
    assert (s.confirmed, s.confirmed_bytes) == (1, 1)
    assert (s.failed, s.refused, s.skipped_live, s.skipped_guard, s.skipped_changed) == \
        (1, 1, 1, 1, 2)
    # a key the sweep stopped before sending is taken up, not skipped by a guard
    assert s.samples == {"failed": ["b: AccessDenied: no"], "refused": ["c"],
                         "skipped_live": ["d: staged"], "skipped_guard": ["e: held"],
                         "skipped_changed": [f"f: {CHANGED_AFTER_MARK}", "g"]}
