"""The guards and the evidence every delete path re-reads right before its request.

The requests themselves are the one deleter's (``core.deleter``): it runs a caller's
recheck, built from what this module reads, right before every request.

:class:`Gate` is what a recheck reads from Redis right before the request (SPEC safety 3, 8,
and the holds of issue 8): the namespace registry ``hd:namespaces``, the global and the
repository's fail-closed flags, the repository's pause, and the holds on the addresses asked.
:meth:`Gate.guards` turns it into the judgment's :class:`schemas.liveness.Guards`.

An **empty registry** is the legacy mode: no repository has been registered yet (a tracker that
predates the registry), so only the namespace check applies (the address must be a plain key of
the repository's own namespace, outside the reserved prefixes). As soon as the registry has any
entry it is authoritative: a namespace not registered to the repository (retired, unknown) or an
address inside another live repository's namespace is refused.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path as FilePath
from typing import Any

import orjson

from core.clock import aredis_time_ms, redis_time_ms
from core.continuity_store import compose
from core.facts import NOT_PROVEN, FactsProof
from core.guards import fail_closed_text
from schemas.address import canonical_namespace
from schemas.layout import (
    APPLIED,
    FAIL_CLOSED,
    NAMESPACES,
    OutsideNamespace,
    RepoKeys,
    namespace_key,
)
from schemas.liveness import Guards, Keep, Path, judge
from schemas.namespaces import ownership_problem
from schemas.records import AddressRecord, decode_address

# --- the guards ----------------------------------------------------------------------------------

def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _reason(raw: Any, default: str) -> str:
    """A hold/pause/fail-closed value (json with a reason, or text) -> a short reason."""
    import orjson

    if raw is None:
        return default
    text = _text(raw)
    try:
        d = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text or default
    if isinstance(d, dict) and d.get("reason"):
        return str(d["reason"])
    return text or default


@dataclass(frozen=True)
class Gate:
    """What the delete paths read right before a request (see the module docstring)."""

    registry: Mapping[str, str] = field(default_factory=dict)  # namespace -> repository
    global_fail_closed: str | None = None
    repo_fail_closed: str | None = None
    paused: str | None = None
    holds: Mapping[str, str] = field(default_factory=dict)  # address -> reason (asked ones)
    hold_prefixes: Mapping[str, str] = field(default_factory=dict)  # prefix -> reason
    # Why the copy of the repository's holds and pauses may be missing some (core/facts.py):
    # it keeps every address, as a hold would (no export vouches past it).
    facts_problem: str | None = None

    def _registered(self, namespace: str) -> str:
        """The namespace as the registry spells it (canonical form: ``schemas.namespaces``)."""
        if namespace in self.registry:
            return namespace
        try:
            canonical = canonical_namespace(namespace)
        except OutsideNamespace:
            return namespace
        return canonical if canonical in self.registry else namespace

    def repo_problem(self, repo: str, namespace: str) -> tuple[str, str] | None:
        """(reason, detail) when nothing of the repository may be deleted now."""
        fail = fail_closed_text(self.global_fail_closed, self.repo_fail_closed)
        if fail is not None:
            return "fail_closed", fail
        if self.facts_problem:
            return "facts", self.facts_problem
        if self.paused:
            return "paused", f"repository paused: {self.paused}"
        if self.registry and self.registry.get(self._registered(namespace)) != repo:
            owner = self.registry.get(self._registered(namespace))
            return "not_owner", (f"namespace {namespace!r} is not owned by live repository "
                                 f"{repo!r}" + (f" (owner: {owner!r})" if owner else ""))
        return None

    def guards(self, repo: str, namespace: str, address: str) -> Guards:
        if self.registry:
            not_owner = ownership_problem(self.registry, repo, self._registered(namespace),
                                          address)
        else:  # legacy: no registry yet, only the namespace check
            try:
                namespace_key(namespace, address)
                not_owner = None
            except OutsideNamespace as exc:
                not_owner = str(exc)
        fail = fail_closed_text(self.global_fail_closed, self.repo_fail_closed)
        held = self.facts_problem or self.holds.get(address)
        if held is None:
            for prefix, reason in self.hold_prefixes.items():
                if address.startswith(prefix):
                    held = f"{reason} (prefix {prefix})"
                    break
        return Guards(not_owner=not_owner, fail_closed=fail, paused=self.paused, held=held)


def applied_regression(recorded: Any, current: Mapping[Any, Any] | None) -> str | None:
    """Redis Cluster: why a repository's ``applied[]`` (``current``, in its own slot) shows
    its node went back behind the tracker's copy (``recorded``: the json of ``hd:applied``,
    in another slot), or None. Pure. A partition whose value is missing, of another log, or
    at a lower offset than recorded is behind: the mirror may lack what was applied there."""
    if not recorded:
        return None  # one node (the copy is written on a cluster only), or nothing applied yet
    try:
        copy = orjson.loads(recorded)
    except orjson.JSONDecodeError:
        return "the tracker's copy of applied[] is unreadable (hd:applied)"
    if isinstance(copy, dict) and copy.get("regressed"):
        return (f"the repository's Redis node went back in time: {copy['regressed']} "
                "(hd:applied; `hardelete fail-closed clear` after a rebuild)")
    cur = {_text(k): _text(v) for k, v in (current or {}).items()}
    for p, want in sorted(copy.items()) if isinstance(copy, dict) else ():
        have = cur.get(str(p))
        if have == want:
            continue
        h_epoch, _, h_off = (have or "").rpartition(":")
        w_epoch, _, w_off = str(want).rpartition(":")
        if have is not None and h_epoch == w_epoch and h_off.lstrip("-").isdigit() \
                and w_off.lstrip("-").isdigit() and int(h_off) >= int(w_off):
            continue  # further on (the copy is written after the chunk)
        return (f"the repository's Redis node went back in time: applied[{p}] is "
                f"{have or 'missing'}, the tracker applied up to {want} (hd:applied)")
    return None


def _gate_from(raw: list[Any], addresses: list[str], repo: str,
               facts: FactsProof | None) -> Gate:
    registry, gfc, rfc, paused, holds, prefixes, recorded, applied, facts_seq, owed = raw
    regressed = applied_regression(recorded, applied)
    return Gate(
        registry={_text(k): _text(v) for k, v in (registry or {}).items()},
        global_fail_closed=(_text((gfc or {}).get("reason") or "fail-closed")
                            if gfc else None),
        repo_fail_closed=(_text((rfc or {}).get("reason") or "fail-closed") if rfc
                          else regressed),
        paused=_reason(paused, "paused") if paused is not None else None,
        holds={a: _reason(v, "held") for a, v in zip(addresses, holds or [], strict=False)
               if v is not None},
        hold_prefixes={_text(k): _reason(v, "held") for k, v in (prefixes or {}).items()},
        facts_problem=(NOT_PROVEN if facts is None else
                       facts.copy_problem(repo, int(facts_seq) if facts_seq else 0,
                                          int(owed or 0))),
    )


def _gate_calls(pipe: Any, repo: str, addresses: list[str]) -> None:
    k = RepoKeys(repo)
    pipe.hgetall(NAMESPACES)
    pipe.hgetall(FAIL_CLOSED)
    pipe.hgetall(k.fail_closed)
    pipe.get(k.paused)
    if addresses:
        pipe.hmget(k.holds, addresses)
    pipe.hgetall(k.hold_prefixes)
    pipe.hget(APPLIED, repo)
    pipe.hgetall(k.applied)
    pipe.get(k.facts_seq)
    pipe.scard(k.facts_owed)


def read_gate(r: Any, repo: str, addresses: Iterable[str] = (), *,
              facts: FactsProof | None = None) -> Gate:
    """Read the guards now (synchronous client; Redis Cluster too). ``facts``: the proof
    (``core.facts.RepoFacts.prove``) taken right before; without it the gate keeps everything
    of the repository (``facts_problem``), so only readers that delete nothing omit it."""
    addrs = list(addresses)
    pipe = r.pipeline(transaction=False)
    _gate_calls(pipe, repo, addrs)
    res = pipe.execute()
    if not addrs:
        res.insert(4, [])
    return _gate_from(res, addrs, repo, facts)


async def aread_gate(r: Any, repo: str, addresses: Iterable[str] = (), *,
                     facts: FactsProof | None = None) -> Gate:
    """Read the guards now (async client); ``facts`` as :func:`read_gate`."""
    addrs = list(addresses)
    pipe = r.pipeline(transaction=False)
    _gate_calls(pipe, repo, addrs)
    res = await pipe.execute()
    if not addrs:
        res.insert(4, [])
    return _gate_from(res, addrs, repo, facts)


# --- the one evidence reader ----------------------------------------------------------------------

class _Unsequenced:
    def __repr__(self) -> str:
        return "UNSEQUENCED"


# Evidence.continuity_ms of a repository whose service does not number its history: only the
# tracker's horizon over the log bounds it (schemas/README.md, "Continuity", status).
UNSEQUENCED = _Unsequenced()


@dataclass(frozen=True)
class Evidence:
    """Everything the judgment needs about some addresses of one repository, read at once right
    before a request: the guards, the address records, the claims, the token states, the
    repository's continuity horizon (read with the records, in one script in its slot) and the
    Redis clock. Every delete path reads it here (:func:`read_evidence`,
    :func:`aread_evidence`) and asks :func:`keep_reasons`; none reads Redis for a delete
    decision by itself."""

    gate: Gate
    records: Mapping[str, AddressRecord | None]
    claimed: Mapping[str, bool]
    token_states: Mapping[str, str | None]
    now_ms: int
    continuity_ms: int | _Unsequenced | None = UNSEQUENCED
    # The records' hashes as read (address -> fields; absent: no record), from the same read:
    # a caller that compares a record with an earlier reading of it (the reconciler's digest)
    # needs no second read, which could see another moment.
    fields: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def horizon(self, horizon_ms: int | None) -> int | None:
        """The horizon a judgment may use: the caller's (the tracker's, over the log), and for
        a sequenced repository no later than its continuity horizon (None while it has none).
        A caller that knows no horizon (the reconciler's sweep) still gets the continuity
        horizon: without it the reconciler path would judge by its cutoff alone."""
        if isinstance(self.continuity_ms, _Unsequenced):
            return horizon_ms
        if self.continuity_ms is None:
            return None
        return self.continuity_ms if horizon_ms is None else min(horizon_ms, self.continuity_ms)

    @property
    def uncertified(self) -> bool:
        """A sequenced repository without a continuity horizon (a gap, a broken stripe, no
        watermark yet): nothing of it may be deleted, on any path."""
        return self.continuity_ms is None


EVIDENCE_LUA = compose(FilePath(__file__).with_name("evidence.lua").read_text())


def _evidence_args(repo: str, addresses: list[str]) -> tuple[list[str], list[str]]:
    k = RepoKeys(repo)
    return [k.meta], [k.tag + ":", k.address_prefix, k.claims, *addresses]
    # (the clock is read apart: a script that read TIME before writing nothing is fine, but
    # the judgment's now must precede the records, as read_evidence does)


def _evidence_from(gate: Gate, raw: list[Any], addresses: list[str]
                   ) -> tuple[dict[str, AddressRecord | None], dict[str, bool], list[str],
                              int | _Unsequenced | None, dict[str, dict[str, str]]]:
    n = len(addresses)
    sequenced, horizon, body = _text(raw[0]), _text(raw[1]), raw[2:]
    fields = {a: _pairs(h) for a, h in zip(addresses, body[:n], strict=True) if h}
    records = {a: (decode_address(fields[a]) if a in fields else None) for a in addresses}
    claimed = {a: c is not None for a, c in zip(addresses, body[n:2 * n], strict=True)}
    tokens = sorted({t for rec in records.values() if rec is not None for t in rec.adds.values()})
    cont: int | _Unsequenced | None = UNSEQUENCED
    if sequenced == "1":
        cont = int(horizon) if horizon else None
    return records, claimed, tokens, cont, fields


def _pairs(flat: Any) -> dict[str, str]:
    """HGETALL's reply inside a script (a flat list) as the hash."""
    if isinstance(flat, dict):
        return {_text(k): _text(v) for k, v in flat.items()}
    items = [_text(v) for v in flat]
    return dict(zip(items[0::2], items[1::2], strict=True))


def read_evidence(r: Any, repo: str, addresses: Iterable[str], *,
                  facts: FactsProof | None = None) -> Evidence:
    """Read the evidence now (synchronous client; Redis Cluster too); ``facts``: the proof
    taken right before (:func:`read_gate`)."""
    addrs = list(dict.fromkeys(addresses))
    now = redis_time_ms(r)  # before the records: a clock read later would judge them older
    gate = read_gate(r, repo, addrs, facts=facts)
    keys, args = _evidence_args(repo, addrs)
    raw = r.register_script(EVIDENCE_LUA)(keys=keys, args=args)
    records, claimed, tokens, cont, fields = _evidence_from(gate, raw, addrs)
    states = dict(zip(tokens, r.hmget(RepoKeys(repo).tokens, tokens), strict=True)) \
        if tokens else {}
    return Evidence(gate, records, claimed, {t: _opt_text(v) for t, v in states.items()}, now,
                    cont, fields)


async def aread_evidence(r: Any, repo: str, addresses: Iterable[str], *,
                         facts: FactsProof | None = None) -> Evidence:
    """Read the evidence now (async client); ``facts`` as :func:`read_evidence`."""
    addrs = list(dict.fromkeys(addresses))
    now = await aredis_time_ms(r)  # before the records (see read_evidence)
    gate = await aread_gate(r, repo, addrs, facts=facts)
    keys, args = _evidence_args(repo, addrs)
    raw = await r.register_script(EVIDENCE_LUA)(keys=keys, args=args)
    records, claimed, tokens, cont, fields = _evidence_from(gate, raw, addrs)
    states = dict(zip(tokens, await r.hmget(RepoKeys(repo).tokens, tokens), strict=True)) \
        if tokens else {}
    return Evidence(gate, records, claimed, {t: _opt_text(v) for t, v in states.items()}, now,
                    cont, fields)


def _opt_text(v: Any) -> str | None:
    return None if v is None else _text(v)


def keep_reasons(evidence: Evidence, repo: str, namespace: str, *, path: Path,
                 horizon_ms: int | None, grace_ms: int, cutoff_ms: int | None = None,
                 claimer: str | None = None, vouched: Container[str] = (),
                 now_ms: int | None = None) -> dict[str, str]:
    """address -> reason to keep, for the addresses the one judgment (``schemas.liveness``)
    does not let go now. ``vouched``: addresses a fresh service export vouched for, which the
    fail-closed guard alone does not keep (SPEC safety 10)."""
    keep: dict[str, str] = {}
    now = evidence.now_ms if now_ms is None else now_ms
    if evidence.uncertified:  # (the reconciler path reads "no horizon" as "cutoff only")
        return dict.fromkeys(evidence.records, Keep.NO_HORIZON.value)
    horizon_ms = evidence.horizon(horizon_ms)
    for address, rec in evidence.records.items():
        guards = evidence.gate.guards(repo, namespace, address)
        if address in vouched and guards.fail_closed is not None:
            guards = replace(guards, fail_closed=None)
        j = judge(rec, evidence.token_states, now_ms=now, horizon_ms=horizon_ms,
                  grace_ms=grace_ms, path=path, cutoff_ms=cutoff_ms,
                  claimed=evidence.claimed.get(address, False), claimer=claimer,
                  guards=guards)
        if not j.may_delete:
            keep[address] = j.reason
    return keep
