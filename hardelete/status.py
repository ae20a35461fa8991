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
from rich import box
from rich.console import Console
from rich.table import Table

from core.clients import redis_sync, s3_client
from core.clock import horizon_from, redis_time_ms
from core.errors import UserError
from core.facts import RepoFacts
from core.gate import read_gate
from core.guards import fail_closed_repos
from core.registry import find_owner, owned_namespaces, repo_namespace
from core.settings import Settings
from hardelete.health import Operations
from schemas.address import canonical_uri, has_scheme
from schemas.holds import TargetError, resolve_target
from schemas.layout import (
    FAIL_CLOSED,
    INCIDENTS,
    PROGRESS,
    PROGRESS_META,
    REPOS,
    RETIRED,
    OutsideNamespace,
    RepoKeys,
)
from schemas.liveness import Keep, judge
from schemas.records import AddressRecord, decode_address, token_state


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
    fail_closed: str | None = None  # why nothing is deleted for it (Safety I), or None
    needs: str | None = None  # fail-closed: what lifts it (the rebuild's next step)
    rebuild_nonce: str | None = None  # the nonce the service's state export must carry
    continuity: ContinuityView | None = None  # a sequenced repository's certified history


@dataclass(frozen=True)
class ContinuityView:
    """A sequenced repository's continuity (schemas/README.md, "Continuity"): the horizon its
    service certified (None: nothing of it is deleted online), a broken stripe's reason, and
    the seqs the tracker is still asking for."""

    stripes: int
    horizon_ms: int | None
    broken: str | None = None  # "stripe k: reason"
    missing: tuple[tuple[int, int, int], ...] = ()  # (stripe, from, to)
    # missing seqs that were dead-lettered: (stripe, seq, dead letter "p:o", its reason)
    dead: tuple[tuple[int, int, str, str], ...] = ()
    # how far the slot's clock is ahead of its node's (a clock stepped back): ticks wait
    clock_ahead_ms: int = 0

    def text(self, now_ms: int) -> str:
        stall = "" if self.clock_ahead_ms <= 1000 else (
            f"; its Redis slot's clock is {self.clock_ahead_ms / 1000:.1f}s ahead of its "
            "node's (a clock stepped back?): the horizon waits until the node catches up")
        return self._state(now_ms) + stall

    def _state(self, now_ms: int) -> str:
        if self.broken:
            return f"broken ({self.broken})"
        if self.dead:
            k, seq, where, why = self.dead[0]
            more = f" and {len(self.dead) - 1} more" if len(self.dead) > 1 else ""
            return (f"waiting for seq {seq} of stripe {k}{more}: dead-lettered ({where}: "
                    f"{why}); replay it fixed (`hardelete dlq replay`) to go on")
        if self.missing:
            k, a, b = self.missing[0]
            more = f" and {len(self.missing) - 1} more" if len(self.missing) > 1 else ""
            return f"waiting for seqs {a}..{b} of stripe {k}{more}"
        if self.horizon_ms is None:
            return "no watermark yet"
        return f"certified to {max(0.0, (now_ms - self.horizon_ms) / 1000):.1f}s ago"


def continuity_view(r: Any, repo: str, stripes: int) -> ContinuityView:
    from core.continuity import gaps, horizon
    from core.continuity_store import ContinuityStore

    store = ContinuityStore(r)
    domains = [store.read(repo, k) for k in range(stripes)]
    broken = next((f"stripe {k}: {d.broken}" for k, d in enumerate(domains) if d.broken), None)
    missing = tuple((k, a, b) for k, d in enumerate(domains) for a, b in gaps(d, limit=3))
    dead = []
    for name, raw in sorted(r.hgetall(RepoKeys(repo).dead_seqs).items()):
        k_text, _, seq_text = str(name).partition(":")
        if not (k_text.isdigit() and seq_text.isdigit()):
            continue
        k, seq = int(k_text), int(seq_text)
        if k < stripes and not domains[k].is_applied(seq):
            try:
                note = orjson.loads(raw)
            except orjson.JSONDecodeError:
                note = {}
            note = note if isinstance(note, dict) else {}
            dead.append((k, seq, str(note.get("dlq", "?")), str(note.get("reason", "?"))))
    ahead = _clock_ahead(r, repo)
    return ContinuityView(stripes, horizon(domains), broken, missing, tuple(dead[:10]), ahead)


# Read on the slot's own node (a cluster's nodes each keep their own clock).
_CLOCK_AHEAD = """
local t = redis.call('TIME')
local node = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local high = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
return string.format('%.0f', math.max(0, high - node))
"""


def _clock_ahead(r: Any, repo: str) -> int:
    return int(r.eval(_CLOCK_AHEAD, 1, RepoKeys(repo).clock))


@dataclass
class Status:
    now_ms: int
    horizon_ms: int | None
    progress_lag_s: dict[str, float]
    repositories: list[RepoStatus]
    # Incidents of no live repository (a refused repository_created: namespace overlap,
    # retired id ...), the most recent last; and the retired repositories.
    global_incidents: list[dict[str, Any]] = field(default_factory=list)
    global_incidents_total: int = 0
    retired: dict[str, dict[str, Any]] = field(default_factory=dict)
    fail_closed_all: str | None = None  # every repository is fail-closed: why


def rebuild_needs(repo: str, nonce: str | None, sequenced: bool = False) -> str:
    """What a fail-closed (or broken sequenced) repository needs to delete again
    (tracker/rebuild.py)."""
    if not nonce:
        return (f"a rebuild: `hardelete rebuild prepare {repo}` (or the tracker, with "
                "rebuild_interval_seconds > 0), then the service's state export")
    counters = " with its counters (\"continuity\")" if sequenced else ""
    return (f"the service's whole-state export{counters} with rebuild_nonce {nonce} (format 2, "
            "schemas/README.md), under the namespace's _hardelete/exports/ (applied by the "
            f"tracker when rebuild_interval_seconds > 0) or `hardelete rebuild apply {repo} "
            "--export LOCATION`")


def collect_status(r: Any, retired_retention_days: float = 7.0) -> Status:
    now = redis_time_ms(r)
    progress = r.hgetall(PROGRESS)
    horizon = horizon_from(r.hgetall(PROGRESS_META), progress)
    repos = []
    flags = fail_closed_repos(r)  # the gate's reader: a flag with no reason is still a flag
    for repo in sorted(r.smembers(REPOS)):
        k = RepoKeys(repo)
        pipe = r.pipeline(transaction=False)
        pipe.hget(k.meta, "namespace")
        pipe.zcard(k.unreferenced)
        pipe.zcard(k.claims)
        pipe.zcard(k.reaped)
        pipe.llen(k.incidents)
        pipe.hgetall(k.stats)
        pipe.hget(k.rebuild, "nonce")
        pipe.hmget(k.meta, ["sequenced", "stripes"])
        ns, queued, claims, tomb, inc, stats, nonce, (seqd, stripes) = pipe.execute()
        closed = None if repo not in flags else flags[repo].get("reason") or "fail-closed"
        view = continuity_view(r, repo, int(stripes or 1)) if seqd == "1" else None
        rebuilds = closed is not None or (view is not None and view.broken is not None)
        repos.append(RepoStatus(repo, ns or "?", queued, claims, tomb, inc,
                                {f: int(float(v)) for f, v in (stats or {}).items()}, closed,
                                rebuild_needs(repo, nonce, view is not None)
                                if rebuilds else None,
                                nonce if rebuilds else None, view))
    lag = {p: max(0.0, (now - int(v)) / 1000) for p, v in sorted(progress.items())}
    incidents = [orjson.loads(j) for j in r.lrange(INCIDENTS, -100, -1)]
    retired = {}
    for repo, j in sorted(r.hgetall(RETIRED).items()):
        d = orjson.loads(j)
        # retirement keeps data (reconciler/retirement.py): until when, and whether purged
        d["kept_until_ms"] = int(d.get("at_ms") or 0) + int(retired_retention_days * 86_400_000)
        retired[repo] = d
    return Status(now, horizon, lag, repos, incidents, r.llen(INCIDENTS), retired,
                  r.hget(FAIL_CLOSED, "reason"))


@dataclass(frozen=True)
class Attention:
    """One thing that needs a person: its kind (counted in the verdict line) and what to do."""

    kind: str  # no tracker, tracker stale, fail-closed, frozen, incident, dead letter, ...
    detail: str
    count: int = 1


def attention(st: Status, ops: Operations, stale_s: float) -> list[Attention]:
    """What needs a person (pure): no tracker or a stale one (nothing is reaped), fail-closed
    repositories (nothing of them is deleted), frozen ones (a dead letter holds the whole
    namespace), incidents not acknowledged, dead letters whose holds are not resolved, and
    dead letters that cannot be counted."""
    out = []
    age = ops.tracker_progress_age_s
    if age is None:
        out.append(Attention("no tracker", "tracker: no progress ever claimed (no tracker has "
                                           "run): nothing is reaped"))
    elif not ops.tracker_alive:
        out.append(Attention("tracker stale", f"tracker: STALE, last progress {age:.0f}s ago "
                                              f"(> {stale_s:g}s): reaping is held back"))
    if st.fail_closed_all:
        out.append(Attention("fail-closed", f"fail-closed: every repository "
                                            f"({st.fail_closed_all}): `hardelete fail-closed "
                                            "list`"))
    for r in st.repositories:
        if r.fail_closed:
            out.append(Attention("fail-closed", f"fail-closed: {r.repository} ({r.fail_closed});"
                                                f" needs {r.needs}"))
    for r in st.repositories:
        if r.continuity is not None and r.continuity.broken:
            out.append(Attention("continuity broken",
                                 f"continuity broken: {r.repository} ({r.continuity.broken}): "
                                 "nothing of it is deleted, online or by the reconciler, until "
                                 f"it is rebuilt: needs {r.needs}"))
    for repo, why in sorted(ops.frozen.items()):
        out.append(Attention("frozen", f"frozen: {repo}: a dead letter holds its whole "
                                       f"namespace, nothing of it is deleted ({why[0]}): "
                                       f"`hardelete dlq list --repo {repo}`, then `dlq resolve`"))
    for scope, n in sorted(ops.incidents_new.items()):
        where = "of no live repository" if scope == "*" else f"in {scope}"
        out.append(Attention("incident", f"incidents: {n} new {where}: `hardelete incidents "
                                         f"list --repo '{scope}'`, then `incidents ack`", n))
    if ops.dead_letters_holding:
        n = ops.dead_letters_holding
        out.append(Attention("dead letter", f"dead letters: {n} still hold what they name: "
                                            "`hardelete dlq list`, then `dlq replay|resolve`", n))
    if ops.dead_letters is None:
        out.append(Attention("dead letters unknown",
                             f"dead letters: unknown ({ops.dead_letters_note})"))
    return out


def verdict_line(items: list[Attention], width: int = 80) -> str:
    """The one line status leads with: OK, or what needs a person, counted by kind."""
    counts: dict[str, int] = {}
    for a in items:
        counts[a.kind] = counts.get(a.kind, 0) + a.count
    parts = [kind if kind.startswith(("no ", "tracker", "dead letters ")) else
             f"{n} {kind}{'s' if n > 1 and kind in ('incident', 'dead letter') else ''}"
             for kind, n in counts.items()]
    line = "NEEDS A PERSON: " + ", ".join(parts) if items else "OK: nothing needs a person"
    return line if len(line) <= width else line[:width - 1] + "…"


def _state(r: RepoStatus, ops: Operations) -> str:
    marks = [m for m, on in (("fail-closed", r.fail_closed), ("frozen", r.repository in
                                                              ops.frozen),
                             ("paused", r.repository in ops.paused)) if on]
    if r.repository in ops.holds:
        marks.append(f"{ops.holds[r.repository]} held")
    if r.continuity is not None and (r.continuity.broken or r.continuity.missing
                                     or r.continuity.horizon_ms is None):
        marks.append("uncertified")
    return ", ".join(marks) or "ok"


def _print_status(st: Status, ops: Operations | None = None) -> None:
    """The repositories (one narrow row each: 80 columns hold it) and what else status knows;
    ``--json`` has every field, the counters too."""
    con = Console(markup=False, highlight=False)
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    t.add_column("repository", no_wrap=True)
    t.add_column("namespace", overflow="fold", ratio=1)
    for col in ("queued", "claims", "reaped", "incid."):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("state", overflow="fold")
    for r in st.repositories:
        bad = r.fail_closed or (ops is not None and r.repository in ops.frozen)
        t.add_row(r.repository, r.namespace, str(r.queued), str(r.claims),
                  str(r.counters.get("reaped", 0)), str(r.incidents),
                  _state(r, ops) if ops is not None else (
                      "fail-closed" if r.fail_closed else "ok"),
                  style="bold red" if bad else "")
    con.print(t)
    if st.retired:
        con.print("retired repositories (nothing of them is deleted online; data kept until "
                  "purged, `hardelete retired list`): " + ", ".join(
                      f"{k} ({v.get('namespace', '?')}, "
                      + (f"purged {_when(v['purged_at_ms'])}" if v.get("purged_at_ms")
                         else f"kept until {_when(v.get('kept_until_ms'))}") + ")"
                      for k, v in st.retired.items()))
    if st.global_incidents_total:
        con.print(f"{st.global_incidents_total} incident(s) outside any live repository, the "
                  "latest:")
        for inc in st.global_incidents[-5:]:
            con.print(f"  {inc.get('repository')}: {inc.get('reason')}")
    for r in st.repositories:
        if r.continuity is not None:
            con.print(f"{r.repository}: continuity {r.continuity.text(st.now_ms)}")
    lag = ", ".join(f"p{p}: {s:.1f}s" for p, s in st.progress_lag_s.items()) or "none"
    con.print(f"tracker progress lag per partition: {lag}")
    if st.horizon_ms is None:
        con.print("tracker horizon: none yet (nothing may be reaped)")
    else:
        con.print(f"tracker horizon: {_when(st.horizon_ms)}")


def _print_operations(ops: Operations) -> None:
    con = Console(markup=False, highlight=False)
    if ops.tracker_alive and ops.tracker_progress_age_s is not None:
        con.print(f"tracker: alive, last progress {ops.tracker_progress_age_s:.1f}s ago")
    if ops.dead_letters is not None:
        con.print(f"dead letters: {ops.dead_letters} in {ops.dead_letters_note} "
                  f"({ops.dead_letters_holding} holding)")
    con.print("holds: " + (", ".join(f"{r}={n}" for r, n in ops.holds.items()) or "none"))
    for repo, info in ops.paused.items():
        con.print(f"paused: {repo} ({info.get('reason', '')})")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true")


def run_cli(settings: Settings, args: argparse.Namespace) -> int:
    """Exit 1 when something needs a person (the verdict line says what), else 0."""
    from hardelete.health import collect_operations

    r = redis_sync(settings)
    try:
        st = collect_status(r, settings.retired_retention_days)
        ops = collect_operations(r, settings)
    finally:
        r.close()
    items = attention(st, ops, settings.tracker_stale_seconds)
    if args.json:
        print(orjson.dumps({"verdict": verdict_line(items, width=10_000),
                            "attention": [asdict(a) for a in items], **asdict(st),
                            "operations": asdict(ops)}, option=orjson.OPT_INDENT_2).decode())
    else:
        con = Console(markup=False, highlight=False)
        con.print(verdict_line(items, min(con.width, 80)),
                  style="bold red" if items else "bold green")
        for a in items:
            con.print(f"- {a.detail}", style="red")
        _print_status(st, ops)
        _print_operations(ops)
    return 1 if items else 0


# --- explain -------------------------------------------------------------------------------------

@dataclass
class Explanation:
    address: str
    repository: str | None
    state: str
    verdict: str
    lines: list[str]


@dataclass(frozen=True)
class RunFinding:
    """What one reconciler run's report says of an address: marked, or swept with an outcome
    (``reconciler/sweep.py``: ``deleted``, ``skipped_live``, ...)."""

    run_id: str
    part: str  # "mark" or "sweep"
    category: str
    outcome: str | None  # the sweep's outcome (None for a mark)
    cutoff: str | None
    finished_at: str | None
    dry_run: bool

    @property
    def deleted(self) -> bool:
        return self.part == "sweep" and self.outcome == "deleted"

    def line(self) -> str:
        if self.part == "sweep":
            return (f"reconciler run {self.run_id}: {self.outcome} as {self.category} "
                    f"(cutoff {self.cutoff or '?'})")
        return (f"reconciler run {self.run_id}: marked as {self.category}"
                + (" (dry run)" if self.dry_run else ""))


def reconciler_findings(s3: Any, namespace: str, address: str,
                        runs: int = 5) -> list[RunFinding]:
    """What the newest of the last few reconciler runs that met an address did with it (from
    their reports): its sweep's row, else its mark's."""
    from reconciler.report import read_summary, run_ids
    from reconciler.s3io import Namespace, list_keys, read_parquet_rows

    ns = Namespace(namespace)
    rel = ns.rel_of_address(address)
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
                return [RunFinding(rid, part, str(found[1]),
                                   str(found[2]) if part == "sweep" else None,
                                   summary.get("cutoff"),
                                   summary.get("finished_at") or summary.get("updated_at"),
                                   bool(summary.get("dry_run")))]
    return []


def _retention_lines(r: Any, s3: Any, repo: str, address: str, now_ms: int,
                     max_manifests: int = 50) -> list[str]:
    """When the reconciler may take a committed address: the retained commits whose manifests
    list it (read only with ``s3``), and when retention stops holding them if nothing changes
    (retention is monotone in time for a fixed history, so a bisection finds the moment)."""
    from reconciler.committed import manifest_location, plan_retention
    from reconciler.errors import ReconcileError
    from reconciler.s3io import read_parquet_rows
    from reconciler.state import load_repo

    try:
        state = load_repo(r, repo)
        plan = plan_retention(state, now_ms / 1000.0)
    except (ReconcileError, ValueError) as exc:
        return [f"retention cannot be computed ({exc}): the reconciler's mark would fail and "
                "delete nothing"]
    rel = state.namespace.rel_of_address(address)
    lines: list[str] = []
    holders: list[str] = []
    if s3 is None:
        lines.append(f"{len(plan.retained)} commits are retained; read their manifests (drop "
                     "--no-reports) to know which hold this address")
        return lines
    checked = 0
    for cid in sorted(plan.retained, key=lambda c: -state.commits[c].time
                      if c in state.commits else 0):
        rec = state.commits.get(cid)
        if rec is None or not rec.manifest or checked >= max_manifests:
            continue
        checked += 1
        bucket, key = manifest_location(state.namespace, rec.manifest)
        try:
            rows = read_parquet_rows(s3, bucket, key, ["address"])
            if any(str(a) in (address, rel) for (a,) in rows):
                holders.append(cid)
        except Exception as exc:  # an unreadable manifest: the mark would fail, keeping all
            lines.append(f"manifest of retained commit {cid} unreadable ({type(exc).__name__}):"
                         " the reconciler's mark would fail and delete nothing")
    if not holders:
        lines.append(f"no retained commit's manifest lists it ({checked} read): the next "
                     "reconciler run may delete it once it is older than the run's cutoff")
        return lines
    lines.append("held by retained commits: " + ", ".join(holders))
    year_ms = 100 * 365 * 86_400_000

    def retained_at(t_ms: int) -> bool:
        try:
            kept = plan_retention(state, t_ms / 1000.0).retained
        except (ReconcileError, ValueError):
            return True
        return any(c in kept for c in holders)

    if retained_at(now_ms + year_ms):
        lines.append("they stay retained as long as nothing changes (a branch head or tag "
                     "points at one, or retention is unbounded)")
        return lines
    lo, hi = now_ms, now_ms + year_ms
    while hi - lo > 60_000:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if retained_at(mid) else (lo, mid)
    lines.append(f"collectable by the reconciler from {_when(hi)} if nothing changes (its "
                 "commits leave every retention window; later commits may list it too)")
    return lines


def explain_address(r: Any, settings: Settings, address: str,
                    repository: str | None = None, s3: Any = None) -> Explanation:
    """Why an address is alive, when it may go, or why it was deleted: the one judgment
    (``schemas.liveness.judge``) over its record, with the guards read now, plus retention
    for a committed address and the reconciler's reports."""
    owner = find_owner(r, address)
    repo = owner[0] if owner is not None else None
    elsewhere: list[str] = []  # --repo named another repository than the owner
    if owner is not None and repository not in (None, owner[0]):
        theirs = repo_namespace(r, repository) if repository else None
        elsewhere = [f"not in the namespace of repository {repository!r} ("
                     + (theirs or "not a tracked repository") + "): it lies in that of "
                     f"{owner[0]!r} ({owner[1]}), whose judgment follows"]
    if repo is None:
        for old, raw in sorted(r.hgetall(RETIRED).items()):
            ns = orjson.loads(raw).get("namespace", "")
            if ns and address.startswith(ns):
                return Explanation(address, old, "retired", "kept online: repository retired", [
                    f"Repository {old!r} owned this namespace and was retired "
                    f"({_when(orjson.loads(raw).get('at_ms'))}): nothing of a retired "
                    "repository is deleted online."])
        return Explanation(address, None, "unknown", "outside every tracked namespace",
                           ["No tracked repository's namespace contains this address: "
                            "hardelete never deletes it."])
    k = RepoKeys(repo)
    namespace = repo_namespace(r, repo) or ""
    h = r.hgetall(k.address(address))
    findings = reconciler_findings(s3, namespace, address) if s3 is not None else []
    history = [f.line() for f in findings]
    # Proven as a delete path proves it (core/facts.py), so what it says is what they see.
    proof = RepoFacts(r, s3 if s3 is not None else s3_client(settings), repo,
                      namespace).prove(by="explain", adopt=False)
    gate = read_gate(r, repo, [address], facts=proof)
    guards = gate.guards(repo, namespace, address)
    guard_lines = [f"{name.replace('_', '-')}: {why}" for name, why in (
        ("held", guards.held), ("fail_closed", guards.fail_closed), ("paused", guards.paused),
        ("not_owner", guards.not_owner)) if why]
    swept = _swept(s3, address, findings)
    if not h:
        return Explanation(address, repo, "untracked", swept or "only the reconciler decides", [
            *elsewhere,
            "The tracker never saw a reference to this address (a leak, an object from before "
            "tracking started, or its tombstone was pruned).",
            "The online path never deletes it; the nightly reconciler deletes it if no retained "
            "commit, staging token or issued upload references it and it is older than the "
            "cutoff.", *guard_lines, *history])
    rec = decode_address(h)
    now = redis_time_ms(r)
    tokens = r.hgetall(k.tokens)
    lines = [*elsewhere, *guard_lines]
    for ref, tok in sorted(rec.adds.items()):
        tstate = token_state(tokens.get(tok)) or "unknown"
        removed = rec.removes.get(ref) == tok  # only a removal in its own token ends it
        lines.append(f"reference {ref} in token {tok} ({tstate})"
                     + (": removed" if removed else ": live" if tstate in (
                         "open", "sealed", "unknown", "doubt") else f": ended ({tstate})"))
    if rec.doubt:
        lines.append("doubt: a reference id was named with two tokens (a contract breach; "
                     "see the incidents): kept")
    for ref, tok in sorted(rec.removes.items()):
        if ref not in rec.adds:
            lines.append(f"reference {ref} (token {tok}) removed before its add arrived")
    state = rec.state or "none"
    horizon = horizon_from(r.hgetall(PROGRESS_META), r.hgetall(PROGRESS))
    grace_ms = int(settings.grace_for(repo) * 1000)
    j = judge(rec, tokens, now_ms=now, horizon_ms=horizon, grace_ms=grace_ms, path="online",
              guards=guards)
    if j.may_delete:
        verdict = (f"garbage: unreferenced since {_when(rec.since)}; may be reaped now "
                   f"(grace {grace_ms / 1000:g}s)")
    elif j.reason == Keep.COMMITTED:
        verdict = "alive: a commit took it (only the reconciler may delete it, by retention)"
        lines.extend(_retention_lines(r, s3, repo, address, now))
    elif j.reason == Keep.STAGED:
        verdict = "alive: a live reference in an open or sealed staging token"
        if rec.committed:
            lines.extend(_retention_lines(r, s3, repo, address, now))
    elif j.reason == Keep.ISSUED:
        verdict = f"alive: issued upload address, protected until {_when(rec.issued_until)}"
    elif j.reason in (Keep.YOUNG, Keep.NO_HORIZON):
        eligible = j.eligible_at_ms or max(rec.since or 0, rec.issued_until or 0) + grace_ms
        verdict = (f"garbage: unreferenced since {_when(rec.since)}; may be reaped once the "
                   f"tracker's proven progress passes {_when(eligible)} "
                   f"(grace {grace_ms / 1000:g}s)")
    elif j.reason == Keep.CLAIMED:
        verdict = f"being reaped by {rec.claimer}, lease until {_when(rec.lease_until)}"
    elif j.reason in (Keep.HELD, Keep.FAIL_CLOSED, Keep.PAUSED, Keep.NOT_OWNER):
        verdict = f"kept ({j.reason}): {j.detail}"
    else:
        verdict = f"kept ({j.reason}): {j.detail or 'state ' + state}"
    if rec.state == "reaped":
        # Deleted: said at once, whatever the judgment keeps it for now (a reaped record stays
        # under grace from its delete, and a hold placed since keeps only a quarantine copy).
        from reaper.quarantine_ops import restore_hint

        hint = restore_hint(s3, settings, repo, namespace, address)
        lines += hint
        verdict = _reaped(rec, quarantined=bool(hint))
        if j.reason in (Keep.STAGED, Keep.COMMITTED, Keep.DOUBT):
            lines.append(f"a reference names it now ({j.reason}: {j.detail}), though the reaper "
                         "deleted it: see the INCIDENT lines")
    elif swept is not None:
        lines.append(f"the tracker's record says {state} ({verdict}), but the object is gone")
        verdict = swept
    incidents = [orjson.loads(x) for x in r.lrange(k.incidents, -1000, -1)]
    for inc in incidents:
        if inc.get("address") == address:
            lines.append(f"INCIDENT: {inc}")
    if rec.issued_until:
        lines.append(f"issued upload protected until {_when(rec.issued_until)}"
                     + (" (over)" if rec.issued_until <= now else ""))
    lines.append(f"now {_when(now)}; tracker horizon {_when(horizon)}")
    return Explanation(address, repo, state, verdict, lines + history)


def _reaped(rec: AddressRecord, *, quarantined: bool) -> str:
    """The verdict on an address the reaper took: who, when, and why it was allowed to."""
    who = (f"reaper {rec.claimer}" if rec.claimer else
           "a reaper (its addresses_reaped record in the log told the tracker)")
    what = "moved to quarantine" if quarantined else "deleted"
    why = (f"every reference had ended by {_when(rec.since)}" if rec.since is not None
           else "no reference kept it")
    return (f"{what} by {who} at {_when(rec.reaped_at)}: {why} and its grace window had "
            "passed by the tracker's proven progress")


def _swept(s3: Any, address: str, findings: list[RunFinding]) -> str | None:
    """The verdict on an address the reconciler's newest report says it deleted, once the store
    confirms it is not there (None: not deleted by a reconciler run, or back in the store)."""
    from botocore.exceptions import ClientError

    from core.clients import split_s3_uri

    done = next((f for f in findings if f.deleted), None)
    if done is None or s3 is None:
        return None
    bucket, key = split_s3_uri(address)
    try:
        s3.head_object(Bucket=bucket, Key=key)
        return None
    except ClientError as exc:
        if str(exc.response.get("Error", {}).get("Code", "")) not in ("404", "NoSuchKey",
                                                                      "NotFound"):
            return None
    return (f"deleted by the reconciler, run {done.run_id} (finished {done.finished_at or '?'}):"
            f" marked {done.category}, older than the run's cutoff {done.cutoff or '?'} and "
            "referenced by no retained commit, staging token or issued upload")


def explain_spelling(r: Any, settings: Settings, raw: str, repository: str | None = None,
                     s3: Any = None) -> list[Explanation]:
    """:func:`explain_address` of every object the spelling ``raw`` may name, in the canonical
    form the delete paths judge (``schemas.holds.resolve_target``: ``S3://``, ``s3a://``, a
    bucket in any case, ``%XX`` escapes both ways, a key relative to ``repository``'s
    namespace); a spelling that names nothing of a live namespace is explained as given."""
    try:
        targets = resolve_target(owned_namespaces(r), raw, repo=repository)
    except TargetError as exc:
        if not has_scheme(raw):
            raise UserError(str(exc)) from None
        targets = ()
    named = [t for t in targets if not t.prefix]
    if not named:
        try:
            raw = canonical_uri(raw)
        except OutsideNamespace as exc:
            raise UserError(str(exc)) from None
        return [explain_address(r, settings, raw, repository, s3)]
    return [explain_address(r, settings, t.key, t.repository, s3) for t in named]


class explain:  # the CLI's command object for `hardelete explain`
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("address", help="s3:// address (any spelling), or a key relative "
                                            "to --repo's namespace")
        parser.add_argument("--repo", help="repository (default: found by namespace)")
        parser.add_argument("--no-reports", action="store_true",
                            help="do not read the reconciler's reports from the store")
        parser.add_argument("--json", action="store_true")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        if not has_scheme(args.address) and not args.repo:
            raise UserError(f"address must be an s3:// URI (or a key relative to --repo's "
                            f"namespace), got {args.address!r}")
        r = redis_sync(settings)
        try:
            s3 = None if args.no_reports else s3_client(settings)
            explained = explain_spelling(r, settings, args.address, args.repo, s3)
        finally:
            r.close()
        if args.json:  # one object per object named (a list only when the spelling is ambiguous)
            rows = [asdict(ex) for ex in explained]
            print(orjson.dumps(rows[0] if len(rows) == 1 else rows,
                               option=orjson.OPT_INDENT_2).decode())
            return 0
        con = Console(markup=False, highlight=False)
        if len(explained) > 1:
            con.print(f"{args.address} may name {len(explained)} objects:")
        for ex in explained:
            con.print(f"{ex.address}  repository={ex.repository} state={ex.state}",
                      style="bold")
            con.print(f"  {ex.verdict}")
            for line in ex.lines:
                con.print(f"  - {line}")
        return 0
