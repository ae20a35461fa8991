"""``hardelete status`` and ``hardelete explain ADDRESS``: what the online path knows.

status: per repository, the reaper's queue, claims in flight, tombstones, incidents and counters,
and the tracker's proven progress per partition (a lagging tracker holds reaping back).
explain: why one address is alive, when it may go, or why and when it was deleted.
"""

from __future__ import annotations

import argparse
import datetime as dt
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from hardelete import UserError
from hardelete.clients import redis_sync, s3_client
from hardelete.settings import Settings
from schemas.layout import PROGRESS, PROGRESS_META, REPOS, AddressState, RepoKeys
from tracker.state import horizon_from, parse_address, parse_token, redis_time_ms


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="milliseconds")


@dataclass
class RepoStatus:
    repository: str
    namespace: str
    queued: int
    claims: int
    tombstones: int
    incidents: int
    counters: dict[str, int] = field(default_factory=dict)


@dataclass
class Status:
    now_ms: int
    horizon_ms: int | None
    progress_lag_s: dict[str, float]
    repositories: list[RepoStatus]


def collect_status(r: Any) -> Status:
    now = redis_time_ms(r)
    progress = r.hgetall(PROGRESS)
    horizon = horizon_from(r.hgetall(PROGRESS_META), progress)
    repos = []
    for repo in sorted(r.smembers(REPOS)):
        k = RepoKeys(repo)
        pipe = r.pipeline(transaction=False)
        pipe.hget(k.meta, "namespace")
        pipe.zcard(k.unreferenced)
        pipe.zcard(k.claims)
        pipe.zcard(k.reaped)
        pipe.llen(k.incidents)
        pipe.hgetall(k.stats)
        ns, queued, claims, tomb, inc, stats = pipe.execute()
        repos.append(RepoStatus(repo, ns or "?", queued, claims, tomb, inc,
                                {f: int(float(v)) for f, v in (stats or {}).items()}))
    lag = {p: max(0.0, (now - int(v)) / 1000) for p, v in sorted(progress.items())}
    return Status(now, horizon, lag, repos)


def _print_status(st: Status) -> None:
    con = Console()
    t = Table(title="hardelete status")
    for col in ("repository", "namespace", "queued", "claims", "tombstones", "incidents",
                "counters"):
        t.add_column(col)
    for r in st.repositories:
        counters = ", ".join(f"{k}={v}" for k, v in sorted(r.counters.items()))
        style = "bold red" if r.incidents else ""
        t.add_row(r.repository, r.namespace, str(r.queued), str(r.claims), str(r.tombstones),
                  str(r.incidents), counters, style=style)
    con.print(t)
    lag = ", ".join(f"p{p}: {s:.1f}s" for p, s in st.progress_lag_s.items()) or "none"
    con.print(f"tracker progress lag per partition: {lag}")
    if st.horizon_ms is None:
        con.print("[yellow]tracker horizon: none yet (nothing may be reaped)[/yellow]")
    else:
        con.print(f"tracker horizon: {_when(st.horizon_ms)}")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true")


def run_cli(settings: Settings, args: argparse.Namespace) -> int:
    from hardelete.health import collect_operations, print_operations

    r = redis_sync(settings)
    try:
        st = collect_status(r)
        ops = collect_operations(r, settings)
    finally:
        r.close()
    if args.json:
        print(orjson.dumps({**asdict(st), "operations": asdict(ops)},
                           option=orjson.OPT_INDENT_2).decode())
    else:
        _print_status(st)
        print_operations(ops, settings)
    return 0


# --- explain -------------------------------------------------------------------------------------

@dataclass
class Explanation:
    address: str
    repository: str | None
    state: str
    verdict: str
    lines: list[str]


def reconciler_history(s3: Any, namespace: str, address: str, runs: int = 5) -> list[str]:
    """What the last few reconciler runs did with an address (from their reports)."""
    from reconciler.report import read_summary, run_ids
    from reconciler.s3io import Namespace, list_keys, read_parquet_rows

    ns = Namespace(namespace)
    rel = ns.rel_of_address(address)
    lines: list[str] = []
    for rid in run_ids(s3, ns)[:runs]:
        summary = read_summary(s3, ns, rid) or {}
        for part in ("sweep", "mark"):
            prefix = ns.report_prefix(rid) + part + "/"
            cols = ("key", "category", "outcome") if part == "sweep" else ("key", "category")
            found = None
            for key in list_keys(s3, ns.bucket, prefix):
                if key.endswith(".parquet"):
                    for row in read_parquet_rows(s3, ns.bucket, key, cols):
                        if row[0] == rel:
                            found = row
                            break
                if found:
                    break
            if found:
                if part == "sweep":
                    lines.append(f"reconciler run {rid}: {found[2]} as {found[1]} "
                                 f"(cutoff {summary.get('cutoff', '?')})")
                else:
                    lines.append(f"reconciler run {rid}: marked as {found[1]}"
                                 + (" (dry run)" if summary.get("dry_run") else ""))
                break
    return lines


def explain_address(r: Any, settings: Settings, address: str,
                    repository: str | None = None, s3: Any = None) -> Explanation:
    repos = [repository] if repository else sorted(r.smembers(REPOS))
    repo = None
    for candidate in repos:
        ns = r.hget(RepoKeys(candidate).meta, "namespace")
        if ns and address.startswith(ns):
            repo = candidate
            break
    if repo is None:
        return Explanation(address, None, "unknown", "outside every tracked namespace",
                           ["No tracked repository's namespace contains this address: "
                            "hardelete never deletes it."])
    k = RepoKeys(repo)
    h = r.hgetall(k.address(address))
    history: list[str] = []
    if s3 is not None:
        history = reconciler_history(s3, r.hget(k.meta, "namespace"), address)
    if not h:
        return Explanation(address, repo, "untracked", "only the reconciler decides", [
            "The tracker never saw a reference to this address (a leak, an object from before "
            "tracking started, or its tombstone was pruned).",
            "The online path never deletes it; the nightly reconciler deletes it if no retained "
            "commit, staging token or issued upload references it and it is older than the "
            "cutoff.", *history])
    rec = parse_address(h)
    now = redis_time_ms(r)
    tokens = r.hgetall(k.tokens)
    lines = []
    for ref, tok in sorted(rec.adds.items()):
        tstate = parse_token(tokens[tok])[0].value if tok in tokens else "unknown"
        removed = ref in rec.removes
        lines.append(f"reference {ref} in token {tok} ({tstate})"
                     + (": removed" if removed else ": live" if tstate in (
                         "open", "sealed", "unknown") else f": ended ({tstate})"))
    for ref, tok in sorted(rec.removes.items()):
        if ref not in rec.adds:
            lines.append(f"reference {ref} (token {tok}) removed before its add arrived")
    state = rec.state.value if rec.state else "none"
    horizon = horizon_from(r.hgetall(PROGRESS_META), r.hgetall(PROGRESS))
    grace_ms = int(settings.grace_for(repo) * 1000)
    if rec.committed:
        verdict = "alive: a commit took it (only the reconciler may delete it, by retention)"
    elif rec.state == AddressState.STAGED:
        verdict = "alive: a live reference in an open or sealed staging token"
    elif rec.state == AddressState.ISSUED:
        verdict = f"alive: issued upload address, protected until {_when(rec.issued_until)}"
    elif rec.state == AddressState.UNREFERENCED:
        eligible = max(rec.since or 0, rec.issued_until or 0) + grace_ms
        wait = ("now" if horizon is not None and horizon >= eligible
                else f"once the tracker's proven progress passes {_when(eligible)}")
        verdict = (f"garbage: unreferenced since {_when(rec.since)}; may be reaped {wait} "
                   f"(grace {grace_ms / 1000:g}s)")
    elif rec.state == AddressState.REAPING:
        verdict = f"being reaped by {rec.claimer}, lease until {_when(rec.lease_until)}"
    elif rec.state == AddressState.REAPED:
        verdict = (f"deleted by the reaper at {_when(rec.reaped_at)}: every reference had ended "
                   f"by {_when(rec.since)} and the grace window had passed")
    else:
        verdict = f"state {state}"
    if rec.state == AddressState.REAPED:  # moved to quarantine rather than deleted?
        from reaper.quarantine_ops import restore_hint

        lines += restore_hint(s3, settings, repo, r.hget(k.meta, "namespace"), address)
    incidents = [orjson.loads(j) for j in r.lrange(k.incidents, -1000, -1)]
    for inc in incidents:
        if inc.get("address") == address:
            lines.append(f"INCIDENT: {inc}")
    if rec.issued_until:
        lines.append(f"issued upload protected until {_when(rec.issued_until)}")
    lines.append(f"now {_when(now)}; tracker horizon {_when(horizon)}")
    return Explanation(address, repo, state, verdict, lines + history)


class explain:  # the CLI's command object for `hardelete explain`
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("address", help="s3:// address")
        parser.add_argument("--repo", help="repository (default: found by namespace)")
        parser.add_argument("--no-reports", action="store_true",
                            help="do not read the reconciler's reports from the store")
        parser.add_argument("--json", action="store_true")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        if not args.address.startswith("s3://"):
            raise UserError(f"address must be an s3:// URI, got {args.address!r}")
        r = redis_sync(settings)
        try:
            s3 = None if args.no_reports else s3_client(settings)
            ex = explain_address(r, settings, args.address, args.repo, s3)
        finally:
            r.close()
        if args.json:
            print(orjson.dumps(asdict(ex), option=orjson.OPT_INDENT_2).decode())
        else:
            con = Console()
            con.print(f"[bold]{ex.address}[/bold]  repository={ex.repository} state={ex.state}")
            con.print(f"  {ex.verdict}")
            for line in ex.lines:
                con.print(f"  - {line}")
        return 0
