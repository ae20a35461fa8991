"""The control topic: what the tracker asks of the services' relays (schemas/README.md,
"Continuity").

Messages are flat JSON objects like events (``type``, ``v``: 1, then the fields of the type),
published to the control topic (setting ``control_topic``, ``hardelete.control`` by default)
**keyed by repository**. The tracker publishes them; each service's relay consumes the whole
topic and answers those of the repositories its outbox holds, on the events topic:

- ``tick`` {repository, tick_ms, applied, tick_id, sig}: ``tick_ms`` is a time on the
  tracker's Redis clock (the node that holds the repository's records), ``applied`` the
  highest seq the tracker had applied in each stripe when it read that time (read in the same
  script), ``tick_id`` names the tick, ``sig`` is HMAC-SHA256 under the tracker's key over
  all of them (``reaper_auth.seal_tick``). The relay, after receiving it, reads each stripe's
  committed counter M and publishes ``watermark`` (schemas/events.py) with the tick's time,
  applied seqs, id and signature as received. Relays hold no key: they check the format
  only, and the tracker verifies the signature the watermark carries back.
- ``resend`` {repository, stripe, incarnation, from_seq, to_seq}: publish the events of that
  range again from the outbox, or ``range_gone`` for what it no longer has.
- ``broken`` {repository, stripe, incarnation, reason}: the tracker reads that stripe as
  broken. The relay records it in the outbox's database (for the outbox's current incarnation
  only; idempotent) and every later watermark of that stripe and incarnation carries it, so a
  Redis that went back to before the break breaks the stripe again.

:func:`decode` raises :class:`ControlError` naming the field and the problem.
"""

from __future__ import annotations

import typing
import uuid
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, ClassVar

import orjson

from schemas import events as ev
from schemas.reaper_auth import seal_tick

CONTROL_VERSION = 1


class ControlError(ValueError):
    """A control message could not be decoded; ``field`` names the culprit (or ``None``)."""

    def __init__(self, problem: str, field: str | None = None, message_type: str | None = None):
        where = f"field {field!r}: " if field else ""
        what = f"{message_type} message: " if message_type else ""
        super().__init__(f"{what}{where}{problem}")
        self.field = field
        self.problem = problem
        self.message_type = message_type


@dataclass(frozen=True, slots=True, kw_only=True)
class Tick:
    TYPE: ClassVar[str] = "tick"
    repository: str
    tick_ms: int
    applied: list[int]  # per stripe: the highest seq applied when tick_ms was read
    tick_id: str
    sig: str

    @property
    def key(self) -> bytes:
        return self.repository.encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class Resend:
    TYPE: ClassVar[str] = "resend"
    repository: str
    stripe: int
    incarnation: str
    from_seq: int
    to_seq: int

    @property
    def key(self) -> bytes:
        return self.repository.encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class Broken:
    TYPE: ClassVar[str] = "broken"
    repository: str
    stripe: int
    incarnation: str
    reason: str  # (at most MAX_REASON characters: see broken())
    epoch: int = 0  # the stripe's rebuilds when it was read broken (a later rebuild supersedes)

    @property
    def key(self) -> bytes:
        return self.repository.encode()


MAX_REASON = 1000  # events.MAX_LENGTHS["reason"]: a watermark carries it back as ``broken``

ControlMessage = Tick | Resend | Broken
CONTROL_TYPES: dict[str, type[Tick] | type[Resend] | type[Broken]] = {
    Tick.TYPE: Tick, Resend.TYPE: Resend, Broken.TYPE: Broken}


def signed_tick(key: bytes, repository: str, tick_ms: int, applied: list[int] | None = None,
                tick_id: str | None = None) -> Tick:
    """A tick the tracker publishes: ``tick_ms`` and ``applied`` (per stripe) read together
    from the repository's Redis node."""
    tick_id = tick_id or uuid.uuid4().hex
    applied = list(applied or [0])
    return Tick(repository=repository, tick_ms=tick_ms, applied=applied, tick_id=tick_id,
                sig=seal_tick(key, repository, tick_ms, tick_id, applied))


def broken(repository: str, stripe: int, incarnation: str, reason: str,
           epoch: int = 0) -> Broken:
    """A ``broken`` message, its reason cut to what a watermark can carry back."""
    cut = reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 1] + "\u2026"
    return Broken(repository=repository, stripe=stripe, incarnation=incarnation,
                  reason=cut or "(no reason)", epoch=epoch)


def encode(message: ControlMessage) -> bytes:
    body = asdict(message)
    body["type"] = message.TYPE
    body["v"] = CONTROL_VERSION
    return orjson.dumps(body)


def decode(data: bytes | str) -> ControlMessage:
    """Parse and validate one control message; raises ControlError naming the problem."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ControlError(f"not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ControlError(f"expected a JSON object, got {type(body).__name__}")
    mtype = body.get("type")
    if not isinstance(mtype, str):
        raise ControlError("missing or not a string", "type")
    cls = CONTROL_TYPES.get(mtype)
    if cls is None:
        raise ControlError(f"unknown control message type {mtype!r}", "type")
    version = body.get("v")
    if isinstance(version, bool) or version != CONTROL_VERSION:
        raise ControlError(f"unsupported version {version!r} (this is v{CONTROL_VERSION})",
                           "v", mtype)
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in body:
            if f.default is MISSING:
                raise ControlError("missing", f.name, mtype)
            continue
        try:  # the events' field rules: types, ranges, lengths, no empty strings
            kwargs[f.name] = ev._check(f.name, hints[f.name], body[f.name], mtype)
        except ev.EventError as exc:
            raise ControlError(exc.problem, exc.field, mtype) from None
    extra = set(body) - {f.name for f in fields(cls)} - {"type", "v"}
    if extra:
        raise ControlError(f"unknown field(s) {sorted(extra)}", sorted(extra)[0], mtype)
    message = cls(**kwargs)
    if isinstance(message, Resend) and message.from_seq > message.to_seq:
        raise ControlError(f"must be <= to_seq ({message.to_seq}), got {message.from_seq}",
                           "from_seq", mtype)
    return message
