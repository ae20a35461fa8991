"""Adversarial sequences against the durable facts (``core/facts.py``) on the real stack: each
ends with the reaper deleting an object a hold had to keep, after the repository's slot went
back (a cluster node failing over to a replica taken before the hold; one node: the same keys
restored, as ``test_durable_facts.py`` does)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from core.clients import redis_sync, s3_client
from core.facts import HOLD_ADD, FactLog, RepoFacts, make_fact
from core.settings import Settings
from hardelete.holds import add_hold
from schemas import events as ev
from schemas.layout import RepoKeys
from schemas.publisher import Publisher
from sim.operations import broken, stored
from sim.testing import (
    publish,
    raw_redis,
    reap_past_grace,
    redis_now,
    slot_copy,
    slot_go_back,
    unreferenced_object,
    wait_for,
    wait_horizon,
)
from tracker.daemon import running_tracker

pytestmark = [pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True),
              pytest.mark.usefixtures("sequenced")]  # (the service certifies its history)

BUCKET = "attack2"
REPO = "atk"
NS = f"s3://{BUCKET}/atk/"
A = NS + "data/a"


_raw = raw_redis


async def _garbage(s: Settings, s3: Any) -> None:
    """``A`` written then deleted: unreferenced, the reaper's once grace has passed."""
    await unreferenced_object(s, s3, REPO, NS, A)


async def _reap(s: Settings, s3: Any) -> Any:
    return await reap_past_grace(s, s3)


def _alive(s3: Any) -> bool:
    return stored(s3, A)


def _settings(settings: Settings) -> Settings:
    return settings.replace(grace_seconds=1.0, quarantine_days=0.0, lease_seconds=1.0)


async def _dead_letter_naming_a(s: Settings, r: Any) -> None:
    async with Publisher(s) as pub:
        await pub.publish_raw(broken(REPO, A), REPO.encode())
    await wait_horizon(s, await redis_now(s))
    assert r.hexists(RepoKeys(REPO).holds, A)  # the tracker held what it names


async def test_a_dead_letters_hold_whose_reply_was_lost_is_made_durable(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequence 1. The tracker puts a dead letter's claim into Redis, and the reply is lost
    (a connection reset after the script ran). Its retry finds the claim in Redis, takes the
    dead letter for a redelivered one, and writes no fact: the hold lives only in Redis, with
    no error and no metric. The repository's slot goes back to a copy taken before it; nothing
    replays the dead letter (the tracker's offsets, elsewhere, did not move) and the facts
    proof finds nothing missing: the reaper deletes the address a lost event named."""
    import tracker.deadletters as deadletters

    s = _settings(settings)
    s3 = s3_client(s)
    raw, r = _raw(s), redis_sync(s)
    real = deadletters.aadd_claims
    dropped: list[str] = []

    async def reply_lost(rc: Any, key: str, items: Any, replace: bool = False) -> int:
        n = await real(rc, key, items, replace)
        if not dropped:
            dropped.append(key)
            raise RedisConnectionError("Connection reset by peer (reply lost)")
        return n

    monkeypatch.setattr(deadletters, "aadd_claims", reply_lost)
    try:
        async with running_tracker(s, name="t1"):
            await _garbage(s, s3)
            before = slot_copy(raw, REPO)
            await _dead_letter_naming_a(s, r)
            slot_go_back(raw, REPO, before)
            report = await _reap(s, s3)
            assert _alive(s3), f"a dead letter's address was deleted: {report.as_dict()}"
            assert FactLog(s3, NS, REPO).seqs_from(1), "the dead letter's hold is not durable"
    finally:
        raw.close()
        r.close()


async def test_a_dead_letters_hold_placed_while_s3_was_unreachable(settings: Settings) -> None:
    """Sequence 2. The tracker cannot reach S3 for a moment (its network to the store, or the
    store restarting) when it dead-letters an event naming A: the hold goes into Redis, the
    fact log cannot take it (an error and a metric, as documented). S3 comes back; nothing
    ever wrote the fact. Later the repository's slot goes back to a copy taken before the
    hold: the proof found nothing missing and the reaper deleted A. Now the claim is owed
    (``facts_owed``): the gate keeps the repository while it is, and the tracker writes it
    once S3 takes it."""
    s = _settings(settings)
    s3 = s3_client(s)
    raw, r = _raw(s), redis_sync(s)
    # The tracker's view of the store: a port nothing listens on.
    cut = s.replace(s3_endpoint_url="http://127.0.0.1:9")
    try:
        async with running_tracker(s, name="t1"):
            await _garbage(s, s3)
        before = slot_copy(raw, REPO)
        async with running_tracker(cut, name="t2") as t2:
            await _dead_letter_naming_a(s, r)
            assert t2.metrics.facts_failed._value.get() >= 1  # the documented error
        assert r.scard(RepoKeys(REPO).facts_owed) == 1  # owed: the gate keeps the repository
        async with running_tracker(s, name="t3"):  # S3 is back: the tracker pays the debt
            await wait_horizon(s, await redis_now(s))
            async def paid() -> bool:
                return not r.scard(RepoKeys(REPO).facts_owed)

            await wait_for(paid, timeout=30, what="the owed hold written to the fact log")
            slot_go_back(raw, REPO, before)
            report = await _reap(s, s3)
            assert _alive(s3), f"a dead letter's address was deleted: {report.as_dict()}"
    finally:
        raw.close()
        r.close()


async def test_an_overwritten_hold_fact_lifts_the_hold_after_the_slot_goes_back(
        settings: Settings) -> None:
    """Sequence 3. The operator holds A: fact 1, signed. A publisher (it can write the
    namespace, so the home) overwrites fact 1 with an unsigned hold_add on another address (a
    valid fact that "only keeps more": nothing verified it). The repository's slot goes back
    to a copy taken before the hold (facts_seq 0). The reaper's proof applied fact 1 as the
    home now has it, A was not held, and it was deleted. Now every fact must verify: the copy
    stops before fact 1 and the repository deletes nothing until an operator reseals."""
    s = _settings(settings)
    s3 = s3_client(s)
    raw, r = _raw(s), redis_sync(s)
    try:
        async with running_tracker(s, name="t1"):
            await _garbage(s, s3)
            before = slot_copy(raw, REPO)
            add_hold(r, A, "legal: case 77", s3=s3)
            log = FactLog(s3, NS, REPO)
            assert log.seqs_from(1) == [1]
            forged = make_fact(REPO, 1, HOLD_ADD, {"hash": "holds", "replace": False, "items": [
                [NS + "data/elsewhere", "operator", {"reason": "harmless-looking"}]]},
                at_ms=1, by="publisher")
            s3.put_object(Bucket=log.bucket, Key=log.prefix + "000000000001.json",
                          Body=forged.encode())  # an overwrite: no If-None-Match
            slot_go_back(raw, REPO, before)
            report = await _reap(s, s3)
            assert _alive(s3), f"a held object was deleted: {report.as_dict()}"
            proof = RepoFacts(r, s3, REPO, NS).prove()
            assert proof.problem is not None and "fact 1 " in proof.problem
    finally:
        raw.close()
        r.close()


B = NS + "data/b"


async def test_a_held_addresss_quarantine_copy_survives_forged_metadata(
        settings: Settings) -> None:
    """Sequence 4. A and B are garbage; the reaper quarantines both. The operator holds A (a
    legal hold: its quarantine copy is now the only copy of a held object, and the purge keeps
    a copy while anything would keep its address). A publisher (it writes the namespace)
    rewrites the metadata of A's copy to name B. The purge judges B (not held, past grace) and
    deletes A's copy: the held object is gone for good."""
    from core.deleter import Deleter
    from reaper.quarantine import purge_expired, purge_recheck, quarantine_address

    s = settings.replace(grace_seconds=1.0, quarantine_days=2e-5, lease_seconds=1.0)
    s3 = s3_client(s)
    r = redis_sync(s)
    try:
        async with running_tracker(s, name="t1"):
            s3.create_bucket(Bucket=BUCKET)
            for name in ("a", "b"):
                s3.put_object(Bucket=BUCKET, Key=f"atk/data/{name}", Body=name.encode())
            events: list[Any] = [
                ev.RepositoryCreated(repository=REPO, storage_namespace=NS,
                                     default_branch="main", default_retention_days=1.0),
                ev.BranchCreated(repository=REPO, branch="main", staging_token="t",
                                 ref_version=1)]
            for name, addr in (("a", A), ("b", B)):
                events += [ev.ObjectWritten(repository=REPO, branch="main", staging_token="t",
                                            path=name, address=addr, size=1, ref_id="r" + name),
                           ev.ObjectDeleted(repository=REPO, branch="main", staging_token="t",
                                            path=name, address=addr, ref_id="r" + name)]
            await wait_horizon(s, await publish(s, events))
            await _reap(s, s3)
            qa = quarantine_address(NS, A)[len(f"s3://{BUCKET}/"):]
            qb = quarantine_address(NS, B)[len(f"s3://{BUCKET}/"):]
            for q in (qa, qb):
                assert s3.head_object(Bucket=BUCKET, Key=q)  # quarantined, not in place
            add_hold(r, A, "legal: keep what was quarantined", s3=s3)
            meta = s3.head_object(Bucket=BUCKET, Key=qa)["Metadata"]
            s3.copy_object(Bucket=BUCKET, Key=qa, CopySource={"Bucket": BUCKET, "Key": qa},
                           Metadata={**meta, "hardelete-address": B},
                           MetadataDirective="REPLACE")
            await asyncio.sleep(2.0)  # past the copies' keep period (2e-5 days)
            await wait_horizon(s, await redis_now(s))
            deleter = Deleter.for_settings(s)
            purged = await purge_expired(deleter, NS, listing=s3, recheck=purge_recheck(
                r, deleter.client, REPO, NS, int(s.grace_for(REPO) * 1000)))
            assert f"s3://{BUCKET}/{qb}" in purged.deleted  # the purge does purge
            assert s3.list_objects_v2(Bucket=BUCKET, Prefix=qa).get("KeyCount", 0) == 1, (
                f"the last copy of a held address was purged: {purged}")
    finally:
        r.close()
