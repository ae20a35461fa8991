"""Continuity is per repository (schemas/README.md, "Continuity"), end to end on the real stack:
a gap or a restored store in one repository stops that repository's deletions only, with a
reason; the other repositories go on being certified and reaped."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, closing, suppress
from pathlib import Path
from typing import Any

import pytest

from core.clients import redis_sync
from core.continuity_store import ContinuityStore
from core.settings import Settings
from reaper.daemon import Reaper
from schemas import events as ev
from schemas.layout import RepoKeys
from schemas.outbox import Outbox
from sim.sequenced import LossyRelay
from sim.testing import object_exists, put_object, redis_now, wait_for, wait_horizon
from tracker.daemon import running_tracker

pytestmark = pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)

ONE, TWO = "one", "two"


class TwoRepos:
    """Two repositories, each in its own service (its own store, outbox and relay)."""

    def __init__(self, settings: Settings, s3: Any, outboxes: dict[str, Outbox],
                 relays: dict[str, LossyRelay], bucket: str) -> None:
        self.settings, self.s3, self.outboxes, self.relays = settings, s3, outboxes, relays
        self.bucket = bucket

    def namespace(self, repo: str) -> str:
        return f"s3://{self.bucket}/{repo}/"

    def emit(self, *events: ev.ServiceEvent) -> list[ev.ServiceEvent]:
        (repo,) = {e.repository for e in events}
        with self.outboxes[repo].transaction() as tx:
            return [tx.emit(e) for e in events]

    def store(self, repo: str, path: str) -> str:
        return put_object(self.s3, self.namespace(repo) + path)

    def exists(self, address: str) -> bool:
        return object_exists(self.s3, address)

    def garbage(self, repo: str, path: str, ref: str) -> str:
        """An object written and deleted at once: unreferenced from now."""
        a = self.store(repo, path)
        self.emit(ev.ObjectWritten(repository=repo, branch="main", staging_token=f"t-{repo}",
                                   path=path, address=a, size=1, ref_id=ref),
                  ev.ObjectDeleted(repository=repo, branch="main", staging_token=f"t-{repo}",
                                   path=path, address=a, ref_id=ref))
        return a


@asynccontextmanager
async def two_repos(settings: Settings, s3: Any, tmp_path: Path) -> AsyncIterator[TwoRepos]:
    bucket = f"doms-{int(time.time() * 1000) % 10**9}"
    with suppress(s3.exceptions.BucketAlreadyOwnedByYou):
        s3.create_bucket(Bucket=bucket)
    outboxes = {repo: Outbox(tmp_path / f"{repo}.db") for repo in (ONE, TWO)}
    relays = {repo: LossyRelay(settings, outboxes[repo]) for repo in (ONE, TWO)}
    async with relays[ONE], relays[TWO]:
        svc = TwoRepos(settings, s3, outboxes, relays, bucket)
        for repo in (ONE, TWO):
            svc.emit(ev.RepositoryCreated(repository=repo, storage_namespace=svc.namespace(repo),
                                          default_branch="main", default_retention_days=1.0),
                     ev.BranchCreated(repository=repo, branch="main", staging_token=f"t-{repo}",
                                      ref_version=1))
        try:
            yield svc
        finally:
            for outbox in outboxes.values():
                outbox.close()


@pytest.fixture
def fast(settings: Settings) -> Settings:
    return settings.replace(tick_interval_seconds=0.1, resend_interval_seconds=0.3)


async def _reap(settings: Settings, s3: Any) -> None:
    reaper = Reaper(settings, s3=s3)
    try:
        await reaper.run_once()
    finally:
        await reaper.close()


async def _reaped(settings: Settings, s3: Any, svc: TwoRepos, address: str) -> None:
    async def gone() -> bool:
        await _reap(settings, s3)
        return not svc.exists(address)
    await wait_for(gone, 30, f"{address} to be reaped")


async def test_a_gap_in_one_repository_leaves_the_others_horizon_moving(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    async with two_repos(fast, s3, tmp_path) as svc, running_tracker(fast):
        kept = svc.store(ONE, "data/a")
        svc.emit(ev.ObjectWritten(repository=ONE, branch="main", staging_token="t-one",
                                  path="a", address=kept, size=1, ref_id="r1"))
        copy = ev.ObjectCopied(repository=ONE, branch="main", staging_token="t-one", path="b",
                               address=kept, size=1, ref_id="r2", source_read_at=0.0)
        svc.relays[ONE].drop.add(copy.event_id)  # its publish is lost, re-sends too for now
        svc.emit(copy)
        svc.emit(ev.ObjectDeleted(repository=ONE, branch="main", staging_token="t-one",
                                  path="a", address=kept, ref_id="r1"))
        gap_at = await redis_now(fast)
        two_garbage = svc.garbage(TWO, "data/g", "g1")
        await wait_horizon(fast, await redis_now(fast))
        await asyncio.sleep(fast.grace_seconds + 0.3)
        # the other repository is certified past the gap and its garbage goes
        await _reaped(fast, s3, svc, two_garbage)
        r = redis_sync(fast)
        store = ContinuityStore(r)
        assert (store.horizon(TWO, 1) or 0) > gap_at + fast.grace_seconds * 1000
        # the repository with the gap is held where its gap is: nothing of it goes
        one = store.read(ONE, 0)
        assert one.prefix == 3 and one.above == {5} and one.broken is None, one
        assert one.horizon_ms is None or one.horizon_ms < gap_at
        assert svc.exists(kept)
        # the re-send heals it, with no rebuild and no break: the copy keeps the object
        svc.relays[ONE].drop.clear()

        async def healed() -> bool:
            return store.read(ONE, 0).prefix == 5
        await wait_for(healed, 30, "the lost copy to be re-sent and applied")
        await asyncio.sleep(fast.grace_seconds + 0.3)
        await wait_horizon(fast, await redis_now(fast))
        await _reap(fast, s3)
        assert svc.exists(kept)
        assert store.read(ONE, 0).broken is None


async def test_a_restored_store_stops_only_its_repository_with_a_reason(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    """ONE's service store is restored from a backup (a new incarnation): its next event
    reuses seq 3, which the tracker applied from the old history (a's write), so ONE's domain
    stops, with a reason, until it is rebuilt. TWO's service goes on being certified and
    reaped."""
    async with two_repos(fast, s3, tmp_path) as svc, running_tracker(fast):
        backup = sqlite3.connect(tmp_path / "restored.db")
        with closing(sqlite3.connect(tmp_path / "one.db")) as live:
            live.backup(backup)  # ONE's store backed up, before a's write and delete
        backup.close()
        a = svc.garbage(ONE, "data/a", "r1")
        await wait_horizon(fast, await redis_now(fast))
        await svc.relays[ONE].stop()  # ONE's service goes down; its store is restored
        svc.outboxes[ONE].close()
        svc.outboxes[ONE] = Outbox(tmp_path / "restored.db")
        svc.outboxes[ONE].restored()  # (as the contract asks: a new incarnation before any write)
        svc.relays[ONE] = LossyRelay(fast, svc.outboxes[ONE])
        async with svc.relays[ONE]:
            b = svc.store(ONE, "data/b")
            svc.emit(ev.ObjectWritten(repository=ONE, branch="main", staging_token="t-one",
                                      path="b", address=b, size=1, ref_id="r9"))
            r = redis_sync(fast)
            store = ContinuityStore(r)

            async def stopped() -> bool:
                return store.read(ONE, 0).broken is not None
            await wait_for(stopped, 30, "ONE's domain to stop")
            assert "incarnation" in (store.read(ONE, 0).broken or ""), store.read(ONE, 0)
            two_garbage = svc.garbage(TWO, "data/g", "g1")
            await asyncio.sleep(fast.grace_seconds + 0.3)
            await _reaped(fast, s3, svc, two_garbage)
            await _reap(fast, s3)
            assert svc.exists(a) and svc.exists(b)  # nothing of ONE goes
            assert store.horizon(ONE, 1) is None


async def test_a_service_crash_between_its_commit_and_the_publish_deletes_nothing(
        fast: Settings, s3: Any, tmp_path: Path) -> None:
    """ONE's service hands out an upload address (its ``address_issued`` is published), the
    client uploads, the service commits the entry (``object_written``, in its outbox) and
    crashes before its relay publishes it. The upload ticket expires, grace passes: no
    consumer-side proof can tell that an event is missing, and the object looks abandoned. The
    repository's horizon waits for a watermark, which only a running relay gives, so nothing
    of ONE goes; TWO goes on. The relay restarts, publishes the row, and the object is staged."""
    s = fast.replace(upload_ttl_seconds=1.0)
    async with two_repos(s, s3, tmp_path) as svc, running_tracker(s):
        a = svc.namespace(ONE) + "data/upload"
        svc.emit(ev.AddressIssued(repository=ONE, address=a, ttl_seconds=1.0))
        r = redis_sync(s)
        store = ContinuityStore(r)

        async def issued_certified() -> bool:
            return store.read(ONE, 0).prefix == 3 and store.horizon(ONE, 1) is not None
        await wait_for(issued_certified, 30, "the address_issued to be applied and certified")
        svc.store(ONE, "data/upload")  # the client's upload
        await svc.relays[ONE].stop()  # the service crashes ...
        svc.emit(ev.ObjectWritten(repository=ONE, branch="main", staging_token="t-one",
                                  path="upload", address=a, size=1, ref_id="r1"))
        crashed_at = await redis_now(s)  # ... after its commit, before the publish
        await asyncio.sleep(s.upload_ttl_seconds + s.grace_seconds + 0.5)
        two_garbage = svc.garbage(TWO, "data/g", "g1")
        await asyncio.sleep(s.grace_seconds + 0.3)
        await _reaped(s, s3, svc, two_garbage)  # (the tracker and the reaper are at work)
        await _reap(s, s3)
        assert svc.exists(a)
        h = store.horizon(ONE, 1)
        assert h is not None and h < crashed_at
        svc.relays[ONE] = LossyRelay(s, svc.outboxes[ONE])  # the service is back
        async with svc.relays[ONE]:
            async def staged() -> bool:
                return bool(r.hget(RepoKeys(ONE).address(a), "state") == "staged")
            await wait_for(staged, 30, "the committed entry to be published and applied")
            await asyncio.sleep(s.grace_seconds + 0.3)
            await wait_horizon(s, await redis_now(s))
            await _reap(s, s3)
            assert svc.exists(a)
