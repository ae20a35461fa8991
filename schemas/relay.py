"""The relay a service runs beside its outbox (schemas/README.md, "Continuity").

It does three things, each at least once:

- **publishes** every outbox row not yet acknowledged (``schemas/outbox.py``), keyed by
  repository, with an idempotent producer (``enable_idempotence``: a retry inside one producer
  session is not a second record); a row is marked published only after the broker
  acknowledged it, so a relay that dies in between publishes it again when it restarts (the
  tracker drops the duplicate by its ``(domain, seq)``);
- **answers the tracker's ticks** (control topic, ``schemas/control.py``): *after* receiving a
  tick it reads each stripe's committed counter M and publishes ``watermark(repository, stripe,
  incarnation, M, tick_ms, tick_applied, tick_id, tick_sig)`` on the events topic, keyed by
  repository. Every event committed before the tick's time was committed before that read, so
  its seq is <= M. It first publishes what is pending, so that in the partition the events up
  to M precede their watermark (liveness only: the tracker waits for a prefix >= M whatever
  the order);
- **re-sends** a range on request (``resend``) from the outbox, the same bytes as first
  published, and says ``range_gone`` for the seqs the outbox no longer holds (trimmed, or of an
  incarnation the store left behind when it was restored);
- **keeps a stripe's break** (``broken``): records it in the outbox's database
  (``Outbox.record_break``, the current incarnation only), and from then on every watermark of
  that stripe carries it (``broken``), so the tracker's Redis going back cannot un-break it.

A relay holds no key: it checks a tick's format, never its signature, which the watermark
carries back to the tracker. Ticks and re-sends of repositories the outbox has never held are
left to the relays of other services. It reads the control topic from its end when it starts:
a request made while no relay ran is made again by the tracker (its horizon waits meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas import control
from schemas.events import RangeGone, Watermark, encode
from schemas.outbox import Counters, Outbox, Row
from schemas.publisher import Topics, ensure_topics

log = logging.getLogger(__name__)
T = TypeVar("T")


class RelayTopics(Topics, Protocol):
    @property
    def control_topic(self) -> str: ...


@dataclass
class RelayStats:
    published: int = 0  # outbox rows acknowledged by the broker (a re-publish counts again)
    watermarks: int = 0
    resent: int = 0  # rows published again on request
    gone: int = 0  # range_gone answers
    refused: int = 0  # control messages that did not decode
    breaks: int = 0  # broken messages recorded (a repeat counts again)


def gone_ranges(lo: int, hi: int, held: Iterable[int]) -> list[tuple[int, int]]:
    """The maximal ranges of ``lo..hi`` not in ``held``."""
    out: list[tuple[int, int]] = []
    start = lo
    for s in sorted(set(held)):
        if s > hi:
            break
        if s > start:
            out.append((start, s - 1))
        start = max(start, s + 1)
    if start <= hi:
        out.append((start, hi))
    return out


def watermarks(tick: control.Tick, counters: Counters, emitted_at: float) -> list[Watermark]:
    """The answer to ``tick``: one watermark per stripe from ``counters`` (read after the tick
    was received), each carrying the break recorded for its stripe, if any."""
    broken = counters.broken or (None,) * counters.stripes
    epochs = counters.broken_epochs or (0,) * counters.stripes
    return [Watermark(repository=tick.repository, stripe=k, incarnation=counters.incarnation,
                      seq=m, tick_ms=tick.tick_ms, tick_applied=tick.applied,
                      tick_id=tick.tick_id, tick_sig=tick.sig, broken=broken[k],
                      broken_epoch=epochs[k] if broken[k] is not None and epochs[k] else None,
                      emitted_at=emitted_at)
            for k, m in enumerate(counters.seqs)]


class Relay:
    """Publishes an outbox, answers ticks and re-sends. ``async with Relay(settings, outbox)``
    or :meth:`start` / :meth:`stop`."""

    def __init__(self, settings: RelayTopics, outbox: Outbox, *, batch: int = 1000,
                 poll_seconds: float = 0.2, expire_every_seconds: float = 60.0,
                 resend_max: int = 10_000, linger_ms: int = 5) -> None:
        self.settings = settings
        self.outbox = outbox
        self.batch = batch
        self.poll_seconds = poll_seconds
        self.expire_every_seconds = expire_every_seconds
        self.resend_max = resend_max
        self.stats = RelayStats()
        self._producer = AIOKafkaProducer(
            bootstrap_servers=settings.kafka_bootstrap, acks="all", enable_idempotence=True,
            linger_ms=linger_ms, max_batch_size=1 << 20, request_timeout_ms=30_000)
        self._consumer: AIOKafkaConsumer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self._flush = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight: set[asyncio.Task[Any]] = set()

    # -- lifecycle --

    async def start(self) -> Relay:
        s = self.settings
        await ensure_topics(s, extra=[s.control_topic])
        await self._producer.start()
        consumer = AIOKafkaConsumer(bootstrap_servers=s.kafka_bootstrap, group_id=None,
                                    enable_auto_commit=False, auto_offset_reset="latest")
        await consumer.start()
        self._consumer = consumer
        parts = await self._producer.partitions_for(s.control_topic)  # (waits for metadata)
        tps = [TopicPartition(s.control_topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        for tp in tps:  # resolved now: a tick sent once start() returned is seen
            await consumer.position(tp)
        self._loop = asyncio.get_running_loop()
        self.outbox.add_listener(self._wake_up)
        self._tasks = [asyncio.create_task(self._publishing(), name="relay-publish"),
                       asyncio.create_task(self._controlling(), name="relay-control")]
        return self

    async def stop(self) -> None:
        self.outbox.remove_listener(self._wake_up)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):  # (however it ended: it is over)
                await task
        self._tasks = []
        if self._inflight:  # the outbox may be closed once we return
            await asyncio.gather(*self._inflight, return_exceptions=True)
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        await self._producer.stop()

    async def __aenter__(self) -> Relay:
        return await self.start()

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    # -- the work --

    async def publish_pending(self) -> int:
        """Publish every row not yet acknowledged (batch by batch); returns how many."""
        total = 0
        async with self._flush:
            while True:
                rows = await self._io(self.outbox.unpublished, self.batch)
                if not rows:
                    return total
                await self._send([(r.value, r.repository.encode()) for r in rows])
                await self._mark_published([r.id for r in rows])
                self.stats.published += len(rows)
                total += len(rows)

    async def answer(self, message: control.ControlMessage) -> int:
        """Answer one control message; returns how many records it published (0: the
        repository is not this outbox's)."""
        if isinstance(message, control.Tick):
            return await self._tick(message)
        if isinstance(message, control.Broken):
            return await self._broken(message)
        return await self._resend(message)

    async def _tick(self, tick: control.Tick) -> int:
        counters = await self._io(self.outbox.counters, tick.repository)
        if counters is None:
            return 0  # another service's repository
        await self.publish_pending()
        marks = watermarks(tick, counters, time.time())
        await self._send([(encode(w), w.key) for w in marks])
        self.stats.watermarks += len(marks)
        return len(marks)

    async def _broken(self, msg: control.Broken) -> int:
        recorded = await self._io(self.outbox.record_break, msg.repository, msg.stripe,
                                  msg.incarnation, msg.reason, msg.epoch)
        if recorded:
            self.stats.breaks += 1
        return 0  # (it publishes nothing: the next watermarks carry it)

    async def _resend(self, req: control.Resend) -> int:
        counters = await self._io(self.outbox.counters, req.repository)
        if counters is None:
            return 0
        rows: list[Row] = await self._io(
            self.outbox.rows, req.repository, req.stripe, req.incarnation, req.from_seq,
            req.to_seq, self.resend_max)
        top = req.to_seq
        if req.stripe >= counters.stripes:
            reason = f"the repository has stripes 0..{counters.stripes - 1}"
        elif req.incarnation != counters.incarnation:
            reason = (f"incarnation {req.incarnation!r} is not the outbox's "
                      f"({counters.incarnation!r}): the store was restored")
        else:
            reason = "trimmed from the outbox"
            top = min(top, counters.seqs[req.stripe])  # (not allocated yet: nothing to say)
        if len(rows) == self.resend_max:
            top = min(top, rows[-1].seq)  # the rest when asked again
        gone = [RangeGone(repository=req.repository, stripe=req.stripe,
                          incarnation=req.incarnation, from_seq=a, to_seq=b, reason=reason,
                          emitted_at=time.time())
                for a, b in gone_ranges(req.from_seq, top, (r.seq for r in rows))]
        await self._send([(r.value, r.repository.encode()) for r in rows]
                         + [(encode(g), g.key) for g in gone])
        self.stats.resent += len(rows)
        self.stats.gone += len(gone)
        if gone:
            log.warning("relay: range gone: %s stripe %d incarnation %s %s (%s)",
                        req.repository, req.stripe, req.incarnation,
                        [(g.from_seq, g.to_seq) for g in gone], reason)
        return len(rows) + len(gone)

    # -- internals --

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (outbox work) on a thread. A cancelled caller does not stop the
        thread: stop() waits for it, since closing a connection under a running query crashes
        SQLite."""
        task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return await asyncio.shield(task)

    async def _send(self, records: Sequence[tuple[bytes, bytes]]) -> None:
        topic = self.settings.events_topic
        futures = [await self._producer.send(topic, value, key=key) for value, key in records]
        if futures:
            await asyncio.gather(*futures)

    async def _mark_published(self, ids: Sequence[int]) -> None:
        await self._io(self.outbox.mark_published, ids)

    def _wake_up(self) -> None:
        # (called on the service's committing thread)
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._wake.set)

    async def _publishing(self) -> None:
        backoff = 0.1
        next_expiry = time.monotonic()
        while True:
            try:
                await self.publish_pending()
                if time.monotonic() >= next_expiry:
                    await self._io(self.outbox.expire)
                    next_expiry = time.monotonic() + self.expire_every_seconds
                backoff = 0.1
            except Exception as exc:  # the broker or the store away: the rows wait
                log.warning("relay: publishing failed, retrying in %.1fs: %s", backoff, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_seconds)

    async def _controlling(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        while True:
            batches = await consumer.getmany(timeout_ms=1000)
            for records in batches.values():
                for rec in records:
                    try:
                        message = control.decode(rec.value or b"")
                    except control.ControlError as exc:
                        self.stats.refused += 1
                        log.warning("relay: control message refused: %s", exc)
                        continue
                    while True:
                        try:
                            await self.answer(message)
                            break
                        except Exception as exc:  # answered again: the tracker waits
                            log.warning("relay: answering %s failed, retrying: %s",
                                        message.TYPE, exc)
                            await asyncio.sleep(0.5)
