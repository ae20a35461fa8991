"""Log verification, one part of the tracker (tracker/logid.py holds its pure decisions).

On assignment each partition is sought to what *Redis* says it applied (+1), after checking
that the log is still the one Redis folded (its epoch and the fingerprint of the last applied
record, or the anchor the tracker wrote into a log known by no record); a log that changed or
lost what Redis lacks puts every known repository fail-closed *before* ``hd:log`` takes the new
epoch. While running, the partition count is verified every quarter second (the horizon never
passes it) and every 5 s the record last applied must still be in the log. Every write of
``hd:log`` is a compare-and-set against what this tracker expects Redis to hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from typing import Any

import orjson
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError, OffsetOutOfRangeError

from core.clock import aredis_time_ms
from schemas.layout import (
    APPLIED,
    FAIL_CLOSED,
    INCIDENTS,
    LOG,
    PROGRESS,
    PROGRESS_META,
    REPOS,
    RepoKeys,
)
from tracker.fetching import set_fetch_max_wait
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
    log_field,
    new_epoch,
)
from tracker.progress import PartitionClock
from tracker.shared import TrackerShared

_ANCHOR_TIMEOUT_S = 5.0  # a broker that does not take the anchor by then: tried again later
_ANCHOR_RETRY_S = 30.0  # (not every log check: a broker that refuses it would stall the tracker)
_META_INTERVAL_S = 0.25  # how often the partition count is re-verified (horizon lags by this)
_LOG_CHECK_ROUNDS = 20  # every 5 s: is the record last applied still in the log?


class LogVerification(TrackerShared):
    """Is the log the one Redis folded? Seek from Redis, anchor, fail closed, record hd:log."""

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
            # Held: this tracker wrote what Redis holds and has kept the partition since (a
            # revocation forgets it): its re-check of a log it could not anchor.
            held = bool(value) and self._logrec.get(tp.partition) == value
            d = decide(rec, start, end, found, new_epoch(cluster),
                       group_committed=committed is not None, cluster=cluster, held=held)
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
        set_fetch_max_wait(probe, self._fetch_wait.poll_ms)
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
