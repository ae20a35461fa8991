"""``hardelete schedule``: run the reconciler once a day, catch up a missed day, surface failures.

The compose deployment's reconciler service runs this (Kubernetes uses a CronJob instead). The
decision is pure (:func:`decide`): a run is due when no run succeeded since the most recent
daily slot, so a scheduler that was down at 02:00 runs as soon as it is back (one run, not one
per missed day). A failed run is retried every ``--retry-minutes`` and stays visible: its exit code
and error line are recorded in Redis (``RECONCILER_SCHEDULE``), logged as an error, and make
``hardelete health reconciler`` fail (the compose healthcheck). Each run is a child process
(``hardelete reconcile ...``), so a crashed Spark driver never takes the scheduler down with it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from core.errors import UserError
from core.logs import get_logger
from core.settings import Settings
from schemas.layout import RECONCILER_SCHEDULE

log = get_logger("schedule")
DAY = dt.timedelta(days=1)


@dataclass(frozen=True)
class Decision:
    run_now: bool
    wait_s: float
    why: str


def last_slot(now: dt.datetime, at: dt.time) -> dt.datetime:
    """The most recent daily slot at or before ``now`` (UTC)."""
    slot = dt.datetime.combine(now.date(), at, tzinfo=dt.UTC)
    return slot if slot <= now else slot - DAY


def decide(now: dt.datetime, at: dt.time, last_success: dt.datetime | None,
           last_failure: dt.datetime | None, retry: dt.timedelta) -> Decision:
    slot = last_slot(now, at)
    if last_success is not None and last_success >= slot:
        nxt = slot + DAY
        return Decision(False, (nxt - now).total_seconds(), f"done for {slot:%Y-%m-%d}; next "
                        f"at {nxt.isoformat()}")
    if last_failure is not None and last_failure >= slot and now < last_failure + retry:
        return Decision(False, (last_failure + retry - now).total_seconds(),
                        f"the run at {last_failure.isoformat()} failed; retry at "
                        f"{(last_failure + retry).isoformat()}")
    why = ("first run" if last_success is None else
           f"no successful run since the slot {slot.isoformat()} (last success "
           f"{last_success.isoformat()}): catching up")
    return Decision(True, 0.0, why)


def parse_at(text: str) -> dt.time:
    try:
        return dt.time.fromisoformat(text)
    except ValueError:
        raise UserError(f"--at expects HH:MM (UTC), got {text!r}") from None


def _ms_to_dt(v: str | None) -> dt.datetime | None:
    if not v:
        return None
    return dt.datetime.fromtimestamp(int(v) / 1000, dt.UTC)


def _state(r: Any) -> tuple[dt.datetime | None, dt.datetime | None]:
    h = r.hgetall(RECONCILER_SCHEDULE)
    failure = _ms_to_dt(h.get("last_attempt_ms")) if h.get("last_exit") not in (None, "0") \
        else None
    return _ms_to_dt(h.get("last_success_ms")), failure


def run_command(settings: Settings, r: Any, command: list[str]) -> int:
    """Run ``hardelete COMMAND`` as a child and record its outcome."""
    started = dt.datetime.now(dt.UTC)
    log.info("scheduled run starting", command=" ".join(command))
    proc = subprocess.run([sys.executable, "-m", "hardelete.cli", *command],
                          capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    ms = int(started.timestamp() * 1000)
    fields: dict[str, str] = {"last_attempt_ms": str(ms), "last_exit": str(proc.returncode)}
    if proc.returncode == 0:
        fields["last_success_ms"] = str(ms)
        fields["last_error"] = ""
        log.info("scheduled run done", command=" ".join(command))
    else:
        err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        fields["last_error"] = err[-1][:500] if err else f"exit {proc.returncode}"
        log.error("scheduled run FAILED", command=" ".join(command), exit=proc.returncode,
                  error=fields["last_error"])
    r.hset(RECONCILER_SCHEDULE, mapping=fields)
    return proc.returncode


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--at", default="02:00", help="daily slot, HH:MM UTC")
    parser.add_argument("--retry-minutes", type=float, default=30.0,
                        help="after a failed run, try again this much later")
    parser.add_argument("--once", action="store_true",
                        help="run now if due, then exit with the run's code (0 if not due)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the hardelete command to run (default: reconcile --all)")


def run_cli(settings: Settings, args: argparse.Namespace) -> int:
    from core.clients import redis_sync

    at = parse_at(args.at)
    command = [c for c in args.command if c != "--"] or ["reconcile", "--all"]
    retry = dt.timedelta(minutes=args.retry_minutes)
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    r = redis_sync(settings)
    try:
        now_ms = str(int(dt.datetime.now(dt.UTC).timestamp() * 1000))
        r.hsetnx(RECONCILER_SCHEDULE, "started_ms", now_ms)
        while not stop.is_set():
            success, failure = _state(r)
            d = decide(dt.datetime.now(dt.UTC), at, success, failure, retry)
            log.info("schedule", run_now=d.run_now, why=d.why, pid=os.getpid())
            if d.run_now:
                code = run_command(settings, r, command)
                if args.once:
                    return code
                continue
            if args.once:
                return 0
            stop.wait(min(d.wait_s, 300.0))  # re-decide every 5 min: the clock may jump
        return 0
    finally:
        r.close()
