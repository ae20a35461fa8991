"""Tracker throughput against the raw consume limit of the same broker, in one run.

    .venv/bin/python -m sim.bench_tracker --events 200000

Starts the embedded stack (Apache Kafka + Redis), publishes N events of a realistic mix
(``sim.gen.workload``), then measures (1) a raw aiokafka loop that only iterates the
records and (2) the tracker applying them end to end into Redis (decode, admission, Lua apply,
offset commits, progress). The tracker's clock starts once its partitions are assigned (the
group join is a fixed cost, reported separately). Prints events/s for both and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from aiokafka import AIOKafkaConsumer

from core.clients import redis_sync, topic_partitions
from core.settings import Settings, load_settings
from schemas.publisher import Publisher, ensure_topics
from sim.gen import workload
from sim.stack import REDIS_MALLOCS, embedded_stack
from tracker.daemon import Tracker, tune_gc


async def _publish(settings: Settings, events: list[Any]) -> float:
    await ensure_topics(settings)
    t0 = time.perf_counter()
    async with Publisher(settings, linger_ms=20) as pub:
        for i in range(0, len(events), 20_000):
            await pub.publish_many(events[i:i + 20_000])
    return time.perf_counter() - t0


async def _raw_consume(settings: Settings, n: int) -> float:
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap,
                                enable_auto_commit=False, auto_offset_reset="earliest",
                                max_partition_fetch_bytes=8 << 20, fetch_max_bytes=64 << 20)
    await consumer.start()
    try:
        consumer.assign(await topic_partitions(consumer, settings.events_topic))
        count = 0
        t0 = time.perf_counter()
        while count < n:
            batch = await consumer.getmany(timeout_ms=500, max_records=settings.tracker_batch_max)
            for records in batch.values():
                for _ in records:
                    count += 1
        return time.perf_counter() - t0
    finally:
        await consumer.stop()


def _redis_cpu_s(settings: Settings) -> float:
    r = redis_sync(settings)
    try:
        info = r.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    finally:
        r.close()


@dataclass
class _Tracked:
    elapsed_s: float
    join_s: float
    tracker: Tracker
    cpu_s: float  # this process (the tracker's event loop) during the tracked phase
    redis_cpu_s: float  # the Redis server during the tracked phase


async def _track(settings: Settings, n: int) -> _Tracked:
    tracker = Tracker(settings, name="bench")
    t_start = time.perf_counter()
    task = tracker.start()
    await asyncio.wait_for(tracker.assigned_event.wait(), 60)
    t0, cpu0, rcpu0 = time.perf_counter(), time.process_time(), _redis_cpu_s(settings)
    while tracker.applied + tracker.dead_lettered < n:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - t0
    cpu, rcpu = time.process_time() - cpu0, _redis_cpu_s(settings) - rcpu0
    await tracker.stop()
    return _Tracked(elapsed, t0 - t_start, tracker, cpu, rcpu)


def sequenced(events: list[Any]) -> list[Any]:
    """The events as an outbox would number them: a gapless seq per repository (one stripe),
    in the order they are published (schemas/README.md, "Continuity")."""
    from schemas.events import ServiceEvent

    seqs: Counter[str] = Counter()
    out = []
    for e in events:
        if isinstance(e, ServiceEvent):
            seqs[e.repository] += 1
            e = replace(e, seq=seqs[e.repository], incarnation="bench")
        out.append(e)
    return out


async def bench(settings: Settings, n: int, repos: int, seed: int,
                with_seqs: bool = False) -> dict[str, float]:
    t0 = time.perf_counter()
    events = workload(seed, n, repos=repos)
    if with_seqs:
        events = sequenced(events)
    n = len(events)
    gen_s = time.perf_counter() - t0
    mix = Counter(e.TYPE for e in events)
    pub_s = await _publish(settings, events)
    raw_s = await _raw_consume(settings, n)
    tracked = await _track(settings, n)
    trk_s, tracker = tracked.elapsed_s, tracked.tracker
    r = redis_sync(settings)
    info = r.info("memory")
    r.close()
    out = {
        "events": n, "repos": repos, "partitions": settings.topic_partitions,
        "generate_s": gen_s, "publish_eps": n / pub_s,
        "raw_consume_eps": n / raw_s, "tracker_eps": n / trk_s,
        "ratio": (n / trk_s) / (n / raw_s), "tracker_join_s": tracked.join_s,
        "tracker_cpu_us": tracked.cpu_s / n * 1e6, "redis_cpu_us": tracked.redis_cpu_s / n * 1e6,
        "batches": tracker.batches, "redis_used_mb": info["used_memory"] / 2**20,
    }
    print(f"mix: {dict(mix.most_common())}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.bench_tracker", description=__doc__)
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--repos", type=int, default=32)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--batch", type=int, default=10_000, help="tracker_batch_max")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--redis-malloc", choices=REDIS_MALLOCS, default="mimalloc",
                    help="allocator of the embedded Redis (see sim.stack)")
    ap.add_argument("--sequenced", action="store_true",
                    help="every service event carries a seq (continuity accounting in apply.lua)")
    ap.add_argument("--default-gc", action="store_true",
                    help="keep Python's default GC thresholds (not the tracker process's)")
    args = ap.parse_args(argv)
    if not args.default_gc:  # both loops run as in a tracker process (tracker.daemon.tune_gc)
        tune_gc()
    base = load_settings(env={}, topic_partitions=args.partitions,
                         tracker_batch_max=args.batch, session_timeout_ms=3000,
                         heartbeat_interval_ms=1000, tracker_poll_ms=50, log_level="warning")
    from core.logs import configure_logging

    configure_logging("console", "warning")
    with embedded_stack(base, s3=False, redis_malloc=args.redis_malloc) as stack:
        res = asyncio.run(bench(stack.settings, args.events, args.repos, args.seed,
                               args.sequenced))
    print(f"events              {res['events']:>10,}  ({res['repos']} repositories, "
          f"{res['partitions']} partitions{', sequenced' if args.sequenced else ''})")
    print(f"publish             {res['publish_eps']:>10,.0f} events/s")
    print(f"raw aiokafka loop   {res['raw_consume_eps']:>10,.0f} events/s")
    print(f"tracker end to end  {res['tracker_eps']:>10,.0f} events/s   "
          f"({res['batches']} batches; group join {res['tracker_join_s']:.1f} s not counted)")
    print(f"ratio tracker/raw   {res['ratio']:>10.2f}")
    print(f"CPU per event       {res['tracker_cpu_us']:>10.1f} us tracker process, "
          f"{res['redis_cpu_us']:.1f} us Redis (wall {1e6 / res['tracker_eps']:.1f} us)")
    print(f"redis memory        {res['redis_used_mb']:>10.1f} MiB ({args.redis_malloc}; "
          f"{'default' if args.default_gc else 'tracker'} GC thresholds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
