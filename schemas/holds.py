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
- ``operator``: ``hardelete hold add``; ``hardelete hold remove`` removes it (only it).
- ``restore``: ``hardelete restore``; ``hardelete hold remove --restore`` removes it (only it):
  letting a restored object go never lifts a legal hold placed on it since, nor the reverse.
  Restore places it only while no reaper claims the address (:func:`restore_claim`, one script
  with the check), so a restore and a reaper's delete of one address exclude each other.
- ``legacy``: a value written before holds had claims; only ``--force`` lifts it (nobody can
  tell whose it was).

The hold is lifted when its last claim goes. Claims are changed by one script (``holds.lua``),
so a claim added while another is removed is never lost. This module is the pure specification
(:func:`add`, :func:`remove`) and the adapters that run the script.

**Where a hold is stored.** Every delete path compares the canonical address it is about to
delete (``schemas/address.py``) with the exact fields of ``holds`` and with the fields of
``hold_prefixes`` as prefixes. So an operator's target is stored only in canonical form, and
in every form it may take (:func:`resolve_target`): the same rule the tracker's dead-letter
holds follow (``tracker.codec.hold_targets``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import orjson

from schemas.address import address_forms, canonical_uri, has_scheme, spelling
from schemas.layout import RESERVED_PREFIXES, OutsideNamespace, RepoKeys, namespace_key
from schemas.namespaces import overlaps

OPERATOR, RESTORE, DLQ = "operator", "restore", "dlq"  # sources
OPERATOR_CLAIM, RESTORE_CLAIM, LEGACY_CLAIM = "operator", "restore", "legacy"
# The one claim `hardelete hold remove` lifts without --force for each party that lets go by
# hand: each party only its own (two parties on one address are two reasons to keep it). The
# other claims name a dead letter, which `hardelete dlq resolve` answers for, or nobody.
RELEASABLE = {OPERATOR: OPERATOR_CLAIM, RESTORE: RESTORE_CLAIM}

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


@dataclass(frozen=True)
class RestoreClaim:
    """What ``hardelete restore``'s claim script did (``holds.lua`` op ``restore``)."""

    status: str  # "held": restore's claim is on the address; "claimed": a reaper claims it
    added: bool  # restore's claim was not there before
    state: str  # the address record's state ('' : no record, or no state)
    lease_until: int | None = None  # "claimed": the reaper's lease (ms, Redis clock)
    claimer: str = ""


def _ms(text: str | None) -> int | None:
    try:
        return int(text) if text else None
    except ValueError:
        return None


def reaper_claims(state: str | None, in_claims: bool) -> bool:
    """Whether a reaper's claim is on an address (pure): it is in the claims set, or its record
    says ``reaping``. Whatever its lease: a reaper whose lease ran out may still have its
    delete request in flight, and only its next pass (or another reaper's) settles it."""
    return in_claims or state == "reaping"


def restore_claim(raw: str | bytes | None, claim: Mapping[str, Any], *, state: str | None,
                  in_claims: bool, lease_until: str | None = None, claimer: str | None = None
                  ) -> tuple[RestoreClaim, dict[str, Any] | None]:
    """(what happened, the hold's value after: None when nothing is written) when restore
    claims an address whose hold is ``raw`` and whose record has ``state`` (and is in the
    reaper's claims set when ``in_claims``). Pure: ``holds.lua`` op ``restore`` does this in
    one step, so no reaper claims the address between the check and the claim (the claim
    script keeps a held address), and a claimed address is never restored under a delete in
    flight."""
    if reaper_claims(state, in_claims):
        return (RestoreClaim("claimed", False, state or "", _ms(lease_until), claimer or ""),
                None)
    added = RESTORE_CLAIM not in claims_of(raw)
    return (RestoreClaim("held", added, state or ""),
            add(raw, RESTORE_CLAIM, claim, replace=True))


# --- what an operator's target names --------------------------------------------------------------

class TargetError(ValueError):
    """A hold target that names nothing a delete path may take (one line for the operator)."""


@dataclass(frozen=True, slots=True)
class Target:
    """One hold as it is stored and as every delete path compares it: ``key`` in the ``holds``
    hash of ``repository`` (an address), or in its ``hold_prefixes`` hash when ``prefix``
    (everything whose canonical address starts with ``key``). ``namespace``: the repository's
    canonical namespace."""

    repository: str
    namespace: str
    key: str
    prefix: bool


def resolve_target(registry: Mapping[str, str], raw: str, *, prefix: bool = False,
                   repo: str | None = None) -> tuple[Target, ...]:
    """Every hold that keeps what an operator's spelling ``raw`` may name. Pure.

    ``registry``: canonical namespace -> repository (``hd:namespaces``: live repositories and
    retired ones whose data is still kept). The delete paths compare canonical addresses, so
    each target is returned in canonical form, and a spelling that may name several objects
    is returned in every form, each in the repository whose namespace holds it (doubt keeps,
    as the tracker's dead-letter holds do):

    - an **address** means in each namespace what :func:`schemas.address.spelling` says it
      may mean there: any case of ``s3://``/``s3a://``/``s3n://`` and of the bucket, a
      ``%XX`` escape both literally and decoded; plain keys only (no delete path takes any
      other key);
    - a **prefix** (``prefix``, a spelling ending in ``/``, or a form that ends in ``/``: a
      prefix hold keeps the object of that key too) is held in every repository whose
      namespace it lies in or contains;
    - a key **relative** to a namespace (no scheme) needs ``repo``, whose namespace it is in.

    For an absolute spelling, ``repo`` only checks that the repository owns one of the objects
    named; the others' are held all the same. Raises :class:`TargetError` (one line) when the
    spelling names nothing a delete path may take."""
    if not isinstance(raw, str) or not raw.strip():
        raise TargetError("no target: give an s3:// address or prefix")
    prefix = prefix or raw.endswith("/")
    absolute = has_scheme(raw)
    if absolute:
        spaces = sorted(registry.items())
    elif "://" in raw or raw.startswith("/"):
        raise TargetError(f"{raw!r} is not an s3:// URI (s3://, s3a://, s3n://) nor a key "
                          "relative to a namespace")
    elif repo is None:
        raise TargetError(f"{raw!r} is not an s3:// URI: a key relative to a repository's "
                          "namespace needs --repo")
    else:
        spaces = [(ns, owner) for ns, owner in sorted(registry.items()) if owner == repo]
        if not spaces:
            raise TargetError(f"unknown repository {repo!r} (no namespace of it is registered)")
    out: dict[tuple[str, str, bool], Target] = {}
    refused: list[str] = []
    for ns, owner in spaces:
        if prefix:
            forms = [(form, True) for form in _prefix_forms(ns, raw)]
        else:
            forms = [(form, form.endswith("/")) for form in spelling(ns, raw).meant]
            if not forms:
                refused += _address_refusals(ns, raw)
        for form, is_prefix in forms:
            why = _prefix_refusal(ns, form) if is_prefix else None
            if why is not None:
                refused.append(why)
                continue
            out.setdefault((owner, form, is_prefix), Target(owner, ns, form, is_prefix))
    targets = tuple(out.values())
    if repo is not None and absolute and not any(t.repository == repo for t in targets):
        owners = sorted({t.repository for t in targets})
        mine = [ns for ns, owner in sorted(registry.items()) if owner == repo]
        raise TargetError(f"{raw} is not inside the namespace of repository {repo!r}"
                          + (f" ({mine[0]})" if mine else " (unknown repository)")
                          + (f": repository {owners[0]!r} owns it" if owners else ""))
    if not targets:
        if refused:
            raise TargetError(f"{raw} names nothing a delete path may take: {refused[0]}")
        raise TargetError(f"{raw} is inside no tracked repository's namespace (hardelete never "
                          "deletes it)")
    return targets


def _address_refusals(namespace: str, raw: str) -> list[str]:
    """Why the forms of ``raw`` that lie in ``namespace`` are no deletable keys (for the
    operator's one line)."""
    try:
        forms = address_forms(namespace, raw)
    except (OutsideNamespace, UnicodeDecodeError):
        return []
    out = []
    for form in forms:
        try:
            namespace_key(namespace, form)
        except OutsideNamespace as exc:
            out.append(str(exc))
    return out


def _prefix_forms(namespace: str, raw: str) -> list[str]:
    """The canonical prefixes ``raw`` may spell (literally, and ``%XX`` decoded) that lie in
    ``namespace`` or contain it; a relative one is relative to ``namespace``."""
    texts = [raw]
    if "%" in raw:
        with suppress(UnicodeDecodeError):
            texts.append(unquote(raw, errors="strict"))
    out: list[str] = []
    for text in texts:
        if has_scheme(text):
            try:
                form = canonical_uri(text)
            except OutsideNamespace:
                continue
        elif "://" in text or text.startswith("/"):
            continue
        else:
            form = namespace + text
        if form not in out and overlaps(form, namespace):
            out.append(form)
    return out


def _prefix_refusal(namespace: str, form: str) -> str | None:
    """Why a prefix inside ``namespace`` covers no key a delete path takes, or None."""
    if not form.startswith(namespace):
        return None  # it contains the namespace: every key of it
    rel = form[len(namespace):]
    if any(seg in ("", ".", "..") for seg in rel.split("/")[:-1]):  # (the last may be partial)
        return f"{form!r} is not a plain object key prefix under {namespace!r}"
    if rel.startswith(RESERVED_PREFIXES):
        return (f"{form!r} is under a reserved metadata prefix, which no delete path compares "
                "(a quarantined copy is kept by a hold on its address)")
    return None


def related(target: Target, key: str, prefix: bool) -> bool:
    """Whether the stored hold ``key`` (a prefix hold when ``prefix``) of ``target``'s
    repository is on what ``target`` names: the same hold, a prefix hold that keeps it, or a
    hold under the prefix ``target`` names. Pure (``hardelete hold list TARGET``)."""
    return ((key == target.key and prefix == target.prefix)
            or (prefix and target.key.startswith(key))
            or (target.prefix and key.startswith(target.key)))


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


def _restore_claim(res: list[Any]) -> RestoreClaim:
    status, added, state, lease, claimer = (x.decode() if isinstance(x, bytes) else str(x)
                                            for x in res)
    return RestoreClaim(status, added == "1", state, _ms(lease), claimer)


def _restore_keys(repo: str, address: str) -> list[str]:
    k = RepoKeys(repo)  # (one slot: the repository's hash tag)
    return [k.holds, k.claims, k.address(address)]


def _restore_args(address: str, claim: Mapping[str, Any]) -> list[str]:
    return ["restore", address, RESTORE_CLAIM, orjson.dumps(dict(claim)).decode()]


def place_restore_claim(r: Any, repo: str, address: str,
                        claim: Mapping[str, Any]) -> RestoreClaim:
    """Restore's claim on ``address`` unless a reaper claims it (:func:`restore_claim`; sync)."""
    return _restore_claim(r.eval(SCRIPT, 3, *_restore_keys(repo, address),
                                 *_restore_args(address, claim)))


async def aplace_restore_claim(r: Any, repo: str, address: str,
                               claim: Mapping[str, Any]) -> RestoreClaim:
    return _restore_claim(await r.eval(SCRIPT, 3, *_restore_keys(repo, address),
                                       *_restore_args(address, claim)))


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
