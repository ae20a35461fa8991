"""What the parts of one tracker share (tracker/daemon.py is the loop that drives them): its
settings, clients and locks, the log identity it expects Redis to hold for each partition, its
counters, and the one retry of a Redis call. Each part (log verification, the progress proof,
dead letters) is a class of its own file that the ``Tracker`` inherits; its state is declared
and made here, once."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from core.errors import UserError
from core.settings import Settings
from tracker import codec
from tracker.fetching import FetchWait
from tracker.metrics import TrackerMetrics

if TYPE_CHECKING:
    from tracker.progress import PartitionClock

log = structlog.get_logger("tracker")


class TrackerShared:
    """The state of one tracker; the scripts are registered when it runs."""

    _progress_script: Any  # PROGRESS_LUA
    _log_script: Any  # LOG_WRITE_LUA
    _meta_script: Any  # META_LUA
    _applied_script: Any  # APPLIED_MERGE_LUA

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
        self._failure: Exception | None = None  # raised by run(): the tracker stops
        self._failed = asyncio.Event()  # set with it: wakes the main loop wherever it waits
        self._last_time_read = 0.0
        self._redis: Any = None
        self._facts_clients: tuple[Any, Any] | None = None  # (sync Redis, S3): core/facts.py
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

    def _fail(self, exc: Exception) -> None:
        """Record the error that stops the tracker (its ``run()`` raises it). Found outside the
        main loop (the rebalance listener, a revoke's drain): the loop is woken from whatever
        it awaits, since an unverified partition may give it nothing to return."""
        self._failure = exc
        self._failed.set()

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
