"""Adversarial review of the online delete path for SEQUENCED repositories (schemas/README.md,
"Continuity"), on the real stack: a service with a transactional outbox and its relay, the
tracker (ticks, watermarks, re-sends), the reaper. Each test drives a sequence of events and
faults and asserts the SAFE outcome: the live object survives. A test marked
``xfail(strict=True)`` shows a live deletion on today's main.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from redis import Redis

from core.clients import redis_sync, split_s3_uri
from core.continuity_store import ContinuityStore
from core.settings import Settings
from schemas import control
from schemas import events as ev
from schemas.outbox import Outbox
from sim.sequenced import LossyRelay, reap, until, wait_log
from sim.testing import (
    keys_copy,
    keys_go_back,
    publish,
    redis_now,
    slot_copy,
    slot_go_back,
    wait_horizon,
)
from tracker.daemon import running_tracker

REPO = "svc"


@dataclass
class Service:
    settings: Settings
    s3: Any
    outbox: Outbox
    relay: LossyRelay
    namespace: str
    bucket: str
    stripes: int
    events: list[ev.ServiceEvent] = field(default_factory=list)

    def emit(self, *events: ev.ServiceEvent) -> list[ev.ServiceEvent]:
        with self.outbox.transaction() as tx:
            stamped = [tx.emit(e, stripe=stripe(e, self.stripes)) for e in events]
        self.events += stamped
        return stamped

    def store(self, path: str) -> str:
        address = self.namespace + path
        self.s3.put_object(Bucket=self.bucket, Key=split_s3_uri(address)[1], Body=b"x")
        return address

    def exists(self, address: str) -> bool:
        try:
            self.s3.head_object(Bucket=self.bucket, Key=split_s3_uri(address)[1])
            return True
        except self.s3.exceptions.ClientError:
            return False


def stripe(e: ev.ServiceEvent, stripes: int) -> int:
    branch = getattr(e, "branch", None)
    return 0 if stripes == 1 or not branch else zlib.crc32(branch.encode()) % stripes


def branch_in_stripe(k: int, stripes: int) -> str:
    return next(b for b in (f"b{i}" for i in range(1000))
                if zlib.crc32(b.encode()) % stripes == k)


@asynccontextmanager
async def service(settings: Settings, s3: Any, tmp_path: Path, *, stripes: int = 1,
                  branches: tuple[str, ...] = ("main",)) -> AsyncIterator[Service]:
    bucket = f"atkon-{int(time.time() * 1000) % 10**9}"
    with suppress(s3.exceptions.BucketAlreadyOwnedByYou):
        s3.create_bucket(Bucket=bucket)
    outbox = Outbox(tmp_path / "service.db")
    relay = LossyRelay(settings, outbox)
    try:
        async with relay:  # (stopped before the outbox closes under it)
            svc = Service(settings, s3, outbox, relay, f"s3://{bucket}/{REPO}/", bucket,
                          stripes)
            svc.emit(ev.RepositoryCreated(repository=REPO, storage_namespace=svc.namespace,
                                          default_branch=branches[0],
                                          default_retention_days=1.0, stripes=stripes))
            for b in branches:
                svc.emit(ev.BranchCreated(repository=REPO, branch=b, staging_token=f"t-{b}",
                                          ref_version=1))
            yield svc
    finally:
        outbox.close()


def write(branch: str, path: str, address: str, ref: str) -> ev.ServiceEvent:
    return ev.ObjectWritten(repository=REPO, branch=branch, staging_token=f"t-{branch}",
                            path=path, address=address, size=1, ref_id=ref)


def copy(branch: str, path: str, address: str, ref: str) -> ev.ServiceEvent:
    return ev.ObjectCopied(repository=REPO, branch=branch, staging_token=f"t-{branch}",
                           path=path, address=address, size=1, ref_id=ref,
                           source_read_at=time.time())


def delete(branch: str, path: str, address: str, ref: str) -> ev.ServiceEvent:
    return ev.ObjectDeleted(repository=REPO, branch=branch, staging_token=f"t-{branch}",
                            path=path, address=address, ref_id=ref)








@asynccontextmanager
async def control_reader(settings: Settings) -> AsyncIterator[AIOKafkaConsumer]:
    consumer = AIOKafkaConsumer(settings.control_topic,
                                bootstrap_servers=settings.kafka_bootstrap,
                                auto_offset_reset="latest", enable_auto_commit=False)
    await consumer.start()
    try:
        yield consumer
    finally:
        await consumer.stop()


async def next_tick(consumer: AIOKafkaConsumer, repo: str, after_ms: int,
                    timeout: float = 30.0) -> control.Tick:
    """The first genuine tick of the tracker for ``repo`` read past ``after_ms``: what any
    reader of the control topic (every service's relay) sees."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for recs in (await consumer.getmany(timeout_ms=200)).values():
            for rec in recs:
                with suppress(control.ControlError):
                    msg = control.decode(rec.value or b"")
                    if isinstance(msg, control.Tick) and msg.repository == repo \
                            and msg.tick_ms > after_ms:
                        return msg
    raise TimeoutError(f"no tick of {repo} past {after_ms}")





@pytest.fixture
def fast(settings: Settings) -> Settings:
    return settings.replace(tick_interval_seconds=0.1, resend_interval_seconds=0.3)


# --- 1. a watermark that carries a GENUINE tick but an M the service never answered ---

@pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)
async def test_a_genuine_tick_answered_with_an_m_below_its_applied_seq_breaks_the_stripe(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    """A is written (r1, seq 3 of stripe 0), copied (r2, seq 4: committed, its publish lost),
    then r1 is deleted (seq 5, applied). The mirror has prefix 3 and seq 5 above it: the real
    relay's watermarks (M = 5) would certify nothing. Another writer of the events topic (a second,
    stale relay of the service reading a lagging replica; a bug; an attacker with produce
    rights) takes the tracker's next genuine tick past since(A) + grace from the control
    topic and publishes watermark(stripe 0, the outbox's incarnation, M = 3, that tick). The
    tracker verifies the tick's signature, the prefix covers M = 3, the horizon jumps to the
    tick, and the reaper deletes A while r2 (open token) references it at the service."""
    async with service(fast, s3, tmp_path) as svc, running_tracker(fast), \
            control_reader(fast) as ctl:
        svc.relay.drop.add("watermark")  # the real relay's answers are lost: only the forgery
        a = svc.store("data/a")
        svc.emit(write("main", "a", a, "r1"))
        lost = copy("main", "b", a, "r2")
        svc.relay.drop.add(lost.event_id)
        svc.emit(lost)
        svc.emit(delete("main", "a", a, "r1"))
        r = redis_sync(fast)
        d = await until(lambda: ContinuityStore(r).read(REPO, 0),
                        lambda d: d.prefix == 3 and d.above == {5})
        assert d.horizon_ms is None, d
        since = int(r.hget(f"hd:{{{REPO}}}:a:{a}", "since"))
        tick = await next_tick(ctl, REPO, since + int(fast.grace_seconds * 1000) + 200)
        forged = ev.Watermark(repository=REPO, stripe=0, incarnation=svc.outbox.incarnation,
                              seq=3, tick_ms=tick.tick_ms,
                              tick_applied=tick.applied, tick_id=tick.tick_id,
                              tick_sig=tick.sig)
        assert tick.applied == [5], tick
        await publish(fast, [forged])
        d = await until(lambda: ContinuityStore(r).read(REPO, 0),
                        lambda d: d.horizon_ms is not None or d.broken is not None)
        assert d.broken is not None and "lags" in d.broken, d
        await wait_log(fast)
        report = await reap(fast, s3)
        assert svc.exists(a), report  # r2 (open token t-main) references A at the service


# --- 2. stripes: a copy lost in one stripe, its source removed in another ---

async def test_a_copy_lost_in_one_stripe_keeps_its_object_whatever_the_others_certify(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    """Two stripes; branch X in stripe 0, branch Y in stripe 1. A is written on X (r1), copied
    into Y (r2: committed, publish lost), and r1 is deleted. Stripe 0 is complete and
    certified past since(A) + grace; stripe 1 has a gap. The repository's horizon is the least
    over its stripes: A is kept; once the relay re-sends the copy, A is staged."""
    x, y = branch_in_stripe(0, 2), branch_in_stripe(1, 2)
    async with service(fast, s3, tmp_path, stripes=2, branches=(x, y)) as svc, \
            running_tracker(fast):
        a = svc.store("data/a")
        svc.emit(write(x, "a", a, "r1"))
        lost = copy(y, "b", a, "r2")
        svc.relay.drop.add(lost.event_id)
        svc.emit(lost)
        svc.emit(delete(x, "a", a, "r1"))
        await asyncio.sleep(fast.grace_seconds + 0.5)
        await wait_log(fast)
        r = redis_sync(fast)
        store = ContinuityStore(r)
        deadline = time.monotonic() + 30
        while (store.read(REPO, 0).horizon_ms or 0) < await redis_now(fast) - 300:
            assert time.monotonic() < deadline, store.read(REPO, 0)
            await asyncio.sleep(0.05)
        report = await reap(fast, s3)
        assert svc.exists(a), report
        h = store.horizon(REPO, 2)
        since = int(r.hget(f"hd:{{{REPO}}}:a:{a}", "since") or 0)
        assert h is None or h < since + int(fast.grace_seconds * 1000), (h, since)
        svc.relay.drop.clear()  # the next re-send gets through
        rec = await until(lambda: r.hgetall(f"hd:{{{REPO}}}:a:{a}"),
                          lambda rec: rec.get("state") == "staged")
        assert rec["+r2"] == f"t-{y}", rec
        await reap(fast, s3)
        assert svc.exists(a)


# --- 3. a genuine watermark of one stripe replayed as another stripe's ---

@pytest.mark.xfail(strict=True, reason=(
    "atk-on 3: a genuine watermark of stripe 0 (its tick signed) re-published with stripe 1 "
    "and the M of stripe 1's prefix certifies stripe 1 past a copy lost in it (the copy is "
    "the last event of stripe 1, so the tick's applied seqs cannot show the lie): nothing "
    "binds the stripe and M to the relay. A writer of the events topic that lies is outside "
    "A6 (it could as well publish a false object_deleted); closing it needs the relay's "
    "events and watermarks authenticated (a relay key)"))
async def test_a_genuine_watermark_replayed_for_another_stripe_certifies_its_gap(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    x, y = branch_in_stripe(0, 2), branch_in_stripe(1, 2)
    async with service(fast, s3, tmp_path, stripes=2, branches=(x, y)) as svc, \
            running_tracker(fast), control_reader(fast) as ctl:
        a = svc.store("data/a")
        svc.emit(write(x, "a", a, "r1"))
        lost = copy(y, "b", a, "r2")
        svc.relay.drop.add(lost.event_id)
        svc.emit(lost)
        svc.emit(delete(x, "a", a, "r1"))
        r = redis_sync(fast)
        store = ContinuityStore(r)
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 4)  # created, X, w, del
        since = int(r.hget(f"hd:{{{REPO}}}:a:{a}", "since"))
        tick = await next_tick(ctl, REPO, since + int(fast.grace_seconds * 1000) + 200)
        y_prefix = store.read(REPO, 1).prefix  # (branch_created of Y; the copy is missing)
        assert y_prefix == 1, store.read(REPO, 1)
        replayed = ev.Watermark(repository=REPO, stripe=1, incarnation=svc.outbox.incarnation,
                                seq=y_prefix, tick_ms=tick.tick_ms,
                              tick_applied=tick.applied, tick_id=tick.tick_id,
                                tick_sig=tick.sig)
        await publish(fast, [replayed])
        deadline = time.monotonic() + 30
        while (store.horizon(REPO, 2) or 0) < tick.tick_ms:
            assert time.monotonic() < deadline, (store.read(REPO, 0), store.read(REPO, 1))
            await asyncio.sleep(0.05)
        await wait_log(fast)
        report = await reap(fast, s3)
        assert svc.exists(a), report


# --- 4. the repository's slot goes back (a restored snapshot): records and horizon together ---

async def test_a_slot_that_went_back_past_a_copy_keeps_its_object_until_the_copy_is_sent_again(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    """write A (r1), delete r1: A unreferenced since s0; the slot is snapshotted. Within grace
    of reading r1 the service commits a copy (r2), applied and certified: A staged. The slot
    then goes back to the snapshot (A unreferenced since s0, prefix before the copy) while the
    log has moved on: the copy is never consumed again, and its re-send is lost for a while.
    Watermarks past since(A) + grace arrive meanwhile; the horizon must not pass the copy."""
    async with service(fast, s3, tmp_path) as svc, running_tracker(fast):
        raw = Redis.from_url(fast.redis_url)  # (DUMP payloads are bytes)
        a = svc.store("data/a")
        svc.emit(write("main", "a", a, "r1"))
        svc.emit(delete("main", "a", a, "r1"))
        store = ContinuityStore(redis_sync(fast))
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 4)
        snap = slot_copy(raw, REPO)
        cp = copy("main", "b", a, "r2")
        svc.emit(cp)
        await wait_horizon(fast, await redis_now(fast))
        rec = redis_sync(fast).hgetall(f"hd:{{{REPO}}}:a:{a}")
        assert rec["state"] == "staged", rec
        svc.relay.drop.add(cp.event_id)  # its re-sends are lost for now
        slot_go_back(raw, REPO, snap)
        await asyncio.sleep(fast.grace_seconds + 0.5)
        await wait_log(fast)
        d = store.read(REPO, 0)
        assert d.prefix == 4, d
        report = await reap(fast, s3)
        assert svc.exists(a), report
        svc.relay.drop.clear()  # the next re-send gets through
        r = redis_sync(fast)
        rec = await until(lambda: r.hgetall(f"hd:{{{REPO}}}:a:{a}"),
                          lambda rec: rec.get("state") == "staged")
        assert rec["+r2"] == "t-main", rec
        await reap(fast, s3)
        assert svc.exists(a)


# --- 5. a dead-lettered sequenced copy whose dead letter the operator resolves ---

async def test_a_dead_lettered_copy_keeps_its_object_after_its_dead_letter_is_resolved(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    """The service commits a copy of A (r2, seq 4) whose record the tracker cannot read (a
    field of a newer schema): dead letter, hold on A. r1 is deleted (seq 5, applied). The
    operator judges the dead letter and resolves it without replaying a fix (its re-sends are
    lost meanwhile): the hold goes. Nothing in the mirror keeps A any more but the gap at seq
    4: the horizon must stay before it."""
    from hardelete import dlq
    from hardelete.holds import list_holds
    from sim.testing import dead_letters

    async with service(fast, s3, tmp_path) as svc, running_tracker(fast):
        a = svc.store("data/a")
        svc.emit(write("main", "a", a, "r1"))
        with svc.outbox.transaction() as tx:
            bad = tx.emit(copy("main", "b", a, "r2"))
            raw = ev.encode(bad)
            patched = raw[:-1] + b',"x_newer_field":1}'
            tx.execute("UPDATE hd_outbox SET value = ? WHERE repository = ? AND stripe = 0 "
                       "AND seq = ?", (patched, REPO, bad.seq))
        assert bad.seq == 4
        got = await dead_letters(fast, 1)
        assert bad.event_id in got, got
        svc.relay.drop.add(bad.event_id)  # its re-sends are lost from now on
        svc.emit(delete("main", "a", a, "r1"))
        r = redis_sync(fast)
        store = ContinuityStore(r)
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 3 and 5 in d.above)
        assert list_holds(r, REPO, target=a), "the dead letter holds A"
        for letter in await dlq.read(fast):
            if letter.body is not None and letter.body.get("event_id") == bad.event_id:
                await asyncio.to_thread(dlq.resolve, r, letter, s3=s3, wait_s=30)
        assert not list_holds(r, REPO, target=a), list_holds(r, REPO, target=a)
        await asyncio.sleep(fast.grace_seconds + 0.5)
        await wait_log(fast)
        report = await reap(fast, s3)
        assert svc.exists(a), report  # r2 (open token) references A at the service
        d = store.read(REPO, 0)
        assert d.prefix == 3 and d.broken is None, d


# --- 6. a second relay on a lagging copy of the service's store (a standby) ---

async def test_a_standby_relay_on_a_lagging_replica_breaks_the_stripe(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    """The service's database has a replica (a standby site), and the standby runs the same
    relay against it: the replica holds the outbox tables and the incarnation row, so its
    relay answers every tick for the repository, from counters that lag. A is written (r1,
    seq 3) and replicated; then the primary commits a copy (r2, seq 4; its publish is slow:
    lost, re-sent later) and deletes r1 (seq 5). The primary relay's watermark (M = 5) waits
    for seq 4; the standby's (M = 3, same tick, same incarnation) is covered by the prefix, but
    its tick says seq 5 was applied when it was read: the standby's answer lies, and the
    stripe breaks instead of certifying."""
    import sqlite3

    from schemas.relay import Relay

    async with service(fast, s3, tmp_path) as svc, running_tracker(fast):
        a = svc.store("data/a")
        svc.emit(write("main", "a", a, "r1"))
        store = ContinuityStore(redis_sync(fast))
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 3)
        await until(svc.outbox.unpublished, lambda rows: not rows)
        replica_path = tmp_path / "replica.db"
        src = sqlite3.connect(svc.outbox.path)
        dst = sqlite3.connect(replica_path)
        src.backup(dst)  # the replica, as of now (it lags from here on)
        src.close()
        dst.close()
        replica = Outbox(replica_path)
        assert replica.incarnation == svc.outbox.incarnation
        try:
            async with Relay(fast, replica, poll_seconds=0.05):
                lost = copy("main", "b", a, "r2")
                svc.relay.drop.add(lost.event_id)
                svc.emit(lost)
                svc.emit(delete("main", "a", a, "r1"))
                await until(lambda: store.read(REPO, 0), lambda d: 5 in d.above)
                await asyncio.sleep(fast.grace_seconds + 0.5)
                await wait_log(fast)
                report = await reap(fast, s3)
                assert svc.exists(a), report  # r2 (open token) references A at the service
                d = store.read(REPO, 0)
                assert d.broken is not None and "lags" in d.broken, d
        finally:
            replica.close()


# --- 7. the break an event without a seq caused, lost with the slot ---

@pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)
async def test_a_break_for_an_event_without_a_seq_lost_with_the_slot_deletes_nothing(
        fast: Settings, s3: Any, tmp_path: Path, topology: str) -> None:
    """A1 broken once: a copy of A (r2) published outside the outbox is applied and breaks
    stripe 0 (nothing certifies the history any more). The slot goes back to before the break
    (a failover to a lagging replica, the tracker restarted meanwhile), whether or not the
    service kept it yet (the next test waits for that), and the copy, consumed already, is
    never read again. No seq says it is missing: only the log forensics (hd:applied, another
    slot) and the service's copy of the break can tell. Then
    the service deletes r1 through its outbox: A must not be reaped while r2 references it.
    One node: the whole dataset goes back together (hd:log with it); the cluster: only the
    repository's node."""
    from redis.cluster import RedisCluster

    from schemas.publisher import Publisher

    raw: Any = RedisCluster.from_url(fast.redis_url) if fast.redis_cluster \
        else Redis.from_url(fast.redis_url)
    pattern = "*" if topology == "single" else f"hd:{{{REPO}}}:*"
    async with service(fast, s3, tmp_path) as svc:
        store = ContinuityStore(redis_sync(fast))
        a = svc.store("data/a")
        async with running_tracker(fast, name="t1"):
            svc.emit(write("main", "a", a, "r1"))
            await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 3)
            snap = keys_copy(raw, pattern)
            async with Publisher(fast) as pub:
                await pub.publish_many([copy("main", "b", a, "r2")])
            await until(lambda: store.read(REPO, 0), lambda d: d.broken is not None)
            await wait_log(fast)
        keys_go_back(raw, snap, pattern)
        assert store.read(REPO, 0).broken is None
        async with running_tracker(fast, name="t2"):
            svc.emit(delete("main", "a", a, "r1"))
            await asyncio.sleep(fast.grace_seconds + 0.5)
            await wait_log(fast)
            report = await reap(fast, s3)
            assert svc.exists(a), (report, store.read(REPO, 0),
                                   redis_sync(fast).hgetall(f"hd:{{{REPO}}}:a:{a}"))
    raw.close()


@pytest.mark.parametrize("topology", ["cluster"], indirect=True)
async def test_a_lost_break_reads_as_certified_and_clearing_fail_closed_reaps_a_live_object(
        fast: Settings, s3: Any, tmp_path: Path, topology: str) -> None:
    """As above, on the cluster, where only the repository's node goes back: the log
    forensics' fail-closed flag keeps A at first; the operator clears it. The break is
    durable at the service (schemas/README.md, "Continuity"): the tracker reported it, the
    outbox kept it, and the relay's first watermark after the node went back breaks the stripe
    again, so nothing of the repository is certified and A stays. (Before the service kept
    breaks, the node going back lost the break and the copy with it, continuity read
    certified, and the reaper deleted A once the flag was cleared.)"""
    from redis.cluster import RedisCluster

    from hardelete.failclosed import clear
    from schemas.publisher import Publisher

    raw: Any = RedisCluster.from_url(fast.redis_url)
    pattern = f"hd:{{{REPO}}}:*"
    async with service(fast, s3, tmp_path) as svc:
        r = redis_sync(fast)
        store = ContinuityStore(r)
        a = svc.store("data/a")
        async with running_tracker(fast, name="t1"):
            svc.emit(write("main", "a", a, "r1"))
            await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 3)
            snap = keys_copy(raw, pattern)
            async with Publisher(fast) as pub:
                await pub.publish_many([copy("main", "b", a, "r2")])
            broken = await until(lambda: store.read(REPO, 0), lambda d: d.broken is not None)
            # the contract: the break is the service's once its outbox holds it
            kept = await until(lambda: svc.outbox.breaks(REPO), bool)
            assert kept == {(0, svc.outbox.incarnation): broken.broken}, kept
            await wait_log(fast)
        keys_go_back(raw, snap, pattern)  # the repository's node fails over to a lagging replica
        assert store.read(REPO, 0).broken is None
        restored_ms = await redis_now(fast)
        async with running_tracker(fast, name="t2"):
            svc.emit(delete("main", "a", a, "r1"))
            # a watermark answering a tick past the restore: it breaks the stripe again (it
            # would certify it if the break lived in the slot only)
            d = await until(lambda: store.read(REPO, 0),
                            lambda d: d.broken is not None or (d.horizon_ms or 0) > restored_ms)
            await asyncio.sleep(fast.grace_seconds + 0.5)
            await wait_log(fast)
            first = await reap(fast, s3)
            assert first.repos[0].skipped == "fail_closed", first
            assert clear(r, REPO, reason="continuity certifies the repository", who="op") == 1
            await wait_log(fast)
            report = await reap(fast, s3)
            assert svc.exists(a), (report, d)  # r2 (open token) references A at the service
            assert d.broken == f"the service recorded a break: {broken.broken}", d
            assert store.read(REPO, 0).horizon_ms is None
    raw.close()
