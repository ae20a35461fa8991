"""An issued upload address whose ``address_issued`` was lost with the broker log is protected
until its upload ticket expires after the rebuild (SPEC safety 1), linked or not.

Real stack: MinIO (the object, manifests, the export), Redis with the tracker's apply script,
the reaper. Found by an adversarial review: the model's export listed only the *unlinked*
unexpired issued addresses, while the service (and the model's truth) protects every issued
address until its ticket expires. An address linked after the loss, whose reference then ended
(its branch deleted), had no expiry in the rebuilt mirror: the reaper took it one grace after
the reference ended, with its ticket still valid.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from schemas.layout import RepoKeys
from sim.model import Model as M
from sim.rebuilding import MAX_AGE, call, export, lose_log, state_of
from sim.worlds import BUCKET, World, make_world
from tracker.rebuild import prepare, rebuild
from tracker.state import read_repo_state

TTL = 120.0  # s: the upload ticket outlives the test (grace is 1 s)


@pytest.fixture
def w(settings, s3, redis_client) -> World:
    world = make_world(settings, s3, redis_client)
    world.model.upload_ttl_seconds = TTL
    return world


def _issued_lost_then_linked(w: World, ns: str) -> dict[str, Any]:
    """dev applied; an address issued (and uploaded) with its event lost with the log; then,
    from the new log, the address linked on dev."""
    call(w, M.create_repository, "r", f"s3://{BUCKET}/{ns}/r/")
    call(w, M.write, "r", "main", "a", 10)
    call(w, M.create_branch, "r", "dev", None)
    w.track(None)
    issued = call(w, M.issue_address, "r")
    call(w, M.upload, "r", issued.address, 10)
    w.applied = len(w.model.events)  # address_issued: lost with the broker's log
    lose_log(w, "r")
    call(w, M.link, "r", "dev", "p", issued.address, issued.signed_token)
    w.track(None)  # the link, from the new log
    assert state_of(w, "r", issued.address) == "staged"
    return {"u": issued.address}


def _reap(w: World) -> Any:
    from reaper.daemon import Reaper

    async def once() -> Any:
        reaper = Reaper(w.settings, s3=w.s3)
        try:
            return await reaper.run_once()
        finally:
            await reaper.close()

    return asyncio.run(once())


def _past_grace(w: World) -> None:
    time.sleep(w.settings.grace_for("r") + 0.5)


def _kept(w: World, u: str) -> None:
    # The oracle: the service still protects it (its ticket has not expired) ...
    assert u in w.model.truth().issued_unexpired
    assert u not in w.model.truth().online_garbage
    # ... and so does the mirror, and the store still has it.
    assert state_of(w, "r", u) == "issued", state_of(w, "r", u)
    until = read_repo_state(w.r, "r").addresses[u].issued_until
    assert until is not None
    assert u in w.data("r"), f"{u} deleted while its upload ticket is unexpired"


def test_a_linked_issued_address_whose_branch_was_deleted_before_the_rebuild_is_kept(
        w: World) -> None:
    """The brief's order: issue lost, link and branch deletion applied, then the rebuild."""
    u = _issued_lost_then_linked(w, "issued1")["u"]
    call(w, M.delete_branch, "r", "dev")  # the token is dropped: u has no live reference
    w.track(None)
    assert u in w.model.truth().issued_unexpired  # the service's ticket is still valid
    p = prepare(w.r, w.s3, "r")
    location = export(w, "r", p.nonce)
    rebuild(w.r, w.s3, "r", location, max_age_ms=MAX_AGE)
    assert not w.r.exists(RepoKeys("r").fail_closed)
    _past_grace(w)
    report = _reap(w)
    assert report.total("deleted") == 0, report
    _kept(w, u)


def test_a_linked_issued_address_whose_branch_is_deleted_after_the_rebuild_is_kept(
        w: World) -> None:
    """The other order: rebuilt while u is staged (its token in the export), then its branch
    deleted: the rebuilt mirror must still know u's ticket."""
    u = _issued_lost_then_linked(w, "issued2")["u"]
    p = prepare(w.r, w.s3, "r")
    rebuild(w.r, w.s3, "r", export(w, "r", p.nonce), max_age_ms=MAX_AGE)
    assert not w.r.exists(RepoKeys("r").fail_closed)
    call(w, M.delete_branch, "r", "dev")
    w.track(None)
    assert u in w.model.truth().issued_unexpired
    _past_grace(w)
    report = _reap(w)
    assert report.total("deleted") == 0, report
    _kept(w, u)


@pytest.mark.spark
def test_a_reconciler_run_after_the_rebuild_keeps_a_linked_unexpired_issued_address(
        spark, settings, s3, redis_client) -> None:
    """Same hole through the mark and sweep: the object is older than the run's cutoff and its
    reference ended more than a grace ago, but its upload ticket is still valid."""
    from reconciler.job import RunOptions, reconcile
    from sim.worlds import boundary, past_grace

    rsettings = settings.replace(reconcile_min_age_seconds=0.0)
    w = make_world(rsettings, s3, redis_client)
    w.model.upload_ttl_seconds = TTL
    u = _issued_lost_then_linked(w, "issued3")["u"]
    call(w, M.delete_branch, "r", "dev")
    w.track(None)
    p = prepare(w.r, w.s3, "r")
    rebuild(w.r, w.s3, "r", export(w, "r", p.nonce), max_age_ms=MAX_AGE)
    cutoff = boundary()  # the object is older than the cutoff
    past_grace(rsettings, "r")
    res = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff, allow_large_sweep=True))
    assert res["success"], res["error"]
    assert res["mark"]["marked"] == 0, res["mark"]
    _kept(w, u)
