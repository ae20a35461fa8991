"""The cluster's copy of each repository's applied[] (``hd:applied``) is merged per partition:
two trackers of one group never take each other's progress back (found by an adversarial
review: the copy was one JSON value written whole from one tracker's memory, so a delayed write
put back an old applied[0], and a node that then went back to it was not seen)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from core.clients import redis_async
from core.gate import applied_regression
from core.settings import Settings
from schemas.layout import APPLIED, LOG, RepoKeys
from tracker.daemon import Tracker, _Batch
from tracker.state import APPLIED_MERGE_LUA

R = "victim"


class _Log:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def _tracker(redis: Any, epochs: dict[int, str], seen: dict[tuple[str, int], str]) -> Any:
    """The real Tracker's bookkeeping (``_note_applied``) on a real Redis, without its loop."""
    t = Tracker.__new__(Tracker)
    t._redis = redis
    t._epochs = dict(epochs)
    t._applied_seen = dict(seen)
    t._applied_script = redis.register_script(APPLIED_MERGE_LUA)
    t.log = _Log()
    return t


def test_the_copy_shares_the_slot_of_hd_log() -> None:
    from redis.crc import key_slot

    assert key_slot(APPLIED.encode()) == key_slot(LOG.encode())


@pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)
async def test_two_trackers_never_take_each_others_applied_copy_back(
        settings: Settings, topology: str) -> None:
    redis = redis_async(settings)
    node = RepoKeys(R).applied  # the repository's own applied[] (its slot, its node)
    try:
        await redis.hset(node, mapping={"0": "e0:49"})
        await redis.hset(APPLIED, R, orjson.dumps({"0": "e0:49"}).decode())
        seen = {(R, 0): "e0:49"}
        t1 = _tracker(redis, {0: "e0"}, seen)  # owns partition 0 (R's older events)
        t2 = _tracker(redis, {2: "e2"}, seen)  # owns partition 2 (R's key maps there now)
        await redis.hset(node, "2", "e2:5")  # tracker 2 applied R's chunk of partition 2 ...
        snapshot = await redis.hgetall(node)  # (what a stale replica will hold)
        await redis.hset(node, "0", "e0:100")  # ... tracker 1 applied offsets 50..100 of p0
        await t1._note_applied(_Batch(maxoff={(R, 0): 100}))
        await t2._note_applied(_Batch(maxoff={(R, 2): 5}))  # tracker 2's late copy write
        copy = await redis.hget(APPLIED, R)
        assert orjson.loads(copy) == {"0": "e0:100", "2": "e2:5"}
        # the node fails over to the replica without the partition-0 chunk: seen
        why = applied_regression(copy, snapshot)
        assert why is not None and "applied[0]" in why
        # and a stale write of the same log never moves a partition back
        late = _tracker(redis, {0: "e0"}, {(R, 0): "e0:60"})
        await late._note_applied(_Batch(maxoff={(R, 0): 60}))
        assert orjson.loads(await redis.hget(APPLIED, R))["0"] == "e0:100"
        # a new log's value replaces the old log's (its offsets start again)
        fresh = _tracker(redis, {0: "e9"}, {(R, 0): "e9:3"})
        await fresh._note_applied(_Batch(maxoff={(R, 0): 3}))
        assert orjson.loads(await redis.hget(APPLIED, R))["0"] == "e9:3"
    finally:
        await redis.aclose()


@pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)
async def test_a_regressed_repository_stays_unproven_when_its_flag_is_lost_too(
        settings: Settings, topology: str) -> None:
    """Found by an adversarial review: a node went back (caught: fail-closed), then a second
    failover lost the flag too. The tracker had removed the repository from hd:applied, so its
    next chunk (guard ``*``) re-seeded the copy from the regressed node and nothing kept the
    repository. The copy now keeps a ``regressed`` marker until an operator clears it."""
    from core.clients import redis_sync
    from core.gate import read_gate
    from hardelete.failclosed import clear

    redis = redis_async(settings)
    sync = redis_sync(settings)
    node = RepoKeys(R).applied
    try:
        await redis.hset(node, mapping={"0": "e0:90"})  # went back from e0:100
        await redis.hset(APPLIED, R, orjson.dumps({"0": "e0:100"}).decode())
        t = _tracker(redis, {0: "e0"}, {})
        t.fail_closed = 0
        t.settings = settings
        await t._fail_regressed(f'hardelete: log record moved: applied[0] of {R} is "e0:90", '
                                'expected "e0:100"')
        assert read_gate(sync, R).repo_fail_closed is not None
        await redis.delete(RepoKeys(R).fail_closed)  # the second failover lost the flag
        await redis.hset(node, "0", "e0:101")  # the next chunk applied with guard '*'
        await t._note_applied(_Batch(maxoff={(R, 0): 101}))
        why = read_gate(sync, R).repo_fail_closed
        assert why is not None and "went back" in why, why
        # the operator's clear (after a rebuild) lifts it
        await redis.hset(RepoKeys(R).fail_closed, "reason", "x")
        clear(sync, R, reason="rebuilt", who="pytest")
        assert read_gate(sync, R).repo_fail_closed is None
    finally:
        sync.close()
        await redis.aclose()
