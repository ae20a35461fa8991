"""What the tracker's record of one address says, for the reconciler: a pure verdict.

The tracker keeps, per address, an observed-remove set of references (``+<ref>`` -> token,
``-<ref>`` -> token), a state, the sticky ``committed`` flag, ``iu`` (issued until, ms) and a
reaper's lease (see ``schemas/README.md``). :func:`verdict` turns one such hash into:

* ``live`` - must be kept whatever the listing says, with a ``reason``:
  ``staged`` (a live reference: added, never removed, its token open, sealed or unknown),
  ``issued`` (an upload address whose ``iu`` is after the run's cutoff), ``claimed`` (a reaper's
  claim in flight), ``doubt`` (the record is inconsistent or has a state we do not know:
  ambiguity keeps, SPEC safety 6), ``young`` (unreferenced less than the grace window before
  the tracker horizon, when the caller gives the horizon), ``held``;
* otherwise a ``kind`` for the report: ``committed`` (committed once; the job keeps it only
  when a retained commit's manifest lists it), ``reaped``, ``issued`` (expired, never linked)
  or ``unreferenced``;
* ``commit``: the ``committed`` flag's value when it names a known commit, else None. It is
  written to the tracker export (column ``commit``) for the report and protects nothing: the
  retained commits' manifests alone say what is committed (reconciler/committed.py), and an
  address a manifest misses is not kept for its record's commit (the manifest is the
  service's truth).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from schemas.liveness import Guards, judge
from schemas.records import decode_address
from schemas.records import token_state as token_state  # re-exported: the one token codec


@dataclass(frozen=True, slots=True)
class Verdict:
    live: bool
    kind: str
    reason: str
    commit: str | None = None


def verdict(fields: Mapping[str, str], *, token_states: Mapping[str, str | None],
            cutoff_ms: int, now_ms: int, claimed: bool = False,
            commit_ids: frozenset[str] | set[str] | None = None,
            horizon_ms: int | None = None, grace_ms: int = 0,
            held: str | None = None) -> Verdict:
    """The reconciler's reading of one address hash (see the module docstring): a thin
    wrapper over the one judgment, ``schemas.liveness.judge`` (path ``reconciler``).

    ``token_states``: token -> state (``open``...), None/absent when the tracker has no state
    for it (kept: unknown tokens count as live). ``claimed``: the address is in the claims zset.
    ``commit_ids``: known commit ids (to tell whether the ``committed`` flag names a commit).
    ``horizon_ms``/``grace_ms``: the tracker's proven progress and the repository's grace;
    given, an address unreferenced less than ``grace`` before the horizon is kept (``young``,
    SPEC safety 2); None keeps the old reading (only ``cutoff_ms`` bounds an issued upload).
    ``held``: the reason of a hold on the address (kept).
    """
    rec = decode_address(fields)
    flag = rec.committed_value
    commit: str | None = None
    if flag and commit_ids is not None and flag in commit_ids:
        commit = flag
    j = judge(rec, token_states, now_ms=now_ms, horizon_ms=horizon_ms, grace_ms=grace_ms,
              path="reconciler", cutoff_ms=cutoff_ms, claimed=claimed,
              guards=Guards(held=held))
    if j.may_delete:
        return Verdict(False, j.kind, "", commit)
    return Verdict(True, j.kind, j.reason, commit)
