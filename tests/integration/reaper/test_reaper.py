"""The reaper end to end on the real stack (Kafka, Redis, MinIO), driven by the model service.

SPEC.md's safety rules are the acceptance criteria: nothing live is ever deleted, a stopped
tracker holds reaping back, a crash between claim and delete loses nothing and leaves nothing
stuck, partial S3 failures are retried and reported truthfully, late references are incidents.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from typing import Any

import orjson
import pytest
from prometheus_client import REGISTRY

from core.clients import redis_async, s3_client
from core.settings import Settings
from hardelete.status import collect_status, explain_address
from reaper.claims import ClaimStore
from reaper.daemon import Reaper
from schemas.layout import AddressState, RepoKeys
from schemas.publisher import Publisher, ensure_topics
from sim.faultproxy import FaultProxy
from sim.model import Model, ModelService, Workload
from sim.reaping import _many_garbage, _service, _settings, _state_is
from sim.testing import listed, wait_for
from tracker.daemon import running_tracker
from tracker.state import parse_address

# The service certifies its history (schemas/README.md, "Continuity").
pytestmark = pytest.mark.usefixtures("sequenced")


async def test_reaps_online_garbage_and_never_anything_live(settings, s3):
    s = _settings(settings)
    await ensure_topics(s)
    async with Publisher(s) as pub:
        svc = await _service(s, s3, pub)
        await svc.run_workload(Workload(seed=11, ops=160, bucket="wl-reap"))
    bucket = "wl-reap"
    before = listed(s3, bucket)
    repo = next(iter(svc.model.repositories))
    reaped_before = REGISTRY.get_sample_value(
        "hardelete_reaper_objects_reaped_total", {"repository": repo}) or 0.0
    latency_before = REGISTRY.get_sample_value(
        "hardelete_reaper_unreferenced_to_deleted_seconds_count") or 0.0
    deleted: set[str] = set()
    async with running_tracker(s):
        reaper = Reaper(s)
        try:
            async def done() -> bool:
                truth = svc.model.truth()
                report = await reaper.run_once()
                for repo in report.repos:
                    assert repo.failed == 0 and repo.refused == 0
                now = listed(s3, bucket)
                deleted.update(before - now)
                # Safety at every step: nothing that is not online garbage ever disappears.
                assert not (deleted - truth.online_garbage), deleted - truth.online_garbage
                return bool(truth.online_garbage) and truth.online_garbage <= deleted
            await wait_for(done, 40, "every online-reclaimable address to be reaped")
        finally:
            await reaper.close()
    truth = svc.model.truth()
    assert deleted == truth.online_garbage
    live = truth.committed | truth.superseded | truth.staged_live | truth.leaked
    assert live and live <= listed(s3, bucket)
    r = redis_async(s)
    try:
        st = await r.hgetall(RepoKeys(repo).stats)
        assert int(st.get("reaped", 0)) == len(truth.online_garbage)
    finally:
        await r.aclose()
    # The Prometheus metrics say the same.
    reaped_metric = REGISTRY.get_sample_value(
        "hardelete_reaper_objects_reaped_total", {"repository": repo})
    assert reaped_metric == reaped_before + len(truth.online_garbage)
    latency_count = REGISTRY.get_sample_value(
        "hardelete_reaper_unreferenced_to_deleted_seconds_count")
    assert latency_count == latency_before + len(truth.online_garbage)


async def _one_garbage(s: Settings, s3: Any, pub: Publisher, bucket: str) -> tuple[
        ModelService, str, str]:
    svc = await _service(s, s3, pub)
    ns = f"s3://{bucket}/repo/"
    await svc.call(Model.create_repository, "repo", ns)
    keep = (await svc.call(Model.write, "repo", "main", "keep", 10)).address
    gone = (await svc.call(Model.write, "repo", "main", "gone", 10)).address
    await svc.call(Model.delete, "repo", "main", "gone")
    assert keep and gone
    return svc, keep, gone


async def test_stopped_tracker_holds_the_reaper_back(settings, s3):
    s = _settings(settings, upload_ttl_seconds=0.5)
    await ensure_topics(s)
    async with Publisher(s) as pub:
        _svc, keep, gone = await _one_garbage(s, s3, pub, "held")
        async with running_tracker(s) as tracker:
            await wait_for(lambda: _state_is(s, "repo", gone, *ENDED), 20,
                           "the delete to be applied")
            await tracker.stop()
        # The tracker is stopped: wall-clock time passes well beyond grace and token expiry,
        # but its proven progress does not, so nothing may go.
        await asyncio.sleep(s.grace_seconds + s.upload_ttl_seconds + 1.0)
        reaper = Reaper(s)
        try:
            report = await reaper.run_once()
            assert report.total("deleted") == 0
            assert {keep, gone} <= listed(s3, "held")
            async with running_tracker(s):
                async def reaped() -> bool:
                    await reaper.run_once()
                    return gone not in listed(s3, "held")
                await wait_for(reaped, 20, "the reaper to proceed once the tracker runs")
        finally:
            await reaper.close()
    assert keep in listed(s3, "held")


# Garbage whose upload token has not expired yet stays `issued` until then (claimable after).
ENDED = (AddressState.UNREFERENCED, AddressState.ISSUED)


def _env(s: Settings) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("kafka_bootstrap", "redis_url", "s3_endpoint_url", "events_topic", "dlq_topic",
                 "consumer_group", "grace_seconds", "lease_seconds", "upload_ttl_seconds"):
        env[f"HARDELETE_{name.upper()}"] = str(getattr(s, name))
    env["HARDELETE_ALLOW_UNSAFE_GRACE"] = "true"
    env["HARDELETE_LOG_FORMAT"] = "json"
    return env


async def test_kill_9_between_claim_and_delete_then_restart_finishes(settings, s3):
    s = _settings(settings, lease_seconds=3.0)
    await ensure_topics(s)
    async with Publisher(s) as pub:
        _svc, keep, gone = await _one_garbage(s, s3, pub, "crash")
        async with running_tracker(s):
            await wait_for(lambda: _state_is(s, "repo", gone, *ENDED), 20,
                           "the delete to be applied")
            with FaultProxy(s.s3_endpoint_url) as proxy:
                proxy.faults.hold_deletes = threading.Event()  # the delete request hangs
                env = _env(s.replace(s3_endpoint_url=proxy.url))
                proc = subprocess.Popen([sys.executable, "-m", "hardelete.cli", "reaper", "run"],
                                        env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
                try:
                    waited = await asyncio.to_thread(proxy.faults.deletes_waiting.wait, 30)
                    assert waited, "the reaper never reached its delete"
                    # Claimed, delete in flight: kill -9 right here.
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(10)
                finally:
                    proxy.faults.drop_held = True  # the dead reaper's request never lands
                    proxy.faults.hold_deletes.set()
                    if proc.poll() is None:
                        proc.kill()
            assert await _state_is(s, "repo", gone, AddressState.REAPING)
            assert gone in listed(s3, "crash")
            reaper = Reaper(s)
            try:
                first = await reaper.run_once()  # the dead reaper's lease still holds
                assert first.total("deleted") == 0

                async def finished() -> bool:
                    await reaper.run_once()
                    return await _state_is(s, "repo", gone, AddressState.REAPED)
                await wait_for(finished, 20, "the expired claim to be taken and finished")
            finally:
                await reaper.close()
    assert gone not in listed(s3, "crash") and keep in listed(s3, "crash")


async def test_partial_s3_failures_are_retried_and_reported_truthfully(settings, s3):
    s = _settings(settings, lease_seconds=1.5)
    await ensure_topics(s)
    async with Publisher(s) as pub:
        svc = await _service(s, s3, pub)
        ns = "s3://partial/repo/"
        await svc.call(Model.create_repository, "repo", ns)
        garbage = []
        for i in range(30):
            garbage.append((await svc.call(Model.write, "repo", "main", f"p{i}", 5)).address)
        for i in range(30):
            await svc.call(Model.delete, "repo", "main", f"p{i}")
    denied = {a for a in garbage[:3] if a}
    flaky = {a for a in garbage[3:6] if a}
    with FaultProxy(s.s3_endpoint_url) as proxy:
        proxy.faults.fail_keys = {a.split("/", 3)[3]: ("AccessDenied", 1) for a in denied}
        proxy.faults.fail_keys.update({a.split("/", 3)[3]: ("InternalError", 2) for a in flaky})
        reaper = Reaper(s, s3=s3_client(s.replace(s3_endpoint_url=proxy.url)))
        try:
            async with running_tracker(s):
                totals = {"deleted": 0, "failed": 0}

                async def first_pass_done() -> bool:
                    rep = await reaper.run_once()
                    totals["deleted"] += rep.total("deleted")
                    totals["failed"] += rep.total("failed")
                    return totals["deleted"] + totals["failed"] >= len(garbage)
                await wait_for(first_pass_done, 20, "all garbage to be attempted")
                # Retryable errors were retried inside the pass; denied keys are reported as
                # failed, not deleted, and the store agrees.
                assert totals == {"deleted": len(garbage) - len(denied), "failed": len(denied)}
                assert denied <= listed(s3, "partial")
                assert not (set(garbage) - denied) & listed(s3, "partial")
                for a in denied:
                    assert await _state_is(s, "repo", a, AddressState.REAPING)

                async def all_gone() -> bool:
                    await reaper.run_once()
                    return not (set(garbage) & listed(s3, "partial"))
                await wait_for(all_gone, 20, "failed keys to be retried after their lease")
        finally:
            await reaper.close()


async def test_a_throttled_store_the_reaper_backs_off_and_loses_nothing(settings, s3):
    """MinIO behind the fault proxy answers the first delete requests 503 SlowDown (issue 24):
    the reaper backs off and asks again (each retry judged again by the gate first), every
    garbage object goes within the pass, nothing live is touched, and no request is lost."""
    s = _settings(settings)
    await ensure_topics(s)
    async with Publisher(s) as pub:
        svc = await _service(s, s3, pub)
        await svc.call(Model.create_repository, "repo", "s3://slow/repo/")
        keep = (await svc.call(Model.write, "repo", "main", "keep", 5)).address
        garbage = [(await svc.call(Model.write, "repo", "main", f"p{i}", 5)).address
                   for i in range(20)]
        for i in range(20):
            await svc.call(Model.delete, "repo", "main", f"p{i}")
    with FaultProxy(s.s3_endpoint_url) as proxy:
        proxy.faults.throttle_deletes = 3
        reaper = Reaper(s, s3=s3_client(s.replace(s3_endpoint_url=proxy.url)))
        try:
            async with running_tracker(s):
                deleted = 0

                async def all_deleted() -> bool:
                    nonlocal deleted
                    deleted += (await reaper.run_once()).total("deleted")
                    return deleted >= len(garbage)
                await wait_for(all_deleted, 30, "the garbage to be deleted through 503s")
        finally:
            await reaper.close()
        assert proxy.faults.throttle_deletes == 0  # all three 503s were answered...
        assert proxy.faults.delete_requests >= 4  # ... and each was asked again
    assert deleted == len(garbage)
    assert not set(garbage) & listed(s3, "slow") and keep in listed(s3, "slow")


@pytest.mark.unsequenced  # (a service holding an event back: sequenced, a gap holds the horizon)
async def test_late_copy_is_an_incident(settings, s3, redis_client):
    s = _settings(settings)
    await ensure_topics(s)
    async with Publisher(s) as pub:
        svc = await _service(s, s3, pub)
        await svc.call(Model.create_repository, "repo", "s3://late/repo/")
        await svc.call(Model.create_branch, "repo", "dev")
        addr = (await svc.call(Model.write, "repo", "main", "a", 5)).address
        assert addr
        # The service copies a -> dev/b, but its event is held back (a publisher breaking the
        # contract); then main/a is deleted and that event is published promptly.
        held = svc.model.copy("repo", "main", "a", "dev", "b")
        await svc.call(Model.delete, "repo", "main", "a")
        async with running_tracker(s):
            reaper = Reaper(s)
            try:
                async def reaped() -> bool:
                    await reaper.run_once()
                    return await _state_is(s, "repo", addr, AddressState.REAPED)
                await wait_for(reaped, 20, "the address to be reaped")
            finally:
                await reaper.close()
            await pub.publish_many(held)

            def incidents() -> list[str]:
                return list(redis_client.lrange(RepoKeys("repo").incidents, 0, -1))

            async def recorded() -> bool:
                return bool(incidents())
            await wait_for(recorded, 20, "the incident to be recorded")
    incident = orjson.loads(incidents()[0])
    assert incident["address"] == addr and incident["type"] == "object_copied"
    assert incident["repository"] == "repo" and incident["at_ms"] > 0
    status = collect_status(redis_client)
    assert [r.incidents for r in status.repositories] == [1]
    ex = explain_address(redis_client, s, addr)
    assert any("INCIDENT" in line for line in ex.lines)
    assert ex.state == "reaped"


async def test_dry_run_deletes_nothing(settings, s3):
    s = _settings(settings)
    await ensure_topics(s)
    async with Publisher(s) as pub:
        _svc, keep, gone = await _one_garbage(s, s3, pub, "dry")
    async with running_tracker(s):
        reaper = Reaper(s, dry_run=True)
        try:
            async def proposed() -> bool:
                rep = await reaper.run_once()
                return any(gone in r.would_delete for r in rep.repos)
            await wait_for(proposed, 20, "the dry run to propose the garbage")
        finally:
            await reaper.close()
    assert {keep, gone} <= listed(s3, "dry")
    r = redis_async(s)
    try:
        h = await r.hgetall(RepoKeys("repo").address(gone))
        assert parse_address(h).state in ENDED
        assert await ClaimStore(r).complete("repo", []) == 0
    finally:
        await r.aclose()


async def test_two_reapers_never_delete_twice(settings, s3):
    s = _settings(settings, reaper_batch_keys=10, reaper_concurrency=2)
    await ensure_topics(s)
    garbage, keep = await _many_garbage(s, s3, "twins", 60)
    async with running_tracker(s):
        a, b = Reaper(s, reaper_id="a"), Reaper(s, reaper_id="b")
        deleted = {"a": 0, "b": 0}
        try:
            async def done() -> bool:
                ra, rb = await asyncio.gather(a.run_once(), b.run_once())
                deleted["a"] += ra.total("deleted")
                deleted["b"] += rb.total("deleted")
                return not (set(garbage) & listed(s3, "twins"))
            await wait_for(done, 30, "both reapers to finish the garbage")
        finally:
            await a.close()
            await b.close()
    # Each address was claimed once: the confirmed deletes add up to the garbage exactly.
    assert deleted["a"] + deleted["b"] == len(garbage)
    assert keep in listed(s3, "twins")


async def test_quarantine_then_restore(settings, s3, redis_client):
    s = _settings(settings, quarantine_days=1.0)
    await ensure_topics(s)
    garbage, _keep = await _many_garbage(s, s3, "quar", 3)
    async with running_tracker(s):
        reaper = Reaper(s)
        try:
            async def moved() -> bool:
                await reaper.run_once()
                return not (set(garbage) & listed(s3, "quar"))
            await wait_for(moved, 20, "garbage to move to quarantine")
        finally:
            await reaper.close()
    quarantined = {a.replace("s3://quar/repo/", "s3://quar/repo/_hardelete/quarantine/")
                   for a in garbage}
    assert quarantined <= listed(s3, "quar")
    from reaper.quarantine import restore

    done = await restore(s, "repo", garbage[0])
    # nothing references it: the grace window starts again; the copy goes once it is back
    assert done.state == "unreferenced" and done.copy_kept is None
    assert garbage[0] in listed(s3, "quar")
    assert garbage[0].replace("/repo/", "/repo/_hardelete/quarantine/") not in listed(s3, "quar")
    h = redis_client.hgetall(RepoKeys("repo").address(garbage[0]))
    assert parse_address(h).state == AddressState.UNREFERENCED
    proc = subprocess.run([sys.executable, "-m", "hardelete.cli", "restore", "repo",
                           garbage[0]], env=_env(s), capture_output=True, text=True)
    assert proc.returncode == 2 and "not in quarantine" in proc.stderr
    assert "Traceback" not in proc.stderr


async def test_reaper_cli_once_dry_run_then_for_real(settings, s3):
    s = _settings(settings)
    await ensure_topics(s)
    async with Publisher(s) as pub:
        _svc, keep, gone = await _one_garbage(s, s3, pub, "cli")
    async with running_tracker(s):
        await wait_for(lambda: _state_is(s, "repo", gone, *ENDED), 20, "the delete applied")

        def once(*extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "hardelete.cli", "reaper", "run",
                                   "--once", *extra], env=_env(s), capture_output=True,
                                  text=True, timeout=60)

        async def proposed() -> bool:
            proc = await asyncio.to_thread(once, "--dry-run", "--json")
            assert proc.returncode == 0, proc.stderr
            body = orjson.loads(proc.stdout)
            return any(gone in r["would_delete"] for r in body["repositories"])
        await wait_for(proposed, 30, "the dry run to propose the garbage")
        assert {keep, gone} <= listed(s3, "cli")
        proc = await asyncio.to_thread(once)
        assert proc.returncode == 0 and "reaper pass" in proc.stdout
        assert "Traceback" not in proc.stderr
    assert gone not in listed(s3, "cli") and keep in listed(s3, "cli")
