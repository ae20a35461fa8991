"""Event contract, version 1.

Every event is a flat JSON object (orjson-encoded) with an envelope, ``event_id``, ``type``,
``v`` (schema version), ``repository`` and ``emitted_at``, plus the fields of its type. The
repository is the Kafka partition key, so the events of one repository are totally ordered by
the broker (but services may publish concurrently, so the order is not the order of operations:
see ``schemas/README.md`` for the reference-id rule that makes that harmless).

``decode`` validates every field and raises :class:`EventError`, whose message names the field
and the problem; the tracker sends such events to the dead-letter topic with that reason.
"""

from __future__ import annotations

import types
import typing
import uuid
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Union, get_args, get_origin

import orjson

SCHEMA_VERSION = 1


# Required on every event that changes a branch or tag (REF_EVENT_TYPES): the service KV's
# version of that ref after the change (seed 004: every SetIf of a ref bumps it; deletes too;
# never reused for the same ref name, even after a delete). The tracker keeps the highest
# version it applied per ref, deletes included (a versioned tombstone), so duplicates and
# reordering converge to the in-order state. Without it arrival order would decide (a retried
# tag_created after the tag's deletion would resurrect it): an unversioned ref event is
# dead-lettered, and its hold keeps the repository's namespace (schemas/README.md).
REF_VERSION_MAX = 2**53 - 1  # exact in every JSON implementation (and in Lua's doubles)


class EventError(ValueError):
    """An event could not be decoded; ``field`` names the culprit (or ``None``)."""

    def __init__(self, problem: str, field: str | None = None, event_type: str | None = None):
        where = f"field {field!r}: " if field else ""
        what = f"{event_type} event: " if event_type else ""
        super().__init__(f"{what}{where}{problem}")
        self.field = field
        self.problem = problem
        self.event_type = event_type


def new_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    TYPE: ClassVar[str] = ""
    DOC: ClassVar[str] = ""
    repository: str
    event_id: str = field(default_factory=new_id)
    # Publisher's clock: informational only. No safety decision ever reads it.
    emitted_at: float = 0.0

    @property
    def key(self) -> bytes:
        """Kafka partition key: the repository, so one repository is one ordered stream."""
        return self.repository.encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceEvent(Event):
    """An event a service publishes about a change of its own (every type but the reaper's and
    the relay's). ``seq``/``incarnation``/``stripe`` place it in its ordering domain
    (schemas/README.md, "Continuity"): ``seq`` gapless per (repository, stripe), allocated with
    the change; both or neither (an event without them gets no online deletion once the tracker
    certifies continuity); ``stripe`` only with them."""

    seq: int | None = None
    incarnation: str | None = None
    stripe: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RepositoryCreated(ServiceEvent):
    TYPE = "repository_created"
    DOC = "A repository and its storage namespace; retention defaults for the reconciler."
    storage_namespace: str
    default_branch: str
    default_retention_days: float
    branch_retention_days: dict[str, float] = field(default_factory=dict)
    # Ordering domains of the repository (1: the repository itself; K: stripes 0..K-1).
    stripes: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class RepositoryDeleted(ServiceEvent):
    TYPE = "repository_deleted"
    DOC = (
        "A repository retired: nothing of it is deleted online any more, later events of it are "
        "refused, its namespace may be registered by a new repository, and its id is never "
        "used again. storage_namespace must be the repository's (a safeguard)."
    )
    storage_namespace: str


@dataclass(frozen=True, slots=True, kw_only=True)
class BranchCreated(ServiceEvent):
    TYPE = "branch_created"
    DOC = "A branch with its first open staging token, starting at source_commit (if any)."
    branch: str
    staging_token: str
    source_commit: str | None = None
    ref_version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AddressIssued(ServiceEvent):
    TYPE = "address_issued"
    DOC = (
        "An upload address handed to a client (GetPhysicalAddress). Protected for ttl_seconds, "
        "measured on the tracker's clock from when the tracker applies this event."
    )
    address: str
    ttl_seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectWritten(ServiceEvent):
    TYPE = "object_written"
    DOC = (
        "An entry staged in a token (upload or link): reference ref_id of address. If it "
        "overwrote an entry staged in the SAME token, replaces_ref_id/replaces_address name the "
        "reference it removes."
    )
    branch: str
    staging_token: str
    path: str
    address: str
    size: int
    ref_id: str
    replaces_ref_id: str | None = None
    replaces_address: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectCopied(ServiceEvent):
    TYPE = "object_copied"
    DOC = (
        "Shallow copy: source address gains reference ref_id in the destination token. "
        "source_read_at is when the service read the source entry (publisher clock, diagnostics)."
    )
    branch: str
    staging_token: str
    path: str
    address: str
    size: int
    ref_id: str
    source_read_at: float
    replaces_ref_id: str | None = None
    replaces_address: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectDeleted(ServiceEvent):
    TYPE = "object_deleted"
    DOC = "An entry removed from a staging token: the reference ref_id of address ends."
    branch: str
    staging_token: str
    path: str
    address: str
    ref_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitCreated(ServiceEvent):
    TYPE = "commit_created"
    DOC = (
        "A commit on branch: it sealed and committed sealed_tokens, the branch's open token is "
        "now staging_token, and its entries are listed in the Parquet manifest at manifest."
    )
    branch: str
    commit_id: str
    parents: list[str]
    sealed_tokens: list[str]
    staging_token: str
    committed_at: float
    manifest: str
    ref_version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BranchReset(ServiceEvent):
    TYPE = "branch_reset"
    DOC = "Uncommitted changes thrown away: dropped_tokens are dropped, staging_token is new."
    branch: str
    dropped_tokens: list[str]
    staging_token: str
    head: str | None = None
    ref_version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BranchDeleted(ServiceEvent):
    TYPE = "branch_deleted"
    DOC = "A branch deleted: its tokens are dropped; last_head may now be a dangling commit."
    branch: str
    dropped_tokens: list[str]
    last_head: str | None = None
    ref_version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TagCreated(ServiceEvent):
    TYPE = "tag_created"
    DOC = "A tag naming a commit."
    tag: str
    commit_id: str
    ref_version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TagDeleted(ServiceEvent):
    TYPE = "tag_deleted"
    DOC = "A tag removed."
    tag: str
    ref_version: int


MAX_REAPED_PER_EVENT = 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class AddressesReaped(Event):
    TYPE = "addresses_reaped"
    DOC = (
        "Published by the reaper, never by a service: the store confirmed these deletes. The "
        "reaper publishes it before it marks them reaped in Redis, so the log, not Redis "
        "alone, holds what was deleted: a Redis restored from an older copy learns it again by "
        "replay, and a reference that arrives for such an address is an incident."
    )
    addresses: list[str]
    reaper: str
    # HMAC-SHA256 under the reaper's key (schemas/reaper_auth.py): the tracker applies only a
    # record that verifies; any other is dead-lettered with a forged_reap incident.
    signature: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Watermark(Event):
    TYPE = "watermark"
    DOC = (
        "Published by the service's relay, never with a change: its answer to the tracker's "
        "tick. Read after the tick was received, from committed state: every event of the "
        "domain (repository, stripe) committed before tick_ms has seq <= this seq (0: none). "
        "tick_applied, tick_id and tick_sig are the tick's, as received (the tracker verifies "
        "them; a seq below tick_applied[stripe] is a watermark from a store that lags). "
        "broken, when present, is the reason of a break of this domain the service recorded "
        "(the tracker's broken message, with its broken_epoch): the watermark then certifies "
        "nothing and breaks it, unless the stripe was rebuilt since that epoch."
    )
    stripe: int
    incarnation: str
    seq: int
    tick_ms: int
    tick_applied: list[int]
    tick_id: str
    tick_sig: str
    broken: str | None = None
    # the tracker's rebuild epoch of the stripe when it reported that break (absent: 0): a
    # break from before a later rebuild is superseded
    broken_epoch: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RangeGone(Event):
    TYPE = "range_gone"
    DOC = (
        "Published by the service's relay in answer to a re-send request: the events "
        "from_seq..to_seq of the domain (repository, stripe) in that incarnation are no longer "
        "in its outbox (trimmed, or the store was restored under a new incarnation)."
    )
    stripe: int
    incarnation: str
    from_seq: int
    to_seq: int
    reason: str


EVENT_TYPES: dict[str, type[Event]] = {
    cls.TYPE: cls
    for cls in (
        RepositoryCreated,
        RepositoryDeleted,
        BranchCreated,
        AddressIssued,
        ObjectWritten,
        ObjectCopied,
        ObjectDeleted,
        CommitCreated,
        BranchReset,
        BranchDeleted,
        TagCreated,
        TagDeleted,
        AddressesReaped,
        Watermark,
        RangeGone,
    )
}

# Published by the relay about a domain, never with a change: the tracker applies them to its
# continuity state only (no reference, no address).
RELAY_EVENT_TYPES = frozenset(cls.TYPE for cls in (Watermark, RangeGone))

# Events that change a branch or tag record (each carries a required ref_version).
REF_EVENT_TYPES = frozenset(cls.TYPE for cls in (
    BranchCreated, CommitCreated, BranchReset, BranchDeleted, TagCreated, TagDeleted))

# Fields whose string value (a list field: each item) must be an s3:// URI (checked here;
# namespace checked by the tracker).
ADDRESS_FIELDS = ("address", "replaces_address", "storage_namespace", "addresses")
# Of those, the fields naming an object an event acts on (not a namespace): admission checks
# each against the repository's namespace, and a dead-lettered event's are held.
NAMED_ADDRESS_FIELDS = ("address", "replaces_address", "addresses")


def named_addresses(value_of: Callable[[str], object]) -> list[str]:
    """The physical addresses an event names, in field order. ``value_of(name)`` is the field's
    value, None when absent: ``body.get`` for a decoded body, ``getattr`` for an event. Lenient
    (a value of another type names nothing), so it also reads a record that failed validation."""
    out: list[str] = []
    for name in NAMED_ADDRESS_FIELDS:
        v = value_of(name)
        if type(v) is str:
            out.append(v)
        elif type(v) is list or type(v) is tuple:
            out += [a for a in v if type(a) is str]
    return out


_ENVELOPE = ("type", "v")
_MISSING_WHY = {"ref_version": "missing (required on ref events: without the ref's version a "
                               "duplicate or late event would move the ref)"}


@dataclass(frozen=True, slots=True)
class Range:
    """Allowed values of a numeric field (also exported to the JSON Schema files).

    Every number the tracker stores or computes with has one: a value it cannot represent
    exactly (a size beyond 2**53, a TTL that overflows the clock) is refused at admission and
    dead-lettered, never crashes the encoder or the Lua script.
    """

    lo: float
    hi: float
    lo_exclusive: bool = False

    def problem(self, value: float) -> str | None:
        if value < self.lo or (self.lo_exclusive and value == self.lo) or value > self.hi:
            low = f"> {self.lo:g}" if self.lo_exclusive else f">= {self.lo:g}"
            return f"must be {low} and <= {self.hi:g}, got {value!r}"
        return None

    def schema(self) -> dict[str, float]:
        lo_key = "exclusiveMinimum" if self.lo_exclusive else "minimum"
        return {lo_key: self.lo, "maximum": self.hi}


MAX_EXACT_INT = 2**53 - 1  # what JSON readers, Lua and Redis scores all hold exactly
MAX_TTL_SECONDS = 366 * 86400.0  # an upload address is protected for at most a year
MAX_RETENTION_DAYS = 36_600.0  # a century
MAX_TIME = 1e11  # seconds since the epoch (year ~5000): publisher clocks, informational
MAX_STRIPES = 64  # ordering domains a repository may declare
# Per field (dict fields: their values). Fields not listed: ints DEFAULT_INT, floats finite.
RANGES: dict[str, Range] = {
    "size": Range(0, MAX_EXACT_INT),
    "ttl_seconds": Range(0, MAX_TTL_SECONDS, lo_exclusive=True),
    "default_retention_days": Range(0, MAX_RETENTION_DAYS),
    "branch_retention_days": Range(0, MAX_RETENTION_DAYS),
    "committed_at": Range(-MAX_TIME, MAX_TIME),
    "emitted_at": Range(-MAX_TIME, MAX_TIME),
    "source_read_at": Range(-MAX_TIME, MAX_TIME),
    "seq": Range(1, MAX_EXACT_INT),
    "from_seq": Range(1, MAX_EXACT_INT),
    "to_seq": Range(1, MAX_EXACT_INT),
    "stripe": Range(0, MAX_STRIPES - 1),
    "stripes": Range(1, MAX_STRIPES),
}
# Where one event type's field differs from the field of that name elsewhere.
TYPE_RANGES: dict[tuple[str, str], Range] = {
    ("watermark", "seq"): Range(0, MAX_EXACT_INT),  # M = 0: nothing committed yet
}
DEFAULT_INT = Range(0, MAX_EXACT_INT)
DEFAULT_FLOAT = Range(-1e15, 1e15)
# Longest value of a string field (code points; others: any length).
# (sig: a tick's, schemas/control.py; broken: a watermark's, the tracker's reason)
MAX_LENGTHS: dict[str, int] = {"incarnation": 128, "tick_id": 128, "tick_sig": 128,
                               "reason": 1000, "broken": 1000, "sig": 128}


def field_range(name: str, tp: Any, event_type: str = "") -> Range:
    """The range of numeric field ``name`` of ``event_type`` (``tp``: its scalar type)."""
    base = name.split(".", 1)[0].split("[", 1)[0]
    found = TYPE_RANGES.get((event_type, base)) or RANGES.get(base)
    if found is not None:
        return found
    return DEFAULT_INT if tp is int else DEFAULT_FLOAT


_NAMES: dict[type[Event], tuple[str, ...]] = {}


def encode(event: Event) -> bytes:
    names = _NAMES.get(type(event))
    if names is None:
        names = _NAMES[type(event)] = tuple(f.name for f in fields(event))
    # (not asdict: its deep copy cost more than the rest of the encoding; no field nests a
    # dataclass)
    body = {name: getattr(event, name) for name in names}
    body["type"] = event.TYPE
    body["v"] = SCHEMA_VERSION
    if isinstance(event, ServiceEvent):
        # The continuity fields are left out at their defaults: an event without a sequence
        # is byte for byte what it was before they existed.
        if event.seq is None and event.incarnation is None:
            del body["seq"], body["incarnation"]
            if event.stripe == 0:
                del body["stripe"]
        if isinstance(event, RepositoryCreated) and event.stripes == 1:
            del body["stripes"]
    elif isinstance(event, Watermark):
        # (a watermark without a break is what it was before the fields)
        if event.broken is None:
            del body["broken"]
        if event.broken_epoch is None:
            del body["broken_epoch"]
    return orjson.dumps(body)


def _type_name(tp: Any) -> str:
    if tp is str:
        return "string"
    if tp is int:
        return "integer"
    if tp is float:
        return "number"
    if tp is bool:
        return "boolean"
    return str(tp)


def _check(name: str, tp: Any, value: Any, etype: str) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _check(name, args[0], value, etype)
    if origin is list:
        (item,) = get_args(tp)
        if not isinstance(value, list):
            raise EventError(f"expected a list, got {type(value).__name__}", name, etype)
        return [_check(f"{name}[{i}]", item, v, etype) for i, v in enumerate(value)]
    if origin is dict:
        _, vt = get_args(tp)
        if not isinstance(value, dict):
            raise EventError(f"expected an object, got {type(value).__name__}", name, etype)
        return {str(k): _check(f"{name}.{k}", vt, v, etype) for k, v in value.items()}
    if tp is int and type(value) is float and value.is_integer():
        value = int(value)  # JSON has one number type: 3.0 is the integer 3 (as JSON Schema says)
    ok = (
        (tp is str and isinstance(value, str))
        or (tp is int and isinstance(value, int) and not isinstance(value, bool))
        or (tp is float and isinstance(value, int | float) and not isinstance(value, bool))
        or (tp is bool and isinstance(value, bool))
    )
    if not ok:
        got = "null" if value is None else type(value).__name__
        raise EventError(f"expected {_type_name(tp)}, got {got}", name, etype)
    if tp is float:
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise EventError("must be a finite number", name, etype)
    if tp is float or tp is int:
        problem = field_range(name, tp, etype).problem(value)
        if problem:
            raise EventError(problem, name, etype)
    if tp is str and not value and name not in ("path",):
        raise EventError("must not be empty", name, etype)
    if tp is str and len(value) > MAX_LENGTHS.get(name, len(value)):
        raise EventError(f"must be at most {MAX_LENGTHS[name]} characters, got {len(value)}",
                         name, etype)
    if tp is str and name.split("[", 1)[0] in ADDRESS_FIELDS and not value.startswith("s3://"):
        raise EventError(f"must be an s3:// URI, got {value[:80]!r}", name, etype)
    return value


def decode(data: bytes | str) -> Event:
    """Parse and validate one event; raises EventError naming the field and the problem."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise EventError(f"not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise EventError(f"expected a JSON object, got {type(body).__name__}")
    etype = body.get("type")
    if not isinstance(etype, str):
        raise EventError("missing or not a string", "type")
    cls = EVENT_TYPES.get(etype)
    if cls is None:
        raise EventError(f"unknown event type {etype!r}", "type")
    version = body.get("v")
    # bool is an int in Python (True == 1): a JSON `true` is not version 1.
    if isinstance(version, bool) or version != SCHEMA_VERSION:
        raise EventError(f"unsupported schema version {version!r} (this is v{SCHEMA_VERSION})",
                         "v", etype)
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in body:
            if f.default is MISSING and f.default_factory is MISSING:
                raise EventError(_MISSING_WHY.get(f.name, "missing"), f.name, etype)
            continue
        kwargs[f.name] = _check(f.name, hints[f.name], body[f.name], etype)
    extra = set(body) - {f.name for f in fields(cls)} - set(_ENVELOPE)
    if extra:
        raise EventError(f"unknown field(s) {sorted(extra)}", sorted(extra)[0], etype)
    if issubclass(cls, ServiceEvent) and "stripe" in kwargs and kwargs.get("seq") is None:
        # (once the event is built, an absent stripe and stripe 0 look alike)
        raise EventError("goes only with seq and incarnation", "stripe", etype)
    event = cls(**kwargs)
    _check_semantics(event)
    return event


def _check_semantics(e: Event) -> None:
    etype = e.TYPE
    if isinstance(e, ObjectWritten | ObjectCopied):
        if (e.replaces_ref_id is None) != (e.replaces_address is None):
            raise EventError("replaces_ref_id and replaces_address go together",
                             "replaces_address", etype)
        if e.replaces_ref_id == e.ref_id:
            raise EventError("a reference cannot replace itself", "replaces_ref_id", etype)
    # A repository's namespace is a directory; a retirement names the same one.
    if isinstance(e, RepositoryCreated | RepositoryDeleted) and \
            not e.storage_namespace.endswith("/"):
        raise EventError("must end with '/'", "storage_namespace", etype)
    if isinstance(e, ServiceEvent) and (e.seq is None) != (e.incarnation is None):
        raise EventError("seq and incarnation go together",
                         "incarnation" if e.incarnation is None else "seq", etype)
    if isinstance(e, RangeGone) and e.from_seq > e.to_seq:
        raise EventError(f"must be <= to_seq ({e.to_seq}), got {e.from_seq}", "from_seq", etype)
    if isinstance(e, AddressesReaped) and not 1 <= len(e.addresses) <= MAX_REAPED_PER_EVENT:
        raise EventError(f"must hold 1 to {MAX_REAPED_PER_EVENT} addresses, got "
                         f"{len(e.addresses)}", "addresses", etype)


def required_fields(cls: type[Event]) -> list[str]:
    return [f.name for f in fields(cls)
            if f.default is MISSING and f.default_factory is MISSING]


# --- JSON Schema export, for publishers in other languages ------------------------------------

# Trailing slash, in a pattern that means the same in ECMA-262 and Python's re ("$" would also
# match before a final newline in Python).
_NAMESPACE_PATTERN = "^s3://[\\s\\S]*/(?![\\s\\S])"
# Pairs of optional fields that go together: both present (non-null) or neither.
TOGETHER = (("replaces_ref_id", "replaces_address"), ("seq", "incarnation"))
# (field, the field it needs): present only with the other present (non-null).
ONLY_WITH = (("stripe", "seq"),)


def _json_type(tp: Any, name: str = "", event_type: str = "") -> dict[str, Any]:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = next(a for a in get_args(tp) if a is not type(None))
        schema = _json_type(inner, name, event_type)
        return {"anyOf": [schema, {"type": "null"}]}
    if origin is list:
        return {"type": "array", "items": _json_type(get_args(tp)[0], name, event_type)}
    if origin is dict:
        return {"type": "object",
                "additionalProperties": _json_type(get_args(tp)[1], name, event_type)}
    scalars: dict[Any, dict[str, Any]] = {
        str: {"type": "string", "minLength": 1},
        int: {"type": "integer"},
        float: {"type": "number"},
        bool: {"type": "boolean"},
    }
    out = dict(scalars[tp])
    if tp is int or tp is float:
        out.update(field_range(name, tp, event_type).schema())
    if tp is str and name in MAX_LENGTHS:
        out["maxLength"] = MAX_LENGTHS[name]
    return out


def _present(name: str) -> dict[str, Any]:
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


def json_schema(cls: type[Event]) -> dict[str, Any]:
    """The JSON Schema of one event type: accepts exactly what ``decode`` accepts, except the
    rules no JSON Schema can state (documented in schemas/README.md: a reference replacing
    itself, a ``range_gone`` whose from_seq is above its to_seq, and the tracker's namespace
    checks, which need the repository's namespace)."""
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {
        "type": {"const": cls.TYPE},
        "v": {"const": SCHEMA_VERSION},
    }
    names = [f.name for f in fields(cls)]
    for f in fields(cls):
        prop = _json_type(hints[f.name], f.name, cls.TYPE)
        if f.name == "path":
            prop.pop("minLength", None)
        if f.name in ADDRESS_FIELDS:
            target = prop["anyOf"][0] if "anyOf" in prop else prop
            if target.get("type") == "array":
                target["minItems"], target["maxItems"] = 1, MAX_REAPED_PER_EVENT
                target = target["items"]
            target["pattern"] = (_NAMESPACE_PATTERN if f.name == "storage_namespace"
                                 else "^s3://")
        props[f.name] = prop
    schema: dict[str, Any] = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"hardelete/events/v{SCHEMA_VERSION}/{cls.TYPE}",
        "title": cls.TYPE,
        "description": cls.DOC,
        "type": "object",
        "properties": props,
        "required": ["type", "v", *required_fields(cls)],
        "additionalProperties": False,
    }
    rules = []
    optional = set(names) - set(required_fields(cls))
    for a, b in TOGETHER:
        if a in optional and b in optional:
            rules += [{"if": _present(a), "then": _present(b)},
                      {"if": _present(b), "then": _present(a)}]
    if issubclass(cls, ServiceEvent):
        rules += [{"if": {"required": [a]}, "then": _present(b)} for a, b in ONLY_WITH]
    if rules:
        schema["allOf"] = rules
    return schema
