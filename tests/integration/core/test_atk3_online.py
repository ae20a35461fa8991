"""Attacks on the online path (atk3): sequences that delete what had to stay."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest

from core.clients import redis_sync, s3_client
from core.errors import UserError
from core.facts import HOLD_REMOVE, FactLog, make_fact
from core.settings import Settings
from hardelete.facts import reseal
from hardelete.holds import add_hold
from reaper.daemon import Reaper
from schemas import events as ev
from schemas.layout import FACT_KEY, RepoKeys
from sim.testing import publish, redis_now, wait_horizon
from tracker.daemon import running_tracker

pytestmark = [pytest.mark.parametrize("topology", ["single"], indirect=True),
              pytest.mark.usefixtures("sequenced")]  # (the service certifies its history)

BUCKET = "atkthree"
REPO = "atk3"
NS = f"s3://{BUCKET}/atk3/"
A = NS + "data/a"


async def _garbage(s: Settings, s3: Any) -> None:
    s3.create_bucket(Bucket=BUCKET)
    s3.put_object(Bucket=BUCKET, Key="atk3/data/a", Body=b"held")
    events = [ev.RepositoryCreated(repository=REPO, storage_namespace=NS, default_branch="main",
                                   default_retention_days=1.0),
              ev.BranchCreated(repository=REPO, branch="main", staging_token="t",
                               ref_version=1),
              ev.ObjectWritten(repository=REPO, branch="main", staging_token="t", path="a",
                               address=A, size=4, ref_id="ra"),
              ev.ObjectDeleted(repository=REPO, branch="main", staging_token="t", path="a",
                               address=A, ref_id="ra")]
    await wait_horizon(s, await publish(s, events))


async def _reap(s: Settings, s3: Any) -> Any:
    await asyncio.sleep(1.2)  # past grace (1 s)
    await wait_horizon(s, await redis_now(s))
    reaper = Reaper(s, s3=s3)
    try:
        return await reaper.run_once()
    finally:
        await reaper.close()


def _alive(s3: Any) -> bool:
    return bool(s3.list_objects_v2(Bucket=BUCKET, Prefix="atk3/data/a").get("KeyCount", 0) > 0)


async def test_reseal_blesses_a_fact_appended_after_the_operator_judged(
        settings: Settings) -> None:
    s = settings.replace(grace_seconds=1.0, quarantine_days=0.0, lease_seconds=1.0)
    s3 = s3_client(s)
    r = redis_sync(s)
    try:
        async with running_tracker(s, name="t1"):
            await _garbage(s, s3)
            add_hold(r, A, "legal: case 77", s3=s3)  # fact 1
            # The fact key is lost (Redis restored from a copy older than its minting):
            # every fact now fails verification, the repository deletes nothing, and
            # reseal is the documented way out.
            r.delete(FACT_KEY)
            report = await _reap(s, s3)
            assert _alive(s3), report.as_dict()
            log = FactLog(s3, NS, REPO)
            judged = log.seqs_from(1)
            assert judged == [1]  # the operator runs `facts list`: one genuine hold_add
            digest, _ = log.snapshot()  # (the digest `facts list` shows)
            # Meanwhile whoever can write the namespace appends a removal of that hold.
            removal = {"hash": "holds", "target": A, "claim_ids": ["operator"], "force": True}
            s3.put_object(Bucket=log.bucket, Key=log.prefix + "000000000002.json",
                          Body=make_fact(REPO, 2, HOLD_REMOVE, removal, at_ms=1,
                                         by="someone@host").encode())
            # The operator, having judged fact 1, reseals.
            # reseal is bound to what was judged: the home changed, nothing is resealed
            with pytest.raises(UserError, match="changed since"):
                reseal.run_cli(s, argparse.Namespace(repository=REPO, digest=digest))
            for _ in range(5):
                report = await _reap(s, s3)
                if not _alive(s3):
                    break
            assert _alive(s3), f"a held object was deleted: {report.as_dict()}"
            assert r.hexists(RepoKeys(REPO).holds, A), "the legal hold was lifted"
    finally:
        r.close()


@pytest.mark.xfail(strict=True, reason="atk3: the proof cannot tell a home whose newest facts "
                   "were deleted from a home with no newer facts: the newest hold_add deleted "
                   "from the namespace plus the slot going back to before it loses the hold")
async def test_the_newest_fact_deleted_and_the_slot_going_back_lose_a_hold(
        settings: Settings) -> None:
    import redis as redis_lib

    from sim.testing import slot_copy, slot_go_back

    s = settings.replace(grace_seconds=1.0, quarantine_days=0.0, lease_seconds=1.0)
    s3 = s3_client(s)
    r = redis_sync(s)
    raw = (redis_lib.RedisCluster.from_url(s.redis_url) if s.redis_cluster
           else redis_lib.Redis.from_url(s.redis_url))
    try:
        async with running_tracker(s, name="t1"):
            await _garbage(s, s3)
            before = slot_copy(raw, REPO)
            add_hold(r, A, "legal: case 78", s3=s3)  # fact 1
            log = FactLog(s3, NS, REPO)
            # Whoever can write the namespace deletes the newest fact (no signature needed).
            s3.delete_object(Bucket=log.bucket, Key=log.prefix + "000000000001.json")
            slot_go_back(raw, REPO, before)  # a failover to a replica without the hold
            report = await _reap(s, s3)
            assert _alive(s3), f"a held object was deleted: {report.as_dict()}"
    finally:
        raw.close()
        r.close()
