"""``hardelete reconcile``: the nightly mark and sweep of one repository.

Order of a run (see reconciler/README.md):

1. lease (one reconciler per repository) and **cutoff first**: ``min(Redis now, tracker
   watermark) - reconcile_min_age_seconds`` (or an earlier ``--cutoff``), fixed before anything
   is listed;
2. export the tracker's address records (live verdicts) to the report, BEFORE reading the
   commits (seed 002: uncommitted first, so a commit landing in between is seen by one or the
   other);
3. commit graph -> retention/expiration -> manifests of the retained commits;
4. listing of the namespace (slices in Spark tasks, or an inventory);
5. classify and mark (Parquet + summary.json); any error so far: the run fails, nothing is
   deleted;
6. sweep (unless ``--dry-run``), with an online re-check of every batch;
7. cross-check the mark against the online state.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hardelete import UserError
from hardelete.clients import redis_sync, s3_client
from hardelete.logs import get_logger
from hardelete.settings import Settings
from reconciler.committed import export_df, manifest_keys_df, plan_retention
from reconciler.errors import ReconcileError, SweepRefused
from reconciler.listing import (
    discover_units,
    inventory_df,
    inventory_files,
    listing_df,
    newest_slice,
    select_optimized,
)
from reconciler.mark import LISTING_SCHEMA, MARKED_CATEGORIES, classify_df, tally_df
from reconciler.report import (
    REPORT_FORMAT,
    is_swept_baseline,
    iso,
    new_run_id,
    previous_runs,
    read_summary,
    write_summary,
)
from reconciler.s3io import Namespace, cached_s3, put_parquet
from reconciler.state import (
    Lease,
    export_addresses,
    load_namespace,
    load_repo,
    redis_now_ms,
    tracker_watermark_ms,
)
from reconciler.sweep import SweepStats, sweep
from reconciler.ui import NullUi, RichUi, summary_table

log = get_logger("reconciler")

MARK_PART_ROWS = 1_000_000
SAMPLE = 20


@dataclass
class RunOptions:
    repo: str
    dry_run: bool = False
    sweep_only: str | None = None
    optimized: bool = False
    cutoff_ms: int | None = None
    inventory: str | None = None
    expire_older_than_days: float | None = None
    expiration_mode: str = "seed"  # seed 001 reading: "seed" | "icechunk" (retention.py)
    delete_expired_refs: bool = False  # refs at expired snapshots no longer retain (Icechunk)
    ignore_tracker_progress: bool = False
    max_mark_age_hours: float = 24.0
    lease_ttl_ms: int = 60_000
    recheck: bool = True
    tracker_wait_s: float = 120.0


def _ms_now() -> int:
    return int(time.time() * 1000)


# ------------------------------------------------------------------------------- cutoff

def decide_cutoff(now_ms: int, watermark_ms: int | None, min_age_s: float,
                  requested_ms: int | None, *, ignore_tracker: bool = False) -> tuple[int, str]:
    """The run's cutoff (ms) and where it came from. Objects at/after it are never marked.

    ``min(now, tracker watermark) - min_age``: the margin is measured against what the
    tracker has applied, so a lagging tracker moves the cutoff back (SPEC safety 2). A
    requested cutoff may only be earlier.
    """
    base = now_ms
    source = "min_age"
    if watermark_ms is None:
        if not ignore_tracker:
            raise ReconcileError(
                "tracker progress is unknown (no hd:progress): the tracker's state cannot be "
                "trusted to be complete; run the tracker, or pass --ignore-tracker-progress")
    elif watermark_ms < now_ms:
        base = watermark_ms
        source = "tracker_watermark"
    limit = base - int(min_age_s * 1000)
    if requested_ms is None:
        return limit, source
    if requested_ms > now_ms - int(min_age_s * 1000):
        raise UserError(f"--cutoff {iso(requested_ms)} is later than now minus "
                        f"reconcile_min_age_seconds ({iso(now_ms - int(min_age_s * 1000))})")
    if requested_ms > limit:
        return limit, source
    return requested_ms, "requested"


def parse_cutoff(text: str) -> int:
    """ISO-8601 (naive means UTC) or epoch seconds -> ms."""
    try:
        return int(float(text) * 1000)
    except ValueError:
        pass
    try:
        value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise UserError(f"--cutoff {text!r}: expected ISO-8601 or epoch seconds") from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return int(value.timestamp() * 1000)


# ------------------------------------------------------------------------------ the run

def _write_mark(spark: Any, settings: Settings, ns: Namespace, run_id: str,
                marked: Any) -> list[str]:
    """Write the marked rows as Parquet parts from the tasks; the part keys come back."""
    prefix = ns.report_prefix(run_id) + "mark/"
    token = uuid.uuid4().hex[:6]
    columns = ("key", "size", "last_modified", "category")

    def write(index: int, rows: Iterator[Any]) -> Iterator[tuple[str, int]]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        attempt = ctx.attemptNumber() if ctx else 0
        s3 = cached_s3(settings)
        cols: dict[str, list[Any]] = {c: [] for c in columns}
        seq = 0

        def flush() -> tuple[str, int] | None:
            nonlocal seq
            n = len(cols["key"])
            if not n:
                return None
            key = f"{prefix}part-{index:05d}-{attempt}-{seq:03d}-{token}.parquet"
            put_parquet(s3, ns.bucket, key, cols)
            seq += 1
            for c in cols.values():
                c.clear()
            return key, n

        for row in rows:
            for c in columns:
                cols[c].append(row[c])
            if len(cols["key"]) >= MARK_PART_ROWS:
                done = flush()
                if done:
                    yield done
        done = flush()
        if done:
            yield done

    parts = marked.select(*columns).rdd.mapPartitionsWithIndex(write).collect()
    return sorted(p for p, _ in parts)


def _head_rows(spark: Any, settings: Settings, ns: Namespace, keys_df: Any) -> Any:
    """HEAD each key inside tasks: (key, size, last_modified) of those that still exist."""

    def head(rows: Iterator[Any]) -> Iterator[tuple[str, int, int]]:
        s3 = cached_s3(settings)
        for row in rows:
            rel = row["key"]
            try:
                h = s3.head_object(Bucket=ns.bucket, Key=ns.key(rel))
            except Exception as exc:
                code = str(getattr(exc, "response", {}).get("Error", {}).get("Code"))
                if code in ("404", "NoSuchKey", "NotFound"):
                    continue
                raise
            yield rel, int(h["ContentLength"]), int(h["LastModified"].timestamp() * 1000)

    return spark.createDataFrame(keys_df.select("key").rdd.mapPartitions(head), LISTING_SCHEMA,
                                 verifySchema=False)


def _sample(df: Any, col: str = "key") -> list[str]:
    return [str(r[col]) for r in df.select(col).limit(SAMPLE).collect()]


def _crosscheck(classified: Any, committed: Any, known: Any) -> dict[str, Any]:
    """Divergences between the mark and the online (tracker) state."""
    from pyspark.sql import functions as F

    listed = classified.select("key")
    live_missing = (known.filter(F.col("live") & (F.col("reason") == "staged"))
                    .join(listed, "key", "left_anti"))
    committed_missing = committed.join(listed, "key", "left_anti")
    unref_not_marked = (known.filter((~F.col("live")) & (F.col("kind") == "unreferenced"))
                        .select("key")
                        .join(classified.filter(F.col("category").isin("reserved",
                                                                       "committed",
                                                                       "uncommitted")),
                              "key"))
    out: dict[str, Any] = {}
    for name, df in (("live_in_redis_missing_from_store", live_missing),
                     ("committed_missing_from_store", committed_missing),
                     ("unreferenced_online_not_marked", unref_not_marked)):
        n = df.count()
        out[name] = {"count": n, "sample": _sample(df) if n else []}
    return out


class Run:
    """One reconcile invocation; ``summary`` is what lands in summary.json."""

    def __init__(self, spark: Any, settings: Settings, opts: RunOptions, ui: Any = None):
        self.spark = spark
        self.settings = settings
        self.opts = opts
        self.ui = ui or NullUi()
        self.r = redis_sync(settings)
        self.s3 = s3_client(settings)
        self.summary: dict[str, Any] = {}

    # -- helpers
    def _save(self) -> None:
        self.summary["updated_at"] = iso(_ms_now())
        write_summary(self.s3, self.ns, self.summary)

    def close(self) -> None:
        self.r.close()

    # -- entry points
    def run(self) -> dict[str, Any]:
        import redis

        try:
            self.ns = load_namespace(self.r, self.opts.repo)
        except ReconcileError as exc:
            raise UserError(str(exc)) from None
        except redis.exceptions.ConnectionError as exc:
            raise UserError(f"cannot reach the tracker's Redis ({exc}): nothing was done") \
                from None
        if self.opts.sweep_only:
            return self.sweep_only(self.opts.sweep_only)
        return self.mark_and_sweep()

    def mark_and_sweep(self) -> dict[str, Any]:
        o = self.opts
        now_ms = redis_now_ms(self.r)
        run_id = new_run_id(now_ms)
        self.summary = {
            "format": REPORT_FORMAT, "run_id": run_id, "repository": o.repo,
            "namespace": self.ns.uri, "mode": "optimized" if o.optimized else "clean",
            "dry_run": o.dry_run, "started_at": iso(now_ms), "now_ms": now_ms, "success": False,
            "status": "running", "error": None,
        }
        lease = Lease(self.r, o.repo, run_id, o.lease_ttl_ms)
        lease.acquire()
        try:
            self._save()
            t0 = time.monotonic()
            try:
                marked_parts = self._mark(now_ms, lease)
            except Exception as exc:
                self.summary.update(success=False, status="failed",
                                    error=f"{type(exc).__name__}: {exc}")
                self.summary["sweep"] = {"status": "not_run",
                                         "reason": "the mark failed: nothing is deleted"}
                log.error("reconcile.mark_failed", run_id=run_id, error=str(exc),
                          trace=traceback.format_exc(limit=3))
                self._save()
                return self.summary
            self.summary["timings"]["mark_s"] = round(time.monotonic() - t0, 3)
            self.summary.update(success=True, status="marked")
            self._save()
            if o.dry_run:
                self.summary["sweep"] = {"status": "not_run", "reason": "dry run"}
                try:
                    with self.ui.phase("re-check the mark online (dry run: no deletes)"):
                        stats = self._sweep(run_id, marked_parts, lease, delete=False)
                    self.summary["crosscheck"]["marked_but_referenced_online"] = {
                        "count": stats.skipped_live,
                        "sample": stats.samples.get("skipped_live", [])}
                except Exception as exc:  # the mark stands; only the re-check is missing
                    self.summary["crosscheck"]["marked_but_referenced_online"] = {
                        "error": f"{type(exc).__name__}: {exc}"}
                self.summary["status"] = "done"
            else:
                self._do_sweep(run_id, marked_parts, lease)
            self.summary["finished_at"] = iso(_ms_now())
            self._save()
            return self.summary
        finally:
            lease.release()

    def sweep_only(self, run_id: str) -> dict[str, Any]:
        summary = read_summary(self.s3, self.ns, run_id)
        if summary is None:
            raise SweepRefused(f"no report for run {run_id!r} in {self.ns.uri}")
        if summary.get("repository") != self.opts.repo:
            raise SweepRefused(f"run {run_id} is of repository {summary.get('repository')!r}")
        if not summary.get("success") or summary.get("status") == "running":
            raise SweepRefused(f"run {run_id} is not a successful mark "
                               f"(status {summary.get('status')}, error {summary.get('error')})")
        marked_at = summary.get("marked_at_ms") or 0
        now_ms = redis_now_ms(self.r)
        age_h = (now_ms - int(marked_at)) / 3_600_000
        if age_h > self.opts.max_mark_age_hours:
            raise SweepRefused(f"the mark of run {run_id} is {age_h:.1f} h old (limit "
                               f"{self.opts.max_mark_age_hours:g} h): run a new mark")
        self.summary = summary
        lease_id = f"{run_id}:sweep:{uuid.uuid4().hex[:6]}"
        lease = Lease(self.r, self.opts.repo, lease_id, self.opts.lease_ttl_ms)
        lease.acquire()
        try:
            self._do_sweep(lease_id, list(summary["mark"]["parts"]), lease)
            self.summary["status"] = "done" if self.summary["sweep"]["status"] == "done" \
                else self.summary["status"]
            self._save()
            return self.summary
        finally:
            lease.release()

    # -- phases
    def _mark(self, now_ms: int, lease: Lease) -> list[str]:
        from pyspark import StorageLevel
        from pyspark.sql import functions as F

        o, ns, s = self.opts, self.ns, self.summary
        timings: dict[str, float] = {}
        s["timings"] = timings
        run_id = s["run_id"]
        report = ns.report_prefix(run_id)

        def timed(name: str, t0: float) -> None:
            timings[name] = round(time.monotonic() - t0, 3)

        # 1. cutoff first
        watermark = tracker_watermark_ms(self.r)
        cutoff_ms, source = decide_cutoff(now_ms, watermark, self.settings
                                          .reconcile_min_age_seconds, o.cutoff_ms,
                                          ignore_tracker=o.ignore_tracker_progress)
        s.update(cutoff_ms=cutoff_ms, cutoff=iso(cutoff_ms), cutoff_source=source,
                 tracker={"watermark_ms": watermark, "watermark": iso(watermark),
                          "ignored": o.ignore_tracker_progress})
        self._save()

        # 2. the tracker's records, exported before the commits are read
        t0 = time.monotonic()
        pre_state = load_repo(self.r, o.repo)
        export_started = redis_now_ms(self.r)
        s["tracker"]["export_started_ms"] = export_started
        with self.ui.phase("export tracker state (uncommitted live set)"):
            export = export_addresses(
                self.r, self.s3, o.repo, ns, report + "uncommitted/", cutoff_ms=cutoff_ms,
                now_ms=now_ms, token_commits=pre_state.token_commits,
                commit_ids=set(pre_state.commits), progress=self.ui.count)
        s["uncommitted"] = {**export.as_dict(), "part_keys": export.parts}
        timed("export_s", t0)
        lease.check()

        # 3. committed: retention, expiration, manifests
        t0 = time.monotonic()
        state = load_repo(self.r, o.repo)
        plan = plan_retention(state, now_ms / 1000.0,
                              expire_older_than_days=o.expire_older_than_days,
                              mode=o.expiration_mode,  # type: ignore[arg-type]
                              delete_expired_refs=o.delete_expired_refs)
        s["retention"] = {**plan.as_dict(), "policy": {
            "default_days": state.policy.default_days,
            "branch_days": dict(state.policy.branch_days)},
            "expire_older_than_days": (o.expire_older_than_days
                                       if o.expire_older_than_days is not None
                                       else state.expire_older_than_days),
            "expiration_mode": o.expiration_mode,
            "delete_expired_refs": o.delete_expired_refs}
        known = export_df(self.spark, self.settings, ns.bucket, export.parts)
        known = known.persist(StorageLevel.MEMORY_AND_DISK)
        with self.ui.phase(f"read {len(plan.manifests)} manifests of "
                           f"{len(plan.retained)} retained commits"):
            # The manifests are the committed truth: a committed record that no retained
            # manifest lists (an expired commit's, or an entry superseded before its commit)
            # is garbage; a retained commit whose manifest is missing fails the run above/here.
            committed = (manifest_keys_df(self.spark, self.settings, ns, plan.manifests)
                         .distinct().persist(StorageLevel.MEMORY_AND_DISK))
            s["retention"]["committed_keys"] = committed.count()
        timed("committed_s", t0)
        lease.check()

        # 4. listing
        t0 = time.monotonic()
        baseline = None
        if o.optimized:
            baseline = next((p for p in previous_runs(self.s3, ns, o.repo, before=run_id)
                             if is_swept_baseline(p)), None)
            if baseline is None:
                s["mode"] = "clean"
                s["mode_note"] = "optimized run requested, but no earlier swept run: clean run"
        if o.inventory:
            files = inventory_files(self.s3, o.inventory)
            listing = inventory_df(self.spark, self.settings, ns, files)
            s["listing"] = {"source": "inventory", "inventory": o.inventory,
                            "files": len(files), "last_read_slice": None}
        else:
            units = discover_units(self.s3, ns)
            if baseline is not None:
                last = (baseline.get("listing") or {}).get("last_read_slice")
                chosen = select_optimized(units, last)
                s["listing"] = {"source": "s3", "units": len(chosen), "units_total": len(units),
                                "baseline_run": baseline["run_id"],
                                "baseline_last_read_slice": last,
                                "last_read_slice": newest_slice(chosen) or last}
            else:
                chosen = units
                s["listing"] = {"source": "s3", "units": len(chosen),
                                "slices": sum(1 for u in units if u.slice is not None),
                                "last_read_slice": newest_slice(units)}
            listing = listing_df(self.spark, self.settings, ns, chosen)
            if baseline is not None:
                # Flow 2 step 1: the previous run's uncommitted set, re-checked now.
                prev = export_df(self.spark, self.settings, ns.bucket,
                                 list((baseline.get("uncommitted") or {}).get("part_keys", [])))
                prev_live = prev.filter(F.col("live")).select("key")
                candidates = prev_live.join(known.filter(F.col("live")).select("key"), "key",
                                            "left_anti")
                listing = listing.unionByName(_head_rows(self.spark, self.settings, ns,
                                                         candidates))
                listing = listing.dropDuplicates(["key"])

        # 5. classify and mark
        with self.ui.phase("list the namespace and classify"):
            classified = classify_df(listing, committed, known, cutoff_ms) \
                .persist(StorageLevel.MEMORY_AND_DISK)
            tally = tally_df(classified)
        timed("listing_classify_s", t0)
        lease.check()
        t0 = time.monotonic()
        with self.ui.phase(f"write the mark ({tally.marked:,} objects)"):
            marked = classified.filter(F.col("category").isin(*MARKED_CATEGORIES))
            parts = _write_mark(self.spark, self.settings, ns, run_id, marked)
        s["mark"] = {**tally.as_dict(), "parts": parts}
        s["marked_at_ms"] = redis_now_ms(self.r)
        timed("write_mark_s", t0)
        t0 = time.monotonic()
        with self.ui.phase("cross-check with the online state"):
            s["crosscheck"] = _crosscheck(classified, committed, known)
        timed("crosscheck_s", t0)
        classified.unpersist()
        committed.unpersist()
        known.unpersist()
        lease.check()
        return parts

    def _sweep(self, lease_id: str, parts: list[str], lease: Lease,
               delete: bool = True) -> SweepStats:
        return sweep(self.spark, self.settings, self.opts.repo, lease_id, self.ns, parts,
                     cutoff_ms=int(self.summary["cutoff_ms"]), recheck=self.opts.recheck,
                     delete=delete, report_run_id=self.summary["run_id"])

    def _do_sweep(self, lease_id: str, parts: list[str], lease: Lease) -> None:
        s = self.summary
        export_started = (s.get("tracker") or {}).get("export_started_ms") or 0
        if not self.opts.ignore_tracker_progress:
            # Events published while the mark ran must be visible to the sweep's re-check:
            # wait (a little) for the tracker to have applied everything up to the export.
            deadline = time.monotonic() + self.opts.tracker_wait_s
            watermark = tracker_watermark_ms(self.r)
            while (watermark is None or watermark < export_started) \
                    and time.monotonic() < deadline:
                time.sleep(0.25)
                watermark = tracker_watermark_ms(self.r)
            if watermark is None or watermark < export_started:
                s["sweep"] = {"status": "deferred",
                              "reason": "the tracker has not yet applied everything up to the "
                                        "mark's export; sweep later with --sweep-only "
                                        f"{s['run_id']}"}
                return
        t0 = time.monotonic()
        try:
            lease.check()
            with self.ui.phase(f"sweep {s['mark']['marked']:,} marked objects"):
                stats = self._sweep(lease_id, parts, lease)
        except Exception as exc:
            s["sweep"] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            log.error("reconcile.sweep_failed", run_id=s["run_id"], error=str(exc))
            return
        s["sweep"] = {"status": "done", **stats.as_dict(),
                      "seconds": round(time.monotonic() - t0, 3), "at": iso(_ms_now())}
        s.setdefault("crosscheck", {})["marked_but_referenced_online"] = {
            "count": stats.skipped_live, "sample": stats.samples.get("skipped_live", [])}
        s["status"] = "done"


def reconcile(spark: Any, settings: Settings, opts: RunOptions, ui: Any = None) -> dict[str,
                                                                                        Any]:
    """Run one reconcile (mark, sweep, or both) and return its summary."""
    job = Run(spark, settings, opts, ui)
    try:
        return job.run()
    finally:
        job.close()


# ---------------------------------------------------------------------------------- CLI

def configure(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--repo", help="repository id")
    which.add_argument("--all", action="store_true",
                       help="every repository the tracker knows, one after the other (nightly)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true",
                      help="mark only: write the mark and report, delete nothing")
    mode.add_argument("--sweep-only", metavar="RUN_ID",
                      help="sweep the mark of an earlier successful run")
    parser.add_argument("--optimized", action="store_true",
                        help="seed 002 flow 2: only slices newer than the last swept run's, "
                             "plus that run's uncommitted set")
    parser.add_argument("--cutoff", help="ISO-8601 or epoch seconds; only earlier than "
                                         "now - reconcile_min_age_seconds")
    parser.add_argument("--inventory", metavar="PATH",
                        help="S3-Inventory-style Parquet/CSV (key,size,last_modified) instead "
                             "of listing: s3://bucket/prefix/ or a local directory")
    parser.add_argument("--expire-older-than-days", type=float,
                        help="snapshot expiration (seed 001) before retention")
    parser.add_argument("--expiration-mode", choices=("seed", "icechunk"), default="seed",
                        help="seed: refs at expired snapshots keep their ancestry (the seed's "
                             "sample run); icechunk: every ref's snapshot is re-parented to "
                             "the root (Icechunk 1.1)")
    parser.add_argument("--delete-expired-refs", action="store_true",
                        help="with --expire-older-than-days: branches and tags that point at "
                             "expired snapshots no longer retain anything (Icechunk's "
                             "delete-expired-tags/branches)")
    parser.add_argument("--ignore-tracker-progress", action="store_true",
                        help="DANGEROUS: do not hold the cutoff back to the tracker's progress")
    parser.add_argument("--max-mark-age-hours", type=float, default=24.0,
                        help="--sweep-only refuses older marks (default 24)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def _check_args(args: argparse.Namespace) -> None:
    if args.inventory and args.optimized:
        raise UserError("--inventory and --optimized do not go together")
    if args.sweep_only and (args.optimized or args.inventory or args.cutoff):
        raise UserError("--sweep-only takes no listing options")
    if args.expire_older_than_days is not None and args.expire_older_than_days < 0:
        raise UserError("--expire-older-than-days must be >= 0")
    if args.all and (args.sweep_only or args.inventory):
        raise UserError("--all takes no --sweep-only or --inventory (they name one "
                        "repository's run or input)")


def run_cli(settings: Settings, args: argparse.Namespace) -> int:
    import orjson

    _check_args(args)
    if not settings.redis_url:
        raise UserError("reconcile needs the tracker's Redis: set redis_url "
                        "(HARDELETE_REDIS_URL)")
    if args.all:
        from hardelete.clients import redis_sync
        from tracker.state import repositories

        r = redis_sync(settings)
        try:
            repos = sorted(repositories(r))
        finally:
            r.close()
    else:
        repos = [args.repo]
    from reconciler.spark import get_spark

    spark = get_spark(settings)
    ui = RichUi(spark) if sys.stderr.isatty() or not args.json else NullUi()
    summaries = []
    failed = 0
    for repo in repos:
        opts = RunOptions(
            repo=repo, dry_run=args.dry_run, sweep_only=args.sweep_only,
            optimized=args.optimized,
            cutoff_ms=parse_cutoff(args.cutoff) if args.cutoff else None,
            inventory=args.inventory, expire_older_than_days=args.expire_older_than_days,
            expiration_mode=args.expiration_mode, delete_expired_refs=args.delete_expired_refs,
            ignore_tracker_progress=args.ignore_tracker_progress,
            max_mark_age_hours=args.max_mark_age_hours)
        # One repository's failure (reported in its summary) does not stop the others.
        summary = reconcile(spark, settings, opts, ui)
        summaries.append(summary)
        if not args.json:
            from rich.console import Console

            Console().print(summary_table(summary))
        sweep_status = (summary.get("sweep") or {}).get("status")
        # ok: the mark succeeded and, unless it was a dry run, the sweep completed
        wanted = ("not_run",) if summary.get("dry_run") and not opts.sweep_only else ("done",)
        failed += not (bool(summary.get("success")) and sweep_status in wanted)
    from reconciler.metrics import publish

    publish(settings, summaries)  # textfile, Pushgateway, summary["metrics"]
    if args.json:
        body = summaries[0] if not args.all else summaries
        print(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode())
    return 0 if failed == 0 else 1


__all__ = ["Run", "RunOptions", "configure", "decide_cutoff", "parse_cutoff", "reconcile",
           "run_cli"]
