"""The one clock (Redis's) and the tracker's horizon on it: the Redis-clock time up to which the
trackers have applied everything the broker held, over *all* partitions of the events topic
(``None`` while any partition has no progress yet: then nothing may be reaped)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from schemas.layout import PROGRESS, PROGRESS_META


def redis_time_ms(r: Any) -> int:
    sec, usec = r.time()
    return int(sec) * 1000 + int(usec) // 1000


async def aredis_time_ms(r: Any) -> int:
    sec, usec = await r.time()
    return int(sec) * 1000 + int(usec) // 1000


def horizon_from(meta: dict[str, str], progress: dict[str, str]) -> int | None:
    """min over every partition of the topic; None if the partition count is unknown or any
    partition has no progress yet (a partition nobody tracks holds everything back).

    Also at most ``verified_ms``: the Redis time before the last metadata request that found
    this partition count. A claim "everything up to R is applied" is only as good as the
    partition list it covers, so it cannot pass the last time that list was proven complete
    (a tracker always writes both; meta written by hand without it is not capped).
    """
    try:
        n = int(meta["partitions"])
    except (KeyError, ValueError):
        return None
    values = []
    if "verified_ms" in meta:
        try:
            values.append(int(meta["verified_ms"]))
        except ValueError:
            return None
    for p in range(n):
        v = progress.get(str(p))
        if v is None:
            return None
        values.append(int(v))
    return min(values) if n > 0 and values else None


def tracker_horizon_ms(r: Any) -> int | None:
    """Redis-clock ms up to which every partition's broker content has been applied."""
    return horizon_from(r.hgetall(PROGRESS_META), r.hgetall(PROGRESS))


async def atracker_horizon_ms(r: Any) -> int | None:
    return horizon_from(await r.hgetall(PROGRESS_META), await r.hgetall(PROGRESS))


async def await_horizon(r: Any, target_ms: int, timeout: float = 30.0,
                        interval: float = 0.02) -> int:
    """Wait until the tracker horizon reaches ``target_ms`` (async client); returns it."""
    deadline = time.monotonic() + timeout
    while True:
        h = await atracker_horizon_ms(r)
        if h is not None and h >= target_ms:
            return h
        if time.monotonic() > deadline:
            raise TimeoutError(f"tracker horizon {h} did not reach {target_ms} in {timeout}s")
        await asyncio.sleep(interval)
