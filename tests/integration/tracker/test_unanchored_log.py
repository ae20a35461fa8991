"""A partition known by no record (nothing applied from it) whose anchor the broker refused, then
reset on the same cluster (its log gone, offsets reused, the cluster id unchanged).

Exact sequence (found by review of tracker/logid.py ``_by_anchor``): a repository is created and
stages ``a -> X`` on partition 0 (applied: partition 0 has a fingerprint). The topic gets a second
partition (CreatePartitions); the repository's key now maps to partition 1, which nothing was
applied from. The tracker is assigned it, the broker refuses the anchor (it is unhealthy), and
``hd:log`` records it as ``<epoch>:-1:`` (no witness). The tracker stops (a deploy). The service
shallow-copies X to ``b`` (on partition 1). Partition 1's log is lost on the same cluster (its
directory gone while the broker was down; Kafka re-creates it empty: offsets reused, cluster id
and partition 0 unchanged). The tracker starts again, the broker takes anchors now, and the
service deletes ``a`` (offset 0 of the new log). Before the fix the tracker resumed "(no anchor to
compare)", nothing was failed closed, X looked unreferenced, and the reaper deleted it while ``b``
still staged it.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions
from aiokafka.errors import KafkaTimeoutError
from aiokafka.partitioner import murmur2

from core.clients import redis_sync
from core.guards import fail_closed_reason
from core.settings import Settings
from reaper.daemon import Reaper
from schemas import events as ev
from schemas.layout import FAIL_CLOSED, LOG, PROGRESS_META, RepoKeys
from sim.log_loss import delete, repo_events, write
from sim.stack import kafka_server
from sim.testing import publish, wait_horizon
from tracker.daemon import running_tracker
from tracker.logid import ANCHOR_KEY, LogRecord, log_field


def _repo_on(partition: int, of: int) -> str:
    """A repository name the publisher's (murmur2) partitioner keys to ``partition`` of ``of``."""
    for i in range(1000):
        name = f"repo{i}"
        if (murmur2(name.encode()) & 0x7FFFFFFF) % of == partition:
            return name
    raise AssertionError("no such name")


async def _end(s: Settings, partition: int) -> int:
    c = AIOKafkaConsumer(bootstrap_servers=s.kafka_bootstrap)
    await c.start()
    try:
        tp = TopicPartition(s.events_topic, partition)
        return int((await c.end_offsets([tp]))[tp])
    finally:
        await c.stop()


async def test_a_partition_reset_before_it_was_anchored_fails_closed_and_deletes_nothing(
        settings: Settings, s3: Any, bucket: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The fault injected: the broker refuses the tracker's anchor record on partition 1 (what a
    # timeout or NOT_ENOUGH_REPLICAS does); nothing else of the tracker is touched.
    refusing = {"on": True}
    real_send = AIOKafkaProducer.send_and_wait

    async def send_and_wait(self: Any, topic: str, value: Any = None, key: Any = None,
                            partition: Any = None, **kw: Any) -> Any:
        if refusing["on"] and key == ANCHOR_KEY and partition == 1:
            raise KafkaTimeoutError("injected: the broker did not take the anchor")
        return await real_send(self, topic, value, key=key, partition=partition, **kw)

    monkeypatch.setattr(AIOKafkaProducer, "send_and_wait", send_and_wait)

    server = kafka_server(tmp_path)
    await asyncio.to_thread(server.start)
    try:
        s = settings.replace(kafka_bootstrap=f"127.0.0.1:{server.port}", topic_partitions=1)
        repo = _repo_on(1, 2)
        ns = f"s3://{bucket}/{repo}/"
        x = ns + "data/x"
        s3.put_object(Bucket=bucket, Key=f"{repo}/data/x", Body=b"x")
        r = redis_sync(s)
        field = log_field(s.events_topic, 1)
        async with running_tracker(s):
            await wait_horizon(s, await publish(s, [*repo_events(ns, repo), write(repo, x, "a")]))
            admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
            await admin.start()
            try:
                await admin.create_partitions({s.events_topic: NewPartitions(total_count=2)})
            finally:
                await admin.close()
            deadline = time.monotonic() + 60
            while r.hget(PROGRESS_META, "partitions") != "2" or not r.hget(LOG, field):
                assert time.monotonic() < deadline, "partition 1 never assigned"
                await asyncio.sleep(0.05)
            rec = LogRecord.decode(r.hget(LOG, field))
            assert rec is not None and rec.witness is None, rec  # known by nothing
        # The tracker is down; the service copies X to b (partition 1 now).
        await publish(s, [ev.ObjectCopied(repository=repo, branch="main", staging_token="t1",
                                          path="b", address=x, size=1, ref_id="b",
                                          source_read_at=time.time())])
        assert await _end(s, 1) == 1
        # Partition 1's log is lost on the same cluster (only its directory).
        await asyncio.to_thread(server.stop)
        shutil.rmtree(server.data_dir / f"{s.events_topic}-1")
        await asyncio.to_thread(server.start, move_on_clash=False)
        assert await _end(s, 1) == 0  # re-created empty, offsets reused
        refusing["on"] = False  # the broker is healthy again
        async with running_tracker(s, name="after-reset"):
            await wait_horizon(s, await publish(s, [delete(repo, x, "a")]), timeout=90)
            unref = r.zscore(RepoKeys(repo).unreferenced, x)
            if unref is not None:  # X looks garbage: give the reaper its chance
                await wait_horizon(s, int(unref) + 1_500, timeout=60)
                reaper = Reaper(s)
                try:
                    await reaper.run_once()
                finally:
                    await reaper.close()
        # b still stages X: it must be there, and the repository's loss must be known.
        assert s3.list_objects_v2(Bucket=bucket, Prefix=f"{repo}/data/x")["KeyCount"] == 1, (
            "the reaper deleted a live object")
        reason = fail_closed_reason(r, repo)
        assert reason is not None and "log" in reason, reason
        r.close()
    finally:
        await asyncio.to_thread(server.stop)


async def test_a_tracker_holding_an_unanchored_log_goes_on_with_it(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Liveness of the rule above: the tracker that recorded a log it could not anchor, and has
    held it since, re-checks it (anchor retried) without failing anything closed, and applies
    what is published to it."""
    import tracker.verification as verification

    tries = {"n": 0}
    real_send = AIOKafkaProducer.send_and_wait

    async def send_and_wait(self: Any, topic: str, value: Any = None, key: Any = None,
                            partition: Any = None, **kw: Any) -> Any:
        if key == ANCHOR_KEY and partition == 1:
            tries["n"] += 1
            raise KafkaTimeoutError("injected: the broker did not take the anchor")
        return await real_send(self, topic, value, key=key, partition=partition, **kw)

    monkeypatch.setattr(AIOKafkaProducer, "send_and_wait", send_and_wait)
    monkeypatch.setattr(verification, "_ANCHOR_RETRY_S", 1.0)
    s = settings.replace(topic_partitions=2)
    repo = _repo_on(1, 2)
    r = redis_sync(s)
    async with running_tracker(s):
        await wait_horizon(s, await publish(s, repo_events(f"s3://b/{_repo_on(0, 2)}/",
                                                           _repo_on(0, 2))))
        deadline = time.monotonic() + 60
        while tries["n"] < 3:  # assigned, then re-checked twice, every anchor refused
            assert time.monotonic() < deadline, tries
            await asyncio.sleep(0.1)
        unanchored = LogRecord.decode(r.hget(LOG, log_field(s.events_topic, 1)))
        assert unanchored is not None and unanchored.witness is None, unanchored
        await wait_horizon(s, await publish(s, repo_events(f"s3://b/{repo}/", repo)))
        assert repo in r.smembers("hd:repos")
        rec = LogRecord.decode(r.hget(LOG, log_field(s.events_topic, 1)))
        assert rec is not None and rec.fingerprint  # known by what was applied now
    assert fail_closed_reason(r, repo) is None and fail_closed_reason(r, _repo_on(0, 2)) is None
    assert r.hgetall(FAIL_CLOSED) == {}
    r.close()
