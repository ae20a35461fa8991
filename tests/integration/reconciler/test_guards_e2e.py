"""Every delete path re-checks right before its request (issue 8 items 1 and 6, SPEC 3, 8, 9):
holds, fail-closed and paused repositories, namespace ownership. On the real Redis and the real
S3 server, with the real reaper, claim script, deleter core and sweep part.

The tracker's records are written with the one codec (``schemas.records``) exactly as
``apply.lua`` leaves an unreferenced address; the horizon is set by hand (the tracker daemon is
not what these tests exercise)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from prometheus_client import REGISTRY

from core.clients import redis_async
from core.clock import redis_time_ms
from core.settings import Settings
from reaper.claims import ClaimStore
from reaper.daemon import Reaper
from reconciler.s3io import Namespace, put_parquet
from reconciler.sweep import CONFIRMED, SKIPPED_GUARD, SweepPlan, sweep_part
from schemas.layout import (
    FAIL_CLOSED,
    NAMESPACES,
    PROGRESS,
    PROGRESS_META,
    RECONCILER_LEASE,
    REPOS,
    RepoKeys,
)
from schemas.records import AddressRecord, encode_address, encode_token

# Every check holds on one Redis and on a real three-node Redis Cluster (issue 19 item 9).
BOTH_TOPOLOGIES = pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)


def _s(settings: Settings) -> Settings:
    return settings.replace(grace_seconds=1.0, lease_seconds=5.0, quarantine_days=0.0)


def setup_repo(r: Any, s3: Any, repo: str, namespace: str, rels: list[str],
               *, age_ms: int = 60_000) -> list[str]:
    """A repository whose given keys are unreferenced for ``age_ms`` (queued for the reaper),
    the objects in the store, and tracker progress up to now."""
    k = RepoKeys(repo)
    now = redis_time_ms(r)
    since = now - age_ms
    r.sadd(REPOS, repo)
    r.hset(k.meta, mapping={"namespace": namespace, "default_branch": "main",
                            "default_retention_days": "1", "branch_retention": "{}"})
    r.hset(k.tokens, "t1", encode_token("open", since))
    bucket = namespace[5:].split("/", 1)[0]
    addresses = []
    for i, rel in enumerate(rels):
        address = namespace + rel
        addresses.append(address)
        rec = AddressRecord(adds={f"ref{i}": "t1"}, removes={f"ref{i}": "t1"},
                             state="unreferenced", since=since, size=1)
        r.hset(k.address(address), mapping=encode_address(rec))
        r.sadd(k.token_addresses("t1"), address)
        r.zadd(k.unreferenced, {address: since})
        key = address[len(f"s3://{bucket}/"):]
        s3.put_object(Bucket=bucket, Key=key, Body=b"x")
    r.hset(PROGRESS_META, mapping={"topic": "events", "partitions": "1"})
    r.hset(PROGRESS, "0", str(now))
    return addresses


def exists(s3: Any, address: str) -> bool:
    bucket, _, key = address[5:].partition("/")
    return bool(s3.list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount", 0) > 0)


def reap_once(s: Settings, s3: Any, *, dry_run: bool = False) -> Any:
    async def run() -> Any:
        reaper = Reaper(s, s3=s3, dry_run=dry_run)
        try:
            return await reaper.run_once()
        finally:
            await reaper.close()
    return asyncio.run(run())


def by_repo(report: Any) -> dict[str, Any]:
    return {p.repository: p for p in report.repos}


HOLD = orjson.dumps({"reason": "dead-lettered event names it", "source": "test",
                     "at_ms": 1}).decode()


@BOTH_TOPOLOGIES
def test_held_addresses_are_never_reaped(settings, redis_client, s3, bucket):
    s, r = _s(settings), redis_client
    ns = f"s3://{bucket}/repo/"
    held, prefixed, gone = setup_repo(r, s3, "repo", ns, ["data/1/held", "data/2/x", "data/1/go"])
    k = RepoKeys("repo")
    r.hset(k.holds, held, HOLD)
    r.hset(k.hold_prefixes, ns + "data/2/", HOLD)
    labels = {"repository": "repo", "reason": "held"}
    before = REGISTRY.get_sample_value("hardelete_reaper_kept_total", labels) or 0.0
    report = by_repo(reap_once(s, s3))["repo"]
    assert REGISTRY.get_sample_value("hardelete_reaper_kept_total", labels) == before + 2
    assert exists(s3, held) and exists(s3, prefixed)
    assert not exists(s3, gone)  # the control: the reaper did run
    assert report.deleted == 1 and report.kept["held"] == 2
    # still queued (looked at again later), never claimed
    assert r.zscore(k.unreferenced, held) is not None and r.zcard(k.claims) == 0
    # the hold is resolved: the next pass reaps it (once the queue's look-again time passes)
    r.hdel(k.holds, held)
    r.hdel(k.hold_prefixes, ns + "data/2/")
    r.zadd(k.unreferenced, {held: 0, prefixed: 0})
    assert by_repo(reap_once(s, s3))["repo"].deleted == 2
    assert not exists(s3, held) and not exists(s3, prefixed)


@BOTH_TOPOLOGIES
def test_a_hold_placed_after_the_claim_is_respected_right_before_the_request(
        settings, redis_client, s3, bucket):
    s, r = _s(settings), redis_client
    ns = f"s3://{bucket}/repo/"
    a, b = setup_repo(r, s3, "repo", ns, ["data/1/a", "data/1/b"])

    async def run() -> Any:
        reaper = Reaper(s, s3=s3)
        try:
            horizon = redis_time_ms(r)
            batch = await reaper.claims.claim("repo", grace_ms=0, cutoff_ms=horizon - 1000,
                                              limit=10, lease_ms=5000, claimer=reaper.id)
            assert {c.address for c in batch.claimed} == {a, b}
            r.hset(RepoKeys("repo").holds, a, HOLD)  # the hold arrives after the claim
            return await reaper._remove(ns, "repo", [a, b],
                                        reaper._recheck("repo", ns, horizon, 1000))
        finally:
            await reaper.close()

    outcome = asyncio.run(run())
    assert outcome.kept == {a: "held"} and list(outcome.deleted) == [b]
    assert exists(s3, a) and not exists(s3, b)


@BOTH_TOPOLOGIES
@pytest.mark.parametrize("flag", ["repo_fail_closed", "global_fail_closed", "paused"])
def test_fail_closed_or_paused_repository_is_not_reaped(settings, redis_client, s3, bucket,
                                                        flag):
    s, r = _s(settings), redis_client
    ns = f"s3://{bucket}/repo/"
    (address,) = setup_repo(r, s3, "repo", ns, ["data/1/a"])
    setup_repo(r, s3, "other", f"s3://{bucket}/other/", ["data/1/b"])
    k = RepoKeys("repo")
    reason = {"repo_fail_closed": "fail_closed", "global_fail_closed": "fail_closed",
              "paused": "paused"}[flag]
    if flag == "repo_fail_closed":
        r.hset(k.fail_closed, mapping={"reason": "log reset", "at_ms": "1"})
    elif flag == "global_fail_closed":
        r.hset(FAIL_CLOSED, mapping={"reason": "redis lost everything", "at_ms": "1"})
    else:
        r.set(k.paused, orjson.dumps({"reason": "maintenance", "at_ms": 1}))
    report = by_repo(reap_once(s, s3))
    assert exists(s3, address)
    assert report["repo"].skipped == reason and report["repo"].claimed == 0
    assert r.zcard(k.claims) == 0 and r.zscore(k.unreferenced, address) is not None
    other_gone = not exists(s3, f"s3://{bucket}/other/data/1/b")
    assert other_gone == (flag != "global_fail_closed")  # only the global flag stops all
    if flag != "global_fail_closed":
        # the claim script refuses on its own too (not only the Python pre-check)
        async def claim() -> Any:
            ar = redis_async(s)
            try:
                return await ClaimStore(ar).claim("repo", grace_ms=0, cutoff_ms=redis_time_ms(r),
                                                  limit=10, lease_ms=1000, claimer="x")
            finally:
                await ar.aclose()
        batch = asyncio.run(claim())
        assert batch.refused == reason and not batch.claimed


@BOTH_TOPOLOGIES
def test_an_address_of_another_live_repository_is_refused_right_before_the_request(
        settings, redis_client, s3, bucket):
    """P's namespace contains R's (registered by hand, as a broken admission would): P's queue
    holds an address of R. The claim passes (it is inside P's namespace); the ownership check
    right before the request refuses it."""
    s, r = _s(settings), redis_client
    ns_p, ns_r = f"s3://{bucket}/", f"s3://{bucket}/R/"
    r_addr, p_addr = setup_repo(r, s3, "P", ns_p, ["R/data/1/live", "data/1/garbage"])
    r.hset(NAMESPACES, mapping={ns_p: "P", ns_r: "R"})
    report = by_repo(reap_once(s, s3))["P"]
    assert exists(s3, r_addr), "P's reaper deleted an object of R"
    assert not exists(s3, p_addr)
    assert report.kept["not_owner"] == 1 and report.deleted == 1


@BOTH_TOPOLOGIES
def test_retired_or_unregistered_repository_deletes_nothing(settings, redis_client, s3, bucket):
    s, r = _s(settings), redis_client
    ns = f"s3://{bucket}/old/"
    (address,) = setup_repo(r, s3, "old", ns, ["data/1/a"])
    # the registry has entries (authoritative) but none for "old": a retired repository
    r.hset(NAMESPACES, f"s3://{bucket}/new/", "new")
    report = by_repo(reap_once(s, s3))["old"]
    assert report.skipped == "not_owner" and exists(s3, address)
    # an empty registry is the legacy mode: only the namespace check applies
    r.delete(NAMESPACES)
    assert by_repo(reap_once(s, s3))["old"].deleted == 1


@BOTH_TOPOLOGIES
def test_an_address_outside_the_namespace_is_refused(settings, redis_client, s3, bucket):
    s, r = _s(settings), redis_client
    ns = f"s3://{bucket}/repo/"
    setup_repo(r, s3, "repo", ns, [])
    # a queue entry outside the namespace (admission would have refused the event)
    outside = f"s3://{bucket}/elsewhere/x"
    s3.put_object(Bucket=bucket, Key="elsewhere/x", Body=b"x")
    k = RepoKeys("repo")
    r.hset(k.address(outside), mapping=encode_address(AddressRecord(
        state="unreferenced", since=1, size=1)))
    r.zadd(k.unreferenced, {outside: 1})
    report = by_repo(reap_once(s, s3))["repo"]
    assert exists(s3, outside)
    assert report.deleted == 0 and report.refused == 1


# --- the sweep --------------------------------------------------------------------------------

def _sweep(s: Settings, r: Any, s3: Any, repo: str, ns: Namespace, rels: list[str]) -> Any:
    """Run one sweep part (what a Spark task runs) over a mark listing ``rels``."""
    mark_key = ns.key("_hardelete/reports/run1/mark/part-00000.parquet")
    out_prefix = ns.key("_hardelete/reports/run1/sweep/part-00000-t-")
    put_parquet(s3, ns.bucket, mark_key, {"key": rels, "category": ["leaked"] * len(rels),
                                          "size": [1] * len(rels),
                                          "digest": [None] * len(rels)})  # no record at mark
    r.set(RECONCILER_LEASE + repo, "run1")
    res = sweep_part(s, SweepPlan(repo, "run1", ns, redis_time_ms(r)), mark_key, out_prefix)
    assert res.error is None, res.error
    from reconciler.s3io import read_parquet_rows

    outcomes = {row[0]: row[1] for row in read_parquet_rows(s3, ns.bucket,
                                                            out_prefix + "00000.parquet",
                                                            ["key", "outcome"])}
    return res.stats, outcomes


@BOTH_TOPOLOGIES
def test_the_sweep_keeps_held_not_owned_and_fail_closed_keys(settings, redis_client, s3,
                                                             bucket):
    s, r = _s(settings), redis_client
    ns = Namespace(f"s3://{bucket}/repo/")
    rels = ["data/1/held", "data/1/prefixheld", "data/2/other-repo", "data/1/go"]
    for rel in rels:  # leaked objects: no tracker record at all
        s3.put_object(Bucket=bucket, Key=ns.key(rel), Body=b"x")
    r.hset(RepoKeys("repo").meta, "namespace", ns.uri)
    k = RepoKeys("repo")
    r.hset(k.holds, ns.address("data/1/held"), HOLD)
    r.hset(k.hold_prefixes, ns.address("data/1/prefix"), HOLD)
    r.hset(NAMESPACES, mapping={ns.uri: "repo", ns.uri + "data/2/": "inner"})
    stats, outcomes = _sweep(s, r, s3, "repo", ns, rels)
    # kept by guards: counted apart from divergences (they never gate the sweep)
    assert outcomes == {"data/1/held": SKIPPED_GUARD, "data/1/prefixheld": SKIPPED_GUARD,
                        "data/2/other-repo": SKIPPED_GUARD, "data/1/go": CONFIRMED}
    assert stats.confirmed == 1 and stats.skipped_guard == 3 and stats.skipped_live == 0
    for rel in rels[:3]:
        assert exists(s3, ns.address(rel))
    assert not exists(s3, ns.address("data/1/go"))
    # the repository goes fail-closed: the sweep deletes nothing more
    s3.put_object(Bucket=bucket, Key=ns.key("data/1/go"), Body=b"x")
    r.hset(k.fail_closed, mapping={"reason": "log reset"})
    stats, outcomes = _sweep(s, r, s3, "repo", ns, ["data/1/go"])
    assert outcomes == {"data/1/go": SKIPPED_GUARD} and exists(s3, ns.address("data/1/go"))
