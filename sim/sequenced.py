"""A service side that certifies its own history, for tests and the demo (schemas/README.md,
"Continuity"): a SQLite outbox (``schemas/outbox.py``) and its relay (``schemas/relay.py``).

``sim.testing.publish`` sends a test's service events through the active one for the test's
events topic (:func:`active`): each call is one transaction of the service's store, every
event gets the next seq of its repository's stripe, and the call returns once the relay's
broker acknowledged them, as a raw publish does. Events that already carry a seq, and events
that are not the service's (the reaper's ``addresses_reaped``), are published as they are.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from core.clients import redis_async, split_s3_uri
from core.clock import aredis_time_ms
from core.continuity_store import AsyncContinuityStore
from core.settings import Settings
from schemas import events as ev
from schemas.outbox import Outbox
from schemas.publisher import Publisher
from schemas.relay import Relay

_ACTIVE: dict[str, SequencedService] = {}


def put_object(s3: Any, address: str, body: bytes = b"x") -> str:
    """Store an object at ``address`` (``s3://bucket/key``); returns the address."""
    bucket, key = split_s3_uri(address)
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    return address


def object_exists(s3: Any, address: str) -> bool:
    bucket, key = split_s3_uri(address)
    try:
        s3.head_object(Bucket=bucket, Key=key)
        return True
    except s3.exceptions.ClientError:
        return False


class LossyRelay(Relay):
    """A relay whose publishes of some events are lost (the service crashed after its commit,
    or the broker lost them), first sends and re-sends alike: the events whose id is in
    ``drop``, or every watermark while ``"watermark"`` is."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drop: set[str] = set()

    async def _send(self, records: Sequence[tuple[bytes, bytes]]) -> None:
        kept = [(v, k) for v, k in records if not any(e.encode() in v for e in self.drop)]
        await super()._send(kept)


def active(settings: Settings) -> SequencedService | None:
    """The sequenced service publishing on ``settings``' events topic, if one runs."""
    return _ACTIVE.get(settings.events_topic)


def stripe_of(event: ev.ServiceEvent, stripes: int) -> int:
    """A branch's events share a stripe; lifecycle events (no branch) go to stripe 0."""
    branch = getattr(event, "branch", None)
    if stripes == 1 or not branch:
        return 0
    return zlib.crc32(branch.encode()) % stripes


class SequencedService:
    """An outbox (in ``directory``, a temporary one by default) and its relay, registered for
    the settings' events topic: ``async with SequencedService(settings) as svc`` runs the
    relay in the caller's event loop; ``with SequencedService(settings) as svc`` on a thread
    of its own (for callers whose loop does not run between their calls: sync tests that
    ``asyncio.run`` each step)."""

    def __init__(self, settings: Settings, directory: str | Path | None = None) -> None:
        self.settings = settings
        self._tmp = None if directory is not None else tempfile.TemporaryDirectory(
            prefix="hardelete-service-")
        where = Path(directory if directory is not None else self._tmp.name)  # type: ignore[union-attr]
        where.mkdir(parents=True, exist_ok=True)
        self.outbox = Outbox(where / "service.db", synchronous="OFF")
        self.repositories: set[str] = set()
        self._stripes: dict[str, int] = {}  # declared by the repository_created emitted here
        self._relay: Relay | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the relay's
        self._thread: threading.Thread | None = None

    @property
    def relay(self) -> Relay:
        if self._relay is None:
            raise RuntimeError("the service's relay is not running")
        return self._relay

    async def _start(self) -> None:
        # (aiokafka binds its clients to the loop they are made in: made here, in the relay's)
        relay = Relay(self.settings, self.outbox, poll_seconds=0.05)
        await relay.start()
        self._relay, self._loop = relay, asyncio.get_running_loop()

    def _register(self) -> None:
        if self.settings.events_topic in _ACTIVE:
            raise RuntimeError(f"a sequenced service already runs on {self.settings.events_topic}")
        _ACTIVE[self.settings.events_topic] = self

    def _close(self) -> None:
        self.outbox.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    async def __aenter__(self) -> SequencedService:
        self._register()
        try:
            await self._start()
        except BaseException:
            _ACTIVE.pop(self.settings.events_topic, None)
            raise
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        _ACTIVE.pop(self.settings.events_topic, None)
        try:
            await self.relay.stop()
        finally:
            self._close()

    def __enter__(self) -> SequencedService:
        self._register()
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="relay", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), loop).result(60)
        except BaseException:
            self._end_thread(loop)
            _ACTIVE.pop(self.settings.events_topic, None)
            raise
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        _ACTIVE.pop(self.settings.events_topic, None)
        loop = self._loop
        try:
            if loop is not None:
                asyncio.run_coroutine_threadsafe(self.relay.stop(), loop).result(60)
        finally:
            if loop is not None:
                self._end_thread(loop)
            self._close()

    def _end_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(30)
        loop.close()

    async def _publish_pending(self) -> None:
        loop = self._loop
        if loop is None or loop is asyncio.get_running_loop():
            await self.relay.publish_pending()
        else:  # the relay runs on its own thread
            await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(self.relay.publish_pending(), loop))

    def emit(self, events: Sequence[ev.ServiceEvent]) -> list[ev.ServiceEvent]:
        """Commit ``events`` in one transaction of the service's store (seqs allocated)."""
        for e in events:
            if isinstance(e, ev.RepositoryCreated):
                self._stripes.setdefault(e.repository, e.stripes)
        with self.outbox.transaction() as tx:
            stamped = [tx.emit(e, stripe=stripe_of(e, self._stripes.get(e.repository, 1)))
                       for e in events]
        self.repositories.update(e.repository for e in stamped)
        return stamped

    async def publish(self, events: Iterable[ev.Event]) -> list[ev.Event]:
        """Emit the service's events, publish the rest as they are; returns once every one is
        acknowledged by the broker."""
        mine: list[ev.ServiceEvent] = []
        raw: list[ev.Event] = []
        for e in events:
            if isinstance(e, ev.ServiceEvent) and e.seq is None and e.incarnation is None:
                mine.append(e)
            else:
                raw.append(e)
        stamped: list[ev.Event] = list(self.emit(mine)) if mine else []
        await self._publish_pending()
        if raw:
            async with Publisher(self.settings) as pub:
                await pub.publish_many(raw)
        return stamped + raw

    async def wait_certified(self, target_ms: int, timeout: float = 60.0) -> None:
        """Wait until every repository this service numbered has a continuity horizon at or
        past ``target_ms`` (the tracker applied all of it up to then)."""
        r = redis_async(self.settings)
        store = AsyncContinuityStore(r)
        deadline = time.monotonic() + timeout
        try:
            for repo in sorted(self.repositories):
                counters = self.outbox.counters(repo)
                stripes = counters.stripes if counters is not None else 1
                while True:
                    h = await store.horizon(repo, stripes)
                    if h is not None and h >= target_ms:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"repository {repo}: continuity horizon {h} did not reach "
                            f"{target_ms} in {timeout}s (Redis now {await aredis_time_ms(r)})")
                    await asyncio.sleep(0.02)
        finally:
            await r.aclose()


# ------------------------------------------------- a one-repository service for tests

REPO = "svc"


@dataclass
class Service:
    """A one-repository service (repository ``REPO``, branch main, token "t") with an outbox
    and a relay that can lose chosen publishes: the attack and end-to-end tests' service."""

    settings: Settings
    s3: Any
    outbox: Outbox
    relay: LossyRelay
    namespace: str
    bucket: str
    events: list[ev.ServiceEvent] = field(default_factory=list)

    def emit(self, *events: ev.ServiceEvent) -> list[ev.ServiceEvent]:
        with self.outbox.transaction() as tx:
            stamped = [tx.emit(e) for e in events]
        self.events += stamped
        return stamped

    def store(self, path: str) -> str:
        return put_object(self.s3, self.namespace + path)

    def exists(self, address: str) -> bool:
        return object_exists(self.s3, address)


@asynccontextmanager
async def service(settings: Settings, s3: Any, tmp_path: Path) -> AsyncIterator[Service]:
    """The service, its repository created, in a bucket of its own, its outbox in ``tmp_path``."""
    bucket = f"atk4-{int(time.time() * 1000) % 10**9}"
    with suppress(s3.exceptions.BucketAlreadyOwnedByYou):
        s3.create_bucket(Bucket=bucket)
    outbox = Outbox(tmp_path / "service.db")
    relay = LossyRelay(settings, outbox)
    async with relay:
        svc = Service(settings, s3, outbox, relay, f"s3://{bucket}/{REPO}/", bucket)
        svc.emit(ev.RepositoryCreated(repository=REPO, storage_namespace=svc.namespace,
                                      default_branch="main", default_retention_days=1.0),
                 ev.BranchCreated(repository=REPO, branch="main", staging_token="t",
                                  ref_version=1))
        try:
            yield svc
        finally:
            outbox.close()


def write(path: str, address: str, ref: str) -> ev.ServiceEvent:
    return ev.ObjectWritten(repository=REPO, branch="main", staging_token="t", path=path,
                            address=address, size=1, ref_id=ref)


def copy(path: str, address: str, ref: str) -> ev.ServiceEvent:
    return ev.ObjectCopied(repository=REPO, branch="main", staging_token="t", path=path,
                           address=address, size=1, ref_id=ref, source_read_at=0.0)


def delete(path: str, address: str, ref: str) -> ev.ServiceEvent:
    return ev.ObjectDeleted(repository=REPO, branch="main", staging_token="t", path=path,
                            address=address, ref_id=ref)


# --- waiting and reaping, for the tests of this service ----------------------------------------

async def until(read: Callable[[], Any], ok: Callable[[Any], bool],
                timeout: float = 30.0) -> Any:
    """``read()`` again until ``ok`` of it holds (returns it); fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        v = read()
        if ok(v):
            return v
        assert time.monotonic() < deadline, v
        await asyncio.sleep(0.05)


async def certified(settings: Settings, after_ms: int, timeout: float = 30.0) -> int:
    """Wait until ``REPO``'s continuity horizon passes ``after_ms``; returns it."""
    from core.clients import redis_sync
    from core.continuity_store import ContinuityStore

    r = redis_sync(settings)
    store = ContinuityStore(r)
    try:
        h = await until(lambda: store.horizon(REPO, 1), lambda h: h is not None and h > after_ms,
                        timeout)
        return int(h)
    finally:
        r.close()


async def wait_log(settings: Settings) -> None:
    """The tracker's horizon over the log passes the server's now (the continuity horizon is
    not waited for: :func:`certified`)."""
    from core.clients import redis_async
    from core.clock import await_horizon
    from sim.testing import redis_now

    r = redis_async(settings)
    try:
        await await_horizon(r, await redis_now(settings), 60.0)
    finally:
        await r.aclose()


async def reap(settings: Settings, s3: Any) -> Any:
    """One pass of a reaper; its report."""
    from reaper.daemon import Reaper

    reaper = Reaper(settings, s3=s3)
    try:
        return await reaper.run_once()
    finally:
        await reaper.close()


# --- a relay whose publishes wait, and ticks at the moment a test chooses --------------------

class HoldingRelay(LossyRelay):
    """A relay whose watermark publishes are held back while ``hold`` is set, and those of the
    events whose id is in ``hold_ids`` (then sent by :meth:`release`): the same records,
    reaching the tracker late, as when the tracker lags behind the events topic (a failover of
    its Redis node stalls it meanwhile) or a publish is slow."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hold = False
        self.hold_ids: set[str] = set()
        self.held: list[tuple[bytes, bytes]] = []

    def _held(self, value: bytes) -> bool:
        return (self.hold and b'"type":"watermark"' in value) or any(
            e.encode() in value for e in self.hold_ids)

    async def _send(self, records: Sequence[tuple[bytes, bytes]]) -> None:
        if self.hold or self.hold_ids:
            marks = [(v, k) for v, k in records if self._held(v)]
            self.held += marks
            records = [rec for rec in records if rec not in marks]
        await super()._send(records)

    async def release(self, records: Sequence[tuple[bytes, bytes]]) -> None:
        async with Publisher(self.settings) as pub:
            for value, key in records:
                await pub._producer.send_and_wait(self.settings.events_topic, value, key=key)


@asynccontextmanager
async def holding_service(settings: Settings, s3: Any, tmp_path: Path
                          ) -> AsyncIterator[tuple[Service, HoldingRelay]]:
    """:func:`service` with a :class:`HoldingRelay`."""
    bucket = f"atk5-{int(time.time() * 1000) % 10**9}"
    with suppress(s3.exceptions.BucketAlreadyOwnedByYou):
        s3.create_bucket(Bucket=bucket)
    outbox = Outbox(tmp_path / "service.db")
    relay = HoldingRelay(settings, outbox)
    await relay.start()
    try:
        svc = Service(settings, s3, outbox, relay, f"s3://{bucket}/{REPO}/", bucket)
        svc.emit(ev.RepositoryCreated(repository=REPO, storage_namespace=svc.namespace,
                                      default_branch="main", default_retention_days=1.0),
                 ev.BranchCreated(repository=REPO, branch="main", staging_token="t",
                                  ref_version=1))
        yield svc, relay
    finally:
        await relay.stop()  # (idempotent: the test may have stopped it)
        outbox.close()


@asynccontextmanager
async def manual_ticker(settings: Settings) -> AsyncIterator[Any]:
    """The tracker's Ticker (its key, its producer), run one round at a time by the test, so
    that a tick is read at a known moment (the tracker's own ticks once, when it starts)."""
    from aiokafka import AIOKafkaProducer

    from core.logs import get_logger
    from schemas import reaper_auth
    from tracker.metrics import TrackerMetrics
    from tracker.ticks import Ticker

    r = redis_async(settings)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        key = await reaper_auth.aload_key(r, settings.reaper_secret)
        yield Ticker(settings, r, producer, key, TrackerMetrics(), get_logger("manual-ticker"))
    finally:
        await producer.stop()
        await r.aclose()
