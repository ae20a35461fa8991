"""Adversarial review (atk7) of the slot clock (schemas/README.md, "Continuity", A7) on the
online delete path of a SEQUENCED repository, on the real stack: a service with an outbox and
its relay, the tracker, the reaper, MinIO, and a valkey-server whose clock the test shifts
(``sim.clockshim``). Each test asserts the SAFE outcome (the live object survives); a test
marked ``xfail(strict=True)`` deletes a live object today (``--runxfail`` shows the deletion).
Both findings here are held: a watermark certifies only a tick whose reading its slot still
holds (``hd:{R}:ticks``); with that check removed both tests delete the live object.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.clients import redis_sync
from core.continuity_store import ContinuityStore
from core.settings import Settings
from sim.clockshim import FailoverPair, ShiftedRedis
from sim.sequenced import (
    REPO,
    copy,
    delete,
    holding_service,
    manual_ticker,
    reap,
    until,
    write,
)
from sim.testing import keys_copy, keys_go_back, redis_now
from tracker.daemon import running_tracker

GRACE_S = 5.0
SKEW_S = 1.0  # the product's default clock_skew_seconds
BEHIND_S = 12.0  # the node's clock after the failover: behind by more than grace + skew


@pytest.fixture
def clocked(settings: Settings, shifted_redis: ShiftedRedis) -> Iterator[Settings]:
    """The test's settings on the shifted server (flushed, its clock the machine's), ticks
    only when the test asks (the tracker's own tick once, when it starts)."""
    shifted_redis.shift(0)
    s = settings.replace(redis_url=shifted_redis.url, redis_cluster=False,
                         tick_interval_seconds=3600.0, resend_interval_seconds=0.3,
                         grace_seconds=GRACE_S, clock_skew_seconds=SKEW_S)
    r = redis_sync(s)
    r.flushall()
    r.close()
    yield s
    shifted_redis.shift(0)


async def settled(store: ContinuityStore, target_ms: int, timeout: float = 10.0) -> Any:
    """The stripe once its horizon reaches ``target_ms`` or it broke, or after ``timeout``
    (a watermark that certifies nothing leaves no other trace to wait for)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        d = store.read(REPO, 0)
        if d.broken is not None or (d.horizon_ms or 0) >= target_ms \
                or asyncio.get_running_loop().time() > deadline:
            return d
        await asyncio.sleep(0.05)


# --- 1. a tick read on a slot state that is then lost -------------------------------------------

async def test_a_tick_read_on_a_slot_state_that_is_lost_certifies_no_since_stamped_below_it(
        clocked: Settings, s3: Any, tmp_path: Path, shifted_redis: ShiftedRedis) -> None:
    """A is written (r1, seq 3) and certified. The slot's state S is what a replica (or a
    backup) holds: the slot clock at c_S. Time passes (> grace + skew). The service starts a
    copy of A into b: it reads r1. It deletes r1 (seq 4, its publish slow). The Ticker reads
    its tick at slot clock c >= c_S + grace + skew (hd:{R}:clock = c) and publishes R = c -
    skew; the relay honestly answers M = 4 (its watermark, like any publish, reaches the
    tracker late). The copy commits (r2, seq 5) within grace of its read (A4), its publish
    lost. The repository's node then fails over to the replica holding S (only the tick's
    own clock write is lost: no record, no applied offset, so no log forensics fire), whose
    clock is BEHIND_S behind (A7: a clock behind needs no bound, the slot clock only stalls,
    at what the slot last read, c_S). The delete reaches the tracker: since(A) = max(node
    clock, c_S), far below c - skew - grace; the watermark follows: prefix 4 >= M = 4, the
    horizon jumps to R = c - skew. Every assumption A1-A7 holds: the relay's promise is true
    (every event committed before the tick read has seq <= 4), the slot clock never gains on
    real time. A is live at the service through r2 and must survive."""
    s = clocked
    r = redis_sync(s)
    store = ContinuityStore(r)
    pattern = f"hd:{{{REPO}}}:*"
    clock_key = f"hd:{{{REPO}}}:clock"
    async with holding_service(s, s3, tmp_path) as (svc, relay), manual_ticker(s) as ticker, \
            running_tracker(s):
        a = svc.store("data/a")
        svc.emit(write("a", a, "r1"))
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 3)
        await ticker.round()
        await until(lambda: store.read(REPO, 0), lambda d: d.horizon_ms is not None)
        replica = keys_copy(r, pattern)  # the slot as the replica (or a backup) holds it
        c_s = int(r.get(clock_key))
        while await redis_now(s) < c_s + int((GRACE_S + SKEW_S) * 1000) + 300:
            await asyncio.sleep(0.05)  # (time passes; nothing of the slot changes)
        assert int(r.get(clock_key)) == c_s
        # the copy of A reads r1 here; then r1 is deleted
        gone = delete("a", a, "r1")
        relay.hold_ids.add(gone.event_id)  # (its publish is slow)
        svc.emit(gone)
        relay.hold = True  # (the tracker is behind the relay's watermarks)
        done = await ticker.round()
        assert done.ticks == 1, done
        c = int(r.get(clock_key))
        await until(lambda: relay.held, lambda h: len(h) >= 2)  # the delete and M = 4 at c - skew
        lost = copy("b", a, "r2")
        relay.drop.add(lost.event_id)
        svc.emit(lost)  # committed after the relay read M = 4
        # The node fails over to the replica: it lacks only the tick's clock write, and its
        # clock is behind.
        keys_go_back(r, replica, pattern)
        shifted_redis.shift(-BEHIND_S)
        assert store.read(REPO, 0).prefix == 3 and int(r.get(clock_key)) == c_s
        await relay.release(relay.held)  # the slow publishes reach the tracker
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 4)
        d = await settled(store, c - int(1000 * SKEW_S))  # (the watermark, applied)
        since = int(r.hget(f"hd:{{{REPO}}}:a:{a}", "since"))
        report = await reap(s, s3)
        assert svc.exists(a), (report, d, since, c)  # r2 (open token) references A
    r.close()


# --- 1b. the same on a Redis Cluster: a forced failover to a replica that lags and runs behind --

def cut_replication(pair: FailoverPair) -> None:
    """The replica stops receiving the primary's writes (a partition between them): its link
    is dropped and it cannot authenticate again."""
    import redis as redis_lib

    q = redis_lib.Redis(port=pair.replica.server.port)
    p = redis_lib.Redis(port=pair.primary.server.port)
    try:
        q.config_set("masterauth", "not-the-primarys")
        p.execute_command("CLIENT", "KILL", "TYPE", "replica")  # type: ignore[no-untyped-call]
        deadline = time.monotonic() + 30
        while q.info("replication").get("master_link_status") != "down":
            assert time.monotonic() < deadline, "the replica's link stayed up"
            time.sleep(0.02)
    finally:
        p.close()
        q.close()


def replica_value(pair: FailoverPair, key: str) -> str | None:
    """``key`` as the replica holds it."""
    import redis as redis_lib

    q = redis_lib.Redis(port=pair.replica.server.port, decode_responses=True)
    try:
        q.execute_command("READONLY")  # type: ignore[no-untyped-call]
        value = q.get(key)
        return None if value is None else str(value)
    finally:
        q.close()


def takeover(pair: FailoverPair) -> None:
    """A forced failover (CLUSTER FAILOVER TAKEOVER): the replica becomes primary with what
    it holds, as when the primary is unreachable."""
    import redis as redis_lib

    q = redis_lib.Redis(port=pair.replica.server.port)
    try:
        q.config_set("masterauth", "")
        q.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")  # type: ignore[no-untyped-call]
        deadline = time.monotonic() + 30
        while q.info("replication").get("role") != "master":
            assert time.monotonic() < deadline, "the failover did not complete"
            time.sleep(0.02)
    finally:
        q.close()


async def test_a_forced_failover_to_a_lagging_replica_behind_keeps_a_copys_object(
        settings: Settings, s3: Any, tmp_path: Path, failover_pair: FailoverPair) -> None:
    """Test 1 on a Redis Cluster of a primary and its replica, each with its own clock, the
    replica's BEHIND_S behind (A7: a failover to a replica whose clock is behind needs no
    bound). A is written (r1, seq 3) and certified. The replica's link drops (a partition);
    time passes (> grace + skew) with nothing written to the slot. A copy of A reads r1; r1
    is deleted (seq 4, its publish slow); the Ticker reads its tick on the primary at c; the
    relay answers M = 4 (the tracker lags behind the relay's watermarks); the copy commits
    (r2, seq 5, publish lost). The primary is cut off and the replica takes over with what it
    holds: all but the tick's clock write. A, live at the service through r2, must survive."""
    s = settings.replace(redis_url=failover_pair.url, redis_cluster=True,
                         tick_interval_seconds=3600.0, resend_interval_seconds=0.3,
                         grace_seconds=GRACE_S, clock_skew_seconds=SKEW_S)
    failover_pair.replica.shift(-BEHIND_S)
    clock_key = f"hd:{{{REPO}}}:clock"
    async with holding_service(s, s3, tmp_path) as (svc, relay), manual_ticker(s) as ticker, \
            running_tracker(s):
        r = redis_sync(s)
        store = ContinuityStore(r)
        a = svc.store("data/a")
        svc.emit(write("a", a, "r1"))
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 3)
        await ticker.round()
        await until(lambda: store.read(REPO, 0), lambda d: d.horizon_ms is not None)
        await asyncio.to_thread(cut_replication, failover_pair)
        c_s = int(r.get(clock_key))
        while await redis_now(s) < c_s + int((GRACE_S + SKEW_S) * 1000) + 300:
            await asyncio.sleep(0.05)  # (time passes; nothing of the slot changes)
        assert int(r.get(clock_key)) == c_s
        gone = delete("a", a, "r1")  # (the copy of A read r1 before this)
        relay.hold_ids.add(gone.event_id)
        svc.emit(gone)
        relay.hold = True
        done = await ticker.round()
        assert done.ticks == 1, done
        c = int(r.get(clock_key))
        await until(lambda: relay.held, lambda h: len(h) >= 2)  # the delete and M = 4 at c - skew
        lost = copy("b", a, "r2")
        relay.drop.add(lost.event_id)
        svc.emit(lost)  # committed after the relay read M = 4
        assert replica_value(failover_pair, clock_key) == str(c_s)  # (the link stayed down)
        await asyncio.to_thread(takeover, failover_pair)
        await until(lambda: store.read(REPO, 0).prefix, lambda p: p == 3)
        await relay.release(relay.held)  # the slow publishes reach the tracker
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 4)
        d = await settled(store, c - int(1000 * SKEW_S))
        since = int(r.hget(f"hd:{{{REPO}}}:a:{a}", "since"))
        report = await reap(s, s3)
        assert svc.exists(a), (report, d, since, c, c_s)  # r2 (open token) references A
        r.close()
