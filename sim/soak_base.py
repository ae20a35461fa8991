"""The state of one soak run and what each of its parts uses: publishing (with the events a
fault withholds), the reconciler runs on the shared Spark session, and the listings that check
no live object is gone. The parts: fault injection (``soak_faults.py``), the drain
(``soak_drain.py``) and the verdict (``soak_judge.py``); ``sim/soak.py`` is the load that
drives them."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter, defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console

from core.clients import redis_async
from core.logs import get_logger
from schemas.events import Event, encode
from schemas.layout import RepoKeys
from sim.soak_plan import FaultKind, ReconcileKind, Step
from sim.soak_procs import SoakServers, Supervisor
from sim.soak_verdict import FailClosedPeriod, ReconcileRun, may_be_gone

if TYPE_CHECKING:
    from sim.soak import PipelinedService, SoakOptions

log = get_logger("sim.soak")

@dataclass
class _Held:
    """Events withheld from the stream, published later (delays, reorders)."""

    ids: set[str] = field(default_factory=set)


class SoakBase:
    """One soak run's state (``Soak`` in sim/soak.py is the whole run)."""

    def __init__(self, o: SoakOptions, servers: SoakServers, supervisor: Supervisor,
                 run_id: str, console: Console, started: float,
                 service: PipelinedService) -> None:
        self.o = o
        self.servers = servers
        self.sup = supervisor
        self.run_id = run_id
        self.console = console
        self.started = started
        self.settings = servers.settings
        self.rng = random.Random(f"hardelete-soak-run:{o.seed}")
        self.steps: list[Step] = []  # the plan: Soak sets it (sim/soak.py: schedule)
        self.model = service.model
        self.service = service
        self.published_upto = 0  # index into model.events
        self.held = _Held()
        self.diverted: dict[str, list[Event]] = {}  # repository -> events held back by a fault
        self.recent: deque[Event] = deque(maxlen=5_000)  # published: material for duplicates
        self.producer: Any = None
        self.in_flight: tuple[list[Event], list[asyncio.Future[Any]]] | None = None
        self.ops_by_kind: Counter[str] = Counter()
        self.ops_refused = 0
        self.op_index = 0
        self.faults_injected: Counter[str] = Counter()
        self.fault_errors: dict[str, list[str]] = {}
        self.late: dict[str, str] = {}  # address -> note: a reference published beyond grace
        self.beyond_contract: Counter[str] = Counter()  # delay_beyond copies, by source state
        self.notes: dict[str, list[str]] = {}  # address -> what the soak did with it
        self.violations: dict[str, str] = {}  # address -> where first seen gone while live
        self.violation_op: dict[str, int] = {}  # address -> operation index of that check
        self.fault_log: list[tuple[int, str]] = []  # (operation index, fault kind) injected
        self.checks = 0
        self.runs: list[ReconcileRun] = []
        self.dry_runs: dict[str, str] = {}  # repo -> run id of its last dry run
        self.dry_pending: dict[str, asyncio.Event] = {}  # repo -> set when its dry run ended
        self.spark: Any = None
        self.spark_shared = False
        self.spark_ready: asyncio.Future[Any] | None = None
        self.recon_lock = asyncio.Lock()
        self.tasks: list[asyncio.Task[Any]] = []
        self.fail_closed: dict[str, FailClosedPeriod] = {}
        self.fail_closed_periods: list[FailClosedPeriod] = []
        self.misdirected: list[list[Event]] = []  # miskeyed blocks, dead-lettered
        self.operator_holds: set[str] = set()  # addresses an operator held (never deleted)
        self.paused_spans = 0  # operator pauses carried out and checked
        self.dlq_replayed = 0
        self.dlq_resolved = 0
        self.exported: set[str] = set()  # rebuild nonces the service exported its state for
        self.rebuild_exports = 0
        self.phases: dict[str, float] = {}
        self.max_horizon_lag = 0.0
        self.timing: defaultdict[str, float] = defaultdict(float)  # where the load goes
        self.stopping = False
        self.counter = 0

    def _elapsed(self) -> float:
        return time.monotonic() - self.started

    def _note(self, address: str, text: str) -> None:
        self.notes.setdefault(address, []).append(f"soak: {text}")

    def _injected(self, kind: FaultKind) -> None:
        self.faults_injected[kind.value] += 1
        self.fault_log.append((min(self.op_index, self.o.ops), kind.value))

    def _failed(self, kind: FaultKind, why: str) -> None:
        self.fault_errors.setdefault(kind.value, []).append(why)
        log.warning("soak.fault_not_injected", fault=kind.value, why=why)

    def _background(self, coro: Awaitable[Any], name: str) -> None:
        async def guarded() -> None:
            try:
                await coro
            except Exception as exc:
                log.exception("soak.task_failed", task=name)
                self.fault_errors.setdefault(name, []).append(f"{type(exc).__name__}: {exc}")

        self.tasks.append(asyncio.create_task(guarded(), name=name))

    async def _publish(self, events: list[Event], key: bytes | None = None,
                       budget: float = 120.0) -> None:
        """Publish raw and wait for the acks (retrying through broker restarts), after the
        load's batch in flight; ``key`` overrides the repository."""
        await self._acked()
        await self._publish_now(events, key, budget)

    async def _publish_now(self, events: list[Event], key: bytes | None = None,
                           budget: float = 120.0) -> None:
        if not events:
            return
        deadline = time.monotonic() + budget
        delay = 0.1
        while True:
            try:
                await asyncio.gather(*await self._send(events, key))
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("soak.publish_retry", error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _send(self, events: list[Event], key: bytes | None = None
                    ) -> list[asyncio.Future[Any]]:
        return [await self.producer.send(self.settings.events_topic, encode(e),
                                          key=key if key is not None else e.key)
                for e in events]

    async def _acked(self) -> None:
        """Wait for the load's batch in flight; publish it again if it failed (a duplicate
        is harmless; the next batch is sent only after this one, so order holds)."""
        pending, self.in_flight = self.in_flight, None
        if pending is None:
            return
        events, futures = pending
        try:
            await asyncio.gather(*futures)
        except Exception as exc:
            log.warning("soak.publish_retry", error=str(exc))
            await self._publish_now(events)

    async def flush(self, wait: bool = True) -> None:
        """Publish the model's new events (after their effects), skipping withheld ones and
        diverting those of repositories a fault holds back. ``wait=False`` (the load) leaves
        the batch's acks in flight while the next operations run and write."""
        t0 = time.monotonic()
        await self.service.settle()
        end = len(self.model.events)
        batch = []
        for e in self.model.events[self.published_upto:end]:
            if e.event_id in self.held.ids:
                continue
            diverted = self.diverted.get(e.repository)
            if diverted is not None:
                diverted.append(e)
            else:
                batch.append(e)
        await self._acked()
        if batch:
            try:
                self.in_flight = (batch, await self._send(batch))
            except Exception:
                await self._publish_now(batch)  # the broker is down: retry until it is back
        if wait:
            await self._acked()
        self.recent.extend(batch)
        self.published_upto = end
        self.timing["publish"] += time.monotonic() - t0

    def _withhold(self, events: list[Event]) -> list[Event]:
        self.held.ids.update(e.event_id for e in events)
        return list(events)

    async def _release(self, events: list[Event], key: bytes | None = None) -> None:
        await self.flush()  # whatever came before the release goes first
        await self._publish(events, key=key)

    async def _start_producer(self) -> None:
        from aiokafka import AIOKafkaProducer

        self.producer = AIOKafkaProducer(
            bootstrap_servers=self.settings.kafka_bootstrap, acks="all", linger_ms=5,
            max_batch_size=1 << 20, max_request_size=8 << 20, request_timeout_ms=15_000)
        await self.producer.start()

    def _repo(self, index: int) -> str:
        repos = sorted(self.model.repositories)
        return repos[index % len(repos)]

    def _later(self, delay: float, fn: Callable[[], Awaitable[Any]], name: str) -> None:
        async def go() -> None:
            await asyncio.sleep(delay)
            await fn()

        self._background(go(), name)

    async def _await_tracker_knows(self, repo: str | None, timeout: float = 90.0) -> None:
        """Until the trackers have published progress and (if given) know ``repo`` (a Redis
        rollback or restart can take both away until they have replayed): a mark before that
        fails closed, rightly, and the race would not be injected."""
        from core.clock import atracker_horizon_ms

        r = redis_async(self.settings)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and not self.stopping:
                with contextlib.suppress(Exception):
                    if await atracker_horizon_ms(r) is not None and (
                            repo is None
                            or await r.hexists(RepoKeys(repo).meta, "namespace")):
                        return
                await asyncio.sleep(0.2)
        finally:
            await r.aclose()

    async def _reconcile(self, kind: ReconcileKind, repo: str, at_op: int, *,
                         retry_lease: bool = False, label: str | None = None) -> None:
        from reconciler.job import RunOptions

        if kind is ReconcileKind.SWEEP_ONLY:
            pending = self.dry_pending.get(repo)
            if pending is not None:
                await pending.wait()
            run_id = self.dry_runs.pop(repo, None)
            if run_id is None:
                return
            opts = RunOptions(repo, sweep_only=run_id, tracker_wait_s=20.0)
        else:
            opts = RunOptions(repo, dry_run=kind is ReconcileKind.DRY_RUN, tracker_wait_s=20.0)
        done = asyncio.Event()
        if kind is ReconcileKind.DRY_RUN:
            self.dry_pending[repo] = done  # a sweep-only of this repository waits for it
        try:
            await self._await_tracker_knows(repo)
            deadline = time.monotonic() + (75.0 if retry_lease else 0.0)
            while True:
                summary = await self._run_reconcile(opts, label or kind.value, repo, at_op)
                busy = "lease" in str(summary.get("error") or "").lower()
                if not (busy and time.monotonic() < deadline and not self.stopping):
                    break
                self.runs.pop()
                await asyncio.sleep(2.0)
            if kind is ReconcileKind.DRY_RUN and summary.get("success"):
                self.dry_runs[repo] = str(summary.get("run_id"))
        finally:
            done.set()

    async def _run_reconcile(self, opts: Any, label: str, repo: str,
                             at_op: int) -> dict[str, Any]:
        from reconciler.job import reconcile

        assert self.spark_ready is not None
        spark = await self.spark_ready
        async with self.recon_lock:
            t0 = time.monotonic()
            try:
                summary: dict[str, Any] = await asyncio.to_thread(
                    reconcile, spark, self.servers.daemon_settings, opts)
            except Exception as exc:
                summary = {"success": False, "error": f"{type(exc).__name__}: {exc}"}
        mark = summary.get("mark") or {}
        sweep = summary.get("sweep") or {}
        status = str(sweep.get("status") or ("marked" if summary.get("success") else
                                             summary.get("error") or "failed"))
        self.runs.append(ReconcileRun(
            label, repo, at_op, summary.get("run_id"), bool(summary.get("success")),
            status[:120], int(mark.get("marked", 0) or 0),
            int(sweep.get("confirmed", 0) or 0), round(time.monotonic() - t0, 2)))
        return summary

    async def _listed(self) -> set[str]:
        await self.service.settle()
        out: set[str] = set()
        for repo in self.model.repositories:
            out.update(await self.service.list_namespace(repo))
        return out

    async def _check(self, where: str) -> set[str]:
        """List the namespaces; record every object gone that the model calls live."""
        listed = await self._listed()
        written = set(self.model.objects)
        gone = written - listed
        allowed = may_be_gone(self.model, time.time())
        for address in gone - allowed:
            self.violations.setdefault(address, where)
            self.violation_op.setdefault(address, min(self.op_index, self.o.ops))
        self.checks += 1
        return listed
