"""Holds as claims: who keeps an address (or a prefix) from every delete path, and who may let go.

A hold is the field of a repository's ``holds`` hash (address -> json) or ``hold_prefixes``
hash (s3:// prefix -> json). The field exists while at least one party **claims** it; the delete
paths only ask whether it exists (reaper/claims.lua, core/gate.py, the quarantine purge).
Its value (see ``holds.lua``)::

    {"claims": {<claim id>: {"source", "reason", "at_ms", ...detail}},
     "reason", "source", "at_ms"}            <- the oldest claim, for one-line readers

Claim ids, one per party:

- ``dlq:<topic>:<partition>:<offset>:<log>:<digest>``: a dead-lettered event (where it was in
  the events topic, which log, which record). The tracker adds it on every address the event
  names (or the namespace prefix when what it names cannot be read); ``hardelete dlq
  resolve`` removes exactly that claim, so the hold stays while another dead letter still
  claims the address.
- ``operator``: ``hardelete hold add``; ``hardelete hold remove`` removes it.
- ``restore``: ``hardelete restore``; ``hardelete hold remove`` removes it too.
- ``legacy``: a value written before holds had claims; only ``--force`` lifts it (nobody can
  tell whose it was).

The hold is lifted when its last claim goes. Claims are changed by one script (``holds.lua``),
so a claim added while another is removed is never lost. This module is the pure specification
(:func:`add`, :func:`remove`) and the adapters that run the script.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

OPERATOR, RESTORE, DLQ = "operator", "restore", "dlq"  # sources
OPERATOR_CLAIM, RESTORE_CLAIM, LEGACY_CLAIM = "operator", "restore", "legacy"
# Claims `hardelete hold remove` may remove without --force (the others name a dead letter that
# `hardelete dlq resolve` answers for, or nobody).
OPERATOR_CLAIMS = (OPERATOR_CLAIM, RESTORE_CLAIM)

SCRIPT = (Path(__file__).with_name("holds.lua")).read_text()


def dlq_claim(topic: str, partition: int, offset: int, log: str = "",
              key: bytes | None = None, value: bytes | None = None) -> str:
    """The claim id of the dead letter of record ``topic``/``partition``@``offset``: with the
    partition's log identity and a digest of the record, because a topic re-created (or a log
    lost) reuses offsets while the dead-letter topic keeps the old log's dead letters, and
    resolving one of those must not lift a hold a new record at the same offset placed. The
    tracker writes the id it used in the dead letter's ``claim`` header."""
    base = f"{DLQ}:{topic}:{partition}:{offset}"
    if not log and key is None and value is None:
        return base  # (the form before log identities: what old dead letters name)
    digest = hashlib.sha256((key or b"") + b"\0" + (value or b"")).hexdigest()[:16]
    return f"{base}:{log or '-'}:{digest}"


# --- the specification (holds.lua does exactly this) --------------------------------------------

def claims_of(raw: str | bytes | None) -> dict[str, dict[str, Any]]:
    """The claims of a stored value: a value without claims is one ``legacy`` claim."""
    if raw is None:
        return {}
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        return {LEGACY_CLAIM: {"reason": text, "source": "?"}}
    if isinstance(value, dict) and isinstance(value.get("claims"), dict):
        return dict(value["claims"])
    if isinstance(value, dict):
        return {LEGACY_CLAIM: value}
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    return {LEGACY_CLAIM: {"reason": text, "source": "?"}}


def _at(claim: Any) -> float:
    at = claim.get("at_ms") if isinstance(claim, dict) else None
    return float(at) if isinstance(at, int | float) and not isinstance(at, bool) else 0.0


def _text(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def summary(claims: Mapping[str, Any]) -> dict[str, Any] | None:
    """The stored value of a hold with these claims (None: no claim, no hold)."""
    if not claims:
        return None
    first_id = min(claims, key=lambda i: (_at(claims[i]), i))
    first = claims[first_id] if isinstance(claims[first_id], dict) else {}
    reason = _text(first.get("reason")) or first_id
    if len(claims) > 1:
        reason += f" (+{len(claims) - 1} more)"
    return {"claims": dict(claims), "reason": reason, "source": _text(first.get("source")) or "?",
            "at_ms": first.get("at_ms")}


def add(raw: str | bytes | None, claim_id: str, claim: Mapping[str, Any],
        replace: bool = False) -> dict[str, Any]:
    """The value after ``claim_id`` claims the hold."""
    claims = claims_of(raw)
    if claim_id not in claims or replace:
        claims[claim_id] = dict(claim)
    out = summary(claims)
    assert out is not None
    return out


@dataclass(frozen=True)
class Removal:
    status: str  # "none" (no hold), "lifted" (no claim left), "kept" (others still claim it)
    removed: tuple[str, ...]
    remaining: tuple[str, ...]


def remove(raw: str | bytes | None, claim_ids: Iterable[str],
           force: bool = False) -> tuple[Removal, dict[str, Any] | None]:
    """(what happened, the value after: None when the hold is gone) when ``claim_ids`` let go.
    ``legacy`` is only removed by ``force``, which removes every claim."""
    if raw is None:
        return Removal("none", (), ()), None
    claims = claims_of(raw)
    if force:
        removed = sorted(claims)
        claims = {}
    else:
        removed = sorted({i for i in claim_ids if i != LEGACY_CLAIM and i in claims})
        for i in removed:
            del claims[i]
    value = summary(claims)
    status = "lifted" if value is None else "kept"
    return Removal(status, tuple(removed), tuple(sorted(claims))), value


# --- adapters ------------------------------------------------------------------------------------

def _add_args(items: Iterable[tuple[str, str, Mapping[str, Any]]], replace: bool) -> list[Any]:
    args: list[Any] = ["add", "1" if replace else "0"]
    for target, claim_id, claim in items:
        args += [target, claim_id, orjson.dumps(dict(claim)).decode()]
    return args


def _removal(res: list[Any]) -> Removal:
    status, removed, remaining = (x.decode() if isinstance(x, bytes) else str(x) for x in res)
    return Removal(status, tuple(orjson.loads(removed)), tuple(orjson.loads(remaining)))


def _remove_args(target: str, claim_ids: Iterable[str], force: bool) -> list[Any]:
    return ["remove", target, "1" if force else "0", *claim_ids]


def add_claims(r: Any, key: str, items: Iterable[tuple[str, str, Mapping[str, Any]]],
               replace: bool = False) -> int:
    """Add claims (target, claim id, claim) to the holds hash ``key``; claims added (sync)."""
    args = _add_args(items, replace)
    if len(args) == 2:
        return 0
    return int(r.eval(SCRIPT, 1, key, *args))


def remove_claims(r: Any, key: str, target: str, claim_ids: Iterable[str],
                  force: bool = False) -> Removal:
    """Remove claims of the hold on ``target`` in hash ``key`` (sync)."""
    return _removal(r.eval(SCRIPT, 1, key, *_remove_args(target, claim_ids, force)))


async def aadd_claims(r: Any, key: str, items: Iterable[tuple[str, str, Mapping[str, Any]]],
                      replace: bool = False) -> int:
    args = _add_args(items, replace)
    if len(args) == 2:
        return 0
    return int(await r.eval(SCRIPT, 1, key, *args))


async def aremove_claims(r: Any, key: str, target: str, claim_ids: Iterable[str],
                         force: bool = False) -> Removal:
    return _removal(await r.eval(SCRIPT, 1, key, *_remove_args(target, claim_ids, force)))
