"""Safety I on the real stack (issue 8): the tracker proves its evidence is complete, current
and its own, or the repositories affected delete nothing.

- a broker that lost its log (Apache Kafka killed, its data directory wiped and formatted with a
  new cluster id, started on the same port): records reusing offsets are applied, and the
  repositories of the reset partition are fail-closed (the reaper skips them);
- a broker that kept its log (restarted): nothing is fail-closed;
- Redis restored from an older copy of its data: the tracker replays what Redis lost;
- a topic re-created with more partitions: the horizon waits for the new partitions;
- poison records (5 MB, ttl 9e15, null/different key, deep nesting, huge ints): dead-lettered
  with their reasons (truncated when too large), holds on the addresses they name, tracker goes on;
- a dead-letter topic that refuses records (acks=all cannot be met): the tracker waits (hold
  first, nothing committed or claimed past the event) and dead-letters it once the broker
  accepts it again.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from core.clients import redis_sync
from core.clock import tracker_horizon_ms
from core.guards import fail_closed_reason, holds
from core.settings import Settings
from reaper.daemon import Reaper
from schemas import events as ev
from schemas.layout import FAIL_CLOSED, PROGRESS_META, RepoKeys
from schemas.publisher import Publisher, ensure_topics
from sim.log_loss import _lose_log, delete, repo_events, write
from sim.stack import KafkaServer, kafka_server, redis_server
from sim.testing import publish, redis_now, wait_horizon
from tracker.daemon import running_tracker
from tracker.state import read_repo_state

# Every check holds on one Redis and on a real three-node Redis Cluster (issue 19 item 9).
BOTH_TOPOLOGIES = pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)


def fillers(repo: str, ns: str, n: int) -> list[ev.Event]:
    return [ev.AddressIssued(repository=repo, address=f"{ns}data/i{i}", ttl_seconds=3600.0)
            for i in range(n)]


async def _create_topic(s: Settings, name: str, partitions: int, **configs: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1, topic_configs=configs)])
    finally:
        await admin.close()


async def _broker_restart_scenario(settings: Settings, s3: Any, bucket: str,
                                   server: KafkaServer, *, keep_running: bool = False,
                                   kept_log: bool = False) -> tuple[Settings, Any]:
    """Track a repository whose 'gone' address is unreferenced, restart the broker (with the
    tracker stopped, or running through it; its log kept or lost), publish a new write, track
    again. Returns (settings, sync redis)."""
    restart = server.restart if kept_log else (lambda: _lose_log(server))
    s = settings.replace(kafka_bootstrap=f"127.0.0.1:{server.port}", topic_partitions=1)
    ns = f"s3://{bucket}/repo0/"
    s3.put_object(Bucket=bucket, Key="repo0/data/gone", Body=b"x")
    before = [*repo_events(ns), write("repo0", ns + "data/gone", "g1"),
              delete("repo0", ns + "data/gone", "g1"), *fillers("repo0", ns, 40)]
    after = [write("repo0", ns + "data/new", "n1")]
    if keep_running:
        async with running_tracker(s):
            await wait_horizon(s, await publish(s, before))
            await asyncio.to_thread(restart)
            # (Published at once: on Tansu's s3:// engine the tracker first had to prove
            # progress on the restarted broker, tests/repro_tansu_stale_highwater.py.)
            await wait_horizon(s, await publish(s, after), timeout=90)
        return s, redis_sync(s)
    async with running_tracker(s):
        await wait_horizon(s, await publish(s, before))
    await asyncio.to_thread(restart)
    async with running_tracker(s, name="after-restart"):
        await wait_horizon(s, await publish(s, after), timeout=90)
    return s, redis_sync(s)


@BOTH_TOPOLOGIES
async def test_broker_log_lost_new_records_applied_and_repository_fail_closed(
        settings: Settings, s3: Any, bucket: str, tmp_path: Path) -> None:
    server = kafka_server(tmp_path)
    await asyncio.to_thread(server.start)
    try:
        s, r = await _broker_restart_scenario(settings, s3, bucket, server)
        ns = f"s3://{bucket}/repo0/"
        state = read_repo_state(r, "repo0")
        # Offset 0 of the new log was applied, not skipped as "already applied".
        assert state.addresses[ns + "data/new"].adds == {"n1": "t1"}
        reason = fail_closed_reason(r, "repo0")
        assert reason is not None and "log reset" in reason
        assert any(i.type == "fail_closed" for i in state.incidents)
        # The reaper deletes nothing for a fail-closed repository, even past grace...
        async with running_tracker(s, name="for-reaper"):
            since = int(r.zscore(RepoKeys("repo0").unreferenced, ns + "data/gone"))
            await wait_horizon(s, since + 1_500)
            reaper = Reaper(s)
            try:
                await reaper.run_once()
                assert s3.list_objects_v2(Bucket=bucket, Prefix="repo0/data/gone")["KeyCount"] == 1
                # ... and would have, once an operator lifts the flag (the test can fail).
                from hardelete.failclosed import clear
                assert clear(r, "repo0", reason="rebuilt in test", who="pytest") == 1
                assert fail_closed_reason(r, "repo0") is None
                await reaper.run_once()
            finally:
                await reaper.close()
        assert s3.list_objects_v2(Bucket=bucket, Prefix="repo0/data/gone")["KeyCount"] == 0
        r.close()
    finally:
        await asyncio.to_thread(server.stop)


async def test_a_log_lost_before_anything_of_it_was_applied_fails_its_repositories_closed(
        settings: Settings, s3: Any, bucket: str, tmp_path: Path) -> None:
    """The broker loses its log twice, and nothing of the log between was applied (the tracker
    was down): Redis's record of that log is "nothing applied yet" (offset -1), so no record's
    fingerprint can tell the next log from it. The broker's cluster id does (a lost disk is
    formatted anew): the repository is failed closed, not resumed as if nothing were lost
    (found by the recovery soak: the lost write's object was then reaped)."""
    server = kafka_server(tmp_path)
    await asyncio.to_thread(server.start)
    try:
        s = settings.replace(kafka_bootstrap=f"127.0.0.1:{server.port}", topic_partitions=1)
        ns = f"s3://{bucket}/repo0/"
        async with running_tracker(s, name="first"):
            await wait_horizon(s, await publish(s, [*repo_events(ns),
                                                    write("repo0", ns + "data/a", "a1")]))
        await asyncio.to_thread(_lose_log, server)
        r = redis_sync(s)
        try:
            async with running_tracker(s, name="second"):  # fails repo0 closed (log reset)
                await wait_horizon(s, await publish(s, []), timeout=90)
            assert fail_closed_reason(r, "repo0") is not None
            from hardelete.failclosed import clear

            assert clear(r, "repo0", reason="rebuilt in test", who="pytest") == 1
            # the tracker is down: this write reaches the new log and is never applied
            await publish(s, [write("repo0", ns + "data/lost", "l1")])
            await asyncio.to_thread(_lose_log, server)
            async with running_tracker(s, name="third"):
                await wait_horizon(s, await publish(s, []), timeout=90)
            reason = fail_closed_reason(r, "repo0")
            assert reason is not None and "cluster changed" in reason, reason
        finally:
            r.close()
    finally:
        await asyncio.to_thread(server.stop)


@BOTH_TOPOLOGIES
async def test_broker_log_lost_under_a_running_tracker(settings: Settings, s3: Any,
                                                       bucket: str, tmp_path: Path) -> None:
    server = kafka_server(tmp_path)
    await asyncio.to_thread(server.start)
    try:
        _, r = await _broker_restart_scenario(settings, s3, bucket, server, keep_running=True)
        ns = f"s3://{bucket}/repo0/"
        assert read_repo_state(r, "repo0").addresses[ns + "data/new"].adds == {"n1": "t1"}
        reason = fail_closed_reason(r, "repo0")
        assert reason is not None and "log reset" in reason
        r.close()
    finally:
        await asyncio.to_thread(server.stop)


@BOTH_TOPOLOGIES
async def test_broker_log_kept_under_a_running_tracker(settings: Settings, s3: Any,
                                                       bucket: str, tmp_path: Path) -> None:
    """The tracker rides through the restart: it applies what comes after, fails nothing."""
    server = kafka_server(tmp_path)
    await asyncio.to_thread(server.start)
    try:
        _, r = await _broker_restart_scenario(settings, s3, bucket, server, keep_running=True,
                                              kept_log=True)
        ns = f"s3://{bucket}/repo0/"
        assert read_repo_state(r, "repo0").addresses[ns + "data/new"].adds == {"n1": "t1"}
        assert fail_closed_reason(r, "repo0") is None
        r.close()
    finally:
        await asyncio.to_thread(server.stop)


@BOTH_TOPOLOGIES
async def test_tracker_catches_up_behind_a_long_log(settings: Settings, bucket: str) -> None:
    """A tracker that starts behind a log of 400 batches catches up, and its fetch wait ends at
    the poll again. (The wait is raised while behind because Tansu's s3:// engine answered a
    fetch with what it read within the wait: behind a long log a tracker that kept the tests'
    50 ms poll got nothing, fetch after fetch, the long soaks' stall. Kafka answers a fetch
    that has records at once; a broker reading cold segments from tiered storage may not.)"""
    assert settings.tracker_poll_ms <= 50
    s = settings.replace(topic_partitions=1)
    ns = f"s3://{bucket}/repo0/"
    events = [*repo_events(ns), *fillers("repo0", ns, 3_998)]
    await ensure_topics(s)
    async with Publisher(s) as pub:
        for i in range(0, len(events), 10):  # acknowledged one by one: 400 batch objects
            await pub.publish_many(events[i:i + 10])
    async with running_tracker(s) as tracker:
        await wait_horizon(s, await redis_now(s), timeout=120)
        assert tracker.applied == len(events)

        def fetch_wait() -> float | None:
            return tracker.metrics.registry.get_sample_value(
                "hardelete_tracker_fetch_wait_ms")

        deadline = time.monotonic() + 30
        while fetch_wait() != settings.tracker_poll_ms and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert fetch_wait() == settings.tracker_poll_ms  # at the end: short again


@BOTH_TOPOLOGIES
async def test_broker_log_kept_nothing_fail_closed(settings: Settings, s3: Any, bucket: str,
                                                   tmp_path: Path) -> None:
    server = kafka_server(tmp_path)
    await asyncio.to_thread(server.start)
    try:
        _, r = await _broker_restart_scenario(settings, s3, bucket, server, kept_log=True)
        ns = f"s3://{bucket}/repo0/"
        state = read_repo_state(r, "repo0")
        assert state.addresses[ns + "data/new"].adds == {"n1": "t1"}
        assert fail_closed_reason(r, "repo0") is None
        assert not r.exists(FAIL_CLOSED)
        assert not any(i.type == "fail_closed" for i in state.incidents)
        assert int(r.hget(RepoKeys("repo0").stats, "events")) == 2 + 2 + 40 + 1  # each once
        r.close()
    finally:
        await asyncio.to_thread(server.stop)


# (One Redis restored whole from its RDB: the cluster case, one node going back, is
# test_tracker_daemon.py::test_a_repository_going_back_under_a_running_tracker_...[cluster].)
async def test_redis_restored_from_an_older_copy_is_repaired_by_replay(
        settings: Settings, tmp_path: Path) -> None:
    server = redis_server(tmp_path)  # RDB snapshots only when asked (SAVE)
    await asyncio.to_thread(server.start)
    try:
        s = settings.replace(redis_url=f"redis://127.0.0.1:{server.port}/0")
        ns = "s3://b/repo0/"
        a = ns + "data/a"
        r = redis_sync(s)
        async with running_tracker(s) as tracker:
            await wait_horizon(s, await publish(s, [*repo_events(ns), write("repo0", a, "r1")]))
            r.save()
            rdb = tmp_path / f"redis-{server.port}" / "dump.rdb"
            shutil.copy(rdb, tmp_path / "old.rdb")
            # A shallow copy keeps `a` alive, then the original reference is deleted.
            copied = ev.ObjectCopied(repository="repo0", branch="main", staging_token="t1",
                                     path="copy", address=a, size=1, ref_id="r2",
                                     source_read_at=1.0)
            await wait_horizon(s, await publish(s, [copied, delete("repo0", a, "r1")]))
            assert read_repo_state(r, "repo0").addresses[a].state == "staged"
            # Redis goes back in time: stopped, its older copy restored, restarted.
            await asyncio.to_thread(server.stop)
            shutil.copy(tmp_path / "old.rdb", rdb)
            await asyncio.to_thread(server.start, move_on_clash=False)
            assert "r2" not in read_repo_state(r, "repo0").addresses[a].adds  # the loss
            # The tracker notices and replays: the copy is recorded again, `a` stays alive.
            await wait_horizon(s, await redis_now(s), timeout=60)
            rec = read_repo_state(r, "repo0").addresses[a]
            assert rec.adds == {"r1": "t1", "r2": "t1"} and rec.removes == {"r1": "t1"}
            assert rec.state == "staged"
            # And it keeps going.
            await wait_horizon(s, await publish(s, [write("repo0", ns + "data/b", "r3")]))
            assert read_repo_state(r, "repo0").addresses[ns + "data/b"].adds == {"r3": "t1"}
            assert tracker.applied >= 5
        assert fail_closed_reason(r, "repo0") is None  # replay was possible: nothing failed
        r.close()
    finally:
        await asyncio.to_thread(server.stop)


# (One Redis restored whole from its RDB: the cluster case, one node going back, is
# test_tracker_daemon.py::test_a_repository_going_back_under_a_running_tracker_...[cluster].)
async def test_redis_restored_from_an_older_copy_remembers_what_the_reaper_deleted(
        settings: Settings, s3: Any, bucket: str, tmp_path: Path) -> None:
    """The reaper's deletes are in the log (``addresses_reaped``), not only in Redis: a Redis
    restored from a copy taken before the reap learns them again by replay, so a copy published
    after the reap (beyond the contract) is still an incident, never a silently dead reference."""
    server = redis_server(tmp_path)
    await asyncio.to_thread(server.start)
    try:
        s = settings.replace(redis_url=f"redis://127.0.0.1:{server.port}/0",
                             grace_seconds=1.0, lease_seconds=2.0)
        ns = f"s3://{bucket}/repo0/"
        a = ns + "data/a"
        s3.put_object(Bucket=bucket, Key="repo0/data/a", Body=b"x")
        r = redis_sync(s)
        async with running_tracker(s):
            await wait_horizon(s, await publish(s, [*repo_events(ns), write("repo0", a, "r1"),
                                                    delete("repo0", a, "r1")]))
            r.save()  # the older copy: `a` unreferenced, not yet reaped
            rdb = tmp_path / f"redis-{server.port}" / "dump.rdb"
            shutil.copy(rdb, tmp_path / "old.rdb")
            reaper = Reaper(s)
            try:
                deadline = time.monotonic() + 30
                while read_repo_state(r, "repo0").addresses[a].state != "reaped":
                    assert time.monotonic() < deadline, "the reaper did not reap `a`"
                    await reaper.run_once()
            finally:
                await reaper.close()
            assert "Contents" not in s3.list_objects_v2(Bucket=bucket, Prefix="repo0/data/a")
            # Beyond the contract: a copy of `a` published after its reap.
            copied = ev.ObjectCopied(repository="repo0", branch="main", staging_token="t1",
                                     path="copy", address=a, size=1, ref_id="r2",
                                     source_read_at=1.0)
            await wait_horizon(s, await publish(s, [copied]))
            assert len(r.lrange(RepoKeys("repo0").incidents, 0, -1)) == 1
            # Redis goes back to the copy taken before the reap: the reap and the incident are
            # forgotten; the tracker replays the log from there.
            await asyncio.to_thread(server.stop)
            shutil.copy(tmp_path / "old.rdb", rdb)
            await asyncio.to_thread(server.start, move_on_clash=False)
            assert read_repo_state(r, "repo0").addresses[a].state == "unreferenced"
            await wait_horizon(s, await redis_now(s), timeout=60)
            rec = read_repo_state(r, "repo0").addresses[a]
            assert rec.state == "reaped" and rec.adds == {"r1": "t1", "r2": "t1"}
            incidents = [orjson.loads(x) for x in r.lrange(RepoKeys("repo0").incidents, 0, -1)]
            assert [(i["address"], i["ref_id"], i["type"]) for i in incidents] == [
                (a, "r2", "object_copied")]
        r.close()
    finally:
        await asyncio.to_thread(server.stop)


@BOTH_TOPOLOGIES
async def test_topic_recreated_with_more_partitions_holds_the_horizon(settings: Settings
                                                                      ) -> None:
    # The topic is deleted and re-created with more partitions (a log reset too); partitions
    # added in place (CreatePartitions): the next test. Either way the horizon must cover the
    # partitions as they are now.
    s = settings.replace(topic_partitions=2)
    r = redis_sync(s)
    repos = [f"repo{i}" for i in range(8)]
    async with running_tracker(s):
        await wait_horizon(s, await publish(s, repo_events("s3://b/repo0/")))
        admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
        await admin.start()
        try:
            deadline = time.monotonic() + 30
            while True:
                await admin.delete_topics([s.events_topic])
                created = await admin.create_topics([NewTopic(s.events_topic, 4, 1)])
                if created.topic_errors[0][1] == 0:
                    break
                # Kafka was still deleting it, or the running tracker's metadata request
                # auto-created it again meanwhile (1 partition, the broker's default): again.
                assert time.monotonic() < deadline, "the topic could not be re-created"
                await asyncio.sleep(0.2)
        finally:
            await admin.close()
        deadline = time.monotonic() + 30
        while r.hget(PROGRESS_META, "partitions") != "4":
            assert time.monotonic() < deadline, "the tracker never noticed the new partitions"
            await asyncio.sleep(0.05)
        events: list[ev.Event] = []
        for repo in repos:  # eight keys: every partition gets some
            events += repo_events(f"s3://b/{repo}/", repo)
        target = await publish(s, events)
        await wait_horizon(s, target)
        # Whatever the horizon covers is applied, in every partition.
        assert set(repos) <= set(r.smembers("hd:repos"))
        progress = r.hgetall("hd:progress")
        assert all(int(progress[str(p)]) >= target for p in range(4))
    r.close()


@BOTH_TOPOLOGIES
async def test_partitions_added_in_place_hold_the_horizon_until_applied(settings: Settings
                                                                         ) -> None:
    """CreatePartitions under a running tracker: the horizon waits until the new partitions are
    assigned and applied; records published to them are applied."""
    s = settings.replace(topic_partitions=2)
    r = redis_sync(s)
    repos = [f"repo{i}" for i in range(8)]
    async with running_tracker(s):
        await wait_horizon(s, await publish(s, repo_events("s3://b/repo0/")))
        admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
        await admin.start()
        try:
            await admin.create_partitions({s.events_topic: NewPartitions(total_count=4)})
        finally:
            await admin.close()
        deadline = time.monotonic() + 30
        while r.hget(PROGRESS_META, "partitions") != "4":
            assert time.monotonic() < deadline, "the tracker never noticed the new partitions"
            await asyncio.sleep(0.05)
        events: list[ev.Event] = []
        for repo in repos:
            events += repo_events(f"s3://b/{repo}/", repo)
        target = await publish(s, events)
        await wait_horizon(s, target)
        assert set(repos) <= set(r.smembers("hd:repos"))
        progress = r.hgetall("hd:progress")
        assert all(int(progress[str(p)]) >= target for p in range(4))
        # Offsets 0.. of the old partitions were kept: nothing was failed closed.
        assert fail_closed_reason(r, "repo0") is None
    r.close()


async def _recreate_topic(s: Settings, partitions: int) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
    await admin.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            await admin.delete_topics([s.events_topic])
            created = await admin.create_topics([NewTopic(s.events_topic, partitions, 1)])
            if created.topic_errors[0][1] == 0:
                return
            # Kafka was still deleting it (or a client's metadata request auto-created it).
            assert time.monotonic() < deadline, "the topic could not be re-created"
            await asyncio.sleep(0.2)
    finally:
        await admin.close()


async def test_a_partition_nothing_was_applied_from_is_told_from_a_re_created_one(
        settings: Settings) -> None:
    """A partition the tracker applied nothing from had no fingerprint in hd:log (``e:-1:``):
    the topic re-created on the same cluster passed for it, and whatever was published to the
    old log and not applied yet was lost unnoticed. The tracker now writes an anchor into such a
    log; applied as nothing (not dead-lettered), it gives the partition its fingerprint."""
    from schemas.layout import LOG
    from tracker.logid import ANCHOR_KEY, LogRecord, log_field

    s = settings.replace(topic_partitions=2)
    r = redis_sync(s)
    async with running_tracker(s):
        await wait_horizon(s, await publish(s, repo_events("s3://b/repo0/")))
        recs = {p: LogRecord.decode(r.hget(LOG, log_field(s.events_topic, p))) for p in (0, 1)}
    assert all(rec is not None and rec.fingerprint and rec.offset >= 0
               for rec in recs.values()), recs
    consumer = AIOKafkaConsumer(s.events_topic, s.dlq_topic, bootstrap_servers=s.kafka_bootstrap,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        ends = await consumer.end_offsets(list(consumer.assignment()))
        assert all(end == 0 for tp, end in ends.items() if tp.topic == s.dlq_topic), ends
        total = sum(end for tp, end in ends.items() if tp.topic == s.events_topic)
        keys: list[bytes | None] = []
        while len(keys) < total:
            for got in (await consumer.getmany(timeout_ms=200)).values():
                keys += [rec.key for rec in got if rec.topic == s.events_topic]
        assert keys.count(ANCHOR_KEY) == 2  # one per partition, written when it was first seen
    finally:
        await consumer.stop()
    await _recreate_topic(s, 2)
    async with running_tracker(s, name="after-recreate") as tracker:
        await wait_horizon(s, await redis_now(s), timeout=60)
    incidents = [orjson.loads(i) for i in r.lrange(RepoKeys("repo0").incidents, 0, -1)]
    told = [i["partitions"] for i in incidents if i["type"] == "fail_closed"]
    assert told == [[0, 1]], incidents  # the partition repo0 never published to, too; once
    # the anchors' fingerprints, computed from what was sent, are what the broker stored
    assert tracker.regressions == 0
    r.close()


async def test_a_tracker_killed_between_failing_closed_and_the_new_epoch_loses_nothing(
        settings: Settings) -> None:
    """The repositories are failed closed *before* hd:log takes the new log's epoch. In the
    other order a tracker killed right after that write left a record that matches the new log:
    the next tracker resumed as if nothing happened, nothing was failed closed, and what the old
    log held unapplied was lost. The tracker here dies right after the first reset write."""
    from schemas.layout import LOG
    from tracker.daemon import Tracker
    from tracker.logid import LogRecord

    class DiesAtTheResetWrite(Tracker):
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "_log_script":
                script = value

                async def dying(keys: list[str], args: list[str]) -> Any:
                    if keys == [LOG] and len(args) == 3:
                        old, new = LogRecord.decode(args[1]), LogRecord.decode(args[2])
                        if old is not None and new is not None and old.epoch != new.epoch:
                            await script(keys=keys, args=args)
                            raise RuntimeError("killed right after hd:log took the new log")
                    return await script(keys=keys, args=args)
                value = dying
            super().__setattr__(name, value)

    s = settings.replace(topic_partitions=2)
    r = redis_sync(s)
    async with running_tracker(s):
        await wait_horizon(s, await publish(s, repo_events("s3://b/repo0/")))
    before = r.hgetall(LOG)
    await _recreate_topic(s, 2)
    dying = DiesAtTheResetWrite(s, name="dying")
    with pytest.raises(RuntimeError, match="killed right after"):  # exits by itself, there
        await asyncio.wait_for(dying.start(), 60)
    assert r.hgetall(LOG) != before  # the new log's record took its place
    assert fail_closed_reason(r, "repo0") is not None  # and the loss was recorded before it
    async with running_tracker(s, name="next"):
        await wait_horizon(s, await redis_now(s), timeout=60)
    assert fail_closed_reason(r, "repo0") is not None
    r.close()


@pytest.mark.parametrize("group_offsets", [False, True], ids=["new-group", "group-offsets"])
async def test_a_tracker_whose_verification_fails_stops_by_itself_and_applies_nothing(
        settings: Settings, group_offsets: bool) -> None:
    """Verification failing on an assignment (in the rebalance listener) leaves the partitions
    unsought: nothing may be consumed from them. The tracker must then stop by itself, at once,
    with that error (its process exits non-zero and is restarted), applying and committing
    nothing. It used to wait for ever: aiokafka's ``position()`` waits, without end, for a
    position that no seek will give (``auto_offset_reset="none"``, no offset of the group);
    with offsets of the group, its fetcher resumed from those: records nobody verified."""
    from schemas.layout import LOG
    from tracker.daemon import Tracker

    ns = "s3://b/repo0/"
    r = redis_sync(settings)
    if group_offsets:  # a tracker of the group applied and committed the repository's creation
        async with running_tracker(settings):
            await wait_horizon(settings, await publish(settings, repo_events(ns)))
        await publish(settings, [write("repo0", ns + "data/unverified", "u")])
    else:
        await publish(settings, [*repo_events(ns), write("repo0", ns + "data/unverified", "u")])
    offsets = await _group_offsets(settings)
    log, applied = r.hgetall(LOG), read_repo_state(r, "repo0").addresses

    tracker = Tracker(settings, name="unverified")
    looping, failed = asyncio.Event(), asyncio.Event()
    cycle = tracker._cycle

    async def cycling(consumer: AIOKafkaConsumer) -> None:
        looping.set()
        await cycle(consumer)

    async def unverifiable(tps: set[Any]) -> None:
        await looping.wait()  # the assignment is verified while the main loop runs (the hang)
        failed.set()
        raise RuntimeError("verification broke")

    tracker._cycle = cycling  # type: ignore[method-assign]
    tracker._verify_locked = unverifiable  # type: ignore[method-assign]
    task = tracker.start()
    await asyncio.wait_for(failed.wait(), 60)
    with pytest.raises(RuntimeError, match="verification broke"):
        await asyncio.wait_for(task, 5)  # by itself: no stop(), no cancel
    assert (tracker.applied, tracker.batches, tracker.dead_lettered) == (0, 0, 0)
    # not even tried: records fetched from the group's offsets once reached the apply script,
    # whose log guard refused them ("Redis lost applied records")
    assert tracker.regressions == 0
    assert r.hgetall(LOG) == log
    assert read_repo_state(r, "repo0").addresses == applied
    assert ns + "data/unverified" not in applied
    assert await _group_offsets(settings) == offsets  # nothing committed
    r.close()


async def _group_offsets(s: Settings) -> dict[Any, Any]:
    """The consumer group's committed offsets (none for a group that never committed)."""
    from aiokafka.errors import CoordinatorNotAvailableError

    admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
    await admin.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                return dict(await admin.list_consumer_group_offsets(s.consumer_group))
            except CoordinatorNotAvailableError:  # (a group Kafka has not heard of yet)
                assert time.monotonic() < deadline, "no coordinator for the group"
                await asyncio.sleep(0.1)
    finally:
        await admin.close()


async def test_a_malformed_event_keyed_like_the_anchor_is_dead_lettered_and_held(
        settings: Settings) -> None:
    """Found by review: the apply path skipped every undecodable record with the anchor's key.
    A malformed copy a service keys so names a live address: it must be dead-lettered and the
    address held, as any malformed event (SPEC 10)."""
    from tracker.logid import ANCHOR_KEY

    ns = "s3://b/repo0/"
    good = orjson.loads(ev.encode(write("repo0", ns + "data/copy", "r")))
    bad = orjson.dumps({**good, "junk": "x"})  # unknown field: refused, as a newer schema
    async with running_tracker(settings) as tracker:
        await wait_horizon(settings, await publish(settings, repo_events(ns)))
        async with Publisher(settings) as pub:
            await pub.publish_raw(bad, ANCHOR_KEY)
        await wait_horizon(settings,
                           await publish(settings, [write("repo0", ns + "data/ok", "ok")]))
        dead = tracker.dead_lettered
    r = redis_sync(settings)
    try:
        held = holds(r, "repo0")
    finally:
        r.close()
    assert dead == 1 and ns + "data/copy" in held, (dead, held)


# --- poison records ----------------------------------------------------------------------------

def _bad_records(ns: str) -> list[tuple[bytes | None, bytes, str, str | None]]:
    """(key, value, reason fragment, address held or None)."""
    good = orjson.loads(ev.encode(write("repo0", ns + "data/x", "r")))

    def body(**changes: Any) -> bytes:
        return orjson.dumps({**good, **changes})

    deep = b'{"type":"object_written","junk":' + b"[" * 5000 + b"]" * 5000 + b"}"
    huge_int = body(address=ns + "data/hugeint").replace(b'"size":1', b'"size":' + b"9" * 30)
    return [
        (b"repo0", body(address=ns + "data/big", junk="x" * (5 << 20)), "unknown field",
         ns + "data/big"),
        (b"repo0", orjson.dumps(orjson.loads(ev.encode(ev.AddressIssued(
            repository="repo0", address=ns + "data/ttl", ttl_seconds=1.0))) | {
            "ttl_seconds": 9e15}), "field 'ttl_seconds': must be", ns + "data/ttl"),
        (None, body(address=ns + "data/nokey"), "record key null", ns + "data/nokey"),
        (b"other", body(address=ns + "data/otherkey"), "record key b'other'",
         ns + "data/otherkey"),
        (b"repo0", deep, "not valid JSON", None),
        (b"repo0", huge_int, "field 'size': must be", ns + "data/hugeint"),
        (b"repo0", body(address=ns + "data/sz", size=2**53), "field 'size': must be",
         ns + "data/sz"),
    ]


@BOTH_TOPOLOGIES
async def test_poison_records_are_dead_lettered_held_and_the_tracker_goes_on(
        settings: Settings) -> None:
    ns = "s3://b/repo0/"
    bad = _bad_records(ns)
    # A topic that takes records up to 8 MB (Kafka's default refuses over 1 MB); the
    # dead-letter topic keeps the default: the 5 MB record is dead-lettered truncated.
    await _create_topic(settings, settings.events_topic, settings.topic_partitions,
                        **{"max.message.bytes": str(8 << 20)})
    async with running_tracker(settings) as tracker:
        # The repository is known first: a dead letter that names it holds its address.
        await wait_horizon(settings, await publish(settings, repo_events(ns)))
        producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap,
                                    max_request_size=8 << 20, acks="all")
        await producer.start()
        try:
            for key, value, _, _ in bad:
                await producer.send_and_wait(settings.events_topic, value, key=key)
        finally:
            await producer.stop()
        await wait_horizon(settings,
                           await publish(settings, [write("repo0", ns + "data/ok", "ok")]))
        assert tracker.dead_lettered == len(bad)
    r = redis_sync(settings)
    try:
        state = read_repo_state(r, "repo0")
        assert state.addresses[ns + "data/ok"].adds == {"ok": "t1"}
        held = holds(r, "repo0")
        assert set(held) == {a for *_, a in bad if a}
        for _, _, fragment, address in bad:
            if address:
                (claim,) = held[address]["claims"].values()  # one dead letter's claim
                assert claim["source"] == held[address]["source"] == "dlq"
                assert fragment in claim["reason"] and fragment in held[address]["reason"]
                assert claim["offset"] >= 0 and claim["topic"] == settings.events_topic
        # a record nobody can read could have named anything: its namespace is held
        (prefix_claim,) = orjson.loads(r.hget(RepoKeys("repo0").hold_prefixes, ns))[
            "claims"].values()
        assert "not valid JSON" in prefix_claim["reason"]
    finally:
        r.close()
    got = await _read_dlq(settings, len(bad))
    assert len(got) == len(bad)
    for _key, value, fragment, _ in bad:
        matches = [g for g in got if fragment in dict(g.headers)["reason"].decode()]
        assert matches, fragment
        h = dict(matches[0].headers)
        if len(value) > 900_000:
            assert len(matches[0].value) <= 900_000
            assert h["truncated"] == b"value" and int(h["original_size"]) == len(value)
        else:
            assert any(g.value == value for g in matches)


async def _read_dlq(settings: Settings, n: int) -> list[Any]:
    consumer = AIOKafkaConsumer(settings.dlq_topic, bootstrap_servers=settings.kafka_bootstrap,
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                max_partition_fetch_bytes=8 << 20)
    await consumer.start()
    got: list[Any] = []
    try:
        deadline = time.monotonic() + 30
        while len(got) < n and time.monotonic() < deadline:
            for recs in (await consumer.getmany(timeout_ms=200)).values():
                got.extend(recs)
    finally:
        await consumer.stop()
    return got


@BOTH_TOPOLOGIES
async def test_failing_dead_letter_publish_holds_the_batch_then_recovers(
        settings: Settings) -> None:
    """A dead-letter topic that refuses records (compacted: Kafka refuses a record without a
    key, and the dead letter of an event without one has none) never stops the tracker and
    never lets it commit past the event; once the topic accepts them again (its configuration
    changed) the event is dead-lettered."""
    s = settings.replace(topic_partitions=1)
    await _create_topic(s, s.dlq_topic, 1, **{"cleanup.policy": "compact"})
    ns = "s3://b/repo0/"
    bad = orjson.dumps({"type": "object_written", "v": 1, "repository": "repo0",
                        "address": ns + "data/lost", "junk": True})
    async with running_tracker(s) as tracker:
        await wait_horizon(s, await publish(s, repo_events(ns)))
        producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap, acks="all")
        await producer.start()
        try:
            await producer.send_and_wait(s.events_topic, bad, key=None)
        finally:
            await producer.stop()
        stuck = await redis_now(s)
        r = redis_sync(s)
        try:
            deadline = time.monotonic() + 30
            while not r.exists(RepoKeys("repo0").holds):  # the hold comes first
                assert time.monotonic() < deadline, "no hold for the dead-lettered event"
                await asyncio.sleep(0.05)
            await asyncio.sleep(2)  # (a window for a wrong tracker to move on; no sync)
            assert tracker.dead_lettered == 0 and not tracker._task.done()  # type: ignore
            horizon = tracker_horizon_ms(r)
            assert horizon is None or horizon < stuck  # nothing past it is claimed
        finally:
            r.close()
        admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
        await admin.start()
        try:  # the topic accepts dead letters again
            await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, s.dlq_topic,
                                                      configs={"cleanup.policy": "delete"})])
        finally:
            await admin.close()
        await wait_horizon(s, await redis_now(s), timeout=90)
        assert tracker.dead_lettered == 1
    got = await _read_dlq(s, 1)
    assert [g.value for g in got] == [bad]
