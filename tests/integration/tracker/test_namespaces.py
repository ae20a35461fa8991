"""Namespace ownership and the repository lifecycle (SPEC safety 8): the pure rules, the
registry script, and end to end on the real stack (Kafka, Redis, MinIO) with the reaper.

A repository whose namespace equals, contains or lies inside a live repository's is refused
(dead letter with the reason, and an incident); ``repository_deleted`` retires a repository:
its queue and claims go, later events of it are refused, its id is never reused, and only
then is its namespace free for a new repository."""

from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import pytest

from core.clients import redis_async, redis_sync
from core.clock import await_horizon
from core.guards import fail_closed_repos
from core.registry import register_namespace
from core.settings import Settings
from hardelete.failclosed import clear
from hardelete.status import collect_status, explain_address
from reaper.daemon import Reaper
from reconciler.retirement import purge_retired
from schemas import events as ev
from schemas.layout import INCIDENTS, NAMESPACES, REPOS, RETIRED, RepoKeys
from schemas.namespaces import overlaps, registration_problem
from sim.operations import created, deleted, written
from sim.testing import dead_letters, publish
from tracker.daemon import Tracker, running_tracker
from tracker.state import read_repo_state

# --- the pure rules -----------------------------------------------------------------------------









def test_registration_reports_the_same_conflict_as_the_script(redis_client):
    registry = {"s3://b/a/": "A", "s3://b/c/": "C", "s3://b/é/": "E"}
    for ns, repo in registry.items():
        assert register_namespace(redis_client, repo, ns) is None
    for ns in ["s3://b/", "s3://b/c/d/", "s3://b/é/x/", "s3://b/z/"]:
        assert register_namespace(redis_client, "P", ns) \
            == registration_problem(registry, "P", ns)
        redis_client.hdel(NAMESPACES, "s3://b/z/")
    assert register_namespace(redis_client, "A", "s3://b/a/") is None  # idempotent
    assert "already owns" in (register_namespace(redis_client, "A", "s3://b/q/") or "")
def test_registration_is_atomic_across_concurrent_trackers(settings, redis_client):
    """Many clients register nested and equal namespaces at once: the registry never holds
    two overlapping namespaces, and each call's verdict is what the registry shows."""
    spaces = ["s3://b/", "s3://b/x/", "s3://b/x/y/", "s3://b/x/y/z/", "s3://b/w/", "s3://c/"]
    jobs = [(f"repo{i}", spaces[i % len(spaces)]) for i in range(48)]

    def register(job: tuple[str, str]) -> tuple[str, str, str | None]:
        r = redis_sync(settings)
        try:
            return job[0], job[1], register_namespace(r, *job)
        finally:
            r.close()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(register, jobs))
    registry = redis_client.hgetall(NAMESPACES)
    assert {(repo, ns) for repo, ns, problem in results if problem is None} \
        == {(repo, ns) for ns, repo in registry.items()}
    for a, b in itertools.combinations(registry, 2):
        assert not overlaps(a, b), (a, b)
    assert registry  # somebody won


# --- end to end ----------------------------------------------------------------------------------

async def _wait(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _past_grace(settings: Settings, target_ms: int) -> None:
    """Wait until the tracker's proven progress passes target + grace (no sleep)."""
    r = redis_async(settings)
    try:
        await await_horizon(r, target_ms + int(settings.grace_seconds * 1000) + 50, 60)
    finally:
        await r.aclose()


async def _reap(settings: Settings) -> Any:
    reaper = Reaper(settings)
    try:
        return await reaper.run_once()
    finally:
        await reaper.close()


def _exists(s3: Any, bucket: str, key: str) -> bool:
    return bool(s3.list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount"))
async def test_a_repository_over_a_live_namespace_is_refused_and_reaps_nothing_of_it(
        settings: Settings, s3: Any, bucket: str) -> None:
    """P claims s3://b/ while R owns s3://b/R/: refused (dead letter + incident), and P's write
    and delete of R's committed object never reach any reaper queue."""
    r_ns, p_ns = f"s3://{bucket}/R/", f"s3://{bucket}/"
    x = r_ns + "data/x"
    s3.put_object(Bucket=bucket, Key="R/data/x", Body=b"committed in R")
    r_events: list[ev.Event] = [
        created("R", r_ns),
        ev.BranchCreated(repository="R", branch="main", staging_token="t1", ref_version=1),
        written("R", x, token="t1", ref="rx"),
        ev.CommitCreated(repository="R", branch="main", commit_id="c1", parents=[],
                         sealed_tokens=["t1"], staging_token="t2", committed_at=1.0,
                         manifest=r_ns + "_hardelete/manifests/c1.parquet", ref_version=2),
    ]
    p_events: list[ev.Event] = [
        created("P", p_ns, event_id="p-create"),
        ev.BranchCreated(repository="P", branch="main", staging_token="tp", event_id="p-branch",
                         ref_version=1),
        ev.ObjectWritten(repository="P", branch="main", staging_token="tp", path="q",
                         address=x, size=1, ref_id="rp", event_id="p-write"),
        ev.ObjectDeleted(repository="P", branch="main", staging_token="tp", path="q",
                         address=x, ref_id="rp", event_id="p-delete"),
    ]
    r = redis_async(settings)
    try:
        async with running_tracker(settings) as tracker:
            await publish(settings, r_events)

            async def registered() -> bool:
                return bool(await r.hget(NAMESPACES, r_ns) == "R")

            await _wait(registered, "R's namespace registered")
            target = await publish(settings, p_events)
            await _past_grace(settings, target)
            report = await _reap(settings)
            dead_lettered = tracker.dead_lettered
        assert _exists(s3, bucket, "R/data/x"), "R's committed object was deleted"
        assert dead_lettered == len(p_events)
        assert await r.smembers(REPOS) == {"R"}
        assert await r.hgetall(NAMESPACES) == {r_ns: "R"}
        assert not await r.exists(RepoKeys("P").unreferenced)
    finally:
        await r.aclose()
    assert report.total("deleted") == 0
    reasons = await dead_letters(settings, len(p_events))
    assert "namespace overlap" in reasons["p-create"] and "'R'" in reasons["p-create"]
    assert reasons["p-write"] == "unknown repository 'P'"
    rs = redis_sync(settings)
    try:
        st = collect_status(rs)
        assert st.global_incidents_total == 1
        (inc,) = st.global_incidents
        assert (inc["repository"], inc["event_id"]) == ("P", "p-create")
        assert "namespace overlap" in inc["reason"] and inc["namespace"] == p_ns
        assert read_repo_state(rs, "R").addresses[x].committed
    finally:
        rs.close()
async def test_a_retired_repositorys_queue_is_not_reaped_under_a_new_repository(
        settings: Settings, s3: Any, bucket: str) -> None:
    """R1 queues address a (written, deleted), is retired, and R2 is created on the same
    namespace and references a: nothing of R1 deletes it; R1's late events and a re-use of its
    id are refused. R2's premature repository_created (while R1 still owned the namespace) is
    refused, and stays refused when the same event is delivered again after the retirement."""
    ns = f"s3://{bucket}/repo/"
    a = ns + "data/a"
    s3.put_object(Bucket=bucket, Key="repo/data/a", Body=b"referenced by R2")
    early = created("R2", ns, event_id="r2-early")
    phase1: list[ev.Event] = [
        created("R1", ns),
        written("R1", a, token="t1", ref="r1"),
        deleted("R1", a, token="t1", ref="r1"),
    ]
    phase2: list[ev.Event] = [
        early,  # delivered again: the refusal is final
        created("R2", ns),
        ev.BranchCreated(repository="R2", branch="main", staging_token="u1", ref_version=1),
        written("R2", a, token="u1", ref="r2"),
        ev.ObjectWritten(repository="R1", branch="main", staging_token="t1", path="z",
                         address=ns + "data/late", size=1, ref_id="late", event_id="r1-late"),
        created("R1", f"s3://{bucket}/again/", event_id="r1-again"),
    ]
    r = redis_async(settings)
    try:
        async with running_tracker(settings):
            await publish(settings, phase1)

            async def registered() -> bool:
                return bool(await r.hget(NAMESPACES, ns) == "R1")

            async def refused() -> bool:
                return bool(await r.llen(INCIDENTS))

            await _wait(registered, "R1 registered")
            await publish(settings, [early])
            await _wait(refused, "R2's premature repository_created refused")
            # R2's service may write into R1's namespace: both are fail-closed (R1's purge
            # waits) until the operator, having judged it, clears R1 (R2 is not live: the
            # conflict does not stand)
            rs = redis_sync(settings)
            try:
                for repo in ("R1", "R2"):
                    assert "'R1'" in rs.hget(RepoKeys(repo).fail_closed, "reason") \
                        and "'R2'" in rs.hget(RepoKeys(repo).fail_closed, "reason")
                assert clear(rs, "R1", reason="R2's service writes nothing yet",
                             who="pytest") == 1
            finally:
                rs.close()
            await publish(settings, [ev.RepositoryDeleted(
                repository="R1", storage_namespace=ns, event_id="r1-retire")])

            async def retired() -> bool:  # the service waits for the retirement to land
                return bool(await r.hexists(RETIRED, "R1"))

            await _wait(retired, "R1 retired")
            queue_dropped = not await r.exists(RepoKeys("R1").unreferenced)
            # its data is kept, and with it its namespace, until an operator releases it
            assert await r.hget(NAMESPACES, ns) == "R1"
            purge = await asyncio.to_thread(purge_retired, settings, "R1", release=True)
            assert purge["status"] == "done" and purge["deleted"] == 1
            assert not await r.hexists(NAMESPACES, ns)
            s3.put_object(Bucket=bucket, Key="repo/data/a", Body=b"referenced by R2")
            target = await publish(settings, phase2)
            await _past_grace(settings, target)
            report = await _reap(settings)
        assert _exists(s3, bucket, "repo/data/a"), "R1's stale queue deleted R2's object"
        assert queue_dropped
        assert await r.hgetall(NAMESPACES) == {ns: "R2"}
        assert await r.smembers(REPOS) == {"R2"}
    finally:
        await r.aclose()
    assert report.total("deleted") == 0
    reasons = await dead_letters(settings, 3)
    assert "s3://" in reasons["r2-early"] and "R1" in reasons["r2-early"]
    assert reasons["r1-late"] == "repository 'R1' is retired"
    assert "never used again" in reasons["r1-again"]
    rs = redis_sync(settings)
    try:
        assert read_repo_state(rs, "R2").addresses[a].state == "staged"
        old = read_repo_state(rs, "R1")
        assert old.retired_at is not None and ns + "data/late" not in old.addresses
        assert orjson.loads(rs.hget(RETIRED, "R1"))["event_id"] == "r1-retire"
        incidents = [orjson.loads(j) for j in rs.lrange(INCIDENTS, 0, -1)]
        # (R1's and R2's events lie on different partitions: no order between them)
        assert sorted(i["event_id"] for i in incidents) == ["r1-again", "r2-early", "r2-early"]
        # (delivered again once R1's namespace was freed: no conflict any more)
        assert [i.get("repositories") for i in incidents if i["event_id"] == "r2-early"] \
            == [["R1", "R2"], None]
        assert len({i["reason"] for i in incidents if i["event_id"] == "r2-early"}) == 1
        assert explain_address(rs, settings, a).repository == "R2"
        gone = explain_address(rs, settings, f"s3://{bucket}/again/x")
        assert gone.repository is None
    finally:
        rs.close()
async def test_two_trackers_admit_no_overlapping_repositories(settings: Settings) -> None:
    """Two trackers of one group, each with its own partitions, admit repository_created events
    whose namespaces nest: the registry ends without overlaps, exactly its owners are live, and
    every refused one is a dead letter with an incident."""
    spaces = ["s3://b/", "s3://b/x/", "s3://b/x/y/", "s3://b/w/", "s3://c/", "s3://c/d/"]
    events = [created(f"repo{i}", spaces[i % len(spaces)], event_id=f"c{i}") for i in range(36)]
    first, second = Tracker(settings, name="one"), Tracker(settings, name="two")
    first.start()
    second.start()
    try:
        await _wait(lambda: _both(first, second), "both trackers assigned", 60)
        target = await publish(settings, events)
        r = redis_async(settings)
        try:
            await await_horizon(r, target, 60)
        finally:
            await r.aclose()
    finally:
        await first.stop()
        await second.stop()
    rs = redis_sync(settings)
    try:
        registry = rs.hgetall(NAMESPACES)
        incidents = [orjson.loads(j) for j in rs.lrange(INCIDENTS, 0, -1)]
        live = rs.smembers(REPOS)
    finally:
        rs.close()
    for a, b in itertools.combinations(registry, 2):
        assert not overlaps(a, b), (a, b)
    assert live == set(registry.values()) and live
    refused = {inc["repository"] for inc in incidents}
    assert refused | live == {e.repository for e in events} and not refused & live
    assert first.dead_lettered + second.dead_lettered == len(refused)


async def _both(first: Tracker, second: Tracker) -> bool:
    return first.assigned_event.is_set() and second.assigned_event.is_set()
async def test_a_tracker_registers_repositories_that_predate_the_registry(
        settings: Settings) -> None:
    """An upgrade: live repositories without a registry entry are registered at start; two
    legacy repositories that overlap leave an incident for the one refused."""
    rs = redis_sync(settings)
    try:
        for repo, ns in [("L1", "s3://b/L/"), ("L2", "s3://b/L/x/"), ("L3", "s3://b/M/")]:
            rs.hset(RepoKeys(repo).meta, mapping={"namespace": ns})
            rs.sadd(REPOS, repo)
        rs.hset(RepoKeys("old").meta, mapping={"namespace": "s3://b/o/", "retired_at": "1"})
        async with running_tracker(settings):
            r = redis_async(settings)
            try:
                async def registered() -> bool:
                    return bool(await r.hlen(NAMESPACES) == 2 and await r.llen(INCIDENTS))

                await _wait(registered, "legacy repositories registered")
            finally:
                await r.aclose()
        assert rs.hgetall(NAMESPACES) == {"s3://b/L/": "L1", "s3://b/M/": "L3"}
        (inc,) = [orjson.loads(j) for j in rs.lrange(INCIDENTS, 0, -1)]
        assert inc["kind"] == "registry_conflict" and inc["refused"] == "L2"
        assert inc["repositories"] == ["L1", "L2"]  # both at risk: both fail-closed
        assert set(fail_closed_repos(rs)) == {"L1", "L2"}
    finally:
        rs.close()
async def test_a_tracker_with_a_stale_cache_cannot_revive_a_retired_repository(
        settings: Settings) -> None:
    """Another tracker retired X after this one cached X as live: a repository_created for X
    is still refused (Redis is asked), and X's namespace is not registered again."""
    from tracker import codec
    from tracker.daemon import _Batch

    t = Tracker(settings)
    t._redis = redis_async(settings)
    try:
        await t._redis.hset(RepoKeys("X").meta,
                            mapping={"namespace": "s3://b/X/", "retired_at": "5"})
        t.gate.namespaces["X"] = "s3://b/X/"  # the stale cache
        body = codec.event_body(created("X", "s3://b/X/"))
        assert t.gate.check(body) is None
        batch = _Batch()
        problem = await t._lifecycle(batch, body, None)
        assert problem is not None and "never used again" in problem
        assert [inc["repository"] for inc in batch.refused] == ["X"]
        assert not batch.new_repos and not await t._redis.hlen(NAMESPACES)
        assert "is retired" in (t.gate.check(codec.event_body(
            written("X", "s3://b/X/data/a", token="t", ref="r"))) or "")
    finally:
        await t._redis.aclose()
async def test_a_retirement_interrupted_after_its_apply_completes_on_redelivery(
        settings: Settings) -> None:
    """A tracker died after the script retired R (queue dropped) but before it recorded the
    retirement: the redelivered repository_deleted finishes the job; the namespace stays R's
    (its data is kept until purged), so S is refused."""
    ns = "s3://b/R/"
    retire = ev.RepositoryDeleted(repository="R", storage_namespace=ns, event_id="retire")
    rs = redis_sync(settings)
    try:
        # the state such a crash leaves: retired in the repository's slot, still live globally
        rs.hset(RepoKeys("R").meta, mapping={"namespace": ns, "retired_at": "7",
                                             "retired_event": "retire"})
        rs.sadd(REPOS, "R")
        rs.hset(NAMESPACES, ns, "R")
        async with running_tracker(settings) as tracker:
            target = await publish(settings, [retire, created("S", ns, event_id="s")])
            r = redis_async(settings)
            try:
                await await_horizon(r, target, 60)
            finally:
                await r.aclose()
            dead_lettered = tracker.dead_lettered
        assert "R" not in rs.smembers(REPOS)
        assert orjson.loads(rs.hget(RETIRED, "R"))["event_id"] == "retire"
        # S arrived while R's data is kept: refused, whatever the batching
        assert rs.hgetall(NAMESPACES) == {ns: "R"}
        assert dead_lettered == 1
    finally:
        rs.close()




@pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)
@pytest.mark.parametrize("inside", [True, False], ids=["nested", "containing"])
async def test_a_repository_created_over_a_live_one_fails_closed_both(
        settings: Settings, s3: Any, bucket: str, inside: bool) -> None:
    """P's repository_created nests in (or contains) live R's namespace (issue 34 item 4;
    failed before: only P's refusal was recorded, R went on deleting, and P's service may write
    its data where R's sweep takes it for R's garbage). Both are fail-closed, one incident names
    both, R's reaper deletes nothing; the operator who judged it clears R (P, refused, is not
    live: the conflict does not stand), and R deletes again."""
    s = settings.replace(grace_seconds=1.0, quarantine_days=0.0)
    r_ns = f"s3://{bucket}/R/"
    p_ns = r_ns + "P/" if inside else f"s3://{bucket}/"
    q = r_ns + "data/q"  # R's own garbage
    s3.put_object(Bucket=bucket, Key="R/data/q", Body=b"garbage of R")
    rs = redis_sync(s)
    try:
        async with running_tracker(s):
            await publish(s, [created("R", r_ns),
                              ev.BranchCreated(repository="R", branch="main",
                                               staging_token="t1", ref_version=1),
                              written("R", q, token="t1", ref="rq"),
                              deleted("R", q, token="t1", ref="rq")])

            async def registered() -> bool:  # (P's events lie on another partition)
                return bool(rs.hget(NAMESPACES, r_ns) == "R")

            await _wait(registered, "R registered")
            target = await publish(s, [created("P", p_ns, event_id="p-create")])
            await _past_grace(s, target)
            report = await _reap(s)
            assert report.total("deleted") == 0 and _exists(s3, bucket, "R/data/q"), \
                report.as_dict()
            for repo in ("R", "P"):
                reason = rs.hget(RepoKeys(repo).fail_closed, "reason") or ""
                assert "registry conflict" in reason and "'P'" in reason and "'R'" in reason
            (inc,) = [orjson.loads(j) for j in rs.lrange(INCIDENTS, 0, -1)]
            assert inc["event_id"] == "p-create" and inc["repositories"] == ["P", "R"]
            assert inc["namespaces"] == {"P": p_ns, "R": r_ns}
            assert clear(rs, "R", reason="P's service writes nothing there", who="pytest") == 1
            report = await _reap(s)
        assert report.total("deleted") == 1 and not _exists(s3, bucket, "R/data/q")
    finally:
        rs.close()
