"""A dead letter's claim names its log and its record (found by an adversarial review; this
test failed before). The claim was ``dlq:<topic>:<partition>:<offset>`` (no log epoch, no
repository), and ``hardelete dlq resolve`` removes that claim from every hold of *every*
repository (``hardelete/dlq.py`` ``holds_of``/``resolve``). Kafka reuses offsets when the events
topic is re-created (a log reset the tracker detects and survives), and the dead-letter topic
keeps the old log's dead letters. So resolving a stale dead letter of the old log lifts the hold
a *new* dead letter (another repository, the new log, same offset) placed, and the reaper
deletes the object that hold kept (the lost event may have been the copy that kept it alive).

Real stack: Apache Kafka (topic deleted and re-created), the real tracker, the CLI, the reaper,
MinIO.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from schemas.events import encode
from schemas.publisher import Publisher, ensure_topics
from sim.model import Model
from sim.operations import (
    broken,
    claims,
    created,
    kept,
    make_garbage,
    reap_until,
    run,
    stored,
    tracked,
)
from tracker.daemon import Tracker

K = 30  # the offset both dead letters have in their log


async def send(s: Any, values: list[tuple[bytes, bytes]]) -> list[int]:
    await ensure_topics(s)
    async with Publisher(s) as pub:
        out = []
        for value, key in values:
            md = await pub._producer.send_and_wait(s.events_topic, value, key=key)
            out.append(md.offset)
    return out


async def end_offset(s: Any) -> int:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    c = AIOKafkaConsumer(bootstrap_servers=s.kafka_bootstrap)
    await c.start()
    try:
        tp = TopicPartition(s.events_topic, 0)
        return (await c.end_offsets([tp]))[tp]
    finally:
        await c.stop()


async def recreate_topic(s: Any) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
    await admin.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            await admin.delete_topics([s.events_topic])
            created_ = await admin.create_topics([NewTopic(s.events_topic, 1, 1)])
            if created_.topic_errors[0][1] == 0:
                break
            assert time.monotonic() < deadline, "the topic could not be re-created"
            await asyncio.sleep(0.3)
    finally:
        await admin.close()


def test_resolving_a_stale_dead_letter_lifts_a_new_logs_hold_and_the_reaper_deletes(
        cli, capsys, s3, redis_client):
    s = cli.replace(lease_seconds=1.0, upload_ttl_seconds=1.0, topic_partitions=1)
    s3.create_bucket(Bucket="dlqb")
    # --- the old log: repository 'old' and a dead letter at offset K
    ev_old = created("old", "s3://dlqb/old/")
    fill = [(encode(created("old", "s3://dlqb/old/")), b"old") for _ in range(K - 1)]
    offs = asyncio.run(send(s, [(encode(ev_old), b"old"), *fill,
                                (broken("old", "s3://dlqb/old/data/z"), b"old")]))
    assert offs[-1] == K
    asyncio.run(Tracker(s).run_until_caught_up())
    (claim,) = claims(redis_client, "old", "s3://dlqb/old/data/z")
    assert claim.startswith(f"dlq:{s.events_topic}:0:{K}:")  # the place, its log, the record

    # --- fault: the events topic is re-created (Kafka reuses offsets 0..)
    asyncio.run(recreate_topic(s))
    model = Model.from_settings(s)
    (x,) = asyncio.run(make_garbage(s, s3, model, "victim", ["x"],
                                    namespace="s3://dlqb/victim/"))
    n = asyncio.run(end_offset(s))
    assert n <= K, n
    pad = [(encode(created("victim", "s3://dlqb/victim/")), b"victim") for _ in range(K - n)]
    # the lost event of the new log (e.g. the copy that kept x alive) names x, at offset K
    offs = asyncio.run(send(s, [*pad, (broken("victim", x), b"victim")]))
    assert offs[-1] == K
    asyncio.run(Tracker(s).run_until_caught_up())
    (new_claim,) = claims(redis_client, "victim", x)  # x is held by the new dead letter,
    assert new_claim.startswith(f"dlq:{s.events_topic}:0:{K}:") and new_claim != claim

    # --- the operator resolves the OLD dead letter (repository 'old', fixed or judged)
    code, out, _ = run(capsys, "dlq", "list", "--json")
    letters = orjson.loads(out)
    old = [d for d in letters if d["repository"] == "old"]
    new = [d for d in letters if d["repository"] == "victim"]
    assert len(old) == 1 and len(new) == 1
    code, out, _ = tracked(s, capsys, "dlq", "resolve", old[0]["id"])
    assert code == 0, out
    # the new dead letter is unresolved: its hold must still keep x
    still = claims(redis_client, "victim", x)
    report = asyncio.run(reap_until(
        s, lambda rep: not stored(s3, x) or kept(rep, "victim", "held") > 0))
    assert stored(s3, x), (
        f"x deleted while the unresolved dead letter {new[0]['id']} held it "
        f"(resolve output: {out.strip()!r}; claims left: {still}; {report.as_dict()})")
