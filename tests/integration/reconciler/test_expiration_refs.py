"""Expiration only ever acts on refs the service has deleted (issue 33), end to end (MinIO +
Redis + the tracker's apply script + local Spark).

A quiet repository: main last committed ten days ago with a write staged on top, a branch
``old`` left at main's previous commit and a tag on main's head. ``--expire-older-than-days 7
--delete-expired-refs`` used to drop every ref at an expired snapshot from retention, main
included, and sweep its head commit's data while main was live at the service and in the
mirror. Now the refs are listed for the service to delete (never the default branch) and keep
their data until the service has deleted them; the next run then frees it by retention."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest

from reconciler.committed import RetentionPlan, manifest_location, plan_retention
from reconciler.job import RunOptions, reconcile
from reconciler.report import read_summary, write_summary
from reconciler.retention import SECONDS_PER_DAY, active_commits, expire_snapshots
from reconciler.s3io import Namespace, get_json
from reconciler.state import CommittedState
from sim.model import Model as M
from sim.worlds import BUCKET, DAY, World, boundary, call, make, past_grace

pytestmark = [pytest.mark.spark]


@pytest.fixture
def rsettings(settings):
    return settings.replace(reconcile_min_age_seconds=0.0)


def quiet_repository(w: World, ns: str) -> dict[str, str]:
    """main: C0 (12 days ago, p0) -> C1 (10 days ago, p0 deleted, p1), p2 staged on top;
    branch ``old`` at C0, tag ``v1`` at C1; retention one day."""
    now = time.time()
    call(w, M.create_repository, "r", ns, default_retention_days=1.0)
    p0 = call(w, M.write, "r", "main", "p0", 10).address
    c0 = call(w, M.commit, "r", "main", at=now - 12 * DAY).commit.id
    call(w, M.create_branch, "r", "old", c0)
    call(w, M.delete, "r", "main", "p0")
    p1 = call(w, M.write, "r", "main", "p1", 10).address
    c1 = call(w, M.commit, "r", "main", at=now - 10 * DAY).commit.id
    call(w, M.create_tag, "r", "v1", c1)
    p2 = call(w, M.write, "r", "main", "p2", 10).address
    w.track(None)
    past_grace(w.settings)
    return {"c0": c0, "c1": c1, "p0": p0, "p1": p1, "p2": p2}


EXPIRE = {"expire_older_than_days": 7.0, "delete_expired_refs": True}


def test_expiring_a_quiet_main_keeps_every_live_refs_data_and_lists_the_refs(
        spark, rsettings, s3, redis_client):
    w = make(rsettings, s3, redis_client)
    h = quiet_repository(w, f"s3://{BUCKET}/exp33/r/")
    cutoff = boundary()
    data_before = w.data("r")
    assert data_before == {h["p0"], h["p1"], h["p2"]}

    res = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff, **EXPIRE))
    assert res["success"], res["error"]
    assert res["sweep"]["status"] == "done", res["sweep"]
    # main's head (p1), old's head (p0) and the staged p2 are all live: nothing is swept
    assert w.data("r") == data_before
    assert res["sweep"]["confirmed"] == 0 and res["mark"]["marked"] == 0
    ret = res["retention"]
    assert ret["refs_pointing_to_expired"] == ["tag:v1", "branch:main", "branch:old"]
    assert ret["refs_to_delete"] == ["tag:v1", "branch:old"]  # never the default branch
    ns = Namespace(w.model.repository("r").storage_namespace)
    assert ret["expired_refs_key"] == ns.report_prefix(res["run_id"]) + "expired_refs.json"
    listed = get_json(s3, ns.bucket, ret["expired_refs_key"])
    assert listed["default_branch"] == "main" and listed["expire_older_than_days"] == 7.0
    assert [(r["kind"], r["name"], r["commit"]) for r in listed["refs"]] == [
        ("tag", "v1", h["c1"]), ("branch", "old", h["c0"])]
    assert listed["refs"][1]["commit_time"] == pytest.approx(time.time() - 12 * DAY, abs=600)

    # The service deletes what it was asked to; once the tracker has the deletions, the next
    # run frees old's data by ordinary retention (C0 is past main's window), and still no
    # byte of main's head.
    call(w, M.delete_branch, "r", "old")
    call(w, M.delete_tag, "r", "v1")
    w.track(None)
    again = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff, **EXPIRE))
    assert again["success"], again["error"]
    assert again["sweep"]["status"] == "done", again["sweep"]
    assert again["sweep"]["confirmed"] == 1
    assert w.data("r") == {h["p1"], h["p2"]}
    assert again["retention"]["refs_pointing_to_expired"] == ["branch:main"]
    assert again["retention"]["refs_to_delete"] == []


def _plan_before_issue_33(state: CommittedState, now_s: float, **kw: Any) -> RetentionPlan:
    """plan_retention as it was: the refs at expired snapshots dropped from retention."""
    plan = plan_retention(state, now_s, **kw)
    at = now_s - kw["expire_older_than_days"] * SECONDS_PER_DAY
    res = expire_snapshots(state.commits, state.branch_heads, state.tags, at)
    stale = set(res.refs_pointing_to_expired)
    branches = {b: c for b, c in state.branch_heads.items() if ("branch", b) not in stale}
    tags = {t: c for t, c in state.tags.items() if ("tag", t) not in stale}
    retained = active_commits(res.commits, branches, tags, state.policy, now_s)
    manifests = list(dict.fromkeys(manifest_location(state.namespace,
                                                     state.commits[c].manifest)
                                   for c in sorted(retained)))
    return replace(plan, retained=retained, manifests=manifests, refs_to_delete=None)


def test_sweep_only_judges_again_a_mark_that_dropped_live_refs(
        spark, rsettings, s3, redis_client, monkeypatch):
    """A mark made before the fix (its --delete-expired-refs dropped main, old and v1 from
    retention and marked their data) is swept by this version: its retention inputs did not
    change, yet it is judged again, and main's and old's data is kept."""
    w = make(rsettings, s3, redis_client)
    h = quiet_repository(w, f"s3://{BUCKET}/exp33b/r/")
    cutoff = boundary()
    data_before = w.data("r")
    assert data_before == {h["p0"], h["p1"], h["p2"]}
    with monkeypatch.context() as m:
        m.setattr("reconciler.job.plan_retention", _plan_before_issue_33)
        dry = reconcile(spark, rsettings, RunOptions("r", dry_run=True, cutoff_ms=cutoff,
                                                     **EXPIRE))
    assert dry["success"], dry["error"]
    assert dry["mark"]["marked"] == 2  # p0 and p1: the hole, as the old version marked it
    ns = Namespace(w.model.repository("r").storage_namespace)
    stored = read_summary(s3, ns, dry["run_id"])
    assert stored is not None
    old_retention = {k: v for k, v in stored["retention"].items()
                     if k not in ("expired_refs_key", "refs_to_delete")}
    write_summary(s3, ns, {**stored, "retention": old_retention})  # as the old version wrote it

    res = reconcile(spark, rsettings, RunOptions("r", sweep_only=dry["run_id"]))
    assert res["sweep"]["status"] == "done", res["sweep"]
    assert w.data("r") == data_before
    assert res["sweep"]["skipped_retained"] == 2 and res["sweep"]["confirmed"] == 0
    assert not res["revalidation"]["retention_changed"]
    assert res["revalidation"]["newly_retained_commits"] == 2  # C0 (old) and C1 (main, v1)
