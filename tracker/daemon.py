"""``hardelete tracker run``: consume the events topic into Redis reference state.

One cycle: read the Redis clock, ``getmany`` a batch, decode and admit every record (bad ones go
to the dead-letter topic, produced and acknowledged first), apply the batch with one
``apply.lua`` call per (repository, partition) in one pipeline, record what was applied from each
partition's log (``hd:log``), commit the offsets, then record per-partition progress. A crash
anywhere only causes redelivery, which is harmless: the script skips offsets it already applied
and the reference sets are idempotent.

The tracker's parts, each in its own file, all inheriting the state of ``tracker/shared.py``:
log verification (``verification.py``: is the log the one Redis folded, seek from Redis, fail
closed), the progress proof (``progress.py``), dead letters and their holds
(``deadletters.py``), the fetch wait (``fetching.py``) and the metrics (``metrics.py``). This
file is the loop and its lifecycle.

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
import signal
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError, NoOffsetForPartitionError, OffsetOutOfRangeError
from aiokafka.structs import OffsetAndMetadata
from prometheus_client import start_http_server
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from core.clients import redis_async, redis_sync
from core.clock import aredis_time_ms, atracker_horizon_ms
from core.registry import afail_closed_conflict, aregister_namespace, arepo_lifecycles
from core.settings import Settings
from schemas import reaper_auth
from schemas.events import RELAY_EVENT_TYPES, EventError
from schemas.holds import DLQ, dlq_claim
from schemas.layout import APPLIED, INCIDENTS, NAMESPACES, REFUSED, REPOS, RETIRED, RepoKeys
from schemas.namespaces import Conflict, conflict_of
from schemas.publisher import ensure_topics
from tracker import codec
from tracker.deadletters import (
    MAX_REASON,
    DeadLetterClaim,
    DeadLetters,
    event_id_of,
    short_key,
)
from tracker.fetching import buffered, set_fetch_max_wait
from tracker.logid import fingerprint, is_anchor, log_field
from tracker.progress import PartitionClock, ProgressProof
from tracker.references import admission_problem
from tracker.state import (
    APPLIED_MERGE_LUA,
    LOG_WRITE_LUA,
    META_LUA,
    PROGRESS_LUA,
    ApplyScript,
    LogGuard,
)
from tracker.ticks import Ticker
from tracker.verification import LogVerification


@dataclass
class _Batch:
    calls: list[tuple[str, int, bytes]] = field(default_factory=list)
    maxoff: dict[tuple[str, int], int] = field(default_factory=dict)  # (repo, p) -> offset
    dlq: list[tuple[Any, str]] = field(default_factory=list)
    # id(dead record) -> its hold claim and what it holds
    claims: dict[int, DeadLetterClaim] = field(default_factory=dict)
    new_repos: set[str] = field(default_factory=set)
    refused: list[dict[str, Any]] = field(default_factory=list)  # refused repository_created
    conflicts: list[Conflict] = field(default_factory=list)  # their registry conflicts
    refused_ids: dict[str, str] = field(default_factory=dict)  # hd:refused, as far as known
    retired: dict[str, tuple[str, str]] = field(default_factory=dict)  # repo -> (ns, event id)
    offsets: dict[Any, OffsetAndMetadata] = field(default_factory=dict)
    positions: dict[int, int] = field(default_factory=dict)
    last: dict[int, tuple[int, str]] = field(default_factory=dict)  # p -> (offset, fingerprint)
    # repo, address (or the namespace, then a prefix hold), prefix?, claim id, claim
    holds: list[tuple[str, str, bool, str, dict[str, Any]]] = field(default_factory=list)
    records: int = 0
    t0: float = 0.0


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
            t._fail(exc)
            t.log.error("partition verification failed", error=str(exc))
        finally:
            t._assigning.set()
        t.assigned_event.set()
        t.log.info("partitions assigned", partitions=sorted(tp.partition for tp in assigned))


class Tracker(LogVerification, ProgressProof, DeadLetters):
    """One tracker process' worth of work, as an asyncio task: the loop and its lifecycle (the
    parts it drives are in their own files: verification, progress, deadletters)."""

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
        await ensure_topics(s, extra=[s.control_topic])
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
        debts_task: asyncio.Task[None] | None = None
        tick_task: asyncio.Task[None] | None = None
        try:
            await producer.start()
            await probe.start()
            await self._write_meta()
            consumer.subscribe([s.events_topic], listener=_Listener(self))
            await consumer.start()
            meta_task = asyncio.create_task(self._meta_loop())
            if s.rebuild_interval_seconds > 0:
                self._heal_task = asyncio.create_task(self._heal_loop())
            debts_task = asyncio.create_task(self._debts_loop())
            tick_task = asyncio.create_task(
                Ticker(s, self._redis, producer, self._reap_key, self.metrics, self.log)
                .run(self._stop))
            if s.metrics_port:
                server = start_http_server(s.metrics_port, registry=self.metrics.registry)
            self.log.info("tracker started", metrics_port=s.metrics_port or None)
            while not self._stop.is_set():
                if self._rejoin:
                    consumer = await self._rejoin_group(consumer)
                await self._cycle(consumer)
                self.metrics.cycle.set_to_current_time()
            await self._drain()
        finally:
            # Its loops end now, also after an error: one whose cancellation is lost (seen: the
            # meta loop cancelled inside a Redis connect went on; asyncio.wait_for before Python
            # 3.12 can swallow a cancellation) ends at its next check, not ~10 s later.
            self._stop.set()
            for task in (meta_task, self._heal_task, debts_task, tick_task):
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
            if self._facts_clients is not None:
                with contextlib.suppress(Exception):
                    self._facts_clients[0].close()
                self._facts_clients = None
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

    async def _debts_loop(self, every_s: float = 5.0) -> None:
        """Dead-letter holds the fact log refused (S3 down) are owed: written once it takes
        them (core/facts.py ``pay_debts``), so they do not stay in Redis only."""
        from core.clients import s3_client
        from core.facts import pay_debts

        r, s3 = redis_sync(self.settings), s3_client(self.settings)
        try:
            while not self._stop.is_set():
                try:
                    paid = await asyncio.to_thread(pay_debts, r, s3, by=f"tracker {self.name}",
                                                   now_ms=int(time.time() * 1000))
                    for repo, why in paid.items():
                        if why is None:
                            self.log.warning("owed dead-letter holds written to the fact log",
                                             repository=repo)
                except Exception as exc:  # Redis trouble: tried again next round
                    self.log.warning("owed facts round failed",
                                     error=f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), every_s)
        finally:
            r.close()

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

    # --- one cycle ----------------------------------------------------------------------------

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
        # A verification that fails in the rebalance listener leaves its partitions unsought:
        # each wait of the cycle also ends on that failure, which is raised (_raise_failure).
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await self._fetch_and_prepare(consumer, failed)
        finally:
            failed.cancel()

    async def _fetch_and_prepare(self, consumer: AIOKafkaConsumer,
                                 failed: asyncio.Future[Any]) -> None:
        s = self.settings
        stop_wait = asyncio.ensure_future(self._stop.wait())
        fetch = asyncio.ensure_future(
            consumer.getmany(timeout_ms=s.tracker_poll_ms, max_records=s.tracker_batch_max))
        await asyncio.wait({fetch, stop_wait, failed}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if not fetch.done() and not failed.done():  # stopping: getmany returns in its timeout
            await asyncio.wait({fetch, failed}, return_when=asyncio.FIRST_COMPLETED)
        await self._raise_failure(fetch)  # (what it fetched may come from unverified positions)
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
            if self._failure is not None:  # (a failed assignment since the fetch)
                raise self._failure
            assigned = consumer.assignment()
            data = {tp: recs for tp, recs in data.items() if tp in assigned and recs}
            t0 = time.perf_counter()
            batch = await self._prepare(data)
            batch.t0 = t0
            # Every record before these positions is in this batch or an earlier one.
            positions = asyncio.ensure_future(self._positions(consumer, assigned))
            await asyncio.wait({positions, failed}, return_when=asyncio.FIRST_COMPLETED)
            await self._raise_failure(positions)
            lags: dict[int, tuple[int, int | None, bool]] = {}
            # A rebalance may revoke a partition while its position is awaited (the listener
            # then waits for this batch): its lag is not sampled (aiokafka's highwater()
            # asserts an assigned partition; the tracker died of it in a two-tracker test).
            held = consumer.assignment()
            for tp, pos in positions.result().items():
                batch.positions[tp.partition] = pos
                if tp in held:
                    lags[tp.partition] = (pos, consumer.highwater(tp), buffered(consumer, tp))
            self._set_fetch_wait(consumer,
                                 self._fetch_wait.after_fetch(lags, time.monotonic()))
            await self._drain()
            if self._reverify:  # drop the prepared batch: it follows a gap Redis now has
                self._reverify = False
                await self._verify(set(consumer.assignment()))
                return
            if self._failure is not None:  # found while preparing: the batch is dropped
                raise self._failure
            self._pending = asyncio.ensure_future(self._apply(consumer, batch))

    @staticmethod
    async def _positions(consumer: AIOKafkaConsumer, assigned: Any) -> dict[Any, int]:
        """The consumer's position of each assigned partition that has one. aiokafka's
        ``position()`` waits until the partition has one, without end (it retries every
        ``request_timeout_ms``): after a seek from Redis that is at once."""
        found = {}
        for tp in assigned:
            with contextlib.suppress(Exception):
                found[tp] = await consumer.position(tp)
        return found

    async def _raise_failure(self, waited: asyncio.Future[Any]) -> None:
        """After a wait of the cycle that the failure also ends: if the tracker failed, the
        wait is cancelled (or what it got dropped) and the failure raised. A partition the
        listener did not seek has no position: with no offset of the group (and
        auto_offset_reset "none") aiokafka's ``position()`` waits for one for ever (it retries
        every request_timeout_ms, AIOKafkaConsumer.position); with one, its fetcher resumes
        from that (Fetcher._update_fetch_positions) and getmany returns records nobody
        verified (the apply script's log guard then refused them as "Redis lost applied
        records"). Nothing fetched after the failure is prepared or applied."""
        if self._failure is None:
            return
        if not waited.done():
            waited.cancel()
            await asyncio.wait({waited})
        if not waited.cancelled():
            waited.exception()  # (retrieved: an error of the dropped wait is not the story)
        raise self._failure

    def _set_fetch_wait(self, consumer: AIOKafkaConsumer, ms: int) -> None:
        was = set_fetch_max_wait(consumer, ms)
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
                self._fail(exc)  # surfaces in the main loop even if a revoke drained it
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
                    dlq.append((rec, f"record key {short_key(rec.key)} does not equal repository "
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
        compact, compact_sequenced = codec.compact, codec.compact_sequenced
        check = gate.check
        # A repository_created refused once is refused on every later delivery, whatever
        # changed since (schemas.layout.REFUSED); the gate must not learn its repository.
        if creates:
            found = await self._retrying(lambda: self._redis.hmget(REFUSED, creates))
            batch.refused_ids = {e: why for e, why in zip(creates, found, strict=True) if why}
        for p, rec, body, t in parsed:
            if t in RELAY_EVENT_TYPES:
                # The relay's answers carry no address: they certify, or break, the
                # repository's history (schemas/README.md, "Continuity"). A repository the
                # tracker does not track has nothing to certify; a watermark whose tick the
                # tracker did not sign certifies nothing (an incident).
                if body["repository"] not in gate.namespaces:
                    continue
                if t == "watermark" and not await self._tick_signed(batch, body):
                    continue
                chunks[(body["repository"], p)].append(compact(body, rec.offset))
                continue
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
            chunks[(body["repository"], p)].append(compact_sequenced(body, rec.offset))
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
            rec_claims[id(rec)] = DeadLetterClaim(claim_id, tuple(targets))
            claim = {"reason": reason[:MAX_REASON], "source": DLQ, "at_ms": self._redis_now,
                     "event_id": event_id_of(rec.value), "topic": rec.topic,
                     "partition": rec.partition, "offset": rec.offset}
            for repo, address in targets:
                prefix = address.endswith("/")  # it could name anything there
                batch.holds.append((repo, address, prefix, claim_id, claim))
            if targets and "address" in reason:
                # A spelling the tracker will not apply (schemas/address.py): kept, and said.
                batch.refused.append({"kind": "address_spelling", "repository": targets[0][0],
                                      "reason": reason[:MAX_REASON],
                                      "held": [a for _, a in targets][:10],
                                      "event_id": event_id_of(rec.value)})
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

    async def _tick_signed(self, batch: _Batch, body: dict[str, Any]) -> bool:
        """A watermark certifies a time only if it answers a tick this tracker's key signed."""
        args = (body["repository"], body["tick_ms"], body["tick_id"], body["tick_sig"],
                body["tick_applied"])
        if reaper_auth.tick_problem(self._reap_key, *args) is None:
            return True
        self._reap_key = await self._retrying(  # minted or rotated since we read it?
            lambda: reaper_auth.aload_key(self._redis, self.settings.reaper_secret))
        problem = reaper_auth.tick_problem(self._reap_key, *args)
        if problem is None:
            return True
        batch.refused.append({"kind": "forged_watermark", "repository": body["repository"],
                              "stripe": body["stripe"], "seq": body["seq"],
                              "tick_ms": body["tick_ms"], "reason": problem,
                              "event_id": body["event_id"]})
        self.log.error("incident: a watermark answers no tick of this tracker",
                       repository=body["repository"], reason=problem)
        return False

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
            old_ns, retired = (await self._retrying(
                lambda: arepo_lifecycles(self._redis, [repo])))[repo]
            if retired:
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
        # Its service may write its data into the other's namespace (or the other's data lies
        # in its own): every repository of the overlap is fail-closed (schemas/README.md).
        registry = await self._retrying(lambda: self._redis.hgetall(NAMESPACES))
        conflict = conflict_of(repo, ns, registry)
        extra: dict[str, Any] = {}
        if conflict is not None:
            batch.conflicts.append(conflict)
            extra = {"repositories": conflict.repositories,
                     "namespaces": dict(conflict.members), "fail_closed": conflict.reason()}
        batch.refused.append({"kind": "repository_refused", "repository": repo,
                              "namespace": ns, "reason": problem, "event_id": eid, **extra})
        self.log.error("incident: repository refused", repository=repo, namespace=ns,
                       reason=problem, event_id=eid,
                       fail_closed=conflict.repositories if conflict else [])
        return problem

    async def _backfill_registry(self) -> None:
        """Register live repositories that predate the registry (an upgrade): every delete
        path requires its repository to own its namespace there. An overlap with another
        repository fails closed every repository of it, with one incident naming them all
        (the one registered first would otherwise sweep the other's data as its garbage);
        another refusal is an incident (the repository then deletes nothing, as it owns
        nothing in the registry)."""
        repos = sorted(await self._redis.smembers(REPOS))
        if not repos:
            return
        registry = await self._redis.hgetall(NAMESPACES)
        for repo, (ns, retired) in (await arepo_lifecycles(self._redis, repos)).items():
            if not ns or retired or registry.get(ns) == repo:
                continue
            problem = await aregister_namespace(self._redis, repo, ns)
            if problem is not None:
                now = await aredis_time_ms(self._redis)
                conflict = conflict_of(repo, ns, await self._redis.hgetall(NAMESPACES))
                if conflict is not None:
                    await afail_closed_conflict(self._redis, conflict, now_ms=now,
                                                incident={"refused": repo})
                    self.log.error("incident: registry conflict: repositories fail-closed",
                                   repositories=conflict.repositories, reason=problem)
                    continue
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
        for conflict in batch.conflicts:  # first: the flags stand before the incident says so
            now = await aredis_time_ms(self._redis)
            await self._retrying(lambda c=conflict, now=now: afail_closed_conflict(
                self._redis, c, now_ms=now))
            self.fail_closed += len(conflict.repositories)
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
                               error=str(exc)[:MAX_REASON])
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

    async def _load_namespaces(self, repos: set[str]) -> None:
        for repo, (ns, retired) in (await arepo_lifecycles(self._redis, sorted(repos))).items():
            if ns and retired:
                self.gate.retired[repo] = ns
            elif ns:
                self.gate.namespaces[repo] = ns


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
