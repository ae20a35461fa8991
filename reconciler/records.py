"""What the tracker's record of one address says, for the reconciler: a pure verdict.

The tracker keeps, per address, an observed-remove set of references (``+<ref>`` -> token,
``-<ref>`` -> token), a state, the sticky ``committed`` flag, ``iu`` (issued until, ms) and a
reaper's lease (see ``schemas/README.md``). :func:`verdict` turns one such hash into:

* ``live`` - must be kept whatever the listing says, with a ``reason``:
  ``staged`` (a live reference: added, never removed, its token open, sealed or unknown),
  ``issued`` (an upload address whose ``iu`` is after the run's cutoff), ``claimed`` (a reaper's
  claim in flight), ``doubt`` (the record is inconsistent or has a state we do not know:
  ambiguity keeps, SPEC safety 6);
* otherwise a ``kind`` for the report: ``committed`` (committed once; the job keeps it if a
  retained commit took it), ``reaped``, ``issued`` (expired, never linked) or ``unreferenced``;
* ``commit``: when known, the id of a commit that took the address (the flag's value, if it is a
  commit id, or the commit that sealed one of its committed tokens), so that the job can keep a
  committed address whose commit is retained even if a manifest misses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from schemas.layout import (
    F_COMMITTED,
    F_ISSUED_UNTIL,
    F_LEASE_UNTIL,
    F_SINCE,
    F_STATE,
    REF_ADD,
    REF_REMOVE,
    AddressState,
    TokenState,
)

_KNOWN_STATES = {s.value for s in AddressState}


@dataclass(frozen=True, slots=True)
class Verdict:
    live: bool
    kind: str
    reason: str
    commit: str | None = None


def token_state(raw: str | None) -> str | None:
    """``'<state>:<ms>'`` (or a bare state) -> state; None when unknown."""
    if not raw:
        return None
    return raw.split(":", 1)[0]


def _int(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(float(value))
    except ValueError:
        return None


def verdict(fields: Mapping[str, str], *, token_states: Mapping[str, str | None],
            cutoff_ms: int, now_ms: int, claimed: bool = False,
            token_commits: Mapping[str, str] | None = None,
            commit_ids: frozenset[str] | set[str] | None = None,
            grace_ms: int | None = None, horizon_ms: int | None = None) -> Verdict:
    """The reconciler's reading of one address hash (see the module docstring).

    ``token_states``: token -> state (``open``...), None/absent when the tracker has no state
    for it (kept: unknown tokens count as live). ``claimed``: the address is in the claims zset.
    ``token_commits``: token -> commit id that committed it (when the commit records say).
    ``commit_ids``: known commit ids (to tell whether the ``committed`` flag names a commit).
    ``grace_ms``/``horizon_ms`` (SPEC safety 2): an address whose last reference ended (or
    whose upload expired) less than the grace window before the tracker horizon is live
    (reason ``young``, or ``issued`` for an upload): a copy published inside the window is
    legal and may not be applied yet.
    """
    adds = {k[1:]: v for k, v in fields.items() if k.startswith(REF_ADD)}
    removes = {k[1:] for k in fields if k.startswith(REF_REMOVE)}
    state = fields.get(F_STATE)
    flag = fields.get(F_COMMITTED)
    commit: str | None = None
    if flag and commit_ids is not None and flag in commit_ids:
        commit = flag
    committed_tokens: list[str] = []
    for ref, token in adds.items():
        if ref in removes:
            continue
        ts = token_states.get(token)
        if ts is None or ts in (TokenState.OPEN, TokenState.SEALED):
            return Verdict(True, "staged", "staged", commit)
        if ts == TokenState.COMMITTED:
            committed_tokens.append(token)
        elif ts != TokenState.DROPPED:
            return Verdict(True, "staged", "doubt", commit)  # a token state we do not know
    if commit is None and token_commits:
        for token in committed_tokens:
            if token in token_commits:
                commit = token_commits[token]
                break
    lease_until = _int(fields.get(F_LEASE_UNTIL))
    if claimed or state == AddressState.REAPING or (lease_until is not None
                                                    and lease_until > now_ms):
        return Verdict(True, "claimed", "claimed", commit)
    issued_until = _int(fields.get(F_ISSUED_UNTIL))
    if issued_until is not None and issued_until > cutoff_ms:
        # An issued address is protected until its expiry; comparing with the cutoff (not
        # now) adds the cutoff's margin against a skewed service clock and a late sweep.
        return Verdict(True, "issued", "issued", commit)
    if state is not None and state not in _KNOWN_STATES:
        return Verdict(True, "unknown", "doubt", commit)
    if state == AddressState.STAGED:
        # The tracker says staged but no live reference is visible: doubt keeps.
        return Verdict(True, "staged", "doubt", commit)
    if state == AddressState.ISSUED and issued_until is None:
        return Verdict(True, "issued", "doubt", commit)
    if flag or committed_tokens or state == AddressState.COMMITTED:
        return Verdict(False, "committed", "", commit)
    if state == AddressState.REAPED:
        return Verdict(False, "reaped", "", commit)
    if issued_until is not None and not adds:
        if _in_grace(issued_until, grace_ms, horizon_ms):
            return Verdict(True, "issued", "issued", commit)
        return Verdict(False, "issued", "", commit)
    if state is None and not adds:
        # No state and no reference: a record we cannot read. Doubt keeps.
        return Verdict(True, "unknown", "doubt", commit)
    if grace_ms is not None:
        since = _int(fields.get(F_SINCE))
        ended = max(x for x in (since, issued_until, 0) if x is not None)
        if since is None or _in_grace(ended, grace_ms, horizon_ms):
            # no `since`: when the last reference ended is unknown, doubt keeps
            return Verdict(True, "unreferenced", "young", commit)
    return Verdict(False, "unreferenced", "", commit)


def _in_grace(ended_ms: int, grace_ms: int | None, horizon_ms: int | None) -> bool:
    """Whether ``ended_ms`` is less than the grace window before the tracker horizon."""
    if grace_ms is None:
        return False
    if horizon_ms is None:
        return True  # no known horizon: nothing is proven past its grace
    return ended_ms + grace_ms > horizon_ms
