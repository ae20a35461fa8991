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
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from core.clients import redis_async, s3_client, split_s3_uri
from core.errors import UserError
from core.logs import get_logger
from core.settings import Settings
from schemas.layout import FAIL_CLOSED, REPOS, RepoKeys
from schemas.publisher import ensure_topics
from sim.model import Model, ModelError, ModelService, Op, Workload, manifest_bytes, seeded_ids
from sim.soak_drain import Drain
from sim.soak_faults import FaultInjection
from sim.soak_judge import Judging
from sim.soak_plan import (
    SURVIVED,
    FaultKind,
    ReconcileKind,
    Step,
    default_rates,
    parse_faults,
    plan,
)
from sim.soak_procs import PYTHON_CLI, SoakServers, Supervisor, make_daemons, start_servers
from sim.soak_verdict import FailClosedPeriod, SoakVerdict, print_verdict

log = get_logger(__name__)


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
    reaper_command: tuple[str, ...] = PYTHON_CLI

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
                                  command=PYTHON_CLI, reaper_command=options.reaper_command)
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


class Soak(FaultInjection, Drain, Judging):
    """One soak run: the load and the steps of the plan; its parts are in their own files."""

    def __init__(self, o: SoakOptions, servers: SoakServers, supervisor: Supervisor,
                 run_id: str, console: Console, started: float) -> None:
        settings = servers.settings
        super().__init__(o, servers, supervisor, run_id, console, started, PipelinedService(
            settings, s3_client(settings), None,
            model=Model.from_settings(settings, new_id=seeded_ids(o.seed))))
        self.steps = schedule(o)

    # -- plumbing --

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

    # -- reconciler runs --

    # -- checks --

    # -- drain --

    # -- verdict --


__all__ = ["Soak", "SoakOptions", "configure", "run_cli", "run_soak", "schedule",
           "soak_settings"]
