"""The one judgment of liveness: may this address be deleted now, and if not, why it is kept.

Pure: a function of a decoded address record (``schemas/records.py``), the states of its
staging tokens, the clocks (Redis ``now``, the tracker's proven horizon), the grace window and
the guards read right before a delete (holds, fail-closed, pause, namespace ownership). Every
reader that decides or explains a deletion uses it: the reaper (Python side of its claims and
right before its request), the sweep's re-check (``reconciler.sweep.still_referenced``), the
mark's export (``reconciler.records.verdict``) and ``hardelete explain``. ``reaper/claims.lua``
and ``tracker/apply.lua`` implement the same rules inside Redis; differential tests on a real
Redis prove they agree (``tests/integration/schemas/test_liveness_lua.py``).

Two paths ask:

* ``online`` (the reaper): only an address that no reference keeps, never committed, with no
  unexpired issued upload, unreferenced since at least ``grace`` before the horizon, may go.
  A committed address is terminal for the online path.
* ``reconciler`` (mark and sweep): the same, except that a committed address, a reaped
  tombstone and an address with no record are the reconciler's to judge with retention and
  its listing (``may_delete`` then means "the tracker's record does not keep it").

The rules, in the order their reason is reported (every rule that keeps, keeps):

1. guards: ``not_owner`` (the address is outside its repository's namespace or inside another
   live repository's), ``fail_closed``, ``paused``, ``held``;
2. ``gone`` (online: no record), ``doubt`` (a field that cannot be decoded);
3. ``staged``: a reference added, never removed, in an open, sealed or unknown token;
   ``doubt`` for a token state we do not know;
4. ``committed``: the sticky flag, a reference in a committed token, or the state says so;
5. ``claimed``: a reaper's lease in flight (online: an expired lease may be claimed again);
6. ``doubt``: an unknown or missing state, ``staged`` without a live reference, ``issued``
   without ``iu``;
7. ``issued``: an upload address whose protection ends (``iu``) after ``now`` or after the
   bound ``horizon - grace``;
8. ``no_horizon`` (the tracker has no proven progress), ``doubt`` (no ``since``), ``young``
   (unreferenced since after ``horizon - grace``: SPEC safety 2, for both paths; for a
   ``reaped`` record, grace runs from the later of its ``since`` and ``reaped_at``);
9. ``reaped`` (online: already deleted). Last on purpose: a record saying "deleted" is a
   claim, and no claim overrides a live reference, an unexpired upload or the grace window.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from schemas.layout import AddressState, TokenState
from schemas.records import AddressRecord

Path = Literal["online", "reconciler"]


class Keep(StrEnum):
    """Why an address is kept."""

    NOT_OWNER = "not_owner"
    FAIL_CLOSED = "fail_closed"
    PAUSED = "paused"
    HELD = "held"
    GONE = "gone"
    DOUBT = "doubt"
    STAGED = "staged"
    COMMITTED = "committed"
    CLAIMED = "claimed"
    REAPED = "reaped"
    ISSUED = "issued"
    NO_HORIZON = "no_horizon"
    YOUNG = "young"


# Reasons that say something about the queue entry being stale (the address will be queued
# again by the tracker if it becomes unreferenced): the claim script drops them from the queue.
STALE_IN_QUEUE = frozenset({Keep.GONE, Keep.STAGED, Keep.COMMITTED, Keep.REAPED, Keep.DOUBT})

_KNOWN_STATES = frozenset(s.value for s in AddressState)
_LIVE_TOKENS = frozenset({TokenState.OPEN.value, TokenState.SEALED.value})


@dataclass(frozen=True, slots=True)
class Guards:
    """What the delete paths read right before a request; each is a reason text or None."""

    not_owner: str | None = None
    fail_closed: str | None = None
    paused: str | None = None
    held: str | None = None


NO_GUARDS = Guards()


@dataclass(frozen=True, slots=True)
class Judgment:
    may_delete: bool
    reason: str  # a Keep value, "" when it may be deleted
    kind: str  # what the record is: staged, committed, issued, unreferenced, reaped, unknown,
    #            claimed, untracked
    detail: str = ""
    eligible_at_ms: int | None = None  # horizon time from which grace no longer keeps it

    @property
    def kept(self) -> bool:
        return not self.may_delete


def _keep(reason: Keep, kind: str, detail: str = "", eligible: int | None = None) -> Judgment:
    return Judgment(False, reason.value, kind, detail, eligible)


def judge(rec: AddressRecord | None, token_states: Mapping[str, str | None], *,
          now_ms: int, horizon_ms: int | None, grace_ms: int, path: Path = "online",
          cutoff_ms: int | None = None, claimed: bool = False,
          claimer: str | None = None, guards: Guards = NO_GUARDS) -> Judgment:
    """May ``rec`` be deleted now (see the module docstring for the rules).

    ``token_states``: token -> state text (``'open'``...; the ``:<ms>`` suffix is ignored),
    None or absent when the tracker has no state for it (unknown tokens keep).
    ``horizon_ms``: the tracker's proven progress (None: unknown). ``cutoff_ms``: an extra,
    earlier bound of the caller (the reconciler run's cutoff); with ``horizon_ms`` None on the
    reconciler path it is the only bound (callers that do not know the horizon yet).
    ``claimed``: the address is in the claims set (reconciler: someone else's delete in flight).
    ``claimer``: online, the reaper asking; its own live lease does not keep the address (it
    re-validates its claim right before the delete request).
    """
    for reason, text in ((Keep.NOT_OWNER, guards.not_owner),
                         (Keep.FAIL_CLOSED, guards.fail_closed),
                         (Keep.PAUSED, guards.paused), (Keep.HELD, guards.held)):
        if text:
            return _keep(reason, "guarded", text)
    online = path == "online"
    if rec is None:
        if online:
            return _keep(Keep.GONE, "untracked", "no tracker record")
        return Judgment(True, "", "untracked", "no tracker record: the listing decides")
    if rec.malformed:
        return _keep(Keep.DOUBT, "unknown", f"unreadable fields {', '.join(rec.malformed)}")
    if rec.doubt:
        return _keep(Keep.DOUBT, "staged", "a reference id was named with two tokens")

    committed_tokens = False
    unknown: str | None = None
    for ref, token in sorted(rec.unremoved().items()):
        raw = token_states.get(token)
        ts = None if raw is None else raw.split(":", 1)[0]
        if ts is None or ts in _LIVE_TOKENS:
            return _keep(Keep.STAGED, "staged",
                         f"reference {ref} in {ts or 'unknown'} token {token}")
        if ts == TokenState.COMMITTED:
            committed_tokens = True
        elif ts == TokenState.DOUBT and unknown is None:
            unknown = f"token {token} is contested (named by two branches)"
        elif ts != TokenState.DROPPED and unknown is None:
            unknown = f"token {token} has unknown state {ts!r}"
    if unknown is not None:
        return _keep(Keep.DOUBT, "staged", unknown)

    state = rec.state
    if rec.committed or committed_tokens or state == AddressState.COMMITTED:
        if online:
            return _keep(Keep.COMMITTED, "committed",
                         "a commit took it: only the reconciler may delete it, by retention")
        return Judgment(True, "", "committed", "retention decides")

    lease_live = rec.lease_until is not None and rec.lease_until > now_ms
    if online:
        ours = claimer is not None and rec.claimer == claimer
        if state == AddressState.REAPING and lease_live and not ours:
            return _keep(Keep.CLAIMED, "claimed", f"claimed by {rec.claimer}")
    elif claimed or state == AddressState.REAPING or lease_live:
        return _keep(Keep.CLAIMED, "claimed", f"claimed by {rec.claimer}")

    if state is not None and state not in _KNOWN_STATES:
        return _keep(Keep.DOUBT, "unknown", f"unknown state {state!r}")
    if state == AddressState.STAGED:
        return _keep(Keep.DOUBT, "staged", "state staged without a live reference")
    if state == AddressState.ISSUED and rec.issued_until is None:
        return _keep(Keep.DOUBT, "issued", "state issued without an expiry")
    # ``reaped`` is judged last (below): a record saying "deleted" never overrides a live
    # reference, an unexpired upload or the grace window, which are all checked before it.
    reaped = state == AddressState.REAPED
    if state is None and (online or (not rec.adds and rec.issued_until is None)):
        return _keep(Keep.DOUBT, "unknown", "no state")

    # Grace binds every path (SPEC safety 2): unreferenced for at least the grace window before
    # the tracker horizon. An issued upload is also bound by the caller's cutoff (the run's
    # margin against a skewed service clock); when the horizon is unknown the cutoff is the
    # only bound the reconciler has.
    grace_bound: int | None = None if horizon_ms is None else horizon_ms - grace_ms
    iu_bound = grace_bound
    if cutoff_ms is not None:
        iu_bound = cutoff_ms if iu_bound is None else min(iu_bound, cutoff_ms)
    bound = grace_bound if grace_bound is not None else cutoff_ms
    iu = rec.issued_until
    kind = ("reaped" if reaped else
            "issued" if iu is not None and not rec.adds else "unreferenced")
    if iu is not None and (iu > now_ms or (iu_bound is not None and iu > iu_bound)):
        return _keep(Keep.ISSUED, "issued", f"issued upload protected until {iu}",
                     iu + grace_ms)
    if online or horizon_ms is not None:
        if horizon_ms is None:
            return _keep(Keep.NO_HORIZON, kind, "no proven tracker progress")
        since = rec.since
        if reaped:  # grace from the delete or from any reference activity after it
            since = max((t for t in (rec.since, rec.reaped_at) if t is not None), default=None)
        if since is None:
            return _keep(Keep.DOUBT, kind, "unreferenced without a since")
        if bound is not None and since > bound:
            return _keep(Keep.YOUNG, kind, f"unreferenced since {since}, within grace",
                         since + grace_ms)
        if reaped:
            if online:
                return _keep(Keep.REAPED, "reaped", "already deleted by the reaper")
            return Judgment(True, "", "reaped", "the reaper deleted it", since + grace_ms)
        return Judgment(True, "", kind, "", since + grace_ms)
    if reaped and online:  # pragma: no cover - online always knows the horizon here
        return _keep(Keep.REAPED, "reaped", "already deleted by the reaper")
    return Judgment(True, "", kind, "the reaper deleted it" if reaped else "")


def tombstone_keeps(rec: AddressRecord, token_states: Mapping[str, str | None], *,
                    now_ms: int, tombstone_ms: int) -> bool:
    """Whether the reaper's prune must keep a ``reaped`` record older than ``tombstone_ms``
    (``reaper/claims.lua`` ``prune`` is this rule;
    ``tests/integration/reaper/test_reaped_authority.py``).

    Dropping the record makes the address untracked, which the reconciler leaves to its
    listing: so a record is dropped only when it protects nothing. It keeps while a reference
    is not removed (whatever its token, unless dropped), it is committed, an upload is still
    issued, or a reference was active within the tombstone time; a field that cannot be read
    keeps too."""
    if rec.malformed or rec.doubt:
        return True
    for token in rec.unremoved().values():
        raw = token_states.get(token)
        if raw is None or raw.split(":", 1)[0] != TokenState.DROPPED:
            return True
    if rec.committed:
        return True
    if rec.issued_until is not None and rec.issued_until > now_ms:
        return True
    return rec.since is not None and rec.since > now_ms - tombstone_ms
