"""A repository's holds and pauses survive Redis going back (issue 34, finding 1): each is a
durable fact in its namespace (``core/facts.py``), and every delete path applies what its Redis
copy lacks before it deletes. Before, ``hardelete hold add`` and ``hardelete pause`` wrote only
into Redis: the repository's slot restored from a copy taken before them (one node), or its
cluster node failing over to a replica without them, and the reaper deleted the held object."""

from __future__ import annotations

from typing import Any

import pytest

from core.clients import redis_sync, s3_client
from core.facts import FactLog, RepoFacts
from core.gate import read_gate
from core.settings import Settings
from hardelete.holds import add_hold, remove_hold
from hardelete.pause import set_paused
from hardelete.status import explain_address
from reconciler.s3io import Namespace
from reconciler.sweep import recheck_for
from schemas.layout import REPOS, RepoKeys
from sim.operations import stored
from sim.testing import (
    raw_redis,
    reap_past_grace,
    redis_now,
    slot_copy,
    slot_go_back,
    unreferenced_object,
    wait_horizon,
)
from tracker.daemon import running_tracker

pytestmark = [pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True),
              pytest.mark.usefixtures("sequenced")]  # (the service certifies its history)

BUCKET = "durable"
REPO = "dur"
NS = f"s3://{BUCKET}/dur/"
A = NS + "data/a"


_raw = raw_redis


async def _garbage(s: Settings, s3: Any) -> None:
    """``A`` written then deleted: unreferenced, the reaper's once grace has passed."""
    await unreferenced_object(s, s3, REPO, NS, A)


async def _reap(s: Settings, s3: Any) -> Any:
    return await reap_past_grace(s, s3)


def _alive(s3: Any) -> bool:
    return stored(s3, A)


async def test_a_hold_survives_the_repositorys_slot_going_back(settings: Settings) -> None:
    s = settings.replace(grace_seconds=1.0, quarantine_days=0.0, lease_seconds=1.0)
    s3 = s3_client(s)
    raw, r = _raw(s), redis_sync(s)
    try:
        async with running_tracker(s, name="t1"):
            await _garbage(s, s3)
            before = slot_copy(raw, REPO)  # the copy Redis goes back to: no hold in it
            add_hold(r, A, "legal: case 34", s3=s3)
            slot_go_back(raw, REPO, before)
            assert not r.hexists(RepoKeys(REPO).holds, A)  # Redis forgot it
            report = await _reap(s, s3)
            assert _alive(s3), f"a held object was deleted: {report.as_dict()}"
            # The pass applied the durable fact again: explain and the next pass see the hold.
            assert r.hexists(RepoKeys(REPO).holds, A)
            assert explain_address(r, s, A).verdict.startswith("kept")
            # Lifting it is durable too: the object goes once nothing holds it.
            remove_hold(r, A, s3=s3)
            # (the held address is looked at again a lease after the pass that kept it)
            for _ in range(10):
                report = await _reap(s, s3)
                if not _alive(s3):
                    break
            assert not _alive(s3), report.as_dict()
    finally:
        raw.close()
        r.close()


async def test_a_pause_survives_the_repositorys_slot_going_back(settings: Settings) -> None:
    s = settings.replace(grace_seconds=1.0, quarantine_days=0.0, lease_seconds=1.0)
    s3 = s3_client(s)
    raw, r = _raw(s), redis_sync(s)
    try:
        async with running_tracker(s, name="t1"):
            await _garbage(s, s3)
            before = slot_copy(raw, REPO)
            set_paused(r, REPO, "incident 7: stop deleting", s3=s3)
            slot_go_back(raw, REPO, before)
            assert not r.exists(RepoKeys(REPO).paused)
            report = await _reap(s, s3)
            assert _alive(s3), f"a paused repository's object was deleted: {report.as_dict()}"
            assert r.exists(RepoKeys(REPO).paused)
    finally:
        raw.close()
        r.close()


async def test_the_sweeps_recheck_applies_a_forgotten_hold(settings: Settings) -> None:
    """The reconciler's re-check right before its request proves the copy too."""
    s = settings.replace(grace_seconds=1.0, quarantine_days=0.0, lease_seconds=1.0)
    s3 = s3_client(s)
    raw, r = _raw(s), redis_sync(s)
    try:
        async with running_tracker(s, name="t1"):
            await _garbage(s, s3)
            before = slot_copy(raw, REPO)
            add_hold(r, A, "legal: case 35", s3=s3)
            slot_go_back(raw, REPO, before)
            ns = Namespace(NS)
            now = await redis_now(s)
            unproven = recheck_for(r, REPO, ns, cutoff_ms=now)(["data/a"])
            assert unproven["data/a"] == "held"  # no proof: everything is kept
            proven = recheck_for(r, REPO, ns, cutoff_ms=now,
                                 facts=RepoFacts(r, s3, REPO, NS))(["data/a"])
            assert proven == {"data/a": "held"}
            assert r.hexists(RepoKeys(REPO).holds, A)
    finally:
        raw.close()
        r.close()


async def test_a_home_that_lost_facts_deletes_nothing(settings: Settings) -> None:
    """The durable home emptied (or gone back) while Redis applied its facts: what the copy
    knows can no longer be re-derived, so the repository deletes nothing, and says why."""
    s = settings.replace(grace_seconds=1.0, quarantine_days=0.0, lease_seconds=1.0)
    s3 = s3_client(s)
    r = redis_sync(s)
    try:
        async with running_tracker(s, name="t1"):
            await _garbage(s, s3)
            add_hold(r, NS + "data/other", "legal", s3=s3)  # a fact about another address
            log = FactLog(s3, NS, REPO)
            for seq in log.seqs_from(1):
                s3.delete_object(Bucket=log.bucket, Key=log.prefix + f"{seq:012d}.json")
            report = await _reap(s, s3)
            assert _alive(s3), report.as_dict()
            proof = RepoFacts(r, s3, REPO, NS).prove()
            assert proof.problem is not None and "lacks fact 1" in proof.problem
            assert "facts" in str(report.as_dict())
    finally:
        r.close()


async def test_writers_race_and_the_copy_applies_each_fact_once(settings: Settings) -> None:
    """Writers at once each get their own seq; a fact is applied once, in order, whoever
    applies it (a writer, or a delete path's proof)."""
    import threading

    s3 = s3_client(settings)
    s3.create_bucket(Bucket=BUCKET)
    r = redis_sync(settings)
    r.hset(RepoKeys(REPO).meta, mapping={"namespace": NS})
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            facts = RepoFacts(redis_sync(settings), s3_client(settings), REPO, NS)
            for j in range(4):
                facts.record("hold_add", {"hash": "holds", "replace": False, "items": [
                    [f"{NS}w{i}/{j}", "operator", {"reason": "r", "at_ms": j}]]},
                    by=f"w{i}", now_ms=j)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        log = FactLog(s3, NS, REPO)
        assert log.seqs_from(1) == list(range(1, 17))
        assert int(r.get(RepoKeys(REPO).facts_seq)) == 16
        assert len(r.hkeys(RepoKeys(REPO).holds)) == 16
        # A fact applied twice, or out of order, is refused by the copy's guard.
        facts = RepoFacts(r, s3, REPO, NS)
        assert facts._apply(log.read(16)) == "already"
        r.set(RepoKeys(REPO).facts_seq, 10)
        assert facts._apply(log.read(16)) == "gap"
        assert facts.prove().durable == 16 and int(r.get(RepoKeys(REPO).facts_seq)) == 16
    finally:
        r.close()


async def test_a_dead_letters_hold_survives_the_repositorys_slot_going_back(
        settings: Settings) -> None:
    """The tracker's hold on what a dead-lettered event names is a durable fact too: the slot
    going back alone (a cluster node failing over; the tracker's own offsets, elsewhere, do not
    move, so nothing replays the dead letter) loses it in Redis, and the reaper's proof brings
    it back before it claims."""
    from schemas.publisher import Publisher
    from sim.operations import broken

    s = settings.replace(grace_seconds=1.0, quarantine_days=0.0, lease_seconds=1.0)
    s3 = s3_client(s)
    raw, r = _raw(s), redis_sync(s)
    try:
        async with running_tracker(s, name="t1"):
            await _garbage(s, s3)
            before = slot_copy(raw, REPO)
            async with Publisher(s) as pub:
                await pub.publish_raw(broken(REPO, A), REPO.encode())
            await wait_horizon(s, await redis_now(s))
            assert r.hexists(RepoKeys(REPO).holds, A)  # the tracker held what it names
            slot_go_back(raw, REPO, before)
            assert not r.hexists(RepoKeys(REPO).holds, A)
            report = await _reap(s, s3)
            assert _alive(s3), f"a dead letter's address was deleted: {report.as_dict()}"
            assert r.hexists(RepoKeys(REPO).holds, A)
    finally:
        raw.close()
        r.close()


async def test_a_forged_fact_cannot_lift_a_hold(settings: Settings) -> None:
    """Whoever writes the namespace can write into the facts home; a fact without the
    product's signature is never applied (a forged removal would lift a hold, a forged
    addition may have replaced a genuine one): the copy stops before it and the repository
    deletes nothing until an operator reseals (``hardelete facts``)."""
    from core.facts import HOLD_REMOVE, make_fact, sign

    s3 = s3_client(settings)
    s3.create_bucket(Bucket=BUCKET)
    r = redis_sync(settings)
    r.sadd(REPOS, REPO)
    r.hset(RepoKeys(REPO).meta, mapping={"namespace": NS})
    try:
        add_hold(r, A, "legal", s3=s3)
        log = FactLog(s3, NS, REPO)
        removal = {"hash": "holds", "target": A, "claim_ids": ["operator"], "force": True}
        for forged in (make_fact(REPO, 2, HOLD_REMOVE, removal, at_ms=1, by="forger"),
                       sign(b"not the key", make_fact(REPO, 2, HOLD_REMOVE, removal, at_ms=1,
                                                      by="forger"))):
            s3.put_object(Bucket=log.bucket, Key=log.prefix + "000000000002.json",
                          Body=forged.encode())
            proof = RepoFacts(r, s3, REPO, NS).prove()
            assert proof.problem is not None and "fact 2 " in proof.problem
            assert r.hexists(RepoKeys(REPO).holds, A), "a forged removal lifted a hold"
            assert int(r.get(RepoKeys(REPO).facts_seq)) == 1  # stopped before it
            gate = read_gate(r, REPO, [A], facts=proof)
            assert gate.repo_problem(REPO, NS) is not None  # nothing of it is deleted
    finally:
        r.close()


async def test_an_operator_lifts_a_hold_or_pause_redis_forgot(settings: Settings) -> None:
    """After the slot went back, the hold and the pause are still durable (they come back at
    the next proof): `hold remove` and `resume` read the fact log first, so the operator can
    lift them at once, for good, instead of being told there is nothing to lift."""
    from hardelete.pause import clear_paused

    s3 = s3_client(settings)
    s3.create_bucket(Bucket=BUCKET)
    raw, r = _raw(settings), redis_sync(settings)
    r.sadd(REPOS, REPO)
    r.hset(RepoKeys(REPO).meta, mapping={"namespace": NS})
    try:
        before = slot_copy(raw, REPO)
        add_hold(r, A, "legal", s3=s3)
        set_paused(r, REPO, "incident", "ann", s3=s3)
        slot_go_back(raw, REPO, before)
        assert not r.hexists(RepoKeys(REPO).holds, A) and not r.exists(RepoKeys(REPO).paused)
        (lifted,) = remove_hold(r, A, s3=s3)
        assert lifted.lifted
        _, remaining = clear_paused(r, REPO, "ann", s3=s3)
        assert remaining == {}
        slot_go_back(raw, REPO, before)  # and again: the lifts are durable too
        assert RepoFacts(r, s3, REPO, NS).prove().problem is None
        assert not r.hexists(RepoKeys(REPO).holds, A) and not r.exists(RepoKeys(REPO).paused)
    finally:
        raw.close()
        r.close()
