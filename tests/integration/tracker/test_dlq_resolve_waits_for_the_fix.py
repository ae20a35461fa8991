"""``dlq resolve`` waits for the tracker to apply the replayed fix (found by an adversarial
review; this test failed before). ``dlq replay`` then ``dlq resolve`` while the tracker has not
applied the replayed fix yet (it is stopped or lagging): the dead letter's hold was the only
thing keeping the address (its reference is in the lost event), and resolve lifted it at once.
The address was unreferenced long before, so the horizon (which stopped with the tracker)
already let the reaper claim it: the object the replayed copy references was deleted. Now
resolve refuses until the tracker's horizon has passed the moment of the resolve."""

from __future__ import annotations

import asyncio
import time

import pytest

from core.clients import redis_sync, s3_client
from core.errors import UserError
from core.settings import Settings
from hardelete import dlq
from reaper.daemon import Reaper
from schemas import events as ev
from schemas.layout import RepoKeys
from schemas.publisher import Publisher
from sim.testing import publish, redis_now, wait_horizon
from tracker.daemon import running_tracker

BUCKET = "attack3d"
NS = f"s3://{BUCKET}/r/"
A = NS + "data/a"


async def test_resolve_right_after_replay_waits_for_the_fix_to_be_applied(
        settings: Settings) -> None:
    s = settings.replace(grace_seconds=1.0, quarantine_days=0.0)
    s3 = s3_client(s)
    s3.create_bucket(Bucket=BUCKET)
    s3.put_object(Bucket=BUCKET, Key="r/data/a", Body=b"live")
    first = [ev.RepositoryCreated(repository="r", storage_namespace=NS, default_branch="main",
                                  default_retention_days=1.0),
             ev.BranchCreated(repository="r", branch="main", staging_token="t", ref_version=1),
             ev.ObjectWritten(repository="r", branch="main", staging_token="t", path="a",
                              address=A, size=4, ref_id="ra")]
    # a shallow copy (read before the delete below) published with a wrong record key: it is
    # dead-lettered, and its hold keeps A
    copy = ev.ObjectCopied(repository="r", branch="main", staging_token="t", path="b",
                           address=A, size=4, ref_id="rb", source_read_at=time.time())
    delete = ev.ObjectDeleted(repository="r", branch="main", staging_token="t", path="a",
                              address=A, ref_id="ra")
    async with running_tracker(s, name="t1") as tracker:
        await wait_horizon(s, await publish(s, first))
        async with Publisher(s) as pub:
            await pub.publish_raw(ev.encode(copy), b"wrong-key")
        await wait_horizon(s, await publish(s, [delete]))
        await asyncio.sleep(1.5)
        await wait_horizon(s, await redis_now(s))
        assert tracker.dead_lettered == 1
    r = redis_sync(s)
    try:
        assert r.hexists(RepoKeys("r").holds, A)  # the dead letter keeps A
        # The tracker is down (or lagging). The operator replays the fixed event (right key)
        # and resolves the dead letter, as the CLI suggests.
        letters = await dlq.read(s)
        assert len(letters) == 1
        await dlq.publish_fixed(s, letters[0].value)
        with pytest.raises(UserError, match="nothing was lifted"):
            dlq.resolve(r, letters[0], s3=s3)  # the tracker is down: the fix is not applied yet
        assert r.hexists(RepoKeys("r").holds, A)
        reaper = Reaper(s, s3=s3)
        try:
            report = await reaper.run_once()
            assert report.total("deleted") == 0  # held
            async with running_tracker(s, name="t2"):
                done = await asyncio.to_thread(dlq.resolve, r, letters[0], s3=s3, wait_s=60)
                assert done and not r.hexists(RepoKeys("r").holds, A)
                report = await reaper.run_once()  # the replayed copy keeps A now
        finally:
            await reaper.close()
        rec = r.hgetall(RepoKeys("r").address(A))
    finally:
        r.close()
    alive = s3.list_objects_v2(Bucket=BUCKET, Prefix="r/data/a").get("KeyCount", 0) > 0
    # path b (ref rb, open token t) references A once the replay is applied
    assert alive, f"live object deleted: record {rec}, report {report.as_dict()}"
