"""Only the reaper vouches for a deletion: ``addresses_reaped`` records are signed.

An ``addresses_reaped`` record says "the store confirmed these deletes": applied, it moves the
addresses to ``reaped``, and the reaper later prunes such tombstones. Publishers write the
events topic, so an unsigned record could be forged by any of them. The reaper signs what it
publishes with HMAC-SHA256 under a key publishers do not hold; the tracker verifies before it
applies, and dead-letters a record that does not verify (with a ``forged_reap`` incident).

The key: the ``reaper_secret`` setting when set (operators share it between reaper and tracker
like any secret), else one minted in the tracker's Redis (``hd:reaperkey``, SET NX: the first
daemon to start mints it, every other one reads it). Publishers are given the broker, never
the tracker's Redis, so they hold neither. A Redis restored from a copy older than the key
mints a new one; records signed with the lost key then fail verification on replay and are
dead-lettered (safe: the addresses stay in their tracked state and the reaper, finding the
object gone, records it again).

The signed message covers every field a record's effect depends on: repository, reaper, event
id and the addresses in order.

The same key signs the tracker's dead letters (:func:`seal_dead_letter`): ``hardelete dlq
resolve`` lifts a dead letter's holds only when the tracker wrote it, since any publisher can
write the dead-letter topic too. And it signs the tracker's ticks (:func:`seal_tick`), which
the services' watermarks carry back (schemas/README.md, "Continuity"). Messages are
domain-separated: an ``addresses_reaped`` message (the first form, kept so that records
already in the log still verify) starts with the length of its first field; every other
domain's starts with :data:`DOMAIN_MARK`, a length no field has (fields are far below 4 GiB),
then its domain name. So no signature of one domain is a signature of another.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from schemas.layout import REAPER_KEY

DOMAIN_MARK = b"\xff\xff\xff\xff"  # starts every message but addresses_reaped's
DEAD_LETTER = "hardelete/dead_letter/1"
KEY_ID = "hardelete/key_id/1"
TICK = "tick"


def _fields(parts: Iterable[str]) -> bytes:
    # Length-prefixed fields: no two different field lists share a message.
    return b"".join(len(p.encode()).to_bytes(4, "big") + p.encode() for p in parts)


def domain_message(domain: str, parts: Iterable[str]) -> bytes:
    """The message of ``parts`` in ``domain`` (never an ``addresses_reaped`` message)."""
    return DOMAIN_MARK + _fields([domain, *parts])


def message(repository: str, reaper: str, event_id: str, addresses: Sequence[str]) -> bytes:
    return _fields([repository, reaper, event_id, *addresses])


def _mac(key: bytes, msg: bytes) -> str:
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def sign(key: bytes, repository: str, reaper: str, event_id: str,
         addresses: Sequence[str]) -> str:
    return _mac(key, message(repository, reaper, event_id, addresses))


def key_id(key: bytes) -> str:
    """A name of the key (a MAC, not the key): tells a dead letter signed under a key this
    Redis no longer has from one whose signature is wrong."""
    return _mac(key, domain_message(KEY_ID, []))[:16]


def verify(key: bytes, body: dict[str, Any]) -> bool:
    """Does this ``addresses_reaped`` body carry the reaper's signature under ``key``?"""
    signature = body.get("signature")
    if not isinstance(signature, str) or not signature or not key:
        return False
    expected = sign(key, body["repository"], body["reaper"], body["event_id"],
                    body["addresses"])
    return hmac.compare_digest(signature, expected)


def problem(key: bytes | None, body: dict[str, Any]) -> str | None:
    """Why the tracker must refuse this ``addresses_reaped`` body (dead letter and a
    ``forged_reap`` incident), or None when the reaper signed it."""
    if key is not None and verify(key, body):
        return None
    return ("forged addresses_reaped: no valid reaper signature (only the reaper may assert a "
            "deletion)")


# --- ticks ----------------------------------------------------------------------------------
# The tracker's tick (schemas/control.py) names a time on its own Redis clock and the seq it
# had applied in each stripe then; the service's watermark answering it carries them, the
# tick's id and signature back. Only the tracker may say when a tick happened (a forged tick
# could certify a horizon that never came) and what it had applied (a lower figure would hide
# a relay that lags).

def tick_message(repository: str, tick_ms: int, tick_id: str,
                 applied: Sequence[int] = ()) -> bytes:
    return domain_message(TICK, [repository, str(tick_ms), tick_id,
                                 ",".join(str(a) for a in applied)])


def seal_tick(key: bytes, repository: str, tick_ms: int, tick_id: str,
              applied: Sequence[int] = ()) -> str:
    return _mac(key, tick_message(repository, tick_ms, tick_id, applied))


def tick_problem(key: bytes | None, repository: str, tick_ms: int, tick_id: str,
                 signature: str | None, applied: Sequence[int] = ()) -> str | None:
    """Why this tick (or the watermark carrying it back) is not one the tracker signed under
    ``key`` (one line), or None."""
    if not signature:
        return "the tick carries no signature"
    if not key:
        return "no tracker key to verify the tick with"
    if not hmac.compare_digest(signature, seal_tick(key, repository, tick_ms, tick_id, applied)):
        return "the tick's signature does not verify (forged, or signed under another key)"
    return None


# --- dead letters ---------------------------------------------------------------------------

def record_digest(key: bytes | None, value: bytes) -> str:
    """The digest of a dead letter's record as written (key and value, possibly cut)."""
    h = hashlib.sha256()
    for part in (key, value):
        h.update(b"-" if part is None else b"+" + len(part).to_bytes(8, "big") + part)
    return h.hexdigest()


@dataclass(frozen=True)
class DeadLetterFields:
    """Every field ``dlq resolve`` acts on (or shows as the dead letter's origin)."""

    claim: str  # the claim id its holds carry
    topic: str  # where the record was in the events topic
    partition: str
    offset: str
    reason: str
    digest: str  # record_digest of the dead letter's key and value as written
    held: tuple[tuple[str, str], ...]  # (repository, target) the tracker held for it

    def message(self) -> bytes:
        return domain_message(DEAD_LETTER, [
            self.claim, self.topic, self.partition, self.offset, self.reason, self.digest,
            str(len(self.held)), *(x for pair in self.held for x in pair)])


def seal_dead_letter(key: bytes, fields: DeadLetterFields) -> str:
    return _mac(key, fields.message())


def dead_letter_problem(key: bytes | None, fields: DeadLetterFields, signature: str | None,
                        signed_by: str | None) -> str | None:
    """Why this dead letter is not one the tracker wrote under ``key`` (one line), or None."""
    if not signature:
        return ("it carries no tracker signature (written before the tracker signed its dead "
                "letters, or not by the tracker)")
    if key is None:
        return "no tracker key to verify it with (none in Redis: the key was lost)"
    if signed_by and signed_by != key_id(key):
        return ("it was signed under a tracker key this Redis no longer has (the key was "
                "re-minted, e.g. Redis went back to a copy older than it, or reaper_secret "
                "changed)")
    if not hmac.compare_digest(signature, seal_dead_letter(key, fields)):
        return "its signature does not verify (forged, or altered after the tracker wrote it)"
    return None


def load_key(redis: Any, secret: str = "") -> bytes | None:
    """The signing key as a reader sees it (synchronous; never mints one): None when Redis
    has none."""
    if secret:
        return secret.encode()
    raw = redis.get(REAPER_KEY)
    if raw is None:
        return None
    return raw.encode() if isinstance(raw, str) else bytes(raw)


async def aload_key(redis: Any, secret: str = "") -> bytes:
    """The signing key: the configured secret, else the one in Redis (minted if absent)."""
    if secret:
        return secret.encode()
    await redis.set(REAPER_KEY, secrets.token_hex(32), nx=True)
    raw = await redis.get(REAPER_KEY)
    if raw is None:  # pragma: no cover - deleted between the two calls
        raise RuntimeError("the reaper key vanished from Redis")
    return raw.encode() if isinstance(raw, str) else bytes(raw)
