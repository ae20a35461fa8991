"""A restore cannot race a delete of the same address (issue 34 finding 3), on the real stack.

A reaper claims an address (quarantine mode), copies it into quarantine and sends its delete;
the store is slow: the request hangs on its way (the fault proxy holds it). Its claim's lease
runs out; a second reaper takes the claim, quarantines and deletes the object, and finishes.
The operator restores it: the object is copied back and its quarantine copy deleted. Then the
first reaper's delete reaches the store. Before the one deleter bounded its requests, it
deleted the restored object: both copies gone. Now the store refuses it (its signature has
expired), because restore waited out the bound after placing its hold (core/deleter.py).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from core.clients import s3_client
from reaper.daemon import Reaper
from reaper.quarantine import restore
from schemas.layout import AddressState
from schemas.publisher import ensure_topics
from sim.faultproxy import FaultProxy
from sim.reaping import _many_garbage, _settings, _state_is
from sim.testing import listed, wait_for
from tracker.daemon import running_tracker

# The service certifies its history (schemas/README.md, "Continuity").
pytestmark = pytest.mark.usefixtures("sequenced")


async def test_a_late_delete_never_removes_the_restored_object(settings, s3):
    s = _settings(settings, quarantine_days=1.0, lease_seconds=3.0)
    await ensure_topics(s)
    (gone,), keep = await _many_garbage(s, s3, "race", 1)
    copy = gone.replace("/repo/", "/repo/_hardelete/quarantine/", 1)
    async with running_tracker(s):
        probe = Reaper(s, dry_run=True)
        try:
            async def ready() -> bool:
                report = await probe.run_once()
                return any(gone in r.would_delete for r in report.repos)
            await wait_for(ready, 30, "the garbage to be claimable")
        finally:
            await probe.close()
        with FaultProxy(s.s3_endpoint_url) as proxy:
            proxy.faults.hold_deletes = threading.Event()  # the store is slow: deletes hang
            slow = s.replace(s3_endpoint_url=proxy.url)
            first = Reaper(slow, s3=s3_client(slow, retries=False), reaper_id="slow")
            second = Reaper(s, reaper_id="second")
            try:
                task = asyncio.create_task(first.run_once())
                assert await asyncio.to_thread(proxy.faults.deletes_waiting.wait, 30)
                assert copy in listed(s3, "race")  # copied, its delete on its way

                async def taken_over() -> bool:  # once the first claim's lease ran out
                    await second.run_once()
                    return await _state_is(s, "repo", gone, AddressState.REAPED)
                await wait_for(taken_over, 30, "the expired claim to be taken and finished")
                assert gone not in listed(s3, "race")

                done = await restore(s, "repo", gone)
                assert done.copy_kept is None and gone in listed(s3, "race")

                proxy.faults.hold_deletes.set()  # the late delete reaches the store now
                await task
                deadline = time.monotonic() + 30
                while proxy.faults.deletes_forwarded < proxy.faults.delete_requests:
                    assert time.monotonic() < deadline, "the held deletes were never answered"
                    await asyncio.sleep(0.05)
            finally:
                proxy.faults.hold_deletes.set()
                await first.close()
                await second.close()
    left = listed(s3, "race")
    assert gone in left, "the late delete removed the restored object: both copies are gone"
    assert keep in left
