"""hd:log moves only while the repositories still hold what their chunks applied.

Found by the soak (seed 101, 10^4 operations, every fault): a Redis restored from a copy taken
when the partition's hd:log held the value the tracker last wrote went back between a chunk and
the tracker's hd:log write. The compare on hd:log's value alone succeeded, hd:log moved past the
lost chunk, and its records were never replayed: a write was lost and its object reaped while a
retained commit held it."""

from __future__ import annotations

from typing import Any

import pytest
import redis
import redis.asyncio as aredis

from core.clients import redis_sync
from core.settings import Settings
from schemas.layout import LOG, RepoKeys
from schemas.publisher import ensure_topics
from sim.log_loss import repo_events, write
from sim.testing import publish, wait_horizon
from tracker.daemon import running_tracker
from tracker.state import LOG_WRITE_LUA, ApplyScript, read_repo_state


def test_the_advance_refuses_when_a_repository_lost_its_chunk(redis_client: Any) -> None:
    r = redis_client
    applied = RepoKeys("r").applied
    r.hset(LOG, "t:0", "E:4:fp")
    r.hset(applied, "0", "E:4")  # the chunk that reached offset 7 is gone
    advance = r.register_script(LOG_WRITE_LUA)
    args = ["0", "E", "7", "t:0", "E:4:fp", "E:7:fp2"]
    assert advance(keys=[LOG, applied], args=args) == ["gone", applied, "0"]
    assert r.hget(LOG, "t:0") == "E:4:fp"
    r.hset(applied, "0", "F:9")  # another log's offset proves nothing
    assert advance(keys=[LOG, applied], args=args)[0] == "gone"
    r.hset(applied, "0", "E:7")
    assert advance(keys=[LOG, applied], args=args) == []
    assert r.hget(LOG, "t:0") == "E:7:fp2"


async def test_a_redis_gone_back_between_a_chunk_and_its_log_write_replays_the_chunk(
        settings: Settings, bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    s = settings.replace(topic_partitions=1)
    ns = f"s3://{bucket}/repo0/"
    await ensure_topics(s)
    raw = redis.Redis.from_url(s.redis_url)
    async with running_tracker(s):
        await wait_horizon(s, await publish(s, repo_events(ns)))
        # The backup: hd:log holds what the tracker last wrote; the write below is not in it.
        backup = {k: raw.dump(k) for k in raw.scan_iter()}
        real = ApplyScript.apply_many
        state = {"gone_back": False}

        async def going_back(cls: Any, client: Any, calls: Any, *args: Any,
                             **kwargs: Any) -> Any:
            out = await real(client, calls, *args, **kwargs)
            if not state["gone_back"] and any(b"x1" in c[2] for c in calls):
                state["gone_back"] = True  # restored from the backup, before hd:log moves
                fresh = aredis.Redis.from_url(s.redis_url)
                try:
                    await fresh.flushall()
                    for k, v in backup.items():
                        await fresh.restore(k, 0, v)
                finally:
                    await fresh.aclose()
            return out

        monkeypatch.setattr(ApplyScript, "apply_many", classmethod(going_back))
        await wait_horizon(s, await publish(s, [write("repo0", ns + "data/x", "x1")]))
    raw.close()
    assert state["gone_back"]
    r = redis_sync(s)
    try:
        rec = read_repo_state(r, "repo0").addresses.get(ns + "data/x")
        assert rec is not None and rec.adds == {"x1": "t1"}, "the chunk was never replayed"
    finally:
        r.close()
