"""Until the tracker certifies continuity, the relay's ``watermark`` and ``range_gone`` are
applied as nothing (no dead letter, no hold, no record) and sequenced events are applied as
before, their ``seq``/``incarnation``/``stripe`` ignored. Real Kafka and Redis."""

from __future__ import annotations

from core.settings import Settings
from schemas import events as ev
from schemas.layout import RepoKeys
from schemas.publisher import Publisher, ensure_topics
from tracker.daemon import Tracker

NS = "s3://inert/r/"


async def test_watermark_and_range_gone_are_applied_as_nothing(settings: Settings,
                                                               redis_client) -> None:
    x = f"{NS}data/0000000001/x"
    events: list[ev.Event] = [
        ev.RepositoryCreated(repository="r", storage_namespace=NS, default_branch="main",
                             default_retention_days=7, stripes=2, seq=1, incarnation="i1"),
        ev.Watermark(repository="r", stripe=0, incarnation="i1", seq=1, tick_ms=1,
                     tick_applied=[0], tick_id="t1", tick_sig="00"),
        ev.ObjectWritten(repository="r", branch="main", staging_token="t", path="p", address=x,
                         size=3, ref_id="a", seq=1, incarnation="i1", stripe=1),
        ev.RangeGone(repository="r", stripe=1, incarnation="i0", from_seq=1, to_seq=4,
                     reason="trimmed"),
        # of a repository the tracker does not know: still nothing (not "unknown repository")
        ev.Watermark(repository="other", stripe=0, incarnation="i1", seq=0, tick_ms=1,
                     tick_applied=[0], tick_id="t1", tick_sig="00"),
    ]
    await ensure_topics(settings)
    async with Publisher(settings) as pub:
        await pub.publish_many(events)
    tracker = Tracker(settings)
    await tracker.run_until_caught_up()
    dlq = sum(s.value for m in tracker.metrics.dlq.collect() for s in m.samples
              if s.name.endswith("_total"))
    assert dlq == 0
    k = RepoKeys("r")
    assert redis_client.hget(k.address(x), "state") is not None  # the write was applied
    assert not redis_client.exists(k.holds) and not redis_client.exists(k.hold_prefixes)
    assert not redis_client.exists(RepoKeys("other").holds)
