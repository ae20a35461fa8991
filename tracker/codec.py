"""Fast event decoding and the compact form the Lua script consumes.

``schemas.events.decode`` is the contract's validator but it costs ~160 us per event (type hints
are resolved per call). The tracker's hot path uses :func:`fast_body`, which checks the same rules
with a validator per event type generated from the event dataclasses at import (``_compile``),
and falls back to ``decode`` whenever anything looks off:
``decode`` then names the problem (the dead-letter reason) or, if it accepts the event after all,
its result is used. So the fast path never accepts what ``decode`` rejects and never changes a
value (``tests/unit/tracker/test_tracker_codec.py`` checks this on random and mutated events).

The compact form is one JSON array per event, ``[offset, op, ...]`` (see ``OP_*`` below), with
``""`` for an absent optional string (the contract forbids empty strings there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson

from schemas import events as ev
from schemas.address import canonical_uri, spelling
from schemas.events import (
    ADDRESS_FIELDS,
    EVENT_TYPES,
    NAMED_ADDRESS_FIELDS,
    REF_EVENT_TYPES,
    SCHEMA_VERSION,
    EventError,
    named_addresses,
)
from schemas.layout import RESERVED_PREFIXES
from tracker.references import admission_problem

OP_REPO, OP_BRANCH, OP_ISSUE, OP_ADD, OP_DEL, OP_COMMIT = 1, 2, 3, 4, 5, 6
OP_RESET, OP_BDEL, OP_TAG, OP_UNTAG, OP_RETIRE, OP_REAPED = 7, 8, 9, 10, 11, 12
# continuity (apply.lua): a verified watermark, a range gone (14 is not used)
OP_WATERMARK, OP_GONE = 15, 16

# Each field check is the Python expression that is true when the value ``x`` is BAD; the
# per-type validators below are generated from them (one straight-line function per type: a loop
# over field specs with a call per check cost twice as much on the tracker's hot path).
_BAD = {
    "str": "type(x) is not str or not x",
    "path": "type(x) is not str",
    "addr": "type(x) is not str or not x.startswith('s3://')",
    "int": "type(x) is not int",
    "float": "type(x) is not int and (type(x) is not float or not _isfinite(x))",
    "list_str": "not _list_str(x)",
    "list_addr": "not _list_addr(x)",
    "list_int": "not _list_int(x)",
    "dict_float": "not _dict_float(x)",
}


def _list_str(v: Any) -> bool:
    return type(v) is list and all(type(x) is str and x != "" for x in v)


def _list_addr(v: Any) -> bool:
    return type(v) is list and all(type(x) is str and x.startswith("s3://") for x in v)


def _list_int(v: Any) -> bool:  # (the events' default integer range)
    return type(v) is list and all(type(x) is int and 0 <= x <= ev.MAX_EXACT_INT for x in v)


def _dict_float(v: Any) -> bool:
    return type(v) is dict and all(
        type(x) is int or (type(x) is float and math.isfinite(x)) for x in v.values())


def _kind(name: str, tp: Any) -> tuple[str, bool]:
    """The check of field ``name`` (a key of _BAD) and whether it may be None."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = next(a for a in typing.get_args(tp) if a is not type(None))
        return _kind(name, inner)[0], True
    if origin is list and typing.get_args(tp) == (int,):
        return "list_int", False
    if origin is list:
        return ("list_addr" if name in ADDRESS_FIELDS else "list_str"), False
    if origin is dict:
        return "dict_float", False
    if tp is int:
        return "int", False
    if tp is float:
        return "float", False
    if tp is str:
        if name == "path":
            return "path", False
        return ("addr" if name in ADDRESS_FIELDS else "str"), False
    raise TypeError(f"no fast check for {name}: {tp}")  # pragma: no cover


def _scalar(tp: Any) -> Any:
    """int, float, str... inside Optional[...] / dict[str, ...]."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _scalar(next(a for a in typing.get_args(tp) if a is not type(None)))
    if origin is dict:
        return _scalar(typing.get_args(tp)[1])
    return tp


def _range_bad(rng: ev.Range, x: str) -> str:
    """The expression true when number ``x`` is outside ``rng`` (``Range.problem``'s rule;
    the values are finite here: the type check ran first). repr() round-trips floats."""
    low = "<" if rng.lo_exclusive else "<="
    return f"not ({rng.lo!r} {low} {x} <= {rng.hi!r})"


def _field_code(t: str, name: str, tp: Any, f: dataclasses.Field[Any]) -> list[str]:
    """Lines that check field ``name`` of body ``b`` of type ``t`` (``return None`` when bad)
    and normalise it as ``decode`` does: defaults filled in, floats as float."""
    kind, nullable = _kind(name, tp)
    scalar = _scalar(tp)
    rng = ev.field_range(name, scalar, t) if scalar is int or scalar is float else None
    body = [f"if {_BAD[kind]}: return None"]
    if kind == "str" and name in ev.MAX_LENGTHS:
        body.append(f"if len(x) > {ev.MAX_LENGTHS[name]}: return None")
    if rng is not None and kind == "dict_float":
        body.append(f"if any({_range_bad(rng, 'v')} for v in x.values()): return None")
        body.append(f"b[{name!r}] = {{str(k): float(v) for k, v in x.items()}}")
    elif rng is not None:
        body.append(f"if {_range_bad(rng, 'x')}: return None")
    if tp is float:
        body.append(f"if type(x) is int: b[{name!r}] = float(x)")
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    lines = [f"x = get({name!r}, _MISSING)"]
    if required:  # _MISSING fails every type check
        return lines + body
    if name == "event_id":
        default = "_new_id()"
    elif f.default_factory is not dataclasses.MISSING:
        default = repr(f.default_factory())
    else:
        default = repr(f.default)
    lines.append(f"if x is _MISSING: b[{name!r}] = {default}")
    lines.append("elif x is not None:" if nullable else "else:")
    return lines + ["    " + line for line in body]


def _compile(t: str, cls: type[ev.Event]) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    lines = [f"def fast_{t}(b):", "    get = b.get"]
    sequenced = issubclass(cls, ev.ServiceEvent)
    if sequenced:  # (read before the defaults are filled in)
        lines.append("    lone_stripe = 'stripe' in b and get('seq') is None")
    for f in fields:
        lines += ["    " + line for line in _field_code(t, f.name, hints[f.name], f)]
    lines.append("    if not _ALLOWED.issuperset(b): return None")
    if sequenced:  # decode's rules: seq and incarnation together, stripe only with them
        lines.append("    if lone_stripe or (b['seq'] is None) != (b['incarnation'] is None): "
                     "return None")
    if t in _SEMANTICS:
        lines.append("    if not _semantics(b): return None")
    lines.append("    return b")
    allowed = frozenset([f.name for f in fields] + ["type", "v"])
    scope: dict[str, Any] = {
        "_MISSING": _MISSING, "_ALLOWED": allowed, "_isfinite": math.isfinite,
        "_new_id": ev.new_id, "_semantics": _SEMANTICS.get(t), "_list_str": _list_str,
        "_list_addr": _list_addr, "_list_int": _list_int,
        "_dict_float": _dict_float}
    exec(compile("\n".join(lines), f"<fast_body {t}>", "exec"), scope)  # generated from the types
    fn: Callable[[dict[str, Any]], dict[str, Any] | None] = scope[f"fast_{t}"]
    return fn


_MISSING = object()


def _replaces_ok(b: dict[str, Any]) -> bool:
    rr, ra = b.get("replaces_ref_id"), b.get("replaces_address")
    return (rr is None) == (ra is None) and rr != b["ref_id"]


def _namespace_ok(b: dict[str, Any]) -> bool:
    return bool(b["storage_namespace"].endswith("/"))


def _reaped_ok(b: dict[str, Any]) -> bool:
    return 1 <= len(b["addresses"]) <= ev.MAX_REAPED_PER_EVENT


def _range_ok(b: dict[str, Any]) -> bool:
    return bool(b["from_seq"] <= b["to_seq"])


# The rules beyond field types, per event type (``decode``'s ``_check_semantics``); the
# generated validator of a type calls its rule, so a rule added here reaches the fast path.
_SEMANTICS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "object_written": _replaces_ok, "object_copied": _replaces_ok,
    "repository_created": _namespace_ok, "repository_deleted": _namespace_ok,
    "addresses_reaped": _reaped_ok, "range_gone": _range_ok,
}


_FAST = {name: _compile(name, cls) for name, cls in EVENT_TYPES.items()}


def fast_body(body: Any) -> dict[str, Any] | None:
    """The validated, normalised body of a well-formed event, or None (then call ``decode``)."""
    if type(body) is not dict:
        return None
    t = body.get("type")
    if type(t) is not str:
        return None
    fast = _FAST.get(t)
    v = body.get("v")
    if fast is None or type(v) is bool or v != SCHEMA_VERSION:
        return None
    return fast(body)


def event_body(event: ev.Event) -> dict[str, Any]:
    """An Event as the normalised body ``fast_body`` produces."""
    body = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
    body["type"] = event.TYPE
    body["v"] = SCHEMA_VERSION
    return body


def parse(value: bytes | None) -> dict[str, Any]:
    """Decode and validate one record value; raises EventError naming the problem."""
    if value is None:
        raise EventError("empty record (no value)")
    try:
        body = fast_body(orjson.loads(value))
    except orjson.JSONDecodeError:
        body = None
    if body is not None:
        return body
    return event_body(ev.decode(value))  # raises EventError with the reason


def compact(body: dict[str, Any], offset: int) -> list[Any]:
    """The Lua script's form of a validated body (see apply.lua)."""
    t = body["type"]
    if t == "object_written" or t == "object_copied":
        return [offset, OP_ADD, body["staging_token"], body["address"], body["size"],
                body["ref_id"], body.get("replaces_ref_id") or "",
                body.get("replaces_address") or "", body["event_id"], t]
    if t == "object_deleted":
        return [offset, OP_DEL, body["staging_token"], body["address"], body["ref_id"],
                body["event_id"]]
    if t == "address_issued":
        return [offset, OP_ISSUE, body["address"], int(body["ttl_seconds"] * 1000)]
    if t == "commit_created":
        record = orjson.dumps({"parents": body["parents"], "time": body["committed_at"],
                               "branch": body["branch"], "manifest": body["manifest"]}).decode()
        return [offset, OP_COMMIT, body["branch"], body["commit_id"], body["sealed_tokens"],
                body["staging_token"], record, body["event_id"], body["ref_version"]]
    if t == "branch_created":
        return [offset, OP_BRANCH, body["branch"], body["staging_token"],
                body.get("source_commit") or "", body["ref_version"], body["event_id"]]
    if t == "branch_reset":
        return [offset, OP_RESET, body["branch"], body["dropped_tokens"], body["staging_token"],
                body.get("head") or "", body["event_id"], body["ref_version"]]
    if t == "branch_deleted":
        return [offset, OP_BDEL, body["branch"], body["dropped_tokens"], body["event_id"],
                body["ref_version"]]
    if t == "tag_created":
        return [offset, OP_TAG, body["tag"], body["commit_id"], body["ref_version"],
                body["event_id"]]
    if t == "tag_deleted":
        return [offset, OP_UNTAG, body["tag"], body["ref_version"], body["event_id"]]
    if t == "repository_deleted":
        return [offset, OP_RETIRE, body["event_id"]]
    if t == "addresses_reaped":
        return [offset, OP_REAPED, body["addresses"], body["event_id"]]
    if t == "repository_created":
        return [offset, OP_REPO, body["storage_namespace"], body["default_branch"],
                repr(body["default_retention_days"]),
                orjson.dumps(body["branch_retention_days"]).decode(), body.get("stripes", 1)]
    if t == "watermark":
        applied = body["tick_applied"]  # (a stripe the tick did not know: nothing applied)
        return [offset, OP_WATERMARK, body["stripe"], body["incarnation"], body["seq"],
                body["tick_ms"], applied[body["stripe"]] if body["stripe"] < len(applied) else 0,
                body.get("broken") or "", body.get("broken_epoch") or 0]
    if t == "range_gone":
        return [offset, OP_GONE, body["stripe"], body["incarnation"], body["from_seq"],
                body["to_seq"], body["reason"]]
    raise EventError(f"unknown event type {t!r}", "type")  # pragma: no cover


def compact_sequenced(body: dict[str, Any], offset: int) -> list[Any]:
    """:func:`compact`, and for an event that carries a seq apply.lua's sequenced form: the op
    negated, the event's (stripe, incarnation, seq) appended (one entry, not a marker before
    it: the accounting's cost is per entry)."""
    entry = compact(body, offset)
    seq = body.get("seq")
    if seq is not None:
        entry[1] = -entry[1]
        entry += (body.get("stripe") or 0, body["incarnation"], seq)
    return entry


def _plain_key_fast(namespace: str, address: str) -> bool:
    """True only if ``layout.namespace_key(namespace, address)`` accepts (namespace already
    checked): the same conditions, without splitting the key into parts."""
    if not address.startswith(namespace):
        return False
    rel = address[len(namespace):]
    if not rel or rel[0] == "/" or "//" in rel or "%" in rel:  # (%: maybe an escape)
        return False
    if "." in rel:  # only then can a segment be "." or ".."
        padded = "/" + rel + "/"
        if "/./" in padded or "/../" in padded:
            return False
    return not rel.startswith(RESERVED_PREFIXES)


class Gate:
    """Admission for the hot path: the same rule as ``references.admission_problem``, with a
    cache of repository namespaces (set once per repository) and of retired repositories
    (retirement is final). A tracker starts a fresh Gate whenever its partitions change, so a
    repository retired by another tracker meanwhile is read again from Redis.

    A ``repository_created`` that passes is admitted here at once; the daemon then registers
    the namespace (``hd:namespaces``, atomically across trackers) and calls :meth:`forget` if
    the registry refuses it."""

    def __init__(self) -> None:
        self.namespaces: dict[str, str] = {}  # live repository -> namespace
        self.retired: dict[str, str] = {}  # retired repository -> its namespace
        self._valid: dict[str, bool] = {}  # namespace -> namespace_key accepts the namespace

    def missing(self, repos: Iterable[str]) -> set[str]:
        return {r for r in repos if r not in self.namespaces and r not in self.retired}

    def forget(self, repo: str) -> None:
        """Undo the admission of a repository whose registration was refused."""
        self.namespaces.pop(repo, None)

    def check(self, body: dict[str, Any]) -> str | None:
        """Why this event must go to the dead-letter topic, or None (and remember new repos;
        a ``repository_deleted`` marks its repository retired for the events after it)."""
        repo = body["repository"]
        known = self.namespaces.get(repo)
        t = body["type"]
        if t == "repository_created":
            problem = admission_problem(repo, t, [], known, body["storage_namespace"],
                                        repo in self.retired)
            if problem is None and known is None:
                self.namespaces[repo] = body["storage_namespace"]
            return problem
        if t == "repository_deleted":
            problem = admission_problem(repo, t, [], known or self.retired.get(repo),
                                        body["storage_namespace"], repo in self.retired)
            if problem is None and known is not None:
                self.retired[repo] = self.namespaces.pop(repo)
            return problem
        addrs = named_addresses(body.get)
        if known is not None:
            ok = self._valid.get(known)
            if ok is None:
                ok = self._valid[known] = known.startswith("s3://") and known.endswith("/")
            if ok:
                for a in addrs:
                    if not _plain_key_fast(known, a):
                        break
                else:
                    return None
        return admission_problem(repo, t, addrs, known, retired=repo in self.retired)


# The named address fields a hold covers: not ``addresses``, whose record (addresses_reaped)
# names objects already deleted, and which a malformed record could fill with millions.
_HOLD_FIELDS = tuple(f for f in NAMED_ADDRESS_FIELDS if f != "addresses")


def hold_targets(value: bytes | None, key: bytes | None, namespaces: Mapping[str, str],
                 registry: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(repository, target) pairs a dead-lettered record still names (SPEC safety 10: a lost
    event never becomes a deletion); a target ending in ``/`` is a prefix hold.

    - A known repository (its ``repository`` field or the record key): each address field
      inside that repository's namespace; the namespace itself when what the record names
      cannot be read: not a JSON object, an unknown type, an address event without a readable
      address, or a ref event (a lost tag or commit may be what retains committed data; which
      objects, only the reconciler can tell).
    - A repository the tracker does not know (yet: its ``repository_created`` may come in a
      later batch; or refused): the hold goes on its keys all the same, where its namespace
      will be: each form an absolute address may mean in its bucket, else everything
      (``s3://``, a prefix of every address).
    - ``registry`` (``hd:namespaces``, namespace -> live repository): each live repository
      whose namespace holds an absolute address named is held too, whoever the record claims
      to be (a refused repository inside another's namespace names the other's objects).

    Lenient on purpose: the record failed validation, so only its JSON shape is assumed."""
    if not value and not key:
        return []
    try:
        body = orjson.loads(value or b"")
    except orjson.JSONDecodeError:
        body = None
    if type(body) is not dict:
        body = {}
    repos = []
    if type(body.get("repository")) is str:
        repos.append(body["repository"])
    if key:
        with contextlib.suppress(UnicodeDecodeError):
            repos.append(key.decode())
    t = body.get("type")
    unreadable = type(t) is not str or t not in EVENT_TYPES or t in REF_EVENT_TYPES
    out: list[tuple[str, str]] = []
    named = [body.get(name) for name in _HOLD_FIELDS if body.get(name) is not None]
    for repo in dict.fromkeys(repos):
        ns = namespaces.get(repo)
        if ns is None:
            out.extend((repo, target) for target in _unplaced(named, unreadable or (
                t in _ADDRESS_TYPES and not named)))
            continue
        if unreadable or (t in _ADDRESS_TYPES and not named):
            out.append((repo, ns))  # it could have named (or retained) anything there
            if unreadable:
                continue
        for addr in named:
            # Every object the spelling could mean (schemas/address.py); one that cannot be
            # read at all could mean anything in the namespace.
            seen = spelling(ns, addr)
            if not seen.readable:
                out.append((repo, ns))
            out.extend((repo, a) for a in seen.meant)
    for addr in named if registry else ():
        if isinstance(addr, str) and "://" in addr:
            for other_ns, owner in (registry or {}).items():
                out.extend((owner, a) for a in spelling(other_ns, addr).meant)
    return list(dict.fromkeys(out))


EVERYTHING = "s3://"  # a prefix of every address: the whole of a repository not known yet


def _unplaced(named: list[Any], anything: bool) -> list[str]:
    """Hold targets for a repository whose namespace is not known: what each absolute address
    may mean in its bucket, else everything."""
    if anything:
        return [EVERYTHING]
    out: list[str] = []
    for addr in named:
        try:
            root = canonical_uri(addr).split("/", 3)
            seen = spelling(f"s3://{root[2]}/", addr)
        except Exception:  # (not text, not an s3:// URI, no bucket: it could mean anything)
            return [EVERYTHING]
        if not seen.readable or not seen.meant:
            return [EVERYTHING]
        out.extend(seen.meant)
    return out


# Events whose loss may lose a reference: one that names no readable address holds everything.
_ADDRESS_TYPES = frozenset({"object_written", "object_copied", "object_deleted",
                            "address_issued"})


def candidate_repos(value: bytes | None, key: bytes | None) -> set[str]:
    """Repository ids a dead-lettered record may name (to load their namespaces)."""
    out: set[str] = set()
    if key:
        with contextlib.suppress(UnicodeDecodeError):
            out.add(key.decode())
    if value:
        with contextlib.suppress(orjson.JSONDecodeError):
            body = orjson.loads(value)
            if type(body) is dict and type(body.get("repository")) is str:
                out.add(body["repository"])
    return out
