"""An exhaustive model check of the continuity protocol (schemas/README.md, "Continuity").

Explicit-state breadth-first search with state hashing, over the product's own pure functions:
``core.continuity`` (``admit``, ``certify``, ``gaps``, ``horizon``) for the tracker's continuity
state, ``tracker.references.apply`` for the mirror's records and ``schemas.liveness.judge`` for
the reaper's decision. Kafka, Redis and the service are small abstract models:

- **Service**: one repository, one or two branches, each with an open staging token:
  ``write`` (a fresh address), ``copy`` (read a live source reference; commit the copy
  strictly less than ``grace`` later, A4, or abandon it), ``delete`` (end a reference of the
  open token), ``commit`` and ``reset`` of a branch. Every change commits the next gapless
  seq of its stripe (branch index modulo the stripes) with an outbox row carrying the store's
  incarnation. The store may be backed up, and restored once (a fault) from a backup younger
  than grace: the outbox's tail goes with it, a new incarnation is minted, and names (tokens,
  addresses, references) stay fresh.
- **Relay**: publishes outbox rows at least once, in any order; answers the tracker's
  ``tick(R)`` with ``watermark(M, R)``, M the committed counter read *after* the tick
  arrived; re-sends a seq the tracker's gaps name.
- **Log**: an event record is consumed when the relay publishes it (its time in the log is
  folded into the relay's delay, which is arbitrary; a record may arrive in any order); a
  watermark stays in the log until consumed (its M was read when the relay answered), as do
  rows of a restored store's lost tail that were published before the restore. At most
  ``log`` records wait. Faults: a record lost (a publish lost, or a waiting record), the log
  replaced (from some moment on, publishes may be lost, then every waiting record is: a
  re-created topic or a wiped broker, which no client notices), a record delivered twice.
- **Tracker**: ticks as the Redis clock reaches each value (the relay keeps the newest
  ``ticks`` unanswered ones); applies an event record through ``admit`` and, if admitted,
  ``apply`` at the Redis time; a watermark through ``certify``. Redis going back (the whole
  mirror restored from a snapshot: records and continuity state together) is a fault.
- **Reaper**: eager: after every step it deletes every address ``judge`` allows at the
  repository's horizon and marks it reaped (``apply`` of its ``addresses_reaped``).
- **Clock**: real time, advanced by 1 as a step, up to ``clock``; the copy's window (A4) and
  the backup's age run on it. The Redis node's clock is real time plus an offset a fault sets
  once (a forward step of ``skew``, A7's bound, or a step back of ``back``); the slot clock
  (``core.continuity.slot_clock``) stamps every since and is what ticks read, and a tick
  carries ``tick_time`` of it.

Safety: in no reachable state is an address deleted while a reference to it is live in the
service's store (staged in an open token, or committed). A copy that commits a reference to an
address deleted since its read, and a restore that brings one back, are violations too.

Seeded bugs (:class:`Bug`), each to be found with a counterexample: (a) the horizon taken from
the tracker's apply time of the watermark; (b) a watermark accepted without ``prefix >= M``;
(c) M taken from the relay's published count; (d) a copy committing later than grace after its
read; (e) a store restored without a new incarnation (its seqs reused); (f) today's
broker-progress proof (the horizon is the time up to which the log as it is now was consumed)
with the log replaced; (g) a tick carrying the slot clock as read (not ``tick_time``'s skew
less) when the node's clock steps forward; (h) since and ticks read from the node's clock (not
the slot clock, which never goes back) when it steps back. Two limits of the contract show
as counterexamples too (:data:`LIMITS`): a copy committing exactly ``grace`` after its read,
and a store restored from a copy as old as grace.

Run: ``./dev modelcheck [--bound tiny|small|medium|large|stripes]``; the unit tests
(``tests/unit/sim/test_modelcheck.py``) run the tiny bound.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import partial
from itertools import combinations
from typing import Any

from core.continuity import (
    Admission,
    Domain,
    Watermark,
    admit,
    certify,
    gaps,
    horizon,
    slot_clock,
    tick_time,
)
from schemas import events as ev
from schemas.liveness import judge
from schemas.records import AddressRecord
from tracker.references import RepoState, apply

REPO = "r"
NAMESPACE = "s3://bkt/r/"
BRANCHES = ("main", "dev")


class Bug(StrEnum):
    """A seeded bug: the checker must find each one."""

    APPLY_TIME = "a"  # horizon from the tracker's apply time of the watermark, not R
    NO_PREFIX = "b"  # a watermark accepted without prefix >= M
    PUBLISHED_M = "c"  # M from the relay's published count, not the committed counter
    SLOW_COPY = "d"  # a copy commits later than grace after its read
    SEQ_REUSE = "e"  # a store restored without a new incarnation (seqs reused)
    BROKER_PROGRESS = "f"  # today's proof: the log as it is now consumed up to R
    RAW_TICK = "g"  # a tick carries the slot clock as read, not less the skew (A7)
    NODE_CLOCK = "h"  # since and ticks from the node's TIME, not the slot clock (may go back)


BUG_TEXT = {
    Bug.APPLY_TIME: "horizon from the watermark's apply time",
    Bug.NO_PREFIX: "watermark taken without prefix >= M",
    Bug.PUBLISHED_M: "M from the relay's published count",
    Bug.SLOW_COPY: "copy commits later than grace after its read",
    Bug.SEQ_REUSE: "store restored, no new incarnation",
    Bug.BROKER_PROGRESS: "broker-progress proof, log replaced",
    Bug.RAW_TICK: "tick not lowered by the skew, clock steps forward",
    Bug.NODE_CLOCK: "since on the node's clock, clock steps back",
}


class Fault(StrEnum):
    LOSE = "lose"  # one record lost in the log
    REPLACE = "replace"  # the log replaced: every record not consumed from a moment on lost
    DUP = "dup"  # a record delivered twice
    REDIS = "redis"  # the mirror restored from a snapshot (records and continuity together)
    STORE = "store"  # the service's store restored from a backup (younger than grace)
    STEP = "step"  # the node's clock steps forward by Bounds.skew (A7's bound)
    BACK = "back"  # the node's clock steps back by Bounds.back


# The fault a bug needs to show itself (the others need none).
BUG_FAULTS = {Bug.SEQ_REUSE: frozenset({Fault.STORE}),
              Bug.BROKER_PROGRESS: frozenset({Fault.REPLACE}),
              Bug.RAW_TICK: frozenset({Fault.STEP}),
              Bug.NODE_CLOCK: frozenset({Fault.BACK})}


@dataclass(frozen=True, slots=True)
class Bounds:
    writes: int = 1  # addresses the service creates (one per write)
    seqs: int = 3  # committed changes per stripe and incarnation
    clock: int = 3  # the Redis clock runs 0..clock
    grace: int = 2
    log: int = 2  # records waiting in the log
    faults: int = 1
    stripes: int = 1
    ticks: int = 1  # ticks the relay holds unanswered (the newest)
    branches: int = 2  # 1: main only (copies within it)
    commits: bool = False  # the service commits branches
    resets: bool = True  # the service resets branches (drops their staged references)
    copy_window: int | None = None  # A4: a copy commits < read + window (default grace)
    restore_age: int | None = None  # a store is restored from a copy younger (default grace)
    after_restore: int = 1  # changes the service commits after a restore (per stripe)
    skew: int = 0  # A7: what the slot clock may gain on real time; a tick's R is that less
    back: int = 2  # how far the node's clock steps back (Fault.BACK)


BOUNDS = {
    # The unit tests': write, copy and delete on one branch; grace 1.
    "tiny": Bounds(writes=1, seqs=3, clock=2, grace=1, log=2, branches=1, resets=False),
    # Two addresses and four changes on one branch (an off-by-one in the prefix needs them).
    "small": Bounds(writes=2, seqs=4, clock=2, grace=1, log=2, branches=1, resets=False),
    # Two branches, copies between them, resets; grace 2.
    "medium": Bounds(),
    # Two addresses on two branches, commits and resets.
    "large": Bounds(writes=2, commits=True),
    # Two stripes (a branch each): the repository's horizon is the least of theirs.
    "stripes": Bounds(seqs=2, stripes=2),
}


@dataclass(frozen=True, slots=True)
class Config:
    bounds: Bounds = Bounds()
    bug: Bug | None = None
    faults: frozenset[Fault] = frozenset()
    max_states: int = 50_000_000


@dataclass
class Result:
    config: Config
    states: int
    transitions: int
    seconds: float
    depth: int
    complete: bool  # the whole bounded space was explored (or a violation was found)
    trace: list[str] | None = None  # the counterexample, a shortest one (breadth-first)
    steps: int = 0  # the counterexample's steps

    @property
    def safe(self) -> bool:
        return self.trace is None

    @property
    def verdict(self) -> str:
        if self.trace is not None:
            return f"violation in {self.steps} steps"
        return "safe" if self.complete else "safe so far (state limit)"


# A state is one flat tuple (hashable, canonical; stored packed into one int, Checker.pack):
#   0 clock
#   1 the service's store, interned (Checker.stores): (inc, epoch, tokens per branch, versions
#     per branch, refs, n_addr, pending, outbox, cap). refs: frozenset of (ref_id, address, token)
#     live at the service (open or committed tokens); pending: None or (branch, address,
#     read_at), a copy that read its source and has not committed; outbox: per stripe, a tuple
#     of rows (incarnation, event index), row i has seq i+1; cap: per stripe, the seqs it may
#     reach (bounds.seqs; after a restore, bounds.after_restore more than the backup's)
#   2 pub: per stripe, the frozenset of seqs the relay published (kept with the outbox)
#   3 inbox: frozenset of R: ticks the relay has not answered
#   4 lossy: 1 while the log is being replaced (publishes may be lost)
#   5 log: frozenset of records waiting: (1, stripe, inc, M, R) a watermark, (0, stripe, inc,
#     seq, event) a row (broker-progress mode: every published row; else a lost tail's)
#   6 mirror: index of the interned RepoState
#   7 dom: per stripe, index of the interned Domain (broker-progress mode: (horizon,), -1 none)
#   8 last_tick
#   9 rsnap: () not taken | (mirror, dom) | USED: no Redis restore may happen any more
#  10 ssnap: () not taken | (store, pub, clock) | USED
#  11 deleted: frozenset of addresses the reaper deleted
#  12 faults used
#  13 the node clock's offset from real time (Fault.STEP: +skew, Fault.BACK: -back); the slot
#     clock is max(last_tick, clock + offset): every tick moves the slot's high-water mark and
#     settle ticks as soon as the slot clock passes it, so last_tick is that mark (a Redis
#     restore would take the mark back too; with one fault per run it never meets a step)
State = tuple[Any, ...]
Action = tuple[Any, ...]
Move = tuple[Action, int, tuple[int, int, int, int] | None]  # action, store, (k, seq, inc, event)
USED: tuple[int] = (-1,)
EMPTY: frozenset[Any] = frozenset()


def _clone(rs: RepoState) -> RepoState:
    return replace(
        rs,
        addresses={a: replace(r, adds=dict(r.adds), removes=dict(r.removes))
                   for a, r in rs.addresses.items()},
        tokens=dict(rs.tokens),
        token_addresses={t: set(s) for t, s in rs.token_addresses.items()},
        branches=dict(rs.branches), commits=dict(rs.commits), tags=dict(rs.tags),
        incidents=[], unreferenced=dict(rs.unreferenced), ref_versions=dict(rs.ref_versions),
        token_owners=dict(rs.token_owners), ref_seen=dict(rs.ref_seen))


def _record_key(r: AddressRecord) -> tuple[Any, ...]:
    return (tuple(sorted(r.adds.items())), tuple(sorted(r.removes.items())), r.state, r.since,
            r.committed, r.doubt, r.issued_until, r.size, r.lease_until, r.claimer, r.reaped_at)


def mirror_key(rs: RepoState) -> tuple[Any, ...]:
    """Everything of a RepoState that ``apply`` or ``judge`` reads back. Left out: the time a
    token changed state (nothing reads it), the incidents and the duplicate counters (written,
    never read)."""
    return (
        rs.meta.namespace if rs.meta else None,  # (the retention fields are constant here)
        tuple(sorted((a, _record_key(r)) for a, r in rs.addresses.items())),
        tuple(sorted((t, s) for t, (s, _) in rs.tokens.items())),
        tuple(sorted((t, tuple(sorted(a))) for t, a in rs.token_addresses.items())),
        tuple(sorted(rs.branches.items())),
        tuple(sorted(rs.commits)),
        tuple(sorted(rs.unreferenced.items())),
        tuple(sorted(rs.ref_versions.items())),
        tuple(sorted(rs.token_owners.items())),
        tuple(rs.ref_seen.items()),
        rs.retired_at,
    )


def event_id(stripe: int, seq: int, epoch: int) -> str:
    """Unique per change: a restored store reuses seqs, never ids (epoch: restores so far)."""
    return f"{stripe}.{seq}.{epoch}"


def make_event(desc: tuple[Any, ...], eid: str) -> ev.Event:
    """The event of a service change ``desc`` (see ``Checker._service``)."""
    kind, branch, token = desc[:3]
    common: dict[str, Any] = {"repository": REPO, "event_id": eid, "branch": branch}
    if kind == "w":
        return ev.ObjectWritten(**common, staging_token=token, path="p", address=desc[3],
                                size=1, ref_id="w" + eid)
    if kind == "y":
        return ev.ObjectCopied(**common, staging_token=token, path="q", address=desc[3],
                               size=1, ref_id="y" + eid, source_read_at=float(desc[4]))
    if kind == "d":
        return ev.ObjectDeleted(**common, staging_token=token, path="p", address=desc[3],
                                ref_id=desc[4])
    if kind == "c":
        return ev.CommitCreated(**common, commit_id="c" + eid, parents=[], sealed_tokens=[token],
                                staging_token=desc[3], committed_at=0.0, manifest="m",
                                ref_version=desc[4])
    assert kind == "x", kind
    return ev.BranchReset(**common, dropped_tokens=[token], staging_token=desc[3], head=None,
                          ref_version=desc[4])


def address(n: int, epoch: int) -> str:
    return f"{NAMESPACE}a{n}" + (f"~{epoch}" if epoch else "")


def short(addr: str) -> str:
    return addr[len(NAMESPACE):] if addr.startswith(NAMESPACE) else addr


class Checker:
    """One run: the model under a :class:`Config`, with memo tables over the product's pure
    functions (a mirror, a domain state and a store are interned once; each function is called
    once per distinct input)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        b = config.bounds
        self.b = b
        self.grace = b.grace
        self.window = b.grace if b.copy_window is None else b.copy_window
        self.restore_age = b.grace if b.restore_age is None else b.restore_age
        self.bug = config.bug
        self.faults = config.faults
        self.broker = config.bug is Bug.BROKER_PROGRESS
        self.K = b.stripes
        self.skew = b.skew
        self.events: list[ev.Event] = []
        self._event_ids: dict[tuple[Any, ...], int] = {}
        self.mirrors: list[RepoState] = []
        self._mirror_ids: dict[tuple[Any, ...], int] = {}
        self.domains: list[Domain] = []
        self._domain_ids: dict[Domain, int] = {}
        self.stores: list[tuple[Any, ...]] = []
        self._store_ids: dict[tuple[Any, ...], int] = {}
        self.live: list[frozenset[str]] = []  # per store: the addresses a live reference names
        self._moves: dict[tuple[int, int], tuple[Move, ...]] = {}
        self._advance: dict[tuple[int, int], int] = {}
        self._restore: dict[tuple[int, int], int] = {}
        self._apply: dict[tuple[int, int, int], int] = {}
        self._admit: dict[tuple[int, int, int], tuple[int, Admission]] = {}
        self._certify: dict[tuple[int, int, int, int], int] = {}
        self._horizon: dict[tuple[int, ...], int | None] = {}
        self._gaps: dict[tuple[int, ...], frozenset[tuple[int, int]]] = {}
        self._judge: dict[tuple[int, int, int], tuple[str, ...]] = {}
        self._reap: dict[tuple[int, str, int], int] = {}

    # --- interning and memoised product functions -----------------------------------------

    def _intern_mirror(self, rs: RepoState) -> int:
        key = mirror_key(rs)
        mid = self._mirror_ids.get(key)
        if mid is None:
            mid = self._mirror_ids[key] = len(self.mirrors)
            self.mirrors.append(rs)
        return mid

    def _intern_domain(self, d: Domain) -> int:
        did = self._domain_ids.get(d)
        if did is None:
            did = self._domain_ids[d] = len(self.domains)
            self.domains.append(d)
        return did

    def _intern_store(self, svc: tuple[Any, ...]) -> int:
        sid = self._store_ids.get(svc)
        if sid is None:
            sid = self._store_ids[svc] = len(self.stores)
            self.stores.append(svc)
            self.live.append(frozenset(a for _, a, _ in svc[4]))
        return sid

    def _event(self, desc: tuple[Any, ...], make: Callable[[], ev.Event]) -> int:
        idx = self._event_ids.get(desc)
        if idx is None:
            idx = self._event_ids[desc] = len(self.events)
            self.events.append(make())
        return idx

    def apply(self, mid: int, event: int, now: int) -> int:
        key = (mid, event, now)
        out = self._apply.get(key)
        if out is None:
            rs = _clone(self.mirrors[mid])
            result = apply(rs, self.events[event], now)
            assert result.rejected is None, result.rejected
            out = self._apply[key] = self._intern_mirror(rs)
        return out

    def admit(self, did: int, inc: int, seq: int) -> tuple[int, Admission]:
        key = (did, inc, seq)
        out = self._admit.get(key)
        if out is None:
            d, verdict = admit(self.domains[did], f"i{inc}", seq)
            out = self._admit[key] = (self._intern_domain(d), verdict)
        return out

    def certify(self, did: int, inc: int, m: int, r: int) -> int:
        key = (did, inc, m, r)
        out = self._certify.get(key)
        if out is None:
            out = self._certify[key] = self._intern_domain(
                certify(self.domains[did], f"i{inc}", Watermark(m, r)))
        return out

    def horizon(self, dom: tuple[int, ...]) -> int | None:
        if self.broker:
            return None if dom[0] < 0 else dom[0]
        out = self._horizon.get(dom, -1)
        if out == -1:
            out = self._horizon[dom] = horizon(self.domains[d] for d in dom)
        return out

    def stalled(self, dom: tuple[int, ...]) -> bool:
        """A stripe is broken: the repository has no horizon until a rebuild (or Redis going
        back)."""
        return not self.broker and any(self.domains[d].broken is not None for d in dom)

    def slot(self, s: State) -> int:
        """The slot clock at ``s``: what a since is stamped with and a tick read at
        (``core.continuity.slot_clock``; bug h: the node's TIME as it is)."""
        node = s[0] + s[13]
        return node if self.bug is Bug.NODE_CLOCK else slot_clock(s[8], node)

    def wanted(self, dom: tuple[int, ...]) -> frozenset[tuple[int, int]]:
        """(stripe, seq) of every seq ``gaps`` names."""
        out = self._gaps.get(dom)
        if out is None:
            out = self._gaps[dom] = frozenset(
                (k, s) for k, did in enumerate(dom)
                for a, b in gaps(self.domains[did]) for s in range(a, b + 1))
        return out

    def deletable(self, mid: int, h: int, now: int) -> tuple[str, ...]:
        key = (mid, h, now)
        out = self._judge.get(key)
        if out is None:
            rs = self.mirrors[mid]
            states = {t: s.value for t, (s, _) in rs.tokens.items()}
            out = self._judge[key] = tuple(sorted(
                a for a, rec in rs.addresses.items()
                if judge(rec, states, now_ms=now, horizon_ms=h, grace_ms=self.grace).may_delete))
        return out

    def reap(self, mid: int, addr: str, now: int) -> int:
        key = (mid, addr, now)
        out = self._reap.get(key)
        if out is None:
            rs = _clone(self.mirrors[mid])
            apply(rs, ev.AddressesReaped(repository=REPO, event_id=f"reaped-{short(addr)}",
                                         addresses=[addr], reaper="model"), now)
            out = self._reap[key] = self._intern_mirror(rs)
        return out

    # --- the service -----------------------------------------------------------------------

    def moves(self, sid: int, clock: int) -> tuple[Move, ...]:
        """What the service may do in ``store`` at ``clock``: its changes (each with its
        outbox row) and a copy reading its source."""
        key = (sid, clock)
        out = self._moves.get(key)
        if out is None:
            out = self._moves[key] = tuple(self._service(sid, clock))
        return out

    def _service(self, sid: int, clock: int) -> Iterable[Move]:
        svc = self.stores[sid]
        inc, epoch, tokens, versions, refs, n_addr, pending, outbox, cap = svc
        b, K = self.b, self.K
        out: list[Move] = []

        def change(branch: int, desc: tuple[Any, ...], refs2: frozenset[Any],
                   tokens2: tuple[str, ...] = tokens, versions2: tuple[int, ...] = versions,
                   n2: int = n_addr, pending2: Any = pending) -> None:
            k = branch % K
            seq = len(outbox[k]) + 1
            if seq > cap[k]:
                return
            eid = event_id(k, seq, epoch)
            idx = self._event((*desc, eid), partial(make_event, desc, eid))
            box = (*outbox[:k], (*outbox[k], (inc, idx)), *outbox[k + 1:])
            sid2 = self._intern_store((inc, epoch, tokens2, versions2, refs2, n2, pending2, box,
                                       cap))
            out.append((("change", k, seq, idx), sid2, (k, seq, inc, idx)))

        def next_id(branch: int) -> str:
            k = branch % K
            return event_id(k, len(outbox[k]) + 1, epoch)

        live = sorted({a for _, a, _ in refs})
        for bi, bn in enumerate(BRANCHES[:b.branches]):
            tok = tokens[bi]
            if n_addr < b.writes:
                addr = address(n_addr, epoch)
                change(bi, ("w", bn, tok, addr), refs | {("w" + next_id(bi), addr, tok)},
                       n2=n_addr + 1)
            if pending is None and len(outbox[bi % K]) < cap[bi % K]:
                for addr in live:
                    sid2 = self._intern_store((*svc[:6], (bi, addr, clock), *svc[7:]))
                    out.append((("copy_read", bn, addr), sid2, None))
            own = sorted((r, a) for r, a, t in refs if t == tok)
            for ref, addr in own:
                change(bi, ("d", bn, tok, addr, ref), refs - {(ref, addr, tok)})
            if own:
                v = versions[bi] + 1
                new = f"{bn}{v}" + (f"~{epoch}" if epoch else "")
                toks = (*tokens[:bi], new, *tokens[bi + 1:])
                vers = (*versions[:bi], v, *versions[bi + 1:])
                if b.commits:
                    change(bi, ("c", bn, tok, new, v), refs, toks, vers)
                if b.resets:
                    change(bi, ("x", bn, tok, new, v),
                           frozenset(r for r in refs if r[2] != tok), toks, vers)
        # Bug d: a copy may also commit later than grace after its read (at exactly grace is
        # the limit LIMITS shows).
        if pending is not None and (clock < pending[2] + self.window or (
                self.bug is Bug.SLOW_COPY and clock > pending[2] + self.grace)):
            bi, addr, read_at = pending
            bn, tok = BRANCHES[bi], tokens[bi]
            change(bi, ("y", bn, tok, addr, read_at), refs | {("y" + next_id(bi), addr, tok)},
                   pending2=None)
        return out

    def advance(self, sid: int, clock: int) -> int:
        """The store as the clock reaches ``clock``: a copy that can no longer commit within
        its window (A4) is abandoned."""
        key = (sid, clock)
        out = self._advance.get(key)
        if out is None:
            svc = self.stores[sid]
            pending = svc[6]
            if pending is not None and self.bug is not Bug.SLOW_COPY \
                    and clock >= pending[2] + self.window:
                out = self._intern_store((*svc[:6], None, *svc[7:]))
            else:
                out = sid
            self._advance[key] = out
        return out

    def restore(self, backup: int, sid: int) -> int:
        """The store restored from ``backup``: a new incarnation (not with bug e) and fresh
        names from here on; a copy in flight in a service process still commits."""
        key = (backup, sid)
        out = self._restore.get(key)
        if out is None:
            old, cur = self.stores[backup], self.stores[sid]
            inc = cur[0] if self.bug is Bug.SEQ_REUSE else cur[0] + 1
            cap = tuple(min(self.b.seqs, len(rows) + self.b.after_restore) for rows in old[7])
            out = self._restore[key] = self._intern_store(
                (inc, cur[1] + 1, *old[2:6], cur[6], old[7], cap))
        return out

    # --- the model -------------------------------------------------------------------------

    def initial(self) -> State:
        rs = RepoState(REPO)
        setup: list[ev.Event] = [ev.RepositoryCreated(
            repository=REPO, event_id="setup-repo", storage_namespace=NAMESPACE,
            default_branch="main", default_retention_days=1.0)]
        setup += [ev.BranchCreated(repository=REPO, event_id=f"setup-{b}", branch=b,
                                   staging_token=f"{b}1", ref_version=1) for b in BRANCHES]
        for e in setup:
            assert apply(rs, e, 0).rejected is None
        mid = self._intern_mirror(rs)
        did = self._intern_domain(Domain())
        sid = self._intern_store((0, 0, tuple(f"{b}1" for b in BRANCHES),
                                  (1,) * len(BRANCHES), frozenset(), 0, None, ((),) * self.K,
                                  (self.b.seqs,) * self.K))
        dom = (-1,) if self.broker else (did,) * self.K
        rsnap = () if Fault.REDIS in self.faults and not self.broker else USED
        ssnap = () if Fault.STORE in self.faults and not self.broker else USED
        return (0, sid, (EMPTY,) * self.K, EMPTY, 0, EMPTY, mid, dom, -1,
                rsnap, ssnap, frozenset(), 0, 0)

    def successors(self, s: State) -> list[tuple[Action, State]]:
        """Every step from ``s``, before :meth:`settle`."""
        out: list[tuple[Action, State]] = []
        (clock, sid, pub, inbox, lossy, log, mid, dom, last_tick, rsnap, ssnap, deleted,
         nf, offset) = s
        b = self.b
        fault_left = nf < b.faults
        if not fault_left and self.stalled(dom) and not (
                self.stores[sid][6] is not None and self.stores[sid][6][1] in deleted):
            # Nothing can be deleted any more, and no reference to a deleted address can
            # appear (a copy reads only a live reference): no violation is reachable.
            return out
        if clock < b.clock:
            out.append((("clock", clock + 1), (clock + 1, self.advance(sid, clock + 1), *s[2:])))
        for action, sid2, row in self.moves(sid, clock):
            if row is None or not self.broker:
                out.append((action, (clock, sid2, *s[2:])))
            elif len(log) < b.log:  # today's publisher: in the log as the change commits
                k, seq, inc, idx = row
                out.append((action, (clock, sid2, pub, inbox, lossy,
                                     log | {(0, k, inc, seq, idx)}, *s[6:])))
        for rec in sorted(log):
            out.append(self._consume(s, rec, log - {rec}))
        if self.broker:
            if clock > dom[0] and not log:
                # The broker-progress proof: at R the tracker's position is the log's end.
                out.append((("progress", clock), (*s[:7], (clock,), *s[8:])))
            if fault_left and log and Fault.REPLACE in self.faults:
                out.append((("replace", len(log)), (*s[:5], EMPTY, *s[6:12], nf + 1, *s[13:])))
            return out
        self._relay(s, out, fault_left)
        if not ssnap:
            out.append((("store_backup",), (*s[:10], (sid, pub, clock), *s[11:])))
        elif ssnap is not USED and fault_left and clock - ssnap[2] < self.restore_age:
            backup, old_pub, _ = ssnap
            sid2 = self.restore(backup, sid)
            # Rows of the lost tail that were published may still be in the log (within its
            # bound): any of those not delivered yet.
            box, kept = self.stores[sid][7], self.stores[backup][7]
            tail = [(0, k, box[k][q - 1][0], q, box[k][q - 1][1]) for k in range(self.K)
                    for q in range(len(kept[k]) + 1, len(box[k]) + 1) if q not in pub[k]]
            room = max(0, b.log - len(log))
            for n in range(min(room, len(tail)) + 1):
                for ghosts in combinations(tail, n):
                    out.append((("store_restore", self.stores[sid2][0], len(ghosts)),
                                (clock, sid2, old_pub, inbox, lossy, log | set(ghosts), mid,
                                 dom, last_tick, rsnap, USED, deleted, nf + 1, s[13])))
        if not rsnap:
            out.append((("redis_snapshot",), (*s[:9], (mid, dom), *s[10:])))
        elif rsnap is not USED and fault_left:
            out.append((("redis_restore",), (*s[:6], rsnap[0], rsnap[1], last_tick, USED,
                                             ssnap, deleted, nf + 1, s[13])))
        if fault_left and offset == 0:
            if Fault.STEP in self.faults:
                out.append((("clock_step", b.skew), (*s[:12], nf + 1, b.skew)))
            if Fault.BACK in self.faults:
                out.append((("clock_step", -b.back), (*s[:12], nf + 1, -b.back)))
        if fault_left and Fault.LOSE in self.faults:
            for rec in sorted(log):
                out.append((("lose", rec), (*s[:5], log - {rec}, *s[6:12], nf + 1, *s[13:])))
        if Fault.REPLACE in self.faults:
            if lossy:
                out.append((("replace", len(log)), (*s[:4], 0, EMPTY, *s[6:])))
            elif fault_left:
                out.append((("replace_from",), (*s[:4], 1, *s[5:12], nf + 1, *s[13:])))
        return out

    def _relay(self, s: State, out: list[tuple[Action, State]], fault_left: bool) -> None:
        """The relay publishes a row (in any order) and the tracker consumes it (the time a
        record spends in the log is the relay's delay); it answers a tick (the watermark
        stays in the log until consumed); it re-sends a seq the tracker's gaps name."""
        clock, sid, pub, inbox, lossy, log = s[:6]
        svc = self.stores[sid]
        inc, outbox = svc[0], svc[7]
        dom = s[7]
        lose = fault_left and Fault.LOSE in self.faults
        dup = fault_left and Fault.DUP in self.faults
        for k in range(self.K):
            rows, done = outbox[k], pub[k]
            for seq in range(1, len(rows) + 1):
                row_inc, idx = rows[seq - 1]
                rec = (0, k, row_inc, seq, idx)
                if seq not in done:
                    pub2 = (*pub[:k], done | {seq}, *pub[k + 1:])
                    t = (clock, sid, pub2, *s[3:])
                    out.append(self._consume(t, rec, log, "publish"))
                    if lossy:
                        out.append((("publish_lost", k, seq), t))
                    elif lose:
                        out.append((("publish_lost", k, seq), (*t[:12], t[12] + 1, *t[13:])))
                elif dup:
                    out.append(self._consume((*s[:12], s[12] + 1, *s[13:]), rec, log, "dup"))
        for k, seq in sorted(self.wanted(dom)):
            rows = outbox[k]
            if seq <= len(rows) and seq in pub[k]:
                row_inc, idx = rows[seq - 1]
                out.append(self._consume(s, (0, k, row_inc, seq, idx), log, "resend"))
        if len(log) + self.K <= self.b.log:
            for r in sorted(inbox):
                ms = tuple(len(p) for p in pub) if self.bug is Bug.PUBLISHED_M else \
                    tuple(len(rows) for rows in outbox)
                marks = {(1, k, inc, m, r) for k, m in enumerate(ms)}
                out.append((("answer", r, ms), (clock, sid, pub, inbox - {r}, lossy,
                                                log | marks, *s[6:])))

    def _consume(self, s: State, rec: tuple[int, ...], rest: frozenset[Any],
                 how: str = "consume") -> tuple[Action, State]:
        """The tracker consumes ``rec`` (``rest``: the log after it)."""
        clock, mid, dom = s[0], s[6], s[7]
        if self.broker:
            mid2 = self.apply(mid, rec[4], clock)
            return (how, rec, "apply"), (*s[:5], rest, mid2, *s[7:])
        kind, k, inc = rec[0], rec[1], rec[2]
        verdict: str
        if kind == 0:
            did, admission = self.admit(dom[k], inc, rec[3])
            now = self.slot(s)
            mid2 = self.apply(mid, rec[4], now) if admission is Admission.APPLY else mid
            verdict = admission.value
        else:
            m, r = rec[3], rec[4]
            if self.bug is Bug.APPLY_TIME:
                r = tick_time(self.slot(s), self.skew)
            if self.bug is Bug.NO_PREFIX:
                m = min(m, self.domains[dom[k]].prefix)
            did = self.certify(dom[k], inc, m, r)
            mid2 = mid
            verdict = "certify"
        dom2 = (*dom[:k], did, *dom[k + 1:])
        return (how, rec, verdict), (*s[:5], rest, mid2, dom2, *s[8:])

    def settle(self, s: State) -> State:
        """What happens at once after every step, and the canonical form of a state:

        - the tracker ticks as its clock reaches a new value (the relay keeps the newest
          ``ticks`` per stripe; an older one is superseded);
        - the eager reaper deletes what ``judge`` allows at the horizon and marks it reaped;
        - once no fault is left, the snapshots are forgotten."""
        (clock, sid, pub, inbox, lossy, log, mid, dom, last_tick, rsnap, ssnap, deleted,
         nf, offset) = s
        changed = False
        now = clock if self.broker else self.slot(s)
        if now > last_tick and not self.broker:
            changed = True
            last_tick = now
            if len(inbox) >= self.b.ticks:
                inbox = inbox - set(sorted(inbox)[:len(inbox) - self.b.ticks + 1])
            inbox = inbox | {now if self.bug is Bug.RAW_TICK else tick_time(now, self.skew)}
        h = self.horizon(dom)
        if h is not None:
            dels = self.deletable(mid, h, now)
            if dels:
                changed = True
                for a in dels:
                    mid = self.reap(mid, a, now)
                deleted = deleted | set(dels)
        if nf >= self.b.faults and (rsnap is not USED or ssnap is not USED):
            changed = True
            rsnap = ssnap = USED
        elif ssnap and ssnap is not USED and clock - ssnap[2] >= self.restore_age:
            changed = True
            ssnap = ()  # too old to be restored (a new backup may be taken)
        if not changed:
            return s
        return (clock, sid, pub, inbox, lossy, log, mid, dom, last_tick, rsnap, ssnap, deleted,
                nf, offset)

    def violation(self, s: State) -> str | None:
        deleted = s[11]
        if not deleted or not (deleted & self.live[s[1]]):
            return None
        for ref, addr, tok in sorted(self.stores[s[1]][4]):
            if addr in deleted:
                return (f"{short(addr)} was deleted and is live at the service: reference "
                        f"{ref} in token {tok}")
        raise AssertionError("unreachable")  # pragma: no cover

    # --- the search ------------------------------------------------------------------------

    # A state is stored as one int: the small fields, then 28 bits per interned field.
    _PACKED = (2, 3, 5, 7, 9, 10, 11)  # pub, inbox, log, dom, rsnap, ssnap, deleted
    _ID_BITS = 28

    def _new_id(self, j: int, v: Any) -> int:
        n = self._ids[j][v] = len(self._values[j])
        self._values[j].append(v)
        return n

    def pack(self, s: State) -> int:
        a, b, c, d, e, f, g = self._ids
        new = self._new_id
        n0 = a.get(s[2])
        if n0 is None:
            n0 = new(0, s[2])
        n1 = b.get(s[3])
        if n1 is None:
            n1 = new(1, s[3])
        n2 = c.get(s[5])
        if n2 is None:
            n2 = new(2, s[5])
        n3 = d.get(s[7])
        if n3 is None:
            n3 = new(3, s[7])
        n4 = e.get(s[9])
        if n4 is None:
            n4 = new(4, s[9])
        n5 = f.get(s[10])
        if n5 is None:
            n5 = new(5, s[10])
        n6 = g.get(s[11])
        if n6 is None:
            n6 = new(6, s[11])
        return int(s[0] | (s[8] + 1) << 6 | s[4] << 12 | s[12] << 13 | s[1] << 16 | s[6] << 44
                   | n0 << 72 | n1 << 100 | n2 << 128 | n3 << 156 | n4 << 184 | n5 << 212
                   | n6 << 240 | (s[13] + 32) << 268)

    def unpack(self, key: int) -> State:
        m = (1 << 28) - 1
        pub, inbox, log, dom, rsnap, ssnap, deleted = (
            values[key >> (72 + 28 * j) & m] for j, values in enumerate(self._values))
        return (key & 63, key >> 16 & m, pub, inbox, key >> 12 & 1, log, key >> 44 & m, dom,
                (key >> 6 & 63) - 1, rsnap, ssnap, deleted, key >> 13 & 7, (key >> 268) - 32)

    def run(self, progress: Callable[[int, int, float], None] | None = None,
            every: int = 500_000) -> Result:
        """Breadth-first: the first violation found has a shortest trace."""
        start = time.monotonic()
        self._ids: list[dict[Any, int]] = [{} for _ in self._PACKED]
        self._values: list[list[Any]] = [[] for _ in self._PACKED]
        assert self.b.clock + self.b.skew < 62 and self.b.faults < 7 and self.b.back < 32
        pack, unpack = self.pack, self.unpack
        init = self.settle(self.initial())
        parent: dict[int, int] = {pack(init): -1}
        frontier = [pack(init)]
        transitions = 0
        depth = 0
        limit = self.config.max_states
        found: int | None = None
        bad = self.violation(init)
        if bad is not None:
            found = frontier[0]
        successors, settle, violation = self.successors, self.settle, self.violation
        report = every
        while frontier and found is None and len(parent) < limit:
            depth += 1
            nxt: list[int] = []
            for key in frontier:
                for _, raw in successors(unpack(key)):
                    t = settle(raw)
                    transitions += 1
                    k = pack(t)
                    if k in parent:
                        continue
                    parent[k] = key
                    nxt.append(k)
                    why = violation(t)
                    if why is not None:
                        found, bad = k, why
                        break
                if found is not None or len(parent) >= limit:
                    break
                if progress is not None and len(parent) >= report:
                    report += every
                    progress(len(parent), depth, time.monotonic() - start)
            frontier = nxt
        seconds = time.monotonic() - start
        trace = None
        if found is not None and bad is not None:
            path = [found]
            while parent[path[-1]] != -1:
                path.append(parent[path[-1]])
            trace = self.describe([unpack(k) for k in reversed(path)])
            trace.append(f"VIOLATION: {bad}")
        complete = found is not None or not frontier
        assert max(len(self.stores), len(self.mirrors), *map(len, self._values)) < 1 << 28
        return Result(self.config, len(parent), transitions, seconds, depth, complete, trace,
                      len(path) - 1 if found is not None else 0)

    # --- traces ----------------------------------------------------------------------------

    def describe(self, path: Sequence[State]) -> list[str]:
        lines = [f"{self.b}; bug {self.bug.value if self.bug else '-'}; faults "
                 f"{','.join(sorted(self.faults)) or '-'}"]
        for i in range(1, len(path)):
            s, t = path[i - 1], path[i]
            action, raw = next((a, u) for a, u in self.successors(s) if self.settle(u) == t)
            lines.append(f"{i:3}. t={s[0]} {self._say(s, action)}")
            if t[8] > s[8] and not self.broker:
                r = t[8] if self.bug is Bug.RAW_TICK else tick_time(t[8], self.skew)
                lines.append(f"     tracker: tick at slot clock {t[8]}, R={r}")
            for a in sorted(t[11] - s[11]):
                rec = self.mirrors[raw[6]].addresses.get(a)
                since = rec.since if rec else None
                lines.append(f"     reaper: deletes {short(a)} (unreferenced since {since}, "
                             f"horizon {self.horizon(t[7])}, grace {self.grace})")
        return lines

    def _say(self, s: State, a: Action) -> str:
        kind = a[0]
        if kind == "change":
            e = self.events[a[3]]
            return (f"service: commits seq {a[2]} (stripe {a[1]}, i{self.stores[s[1]][0]}): "
                    f"{_event(e)}")
        if kind == "clock":
            return f"clock -> {a[1]}"
        if kind == "clock_step":
            return f"redis: the node's clock steps {'forward' if a[1] > 0 else 'back'} by " \
                   f"{abs(a[1])} (fault)"
        if kind == "copy_read":
            return f"service: a copy into {a[1]} reads a live reference to {short(a[2])}"
        if kind in ("consume", "publish", "dup", "resend"):
            rec, verdict = a[1], a[2]
            who = {"consume": "tracker: consumes",
                   "publish": "relay publishes, tracker consumes",
                   "dup": "relay publishes again (fault), tracker consumes",
                   "resend": "relay re-sends (a gap), tracker consumes"}[kind]
            if rec[0] == 0:
                e = self.events[rec[4]]
                return f"{who} seq {rec[3]} (i{rec[2]}) {_event(e)}: {verdict}"
            d = self.domains[s[7][rec[1]]]
            return (f"{who} watermark(M={rec[3]}, R={rec[4]}, i{rec[2]}) of stripe {rec[1]}; "
                    f"prefix {d.prefix}, horizon was {d.horizon_ms}")
        if kind == "publish_lost":
            return f"relay: publishes seq {a[2]} of stripe {a[1]}: lost in the log (fault)"
        if kind == "answer":
            ms = ", ".join(f"M{k}={m}" for k, m in enumerate(a[2])) if self.K > 1 else \
                f"M={a[2][0]}"
            return f"relay: answers tick R={a[1]} with {ms}"
        if kind == "progress":
            return f"tracker: the log consumed to its end at R={a[1]}: horizon {a[1]}"
        if kind == "lose":
            return f"log: {_rec(a[1])} lost (fault)"
        if kind == "replace_from":
            return "log: replaced from here (fault): what is published now may be lost"
        if kind == "replace":
            return f"log: replaced, its {a[1]} unconsumed record(s) lost (fault)"
        if kind == "redis_snapshot":
            return "redis: snapshot taken"
        if kind == "redis_restore":
            return "redis: restored from the snapshot (fault)"
        if kind == "store_backup":
            return "service: store backed up"
        if kind == "store_restore":
            return (f"service: store restored from the backup, incarnation i{a[1]} (fault); "
                    f"{a[2]} row(s) of the lost tail still in the log")
        return repr(a)  # pragma: no cover


def _event(e: ev.Event) -> str:
    if isinstance(e, ev.ObjectWritten | ev.ObjectCopied):
        return f"{e.TYPE} {short(e.address)} ref {e.ref_id} in {e.staging_token}"
    if isinstance(e, ev.ObjectDeleted):
        return f"{e.TYPE} {short(e.address)} ref {e.ref_id} in {e.staging_token}"
    if isinstance(e, ev.CommitCreated):
        return f"{e.TYPE} {e.branch} seals {e.sealed_tokens[0]}, opens {e.staging_token}"
    if isinstance(e, ev.BranchReset):
        return f"{e.TYPE} {e.branch} drops {e.dropped_tokens[0]}, opens {e.staging_token}"
    return e.TYPE  # pragma: no cover


def _rec(rec: tuple[Any, ...]) -> str:
    if rec[0] == 0:
        return f"seq {rec[3]} (stripe {rec[1]})"
    return f"watermark(M={rec[3]}, R={rec[4]})"



def check(bounds: Bounds = Bounds(), bug: Bug | None = None,
          faults: Iterable[Fault] = (), max_states: int = 50_000_000,
          progress: Callable[[int, int, float], None] | None = None) -> Result:
    """Explore every state of the model within ``bounds`` (up to ``max_states``)."""
    config = Config(bounds, bug, frozenset(faults), max_states)
    return Checker(config).run(progress)


# --- ./dev modelcheck --------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    bug: Bug | None = None
    faults: frozenset[Fault] = frozenset()
    expect_safe: bool = True
    # Bounds changed for this case: (field, (other field, plus)): other field's value + plus.
    adjust: tuple[tuple[str, tuple[str, int]], ...] = field(default=())

    def bounds(self, base: Bounds) -> Bounds:
        return replace(base, **{k: getattr(base, f) + plus for k, (f, plus) in self.adjust})


# A restored store re-runs the service from its backup: one change fewer keeps the space of
# the store fault near the others'.
STORE_ADJUST = (("seqs", ("seqs", -1)),)
# A forward step needs a skew to step by (A7's bound, which the correct protocol subtracts).
STEP_ADJUST = (("skew", ("skew", 1)),)
FAULT_ADJUST = {Fault.STORE: STORE_ADJUST, Fault.STEP: STEP_ADJUST}
BUG_ADJUST = {Bug.RAW_TICK: STEP_ADJUST}


# Where the contract's own wording stops protecting (schemas/README.md, "Model check").
LIMITS = (
    Case("limit: a copy commits grace after its read", expect_safe=False,
         adjust=(("copy_window", ("grace", 1)),)),
    Case("limit: store restored from a copy grace old", faults=frozenset({Fault.STORE}),
         expect_safe=False, adjust=(("restore_age", ("grace", 1)),)),
)


def cases() -> list[Case]:
    out = [Case("correct, no fault")]
    out += [Case(f"correct, {f.value}", faults=frozenset({f}), adjust=FAULT_ADJUST.get(f, ()))
            for f in Fault]
    out += [Case(f"bug {b.value}: {BUG_TEXT[b]}", b, BUG_FAULTS.get(b, frozenset()),
                 expect_safe=False, adjust=BUG_ADJUST.get(b, ())) for b in Bug]
    out.append(Case("broker-progress proof, no fault", Bug.BROKER_PROGRESS))
    return out + list(LIMITS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="./dev modelcheck",
        description="Exhaustive model check of the continuity protocol (schemas/README.md, "
                    "'Model check'): the correct protocol under each fault kind, each seeded "
                    "bug, and the contract's limits.")
    parser.add_argument("--bound", choices=list(BOUNDS), default="small",
                        help="the model's size (default small)")
    parser.add_argument("--only", default="",
                        help="run only the cases whose name contains this text")
    parser.add_argument("--max-states", type=int, default=20_000_000,
                        help="stop a case after this many states (default 20,000,000: about "
                             "2.5 GB)")
    parser.add_argument("--traces", action="store_true",
                        help="print every counterexample in full (default: the first lines)")
    args = parser.parse_args(argv)
    base = BOUNDS[args.bound]
    print(f"model check, bound {args.bound}: {base}", flush=True)
    rows = []
    for case in cases():
        if args.only not in case.name:
            continue
        print(f"- {case.name}", flush=True)

        def progress(states: int, depth: int, seconds: float) -> None:
            print(f"    {states:>12,} states  depth {depth:3}  {seconds:8.1f} s  "
                  f"{states / max(seconds, 1e-9):>9,.0f} states/s", flush=True)

        r = check(case.bounds(base), case.bug, case.faults, args.max_states, progress)
        good = r.complete and r.safe == case.expect_safe
        rows.append((case, r, good))
        print(f"    {r.states:,} states, {r.seconds:.1f} s: {r.verdict}", flush=True)
        if r.trace:
            shown = r.trace if args.traces else r.trace[:1] + r.trace[-8:]
            print("\n".join("      " + ln for ln in shown), flush=True)
    width = max((len(case.name) for case, _, _ in rows), default=4)
    print()
    print(f"{'case':<{width}} {'states':>12} {'seconds':>8}  verdict")
    for case, r, good in rows:
        print(f"{case.name:<{width}} {r.states:>12,} {r.seconds:>8.1f}  {r.verdict}"
              f"{'' if good else '  UNEXPECTED'}")
    bad = [case.name for case, _, good in rows if not good]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} as expected"
          + (f"; unexpected: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
