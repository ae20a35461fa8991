"""Retirement keeps data until it is explicitly released (issue 19 item 6).

Finding: after ``repository_deleted``, a new repository registered on the same namespace marked
the retired repository's committed objects as leaked and swept them at once.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from core.errors import UserError
from core.settings import Settings
from reconciler.job import RunOptions, reconcile
from reconciler.retirement import purge_retired
from schemas.layout import INCIDENTS, NAMESPACES, RETIRED
from schemas.publisher import Publisher, ensure_topics
from sim.model import Model
from sim.operations import run
from sim.reaping import _service
from sim.testing import listed, publish, wait_horizon
from tracker.daemon import running_tracker


def test_a_retired_repositorys_data_is_kept_from_the_next_owner_until_released(
        cli: Settings, capsys: Any, s3: Any, redis_client: Any, spark: Any) -> None:
    import asyncio

    s = cli
    ns = "s3://retire/repo/"

    async def history() -> tuple[set[str], str]:
        await ensure_topics(s)
        async with Publisher(s) as pub, running_tracker(s):
            svc = await _service(s, s3, pub)
            await svc.call(Model.create_repository, "A", ns)
            await svc.call(Model.write, "A", "main", "kept", 10)
            await svc.call(Model.commit, "A", "main")
            await svc.call(Model.delete_repository, "A")
            await wait_horizon(s, await publish(s, []))  # (A and B: different partitions)
            # the service gives the namespace to a new repository at once
            await svc.call(Model.create_repository, "B", ns)
            await wait_horizon(s, await publish(s, []))
            return set(listed(s3, "retire")), svc.model.repository("B").storage_namespace

    a_objects, _ = asyncio.run(history())
    a_data = {o for o in a_objects if "/_hardelete/" not in o}
    assert a_data
    # B was refused (dead letter and incident): A's data is kept, and with it the namespace
    assert redis_client.hget(NAMESPACES, ns) == "A"
    incidents = [orjson.loads(i) for i in redis_client.lrange(INCIDENTS, 0, -1)]
    assert any(i["repository"] == "B" and "retired with its data still kept" in i["reason"]
               for i in incidents)
    with pytest.raises(UserError):  # B's reconciler cannot run: B owns nothing
        reconcile(spark, s.replace(reconcile_min_age_seconds=0.0), RunOptions("B"))
    assert a_data <= listed(s3, "retire")

    code, out, _ = run(capsys, "status")  # B's refusal is an incident: it needs a person
    assert code == 1 and "incident" in out.splitlines()[0]
    assert "A (s3://retire/repo/, kept until" in out
    code, out, _ = run(capsys, "retired", "list", "--json")
    rows = orjson.loads(out)
    assert [r["repository"] for r in rows] == ["A"] and "kept until" in rows[0]["purge"]
    code, _, err = run(capsys, "retired", "purge", "A")  # not due: refused, nothing deleted
    assert code == 2 and "kept until" in err and "Traceback" not in err
    assert a_data <= listed(s3, "retire")

    # B's create over A's kept data is a registry conflict: A is fail-closed too (its purge
    # would take whatever B's service writes there), and the release purge keeps everything
    code, out, _ = run(capsys, "retired", "purge", "A", "--release", "--json")
    summary = orjson.loads(out)
    assert summary["status"] == "incomplete" and not summary["deleted"]
    assert a_data <= listed(s3, "retire")
    # the operator judges it (B was refused: it is not live, nothing of it is there) and clears A
    code, _, err = run(capsys, "fail-closed", "clear", "A", "--reason", "B was refused; "
                       "nothing of it in the namespace")
    assert code == 0, err
    # then releases it: a reported purge through the gate, then the namespace is free
    code, out, _ = run(capsys, "retired", "purge", "A", "--release", "--json")
    summary = orjson.loads(out)
    assert code == 0 and summary["status"] == "done", (summary["kept"], summary["failed"])
    assert summary["deleted"] == len(a_data) and summary["retired"]["released_at"]
    assert not a_data & listed(s3, "retire")
    assert redis_client.hget(NAMESPACES, ns) is None
    assert orjson.loads(redis_client.hget(RETIRED, "A"))["purge_run"] == summary["run_id"]
    assert f"s3://retire/repo/_hardelete/reports/{summary['run_id']}/summary.json" in \
        listed(s3, "retire")
    code, _, err = run(capsys, "retired", "purge", "A")
    assert code == 2 and "already purged" in err


def test_purge_of_a_live_repository_is_refused(cli: Settings, redis_client: Any
                                               ) -> None:
    with pytest.raises(UserError, match="not retired"):
        purge_retired(cli, "nobody")
