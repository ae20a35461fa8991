"""The one codec of the tracker's Redis records (layout: ``schemas/layout.py``).

Every reader outside Lua (``tracker.state``, the reaper, the reconciler, ``status``/``explain``,
the tests) decodes through here, so a field means the same thing everywhere:

* the address hash ``hd:{R}:a:<address>`` (:func:`decode_address` / :func:`encode_address`):
  ``+<ref>`` -> token (added), ``-<ref>`` -> token (removed), ``state``, ``since``,
  ``committed``, ``doubt``, ``iu``, ``size``, ``lease_until``, ``claimer``, ``reaped_at``;
* a token value ``'<state>:<ms>'`` (:func:`decode_token`, :func:`token_state`,
  :func:`encode_token`);
* branch and commit JSON (:func:`decode_branch`, :func:`decode_commit`, and their encoders);
* the repository metadata hash ``hd:{R}:meta`` (:func:`decode_meta`).

Decoding an address never raises: what cannot be read is kept as text and named in
``AddressRecord.malformed``, and the liveness judgment (``schemas/liveness.py``) keeps such an
address (SPEC safety 6: every doubt keeps the object).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from schemas.layout import (
    F_CLAIMER,
    F_COMMITTED,
    F_DOUBT,
    F_ISSUED_UNTIL,
    F_LEASE_UNTIL,
    F_REAPED_AT,
    F_SINCE,
    F_SIZE,
    F_STATE,
    REF_ADD,
    REF_REMOVE,
    TokenState,
)

_INT_FIELDS = (F_SINCE, F_ISSUED_UNTIL, F_SIZE, F_LEASE_UNTIL, F_REAPED_AT)


class RecordError(ValueError):
    """A record that cannot be decoded (names the record and what is wrong)."""


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


_NUMBER = re.compile(r"-?[0-9]+\.?[0-9]*")  # the grammar claims.lua accepts, exactly


def _int_or_none(value: str | None) -> int | None:
    """Integer ms (or bytes); raises ValueError on anything else (an empty value, ``inf``,
    ``1e3``, ``0x10``, spaces: the same grammar as ``claims.lua``'s reader). ``'1.0'`` is
    accepted (Lua writes integers, older writers floats)."""
    if value is None:
        return None
    if not _NUMBER.fullmatch(value):
        raise ValueError(value)
    return int(float(value))


@dataclass
class AddressRecord:
    """One address record (``RepoKeys.address``): the one shape for the codec, the pure
    machine (which updates it in place), the liveness judgment and every reader.

    ``state`` is an :class:`AddressState` where the machine or the tracker's reader set it, and
    the raw text as decoded (possibly a state this version does not know: the judgment keeps
    it). ``committed_value`` is the raw flag (``'1'`` or a commit id) and ``malformed`` the
    fields that could not be decoded; neither takes part in equality (the machine writes
    neither)."""

    adds: dict[str, str] = field(default_factory=dict)  # ref -> token
    removes: dict[str, str] = field(default_factory=dict)  # ref -> token
    state: str | None = None
    since: int | None = None  # ms: unreferenced since (issued: when protection ends)
    committed: bool = False
    committed_value: str | None = field(default=None, compare=False)
    issued_until: int | None = None
    size: int | None = None
    # Owned by the reaper (never written by the tracker).
    lease_until: int | None = None
    claimer: str | None = None
    reaped_at: int | None = None
    malformed: tuple[str, ...] = field(default=(), compare=False)  # fields not decoded
    # Sticky: a reference id was named with two tokens (schemas/README.md): kept for good.
    doubt: bool = False

    def unremoved(self) -> dict[str, str]:
        """References added and not ended: ref -> token. Only a removal naming the add's own
        token ends a reference (one naming another is a contradiction, which keeps)."""
        return {ref: tok for ref, tok in self.adds.items() if self.removes.get(ref) != tok}


def decode_address(h: Mapping[Any, Any]) -> AddressRecord:
    """Decode an address hash (str or bytes fields); never raises."""
    adds: dict[str, str] = {}
    removes: dict[str, str] = {}
    plain: dict[str, str] = {}
    for k, v in h.items():
        f, val = _text(k), _text(v)
        if f.startswith(REF_ADD):
            adds[f[1:]] = val
        elif f.startswith(REF_REMOVE):
            removes[f[1:]] = val
        else:
            plain[f] = val
    ints: dict[str, int | None] = {}
    bad: list[str] = []
    for name in _INT_FIELDS:
        try:
            ints[name] = _int_or_none(plain.get(name))
        except ValueError:
            ints[name] = None
            bad.append(name)
    flag = plain.get(F_COMMITTED)
    return AddressRecord(
        adds=adds, removes=removes, state=plain.get(F_STATE) or None,
        since=ints[F_SINCE], committed=bool(flag) and flag != "0", committed_value=flag,
        issued_until=ints[F_ISSUED_UNTIL], size=ints[F_SIZE], lease_until=ints[F_LEASE_UNTIL],
        claimer=plain.get(F_CLAIMER), reaped_at=ints[F_REAPED_AT], malformed=tuple(bad),
        doubt=plain.get(F_DOUBT, "0") not in ("", "0"))


def encode_address(rec: AddressRecord) -> dict[str, str]:
    """The hash fields of a decoded address (tests, tools; the tracker writes in Lua)."""
    out: dict[str, str] = {}
    for ref, tok in rec.adds.items():
        out[REF_ADD + ref] = tok
    for ref, tok in rec.removes.items():
        out[REF_REMOVE + ref] = tok
    if rec.state is not None:
        out[F_STATE] = rec.state
    if rec.committed:
        out[F_COMMITTED] = rec.committed_value or "1"
    if rec.doubt:
        out[F_DOUBT] = "1"
    for name, value in ((F_SINCE, rec.since), (F_ISSUED_UNTIL, rec.issued_until),
                        (F_SIZE, rec.size), (F_LEASE_UNTIL, rec.lease_until),
                        (F_REAPED_AT, rec.reaped_at)):
        if value is not None:
            out[name] = str(value)
    if rec.claimer is not None:
        out[F_CLAIMER] = rec.claimer
    return out


# --- tokens ------------------------------------------------------------------------------------

def token_state(raw: Any) -> str | None:
    """``'<state>:<ms>'`` (or a bare state) -> the state text; None when absent."""
    if raw is None or raw == "" or raw == b"":
        return None
    return _text(raw).split(":", 1)[0]


def decode_token(raw: Any) -> tuple[TokenState, int]:
    """``'<state>:<ms>'`` -> (state, ms); raises :class:`RecordError` on anything else."""
    text = _text(raw)
    state, _, ms = text.partition(":")
    try:
        return TokenState(state), int(ms)
    except ValueError:
        raise RecordError(f"token value {text!r} is not '<state>:<ms>'") from None


def encode_token(state: TokenState | str, ms: int) -> str:
    return f"{TokenState(state).value}:{int(ms)}"


# --- branches and commits ----------------------------------------------------------------------

@dataclass(frozen=True)
class BranchRecord:
    """A branch as the mirror records it (``RepoKeys.branches``; the one shape for every
    reader and the pure machine)."""

    head: str | None
    staging_token: str
    sealed_tokens: tuple[str, ...] = ()


@dataclass(frozen=True)
class CommitRecord:
    """A commit as the mirror records it (``RepoKeys.commits``; ``time`` in epoch seconds as
    the event gave it, ``branch`` and ``manifest`` empty when unknown). Its id is the key it is
    stored under. The one commit shape: the mirror, the rebuild's export and the pure
    retention computation (``parents[0]``, if any, is the main ancestry) all use it."""

    parents: tuple[str, ...]
    time: float
    branch: str = ""
    manifest: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.parents, tuple):
            object.__setattr__(self, "parents", tuple(self.parents))
        if math.isnan(self.time):
            raise RecordError(f"commit with parents {self.parents!r}: time is NaN")


def _json_object(what: str, raw: Any) -> dict[str, Any]:
    try:
        d = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise RecordError(f"{what} is not JSON") from None
    if not isinstance(d, dict):
        raise RecordError(f"{what} is not an object")
    return d


def decode_branch(raw: Any, name: str = "?") -> BranchRecord:
    d = _json_object(f"branch {name!r}: record", raw)
    try:
        head = d.get("head")
        return BranchRecord(None if head is None else str(head), str(d["staging_token"]),
                            tuple(str(t) for t in d.get("sealed_tokens") or ()))
    except (KeyError, TypeError):
        raise RecordError(f"branch {name!r}: missing staging_token") from None


def encode_branch(b: BranchRecord) -> str:
    return orjson.dumps({"head": b.head, "staging_token": b.staging_token,
                         "sealed_tokens": list(b.sealed_tokens)}).decode()


def decode_commit(raw: Any, name: str = "?") -> CommitRecord:
    d = _json_object(f"commit {name!r}: record", raw)
    try:
        return CommitRecord(tuple(str(p) for p in d.get("parents") or ()), float(d["time"]),
                            str(d.get("branch") or ""), str(d.get("manifest") or ""))
    except (KeyError, TypeError, ValueError):
        raise RecordError(f"commit {name!r}: bad or missing time") from None


def encode_commit(c: CommitRecord) -> str:
    return orjson.dumps({"parents": list(c.parents), "time": c.time, "branch": c.branch,
                         "manifest": c.manifest}).decode()


# --- repository metadata -----------------------------------------------------------------------

@dataclass(frozen=True)
class RepoMeta:
    """A repository's metadata (``RepoKeys.meta``, written by its ``repository_created``).

    ``default_retention_days`` None: no retention configured (the reconciler keeps every
    commit: doubt keeps). ``expire_older_than_days`` is set by an operator, never by an event.
    """

    namespace: str
    default_branch: str = ""
    default_retention_days: float | None = None
    branch_retention_days: Mapping[str, float] = field(default_factory=dict)
    expire_older_than_days: float | None = None


def _days(repo: str, what: str, value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise RecordError(f"repository {repo!r}: {what} is not a number: {value!r}") from None
    if math.isnan(out):
        raise RecordError(f"repository {repo!r}: {what} is NaN")
    # Days are never negative (the CLI refuses --expire-older-than-days <= 0 and the retention
    # policy negative days): an expiration threshold in the future is a typo, not a policy.
    if out < 0:
        raise RecordError(f"repository {repo!r}: {what} is negative: {value!r}")
    return out


def decode_meta(fields: Mapping[str, str] | None, repo: str = "?") -> RepoMeta | None:
    """The metadata hash as a record; None when it names no namespace (a repository the
    tracker has not seen). Older spellings (``storage_namespace``, ``branch_retention_days``)
    are read too; a garbled number or retention map raises :class:`RecordError` naming it."""
    fields = fields or {}
    ns = fields.get("namespace") or fields.get("storage_namespace")
    if not ns:
        return None
    raw_default = fields.get("default_retention_days")
    default = None if raw_default in (None, "") else _days(repo, "default_retention_days",
                                                           raw_default)
    branch: dict[str, float] = {}
    raw_branch = fields.get("branch_retention") or fields.get("branch_retention_days")
    if raw_branch:
        parsed = _json_object(f"repository {repo!r}: branch_retention", raw_branch)
        branch = {str(b): _days(repo, f"branch_retention.{b}", d) for b, d in parsed.items()}
    raw_expire = fields.get("expire_older_than_days")
    expire = None if raw_expire in (None, "") else _days(repo, "expire_older_than_days",
                                                         raw_expire)
    if expire == 0:  # every branch and tag head would count as expired (issue 33)
        raise RecordError(f"repository {repo!r}: expire_older_than_days is 0: it must be > 0 "
                          "(0 would count every branch and tag head as expired)")
    return RepoMeta(str(ns), str(fields.get("default_branch") or ""), default, branch, expire)
