"""The soak's verdict: what was deleted that the model's ground truth calls live, what garbage
was reclaimed after recovery, which incidents were legitimate; as a rich table and as JSON.

The judgement is pure (model state and listings in, sets out): :func:`may_be_gone` is the
model's oracle of everything a correct system may have deleted at a moment (one reconciler run
with retention at that moment: online garbage, superseded, leaked, expired-commit objects;
never a live staged reference, an unexpired issued upload or a retained commit's entry).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from reconciler.retention import RetentionPolicy, retained_commits
from sim.model import Model
from sim.soak_plan import NEEDS_FIX, FaultKind

RECLAIM_TARGET = 0.999


def retained(model: Model, repo: str, now: float) -> set[str]:
    """The commits of ``repo`` that retention keeps at ``now`` (the reconciler's own rule)."""
    r = model.repository(repo)
    graph = model.commit_graph(repo)
    heads = {b: br.head for b, br in r.branches.items() if br.head}
    return set(retained_commits(graph, heads, dict(r.tags),
                                RetentionPolicy(r.default_retention_days,
                                                r.branch_retention_days), now))


def may_be_gone(model: Model, now: float) -> frozenset[str]:
    """Every object a correct system may have deleted by ``now``."""
    out: set[str] = set()
    for repo in model.repositories:
        out |= model.reconciler_garbage(retained(model, repo, now), repository=repo, now=now)
    return frozenset(out)


def why_live(model: Model, address: str, now: float) -> str:
    """One line: what keeps ``address`` alive in the model at ``now``."""
    reasons: list[str] = []
    for ref in model.references.values():
        if ref.address != address or ref.removed_at is not None:
            continue
        token = model.tokens[ref.token]
        if token.state.value in ("open", "sealed"):
            reasons.append(f"staged at {token.branch}:{ref.path} (token {token.state.value}, "
                           f"ref {ref.ref_id})")
    issued = model.issued.get(address)
    if issued is not None and issued.expires_at > now:
        reasons.append(f"issued upload, unexpired until {issued.expires_at:.3f}")
    obj = model.objects.get(address)
    if obj is not None:
        keep = retained(model, obj.repository, now)
        for cid in keep:
            c = model.commits[cid]
            if any(e.address == address for e in c.entries.values()):
                refs = [b for b, br in model.repository(obj.repository).branches.items()
                        if br.head == cid]
                refs += [t for t, t_cid in model.repository(obj.repository).tags.items()
                         if t_cid == cid]
                reasons.append(f"in retained commit {cid[:12]} (branch {c.branch}"
                               + (f"; head/tag of {', '.join(refs)}" if refs else "") + ")")
                break
    return "; ".join(reasons) or "live per the model"


def event_history(model: Model, address: str, notes: Iterable[str] = ()) -> list[str]:
    """The model's events that name ``address``, in order, plus the soak's notes about it."""
    out = []
    for e in model.events:
        body = dataclasses.asdict(e)
        if address in (body.get("address"), body.get("replaces_address")):
            extra = " ".join(f"{k}={body[k]}" for k in ("branch", "path", "ref_id",
                                                       "replaces_ref_id", "staging_token")
                             if body.get(k))
            out.append(f"{e.TYPE} id={body.get('event_id')} at={body.get('emitted_at'):.3f} "
                       f"{extra}")
    return out + list(notes)


@dataclass
class LiveDeletion:
    address: str
    repository: str
    why_live: str
    seen: str  # at which check it was first seen gone
    events: list[str] = field(default_factory=list)
    explain: list[str] = field(default_factory=list)
    attributed_to: str | None = None  # a deliberate contract violation that raised an incident
    faults_before: list[str] = field(default_factory=list)  # injected before it was seen gone


@dataclass
class IncidentRecord:
    repository: str
    address: str
    type: str
    legitimate: bool
    why: str


@dataclass
class FailClosedPeriod:
    scope: str  # a repository, or "*" for the whole mirror
    reason: str
    start_s: float  # seconds since the soak started
    end_s: float | None = None


@dataclass
class ReconcileRun:
    kind: str
    repository: str
    at_op: int
    run_id: str | None
    success: bool
    status: str  # sweep status or error
    marked: int = 0
    confirmed: int = 0
    seconds: float = 0.0


@dataclass
class SoakVerdict:
    seed: int
    ops: int
    repos: int
    faults_selected: list[str]
    ops_by_kind: dict[str, int]
    ops_refused: int  # drawn operations a racing fault step had made invalid
    faults_planned: dict[str, int]
    faults_injected: dict[str, int]
    fault_errors: dict[str, list[str]]  # a fault that could not be injected, and why
    reconciler_runs: list[ReconcileRun]
    live_deleted: list[LiveDeletion]  # must be empty
    late_deleted: list[LiveDeletion]  # live per the model, but its reference came beyond the
    #                                   contract and the tracker raised an incident: legitimate
    beyond_contract: dict[str, int]  # delay_beyond copies: published after their source was
    #                                  reaped ("after_reap", each must raise an incident) or not
    objects_written: int
    reclaimable: int  # the model's reclaimable garbage at the end, every repository (only
    #                   addresses a dead letter holds are left out: an operator's to resolve)
    reclaimed: int
    garbage_left_sample: list[str]
    garbage_left_why: dict[str, list[str]]  # hardelete's explanation of each sampled object
    fail_closed_repos: list[str]
    fail_closed_garbage: int  # reclaimable garbage still stored in fail-closed repositories
    fail_closed_periods: list[FailClosedPeriod]
    incidents: list[IncidentRecord]
    dead_lettered: int
    log_regressions: list[str]  # the events log went back under the tracker's feet
    daemons: dict[str, dict[str, Any]]  # starts, kills, unplanned exits
    checks: int
    tracker_caught_up: bool
    max_horizon_lag_s: float  # longest the trackers' proven progress trailed the Redis clock
    phases_s: dict[str, float]
    elapsed_s: float
    workdir: str | None = None
    rebuilds: int = 0  # fail-closed repositories rebuilt from the service's state export
    rebuild_exports: int = 0  # state exports the service wrote for a prepared rebuild
    dlq_replayed: int = 0  # dead-lettered service events published again under their own key
    dlq_resolved: int = 0  # dead-letter holds lifted by the soak as operator, after the replay
    operator_holds: int = 0  # objects an operator held (each must still be there)
    paused_spans: int = 0  # repositories paused for a span and checked: nothing of them went

    @property
    def reclaim_ratio(self) -> float:
        return 1.0 if not self.reclaimable else self.reclaimed / self.reclaimable

    @property
    def illegitimate_incidents(self) -> int:
        return sum(not i.legitimate for i in self.incidents)

    @property
    def safe(self) -> bool:
        return not self.live_deleted

    @property
    def ok(self) -> bool:
        return self.safe and self.reclaim_ratio >= RECLAIM_TARGET

    def as_json(self) -> bytes:
        body = dataclasses.asdict(self)
        body.update(ok=self.ok, safe=self.safe, reclaim_ratio=round(self.reclaim_ratio, 6),
                    reclaim_target=RECLAIM_TARGET,
                    illegitimate_incidents=self.illegitimate_incidents)
        return orjson.dumps(body, option=orjson.OPT_INDENT_2)


def _counts_table(title: str, rows: Mapping[str, Any], *cols: str) -> Table:
    t = Table(title=title, title_justify="left")
    for c in cols:
        t.add_column(c, justify="left" if c == cols[0] else "right")
    for k, v in rows.items():
        t.add_row(k, *(str(x) for x in (v if isinstance(v, tuple) else (v,))))
    return t


def print_verdict(v: SoakVerdict, console: Console) -> None:
    console.print(_counts_table(f"Operations (seed {v.seed}, {v.repos} repositories)",
                                {**v.ops_by_kind, "[bold]total": sum(v.ops_by_kind.values()),
                                 "refused (raced by a fault step)": v.ops_refused},
                                "operation", "count"))
    faults = Table(title="Faults", title_justify="left")
    for c in ("fault", "planned", "injected", "note"):
        faults.add_column(c, justify="left" if c in ("fault", "note") else "right")
    for kind in FaultKind:
        if kind.value not in v.faults_planned:
            continue
        errors = v.fault_errors.get(kind.value, [])
        note = NEEDS_FIX.get(kind, "")
        if errors:
            note = (note + "; " if note else "") + f"[yellow]{len(errors)} not injected: " \
                f"{errors[0]}"
        faults.add_row(kind.value, str(v.faults_planned[kind.value]),
                       str(v.faults_injected.get(kind.value, 0)), note)
    console.print(faults)

    runs = Table(title="Reconciler runs during the load and at the end", title_justify="left")
    for c in ("kind", "repository", "op", "run", "status", "marked", "confirmed", "s"):
        runs.add_column(c, justify="right" if c in ("op", "marked", "confirmed", "s") else "left")
    for r in v.reconciler_runs:
        runs.add_row(r.kind, r.repository, str(r.at_op), (r.run_id or "-")[:24],
                     r.status if r.success else f"[red]{r.status}", str(r.marked),
                     str(r.confirmed), f"{r.seconds:.1f}")
    console.print(runs)

    t = Table(title="Verdict against the model's ground truth", title_justify="left")
    t.add_column("what")
    t.add_column("value", justify="right")
    style = "bold green" if v.safe else "bold red"
    t.add_row(f"[{style}]live objects deleted (must be 0)", f"[{style}]{len(v.live_deleted)}")
    t.add_row("deleted after a reference published beyond the contract (incident raised)",
              str(len(v.late_deleted)))
    t.add_row("copies published beyond the contract: after / before their source was reaped",
              f"{v.beyond_contract.get('after_reap', 0)} / "
              f"{v.beyond_contract.get('source_not_yet_reaped', 0)}")
    t.add_row("objects written", str(v.objects_written))
    ratio_style = "green" if v.reclaim_ratio >= RECLAIM_TARGET else "red"
    t.add_row("garbage reclaimable at the end (model oracle)", str(v.reclaimable))
    t.add_row(f"[{ratio_style}]reclaimed after recovery (target >= {RECLAIM_TARGET:.1%})",
              f"[{ratio_style}]{v.reclaimed} ({v.reclaim_ratio:.3%})")
    t.add_row("repositories fail-closed at the end", ", ".join(v.fail_closed_repos) or "none")
    t.add_row("  garbage they keep", str(v.fail_closed_garbage))
    t.add_row("fail-closed periods", str(len(v.fail_closed_periods)))
    legit = sum(i.legitimate for i in v.incidents)
    t.add_row("incidents (legitimate / not)", f"{legit} / {v.illegitimate_incidents}")
    t.add_row("rebuilds of fail-closed repositories (service exports)",
              f"{v.rebuilds} ({v.rebuild_exports})")
    t.add_row("dead letters: events replayed / holds resolved (the soak as operator)",
              f"{v.dlq_replayed} / {v.dlq_resolved}")
    t.add_row("operator holds kept / pauses checked (durable facts, across Redis rollbacks)",
              f"{v.operator_holds} / {v.paused_spans}")
    t.add_row("dead-lettered events", str(v.dead_lettered))
    t.add_row("tracker caught up in the drain", "yes" if v.tracker_caught_up else "[red]no")
    t.add_row("longest tracker stall: horizon behind the Redis clock (s)",
              f"{v.max_horizon_lag_s:.1f}")
    t.add_row("partitions whose log went back (offsets reused)",
              f"[red]{len(v.log_regressions)}" if v.log_regressions else "0")
    for name, d in v.daemons.items():
        t.add_row(f"{name}: starts / kills / unplanned exits",
                  f"{d['starts']} / {d['kills']} / {len(d['exits'])}")
    t.add_row("consistency checks during the run", str(v.checks))
    for phase, s in v.phases_s.items():
        t.add_row(f"time: {phase} (s)", f"{s:.1f}")
    t.add_row("[bold]time (s)", f"[bold]{v.elapsed_s:.1f}")
    console.print(t)

    for p in v.fail_closed_periods:
        end = f"{p.end_s:.1f}s" if p.end_s is not None else "the end"
        console.print(f"fail-closed {p.scope}: {p.reason} from {p.start_s:.1f}s to {end}")
    for line in v.log_regressions:
        console.print(f"[red]log went back[/red]: {line}")
    for inc in v.incidents:
        if not inc.legitimate:
            console.print(f"[red]illegitimate incident[/red] {inc.repository} {inc.address} "
                          f"{inc.type}: {inc.why}")
    for dead in v.live_deleted[:20]:
        console.print(f"[bold red]LIVE OBJECT DELETED[/bold red] {dead.address}")
        console.print(f"  repository {dead.repository}; first seen gone at {dead.seen}")
        console.print(f"  live because: {dead.why_live}")
        if dead.attributed_to:
            console.print(f"  [yellow]{dead.attributed_to}")
        if dead.faults_before:
            console.print(f"  faults injected before: {', '.join(dead.faults_before)}")
        for line in dead.events:
            console.print(f"  event: {line}")
        for line in dead.explain:
            console.print(f"  explain: {line}")
    if len(v.live_deleted) > 20:
        console.print(f"[red]... and {len(v.live_deleted) - 20} more (see --json)")
    if v.garbage_left_sample and v.reclaim_ratio < RECLAIM_TARGET:
        console.print("garbage left, e.g.: " + ", ".join(v.garbage_left_sample[:5]))
        for address in v.garbage_left_sample[:5]:
            for line in v.garbage_left_why.get(address, [])[:3]:
                console.print(f"  {address.rsplit('/', 1)[-1][:8]}: {line}")
    if v.workdir:
        console.print(f"logs and data kept in {v.workdir}")
