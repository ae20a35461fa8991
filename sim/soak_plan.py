"""The soak's fault scheduler: which fault, and which reconciler run, before which operation.

Pure and seeded: :func:`plan` is a function of its arguments only (no clock, no I/O), so a soak
is repeatable by its seed and the schedule is tested alone (tests/unit/sim/test_soak_plan.py). The
harness (:mod:`sim.soak`) executes the steps; it decides nothing about *when*.

Fault kinds come in two groups:

* :data:`SURVIVED` — every fault the embedded stack can inject (kill -9 of each daemon, Redis
  restarted and rolled back, the broker restarted, killed or with its log lost, duplicated,
  reordered, delayed, malformed, oversized and mis-keyed events, a namespace claim, refs racing
  a reconciler between mark and sweep, S3 errors on deletes). The default selection.
  :data:`FAILS_CLOSED` marks those after which the affected repositories are fail-closed.
* :data:`NEEDS_FIX` — kinds the embedded stack cannot inject yet, with the reason (named so
  that ``--faults needs-fix`` keeps working as a selection).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "ALL_FAULTS",
    "FAILS_CLOSED",
    "NEEDS_FIX",
    "STALLS",
    "SURVIVED",
    "FaultKind",
    "ReconcileKind",
    "Step",
    "parse_faults",
    "plan",
]


class FaultKind(StrEnum):
    KILL_TRACKER = "kill_tracker"  # kill -9 one tracker process, restart it
    KILL_REAPER = "kill_reaper"  # kill -9 one reaper process, restart it
    KILL_RECONCILER = "kill_reconciler"  # kill -9 a reconciler run (subprocess), run it again
    REDIS_RESTART = "redis_restart"  # kill -9 Redis (AOF, fsync always), restart it
    REDIS_ROLLBACK = "redis_rollback"  # restart Redis from an older copy of its data
    BROKER_RESTART = "broker_restart"  # stop the broker, restart it with its log kept
    BROKER_KILL = "broker_kill"  # kill -9 the broker, restart it on the same log
    BROKER_LOG_LOST = "broker_log_lost"  # restart the broker on an empty log
    ADD_PARTITION = "add_partition"  # one more partition on the events topic while running
    DUPLICATE = "duplicate"  # re-publish earlier events
    REORDER = "reorder"  # a block of events published after later ones; a stale tag event
    DELAY = "delay"  # a copy's event published late, within the grace window (the contract)
    DELAY_BEYOND = "delay_beyond"  # a copy's event published after its source was reaped
    MARK_SWEEP_RACE = "mark_sweep_race"  # branch, tag, commit created between mark and sweep
    MALFORMED = "malformed"  # not JSON, unknown type, bad version, outside the namespace
    OVERSIZED = "oversized"  # a multi-megabyte malformed event
    MISKEYED = "miskeyed"  # a valid event published under another repository's key
    NAMESPACE_CLAIM = "namespace_claim"  # a repository claims a namespace around another's
    S3_ERRORS = "s3_errors"  # a share of delete requests/keys fail at the S3 proxy
    OPERATOR_HOLD = "operator_hold"  # an operator holds an object: it is never deleted
    OPERATOR_PAUSE = "operator_pause"  # a repository paused for a span: nothing of it goes


class ReconcileKind(StrEnum):
    MARK_SWEEP = "mark_sweep"
    DRY_RUN = "dry_run"
    SWEEP_ONLY = "sweep_only"  # sweep the mark of an earlier dry run


SURVIVED: frozenset[FaultKind] = frozenset({
    FaultKind.KILL_TRACKER, FaultKind.KILL_REAPER, FaultKind.KILL_RECONCILER,
    FaultKind.REDIS_RESTART, FaultKind.DUPLICATE, FaultKind.DELAY,
    FaultKind.DELAY_BEYOND, FaultKind.MALFORMED, FaultKind.S3_ERRORS,
    # closed by issue 8 and issue 9 (merged): checked by tests/integration/sim/test_soak.py
    FaultKind.REDIS_ROLLBACK, FaultKind.BROKER_LOG_LOST, FaultKind.BROKER_KILL,
    FaultKind.BROKER_RESTART, FaultKind.REORDER, FaultKind.OVERSIZED, FaultKind.MISKEYED,
    FaultKind.NAMESPACE_CLAIM, FaultKind.MARK_SWEEP_RACE,
    # CreatePartitions under running trackers: Apache Kafka has it (Tansu 0.6 had not)
    FaultKind.ADD_PARTITION,
    # durable holds and pauses (issue 34): a Redis rollback in the run must not lose them
    FaultKind.OPERATOR_HOLD, FaultKind.OPERATOR_PAUSE,
})

# Kinds that cannot be injected on the embedded stack, and why (none since Apache Kafka).
NEEDS_FIX: dict[FaultKind, str] = {}

# Faults after which replay is impossible (the log lost records Redis never applied): the
# affected repositories go fail-closed, which is the safe answer, and stay so until an operator
# clears them. A soak with them proves safety, not reclamation.
FAILS_CLOSED: frozenset[FaultKind] = frozenset({
    FaultKind.BROKER_LOG_LOST, FaultKind.BROKER_KILL,
})

# Survived for safety, but seen to stall the trackers for minutes before the safety work
# (liveness: no deletion, no reaping either): a killed tracker does not leave the consumer
# group, and Tansu's group was slow to rebalance the restarted trackers.
STALLS: dict[FaultKind, str] = {
    FaultKind.KILL_TRACKER: "tracker group stalled after a killed member (rebalance on Tansu)",
    FaultKind.REDIS_RESTART: "trackers exited on NoScriptError after Redis restarts, then the "
                             "group stalled as after kill_tracker",
}

ALL_FAULTS: tuple[FaultKind, ...] = tuple(FaultKind)
assert SURVIVED.isdisjoint(NEEDS_FIX) and SURVIVED | set(NEEDS_FIX) == set(FaultKind)

# Faults that take a process down; the harness keeps them apart so each one's restart is seen.
_HEAVY = frozenset({FaultKind.REDIS_RESTART, FaultKind.REDIS_ROLLBACK, FaultKind.BROKER_RESTART,
                    FaultKind.BROKER_KILL, FaultKind.BROKER_LOG_LOST, FaultKind.KILL_RECONCILER})


def parse_faults(text: str) -> frozenset[FaultKind]:
    """``survived`` (default), ``all``, ``none``, ``needs-fix``, or a comma list of kinds
    (``+kind`` adds to the default, ``-kind`` removes from it)."""
    text = text.strip()
    groups = {"survived": SURVIVED, "all": frozenset(ALL_FAULTS), "none": frozenset(),
              "needs-fix": frozenset(NEEDS_FIX)}
    if text in groups:
        return groups[text]
    items = [p.strip() for p in text.split(",") if p.strip()]
    relative = all(p[0] in "+-" for p in items) and items
    chosen = set(SURVIVED) if relative else set()
    for item in items:
        sign, name = (item[0], item[1:]) if item[0] in "+-" else ("+", item)
        if name in groups:
            kinds: set[FaultKind] = set(groups[name])
        else:
            try:
                kinds = {FaultKind(name)}
            except ValueError:
                known = ", ".join([*groups, *(k.value for k in FaultKind)])
                raise ValueError(f"unknown fault kind {name!r}; known: {known}") from None
        if sign == "+":
            chosen |= kinds
        else:
            chosen -= kinds
    return frozenset(chosen)


@dataclass(frozen=True, slots=True)
class Step:
    """Before operation ``at_op`` (0-based, after set-up), do ``action``.

    ``target`` picks the instance (tracker/reaper 0 or 1, a repository index); ``delay`` is a
    duration in seconds the action uses (how long into a reconciler run the kill lands, how
    long a delayed event is held); ``span`` is a number of operations the fault lasts (S3
    errors, a Redis snapshot's age, a reordered block); ``share`` a fraction (S3 errors).
    """

    at_op: int
    action: FaultKind | ReconcileKind
    target: int = 0
    delay: float = 0.0
    span: int = 0
    share: float = 0.0


def default_rates(ops: int) -> tuple[float, float, int]:
    """(faults per 1000 operations, reconciler runs per 1000, operations between checks) for a
    run of ``ops`` that names none: the short runs' density (4 faults and 1 run per 1000, a
    listing every 2,500) up to 10^4 operations, then totals that grow slowly: 10^6 operations
    get 100 faults, 20 reconciler runs and 20 listings, not 4,000, 1,000 and 400, which would
    spend the run in recoveries, queued Spark runs and listings of a large namespace."""
    if ops <= 10_000:
        return 4.0, 1.0, 2_500
    faults = max(0.1, 40_000 / ops)
    reconciles = max(0.02, 10_000 / ops)
    return faults, reconciles, max(2_500, ops // 20)


def plan(seed: int, ops: int, faults: Iterable[FaultKind], *, repos: int,
         grace_seconds: float, faults_per_kind: float = 1.0, per_1000_ops: float = 4.0,
         reconciles_per_1000_ops: float = 1.5) -> list[Step]:
    """The whole schedule of one soak, sorted by operation index.

    Every selected fault kind happens at least ``max(1, faults_per_kind)`` times; more are
    drawn, uniformly over kinds, until about ``per_1000_ops`` faults per thousand operations.
    Faults land in the first 90% of the run (the rest is for the drain). Reconciler runs are
    spread over the run, at least one of each kind when ops allow; a sweep-only always follows
    a dry run. Heavy faults (a restart of a server or a killed reconciler) are at least 2% of
    the run apart.
    """
    if ops < 0 or repos < 1 or grace_seconds < 0:
        raise ValueError("need ops >= 0, repos >= 1, grace_seconds >= 0")
    kinds = sorted(set(faults), key=lambda k: k.value)
    rng = random.Random(f"hardelete-soak-plan:{seed}")
    steps: list[Step] = []
    if ops == 0:
        return steps
    window = max(1, int(ops * 0.9))
    want: list[FaultKind] = []
    for k in kinds:
        want += [k] * max(1, int(faults_per_kind))
    extra = int(ops / 1000 * per_1000_ops) - len(want)
    if kinds and extra > 0:
        want += [rng.choice(kinds) for _ in range(extra)]
    rng.shuffle(want)
    gap = max(1, ops // 50)
    heavy_at: list[int] = []
    for kind in want:
        at = rng.randrange(window)
        if kind in _HEAVY:
            for _ in range(50):  # keep heavy faults apart when the run is long enough
                if all(abs(at - h) >= gap for h in heavy_at):
                    break
                at = rng.randrange(window)
            heavy_at.append(at)
        steps.append(_fault_step(rng, kind, at, repos, grace_seconds, ops))
    n_recon = max(3, int(ops / 1000 * reconciles_per_1000_ops)) if ops >= 30 else 0
    for i in range(n_recon):
        at = int((i + rng.random()) * window / n_recon)
        rkind = (ReconcileKind.MARK_SWEEP, ReconcileKind.DRY_RUN)[i % 2]
        steps.append(Step(at, rkind, target=rng.randrange(repos)))
        if rkind is ReconcileKind.DRY_RUN:
            # Sweep that mark later, while the workload goes on changing the repository.
            later = min(window, at + max(1, int(rng.uniform(0.01, 0.05) * ops)))
            steps.append(Step(later, ReconcileKind.SWEEP_ONLY, target=steps[-1].target))
    steps.sort(key=lambda s: (s.at_op, s.action.value, s.target))
    return steps


def _fault_step(rng: random.Random, kind: FaultKind, at: int, repos: int, grace: float,
                ops: int) -> Step:
    k = FaultKind
    if kind in (k.KILL_TRACKER, k.KILL_REAPER):
        return Step(at, kind, target=rng.randrange(2), delay=round(rng.uniform(0.0, 2.0), 3))
    if kind is k.KILL_RECONCILER:
        # Lands in Spark's start, the mark or the sweep depending on the delay.
        return Step(at, kind, target=rng.randrange(repos), delay=round(rng.uniform(1.0, 25.0), 3))
    if kind in (k.REDIS_RESTART, k.BROKER_RESTART, k.BROKER_KILL, k.BROKER_LOG_LOST):
        return Step(at, kind, delay=round(rng.uniform(0.0, 1.0), 3))
    if kind is k.REDIS_ROLLBACK:
        return Step(at, kind, span=max(1, int(ops * rng.uniform(0.005, 0.02))))
    if kind is k.DELAY:
        # Well inside the window: the tracker's horizon also lags behind publishing.
        return Step(at, kind, target=rng.randrange(repos),
                    delay=round(rng.uniform(0.05, 0.4) * grace, 3))
    if kind is k.DELAY_BEYOND:
        return Step(at, kind, target=rng.randrange(repos))
    if kind is k.DUPLICATE:
        return Step(at, kind, span=rng.randint(1, 50))
    if kind is k.REORDER:
        return Step(at, kind, target=rng.randrange(repos), span=rng.randint(2, 20))
    if kind is k.S3_ERRORS:
        return Step(at, kind, span=max(1, int(ops * rng.uniform(0.01, 0.05))),
                    share=round(rng.uniform(0.1, 0.5), 3))
    if kind is k.OPERATOR_PAUSE:
        return Step(at, kind, target=rng.randrange(repos),
                    span=max(1, int(ops * rng.uniform(0.005, 0.02))))
    if kind in (k.MARK_SWEEP_RACE, k.MISKEYED, k.NAMESPACE_CLAIM, k.OPERATOR_HOLD):
        return Step(at, kind, target=rng.randrange(repos))
    return Step(at, kind, target=rng.randrange(4))  # MALFORMED (variant), OVERSIZED, ADD_PARTITION
