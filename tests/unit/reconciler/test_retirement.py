"""Retirement keeps data until it is explicitly released (issue 19 item 6).

Finding: after ``repository_deleted``, a new repository registered on the same namespace marked
the retired repository's committed objects as leaked and swept them at once.
"""

from __future__ import annotations

from reconciler.retirement import DAY_MS, Retired, purge_due


def test_purge_is_due_only_after_the_retention_or_a_release() -> None:
    rec = Retired("A", "s3://b/a/", at_ms=1_000)
    assert "kept until" in (purge_due(rec, 1_000 + 7 * DAY_MS - 1, 7.0) or "")
    assert purge_due(rec, 1_000 + 7 * DAY_MS, 7.0) is None
    assert purge_due(Retired("A", "s3://b/a/", 1_000, released_at_ms=2_000), 2_000, 7.0) is None
    assert purge_due(Retired("A", "s3://b/a/", 1_000, purged_at_ms=5), 10**15, 7.0) \
        == "already purged"
    assert purge_due(Retired("A", "", 1_000), 10**15, 7.0) is not None




