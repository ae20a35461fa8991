"""Adversarial review (atk5) of the online delete path for SEQUENCED repositories
(schemas/README.md, "Continuity"), on the real stack: a service with an outbox and its relay,
the tracker (ticks, watermarks, re-sends), the reaper, MinIO. Each test asserts the SAFE outcome
(the live object survives); a test marked ``xfail(strict=True)`` deletes a live object today
(``--runxfail`` shows the deletion).

The clock tests run their own valkey-server with a small ``LD_PRELOAD`` shim that shifts its
wall clock (``TIME``, the only clock the proof reads) by an offset the test sets while it runs:
what a node's clock does when NTP steps it, or what the repository's slot sees when it fails
over to a replica whose clock differs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest

from core.clients import redis_sync
from core.continuity_store import ContinuityStore
from core.settings import Settings
from schemas import events as ev
from schemas.outbox import Outbox
from schemas.publisher import Publisher
from sim.clockshim import FailoverPair, ShiftedRedis
from sim.sequenced import (
    REPO,
    LossyRelay,
    Service,
    copy,
    delete,
    holding_service,
    manual_ticker,
    reap,
    service,
    until,
    wait_log,
    write,
)
from sim.testing import keys_copy, keys_go_back, redis_now
from tracker.daemon import running_tracker


@pytest.fixture
def skewed(settings: Settings, shifted_redis: ShiftedRedis) -> Iterator[Settings]:
    """The test's settings on the shifted server (flushed, clock back to the machine's), with
    a grace that leaves the service's copy well within A4."""
    shifted_redis.shift(0)
    s = settings.replace(redis_url=shifted_redis.url, redis_cluster=False,
                         tick_interval_seconds=0.1, resend_interval_seconds=0.3,
                         grace_seconds=GRACE_S)
    r = redis_sync(s)
    r.flushall()
    r.close()
    yield s
    shifted_redis.shift(0)


GRACE_S = 5.0
STEP_S = 2.5  # a forward step smaller than grace
SHIFT_S = 12.0  # a backward step: more than grace











# --- 1. the horizon is certified on one clock, since(A) was stamped on another ---------------

async def test_a_clock_stepping_forward_between_since_and_the_tick_keeps_a_copys_object(
        skewed: Settings, s3: Any, tmp_path: Path, shifted_redis: ShiftedRedis) -> None:
    """A is written (r1, seq 3). The service starts a copy of A into b: it reads r1 (time
    ``read``). r1 is deleted (seq 4): the mirror holds A unreferenced since s, on the node's
    clock. The copy is slow (within A4: it commits less than grace after its read). About
    grace - STEP_S after s the node's clock steps forward by STEP_S (< grace). The next tick
    reads the slot clock c >= s + grace; the relay, honestly, answers M = 4 (everything
    committed so far); the prefix covers it. The copy then commits (r2, seq 5), its publish
    slow (lost for now, re-sends too). Every assumption A1-A6 holds and the relay's promise
    holds in real time. A tick carrying R = c (the slot clock read raw) certified a horizon
    R - grace >= s, and the reaper deleted A while r2 (open token) references it: any forward
    step D > 0 opened such a window, D wide, for a copy slow enough. Held: with A7 (the slot
    clock gains at most ``clock_skew_seconds`` = STEP_S) the tick carries R = c - skew."""
    skewed = skewed.replace(clock_skew_seconds=STEP_S)  # A7: the step is within the bound
    async with service(skewed, s3, tmp_path) as svc, running_tracker(skewed):
        r = redis_sync(skewed)
        store = ContinuityStore(r)
        a = svc.store("data/a")
        svc.emit(write("a", a, "r1"))
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 3 and d.horizon_ms)
        read = time.monotonic()  # the copy reads its source entry r1
        svc.emit(delete("a", a, "r1"))
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 4)
        since = int(r.hget(f"hd:{{{REPO}}}:a:{a}", "since"))
        grace_ms, step_ms = int(GRACE_S * 1000), int(STEP_S * 1000)
        while await redis_now(skewed) < since + grace_ms - step_ms + 200:
            await asyncio.sleep(0.05)
        shifted_redis.shift(STEP_S)  # the node's clock steps forward
        stepped = await redis_now(skewed)  # (>= s + grace on the stepped clock)
        await until(lambda: store.read(REPO, 0).horizon_ms or 0,  # a tick read since certified
                    lambda h: h >= stepped - step_ms)
        lost = copy("b", a, "r2")
        svc.relay.drop.add(lost.event_id)
        svc.emit(lost)  # committed after the relay read M = 4
        assert time.monotonic() - read < GRACE_S  # A4: the copy commits within grace of its read
        await wait_log(skewed)
        report = await reap(skewed, s3)
        assert svc.exists(a), (report, store.read(REPO, 0), since)  # r2 references A


async def test_a_clock_stepping_back_under_a_certified_horizon_keeps_a_copys_object(
        skewed: Settings, s3: Any, tmp_path: Path, shifted_redis: ShiftedRedis) -> None:
    """The node's clock runs SHIFT_S ahead; A is written (r1, seq 3) and the horizon is
    certified at R (node clock). The clock steps back to the machine's (an NTP step, a
    failover to a replica whose clock is right): ticks now read times below R and certify
    nothing new, so the horizon stays at R. The service copies A (r2, seq 4, publish lost) and
    deletes r1 (seq 5, applied): since(A) = s, stamped on the new clock, below R - grace. The
    relay never said anything about seq 4 at any R' >= s; a since stamped on the node's raw
    clock let the reaper delete A anyway. Held: the slot clock never goes back (it stalls at
    the highest time its scripts read), so since(A) is stamped at or above R."""
    shifted_redis.shift(SHIFT_S)
    async with service(skewed, s3, tmp_path) as svc, running_tracker(skewed):
        r = redis_sync(skewed)
        store = ContinuityStore(r)
        a = svc.store("data/a")
        svc.emit(write("a", a, "r1"))
        ahead = await redis_now(skewed)
        await until(lambda: store.read(REPO, 0),
                    lambda d: d.prefix == 3 and (d.horizon_ms or 0) >= ahead)
        shifted_redis.shift(0)  # the clock steps back
        from hardelete.status import continuity_view
        view = continuity_view(r, REPO, 1)  # status says why the horizon waits
        assert view.clock_ahead_ms > (SHIFT_S - 2) * 1000, view
        assert "ahead of its node's" in view.text(await redis_now(skewed)), view
        lost = copy("b", a, "r2")
        svc.relay.drop.add(lost.event_id)
        svc.emit(lost)
        svc.emit(delete("a", a, "r1"))
        await until(lambda: store.read(REPO, 0), lambda d: 5 in d.above)
        await wait_log(skewed)
        report = await reap(skewed, s3)
        since = r.hget(f"hd:{{{REPO}}}:a:{a}", "since")
        assert svc.exists(a), (report, store.read(REPO, 0), since)  # r2 references A


# --- 3. a tick the tracker read while the stripe was broken, answered before the relay kept it --

@pytest.mark.parametrize("topology", ["cluster"], indirect=True)
async def test_a_tick_read_on_a_broken_stripe_certifies_nothing_once_the_slot_went_back(
        settings: Settings, s3: Any, tmp_path: Path, topology: str) -> None:
    """The claim of schemas/README.md ("A break is durable at the service"): once the outbox
    holds the break, a slot that goes back breaks the stripe again with the first watermark it
    applies, before any watermark can certify it.

    A is written (r1, seq 3) and certified; a copy of A reads r1; r1 is deleted (seq 4): A is
    unreferenced since s, no watermark certifies past s yet. The copy (r2) was committed
    within grace but is published late and outside the outbox (A1 broken, as in
    test_atk_online_sequenced's lost-break tests): applied past s + grace, it breaks stripe 0.
    The Ticker's next round used to read its tick R1 (> the break: the tracker KNEW the stripe
    was broken when it signed R1) and then tell the relay of the break; the relay answered R1
    first (watermark M = 4, no break: it had not read the `broken` message yet), then kept
    the break, then went down. Now no tick is read while a stripe is broken (atomically with
    the time, tracker/ticks.py). The tracker is behind the events topic (its node fails over
    meanwhile, to a replica that lacks the break); the answer to R1 is the first watermark the
    restored slot applies: the prefix covers M = 4 and the horizon jumps to R1 >= s + grace.
    The log forensics' flag is cleared by the operator, as in that test; A must survive."""
    from redis.cluster import RedisCluster

    from hardelete.failclosed import clear

    s = settings.replace(tick_interval_seconds=3600.0, resend_interval_seconds=0.3)
    raw: Any = RedisCluster.from_url(s.redis_url)
    pattern = f"hd:{{{REPO}}}:*"
    async with holding_service(s, s3, tmp_path) as (svc, relay), manual_ticker(s) as ticker:
        r = redis_sync(s)
        store = ContinuityStore(r)
        a = svc.store("data/a")
        async with running_tracker(s, name="t1"):
            svc.emit(write("a", a, "r1"))
            await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 3)
            await ticker.round()
            await until(lambda: store.read(REPO, 0), lambda d: d.horizon_ms is not None)
            svc.emit(delete("a", a, "r1"))  # (the copy read r1 before this)
            await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 4)
            since = int(r.hget(f"hd:{{{REPO}}}:a:{a}", "since"))
            await asyncio.sleep(s.grace_seconds + 0.5)
            await wait_log(s)
            snap = keys_copy(raw, pattern)  # the replica the node will fail over to
            async with Publisher(s) as pub:  # the copy, late and without a seq
                await pub.publish_many([copy("b", a, "r2")])
            await until(lambda: store.read(REPO, 0), lambda d: d.broken is not None)
            broken_at = await redis_now(s)
            relay.hold = True  # (from here the tracker lags behind the relay's watermarks)
            done = await ticker.round()  # (was: tick R1, then `broken`)
            assert done.breaks, done
            await until(lambda: svc.outbox.breaks(REPO), bool)  # the service keeps the break
            await relay.stop()  # ... and goes down
            answers = [ev.decode(v) for v, _ in relay.held]
            # No tick is read while the stripe is broken, so nothing answers one past the
            # break (before the fix the relay answered R1 >= s + grace without the break).
            assert done.ticks == 0 and not [
                w for w in answers if isinstance(w, ev.Watermark) and w.broken is None
                and w.tick_ms > broken_at], (done, answers)
            await wait_log(s)
        keys_go_back(raw, snap, pattern)  # the repository's node fails over to a lagging replica
        assert store.read(REPO, 0).broken is None
        async with running_tracker(s, name="t2"):
            await relay.release(relay.held)  # the tracker reaches the relay's answers
            await wait_log(s)
            d = store.read(REPO, 0)  # (none certifies past the break)
            assert d.broken is not None or (d.horizon_ms or 0) <= since, d
            clear(r, REPO, reason="continuity certifies the repository", who="op")
            report = await reap(s, s3)
            assert svc.exists(a), (report, d)  # r2 (open token) references A at the service
    raw.close()


# --- held: a break the restored store refuses (an older incarnation's) is made again ---------

@pytest.mark.parametrize("topology", ["cluster"], indirect=True)
async def test_a_break_kept_for_no_incarnation_is_made_again_by_the_restored_stores_watermark(
        settings: Settings, s3: Any, tmp_path: Path, topology: str) -> None:
    """A is written (r1, seq 3); the service's store is backed up; r1 is deleted (seq 4): A
    unreferenced since s in the mirror. The store is restored from the backup (r1 live again at
    the service) with a new incarnation Y, as the contract asks: Y's first watermark breaks
    stripe 0 (bound to X). The Ticker reports the break under the stripe's incarnation X,
    which the restored outbox does not keep (only its own): the service holds no break. The
    repository's node then fails over to a replica from before the break (X bound, A
    unreferenced). Held: Y's next watermark breaks the stripe again (a changed incarnation), so
    nothing is certified and A, live at the service through r1, survives."""
    import sqlite3
    from contextlib import closing

    from redis.cluster import RedisCluster

    from hardelete.failclosed import clear

    s = settings.replace(tick_interval_seconds=0.1, resend_interval_seconds=0.3)
    raw: Any = RedisCluster.from_url(s.redis_url)
    pattern = f"hd:{{{REPO}}}:*"
    async with service(s, s3, tmp_path) as svc:
        r = redis_sync(s)
        store = ContinuityStore(r)
        a = svc.store("data/a")
        async with running_tracker(s, name="t1"):
            svc.emit(write("a", a, "r1"))
            await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 3 and d.horizon_ms)
            with closing(sqlite3.connect(tmp_path / "backup.db")) as backup, \
                    closing(sqlite3.connect(svc.outbox.path)) as live:
                live.backup(backup)  # the service's backup: r1 live
            svc.emit(delete("a", a, "r1"))
            await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 4)
            snap = keys_copy(raw, pattern)  # the replica the node will fail over to
            x = svc.outbox.incarnation
            await svc.relay.stop()  # the service goes down; its store is restored
            # X answered no tick read after this: its watermarks, replayed after the
            # failover, certify at most up to here (what the mirror had certified already)
            x_end = await redis_now(s)
            restored = Outbox(tmp_path / "backup.db")
            y = restored.restored()  # the store restored from its backup, a new incarnation
            try:
                async with LossyRelay(s, restored):
                    d = await until(lambda: store.read(REPO, 0), lambda d: d.broken is not None)
                    assert d.incarnation == x and y in (d.broken or ""), d
                    await wait_log(s)
                    keys_go_back(raw, snap, pattern)  # the node fails over: the break is lost
                    assert store.read(REPO, 0).broken is None
                    async with running_tracker(s, name="t2"):
                        d = await until(lambda: store.read(REPO, 0),
                                        lambda d: d.broken is not None
                                        or (d.horizon_ms or 0) > x_end)
                        assert d.broken is not None and y in d.broken, d
                        await asyncio.sleep(s.grace_seconds + 0.3)  # (grace passes)
                        await wait_log(s)
                        clear(r, REPO, reason="continuity certifies the repository", who="op")
                        report = await reap(s, s3)
                        assert svc.exists(a), (report, d)  # r1 is live at the restored service
                    assert restored.breaks(REPO) == {}, restored.breaks(REPO)  # (X's: refused)
            finally:
                restored.close()
    raw.close()


# --- 4. a repository that adopts its outbox: its first sequenced event is lost ---------------

@pytest.mark.xfail(strict=True, reason=(
    "atk5 4: the tracker learns that a repository is sequenced only from a sequenced fact it "
    "applied (hd:{R}:repo `sequenced`), and only then ticks it; a repository adopting its "
    "outbox whose first sequenced event is lost (a copy) stays judged by the log forensics "
    "alone, which cannot see a lost publish: the reaper deletes the copy's object"))
async def test_a_repository_whose_first_sequenced_event_is_lost_keeps_its_object(
        settings: Settings, s3: Any, tmp_path: Path) -> None:
    """A repository of a service that predates its outbox: created, A written (r1), all
    without seqs (log forensics only, as the status of schemas/README.md allows). The service
    adopts the transactional outbox (schemas/outbox.py supports a repository whose
    repository_created it never emitted: stripe 0, seq 1). A copy of A (r2) reads r1; r1 is
    deleted, the last change before the switch (no seq); the copy commits after the switch:
    seq 1 of stripe 0, its publish lost (a crash after the commit). From the switch on every
    change has its seq (A1). The tracker never saw a seq of the repository: it does not
    tick it, asks for nothing, and the claim script judges it by the log's horizon, which the
    lost publish does not hold back. A (live through r2) must survive."""
    s = settings.replace(tick_interval_seconds=0.1, resend_interval_seconds=0.3)
    bucket = f"atk5-{int(time.time() * 1000) % 10**9}"
    with suppress(s3.exceptions.BucketAlreadyOwnedByYou):
        s3.create_bucket(Bucket=bucket)
    outbox = Outbox(tmp_path / "service.db")
    relay = LossyRelay(s, outbox)
    try:
        async with relay, running_tracker(s):
            svc = Service(s, s3, outbox, relay, f"s3://{bucket}/{REPO}/", bucket)
            r = redis_sync(s)
            a = svc.store("data/a")
            async with Publisher(s) as pub:  # before the outbox: no seqs
                await pub.publish_many([
                    ev.RepositoryCreated(repository=REPO, storage_namespace=svc.namespace,
                                         default_branch="main", default_retention_days=1.0),
                    ev.BranchCreated(repository=REPO, branch="main", staging_token="t",
                                     ref_version=1),
                    write("a", a, "r1")])
                await until(lambda: r.hget(f"hd:{{{REPO}}}:a:{a}", "state"),
                            lambda st: st == "staged")
                # the copy reads r1; r1 is deleted (the last change without a seq)
                await pub.publish_many([delete("a", a, "r1")])
            lost = copy("b", a, "r2")
            relay.drop.add(lost.event_id)
            stamped = svc.emit(lost)  # the first change through the outbox
            assert stamped[0].seq == 1, stamped
            await until(lambda: r.hget(f"hd:{{{REPO}}}:a:{a}", "state"),
                        lambda st: st == "unreferenced")
            await asyncio.sleep(s.grace_seconds + 0.3)  # (grace passes)
            await wait_log(s)
            report = await reap(s, s3)
            assert svc.exists(a), (report, r.hgetall(f"hd:{{{REPO}}}:repo"))  # r2 references A
    finally:
        outbox.close()


# --- 1b. the same, by a lossless failover to a replica whose clock runs ahead ----------------

FAILOVER_GRACE_S = 8.0
AHEAD_S = 4.0  # the replica's clock runs this far ahead of the primary's (< grace)


async def test_a_failover_to_a_replica_whose_clock_runs_ahead_keeps_a_copys_object(
        settings: Settings, s3: Any, tmp_path: Path, failover_pair: FailoverPair) -> None:
    """Test 1 on a Redis Cluster, with no clock stepping: the repository's primary and its
    replica each keep their own clock, the replica's AHEAD_S ahead (< grace). A is written
    (r1) and certified; a copy of A reads r1; r1 is deleted: since(A) = s on the primary's
    clock. A planned failover (CLUSTER FAILOVER: the replica catches up first, nothing is
    lost, no forensics fire) makes the replica primary; its ticks read its own clock, the
    relay honestly answers M = 4, and the horizon passes s + grace. The copy commits within
    grace of its read (A4), its publish slow. With the tick read raw the reaper deleted A,
    live through r2. Held: A7 bounds what the failover moves the slot clock forward
    (``clock_skew_seconds`` = AHEAD_S), and the tick carries R = clock - skew."""
    s = settings.replace(redis_url=failover_pair.url, redis_cluster=True,
                         tick_interval_seconds=0.1, resend_interval_seconds=0.3,
                         grace_seconds=FAILOVER_GRACE_S, clock_skew_seconds=AHEAD_S)
    failover_pair.replica.shift(AHEAD_S)
    async with service(s, s3, tmp_path) as svc, running_tracker(s):
        r = redis_sync(s)
        store = ContinuityStore(r)
        a = svc.store("data/a")
        svc.emit(write("a", a, "r1"))
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 3 and d.horizon_ms)
        read = time.monotonic()  # the copy reads its source entry r1
        svc.emit(delete("a", a, "r1"))
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 4)
        since = int(r.hget(f"hd:{{{REPO}}}:a:{a}", "since"))
        grace_ms = int(FAILOVER_GRACE_S * 1000)
        while await redis_now(s) < since + grace_ms - int(AHEAD_S * 1000) + 200:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(failover_pair.failover)
        ahead = since + grace_ms + 200  # the new primary's clock is at least this
        await until(lambda: store.read(REPO, 0).horizon_ms or 0,  # a tick read since certified
                    lambda h: h >= ahead - int(AHEAD_S * 1000))
        lost = copy("b", a, "r2")
        svc.relay.drop.add(lost.event_id)
        svc.emit(lost)  # committed after the relay read M = 4
        took = time.monotonic() - read
        assert took < FAILOVER_GRACE_S, took  # A4: the copy commits within grace of its read
        await wait_log(s)
        report = await reap(s, s3)
        assert svc.exists(a), (report, store.read(REPO, 0), since, took)  # r2 references A
