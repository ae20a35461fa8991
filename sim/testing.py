"""Helpers for tests (tracker, reaper, reconciler): the tests' settings, drive the pure machine
and the Lua script with the same events, compare states with or without arrival-time
timestamps, publish to a running tracker and wait for its horizon, list a bucket and poll a
condition. (Helpers of one concept live beside this module: sim/worlds.py, sim/event_chaos.py,
sim/operations.py, sim/reaping.py, sim/log_loss.py, sim/strategies.py,
sim/retention_examples.py.)"""

from __future__ import annotations

import asyncio
import copy
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from core.clients import redis_async, split_s3_uri
from core.clock import aredis_time_ms, await_horizon
from core.registry import register_namespace
from core.settings import Settings, load_settings
from schemas import events as ev
from schemas.layout import INCIDENTS, REFUSED, REPOS, RETIRED, AddressState, RepoKeys
from schemas.publisher import Publisher, ensure_topics
from sim import sequenced
from sim.sequenced import object_exists as object_exists  # (re-exported for the tests)
from sim.sequenced import put_object as put_object
from tracker import codec
from tracker.references import RefusedRepository, RepoState, World
from tracker.state import ApplyScript

# The test fixtures (tests/conftest.py) that start or reach a server: a test that asks for one
# is an integration test and lives in tests/integration/.
SERVER_FIXTURES = frozenset({"stack", "redis_cluster", "settings", "redis_client", "s3",
                             "bucket", "cli", "spark"})


def misplaced_tests(tests: Iterable[tuple[str, bool, Iterable[str]]]) -> list[str]:
    """Of (test id, in tests/integration/?, its fixture names): each test outside
    tests/integration/ that asks for a server fixture, with the fixtures it asks for."""
    out = []
    for nodeid, integration, fixtures in tests:
        servers = sorted(SERVER_FIXTURES & set(fixtures))
        if servers and not integration:
            out.append(f"{nodeid} uses {', '.join(servers)}")
    return out


def base_settings(**overrides: Any) -> Settings:
    """Settings for tests: short timeouts, tiny grace (explicitly allowed as unsafe)."""
    defaults: dict[str, Any] = {
        "session_timeout_ms": 3000,
        "heartbeat_interval_ms": 1000,
        "grace_seconds": 1.0,
        "allow_unsafe_grace": True,
        "lease_seconds": 5.0,
        "s3_request_seconds": 2,  # (restore waits it out: short in tests)
        "clock_skew_seconds": 0.0,  # one machine, one clock
        "tracker_poll_ms": 50,
        "reaper_poll_seconds": 0.1,
    }
    defaults.update(overrides)
    return load_settings(env={}, **defaults)


async def publish(settings: Settings, events: Iterable[ev.Event]) -> int:
    """Publish (acks=all) and return the Redis time after every ack: the horizon to wait for.
    Through the test's sequenced service when one runs (``sim/sequenced.py``), else raw."""
    await ensure_topics(settings)
    svc = sequenced.active(settings)
    if svc is not None:
        await svc.publish(events)
    else:
        async with Publisher(settings) as pub:
            await pub.publish_many(events)
    return await redis_now(settings)


async def dead_letters(settings: Settings, n: int, timeout: float = 30.0) -> dict[str, str]:
    """event_id -> reason of the first ``n`` dead letters (waits up to ``timeout``)."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(settings.dlq_topic, bootstrap_servers=settings.kafka_bootstrap,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    got: dict[str, str] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            for recs in (await consumer.getmany(timeout_ms=200)).values():
                for rec in recs:
                    got[orjson.loads(rec.value)["event_id"]] = dict(rec.headers)[
                        "reason"].decode()
    finally:
        await consumer.stop()
    return got


async def redis_now(settings: Settings) -> int:
    r = redis_async(settings)
    try:
        return await aredis_time_ms(r)
    finally:
        await r.aclose()


async def wait_horizon(settings: Settings, target: int, timeout: float = 60.0) -> int:
    """Wait until the tracker horizon reaches ``target``, and the continuity horizon of every
    repository the test's sequenced service numbered; returns the tracker's."""
    r = redis_async(settings)
    try:
        h = await await_horizon(r, target, timeout)
    finally:
        await r.aclose()
    svc = sequenced.active(settings)
    if svc is not None:
        await svc.wait_certified(target, timeout)
    return h


def timeless(st: RepoState) -> RepoState:
    """A copy without arrival-time values (since, iu, token/incident ms, index scores).

    ``issued_until`` becomes 1 if set, so that "was issued" still compares."""
    out = copy.deepcopy(st)
    for rec in out.addresses.values():
        rec.since = None
        rec.issued_until = None if rec.issued_until is None else 1
    out.tokens = {t: (s, 0) for t, (s, _) in out.tokens.items()}
    out.incidents = sorted(i.__class__(**{**i.__dict__, "at_ms": 0}) for i in out.incidents)
    out.unreferenced = {a: 0 for a in out.unreferenced}
    return out


def canonical(st: RepoState, counters: bool = True) -> RepoState:
    """Incidents sorted (the script does not promise an order across addresses).
    ``counters=False``: the duplicate counters zeroed (to compare outcomes: delivering a
    duplicate counts it and changes nothing else)."""
    out = copy.deepcopy(st)
    out.incidents = sorted(out.incidents)
    if not counters:
        out.ref_duplicates = out.ref_ids_reused = 0
    return out


def lua_batches(events: Sequence[ev.Event], gate: codec.Gate, first_offset: int = 0
                ) -> tuple[dict[str, list[list[Any]]], list[tuple[int, str]]]:
    """Group a batch by repository as the daemon does: (compact events, rejections)."""
    per_repo: dict[str, list[list[Any]]] = defaultdict(list)
    rejected = []
    for i, e in enumerate(events):
        body = codec.parse(ev.encode(e))
        if body["type"] in ev.RELAY_EVENT_TYPES:
            continue  # (as the daemon: applied as nothing)
        problem = gate.check(body)
        if problem:
            rejected.append((first_offset + i, problem))
        else:
            per_repo[body["repository"]].append(codec.compact(body, first_offset + i))
    return per_repo, rejected


class LuaTracker:
    """The daemon's steps for one batch, synchronously, without Kafka: gate, namespace
    registration, one ``apply.lua`` call per repository, then retirements (``REPOS``,
    ``RETIRED``, registry). For differential tests against :class:`World` (then call
    ``World.settle()`` after each batch)."""

    def __init__(self, r: Any) -> None:
        self.r = r
        self.gate = codec.Gate()

    def batch(self, events: Sequence[ev.Event], now_ms: int | None, first_offset: int = 0,
              partition: int = 0) -> tuple[list[tuple[int, str]], list[Any]]:
        """Apply; returns (rejected (offset, reason), script results)."""
        per_repo: dict[str, list[list[Any]]] = defaultdict(list)
        rejected: list[tuple[int, str]] = []
        new, retired, refused = set(), {}, []
        for i, e in enumerate(events):
            body = codec.parse(ev.encode(e))
            repo, t = body["repository"], body["type"]
            if t in ev.RELAY_EVENT_TYPES:
                continue  # (as the daemon: applied as nothing)
            # As the daemon: a refused repository_created stays refused (hd:refused), and the
            # gate does not learn its repository.
            earlier = self.r.hget(REFUSED, body["event_id"]) if t == "repository_created" else None
            problem = earlier or self.gate.check(body)
            if t == "repository_created":
                if problem is None:
                    problem = register_namespace(self.r, repo, body["storage_namespace"])
                    if problem is not None:
                        self.gate.forget(repo)
                if problem is None:
                    new.add(repo)
                else:
                    self.r.hset(REFUSED, body["event_id"], problem)
                    refused.append(RefusedRepository(repo, body["storage_namespace"], problem,
                                                     body["event_id"], now_ms or 0))
            elif t == "repository_deleted" and problem is None:
                retired[repo] = self.gate.retired[repo]
            if problem:
                rejected.append((first_offset + i, problem))
            else:
                per_repo[repo].append(codec.compact(body, first_offset + i))
        for inc in refused:
            self.r.rpush(INCIDENTS, orjson.dumps({"kind": "repository_refused",
                                                  **inc.__dict__}))
        if new:
            self.r.sadd(REPOS, *new)
        results = apply_lua(self.r, per_repo, now_ms, partition)
        for repo, ns in retired.items():
            self.r.srem(REPOS, repo)
            self.r.hsetnx(RETIRED, repo, orjson.dumps({"namespace": ns, "at_ms": now_ms}))
        return rejected, results


def refused_incidents(r: Any) -> list[RefusedRepository]:
    """``hd:incidents`` read back as the pure World's ``refused`` list."""
    out = []
    for raw in r.lrange(INCIDENTS, 0, -1):
        d = orjson.loads(raw)
        d.pop("kind", None)
        out.append(RefusedRepository(**d))
    return out


def apply_lua(r: Any, batch: dict[str, list[list[Any]]], now_ms: int | None,
              partition: int = 0) -> list[Any]:
    """Apply each repository's chunk; a chunk that creates its repository first registers the
    namespace in ``hd:namespaces`` (as the daemon does; raises if the registry refuses)."""
    for repo, chunk in batch.items():
        for e in chunk:
            if e[1] == codec.OP_REPO:
                problem = register_namespace(r, repo, e[2])
                if problem is not None:
                    raise AssertionError(f"test set-up: {problem}")
    return [ApplyScript.apply_sync(r, repo, partition, chunk, now_ms)
            for repo, chunk in batch.items()]


def reap(r: Any, world: World, repo: str, address: str, now_ms: int) -> None:
    """Play the reaper: mark an address reaped in Redis and in the pure world alike."""
    k = RepoKeys(repo)
    r.hset(k.address(address), mapping={"state": "reaped", "reaped_at": str(now_ms)})
    r.hdel(k.address(address), "since")
    r.zrem(k.unreferenced, address)
    st = world.repos[repo]
    rec = st.addresses[address]
    rec.state = AddressState.REAPED
    rec.reaped_at = now_ms
    rec.since = None
    st.unreferenced.pop(address, None)


def pure_world(events: Iterable[ev.Event], now_ms: int = 1_000) -> World:
    w = World()
    for e in events:
        w.apply(e, now_ms)
    return w


def encode_all(events: Iterable[ev.Event]) -> list[bytes]:
    return [ev.encode(e) for e in events]


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def listed(s3: Any, bucket: str) -> set[str]:
    out: set[str] = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out.update(f"s3://{bucket}/{o['Key']}" for o in page.get("Contents", []))
    return out


async def wait_for(cond: Any, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll an async condition until true or the deadline."""
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def keys_copy(r: Any, pattern: str) -> dict[Any, bytes]:
    """A copy (DUMP) of every key ``pattern`` matches, to take them back to later
    (:func:`keys_go_back`). Redis's glob has no braces: ``hd:{R}:*`` is R's slot."""
    return {n: r.dump(n) for n in r.scan_iter(match=pattern, count=1000)}


def keys_go_back(r: Any, copy: dict[Any, bytes], pattern: str) -> None:
    """The keys ``pattern`` matches as they were in ``copy``: keys written since go, the
    others are restored (what a restore from an older copy or a stale replica's promotion
    does to them)."""
    for n in r.scan_iter(match=pattern, count=1000):
        if n not in copy:
            r.delete(n)
    for n, value in copy.items():
        r.restore(n, 0, value, replace=True)


def slot_copy(raw: Any, repo: str) -> dict[Any, bytes]:
    """A copy of every key of ``repo``'s slot (:func:`keys_copy`)."""
    from schemas.layout import RepoKeys

    return keys_copy(raw, f"{RepoKeys(repo).tag}:*")


def slot_go_back(raw: Any, repo: str, copy: dict[Any, bytes]) -> None:
    """Take ``repo``'s slot back to ``copy`` (:func:`keys_go_back`)."""
    from schemas.layout import RepoKeys

    keys_go_back(raw, copy, f"{RepoKeys(repo).tag}:*")


def raw_redis(settings: Settings) -> Any:
    """A client that does not decode (DUMP/RESTORE: :func:`slot_copy`), Redis Cluster too."""
    import redis as redis_lib

    return (redis_lib.RedisCluster.from_url(settings.redis_url) if settings.redis_cluster
            else redis_lib.Redis.from_url(settings.redis_url))


async def unreferenced_object(settings: Settings, s3: Any, repo: str, namespace: str,
                              address: str) -> None:
    """``address`` stored, written into ``repo``'s branch main (token ``t``) and deleted again:
    unreferenced, the reaper's once grace has passed; the tracker must be running."""
    from contextlib import suppress


    bucket, key = split_s3_uri(address)
    with suppress(s3.exceptions.BucketAlreadyOwnedByYou):
        s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key=key, Body=b"held")
    path = address.removeprefix(namespace)
    events = [ev.RepositoryCreated(repository=repo, storage_namespace=namespace,
                                   default_branch="main", default_retention_days=1.0),
              ev.BranchCreated(repository=repo, branch="main", staging_token="t",
                               ref_version=1),
              ev.ObjectWritten(repository=repo, branch="main", staging_token="t", path=path,
                               address=address, size=4, ref_id="ra"),
              ev.ObjectDeleted(repository=repo, branch="main", staging_token="t", path=path,
                               address=address, ref_id="ra")]
    await wait_horizon(settings, await publish(settings, events))


async def reap_past_grace(settings: Settings, s3: Any) -> Any:
    """One reaper pass once grace has passed on the tracker's horizon (its report)."""
    from reaper.daemon import Reaper

    await asyncio.sleep(settings.grace_seconds + 0.2)  # past grace: judged but for its guards
    await wait_horizon(settings, await redis_now(settings))
    reaper = Reaper(settings, s3=s3)
    try:
        return await reaper.run_once()
    finally:
        await reaper.close()
