"""The reaper's metrics the alert rules read (compose/alerts.yml): a pass without proof of the
trackers' progress says so, a failed pass is counted, and refused deletes are told apart from
failed ones. No server: Redis is a stand-in object."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from prometheus_client import REGISTRY

from core.deleter import Report
from reaper.claims import Claim, ClaimBatch
from reaper.daemon import HORIZON_LAG, Reaper, RepoPass
from sim.testing import base_settings


class _NoProgress:
    """Redis as a reaper sees it before any tracker proved progress."""

    async def hgetall(self, key: str) -> dict[str, str]:
        return {}

    async def aclose(self) -> None:
        return None

    def register_script(self, script: str) -> None:
        return None


class _Down(_NoProgress):
    async def hgetall(self, key: str) -> dict[str, str]:
        raise ConnectionError("Redis is down")


def _reaper(redis: Any) -> Reaper:
    return Reaper(base_settings(s3_endpoint_url="http://127.0.0.1:1"), redis=redis)


def _value(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_no_proof_of_progress_reads_as_an_infinite_horizon_lag() -> None:
    """Without a horizon nothing may be reaped: the gauge must not keep its last, fresh value
    (HardeleteReapingHeldBack would never fire)."""
    HORIZON_LAG.set(1.0)
    report = asyncio.run(_reaper(_NoProgress()).run_once())
    assert report.horizon_ms is None
    assert _value("hardelete_reaper_horizon_lag_seconds") == math.inf


def test_a_failed_pass_is_counted() -> None:
    before = _value("hardelete_reaper_pass_failures_total")

    async def scenario() -> None:
        reaper = _reaper(_Down())
        stop = asyncio.Event()
        task = asyncio.create_task(reaper.run(stop))
        while _value("hardelete_reaper_pass_failures_total") < before + 2:  # and goes on
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_refused_deletes_are_counted_apart_from_failed_ones() -> None:
    repo = "metrics-repo"
    labels = {"repository": repo}
    failed0 = _value("hardelete_reaper_failures_total", labels)
    refused0 = _value("hardelete_reaper_refused_total", labels)
    batch = ClaimBatch(now_ms=1_000, claimed=[Claim(f"s3://b/{i}", 1, 0) for i in range(3)],
                       kept=[])
    outcome = Report(deleted=("s3://b/0",), failed={"s3://b/1": "AccessDenied: no"},
                     refused={"s3://b/2": "outside the namespace"})
    result = RepoPass(repo)
    _reaper(_NoProgress())._account(result, batch, outcome, _NullLog())
    assert (result.failed, result.refused) == (1, 1)
    assert _value("hardelete_reaper_failures_total", labels) == failed0 + 1
    assert _value("hardelete_reaper_refused_total", labels) == refused0 + 1


class _NullLog:
    def warning(self, *args: Any, **kw: Any) -> None:
        return None

    def info(self, *args: Any, **kw: Any) -> None:
        return None
