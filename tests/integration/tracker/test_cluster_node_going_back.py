"""A repository's Redis Cluster node going back in time is seen (found by an adversarial
review; the cluster cases failed before): across a tracker restart, and for a quiet repository
no event of which comes afterwards. The tracker keeps a copy of each repository's applied[] in
another slot (``hd:applied``): its first chunk after a restart requires it, and every delete
path's gate compares the repository's node against it (``core.gate.applied_regression``).

Before: the tracker resumed every partition from ``hd:log`` (another slot, another node, it did
not move) and its first chunk per repository carried the in-slot guard ``*`` (nothing seen
yet, tracker/state.py ``_in_slot``; apply.lua skips the check for ``*``). So the events the
regressed node lost were never applied again, and nothing was failed closed: a live reference
(a shallow copy) was gone from the mirror and the reaper deleted the object.

On one node the same fault takes hd:log back with the data, and the tracker replays the gap
(the control)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis as redis_lib

from core.clients import redis_sync, s3_client
from core.settings import Settings
from reaper.daemon import Reaper
from schemas import events as ev
from schemas.layout import LOG, RepoKeys
from sim.testing import publish, redis_now, wait_horizon
from tracker.daemon import running_tracker

BUCKET = "attack3"
NS = f"s3://{BUCKET}/back/"
A = NS + "data/a"


def _raw(s: Settings):
    return (redis_lib.RedisCluster.from_url(s.redis_url) if s.redis_cluster
            else redis_lib.Redis.from_url(s.redis_url))


@pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)
async def test_slot_regression_across_tracker_restart_deletes_a_live_object(
        settings: Settings, topology: str) -> None:
    s = settings.replace(grace_seconds=1.0, quarantine_days=0.0)
    s3 = s3_client(s)
    s3.create_bucket(Bucket=BUCKET)
    s3.put_object(Bucket=BUCKET, Key="back/data/a", Body=b"live")
    raw = _raw(s)
    k = RepoKeys("back")
    first = [ev.RepositoryCreated(repository="back", storage_namespace=NS,
                                  default_branch="main", default_retention_days=1.0),
             ev.BranchCreated(repository="back", branch="main", staging_token="t",
                              ref_version=1),
             ev.ObjectWritten(repository="back", branch="main", staging_token="t", path="a",
                              address=A, size=4, ref_id="ra")]
    # lost by the node: a shallow copy of a into path b (a second, live reference)
    lost = [ev.ObjectCopied(repository="back", branch="main", staging_token="t", path="b",
                            address=A, size=4, ref_id="rb", source_read_at=time.time())]
    # after the restart: path a is deleted; path b still references the object
    later = [ev.ObjectDeleted(repository="back", branch="main", staging_token="t", path="a",
                              address=A, ref_id="ra")]
    try:
        async with running_tracker(s, name="t1"):
            await wait_horizon(s, await publish(s, first))
            names = list(raw.scan_iter(match=f"{k.tag}:*".encode()))
            if topology == "single":
                names.append(LOG.encode())  # one node: hd:log goes back with the data
            copy = {n: raw.dump(n) for n in names}
            await wait_horizon(s, await publish(s, lost))
        # The tracker is down (deploy, crash). The repository's node fails over to a replica
        # that had not received the copy's write yet.
        for n in raw.scan_iter(match=f"{k.tag}:*".encode()):
            if n not in copy:
                raw.delete(n)
        for n, value in copy.items():
            raw.restore(n, 0, value, replace=True)
        async with running_tracker(s, name="t2"):
            await wait_horizon(s, await publish(s, later))
            await asyncio.sleep(1.5)  # past grace
            await wait_horizon(s, await redis_now(s))
            reaper = Reaper(s, s3=s3)
            try:
                report = await reaper.run_once()
            finally:
                await reaper.close()
        r = redis_sync(s)
        try:
            rec = r.hgetall(k.address(A))
            fail_closed = r.hgetall(k.fail_closed)
        finally:
            r.close()
        alive = s3.list_objects_v2(Bucket=BUCKET, Prefix="back/data/a").get("KeyCount", 0) > 0
        # Path b (ref rb, open token t) still references the object: it must exist.
        assert alive, (f"live object deleted: record {rec}, fail_closed {fail_closed}, "
                       f"report {report.as_dict()}")
    finally:
        raw.close()


@pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)
async def test_slot_regression_of_a_quiet_repository_is_never_noticed(
        settings: Settings, topology: str) -> None:
    """No restart needed: the in-slot guard only runs when a later chunk of the repository
    arrives. The repository's last event before the fault (a shallow copy, within grace of the
    entry's deletion, the race seed 000 describes) is lost with its node; the repository stays
    quiet, hd:log and hd:progress (other slots) do not move, the horizon keeps advancing, and
    the reaper deletes the object the copy references. One node: everything goes back
    together, the tracker notices hd:log moved and replays (the control)."""
    s = settings.replace(grace_seconds=3.0, quarantine_days=0.0)
    s3 = s3_client(s)
    s3.create_bucket(Bucket=BUCKET)
    s3.put_object(Bucket=BUCKET, Key="back/data/a", Body=b"live")
    raw = _raw(s)
    k = RepoKeys("back")
    first = [ev.RepositoryCreated(repository="back", storage_namespace=NS,
                                  default_branch="main", default_retention_days=1.0),
             ev.BranchCreated(repository="back", branch="main", staging_token="t",
                              ref_version=1),
             ev.ObjectWritten(repository="back", branch="main", staging_token="t", path="a",
                              address=A, size=4, ref_id="ra"),
             ev.ObjectDeleted(repository="back", branch="main", staging_token="t", path="a",
                              address=A, ref_id="ra")]
    lost = [ev.ObjectCopied(repository="back", branch="main", staging_token="t", path="b",
                            address=A, size=4, ref_id="rb", source_read_at=time.time())]
    try:
        async with running_tracker(s, name="t1"):
            await wait_horizon(s, await publish(s, first))
            pattern = b"*" if topology == "single" else f"{k.tag}:*".encode()
            names = list(raw.scan_iter(match=pattern))
            copy = {n: raw.dump(n) for n in names}
            await wait_horizon(s, await publish(s, lost))
            # the node (one node: the whole Redis) fails over to a replica without the copy
            for n in raw.scan_iter(match=pattern):
                if n not in copy:
                    raw.delete(n)
            for n, value in copy.items():
                raw.restore(n, 0, value, replace=True)
            await asyncio.sleep(3.5)  # past grace of the deletion of path a
            await wait_horizon(s, await redis_now(s))
            reaper = Reaper(s, s3=s3)
            try:
                report = await reaper.run_once()
            finally:
                await reaper.close()
        r = redis_sync(s)
        try:
            rec = r.hgetall(k.address(A))
        finally:
            r.close()
        alive = s3.list_objects_v2(Bucket=BUCKET, Prefix="back/data/a").get("KeyCount", 0) > 0
        assert alive, f"live object deleted: record {rec}, report {report.as_dict()}"
    finally:
        raw.close()
