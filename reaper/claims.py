"""Atomic claims in Redis (``claims.lua``): the reaper's only way to decide what to delete.

A claim re-checks the address record at claim time on the Redis clock with the one judgment of
liveness (``schemas/liveness.py``, path ``online``: not held, no live reference, never
committed, no unexpired issued upload, unreferenced since before ``horizon - grace``), marks it
``reaping`` with a lease, and moves it from the queue to the claims set. A fail-closed or paused
repository claims nothing. A reaper that dies leaves its claims to expire; they are then taken
again (deleting twice is harmless).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.continuity_store import compose
from schemas.layout import RepoKeys

_SCRIPT = compose((Path(__file__).parent / "claims.lua").read_text())


@dataclass(frozen=True, slots=True)
class Claim:
    address: str
    size: int
    since_ms: int


@dataclass(frozen=True, slots=True)
class ClaimBatch:
    now_ms: int
    claimed: list[Claim]
    kept: list[tuple[str, str]]  # (address, reason it was kept)
    refused: str | None = None  # the repository claims nothing: fail_closed | paused


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class ClaimStore:
    """Claims for one Redis (or Redis Cluster) client; one script call per repository."""

    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self._script = redis.register_script(_SCRIPT)

    @staticmethod
    def _keys(repo: str) -> list[str]:
        k = RepoKeys(repo)
        return [k.unreferenced, k.claims, k.tokens, k.reaped, k.stats, k.holds, k.hold_prefixes,
                k.fail_closed, k.paused, k.meta]

    async def claim(self, repo: str, *, cutoff_ms: int, limit: int, lease_ms: int,
                    claimer: str, grace_ms: int, dry_run: bool = False) -> ClaimBatch:
        raw = await self._script(
            keys=self._keys(repo),
            args=["claim", RepoKeys(repo).address_prefix, cutoff_ms, limit, lease_ms, claimer,
                  "1" if dry_run else "0", RepoKeys(repo).tag + ":", grace_ms],
        )
        now, claimed, kept = raw[0], raw[1], raw[2]
        return ClaimBatch(
            now_ms=int(now),
            claimed=[Claim(_text(a), int(s), int(t)) for a, s, t in claimed],
            kept=[(_text(a), _text(r)) for a, r in kept],
            refused=_text(raw[3]) if len(raw) > 3 else None,
        )

    async def complete(self, repo: str, addresses: list[str]) -> int:
        """Mark addresses whose delete the store confirmed as reaped (tombstones)."""
        if not addresses:
            return 0
        done = await self._script(keys=self._keys(repo),
                                  args=["complete", RepoKeys(repo).address_prefix, *addresses])
        return int(done)

    async def prune(self, repo: str, *, tombstone_ms: int, limit: int = 1000) -> int:
        """Forget tombstones older than tombstone_ms (late references are caught until then)."""
        n = await self._script(keys=self._keys(repo),
                               args=["prune", RepoKeys(repo).address_prefix, tombstone_ms, limit])
        return int(n)

    async def restore(self, repo: str, address: str) -> str:
        """After a quarantined object is copied back: recompute its state from its record."""
        state = await self._script(keys=self._keys(repo),
                                   args=["restore", RepoKeys(repo).address_prefix, address])
        return _text(state)
