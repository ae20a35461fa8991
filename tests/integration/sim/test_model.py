"""The model service: pure semantics and ground truth (no servers), property tests over seeded
workloads, and the service layer against the real S3 server and broker."""

from __future__ import annotations

import io
import uuid
from typing import Any

import pyarrow.parquet as pq
import pytest
from aiokafka import AIOKafkaConsumer

from core.clients import split_s3_uri, topic_partitions
from core.settings import Settings
from schemas.publisher import Publisher, ensure_topics
from sim.model import (
    MANIFEST_COLUMNS,
    Model,
    ModelService,
    Workload,
)

# --- repositories, addresses ------------------------------------------------------------------






# --- writes, overwrites, deletes, copies -------------------------------------------------------
















# --- commits, merges, resets, tags -------------------------------------------------------------












# --- upload tokens, unlinked uploads, leaks ----------------------------------------------------












# --- workloads ---------------------------------------------------------------------------------










# --- property tests: invariants of the ground truth over random workloads ----------------------








# --- the service layer on real servers --------------------------------------------------------


async def _topic_records(settings: Settings) -> int:
    """The records in the events topic: the sum of its partitions' ends (ListOffsets). (Read
    one by one while the embedded broker was Tansu, whose ListOffsets answered the last
    batch's base offset + 1.)"""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap)
    await consumer.start()
    try:
        tps = await topic_partitions(consumer, settings.events_topic)
        assert len(tps) == settings.topic_partitions
        return int(sum((await consumer.end_offsets(tps)).values()))
    finally:
        await consumer.stop()
@pytest.mark.parametrize("mode", ["per-op", "buffered"])
async def test_model_service_writes_objects_manifests_and_events(
        settings: Settings, s3: Any, mode: Any) -> None:
    await ensure_topics(settings)
    bucket = f"model-{uuid.uuid4().hex[:8]}"  # not created: the service must create it
    workload = Workload(seed=11, ops=90, repos=2, bucket=bucket, max_size=3000)
    async with Publisher(settings) as publisher:
        service = ModelService(settings, s3, publisher, publish_mode=mode, payload_cap=512)
        summary = await service.run_workload(workload)
    model = service.model

    assert summary.ops == 90 + workload.setup_ops
    assert summary.events == len(model.events) == summary.events_published
    assert await _topic_records(settings) == len(model.events)
    assert summary.objects_written == len(model.objects) > 0
    assert summary.manifests_written == len(model.commits) > 0
    assert summary.truth == model.truth().counts()

    check = await service.verify_store()
    assert check.ok, check
    assert check.listed_data == len(model.objects)

    # Every object in the store is in exactly one truth category, and every non-garbage
    # (indeed every) object the model knows is there.
    truth = model.truth()
    listed: set[str] = set()
    for repo in model.repositories:
        listed.update(u for u in await service.list_namespace(repo) if "/data/" in u)
    assert listed == set(truth.objects)
    for address in listed:
        assert sum(address in members for members in truth.partition().values()) == 1
    live = truth.committed | truth.superseded | truth.staged_live | truth.issued_unexpired
    assert (live & truth.objects) <= listed

    # Object bytes: random, of the entry's size capped at payload_cap.
    record = next(iter(model.objects.values()))
    b, k = split_s3_uri(record.address)
    assert s3.head_object(Bucket=b, Key=k)["ContentLength"] == min(record.size, 512)

    # Manifests are real Parquet files with the commit's entries.
    for commit in list(model.commits.values())[-3:]:
        b, k = split_s3_uri(commit.manifest)
        table = pq.read_table(io.BytesIO(s3.get_object(Bucket=b, Key=k)["Body"].read()))
        assert tuple(table.column_names) == MANIFEST_COLUMNS
        rows = table.to_pylist()
        assert rows == [{"path": p, "address": e.address, "size": e.size, "ref_id": e.ref_id}
                        for p, e in sorted(commit.entries.items())]
        assert b"hardelete.commit" in (table.schema.metadata or {})
async def test_model_service_call_and_store_check_detects_divergence(
        settings: Settings, s3: Any, bucket: str) -> None:
    service = ModelService(settings, s3)  # no publisher: events stay in the model
    await service.call(Model.create_repository, "r", f"s3://{bucket}/r/")
    written = await service.call(Model.write, "r", "main", "a", 10)
    await service.call(Model.commit, "r", "main")
    assert service.events_published == 0 and len(service.model.events) == 5
    assert (await service.verify_store()).ok
    # Delete an object behind the model's back and add a stray one: the check must notice.
    assert written.address
    b, k = split_s3_uri(written.address)
    s3.delete_object(Bucket=b, Key=k)
    s3.put_object(Bucket=bucket, Key="r/data/0000000000/stray", Body=b"x")
    check = await service.verify_store()
    assert not check.ok
    assert check.missing == (written.address,)
    assert check.unexpected == (f"s3://{bucket}/r/data/0000000000/stray",)






