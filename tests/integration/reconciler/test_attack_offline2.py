"""Adversarial review of the offline delete path after the durable facts and the one deleter
(real Kafka, valkey, MinIO). Each test asserts the SAFE outcome."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis as redis_lib

from core.errors import UserError
from core.settings import Settings
from reconciler.retirement import purge_retired
from schemas.layout import NAMESPACES
from schemas.publisher import Publisher, ensure_topics
from sim.model import Model
from sim.model import Model as M
from sim.reaping import _service
from sim.testing import listed, publish, wait_horizon
from tracker.daemon import running_tracker


def _whole_copy(raw: Any) -> dict[bytes, bytes]:
    """Every key of a single Redis (DUMP): the older copy it is restored from later."""
    return {n: raw.dump(n) for n in raw.scan_iter()}


def _whole_go_back(raw: Any, copy: dict[bytes, bytes]) -> None:
    """Redis restored from ``copy``: keys written since go, the others come back."""
    for n in raw.scan_iter():
        if n not in copy:
            raw.delete(n)
    for n, value in copy.items():
        raw.restore(n, 0, value, replace=True)


def test_a_retired_purge_after_redis_went_back_spares_the_namespaces_next_owner(
        settings: Settings, s3: Any, redis_client: Any) -> None:
    """Sequence: A (namespace X) is retired; Redis is copied (a nightly backup); A's data is
    purged when due, which frees X; the service creates B on X and stages an object there
    (live, uncommitted). Redis is restored from the backup: A is retired again, not purged,
    X registered to it; the tracker replays B's `repository_created` and refuses it (X is
    kept for A). The next purge of A (due: `reconcile --all` does it) lists X and deletes B's
    live staged object: its purge was not a fact of the log and had no durable home, so a
    Redis that went back re-derived "A still keeps X" and purged again (SPEC 1, 8, 11).
    The purge runs before the tracker replays (it waits for no tracker): once it has, B's
    dead-lettered events hold B's addresses in A's holds, too late for this purge.

    Now the purge's report, written before the namespace is freed, is its durable record: a
    purge that finds one refuses, and puts the record and the registry back as they were."""
    s = settings.replace(retired_retention_days=0.0)
    ns = "s3://retback/x/"
    raw = redis_lib.Redis.from_url(s.redis_url)

    async def history() -> tuple[dict[bytes, bytes], str]:
        await ensure_topics(s)
        async with Publisher(s) as pub, running_tracker(s):
            svc = await _service(s, s3, pub)
            await svc.call(Model.create_repository, "A", ns)
            await svc.call(Model.write, "A", "main", "old", 10)
            await svc.call(Model.commit, "A", "main")
            await svc.call(Model.delete_repository, "A")
            await wait_horizon(s, await publish(s, []))
            backup = _whole_copy(raw)  # A retired, its data kept, X registered to A
            done = await asyncio.to_thread(purge_retired, s, "A")
            assert done["status"] == "done", done
            assert redis_client.hget(NAMESPACES, ns) is None  # X is free
            await svc.call(Model.create_repository, "B", ns)
            live = (await svc.call(Model.write, "B", "main", "staged", 10)).address
            await wait_horizon(s, await publish(s, []))
            assert redis_client.hget(NAMESPACES, ns) == "B"
            return backup, live

    backup, live = asyncio.run(history())
    assert live in listed(s3, "retback")
    _whole_go_back(raw, backup)  # Redis restored from the backup

    raw.close()
    with pytest.raises(UserError, match="already purged"):
        purge_retired(s, "A")
    # nothing freed either: the report may be forged (test_attack_offline4), so the namespace
    # stays with the Redis copy's owner until an operator has judged it
    assert redis_client.hget(NAMESPACES, ns) == "A"
    assert live in listed(s3, "retback"), (
        "the retired purge of A deleted live repository B's staged object after Redis went "
        "back")


@pytest.mark.spark
def test_a_hold_that_returned_is_not_undone_by_a_sweep_request_in_flight(
        spark: Any, settings: Settings, s3: Any, redis_client: Any) -> None:
    """Sequence: a leaked object is marked and the sweep's request for it is on its way (a
    slow store: the fault proxy holds it). The operator places a legal hold on it: `hold
    add` records its fact, applies it and returns. The request then reaches the store within
    its signed bound (``s3_request_seconds``) and the held object is deleted after the
    operator was told it is held. ``hardelete restore`` waits that bound out after its hold
    (core/deleter.py, point 3); ``hold add`` did not (SPEC 1: deleted while a hold keeps it).
    Now ``hold add`` (and ``pause``) wait it out before they say the object is held.
    """
    import argparse
    import threading

    from hardelete.holds import add
    from reconciler.job import RunOptions, reconcile
    from sim.faultproxy import FaultProxy
    from sim.worlds import BUCKET, boundary, call, make

    rs = settings.replace(reconcile_min_age_seconds=0.0)
    w = make(rs, s3, redis_client)
    ns = f"s3://{BUCKET}/atk-hold/r/"
    call(w, M.create_repository, "r", ns)
    call(w, M.write, "r", "main", "keep", 10)
    w.track(None)
    leak = ns + "data/leaked-object"
    s3.put_object(Bucket=BUCKET, Key=leak[len(f"s3://{BUCKET}/"):], Body=b"legal")
    cutoff = boundary()
    errors: list[BaseException] = []
    with FaultProxy(rs.s3_endpoint_url) as proxy:
        release = threading.Event()
        proxy.faults.hold_deletes = release

        def operator() -> None:
            try:
                assert proxy.faults.deletes_waiting.wait(120), "no delete request came"
                add.run_cli(rs, argparse.Namespace(  # `hardelete hold add`: returned, held
                    target=leak, reason="legal: case 35", prefix=False, repo=None))
            except BaseException as exc:
                errors.append(exc)
            finally:
                release.set()  # the slow store answers now

        t = threading.Thread(target=operator, daemon=True)
        t.start()
        res = reconcile(spark, rs.replace(s3_endpoint_url=proxy.url),
                        RunOptions("r", cutoff_ms=cutoff, allow_large_sweep=True))
        t.join(60)
    assert not errors, errors
    assert res["success"], res["error"]
    assert leak in w.data("r") or leak in listed(s3, BUCKET), (
        f"the held object was deleted after `hold add` returned: {res['sweep']}")
