"""Continuity: the service certifies its own history (schemas/README.md, "Continuity").

Pure functions over the state of one **ordering domain** (a repository, or one of its K
stripes). The service gives every event that can create or end a reference a gapless ``seq``
per domain, committed with the change, and an ``incarnation`` that changes when its store is
restored. The tracker applies events in any order and keeps, per domain:

- ``prefix``: every seq <= prefix is applied; ``above``: the seqs applied beyond it (a gap
  below them holds the prefix back);
- ``pending``: watermarks ``(M, R)`` not yet covered by the prefix. A watermark is the service's
  answer to the tracker's signed ``tick(R)`` (R read from the Redis node that holds the
  domain's records): every event of the domain committed before R has ``seq <= M``;
- ``horizon_ms``: the largest R of a watermark with ``M <= prefix``. Every event that committed
  before the horizon is applied, so an address unreferenced since ``s`` may go once
  ``horizon >= s + grace``.

The same state lives in the repository's Redis slot, updated by the same script as the records
it certifies (``core/continuity.lua``, tested against these functions): Redis going back
takes records and horizon back together, to an older but consistent state.

A second incarnation, or a range the service says is gone, **breaks** the domain: it applies
nothing and has no horizon until it is rebuilt from the service's export (:func:`rebuilt`:
the export's incarnation and counter start the domain again; the incarnations it leaves behind
are **retired**, so their late events are stale, not a new break).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum

SEQ_MAX = 2**53 - 1  # exact in JSON and in Lua's doubles
PENDING_MAX = 32  # watermarks kept above the prefix (more only delays the horizon)
RETIRED_MAX = 8  # incarnations a rebuild left behind that are remembered (the newest by name)


class Admission(StrEnum):
    APPLY = "apply"  # new: apply the event and its records in the same step
    DUPLICATE = "duplicate"  # (domain, seq) applied already: change nothing
    REFUSED = "refused"  # the domain is broken, or the event is of another incarnation


@dataclass(frozen=True, slots=True)
class Watermark:
    seq: int  # M: every event committed before the tick has seq <= M
    tick_ms: int  # R: the tick's Redis time, on the node that holds the domain
    # The highest seq of the domain the tracker had applied when it read R (the tick carries
    # it, signed). Those events were committed before the relay read M, so M below it is a
    # watermark that lies: a relay reading a store that lags (a standby, a replica).
    applied: int = 0


@dataclass(frozen=True, slots=True)
class Domain:
    incarnation: str | None = None
    prefix: int = 0
    above: frozenset[int] = frozenset()
    pending: tuple[Watermark, ...] = ()  # M > prefix; M and R both strictly increasing
    horizon_ms: int | None = None
    broken: str | None = None
    retired: frozenset[str] = frozenset()  # left behind by a rebuild: their events are stale
    # Rebuilds so far: a break the service kept from before the last rebuild is superseded.
    epoch: int = 0

    @property
    def applied_max(self) -> int:
        return max(self.above, default=self.prefix)

    def is_applied(self, seq: int) -> bool:
        return seq <= self.prefix or seq in self.above


def _check_seq(seq: int, what: str = "seq") -> None:
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= SEQ_MAX:
        raise ValueError(f"{what} must be an integer in 0..{SEQ_MAX}, got {seq!r}")


def _bind(d: Domain, incarnation: str) -> Domain:
    """The domain's incarnation, set by the first sequenced fact; a second one breaks it."""
    if not incarnation:
        raise ValueError("incarnation must be a non-empty string")
    if d.incarnation is None:
        return replace(d, incarnation=incarnation)
    if d.incarnation != incarnation:
        return break_domain(d, f"incarnation changed from {d.incarnation!r} to {incarnation!r}")
    return d


def _settle(d: Domain) -> Domain:
    """Advance the prefix over ``above`` and turn covered watermarks into the horizon."""
    prefix, above = d.prefix, set(d.above)
    while prefix + 1 in above:
        prefix += 1
        above.discard(prefix)
    horizon = d.horizon_ms
    for w in d.pending:
        if w.seq <= prefix:
            horizon = w.tick_ms if horizon is None else max(horizon, w.tick_ms)
    pending = [w for w in d.pending
               if w.seq > prefix and (horizon is None or w.tick_ms > horizon)]
    return replace(d, prefix=prefix, above=frozenset(above), pending=tuple(pending),
                   horizon_ms=horizon)


def admit(d: Domain, incarnation: str, seq: int) -> tuple[Domain, Admission]:
    """An event ``(incarnation, seq)`` of this domain arrives: apply it once, in any order."""
    _check_seq(seq)
    if seq == 0:
        raise ValueError("seq starts at 1")
    if d.broken is not None or incarnation in d.retired:
        return d, Admission.REFUSED
    d = _bind(d, incarnation)
    if d.broken is not None:
        return d, Admission.REFUSED
    if d.is_applied(seq):
        return d, Admission.DUPLICATE
    return _settle(replace(d, above=d.above | {seq})), Admission.APPLY


def certify(d: Domain, incarnation: str, w: Watermark) -> Domain:
    """A watermark arrives (its tick's signature already verified by the caller)."""
    _check_seq(w.seq, "watermark seq")
    _check_seq(w.applied, "watermark applied")
    if d.broken is not None or incarnation in d.retired:
        return d
    d = _bind(d, incarnation)
    if d.broken is not None:
        return d
    if w.seq < w.applied:
        return break_domain(d, lied(w))
    if d.horizon_ms is not None and w.tick_ms <= d.horizon_ms:
        return d  # certifies nothing new
    if w.seq <= d.prefix:
        return replace(d, horizon_ms=w.tick_ms,
                       pending=tuple(p for p in d.pending if p.tick_ms > w.tick_ms))
    # Keep M and R increasing: a watermark with a larger M and a smaller or equal R is
    # dominated (it will certify less, later); one with a smaller or equal M and a larger R
    # dominates the ones it passes.
    kept = [p for p in d.pending if not (p.seq >= w.seq and p.tick_ms <= w.tick_ms)]
    if any(p.seq <= w.seq and p.tick_ms >= w.tick_ms for p in kept):
        return d
    kept.append(Watermark(w.seq, w.tick_ms))  # (applied served its check: not kept)
    kept.sort(key=lambda p: p.seq)
    if len(kept) > PENDING_MAX:
        kept = kept[: PENDING_MAX - 1] + kept[-1:]
    return replace(d, pending=tuple(kept))


def lied(w: Watermark) -> str:
    """Why a watermark below what the tracker had applied at its tick breaks the domain."""
    return (f"a watermark says seq <= {w.seq} at tick {w.tick_ms}, when seq {w.applied} was "
            "applied already: its relay read a store that lags (a standby or a replica?)")


def break_domain(d: Domain, reason: str) -> Domain:
    """Stop the domain: it keeps everything until it is rebuilt (a new, empty state)."""
    if d.broken is not None:
        return d
    return replace(d, broken=reason, horizon_ms=None, pending=())


def rebuilt(d: Domain, incarnation: str, counter: int) -> Domain:
    """The domain after a rebuild from the service's export, which was read (in the service's
    store, in one transaction with the state it exports) with this ``incarnation`` and
    ``counter``: every event of the domain up to ``counter`` is in the export, so the prefix
    starts there. Nothing above it is kept (applied again when re-sent: the fold is
    idempotent, and an event the export predates must not stay shadowed by the export's
    state), nor any watermark or horizon: the next watermark certifies again. The domain's
    previous incarnation is retired (its late events, a restored store's unpublished rows,
    are stale: the export holds their effect)."""
    _check_seq(counter, "counter")
    if not incarnation:
        raise ValueError("incarnation must be a non-empty string")
    retired = set(d.retired)
    if d.incarnation is not None:
        retired.add(d.incarnation)
    retired.discard(incarnation)
    return Domain(incarnation=incarnation, prefix=counter,
                  retired=frozenset(sorted(retired)[-RETIRED_MAX:]), epoch=d.epoch + 1)


def gaps(d: Domain, limit: int = 16) -> list[tuple[int, int]]:
    """The seq ranges [a, b] to ask the relay to re-send: below the highest applied seq or the
    highest pending watermark, not applied. At most ``limit`` ranges, lowest first."""
    if d.broken is not None or limit < 1:
        return []
    top = max(d.applied_max, max((w.seq for w in d.pending), default=0))
    out: list[tuple[int, int]] = []
    start = d.prefix + 1
    for s in [*sorted(d.above), top + 1]:
        if s > start:
            out.append((start, s - 1))
            if len(out) >= limit:
                break
        start = max(start, s + 1)
    return out


def horizon(domains: Iterable[Domain]) -> int | None:
    """The repository's horizon: the least over its stripes; None if any has none (or none
    exist), so a repository is reaped only when every stripe is certified."""
    values = []
    for d in domains:
        if d.horizon_ms is None:
            return None
        values.append(d.horizon_ms)
    return min(values) if values else None


def slot_clock(high_ms: int, time_ms: int) -> int:
    """The repository slot's clock at a node's ``TIME`` reading, given the highest value it
    gave before (kept in the slot, ``hd:{R}:clock``): never lower. A clock stepping back, or a
    failover to a replica whose clock is behind, then stalls it instead of stamping a since
    below a tick read earlier (``continuity.lua``'s ``C.clock``)."""
    return max(high_ms, time_ms)


def tick_time(clock_ms: int, skew_ms: int) -> int:
    """The R a tick read at the slot clock ``clock_ms`` carries: ``skew_ms`` less, so that an
    address unreferenced since ``s`` (slot clock) goes only once ``R >= s + grace``, which
    then means at least ``grace`` of real time passed between the since and the tick as long
    as the slot clock gains at most ``skew_ms`` on real time (A7: a forward step of a node's
    clock, a failover to a replica whose clock is ahead)."""
    return max(0, clock_ms - skew_ms)
