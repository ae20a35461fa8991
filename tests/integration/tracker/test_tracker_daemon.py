"""The tracker daemon against the real broker (Apache Kafka) and Redis: end to end, dead letters,
progress/horizon, metrics, rebalance between two trackers, kill -9 and restart, Redis Cluster."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson
import pytest
from aiokafka import AIOKafkaConsumer

from core.clients import redis_async, redis_sync
from core.clock import aredis_time_ms, await_horizon, tracker_horizon_ms
from core.registry import repositories
from core.settings import Settings
from schemas import events as ev
from schemas.layout import PROGRESS, PROGRESS_META
from schemas.publisher import Publisher, ensure_topics
from sim.gen import workload
from sim.stack import free_port, start_redis_cluster
from sim.testing import publish, pure_world, timeless, wait_horizon
from tracker.daemon import Tracker, running_tracker
from tracker.state import read_repo_state

NS = "s3://bucket/repo0/"


def assert_matches_pure(settings: Settings, events: list[ev.Event]) -> None:
    world = pure_world(events)
    r = redis_sync(settings)
    try:
        assert repositories(r) == set(world.repos)
        for repo, expected in world.repos.items():
            assert timeless(read_repo_state(r, repo)) == timeless(expected), repo
    finally:
        r.close()


async def test_end_to_end_publish_track_read_back(settings: Settings) -> None:
    events = workload(11, 3_000, repos=5)
    async with running_tracker(settings) as tracker:
        target = await publish(settings, events)
        await wait_horizon(settings, target)
        assert tracker.applied == len(events)
        assert tracker.dead_lettered == 0
    assert_matches_pure(settings, events)
    r = redis_sync(settings)
    meta = r.hgetall(PROGRESS_META)
    assert int(meta.pop("verified_ms")) > 0
    assert meta == {"topic": settings.events_topic, "partitions": str(settings.topic_partitions)}
    r.close()


async def test_horizon_advances_on_idle_partitions_and_stops_with_the_tracker(
        settings: Settings) -> None:
    await ensure_topics(settings)
    r = redis_async(settings)
    try:
        assert await asyncio.wait_for(_horizon(r), 5) is None  # nothing tracked yet
        async with running_tracker(settings):
            t1 = await aredis_time_ms(r)
            await await_horizon(r, t1, 30)  # every partition progresses, none has events
            t2 = await aredis_time_ms(r)
            await await_horizon(r, t2, 30)  # and keeps progressing
        stopped = await _horizon(r)
        # A stopped tracker holds the horizon back: it never passes the stop time.
        t3 = await aredis_time_ms(r)
        await asyncio.sleep(0.3)  # give a (wrongly) running tracker time to advance it
        assert await _horizon(r) == stopped
        assert stopped is not None and stopped <= t3
    finally:
        await r.aclose()


async def test_start_up_verifies_each_partition_once(settings: Settings) -> None:
    """On a first start the fetcher looks for the group's offsets before the listener's seek
    from Redis lands (NoOffsetForPartitionError). The tracker waits for that seek; it used to
    verify every partition a second time (seconds of probing, and two verifications racing on
    hd:log's compare-and-set)."""
    await ensure_topics(settings)
    r = redis_async(settings)
    try:
        for name in ("first", "second"):  # a fresh group, then one with committed offsets
            async with running_tracker(settings, name=name) as tracker:
                if name == "first":
                    await publish(settings, workload(3, 40, repos=4))
                await await_horizon(r, await aredis_time_ms(r), 30)
                assert tracker.verified == settings.topic_partitions, name
    finally:
        await r.aclose()


async def test_horizon_follows_the_clock_closely_while_idle(settings: Settings) -> None:
    """An idle tracker's horizon trails the Redis clock by about two fetches, not by the
    broker's longest fetch wait: the log-identity probe goes idle between probes, so the
    partition-count checks its client also sends do not queue behind a fetch the broker holds
    (which once kept the horizon, and with it every unreferenced-to-deleted time, 3-5 s
    behind)."""
    settings = settings.replace(tracker_poll_ms=200)  # the default
    await ensure_topics(settings)
    r = redis_async(settings)
    try:
        async with running_tracker(settings) as tracker:
            await await_horizon(r, await aredis_time_ms(r), 30)
            assert tracker._probe is not None and tracker._probe.assignment() == set()
            waits = []
            for _ in range(5):
                target, t0 = await aredis_time_ms(r), time.monotonic()
                await await_horizon(r, target, 30)
                waits.append(time.monotonic() - t0)
            assert sorted(waits)[2] < 2.5, waits  # the median (it was 3.5 s and more)
    finally:
        await r.aclose()


async def _horizon(r):
    from core.clock import atracker_horizon_ms

    return await atracker_horizon_ms(r)


def test_horizon_requires_every_partition() -> None:
    from core.clock import horizon_from

    assert horizon_from({}, {"0": "5"}) is None
    assert horizon_from({"partitions": "2"}, {"0": "5"}) is None
    assert horizon_from({"partitions": "2"}, {"0": "5", "1": "3"}) == 3


def _bad_records(settings: Settings) -> list[tuple[bytes, bytes, str]]:
    """(value, key, expected reason fragment): one for each kind of bad event."""
    good = orjson.loads(ev.encode(ev.ObjectWritten(
        repository="repo0", branch="main", staging_token="t", path="p",
        address=NS + "data/x", size=1, ref_id="r1")))

    def variant(**changes: object) -> bytes:
        body = {**good, **changes}
        return orjson.dumps({k: v for k, v in body.items() if v is not ...})

    return [
        (b"{not json", b"repo0", "not valid JSON"),
        (variant(ref_id=...), b"repo0", "field 'ref_id': missing"),
        (variant(size="big"), b"repo0", "field 'size': expected integer"),
        (variant(v=2), b"repo0", "unsupported schema version"),
        (variant(type="object_moved"), b"repo0", "unknown event type"),
        (variant(repository="nope"), b"nope", "unknown repository 'nope'"),
        (variant(address="s3://elsewhere/data/x"), b"repo0", "outside namespace"),
        (variant(address=NS + "_hardelete/manifests/m"), b"repo0", "reserved"),
        (variant(address=NS + "_lakefs/x"), b"repo0", "reserved"),
    ]


async def test_dead_letter_for_each_kind_of_bad_event(settings: Settings) -> None:
    good = [ev.RepositoryCreated(repository="repo0", storage_namespace=NS,
                                 default_branch="main", default_retention_days=1.0)]
    after = [ev.ObjectWritten(repository="repo0", branch="main", staging_token="t", path="p",
                              address=NS + "data/ok", size=1, ref_id="ok")]
    bad = _bad_records(settings)
    await ensure_topics(settings)
    async with Publisher(settings) as pub:
        await pub.publish_many(good)
        for value, key, _ in bad:
            await pub.publish_raw(value, key)
        await pub.publish_many(after)
    r = redis_async(settings)
    target = await aredis_time_ms(r)
    await r.aclose()
    async with running_tracker(settings) as tracker:
        await wait_horizon(settings, target)
        assert tracker.dead_lettered == len(bad)
        assert tracker.applied == 2
    # The tracker kept going: the event after the bad ones is applied.
    rs = redis_sync(settings)
    state = read_repo_state(rs, "repo0")
    rs.close()
    assert state.addresses[NS + "data/ok"].adds == {"ok": "t"}
    assert set(state.addresses) == {NS + "data/ok"}

    consumer = AIOKafkaConsumer(settings.dlq_topic, bootstrap_servers=settings.kafka_bootstrap,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    got = []
    try:
        deadline = time.monotonic() + 30
        while len(got) < len(bad) and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200)
            for recs in batch.values():
                got.extend(recs)
    finally:
        await consumer.stop()
    assert len(got) == len(bad)
    by_value = {rec.value: dict(rec.headers) for rec in got}
    for value, _, fragment in bad:
        headers = by_value[value]
        assert fragment in headers["reason"].decode(), (fragment, headers["reason"])
        assert headers["topic"].decode() == settings.events_topic
        assert int(headers["partition"]) in range(settings.topic_partitions)
        assert int(headers["offset"]) >= 0


async def test_metrics_endpoint(settings: Settings) -> None:
    port = free_port()
    s = settings.replace(metrics_port=port)
    events = workload(3, 300, repos=2)
    async with running_tracker(s):
        target = await publish(s, events)
        await wait_horizon(s, target)
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read())
    text = body.decode()
    assert f"hardelete_tracker_events_applied_total {float(len(events))}" in text
    assert "hardelete_tracker_batch_seconds_count" in text
    assert 'hardelete_tracker_lag{partition="0"} 0.0' in text
    assert "hardelete_tracker_incidents_total 0.0" in text


async def test_two_trackers_with_a_rebalance_in_the_middle(settings: Settings) -> None:
    events = workload(21, 12_000, repos=8)
    first = Tracker(settings, name="one")
    first.start()
    await publish(settings, events[:2_000])
    second = Tracker(settings, name="two")
    second.start()  # joins mid-stream: the group rebalances while events flow
    await ensure_topics(settings)
    sent = 2_000
    async with Publisher(settings) as pub:
        while not second.assigned_event.is_set():
            assert sent < len(events) - 2_000, "the second tracker never got partitions"
            await pub.publish_many(events[sent:sent + 100])
            sent += 100
            await asyncio.sleep(0.03)  # pace the publisher: a stream, not a burst
        await pub.publish_many(events[sent:])
    r = redis_async(settings)
    target = await aredis_time_ms(r)
    await r.aclose()
    await wait_horizon(settings, target, timeout=90)
    # Both applied part of the stream; every event was applied exactly once overall.
    assert first.applied > 0 and second.applied > 0
    assert first.applied + second.applied == len(events)
    await first.stop()
    await second.stop()
    assert_matches_pure(settings, events)


def _env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARDELETE_")}
    env.update({
        "HARDELETE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "HARDELETE_REDIS_URL": settings.redis_url,
        "HARDELETE_EVENTS_TOPIC": settings.events_topic,
        "HARDELETE_DLQ_TOPIC": settings.dlq_topic,
        "HARDELETE_CONSUMER_GROUP": settings.consumer_group,
        "HARDELETE_SESSION_TIMEOUT_MS": "3000",
        "HARDELETE_HEARTBEAT_INTERVAL_MS": "1000",
        "HARDELETE_TRACKER_BATCH_MAX": "500",
        "HARDELETE_LOG_FORMAT": "json",
    })
    return env


def _hardelete() -> list[str]:
    exe = Path(sys.executable).parent / "hardelete"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "hardelete.cli"]


@pytest.mark.slow
async def test_kill_9_during_a_batch_then_restart(settings: Settings, tmp_path: Path) -> None:
    events = workload(31, 30_000, repos=6)
    await publish(settings, events)
    r = redis_sync(settings)
    log = (tmp_path / "tracker.log").open("wb")
    proc = subprocess.Popen([*_hardelete(), "tracker", "run", "--name", "victim"],
                            env=_env(settings), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:  # kill once it is mid-way: some events applied, not all
            applied = sum(int(r.hget(f"hd:{{repo-r{i}}}:stats", "events") or 0) for i in range(6))
            if applied > 2_000:
                break
            assert proc.poll() is None, (tmp_path / "tracker.log").read_text()
            assert time.monotonic() < deadline, "tracker made no progress"
            await asyncio.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        applied = sum(int(r.hget(f"hd:{{repo-r{i}}}:stats", "events") or 0) for i in range(6))
        assert applied < len(events), "too late to kill mid-stream; raise the event count"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Restart: the uncommitted batch is redelivered; the script skips what was applied.
    t = redis_async(settings)
    target = await aredis_time_ms(t)
    await t.aclose()
    async with running_tracker(settings, name="restarted") as tracker:
        await wait_horizon(settings, target, timeout=90)
        # Redelivered events (applied but not committed by the victim) are skipped.
        assert tracker.applied + applied == len(events)
    total = sum(int(r.hget(f"hd:{{repo-r{i}}}:stats", "events") or 0) for i in range(6))
    r.close()
    assert total == len(events)  # every event applied exactly once
    assert_matches_pure(settings, events)


async def test_sigterm_finishes_commits_and_exits_0(settings: Settings, tmp_path: Path) -> None:
    events = workload(41, 2_000, repos=3)
    target = await publish(settings, events)
    proc = subprocess.Popen([*_hardelete(), "tracker", "run"], env=_env(settings),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        await wait_horizon(settings, target, timeout=60)
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out.decode()
    assert b"tracker stopped" in out
    # Offsets were committed: a new tracker in the same group re-applies nothing.
    async with running_tracker(settings) as tracker:
        t = redis_async(settings)
        t2 = await aredis_time_ms(t)
        await t.aclose()
        await wait_horizon(settings, t2)
        assert tracker.applied == 0 and tracker.redelivered == 0


async def test_redis_cluster(settings: Settings, tmp_path: Path) -> None:
    nodes = await asyncio.to_thread(start_redis_cluster, tmp_path, 3)
    try:
        s = settings.replace(redis_url=f"redis://127.0.0.1:{nodes[0].port}/0",
                             redis_cluster=True)
        events = workload(51, 3_000, repos=9)
        async with running_tracker(s, name="cluster") as tracker:
            target = await publish(s, events)
            await wait_horizon(s, target)
            assert tracker.applied == len(events)
        rc = redis_sync(s)
        try:
            slots = {rc.keyslot(f"hd:{{{repo}}}:repo") for repo in repositories(rc)}
            assert len(slots) > 1  # the repositories really are spread over the nodes
            nodes_used = {rc.get_node_from_key(f"hd:{{{repo}}}:repo").port
                          for repo in repositories(rc)}
            assert len(nodes_used) > 1
            assert tracker_horizon_ms(rc) is not None
            assert rc.hlen(PROGRESS) == settings.topic_partitions
        finally:
            rc.close()
        assert_matches_pure(s, events)
    finally:
        for n in nodes:
            n.stop()


async def test_incident_end_to_end(settings: Settings) -> None:
    """A copy published for an address the reaper already deleted: recorded, logged, counted."""
    from schemas.layout import RepoKeys

    first = [ev.RepositoryCreated(repository="repo0", storage_namespace=NS,
                                  default_branch="main", default_retention_days=1.0),
             ev.ObjectDeleted(repository="repo0", branch="main", staging_token="t", path="p",
                              address=NS + "data/gone", ref_id="r1")]
    async with running_tracker(settings) as tracker:
        await wait_horizon(settings, await publish(settings, first))
        r = redis_sync(settings)
        k = RepoKeys("repo0")
        r.hset(k.address(NS + "data/gone"), mapping={"state": "reaped", "reaped_at": "1"})
        r.zrem(k.unreferenced, NS + "data/gone")
        late = ev.ObjectCopied(repository="repo0", branch="main", staging_token="t2", path="q",
                               address=NS + "data/gone", size=1, ref_id="r2",
                               source_read_at=1.0, event_id="late-copy")
        await wait_horizon(settings, await publish(settings, [late]))
        assert tracker.incidents == 1
        assert tracker.metrics.incidents._value.get() == 1
    (raw,) = r.lrange(k.incidents, 0, -1)
    inc = orjson.loads(raw)
    assert {k_: inc[k_] for k_ in ("repository", "address", "event_id", "type", "ref_id")} == {
        "repository": "repo0", "address": NS + "data/gone", "event_id": "late-copy",
        "type": "object_copied", "ref_id": "r2"}
    assert r.hget(k.stats, "incidents") == "1"
    assert r.hget(k.address(NS + "data/gone"), "state") == "reaped"
    r.close()


def test_partition_clock_needs_two_fresh_fetches_and_the_position() -> None:
    from tracker.progress import PartitionClock

    c = PartitionClock()
    c.begin(1_000, ts=50)  # Redis time 1000 read; last fetch seen at local ts 50
    c.sample(50, 10)
    assert c.claim(10**9) is None  # no fetch since: nothing is known about time 1000
    c.sample(60, 12)  # one fetch processed after the read: its request may predate it
    assert c.claim(10**9) is None
    c.sample(70, 15)  # a second one: requested after the first was processed
    assert c.claim(14) is None  # not everything below the highwater is applied yet
    assert c.claim(15) == 1_000
    assert c.claim(10**9) is None  # claimed once
    c.begin(2_000, ts=70)
    c.begin(3_000, ts=70)  # replaces the candidate that saw no fetch yet
    c.sample(80, 20)
    c.sample(90, 21)
    assert c.claim(21) == 3_000


def test_fetch_wait_grows_only_while_starved_behind_the_end() -> None:
    from tracker.fetching import FetchWait

    w = FetchWait(poll_ms=50, catchup_ms=3_000, stuck_s=1.0)
    assert w.current == 50
    # Behind, with fetched records in hand (the tracker, not the broker, is the limit): short.
    for i in range(40):
        assert w.after_fetch({0: (100 * i, 10_000, True), 1: (5, 5, False)}, now=i * 0.1) == 50
    # Behind with nothing in hand, fetch after fetch: once per starved second the wait doubles.
    got = [w.after_fetch({0: (4_000, 10_000, False), 1: (5, 5, False)}, now=4.0 + i * 0.1)
           for i in range(100)]
    assert got[:10] == [50] * 10  # not a whole second yet
    assert sorted(set(got)) == [50, 100, 200, 400, 800, 1_600, 3_000]
    assert got[-1] == 3_000  # capped
    # Starved only now and then (records in hand most of the time): the wait is kept.
    for i in range(30):
        assert w.after_fetch({0: (5_000 + i, 10_000, i % 5 != 0)}, now=15.0 + i * 0.1) == 3_000
    # No partition behind: latency matters again.
    assert w.after_fetch({0: (10_000, 10_000, False), 1: (5, 5, False)}, now=20.0) == 50
    # A partition whose high watermark is unknown is not behind.
    assert w.after_fetch({0: (10_000, None, False)}, now=30.0) == 50
    assert FetchWait(poll_ms=500, catchup_ms=100).grow() == 500  # never under the poll


@pytest.mark.parametrize("topology", ["single", "cluster"])
async def test_a_repository_going_back_under_a_running_tracker_is_never_applied_past(
        settings: Settings, tmp_path: Path, topology: str) -> None:
    """The log guard holds on one node and on a Redis Cluster (issue 19 item 9: with
    ``redis_cluster`` the guard used to be off). A repository's keys go back to an older copy
    while the tracker runs (single node: all of Redis, hd:log included; cluster: the node of the
    repository's slot only, hd:log elsewhere does not move). The next chunk of it is refused
    rather than applied on top of the hole: one node replays from the older hd:log (repaired);
    the cluster, whose hd:log did not move, fails the repository closed."""
    import redis as redis_lib

    from schemas.layout import LOG, RepoKeys

    nodes = []
    s = settings
    if topology == "cluster":
        nodes = await asyncio.to_thread(start_redis_cluster, tmp_path, 3)
        s = settings.replace(redis_url=f"redis://127.0.0.1:{nodes[0].port}/0",
                             redis_cluster=True)
    raw = (redis_lib.RedisCluster.from_url(s.redis_url) if topology == "cluster"
           else redis_lib.Redis.from_url(s.redis_url))
    ns = "s3://b/back/"
    first = [ev.RepositoryCreated(repository="back", storage_namespace=ns,
                                  default_branch="main", default_retention_days=1.0),
             ev.BranchCreated(repository="back", branch="main", staging_token="t",
                              ref_version=1),
             ev.ObjectWritten(repository="back", branch="main", staging_token="t", path="a",
                              address=ns + "data/a", size=1, ref_id="ra")]
    lost = [ev.ObjectWritten(repository="back", branch="main", staging_token="t", path="b",
                             address=ns + "data/b", size=1, ref_id="rb")]
    later = [ev.ObjectDeleted(repository="back", branch="main", staging_token="t", path="a",
                              address=ns + "data/a", ref_id="ra")]
    k = RepoKeys("back")
    try:
        async with running_tracker(s, name=topology) as tracker:
            await wait_horizon(s, await publish(s, first))
            names = [n for n in raw.scan_iter(match=f"{k.tag}:*".encode())]
            if topology == "single":
                names.append(LOG.encode())
            copy = {n: raw.dump(n) for n in names}
            await wait_horizon(s, await publish(s, lost))
            # the older copy comes back: what it did not hold is gone, the rest is as it was
            for n in raw.scan_iter(match=f"{k.tag}:*".encode()):
                if n not in copy:
                    raw.delete(n)
            for n, value in copy.items():
                raw.restore(n, 0, value, replace=True)
            await wait_horizon(s, await publish(s, later))

            async def noticed() -> bool:
                return tracker.regressions >= 1
            deadline = time.monotonic() + 30
            while not await noticed():
                assert time.monotonic() < deadline, "the regression was never noticed"
                await asyncio.sleep(0.05)
            r = redis_sync(s)
            try:
                if topology == "cluster":
                    reason = r.hget(k.fail_closed, "reason")
                    assert reason and "went back in time" in reason
                else:
                    await wait_horizon(s, await publish(s, []))
            finally:
                r.close()
        if topology == "single":  # replayed from the older hd:log: whole again
            assert_matches_pure(s, first + lost + later)
    finally:
        raw.close()
        for n in nodes:
            n.stop()
