"""A three-broker KRaft cluster (replication 3, acks=all, min.insync.replicas=2) with the leader
of the events partition killed by SIGKILL mid-load (issue 24 item 2): no acknowledged event is
lost, and the tracker goes on applying through the failover."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from core.clients import redis_sync
from core.settings import Settings
from schemas import events as ev
from schemas.publisher import Publisher
from sim.stack import bootstrap, kafka_cluster
from sim.testing import publish, redis_now, wait_horizon
from tracker.daemon import running_tracker
from tracker.state import read_repo_state

pytestmark = [pytest.mark.slow]

BATCHES, PER_BATCH = 40, 50


async def _leader(s: Settings) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
    await admin.start()
    try:
        (topic,) = await admin.describe_topics([s.events_topic])
        (partition,) = topic["partitions"]
        assert len(partition["replicas"]) == 3 and len(partition["isr"]) == 3, partition
        return int(partition["leader"])
    finally:
        await admin.close()


async def test_a_broker_killed_mid_load_loses_no_acknowledged_event(
        settings: Settings, tmp_path: Path) -> None:
    servers = await asyncio.to_thread(kafka_cluster, tmp_path, 3)
    try:
        s = settings.replace(kafka_bootstrap=bootstrap(servers), topic_partitions=1,
                             topic_replication_factor=3)
        ns = "s3://b/ha/"
        await publish(s, [
            ev.RepositoryCreated(repository="ha", storage_namespace=ns, default_branch="main",
                                 default_retention_days=1.0),
            ev.BranchCreated(repository="ha", branch="main", staging_token="t",
                             ref_version=1)])
        leader = await _leader(s)
        victim = next(sv for sv in servers if sv.node_id == leader)
        acked: list[str] = []
        async with running_tracker(s, name="ha") as tracker, Publisher(s) as pub:
            for b in range(BATCHES):
                if b == BATCHES // 2:
                    await asyncio.to_thread(victim.kill)  # kill -9 of the partition's leader
                batch = [ev.ObjectWritten(repository="ha", branch="main", staging_token="t",
                                          path=f"p{b}-{i}", address=f"{ns}data/{b}/{i}",
                                          size=1, ref_id=f"r{b}-{i}")
                         for i in range(PER_BATCH)]
                for attempt in range(3):  # what a producer does when a send is not acknowledged
                    try:
                        await pub.publish_many(batch)
                        break
                    except Exception:
                        if attempt == 2:
                            raise
                acked += [e.address for e in batch]
            await wait_horizon(s, await redis_now(s), timeout=120)
            applied = tracker.applied
        assert victim.proc is not None and victim.proc.poll() is not None  # it really died
        r = redis_sync(s)
        try:
            state = read_repo_state(r, "ha")
        finally:
            r.close()
        missing = [a for a in acked if a not in state.addresses]
        assert not missing, f"{len(missing)} acknowledged events lost, e.g. {missing[:3]}"
        assert all(state.addresses[a].adds for a in acked)
        assert applied >= len(acked)  # the same tracker applied them, before and after
    finally:
        for sv in servers:
            sv.stop()
