"""Continuity end to end on the real stack (schemas/README.md, "Continuity"): a service with a
transactional outbox and its relay, the tracker (ticks, watermarks, re-sends), the reaper.

The service numbers its history; the tracker's horizon for a sequenced repository is the last
tick whose watermark M is covered by the applied prefix. The attack each test replays: a change
the service committed whose event never reached the log (a crash between commit and publish,
a lost log) leaves the log looking complete to any consumer; only the service's count says
it is not.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from core.clients import redis_sync
from core.continuity_store import ContinuityStore
from core.settings import Settings
from schemas import events as ev
from schemas.layout import INCIDENTS, RepoKeys
from sim.sequenced import REPO, Service, certified, delete, reap, service
from sim.testing import publish, redis_now, wait_horizon
from tracker.daemon import running_tracker

pytestmark = pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)



def write(svc: Service, path: str, address: str, ref: str) -> ev.ServiceEvent:
    return ev.ObjectWritten(repository=REPO, branch="main", staging_token="t", path=path,
                            address=address, size=1, ref_id=ref)








@pytest.fixture
def fast(settings: Settings) -> Settings:
    return settings.replace(tick_interval_seconds=0.1, resend_interval_seconds=0.3)


async def test_a_sequenced_repository_is_reaped_once_its_service_certifies_it(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    async with service(fast, s3, tmp_path) as svc, running_tracker(fast):
        a = svc.store("data/a")
        svc.emit(write(svc, "a", a, "r1"), delete("a", a, "r1"))
        await certified(fast, await redis_now(fast))
        await asyncio.sleep(fast.grace_seconds + 0.2)
        await certified(fast, await redis_now(fast))
        await wait_horizon(fast, await redis_now(fast))
        report = await reap(fast, s3)
        assert not svc.exists(a), report
    d = ContinuityStore(redis_sync(fast)).read(REPO, 0)
    assert d.prefix == 4 and d.broken is None  # created, branch, write, delete


async def test_a_committed_change_whose_event_was_lost_holds_its_object_until_it_is_sent_again(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    """The service copied A (ref r2, committed in its outbox) and then deleted the first
    reference r1; the copy's publish was lost. Every consumer-side proof sees a complete log
    (the tracker's horizon passes), and the mirror holds A unreferenced. The service's count
    (watermark M) says seq 4 is missing: the horizon waits, the reaper keeps A, the tracker asks
    for seq 4 again, and once the relay re-sends it A is staged."""
    async with service(fast, s3, tmp_path) as svc, running_tracker(fast):
        a = svc.store("data/a")
        svc.emit(write(svc, "a", a, "r1"))
        copy = ev.ObjectCopied(repository=REPO, branch="main", staging_token="t", path="b",
                               address=a, size=1, ref_id="r2", source_read_at=0.0)
        svc.relay.drop.add(copy.event_id)
        svc.emit(copy)
        svc.emit(delete("a", a, "r1"))
        log_complete = await redis_now(fast)
        await wait_horizon(fast, log_complete)  # the log, as it is, is all applied
        await asyncio.sleep(fast.grace_seconds + 0.3)
        await wait_horizon(fast, await redis_now(fast))
        report = await reap(fast, s3)
        assert svc.exists(a), report  # (without the continuity horizon the reaper deletes A)
        r = redis_sync(fast)
        d = ContinuityStore(r).read(REPO, 0)
        assert d.prefix == 3 and d.above == {5}, d
        assert d.horizon_ms is None or d.horizon_ms < log_complete
        svc.relay.drop.clear()  # the next re-send gets through
        await certified(fast, log_complete)
        rec = r.hgetall(RepoKeys(REPO).address(a))
        assert rec["state"] == "staged" and rec["+r2"] == "t", rec
        await asyncio.sleep(fast.grace_seconds + 0.3)
        await reap(fast, s3)
        assert svc.exists(a)


async def test_a_watermark_that_answers_no_tick_of_the_tracker_certifies_nothing(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    async with service(fast, s3, tmp_path) as svc, running_tracker(fast):
        svc.relay.drop.add("watermark")  # the real relay's answers are lost: only the forgery
        a = svc.store("data/a")
        svc.emit(write(svc, "a", a, "r1"), delete("a", a, "r1"))
        forged = ev.Watermark(repository=REPO, stripe=0, incarnation=svc.outbox.incarnation,
                              seq=4, tick_ms=await redis_now(fast) + 10**9,
                     tick_applied=[0], tick_id="x",
                              tick_sig="0" * 64)
        await wait_horizon(fast, await publish(fast, [forged]))
        r = redis_sync(fast)
        assert ContinuityStore(r).read(REPO, 0).horizon_ms is None
        assert any('"forged_watermark"' in i for i in r.lrange(INCIDENTS, 0, -1))
        await asyncio.sleep(fast.grace_seconds + 0.3)
        await wait_horizon(fast, await redis_now(fast))
        await reap(fast, s3)
        assert svc.exists(a)


async def test_an_event_without_a_seq_in_a_sequenced_repository_stops_its_deletions(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    """A1 broken (the service published a change outside its outbox): its history is no longer
    certified, so nothing of the repository is deleted online."""
    async with service(fast, s3, tmp_path) as svc, running_tracker(fast):
        a = svc.store("data/a")
        svc.emit(write(svc, "a", a, "r1"))
        await wait_horizon(fast, await publish(fast, [delete("a", a, "r1")]))
        await asyncio.sleep(fast.grace_seconds + 0.3)
        await wait_horizon(fast, await redis_now(fast))
        await reap(fast, s3)
        assert svc.exists(a)
        d = ContinuityStore(redis_sync(fast)).read(REPO, 0)
        assert d.broken and "without a seq" in d.broken and d.horizon_ms is None


async def test_a_range_the_service_lost_breaks_the_stripe(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    async with service(fast, s3, tmp_path) as svc, running_tracker(fast):
        a = svc.store("data/a")
        svc.emit(write(svc, "a", a, "r1"))
        lost = svc.emit(ev.ObjectCopied(repository=REPO, branch="main", staging_token="t",
                                        path="b", address=a, size=1, ref_id="r2",
                                        source_read_at=0.0))[0]
        svc.relay.drop.add(lost.event_id)
        deadline = time.monotonic() + 30
        while svc.outbox.unpublished():  # (its publish "succeeded" and was lost)
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        svc.outbox.trim(REPO, 0, 4)  # ... and the outbox no longer has it
        svc.emit(delete("a", a, "r1"))
        r = redis_sync(fast)
        store = ContinuityStore(r)
        deadline = time.monotonic() + 30
        while store.read(REPO, 0).broken is None:
            assert time.monotonic() < deadline, store.read(REPO, 0)
            await asyncio.sleep(0.05)
        assert "lost seqs 4..4" in (store.read(REPO, 0).broken or "")
        from hardelete.status import collect_status

        (row,) = collect_status(r).repositories
        assert row.continuity is not None and "lost seqs 4..4" in (row.continuity.broken or "")
        await asyncio.sleep(fast.grace_seconds + 0.3)
        await wait_horizon(fast, await redis_now(fast))
        await reap(fast, s3)
        assert svc.exists(a)


async def test_a_dead_lettered_seq_is_named_by_status_until_its_fixed_replay_is_applied(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    """The service commits an event the tracker cannot read (a field of a newer schema): it is
    dead-lettered, its seq stays missing and the horizon waits (safe). ``status`` says which
    dead letter the seq waits on and what to do; once the operator replays it fixed, the seq
    is applied and the note goes."""
    from hardelete import dlq
    from hardelete.status import continuity_view
    from sim.sequenced import copy
    from sim.testing import dead_letters

    async with service(fast, s3, tmp_path) as svc, running_tracker(fast):
        a = svc.store("data/a")
        svc.emit(write(svc, "a", a, "r1"))
        with svc.outbox.transaction() as tx:
            bad = tx.emit(copy("b", a, "r2"))
            good = ev.encode(bad)
            tx.execute("UPDATE hd_outbox SET value = ? WHERE repository = ? AND stripe = 0 "
                       "AND seq = ?", (good[:-1] + b',"x_newer_field":1}', REPO, bad.seq))
        assert bad.event_id in await dead_letters(fast, 1)
        r = redis_sync(fast)
        deadline = time.monotonic() + 30
        while not (view := continuity_view(r, REPO, 1)).dead:
            assert time.monotonic() < deadline, (view, r.hgetall(RepoKeys(REPO).dead_seqs))
            await asyncio.sleep(0.05)
        assert view.dead[0][:2] == (0, bad.seq), view
        text = view.text(await redis_now(fast))
        assert f"seq {bad.seq} of stripe 0" in text and "dead-lettered" in text, text
        assert "dlq replay" in text, text
        await dlq.publish_fixed(fast, good)
        await certified(fast, await redis_now(fast))
        deadline = time.monotonic() + 30
        while r.hlen(RepoKeys(REPO).dead_seqs):  # the Ticker forgets it once applied
            assert time.monotonic() < deadline, r.hgetall(RepoKeys(REPO).dead_seqs)
            await asyncio.sleep(0.05)
        assert not continuity_view(r, REPO, 1).dead
        assert r.hget(f"hd:{{{REPO}}}:a:{a}", "+r2") == "t"


async def test_a_broken_stripe_is_rebuilt_from_the_services_export_and_reaps_again(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    """An event without a seq breaks stripe 0 (the service keeps the break: every watermark
    carries it). The service exports its state with its counters, read together; the rebuild
    starts the stripe again at them (its epoch moves on, so the break the service kept from
    before is moot), the horizon comes back, garbage made since is reaped, and the live object
    stays."""
    from schemas.publisher import Publisher
    from schemas.records import BranchRecord
    from tracker.rebuild import (
        ExportContinuity,
        ExportEntry,
        RebuildError,
        StateExport,
        prepare,
        rebuild,
        write_export,
    )

    async with service(fast, s3, tmp_path) as svc, running_tracker(fast):
        r = redis_sync(fast)
        store = ContinuityStore(r)
        a = svc.store("data/a")
        svc.emit(write(svc, "a", a, "r1"))
        deadline = time.monotonic() + 30
        while store.read(REPO, 0).prefix < 3:  # (created, main, the write: all applied)
            assert time.monotonic() < deadline, store.read(REPO, 0)
            await asyncio.sleep(0.05)
        async with Publisher(fast) as pub:  # outside the outbox: A1 broken once
            await pub.publish_many([write(svc, "x", svc.store("data/x"), "rx")])
        deadline = time.monotonic() + 30
        while (d := store.read(REPO, 0)).broken is None:
            assert time.monotonic() < deadline, d
            await asyncio.sleep(0.05)
        deadline = time.monotonic() + 30
        while not svc.outbox.breaks(REPO):  # the service keeps it (the Ticker told it)
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        prepared = prepare(r, s3, REPO)
        counters = svc.outbox.counters(REPO)
        assert counters is not None
        export = StateExport(
            REPO, await redis_now(fast), prepared.nonce,
            branches={"main": (BranchRecord(None, "t", ()), 1)}, tags={},
            tokens={"t": ("open", (ExportEntry(a, "r1", 1),))}, commits={}, issued={},
            continuity=ExportContinuity.of(counters))
        bare = write_export(s3, f"{svc.namespace}_hardelete/exports/state-0/",
                            replace(export, continuity=None))
        with pytest.raises(RebuildError, match="must carry the counters"):
            rebuild(r, s3, REPO, bare, max_age_ms=60_000, by="test")
        assert store.read(REPO, 0).broken is not None  # (nothing lifted)
        location = write_export(s3, f"{svc.namespace}_hardelete/exports/state-1/", export)
        rebuild(r, s3, REPO, location, max_age_ms=60_000, by="test")
        d = store.read(REPO, 0)
        assert d.broken is None and d.epoch == 1 and d.prefix == counters.seqs[0], d
        # garbage made after the rebuild is reaped once certified; the live object stays
        g = svc.store("data/g")
        svc.emit(write(svc, "g", g, "rg"), delete("g", g, "rg"))
        await certified(fast, await redis_now(fast))
        await asyncio.sleep(fast.grace_seconds + 0.2)
        await certified(fast, await redis_now(fast))
        await wait_horizon(fast, await redis_now(fast))
        report = await reap(fast, s3)
        assert not svc.exists(g), (report, store.read(REPO, 0))
        assert svc.exists(a), report
        assert store.read(REPO, 0).broken is None  # the break kept from epoch 0 is moot
