"""Adversarial review of continuity (schemas/README.md, "Continuity"): sequences that delete an
object live at the service in a SEQUENCED repository, on the real stack (Kafka, valkey, MinIO;
Spark where the reconciler is the delete path).

Each test is the sequence as it runs; one that still deletes a live object is marked
``xfail(strict=True)`` with the hole it shows. The setup is that of
``test_continuity_e2e.py``: a service with an outbox, its relay (which can lose publishes),
the tracker (ticks, watermarks, re-sends) and the delete paths.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from core.clients import redis_sync
from core.continuity_store import ContinuityStore
from core.settings import Settings
from sim.sequenced import REPO, Service, copy, delete, reap, service, write
from sim.testing import redis_now, wait_horizon
from sim.worlds import boundary
from tracker.daemon import running_tracker


@pytest.fixture
def fast(settings: Settings) -> Settings:
    return settings.replace(tick_interval_seconds=0.1, resend_interval_seconds=0.3)


async def lost_copy(svc: Service, settings: Settings) -> str:
    """The sequence of the e2e test: A written (r1), copied (r2: committed at the service, its
    publish lost, first send and re-sends alike), r1 deleted. The log as it is was all applied
    and grace has passed on the tracker's horizon; the service's count (seq 4) says it is not
    complete, so the continuity horizon stays behind. A is live at the service through r2."""
    a = svc.store("data/a")
    svc.emit(write("a", a, "r1"))
    lost = copy("b", a, "r2")
    svc.relay.drop.add(lost.event_id)
    svc.emit(lost)
    svc.emit(delete("a", a, "r1"))
    log_complete = await redis_now(settings)
    await wait_horizon(settings, log_complete)
    await asyncio.sleep(settings.grace_seconds + 0.3)
    await wait_horizon(settings, await redis_now(settings))
    r = redis_sync(settings)
    try:
        d = ContinuityStore(r).read(REPO, 0)
    finally:
        r.close()
    assert d.prefix == 3 and 5 in d.above and d.broken is None, d
    assert d.horizon_ms is None or d.horizon_ms < log_complete, d
    return a


# --- 1. the reconciler and the continuity horizon --------------------------------------------
# The reconciler's mark judges the mirror's records by the log's horizon, which a lost copy
# does not hold back; its sweep re-judges each address by the one evidence reader, which must
# keep everything of a sequenced repository without a continuity horizon on this path too
# (schemas.liveness.judge reads "no horizon" on the reconciler path as "the cutoff alone").

@pytest.mark.spark
@pytest.mark.parametrize("topology", ["single"], indirect=True)
async def test_the_reconciler_keeps_an_object_the_continuity_horizon_keeps(
        fast: Settings, s3: Any, tmp_path: Path, spark: Any) -> None:
    from reconciler.job import RunOptions, reconcile

    rs = fast.replace(reconcile_min_age_seconds=0.0)
    async with service(rs, s3, tmp_path) as svc, running_tracker(rs):
        a = await lost_copy(svc, rs)
        report = await reap(rs, s3)
        assert svc.exists(a), report  # the online path keeps it: no continuity horizon
        cutoff = await asyncio.to_thread(boundary)
        res = await asyncio.to_thread(reconcile, spark, rs, RunOptions(
            REPO, cutoff_ms=cutoff, allow_large_sweep=True))
        assert svc.exists(a), (
            f"A, live at the service through the copy r2 (seq 4, never applied), was deleted "
            f"by the reconciler: mark {res.get('mark')}, sweep {res.get('sweep')}")
        # the mark refuses too, with the reason, rather than marking what the sweep refuses
        assert not res["success"] and "not certified its history" in str(res["error"]), res
