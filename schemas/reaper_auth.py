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
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from typing import Any

from schemas.layout import REAPER_KEY


def message(repository: str, reaper: str, event_id: str, addresses: Sequence[str]) -> bytes:
    # Length-prefixed fields: no two different records share a message.
    parts = [repository, reaper, event_id, *addresses]
    return b"".join(len(p.encode()).to_bytes(4, "big") + p.encode() for p in parts)


def sign(key: bytes, repository: str, reaper: str, event_id: str,
         addresses: Sequence[str]) -> str:
    return hmac.new(key, message(repository, reaper, event_id, addresses),
                    hashlib.sha256).hexdigest()


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


async def aload_key(redis: Any, secret: str = "") -> bytes:
    """The signing key: the configured secret, else the one in Redis (minted if absent)."""
    if secret:
        return secret.encode()
    await redis.set(REAPER_KEY, secrets.token_hex(32), nx=True)
    raw = await redis.get(REAPER_KEY)
    if raw is None:  # pragma: no cover - deleted between the two calls
        raise RuntimeError("the reaper key vanished from Redis")
    return raw.encode() if isinstance(raw, str) else bytes(raw)
