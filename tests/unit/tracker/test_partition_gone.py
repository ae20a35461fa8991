"""A broker that lost its disk may get the events topic back with fewer partitions (a client's
metadata request auto-creates it with the broker's default count before the operator re-creates
it). Repositories keyed to a partition that no longer exists move to other partitions; what was
published to the gone one and never applied is lost, and no assignment ever checks it again.
Found by the safety soak (seed 2): a repository of a gone partition was never fail-closed, and
the reaper deleted an object of a retained commit whose events were lost with the log."""

from __future__ import annotations

from tracker.logid import gone_partitions


def test_gone_partitions_are_those_the_topic_no_longer_has() -> None:
    fields = ["t:0", "t:1", "t:3", "other:7", "t:x", "t2:5"]
    assert gone_partitions(fields, "t", {0, 1, 2, 3}) == []
    assert gone_partitions(fields, "t", {0}) == [1, 3]
    assert gone_partitions(fields, "t", {0, 3}) == [1]








