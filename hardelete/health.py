"""Operator health: what ``status`` adds to its table, and ``hardelete health COMPONENT``, the
healthcheck of compose and the readiness probe of Kubernetes.

- tracker liveness: the age of the tracker's newest progress claim (``hd:progress``, Redis clock).
  A live tracker claims progress every cycle, even on an idle topic; an old one means no tracker
  is consuming, and reaping is held back (the horizon stops).
- dead letters: the dead-letter topic's high-watermark sum, when Kafka answers.
- holds, paused and fail-closed repositories (Safety I/II keys in schemas/layout.py).
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
from core.settings import Settings
from schemas.layout import FAIL_CLOSED, PROGRESS, RECONCILER_SCHEDULE, REPOS, RepoKeys

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


def collect_operations(r: Any, settings: Settings, *, kafka: bool = True) -> Operations:
    age = progress_age_s(r)
    repos = sorted(r.smembers(REPOS))
    pipe = r.pipeline(transaction=False)
    for repo in repos:
        k = RepoKeys(repo)
        pipe.hlen(k.holds)
        pipe.hlen(k.hold_prefixes)
        pipe.get(k.paused)
        pipe.hgetall(k.fail_closed)
    pipe.hgetall(FAIL_CLOSED)
    res = pipe.execute()
    holds, paused, failed = {}, {}, {}
    for i, repo in enumerate(repos):
        n_addr, n_pre, p, fc = res[4 * i: 4 * i + 4]
        if n_addr or n_pre:
            holds[repo] = int(n_addr) + int(n_pre)
        if p is not None:
            paused[repo] = _json(p)
        if fc:
            failed[repo] = dict(fc)
    if res[-1]:
        failed["*"] = dict(res[-1])
    dl, note = dead_letter_count(settings) if kafka else (None, "not asked")
    return Operations(age, age is not None and age <= settings.tracker_stale_seconds, dl, note,
                      holds, paused, failed)


def print_operations(ops: Operations, settings: Settings) -> None:
    from rich.console import Console

    con = Console()
    if ops.tracker_progress_age_s is None:
        con.print("[red]tracker: no progress ever claimed (no tracker has run)[/red]")
    elif ops.tracker_alive:
        con.print(f"tracker: alive, last progress {ops.tracker_progress_age_s:.1f}s ago")
    else:
        con.print(f"[red]tracker: STALE, last progress {ops.tracker_progress_age_s:.0f}s ago "
                  f"(> {settings.tracker_stale_seconds:g}s): reaping is held back[/red]")
    if ops.dead_letters is None:
        con.print(f"dead letters: unknown ({ops.dead_letters_note})")
    else:
        style = "yellow" if ops.dead_letters else ""
        text = f"dead letters: {ops.dead_letters} in {ops.dead_letters_note}"
        con.print(f"[{style}]{text}[/{style}]" if style else text)
    con.print("holds: " + (", ".join(f"{r}={n}" for r, n in ops.holds.items()) or "none"))
    for repo, info in ops.paused.items():
        con.print(f"[yellow]paused: {repo} ({info.get('reason', '')})[/yellow]")
    for repo, info in ops.fail_closed.items():
        who = "every repository" if repo == "*" else repo
        con.print(f"[red]fail-closed: {who} ({info.get('reason', '')})[/red]")


# --- hardelete health ----------------------------------------------------------------------------

def _metrics_problem(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            body = resp.read(1 << 16)
    except OSError as exc:
        return f"metrics endpoint on port {port} does not answer ({exc})"
    if b"# HELP" not in body:
        return f"metrics endpoint on port {port} answers without metrics"
    return None


def check_component(r: Any, settings: Settings, component: str,
                    max_age_hours: float = 26.0) -> str | None:
    """None if healthy, else why not (one line)."""
    if component in ("tracker", "reaper") and settings.metrics_port:
        problem = _metrics_problem(settings.metrics_port)
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
        h = r.hgetall(RECONCILER_SCHEDULE)
        if not h:
            return "no scheduler has started (hardelete schedule)"
        if "last_exit" not in h:  # waiting for its first run: healthy for one period
            started = int(h.get("started_ms") or 0)
            if (time.time() * 1000 - started) / 3_600_000 > max_age_hours:
                return f"no run in the {max_age_hours:g} h since the scheduler started"
            return None
        if h.get("last_exit") not in (None, "0"):
            return (f"the last scheduled run failed (exit {h.get('last_exit')}): "
                    f"{h.get('last_error', '')}")
        last = int(h.get("last_success_ms") or 0)
        if last and (time.time() * 1000 - last) / 3_600_000 > max_age_hours:
            return f"no successful run in the last {max_age_hours:g} h"
    return None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("component", choices=COMPONENTS)
    parser.add_argument("--max-age-hours", type=float, default=26.0,
                        help="reconciler: the last success must be at most this old")


def run_cli(settings: Settings, args: argparse.Namespace) -> int:
    from core.clients import redis_sync

    r = redis_sync(settings)
    try:
        problem = check_component(r, settings, args.component, args.max_age_hours)
    finally:
        r.close()
    if problem:
        print(f"hardelete: {args.component} unhealthy: {problem}")
        return 1
    print(f"{args.component}: healthy")
    return 0
