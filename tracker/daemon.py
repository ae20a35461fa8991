"""``hardelete tracker run``: consume the events topic into Redis reference state.

One cycle: read the Redis clock, ``getmany`` a batch, decode and admit every record (bad ones go
to the dead-letter topic, produced and acknowledged first), apply the batch with one
``apply.lua`` call per (repository, partition) in one pipeline, record what was applied from each
partition's log (``hd:log``), commit the offsets, then record per-partition progress. A crash
anywhere only causes redelivery, which is harmless: the script skips offsets it already applied
and the reference sets are idempotent.

Log identity (``tracker/logid.py``): on assignment each partition is sought to what *Redis* says
it applied (+1), after checking that the log is still the one Redis folded (epoch and the
fingerprint of the last applied record); a Redis that went back in time is repaired by replay, a
log that changed or lost what Redis lacks puts the repositories concerned fail-closed. Every
chunk and progress claim carries the ``hd:log`` value the tracker expects, so a Redis that went
back in time while running applies nothing past its gap.

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
import gc
import re
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
from aiokafka.errors import (
    KafkaError,
    MessageSizeTooLargeError,
    NoOffsetForPartitionError,
    OffsetOutOfRangeError,
)
from aiokafka.structs import OffsetAndMetadata
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from core.clients import redis_async, redis_sync
from core.clock import aredis_time_ms, atracker_horizon_ms
from core.errors import UserError
from core.registry import aregister_namespace
from core.settings import Settings
from schemas import reaper_auth
from schemas.events import EventError
from schemas.holds import DLQ, aadd_claims, dlq_claim
from schemas.layout import (
    APPLIED,
    FAIL_CLOSED,
    INCIDENTS,
    LOG,
    NAMESPACES,
    PROGRESS,
    PROGRESS_META,
    REFUSED,
    REPOS,
    RETIRED,
    RepoKeys,
)
from schemas.publisher import ensure_topics
from tracker import codec
from tracker.logid import (
    ANCHOR_KEY,
    NOT_FETCHED,
    LogRecord,
    anchor_value,
    anchored,
    cluster_tag,
    decide,
    epoch_cluster,
    fingerprint,
    fingerprint_of,
    gone_partitions,
    is_anchor,
    log_field,
    new_epoch,
)
from tracker.references import admission_problem
from tracker.state import (
    APPLIED_MERGE_LUA,
    LOG_WRITE_LUA,
    META_LUA,
    PROGRESS_LUA,
    ApplyScript,
    LogGuard,
)

log = structlog.get_logger("tracker")

_MAX_CANDIDATES = 64
_ANCHOR_TIMEOUT_S = 5.0  # a broker that does not take the anchor by then: tried again later
_ANCHOR_RETRY_S = 30.0  # (not every log check: a broker that refuses it would stall the tracker)
_META_INTERVAL_S = 0.25  # how often the partition count is re-verified (horizon lags by this)
_LOG_CHECK_ROUNDS = 20  # every 5 s: is the record last applied still in the log?
_DLQ_MAX_VALUE = 900_000  # bytes of a dead-lettered value (the producer's request limit is 1 MB)
_DLQ_MAX_KEY = 1_024
_MAX_REASON = 1_000


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
class FetchWait:
    """How long the broker may hold one fetch (``fetch_max_wait_ms``).

    Short by default: Apache Kafka holds a fetch that has less than ``fetch.min.bytes`` ready
    for the whole wait, which adds it to every event's latency at the log's end, and with
    aiokafka's one fetch in flight per broker a long wait on the partitions at their end also
    holds back those behind them. Raised only while the tracker is *starved behind the end*: a
    partition behind its high watermark with nothing fetched for it in hand. That is what a
    broker whose reads take longer than the wait does (a remote storage tier; the Tansu
    stand-in's ``s3://`` engine did it, fetch after fetch: the long runs' stall,
    RELIABILITY.md); on Kafka's local log it does not happen and the wait stays at the poll.
    When most samples of a ``stuck_s`` window were starved, the wait doubles, up to
    ``catchup_ms``; it drops back to the poll once no partition is behind.
    """

    poll_ms: int
    catchup_ms: int
    stuck_s: float = 1.0
    starved_share: float = 0.8
    current: int = 0
    _window: tuple[float, int, int] | None = None  # (start, samples, starved samples)

    def __post_init__(self) -> None:
        self.catchup_ms = max(self.catchup_ms, self.poll_ms)
        self.current = self.poll_ms

    def grow(self) -> int:
        self.current = min(self.catchup_ms, max(self.poll_ms, self.current * 2))
        return self.current

    def after_fetch(self, lags: dict[int, tuple[int, int | None, bool]], now: float) -> int:
        """The wait for the next fetch, from each partition's (position, high watermark,
        records fetched and not yet returned) after a fetch (``now``: monotonic seconds)."""
        behind = [buffered for pos, hw, buffered in lags.values()
                  if hw is not None and hw > pos]
        if not behind:
            self.current, self._window = self.poll_ms, None
            return self.current
        start, samples, starved = self._window or (now, 0, 0)
        samples += 1
        starved += not all(behind)
        if now - start < self.stuck_s:
            self._window = (start, samples, starved)
        else:
            self._window = None
            if starved >= self.starved_share * samples:
                self.grow()
        return self.current


def _set_fetch_max_wait(consumer: AIOKafkaConsumer, ms: int) -> int | None:
    """Set the wait of the consumer's next fetch requests; returns the previous one. aiokafka
    reads it from its fetcher for every request and has no public setter: if a release moves
    it, None comes back and the configured wait simply stays."""
    fetcher = getattr(consumer, "_fetcher", None)
    was = getattr(fetcher, "_fetch_max_wait_ms", None)
    if was is not None and was != ms:
        fetcher._fetch_max_wait_ms = ms  # type: ignore[union-attr]
    return was


def _buffered(consumer: AIOKafkaConsumer, tp: Any) -> bool:
    """Whether aiokafka holds fetched records of ``tp`` not yet returned (private state; if a
    release moves it, False: a partition behind then counts as starved)."""
    records: Any = getattr(getattr(consumer, "_fetcher", None), "_records", None)
    return bool(records) and tp in records


@dataclass
class _Batch:
    calls: list[tuple[str, int, bytes]] = field(default_factory=list)
    maxoff: dict[tuple[str, int], int] = field(default_factory=dict)  # (repo, p) -> offset
    dlq: list[tuple[Any, str]] = field(default_factory=list)
    claims: dict[int, str] = field(default_factory=dict)  # id(dead record) -> its hold claim
    new_repos: set[str] = field(default_factory=set)
    refused: list[dict[str, Any]] = field(default_factory=list)  # refused repository_created
    refused_ids: dict[str, str] = field(default_factory=dict)  # hd:refused, as far as known
    retired: dict[str, tuple[str, str]] = field(default_factory=dict)  # repo -> (ns, event id)
    offsets: dict[Any, OffsetAndMetadata] = field(default_factory=dict)
    positions: dict[int, int] = field(default_factory=dict)
    last: dict[int, tuple[int, str]] = field(default_factory=dict)  # p -> (offset, fingerprint)
    # repo, address (or the namespace, then a prefix hold), prefix?, claim id, claim
    holds: list[tuple[str, str, bool, str, dict[str, Any]]] = field(default_factory=list)
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
        self.unanchored = Counter("hardelete_tracker_anchor_refused",
                                  "anchor records the broker did not take (such a log is known "
                                  "only by its start until one is taken)", registry=r)
        self.fetch_wait = Gauge("hardelete_tracker_fetch_wait_ms",
                                "longest wait of the next fetch (raised while behind the log's "
                                "end)", registry=r)


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
                t._logrec.pop(tp.partition, None)  # another tracker moves it on now
                t._epochs.pop(tp.partition, None)
                t.metrics.lag.remove(str(tp.partition)) if str(tp.partition) in t._lag_labels \
                    else None
                t._lag_labels.discard(str(tp.partition))
        t.log.info("partitions revoked", partitions=sorted(tp.partition for tp in revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        t = self.tracker
        t._assigning.clear()
        for tp in assigned:
            t._clocks[tp.partition] = PartitionClock()
        try:  # resume from what Redis applied, not from the group's offsets
            await t._verify(set(assigned))
        except Exception as exc:  # surfaces in the main loop: never consume unverified
            t._failure = exc
            t.log.error("partition verification failed", error=str(exc))
        finally:
            t._assigning.set()
        t.assigned_event.set()
        t.log.info("partitions assigned", partitions=sorted(tp.partition for tp in assigned))


def _reason_kind(reason: str) -> str:
    for kind in ("not valid JSON", "unknown event type", "schema version", "unknown repository",
                 "record key", "must be", "missing", "expected", "outside namespace", "reserved",
                 "already exists", "namespace overlap", "retired", "not canonical"):
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
        self.regressions = 0  # chunks refused because Redis no longer held what we applied
        self._reap_key: bytes | None = None  # verifies addresses_reaped (reaper_auth)
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
        self._probe: AIOKafkaConsumer | None = None  # no group: offsets, one-record fetches
        self._epochs: dict[int, str] = {}  # partition -> epoch of its log
        self._logrec: dict[int, str] = {}  # partition -> hd:log value Redis must hold
        self._anchor_tried: dict[int, float] = {}  # partition -> monotonic time of last try
        # Redis Cluster: (repo, partition) -> the applied value Redis must hold (the log
        # guard in the repository's own slot, tracker/apply.lua)
        self._applied_seen: dict[tuple[str, int], str] = {}
        self._reverify = False  # Redis or the log moved under us: resume from Redis again
        self._rejoin = False  # the partition count changed: join the group afresh
        self._probe_lock = asyncio.Lock()
        self._verify_lock = asyncio.Lock()  # one verification at a time (listener, main loop)
        self._assigning = asyncio.Event()  # clear while the listener verifies an assignment
        self._assigning.set()
        self.verified = 0  # partition verifications (seeks from Redis) so far
        self._seen_count: int | None = None
        self._redis_now = 0
        self.fail_closed = 0
        self._heal_task: asyncio.Task[None] | None = None
        self.holds = 0
        self._cluster = bool(getattr(settings, "redis_cluster", False))
        self._fetch_wait = FetchWait(min(settings.tracker_poll_ms, 500),
                                     settings.tracker_catchup_wait_ms)
        self.metrics.fetch_wait.set(self._fetch_wait.current)

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
        # Scripts that reload themselves after a Redis restart (NOSCRIPT).
        self._progress_script = self._redis.register_script(PROGRESS_LUA)
        self._log_script = self._redis.register_script(LOG_WRITE_LUA)
        self._meta_script = self._redis.register_script(META_LUA)
        self._applied_script = self._redis.register_script(APPLIED_MERGE_LUA)
        # auto_offset_reset "none": an offset out of range (a log reset under us) is an error
        # we handle, never a silent jump; every assigned partition is sought from Redis.
        # metadata_max_age_ms: new partitions are noticed (and assigned) within a second.
        await self._backfill_registry()
        # Minted now (if nobody has yet): a copy of Redis taken from here on holds the key that
        # verifies the reaper's records, so replaying them after a restore still verifies.
        self._reap_key = await reaper_auth.aload_key(self._redis, s.reaper_secret)
        consumer = self._consumer = self._new_consumer()
        producer = self._producer = AIOKafkaProducer(
            bootstrap_servers=s.kafka_bootstrap, acks="all", linger_ms=2,
            max_request_size=1 << 20)
        probe = self._probe = AIOKafkaConsumer(
            bootstrap_servers=s.kafka_bootstrap, group_id=None, enable_auto_commit=False,
            client_id=f"hardelete-{self.name}-probe", auto_offset_reset="none",
            fetch_max_wait_ms=self._fetch_wait.poll_ms,
            max_partition_fetch_bytes=8 << 20, fetch_max_bytes=64 << 20)
        server = None
        meta_task: asyncio.Task[None] | None = None
        try:
            await producer.start()
            await probe.start()
            await self._write_meta()
            consumer.subscribe([s.events_topic], listener=_Listener(self))
            await consumer.start()
            meta_task = asyncio.create_task(self._meta_loop())
            if s.rebuild_interval_seconds > 0:
                self._heal_task = asyncio.create_task(self._heal_loop())
            if s.metrics_port:
                server = start_http_server(s.metrics_port, registry=self.metrics.registry)
            self.log.info("tracker started", metrics_port=s.metrics_port or None)
            while not self._stop.is_set():
                if self._rejoin:
                    consumer = await self._rejoin_group(consumer)
                await self._cycle(consumer)
            await self._drain()
        finally:
            for task in (meta_task, self._heal_task):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
            with contextlib.suppress(Exception):
                await self._consumer.stop()  # leaves the group
            with contextlib.suppress(Exception):
                await producer.stop()
            with contextlib.suppress(Exception):
                await probe.stop()
            with contextlib.suppress(Exception):
                await self._redis.aclose()
            if server is not None:
                server[0].shutdown()
            self.log.info("tracker stopped", applied=self.applied, dlq=self.dead_lettered,
                          incidents=self.incidents)

    def _new_consumer(self) -> AIOKafkaConsumer:
        s = self.settings
        return AIOKafkaConsumer(
            bootstrap_servers=s.kafka_bootstrap, group_id=s.consumer_group,
            client_id=f"hardelete-{self.name}", enable_auto_commit=False,
            auto_offset_reset="none", metadata_max_age_ms=1_000,
            session_timeout_ms=s.session_timeout_ms,
            heartbeat_interval_ms=s.heartbeat_interval_ms,
            fetch_max_wait_ms=self._fetch_wait.poll_ms,  # raised while behind (FetchWait)
            max_partition_fetch_bytes=8 << 20, fetch_max_bytes=64 << 20,
            max_poll_interval_ms=300_000,
        )

    async def _rejoin_group(self, consumer: AIOKafkaConsumer) -> AIOKafkaConsumer:
        """The partition count changed: leave the group and join it again as a new member, so
        the new partitions are assigned now. (Kafka's coordinator rebalances on its own once
        every member's metadata shows the new count, up to ``metadata.max.age.ms`` later; the
        Tansu stand-in re-sent the old assignment to a member that merely re-joined. A fresh
        member costs one rebalance and is right on both.)"""
        self._rejoin = False
        await self._drain()
        self.log.info("partition count changed; re-joining the group")
        await consumer.stop()  # revokes (drained) and leaves the group
        fresh = self._consumer = self._new_consumer()
        fresh.subscribe([self.settings.events_topic], listener=_Listener(self))
        await fresh.start()
        return fresh

    async def _relay(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._stop.set()

    async def _write_meta(self) -> None:
        deadline = time.monotonic() + 30
        while not await self._verify_meta():
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {self.settings.events_topic} has no partitions")
            await asyncio.sleep(0.05)

    async def _verify_meta(self) -> bool:
        """One verified partition count: Redis time R, then a metadata request sent after R;
        PROGRESS_META records the count and verified_ms = R (the horizon never passes it)."""
        assert self._probe is not None
        topic = self.settings.events_topic
        at = await aredis_time_ms(self._redis)
        md = await self._probe._client.fetch_all_metadata()
        parts = md.partitions_for_topic(topic)
        if not parts:
            return False
        # Before the count is recorded: while it still names the gone partitions, their stale
        # progress holds the horizon back, so no reaper acts before their repositories fail.
        await self._fail_gone_partitions(set(parts))
        changed = await self._meta_script(keys=[PROGRESS_META],
                                          args=[topic, str(len(parts)), str(at)])
        if changed:
            self.log.info("partition count of the events topic", partitions=len(parts))
        if self._seen_count is not None and self._seen_count != len(parts):
            self._rejoin = True
        self._seen_count = len(parts)
        return True

    async def _fail_gone_partitions(self, partitions: set[int]) -> None:
        """Repositories that applied records from a partition the topic no longer has are
        fail-closed (tracker/logid.py: gone_partitions), then its log record is dropped."""
        topic = self.settings.events_topic
        fields = await self._retrying(lambda: self._redis.hkeys(LOG))
        gone = gone_partitions((str(f) for f in fields), topic, partitions)
        if not gone:
            return
        now = await aredis_time_ms(self._redis)
        await self._fail_repos({p: (
            f"log reset or replaced: partition {p} of {topic} is gone (the topic has "
            f"{len(partitions)} partition(s) now); what was published to it and never applied "
            "is lost") for p in gone}, now)
        for p in gone:
            # Only once they are flagged: a tracker killed in between checks again.
            await self._retrying(lambda: self._redis.hdel(LOG, log_field(topic, p)))  # noqa: B023
            await self._retrying(lambda: self._redis.hdel(PROGRESS, str(p)))  # noqa: B023
            self._logrec.pop(p, None)
            self._epochs.pop(p, None)

    async def _heal_loop(self) -> None:
        """Self-healing (tracker/rebuild.py): a fail-closed repository gets a rebuild prepared,
        and is rebuilt once its service wrote a state export carrying the nonce."""
        from core.clients import s3_client
        from tracker.rebuild import heal

        s = self.settings
        r, s3 = redis_sync(s), s3_client(s)
        try:
            while not self._stop.is_set():
                try:
                    healed = await asyncio.to_thread(
                        heal, r, s3, max_age_ms=int(s.uncommitted_export_max_age_seconds * 1000),
                        by=f"tracker {self.name}")
                    for repo in healed.prepared:
                        self.log.warning("rebuild prepared: waiting for the service's state "
                                         "export", repository=repo)
                    for rep in healed.rebuilt:
                        self.log.warning("repository rebuilt: no longer fail-closed",
                                         **rep.as_dict())
                    for repo, why in healed.problems.items():
                        self.log.warning("rebuild not applied", repository=repo, why=why)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # Redis or S3 trouble: the flag simply stays
                    self.log.warning("rebuild round failed", error=f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), s.rebuild_interval_seconds)
        finally:
            r.close()

    async def _meta_loop(self) -> None:
        rounds = 0
        while not self._stop.is_set():
            try:
                await self._verify_meta()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # broker/Redis trouble: the horizon simply stops
                self.log.warning("partition count not verified", error=str(exc))
            rounds += 1
            if rounds % _LOG_CHECK_ROUNDS == 0:
                try:
                    await self._check_logs()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.log.warning("log identity not checked", error=str(exc))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), _META_INTERVAL_S)

    # --- log identity (tracker/logid.py) -----------------------------------------------------

    async def _wait_assigned(self) -> None:
        stop = asyncio.ensure_future(self._stop.wait())
        done = asyncio.ensure_future(self._assigning.wait())
        try:
            await asyncio.wait({stop, done}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            done.cancel()

    async def _verify(self, tps: set[Any]) -> None:
        async with self._verify_lock:  # two at once would race on hd:log's compare-and-set
            await self._verify_locked(tps)

    async def _verify_locked(self, tps: set[Any]) -> None:
        """Seek each partition to what Redis says it applied (+1), after checking that the log
        is still the one Redis folded; put repositories fail-closed where it cannot replay."""
        self._applied_seen.clear()  # (partitions moved or Redis is in doubt: read them anew)
        if self._cluster:
            # ... from the durable copy, not from each repository's (possibly regressed) node:
            # a node that went back is then refused by the in-slot guard of the next chunk.
            for repo, raw in (await self._retrying(lambda: self._redis.hgetall(APPLIED))).items():
                with contextlib.suppress(orjson.JSONDecodeError, AttributeError, ValueError):
                    for p, value in orjson.loads(raw).items():
                        if p.isdigit():  # (not the "regressed" marker)
                            self._applied_seen[(str(repo), int(p))] = str(value)
        consumer, probe = self._consumer, self._probe
        assert consumer is not None and probe is not None
        if not tps:
            return
        topic = self.settings.events_topic
        ordered = sorted(tps, key=lambda tp: tp.partition)
        fields = [log_field(topic, tp.partition) for tp in ordered]
        raw = await self._retrying(lambda: self._redis.hmget(LOG, fields))
        starts = await probe.beginning_offsets(ordered)
        cluster = await self._broker_cluster()
        now = await self._retrying(lambda: aredis_time_ms(self._redis))
        decided = []
        for tp, value in zip(ordered, raw, strict=True):
            rec = LogRecord.decode(value)
            start = starts[tp]
            witness = rec.witness if rec is not None else None
            at = witness[0] if witness is not None and witness[0] >= start else start
            end, found_fp = await self._probe_at(tp, at)
            found: str | None = NOT_FETCHED
            if witness is not None and start <= witness[0] < end:
                found = found_fp
            committed = None
            if rec is None:
                with contextlib.suppress(Exception):
                    committed = await consumer.committed(tp)
            d = decide(rec, start, end, found, new_epoch(cluster),
                       group_committed=committed is not None, cluster=cluster)
            decided.append((d, start, end))
        # Logs known by no record get an anchor, all at once (each waits for the broker's ack).
        unknown = [i for i, (d, _, _) in enumerate(decided) if d.record.witness is None]
        records = {i: d.record for i, (d, _, _) in enumerate(decided)}
        for i, got in zip(unknown, await asyncio.gather(
                *(self._anchor(ordered[i], records[i]) for i in unknown)), strict=True):
            records[i] = got
        # Fail closed first, then move hd:log: a tracker killed in between finds the old
        # record and decides again (the other way round the new epoch hid the loss for good).
        await self._fail_repos({tp.partition: d.fail_repos for tp, (d, _, _)
                                in zip(ordered, decided, strict=True) if d.fail_repos}, now)
        for tp, (d, _, _) in zip(ordered, decided, strict=True):
            if d.fail_all:
                await self._fail_all(d.fail_all, now, tp.partition)
        for i, (tp, fld, value) in enumerate(zip(ordered, fields, raw, strict=True)):
            p = tp.partition
            d, start, end = decided[i]
            record = records[i]
            new = record.encode()
            if new != (value or ""):
                moved = await self._retrying(lambda: self._log_script(
                    keys=[LOG], args=[fld, value or "", new]))  # noqa: B023
                if moved:
                    raise RuntimeError(f"log record {fld} changed while verifying it")
                if d.reset:  # progress is keyed by the log: the old log's claims end here
                    await self._retrying(lambda: self._redis.hdel(PROGRESS, str(p)))  # noqa: B023
            self._epochs[p] = record.epoch
            self._logrec[p] = new
            self._clocks[p] = PartitionClock()  # no claim from samples taken before the seek
            consumer.seek(tp, d.seek)
            self.verified += 1
            (self.log.warning if d.fail_repos or d.fail_all else self.log.info)(
                "partition resumed from Redis", partition=p, offset=d.seek, epoch=record.epoch,
                log_start=start, log_end=end, detail=d.detail)

    async def _anchor(self, tp: Any, record: LogRecord) -> LogRecord:
        """Write an anchor record into the log (tracker/logid.py) and return ``record`` known by
        it; unchanged (with a warning) when the broker does not take it: a later check tries
        again (_check_logs), and meanwhile the log's start still tells a re-created topic."""
        producer = self._producer
        assert producer is not None
        self._anchor_tried[tp.partition] = time.monotonic()
        value = anchor_value(record.epoch)

        async def send() -> Any:
            # A partition added just now may not be in the producer's metadata yet.
            while tp.partition not in await producer.partitions_for(tp.topic):
                await producer.client.force_metadata_update()
                await asyncio.sleep(0.05)
            return await producer.send_and_wait(tp.topic, value, key=ANCHOR_KEY,
                                                partition=tp.partition)

        try:
            meta = await asyncio.wait_for(send(), _ANCHOR_TIMEOUT_S)
        except (TimeoutError, KafkaError, AssertionError) as exc:
            self.metrics.unanchored.inc()
            self.log.warning("log not anchored: the broker did not take the anchor record",
                             partition=tp.partition, error=f"{type(exc).__name__}: {exc}"[:300])
            return record
        # Its fingerprint from what was sent and the timestamp the broker stored: a log that
        # lost it right after the ack is another log, not one known by nothing.
        fp = fingerprint_of(ANCHOR_KEY, value, meta.timestamp)
        try:
            _, found = await self._probe_at(tp, meta.offset)
        except RuntimeError as exc:
            found = f"not fetched: {exc}"
        result, disagrees = anchored(record, meta.offset, fp, found)
        if disagrees:
            self.log.error("the log lost its anchor right after the broker took it; resuming "
                           "from Redis", partition=tp.partition, offset=meta.offset)
            self.regressions += 1
            self._reverify = True
        return result

    async def _check_logs(self) -> None:
        """While running: is the record we last applied from each partition still there? A log
        replaced under a running consumer (no rebalance, no out-of-range error) is caught here,
        and the tracker resumes from Redis (new epoch, fail-closed) as on assignment."""
        topic = self.settings.events_topic
        tags = {epoch_cluster(e) for e in self._epochs.values()} - {None}
        if tags and not self._reverify:
            # A log replaced under a running consumer with nothing applied from it yet has no
            # record to compare: the broker's cluster id tells (a lost disk is formatted anew).
            cluster = await self._broker_cluster()
            if cluster is not None and tags != {cluster_tag(cluster)}:
                self.log.error("the broker's cluster changed (its log was replaced); resuming "
                               "from Redis", cluster=cluster)
                self._reverify = True
                return
        for p, value in list(self._logrec.items()):
            rec = LogRecord.decode(value)
            if rec is None or self._reverify:
                continue
            witness = rec.witness
            if witness is None:  # not anchored (the broker did not take it): verify again
                if time.monotonic() - self._anchor_tried.get(p, 0.0) >= _ANCHOR_RETRY_S:
                    self.log.info("log not anchored yet; resuming from Redis", partition=p)
                    self._reverify = True
                continue
            _, found = await self._probe_at(TopicPartition(topic, p), witness[0])
            if found != witness[1] and self._logrec.get(p) is not None:
                self.log.error("the record that tells this log is gone from it; resuming from "
                               "Redis", partition=p, offset=witness[0])
                self._reverify = True

    async def _broker_cluster(self) -> str | None:
        """The broker's cluster id (a metadata request naming no topic), or None when it cannot
        be had (then only the records' fingerprints tell one log from another)."""
        from aiokafka.protocol.metadata import MetadataRequest

        probe = self._probe
        if probe is None:
            return None
        try:
            client = probe._client
            resp = await client.send(client.get_random_node(), MetadataRequest([]))
        except Exception as exc:  # (a broker down: the fingerprints and offsets still judge)
            self.log.warning("broker cluster id unavailable", error=str(exc)[:200])
            return None
        cluster = getattr(resp, "cluster_id", None)
        return str(cluster) if cluster else None

    async def _probe_at(self, tp: Any, offset: int) -> tuple[int, str | None]:
        async with self._probe_lock:  # one probe, shared by assignment and the log check
            return await self._probe_at_locked(tp, offset)

    async def _probe_at_locked(self, tp: Any, offset: int) -> tuple[int, str | None]:
        """(end of the log, fingerprint of the record at ``offset`` or None) as the broker sees
        them now: the end (high watermark) from ListOffsets, the record from a fetch.

        A log that was replaced or lost its tail ends at or before ``offset``: that is answered
        at once. (The end used to come from a fetch's high watermark, for Tansu, whose
        ListOffsets lagged; on Kafka a fetch past the end of a new log fails with
        OffsetOutOfRange and brings no high watermark, and the probe waited for one until it
        gave up: the tracker stalled after a broker lost its log.)"""
        probe = self._probe
        assert probe is not None
        end = int((await probe.end_offsets([tp]))[tp])
        if offset >= end:
            return end, None
        probe.assign([tp])
        probe.seek(tp, offset)
        _set_fetch_max_wait(probe, self._fetch_wait.poll_ms)
        limit = 15.0
        deadline = time.monotonic() + limit
        try:
            while time.monotonic() < deadline:
                try:
                    got = await probe.getmany(tp, timeout_ms=100, max_records=1)
                except OffsetOutOfRangeError:
                    # Gone since the ListOffsets (retention, or a log replaced meanwhile).
                    return end, None
                recs = got.get(tp, [])
                if recs:
                    return max(end, recs[0].offset + 1), (
                        fingerprint(recs[0]) if recs[0].offset == offset else None)
        finally:
            # Idle between probes: its client also sends the partition-count checks
            # (_verify_meta), and a fetch the broker holds would delay them.
            probe.unsubscribe()
        raise RuntimeError(f"partition {tp.partition}: no record fetched at offset {offset} "
                           f"below the log's end {end} within {limit:.0f} s")

    async def _known_repos(self) -> list[str]:
        """Repositories that may have had records on this partition that were never applied:
        every repository the trackers know. Having applied from it is not the test: after the
        partition count changed, a repository's records go to a partition it never applied
        from, and the tracker cannot know the service's partitioner (found by the soak, seed
        102: a repository keyed to a partition it had applied nothing from yet lost a write
        with the broker's log and was never failed closed; the write's object was reaped)."""
        return sorted(await self._retrying(lambda: self._redis.smembers(REPOS)))

    async def _fail_repos(self, failures: dict[int, str], now: int) -> None:
        """Fail closed the repositories of the partitions in ``failures`` (partition -> reason):
        every known one (:meth:`_known_repos`), once per call however many partitions
        failed (a lost broker log resets them all: one incident and one loss per repository,
        naming every partition, not one per partition)."""
        if not failures:
            return
        parts = sorted(failures)
        reason = failures[parts[0]]
        if len(parts) > 1:
            reason += f" (and partitions {', '.join(map(str, parts[1:]))})"
        repos = await self._known_repos()
        detail = orjson.dumps({"topic": self.settings.events_topic, "partition": parts[0],
                               "partitions": parts})
        for repo in repos:
            k = RepoKeys(repo)
            inc = orjson.dumps({"repository": repo, "address": "", "event_id": "",
                                "type": "fail_closed", "ref_id": "", "at_ms": now,
                                "reason": reason, "partition": parts[0], "partitions": parts})
            pipe = self._redis.pipeline(transaction=False)
            pipe.hsetnx(k.fail_closed, "reason", reason)
            pipe.hsetnx(k.fail_closed, "at_ms", str(now))
            pipe.hsetnx(k.fail_closed, "detail", detail)
            pipe.hincrby(k.fail_closed, "losses", 1)  # a rebuild prepared before is stale
            pipe.rpush(k.incidents, inc)
            pipe.hincrby(k.stats, "incidents", 1)
            await self._retrying(pipe.execute)
            self.fail_closed += 1
            self.log.error("repository fail-closed", repository=repo, reason=reason,
                           partitions=parts)
        if not repos:
            self.log.warning("log changed; no repository known yet", partitions=parts,
                             reason=reason)

    async def _fail_all(self, reason: str, now: int, partition: int) -> None:
        detail = orjson.dumps({"topic": self.settings.events_topic, "partition": partition})
        pipe = self._redis.pipeline(transaction=False)
        pipe.hsetnx(FAIL_CLOSED, "reason", reason)
        pipe.hsetnx(FAIL_CLOSED, "at_ms", str(now))
        pipe.hsetnx(FAIL_CLOSED, "detail", detail)
        pipe.rpush(INCIDENTS, orjson.dumps({"type": "fail_closed", "scope": "all",
                                            "reason": reason, "at_ms": now,
                                            "partition": partition}))
        await self._retrying(pipe.execute)
        self.fail_closed += 1
        self.log.error("every repository fail-closed", reason=reason, partition=partition)

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
            redis_now = self._redis_now = await self._retrying(
                lambda: aredis_time_ms(self._redis))
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
        try:
            data = fetch.result()
        except NoOffsetForPartitionError:
            # The fetcher looked for the group's offset before the listener's seek from Redis
            # landed. That seek gives the partition its position: wait for it, do not verify
            # again (which once doubled every start-up's verification).
            data = {}
            await self._wait_assigned()
        except OffsetOutOfRangeError as exc:
            # The log is shorter than our position (reset?): resume from Redis again.
            self.log.info("no valid position; resuming from Redis", error=str(exc))
            self._reverify, data = True, {}
        if not self._assigning.is_set():
            # The listener is verifying a new assignment: these records were fetched from the
            # group's offsets, before its seek from Redis (and before the partition's epoch was
            # known); they are fetched again after it. (Taken, they were dead-lettered twice.)
            data = {}
        self._sample(consumer)
        async with self._lock:
            assigned = consumer.assignment()
            data = {tp: recs for tp, recs in data.items() if tp in assigned and recs}
            t0 = time.perf_counter()
            batch = await self._prepare(data)
            batch.t0 = t0
            lags: dict[int, tuple[int, int | None, bool]] = {}
            for tp in assigned:  # every record before these positions is in this batch or
                with contextlib.suppress(Exception):  # an earlier one
                    pos = batch.positions[tp.partition] = await consumer.position(tp)
                    lags[tp.partition] = (pos, consumer.highwater(tp), _buffered(consumer, tp))
            self._set_fetch_wait(consumer,
                                 self._fetch_wait.after_fetch(lags, time.monotonic()))
            await self._drain()
            if self._reverify:  # drop the prepared batch: it follows a gap Redis now has
                self._reverify = False
                await self._verify(set(consumer.assignment()))
                return
            self._pending = asyncio.ensure_future(self._apply(consumer, batch))

    def _set_fetch_wait(self, consumer: AIOKafkaConsumer, ms: int) -> None:
        was = _set_fetch_max_wait(consumer, ms)
        if was is None or was == ms:
            return
        self.metrics.fetch_wait.set(ms)
        if ms == self._fetch_wait.poll_ms:
            self.log.info("caught up with the log's end: fetch wait back to poll", wait_ms=ms)
        elif was == self._fetch_wait.poll_ms:
            self.log.info("behind the log's end: fetch wait raised to catch up", wait_ms=ms)

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
        # The hot path: one pass to decode (collecting what the second needs), one to admit.
        gate = self.gate
        batch = _Batch()
        parsed: list[tuple[int, Any, dict[str, Any], str]] = []
        dlq = batch.dlq
        parse = codec.parse
        wanted: set[str] = set()  # repositories named (gate.missing: those to load)
        creates: list[str] = []  # event ids of repository_created
        for tp, records in data.items():
            p = tp.partition
            for rec in records:
                try:
                    body = parse(rec.value)
                except EventError as exc:
                    if not is_anchor(rec):  # (the tracker's own marker: applied as nothing)
                        dlq.append((rec, str(exc)))
                    continue
                except Exception as exc:  # a poison record must not stop the tracker
                    dlq.append((rec, f"undecodable event ({type(exc).__name__}: {exc})"))
                    continue
                repo, t = body["repository"], body["type"]
                # The key is the partition key: one that is not the repository breaks the
                # repository's ordering (its events could sit in two partitions).
                if rec.key is None or rec.key != repo.encode():
                    dlq.append((rec, f"record key {_short(rec.key)} does not equal repository "
                                     f"{repo[:200]!r}"))
                    continue
                wanted.add(repo)
                if t == "repository_created":
                    creates.append(body["event_id"])
                parsed.append((p, rec, body, t))
            last = records[-1]
            batch.offsets[tp] = OffsetAndMetadata(last.offset + 1, "")
            batch.last[p] = (last.offset, fingerprint(last))
            batch.records += len(records)
        for rec, _ in dlq:
            wanted |= codec.candidate_repos(rec.value, rec.key)
        missing = gate.missing(wanted)
        if missing:
            await self._load_namespaces(missing)
        chunks: dict[tuple[str, int], list[list[Any]]] = defaultdict(list)
        compact = codec.compact
        check = gate.check
        # A repository_created refused once is refused on every later delivery, whatever
        # changed since (schemas.layout.REFUSED); the gate must not learn its repository.
        if creates:
            found = await self._retrying(lambda: self._redis.hmget(REFUSED, creates))
            batch.refused_ids = {e: why for e, why in zip(creates, found, strict=True) if why}
        for p, rec, body, t in parsed:
            if t == "repository_created" or t == "repository_deleted":
                eid = body["event_id"]
                if t == "repository_created" and eid in batch.refused_ids:
                    problem = await self._lifecycle(batch, body, batch.refused_ids[eid])
                else:
                    problem = await self._lifecycle(batch, body, check(body))
            else:
                problem = check(body)
                if problem is None and t == "addresses_reaped":
                    problem = await self._forged_reap(batch, body)
            if problem:
                dlq.append((rec, problem))
                continue
            chunks[(body["repository"], p)].append(compact(body, rec.offset))
        batch.calls = [(repo, p, orjson.dumps(evts)) for (repo, p), evts in chunks.items()]
        batch.maxoff = {key: evts[-1][0] for key, evts in chunks.items()}
        rec_claims = batch.claims
        # the live registry, for what a dead letter names inside another repository's namespace
        registry = (await self._retrying(lambda: self._redis.hgetall(NAMESPACES))) if dlq else {}
        for rec, reason in dlq:  # a lost event never becomes a deletion: hold what it names
            targets = codec.hold_targets(rec.value, rec.key, gate.namespaces, registry)
            # One claim per dead letter (schemas/holds.py): resolving it leaves the others'.
            claim_id = dlq_claim(rec.topic, rec.partition, rec.offset,
                                 self._epochs.get(rec.partition, ""), rec.key, rec.value)
            rec_claims[id(rec)] = claim_id
            claim = {"reason": reason[:_MAX_REASON], "source": DLQ, "at_ms": self._redis_now,
                     "event_id": _event_id(rec.value), "topic": rec.topic,
                     "partition": rec.partition, "offset": rec.offset}
            for repo, address in targets:
                prefix = address.endswith("/")  # it could name anything there
                batch.holds.append((repo, address, prefix, claim_id, claim))
            if targets and "address" in reason:
                # A spelling the tracker will not apply (schemas/address.py): kept, and said.
                batch.refused.append({"kind": "address_spelling", "repository": targets[0][0],
                                      "reason": reason[:_MAX_REASON],
                                      "held": [a for _, a in targets][:10],
                                      "event_id": _event_id(rec.value)})
        return batch

    async def _forged_reap(self, batch: _Batch, body: dict[str, Any]) -> str | None:
        """Only the reaper vouches for a deletion (schemas/reaper_auth.py): an
        ``addresses_reaped`` that does not carry its signature is refused (dead letter and a
        ``forged_reap`` incident), never applied."""
        if reaper_auth.problem(self._reap_key, body) is None:
            return None
        # the key may have been minted (or rotated) since we read it
        self._reap_key = await self._retrying(
            lambda: reaper_auth.aload_key(self._redis, self.settings.reaper_secret))
        problem = reaper_auth.problem(self._reap_key, body)
        if problem is None:
            return None
        batch.refused.append({"kind": "forged_reap", "repository": body["repository"],
                              "reaper": str(body.get("reaper"))[:200],
                              "addresses": len(body["addresses"]),
                              "sample": body["addresses"][:5], "reason": problem,
                              "event_id": body["event_id"]})
        self.log.error("incident: forged addresses_reaped", repository=body["repository"],
                       event_id=body["event_id"], addresses=len(body["addresses"]))
        return problem

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
        if batch.refused_ids.get(eid) != problem:
            batch.refused_ids[eid] = problem
            await self._retrying(lambda: self._redis.hset(REFUSED, eid, problem))
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
            # The namespace stays registered to it while its data is kept (retired retention,
            # reconciler/retirement.py): no new repository may take the retired one's objects.
            self.log.info("repository retired", repository=repo, namespace=ns, event_id=eid)

    async def _apply(self, consumer: AIOKafkaConsumer, batch: _Batch) -> None:
        if batch.holds:  # first: the address is kept even while the dead-letter topic fails
            await self._write_holds(batch.holds)
        if batch.dlq:
            # acknowledged before the offsets are committed
            await self._dead_letter(batch.dlq, batch.claims)
        if batch.refused:
            now = await aredis_time_ms(self._redis)
            items = [orjson.dumps({**inc, "at_ms": now}) for inc in batch.refused]
            await self._retrying(lambda: self._redis.rpush(INCIDENTS, *items))
            self.incidents += len(items)
            self.metrics.incidents.inc(len(items))
        if batch.new_repos:
            await self._retrying(lambda: self._redis.sadd(REPOS, *batch.new_repos))
        if batch.calls:
            topic = self.settings.events_topic
            parts = sorted({p for _, p, _ in batch.calls})
            if self._cluster and not await self._log_unmoved(parts):
                return  # (one node checks hd:log inside the apply script; see _log_unmoved)
            guards = {p: LogGuard(self._epochs.get(p, ""), log_field(topic, p),
                                  self._logrec.get(p, ""), check=not self._cluster)
                      for p in parts}
            try:
                results = await self._retrying(
                    lambda: ApplyScript.apply_many(self._redis, batch.calls, guards,
                                                   self._applied_seen if self._cluster
                                                   else None))
            except ResponseError as exc:
                if "log record moved" not in str(exc):
                    raise
                # Redis went back in time (restart from an older copy, failover): apply
                # nothing past its gap, commit nothing; resume from what it holds.
                self.log.error("Redis lost applied records; resuming from what it holds",
                               error=str(exc)[:_MAX_REASON])
                self.regressions += 1
                self._applied_seen.clear()
                if self._cluster:
                    # One node went back (a failover to a stale replica): hd:log, in another
                    # slot, did not, so replaying from it would skip what this repository lost.
                    # Its mirror is unproven: fail it closed (SPEC safety 10).
                    await self._fail_regressed(str(exc))
                self._reverify = True
                return
            if self._cluster:
                await self._note_applied(batch)
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
        # Retire before hd:log moves past the repository_deleted event: a crash in between
        # replays it from Redis's record, and every retirement step is idempotent.
        if batch.retired:
            await self._retire(batch.retired)
        if not await self._write_log(batch.last, batch.maxoff):
            return
        if batch.offsets:
            try:
                await consumer.commit(batch.offsets)
            except Exception as exc:  # redelivery is harmless
                self.log.warning("offset commit failed; the batch may be redelivered",
                                 error=str(exc))
            self.batches += 1
            self.metrics.batch.observe(time.perf_counter() - batch.t0)
        await self._progress(consumer, batch.positions)

    async def _fail_regressed(self, error: str) -> None:
        found = re.search(r"applied\[(\d+)\] of (.*) is \"", error)
        if found is None:  # not the in-slot guard: re-verification decides
            return
        partition, repo = int(found.group(1)), found.group(2)
        now = await aredis_time_ms(self._redis)
        reason = (f"Redis lost applied records of partition {partition} (a cluster node went "
                  "back in time): the mirror is unproven")
        k = RepoKeys(repo)
        pipe = self._redis.pipeline(transaction=False)
        pipe.hsetnx(k.fail_closed, "reason", reason)
        pipe.hsetnx(k.fail_closed, "at_ms", str(now))
        pipe.hincrby(k.fail_closed, "losses", 1)  # a rebuild prepared before is stale
        pipe.rpush(k.incidents, orjson.dumps({
            "repository": repo, "address": "", "event_id": "", "type": "fail_closed",
            "ref_id": "", "at_ms": now, "reason": reason, "partition": partition}))
        # Its node is what it is now: the next chunks go on from there (no partition values
        # left to require, else each would be refused again, for ever), but the copy keeps a
        # marker in hd:applied's slot: a second failover may lose the flag with the node, and
        # the gate still keeps the repository until an operator clears it after a rebuild.
        pipe.hset(APPLIED, repo, orjson.dumps({"regressed": reason}).decode())
        await self._retrying(pipe.execute)
        self.fail_closed += 1
        self.log.error("repository fail-closed", repository=repo, reason=reason,
                       partition=partition)

    async def _note_applied(self, batch: _Batch) -> None:
        """Redis Cluster: remember each chunk's ``applied[partition]`` (the next chunk of the
        repository requires it). After a chunk the stored value is the larger of what we saw
        and the chunk's last offset; one we never saw is read once."""
        unknown = []
        for (repo, p), off in batch.maxoff.items():
            seen = self._applied_seen.get((repo, p))
            epoch = self._epochs.get(p, "")
            if seen is None:
                unknown.append((repo, p))
                continue
            prev_epoch, _, prev = seen.rpartition(":")
            if prev_epoch != epoch or off > int(prev):  # (a new log starts its offsets again)
                self._applied_seen[(repo, p)] = f"{epoch}:{off}" if epoch else str(off)
        if unknown:
            values = await asyncio.gather(*(self._redis.hget(RepoKeys(repo).applied, str(p))
                                            for repo, p in unknown))
            for key, value in zip(unknown, values, strict=True):
                if value is not None:
                    self._applied_seen[key] = value
        # The durable copy (hd:applied, another slot): after a restart the first chunk of each
        # repository requires it, and every delete path's gate compares against it, so a
        # repository's node going back is seen even when no event of it comes.
        # Only the partitions this batch applied, merged in Redis (APPLIED_MERGE_LUA): what
        # this tracker remembers of other partitions may be stale (another tracker owns them).
        copy: dict[str, dict[str, str]] = {}
        for repo, p in batch.maxoff:
            value = self._applied_seen.get((repo, p))
            if value is not None:
                copy.setdefault(repo, {})[str(p)] = value
        if copy:
            payload = orjson.dumps(copy).decode()
            await self._retrying(lambda: self._applied_script(keys=[APPLIED], args=[payload]))

    async def _log_unmoved(self, partitions: list[int]) -> bool:
        """Redis Cluster: hd:log lives in another slot than the repositories' chunks, so the
        apply script cannot check it; check it right before instead (what one node does inside
        the script), or a tracker that has not resumed a partition from Redis yet would apply
        its batch on an unverified epoch. (A node going back between the two is the in-slot
        ``applied`` guard's part.) False: resume from Redis, as :meth:`_write_log` does."""
        topic = self.settings.events_topic
        fields = [log_field(topic, p) for p in partitions]
        current = await self._retrying(lambda: self._redis.hmget(LOG, fields))
        moved = [f for f, p, cur in zip(fields, partitions, current, strict=True)
                 if (cur or "") != self._logrec.get(p, "")]
        if moved:
            self.log.error("log record moved under the tracker; resuming from Redis",
                           fields=moved)
            self.regressions += 1
            self._reverify = True
            return False
        return True

    async def _write_log(self, last: dict[int, tuple[int, str]],
                         maxoff: dict[tuple[str, int], int] | None = None) -> bool:
        """Record, after the repository chunks succeeded, what was applied from each partition
        (hd:log). False if Redis no longer holds what we expected (then resume from Redis).

        One Redis: in the same script, every repository of the batch must still hold what its
        chunk applied (``maxoff``), or hd:log does not move (LOG_WRITE_LUA). On a cluster the
        keys are in other slots; a node that went back is caught by the chunks' in-slot guard
        and the delete paths' comparison with hd:applied."""
        if not last:
            return True
        topic = self.settings.events_topic
        args: list[str] = []
        new: dict[int, str] = {}
        for p, (offset, fp) in last.items():
            new[p] = LogRecord(self._epochs.get(p, ""), offset, fp).encode()
            args += [log_field(topic, p), self._logrec.get(p, ""), new[p]]
        keys, checks = [LOG], []
        if maxoff and not self._cluster:
            keys += [RepoKeys(repo).applied for repo, _ in maxoff]
            checks = [x for (_, p), off in maxoff.items()
                      for x in (str(p), self._epochs.get(p, ""), str(off))]
        moved = await self._retrying(lambda: self._log_script(keys=keys, args=checks + args))
        if moved and moved[0] == "gone":
            self.log.error("Redis lost a chunk before hd:log recorded it; resuming from Redis",
                           key=str(moved[1]), partition=str(moved[2]))
            self.regressions += 1
            self._reverify = True
            return False
        for p, value in new.items():
            if log_field(topic, p) not in moved:
                self._logrec[p] = value
        if moved:
            self.log.error("log record moved under the tracker; resuming from Redis",
                           fields=list(moved))
            self.regressions += 1
            self._reverify = True
            return False
        return True

    async def _write_holds(self, holds: list[tuple[str, str, bool, str, dict[str, Any]]]
                           ) -> None:
        by_key: dict[str, list[tuple[str, str, dict[str, Any]]]] = defaultdict(list)
        for repo, address, prefix, claim_id, claim in holds:
            k = RepoKeys(repo)
            by_key[k.hold_prefixes if prefix else k.holds].append((address, claim_id, claim))

        async def write() -> None:  # idempotent: a redelivered dead letter has the same claim
            await asyncio.gather(*(aadd_claims(self._redis, key, items)
                                   for key, items in by_key.items()))
        await self._retrying(write)
        self.holds += len(holds)
        for repo, address, _, _, _ in holds:
            self.log.warning("hold placed on an address named by a dead-lettered event",
                             repository=repo, address=address[:500])

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

    async def _dead_letter(self, items: list[tuple[Any, str]],
                           claims: dict[int, str] | None = None) -> None:
        """Every item is acknowledged by the dead-letter topic before the offsets are committed;
        a failing publish is retried with backoff (never dropped, never stops the tracker for
        good: only a requested stop ends the retries, and then nothing is committed)."""
        await asyncio.gather(*(self._dead_letter_one(rec, reason, (claims or {}).get(id(rec)))
                               for rec, reason in items))
        self.dead_lettered += len(items)

    async def _dead_letter_one(self, rec: Any, reason: str, claim: str | None = None) -> None:
        assert self._producer is not None
        limit, delay = _DLQ_MAX_VALUE, 0.1
        reason = reason[:_MAX_REASON]
        while True:
            key, value, headers = dlq_message(rec, reason, limit, claim)
            try:
                fut = await self._producer.send(self.settings.dlq_topic, value=value, key=key,
                                                headers=headers)
                await fut
                break
            except MessageSizeTooLargeError:
                if limit <= 1024:
                    raise
                limit //= 4  # a broker with a smaller limit: cut further
                continue
            except Exception as exc:
                if self._stop.is_set():
                    raise RuntimeError("dead-letter topic unavailable while stopping; the batch "
                                       "is not committed and will be redelivered") from exc
                self.log.warning("dead-letter publish failed; retrying", error=str(exc),
                                 partition=rec.partition, offset=rec.offset)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        self.log.warning("dead-lettered event", reason=reason, partition=rec.partition,
                         offset=rec.offset)
        self.metrics.dlq.labels(_reason_kind(reason)).inc()

    async def _progress(self, consumer: AIOKafkaConsumer, positions: dict[int, int]) -> None:
        topic = self.settings.events_topic
        claims: list[str] = []
        for p, pos in positions.items():
            clock = self._clocks.get(p)
            if clock is None:
                continue
            hw = None
            with contextlib.suppress(Exception):
                hw = consumer.highwater(TopicPartition(topic, p))
                if hw is not None:
                    self.metrics.lag.labels(str(p)).set(max(0, hw - pos))
                    self._lag_labels.add(str(p))
            if hw is not None and pos > hw:
                # Past the end of the log: it was reset or re-created under us. No claim; the
                # tracker resumes from Redis (and fails closed what it cannot replay).
                self.log.error("position beyond the end of the log; resuming from Redis",
                               partition=p, position=pos, highwater=hw)
                self._reverify = True
                continue
            claimed = clock.claim(pos)
            if claimed is not None and p in self._epochs:
                claims += [str(p), str(claimed)]
                if not self._cluster:  # keyed by log identity (one slot needed for the check)
                    claims.append(f"{log_field(topic, p)}|{self._logrec.get(p, '')}")
                self.metrics.progress.labels(str(p)).set(claimed)
        if claims:
            keys = [PROGRESS] if self._cluster else [PROGRESS, LOG]
            refused = await self._retrying(lambda: self._progress_script(keys=keys, args=claims))
            if refused:  # Redis no longer holds what we applied: it went back in time
                self.log.error("progress refused: the log record moved; resuming from Redis",
                               partitions=refused)
                self.regressions += 1
                self._reverify = True


def _short(key: bytes | None) -> str:
    if key is None:
        return "null"
    return repr(key[:200]) + ("..." if len(key) > 200 else "")


def _event_id(value: bytes | None) -> str:
    try:
        body = orjson.loads(value or b"")
    except orjson.JSONDecodeError:
        return ""
    eid = body.get("event_id") if type(body) is dict else None
    return eid[:200] if type(eid) is str else ""


def dlq_message(rec: Any, reason: str, max_value: int = _DLQ_MAX_VALUE,
                claim: str | None = None) -> tuple[bytes | None, bytes, list[tuple[str, bytes]]]:
    """(key, value, headers) of the dead-letter record for ``rec``: its value and key cut to
    fit the topic, with the reason, the id of the claim its holds carry (``dlq resolve``
    removes exactly that one) and, when cut, the original sizes in the headers."""
    value = rec.value if rec.value is not None else b""
    key = rec.key
    headers = [("reason", reason.encode()), ("topic", rec.topic.encode()),
               ("partition", str(rec.partition).encode()),
               ("offset", str(rec.offset).encode())]
    if claim is not None:
        headers.append(("claim", claim.encode()))
    if len(value) > max_value:
        headers += [("truncated", b"value"), ("original_size", str(len(value)).encode())]
        value = value[:max_value]
    if key is not None and len(key) > _DLQ_MAX_KEY:
        headers += [("original_key_size", str(len(key)).encode())]
        key = key[:_DLQ_MAX_KEY]
    return key, value, headers


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


def tune_gc() -> None:
    """Settings of the garbage collector for a tracker process.

    The hot path allocates a handful of container objects per event (records, bodies, compact
    lists) and refcounting frees them all; at Python's default threshold of 700 the cyclic
    collector still ran every ~100 events and cost 3-8 us per event (20-30% of the process).
    Cycles are rare here, so young objects are collected every 50,000 allocations, and what
    exists at start-up (modules, settings) is frozen out of every collection."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


# --- CLI ---------------------------------------------------------------------------------------

def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="tracker", help="name in logs and the Kafka client id")
    parser.add_argument("--until-caught-up", action="store_true",
                        help="exit once everything the broker holds now is applied")


def run_cli(settings: Settings, args: argparse.Namespace) -> int:
    tune_gc()
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
