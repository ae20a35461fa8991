"""A broker that lost its disk may get the events topic back with fewer partitions (a client's
metadata request auto-creates it with the broker's default count before the operator re-creates
it). Repositories keyed to a partition that no longer exists move to other partitions; what was
published to the gone one and never applied is lost, and no assignment ever checks it again.
Found by the safety soak (seed 2): a repository of a gone partition was never fail-closed, and
the reaper deleted an object of a retained commit whose events were lost with the log."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from core.clients import redis_sync
from core.guards import fail_closed_reason
from core.settings import Settings
from schemas import events as ev
from schemas.layout import LOG, RepoKeys
from sim.stack import kafka_server
from sim.testing import publish, redis_now, wait_horizon
from tracker.daemon import running_tracker
from tracker.logid import log_field

REPOS = [f"repo{i}" for i in range(8)]




def _events(repo: str, ns: str) -> list[ev.Event]:
    return [ev.RepositoryCreated(repository=repo, storage_namespace=ns, default_branch="main",
                                 default_retention_days=1.0),
            ev.BranchCreated(repository=repo, branch="main", staging_token="t1",
                             ref_version=1),
            ev.ObjectWritten(repository=repo, branch="main", staging_token="t1", path="k",
                             address=ns + "data/k", size=1, ref_id="w1")]
async def test_repositories_of_a_partition_gone_with_the_log_are_fail_closed(
        settings: Settings, bucket: str, tmp_path: Path) -> None:
    server = kafka_server(tmp_path)
    await asyncio.to_thread(server.start)
    try:
        s = settings.replace(kafka_bootstrap=f"127.0.0.1:{server.port}", topic_partitions=4)
        events = [e for repo in REPOS for e in _events(repo, f"s3://{bucket}/{repo}/")]
        async with running_tracker(s):
            await wait_horizon(s, await publish(s, events))
        r = redis_sync(s)
        partitions = {repo: set(r.hkeys(RepoKeys(repo).applied)) - {"regressed"}
                      for repo in REPOS}
        assert set().union(*partitions.values()) - {"0"}, "no repository off partition 0"
        # The disk is lost; the topic comes back with one partition before anyone re-creates
        # it as configured (as a broker's auto-creation does).
        server.kill()
        server.lose_log()
        await asyncio.to_thread(server.start, move_on_clash=False)
        admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(s.events_topic, 1, 1),
                                       NewTopic(s.dlq_topic, 1, 1)])
        finally:
            await admin.close()
        async with running_tracker(s, name="after-loss"):
            target = await redis_now(s)
            await wait_horizon(s, target, timeout=90)
        for repo in REPOS:
            reason = fail_closed_reason(r, repo)
            assert reason is not None and "log reset" in reason, (repo, partitions[repo])
            if partitions[repo] - {"0"}:
                assert "is gone" in reason, (repo, reason)
        assert [f for f in r.hkeys(LOG) if f != log_field(s.events_topic, 0)
                and f.startswith(s.events_topic + ":")] == []
        r.close()
    finally:
        await asyncio.to_thread(server.kill)


async def _lose_log_back_with(server: Any, s: Settings, partitions: int) -> None:
    server.kill()
    server.lose_log()
    await asyncio.to_thread(server.start, move_on_clash=False)
    admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(s.events_topic, partitions, 1),
                                   NewTopic(s.dlq_topic, 1, 1)])
    finally:
        await admin.close()
async def test_a_repository_that_never_applied_from_a_reset_partition_is_fail_closed(
        settings: Settings, bucket: str, tmp_path: Path) -> None:
    """Found by the soak (seed 102). `x0` (partition 1 of 4) is fail-closed when the topic
    comes back with one partition, and lifted. It now publishes to partition 0, which it never
    applied from; its write there is lost with the next log. Failing closed only the
    repositories that had applied from the reset partition left it open."""
    from hardelete.failclosed import clear

    server = kafka_server(tmp_path)
    await asyncio.to_thread(server.start)
    try:
        s = settings.replace(kafka_bootstrap=f"127.0.0.1:{server.port}", topic_partitions=4,
                             rebuild_interval_seconds=0.0)
        ns = f"s3://{bucket}/x0/"
        async with running_tracker(s):
            await wait_horizon(s, await publish(s, _events("x0", ns)))
        r = redis_sync(s)
        assert set(r.hkeys(RepoKeys("x0").applied)) == {"1"}
        await _lose_log_back_with(server, s, 1)
        async with running_tracker(s, name="after-first-loss"):
            await wait_horizon(s, await redis_now(s), timeout=90)
        assert fail_closed_reason(r, "x0") is not None
        assert clear(r, "x0", reason="rebuilt (test)", who="pytest") == 1
        await publish(s, [ev.ObjectWritten(repository="x0", branch="main", staging_token="t1",
                                           path="k2", address=ns + "data/k2", size=1,
                                           ref_id="w2")])  # to partition 0: never applied
        await _lose_log_back_with(server, s, 1)
        async with running_tracker(s, name="after-second-loss"):
            await wait_horizon(s, await redis_now(s), timeout=90)
        assert "0" not in r.hkeys(RepoKeys("x0").applied)
        reason = fail_closed_reason(r, "x0")
        assert reason is not None and "log reset" in reason, reason
        r.close()
    finally:
        await asyncio.to_thread(server.kill)
