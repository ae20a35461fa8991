"""``hardelete reconcile``: the nightly mark and sweep of one repository.

Order of a run (see reconciler/README.md):

1. lease (one reconciler per repository) and **cutoff first**: ``min(Redis now, tracker
   watermark) - reconcile_min_age_seconds`` (or an earlier ``--cutoff``), fixed before anything
   is listed; a sequenced repository's watermark is bounded by its continuity horizon (none:
   the run fails);
2. export the tracker's address records (live verdicts) to the report, BEFORE reading the
   commits (seed 002: uncommitted first, so a commit landing in between is seen by one or the
   other);
3. commit graph -> retention/expiration -> manifests of the retained commits;
4. listing of the namespace (slices in Spark tasks, or an inventory), and the service's own
   uncommitted export (a second witness; required for a fail-closed repository);
5. classify and mark (Parquet + summary.json); any error so far: the run fails, nothing is
   deleted;
6. sweep (unless ``--dry-run``): re-validate the mark against what is true now (retention
   inputs, fail-closed state), the blast-radius guard, the cross-check gate, then per batch an
   online re-check (live again, record changed since the export, refs moved);
7. cross-check the mark against the online state.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import sys
import time
import traceback
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from core.clients import redis_sync, s3_client
from core.clock import redis_time_ms
from core.continuity_store import ContinuityStore
from core.errors import UserError
from core.guards import fail_closed_reason
from core.logs import get_logger
from core.settings import Settings
from reconciler.blast_radius import judge_blast_radius
from reconciler.committed import (
    export_df,
    manifest_keys_df,
    plan_retention,
)
from reconciler.errors import ReconcileError, SweepRefused
from reconciler.evidence import EvidenceError, KeepSetProof, Source
from reconciler.keepset import (
    SLICE_RE,
    KeepSetPlan,
    KeepSetUnusable,
    StoredKeepSet,
    check_parts,
    manifest_etags,
    parts_df,
    plan_incremental,
    read_stored,
    write_descriptor,
    write_parts,
)
from reconciler.listing import (
    discover_units,
    inventory_df,
    listing_df,
    named_inventory,
    newest_slice,
    select_optimized,
)
from reconciler.mark import (
    LISTING_SCHEMA,
    MARK_COLUMNS,
    MARK_SCHEMA,
    MARKED_CATEGORIES,
    classify_df,
    tally_df,
)
from reconciler.report import (
    REPORT_FORMAT,
    BlastRadiusSection,
    CrossCheck,
    Divergence,
    FailClosedSection,
    ListingSection,
    MarkSection,
    RetentionSection,
    Revalidation,
    RunSummary,
    ServiceExportSection,
    SweepOutcome,
    TrackerView,
    UncommittedSection,
    is_swept_baseline,
    iso,
    new_run_id,
    previous_runs,
    read_summary,
    write_summary,
)
from reconciler.s3io import Namespace, cached_s3, get_json, put_json, put_parquet, read_parquet_rows
from reconciler.service_export import export_keys_df, named_export, resolve_location
from reconciler.sparkio import distributed
from reconciler.state import (
    Lease,
    export_addresses,
    load_namespace,
    load_repo,
    refs_fingerprint,
    retired_problem,
    tracker_watermark_ms,
)
from reconciler.sweep import SKIPPED_RETAINED, SweepPlan, SweepStats, SweepStopped, sweep
from reconciler.ui import NullUi, RichUi, summary_table
from schemas.layout import RepoKeys

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
    delete_expired_refs: bool = False  # list refs at expired snapshots for the service to delete
    ignore_tracker_progress: bool = False
    max_mark_age_hours: float = 24.0
    # an optimized run reuses a baseline's stored keep-set at most this old (else: clean run)
    max_baseline_age_hours: float = 168.0
    lease_ttl_ms: int = 60_000
    recheck: bool = True
    tracker_wait_s: float = 120.0
    uncommitted_export: str | None = None  # None: the ``uncommitted_export`` setting
    allow_large_sweep: bool = False


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
    return _write_rows(settings, ns, ns.report_prefix(run_id) + "mark/", marked, MARK_COLUMNS)


def _mark_df(spark: Any, settings: Settings, ns: Namespace, parts: list[str]) -> Any:
    """The rows of mark parts, read inside tasks."""

    def produce(item: dict[str, Any]) -> Iterator[tuple[Any, ...]]:
        yield from read_parquet_rows(cached_s3(settings), ns.bucket, item["part"], MARK_COLUMNS)

    return distributed(spark, [(p,) for p in parts], "part string", produce, MARK_SCHEMA)


def _write_rows(settings: Settings, ns: Namespace, prefix: str, df: Any,
                columns: tuple[str, ...]) -> list[str]:
    """Write a DataFrame's rows as Parquet parts from the tasks; the part keys come back."""
    token = uuid.uuid4().hex[:6]

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

    parts = df.select(*columns).rdd.mapPartitionsWithIndex(write).collect()
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


def _under_any(units: list[Any]) -> Any:
    """A column condition: the key lies in one of the listing units (recursive ones)."""
    from functools import reduce

    from pyspark.sql import functions as F

    conds = [F.col("key").startswith(u.prefix) for u in units if not u.shallow]
    return reduce(lambda a, b: a | b, conds, F.lit(False))


def _sample(df: Any, col: str = "key") -> list[str]:
    return [str(r[col]) for r in df.select(col).limit(SAMPLE).collect()]


def _crosscheck(classified: Any, committed: Any, known: Any) -> CrossCheck:
    """Divergences between the mark and the online (tracker) state: the three counts in one
    Spark job (one pass over the classified listing), a sample only of those that are not 0.

    ``committed``: distinct keys. ``known``: the tracker export, a row per address form."""
    from pyspark.sql import functions as F

    kept = ("reserved", "committed", "uncommitted")
    staged = F.col("live") & (F.col("reason") == "staged")
    unref = (~F.col("live")) & (F.col("kind") == "unreferenced")
    listed = classified.select("key")
    # The queries of each divergence (run for its sample only when it is not 0).
    queries = {
        "live_in_redis_missing_from_store": known.filter(staged).join(listed, "key",
                                                                       "left_anti"),
        "committed_missing_from_store": committed.join(listed, "key", "left_anti"),
        "unreferenced_online_not_marked": (known.filter(unref).select("key")
                                           .join(classified.filter(F.col("category")
                                                                   .isin(*kept)), "key")),
    }
    # Their counts at once: per key, the export's rows of each kind (a count of rows, as the
    # queries count them) and whether a retained manifest lists it, against the listing.
    online = (known.filter(staged | unref).groupBy("key")
              .agg(F.sum(staged.cast("long")).alias("_staged"),
                   F.sum(unref.cast("long")).alias("_unref"))
              .join(committed.select("key").withColumn("_committed", F.lit(1)), "key",
                    "full_outer")
              .join(classified.select("key", "category"), "key", "left"))
    unlisted = F.col("category").isNull()
    row = online.agg(
        F.sum(F.when(unlisted, F.col("_staged"))).alias("live_in_redis_missing_from_store"),
        F.sum(F.when(unlisted & F.col("_committed").isNotNull(), F.lit(1)))
        .alias("committed_missing_from_store"),
        F.sum(F.when(F.col("category").isin(*kept), F.col("_unref")))
        .alias("unreferenced_online_not_marked")).first()
    out = CrossCheck()
    for name, df in queries.items():
        n = int(row[name] or 0) if row is not None else 0
        out[name] = Divergence(n, _sample(df) if n else [])
    return out


MARK_SEAL_TTL_S = 7 * 86_400


def mark_seal(s3: Any, ns: Namespace, summary: RunSummary) -> str:
    """A digest binding a mark to what the run wrote: its parts (under the run's own
    ``mark/``) and their ETags, the marked count, the cutoff, the retention fingerprint and the
    ETag of ``retained.json`` (what the sweep judges retention again against). A part added,
    removed or rewritten since, or a summary or retained set edited, gives another digest."""
    import hashlib

    run_id, mark, ret = summary.run_id, summary.mark, summary.retention
    if mark is None or ret is None or ret.retained_key is None:
        raise SweepRefused(f"run {run_id} recorded no mark or retention to seal")
    prefix = ns.report_prefix(run_id) + "mark/"
    h = hashlib.sha256(f"{run_id}\n{ns.uri}\n{mark.marked}\n{summary.cutoff_ms}\n"
                       f"{ret.fingerprint}\n".encode())
    if ret.retained_key != ns.report_prefix(run_id) + "retained.json":
        raise SweepRefused(f"run {run_id}: its retained set {ret.retained_key} is not its own")
    for key in [ret.retained_key, *sorted(mark.parts)]:
        if key != ret.retained_key and not key.startswith(prefix):
            raise SweepRefused(f"run {run_id}: mark part {key} is not under {prefix}")
        etag = s3.head_object(Bucket=ns.bucket, Key=key)["ETag"]
        h.update(f"{key}\n{etag}\n".encode())
    return h.hexdigest()


def _keepset_problem(summary: RunSummary) -> str | None:
    """Why the mark's keep-set may not be swept from (its proof missing or incomplete)."""
    if summary.keepset is None:
        return "the mark recorded no keep-set proof"
    return summary.keepset.problem()


class Run:
    """One reconcile invocation; ``summary`` is what lands in summary.json (RunSummary)."""

    def __init__(self, spark: Any, settings: Settings, opts: RunOptions, ui: Any = None):
        self.spark = spark
        self.settings = settings
        self.opts = opts
        self.ui = ui or NullUi()
        self.r = redis_sync(settings)
        self.s3 = s3_client(settings)
        self.summary: RunSummary
        self._refs: str | None = None  # refs_fingerprint the sweep was re-validated against

    # -- helpers
    def _save(self) -> None:
        self.summary.updated_at = iso(_ms_now())
        write_summary(self.s3, self.ns, self.summary)

    def close(self) -> None:
        self.r.close()

    # -- entry points
    def run(self) -> RunSummary:
        import redis

        try:
            self.ns = load_namespace(self.r, self.opts.repo)
        except ReconcileError as exc:
            raise UserError(str(exc)) from None
        except redis.exceptions.ConnectionError as exc:
            raise UserError(f"cannot reach the tracker's Redis ({exc}): nothing was done") \
                from None
        problem = retired_problem(self.r, self.opts.repo, self.ns)
        if problem:
            raise UserError(f"{problem}: nothing was done")
        if self.opts.sweep_only:
            return self.sweep_only(self.opts.sweep_only)
        return self.mark_and_sweep()

    def mark_and_sweep(self) -> RunSummary:
        o = self.opts
        now_ms = redis_time_ms(self.r)
        run_id = new_run_id(now_ms)
        s = self.summary = RunSummary(run_id, o.repo, self.ns.uri,
                                      "optimized" if o.optimized else "clean", o.dry_run,
                                      iso(now_ms), now_ms)
        lease = Lease(self.r, o.repo, run_id, o.lease_ttl_ms)
        lease.acquire()
        try:
            self._save()
            t0 = time.monotonic()
            try:
                marked_parts = self._mark(now_ms, lease)
            except Exception as exc:
                s.success, s.status, s.error = False, "failed", f"{type(exc).__name__}: {exc}"
                s.sweep = SweepOutcome("not_run", "the mark failed: nothing is deleted")
                log.error("reconcile.mark_failed", run_id=run_id, error=str(exc),
                          trace=traceback.format_exc(limit=3))
                self._save()
                return s
            assert s.timings is not None
            s.timings["mark_s"] = round(time.monotonic() - t0, 3)
            s.success, s.status = True, "marked"
            self._save()
            if o.dry_run:
                s.sweep = SweepOutcome("not_run", "dry run")
                try:
                    with self.ui.phase("re-check the mark online (dry run: no deletes)"):
                        stats = self._sweep(run_id, marked_parts, lease, delete=False)
                    s.crosscheck["marked_but_referenced_online"] = Divergence(
                        stats.skipped_live, stats.samples.get("skipped_live", []))
                except Exception as exc:  # the mark stands; only the re-check is missing
                    s.crosscheck["marked_but_referenced_online"] = Divergence(
                        error=f"{type(exc).__name__}: {exc}")
                s.status = "done"
            else:
                self._do_sweep(run_id, marked_parts, lease)
            s.finished_at = iso(_ms_now())
            self._save()
            return s
        finally:
            lease.release()

    def sweep_only(self, run_id: str) -> RunSummary:
        summary = read_summary(self.s3, self.ns, run_id)
        if summary is None:
            raise SweepRefused(f"no report for run {run_id!r} in {self.ns.uri}")
        if summary.get("repository") != self.opts.repo:
            raise SweepRefused(f"run {run_id} is of repository {summary.get('repository')!r}")
        if not summary.get("success") or summary.get("status") == "running":
            raise SweepRefused(f"run {run_id} is not a successful mark "
                               f"(status {summary.get('status')}, error {summary.get('error')})")
        if int(summary.get("format") or 0) < REPORT_FORMAT:
            raise SweepRefused(f"run {run_id} was marked by an older reconciler (report format "
                               f"{summary.get('format')}): it cannot be re-validated; run a "
                               "new mark")
        if int(summary.get("format") or 0) > REPORT_FORMAT:
            # A newer mark may hold what this version cannot judge (a category, a check): it
            # is swept by the version that wrote it, or marked again by this one.
            raise SweepRefused(f"run {run_id} was marked by a newer reconciler (report format "
                               f"{summary.get('format')}, this one reads {REPORT_FORMAT}): "
                               "sweep it with that version, or run a new mark")
        marked_at = summary.get("marked_at_ms") or 0
        now_ms = redis_time_ms(self.r)
        age_h = (now_ms - int(marked_at)) / 3_600_000
        if age_h > self.opts.max_mark_age_hours:
            raise SweepRefused(f"the mark of run {run_id} is {age_h:.1f} h old (limit "
                               f"{self.opts.max_mark_age_hours:g} h): run a new mark")
        self.summary = RunSummary.from_dict(summary)
        if self.summary.mark is None:
            raise SweepRefused(f"run {run_id} has no mark to sweep")
        if self.summary.namespace != self.ns.uri:
            raise SweepRefused(f"run {run_id} marked namespace {self.summary.namespace}, the "
                               f"repository's is {self.ns.uri}: run a new mark")
        problem = _keepset_problem(self.summary)
        if problem is not None:
            raise SweepRefused(f"run {run_id}: {problem}; run a new mark")
        sealed = self.r.get(RepoKeys(self.opts.repo).mark_seal(run_id))
        if sealed is None or sealed != mark_seal(self.s3, self.ns, self.summary):
            raise SweepRefused(f"run {run_id}: its mark is not the one the run wrote (its "
                               "parts or counts changed since, or its seal is gone): run a "
                               "new mark")
        lease_id = f"{run_id}:sweep:{uuid.uuid4().hex[:6]}"
        lease = Lease(self.r, self.opts.repo, lease_id, self.opts.lease_ttl_ms)
        lease.acquire()
        try:
            self._do_sweep(lease_id, list(self.summary.mark.parts), lease)
            if self.summary.sweep is not None and self.summary.sweep.status == "done":
                self.summary.status = "done"
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
        s.timings = timings
        run_id = s.run_id
        report = ns.report_prefix(run_id)

        def timed(name: str, t0: float) -> None:
            timings[name] = round(time.monotonic() - t0, 3)

        # 1. cutoff first
        watermark = tracker_watermark_ms(self.r)
        # A sequenced repository is complete in the mirror only up to its continuity horizon
        # (schemas/README.md, "Continuity"): the cutoff and the grace horizon stop there, and
        # without one (a gap, a broken stripe, no watermark yet) nothing can be marked.
        sequenced, certified = ContinuityStore(self.r).sequenced_horizon(o.repo)
        if sequenced:
            if certified is None:
                raise ReconcileError(
                    f"repository {o.repo!r}: its service has not certified its history (a gap "
                    "being re-sent, a broken stripe or no watermark yet); nothing can be marked "
                    "until it has (see `hardelete status`)")
            watermark = certified if watermark is None else min(watermark, certified)
        cutoff_ms, source = decide_cutoff(now_ms, watermark, self.settings
                                          .reconcile_min_age_seconds, o.cutoff_ms,
                                          ignore_tracker=o.ignore_tracker_progress)
        s.cutoff_ms, s.cutoff, s.cutoff_source = cutoff_ms, iso(cutoff_ms), source
        tracker = s.tracker = TrackerView(watermark, iso(watermark), o.ignore_tracker_progress)
        self._save()

        # 2. the tracker's records, exported before the commits are read
        t0 = time.monotonic()
        pre_state = load_repo(self.r, o.repo)
        export_started = redis_time_ms(self.r)
        tracker.export_started_ms = export_started
        # Grace binds the mark too (SPEC safety 2): an address unreferenced less than the grace
        # window before the tracker horizon is live. Without a known horizon (ignored), now.
        grace_ms = int(self.settings.grace_for(o.repo) * 1000)
        horizon = export_started if watermark is None else min(watermark, export_started)
        tracker.grace_ms, tracker.grace_horizon_ms = grace_ms, horizon
        with self.ui.phase("export tracker state (uncommitted live set)"):
            export = export_addresses(
                self.r, self.s3, o.repo, ns, report + "uncommitted/", cutoff_ms=cutoff_ms,
                now_ms=now_ms,
                commit_ids=set(pre_state.commits), grace_ms=grace_ms, horizon_ms=horizon,
                progress=self.ui.count)
        s.uncommitted = UncommittedSection(export.as_dict(), export.parts)
        proof = KeepSetProof()
        timed("export_s", t0)
        lease.check()

        # The optimized run's baseline: the newest swept run (its listing and its keep-set).
        baseline = None
        if o.optimized:
            baseline = next((p for p in previous_runs(self.s3, ns, o.repo, before=run_id)
                             if is_swept_baseline(p)), None)
            if baseline is None:
                s.mode = "clean"
                s.mode_note = "optimized run requested, but no earlier swept run: clean run"

        # 3. committed: retention, expiration, manifests
        t0 = time.monotonic()
        state = load_repo(self.r, o.repo)
        plan = plan_retention(state, now_ms / 1000.0,
                              expire_older_than_days=o.expire_older_than_days,
                              mode=o.expiration_mode,  # type: ignore[arg-type]
                              delete_expired_refs=o.delete_expired_refs)
        retention = s.retention = RetentionSection(
            plan.as_dict(), {"default_days": state.policy.default_days,
                             "branch_days": dict(state.policy.branch_days)},
            (o.expire_older_than_days if o.expire_older_than_days is not None
             else state.expire_older_than_days),
            o.expiration_mode, o.delete_expired_refs, state.fingerprint,
            report + "retained.json")
        # What retention kept at the mark: the sweep re-judges retention against it.
        put_json(self.s3, ns.bucket, report + "retained.json",
                 {"retained": sorted(plan.retained),
                  "manifests": [list(m) for m in plan.manifests]})
        if o.delete_expired_refs:
            # The refs for the service to delete (issue 33): they retain until it has.
            retention.expired_refs_key = report + "expired_refs.json"
            put_json(self.s3, ns.bucket, retention.expired_refs_key, {
                "repository": o.repo, "default_branch": state.default_branch,
                "expire_older_than_days": retention.expire_older_than_days,
                "refs": [{"kind": r.kind, "name": r.name, "commit": r.commit,
                          "commit_time": r.commit_time} for r in plan.refs_to_delete or ()]})
        # Each manifest's ETag, taken before it is read: what this run's stored keep-set
        # vouches for, and what a baseline's keep-set is checked against.
        etags = manifest_etags(self.s3, plan.manifests)
        keep = self._keepset_plan(baseline, now_ms, etags)
        if baseline is not None and not keep.reuse:
            baseline = None
            s.mode = "clean"
            s.mode_note = f"optimized run requested, but {keep.reason}: clean run"
        known = export_df(self.spark, self.settings, ns.bucket, export.parts)
        known = known.persist(StorageLevel.MEMORY_AND_DISK)
        to_read = list(keep.new_manifests) if keep.reuse else plan.manifests
        with ThreadPoolExecutor(1) as pool, \
                self.ui.phase(f"read {len(to_read)} manifests of "
                              f"{len(plan.retained)} retained commits"):
            # The export is read back (and cached) while the manifests are read: two jobs
            # at once, so that a single export part and a single manifest use two cores.
            counting = pool.submit(known.count)
            # The manifests are the committed truth: a committed record that no retained
            # manifest lists (an expired commit's, or an entry superseded before its commit)
            # is garbage; a retained commit whose manifest is missing fails the run above/here.
            fresh = (manifest_keys_df(self.spark, self.settings, ns, to_read).distinct()
                     .persist(StorageLevel.MEMORY_AND_DISK))
            kparts = write_parts(self.settings, ns, run_id, fresh)
            fresh_keys = sum(p.rows for p in kparts)
            read_back = counting.result()
        if read_back != export.rows:  # the parts this run wrote a moment ago, read whole
            raise EvidenceError(f"tracker export {report}uncommitted/: {read_back} rows read "
                                f"back, {export.rows} written")
        proof.add(Source("tracker_export", len(export.parts), export.rows))
        proof.add(Source("manifests", len(to_read), keys=fresh_keys))
        committed = None if keep.reuse else fresh  # an optimized run's: after its listing
        if keep.reuse and keep.baseline is not None:
            kparts = [*keep.baseline.parts, *kparts]
        else:
            retention.committed_keys = fresh_keys
        stored = StoredKeepSet(run_id, o.repo, ns.uri, now_ms, etags, tuple(sorted(
            plan.retained)), tuple(kparts), sum(p.rows for p in kparts))
        proof.stored = write_descriptor(self.s3, self.r, RepoKeys(o.repo).keep_seal(run_id),
                                         ns, stored)
        timed("committed_s", t0)
        lease.check()

        # 4. listing
        t0 = time.monotonic()
        chosen = None  # the units listed (None: an inventory)
        wanted: set[str] | None = None  # the slices of the baseline's keep-set to read
        if o.inventory:
            files = named_inventory(self.s3, o.inventory, ns.bucket)
            listing = inventory_df(self.spark, self.settings, ns, files)
            s.listing = ListingSection("inventory", None,
                                       {"inventory": o.inventory, "files": len(files)})
        else:
            units = discover_units(self.s3, ns)
            if baseline is not None:
                last = None if baseline.listing is None else baseline.listing.last_read_slice
                chosen = select_optimized(units, last)
                s.listing = ListingSection("s3", newest_slice(chosen) or last, {
                    "units": len(chosen), "units_total": len(units),
                    "baseline_run": baseline.run_id, "baseline_last_read_slice": last})
            else:
                chosen = units
                s.listing = ListingSection("s3", newest_slice(units), {
                    "units": len(chosen),
                    "slices": sum(1 for u in units if u.slice is not None)})
            listing = listing_df(self.spark, self.settings, ns, chosen)
            if baseline is not None:
                # Flow 2 step 1: the previous run's uncommitted set, re-checked now.
                prev = export_df(self.spark, self.settings, ns.bucket,
                                 [] if baseline.uncommitted is None
                                 else list(baseline.uncommitted.part_keys))
                prev_live = prev.filter(F.col("live")).select("key")
                candidates = prev_live.join(known.filter(F.col("live")).select("key"), "key",
                                            "left_anti").persist(StorageLevel.MEMORY_AND_DISK)
                listing = listing.unionByName(_head_rows(self.spark, self.settings, ns,
                                                         candidates))
                listing = listing.dropDuplicates(["key"])
                # The slices this run may classify: those it lists and those of the keys it
                # HEADs (and the keys in no slice): of the baseline's keep-set, only theirs.
                wanted = {u.slice for u in chosen if u.slice is not None} | {""}
                wanted |= {str(r[0]) for r in candidates.select(
                    F.regexp_extract("key", SLICE_RE, 1)).distinct().collect()}
                candidates.unpersist()
        if committed is None and keep.baseline is not None:
            read = tuple(p for p in keep.baseline.parts if wanted is None or p.unit in wanted)
            # K(M_now) = K(M_baseline) | K(M_now - M_baseline) (reconciler/keepset.py)
            committed = parts_df(self.spark, self.settings, ns, read).unionByName(fresh) \
                .distinct().persist(StorageLevel.MEMORY_AND_DISK)
            # (``committed_keys`` stays unset: this run reads a part of the keep-set only)
            proof.add(Source("baseline_keepset", len(read), sum(p.rows for p in read),
                             location=keep.baseline.run_id))
        if committed is None:
            raise ReconcileError("the committed keep-set was not built")

        # 5. the service's own uncommitted export (a second witness) and fail-closed state
        service, withhold = self._service_evidence(cutoff_ms, proof)

        # 6. classify and mark
        with self.ui.phase("list the namespace and classify"):
            classified = classify_df(listing, committed, known, cutoff_ms, service=service,
                                     withhold=withhold,
                                     known_unique=export.extra_forms == 0) \
                .persist(StorageLevel.MEMORY_AND_DISK)
            tally = tally_df(classified)
        # Every source has been read whole by its strict reader (tally_df forced them all).
        proof.complete = True
        s.keepset = proof
        timed("listing_classify_s", t0)
        lease.check()
        t0 = time.monotonic()
        with self.ui.phase(f"write the mark ({tally.marked:,} objects)"):
            marked = classified.filter(F.col("category").isin(*MARKED_CATEGORIES))
            parts = _write_mark(self.spark, self.settings, ns, run_id, marked)
        s.mark = MarkSection(tally, parts)
        self.r.set(RepoKeys(o.repo).mark_seal(run_id), mark_seal(self.s3, ns, s),
                   ex=MARK_SEAL_TTL_S)
        s.marked_at_ms = redis_time_ms(self.r)
        timed("write_mark_s", t0)
        t0 = time.monotonic()
        with self.ui.phase("cross-check with the online state"):
            # An optimized run lists only new slices: a committed key elsewhere is not missing.
            listed_committed = committed if baseline is None or chosen is None \
                else committed.filter(_under_any(chosen))
            s.crosscheck = _crosscheck(classified, listed_committed, known)
        timed("crosscheck_s", t0)
        classified.unpersist()
        committed.unpersist()
        fresh.unpersist()
        known.unpersist()
        lease.check()
        return parts

    def _keepset_plan(self, baseline: RunSummary | None, now_ms: int,
                      etags: dict[tuple[str, str], str]) -> KeepSetPlan:
        """Whether the baseline's stored keep-set may be reused (``reconciler/keepset.py``);
        no baseline: a clean keep-set."""
        if baseline is None:
            return KeepSetPlan(False, "no baseline")
        o, ns = self.opts, self.ns
        try:
            stored = read_stored(self.s3, self.r, RepoKeys(o.repo).keep_seal(baseline.run_id),
                                 ns, o.repo, baseline.run_id)
            keep = plan_incremental(stored, repository=o.repo, namespace=ns.uri,
                                    now_ms=now_ms,
                                    max_age_ms=int(o.max_baseline_age_hours * 3_600_000),
                                    manifests_now=etags)
            if keep.reuse:
                check_parts(self.s3, ns, stored.parts, f"keep-set of run {stored.run_id}")
        except KeepSetUnusable as exc:
            return KeepSetPlan(False, f"the keep-set of run {baseline.run_id} is not usable "
                                      f"({exc})")
        return keep

    def _service_evidence(self, cutoff_ms: int, proof: KeepSetProof) -> tuple[Any, bool]:
        """The service export's keys (or None) and whether leaks/unreferenced are withheld."""
        o, s = self.opts, self.summary
        setting = o.uncommitted_export if o.uncommitted_export is not None \
            else self.settings.uncommitted_export
        found = None
        if setting:
            location = resolve_location(setting, self.ns, o.repo)
            found = named_export(self.s3, location, o.repo, self.ns, now_ms=s.now_ms,
                                 cutoff_ms=cutoff_ms,
                                 max_age_ms=self.settings.uncommitted_export_max_age_seconds
                                 * 1000)
            s.service_export = ServiceExportSection(
                True, found.location, found.exported_at_ms, len(found.meta.files),
                found.meta.rows, found.exported_at_ms > cutoff_ms)
        else:
            s.service_export = ServiceExportSection(False)
        reason = fail_closed_reason(self.r, o.repo)
        fresh = found is not None and found.exported_at_ms > cutoff_ms
        # An uncommitted export cannot vouch for a fail-closed repository: leaked, unreferenced
        # and expired_upload also rest on the committed side, which comes from the unproven
        # mirror (a commit lost in the gap would make its objects look leaked). Only a rebuild
        # from the service's whole state proves it (issue 20).
        withhold = reason is not None
        if reason is not None:
            s.fail_closed = FailClosedSection(reason, fresh, withhold)
        service = None
        if found is not None:
            service = export_keys_df(self.spark, self.settings, self.ns, o.repo, found)
            proof.add(found.source())
        return service, withhold

    def _sweep(self, lease_id: str, parts: list[str], lease: Lease,
               delete: bool = True) -> SweepStats:
        if self.summary.cutoff_ms is None:  # (a mark always records one before it is swept)
            raise ReconcileError(f"run {self.summary.run_id} has no cutoff: it cannot be swept")
        plan = SweepPlan(self.opts.repo, lease_id, self.ns, self.summary.cutoff_ms,
                         recheck=self.opts.recheck, delete=delete, refs=self._refs,
                         report_run_id=self.summary.run_id,
                         grace_ms=int(self.settings.grace_for(self.opts.repo) * 1000))
        return sweep(self.spark, self.settings, plan, parts)

    def _do_sweep(self, lease_id: str, parts: list[str], lease: Lease) -> None:
        """Re-validate the mark against what is true now, check the blast radius and the
        cross-check, then sweep. Every refusal leaves the mark standing (``--sweep-only``)."""
        s = self.summary
        problem = _keepset_problem(s)
        if problem is not None:
            s.sweep = SweepOutcome("refused", f"{problem}: nothing is deleted")
            return
        if not self.opts.ignore_tracker_progress:
            # What happened before the sweep (since the mark: refs, commits, copies) must be
            # visible to its re-validation: wait (a little) for the tracker to have applied
            # everything the broker held when the sweep started.
            target = redis_time_ms(self.r)
            deadline = time.monotonic() + self.opts.tracker_wait_s
            watermark = tracker_watermark_ms(self.r)
            while (watermark is None or watermark < target) \
                    and time.monotonic() < deadline:
                time.sleep(0.25)
                watermark = tracker_watermark_ms(self.r)
            if watermark is None or watermark < target:
                s.sweep = SweepOutcome("deferred",
                                       "the tracker has not yet applied everything up to the "
                                       "sweep's start; sweep later with --sweep-only "
                                       f"{s.run_id}")
                return
        paused = self.r.get(RepoKeys(self.opts.repo).paused)
        if paused is not None:  # `hardelete pause`: the operator stopped deletion here
            s.sweep = SweepOutcome("paused", f"the repository is paused ({paused}): "
                                   f"nothing is deleted; `hardelete resume {self.opts.repo}`, "
                                   f"then --sweep-only {s.run_id}")
            return
        t0 = time.monotonic()
        if s.timings is None:
            s.timings = {}
        timings = s.timings

        def timed(name: str, since: float) -> float:
            now = time.monotonic()
            timings[name] = round(now - since, 3)
            return now

        try:
            lease.check()
            with self.ui.phase("re-validate the mark (retention, fail-closed state)"):
                refusal, parts, retained = self._revalidate(lease_id, parts)
            if refusal is None:
                refusal = self._blast_radius(parts, retained)
            t1 = timed("sweep_revalidate_s", t0)
            if refusal is None:
                with self.ui.phase("cross-check the mark online before deleting"):
                    pre = self._sweep(lease_id, parts, lease, delete=False)
                t1 = timed("sweep_precheck_s", t1)
                s.crosscheck["marked_but_referenced_online"] = Divergence(
                    pre.skipped_live, pre.samples.get("skipped_live", []))
                # Changed after the mark's snapshot (a copy back into a branch, a new
                # reference): not a divergence; those objects are skipped, the rest is swept.
                s.revalidation.changed_after_mark = Divergence(
                    pre.skipped_changed, pre.samples.get("skipped_changed", []))
                if pre.skipped_live:
                    refusal = (f"cross-check: {pre.skipped_live} marked object(s) are "
                               "referenced online by evidence the mark's snapshot already "
                               "held: the mark is wrong, nothing of this run is deleted; find "
                               "out why, then run a new mark")
            if refusal is not None:
                s.sweep = SweepOutcome("refused", refusal,
                                       skipped_retained=retained.skipped_retained,
                                       samples=retained.samples)
                log.warning("reconcile.sweep_refused", run_id=s.run_id, reason=refusal)
                return
            lease.check()
            try:
                with self.ui.phase(f"sweep {s.marked:,} marked objects"):
                    stats = self._sweep(lease_id, parts, lease)
                timed("sweep_delete_s", t1)
            except SweepStopped as stop:
                # Stopped part-way: the deletes the store confirmed until then are reported,
                # every one of them (SPEC safety 6).
                if stop.stats is not None:
                    stop.stats.merge(retained)
                s.sweep = SweepOutcome("failed", error=stop.error, stats=stop.stats,
                                       seconds=round(time.monotonic() - t0, 3),
                                       at=iso(_ms_now()))
                log.error("reconcile.sweep_failed", run_id=s.run_id, error=stop.error,
                          confirmed=None if stop.stats is None else stop.stats.confirmed)
                return
            stats.merge(retained)
        except Exception as exc:
            error = exc.error if isinstance(exc, SweepStopped) else f"{type(exc).__name__}: {exc}"
            s.sweep = SweepOutcome("failed", error=error)
            log.error("reconcile.sweep_failed", run_id=s.run_id, error=str(exc))
            return
        s.sweep = SweepOutcome("done", stats=stats, seconds=round(time.monotonic() - t0, 3),
                               at=iso(_ms_now()))
        s.crosscheck["marked_but_referenced_online"] = Divergence(
            stats.skipped_live, stats.samples.get("skipped_live", []))
        s.status = "done"

    def _revalidate(self, lease_id: str, parts: list[str]) -> tuple[str | None, list[str],
                                                                     SweepStats]:
        """Judge the mark's retention again with the branches, tags and commits of now.

        Unchanged inputs (same fingerprint): the mark's parts. Changed: retention is
        recomputed at the mark's clock; the keys of every manifest retained now and not at
        the mark are taken out of the sweep (``skipped_retained``, written to the report);
        the rest is swept from new parts. A refusal (a reason) when that cannot be done.
        """
        s = self.summary
        retained = SweepStats()
        ret = s.retention
        reval = s.revalidation = Revalidation()
        reason = fail_closed_reason(self.r, self.opts.repo)
        if reason is not None and not s.fail_closed:
            reval.fail_closed = reason
            return (f"the repository is fail-closed now ({reason}) but was not at the mark: "
                    "run a new mark", parts, retained)
        # Taken before the state is read: every sweep batch checks it (a change after this
        # point stops the sweep, one before it is in the state judged below).
        self._refs = refs_fingerprint(self.r, self.opts.repo)
        state = load_repo(self.r, self.opts.repo)
        at_mark_fingerprint = None if ret is None else ret.fingerprint
        reval.fingerprint_at_mark = at_mark_fingerprint
        reval.fingerprint_now = state.fingerprint
        reval.retention_changed = state.fingerprint != at_mark_fingerprint
        if not reval.retention_changed and not (ret and ret.dropped_live_refs()):
            return None, parts, retained
        if ret is None or ret.retained_key is None:
            return ("the mark recorded no retention to judge again against: nothing deleted, "
                    "run a new mark", parts, retained)
        # The mark's own retention options (expiration mode and ref deletion, when the mark
        # recorded them): the same rules, applied to the refs and commits of now.
        same: dict[str, Any] = {}
        if ret.expiration_mode is not None:
            same["mode"] = ret.expiration_mode
        if ret.delete_expired_refs is not None:
            same["delete_expired_refs"] = ret.delete_expired_refs
        try:
            plan = plan_retention(state, s.now_ms / 1000.0,
                                  expire_older_than_days=ret.expire_older_than_days,
                                  **same)
        except ReconcileError as exc:
            return (f"branches, tags or commits changed since the mark and retention cannot "
                    f"be judged again ({exc}): nothing deleted, run a new mark", parts, retained)
        at_mark = get_json(self.s3, self.ns.bucket, ret.retained_key)
        mark_manifests = {tuple(m) for m in at_mark["manifests"]}
        new = [m for m in plan.manifests if tuple(m) not in mark_manifests]
        reval.newly_retained_commits = len(plan.retained - set(at_mark["retained"]))
        reval.new_manifests = len(new)
        if not new:
            return None, parts, retained
        from pyspark import StorageLevel

        protected = manifest_keys_df(self.spark, self.settings, self.ns, new).distinct()
        marked = _mark_df(self.spark, self.settings, self.ns, parts) \
            .persist(StorageLevel.MEMORY_AND_DISK)
        try:
            skipped = marked.join(protected, "key", "left_semi")
            retained.skipped_retained = skipped.count()
            for key in _sample(skipped):
                retained.sample(SKIPPED_RETAINED, key)
            base = self.ns.report_prefix(s.run_id) + f"revalidated/{lease_id.replace(':', '-')}/"
            if retained.skipped_retained:
                from pyspark.sql import functions as F

                _write_rows(self.settings, self.ns, base + "skipped/",
                            skipped.withColumn("outcome", F.lit(SKIPPED_RETAINED)),
                            (*MARK_COLUMNS, "outcome"))
            parts = _write_rows(self.settings, self.ns, base + "mark/",
                                marked.join(protected, "key", "left_anti"), MARK_COLUMNS)
        finally:
            marked.unpersist()
        reval.skipped_retained, reval.parts = retained.skipped_retained, parts
        return None, parts, retained

    def _blast_radius(self, parts: list[str], retained: SweepStats) -> str | None:
        """Why the sweep is too large to go without ``--allow-large-sweep``, or None
        (``reconciler/blast_radius.py`` decides)."""
        s, cfg = self.summary, self.settings
        marked = s.marked - retained.skipped_retained
        done = (p.sweep for p in previous_runs(self.s3, self.ns, self.opts.repo,
                                               before=s.run_id)
                if p.sweep is not None and p.sweep.status == "done")
        history = [0 if d.stats is None else d.stats.confirmed
                   for d in itertools.islice(done, cfg.sweep_history_runs)]
        verdict = judge_blast_radius(marked, s.listed, history,
                                     max_share=cfg.sweep_max_share,
                                     max_growth=cfg.sweep_max_growth,
                                     floor=cfg.sweep_growth_floor,
                                     history_runs=cfg.sweep_history_runs)
        s.blast_radius = BlastRadiusSection(
            verdict.would_delete, verdict.listed, list(verdict.history), verdict.usual,
            cfg.sweep_growth_floor, cfg.sweep_max_share, cfg.sweep_max_growth,
            list(verdict.problems), self.opts.allow_large_sweep)
        if not verdict.refused or self.opts.allow_large_sweep:
            return None
        return ("blast-radius guard: " + "; ".join(verdict.problems) + ". Check the mark, "
                f"then sweep it with --sweep-only {s.run_id} --allow-large-sweep")


def reconcile(spark: Any, settings: Settings, opts: RunOptions, ui: Any = None) -> dict[str,
                                                                                        Any]:
    """Run one reconcile (mark, sweep, or both) and return its summary."""
    job = Run(spark, settings, opts, ui)
    try:
        return job.run().to_dict()
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
                             "plus that run's uncommitted set, and only the manifests of "
                             "commits new since (its stored keep-set); else a clean run")
    parser.add_argument("--max-baseline-age-hours", type=float, default=168.0,
                        help="--optimized reuses a baseline keep-set at most this old "
                             "(default 168)")
    parser.add_argument("--cutoff", help="ISO-8601 or epoch seconds; only earlier than "
                                         "now - reconcile_min_age_seconds")
    parser.add_argument("--inventory", metavar="PATH",
                        help="S3-Inventory-style Parquet/CSV (key,size,last_modified) instead "
                             "of listing: s3://bucket/prefix/ or a local directory")
    parser.add_argument("--expire-older-than-days", type=float,
                        help="snapshot expiration (seed 001) before retention: days > 0; "
                             "branch and tag heads are never expired")
    parser.add_argument("--expiration-mode", choices=("seed", "icechunk"), default="seed",
                        help="seed: refs at expired snapshots keep their ancestry (the seed's "
                             "sample run); icechunk: every ref's snapshot is re-parented to "
                             "the root (Icechunk 1.1)")
    parser.add_argument("--delete-expired-refs", action="store_true",
                        help="with expiration: write the branches and tags that point at "
                             "expired snapshots (never the default branch) to the report's "
                             "expired_refs.json for the service to delete (Icechunk's "
                             "delete-expired-tags/branches); they keep their data until the "
                             "service has deleted them")
    parser.add_argument("--ignore-tracker-progress", action="store_true",
                        help="DANGEROUS: do not hold the cutoff back to the tracker's progress")
    parser.add_argument("--max-mark-age-hours", type=float, default=24.0,
                        help="--sweep-only refuses older marks (default 24)")
    parser.add_argument("--uncommitted-export", metavar="PATH",
                        help="the service's own export of its uncommitted addresses (Parquet/"
                             "CSV + export.json): a directory, s3:// prefix, or 'namespace'; "
                             "default: the uncommitted_export setting")
    parser.add_argument("--allow-large-sweep", action="store_true",
                        help="sweep even when the blast-radius guard refuses (share of the "
                             "listing, growth over the last run)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def _options(args: argparse.Namespace, repo: str) -> RunOptions:
    """The one typed plan of a run, from the command line."""
    return RunOptions(
        repo=repo, dry_run=args.dry_run, sweep_only=args.sweep_only,
        optimized=args.optimized,
        cutoff_ms=parse_cutoff(args.cutoff) if args.cutoff else None,
        inventory=args.inventory, expire_older_than_days=args.expire_older_than_days,
        expiration_mode=args.expiration_mode, delete_expired_refs=args.delete_expired_refs,
        ignore_tracker_progress=args.ignore_tracker_progress,
        max_mark_age_hours=args.max_mark_age_hours,
        max_baseline_age_hours=args.max_baseline_age_hours,
        uncommitted_export=args.uncommitted_export,
        allow_large_sweep=args.allow_large_sweep)


def _check_args(args: argparse.Namespace) -> None:
    if args.inventory and args.optimized:
        raise UserError("--inventory and --optimized do not go together")
    if args.sweep_only and (args.optimized or args.inventory or args.cutoff
                            or args.uncommitted_export):
        raise UserError("--sweep-only takes no listing options")
    if args.expire_older_than_days is not None and not args.expire_older_than_days > 0:
        raise UserError("--expire-older-than-days must be > 0 (0 would count every branch "
                        "and tag head as expired)")
    if args.all and (args.sweep_only or args.inventory):
        raise UserError("--all takes no --sweep-only or --inventory (they name one "
                        "repository's run or input)")


def preflight(settings: Settings, opts: RunOptions) -> None:
    """The mistakes that can be told without Spark, told before it starts (25 to 40 s): an
    unknown or retired repository, a run id that names no mark of it, an inventory or a
    service export that is not there or not readable. The run checks each again."""
    import redis

    from reconciler.listing import named_inventory
    from reconciler.s3io import check_run_id
    from reconciler.service_export import find_export

    r = redis_sync(settings)
    try:
        ns = load_namespace(r, opts.repo)
        problem = retired_problem(r, opts.repo, ns)
    except ReconcileError as exc:
        raise UserError(str(exc)) from None
    except redis.exceptions.ConnectionError as exc:
        raise UserError(f"cannot reach the tracker's Redis ({exc}): nothing was done") from None
    finally:
        r.close()
    if problem:
        raise UserError(f"{problem}: nothing was done")
    s3 = s3_client(settings)
    if opts.sweep_only:
        if read_summary(s3, ns, check_run_id(opts.sweep_only)) is None:
            raise SweepRefused(f"no report for run {opts.sweep_only!r} in {ns.uri}")
        return
    try:
        if opts.inventory:
            named_inventory(s3, opts.inventory, ns.bucket)
        setting = opts.uncommitted_export if opts.uncommitted_export is not None \
            else settings.uncommitted_export
        if setting:
            location = resolve_location(setting, ns, opts.repo)
            if find_export(s3, location, opts.repo)[0] is None:
                raise ReconcileError(f"uncommitted export {location}: no export of "
                                     f"{opts.repo!r} there (reconciler/README.md)")
    except ReconcileError as exc:
        raise UserError(str(exc)) from None
    except Exception as exc:  # botocore: no such bucket, access denied
        raise UserError(f"{type(exc).__name__}: {exc}") from None


def run_cli(settings: Settings, args: argparse.Namespace) -> int:
    import orjson

    _check_args(args)
    if not settings.redis_url:
        raise UserError("reconcile needs the tracker's Redis: set redis_url "
                        "(HARDELETE_REDIS_URL)")
    if args.all:
        from core.clients import redis_sync
        from core.registry import repositories

        r = redis_sync(settings)
        try:
            repos = sorted(repositories(r))
        finally:
            r.close()
    else:
        repos = [args.repo]
        preflight(settings, _options(args, args.repo))
    from reconciler.spark import get_spark

    spark = get_spark(settings)
    ui = RichUi(spark) if sys.stderr.isatty() or not args.json else NullUi()
    summaries = []
    failed = 0
    for repo in repos:
        opts = _options(args, repo)
        # One repository's failure (reported in its summary) does not stop the others; with
        # --all a refused repository (retired, lease busy) is reported and the others go on.
        try:
            summary = reconcile(spark, settings, opts, ui)
        except UserError as exc:
            if not args.all:
                raise
            summary = {"repository": repo, "success": False, "status": "refused",
                       "error": str(exc), "dry_run": args.dry_run}
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
    if args.all and not args.dry_run and not args.sweep_only:
        failed += _purge_due_retired(settings, summaries, args.json)
    if args.json:
        body = summaries[0] if not args.all else summaries
        print(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode())
    return 0 if failed == 0 else 1


def _purge_due_retired(settings: Settings, summaries: list[dict[str, Any]], quiet: bool) -> int:
    """The nightly run also purges retired repositories whose retention is over (each a
    reported run through the gate, ``reconciler/retirement.py``); the failures."""
    from core.clients import redis_sync
    from reconciler.retirement import purge_due, purge_retired, retired_repositories

    r = redis_sync(settings)
    try:
        now = redis_time_ms(r)
        due = [rec.repository for rec in retired_repositories(r)
               if purge_due(rec, now, settings.retired_retention_days) is None]
    finally:
        r.close()
    failed = 0
    for repo in due:
        try:
            summary = purge_retired(settings, repo)
        except UserError as exc:  # raced with another run: reported, the others go on
            summary = {"repository": repo, "kind": "retired_purge", "status": "refused",
                       "error": str(exc)}
        summaries.append({**summary, "success": summary.get("status") == "done"})
        failed += summary.get("status") != "done"
        if not quiet:
            print(f"retired {repo}: {summary.get('status')}, deleted "
                  f"{summary.get('deleted', 0)} (report {summary.get('run_id', '-')})")
    return failed


__all__ = ["Run", "RunOptions", "configure", "decide_cutoff", "parse_cutoff", "reconcile",
           "run_cli"]
