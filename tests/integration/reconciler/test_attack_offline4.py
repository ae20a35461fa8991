"""Adversarial review of the offline delete path (real Kafka, valkey, MinIO). Each test asserts
the SAFE outcome; a reproduced unsafe sequence is marked xfail(strict)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from core.errors import UserError
from core.settings import Settings
from hardelete.holds import add_hold
from reconciler.retirement import purge_retired
from schemas.layout import NAMESPACES
from schemas.publisher import Publisher, ensure_topics
from sim.model import Model
from sim.reaping import _service
from sim.testing import listed, publish, wait_horizon
from tracker.daemon import running_tracker


def test_a_forged_purge_report_does_not_free_a_namespace_whose_held_data_stays(
        settings: Settings, s3: Any, redis_client: Any) -> None:
    """Sequence: A (namespace X) writes and commits `kept`; an operator holds it (legal).
    A is deleted (retired) and due. Anyone who can write X puts a summary.json under
    X_hardelete/reports/retired-forged/ saying A's purge is done. `purge A` trusts it: it
    deletes nothing, but marks A purged and frees X (the held object is still there, which
    a real purge would never have left: it keeps held objects and then does not free X).
    B is created on X, then deleted and purged (`--release`): B's purge lists X and judges
    each object with B's guards only, so A's held object is deleted."""
    s = settings.replace(retired_retention_days=0.0)
    ns = "s3://forgedrep/x/"
    bucket, prefix = "forgedrep", "x/"

    async def history() -> str:
        await ensure_topics(s)
        async with Publisher(s) as pub, running_tracker(s):
            svc = await _service(s, s3, pub)
            await svc.call(Model.create_repository, "A", ns)
            kept = (await svc.call(Model.write, "A", "main", "kept", 10)).address
            await svc.call(Model.commit, "A", "main")
            await wait_horizon(s, await publish(s, []))
            add_hold(redis_client, kept, "legal: case 7", s3=s3, repo="A")
            await svc.call(Model.delete_repository, "A")
            await wait_horizon(s, await publish(s, []))
            s3.put_object(Bucket=bucket, Key=f"{prefix}_hardelete/reports/retired-forged/"
                          "summary.json", Body=orjson.dumps({
                              "run_id": "retired-forged", "kind": "retired_purge",
                              "repository": "A", "status": "done"}))
            with pytest.raises(UserError, match="already purged"):
                await asyncio.to_thread(purge_retired, s, "A")
            assert kept in listed(s3, bucket)
            if redis_client.hget(NAMESPACES, ns) is None:  # X was freed: B may take it
                await svc.call(Model.create_repository, "B", ns)
                await wait_horizon(s, await publish(s, []))
                await svc.call(Model.delete_repository, "B")
                await wait_horizon(s, await publish(s, []))
                if redis_client.hget(NAMESPACES, ns) == "B":
                    await asyncio.to_thread(purge_retired, s, "B", release=True)
            return kept

    kept = asyncio.run(history())
    assert kept in listed(s3, bucket), (
        "A's held object was deleted by B's retired purge after a forged report freed X")
