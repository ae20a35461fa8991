"""One deleter (``core/deleter.py``): every S3 delete and quarantine copy of the product.

Issue 19 finding: ``quarantine purge`` deleted the last copy of an object a commit references
(it checked holds only) and deleted while the repository was paused or fail-closed; restore and
purge called ``delete_object`` outside the one deleter; the deleter's boto3 client retried on
its own, so a throttled request could be re-sent without the re-check.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from core.clients import s3_client
from core.deleter import Deleter, client_attempts
from core.settings import Settings
from reaper.daemon import Reaper
from reaper.quarantine import purge_expired, purge_recheck
from schemas import events as ev
from schemas.layout import RepoKeys
from schemas.publisher import ensure_topics
from sim.reaping import _many_garbage, _settings
from sim.testing import listed, publish, wait_for, wait_horizon
from tracker.daemon import running_tracker

# The service certifies its history (schemas/README.md, "Continuity").
pytestmark = pytest.mark.usefixtures("sequenced")


def test_the_gate_refuses_a_client_that_retries_by_itself(settings: Settings) -> None:
    retrying = s3_client(settings)
    assert client_attempts(retrying) > 1
    with pytest.raises(ValueError, match="does not retry by itself"):
        Deleter(retrying)
    assert client_attempts(s3_client(settings, retries=False)) == 1


# ------------------------------------------------------- quarantine purge through the gate

async def _quarantined(s: Settings, s3: Any, bucket: str) -> list[str]:
    await ensure_topics(s)
    garbage, _keep = await _many_garbage(s, s3, bucket, 3)
    async with running_tracker(s):
        reaper = Reaper(s)
        try:
            async def moved() -> bool:
                await reaper.run_once()
                return not (set(garbage) & listed(s3, bucket))
            await wait_for(moved, 30, "garbage to move to quarantine")
        finally:
            await reaper.close()
    return garbage


def _copy(address: str) -> str:
    return address.replace("/repo/", "/repo/_hardelete/quarantine/", 1)
async def test_purge_keeps_the_last_copy_of_a_committed_address_and_obeys_pause(
        settings: Settings, s3: Any, redis_client: Any) -> None:
    # a quarantine kept for 2 s: expired by the time we purge
    s = _settings(settings, quarantine_days=2 / 86_400)
    garbage = await _quarantined(s, s3, "purge")
    committed, held, free = garbage
    # Beyond the contract, a copy of `committed` arrives after its reap and is committed: the
    # quarantine copy is now the only copy of committed data (the tracker raised an incident).
    branch = redis_client.hget(RepoKeys("repo").branches, "main")
    assert branch
    open_token = orjson.loads(branch)["staging_token"]
    late = [ev.ObjectCopied(repository="repo", branch="main", staging_token=open_token,
                            path="late", address=committed, size=5, ref_id="late-ref",
                            source_read_at=0.0),
            ev.CommitCreated(repository="repo", branch="main", commit_id="c-late",
                             parents=[], sealed_tokens=[open_token], staging_token="t-next",
                             committed_at=1.0, manifest="s3://purge/repo/_hardelete/m",
                             ref_version=10**6)]
    async with running_tracker(s):
        await wait_horizon(s, await publish(s, late))
        assert redis_client.hget(RepoKeys("repo").address(committed), "committed") == "1"
        await wait_horizon(s, await publish(s, []))  # (past every reap: grace 0 below)
        later = time.time() + 3  # the copies' keep period (2 s, wall clock) is over by then
        deleter = Deleter(s3_client(s, retries=False))
        recheck = purge_recheck(redis_client, deleter.client, "repo", "s3://purge/repo/", 0)

        # paused: nothing is purged
        redis_client.set(RepoKeys("repo").paused, "an operator looks")
        assert not (await purge_expired(deleter, "s3://purge/repo/", recheck=recheck,
                                       now=later)).deleted
        assert {_copy(a) for a in garbage} <= listed(s3, "purge")
        redis_client.delete(RepoKeys("repo").paused)
        # fail-closed: nothing is purged
        redis_client.hset(RepoKeys("repo").fail_closed, "reason", "redis went back")
        assert not (await purge_expired(deleter, "s3://purge/repo/", recheck=recheck,
                                       now=later)).deleted
        redis_client.delete(RepoKeys("repo").fail_closed)
        # a hold on one; the committed one is the last copy of committed data: both stay
        redis_client.hset(RepoKeys("repo").holds, held, '{"reason": "legal"}')
        assert len((await purge_expired(deleter, "s3://purge/repo/", recheck=recheck,
                                         now=later)).deleted) == 1
    left = listed(s3, "purge")
    assert _copy(committed) in left and _copy(held) in left
    assert _copy(free) not in left


class _RacedListing:
    """A real client whose listing is answered, then one listed copy is removed (a restore or
    another reaper's purge between the listing and the metadata read)."""

    def __init__(self, client: Any, bucket: str, key: str) -> None:
        self._client, self._bucket, self._key = client, bucket, key

    def get_paginator(self, name: str) -> Any:
        real = self._client.get_paginator(name)
        client, bucket, key = self._client, self._bucket, self._key

        class Raced:
            def paginate(self, **kw: Any) -> Any:
                pages = list(real.paginate(**kw))
                client.delete_object(Bucket=bucket, Key=key)
                return pages
        return Raced()

    def head_object(self, **kw: Any) -> Any:
        return self._client.head_object(**kw)


async def test_purge_passes_over_a_copy_gone_since_its_listing(settings: Settings, s3: Any,
                                                               redis_client: Any) -> None:
    s = _settings(settings, quarantine_days=2 / 86_400)
    garbage = await _quarantined(s, s3, "purgerace")
    taken = _copy(garbage[0]).removeprefix("s3://purgerace/")
    assert _copy(garbage[0]) in listed(s3, "purgerace")
    deleter = Deleter(s3_client(s, retries=False))
    purged = await purge_expired(deleter, "s3://purgerace/repo/", now=time.time() + 3,
                                 listing=_RacedListing(s3, "purgerace", taken))
    assert sorted(purged.deleted) == sorted(_copy(a) for a in garbage[1:])
    assert not {_copy(a) for a in garbage} & listed(s3, "purgerace")
