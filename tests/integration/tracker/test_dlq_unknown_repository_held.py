"""A dead-lettered reference of a repository the tracker does not (yet) know is held (found by
an adversarial review; this test failed before): it placed no hold, and the reconciler then
deleted the object it named (SPEC safety 10: "a lost or dead-lettered event never turns into a
deletion").

``tracker/codec.py`` ``hold_targets`` used to hold only addresses of repositories whose
namespace is in the gate (``ns = namespaces.get(repo); if ns is None: continue``). Two ways
to reach it:

1. Ordering across batches: the service's ``object_written`` of repository ``r1`` reaches the
   tracker in a batch before its ``repository_created`` (a retried create, or two producers):
   it is dead-lettered as ``unknown repository`` with no hold. The create is applied next.
2. A refused repository: ``r2`` asks for a namespace inside ``r1``'s; it is refused (overlap)
   and every event of ``r2`` is dead-lettered as ``unknown repository``, again with no hold,
   although the addresses it names lie in live ``r1``'s namespace.

Either way the object had no record and no hold; ``r1``'s reconciler marks it as a leak and the
sweep deletes it while the service still references it from an open staging token.

Real stack: MinIO, Redis with the tracker's apply script, local Spark; the dead letters' holds
are computed with the daemon's own ``codec.hold_targets`` on the gate's state at that moment.
"""

from __future__ import annotations

from typing import Any

import pytest

from reconciler.job import RunOptions, reconcile
from schemas import events as ev
from sim.model import Model as M
from sim.testing import apply_lua, lua_batches
from sim.worlds import BUCKET, boundary, call, make, past_grace
from tracker import codec

pytestmark = [pytest.mark.spark]


@pytest.fixture
def rsettings(settings):
    return settings.replace(reconcile_min_age_seconds=0.0)


def _holds_for(gate: codec.Gate, rejected_events: list[ev.Event], r: Any
                ) -> list[tuple[str, str]]:
    """What the daemon holds for these dead letters (tracker/daemon.py ``_prepare``: the
    gate's namespaces and the live registry ``hd:namespaces``), written as it writes them."""
    from schemas.holds import add_claims
    from schemas.layout import NAMESPACES, RepoKeys

    out = []
    registry = r.hgetall(NAMESPACES)
    for i, e in enumerate(rejected_events):
        targets = codec.hold_targets(ev.encode(e), e.repository.encode(), gate.namespaces,
                                     registry)
        for repo, target in targets:
            k = RepoKeys(repo)
            add_claims(r, k.hold_prefixes if target.endswith("/") else k.holds,
                       [(target, f"dlq:test:0:{i}:{e.event_id}", {"source": "dlq"})])
        out += targets
    return out


def test_dead_lettered_reference_of_an_unknown_repository_is_swept(spark, rsettings, s3,
                                                                   redis_client):
    w = make(rsettings, s3, redis_client)
    ns1 = f"s3://{BUCKET}/atk2dlq/r1/"
    call(w, M.create_repository, "r1", ns1)
    x = call(w, M.write, "r1", "main", "x", 10).address  # staged in main's open token
    events = list(w.model.events)
    creates = [e for e in events if e.TYPE in ("repository_created", "branch_created")]
    rest = [e for e in events if e not in creates]

    # batch 1: the references arrive before the create -> dead-lettered, holds computed now
    batch, rejected = lua_batches(rest, w.gate)
    assert not batch and len(rejected) == len(rest)
    assert all("unknown repository" in why for _, why in rejected)
    holds1 = _holds_for(w.gate, rest, redis_client)
    # batch 2: the create (and the branch) are applied
    batch, rejected = lua_batches(creates, w.gate, first_offset=len(rest))
    assert not rejected
    apply_lua(redis_client, batch, None)
    redis_client.sadd("hd:repos", "r1")
    w.applied = len(events)

    # variant 2: r2 asks for a namespace inside r1's: refused; its reference is dead-lettered
    y = f"{ns1}r2/data/y"
    s3.put_object(Bucket=BUCKET, Key=y[len(f"s3://{BUCKET}/"):], Body=b"y" * 10)
    r2_create = ev.RepositoryCreated(repository="r2", storage_namespace=f"{ns1}r2/",
                                     default_branch="main", default_retention_days=7.0)
    r2_write = ev.ObjectWritten(repository="r2", branch="main", staging_token="t-r2",
                                path="y", address=y, size=10, ref_id="ref-y")
    from schemas.namespaces import registration_problem
    assert registration_problem({ns1: "r1"}, "r2", f"{ns1}r2/") is not None  # refused
    assert w.gate.check(codec.parse(ev.encode(r2_write))) is not None  # unknown repository
    holds2 = _holds_for(w.gate, [r2_write], redis_client)
    del r2_create

    # held where the objects are: x on r1 (not known when its reference was dead-lettered),
    # y on r2 (refused) and on r1 (whose namespace holds it)
    assert ("r1", x) in holds1 and {("r2", y), ("r1", y)} <= set(holds2), (holds1, holds2)

    w.track(None)  # (nothing new: keeps progress moving, as a caught-up tracker)
    past_grace(rsettings)
    cutoff = boundary()
    res = reconcile(spark, rsettings, RunOptions("r1", cutoff_ms=cutoff,
                                                 allow_large_sweep=True))
    assert res["success"], res["error"]
    left = w.keys("r1")
    assert x in left and y in left, (
        f"dead-lettered references swept: x kept={x in left}, y kept={y in left}; "
        f"mark {res['mark']['categories']}")
