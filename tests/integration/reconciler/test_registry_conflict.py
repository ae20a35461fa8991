"""A registry conflict fails closed every repository of it (issue 34 finding 4; this test failed
before). Two repositories that predate the namespace registry, B's namespace inside A's: at the
tracker's registry backfill A (first in order) was registered and B refused, with an incident
naming B only; A stayed free to delete, and A's reconciler sweep took B's live staged object
(a key of A's namespace that no reference of A names) for A's leaked garbage.

Now both are fail-closed with one incident naming both, A's sweep withholds, and
``hardelete fail-closed clear`` is refused while the conflict stands.

Real stack: Kafka, the real tracker (its backfill at start), valkey, MinIO, local Spark."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from core.clock import await_horizon
from core.errors import UserError
from hardelete.failclosed import clear
from reconciler.job import RunOptions, reconcile
from schemas import events as ev
from schemas.layout import INCIDENTS, NAMESPACES, REPOS, RepoKeys
from sim.operations import created, written
from sim.testing import publish
from sim.worlds import boundary, past_grace
from tracker.daemon import Tracker, running_tracker
from tracker.rebuild import RebuildError, prepare

pytestmark = [pytest.mark.spark]

BUCKET = "regconflict"
NS_A, NS_B = f"s3://{BUCKET}/A/", f"s3://{BUCKET}/A/B/"
X = NS_B + "data/x"  # B's live staged object


@pytest.fixture
def rsettings(settings):
    return settings.replace(reconcile_min_age_seconds=0.0, grace_seconds=1.0)


async def _history(s: Any) -> None:
    """A and B as a tracker that predates the registry leaves them: both live, each with its
    mirror, no registry entry. (Each is created by the real tracker while the other is out of
    sight of its registry backfill; then the registry is dropped.)"""
    import redis.asyncio as aredis

    r = aredis.Redis.from_url(s.redis_url, decode_responses=True)
    try:
        await publish(s, [created("B", NS_B),
                          ev.BranchCreated(repository="B", branch="main", staging_token="tb",
                                           ref_version=1),
                          written("B", X, token="tb", ref="rx")])
        await Tracker(s).run_until_caught_up(timeout=60)
        await r.srem(REPOS, "B")
        await r.delete(NAMESPACES)
        await publish(s, [created("A", NS_A),
                          ev.BranchCreated(repository="A", branch="main", staging_token="ta",
                                           ref_version=1),
                          written("A", NS_A + "data/a", token="ta", ref="ra")])
        await Tracker(s).run_until_caught_up(timeout=60)
        await r.sadd(REPOS, "B")
        await r.delete(NAMESPACES)
    finally:
        await r.aclose()


async def _reconcile_a(spark: Any, s: Any, cutoff_ms: int) -> dict[str, Any]:
    """A's reconcile while a tracker runs (its start is the registry backfill)."""
    import redis.asyncio as aredis

    async with running_tracker(s):
        r = aredis.Redis.from_url(s.redis_url, decode_responses=True)
        try:
            sec, usec = await r.time()
            await await_horizon(r, int(sec) * 1000 + int(usec) // 1000 + 1000, timeout=60)
        finally:
            await r.aclose()
        return await asyncio.to_thread(reconcile, spark, s, RunOptions(
            "A", cutoff_ms=cutoff_ms, allow_large_sweep=True))


def test_a_backfill_conflict_fails_closed_both_and_the_winners_sweep_keeps_the_other(
        spark, rsettings, s3, redis_client):
    s = rsettings
    s3.create_bucket(Bucket=BUCKET)
    for key in ("A/data/a", "A/B/data/x"):
        s3.put_object(Bucket=BUCKET, Key=key, Body=b"live")
    asyncio.run(_history(s))
    assert not redis_client.exists(NAMESPACES)
    past_grace(s)
    cutoff = boundary()
    res = asyncio.run(_reconcile_a(spark, s, cutoff))
    alive = s3.list_objects_v2(Bucket=BUCKET, Prefix="A/B/data/x").get("KeyCount", 0) > 0
    assert alive, f"A's sweep deleted B's live staged object: {res.get('sweep')}"
    assert s3.list_objects_v2(Bucket=BUCKET, Prefix="A/data/a").get("KeyCount", 0) > 0

    assert redis_client.hgetall(NAMESPACES) == {NS_A: "A"}  # A won the backfill
    flags = {repo: redis_client.hgetall(RepoKeys(repo).fail_closed) for repo in ("A", "B")}
    assert all("registry conflict" in f.get("reason", "") for f in flags.values()), flags
    assert all("'A'" in f["reason"] and "'B'" in f["reason"] for f in flags.values())
    (inc,) = [orjson.loads(j) for j in redis_client.lrange(INCIDENTS, 0, -1)]
    assert inc["kind"] == "registry_conflict" and inc["repositories"] == ["A", "B"]
    assert inc["namespaces"] == {"A": NS_A, "B": NS_B}

    # the operator cannot clear it while the conflict stands; a tracker restart adds nothing
    for repo in ("A", "B"):
        with pytest.raises(UserError, match="registry conflict"):
            clear(redis_client, repo, reason="test", who="pytest")
    with pytest.raises(UserError, match="nothing was cleared"):
        clear(redis_client, None, reason="test", who="pytest")
    with pytest.raises(RebuildError, match="registry conflict"):  # (a rebuild lifts the flag)
        prepare(redis_client, s3, "A")
    asyncio.run(Tracker(s).run_until_caught_up(timeout=60))
    assert redis_client.llen(INCIDENTS) == 1
    assert redis_client.exists(RepoKeys("A").fail_closed, RepoKeys("B").fail_closed) == 2
