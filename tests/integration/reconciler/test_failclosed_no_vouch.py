"""An uncommitted export vouches for nothing in a fail-closed repository (found by an adversarial
review; this test failed before). A fresh service export used to "vouch" for `leaked` objects
(``reconciler/sweep.py`` VOUCHED_CATEGORIES, ``reconciler/job.py`` ``_service_evidence``:
withhold = fail-closed and not fresh). But `leaked` is decided against the *committed* set too,
which comes from the mirror's commits and refs (unproven: that is why the repository is fail-
closed). The service's export lists only its uncommitted data. So when the events lost in the
gap include a commit (object_written + commit_created), the committed object has no record, is
in no manifest the mirror knows, is not in the uncommitted export: it is marked `leaked`,
vouched, and the sweep deletes it although it is in the branch head's commit.

Real stack: MinIO, Redis with the tracker's apply script, local Spark; the fail-closed flag is
the one the tracker writes for a log gap (written here as
tests/integration/reconciler/test_reconcile_safety.py does).
"""

from __future__ import annotations

import asyncio

import pytest

from reconciler.job import RunOptions, reconcile
from schemas.layout import RepoKeys
from sim.model import Model as M
from sim.worlds import BUCKET, boundary, call, make, past_grace

pytestmark = [pytest.mark.spark]


@pytest.fixture
def rsettings(settings):
    return settings.replace(reconcile_min_age_seconds=0.0)


def test_a_commit_lost_in_a_log_gap_is_deleted_through_a_fresh_service_export(
        spark, rsettings, s3, redis_client):
    w = make(rsettings, s3, redis_client)
    call(w, M.create_repository, "r", f"s3://{BUCKET}/atk3/r/")
    k = call(w, M.write, "r", "main", "k", 10).address
    call(w, M.commit, "r", "main")
    w.track(None)
    # the service writes x and commits it on main; these events are lost (a log gap: the
    # broker's retention removed records Redis never applied) ...
    x = call(w, M.write, "r", "main", "x", 10).address
    c1 = call(w, M.commit, "r", "main").commit.id
    w.applied = len(w.model.events)
    # ... which the tracker detects: the repository is fail-closed
    redis_client.hset(RepoKeys("r").fail_closed,
                      mapping={"reason": "log gap: records never applied were removed"})
    past_grace(rsettings)
    cutoff = boundary()
    assert w.model.repository("r").branches["main"].head == c1
    fresh = asyncio.run(w.svc.write_uncommitted_export("r"))  # after the cutoff: fresh
    res = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff,
                                                 uncommitted_export=fresh,
                                                 allow_large_sweep=True))
    assert res["success"], res["error"]
    assert k in w.data("r")
    assert x in w.data("r"), (
        f"x, in main's head commit {c1}, deleted from a fail-closed repository: "
        f"mark {res['mark']['categories']['leaked']}, sweep {res.get('sweep')}")
