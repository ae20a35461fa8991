"""Adversarial review of the rebuild of a SEQUENCED repository whose continuity broke
(schemas/README.md, "Continuity", *Un-breaking*, and "Rebuild"), on the real stack: a service
with a transactional outbox and its relay, the tracker (ticks, watermarks, re-sends), the
rebuild, the reaper. Each test drives a sequence of service operations, faults and operator
commands and asserts the SAFE outcome: the object live at the service survives. A test marked
``xfail(strict=True)`` shows a live deletion on today's main (``--runxfail`` shows it). The
three findings were closed by refusing such an export (tracker/rebuild.py
``continuity_problem``): their tests assert the refusal and that the object stays.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from core.clients import redis_sync
from core.continuity_store import ContinuityStore
from core.settings import Settings
from schemas import events as ev
from schemas.layout import RepoKeys
from schemas.records import BranchRecord
from sim.sequenced import REPO, Service, certified, delete, reap, service, until, wait_log
from sim.testing import keys_copy, keys_go_back, redis_now, wait_horizon
from tracker.daemon import running_tracker
from tracker.rebuild import (
    ExportContinuity,
    ExportEntry,
    RebuildError,
    StateExport,
    prepare,
    rebuild,
    write_export,
)

BOTH = pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)


@pytest.fixture
def fast(settings: Settings) -> Settings:
    return settings.replace(tick_interval_seconds=0.1, resend_interval_seconds=0.3)


def write(path: str, address: str, ref: str, token: str = "t") -> ev.ServiceEvent:
    return ev.ObjectWritten(repository=REPO, branch="main", staging_token=token, path=path,
                            address=address, size=1, ref_id=ref)








def addr_key(address: str) -> str:
    return RepoKeys(REPO).address(address)





def copy_store(svc: Service, where: Path) -> Path:
    """A backup of the service's store (its outbox database: counters, rows, incarnation)."""
    src, dst = sqlite3.connect(svc.outbox.path), sqlite3.connect(where)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    return where


def restore_store(svc: Service, backup: Path) -> str:
    """The service's store restored from ``backup``, then ``Outbox.restored()`` as the
    contract says (before it takes a write): a new incarnation."""
    src, dst = sqlite3.connect(backup), sqlite3.connect(svc.outbox.path)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    return svc.outbox.restored()


# --- 1. a restore of the service's store undoes changes the mirror applied -----------------------

@BOTH
async def test_a_removal_the_restore_undid_is_undone_by_the_rebuild(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    """A is written (r1). The store is copied. r1 is deleted (incarnation I1, applied: A is
    unreferenced in the mirror). The store is restored from the copy (well within grace:
    A2) and gets a new incarnation I2, in which r1 is live again. The next event of I2 breaks
    the stripe (incarnation changed); the tracker prepares, the service exports its state
    (r1 live, counters of I2) and the rebuild lifts. The export lists r1 in token t, but the
    rebuild's add of r1 is a no-op: the mirror already holds the removal of r1 with token t
    (a removal naming the add's token ends it for good). A stays unreferenced since the
    retired incarnation's delete; once the rebuilt stripe is certified past that + grace, the
    reaper deletes A, live at the service."""
    async with service(fast, s3, tmp_path) as svc, running_tracker(fast):
        r = redis_sync(fast)
        store = ContinuityStore(r)
        a = svc.store("data/a")
        svc.emit(write("a", a, "r1"))
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix >= 3)
        await until(lambda: svc.outbox.unpublished(), lambda rows: not rows)
        backup = copy_store(svc, tmp_path / "copy.db")  # the service's backup (A live)
        svc.emit(delete("a", a, "r1"))  # incarnation I1, seq 4
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix >= 4)
        assert r.hget(addr_key(a), "state") == "unreferenced"
        i2 = restore_store(svc, backup)  # r1 is live at the service again
        b = svc.store("data/b")
        svc.emit(write("b", b, "rb"))  # seq 4 of I2: breaks the stripe (incarnation changed)
        d = await until(lambda: store.read(REPO, 0), lambda d: d.broken is not None)
        assert "incarnation changed" in str(d.broken), d
        prepared = prepare(r, s3, REPO)
        counters = svc.outbox.counters(REPO)
        assert counters is not None and counters.incarnation == i2
        export = StateExport(
            REPO, await redis_now(fast), prepared.nonce,
            branches={"main": (BranchRecord(None, "t", ()), 1)}, tags={},
            tokens={"t": ("open", (ExportEntry(a, "r1", 1), ExportEntry(b, "rb", 1)))},
            commits={}, issued={},
            continuity=ExportContinuity.of(counters))
        location = write_export(s3, f"{svc.namespace}_hardelete/exports/state-1/", export)
        # Refused: a rebuild across a restore could not undo the old incarnation's removal
        # (it used to lift, and the reaper deleted A, live at the service).
        with pytest.raises(RebuildError, match="restore of the service's store"):
            rebuild(r, s3, REPO, location, max_age_ms=60_000, by="test")
        assert store.read(REPO, 0).broken is not None  # the repository stays stopped
        await asyncio.sleep(fast.grace_seconds + 0.2)
        await wait_horizon(fast, await redis_now(fast))
        report = await reap(fast, s3)
        # SAFE: A is live at the service (r1 in the open token t, as the export said)
        assert svc.exists(a) and svc.exists(b), (report, store.read(REPO, 0))


@BOTH
async def test_a_reset_the_restore_undid_is_undone_by_the_rebuild(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    """A is written (r1, token t). The store is copied. main is reset (incarnation I1: t
    dropped, new token t2; applied: A unreferenced). The store is restored from the copy
    (incarnation I2): t is open again with r1 live. The next event of I2 breaks the stripe;
    the rebuild's export lists t open with r1, but set_token(t, open) cannot move t back from
    dropped and the add of r1 to a dropped token keeps nothing: A is reaped, live; so are
    B (written in I2 before the rebuild, added by it) and C (written on main after it): every
    entry of main's staging token, for as long as the service keeps it."""
    async with service(fast, s3, tmp_path) as svc, running_tracker(fast):
        r = redis_sync(fast)
        store = ContinuityStore(r)
        a = svc.store("data/a")
        svc.emit(write("a", a, "r1"))
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix >= 3)
        await until(lambda: svc.outbox.unpublished(), lambda rows: not rows)
        backup = copy_store(svc, tmp_path / "copy.db")
        svc.emit(ev.BranchReset(repository=REPO, branch="main", dropped_tokens=["t"],
                                staging_token="t2", ref_version=2))
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix >= 4)
        assert r.hget(addr_key(a), "state") == "unreferenced"
        i2 = restore_store(svc, backup)  # main is back on t, r1 live
        b = svc.store("data/b")
        svc.emit(write("b", b, "rb"))  # breaks the stripe (incarnation changed)
        await until(lambda: store.read(REPO, 0), lambda d: d.broken is not None)
        prepared = prepare(r, s3, REPO)
        counters = svc.outbox.counters(REPO)
        assert counters is not None and counters.incarnation == i2
        export = StateExport(
            REPO, await redis_now(fast), prepared.nonce,
            branches={"main": (BranchRecord(None, "t", ()), 1)}, tags={},
            tokens={"t": ("open", (ExportEntry(a, "r1", 1), ExportEntry(b, "rb", 1)))},
            commits={}, issued={},
            continuity=ExportContinuity.of(counters))
        location = write_export(s3, f"{svc.namespace}_hardelete/exports/state-1/", export)
        with pytest.raises(RebuildError, match="restore of the service's store"):
            rebuild(r, s3, REPO, location, max_age_ms=60_000, by="test")
        assert store.read(REPO, 0).broken is not None  # the repository stays stopped
        c = svc.store("data/c")
        svc.emit(write("c", c, "rc"))  # a write on main after the refusal: token t too
        await asyncio.sleep(fast.grace_seconds + 0.2)
        await wait_horizon(fast, await redis_now(fast))
        report = await reap(fast, s3)
        # SAFE: all three are live at the service (entries of main's open token t)
        lost = [x for x in (a, b, c) if not svc.exists(x)]
        assert not lost, (lost, report, r.hget(RepoKeys(REPO).tokens, "t"))


# --- 2. a rebuild lifts a break the service never kept --------------------------------------------




@pytest.mark.parametrize("topology", ["cluster"], indirect=True)
@pytest.mark.parametrize("relay_up", [pytest.param(True, id="kept"),
                                      pytest.param(False, id="never-kept")])
async def test_a_rebuild_does_not_lift_a_break_the_service_has_not_kept(
        fast: Settings, s3: Any, tmp_path: Path, topology: str, relay_up: bool) -> None:
    """A1 broken once: a copy of A (r2) published outside the outbox breaks stripe 0. The
    relay is down while the Ticker tells it of the break (a relay reads the control topic from
    its end when it starts: what was told meanwhile is gone), so the outbox never keeps it. The
    tracker prepares, the service exports (r1 and r2 live, its counters), the rebuild lifts:
    epoch 1, and the Ticker no longer tells anyone of a break. Later the repository's node
    fails over to a replica from before the copy (epoch 0, unbroken, r2 unknown). The service
    deletes r1; the log forensics fail the repository closed, the operator clears the flag as
    the README's procedure allows once continuity certifies it (test_atk_online_sequenced.py's
    last test), no watermark carries a break, and the reaper deletes A, live through r2.
    (``kept``: the same with the relay up, which keeps the break before the rebuild: the first
    watermark after the failover breaks the stripe again and A stays.)"""
    from redis.cluster import RedisCluster

    from hardelete.failclosed import clear
    from schemas.publisher import Publisher

    settings = fast.replace(rebuild_interval_seconds=0.0)
    raw: Any = RedisCluster.from_url(settings.redis_url)
    pattern = f"hd:{{{REPO}}}:*"
    async with service(settings, s3, tmp_path) as svc:
        r = redis_sync(settings)
        store = ContinuityStore(r)
        a = svc.store("data/a")
        told: list[Any] = []

        async def relay_down(msg: Any) -> int:  # the break is told, nobody keeps it
            told.append(msg)
            return 0

        async with running_tracker(settings, name="t1"):
            svc.emit(write("a", a, "r1"))
            await until(lambda: store.read(REPO, 0), lambda d: d.prefix == 3)
            await certified(settings, 0)
            snap = keys_copy(raw, pattern)  # what the lagging replica will hold
            if not relay_up:
                svc.relay._broken = relay_down  # type: ignore[method-assign]
            async with Publisher(settings) as pub:
                await pub.publish_many([ev.ObjectCopied(
                    repository=REPO, branch="main", staging_token="t", path="b", address=a,
                    size=1, ref_id="r2", source_read_at=0.0)])
            await until(lambda: store.read(REPO, 0), lambda d: d.broken is not None)
            if relay_up:
                await until(lambda: svc.outbox.breaks(REPO), bool)
            else:
                await until(lambda: told, bool)
            prepared = prepare(r, s3, REPO)
            counters = svc.outbox.counters(REPO)
            assert counters is not None
            export = StateExport(
                REPO, await redis_now(settings), prepared.nonce,
                branches={"main": (BranchRecord(None, "t", ()), 1)}, tags={},
                tokens={"t": ("open", (ExportEntry(a, "r1", 1), ExportEntry(a, "r2", 1)))},
                commits={}, issued={},
                continuity=ExportContinuity.of(counters))
            location = write_export(s3, f"{svc.namespace}_hardelete/exports/state-1/", export)
            if not relay_up:
                # Refused: the service does not keep the break (it used to lift it, and a
                # slot that went back later lost it for good: A was reaped live).
                with pytest.raises(RebuildError, match="does not keep that break"):
                    rebuild(r, s3, REPO, location, max_age_ms=60_000, by="test")
                assert store.read(REPO, 0).broken is not None
                await wait_log(settings)
                report = await reap(settings, s3)
                assert svc.exists(a), report
                raw.close()
                return
            rebuild(r, s3, REPO, location, max_age_ms=60_000, by="test")
            assert store.read(REPO, 0).broken is None and store.read(REPO, 0).epoch == 1
            if not relay_up:
                del svc.relay._broken  # the relay is back
                assert not svc.outbox.breaks(REPO)
            await certified(settings, await redis_now(settings))
            await wait_log(settings)
        keys_go_back(raw, snap, pattern)  # the repository's node fails over to a lagging replica
        d = store.read(REPO, 0)
        assert d.broken is None and d.epoch == 0, d
        async with running_tracker(settings, name="t2"):
            svc.emit(delete("a", a, "r1"))
            restored_ms = await redis_now(settings)
            d = await until(lambda: store.read(REPO, 0), lambda d: d.broken is not None
                            or (d.horizon_ms or 0) > restored_ms)
            await asyncio.sleep(settings.grace_seconds + 0.5)
            await wait_log(settings)
            first = await reap(settings, s3)
            assert first.repos[0].skipped == "fail_closed", first
            assert clear(r, REPO, reason="continuity certifies the repository", who="op") == 1
            await wait_log(settings)
            report = await reap(settings, s3)
            # SAFE: r2 (open token t) references A at the service
            assert svc.exists(a), (report, d, store.read(REPO, 0))
            assert d.broken is not None, d
    raw.close()


# --- 3. an export behind what the mirror had applied -------------------------------------------

@BOTH
async def test_an_export_behind_what_the_mirror_applied_is_refused(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    """A is written (r1, seq 3, applied). An event without a seq breaks the stripe; the
    service keeps the break. The tracker prepares (its snapshot holds r1). The service's
    export job reads a replica of its store that lags behind the primary (from before r1):
    the state has no r1 and its counter says 2, read in one transaction with it, and it names
    the current nonce. The tracker had applied seq 3 of that incarnation before the prepare,
    so it holds the proof that this export is behind (as `lied` proves a watermark behind),
    yet the rebuild drops r1 (a snapshot reference the export does not list), starts the
    prefix at 2, and the re-sent seq 3 (add r1 with token t) cannot undo a removal of r1 with
    token t. A is reaped while r1 references it at the service."""
    from schemas.publisher import Publisher

    async with service(fast, s3, tmp_path) as svc, running_tracker(fast):
        r = redis_sync(fast)
        store = ContinuityStore(r)
        lagging = svc.outbox.counters(REPO)  # the replica: created, main; no r1
        assert lagging is not None and lagging.seqs == (2,)
        a = svc.store("data/a")
        svc.emit(write("a", a, "r1"))
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix >= 3)
        async with Publisher(fast) as pub:  # outside the outbox: A1 broken once
            await pub.publish_many([write("x", svc.store("data/x"), "rx")])
        await until(lambda: store.read(REPO, 0), lambda d: d.broken is not None)
        await until(lambda: svc.outbox.breaks(REPO), bool)
        prepared = prepare(r, s3, REPO)
        export = StateExport(
            REPO, await redis_now(fast), prepared.nonce,
            branches={"main": (BranchRecord(None, "t", ()), 1)}, tags={},
            tokens={"t": ("open", ())}, commits={}, issued={},
            continuity=ExportContinuity(lagging.incarnation, lagging.seqs))
        location = write_export(s3, f"{svc.namespace}_hardelete/exports/state-1/", export)
        refused = None
        try:
            rebuild(r, s3, REPO, location, max_age_ms=60_000, by="test")
        except Exception as exc:  # SAFE outcome: the export is refused (nothing lifted)
            refused = exc
        if refused is None:
            await until(lambda: store.read(REPO, 0), lambda d: d.prefix >= 3)  # re-sent
            await certified(fast, await redis_now(fast))
            await asyncio.sleep(fast.grace_seconds + 0.2)
            await certified(fast, await redis_now(fast))
            await wait_horizon(fast, await redis_now(fast))
            report = await reap(fast, s3)
            assert svc.exists(a), (report, r.hgetall(addr_key(a)))


# --- held: the slot goes back right after the lift ---------------------------------------------

@BOTH
async def test_a_slot_that_goes_back_right_after_the_lift_is_not_lifted_again(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    """The rebuild lifts; the repository's slot then goes back to between the prepare and the
    lift (a failover to a replica that missed the last chunk). The stripe is broken again
    (epoch 0), the prepare is back, but its nonce is used: neither the same export nor the
    tracker's heal lifts it again (heal prepares anew), and nothing is reaped."""
    from schemas.publisher import Publisher
    from tracker.rebuild import RebuildError, heal

    settings = fast.replace(rebuild_interval_seconds=0.0)
    raw: Any = redis_sync(settings)
    pattern = f"hd:{{{REPO}}}:*"
    async with service(settings, s3, tmp_path) as svc, running_tracker(settings):
        r = redis_sync(settings)
        store = ContinuityStore(r)
        a = svc.store("data/a")
        svc.emit(write("a", a, "r1"))
        await until(lambda: store.read(REPO, 0), lambda d: d.prefix >= 3)
        async with Publisher(settings) as pub:
            await pub.publish_many([write("x", svc.store("data/x"), "rx")])
        await until(lambda: store.read(REPO, 0), lambda d: d.broken is not None)
        await until(lambda: svc.outbox.breaks(REPO), bool)
        prepared = prepare(r, s3, REPO)
        counters = svc.outbox.counters(REPO)
        assert counters is not None
        export = StateExport(
            REPO, await redis_now(settings), prepared.nonce,
            branches={"main": (BranchRecord(None, "t", ()), 1)}, tags={},
            tokens={"t": ("open", (ExportEntry(a, "r1", 1),))}, commits={}, issued={},
            continuity=ExportContinuity.of(counters))
        location = write_export(s3, f"{svc.namespace}_hardelete/exports/state-1/", export)
        snap = keys_copy(raw, pattern)
        rebuild(r, s3, REPO, location, max_age_ms=60_000, by="test")
        assert store.read(REPO, 0).epoch == 1
        keys_go_back(raw, snap, pattern)
        d = store.read(REPO, 0)
        assert d.broken is not None and d.epoch == 0, d
        with pytest.raises(RebuildError, match="not the current one"):
            rebuild(r, s3, REPO, location, max_age_ms=60_000, by="test")
        healed = heal(r, s3, max_age_ms=60_000, by="test")
        assert healed.prepared == [REPO] and not healed.rebuilt, healed
        assert store.read(REPO, 0).broken is not None
        await asyncio.sleep(settings.grace_seconds + 0.2)
        await wait_horizon(settings, await redis_now(settings))
        report = await reap(settings, s3)
        assert svc.exists(a), report
        assert not report.repos or not report.repos[0].deleted, report
