"""``hardelete tracker run``: consume the events topic into Redis reference state.

One cycle: read the Redis clock, ``getmany`` a batch, decode and admit every record (bad ones go
to the dead-letter topic, produced and acknowledged first), apply the batch with one
``apply.lua`` call per (repository, partition) in one pipeline, commit the offsets, then record
per-partition progress. A crash anywhere only causes redelivery, which is harmless: the script
skips offsets it already applied and the reference sets are idempotent.

Progress (``hd:progress[p]``, Redis-clock ms): "everything the broker held for partition p at
that time has been applied". At the start of a cycle the tracker reads Redis ``TIME`` = R and
samples the partition's fetch timestamp. aiokafka keeps at most one fetch in flight per broker,
so once the fetch timestamp has *changed twice* since that sample, the latest high watermark H
came from a fetch request sent after R was read: every record the broker held at R is below H.
When the consumer position reaches H, progress[p] = R. No local clock is compared with
anything, and a highwater seen in a response that waited in a socket buffer is never used.

In-process use (demo, reaper tests, benchmarks)::

    tracker = Tracker(settings)
    task = asyncio.create_task(tracker.run())      # until tracker.stop()
    ...
    await tracker.stop()                            # finish the batch, commit, leave the group

    await Tracker(settings).run_until_caught_up()   # apply what the broker holds now, return

    async with running_tracker(settings) as tracker: ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from hardelete import UserError
from hardelete.clients import redis_async
from hardelete.settings import Settings
from schemas.events import EventError
from schemas.layout import (
    INCIDENTS,
    NAMESPACES,
    PROGRESS,
    PROGRESS_META,
    REPOS,
    RETIRED,
    RepoKeys,
)
from schemas.publisher import ensure_topics
from tracker import codec
from tracker.references import admission_problem
from tracker.state import (
    PROGRESS_LUA,
    ApplyScript,
    afree_namespace,
    aredis_time_ms,
    aregister_namespace,
    atracker_horizon_ms,
)

log = structlog.get_logger("tracker")

_MAX_CANDIDATES = 64


@dataclass
class _Waiter:
    redis_ms: int
    last_ts: int | None
    changes: int = 0


@dataclass
class PartitionClock:
    """Turns (Redis time, fetch timestamp, highwater, position) samples into safe progress."""

    waiting: list[_Waiter] = field(default_factory=list)
    ready: deque[tuple[int, int]] = field(default_factory=deque)  # (redis_ms, highwater)

    def begin(self, redis_ms: int, ts: int | None) -> None:
        if self.waiting and self.waiting[-1].changes == 0:
            self.waiting[-1] = _Waiter(redis_ms, ts)
        elif len(self.waiting) < 4:
            self.waiting.append(_Waiter(redis_ms, ts))

    def sample(self, ts: int | None, highwater: int | None) -> None:
        if ts is None or highwater is None:
            return
        keep = []
        for w in self.waiting:
            if ts != w.last_ts:
                w.changes += 1
                w.last_ts = ts
            if w.changes >= 2:
                if len(self.ready) < _MAX_CANDIDATES:
                    self.ready.append((w.redis_ms, highwater))
            else:
                keep.append(w)
        self.waiting = keep

    def claim(self, position: int) -> int | None:
        best = None
        while self.ready and self.ready[0][1] <= position:
            best = self.ready.popleft()[0]
        return best


@dataclass
class _Batch:
    calls: list[tuple[str, int, bytes]] = field(default_factory=list)
    dlq: list[tuple[Any, str]] = field(default_factory=list)
    new_repos: set[str] = field(default_factory=set)
    refused: list[dict[str, Any]] = field(default_factory=list)  # refused repository_created
    retired: dict[str, tuple[str, str]] = field(default_factory=dict)  # repo -> (ns, event id)
    offsets: dict[Any, OffsetAndMetadata] = field(default_factory=dict)
    positions: dict[int, int] = field(default_factory=dict)
    records: int = 0
    t0: float = 0.0


class TrackerMetrics:
    """Prometheus metrics of one tracker (own registry: several trackers may share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.applied = Counter("hardelete_tracker_events_applied", "events applied to Redis",
                               registry=r)
        self.skipped = Counter("hardelete_tracker_events_redelivered",
                               "redelivered events skipped by offset", registry=r)
        self.dlq = Counter("hardelete_tracker_dlq", "events sent to the dead-letter topic",
                           ["reason_kind"], registry=r)
        self.incidents = Counter("hardelete_tracker_incidents",
                                 "references for addresses being reaped or reaped", registry=r)
        self.batch = Histogram("hardelete_tracker_batch_seconds", "decode+apply+commit per batch",
                               buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10),
                               registry=r)
        self.lag = Gauge("hardelete_tracker_lag", "highwater - position", ["partition"],
                         registry=r)
        self.progress = Gauge("hardelete_tracker_progress_ms",
                              "Redis-clock ms up to which the partition is applied",
                              ["partition"], registry=r)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    async def on_partitions_revoked(self, revoked: Any) -> None:
        t = self.tracker
        async with t._lock:  # the in-flight batch is applied and committed first
            with contextlib.suppress(Exception):  # (its error surfaces in the main loop)
                await t._drain()
            # Another tracker may retire a repository of these partitions: read it again.
            t.gate = codec.Gate()
            for tp in revoked:
                t._clocks.pop(tp.partition, None)
                t.metrics.lag.remove(str(tp.partition)) if str(tp.partition) in t._lag_labels \
                    else None
                t._lag_labels.discard(str(tp.partition))
        t.log.info("partitions revoked", partitions=sorted(tp.partition for tp in revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        t = self.tracker
        for tp in assigned:
            t._clocks[tp.partition] = PartitionClock()
        t.assigned_event.set()
        t.log.info("partitions assigned", partitions=sorted(tp.partition for tp in assigned))


def _reason_kind(reason: str) -> str:
    for kind in ("not valid JSON", "unknown event type", "schema version", "unknown repository",
                 "missing", "expected", "outside namespace", "reserved", "already exists",
                 "namespace overlap", "retired", "not canonical"):
        if kind in reason:
            return kind.replace(" ", "_")
    return "other"


class Tracker:
    """One tracker process' worth of work, as an asyncio task."""

    def __init__(self, settings: Settings, *, name: str = "tracker",
                 metrics: TrackerMetrics | None = None) -> None:
        if not settings.kafka_bootstrap or not settings.redis_url:
            raise UserError("the tracker needs kafka_bootstrap and redis_url "
                            "(HARDELETE_KAFKA_BOOTSTRAP, HARDELETE_REDIS_URL)")
        self.settings = settings
        self.name = name
        self.metrics = metrics or TrackerMetrics()
        self.log = log.bind(tracker=name, topic=settings.events_topic,
                            group=settings.consumer_group)
        self.gate = codec.Gate()
        self.applied = 0
        self.redelivered = 0
        self.dead_lettered = 0
        self.incidents = 0
        self.batches = 0
        self.assigned_event = asyncio.Event()
        self._stop = asyncio.Event()
        self._lock = asyncio.Lock()
        self._clocks: dict[int, PartitionClock] = {}
        self._lag_labels: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._pending: asyncio.Future[None] | None = None
        self._failure: Exception | None = None
        self._last_time_read = 0.0
        self._redis: Any = None
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self.run(), name=f"tracker-{self.name}")
        return self._task

    async def stop(self) -> None:
        """Finish the in-flight batch, commit, leave the group."""
        self._stop.set()
        if self._task is not None:
            await self._task

    async def run_until_caught_up(self, timeout: float = 60.0) -> None:
        """Run until everything the broker held when called is applied (by this or any
        tracker of the group), then stop."""
        task = self._task or self.start()
        r = redis_async(self.settings)
        try:
            target = await aredis_time_ms(r)
            deadline = time.monotonic() + timeout
            while True:
                if task.done():
                    task.result()
                    raise RuntimeError("tracker stopped before catching up")
                h = await atracker_horizon_ms(r)
                if h is not None and h >= target:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tracker did not catch up within {timeout}s")
                await asyncio.sleep(0.02)
        finally:
            await r.aclose()
            await self.stop()

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Consume until ``stop`` (or :meth:`stop`) is set."""
        s = self.settings
        if stop is not None:
            asyncio.get_running_loop().create_task(self._relay(stop))
        await ensure_topics(s)
        self._redis = redis_async(s)
        await self._redis.script_load(ApplyScript.lua)
        self._progress_sha = await self._redis.script_load(PROGRESS_LUA)
        await self._backfill_registry()
        consumer = self._consumer = AIOKafkaConsumer(
            bootstrap_servers=s.kafka_bootstrap, group_id=s.consumer_group,
            client_id=f"hardelete-{self.name}", enable_auto_commit=False,
            auto_offset_reset="earliest", session_timeout_ms=s.session_timeout_ms,
            heartbeat_interval_ms=s.heartbeat_interval_ms,
            fetch_max_wait_ms=min(s.tracker_poll_ms, 500),
            max_partition_fetch_bytes=8 << 20, fetch_max_bytes=64 << 20,
            max_poll_interval_ms=300_000,
        )
        producer = self._producer = AIOKafkaProducer(
            bootstrap_servers=s.kafka_bootstrap, acks="all", linger_ms=2)
        server = None
        try:
            await producer.start()
            consumer.subscribe([s.events_topic], listener=_Listener(self))
            await consumer.start()
            await self._write_meta(consumer)
            if s.metrics_port:
                server = start_http_server(s.metrics_port, registry=self.metrics.registry)
            self.log.info("tracker started", metrics_port=s.metrics_port or None)
            while not self._stop.is_set():
                await self._cycle(consumer)
            await self._drain()
        finally:
            with contextlib.suppress(Exception):
                await consumer.stop()  # leaves the group
            with contextlib.suppress(Exception):
                await producer.stop()
            with contextlib.suppress(Exception):
                await self._redis.aclose()
            if server is not None:
                server[0].shutdown()
            self.log.info("tracker stopped", applied=self.applied, dlq=self.dead_lettered,
                          incidents=self.incidents)

    async def _relay(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._stop.set()

    async def _write_meta(self, consumer: AIOKafkaConsumer) -> None:
        topic = self.settings.events_topic
        parts = consumer.partitions_for_topic(topic)
        deadline = time.monotonic() + 30
        while not parts:
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {topic} has no partitions")
            await asyncio.sleep(0.05)
            parts = consumer.partitions_for_topic(topic)
        await self._redis.hset(PROGRESS_META, mapping={"topic": topic,
                                                       "partitions": str(len(parts))})

    # --- one cycle ----------------------------------------------------------------------------

    def _sample(self, consumer: AIOKafkaConsumer) -> None:
        topic = self.settings.events_topic
        for p, clock in list(self._clocks.items()):
            tp = TopicPartition(topic, p)
            try:
                clock.sample(consumer.last_poll_timestamp(tp), consumer.highwater(tp))
            except Exception:  # unassigned meanwhile
                continue

    async def _cycle(self, consumer: AIOKafkaConsumer) -> None:
        """Fetch and prepare batch n+1 while batch n is applied and committed (two stages)."""
        if self._failure is not None:
            raise self._failure
        s = self.settings
        topic = s.events_topic
        # A new progress candidate needs the Redis clock; while a batch is in flight TIME would
        # queue behind its script and serialise the two stages, so then only every 100 ms.
        if self._pending is None or time.monotonic() - self._last_time_read > 0.1:
            redis_now = await aredis_time_ms(self._redis)
            self._last_time_read = time.monotonic()
            self._sample(consumer)
            for p, clock in list(self._clocks.items()):
                with contextlib.suppress(Exception):
                    clock.begin(redis_now,
                                consumer.last_poll_timestamp(TopicPartition(topic, p)))
        else:
            self._sample(consumer)
        stop_wait = asyncio.ensure_future(self._stop.wait())
        fetch = asyncio.ensure_future(
            consumer.getmany(timeout_ms=s.tracker_poll_ms, max_records=s.tracker_batch_max))
        await asyncio.wait({fetch, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if not fetch.done():  # stopping: getmany returns within its timeout
            await asyncio.wait({fetch})
        data = fetch.result()
        self._sample(consumer)
        async with self._lock:
            assigned = consumer.assignment()
            data = {tp: recs for tp, recs in data.items() if tp in assigned and recs}
            t0 = time.perf_counter()
            batch = await self._prepare(data)
            batch.t0 = t0
            for tp in assigned:  # every record before these positions is in this batch or
                with contextlib.suppress(Exception):  # an earlier one
                    batch.positions[tp.partition] = await consumer.position(tp)
            await self._drain()
            self._pending = asyncio.ensure_future(self._apply(consumer, batch))

    async def _drain(self) -> None:
        """Wait until the in-flight batch is applied and committed (raises its error)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                await pending
            except Exception as exc:
                self._failure = exc  # surfaces in the main loop even if a revoke drained it
                raise

    async def _prepare(self, data: dict[Any, list[Any]]) -> _Batch:
        gate = self.gate
        batch = _Batch()
        parsed: list[tuple[int, Any, dict[str, Any]]] = []
        dlq = batch.dlq
        parse = codec.parse
        for tp, records in data.items():
            p = tp.partition
            for rec in records:
                try:
                    parsed.append((p, rec, parse(rec.value)))
                except EventError as exc:
                    dlq.append((rec, str(exc)))
                except Exception as exc:  # a poison record must not stop the tracker
                    dlq.append((rec, f"undecodable event ({type(exc).__name__}: {exc})"))
            batch.offsets[tp] = OffsetAndMetadata(records[-1].offset + 1, "")
            batch.records += len(records)
        missing = gate.missing({body["repository"] for _, _, body in parsed})
        if missing:
            await self._load_namespaces(missing)
        chunks: dict[tuple[str, int], list[list[Any]]] = defaultdict(list)
        compact = codec.compact
        check = gate.check
        for p, rec, body in parsed:
            problem = check(body)
            t = body["type"]
            if t == "repository_created" or t == "repository_deleted":
                problem = await self._lifecycle(batch, body, problem)
            if problem:
                dlq.append((rec, problem))
                continue
            chunks[(body["repository"], p)].append(compact(body, rec.offset))
        batch.calls = [(repo, p, orjson.dumps(evts)) for (repo, p), evts in chunks.items()]
        return batch

    async def _lifecycle(self, batch: _Batch, body: dict[str, Any],
                         problem: str | None) -> str | None:
        """Repository lifecycle at admission. A ``repository_created`` the gate admits is
        registered in ``hd:namespaces`` now, atomically across trackers (an overlap with a live
        repository refuses it: dead letter and incident). A ``repository_deleted`` is noted:
        once its chunk is applied, :meth:`_retire` frees the namespace."""
        repo, eid = body["repository"], body["event_id"]
        if body["type"] == "repository_deleted":
            if problem is None:
                batch.retired[repo] = (self.gate.retired[repo], eid)
            return problem
        ns = body["storage_namespace"]
        if problem is None:  # retired by another tracker since this gate cached it?
            old_ns, retired_at = await self._retrying(
                lambda: self._redis.hmget(RepoKeys(repo).meta, ["namespace", "retired_at"]))
            if retired_at:
                self.gate.forget(repo)
                self.gate.retired[repo] = old_ns
                problem = admission_problem(repo, "repository_created", [], old_ns, ns,
                                            retired=True)
        if problem is None:
            problem = await self._retrying(
                lambda: aregister_namespace(self._redis, repo, ns))
            if problem is None:
                batch.new_repos.add(repo)
                return None
            self.gate.forget(repo)
        batch.refused.append({"kind": "repository_refused", "repository": repo,
                              "namespace": ns, "reason": problem, "event_id": eid})
        self.log.error("incident: repository refused", repository=repo, namespace=ns,
                       reason=problem, event_id=eid)
        return problem

    async def _backfill_registry(self) -> None:
        """Register live repositories that predate the registry (an upgrade): every delete
        path requires its repository to own its namespace there. A conflict is an incident
        (the repository's reaper then deletes nothing until an operator resolves it)."""
        repos = sorted(await self._redis.smembers(REPOS))
        if not repos:
            return
        registry = await self._redis.hgetall(NAMESPACES)
        pipe = self._redis.pipeline(transaction=False)
        for repo in repos:
            pipe.hmget(RepoKeys(repo).meta, ["namespace", "retired_at"])
        for repo, (ns, retired_at) in zip(repos, await pipe.execute(), strict=True):
            if not ns or retired_at or registry.get(ns) == repo:
                continue
            problem = await aregister_namespace(self._redis, repo, ns)
            if problem is not None:
                now = await aredis_time_ms(self._redis)
                await self._redis.rpush(INCIDENTS, orjson.dumps({
                    "kind": "registry_conflict", "repository": repo, "namespace": ns,
                    "reason": problem, "event_id": "", "at_ms": now}))
                self.log.error("incident: live repository not registered", repository=repo,
                               namespace=ns, reason=problem)

    async def _retire(self, retired: dict[str, tuple[str, str]]) -> None:
        """After the chunks are applied (queue and claims dropped, later events ignored): the
        reaper stops visiting the repository, the retirement is recorded, then the namespace
        is freed. Each step is idempotent; a crash repeats them on redelivery."""
        now = await aredis_time_ms(self._redis)
        for repo, (ns, eid) in sorted(retired.items()):
            record = orjson.dumps({"namespace": ns, "at_ms": now, "event_id": eid}).decode()
            await self._retrying(lambda repo=repo: self._redis.srem(REPOS, repo))
            await self._retrying(lambda repo=repo, record=record: self._redis.hsetnx(
                RETIRED, repo, record))
            await self._retrying(lambda repo=repo, ns=ns: afree_namespace(self._redis, repo, ns))
            self.log.info("repository retired", repository=repo, namespace=ns, event_id=eid)

    async def _apply(self, consumer: AIOKafkaConsumer, batch: _Batch) -> None:
        if batch.dlq:
            await self._dead_letter(batch.dlq)  # acknowledged before the offsets are committed
        if batch.refused:
            now = await aredis_time_ms(self._redis)
            items = [orjson.dumps({**inc, "at_ms": now}) for inc in batch.refused]
            await self._retrying(lambda: self._redis.rpush(INCIDENTS, *items))
            self.incidents += len(items)
            self.metrics.incidents.inc(len(items))
        if batch.new_repos:
            await self._retrying(lambda: self._redis.sadd(REPOS, *batch.new_repos))
        if batch.calls:
            results = await self._retrying(
                lambda: ApplyScript.apply_many(self._redis, batch.calls))
            for res in results:
                applied, skipped = int(res[0]), int(res[1])
                self.applied += applied
                self.redelivered += skipped
                self.metrics.applied.inc(applied)
                if skipped:
                    self.metrics.skipped.inc(skipped)
                for raw in res[2:]:
                    inc = orjson.loads(raw)
                    self.incidents += 1
                    self.metrics.incidents.inc()
                    self.log.error("incident: reference for an address being reaped or reaped",
                                   **inc)
        if batch.retired:
            await self._retire(batch.retired)
        if batch.offsets:
            try:
                await consumer.commit(batch.offsets)
            except Exception as exc:  # redelivery is harmless
                self.log.warning("offset commit failed; the batch may be redelivered",
                                 error=str(exc))
            self.batches += 1
            self.metrics.batch.observe(time.perf_counter() - batch.t0)
        await self._progress(consumer, batch.positions)

    async def _retrying(self, call: Any, budget_s: float = 60.0) -> Any:
        """Retry a Redis call on connection trouble (every call here is idempotent)."""
        delay, deadline = 0.05, time.monotonic() + budget_s
        while True:
            try:
                return await call()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise
                self.log.warning("redis unavailable; retrying", error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _load_namespaces(self, repos: set[str]) -> None:
        ordered = sorted(repos)
        pipe = self._redis.pipeline(transaction=False)
        for repo in ordered:
            pipe.hmget(RepoKeys(repo).meta, ["namespace", "retired_at"])
        for repo, (ns, retired_at) in zip(ordered, await pipe.execute(), strict=True):
            if ns and retired_at:
                self.gate.retired[repo] = ns
            elif ns:
                self.gate.namespaces[repo] = ns

    async def _dead_letter(self, items: list[tuple[Any, str]]) -> None:
        assert self._producer is not None
        s = self.settings
        futures = []
        for rec, reason in items:
            headers = [("reason", reason.encode()), ("topic", rec.topic.encode()),
                       ("partition", str(rec.partition).encode()),
                       ("offset", str(rec.offset).encode())]
            futures.append(await self._producer.send(
                s.dlq_topic, value=rec.value if rec.value is not None else b"", key=rec.key,
                headers=headers))
            self.log.warning("dead-lettered event", reason=reason, partition=rec.partition,
                             offset=rec.offset)
            self.metrics.dlq.labels(_reason_kind(reason)).inc()
        await asyncio.gather(*futures)  # acknowledged before the offsets are committed
        self.dead_lettered += len(items)

    async def _progress(self, consumer: AIOKafkaConsumer, positions: dict[int, int]) -> None:
        topic = self.settings.events_topic
        claims: list[str] = []
        for p, pos in positions.items():
            clock = self._clocks.get(p)
            if clock is None:
                continue
            with contextlib.suppress(Exception):
                hw = consumer.highwater(TopicPartition(topic, p))
                if hw is not None:
                    self.metrics.lag.labels(str(p)).set(max(0, hw - pos))
                    self._lag_labels.add(str(p))
            claimed = clock.claim(pos)
            if claimed is not None:
                claims += [str(p), str(claimed)]
                self.metrics.progress.labels(str(p)).set(claimed)
        if claims:
            await self._retrying(
                lambda: self._redis.evalsha(self._progress_sha, 1, PROGRESS, *claims))


@contextlib.asynccontextmanager
async def running_tracker(settings: Settings, name: str = "tracker") -> AsyncIterator[Tracker]:
    """A tracker running as a task for the duration of the block."""
    tracker = Tracker(settings, name=name)
    task = tracker.start()
    try:
        yield tracker
    finally:
        await tracker.stop()
        if task.done() and not task.cancelled() and task.exception():
            raise task.exception()  # type: ignore[misc]


# --- CLI ---------------------------------------------------------------------------------------

def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="tracker", help="name in logs and the Kafka client id")
    parser.add_argument("--until-caught-up", action="store_true",
                        help="exit once everything the broker holds now is applied")


def run_cli(settings: Settings, args: argparse.Namespace) -> int:
    tracker = Tracker(settings, name=args.name)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, tracker._stop.set)
        if args.until_caught_up:
            await tracker.run_until_caught_up()
        else:
            await tracker.run()

    try:
        asyncio.run(main())
    except (OSError, RedisConnectionError, KafkaError, RuntimeError) as exc:
        # Unreachable broker/Redis: one clear line, no traceback (the CLI contract).
        print(f"hardelete: tracker: {exc}", file=sys.stderr)
        return 1
    return 0
