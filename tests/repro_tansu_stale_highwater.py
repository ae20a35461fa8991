"""Reproduce a defect of Tansu's ``s3://`` storage engine: after a restart, an acknowledged
record can stay invisible, with every fetch reporting the high watermark from before it.

Not part of the test suite (it demonstrates a broker's defect, not ours); run it with
``.venv/bin/python tests/repro_tansu_stale_highwater.py``. Exit status 0: reproduced.

Why it happens (Tansu's dynostore): a partition's high watermark is a ``watermark.json``
object, cached in the broker under its ETag, and a fetch asks S3 for it with If-None-Match.
Right after a restart the cache is empty, so a fetch reads it unconditionally. When that read
is answered before a concurrent produce writes the new watermark but reaches the broker after
the write, the broker stores the old watermark and its ETag over the new one. Every later fetch
presents that old ETag, its cache answers "not modified", and the partition's high watermark
stays where it was, until the next produce. The record is durable and acknowledged, yet no
consumer can read it, and a fetch says it does not exist.

That breaks what the tracker's progress proof relies on ("a fetch sent after an acknowledgement
reports a high watermark covering it"; Kafka guarantees it), so its horizon can pass such a
record. The suite's broker-restart test waits until the tracker has fetched from the restarted
broker before it publishes (the cache is warm then), RELIABILITY.md has the details.

Here S3 is moto behind the fault proxy (``sim.faultproxy``), which delivers unconditional
reads of ``watermark.json`` late (as a loaded machine does), so the window is wide enough to
hit on purpose.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import boto3
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from sim.faultproxy import FaultProxy
from sim.stack import moto_server, tansu_server

DELAY_S = 0.5  # how late an unconditional read of watermark.json arrives
TOPIC = "events"
TP = TopicPartition(TOPIC, 0)


async def produce(boot: str, n: int) -> list[int]:
    producer = AIOKafkaProducer(bootstrap_servers=boot, acks="all")
    await producer.start()
    try:
        sent = [await producer.send(TOPIC, f"r{i}".encode(), key=b"k") for i in range(n)]
        return [md.offset for md in await asyncio.gather(*sent)]
    finally:
        await producer.stop()


async def attempt(boot: str, restart: Any, lag: float, end: int) -> bool:
    """Restart, produce one record, start fetching (from the log's ``end``) ``lag`` s later;
    True if the acknowledged record stayed invisible for the 3 s after its ack."""
    restart()
    consumer = AIOKafkaConsumer(bootstrap_servers=boot, group_id=None,
                                auto_offset_reset="none", fetch_max_wait_ms=50)
    await consumer.start()
    try:
        prod = asyncio.create_task(produce(boot, 1))
        await asyncio.sleep(lag)  # the produce is re-reading the watermark (cold) now
        consumer.assign([TP])
        consumer.seek(TP, end)
        got: list[int] = []
        seen: list[tuple[float, int | None]] = []
        acked: float | None = None
        while acked is None or time.monotonic() < acked + 3.0:
            batch = await consumer.getmany(TP, timeout_ms=50)
            got += [r.offset for r in batch.get(TP, [])]
            seen.append((time.monotonic(), consumer.highwater(TP)))
            if acked is None and prod.done():
                offset = prod.result()[0]
                acked = time.monotonic()
        late = [hw for t, hw in seen if acked is not None and t > acked + 0.5]
        hidden = offset not in got and bool(late) and max(hw or 0 for hw in late) <= offset
        print(f"lag {lag:.2f} s: record acknowledged at offset {offset}; fetched {got}; "
              f"high watermark reported 0.5-3 s after the ack: {sorted(set(late))}"
              + ("  <- acknowledged but invisible" if hidden else ""))
        return hidden
    finally:
        await consumer.stop()


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        moto = moto_server(work)
        moto.start()
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{moto.port}",
                          aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
        s3.create_bucket(Bucket="tansu-log")
        try:
            with FaultProxy(f"http://127.0.0.1:{moto.port}") as proxy:
                proxy.faults.late_reads = ("watermark.json", DELAY_S)
                tansu = tansu_server(work, storage="s3://tansu-log/", env={
                    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true",
                    "AWS_ENDPOINT": proxy.url})
                tansu.start()
                try:
                    reproduced = asyncio.run(run(f"127.0.0.1:{tansu.port}", tansu.restart))
                finally:
                    tansu.stop()
        finally:
            moto.stop()
    print("reproduced" if reproduced else "not reproduced")
    return 0 if reproduced else 1


async def run(boot: str, restart: Any) -> bool:
    admin = AIOKafkaAdminClient(bootstrap_servers=boot)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(TOPIC, 1, 1)])
    finally:
        await admin.close()
    end = len(await produce(boot, 44))
    hits = []
    for lag in (0.15, 0.3, 0.15):  # each attempt adds one record
        hits.append(await attempt(boot, restart, lag, end))
        end += 1
    return any(hits)


if __name__ == "__main__":
    sys.exit(main())
