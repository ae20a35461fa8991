"""The publisher against a real broker (Apache Kafka): topics, keyed partitioning,
per-repository order."""

from __future__ import annotations

import time
import uuid
from collections import defaultdict

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient

from core.settings import Settings
from schemas.events import Event, ObjectDeleted, ObjectWritten, decode
from schemas.publisher import Publisher, ensure_topics

NS = "s3://bucket/{repo}/"


def _events(repo: str, n: int) -> list[Event]:
    out: list[Event] = []
    for i in range(n):
        address = f"{NS.format(repo=repo)}data/0000000001/{i:04d}"
        if i % 3 == 2:
            out.append(ObjectDeleted(repository=repo, branch="main", staging_token="t",
                                     path=f"p{i}", address=address, ref_id=f"r{i}"))
        else:
            out.append(ObjectWritten(repository=repo, branch="main", staging_token="t",
                                     path=f"p{i}", address=address, size=i, ref_id=f"r{i}"))
    return out


async def _consume(settings: Settings, expected: int, deadline_s: float = 60.0
                   ) -> list[tuple[int, int, Event]]:
    """(partition, offset, event) for every record, once ``expected`` arrived or time is up."""
    consumer = AIOKafkaConsumer(
        settings.events_topic,
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=f"test-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=3000,
        heartbeat_interval_ms=1000,
    )
    await consumer.start()
    got: list[tuple[int, int, Event]] = []
    try:
        deadline = time.monotonic() + deadline_s
        while len(got) < expected and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            for tp, records in batches.items():
                got.extend((tp.partition, r.offset, decode(r.value)) for r in records)
    finally:
        await consumer.stop()
    return got


async def test_ensure_topics_is_idempotent_and_sized(settings: Settings) -> None:
    await ensure_topics(settings)
    await ensure_topics(settings)  # a second start-up must not fail on existing topics
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        topics = set(await admin.list_topics())
        assert {settings.events_topic, settings.dlq_topic} <= topics
        described = await admin.describe_topics([settings.events_topic])
        assert len(described[0]["partitions"]) == settings.topic_partitions
    finally:
        await admin.close()


async def test_per_repository_order_and_partition(settings: Settings) -> None:
    await ensure_topics(settings)
    repos = [f"repo-{i}" for i in range(8)]  # more repositories than partitions
    per_repo = {repo: _events(repo, 12) for repo in repos}
    # Interleave repositories so the broker sees them mixed, as it would from many services.
    interleaved = [per_repo[repo][i] for i in range(12) for repo in repos]
    first, second = interleaved[:40], interleaved[40:]

    async with Publisher(settings) as publisher:
        for event in first:  # one at a time, each acknowledged
            await publisher.publish(event)
        sent = await publisher.publish_many(second)  # batched
        assert sent == len(second)
        assert await publisher.publish_many([]) == 0
        assert publisher.published == len(interleaved)

    got = await _consume(settings, len(interleaved))
    assert len(got) == len(interleaved), f"only {len(got)} of {len(interleaved)} arrived"

    partitions: dict[str, set[int]] = defaultdict(set)
    received: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for partition, offset, event in got:
        partitions[event.repository].add(partition)
        received[event.repository].append((offset, event.event_id))
    for repo in repos:
        assert len(partitions[repo]) == 1, f"{repo} spread over partitions {partitions[repo]}"
        in_offset_order = [eid for _, eid in sorted(received[repo])]
        assert in_offset_order == [e.event_id for e in per_repo[repo]], repo
    # Each event arrived exactly once and intact.
    by_id = {e.event_id: e for e in interleaved}
    assert sorted(by_id) == sorted(e.event_id for _, _, e in got)
    assert all(by_id[e.event_id] == e for _, _, e in got)
    # Eight keys over four partitions: the key really spreads repositories (else one
    # partition would serialise every repository's tracker work).
    assert len({p for ps in partitions.values() for p in ps}) > 1
