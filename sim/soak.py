"""``hardelete soak`` (``./dev soak``): a long randomized workload under injected faults, judged
by the model's ground truth.

The model service drives a seeded lakeFS-like workload over several repositories and branches
through the real stack: Apache Kafka, Redis with AOF, MinIO behind a fault proxy, two trackers
and two reapers as separate OS processes (kill -9 is real), and reconciler runs on a shared
local Spark session scheduled during the load (mark+sweep, dry run, sweep-only of an earlier
mark; a killed run is a subprocess).

:func:`sim.soak_plan.plan` decides, from the seed alone, which fault and which reconciler
run happen before which operation; this module only carries the steps out and keeps the
evidence. Every ``check_every`` operations, and at the end, the namespaces are listed: an object
the model wrote that is gone while the model's oracle (:func:`sim.soak_verdict.may_be_gone`)
says it is live is a *live object deleted*. At the end the faults stop, the trackers catch up,
the reapers drain and a final reconciler run per repository takes the rest; what is left of
the model's reclaimable garbage is the recovery figure.

Short grace windows, upload lifetimes and reconciler min-age are used so that reaping happens
within the run (``allow_unsafe_grace``): never production values.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict, deque
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from core.clients import (
    redis_async,
    redis_sync,
    s3_client,
    split_s3_uri,
    topic_partitions,
)
from core.errors import UserError
from core.logs import get_logger
from core.settings import Settings
from schemas.events import (
    BranchCreated,
    Event,
    ObjectDeleted,
    ObjectWritten,
    RepositoryCreated,
    encode,
)
from schemas.layout import FAIL_CLOSED, LOG, REPOS, RepoKeys
from schemas.publisher import ensure_topics
from sim.model import (
    Model,
    ModelError,
    ModelService,
    Op,
    Workload,
    manifest_bytes,
    seeded_ids,
)
from sim.soak_plan import (
    FAILS_CLOSED,
    SURVIVED,
    FaultKind,
    ReconcileKind,
    Step,
    default_rates,
    parse_faults,
    plan,
)
from sim.soak_procs import (
    Daemon,
    SoakServers,
    Supervisor,
    make_daemons,
    settings_env,
    start_servers,
)
from sim.soak_verdict import (
    FailClosedPeriod,
    IncidentRecord,
    LiveDeletion,
    ReconcileRun,
    SoakVerdict,
    event_history,
    may_be_gone,
    print_verdict,
    why_live,
)

log = get_logger(__name__)

_PYTHON_CLI = (sys.executable, "-m", "hardelete.cli")


@dataclass(frozen=True)
class SoakOptions:
    seed: int = 1
    ops: int = 10_000
    repos: int = 4
    branches: int = 3
    faults: frozenset[FaultKind] = SURVIVED
    # None: scaled to the run (soak_plan.default_rates).
    faults_per_1000_ops: float | None = None
    reconciles_per_1000_ops: float | None = None
    reconcile: bool = True
    grace_seconds: float = 2.0
    upload_ttl_seconds: float = 2.0
    min_age_seconds: float = 3.0
    lease_seconds: float = 4.0
    # A publish batch closes after this many operations or this many seconds, whichever comes
    # first (events still follow their effects). Each batch waits for its S3 writes and for the
    # broker's acks=all: the batch size is what bounds the soak's rate.
    flush_every: int = 200
    flush_interval: float = 0.25
    check_every: int | None = None  # operations between two listings; None: scaled
    payload_cap: int = 64
    span_days: float = 30.0  # commits back-dated over this span: retention has work
    retention_days: float = 7.0
    drain_timeout: float = 90.0
    keep_workdir: bool = False
    # The trackers rebuild fail-closed repositories (tracker/rebuild.py) and the soak plays the
    # service's part (the state export); off, a lost log leaves them fail-closed to the end.
    rebuild: bool = True
    # The command that starts a reaper daemon (``... reaper run`` is appended). Tests point it
    # at a wrapper that patches a safety check, to prove the soak catches the damage; there is
    # no production switch for that.
    reaper_command: tuple[str, ...] = _PYTHON_CLI

    @property
    def rates(self) -> tuple[float, float, int]:
        """Faults and reconciler runs per 1000 operations, operations between listings."""
        faults, reconciles, check = default_rates(self.ops)
        return (faults if self.faults_per_1000_ops is None else self.faults_per_1000_ops,
                reconciles if self.reconciles_per_1000_ops is None
                else self.reconciles_per_1000_ops,
                check if self.check_every is None else self.check_every)

    def workload(self, run_id: str) -> Workload:
        try:
            return Workload(seed=self.seed, ops=self.ops, repos=self.repos,
                            branches=self.branches, bucket="soak", name=f"soak-{run_id}",
                            span_days=self.span_days, retention_days=self.retention_days,
                            max_size=self.payload_cap)
        except ValueError as exc:
            raise UserError(str(exc)) from None


def soak_settings(base: Settings, o: SoakOptions) -> Settings:
    return base.replace(
        grace_seconds=o.grace_seconds, allow_unsafe_grace=True,
        upload_ttl_seconds=o.upload_ttl_seconds, reconcile_min_age_seconds=o.min_age_seconds,
        lease_seconds=o.lease_seconds, session_timeout_ms=6_000, heartbeat_interval_ms=1_000,
        tracker_poll_ms=50, reaper_poll_seconds=0.2, metrics_port=0, log_format="json",
        kafka_bootstrap="", redis_url="", s3_endpoint_url="", redis_cluster=False,
        quarantine_days=0.0, repository_grace="",
        rebuild_interval_seconds=1.0 if o.rebuild else 0.0)


# --- CLI -----------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    d = SoakOptions()
    parser.add_argument("--ops", type=int, default=d.ops, help="random operations")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--repos", type=int, default=d.repos)
    parser.add_argument("--branches", type=int, default=d.branches)
    parser.add_argument("--faults", default="survived",
                        help="survived (default: what the current code survives), all, none, "
                             "needs-fix, or a comma list of kinds; +kind/-kind adjust the "
                             "default. Kinds: " + ", ".join(k.value for k in FaultKind))
    parser.add_argument("--faults-per-1000", type=float, default=d.faults_per_1000_ops,
                        help="faults per 1000 operations (default: 4 up to 10^4 operations, "
                             "then fewer: 100 in all at 10^6)")
    parser.add_argument("--reconciles-per-1000", type=float, default=d.reconciles_per_1000_ops,
                        help="reconciler runs scheduled per 1000 operations, at least 3 "
                             "(default: 1 up to 10^4 operations, then fewer: 20 at 10^6)")
    parser.add_argument("--flush-every", type=int, default=d.flush_every,
                        help="operations per publish batch at most")
    parser.add_argument("--no-reconcile", action="store_true",
                        help="no reconciler runs (no Spark); kill_reconciler and "
                             "mark_sweep_race are dropped")
    parser.add_argument("--grace", type=float, default=d.grace_seconds,
                        help="grace window in seconds (soak only: unsafe in production)")
    parser.add_argument("--check-every", type=int, default=d.check_every,
                        help="operations between two listings of the namespaces (default: "
                             "2,500 up to 5*10^4 operations, then a twentieth of the run)")
    parser.add_argument("--keep-workdir", action="store_true",
                        help="keep the servers' data and the daemons' logs")
    parser.add_argument("--no-rebuild", action="store_true",
                        help="no rebuild of fail-closed repositories (the service exports "
                             "nothing): they stay fail-closed to the end")
    parser.add_argument("--plan", action="store_true",
                        help="print the fault schedule for the seed and exit")
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")


def options_from_args(args: argparse.Namespace) -> SoakOptions:
    if args.ops < 0 or args.repos < 1 or args.branches < 1:
        raise UserError("--ops must be >= 0, --repos and --branches >= 1")
    if (args.grace <= 0 or (args.check_every is not None and args.check_every < 1)
            or (args.faults_per_1000 or 0) < 0 or (args.reconciles_per_1000 or 0) < 0
            or args.flush_every < 1):
        raise UserError("--grace must be > 0, --check-every and --flush-every >= 1, "
                        "--faults-per-1000 and --reconciles-per-1000 >= 0")
    try:
        faults = parse_faults(args.faults)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.no_reconcile:
        faults -= _NEEDS_SPARK
    return SoakOptions(seed=args.seed, ops=args.ops, repos=args.repos, branches=args.branches,
                       faults=faults, faults_per_1000_ops=args.faults_per_1000,
                       reconcile=not args.no_reconcile, grace_seconds=args.grace,
                       check_every=args.check_every, keep_workdir=args.keep_workdir,
                       reconciles_per_1000_ops=args.reconciles_per_1000,
                       flush_every=args.flush_every, rebuild=not args.no_rebuild)


_NEEDS_SPARK = frozenset({FaultKind.KILL_RECONCILER, FaultKind.MARK_SWEEP_RACE})


def schedule(o: SoakOptions) -> list[Step]:
    faults = o.faults if o.reconcile else o.faults - _NEEDS_SPARK
    steps = plan(o.seed, o.ops, faults, repos=o.repos, grace_seconds=o.grace_seconds,
                 per_1000_ops=o.rates[0], reconciles_per_1000_ops=o.rates[1])
    return [s for s in steps if o.reconcile or not isinstance(s.action, ReconcileKind)]


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # run the clean-up: servers and daemons are stopped


def run_cli(settings: Settings, args: argparse.Namespace) -> int:
    options = options_from_args(args)
    signal.signal(signal.SIGTERM, _terminate)
    # The soak's own producer logs every refused connection while it kills the broker.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    if args.plan:
        for s in schedule(options):
            sys.stdout.write(orjson.dumps({"at_op": s.at_op, "action": s.action.value,
                                           "target": s.target, "delay": s.delay,
                                           "span": s.span, "share": s.share}).decode() + "\n")
        return 0
    verdict = run_soak(settings, options, Console(stderr=True))
    if args.json:
        sys.stdout.write(verdict.as_json().decode() + "\n")
    else:
        print_verdict(verdict, Console())
    if not verdict.safe:
        return 1
    return 0 if verdict.ok else 3


def run_soak(settings: Settings, options: SoakOptions,
             console: Console | None = None) -> SoakVerdict:
    """Start the servers and daemons, run the soak, stop everything; return the verdict."""
    console = console or Console(stderr=True, quiet=True)
    run_id = uuid.uuid4().hex[:8]
    options.workload(run_id)  # a bad option fails before any server starts
    workdir = Path(tempfile.mkdtemp(prefix="hardelete-soak-"))
    started = time.monotonic()
    servers: SoakServers | None = None
    supervisor: Supervisor | None = None
    try:
        with console.status("soak: starting MinIO, Redis (AOF) and Apache Kafka"):
            servers = start_servers(soak_settings(settings, options), workdir)
        supervisor = make_daemons(servers.daemon_settings, workdir, trackers=2, reapers=2,
                                  command=_PYTHON_CLI, reaper_command=options.reaper_command)
        soak = Soak(options, servers, supervisor, run_id, console, started)
        verdict = asyncio.run(soak.run())
    finally:
        if supervisor is not None:
            supervisor.stop_all()
        if servers is not None:
            servers.stop(keep=options.keep_workdir)
        if not options.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    verdict.workdir = str(workdir) if options.keep_workdir else None
    return verdict


# --- the run ---------------------------------------------------------------------------------


# Keys obstore (Rust object_store) writes and lists exactly as S3 spells them; any other key
# goes through boto3, so that a listing never disagrees with what was written.
_PLAIN_KEY = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")


class PipelinedService(ModelService):
    """The model service with its S3 writes in flight while the next operations run.

    Events still follow their effects: :meth:`settle` (called before every publish) waits for
    every write issued so far. Writes and listings go through obstore when it is installed
    (no thread and no GIL per request: boto3 capped the soak near 500 PUTs/s here, its CPU
    shared with the daemons under test); the harness is not the product.
    """

    def __init__(self, *args: Any, inflight: int = 64, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inflight: list[asyncio.Future[None]] = []
        self._limit = inflight
        self._stores: dict[str, Any] = {}
        try:
            import obstore  # noqa: F401
            self._obstore = True
        except ImportError:
            self._obstore = False

    def _store(self, bucket: str) -> Any:
        store = self._stores.get(bucket)
        if store is None:
            from obstore.store import S3Store

            st = self.settings
            store = self._stores[bucket] = S3Store(
                bucket, endpoint=st.s3_endpoint_url, region=st.s3_region,
                access_key_id=st.s3_access_key, secret_access_key=st.s3_secret_key,
                client_options={"allow_http": True})
        return store

    def _fast(self, key: str) -> bool:
        return self._obstore and bool(self.settings.s3_endpoint_url) and bool(
            _PLAIN_KEY.fullmatch(key))

    async def _put(self, address: str, body: bytes) -> None:
        import obstore

        bucket, key = split_s3_uri(address)
        await obstore.put_async(self._store(bucket), key, body)

    async def _put_object(self, record: Any) -> None:
        if not self._fast(split_s3_uri(record.address)[1]):
            await self._queue(super()._put_object(record))
            return
        body = os.urandom(min(record.size, self.payload_cap))
        self.objects_written += 1
        self.bytes_written += len(body)
        await self._queue(self._put(record.address, body))

    async def _put_manifest(self, commit: Any) -> None:
        if not self._fast(split_s3_uri(commit.manifest)[1]):
            await self._queue(super()._put_manifest(commit))
            return
        self.manifests_written += 1
        await self._queue(self._put(commit.manifest, manifest_bytes(commit)))

    async def write_state_export(self, repo: str, nonce: str,
                                 location: str | None = None) -> str:
        # A service exports only what it stored: no commit whose manifest is still in flight.
        await self.settle()
        return await super().write_state_export(repo, nonce, location)

    async def all_stored(self, addresses: Iterable[str]) -> bool:
        """Whether every address is in the store now (HEAD each)."""
        await self.settle()
        for address in addresses:
            bucket, key = split_s3_uri(address)
            try:
                if self._fast(key):
                    import obstore

                    await obstore.head_async(self._store(bucket), key)
                else:
                    await asyncio.to_thread(self.s3.head_object, Bucket=bucket, Key=key)
            except Exception:
                return False
        return True

    async def list_namespace(self, repo: str) -> list[str]:
        r = self.model.repository(repo)
        prefix = r.prefix.rstrip("/")
        if not self._fast(prefix):
            return await super().list_namespace(repo)
        import obstore

        out: list[str] = []
        async for batch in obstore.list(self._store(r.bucket), prefix + "/", chunk_size=1000):
            out.extend(f"s3://{r.bucket}/{m['path']}" for m in batch)
        return out

    async def _queue(self, write: Awaitable[None]) -> None:
        self._inflight.append(asyncio.ensure_future(write))
        if len(self._inflight) >= self._limit:
            await self._inflight.pop(0)

    async def settle(self) -> None:
        pending, self._inflight = self._inflight, []
        if pending:
            await asyncio.gather(*pending)


@dataclass
class _Held:
    """Events withheld from the stream, published later (delays, reorders)."""

    ids: set[str] = field(default_factory=set)


class Soak:
    def __init__(self, o: SoakOptions, servers: SoakServers, supervisor: Supervisor,
                 run_id: str, console: Console, started: float) -> None:
        self.o = o
        self.servers = servers
        self.sup = supervisor
        self.run_id = run_id
        self.console = console
        self.started = started
        self.settings = servers.settings
        self.rng = random.Random(f"hardelete-soak-run:{o.seed}")
        self.steps = schedule(o)
        self.model = Model.from_settings(self.settings, new_id=seeded_ids(o.seed))
        self.service = PipelinedService(self.settings, s3_client(self.settings), None,
                                        model=self.model)
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
        self.dlq_replayed = 0
        self.dlq_resolved = 0
        self.exported: set[str] = set()  # rebuild nonces the service exported its state for
        self.rebuild_exports = 0
        self.phases: dict[str, float] = {}
        self.max_horizon_lag = 0.0
        self.timing: defaultdict[str, float] = defaultdict(float)  # where the load goes
        self.stopping = False
        self.counter = 0

    # -- plumbing --

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

    # -- main --

    async def run(self) -> SoakVerdict:
        o = self.o
        # The model service's S3 writes run in threads (boto3): the default pool of cpu+4
        # threads would cap the writes in flight below the pipeline's depth.
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(32))
        await ensure_topics(self.settings)
        await self._start_producer()
        self.sup.start_all()
        if o.reconcile:
            self.spark_ready = asyncio.ensure_future(asyncio.to_thread(self._get_spark))
        watcher = asyncio.create_task(self._watch())
        try:
            # The stack is up once the trackers prove progress: a load that starts earlier
            # runs its first seconds with no horizon, when no reaper may act at all.
            await self._await_tracker_knows(None, timeout=60.0)
            t0 = time.monotonic()
            await self._load()
            self.phases["load"] = time.monotonic() - t0
            for what, seconds in self.timing.items():
                self.phases[f"  load: {what}"] = seconds
            t0 = time.monotonic()
            caught_up = await self._drain()
            self.phases["drain and final reconcile"] = time.monotonic() - t0
            return await self._verdict(caught_up)
        finally:
            self.stopping = True
            watcher.cancel()
            for t in self.tasks:
                t.cancel()
            with contextlib.suppress(Exception):
                await self.producer.stop()
            if self.spark is not None and not self.spark_shared:
                await asyncio.to_thread(self.spark.stop)

    def _get_spark(self) -> Any:
        from pyspark import SparkContext

        from reconciler.spark import get_spark

        # Someone else's session (a test run's) is used, not stopped. (getActiveSession is per
        # thread, and this runs in a worker thread: ask for the process' context.)
        self.spark_shared = SparkContext._active_spark_context is not None
        self.spark = get_spark(self.servers.daemon_settings)
        return self.spark

    async def _load(self) -> None:
        o = self.o
        workload = o.workload(self.run_id)
        steps = list(self.steps)
        setup = workload.setup_ops
        total = o.ops + setup
        check_every = o.rates[2]
        last_sup = last_flush = time.monotonic()
        with self.console.status("soak: load") as status:
            for n, op in enumerate(workload.operations(self.model)):
                i = n - setup
                self.op_index = max(i, 0)
                while steps and i >= 0 and steps[0].at_op <= i:
                    await self._step(steps.pop(0))
                await self._apply(op)
                if (n % o.flush_every == 0 or n == total - 1
                        or time.monotonic() - last_flush > o.flush_interval):
                    # Acks awaited per batch. With them in flight (wait=False) the safety
                    # soak found a product hole, now fixed (a partition gone with a lost log:
                    # RELIABILITY.md) and passed 6 of 6 runs since; wait=False is the faster
                    # load, this the order the suite's runs were proven with.
                    await self.flush(wait=True)
                    last_flush = time.monotonic()
                if i > 0 and i % check_every == 0:
                    await self.flush()
                    t0 = time.monotonic()
                    await self._check(f"op {i}")
                    self.timing["checks"] += time.monotonic() - t0
                if time.monotonic() - last_sup > 0.5:
                    last_sup = last_flush = time.monotonic()
                    self.sup.check()
                    status.update(f"soak: op {max(i, 0)}/{o.ops}, faults "
                                  f"{sum(self.faults_injected.values())}, reconciler runs "
                                  f"{len(self.runs)}")
                    await asyncio.sleep(0)
            for s in steps:  # steps past the end (none unless ops was tiny)
                await self._step(s)
            await self.flush()
        self.op_index = sys.maxsize  # the load is over: steps waiting for an op go on now

    async def _apply(self, op: Op) -> None:
        t0 = time.monotonic()
        try:
            await self.service.apply(op)
        except ModelError:
            # A fault step changed the repository between the draw and now: skip it.
            self.ops_refused += 1
            return
        finally:
            self.timing["apply (model + S3 writes)"] += time.monotonic() - t0
        self.ops_by_kind[op.kind.value] += 1

    # -- watching: daemons and fail-closed state --

    async def _watch(self) -> None:
        r = redis_async(self.settings)
        try:
            while not self.stopping:
                await asyncio.sleep(0.5)
                try:
                    await self._poll_fail_closed(r)
                    await self._poll_horizon(r)
                except Exception:
                    continue  # Redis down (a fault): try again
        finally:
            with contextlib.suppress(Exception):
                await r.aclose()

    async def _poll_horizon(self, r: Any) -> None:
        """The longest the trackers' proven progress trailed the Redis clock (a stall holds
        reaping back: safe, but nothing is reclaimed meanwhile)."""
        from core.clock import aredis_time_ms, atracker_horizon_ms

        now = await aredis_time_ms(r)
        horizon = await atracker_horizon_ms(r)
        if horizon is not None:
            self.max_horizon_lag = max(self.max_horizon_lag, (now - horizon) / 1000)

    async def _poll_fail_closed(self, r: Any) -> None:
        now = {}
        glob = await r.hgetall(FAIL_CLOSED)
        if glob:
            now["*"] = str(glob.get("reason", "?"))
        for repo in await r.smembers(REPOS):
            h = await r.hgetall(RepoKeys(repo).fail_closed)
            if h:
                now[repo] = str(h.get("reason", "?"))
                await self._export_for_rebuild(r, repo)
        t = self._elapsed()
        for scope, reason in now.items():
            if scope not in self.fail_closed:
                p = FailClosedPeriod(scope, reason, t)
                self.fail_closed[scope] = p
                self.fail_closed_periods.append(p)
        for scope in list(self.fail_closed):
            if scope not in now:
                self.fail_closed.pop(scope).end_s = t

    async def _export_for_rebuild(self, r: Any, repo: str) -> None:
        """The service's part of a rebuild (tracker/rebuild.py): once the tracker prepared one,
        read its nonce, then export the whole state with it (after reading: the order the
        nonce proves)."""
        nonce = await r.hget(RepoKeys(repo).rebuild, "nonce")
        if not nonce or nonce in self.exported or repo not in self.model.repositories:
            return
        self.exported.add(nonce)
        await self.service.write_state_export(repo, nonce)
        self.rebuild_exports += 1

    # -- the steps --

    async def _step(self, step: Step) -> None:
        action = step.action
        log.debug("soak.step", at_op=step.at_op, action=action.value, target=step.target)
        if isinstance(action, ReconcileKind):
            repo = self._repo(step.target)
            self._background(self._reconcile(action, repo, step.at_op), f"reconcile-{action}")
            return
        handler = getattr(self, f"_fault_{action.value}")
        try:
            await handler(step)
        except Exception as exc:
            self._failed(action, f"{type(exc).__name__}: {exc}")

    def _repo(self, index: int) -> str:
        repos = sorted(self.model.repositories)
        return repos[index % len(repos)]

    def _later(self, delay: float, fn: Callable[[], Awaitable[Any]], name: str) -> None:
        async def go() -> None:
            await asyncio.sleep(delay)
            await fn()

        self._background(go(), name)

    async def _fault_kill_tracker(self, step: Step) -> None:
        async def kill() -> None:
            self.sup.kill_and_restart(f"tracker-{step.target % 2}")
            self._injected(FaultKind.KILL_TRACKER)

        self._later(step.delay, kill, "kill_tracker")

    async def _fault_kill_reaper(self, step: Step) -> None:
        async def kill() -> None:
            self.sup.kill_and_restart(f"reaper-{step.target % 2}")
            self._injected(FaultKind.KILL_REAPER)

        self._later(step.delay, kill, "kill_reaper")

    async def _fault_redis_restart(self, step: Step) -> None:
        async def go() -> None:
            await asyncio.to_thread(self.servers.kill_redis, step.delay)
            self._injected(FaultKind.REDIS_RESTART)

        self._background(go(), "redis_restart")

    async def _fault_redis_rollback(self, step: Step) -> None:
        snapshot = await asyncio.to_thread(self.servers.snapshot_redis)
        target = step.at_op + max(1, step.span)

        async def go() -> None:
            while self.op_index < target and not self.stopping:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(self.servers.rollback_redis, snapshot)
            self._injected(FaultKind.REDIS_ROLLBACK)

        self._background(go(), "redis_rollback")

    async def _fault_broker_restart(self, step: Step) -> None:
        await asyncio.to_thread(self.servers.restart_broker, lose_log=False,
                                down_seconds=step.delay)
        self._injected(FaultKind.BROKER_RESTART)

    async def _fault_broker_kill(self, step: Step) -> None:
        await asyncio.to_thread(self.servers.restart_broker, lose_log=False,
                                down_seconds=step.delay, hard=True)
        self._injected(FaultKind.BROKER_KILL)

    async def _fault_broker_log_lost(self, step: Step) -> None:
        await asyncio.to_thread(self.servers.restart_broker, lose_log=True,
                                down_seconds=step.delay)
        await ensure_topics(self.settings)  # the operator re-creates the topics
        self._injected(FaultKind.BROKER_LOG_LOST)

    async def _fault_add_partition(self, step: Step) -> None:
        from aiokafka.admin import AIOKafkaAdminClient, NewPartitions

        admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.kafka_bootstrap)
        await admin.start()
        try:
            topic = self.settings.events_topic
            meta = await admin.describe_topics([topic])
            count = len(meta[0]["partitions"])
            await admin.create_partitions({topic: NewPartitions(total_count=count + 1)})
        finally:
            await admin.close()
        self._injected(FaultKind.ADD_PARTITION)

    async def _fault_duplicate(self, step: Step) -> None:
        await self.flush()
        published = list(self.recent)
        if not published:
            return
        start = self.rng.randrange(len(published))
        chunk = published[start:start + max(1, step.span)]
        # Half the time out of order too: a redelivery is not always of the latest events.
        if self.rng.random() < 0.5:
            self.rng.shuffle(chunk)
        await self._publish(chunk)
        self._injected(FaultKind.DUPLICATE)

    async def _fault_reorder(self, step: Step) -> None:
        """A repository's next events are published after later ones; and a stale tag event
        (a tag deleted, re-created, then the old delete delivered again)."""
        repo = self._repo(step.target)
        if repo in self.diverted:
            return
        await self.flush()
        self.diverted[repo] = []
        target_ops = self.op_index + max(2, step.span)

        async def release() -> None:
            while self.op_index < target_ops and not self.stopping:
                await asyncio.sleep(0.02)
            await self.flush()
            block = self.diverted.pop(repo, [])
            half = len(block) // 2
            await self._publish(block[half:])  # the later half first ...
            await self._publish(block[:half])  # ... then the earlier half
            self._injected(FaultKind.REORDER)

        self._background(release(), "reorder")
        r = self.model.repository(repo)
        heads = sorted(b for b, br in r.branches.items() if br.head)
        if heads:
            self.counter += 1
            tag = f"soak-tag-{self.counter}"
            await self.service.call(Model.create_tag, repo, tag, heads[0])
            deleted = await self.service.call(Model.delete_tag, repo, tag)
            await self.service.call(Model.create_tag, repo, tag, heads[-1])
            await self.flush()
            self._later(1.0, lambda: self._publish(list(deleted)), "reorder")  # stale, again

    def _two_branches(self, repo: str) -> tuple[str, str] | None:
        r = self.model.repository(repo)
        names = sorted(r.branches)
        if len(names) < 2:
            return None
        src = r.default_branch
        dst = self.rng.choice([b for b in names if b != src])
        return src, dst

    async def _copy_then_delete_source(self, repo: str, kind: FaultKind
                                       ) -> tuple[str, list[Event]] | None:
        """Write X on one branch, shallow-copy it to another (the copy's event withheld),
        delete X from the first: the tracker sees X unreferenced until the copy arrives."""
        pair = self._two_branches(repo)
        if pair is None:
            return None
        src, dst = pair
        self.counter += 1
        path = f"soak/{kind.value}-{self.counter}"
        # A short upload token: the address' protection as an issued upload ends well inside
        # the grace window, so the grace window alone protects the delayed copy.
        issued = await self.service.call(Model.issue_address, repo, 0.5)
        assert issued.address is not None and issued.signed_token is not None
        await self.service.call(Model.upload, repo, issued.address, 16)
        written = await self.service.call(Model.link, repo, src, path, issued.address,
                                          issued.signed_token)
        assert written.address is not None
        copied = self.model.copy(repo, src, path, dst, path)
        held = self._withhold(copied)
        await self.service.call(Model.delete, repo, src, path)
        await self.flush()
        self._note(written.address, f"{kind.value}: copy {src}->{dst}:{path} withheld, "
                                    f"source deleted")
        return written.address, held

    async def _fault_delay(self, step: Step) -> None:
        made = await self._copy_then_delete_source(self._repo(step.target), FaultKind.DELAY)
        if made is None:
            return
        address, held = made

        async def release() -> None:
            await self._release(held)
            self._note(address, f"delay: copy published {step.delay:.2f}s late (within grace)")
            self._injected(FaultKind.DELAY)

        self._later(step.delay, release, "delay")

    async def _fault_delay_beyond(self, step: Step) -> None:
        repo = self._repo(step.target)
        made = await self._copy_then_delete_source(repo, FaultKind.DELAY_BEYOND)
        if made is None:
            return
        address, held = made

        async def release() -> None:
            # Beyond the contract: publish once the source is reaped (or well past grace).
            r = redis_async(self.settings)
            # A loaded machine (or a killed reaper) can take a while to reap it.
            deadline = time.monotonic() + max(60.0, 20 * self.o.grace_seconds)
            reaped = False
            try:
                while time.monotonic() < deadline and not self.stopping and not reaped:
                    with contextlib.suppress(Exception):
                        reaped = await r.hget(RepoKeys(repo).address(address),
                                              "state") == "reaped"
                    if not reaped:
                        await asyncio.sleep(0.2)
            finally:
                await r.aclose()
            if reaped:
                self.late[address] = "copy published after its source was reaped (beyond grace)"
            self.beyond_contract["after_reap" if reaped else "source_not_yet_reaped"] += 1
            await self._release(held)
            self._note(address, "delay_beyond: copy published "
                       + ("after the source was reaped" if reaped
                          else "beyond grace, its source not yet reaped"))
            self._injected(FaultKind.DELAY_BEYOND)

        self._background(release(), "delay_beyond")

    async def _fault_malformed(self, step: Step) -> None:
        repo = self._repo(step.target)
        ns = self.model.repository(repo).storage_namespace
        bodies = [
            b"{not json",
            orjson.dumps({"type": "object_teleported", "v": 1, "repository": repo,
                          "event_id": uuid.uuid4().hex, "emitted_at": 0}),
            orjson.dumps({"type": "tag_created", "v": 99, "repository": repo,
                          "event_id": uuid.uuid4().hex, "emitted_at": 0, "tag": "x",
                          "commit_id": "y"}),
            encode(ObjectWritten(repository=repo, branch="main", staging_token="t",
                                 path="p", address=f"s3://elsewhere/{uuid.uuid4().hex}",
                                 size=1, ref_id=uuid.uuid4().hex)),
            encode(ObjectWritten(repository=repo, branch="main", staging_token="t", path="p",
                                 address=f"{ns}_hardelete/manifests/x", size=1,
                                 ref_id=uuid.uuid4().hex)),
        ]
        body = bodies[step.target % len(bodies)]
        await self.producer.send_and_wait(self.settings.events_topic, body, key=repo.encode())
        self._injected(FaultKind.MALFORMED)

    async def _fault_oversized(self, step: Step) -> None:
        repo = self._repo(step.target)
        # As large as Kafka's default record limit (1 MB) lets through: above the tracker's
        # dead-letter cut (900 kB), so its dead letter is truncated.
        body = b'{"type": "object_written", "v": 1, "junk": "' + b"x" * 1_000_000 + b'"}'
        await self.producer.send_and_wait(self.settings.events_topic, body, key=repo.encode())
        self._injected(FaultKind.OVERSIZED)

    async def _fault_miskeyed(self, step: Step) -> None:
        """The next operations' events of one repository go out under another's key."""
        repo = self._repo(step.target)
        other = self._repo(step.target + 1)
        if repo in self.diverted:
            return
        await self.flush()
        self.diverted[repo] = []
        until = self.op_index + 10

        async def go() -> None:
            while self.op_index < until and not self.stopping:
                await asyncio.sleep(0.02)
            await self.flush()
            block = self.diverted.pop(repo, [])
            await self._publish(block, key=other.encode() if other != repo else b"")
            self.misdirected.append(block)  # the operator replays it at the drain
            self._injected(FaultKind.MISKEYED)

        self._background(go(), "miskeyed")

    async def _fault_namespace_claim(self, step: Step) -> None:
        """A repository whose namespace contains every other's claims a committed address of
        one of them and deletes it."""
        victim = self._repo(step.target)
        r = self.model.repository(victim)
        head = r.branches[r.default_branch].head
        if head is None:
            heads = [b.head for b in r.branches.values() if b.head]
            head = heads[-1] if heads else None
        if head is None or not self.model.commits[head].entries:
            self._failed(FaultKind.NAMESPACE_CLAIM, "victim has no committed entry yet")
            return
        entry = sorted(self.model.commits[head].entries.values(), key=lambda e: e.address)[0]
        self.counter += 1
        intruder = f"intruder-{self.run_id}-{self.counter}"
        parent = r.storage_namespace.rstrip("/").rsplit("/", 1)[0] + "/"
        token, ref = uuid.uuid4().hex, uuid.uuid4().hex
        events: list[Event] = [
            RepositoryCreated(repository=intruder, storage_namespace=parent,
                              default_branch="main", default_retention_days=7.0),
            BranchCreated(repository=intruder, branch="main", staging_token=token,
                          ref_version=1),
            ObjectWritten(repository=intruder, branch="main", staging_token=token, path="x",
                          address=entry.address, size=entry.size, ref_id=ref),
            ObjectDeleted(repository=intruder, branch="main", staging_token=token, path="x",
                          address=entry.address, ref_id=ref),
        ]
        await self.flush()
        await self._publish(events)
        self._note(entry.address, f"namespace_claim: {intruder} claimed {parent} and "
                                  f"unreferenced this committed address")
        self._injected(FaultKind.NAMESPACE_CLAIM)

    async def _fault_s3_errors(self, step: Step) -> None:
        faults = self.servers.proxy.faults
        faults.rng.seed(f"{self.o.seed}:{step.at_op}")
        faults.error_share = step.share
        until = step.at_op + max(1, step.span)
        self._injected(FaultKind.S3_ERRORS)

        async def heal() -> None:
            while self.op_index < until and not self.stopping:
                await asyncio.sleep(0.05)
            faults.error_share = 0.0

        self._background(heal(), "s3_errors")

    async def _fault_kill_reconciler(self, step: Step) -> None:
        if not self.o.reconcile:
            return
        repo = self._repo(step.target)
        self._background(self._killed_reconcile(repo, step), "kill_reconciler")

    async def _killed_reconcile(self, repo: str, step: Step) -> None:
        env = settings_env(self.servers.daemon_settings)
        env["HARDELETE_LOG_FORMAT"] = "json"
        d = Daemon("reconciler", [*_PYTHON_CLI, "reconcile", "--repo", repo, "--json"], env,
                   self.servers.workdir / "reconciler-killed.log")
        d.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < step.delay and d.alive():
            await asyncio.sleep(0.05)
        finished = not d.alive()
        await asyncio.to_thread(d.kill9)
        self._injected(FaultKind.KILL_RECONCILER)
        self.runs.append(ReconcileRun(
            "killed (subprocess)", repo, step.at_op, None, True,
            "finished before the kill" if finished else f"killed after {step.delay:.1f}s",
            seconds=time.monotonic() - t0))
        # Restart: the same run again, once the killed run's lease has expired.
        await self._reconcile(ReconcileKind.MARK_SWEEP, repo, step.at_op, retry_lease=True,
                              label="mark_sweep (rerun after kill)")

    async def _fault_mark_sweep_race(self, step: Step) -> None:
        if not self.o.reconcile:
            return
        repo = self._repo(step.target)
        self._background(self._race(repo, step), "mark_sweep_race")

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

    async def _race(self, repo: str, step: Step) -> None:
        from reconciler.job import RunOptions

        await self._await_tracker_knows(repo)
        summary = await self._run_reconcile(RunOptions(repo, dry_run=True), "race: mark",
                                            repo, step.at_op)
        run_id = summary.get("run_id") if summary.get("success") else None
        if not run_id:
            self._failed(FaultKind.MARK_SWEEP_RACE, f"mark failed: {summary.get('error')}")
            return
        # Between the mark and the sweep: refs to old commits, and a copy committed on main.
        # Only commits whose data is all still stored: an expired commit whose data an earlier
        # sweep rightly took would otherwise come back "live" in the model with its data gone
        # (a branch at an expired commit after its collection: the retention contract's loss,
        # not a deletion of anything live; seen as a false alarm with seed 101).
        r = self.model.repository(repo)
        old = []
        for c in r.commit_ids:
            entries = self.model.commits[c].entries
            if entries and await self.service.all_stored(e.address for e in entries.values()):
                old.append(c)
                if len(old) == 3:
                    break
        if old:
            self.counter += 1
            branch = f"soak-race-{self.counter}"
            await self.service.call(Model.create_branch, repo, branch, old[0])
            await self.service.call(Model.create_tag, repo, f"soak-race-tag-{self.counter}",
                                    old[-1])
            entries = self.model.branch_entries(repo, branch)
            if entries:
                path = sorted(entries)[0]
                with contextlib.suppress(ModelError):
                    await self.service.call(Model.copy, repo, branch, path, r.default_branch,
                                            f"soak/race-{self.counter}")
                    await self.service.call(Model.commit, repo, r.default_branch)
            await self.flush()
        await self._run_reconcile(RunOptions(repo, sweep_only=run_id), "race: sweep-only",
                                  repo, step.at_op)
        self._injected(FaultKind.MARK_SWEEP_RACE)

    # -- reconciler runs --

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

    # -- checks --

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

    # -- drain --

    async def _drain(self) -> bool:
        """Stop the faults, let everything recover, reap, reconcile; True if the trackers
        caught up."""
        o = self.o
        with self.console.status("soak: drain (faults stopped, trackers catching up)"):
            self.servers.proxy.faults.error_share = 0.0
            await self.flush()
            if self.tasks:  # held events released, reconciler runs finished
                await asyncio.wait(self.tasks, timeout=o.drain_timeout)
            # Reconciler runs queue behind one Spark session: let the scheduled ones finish.
            runs = [t for t in self.tasks if not t.done() and t.get_name().startswith(
                ("reconcile", "kill_reconciler", "mark_sweep_race"))]
            if runs:
                await asyncio.wait(runs, timeout=max(600.0, o.drain_timeout))
            for t in self.tasks:
                t.cancel()
            self.sup.check()
            await self.flush()
            await self._play_dlq_operator()
            caught_up = await self._await_trackers(o.drain_timeout)
            if o.rebuild:
                await self._await_rebuilds(o.drain_timeout)
            # Upload tokens expire and grace passes; then the reapers take the online garbage.
            deadline = time.monotonic() + o.drain_timeout
            await asyncio.sleep(o.upload_ttl_seconds + o.grace_seconds)
            while time.monotonic() < deadline:
                self.sup.check()
                listed = await self._listed()
                truth = self.model.truth()
                closed = set(self.fail_closed)
                pending = [a for a in truth.online_garbage & listed & set(self.model.objects)
                           if "*" not in closed
                           and self.model.objects[a].repository not in closed]
                if not pending:
                    break
                await asyncio.sleep(1.0)
        if o.reconcile:
            with self.console.status("soak: final reconciler runs"):
                await asyncio.sleep(o.min_age_seconds)
                for repo in sorted(self.model.repositories):
                    if repo in self.fail_closed or "*" in self.fail_closed:
                        # Its mark would fail closed after listing the whole namespace: a
                        # drain that grew with the run. (Its garbage counts as kept.)
                        self.runs.append(ReconcileRun("final mark_sweep", repo, o.ops, None,
                                                      False, "skipped: fail-closed"))
                        continue
                    await self._reconcile(ReconcileKind.MARK_SWEEP, repo, o.ops,
                                          retry_lease=True, label="final mark_sweep")
                # A key the sweep kept because its record changed since the mark (a reaper's
                # claim, a late event) is judged again by the next night's mark: run it for
                # the repositories whose final sweep kept marked keys.
                again = [run.repository for run in self.runs
                         if run.kind == "final mark_sweep" and run.status == "done"
                         and run.marked > run.confirmed]
                if again:
                    await asyncio.sleep(o.grace_seconds + o.min_age_seconds)
                for repo in again:
                    await self._reconcile(ReconcileKind.MARK_SWEEP, repo, o.ops,
                                          retry_lease=True, label="final mark_sweep (next night)")
        return caught_up

    async def _await_rebuilds(self, timeout: float) -> None:
        """A repository failed closed late in the load heals by its rebuild (the tracker
        prepares, the service exports, the tracker applies: a round every rebuild interval).
        Wait for it: the final mark skips a fail-closed repository, and its garbage would count
        as kept only because the soak stopped watching too early."""
        deadline = time.monotonic() + timeout
        while self.fail_closed and time.monotonic() < deadline:
            self.sup.check()
            await asyncio.sleep(0.5)

    async def _play_dlq_operator(self) -> None:
        """The operator's part for dead letters, after the load: each one came from a fault the
        soak injected. The miskeyed blocks are the service's real events: they are published
        again under their own key (`dlq replay` of the fixed event), and once the trackers
        applied them every dead letter's claim is lifted (`dlq resolve`). Without the replay a
        resolve would let go what only the dead-lettered events reference; without the
        resolve their holds would keep whole namespaces, and reclaim could not be judged."""
        ids = await asyncio.to_thread(self._dead_lettered_ids)
        ids.update(e.event_id for block in self.misdirected for e in block)
        # The model's own events among them, in the model's order (the fix is the key: an
        # event dead-lettered for any reason, its dead letter lost with a broker log or not,
        # is named by its hold's claim). Crafted ones (malformed, oversized) are not replayed.
        replay = [e for e in self.model.events if e.event_id in ids]
        t0 = time.time()
        await self._publish(replay)
        self.dlq_replayed = len(replay)
        t1 = time.time()
        caught_up = await self._await_trackers(self.o.drain_timeout)
        t2 = time.time()
        holds_before = await asyncio.to_thread(self._dlq_holds_snapshot)
        # As `dlq resolve --wait`: nothing is lifted unless the trackers applied the replay.
        if caught_up:
            self.dlq_resolved = await asyncio.to_thread(self._resolve_dead_letters)
        else:
            log.warning("soak.dlq_not_resolved", why="trackers not caught up with the replay")
        t3 = time.time()
        if not self.o.keep_workdir:
            return
        letters: list[Any] = []
        with contextlib.suppress(Exception):
            from hardelete.dlq import read as read_dlq

            letters = [{"id": d.id, "reason": d.reason[:120], "key": d.key,
                        "event_id": (d.body or {}).get("event_id"), "at": d.timestamp_ms,
                        "claim": d.claim} for d in await read_dlq(self.settings)]
        with contextlib.suppress(Exception):  # what the operator did, with the kept servers
            (self.servers.workdir / "dlq-operator.json").write_bytes(orjson.dumps({
                "published_at": t0, "acked_at": t1, "caught_up": caught_up,
                "caught_up_at": t2, "resolved_at": t3, "ids": sorted(ids),
                "replayed": [{"event_id": e.event_id, "type": e.TYPE,
                              "repository": e.repository,
                              "address": getattr(e, "address", None)} for e in replay],
                "holds_resolved": holds_before, "dead_letters": letters,
                "misdirected": [[e.event_id for e in b] for b in self.misdirected]},
                option=orjson.OPT_INDENT_2))

    def _dead_lettered_ids(self) -> set[str]:
        from hardelete.holds import DLQ, list_holds

        r = redis_sync(self.settings)
        try:
            return {str(c.get("event_id")) for h in list_holds(r, source=DLQ)
                    for c in h.claims.values() if isinstance(c, dict) and c.get("event_id")}
        finally:
            r.close()

    def _dlq_holds_snapshot(self) -> list[dict[str, Any]]:
        from hardelete.holds import DLQ, list_holds

        r = redis_sync(self.settings)
        try:
            return [{"repository": h.repository, "target": h.target, "kind": h.kind,
                     "claims": h.claims} for h in list_holds(r, source=DLQ)]
        finally:
            r.close()

    def _resolve_dead_letters(self) -> int:
        from hardelete.holds import DLQ, list_holds, remove_hold

        r = redis_sync(self.settings)
        n = 0
        try:
            for h in list_holds(r, source=DLQ):
                if h.sources() <= {DLQ}:  # an operator's or a restore's claim stays
                    remove_hold(r, h.target, repo=h.repository, prefix=h.kind == "prefix",
                                force=True)
                    n += 1
        finally:
            r.close()
        return n

    async def _await_trackers(self, timeout: float) -> bool:
        from core.clock import aredis_time_ms, atracker_horizon_ms

        deadline = time.monotonic() + timeout
        target = None
        while time.monotonic() < deadline:
            r = redis_async(self.settings)
            try:
                if target is None:
                    target = await aredis_time_ms(r)
                h = await atracker_horizon_ms(r)
                if h is not None and h >= target:
                    return True
            except Exception:
                pass
            finally:
                with contextlib.suppress(Exception):
                    await r.aclose()
            self.sup.check()
            await asyncio.sleep(0.25)
        return False

    # -- verdict --

    async def _verdict(self, caught_up: bool) -> SoakVerdict:
        listed = await self._check("end")
        now = time.time()
        written = set(self.model.objects)
        allowed = may_be_gone(self.model, now)
        incidents = await asyncio.to_thread(self._incidents)
        incident_addresses = {i.address for i in incidents}
        closed = set(self.fail_closed)
        live: list[LiveDeletion] = []
        late: list[LiveDeletion] = []
        r = redis_sync(self.servers.daemon_settings)
        s3 = s3_client(self.servers.daemon_settings)
        try:
            for address, seen in sorted(self.violations.items()):
                obj = self.model.objects[address]
                d = LiveDeletion(address, obj.repository, why_live(self.model, address, now),
                                 seen, event_history(self.model, address,
                                                     self.notes.get(address, [])))
                seen_op = self.violation_op.get(address, self.o.ops)
                d.faults_before = [f"{kind} at op {op}" for op, kind in self.fault_log
                                   if op <= seen_op]
                if address in self.late and address in incident_addresses:
                    d.attributed_to = (f"{self.late[address]}: the publisher broke the "
                                       "contract and the tracker raised an incident")
                    late.append(d)
                    continue
                if address in self.late:
                    d.attributed_to = f"{self.late[address]}, but NO incident: silent loss"
                d.explain = self._explain(r, s3, address, obj.repository)
                live.append(d)
        finally:
            r.close()
        lost = sorted({kind for _, kind in self.fault_log
                       if kind in {k.value for k in FAILS_CLOSED}})
        for inc in incidents:
            if inc.address in self.late:
                inc.legitimate, inc.why = True, self.late[inc.address]
            elif inc.type == "fail_closed" and lost:
                # the log lost records Redis never applied: failing closed is the safe answer
                inc.legitimate, inc.why = True, f"after {', '.join(lost)}"
            elif inc.type == "rebuilt" and not inc.address:
                # the record of a rebuild (an address would be an exported reference that
                # landed on a reaped one: a live object lost, never legitimate)
                inc.legitimate, inc.why = True, "rebuilt from the service's state export"
        # Without reconciler runs only the online path reclaims: its garbage is the target.
        garbage = (allowed if self.o.reconcile
                   else self.model.truth(now).online_garbage) & written
        # A dead-lettered event that named an address put a hold on it (SPEC safety 10): it is
        # kept until an operator resolves the dead letter, which the soak does not play.
        held = self._held()
        # Every repository counts, fail-closed ones included: failing closed is safe, but the
        # promise is that garbage still goes, so what they keep is garbage not reclaimed.
        reclaimable = {a for a in garbage if a not in held}
        left = sorted(reclaimable & listed)
        # The product's own reading of each object left (the first few): why it was kept.
        r = redis_sync(self.servers.daemon_settings)
        try:
            why_left = {a: self._explain(r, s3, a, self.model.objects[a].repository)
                        for a in left[:10]}
        finally:
            r.close()
        closed_garbage = sum(1 for a in left if "*" in closed
                             or self.model.objects[a].repository in closed)
        planned = Counter(s.action.value for s in self.steps
                          if isinstance(s.action, FaultKind))
        return SoakVerdict(
            seed=self.o.seed, ops=self.o.ops, repos=self.o.repos,
            faults_selected=sorted(k.value for k in self.o.faults),
            ops_by_kind=dict(sorted(self.ops_by_kind.items())), ops_refused=self.ops_refused,
            faults_planned=dict(sorted(planned.items())),
            faults_injected=dict(sorted(self.faults_injected.items())),
            fault_errors=self.fault_errors, reconciler_runs=self.runs,
            live_deleted=live, late_deleted=late,
            beyond_contract=dict(sorted(self.beyond_contract.items())),
            objects_written=len(written),
            rebuilds=sum(i.type == "rebuilt" and not i.address for i in incidents),
            rebuild_exports=self.rebuild_exports,
            dlq_replayed=self.dlq_replayed, dlq_resolved=self.dlq_resolved,
            reclaimable=len(reclaimable), reclaimed=len(reclaimable) - len(left),
            garbage_left_sample=left[:10], garbage_left_why=why_left,
            fail_closed_repos=sorted(closed),
            fail_closed_garbage=closed_garbage, fail_closed_periods=self.fail_closed_periods,
            incidents=incidents, dead_lettered=await self._dead_lettered(),
            log_regressions=await self._log_regressions(),
            daemons={n: {"starts": d.starts, "kills": d.kills, "exits": d.exits}
                     for n, d in self.sup.daemons.items()},
            checks=self.checks, tracker_caught_up=caught_up,
            max_horizon_lag_s=round(self.max_horizon_lag, 1),
            phases_s={k: round(v, 2) for k, v in self.phases.items()},
            elapsed_s=round(self._elapsed(), 2))

    def _explain(self, r: Any, s3: Any, address: str, repo: str) -> list[str]:
        from hardelete.status import explain_address

        try:
            ex = explain_address(r, self.servers.daemon_settings, address, repo, s3)
        except Exception as exc:
            return [f"explain failed: {type(exc).__name__}: {exc}"]
        return [f"state={ex.state}: {ex.verdict}", *ex.lines]

    def _held(self) -> set[str]:
        """Addresses under a hold: exact ones, and every object under a prefix hold (a
        dead-lettered event that named no readable address holds its whole namespace)."""
        r = redis_sync(self.settings)
        try:
            held = {a for repo in self.model.repositories
                    for a in r.hkeys(RepoKeys(repo).holds)}
            prefixes = tuple(p for repo in self.model.repositories
                             for p in r.hkeys(RepoKeys(repo).hold_prefixes))
            if prefixes:
                held |= {a for a in self.model.objects if a.startswith(prefixes)}
            return held
        finally:
            r.close()

    def _incidents(self) -> list[IncidentRecord]:
        r = redis_sync(self.settings)
        out = []
        try:
            for repo in sorted(r.smembers(REPOS)):
                for raw in r.lrange(RepoKeys(repo).incidents, 0, -1):
                    inc = orjson.loads(raw)
                    out.append(IncidentRecord(
                        repo, str(inc.get("address")), str(inc.get("type")), False,
                        "no deliberate contract violation explains it"))
        finally:
            r.close()
        return out

    async def _log_regressions(self) -> list[str]:
        """Partitions whose log ends below what a repository says it applied: the log went
        back (reset or lost tail) and new records reuse offsets the tracker skips."""
        from aiokafka import AIOKafkaConsumer

        c = AIOKafkaConsumer(bootstrap_servers=self.settings.kafka_bootstrap)
        out: list[str] = []
        r = redis_async(self.settings)
        try:
            await c.start()
            topic = self.settings.events_topic
            tps = await topic_partitions(c, topic)
            if not tps:
                raise RuntimeError(f"no partitions of {topic} in the broker's metadata")
            end_of = {tp.partition: int(end) for tp, end in (await c.end_offsets(tps)).items()}
            # hd:log holds what the trackers applied from each partition's log (epoch:offset:
            # fingerprint): an offset at or past the log's end there is a reset they missed.
            for fld, value in (await r.hgetall(LOG)).items():
                t, _, part = fld.rpartition(":")
                if t != topic or not part.isdigit():
                    continue
                _, offset, _ = value.split(":", 2)
                end = end_of.get(int(part))
                if end is not None and int(offset) >= end:
                    out.append(f"partition {part}: applied offset {offset} but the log ends at "
                               f"{end}")
        except Exception as exc:
            out.append(f"could not compare: {type(exc).__name__}: {exc}")
        finally:
            with contextlib.suppress(Exception):
                await c.stop()
            with contextlib.suppress(Exception):
                await r.aclose()
        return out

    async def _dead_lettered(self) -> int:
        from aiokafka import AIOKafkaConsumer

        c = AIOKafkaConsumer(bootstrap_servers=self.settings.kafka_bootstrap)
        try:
            await c.start()
            tps = await topic_partitions(c, self.settings.dlq_topic)
            ends = await c.end_offsets(tps) if tps else {}
            return int(sum(ends.values()))
        except Exception:
            return -1
        finally:
            with contextlib.suppress(Exception):
                await c.stop()


__all__ = ["Soak", "SoakOptions", "configure", "run_cli", "run_soak", "schedule",
           "soak_settings"]
