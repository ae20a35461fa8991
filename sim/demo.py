"""``hardelete demo``: run the model service on the embedded stack and show what it did.

Starts Apache Kafka, Redis and MinIO (or uses the ones the settings point at), creates the topics,
runs a seeded workload through :class:`sim.model.ModelService` (real objects, Parquet
manifests and events), then prints a summary and checks the model's ground truth against a
direct listing of the store.

A tracker runs beside the model service from the start (so it tracks the workload as it
happens); once the model phase is checked, a reaper runs too, and the online phase waits until
every address the model calls online garbage is gone, then reports what was reaped, that no live
object was deleted, and what is left for the nightly reconciler. Finally one reconciler run per
repository (local Spark) marks and sweeps the rest, retention included (commits are back-dated
over ``--span-days``), and is checked against the model's reconciler garbage.

The demo uses a short grace window and upload-token lifetime (``--grace``, ``--upload-ttl``)
so that it finishes in seconds; those values are unsafe for production and are allowed here
explicitly.

Each phase is a function returning a dataclass; :func:`print_summary` and :func:`summary_json`
only present a :class:`DemoResult`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from core.clients import redis_async, s3_client
from core.clock import aredis_time_ms, await_horizon
from core.continuity_store import AsyncContinuityStore
from core.errors import UserError
from core.logs import get_logger
from core.settings import Settings
from reaper.daemon import Reaper
from reconciler.mark import KEPT_CATEGORIES
from schemas.outbox import Outbox
from schemas.publisher import Publisher, ensure_topics
from sim.model import (
    PUBLISH_MODES,
    Category,
    Model,
    ModelService,
    PublishMode,
    StoreCheck,
    Workload,
    WorkloadSummary,
)
from sim.sequenced import SequencedService
from sim.stack import StackError, embedded_stack
from sim.testing import redis_now
from tracker.daemon import Tracker

if TYPE_CHECKING:
    from sim.model import Op

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class DemoOptions:
    seed: int = 42
    ops: int = 300
    repos: int = 1
    branches: int = 3
    bucket: str = "hardelete-demo"
    publish_mode: PublishMode = "per-op"
    payload_cap: int = 1024
    grace_seconds: float = 2.0
    upload_ttl_seconds: float = 2.0
    online_timeout: float = 90.0
    # Commits are back-dated over span_days so that retention (retention_days) has committed
    # history to expire: the reconciler's part of the job.
    span_days: float = 30.0
    retention_days: float = 7.0
    reconcile: bool = True
    # Repositories and their namespaces are named after the run, so that runs against
    # long-lived external servers never share a repository id or a namespace.
    run_id: str = ""

    def workload(self) -> Workload:
        try:
            return Workload(seed=self.seed, ops=self.ops, repos=self.repos,
                            branches=self.branches, bucket=self.bucket,
                            name=f"demo-{self.run_id}", span_days=self.span_days,
                            retention_days=self.retention_days)
        except ValueError as exc:
            raise UserError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class Endpoints:
    kafka: str
    redis: str
    s3: str
    started: tuple[str, ...]  # parts this run started itself (the others were configured)


@dataclass(frozen=True, slots=True)
class ModelPhase:
    summary: WorkloadSummary
    store: StoreCheck


@dataclass(frozen=True, slots=True)
class OnlinePhase:
    """What the tracker and the reaper did with the workload, checked against the truth."""

    objects_written: int
    garbage_online: int  # objects the model says the online path may delete
    reaped: int  # of those, gone from the store
    live_deleted: int  # objects deleted that were NOT online garbage: must be 0
    garbage_left: int  # objects still in the store that are garbage only the reconciler sees
    left_by_kind: dict[str, int]
    events_applied: int  # the service's events, its relay's watermarks, the reaper's records
    events_committed: int  # the service's events, numbered in its outbox
    events_certified: int  # of those, applied in gapless order (the continuity prefixes)
    reaper_records: int  # addresses_reaped records the reaper published
    dead_lettered: int
    incidents: int
    latency_p50_s: float | None
    latency_p95_s: float | None
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.live_deleted == 0 and self.reaped == self.garbage_online and not self.incidents


@dataclass(frozen=True, slots=True)
class ReconcilePhase:
    """One reconciler run per repository, checked against the model's reconciler garbage."""

    runs: list[dict[str, object]]  # per repository: run id, marked, confirmed, categories
    expected: int  # objects the model says one run must delete (retention applied)
    deleted: int  # objects gone from the store after the runs
    live_deleted: int  # deleted but not garbage per the model: must be 0
    garbage_left: int  # expected garbage still in the store
    live_left: int  # objects in the store after the runs (all live per the model)

    @property
    def ok(self) -> bool:
        return (self.live_deleted == 0 and self.garbage_left == 0
                and all(r["success"] for r in self.runs))


@dataclass(frozen=True, slots=True)
class DemoResult:
    options: DemoOptions
    endpoints: Endpoints
    model: ModelPhase
    online: OnlinePhase
    reconcile: ReconcilePhase | None
    elapsed_seconds: float

    @property
    def ok(self) -> bool:
        return (self.model.store.ok and self.online.ok
                and (self.reconcile is None or self.reconcile.ok))


def configure(parser: argparse.ArgumentParser) -> None:
    defaults = DemoOptions()
    parser.add_argument("--seed", type=int, default=defaults.seed, help="workload seed")
    parser.add_argument("--ops", type=int, default=defaults.ops,
                        help="random operations after set-up (MinIO takes ~450 PUT/s)")
    parser.add_argument("--repos", type=int, default=defaults.repos)
    parser.add_argument("--branches", type=int, default=defaults.branches,
                        help="branches per repository at the start")
    parser.add_argument("--bucket", default=defaults.bucket)
    parser.add_argument("--publish-mode", choices=PUBLISH_MODES, default=defaults.publish_mode,
                        help="publish after each operation, or all at the end")
    parser.add_argument("--payload-cap", type=int, default=defaults.payload_cap,
                        help="largest object body written, in bytes")
    parser.add_argument("--grace", type=float, default=defaults.grace_seconds,
                        help="grace window in seconds (demo only: unsafe in production)")
    parser.add_argument("--upload-ttl", type=float, default=defaults.upload_ttl_seconds,
                        help="upload token lifetime in seconds")
    parser.add_argument("--span-days", type=float, default=defaults.span_days,
                        help="back-date commits over this many days (retention has work)")
    parser.add_argument("--retention-days", type=float, default=defaults.retention_days)
    parser.add_argument("--no-reconcile", action="store_true",
                        help="skip the reconciler phase (no Spark)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run_cli(settings: Settings, args: argparse.Namespace) -> int:
    if args.ops < 0 or args.repos < 1 or args.branches < 1 or args.payload_cap < 0:
        raise UserError("--ops and --payload-cap must be >= 0, --repos and --branches >= 1")
    if args.grace < 0 or args.upload_ttl <= 0:
        raise UserError("--grace must be >= 0 and --upload-ttl > 0")
    if args.span_days < 0 or args.retention_days < 0:
        raise UserError("--span-days and --retention-days must be >= 0")
    options = DemoOptions(seed=args.seed, ops=args.ops, repos=args.repos,
                          branches=args.branches, bucket=args.bucket,
                          publish_mode=cast(PublishMode, args.publish_mode),
                          payload_cap=args.payload_cap, run_id=uuid.uuid4().hex[:8],
                          grace_seconds=args.grace, upload_ttl_seconds=args.upload_ttl,
                          span_days=args.span_days, retention_days=args.retention_days,
                          reconcile=not args.no_reconcile)
    result = run_demo(settings, options, Console(stderr=True))
    if args.json:
        sys.stdout.write(summary_json(result).decode() + "\n")
    else:
        print_summary(result, Console())
    return 0 if result.ok else 1


def run_demo(settings: Settings, options: DemoOptions, progress_console: Console) -> DemoResult:
    """Start the stack, run every phase, stop the stack."""
    options.workload()  # a bad option fails before any server starts
    started = time.monotonic()
    demo_settings = settings.replace(grace_seconds=options.grace_seconds, allow_unsafe_grace=True,
                                     upload_ttl_seconds=options.upload_ttl_seconds,
                                     reconcile_min_age_seconds=0.0)
    with _stack(demo_settings, progress_console) as (live, endpoints):
        model, online, recon = asyncio.run(_run_phases(live, options, progress_console))
    return DemoResult(options, endpoints, model, online, recon,
                      round(time.monotonic() - started, 3))


async def _run_phases(settings: Settings, options: DemoOptions, console: Console
                      ) -> tuple[ModelPhase, OnlinePhase, ReconcilePhase | None]:
    await ensure_topics(settings)
    tracker = Tracker(settings, name="demo-tracker")
    tracker.start()
    try:
        # The model service certifies its history: an outbox and its relay (schemas/README.md,
        # "Continuity"), as a service must for hardelete to delete anything online.
        async with SequencedService(settings) as certifying:
            model, service = await run_model_phase(settings, options, console,
                                                   certifying.outbox)
            online = await run_online_phase(settings, options, service, tracker, console)
            # The tracker keeps running: the reconciler's cutoff follows its progress.
            recon = (await run_reconcile_phase(settings, service, console)
                     if options.reconcile else None)
    finally:
        await tracker.stop()
    return model, online, recon


async def run_reconcile_phase(settings: Settings, service: ModelService,
                              console: Console) -> ReconcilePhase:
    """One reconciler run per repository on local Spark; compare with the model's garbage."""
    from pyspark.sql import SparkSession

    from reconciler.job import RunOptions, reconcile
    from reconciler.spark import get_spark

    model = service.model
    before = model.truth().objects & set(await _listing(service))
    shared = SparkSession.getActiveSession() is not None  # someone else's: do not stop it
    with console.status("reconciler: starting Spark"):
        spark = await asyncio.to_thread(get_spark, settings)
    runs: list[dict[str, object]] = []
    expected: set[str] = set()
    try:
        for repo in sorted(model.repositories):
            # The service's own list of its uncommitted addresses: the reconciler's second
            # witness beside the tracker's mirror (a lost event never turns into a delete).
            # The run's cutoff comes first: the export must be made after it to witness
            # everything staged before it (a tracker whose horizon follows the clock closely
            # could otherwise put the cutoff after an export made a moment ago).
            cutoff_ms = await redis_now(settings) - 1
            await service.write_uncommitted_export(repo)
            with console.status(f"reconciler: mark and sweep of {repo}"):
                summary = await asyncio.to_thread(
                    reconcile, spark, settings, RunOptions(repo, uncommitted_export="namespace",
                                                           cutoff_ms=cutoff_ms))
            mark = summary.get("mark") or {}
            sweep = summary.get("sweep") or {}
            runs.append({
                "repository": repo, "run_id": summary.get("run_id"),
                "success": bool(summary.get("success")), "error": summary.get("error"),
                "marked": mark.get("marked", 0), "confirmed": sweep.get("confirmed", 0),
                "categories": {k: v.get("count", 0) for k, v in
                               (mark.get("categories") or {}).items()},
            })
            expected |= expected_sweep(model, repo, summary, settings)
    finally:
        if not shared:
            await asyncio.to_thread(spark.stop)
    expected &= before
    after = before & set(await _listing(service))
    deleted = before - after
    return ReconcilePhase(runs=runs, expected=len(expected), deleted=len(deleted),
                          live_deleted=len(deleted - expected),
                          garbage_left=len(expected & after), live_left=len(after))


def expected_sweep(model: Model, repo: str, summary: Mapping[str, Any],
                   settings: Settings) -> frozenset[str]:
    """The model's answer to one reconciler run of ``repo`` (its summary): the garbage, with
    retention computed at the run's clock and the tracker horizon the run saw."""
    from reconciler.retention import RetentionPolicy, retained_commits

    r = model.repository(repo)
    graph = model.commit_graph(repo)
    heads = {b: br.head for b, br in r.branches.items() if br.head}
    retained = retained_commits(
        graph, heads, dict(r.tags),
        RetentionPolicy(r.default_retention_days, r.branch_retention_days),
        int(summary.get("now_ms") or time.time() * 1000) / 1000)
    horizon = (summary.get("tracker") or {}).get("grace_horizon_ms")
    return model.reconciler_garbage(
        retained, repository=repo, grace_seconds=settings.grace_for(repo),
        horizon=None if horizon is None else int(horizon) / 1000)


async def run_online_phase(settings: Settings, options: DemoOptions, service: ModelService,
                           tracker: Tracker, console: Console) -> OnlinePhase:
    """Run a reaper until the model's online garbage is gone (or the timeout); check safety."""
    model = service.model
    written = model.truth().objects
    reaper = Reaper(settings, reaper_id="demo-reaper")
    latencies: list[float] = []
    deadline = time.monotonic() + options.online_timeout
    timed_out = False
    try:
        with console.status("tracker and reaper at work") as status:
            while True:
                report = await reaper.run_once()
                for repo in report.repos:
                    latencies += repo.latencies_s
                listed = set(await _listing(service))
                truth = model.truth()
                garbage = truth.online_garbage & written
                gone = written - listed
                pending = len(garbage - gone) + len(truth.issued_unexpired & written)
                status.update(f"tracker and reaper at work: {len(gone)} reaped, "
                              f"{pending} garbage still inside its window")
                if not pending:
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                await asyncio.sleep(0.2)
        # The reaper's last records of its deletes are applied too before counting.
        r = redis_async(settings)
        try:
            with contextlib.suppress(TimeoutError):
                await await_horizon(r, await aredis_time_ms(r), timeout=30)
            committed, certified = await _certified(r, service)
        finally:
            await r.aclose()
    finally:
        await reaper.close()
    truth = model.truth()
    garbage = truth.online_garbage & written
    gone = written - listed
    left = {"leaked": len(truth.leaked & listed), "superseded": len(truth.superseded & listed),
            "online garbage not yet reaped": len(garbage - gone)}
    latencies.sort()

    def pct(q: float) -> float | None:
        return round(latencies[int(q * (len(latencies) - 1))], 3) if latencies else None

    return OnlinePhase(
        objects_written=len(written), garbage_online=len(garbage), reaped=len(garbage & gone),
        live_deleted=len(gone - garbage), garbage_left=sum(left.values()), left_by_kind=left,
        events_applied=tracker.applied, events_committed=committed,
        events_certified=certified, reaper_records=reaper.records_published,
        dead_lettered=tracker.dead_lettered,
        incidents=tracker.incidents, latency_p50_s=pct(0.5), latency_p95_s=pct(0.95),
        timed_out=timed_out)


async def _certified(r: Any, service: ModelService) -> tuple[int, int]:
    """The service's events numbered in its outbox, and those the tracker applied in gapless
    order (the prefix of each stripe), over every repository."""
    outbox = service.model.outbox
    if outbox is None:
        return 0, 0
    store = AsyncContinuityStore(r)
    committed = certified = 0
    for repo in sorted(service.model.repositories):
        counters = outbox.counters(repo)
        if counters is None:
            continue
        committed += sum(counters.seqs)
        for k in range(counters.stripes):
            certified += (await store.read(repo, k)).prefix
    return committed, certified


async def _listing(service: ModelService) -> list[str]:
    out: list[str] = []
    for repo in service.model.repositories:
        out += await service.list_namespace(repo)
    return out


@contextlib.contextmanager
def _stack(settings: Settings, console: Console) -> Iterator[tuple[Settings, Endpoints]]:
    with contextlib.ExitStack() as resources:
        try:
            with console.status("starting the embedded stack"):
                stack = resources.enter_context(embedded_stack(settings))
        except StackError as exc:
            raise UserError(f"cannot start the embedded stack: {exc}") from None
        s = stack.settings
        yield s, Endpoints(kafka=s.kafka_bootstrap, redis=s.redis_url, s3=s.s3_endpoint_url,
                           started=tuple(sorted(stack.servers)))


async def run_model_phase(settings: Settings, options: DemoOptions, console: Console,
                          outbox: Outbox | None = None) -> tuple[ModelPhase, ModelService]:
    """Run the seeded workload through the model service; check the store against the truth.
    With ``outbox`` the service commits its events there (a relay publishes them)."""
    workload = options.workload()
    await ensure_topics(settings)
    s3 = s3_client(settings)
    async with Publisher(settings) as publisher:
        service = ModelService(settings, s3, publisher, publish_mode=options.publish_mode,
                               payload_cap=options.payload_cap,
                               model=Model.from_settings(settings, outbox=outbox))
        with _progress(console) as progress:
            task = progress.add_task("model service", total=workload.ops + workload.setup_ops)

            def advance(_op: Op) -> None:
                progress.advance(task)

            summary = await service.run_workload(workload, on_op=advance)
        store = await service.verify_store()
    log.info("demo.model_phase", ok=store.ok, objects=store.listed_data,
             manifests=store.listed_manifests)
    return ModelPhase(summary, store), service


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True)


# --- presentation -----------------------------------------------------------------------------


def _reconcile_table(result: DemoResult) -> Table:
    rc = result.reconcile
    assert rc is not None
    t = Table(title=f"Reconciler: mark and sweep on Spark (retention "
                    f"{result.options.retention_days:g} days, commits over "
                    f"{result.options.span_days:g} days)", title_justify="left")
    t.add_column("what")
    t.add_column("count", justify="right")
    for run in rc.runs:
        t.add_row(f"run {run['run_id']} ({run['repository']})",
                  "ok" if run["success"] else f"[red]failed: {run['error']}")
        t.add_row("  marked", str(run["marked"]))
        t.add_row("  deletes the store confirmed", str(run["confirmed"]))
        cats = run["categories"]
        if isinstance(cats, dict):
            for label, kept in (("kept", True), ("marked", False)):
                parts = [f"{c}={n}" for c, n in sorted(cats.items())
                         if n and (c in KEPT_CATEGORIES) == kept]
                t.add_row(f"  {label} by category", ", ".join(parts) or "-")
    t.add_row("garbage per the model (retention applied)", str(rc.expected))
    t.add_row("deleted from the store", str(rc.deleted))
    style = "bold green" if rc.live_deleted == 0 else "bold red"
    t.add_row(f"[{style}]live objects deleted (must be 0)", f"[{style}]{rc.live_deleted}")
    t.add_row("garbage left", str(rc.garbage_left))
    t.add_row("objects left (all live)", str(rc.live_left))
    return t


def summary_json(result: DemoResult) -> bytes:
    body = dataclasses.asdict(result)
    body["ok"] = result.ok
    return orjson.dumps(body, option=orjson.OPT_INDENT_2)


def print_summary(result: DemoResult, console: Console) -> None:
    s, store = result.model.summary, result.model.store

    ops = Table(title=f"Operations (seed {result.options.seed})", title_justify="left")
    ops.add_column("operation")
    ops.add_column("count", justify="right")
    for kind, count in s.ops_by_kind.items():
        ops.add_row(kind, str(count))
    ops.add_row("[bold]total", f"[bold]{s.ops}")

    effects = Table(title="Side effects", title_justify="left")
    effects.add_column("what")
    effects.add_column("count", justify="right")
    effects.add_row("objects written", str(s.objects_written))
    effects.add_row("bytes written", f"{s.bytes_written:,}")
    effects.add_row("manifests written", str(s.manifests_written))
    effects.add_row(f"events published ({s.publish_mode})", str(s.events_published))
    for etype, count in s.events_by_type.items():
        effects.add_row(f"  {etype}", str(count))

    truth = Table(title="Ground truth vs the store", title_justify="left")
    truth.add_column("category")
    truth.add_column("addresses", justify="right")
    truth.add_column("objects listed", justify="right")
    truth.add_column("after token expiry", justify="right")
    counts = dataclasses.asdict(s.truth)
    later = dataclasses.asdict(s.truth_at_expiry)
    for category in Category:
        truth.add_row(category.value.replace("_", " "), str(counts[category.value]),
                      str(store.listed_by_category.get(category.value, 0)),
                      str(later[category.value]))
    truth.add_row("[bold]objects", f"[bold]{s.truth.objects}", f"[bold]{store.listed_data}",
                  str(s.truth_at_expiry.objects))
    truth.add_row("manifests", str(s.manifests_written), str(store.listed_manifests), "")

    o = result.online
    online = Table(title=f"Online path: tracker + reaper (grace {result.options.grace_seconds:g}s,"
                         f" upload tokens {result.options.upload_ttl_seconds:g}s)",
                   title_justify="left")
    online.add_column("what")
    online.add_column("count", justify="right")
    online.add_row("objects written", str(o.objects_written))
    online.add_row("garbage per the model (online-reclaimable)", str(o.garbage_online))
    online.add_row("reaped by the reaper", str(o.reaped))
    style = "bold green" if o.live_deleted == 0 else "bold red"
    online.add_row(f"[{style}]live objects deleted (must be 0)", f"[{style}]{o.live_deleted}")
    online.add_row("garbage left for the reconciler", str(o.garbage_left))
    for kind, n in o.left_by_kind.items():
        online.add_row(f"  {kind}", str(n))
    online.add_row("service events numbered in its outbox / applied in order",
                   f"{o.events_committed} / {o.events_certified}")
    online.add_row("events applied by the tracker (watermarks and the reaper's records "
                   "included)", str(o.events_applied))
    online.add_row("  records of confirmed deletes the reaper published", str(o.reaper_records))
    online.add_row("dead-lettered events", str(o.dead_lettered))
    online.add_row("incidents", str(o.incidents))
    if o.latency_p50_s is not None:
        online.add_row("unreferenced -> deleted p50 / p95 (s)",
                       f"{o.latency_p50_s} / {o.latency_p95_s}")

    console.print(ops)
    console.print(effects)
    console.print(truth)
    console.print(online)
    if result.reconcile is not None:
        console.print(_reconcile_table(result))
    e = result.endpoints
    console.print(f"kafka {e.kafka}  s3 {e.s3}  redis {e.redis}  "
                  f"(started here: {', '.join(e.started) or 'none'})  "
                  f"{result.elapsed_seconds:.1f}s")
    if o.timed_out:
        console.print("[red]the online phase timed out before all garbage was reaped[/red]")
    if result.ok:
        console.print("[green]store matches the ground truth[/green]: every listed object is in "
                      "exactly one category and every object the model wrote is there; the "
                      "reaper deleted exactly the online garbage and nothing live"
                      + ("; the reconciler deleted exactly the rest of the garbage"
                         if result.reconcile is not None else ""))
    else:
        console.print("[red]store does NOT match the ground truth[/red]")
        for label, items in (("missing", store.missing), ("unexpected", store.unexpected),
                             ("missing manifests", store.missing_manifests)):
            for item in items[:10]:
                console.print(f"  {label}: {item}")
            if len(items) > 10:
                console.print(f"  ... and {len(items) - 10} more {label}")
