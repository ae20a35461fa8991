"""The progress proof, one part of the tracker.

Progress (``hd:progress[p]``, Redis-clock ms): "everything the broker held for partition p at
that time has been applied". At the start of a cycle the tracker reads Redis ``TIME`` = R and
samples the partition's fetch timestamp. aiokafka keeps at most one fetch in flight per broker,
so once the fetch timestamp has *changed twice* since that sample, the latest high watermark H
came from a fetch request sent after R was read: every record the broker held at R is below H.
When the consumer position reaches H, progress[p] = R. No local clock is compared with
anything, and a highwater seen in a response that waited in a socket buffer is never used.
Each claim carries the ``hd:log`` value the tracker expects: a Redis that went back in time
refuses it.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas.layout import LOG, PROGRESS
from tracker.logid import log_field
from tracker.shared import TrackerShared

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


class ProgressProof(TrackerShared):
    """Samples of (Redis time, fetch timestamp, high watermark) turned into progress claims."""

    def _sample(self, consumer: AIOKafkaConsumer) -> None:
        topic = self.settings.events_topic
        for p, clock in list(self._clocks.items()):
            tp = TopicPartition(topic, p)
            try:
                clock.sample(consumer.last_poll_timestamp(tp), consumer.highwater(tp))
            except Exception:  # unassigned meanwhile
                continue

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
