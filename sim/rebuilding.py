"""Test support for the rebuild (tracker/rebuild.py): a repository flagged as a lost log would
flag it, the model service's export, the mirror's view of an address, and a repository's slot
failing over to a replica that holds an older copy."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from core.clock import redis_time_ms
from schemas.layout import RepoKeys
from sim.testing import slot_go_back
from sim.worlds import World
from tracker.state import read_repo_state

MAX_AGE = 86_400_000  # ms: an export this old is still fresh enough for the tests


def call(w: World, fn: Any, *args: Any, **kwargs: Any) -> Any:
    return asyncio.run(w.svc.call(fn, *args, **kwargs))


def lose_log(w: World, repo: str) -> None:
    """The tracker found the log gone: what it writes for each repository."""
    k = RepoKeys(repo)
    w.r.hsetnx(k.fail_closed, "reason", "log reset or re-created")
    w.r.hsetnx(k.fail_closed, "at_ms", str(redis_time_ms(w.r)))
    w.r.hincrby(k.fail_closed, "losses", 1)


def past_upload_windows(w: World, repo: str) -> None:
    """Wait until every upload window the mirror holds for ``repo`` has ended, so an address
    whose last reference ends is 'unreferenced', not 'issued' (a fast run can otherwise end a
    reference inside the window)."""
    ends = [rec.issued_until for rec in read_repo_state(w.r, repo).addresses.values()
            if rec.issued_until is not None]
    end = max(ends, default=0)
    while redis_time_ms(w.r) <= end:
        time.sleep(0.01)


def export(w: World, repo: str, nonce: str) -> str:
    result: str = asyncio.run(w.svc.write_state_export(repo, nonce))
    return result


def state_of(w: World, repo: str, address: str) -> str:
    st = read_repo_state(w.r, repo)
    rec = st.addresses.get(address)
    return "none" if rec is None or rec.state is None else str(rec.state)


def reapable(w: World, repo: str, address: str) -> bool:
    """Would the online path take it once grace has passed (horizon far ahead)?"""
    st = read_repo_state(w.r, repo)
    return bool(st.reapable(address, redis_time_ms(w.r) + 10 * 86_400_000, 0))


def fail_over_to(r: Any, repo: str, copy: dict[Any, bytes]) -> None:
    """The slot's node fails over to the replica holding ``copy`` (the other slots stay)."""
    slot_go_back(r, repo, copy)
