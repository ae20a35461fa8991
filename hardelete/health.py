"""Operator health: what ``status`` adds to its table, and ``hardelete health COMPONENT``, the
healthcheck of compose and the readiness probe of Kubernetes.

- tracker liveness: the age of the tracker's newest progress claim (``hd:progress``, Redis clock).
  A live tracker claims progress every cycle, even on an idle topic; an old one means no tracker
  is consuming, and reaping is held back (the horizon stops).
- dead letters: the dead-letter topic's high-watermark sum, when Kafka answers; and the dead
  letters whose holds are not resolved yet (their claims in the holds, Redis).
- holds, paused and fail-closed repositories (Safety I/II keys in schemas/layout.py); a
  repository whose whole namespace a dead letter holds (an event nobody could read: nothing of
  it is deleted until `dlq resolve`) is frozen.
- incidents not acknowledged yet (hardelete/incidents.py).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import orjson

from core.clock import redis_time_ms
from core.errors import UserError
from core.settings import Settings
from schemas.address import canonical_namespace
from schemas.holds import DLQ, claims_of
from schemas.layout import (
    FAIL_CLOSED,
    PROGRESS,
    RECONCILER_SCHEDULE,
    REPOS,
    OutsideNamespace,
    RepoKeys,
)

COMPONENTS = ("tracker", "reaper", "reconciler")


@dataclass
class Operations:
    tracker_progress_age_s: float | None  # None: the tracker never claimed progress
    tracker_alive: bool
    dead_letters: int | None  # None: Kafka not configured or not answering
    dead_letters_note: str
    holds: dict[str, int] = field(default_factory=dict)
    paused: dict[str, dict[str, Any]] = field(default_factory=dict)
    fail_closed: dict[str, dict[str, Any]] = field(default_factory=dict)  # "*": every repository
    # repository -> what holds its whole namespace for a dead letter (why each was dead-lettered)
    frozen: dict[str, list[str]] = field(default_factory=dict)
    dead_letters_holding: int = 0  # dead letters whose holds no `dlq resolve` lifted yet
    incidents_new: dict[str, int] = field(default_factory=dict)  # scope ("*", repo) -> count


def progress_age_s(r: Any) -> float | None:
    """Seconds since the newest progress any tracker claimed (None: never)."""
    newest = None
    for v in r.hgetall(PROGRESS).values():
        try:
            ms = int(float(v))
        except (TypeError, ValueError):
            continue  # a field of another shape (e.g. keyed by log identity) is not a time
        newest = ms if newest is None else max(newest, ms)
    if newest is None:
        return None
    return max(0.0, (redis_time_ms(r) - newest) / 1000)


def _json(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    try:
        v = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {"reason": str(raw)}
    return v if isinstance(v, dict) else {"reason": str(v)}


def dead_letter_count(settings: Settings, timeout_s: float = 5.0) -> tuple[int | None, str]:
    from hardelete.services import KAFKA, ServiceError, check

    if not settings.kafka_bootstrap:
        return None, "Kafka not configured (kafka_bootstrap)"
    try:
        check(settings, (KAFKA,))
    except ServiceError as exc:
        return None, str(exc)
    from hardelete.dlq import counts

    async def run() -> tuple[int, int]:
        return await asyncio.wait_for(counts(settings), timeout_s)

    try:
        total, _retained = asyncio.run(run())
    except Exception as exc:  # status still shows the rest
        return None, f"Kafka at {settings.kafka_bootstrap}: {type(exc).__name__}: {exc}"
    return total, settings.dlq_topic


def _dlq_claims(raw: Any) -> dict[str, dict[str, Any]]:
    return {cid: c for cid, c in claims_of(raw).items()
            if cid.startswith(DLQ + ":") or (isinstance(c, dict) and c.get("source") == DLQ)}


def _covers(target: str, namespace: str | None) -> bool:
    """A prefix hold on ``target`` holds all of ``namespace``."""
    if not namespace:
        return False
    try:
        return canonical_namespace(namespace).startswith(target)
    except OutsideNamespace:
        return False


def collect_operations(r: Any, settings: Settings, *, kafka: bool = True) -> Operations:
    from hardelete.incidents import unacknowledged

    age = progress_age_s(r)
    repos = sorted(r.smembers(REPOS))
    pipe = r.pipeline(transaction=False)
    for repo in repos:
        k = RepoKeys(repo)
        pipe.hgetall(k.holds)
        pipe.hgetall(k.hold_prefixes)
        pipe.get(k.paused)
        pipe.hgetall(k.fail_closed)
        pipe.hget(k.meta, "namespace")
    pipe.hgetall(FAIL_CLOSED)
    res = pipe.execute()
    holds, paused, failed, frozen = {}, {}, {}, {}
    holding: set[str] = set()
    for i, repo in enumerate(repos):
        addr, pre, p, fc, ns = res[5 * i: 5 * i + 5]
        if addr or pre:
            holds[repo] = len(addr) + len(pre)
        for raw in (*addr.values(), *pre.values()):
            holding.update(_dlq_claims(raw))
        whole = [str(c.get("reason") or cid)[:200] for target, raw in sorted(pre.items())
                 if _covers(target, ns) for cid, c in _dlq_claims(raw).items()]
        if whole:
            frozen[repo] = whole
        if p is not None:
            paused[repo] = _json(p)
        if fc:
            failed[repo] = dict(fc)
    if res[-1]:
        failed["*"] = dict(res[-1])
    new: dict[str, int] = {}
    for inc in unacknowledged(r):
        if inc.needs_person:
            new[inc.scope] = new.get(inc.scope, 0) + 1
    dl, note = dead_letter_count(settings) if kafka else (None, "not asked")
    return Operations(age, age is not None and age <= settings.tracker_stale_seconds, dl, note,
                      holds, paused, failed, frozen, len(holding), new)


# --- hardelete health ----------------------------------------------------------------------------

# The gauge each daemon sets whenever its loop completes a step (tracker/metrics.py,
# reaper/daemon.py): the endpoint answering says the process lives, this says its loop does.
LOOP_GAUGE = {"tracker": "hardelete_tracker_cycle_timestamp_seconds",
              "reaper": "hardelete_reaper_progress_timestamp_seconds"}


def _metrics_body(port: int) -> tuple[bytes, str | None]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            body = resp.read(1 << 20)
    except OSError as exc:
        return b"", f"metrics endpoint on port {port} does not answer ({exc})"
    if b"# HELP" not in body:
        return body, f"metrics endpoint on port {port} answers without metrics"
    return body, None


def metric_value(body: bytes, name: str) -> float | None:
    """The value of an unlabelled sample ``name`` in a Prometheus text exposition (None:
    absent or unreadable)."""
    for line in body.decode(errors="replace").splitlines():
        head, _, value = line.partition(" ")
        if head == name:
            try:
                return float(value.split()[0])
            except (IndexError, ValueError):
                return None
    return None


def stall_limit_s(settings: Settings, component: str) -> float:
    """How long a daemon's loop may go without completing a step before it counts as stuck:
    a tracker cycles at least every poll (tracker_stale_seconds, as its progress); a reaper
    step is at most a delete batch, bounded by its claims' lease."""
    if component == "tracker":
        return settings.tracker_stale_seconds
    return max(settings.tracker_stale_seconds,
               settings.lease_seconds + settings.reaper_poll_seconds)


def loop_problem(component: str, body: bytes, now_s: float, limit_s: float) -> str | None:
    """Why a daemon's loop is not making progress, judged from its own metrics (pure)."""
    name = LOOP_GAUGE[component]
    at = metric_value(body, name)
    if at is None or at <= 0:
        return f"its loop has not completed a step yet ({name} unset)"
    age = now_s - at
    if age > limit_s:
        return (f"its loop is stuck: no step completed for {age:.0f}s (> {limit_s:g}s; "
                f"{name})")
    return None


@dataclass(frozen=True)
class LastRun:
    """The newest real (not dry) reconcile run a repository's reports show."""

    run_id: str
    started_ms: int  # Redis clock, the run's start (summary ``now_ms``)
    ok: bool  # the mark succeeded and its sweep completed
    error: str | None


def last_run(s3: Any, namespace: str, repo: str, scan: int = 20) -> LastRun | None:
    """From the summary.json each run writes in the namespace (reconciler/report.py). Passed
    over: a dry run whose mark no sweep took up (``--sweep-only`` makes it real), and a run
    still going (or whose driver died: its summary stays ``running``). A sweep the operator
    paused (`hardelete pause`) is no failure; any other that did not complete is."""
    from reconciler.report import read_summary, run_ids
    from reconciler.s3io import Namespace

    ns = Namespace(namespace)
    for rid in run_ids(s3, ns)[:scan]:
        summary = read_summary(s3, ns, rid)
        if not summary or summary.get("repository") != repo \
                or summary.get("status") == "running":
            continue
        raw = summary.get("sweep")
        sweep: dict[str, Any] = raw if isinstance(raw, dict) else {}
        if summary.get("dry_run") and sweep.get("status") in (None, "not_run"):
            continue
        ok = bool(summary.get("success")) and sweep.get("status") in ("done", "paused")
        why = summary.get("error") or sweep.get("error") or sweep.get("reason") \
            or f"sweep {sweep.get('status')}"
        return LastRun(rid, int(summary.get("now_ms") or 0), ok, None if ok else str(why))
    return None


def judge_reconciler(runs: dict[str, LastRun | None], now_ms: int, max_age_hours: float,
                     scheduler_started_ms: int | None = None) -> str | None:
    """Whether reconciling is healthy, from each live repository's newest real run (pure): the
    newest failed, or is older than ``max_age_hours`` (a daily schedule missed), or no run
    has reported at all (unless a scheduler started less than that ago has not run yet:
    ``scheduler_started_ms``, None once it ran). A repository with no run yet while others
    have one is new since the last run, or refused by it (its exit code says so: the
    scheduler's record, the CronJob's failed Job)."""
    max_age_ms = max_age_hours * 3_600_000
    for repo, run in sorted(runs.items()):
        if run is None:
            continue
        if not run.ok:
            return (f"the last reconcile run of {repo} ({run.run_id}) failed: "
                    f"{run.error or 'its sweep did not complete'}")
        age_ms = now_ms - run.started_ms
        if age_ms > max_age_ms:
            return (f"the last reconcile run of {repo} ({run.run_id}) started "
                    f"{age_ms / 3_600_000:.1f} h ago (> {max_age_hours:g} h)")
    if runs and all(run is None for run in runs.values()):
        if scheduler_started_ms is not None and now_ms - scheduler_started_ms <= max_age_ms:
            return None  # waiting for the scheduler's first run
        return "no reconcile run has reported in any repository's namespace"
    return None


def reconciler_problem(r: Any, s3: Any, max_age_hours: float) -> str | None:
    from core.registry import repo_namespace, repositories

    h = r.hgetall(RECONCILER_SCHEDULE)
    if h.get("last_exit") not in (None, "0"):
        return (f"the last scheduled run failed (exit {h.get('last_exit')}): "
                f"{h.get('last_error', '')}")
    runs: dict[str, LastRun | None] = {}
    for repo in sorted(repositories(r)):
        ns = repo_namespace(r, repo)
        if ns:
            runs[repo] = _last_run_or_none(s3, ns, repo)
    # A scheduler that has not run yet is waiting for its slot; one that ran a command that
    # wrote no report (`schedule -- status`) reconciled nothing.
    waiting = h.get("started_ms") if "last_attempt_ms" not in h else None
    return judge_reconciler(runs, redis_time_ms(r), max_age_hours,
                            int(waiting) if waiting else None)


def _last_run_or_none(s3: Any, namespace: str, repo: str) -> LastRun | None:
    from botocore.exceptions import ClientError

    try:
        return last_run(s3, namespace, repo)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "NoSuchBucket":
            return None  # no bucket, no report
        raise


def loop_check(settings: Settings, component: str,
               stall_seconds: float | None = None) -> str | None:
    """The daemon's own loop, from its metrics endpoint: None if it completed a step within
    the stall limit, else why not (one line)."""
    if not settings.metrics_port:
        raise UserError(f"health {component} reads the daemon's own loop from its metrics "
                        "endpoint: set metrics_port (HARDELETE_METRICS_PORT) as the "
                        "daemon has it")
    body, problem = _metrics_body(settings.metrics_port)
    if problem is None:
        limit = stall_limit_s(settings, component) if stall_seconds is None else stall_seconds
        problem = loop_problem(component, body, time.time(), limit)
    return problem


def check_component(r: Any, settings: Settings, component: str, max_age_hours: float = 26.0,
                    *, s3: Any = None, stall_seconds: float | None = None) -> str | None:
    """None if healthy, else why not (one line)."""
    if component in LOOP_GAUGE:
        problem = loop_check(settings, component, stall_seconds)
        if problem:
            return problem
    if component == "tracker":
        age = progress_age_s(r)
        if age is None:
            return "the tracker has claimed no progress yet"
        if age > settings.tracker_stale_seconds:
            return (f"the tracker's last progress is {age:.0f}s old "
                    f"(> tracker_stale_seconds={settings.tracker_stale_seconds:g})")
    if component == "reconciler":
        return reconciler_problem(r, s3, max_age_hours)
    return None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("component", choices=COMPONENTS)
    parser.add_argument("--max-age-hours", type=float, default=26.0,
                        help="reconciler: each repository's last run must have started at "
                             "most this long ago (daily schedule: 26)")
    parser.add_argument("--stall-seconds", type=float,
                        help="tracker, reaper: the longest its loop may go without completing "
                             "a step (default: tracker_stale_seconds; reaper: the larger of "
                             "that and lease_seconds + reaper_poll_seconds)")
    parser.add_argument("--loop-only", action="store_true",
                        help="tracker, reaper: judge only the daemon's own loop and ask no "
                             "other service (liveness probes: a tracker catching up a backlog "
                             "proves no progress until it is through, and neither that nor "
                             "Redis or Kafka being down is cured by a restart)")


def run_cli(settings: Settings, args: argparse.Namespace) -> int:
    from core.clients import redis_sync, s3_client

    if args.max_age_hours <= 0 or (args.stall_seconds is not None and args.stall_seconds <= 0):
        raise UserError("--max-age-hours and --stall-seconds must be > 0")
    if args.loop_only:
        if args.component not in LOOP_GAUGE:
            raise UserError(f"--loop-only is for the daemons (tracker, reaper), not "
                            f"{args.component}")
        return _report(args.component, loop_check(settings, args.component,
                                                   args.stall_seconds))
    r = redis_sync(settings)
    try:
        s3 = s3_client(settings) if args.component == "reconciler" else None
        problem = check_component(r, settings, args.component, args.max_age_hours, s3=s3,
                                  stall_seconds=args.stall_seconds)
    finally:
        r.close()
    return _report(args.component, problem)


def _report(component: str, problem: str | None) -> int:
    if problem:
        print(f"hardelete: {component} unhealthy: {problem}")
        return 1
    print(f"{component}: healthy")
    return 0
