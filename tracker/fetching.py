"""How long the broker may hold one of the tracker's fetches (pure, but for two reads of
aiokafka's private fetcher state)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer


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


def set_fetch_max_wait(consumer: AIOKafkaConsumer, ms: int) -> int | None:
    """Set the wait of the consumer's next fetch requests; returns the previous one. aiokafka
    reads it from its fetcher for every request and has no public setter: if a release moves
    it, None comes back and the configured wait simply stays."""
    fetcher = getattr(consumer, "_fetcher", None)
    was = getattr(fetcher, "_fetch_max_wait_ms", None)
    if was is not None and was != ms:
        fetcher._fetch_max_wait_ms = ms  # type: ignore[union-attr]
    return was


def buffered(consumer: AIOKafkaConsumer, tp: Any) -> bool:
    """Whether aiokafka holds fetched records of ``tp`` not yet returned (private state; if a
    release moves it, False: a partition behind then counts as starved)."""
    records: Any = getattr(getattr(consumer, "_fetcher", None), "_records", None)
    return bool(records) and tp in records
